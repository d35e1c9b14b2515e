"""Gradient sync: exposed vs total, bus bandwidth by value, alpha-beta fit recovering α and β."""

from __future__ import annotations

import pytest
from storegen import DEFAULT_PHASES, MS, T0_NS, Comm, make_run, row

from perfscope.analysis import run_analysis
from perfscope.store.open import open_store
from perfscope.store.writer import StoreWriter

ALPHA_INTRA, BETA_INTRA = 5e-6, 1 / 10e9
ALPHA_INTER, BETA_INTER = 20e-6, 1 / 2e9


def _ring_ns(p: int, nbytes: int, alpha: float, beta: float) -> float:
    return 1e9 * (2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta)


def _ring_run(root, n, gpn=8, buckets=(1 << 20, 1 << 22, 1 << 24)):
    a, b = (ALPHA_INTRA, BETA_INTRA) if n <= gpn else (ALPHA_INTER, BETA_INTER)
    make_run(
        root,
        f"r{n}",
        world_size=n,
        gpus_per_node=gpn,
        comm=Comm(list(buckets), lambda nb: _ring_ns(n, nb, a, b)),
    )


def test_busbw_from_comm_rows(tmp_path):
    make_run(tmp_path, "r4", world_size=4, comm=Comm([4 * 2**20], lambda nb: 1e6))
    with open_store(tmp_path) as store:
        s = run_analysis("sync", store).to_pylist()[0]
        c = run_analysis("collectives", store).to_pylist()[0]
    # algbw = bytes/t = 4 MiB / 1 ms; busbw = algbw·2(n−1)/n
    assert s["algbw_gb_per_s"] == pytest.approx(4 * 2**20 / 1e-3 / 1e9)
    assert s["busbw_gb_per_s"] == pytest.approx(4 * 2**20 / 1e-3 / 1e9 * 2 * 3 / 4)
    assert s["bw_source"] == "comm"
    assert s["scope"] == "intra-node"
    assert s["comm_count"] == 1
    assert s["bytes_per_step"] == 4 * 2**20
    assert c["transfer_ns"] == pytest.approx(1e6)
    assert c["busbw_gb_per_s"] == pytest.approx(s["busbw_gb_per_s"])


def test_waiting_for_a_late_rank_is_not_transfer_time(tmp_path):
    make_run(
        tmp_path,
        "r2",
        world_size=2,
        comm=Comm([2**20], lambda nb: 1e6, delay_ns=lambda r, s: 5e6 if r == 1 else 0),
    )
    with open_store(tmp_path) as store:
        c = run_analysis("collectives", store).to_pylist()[0]
        s = run_analysis("sync", store).to_pylist()[0]
    assert c["transfer_ns"] == pytest.approx(1e6)
    # rank 0 waits 5 ms in the collective: total comm per step is the mean over ranks of 6 and 1 ms
    assert s["comm_total_ns"] == pytest.approx(3.5e6)
    # exposed 2 ms of 3.5 ms total: 43% overlapped
    assert s["overlap_share"] == pytest.approx(1 - 2 / 3.5)


def test_alpha_beta_fit_recovers_intra_and_inter_node_parameters(tmp_path):
    for n in (2, 4, 8, 16, 32):
        _ring_run(tmp_path, n)
    with open_store(tmp_path) as store:
        fits = {r["scope"]: r for r in run_analysis("allreduce_fit", store).to_pylist()}
    intra, inter = fits["intra-node"], fits["inter-node"]
    assert intra["alpha_s"] == pytest.approx(ALPHA_INTRA, rel=1e-3)
    assert intra["beta_s_per_byte"] == pytest.approx(BETA_INTRA, rel=1e-3)
    assert intra["bandwidth_gb_per_s"] == pytest.approx(10.0, rel=1e-3)
    assert inter["alpha_s"] == pytest.approx(ALPHA_INTER, rel=1e-3)
    assert inter["bandwidth_gb_per_s"] == pytest.approx(2.0, rel=1e-3)
    assert intra["world_sizes"] == "2,4,8"
    assert intra["points"] == 9 and not intra["too_few_points"]
    assert intra["smape_pct"] < 0.01 and intra["r2_adj"] > 0.9999


def test_few_points_are_flagged(tmp_path):
    _ring_run(tmp_path, 2, buckets=(1 << 20,))
    _ring_run(tmp_path, 4, buckets=(1 << 20,))
    with open_store(tmp_path) as store:
        fit = run_analysis("allreduce_fit", store).to_pylist()[0]
    assert fit["points"] == 2 and fit["too_few_points"]


