"""Rollups of `steps`: per-run aggregates compaction writes beside the data, and the SQL that reads them.

Per run, under `<root>/_rollups/run_id=<id>/` (a folder the store's listing never reads as data):

- `by_step.parquet`: one row per step across ranks (slowest valid rank, ranks present, first start,
  last end, least and most exposed sync): the per-step tables of the analyses, exact for any cut.
- `by_window.parquet`: one row per rank and window of `WINDOW_STEPS` steps (sums and non-NULL counts
  of every phase): the per-rank steady aggregates. Windows start at the run's default warm-up cut,
  so the default steady window is a union of whole windows; a cut elsewhere (`--warmup`) reads the
  rest of its window from the raw rows.

Each file records the steps segments it was built from (name, rows, footprint of size and footer). It
is used only while the store's listing holds exactly those segments and its contents agree with them
(row counts, first and last step, NULL step times from the segments' own footers); a stale rollup is
ignored silently, a malformed one with a warning. Either way the raw rows answer.
"""

from __future__ import annotations

import json
import os
import random
import warnings
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import PerfscopeWarning
from ..words import counted
from .listing import list_store, outside, view_sql
from .schema import PARTITION_KEY
from .segments import Segment
from .warmup import default_cut_sql

if TYPE_CHECKING:
    from .reader import Store

ROLLUP_DIR = "_rollups"
ROLLUP_VERSION = 1
META_ROLLUP = b"perfscope.rollup"
#: Steps per window of `by_window`: its rows are ranks x steps / WINDOW_STEPS.
WINDOW_STEPS = 1024
BY_STEP = "by_step"
BY_WINDOW = "by_window"

#: A row the statistics may use (steady.VALID_STEP, on alias s).
_VALID = "s.step_ns >= 0"
_NAMED_PHASES = ("data", "forward", "backward", "sync_exposed", "optimizer")


def _window_columns() -> dict[str, tuple[str, pa.DataType]]:
    """by_window: name -> (aggregate over a rank's raw rows of one window, stored type). Every column
    but the step bounds adds up over windows, so a steady window is the sum of its windows."""
    i64 = pa.int64()
    cols: dict[str, tuple[str, pa.DataType]] = {
        "step_min": ("min(s.step)", i64),
        "step_max": ("max(s.step)", i64),
        "rows_all": ("count(*)", i64),
        "step_n_all": ("count(s.step_ns)", i64),
        "step_sum_all": ("sum(s.step_ns)", i64),
        "compute_sum_all": (
            "sum(coalesce(s.forward_ns, 0) + coalesce(s.backward_ns, 0) + coalesce(s.optimizer_ns, 0))",
            i64,
        ),
        "null_steps": ("count(*) FILTER (WHERE s.step_ns IS NULL)", i64),
        "negative": (
            "count(*) FILTER (WHERE s.step_ns < 0 OR "
            + " OR ".join(f"s.{p}_ns < 0" for p in _NAMED_PHASES)
            + ")",
            i64,
        ),
        "rows": (f"count(*) FILTER (WHERE {_VALID})", i64),
        "step_sum": (f"sum(s.step_ns) FILTER (WHERE {_VALID})", i64),
    }
    for c in (*(f"{p}_ns" for p in _NAMED_PHASES), "samples", "comm_total_ns", "comm_count"):
        base = c.removesuffix("_ns")
        cols[f"{base}_sum"] = (f"sum(s.{c}) FILTER (WHERE {_VALID})", i64)
        cols[f"{base}_n"] = (f"count(s.{c}) FILTER (WHERE {_VALID})", i64)
    return cols


WINDOW_COLUMNS = _window_columns()
#: Columns that only bound the steps, never summed.
_BOUNDS = ("step_min", "step_max")

