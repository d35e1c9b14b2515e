"""The bundled seed study reproduces the seed's figures, read from the store.

The pinned figures come from perfscope.analysis (docs/analysis.md); `run_figures` recomputes them
with plain DuckDB SQL over the store's views, following DESIGN.md's definitions, and a test checks the
two agree. `python tests/simulate/test_simulate_seed.py [STORE]` prints the SQL figures
(sample_traces/README.md).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tables import assert_tables_close

from perfscope.analysis import Selection, run_analysis
from perfscope.simulate.presets import PARTITIONS
from perfscope.store.open import open_store
from perfscope.store.reader import Store

BUNDLED = Path(__file__).resolve().parents[2] / "sample_traces" / "seed-study"

# Steady state (DESIGN.md): drop the first 10 steps or the first 5 %, whichever is larger.
_STEADY = """
steady AS (
    SELECT s.* FROM steps s
    JOIN (SELECT run_id, count(DISTINCT step) AS n FROM steps GROUP BY run_id) c USING (run_id)
    WHERE s.step >= greatest(10, ceil(0.05 * c.n))
)"""

# Per step: the step ends for every rank when the slowest finishes; phases are the mean over ranks.
_RUN_FIGURES = f"""
WITH {_STEADY},
per_step AS (
    SELECT run_id, step, max(step_ns) AS t_ns, sum(samples) AS samples,
           avg(sync_exposed_ns) AS sync_ns, avg(data_ns) AS data_ns,
           min(start_ns) AS first_ns, max(start_ns + step_ns) AS last_ns
    FROM steady GROUP BY run_id, step
),
per_run AS (
    -- throughput = samples over the steady window / its elapsed time (DESIGN): the window's wall
    -- clock (latest end - earliest start on any rank) per step, never the median or mean of maxima
    SELECT run_id, (max(last_ns) - min(first_ns)) / (max(step) - min(step) + 1) AS step_ns,
           median(samples) AS samples_per_step,
           avg(sync_ns / t_ns) AS sync_share, avg(data_ns / t_ns) AS data_share,
           median(sync_ns) AS sync_ns, min(first_ns) AS lo_ns, max(last_ns) AS hi_ns
    FROM per_step GROUP BY run_id
),
util AS (
    SELECT g.run_id, median(g.util_gpu_pct) AS util_pct
    FROM gpu_samples g JOIN per_run p USING (run_id)
    WHERE g.ts_ns BETWEEN p.lo_ns AND p.hi_ns GROUP BY g.run_id
)
SELECT r.run_id, r.experiment, r.source, r.cluster, r.backend, r.model, r.world_size, r.nodes,
       r.batch_size_per_rank AS batch, r.dataset_samples, p.step_ns, p.sync_share, p.data_share,
       p.sync_ns, u.util_pct,
       p.samples_per_step / p.step_ns * 1e9 AS throughput,
       r.dataset_samples / (p.samples_per_step / p.step_ns * 1e9) AS epoch_s
