"""The small study the report and chart tests share (built with tests/storegen.py), and checks that it
holds what those tests rely on: two backends over a node boundary, measured and simulated runs, a
straggler, GPU and host samples, and a batch sweep with a loss curve."""

from __future__ import annotations

import math
from pathlib import Path

from storegen import DEFAULT_PHASES, MS, Comm, Gpu, Host, make_run

from perfscope.analysis import Selection, run_analysis
from perfscope.store.open import open_store

WORLD_SIZES = (1, 2, 4)
GPUS_PER_NODE = 2
STEPS = 30
BUCKET_BYTES = 8 * 2**20
STRAGGLER_RUN = "study-nccl-n4"
STRAGGLER_RANK = 3
STRAGGLE_NS = 1.5 * MS  # the straggler enters every collective late by ~4% of the step


def _transfer_ns(n: int, backend: str):
    """Ring-allreduce time per bucket: slower across nodes, MPI slower than NCCL."""
    alpha, gb_per_s = (5e-6, 40.0) if n <= GPUS_PER_NODE else (20e-6, 8.0)
    if backend == "mpi":
        alpha, gb_per_s = alpha * 2, gb_per_s / 2

    def t(nbytes: int) -> float:
        return 1e9 * (2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / (gb_per_s * 1e9)) if n > 1 else 0.0

    return t


def build_study(root: Path) -> Path:
    """Write the study into `root` and return it."""
    for backend, source in (("nccl", "measured"), ("mpi", "simulated")):
        for n in WORLD_SIZES:
            run_id = f"study-{backend}-n{n}"
            transfer = _transfer_ns(n, backend)
            sync_ns = transfer(BUCKET_BYTES)
            straggle = run_id == STRAGGLER_RUN

            def delay(rank: int, step: int, straggle: bool = straggle) -> float:
                return STRAGGLE_NS if straggle and rank == STRAGGLER_RANK else 0.0

            make_run(
                root,
                run_id,
                world_size=n,
                steps=STEPS,
                experiment="study",
                source=source,
                backend=backend,
                gpus_per_node=GPUS_PER_NODE,
                phases=dict(
                    DEFAULT_PHASES,
                    sync_exposed=sync_ns + (STRAGGLE_NS if straggle else 0.0),
                    # MPI's host-side optimizer is a little slower, so no two runs tie on step time
                    optimizer=DEFAULT_PHASES["optimizer"] * (1.05 if backend == "mpi" else 1.0),
                ),
                comm=Comm([BUCKET_BYTES], transfer, delay_ns=delay),
                gpu=Gpu(util_pct=lambda rank, n=n: 85.0 - 5 * math.log2(n)),
                host=Host(),
                grad_bytes=BUCKET_BYTES,
                param_count=BUCKET_BYTES // 4,
                dataset_samples=100_000,
            )
    for batch in (32, 64, 128):
        make_run(
            root,
            f"sweep-b{batch}",
            world_size=1,
            steps=STEPS,
            experiment="sweep",
            batch_size_per_rank=batch,
            phases=dict(
                DEFAULT_PHASES, forward=10 * MS * (batch / 32) ** 0.7, backward=20 * MS * (batch / 32) ** 0.7
            ),
            gpu=Gpu(),
            dataset_samples=100_000,
            metrics={"loss": lambda step, b=batch: 1.0 / (1 + step * b / 400)},
        )
    return root


def test_the_study_has_what_the_report_tests_rely_on(tmp_path: Path) -> None:
    build_study(tmp_path)
    with open_store(tmp_path) as store:
        sel = Selection()
        runs = run_analysis("run_summary", store, sel).to_pylist()
        scaling = run_analysis("scaling", store, sel).to_pylist()
        sync = run_analysis("sync", store, sel).to_pylist()
        stragglers = run_analysis("stragglers", store, sel).to_pylist()
        curves = run_analysis("metric_curves", store, sel)
    assert len(runs) == 9
    assert {r["source"] for r in runs} == {"measured", "simulated"}
    groups = {r["group_id"] for r in scaling if r["experiment"] == "study"}
    assert len(groups) == 2  # one curve per backend
    assert {r["scope"] for r in sync if r["world_size"] == 4} == {"inter-node"}
    flagged = [(r["run_id"], r["rank"]) for r in stragglers if r["is_straggler"]]
    assert flagged == [(STRAGGLER_RUN, STRAGGLER_RANK)]
    assert curves.num_rows > 0