#: by_step: name -> (aggregate over one step's raw rows across ranks, stored type).
STEP_COLUMNS: dict[str, tuple[str, pa.DataType]] = {
    "rows_all": ("count(*)", pa.int64()),
    "n_valid": (f"count(*) FILTER (WHERE {_VALID})", pa.int64()),
    "step_max_ns": (f"max(s.step_ns) FILTER (WHERE {_VALID})", pa.int64()),
    "start_min_ns": (f"min(s.start_ns) FILTER (WHERE {_VALID})", pa.int64()),
    "end_max_ns": (f"max(s.start_ns + s.step_ns) FILTER (WHERE {_VALID})", pa.int64()),
    "start_min_all_ns": ("min(s.start_ns)", pa.int64()),
    "sync_n": ("count(s.sync_exposed_ns)", pa.int64()),
    "sync_min_ns": ("min(s.sync_exposed_ns)", pa.int64()),
    "sync_max_ns": ("max(s.sync_exposed_ns)", pa.int64()),
    # the rank that waited least entered last; ties go to the lowest rank, so the answer is one
    "sync_last_rank": (
        "arg_min(s.rank, (s.sync_exposed_ns, s.rank)) FILTER (WHERE s.sync_exposed_ns IS NOT NULL)",
        pa.int32(),
    ),
}

_DUCK = {pa.int64(): "BIGINT", pa.int32(): "INTEGER"}


def _schema(kind: str) -> pa.Schema:
    if kind == BY_STEP:
        return pa.schema(
            [pa.field("step", pa.int64())] + [pa.field(n, t) for n, (_, t) in STEP_COLUMNS.items()]
        )
    return pa.schema(
        [pa.field("rank", pa.int32()), pa.field("win_lo", pa.int64())]
        + [pa.field(n, t) for n, (_, t) in WINDOW_COLUMNS.items()]
    )


def _select(columns: dict[str, tuple[str, pa.DataType]]) -> str:
    return ", ".join(f"({expr})::{_DUCK[t]} AS {name}" for name, (expr, t) in columns.items())


# ---------------------------------------------------------------- building (perfscope compact)


def _sources(segs: Iterable[Segment]) -> list[dict[str, object]]:
    return sorted(
        ({"name": s.path.name, "rows": s.num_rows, "footprint": s.footprint} for s in segs), key=str
    )


def write_rollups(
    root: str | os.PathLike[str],
    *,
    window_steps: int = WINDOW_STEPS,
    run_ids: Collection[str] | None = None,
    max_bytes: int | None = None,
) -> int:
    """Write the rollups of every run (of `run_ids`, when given) whose steps segments changed since its
    rollups were written; returns how many runs got new ones. A run whose sums overflow 64 bits keeps
    none (the raw rows answer), and so does one whose steps files come to more than `max_bytes`
    (a closing writer's bound: `perfscope compact` rolls those up)."""
    root = Path(root).resolve()
    only = next(iter(run_ids)) if run_ids is not None and len(run_ids) == 1 else None
    listing = list_store(root, run_id=only)  # one run's listing reads only its partitions
    by_run: dict[Path, list[Segment]] = {}
    for seg in listing.segments.get("steps", []):
        by_run.setdefault(seg.path.parent, []).append(seg)
    written = 0
    for part, segs in sorted(by_run.items()):
        if run_ids is not None and part.name.split("=", 1)[1] not in run_ids:
            continue
        if any(seg.live is not None for seg in segs):
            continue  # still being written (perfscope.store.live): rolled up once its segments are sealed
        if max_bytes is not None and _bytes(segs) > max_bytes:
            continue
        sources = _sources(segs)
        out_dir = root / ROLLUP_DIR / part.name
        if all(_recorded(out_dir / f"{k}.parquet") == (sources, window_steps) for k in (BY_STEP, BY_WINDOW)):
            continue
        with duckdb.connect(":memory:") as con:
            con.execute("SET enable_progress_bar=false")
            con.execute(f"CREATE TEMP VIEW steps AS {view_sql('steps', segs)}")
            n = "(max(step) - min(step) + 1)"
            row = con.execute(f"SELECT min(step) + {default_cut_sql(n)} FROM steps").fetchone()
            if row is None or row[0] is None:
                continue
            anchor = int(row[0])
            w = int(window_steps)
            win = f"({anchor} + floor((s.step - {anchor})::DOUBLE / {w})::BIGINT * {w})"
            queries = {
                BY_STEP: f"SELECT s.step, {_select(STEP_COLUMNS)} FROM steps s "
                "GROUP BY s.step ORDER BY s.step",
                BY_WINDOW: f"SELECT s.rank, {win} AS win_lo, {_select(WINDOW_COLUMNS)} FROM steps s "
                f"GROUP BY s.rank, win_lo ORDER BY s.rank, win_lo",
            }
            meta = {
                "version": ROLLUP_VERSION,
                "window_steps": w,
                "anchor": anchor,
                "sources": sources,
            }
            try:
                tables = {k: con.sql(q).to_arrow_table().cast(_schema(k)) for k, q in queries.items()}
            except duckdb.Error:  # a sum past 64 bits, a hostile value: no rollup for this run
                continue
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            for kind, table in tables.items():
                tmp = out_dir / f".{kind}.parquet.tmp"
                kv = {META_ROLLUP: json.dumps({**meta, "kind": kind}).encode()}
                pq.write_table(table.replace_schema_metadata(kv), tmp, compression="zstd")
                os.replace(tmp, out_dir / f"{kind}.parquet")
        except OSError:  # a full or read-only disk: the raw rows answer, as without rollups
            continue
        written += 1
    return written