FROM runs r JOIN per_run p USING (run_id) LEFT JOIN util u USING (run_id)
ORDER BY r.experiment, r.cluster, r.backend, r.batch_size_per_rank, r.world_size
"""


def run_figures(store: Store) -> list[dict[str, Any]]:
    """One row per run, with per-GPU speedup S(N)/N against the smallest N of the same group
    (experiment, cluster, backend, per-rank batch, model)."""
    rows = store.query(_RUN_FIGURES).to_pylist()
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["experiment"], r["cluster"], r["backend"], r["batch"], r["model"]), []).append(r)
    for members in groups.values():
        base = min(members, key=lambda r: r["world_size"])
        for r in members:
            speedup = r["throughput"] / base["throughput"]
            r["speedup"] = speedup
            r["per_gpu_speedup"] = speedup / r["world_size"]
    return rows


def pick(rows: list[dict[str, Any]], **where: Any) -> dict[str, Any]:
    found = [r for r in rows if all(r[k] == v for k, v in where.items())]
    assert len(found) == 1, f"{len(found)} runs match {where}"
    return found[0]


def slope(rows: list[dict[str, Any]]) -> float:
    """Least-squares slope of S(N) against N: the seed's 'speedup ~linear, per GPU 0.53'."""
    xs = [r["world_size"] for r in rows]
    ys = [r["speedup"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def scaling_rows(rows: list[dict[str, Any]], cluster: str, backend: str) -> list[dict[str, Any]]:
    return [
        r
        for r in rows
        if r["experiment"] == "seed-scaling" and r["cluster"] == cluster and r["backend"] == backend
    ]


def print_figures(store_path: Path) -> None:
    with open_store(store_path) as store:
        rows = run_figures(store)
    for r in rows:
        print(
            f"{r['experiment']:17} {r['cluster']:6} {r['backend']:13} N={r['world_size']:3} b={r['batch']:5} "
            f"T={r['step_ns'] / 1e6:7.3f} ms  S/N={r['per_gpu_speedup']:.3f}  sync={r['sync_share']:.3f} "
            f"data={r['data_share']:.3f}  sync_ms={r['sync_ns'] / 1e6:.3f}  util={r['util_pct']:.1f}%  "
            f"epoch={r['epoch_s']:.1f} s"
        )
    for cluster in ("alpha", "hpdlf", "gpu2"):
        for backend in ("horovod-nccl", "horovod-mpi"):
            s = scaling_rows(rows, cluster, backend)
            print(f"slope {cluster:6} {backend:13} {slope(s):.3f}")


# ---- the pinned figures: seed figure, tolerance ---------------------------------------------------

SCALING = Selection(experiments=("seed-scaling",))
NCCL, MPI = "horovod-nccl", "horovod-mpi"
GPN = {name: p.gpus_per_node for name, p in PARTITIONS.items()}
LARGEST_N = 12


@pytest.fixture(scope="module")
def store() -> Iterator[Store]:
    with open_store(BUNDLED) as s:
        yield s


def _table(store: Store, name: str, sel: Selection = SCALING) -> list[dict[str, Any]]:
    return run_analysis(name, store, sel).to_pylist()


def _by(rows: list[dict[str, Any]], cluster: str, backend: str) -> dict[int, dict[str, Any]]:
    return {r["world_size"]: r for r in rows if r["cluster"] == cluster and r["backend"] == backend}


def test_bundled_store_is_what_the_preset_generates(store: Store, tmp_path: Path) -> None:
    """The pinned figures describe today's model: regenerating the preset gives the same data."""
    from perfscope.simulate import write_study
    from perfscope.simulate.presets import parse_config, seed_study_config

    write_study(tmp_path / "again", parse_config(seed_study_config()))
    with open_store(tmp_path / "again") as again:
        for table in ("runs", "steps", "comm", "gpu_samples", "metrics"):
            sql = f"SELECT * FROM {table} ORDER BY ALL"
            # another CPU or numpy may differ in a float's last bit: the same data, within 1e-9 relative
            assert_tables_close(
                again.query(sql), store.query(sql), rel=1e-9, what=f"{table} (regenerate the store?)"
            )


def test_bundled_store_is_small_and_all_simulated(store: Store) -> None:
    size = sum(p.stat().st_size for p in BUNDLED.rglob("*.parquet"))
    assert size < 6_000_000, f"the bundled store grew to {size / 1e6:.1f} MB"
    assert store.skipped == []
    runs = store.query("SELECT source, count(*) AS n FROM runs GROUP BY source").to_pylist()
    assert runs == [{"source": "simulated", "n": 6 * 8 + 8}]
    summary = _table(store, "run_summary", Selection())
    assert {r["source"] for r in summary} == {"simulated"} and len(summary) == 56


@pytest.mark.parametrize(
    ("cluster", "backend", "seed_figure"),
    [
        ("alpha", NCCL, 0.53),
        ("alpha", MPI, 0.52),
        ("hpdlf", NCCL, 0.57),
        ("hpdlf", MPI, 0.55),
        ("gpu2", NCCL, 0.74),
    ],
)
def test_per_gpu_speedup_matches_the_seed(
    store: Store, cluster: str, backend: str, seed_figure: float
) -> None:
    """S(N)/N at N = 12 against the 1-GPU run of the same partition and backend, within 0.02."""
    row = _by(_table(store, "scaling"), cluster, backend)[LARGEST_N]
    assert row["baseline_world_size"] == 1 and row["scaling_mode"] == "weak"
    assert row["per_gpu_speedup"] == pytest.approx(seed_figure, abs=0.02)


def test_gpu2_scales_best_and_speedup_keeps_growing(store: Store) -> None:
    rows = _table(store, "scaling")
    for backend in (NCCL, MPI):
        at_12 = {c: _by(rows, c, backend)[LARGEST_N]["per_gpu_speedup"] for c in GPN}
        assert at_12["gpu2"] > at_12["hpdlf"] > at_12["alpha"]
        for cluster in GPN:
            s = {n: r["speedup"] for n, r in _by(rows, cluster, backend).items()}
            assert s[1] < s[2] < s[4] < s[8] < s[LARGEST_N]


def test_sync_and_data_share_at_6_gpus_on_2_nodes(store: Store) -> None:
    """HPDLF with NCCL: 28 % of the epoch in synchronisation, 2 % loading data."""
    row = _by(_table(store, "scaling"), "hpdlf", NCCL)[6]
    assert row["nodes"] == 2
    assert row["sync_share"] == pytest.approx(0.28, abs=0.02)
    assert row["data_share"] == pytest.approx(0.02, abs=0.005)


def _jump(util: dict[int, dict[str, Any]], gpn: int) -> float:
    last_single = max(n for n in util if n <= gpn)
    first_multi = min(n for n in util if n > gpn)
    return float(util[first_multi]["util_gpu_pct"] - util[last_single]["util_gpu_pct"])


def test_utilisation_jumps_at_the_first_extra_node_with_nccl_only(store: Store) -> None:
    """At least 15 points (the explainer's threshold) on Alpha and HPDLF with NCCL; none with MPI."""
    rows = _table(store, "utilisation")
    for cluster in ("alpha", "hpdlf"):
        assert _jump(_by(rows, cluster, NCCL), GPN[cluster]) >= 15.0
    for cluster in GPN:
        assert _jump(_by(rows, cluster, MPI), GPN[cluster]) <= 0.5
    # the seed saw the jump on Alpha and HPDLF; GPU2's longer steps hide most of the ring
    assert _jump(_by(rows, "gpu2", NCCL), GPN["gpu2"]) < 10.0


def test_mpi_syncs_faster_within_a_node_nccl_across_nodes(store: Store) -> None:
    rows = _table(store, "sync")
    for cluster, gpn in GPN.items():
        nccl, mpi = _by(rows, cluster, NCCL), _by(rows, cluster, MPI)
        for n in sorted(nccl):
            if n == 1:
                continue
            faster, slower = (mpi, nccl) if n <= gpn else (nccl, mpi)
            assert faster[n]["sync_exposed_ns"] < slower[n]["sync_exposed_ns"], (cluster, n)


def test_batch_1000_gives_about_7x_faster_epochs_on_one_gpu(store: Store) -> None:
    rows = _table(store, "batch_sweep", Selection(experiments=("seed-batch-sweep",)))
    epoch = {r["batch_size_per_rank"]: r["epoch_s"] for r in rows}
    assert sorted(epoch) == [75, 150, 250, 500, 1000, 2000, 3000, 5000]
    assert epoch[75] / epoch[1000] == pytest.approx(7.0, abs=0.5)
    batches = sorted(epoch)
    assert all(epoch[a] > epoch[b] for a, b in itertools.pairwise(batches))


def test_larger_batch_reaches_a_worse_loss_after_the_same_samples(store: Store) -> None:
    """The seed's 'worse accuracy after the same number of epochs' at a large batch."""
    loss = store.query(
        "SELECT r.batch_size_per_rank AS batch, median(m.value) AS loss "
        "FROM metrics m JOIN runs r USING (run_id) WHERE m.name = 'loss' "
        "AND (m.step + 1) * r.batch_size_per_rank BETWEEN 14000 AND 16000 GROUP BY ALL"
    ).to_pylist()
    by_batch = {r["batch"]: r["loss"] for r in loss}
    assert by_batch[1000] > 1.3 * by_batch[75]


def test_sql_figures_agree_with_the_analysis(store: Store) -> None:
    """The pinned figures do not hinge on the analysis package: plain SQL gives the same numbers."""
    mine = {(r["cluster"], r["backend"], r["world_size"]): r for r in scaling_rows_all(run_figures(store))}
    util = {(r["cluster"], r["backend"], r["world_size"]): r for r in _table(store, "utilisation")}
    for r in _table(store, "scaling"):
        key = (r["cluster"], r["backend"], r["world_size"])
        assert mine[key]["per_gpu_speedup"] == pytest.approx(r["per_gpu_speedup"], rel=1e-6)
        assert mine[key]["sync_share"] == pytest.approx(r["sync_share"], abs=0.003)
        assert mine[key]["data_share"] == pytest.approx(r["data_share"], abs=0.001)
        assert mine[key]["util_pct"] == pytest.approx(util[key]["util_gpu_pct"], abs=1.0)


def test_fitting_the_bundled_runs_recovers_the_preset(store: Store) -> None:
    """Alpha has five world sizes inside a node: coordination and both rings come back. HPDLF has two,
    so the fit says that its intra-node terms cannot be separated, yet still predicts every run."""
    from perfscope.simulate.fit import fit_model

    fits = {(f.cluster, f.backend.name): f for f in fit_model(store)}
    assert len(fits) == 6
    alpha, truth = fits[("alpha", NCCL)], PARTITIONS["alpha"]
    ring = truth.backends[NCCL]
    assert alpha.partition.step_overhead_us == pytest.approx(truth.step_overhead_us, rel=0.02)
    assert alpha.partition.cpu_share_penalty == pytest.approx(truth.cpu_share_penalty, rel=0.1)
    assert alpha.backend.coord_us == pytest.approx(ring.coord_us, rel=0.1)
    assert alpha.backend.intra_alpha_us == pytest.approx(ring.intra_alpha_us, rel=0.1)
    assert alpha.backend.inter_gb_per_s == pytest.approx(ring.inter_gb_per_s, rel=0.1)
    hpdlf = fits[("hpdlf", NCCL)]
    assert hpdlf.experiment == "seed-scaling" and hpdlf.batch_sizes == (75,)
    assert any("cannot be told from the per-collective coordination" in n for n in hpdlf.notes)
    assert all(f.smape < 0.03 for f in fits.values())


def scaling_rows_all(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["experiment"] == "seed-scaling"]


if __name__ == "__main__":
    print_figures(Path(sys.argv[1]) if len(sys.argv) > 1 else BUNDLED)
