"""Gradient synchronisation: exposed and total sync against N, bus bandwidth, alpha-beta fit."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import pyarrow as pa

from ..store.process_groups import GROUP_KEY_SQL, group_members_sql
from ..store.reader import Store
from .cache import memo, temp_table
from .fitting import MIN_POINTS, AlphaBetaFit, fit_alpha_beta
from .registry import analysis
from .scaling import GROUP_SELECT, grouped_stats_table
from .selection import Selection
from .steady import run_comm_table, thresholds_table

SCOPE_SQL = "CASE WHEN world_size <= 1 THEN 'single' WHEN nodes <= 1 THEN 'intra-node' ELSE 'inter-node' END"


def instance_rows_table(store: Store, sel: Selection) -> str:
    """The collective rows of the steady steps, each with the key of the instance it is one rank's
    part of: (run, step, grp, nth).

    A call on a recorded process group (`comm.group_id`, or `comm.group_ranks` in older stores)
    is matched with its own group's members: grp is the group's id (older stores: its member list)
    and nth the call's order among this rank's calls on that group in the step (by seq), so a
    tensor-parallel and a data-parallel allreduce of the same op and size, or two replicas'
    allreduces each on its own group, are never one instance. Without a group (stores before schema
    3, imports that do not know it) grp is '' and nth the step's seq, the same on every rank: the
    n-th collective of the step across all ranks. Point-to-point rows (a
    peer) are no instance.
    """
    thr = thresholds_table(store, sel)
    return temp_table(
        store,
        ("instance_rows", sel),
        f"""
        SELECT c.run_id, c.rank, c.step, c.seq, c.op, c.bytes, c.group_size, c.start_ns, c.dur_ns,
               c.exposed_ns, {GRAD_NAMED_SQL} AS grad_named, {INSTANCE_KEY_SQL}
        FROM comm c JOIN {thr} t ON c.run_id = t.run_id AND c.step >= t.first_steady_step
        WHERE {COLLECTIVE_SQL}
        """,
    )


#: the rows of comm (alias c) that are collectives: a point-to-point transfer (a peer) is no instance
COLLECTIVE_SQL = "c.peer IS NULL"
#: grp and nth of an instance's key (run_id, step, grp, nth) for collective rows of comm (alias c,
#: filtered by COLLECTIVE_SQL in the same SELECT: the order on a group counts collectives only)
INSTANCE_KEY_SQL = f"""coalesce({GROUP_KEY_SQL}, '') AS grp,
               CASE WHEN {GROUP_KEY_SQL} IS NULL THEN c.seq
                    ELSE row_number() OVER (PARTITION BY c.run_id, c.rank, c.step, {GROUP_KEY_SQL}
                                            ORDER BY c.seq, c.start_ns) - 1
               END AS nth"""

#: group kinds whose collectives are gradient synchronisation (`group_kinds_table`)
GRADIENT_KINDS = ("data-parallel", "world", "unknown")
GRADIENT_KINDS_SQL = "(" + ", ".join(f"'{k}'" for k in GRADIENT_KINDS) + ")"
#: a collective named as a gradient one (Megatron-LM's op names: layernorm-grads-all-reduce on the
#: tensor-parallel group, embedding-grads-all-reduce between the first and last stage) is gradient
#: sync on whatever group it runs; recorded calls have no name
GRAD_NAMED_SQL = "coalesce(c.name ILIKE '%grads%', false)"


def is_gradient_sql(kind: str, named: str) -> str:
    """Whether a collective of group kind `kind` (NULL: unknown), named as a gradient one or not
    (`named`), is gradient synchronisation."""
    return f"(coalesce({kind}, 'unknown') IN {GRADIENT_KINDS_SQL} OR {named})"


def group_kinds_table(store: Store, sel: Selection) -> str:
    """Per run and recorded process group (grp of `instance_rows_table`): its kind, from its
    members' coordinates in `ranks` (dp_rank, pp_stage, tp_rank, cp_rank; a NULL one reads as 0).

    The coordinates the members differ in name the group: dp alone (or dp and cp: Megatron-LM's
    gradient group under context parallelism) 'data-parallel', tp alone 'tensor-parallel', pp alone
    'pipeline', cp alone 'context'; any other set that holds every rank of the run 'world', else
    'mixed'. 'unknown' when a member has no coordinates or the group has one member. Groups not
    listed (grp '', no group recorded) or without members (their process_groups row lost) are
    'unknown' too (`kind_sql`)."""
    rows = instance_rows_table(store, sel)
    return temp_table(
        store,
        ("group_kinds", sel),
        f"""
        WITH g AS (SELECT DISTINCT run_id, grp FROM {rows} WHERE grp <> ''),
        gm AS (SELECT run_id, grp, group_ranks
               FROM ({group_members_sql("(SELECT run_id FROM g)")}) JOIN g USING (run_id, grp)),
        m AS (  -- a member that is no rank number (a hostile import) makes the group unknown
            SELECT run_id, grp, TRY_CAST(trim(member) AS INTEGER) AS rank
            FROM (SELECT run_id, grp, unnest(string_split(group_ranks, ',')) AS member FROM gm)
        ),
        r AS (
            SELECT run_id, rank, max(dp_rank) AS dp, max(pp_stage) AS pp, max(tp_rank) AS tp,
                   max(cp_rank) AS cp
            FROM ranks WHERE run_id IN (SELECT run_id FROM g) GROUP BY run_id, rank
        ), w AS (SELECT run_id, count(*) AS world FROM r GROUP BY run_id),
        v AS (
            SELECT m.run_id, m.grp, count(*) AS n,
                   bool_and(coalesce(r.dp, r.pp, r.tp, r.cp) IS NOT NULL) AS laid,
                   count(DISTINCT coalesce(r.dp, 0)) > 1 AS dp, count(DISTINCT coalesce(r.pp, 0)) > 1 AS pp,
                   count(DISTINCT coalesce(r.tp, 0)) > 1 AS tp, count(DISTINCT coalesce(r.cp, 0)) > 1 AS cp
            FROM m LEFT JOIN r USING (run_id, rank) GROUP BY m.run_id, m.grp
        )
        SELECT v.run_id, v.grp, CASE
            WHEN NOT v.laid OR v.n <= 1 THEN 'unknown'
            WHEN v.dp AND NOT (v.pp OR v.tp) THEN 'data-parallel'
            WHEN v.tp AND NOT (v.dp OR v.pp OR v.cp) THEN 'tensor-parallel'
            WHEN v.pp AND NOT (v.dp OR v.tp OR v.cp) THEN 'pipeline'
            WHEN v.cp AND NOT (v.dp OR v.pp OR v.tp) THEN 'context'
            WHEN v.n = w.world THEN 'world'
            ELSE 'mixed'
        END AS kind
        FROM v LEFT JOIN w USING (run_id)
        """,
    )


def instances_table(store: Store, sel: Selection) -> str:
    """Per collective instance (run, step, grp, nth: `instance_rows_table`) of the steady steps:
    bytes, group size and transfer time.

    transfer_ns runs from the last rank's entry to the last rank's exit, so the wait for late
    ranks is not counted as transfer (that wait is the straggler analysis's business). Ranks whose
    calls at one key differ in op or group size made different collectives, not one.
    """
    rows = instance_rows_table(store, sel)
    return temp_table(
        store,
        ("instances", sel),
        f"""
        SELECT c.run_id, c.step, c.grp, c.nth, any_value(c.op) AS op, max(c.bytes) AS bytes,
               bool_or(c.grad_named) AS grad_named,
               any_value(c.group_size) AS group_size, count(*) AS ranks,
               max(c.start_ns + c.dur_ns) - max(c.start_ns) AS transfer_ns,
               max(c.start_ns) - min(c.start_ns) AS entry_spread_ns,
               max(c.start_ns) AS last_entry_ns,
               arg_max(c.rank, c.start_ns) AS last_rank,
               -- the last rank counts only when nobody entered at the same instant
               count(*) > 1 AND list_count(list_distinct(max(c.start_ns, 2))) = 2 AS last_unique
        FROM {rows} c
        GROUP BY c.run_id, c.step, c.grp, c.nth
        HAVING count(DISTINCT c.op) = 1 AND count(DISTINCT coalesce(c.group_size, 0)) = 1
        """,
    )


def ring_factor_sql(n: str) -> str:
    """The ring allreduce's bus factor 2(n−1)/n for a group of n ranks; NULL for one rank."""
    return f"CASE WHEN {n} > 1 THEN 2 * ({n} - 1) / {n} END"


#: an instance's group size: as recorded, else (version-1 stores) the run's world size
GROUP_N = "coalesce(i.group_size, i.world_size)"


def _minus(value: str, other: str) -> str:
    """value − other (other NULL: 0), at least 0; NULL when value is."""
    return f"CASE WHEN {value} IS NOT NULL THEN greatest(0, {value} - coalesce({other}, 0)) END"


def sync_table(store: Store, sel: Selection) -> str:
    gs = grouped_stats_table(store, sel)
    inst = instances_table(store, sel)
    rows = instance_rows_table(store, sel)
    kinds = group_kinds_table(store, sel)
    # the ring factor of the instance's own group (a tensor-parallel pair's is 1, not the world's)
    busbw = f"bytes / (transfer_ns / 1e9) * {ring_factor_sql(GROUP_N)} / 1e9"
    return temp_table(
        store,
        ("sync", sel),
        f"""
        WITH i AS (
            SELECT inst.*, g.world_size FROM {inst} inst JOIN {gs} g USING (run_id)
                LEFT JOIN {kinds} k USING (run_id, grp)
            WHERE transfer_ns > 0 AND op = 'allreduce'  -- the ring model and busbw are an allreduce's
                  AND {is_gradient_sql("k.kind", "inst.grad_named")}  -- gradient sync only
        ), kr AS (
            SELECT r.*, coalesce(k.kind, 'unknown') AS kind,
                   {is_gradient_sql("k.kind", "r.grad_named")} AS grad
            FROM {rows} r LEFT JOIN {kinds} k USING (run_id, grp)
        ), other AS (
            -- per rank and step: the collectives on groups that are not gradient sync (left out of
            -- the steps' comm_total_ns, comm_count and sync_exposed_ns below), the tensor-parallel ones
            -- on their own
            SELECT run_id, sum(dur_ns) / any_value(per) AS total, count(*) / any_value(per) AS calls,
                   coalesce(sum(exposed_ns), 0) / any_value(per) AS exposed,
                   sum(dur_ns) FILTER (WHERE kind = 'tensor-parallel') / any_value(per) AS tp_total,
                   nullif(count(*) FILTER (WHERE kind = 'tensor-parallel'), 0) / any_value(per) AS tp_calls,
                   sum(exposed_ns) FILTER (WHERE kind = 'tensor-parallel') / any_value(per) AS tp_exposed
            FROM kr JOIN (SELECT run_id, count(DISTINCT rank)::DOUBLE * any_value(g.steady_steps) AS per
                          FROM {rows} JOIN {gs} g USING (run_id) GROUP BY run_id) USING (run_id)
            WHERE NOT grad
            GROUP BY run_id
        ), bw AS (
            -- bytes are unknown in traces that do not record them (nsys, gloo Kineto): such an
            -- instance has no bandwidth, and a step's bytes are a sum only when every one is known.
            -- Per rank: an instance on a sub-group is a call of its members only, so the calls, bytes
            -- and transfer time of a rank are the instances' summed over their ranks, over the ranks
            -- (one instance per call of every rank when all run on the whole world)
            SELECT run_id, count(*) AS instances, count(bytes) AS sized,
                   CASE WHEN count(bytes) = count(*) THEN sum(bytes * ranks)::DOUBLE / max(member_ranks) END
                       AS bytes_sum,
                   sum(ranks)::DOUBLE / max(member_ranks) AS calls_per_rank,
                   sum(transfer_ns * ranks)::DOUBLE / max(member_ranks) AS transfer_per_rank,
                   median(bytes / (transfer_ns / 1e9) / 1e9) AS algbw,
                   median({busbw}) AS busbw,
                   quantile_cont({busbw}, 0.1) AS busbw_p10,
                   quantile_cont({busbw}, 0.9) AS busbw_p90
            FROM i JOIN (SELECT run_id, count(DISTINCT rank) AS member_ranks FROM kr
                         WHERE op = 'allreduce' AND grad GROUP BY run_id)
                USING (run_id)
            GROUP BY run_id
        ), s AS (
            SELECT g.* REPLACE ({_minus("g.sync_exposed_ns", "o.exposed")} AS sync_exposed_ns),
                   {SCOPE_SQL} AS scope, bw.* EXCLUDE (run_id), c.* EXCLUDE (run_id),
                   coalesce({_minus("c.comm_total_mean", "o.total")}, bw.transfer_per_rank / g.steady_steps)
                       AS comm_total,
                   coalesce({_minus("c.comm_count_mean", "o.calls")}, bw.calls_per_rank / g.steady_steps)
                       AS comm_n,
                   coalesce(bw.bytes_sum::DOUBLE / g.steady_steps, g.grad_bytes::DOUBLE) AS step_bytes,
                   o.tp_total, o.tp_calls, o.tp_exposed
            FROM {gs} g LEFT JOIN bw USING (run_id) LEFT JOIN {run_comm_table(store, sel)} c USING (run_id)
                LEFT JOIN other o USING (run_id)
        )
        SELECT {GROUP_SELECT}, run_id, source, world_size, nodes, scope,
               sync_exposed_ns, comm_total AS comm_total_ns, comm_n AS comm_count,
               step_bytes AS bytes_per_step,
               CASE WHEN comm_total > 0 THEN greatest(0, 1 - sync_exposed_ns / comm_total) END
                   AS overlap_share,
               CASE WHEN world_size > 1 THEN CASE
                   WHEN sized > 0 THEN algbw
                   WHEN grad_bytes > 0 AND coalesce(comm_total_mean, sync_exposed_ns) > 0
                       THEN grad_bytes / (coalesce(comm_total_mean, sync_exposed_ns) / 1e9) / 1e9
               END END AS algbw_gb_per_s,
               CASE WHEN world_size > 1 THEN CASE
                   WHEN sized > 0 THEN busbw
                   WHEN grad_bytes > 0 AND coalesce(comm_total_mean, sync_exposed_ns) > 0
                       THEN grad_bytes / (coalesce(comm_total_mean, sync_exposed_ns) / 1e9) / 1e9
                            * 2 * (world_size - 1) / world_size
               END END AS busbw_gb_per_s,
               CASE WHEN world_size > 1 AND sized > 0 THEN busbw_p10 END AS busbw_p10_gb_per_s,
               CASE WHEN world_size > 1 AND sized > 0 THEN busbw_p90 END AS busbw_p90_gb_per_s,
               CASE WHEN world_size <= 1 THEN NULL
                    WHEN sized > 0 THEN 'comm'
                    WHEN grad_bytes > 0 AND comm_total_mean > 0 THEN 'steps.comm_total_ns+runs.grad_bytes'
                    WHEN grad_bytes > 0 AND sync_exposed_ns > 0 THEN 'steps.sync_exposed_ns+runs.grad_bytes'
               END AS bw_source,
               tp_total AS tp_comm_total_ns, tp_calls AS tp_comm_count, tp_exposed AS tp_comm_exposed_ns
        FROM s
        """,
    )


@analysis("sync", "Gradient sync and bus bandwidth against world size", "steady-state", "busbw")
def sync(store: Store, sel: Selection) -> pa.Table:
    """Exposed and total sync per step, collectives per step, bytes, overlap and bus bandwidth per run."""
    return store.query(f"SELECT * FROM {sync_table(store, sel)} ORDER BY group_id, world_size, run_id")


@analysis("collectives", "Collectives by message size", "busbw")
def collectives(store: Store, sel: Selection) -> pa.Table:
    """Per run, op, group kind and message size: instances, median transfer time and bus bandwidth."""
    gs = grouped_stats_table(store, sel)
    inst = instances_table(store, sel)
    kinds = group_kinds_table(store, sel)
    return store.query(
        f"""
        WITH i AS (
            SELECT inst.*, g.world_size, coalesce(k.kind, 'unknown') AS group_kind
            FROM {inst} inst JOIN {gs} g USING (run_id) LEFT JOIN {kinds} k USING (run_id, grp)
        )
        SELECT i.run_id, g.source, g.world_size, g.nodes,
               CASE WHEN g.world_size <= 1 THEN 'single' WHEN g.nodes <= 1 THEN 'intra-node'
                    ELSE 'inter-node' END AS scope,
               i.op, i.bytes, count(*) AS instances, median(i.transfer_ns) AS transfer_ns,
               CASE WHEN g.world_size > 1 AND i.op = 'allreduce'
                    THEN median(i.bytes / (i.transfer_ns / 1e9) * {ring_factor_sql(GROUP_N)}) / 1e9
               END AS busbw_gb_per_s,
               i.group_kind
        FROM i JOIN {gs} g USING (run_id)
        WHERE i.transfer_ns > 0
        GROUP BY i.run_id, g.source, g.world_size, g.nodes, i.op, i.bytes, i.group_kind
        ORDER BY i.run_id, i.op, i.bytes, i.group_kind
        """
    )


def _fit_points(store: Store, sel: Selection) -> list[dict[str, Any]]:
    """Points (cluster, backend, scope, p, n bytes, k collectives, t seconds) for the alpha-beta fit."""
    gs = grouped_stats_table(store, sel)
    inst = instances_table(store, sel)
    st = sync_table(store, sel)
    return store.query(
        f"""
        SELECT g.cluster, g.backend, {SCOPE_SQL} AS scope, g.run_id,
               coalesce(i.group_size, g.world_size) AS p,  -- the ring of the instance's own group
               i.bytes::DOUBLE AS n, 1.0 AS k, median(i.transfer_ns) / 1e9 AS t, 'comm' AS data_source
        FROM {inst} i JOIN {gs} g USING (run_id)
        WHERE i.transfer_ns > 0 AND coalesce(i.group_size, g.world_size) > 1 AND i.op = 'allreduce'
              AND i.bytes IS NOT NULL
        GROUP BY g.cluster, g.backend, scope, g.run_id, p, i.bytes
        UNION ALL
        SELECT s.cluster, s.backend, s.scope, s.run_id, s.world_size, g.grad_bytes::DOUBLE,
               coalesce(s.comm_count, 1.0), coalesce(c.comm_total_mean, g.sync_exposed_ns) / 1e9,
               CASE WHEN c.comm_total_mean IS NOT NULL THEN 'steps.comm_total_ns'
                    ELSE 'steps.sync_exposed_ns' END
        FROM {st} s JOIN {gs} g USING (run_id) LEFT JOIN {run_comm_table(store, sel)} c USING (run_id)
        WHERE s.world_size > 1 AND s.bw_source IS NOT NULL AND s.bw_source <> 'comm'
              AND g.grad_bytes > 0
        """
    ).to_pylist()


def fit_points(pts: list[dict[str, Any]]) -> AlphaBetaFit | None:
    """Fit α and β to points with keys p, n, k, t (as `_fit_points` returns them). A point with an
    unknown (NULL) or non-finite value is no point: unknown bytes are not zero bytes."""
    known = [x for x in pts if all(_finite(x.get(key)) for key in ("p", "n", "k", "t"))]
    return fit_alpha_beta(
        [float(x["p"]) for x in known],
        [float(x["n"]) for x in known],
        [float(x["k"]) for x in known],
        [float(x["t"]) for x in known],
    )


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def alpha_beta_fits(
    store: Store, sel: Selection
) -> dict[tuple[str, str, str], tuple[AlphaBetaFit | None, list[dict[str, Any]]]]:
    """(cluster, backend, scope) -> (fit or None, its points)."""

    def compute() -> dict[tuple[str, str, str], tuple[AlphaBetaFit | None, list[dict[str, Any]]]]:
        by: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
        for pt in _fit_points(store, sel):
            by[(str(pt["cluster"]), str(pt["backend"]), str(pt["scope"]))].append(pt)
        return {key: (fit_points(pts), pts) for key, pts in sorted(by.items())}

    return memo(store, ("alpha_beta", sel), compute)


@analysis("allreduce_fit", "Alpha-beta fit of the ring allreduce", "alpha-beta")
def allreduce_fit(store: Store, sel: Selection) -> pa.Table:
    """α (latency per ring step) and β (seconds per byte) within a node and across nodes. α is
    NULL (`alpha_refused`) when it is far above the time per hop the cheapest collective took
    (`alpha_ceiling_s`): that is queueing or contention fitted as latency, not latency."""
    rows = []
    for (cluster, backend, scope), (fit, pts) in alpha_beta_fits(store, sel).items():
        sizes = sorted({int(x["p"]) for x in pts})
        rows.append(
            {
                "cluster": cluster,
                "backend": backend,
                "scope": scope,
                "alpha_s": fit.alpha_s if fit and not fit.alpha_refused else None,
                "alpha_ceiling_s": fit.alpha_ceiling_s if fit else None,
                "alpha_refused": bool(fit and fit.alpha_refused),
                "beta_s_per_byte": fit.beta_s_per_byte if fit else None,
                "bandwidth_gb_per_s": fit.bandwidth_gb_per_s if fit else None,
                "points": len(pts),
                "world_sizes": ",".join(str(s) for s in sizes),
                "smape_pct": fit.smape_pct if fit else None,
                "r2_adj": fit.r2_adj if fit else None,
                "too_few_points": fit is None or len(pts) < MIN_POINTS,
                "data_source": ",".join(sorted({str(x["data_source"]) for x in pts})),
            }
        )
    return pa.Table.from_pylist(rows, schema=ALLREDUCE_FIT_SCHEMA)


ALLREDUCE_FIT_SCHEMA = pa.schema(
    [
        ("cluster", pa.string()),
        ("backend", pa.string()),
        ("scope", pa.string()),
        ("alpha_s", pa.float64()),
        ("alpha_ceiling_s", pa.float64()),
        ("alpha_refused", pa.bool_()),
        ("beta_s_per_byte", pa.float64()),
        ("bandwidth_gb_per_s", pa.float64()),
        ("points", pa.int64()),
        ("world_sizes", pa.string()),
        ("smape_pct", pa.float64()),
        ("r2_adj", pa.float64()),
        ("too_few_points", pa.bool_()),
        ("data_source", pa.string()),
    ]
)