def test_without_comm_rows_bandwidth_falls_back_to_exposed_sync(tmp_path):
    # a Horovod-like summary: only the exposed sync per step and the gradient bytes
    for n in (1, 4):
        make_run(
            tmp_path,
            f"h{n}",
            world_size=n,
            backend="horovod-nccl",
            grad_bytes=8 * 2**20,
            phases={**DEFAULT_PHASES, "sync_exposed": 4 * MS if n > 1 else 0},
        )
    with open_store(tmp_path) as store:
        rows = {r["run_id"]: r for r in run_analysis("sync", store).to_pylist()}
        fit = run_analysis("allreduce_fit", store).to_pylist()
    h4 = rows["h4"]
    assert h4["bw_source"] == "steps.sync_exposed_ns+runs.grad_bytes"
    assert h4["busbw_gb_per_s"] == pytest.approx(8 * 2**20 / 4e-3 / 1e9 * 2 * 3 / 4)
    assert h4["comm_total_ns"] is None and h4["overlap_share"] is None
    assert rows["h1"]["busbw_gb_per_s"] is None
    assert fit[0]["data_source"] == "steps.sync_exposed_ns"


# -- collectives matched with their own group's members (issue 23) ------------------------------------
#: 4 ranks: tensor-parallel pairs {0,1}, {2,3} and data-parallel pairs {0,2}, {1,3}; every step each
#: rank all-reduces the same size first on its tp pair, then on its dp pair
TP = ((0, 1), (2, 3))
DP = ((0, 2), (1, 3))
WORLD = ((0, 1, 2, 3),)
LATE_NS = 5 * MS  # the tp pair {2,3} enters its tp all-reduce this late ...
LATER_NS = 1 * MS  # ... and rank 3 this much later still: the last of its pair
TRANSFER_NS = (1 * MS, 2 * MS)  # the first and the second all-reduce's transfer
GAP_NS = 2 * MS  # compute between the two
NBYTES = 2**20
STEPS = 40


def _group(groups: tuple[tuple[int, ...], ...], rank: int) -> tuple[int, ...]:
    return next(g for g in groups if rank in g)


def _comm_run(root, run_id: str, layout, *, with_groups: bool, late=None) -> list[dict]:
    """A 4-rank run (steps and ranks from make_run) with two all-reduces a step, the first on the
    groups layout[0], the second on layout[1]: a rank leaves one when the last member of its own
    group has entered and the transfer is done, and enters the next GAP_NS later. `late(rank,
    step)`: how late a rank enters the first. Returns the comm rows written, each with its group's
    `members` whether written or not."""
    late = late or (lambda r, s: {2: LATE_NS, 3: LATE_NS + LATER_NS}.get(r, 0))
    make_run(root, run_id, world_size=4, steps=STEPS)
    step_len = int(sum(DEFAULT_PHASES.values()))
    rows = []
    for step in range(STEPS):
        t = T0_NS + step * step_len + int(DEFAULT_PHASES["data"] + DEFAULT_PHASES["forward"])
        enter = {r: t + late(r, step) for r in range(4)}
        for seq, (groups, transfer) in enumerate(zip(layout, TRANSFER_NS, strict=True)):
            leave = {r: max(enter[m] for m in _group(groups, r)) + transfer for r in range(4)}
            for r in range(4):
                members = ",".join(map(str, _group(groups, r)))
                rows.append(
                    {"rank": r, "step": step, "seq": seq, "op": "allreduce", "bytes": NBYTES,
                     "start_ns": int(enter[r]), "dur_ns": int(leave[r] - enter[r]), "clock": "cuda",
                     "group_size": len(_group(groups, r)), "group_ranks": members if with_groups else None,
                     "members": members}
                )  # fmt: skip
            enter = {r: leave[r] + GAP_NS for r in range(4)}
    w = StoreWriter(root, run_id, writer_id=f"gen-{run_id}-comm")
    w.extend("comm", [row("comm", **{k: v for k, v in x.items() if k != "members"}) for x in rows])
    w.close()
    return rows


def _reference_waits(rows: list[dict], key) -> dict[int, float]:
    """Per rank, the mean wait per step at its collectives, max_j(start_j) − start_i over the
    instance `key(row)` matches it with: the definition, in plain Python."""
    last: dict = {}
    for x in rows:
        last[key(x)] = max(last.get(key(x), 0), x["start_ns"])
    wait: dict[int, float] = {}
    for x in rows:
        wait[x["rank"]] = wait.get(x["rank"], 0) + (last[key(x)] - x["start_ns"])
    return {r: v / STEPS for r, v in wait.items()}