def _bytes(segs: list[Segment]) -> int:
    """The segments' size on disk (one gone meanwhile counts as unbounded: skip the run this time)."""
    try:
        return sum(os.stat(seg.file).st_size for seg in segs)
    except OSError:
        return 1 << 62


def _recorded(path: Path) -> tuple[object, object] | None:
    """The sources and window size a rollup file says it was built with (None: unreadable)."""
    try:
        meta = json.loads(pq.read_schema(path).metadata[META_ROLLUP])
        return meta["sources"], meta["window_steps"]
    except Exception:
        return None


# ---------------------------------------------------------------- reading (the analyses)


@dataclass(frozen=True)
class RunRollup:
    """One run's checked rollups: their files and the window grid of by_window."""

    by_step: str
    by_window: str
    anchor: int
    window_steps: int


def _problem(path: Path, kind: str, run_segs: list[Segment]) -> tuple[str, dict[str, object] | None]:
    """('stale', None) when built from other segments, (why, None) when malformed, ('', meta) when usable."""
    try:
        schema = pq.read_schema(path)
        meta = json.loads(schema.metadata[META_ROLLUP])
    except Exception as exc:
        return f"not a readable rollup: {exc}", None
    if not isinstance(meta, dict) or meta.get("version") != ROLLUP_VERSION or meta.get("kind") != kind:
        return "its perfscope.rollup metadata is not of this perfscope's rollup version", None
    if meta.get("sources") != _sources(run_segs):
        return "stale", None
    if schema.remove_metadata() != _schema(kind):
        return "its columns are not those of a rollup", None
    if not all(type(meta.get(k)) is int for k in ("anchor", "window_steps")) or meta["window_steps"] < 1:
        return "its window grid is not two integers", None
    return "", meta


def rollup_index(store: Store) -> dict[str, RunRollup]:
    """Per run id: the rollups that cover exactly the run's current steps segments and agree with
    them; computed once per store listing (kept with the listing: a refresh that finds nothing new
    keeps it)."""
    listing = store.listing
    found = listing.derived.get("rollup_index")
    if found is None:
        found = listing.derived.setdefault("rollup_index", _index(store, listing.of("steps")))
    return cast("dict[str, RunRollup]", found)


