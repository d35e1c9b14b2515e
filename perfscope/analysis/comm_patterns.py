"""Communication beyond DDP (DESIGN.md): every op by type and phase, rank roles, pipeline stages,
parameter servers and periodic synchronisation, from the `comm` rows of the torch.distributed
recorder (and any other producer of them)."""

from __future__ import annotations

import pyarrow as pa

from ..store.reader import Store
from ..store.rollups import rank_sums_sql
from .cache import temp_table
from .registry import analysis
from .selection import Selection
from .steady import roles_table, runs_table, thresholds_table

#: a periodic sync keeps its amortised cost under this share of the mean step (DESIGN.md)
PERIODIC_TARGET_SHARE = 0.10
#: collectives in fewer than this share of the steady steps make a run's sync periodic
PERIODIC_MAX_STEP_SHARE = 0.75
P2P_OPS = "('send', 'recv', 'isend', 'irecv')"


def _with_run(store: Store, sel: Selection, sql: str, order: str) -> pa.Table:
    """The rows of `sql` with their run's source and world size in front."""
    runs = runs_table(store, sel)
    return store.query(
        f"SELECT x.run_id, r.source, r.world_size, x.* EXCLUDE (run_id) "
        f"FROM ({sql}) x JOIN {runs} r USING (run_id) ORDER BY {order}"
    )


def _rank_steady(store: Store, sel: Selection) -> str:
    """Per run and rank (ranks with steps): steady steps, mean step time and mean compute, i.e.
    forward + backward + optimizer, which no longer hold the exposed communication made in them.
    From the per-window rollups where they cover the run (store/rollups.py), else from the raw rows."""
    sums = rank_sums_sql(
        store,
        thresholds_table(store, sel),
        ("rows_all", "step_n_all", "step_sum_all", "compute_sum_all", "sync_exposed_sum", "sync_exposed_n"),
    )
    return temp_table(
        store,
        ("pattern_rank_steady", sel),
        f"""
        SELECT run_id, rank, rows_all::BIGINT AS steps,
               step_sum_all::DOUBLE / nullif(step_n_all, 0) AS step_ns,
               compute_sum_all::DOUBLE / rows_all AS compute_ns,
               -- rank_breakdown's exposed sync: what the step waited for, DDP's buckets included
               sync_exposed_sum::DOUBLE / nullif(sync_exposed_n, 0) AS sync_exposed_ns
        FROM ({sums})
        """,
    )


def _steady_steps(store: Store, sel: Selection) -> str:
    """Per run, rank and steady step of the runs with comm rows (the only ones whose steps meet a
    comm row): its step time."""
    thr = thresholds_table(store, sel)
    return temp_table(
        store,
        ("pattern_steady_steps", sel),
        f"""
        SELECT s.run_id, s.rank, s.step, s.step_ns
        FROM steps s JOIN {thr} t ON s.run_id = t.run_id AND s.step >= t.first_steady_step
        WHERE s.run_id IN (SELECT DISTINCT run_id FROM comm)
        """,
    )


@analysis("comm_roles", "Rank roles: worker, server, pipeline stage", "raw")
def comm_roles(store: Store, sel: Selection) -> pa.Table:
    """Per run and rank: role (recorded or inferred), steps, point-to-point and collective calls."""
    return _with_run(store, sel, f"SELECT * FROM {roles_table(store, sel)}", "run_id, rank")


@analysis("comm_ops", "Communication by op type and phase", "steady-state", "comm-patterns")
def comm_ops(store: Store, sel: Selection) -> pa.Table:
    """Per run, op and phase (steady steps, ranks with steps): calls, total and exposed time per
    rank-step, exposed share of the step, and message sizes from their real distribution."""
    ss = _steady_steps(store, sel)
    return _with_run(
        store,
        sel,
        f"""
        WITH n AS (
            SELECT run_id, count(*) AS rank_steps, sum(step_ns)::DOUBLE AS step_sum FROM {ss} GROUP BY run_id
        ), c AS (
            SELECT c.* FROM comm c JOIN {ss} s USING (run_id, rank, step)
        )
        SELECT c.run_id, c.op, coalesce(c.phase, 'sync') AS phase,
               CASE WHEN bool_or(c.peer IS NOT NULL) THEN 'p2p' ELSE 'collective' END AS kind,
               count(*) AS calls, count(*) / any_value(n.rank_steps) AS calls_per_step,
               sum(c.dur_ns) / any_value(n.rank_steps) AS total_ns_per_step,
               sum(c.exposed_ns) / any_value(n.rank_steps) AS exposed_ns_per_step,
               sum(c.exposed_ns) / any_value(n.step_sum) AS exposed_share_of_step,
               median(c.bytes) AS bytes_median, quantile_cont(c.bytes, 0.1) AS bytes_p10,
               quantile_cont(c.bytes, 0.9) AS bytes_p90, min(c.bytes) AS bytes_min, max(c.bytes) AS bytes_max,
               any_value(c.group_size) AS group_size
        FROM c JOIN n USING (run_id)
        GROUP BY c.run_id, c.op, coalesce(c.phase, 'sync')
        """,
        "run_id, exposed_ns_per_step DESC NULLS LAST, op",
    )


