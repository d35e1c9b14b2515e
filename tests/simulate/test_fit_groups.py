"""The fit's collective points are instances keyed as the sync analysis keys them (issue 23): a call is
matched with its own process group's members, and point-to-point transfers are no collective.

A 4-rank run makes a tensor-parallel all-reduce on pairs {0,1}, {2,3} (the pair {2,3} enters 5 ms
late), a data-parallel one on pairs {0,2}, {1,3} and one on the whole world; a 2-rank run all-reduces
on its world; every transfer follows one alpha-beta ring, and a send/recv rides along. Matched by
(step, seq), the late pair's entry would be the on-time pair's last entry (a negative own time), each
pair's ring would be the world's, and the send would be a collective: the fitted ring would be off."""

from __future__ import annotations

import pytest
from storegen import DEFAULT_PHASES, MS, T0_NS, make_run, row

from perfscope.simulate.fit import fit_model
from perfscope.store.open import open_store
from perfscope.store.writer import StoreWriter

STEPS = 40
ALPHA_S, BETA_S_PER_BYTE = 20e-6, 1 / 5e9
SIZES = (2**20, 4 * 2**20, 16 * 2**20)  # the tp, dp and world all-reduce's bytes
LATE_NS = 5 * MS


def _ring_ns(p: int, nbytes: int) -> int:
    return int(1e9 * (2 * (p - 1) * ALPHA_S + 2 * (p - 1) / p * nbytes * BETA_S_PER_BYTE))


def _run(root, run_id: str, world: int, layout: tuple[tuple[tuple[int, ...], ...], ...]) -> None:
    make_run(root, run_id, world_size=world, steps=STEPS)
    step_len = int(sum(DEFAULT_PHASES.values()))
    rows = []
    for step in range(STEPS):
        t0 = T0_NS + step * step_len + int(DEFAULT_PHASES["data"] + DEFAULT_PHASES["forward"])
        enter = {r: t0 + (LATE_NS if world == 4 and r >= 2 else 0) for r in range(world)}
        for seq, (groups, nbytes) in enumerate(zip(layout, SIZES, strict=True)):
            leave = {}
            for r in range(world):
                g = next(g for g in groups if r in g)
                leave[r] = max(enter[m] for m in g) + _ring_ns(len(g), nbytes)
                rows.append(
                    row("comm", rank=r, step=step, seq=seq, op="allreduce", bytes=nbytes,
                        start_ns=enter[r], dur_ns=leave[r] - enter[r], clock="cuda",
                        group_size=len(g), group_ranks=",".join(map(str, g)))
                )  # fmt: skip
            enter = {r: leave[r] + MS for r in range(world)}
        # a send from rank 0 to rank 1 after the collectives, 30 ms long: no collective
        at = max(enter.values())
        for r, op in ((0, "send"), (1, "recv")):
            rows.append(
                row("comm", rank=r, step=step, seq=len(layout), op=op, bytes=SIZES[-1], start_ns=at,
                    dur_ns=30 * MS, clock="cuda", peer=1 - r, group_size=2, group_ranks="0,1")
            )  # fmt: skip
    w = StoreWriter(root, run_id, writer_id=f"gen-{run_id}-comm")
    w.extend("comm", rows)
    w.close()


def test_the_ring_is_fitted_to_each_groups_own_instances(tmp_path):
    world4 = ((0, 1, 2, 3),)
    _run(tmp_path, "w4", 4, (((0, 1), (2, 3)), ((0, 2), (1, 3)), world4))
    _run(tmp_path, "w2", 2, (((0, 1),),) * 3)
    with open_store(tmp_path) as store:
        (fit,) = fit_model(store)
    gb = fit.backend
    # the transfers follow the ring exactly: the fit recovers it (least squares on exact points)
    assert gb.intra_alpha_us == pytest.approx(ALPHA_S * 1e6, rel=0.02)
    assert gb.intra_gb_per_s == pytest.approx(1 / BETA_S_PER_BYTE / 1e9, rel=0.02)
    assert gb.coord_us == pytest.approx(0.0, abs=1.0)