def _index(store: Store, steps: list[Segment]) -> dict[str, RunRollup]:
    base = store.root / ROLLUP_DIR
    if not base.is_dir() or outside(base, store.root) is not None:
        return {}
    by_run: dict[str, list[Segment]] = {}
    for seg in steps:
        by_run.setdefault(seg.path.parent.name, []).append(seg)
    found: dict[str, tuple[Path, Path, dict[str, object]]] = {}
    bad: list[str] = []
    for part_name, segs in by_run.items():
        if any(s.path.suffix != ".parquet" for s in segs):
            continue  # a live segment is being appended to: raw rows until the next compaction
        paths = [base / part_name / f"{k}.parquet" for k in (BY_STEP, BY_WINDOW)]
        if not all(p.is_file() and outside(p, store.root) is None for p in paths):
            continue
        problems = [_problem(p, k, segs) for p, k in zip(paths, (BY_STEP, BY_WINDOW), strict=True)]
        whys = [why for why, _ in problems if why and why != "stale"]
        if whys:
            bad.append(f"{paths[0].parent}: {whys[0]}")
        elif problems[0][1] is not None and problems[1][1] is not None:
            meta = problems[1][1]
            if meta["anchor"] == problems[0][1].get("anchor"):
                found[part_name] = (paths[0], paths[1], meta)
    index: dict[str, RunRollup] = {}
    if found:
        index, disagree = _check_contents(store, found, by_run)
        bad += disagree
    if bad and store.warns:
        lines = "\n".join(f"  {b}" for b in bad[:10])
        warnings.warn(
            f"perfscope: ignored {counted(len(bad), 'rollup')} in {base}; "
            f"the raw step rows are read instead:\n{lines}",
            PerfscopeWarning,
            stacklevel=3,
        )
    return index