@analysis("comm_by_role", "Communication per rank and role", "steady-state", "comm-patterns")
def comm_by_role(store: Store, sel: Selection) -> pa.Table:
    """Per run and rank: role, step time, compute (forward + backward + optimizer, without the
    exposed communication moved out of them), point-to-point wait and collective wait per step.
    Collective wait is the exposed sync the step waited for less its point-to-point wait (DDP's
    overlapped buckets have no exposed time of their own: their step's exposed sync is theirs).
    `wait_op`, `wait_peer` (NULL for a collective) and `wait_group_size` name the op the rank
    waited on longest (by exposed time, else by total time), `wait_op_ns` its exposed time per step.
    `transfer_wait_ns` (the run's, on each of its rows): per steady step the exposed sync of the rank
    that waited least (it waited for the transfer itself; the others also for it to arrive), their
    mean: what the step would save if communication were free."""
    ss = _steady_steps(store, sel)
    per_rank = _rank_steady(store, sel)
    roles = roles_table(store, sel)
    thr = thresholds_table(store, sel)
    return _with_run(
        store,
        sel,
        f"""
        WITH s AS (
            SELECT * FROM {per_rank}
        ), c AS (
            SELECT c.run_id, c.rank,
                   sum(c.exposed_ns) FILTER (WHERE c.peer IS NOT NULL) AS p2p_ns,
                   sum(c.exposed_ns) FILTER (WHERE c.peer IS NULL) AS collective_ns
            FROM comm c JOIN {ss} st USING (run_id, rank, step) GROUP BY ALL
        ), ops AS (
            SELECT c.run_id, c.rank, c.op, c.peer, max(c.group_size) AS group_size,
                   sum(c.exposed_ns) AS exposed_sum, sum(c.dur_ns) AS total_sum
            FROM comm c JOIN {ss} st USING (run_id, rank, step) GROUP BY ALL
        ), top AS (
            SELECT * FROM ops
            QUALIFY row_number() OVER (
                PARTITION BY run_id, rank
                ORDER BY coalesce(exposed_sum, 0) DESC, total_sum DESC NULLS LAST, op, peer
            ) = 1
        ), least AS (
            SELECT run_id, step, min(coalesce(s.sync_exposed_ns, 0)) AS waited
            FROM steps s JOIN {thr} t USING (run_id)
            WHERE s.step >= t.first_steady_step AND s.step_ns IS NOT NULL GROUP BY ALL
        ), transfer AS (
            SELECT run_id, avg(waited) AS transfer_wait_ns FROM least GROUP BY ALL
        )
        SELECT r.run_id, r.rank, r.role, r.role_source, s.steps, s.step_ns, s.compute_ns,
               coalesce(c.p2p_ns, 0) / s.steps AS p2p_wait_ns,
               greatest(
                   coalesce(c.collective_ns, 0) / s.steps,
                   coalesce(s.sync_exposed_ns, 0) - coalesce(c.p2p_ns, 0) / s.steps
               ) AS collective_wait_ns,
               top.op AS wait_op, top.peer AS wait_peer, top.group_size AS wait_group_size,
               top.exposed_sum / s.steps AS wait_op_ns, transfer.transfer_wait_ns
        FROM {roles} r LEFT JOIN s USING (run_id, rank) LEFT JOIN c USING (run_id, rank)
        LEFT JOIN top USING (run_id, rank) LEFT JOIN transfer USING (run_id)
        """,
        "run_id, rank",
    )