def _by_members(x: dict) -> tuple:
    return (x["step"], x["members"], x["seq"])  # each rank calls a group once a step here


def _by_seq(x: dict) -> tuple:
    return (x["step"], x["seq"])


def test_a_collective_is_matched_with_its_own_groups_members(tmp_path):
    rows = _comm_run(tmp_path, "tpdp", (TP, DP), with_groups=True)
    with open_store(tmp_path) as store:
        st = {r["rank"]: r for r in run_analysis("stragglers", store).to_pylist()}
        heat = run_analysis("collective_wait", store).to_pylist()
        s = run_analysis("sync", store).to_pylist()[0]
        c = run_analysis("collectives", store).to_pylist()[0]
    # the late tp pair keeps only its dp partners waiting (rank 0 for rank 2, rank 1 for rank 3), by
    # how late it is; in its own tp pair rank 2 waits for rank 3; rank 3 waits for no one
    expect = {0: LATE_NS + LATER_NS, 1: LATE_NS + LATER_NS, 2: LATER_NS, 3: 0}
    assert _reference_waits(rows, _by_members) == pytest.approx(expect, abs=1)
    for r, w in expect.items():
        assert st[r]["wait_per_step_ns"] == pytest.approx(w, abs=1e3), r
    assert heat and all(h["wait_ns"] == pytest.approx(expect[h["rank"]], abs=1e3) for h in heat)
    # rank 3 enters last in its tp pair and in its dp pair: in every instance it is in; rank 2 is
    # last in its dp pair only; the on-time tp pair enters together (no last)
    steady = st[0]["instances"] // 2
    assert all(x["instances"] == 2 * steady for x in st.values())
    assert st[3]["last_share"] == pytest.approx(1.0) and st[3]["is_straggler"]
    assert st[2]["last_share"] == pytest.approx(0.5) and not st[2]["is_straggler"]
    assert st[0]["last_count"] == st[1]["last_count"] == 0
    # four instances of two ranks a step; per rank two calls, each its own transfer time
    assert c["instances"] == 4 * steady
    assert s["comm_count"] == pytest.approx(2.0)
    assert s["comm_total_ns"] == pytest.approx(sum(TRANSFER_NS), rel=1e-6)
    # the ring of a pair: busbw = algbw · 2(2−1)/2, not the world's 2(4−1)/4
    algbw = [NBYTES / (t / 1e9) / 1e9 for t in TRANSFER_NS]
    assert s["busbw_p10_gb_per_s"] == pytest.approx(min(algbw), rel=1e-3)
    assert s["busbw_p90_gb_per_s"] == pytest.approx(max(algbw), rel=1e-3)


def test_without_group_ranks_the_nth_collective_of_the_step_is_matched_as_before(tmp_path):
    # the same job imported without its groups: unknown is unknown, so the n-th collective of a
    # step is one instance of every rank (the matching before group_ranks), whatever that makes of it
    rows = _comm_run(tmp_path, "tpdp", (TP, DP), with_groups=False)
    with open_store(tmp_path) as store:
        st = {r["rank"]: r for r in run_analysis("stragglers", store).to_pylist()}
        c = run_analysis("collectives", store).to_pylist()[0]
    expect = _reference_waits(rows, _by_seq)
    assert expect != pytest.approx(_reference_waits(rows, _by_members), abs=1)  # it does differ
    for r, w in expect.items():
        assert st[r]["wait_per_step_ns"] == pytest.approx(w, abs=1e3), r
    assert c["instances"] == st[0]["instances"]  # two instances of all four ranks a step


@pytest.mark.parametrize("name", ["stragglers", "collective_wait", "sync", "collectives", "allreduce_fit"])
def test_world_collectives_read_the_same_with_or_without_group_ranks(tmp_path, name):
    # collectives of the whole world (DDP's buckets) with jittered entries: the numbers must not
    # move when the recorder also writes the group (it does since schema 3)
    def late(r: int, s: int) -> int:
        return (3 * MS if r == 2 else 0) + (s * 7 + r * 3) % 5 * MS // 10

    tables = []
    for with_groups in (False, True):
        root = tmp_path / str(with_groups)
        _comm_run(root, "world", (WORLD, WORLD), with_groups=with_groups, late=late)
        with open_store(root) as store:
            tables.append(run_analysis(name, store).to_pylist())
    old, new = tables
    assert old and len(old) == len(new)
    for a, b in zip(old, new, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], float):
                assert b[k] == pytest.approx(a[k], rel=1e-9, abs=1e-9), k
            else:
                assert b[k] == a[k], k