def _lit(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


#: Columns whose footer statistics a rollup's contents are checked against.
_FOOTER_COLUMNS = ("step", "rank", "step_ns", "start_ns")


def _footer_facts(segs: list[Segment]) -> dict[str, list[int | None]]:
    """Per column of _FOOTER_COLUMNS: [least, greatest, NULL count] over the segments' rows, from the
    statistics in their footers (the bytes the segments' footprints hash)."""
    facts: dict[str, list[int | None]] = {c: [None, None, 0] for c in _FOOTER_COLUMNS}
    for seg in segs:
        md = pq.read_metadata(seg.path)
        names = md.schema.to_arrow_schema().names
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            for col, f in facts.items():
                if col not in names:  # an older segment without the column: all NULL
                    f[2] = int(f[2] or 0) + rg.num_rows
                    continue
                st = rg.column(names.index(col)).statistics
                if st is None or st.null_count is None:
                    raise ValueError(f"{seg.path.name} has no statistics")
                f[2] = int(f[2] or 0) + st.null_count
                if st.null_count == rg.num_rows:
                    continue
                if not st.has_min_max:
                    raise ValueError(f"{seg.path.name} has no statistics")
                f[0] = st.min if f[0] is None else min(f[0], st.min)
                f[1] = st.max if f[1] is None else max(f[1], st.max)
    return facts


def _check_contents(
    store: Store, found: dict[str, tuple[Path, Path, dict[str, object]]], by_run: dict[str, list[Segment]]
) -> tuple[dict[str, RunRollup], list[str]]:
    """Keep the rollups whose contents agree with their run's segments' footers and with each other:
    unique keys on the window grid, every row counted once, the same first and last step, ranks,
    NULL step times, greatest step time and first start."""
    index: dict[str, RunRollup] = {}
    bad: list[str] = []
    for part_name, (step_path, win_path, meta) in found.items():
        segs = by_run[part_name]
        rows = sum(s.num_rows for s in segs)
        anchor, w = int(meta["anchor"]), int(meta["window_steps"])  # type: ignore[call-overload]
        try:
            f = _footer_facts(segs)
            got = store.query(
                f"""
                SELECT (SELECT [count(*), count(DISTINCT step), sum(rows_all), min(step), max(step),
                                sum(n_valid), max(step_max_ns), min(start_min_all_ns),
                                count(*) FILTER (WHERE rows_all < 1 OR n_valid < 0 OR n_valid > rows_all
                                                 OR sync_n < 0 OR sync_n > rows_all)]
                        FROM read_parquet({_lit(str(step_path))})) AS s,
                       (SELECT [count(*), count(DISTINCT (rank, win_lo)), sum(rows_all), min(step_min),
                                max(step_max), sum(rows), sum(null_steps), min(rank), max(rank),
                                sum(step_n_all),
                                count(*) FILTER (WHERE step_min < win_lo OR step_max >= win_lo + {w}
                                                 OR step_min > step_max
                                                 OR (win_lo - {anchor}) % {w} <> 0 OR rows_all < 1
                                                 OR rows < 0 OR rows > rows_all OR null_steps < 0
                                                 OR step_n_all + null_steps <> rows_all)]
                        FROM read_parquet({_lit(str(win_path))})) AS w
                """
            ).to_pylist()[0]
        except (duckdb.Error, OSError, ValueError, KeyError) as exc:
            bad.append(f"{step_path.parent}: unreadable: {str(exc).splitlines()[0]}")
            continue
        step, rank, step_ns, start = (f[c] for c in _FOOTER_COLUMNS)
        valid = got["w"][5]
        top = step_ns[1] if step_ns[1] is not None and step_ns[1] >= 0 else None
        want_s = [got["s"][0], got["s"][0], rows, step[0], step[1], valid, top, start[0], 0]
        want_w = [got["w"][0], got["w"][0], rows, step[0], step[1], valid, step_ns[2], rank[0], rank[1],
                  rows - int(step_ns[2] or 0), 0]  # fmt: skip
        if got["s"] != want_s or got["w"] != want_w or rows == 0:
            bad.append(f"{step_path.parent}: its counts disagree with the run's steps segments")
            continue
        run_id = part_name.split("=", 1)[1]
        try:
            differs = _sample_differs(store, run_id, step_path, win_path, w)
        except (duckdb.Error, OSError, ValueError) as exc:
            bad.append(f"{step_path.parent}: unreadable: {str(exc).splitlines()[0]}")
            continue
        if differs:
            bad.append(f"{step_path.parent}: its {differs} disagree with the run's raw step rows")
            continue
        index[run_id] = RunRollup(str(step_path), str(win_path), anchor, w)
    return index, bad


#: Rollup rows recomputed from the raw step rows each time a store's rollups are read: this many
#: windows of by_window and steps of by_step per run, drawn at random (and the first and last of each)
SAMPLE_ROWS = 8


def _sample_differs(store: Store, run_id: str, step_path: Path, win_path: Path, w: int) -> str:
    """Which of the rollups ('window sums', 'step rows') disagrees with the raw rows, recomputed for
    a random sample of its rows, or ''. Counts and bounds (checked before) say nothing of sums: a
    rollup whose sums were edited, its metadata kept, passes them; it fails here, at the first read,
    unless the edit spared every sampled row (the first and last windows and steps always are).
    One query per run: the sample is drawn here from the rollups' key columns."""
    run = _lit(run_id)
    wins = pq.read_table(win_path, columns=["rank", "win_lo"]).to_pylist()
    steps = pq.read_table(step_path, columns=["step"]).column("step").to_pylist()
    wins = _pick(wins)
    steps = _pick(steps)
    if not wins or not steps:
        return ""
    lo = min(int(r["win_lo"]) for r in wins)
    hi = max(int(r["win_lo"]) for r in wins) + w
    ranges = " OR ".join(
        f"(s.rank = {int(r['rank'])} AND s.step >= {int(r['win_lo'])} AND s.step < {int(r['win_lo']) + w})"
        for r in wins
    )
    raw_w = (
        f"SELECT s.rank, ({lo} + (s.step - {lo}) // {w} * {w})::BIGINT AS win_lo, "
        f"{_select(WINDOW_COLUMNS)} FROM steps s "
        f"WHERE s.run_id = {run} AND s.step >= {lo} AND s.step < {hi} AND ({ranges}) GROUP BY ALL"
    )
    picked_w = " OR ".join(f"(g.rank = {int(r['rank'])} AND g.win_lo = {int(r['win_lo'])})" for r in wins)
    listed = ", ".join(str(int(x)) for x in steps)
    raw_s = (
        f"SELECT s.step, {_select(STEP_COLUMNS)} FROM steps s "
        f"WHERE s.run_id = {run} AND s.step IN ({listed}) GROUP BY s.step"
    )

    def count(raw: str, path: Path, keys: list[str], picked: str, cols: Iterable[str]) -> str:
        on = " AND ".join(f"r.{k} = g.{k}" for k in keys)
        diff = " OR ".join(f"r.{c} IS DISTINCT FROM g.{c}" for c in cols)
        return (
            f"(SELECT count(*) FROM ({raw}) r RIGHT JOIN read_parquet({_lit(str(path))}) g ON {on} "
            f"WHERE ({picked}) AND ({diff} OR r.{keys[0]} IS NULL))"
        )

    got = store.query(
        f"SELECT {count(raw_w, win_path, ['rank', 'win_lo'], picked_w, WINDOW_COLUMNS)} AS w, "
        f"{count(raw_s, step_path, ['step'], f'g.step IN ({listed})', STEP_COLUMNS)} AS s"
    ).to_pylist()[0]
    return "window sums" if got["w"] else "step rows" if got["s"] else ""


def _pick(items: list[Any]) -> list[Any]:
    """SAMPLE_ROWS of `items` at random, and the first and the last."""
    if len(items) <= SAMPLE_ROWS + 2:
        return items
    return [items[0], *random.sample(items[1:-1], SAMPLE_ROWS), items[-1]]


def _files(paths: Iterable[str]) -> str:
    return (
        "read_parquet(["
        + ", ".join(_lit(p) for p in paths)
        + f"], hive_partitioning=true, hive_types={{'{PARTITION_KEY}': 'VARCHAR'}})"
    )


def _split(store: Store, relation: str) -> tuple[dict[str, RunRollup], list[str]]:
    """The runs of `relation` (a table with run_id): those the rollups cover, and the others as
    SQL literals (a literal list lets DuckDB skip whole partitions of the raw rows)."""
    index = rollup_index(store)
    ids = store.query(f"SELECT DISTINCT run_id FROM {relation}").column("run_id").to_pylist()
    covered = {r: index[r] for r in sorted(i for i in ids if i in index)}
    return covered, [_lit(r) for r in sorted(i for i in ids if i not in index)]


def _only(raw: list[str], column: str = "s.run_id") -> str:
    return f"{column} IN ({', '.join(raw)})"


def by_step_sql(store: Store, thr: str, columns: Iterable[str], where: str) -> str:
    """Per run and step of the selected runs (`thr`, aliased t, holds them): `columns` of STEP_COLUMNS,
    for the steps where `where` holds (over s.step and t.*), from the rollups where they are usable and
    from the raw rows elsewhere."""
    covered, raw = _split(store, thr)
    cols = list(columns)
    raw_cols = ", ".join(f"({STEP_COLUMNS[c][0]})::{_DUCK[STEP_COLUMNS[c][1]]} AS {c}" for c in cols)
    parts = []
    if covered:
        parts.append(
            f"SELECT s.run_id, s.step, {', '.join(f's.{c}' for c in cols)} "
            f"FROM {_files(r.by_step for r in covered.values())} s "
            f"JOIN {thr} t ON s.run_id = t.run_id AND {where}"
        )
    if raw or not covered:
        parts.append(
            f"SELECT s.run_id, s.step, {raw_cols} "
            f"FROM steps s JOIN {thr} t ON s.run_id = t.run_id AND {where}"
            + (f" WHERE {_only(raw)}" if raw else "")
            + " GROUP BY s.run_id, s.step"
        )
    return " UNION ALL ".join(parts)


def step_bounds_sql(store: Store, runs: str) -> str:
    """Per run of `runs` (a table with run_id) that has steps: its first and last step."""
    covered, raw = _split(store, runs)
    parts = []
    if covered:
        parts.append(
            "SELECT run_id, min(step_min) AS first_step, max(step_max) AS last_step "
            f"FROM {_files(r.by_window for r in covered.values())} GROUP BY run_id"
        )
    if raw or not covered:
        parts.append(
            "SELECT run_id, min(step) AS first_step, max(step) AS last_step FROM steps "
            f"WHERE {_only(raw, 'run_id') if raw else 'false'} GROUP BY run_id"
        )
    return " UNION ALL ".join(parts)


def rank_sums_sql(store: Store, thr: str, columns: Iterable[str], *, steady: bool = True) -> str:
    """Per run and rank of the selected runs (`thr`): `columns` of WINDOW_COLUMNS summed over the steady
    steps (every step when not `steady`). Rolled-up runs read their whole windows from the cut on and,
    when the cut falls inside a window, that window's raw rows from the cut; other runs read raw rows."""
    covered, raw = _split(store, thr)
    cols = [c for c in columns if c not in _BOUNDS]
    raw_cols = ", ".join(f"({WINDOW_COLUMNS[c][0]})::HUGEINT AS {c}" for c in cols)
    cut = {r["run_id"]: int(r["first_steady_step"]) for r in store.query(f"SELECT * FROM {thr}").to_pylist()}
    whole: list[tuple[str, int]] = []  # (run, first window start read from the rollup)
    edges: list[tuple[str, int, int]] = []  # (run, cut, end of the window it falls inside)
    for run_id, r in covered.items():
        if not steady:
            whole.append((run_id, -(2**62)))
            continue
        c = cut[run_id]
        off = (c - r.anchor) % r.window_steps
        whole.append((run_id, c if off == 0 else c - off + r.window_steps))
        if off:
            edges.append((run_id, c, c - off + r.window_steps))
    parts = []
    if raw or not covered:
        steady_on = "AND s.step >= t.first_steady_step" if steady else ""
        parts.append(
            f"SELECT s.run_id, s.rank, {raw_cols} "
            f"FROM steps s JOIN {thr} t ON s.run_id = t.run_id {steady_on}"
            + (f" WHERE {_only(raw)}" if raw else "")
            + " GROUP BY s.run_id, s.rank"
        )
    if covered:
        starts = ", ".join(f"({_lit(run)}, {lo})" for run, lo in whole)
        parts.append(
            f"SELECT w.run_id, w.rank, {', '.join(f'w.{c}::HUGEINT AS {c}' for c in cols)} "
            f"FROM {_files(r.by_window for r in covered.values())} w "
            f"JOIN (VALUES {starts}) c(run_id, lo) ON w.run_id = c.run_id AND w.win_lo >= c.lo"
        )
    if edges:
        # one scan of the edge runs' partitions; the overall step range lets DuckDB skip row groups
        ranges = ", ".join(f"({_lit(run)}, {lo}, {hi})" for run, lo, hi in edges)
        parts.append(
            f"SELECT s.run_id, s.rank, {raw_cols} "
            f"FROM steps s JOIN (VALUES {ranges}) e(run_id, lo, hi) "
            "ON s.run_id = e.run_id AND s.step >= e.lo AND s.step < e.hi "
            f"WHERE {_only([_lit(run) for run, _, _ in edges])} "
            f"AND s.step >= {min(lo for _, lo, _ in edges)} AND s.step < {max(hi for _, _, hi in edges)} "
            "GROUP BY s.run_id, s.rank"
        )
    sums = ", ".join(f"sum({c}) AS {c}" for c in cols)
    return f"SELECT run_id, rank, {sums} FROM ({' UNION ALL '.join(parts)}) GROUP BY run_id, rank"


__all__ = [
    "ROLLUP_DIR",
    "STEP_COLUMNS",
    "WINDOW_COLUMNS",
    "WINDOW_STEPS",
    "RunRollup",
    "by_step_sql",
    "rank_sums_sql",
    "rollup_index",
    "step_bounds_sql",
    "write_rollups",
]
