"""A window of steps, interval by interval: every rank's steps, spans (phases and user spans) and
collectives, the picture a person wants when one step is slow.

`window_intervals` is the one query of a step window's intervals; the `rank_timeline` analysis (the
dashboard's Run page) and the Perfetto export (perfscope/exporters/perfetto.py) both read through it.
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa

from ..store.reader import Store
from .registry import analysis
from .selection import Selection, sql_literal
from .steady import runs_table, thresholds_table

#: The widest window the analysis returns, in steps: a window of a huge run stays a few thousand bars.
MAX_WINDOW_STEPS = 50
#: The most intervals (bars) of a run's window: a window with more ends at the step before.
MAX_INTERVALS = 100_000
#: Steps either side of the slowest steady step when the selection names no window.
DEFAULT_HALF_WINDOW = 2

#: Interval kinds, in the order a rank's lanes are drawn.
KINDS = ("step", "span", "collective")


def _intervals_sql(windows: str) -> str:
    """Every interval of the steps in `windows` (a relation of run_id, lo, hi; steps lo..hi included),
    on the store's time base (ns since epoch, rank 0's clock), with the rank's hostname."""
    in_window = "JOIN w ON x.run_id = w.run_id AND x.step BETWEEN w.lo AND w.hi"
    return f"""
        WITH w AS ({windows}), iv AS (
            SELECT x.run_id, x.rank, x.step, 'step' AS kind, 'step ' || x.step AS name,
                   NULL::SMALLINT AS depth, NULL::INTEGER AS seq, NULL::BIGINT AS bytes,
                   x.start_ns, x.step_ns AS dur_ns
            FROM steps x {in_window}
            UNION ALL
            SELECT x.run_id, x.rank, x.step, 'span', x.name, coalesce(x.depth, 0)::SMALLINT, NULL, NULL,
                   x.start_ns, x.dur_ns
            FROM spans x {in_window}
            UNION ALL
            SELECT x.run_id, x.rank, x.step, 'collective', x.op, NULL, x.seq, x.bytes, x.start_ns, x.dur_ns
            FROM comm x {in_window}
        ), hosts AS (
            SELECT run_id, rank, any_value(hostname) AS hostname FROM ranks
            WHERE run_id IN (SELECT run_id FROM w) GROUP BY run_id, rank
        )
        SELECT iv.run_id, iv.rank, coalesce(h.hostname, '') AS hostname, iv.step, iv.kind, iv.name,
               iv.depth, iv.seq, iv.bytes, iv.start_ns, greatest(coalesce(iv.dur_ns, 0), 0) AS dur_ns
        FROM iv LEFT JOIN hosts h ON iv.run_id = h.run_id AND iv.rank = h.rank
        WHERE iv.start_ns IS NOT NULL
    """


def window_intervals(
    store: Store, run_id: str, first: int | None = None, last: int | None = None
) -> pa.Table:
    """One run's intervals of steps first..last (None: open), absolute times; ordered by rank, start."""
    lo = "min(step)" if first is None else str(int(first))
    hi = "max(step)" if last is None else str(int(last))
    one = sql_literal(run_id)
    windows = f"SELECT run_id, {lo} AS lo, {hi} AS hi FROM steps WHERE run_id = {one} GROUP BY run_id"
    return store.query(f"{_intervals_sql(windows)} ORDER BY rank, kind, depth, start_ns, step, seq, name")


@analysis("rank_timeline", "Per-rank timeline of a window of steps", "raw")
def rank_timeline(store: Store, sel: Selection) -> pa.Table:
    """Per run, rank and interval of a window of steps: the steps, the spans (phases and user spans,
    with their depth) and the collectives, times in ns from the window's first step start.

    The window is the selection's `steps` (cut to its first 50 steps), else the run's slowest steady
    step (the slowest rank's step time) ± 2 steps, within the run's steps; it ends early where its
    steps would hold more than 100,000 intervals (its first step is always kept).
    """
    # the warm-up cut does not depend on the window: share it with the other analyses
    thr = thresholds_table(store, dataclasses.replace(sel, steps=None))
    runs = runs_table(store, dataclasses.replace(sel, steps=None))
    if sel.steps is not None:
        first, last = sel.steps
        lo = f"greatest(first_step, {first})"
        hi = f"least(last_step, {last}, {lo} + {MAX_WINDOW_STEPS - 1})"
        windows = f"SELECT run_id, {lo} AS lo, {hi} AS hi FROM {thr}"
    else:
        # the slowest steady step (ties: the earliest), by the slowest rank's step time
        windows = f"""
            WITH s AS (
                SELECT x.run_id, x.step, t.first_step, t.last_step,
                       row_number() OVER (PARTITION BY x.run_id ORDER BY max(x.step_ns) DESC, x.step) AS nth
                FROM steps x JOIN {thr} t ON x.run_id = t.run_id AND x.step >= t.first_steady_step
                GROUP BY x.run_id, x.step, t.first_step, t.last_step
            )
            SELECT run_id, greatest(first_step, step - {DEFAULT_HALF_WINDOW}) AS lo,
                   least(last_step, step + {DEFAULT_HALF_WINDOW}) AS hi
            FROM s WHERE nth = 1
        """
    return store.query(
        f"""
        WITH i AS MATERIALIZED ({_intervals_sql(windows)}),
        kept AS (  -- the window's first steps up to MAX_INTERVALS intervals (the first step always)
            SELECT run_id, step FROM (
                SELECT run_id, step, row_number() OVER w AS nth, sum(count(*)) OVER w AS intervals
                FROM i GROUP BY run_id, step WINDOW w AS (PARTITION BY run_id ORDER BY step)
            ) WHERE nth = 1 OR intervals <= {MAX_INTERVALS}
        ),
        origin AS (SELECT run_id, min(start_ns) AS t0_ns FROM i WHERE kind = 'step' GROUP BY run_id)
        SELECT i.run_id, r.source, i.rank, i.hostname, i.step, i.kind, i.name, i.depth, i.seq, i.bytes,
               i.start_ns - o.t0_ns AS start_ns, i.dur_ns
        FROM i JOIN kept USING (run_id, step) JOIN origin o USING (run_id) JOIN {runs} r USING (run_id)
        ORDER BY i.run_id, i.rank, i.kind, i.depth, i.start_ns, i.step, i.seq, i.name
        """
    )