@analysis("pipeline_stages", "Pipeline stages: compute, p2p wait and bubble", "steady-state", "pipeline")
def pipeline_stages(store: Store, sel: Selection) -> pa.Table:
    """Per pipeline stage: step time, compute, wait in point-to-point (the bubble, not gradient
    sync), measured bubble fraction against the ideal (p−1)/(m+p−1), and which stage is slowest."""
    ss = _steady_steps(store, sel)
    per_rank = _rank_steady(store, sel)
    roles = roles_table(store, sel)
    return _with_run(
        store,
        sel,
        f"""
        WITH st AS (
            SELECT run_id, rank, role, role_source, CAST(split_part(role, ':', 2) AS INTEGER) AS stage
            FROM {roles} WHERE role LIKE 'stage:%'
        ), s AS (
            SELECT * FROM {per_rank} WHERE (run_id, rank) IN (SELECT (run_id, rank) FROM st)
        ), pairs AS (
            -- each direction with each neighbour: a stage sends (or receives) every micro-batch's
            -- activations one way and its gradients the other, whatever phase the calls ran in
            SELECT c.run_id, c.rank, c.peer, regexp_replace(c.op, '^i', '') AS op,
                   count(*) AS calls, sum(c.exposed_ns) AS p2p_ns
            FROM comm c JOIN {ss} x USING (run_id, rank, step)
            WHERE c.peer IS NOT NULL GROUP BY ALL
        ), c AS (
            -- micro-batches: the transfers of one step in the direction with fewest (a stage may
            -- send several tensors per micro-batch one way, never fewer than one)
            SELECT run_id, rank, sum(p2p_ns) AS p2p_ns, min(calls) AS mb_calls FROM pairs GROUP BY ALL
        ), per AS (
            SELECT st.*, s.steps, s.step_ns, s.compute_ns, coalesce(c.p2p_ns, 0) / s.steps AS p2p_wait_ns,
                   coalesce(c.mb_calls, 0) / s.steps AS mb_per_step
            FROM st JOIN s USING (run_id, rank) LEFT JOIN c USING (run_id, rank)
        ), run AS (
            SELECT run_id, count(DISTINCT stage) AS stages,
                   greatest(round(median(mb_per_step)), 1)::INTEGER AS micro_batches,
                   arg_max(stage, compute_ns) AS slowest_stage, arg_max(rank, compute_ns) AS slowest_rank,
                   max(compute_ns) AS slowest_compute_ns
            FROM per GROUP BY run_id
        )
        SELECT per.run_id, per.stage, per.rank, per.role_source, per.steps, per.step_ns, per.compute_ns,
               per.p2p_wait_ns, per.p2p_wait_ns / nullif(per.step_ns, 0) AS bubble_fraction,
               run.stages, run.micro_batches,
               (run.stages - 1) / nullif(run.micro_batches + run.stages - 1, 0) AS ideal_bubble_fraction,
               run.slowest_stage, run.slowest_rank,
               per.compute_ns / nullif(run.slowest_compute_ns, 0) AS compute_vs_slowest
        FROM per JOIN run USING (run_id)
        """,
        "run_id, stage",
    )


