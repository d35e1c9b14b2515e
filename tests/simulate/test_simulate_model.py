"""The simulator's cost model: ring allreduce, placement, batch effects, the step timeline, utilisation."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from perfscope.simulate.model import (
    Backend,
    Convergence,
    Timeline,
    busy_share_in_windows,
    nodes_for,
    ranks_on_nodes,
    simulate_timeline,
)
from perfscope.simulate.presets import PARTITIONS

HPDLF = PARTITIONS["hpdlf"]
NCCL = HPDLF.backends["horovod-nccl"]
MPI = HPDLF.backends["horovod-mpi"]
GRAD_BYTES = 153_441 * 4


def test_ring_allreduce_follows_alpha_beta() -> None:
    n = 1_000_000
    # T = 2(p-1)·α + 2(p-1)/p·n·β; β = 1/bandwidth and 1 GB/s moves one byte per ns
    assert NCCL.ring_ns(1, 1, n) == 0.0
    assert NCCL.ring_ns(3, 1, n) == pytest.approx(4 * 10_000 + 4 / 3 * n / 8.0)
    assert NCCL.ring_ns(6, 2, n) == pytest.approx(10 * 60_000 + 10 / 6 * n / 1.05)
    # the ring that crosses a node boundary moves at the inter-node pace
    assert NCCL.ring_ns(4, 2, n) > 3 * NCCL.ring_ns(3, 1, n)
    assert NCCL.allreduce_ns(1, 1, n) == 0.0
    assert NCCL.allreduce_ns(2, 1, n) == pytest.approx(100_000 + NCCL.ring_ns(2, 1, n))


@pytest.mark.parametrize(
    ("world", "per_node", "expected"),
    [(1, 4, [1]), (4, 4, [4]), (5, 4, [4, 1]), (6, 3, [3, 3]), (12, 8, [8, 4]), (10, 3, [3, 3, 3, 1])],
)
def test_sequential_placement_fills_a_node_first(world: int, per_node: int, expected: list[int]) -> None:
    assert ranks_on_nodes(world, per_node).tolist() == expected
    assert nodes_for(world, per_node) == len(expected)


def test_small_batches_pay_the_fixed_overhead() -> None:
    per_sample = [(HPDLF.kernel_ns(b) + HPDLF.fixed_step_ns()) / b for b in (10, 75, 1000, 5000)]
    assert per_sample == sorted(per_sample, reverse=True)
    # kernel time is nearly flat while the batch under-fills the GPU, then linear
    assert HPDLF.kernel_ns(20) / HPDLF.kernel_ns(10) < 1.2
    assert HPDLF.kernel_ns(4000) / HPDLF.kernel_ns(2000) == pytest.approx(2.0, rel=1e-3)


def _timeline(
    world: int, backend: Backend = NCCL, steps: int = 60, batch: int = 75, seed: int = 1
) -> Timeline:
    return simulate_timeline(
        HPDLF, backend, world, batch, steps, GRAD_BYTES, 10**18, np.random.default_rng(seed)
    )


@pytest.mark.parametrize("world", [1, 2, 6])
def test_phases_add_up_and_ranks_leave_the_allreduce_together(world: int) -> None:
    tl = _timeline(world)
    phases = tl.data_ns + tl.forward_ns + tl.backward_ns + tl.sync_ns + tl.optimizer_ns + tl.other_ns
    assert np.array_equal(phases, tl.step_ns)
    # steps follow each other without gaps on every rank
    assert np.array_equal(tl.start_ns[1:], tl.end_ns[:-1])
    exits = tl.enter_ns + tl.sync_ns
    assert np.all(exits == exits[:, :1])
    # the last rank to arrive waits only for coordination and the ring
    own = tl.sync_ns.min(axis=1)
    expected = NCCL.allreduce_ns(world, nodes_for(world, 3), GRAD_BYTES)
    assert np.median(own) == pytest.approx(expected, rel=0.05, abs=1_000)
    assert np.all(tl.step_ns > 0) and np.all(tl.sync_ns >= 0)


def test_the_first_steps_are_warm_up() -> None:
    tl = _timeline(1)
    steady = np.median(tl.step_ns[10:])
    assert tl.step_ns[0, 0] > 5 * steady
    assert abs(tl.step_ns[12, 0] - steady) < 0.2 * steady


def test_nccl_ring_counts_as_kernel_time_mpi_does_not() -> None:
    nccl, mpi = _timeline(6, NCCL), _timeline(6, MPI)
    assert np.all(nccl.kernel_busy_ns > nccl.compute_kernel_ns)
    assert np.array_equal(mpi.kernel_busy_ns, mpi.compute_kernel_ns)


def test_utilisation_is_the_busy_share_of_each_window() -> None:
    start = np.array([0, 100, 200, 300])
    step = np.array([100, 100, 100, 100])
    busy = np.array([50, 50, 0, 100])
    share = busy_share_in_windows(start, step, busy, np.array([100, 200, 300, 400, 250]), 100)
    assert share.tolist() == pytest.approx([0.5, 0.5, 0.0, 1.0, 0.25])


def test_same_seed_same_timeline_other_seed_differs() -> None:
    a, b, c = _timeline(4, seed=3), _timeline(4, seed=3), _timeline(4, seed=4)
    assert np.array_equal(a.step_ns, b.step_ns)
    assert not np.array_equal(a.step_ns, c.step_ns)


def test_no_noise_gives_the_model_exactly() -> None:
    quiet = replace(HPDLF, step_cv=0.0, rank_cv=0.0, comm_cv=0.0)
    tl = simulate_timeline(quiet, NCCL, 3, 75, 30, GRAD_BYTES, 0, np.random.default_rng(0))
    host = quiet.host_ns(3)
    fb = host + quiet.kernel_ns(75)
    assert tl.forward_ns[20, 0] + tl.backward_ns[20, 0] == pytest.approx(fb, abs=1_000)
    assert tl.sync_ns[20, 0] == pytest.approx(NCCL.allreduce_ns(3, 1, GRAD_BYTES), abs=2_000)


def test_larger_batches_converge_slower_per_sample() -> None:
    conv = Convergence()
    seen = np.array([0.0, 1e4, 1e5, 1e6])
    small, large = conv.loss(seen, 75), conv.loss(seen, 1000)
    assert small[0] == large[0] == pytest.approx(conv.initial_loss)
    assert np.all(np.diff(small) < 0) and np.all(np.diff(large) < 0)
    assert np.all(large[1:] > small[1:])