@analysis("parameter_server", "Parameter server: push, pull, server busy share", "pserver")
def parameter_server(store: Store, sel: Selection) -> pa.Table:
    """Per rank of a run with a server: workers' push (send to a server) and pull (receive from
    one) per step and step time; the server's busy share (its active time not spent waiting to
    receive); worker skew = max / median worker step time."""
    ss = _steady_steps(store, sel)
    per_rank = _rank_steady(store, sel)
    roles = roles_table(store, sel)
    return _with_run(
        store,
        sel,
        f"""
        WITH r AS (
            SELECT * FROM {roles}
            WHERE run_id IN (SELECT run_id FROM {roles} WHERE role = 'server')
        ), servers AS (
            SELECT run_id, rank FROM r WHERE role = 'server'
        ), s AS (
            SELECT * FROM {per_rank}
        ), w AS (
            SELECT c.run_id, c.rank,
                   sum(c.exposed_ns) FILTER (WHERE c.op IN ('send', 'isend')) AS push_sum,
                   sum(c.exposed_ns) FILTER (WHERE c.op IN ('recv', 'irecv')) AS pull_sum
            FROM comm c JOIN {ss} x USING (run_id, rank, step)
            WHERE (c.run_id, c.peer) IN (SELECT (run_id, rank) FROM servers)
            GROUP BY ALL
        ), srv AS (
            SELECT c.run_id, c.rank,
                   sum(c.exposed_ns) FILTER (WHERE c.op IN ('recv', 'irecv')) AS wait_sum,
                   max(c.start_ns + c.dur_ns) - min(c.start_ns) AS span_ns
            FROM comm c WHERE (c.run_id, c.rank) IN (SELECT (run_id, rank) FROM servers) GROUP BY ALL
        ), skew AS (
            SELECT run_id, max(step_ns) / nullif(median(step_ns), 0) AS worker_skew,
                   arg_max(rank, step_ns) AS slowest_worker
            FROM s WHERE (run_id, rank) NOT IN (SELECT (run_id, rank) FROM servers) GROUP BY run_id
        )
        SELECT r.run_id, r.rank, r.role, r.role_source, s.steps, s.step_ns, s.compute_ns,
               w.push_sum / s.steps AS push_ns, w.pull_sum / s.steps AS pull_ns,
               CASE WHEN r.role = 'server' THEN 1 - coalesce(srv.wait_sum, 0) / nullif(srv.span_ns, 0)
               END AS server_busy_share,
               skew.worker_skew, skew.slowest_worker,
               (SELECT count(*) FROM servers x WHERE x.run_id = r.run_id) AS servers
        FROM r LEFT JOIN s USING (run_id, rank) LEFT JOIN w USING (run_id, rank)
        LEFT JOIN srv USING (run_id, rank) LEFT JOIN skew USING (run_id)
        """,
        "run_id, rank",
    )


@analysis("periodic_sync", "Periodic synchronisation: cost, amortised share, k for 10%", "periodic-sync")
def periodic_sync(store: Store, sel: Selection) -> pa.Table:
    """Per run whose collectives come only every k-th step (local SGD, parameter averaging): the
    sync step's exposed cost, its amortised share (cost/k of the mean step) and the smallest k
    that keeps that share under 10%."""
    ss = _steady_steps(store, sel)
    return _with_run(
        store,
        sel,
        f"""
        WITH per_step AS (
            SELECT s.run_id, s.step, max(s.step_ns) AS step_ns,
                   avg(coalesce(x.exposed_ns, 0)) AS sync_ns, bool_or(coalesce(x.calls, 0) > 0) AS synced
            FROM {ss} s LEFT JOIN (
                SELECT run_id, rank, step, sum(exposed_ns) AS exposed_ns, count(*) AS calls
                FROM comm WHERE peer IS NULL GROUP BY ALL
            ) x USING (run_id, rank, step)
            GROUP BY s.run_id, s.step
        ), r AS (
            SELECT run_id, count(*) AS steady_steps, count(*) FILTER (WHERE synced) AS sync_steps,
                   -- the period: steps from the first sync step to the last, per sync
                   (max(step) FILTER (WHERE synced) - min(step) FILTER (WHERE synced))::DOUBLE
                       / nullif(count(*) FILTER (WHERE synced) - 1, 0) AS every_k,
                   avg(sync_ns) FILTER (WHERE synced) AS sync_cost_ns,
                   avg(step_ns) FILTER (WHERE NOT synced) AS plain_step_ns
            FROM per_step GROUP BY run_id
        )
        SELECT run_id, steady_steps, sync_steps, every_k, sync_cost_ns, plain_step_ns,
               plain_step_ns + sync_cost_ns / every_k AS step_ns,
               sync_cost_ns / every_k / nullif(plain_step_ns + sync_cost_ns / every_k, 0) AS amortised_share,
               -- cost/k / (T0 + cost/k) < share  <=>  k > cost * (1 - share) / share / T0
               floor(sync_cost_ns * {1 - PERIODIC_TARGET_SHARE} / {PERIODIC_TARGET_SHARE}
                     / nullif(plain_step_ns, 0))::BIGINT + 1 AS k_for_target,
               {PERIODIC_TARGET_SHARE}::DOUBLE AS target_share
        FROM r
        WHERE sync_steps >= 2 AND sync_steps < {PERIODIC_MAX_STEP_SHARE} * steady_steps
        """,
        "run_id",
    )
