"""`perfscope import op-table --vpp N` (issue 23): an interleaved pipeline's transfers, those between
the last and the first stage included, are point-to-point comm with their peer stage's rank, found
from the model chunk of the compute each belongs to. Tables from the what-if tests' generator
(tests/analysis/test_what_if.py `synthetic`, Megatron-LM's interleaved 1F1B schedule)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_what_if import _cli, synthetic

from perfscope.store.open import open_store
from perfscope.store.process_groups import COMM_MEMBERS_SQL

DP, PP, VPP, M, STEPS = 2, 4, 2, 8, 3


def _import(
    tmp_path: Path, table: pa.Table, *layout: str | int | Path, name: str = "t"
) -> tuple[Path, list[str]]:
    path = tmp_path / f"{name}.parquet"
    pq.write_table(table, path)
    store = tmp_path / f"store-{name}"
    res = _cli("import", "op-table", path, "--store", store, *layout)
    assert res.returncode == 0, res.stderr
    return store, [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]


def _transfers(store: Path) -> list[dict]:
    with open_store(store) as s:
        return s.query(
            f"""
            SELECT c.rank, c.step, c.name, c.op, c.peer, c.group_ranks, k.pp_stage AS stage, k.dp_rank,
                   p.pp_stage AS peer_stage, p.dp_rank AS peer_dp
            FROM ({COMM_MEMBERS_SQL}) c JOIN ranks k USING (rank) LEFT JOIN ranks p ON p.rank = c.peer
            WHERE c.name LIKE '%-send' OR c.name LIKE '%-recv'
            """
        ).to_pylist()


@pytest.mark.parametrize(("pp", "vpp", "m", "batched"), [(PP, VPP, M, False), (2, 3, 4, True)])
def test_every_interleaved_transfer_has_its_peer_stage(
    tmp_path: Path, pp: int, vpp: int, m: int, batched: bool
) -> None:
    """Also pp = 2 (both stages send each other both directions) with each exchange recorded as one
    batch (one start, one end: Megatron-LM's batch_isend_irecv)."""
    table = synthetic(DP, pp, m=m, steps=STEPS, vpp=vpp, batched=batched)
    meta = tmp_path / "meta.yaml"
    meta.write_text(f"dp_size: {DP}\npp_size: {pp}\ntp_size: 1\nvpp_size: {vpp}\n")
    store, warnings = _import(tmp_path, table, "--meta", meta)
    assert warnings == []
    rows = _transfers(store)
    sent = pa.compute.sum(pa.compute.match_substring_regex(table.column("optype"), r"-(send|recv)$")).as_py()
    assert len(rows) == sent  # no transfer was kept as compute
    with open_store(store) as s:
        kept = s.query("SELECT count(*) AS n FROM spans WHERE name LIKE '%-send' OR name LIKE '%-recv'")
    assert kept.to_pylist() == [{"n": 0}]
    for r in rows:
        assert r["peer"] is not None and r["peer_dp"] == r["dp_rank"], r
        forward_next = r["name"].startswith("forward") == (r["op"] == "send")
        # the next virtual stage (stage + 1; from the last stage, stage 0 of the next chunk), or the previous
        assert r["peer_stage"] == (r["stage"] + (1 if forward_next else -1)) % pp, r
        assert r["group_ranks"] == ",".join(map(str, sorted((r["rank"], r["peer"]))))
    # the transfers across the wrap: every chunk but the last sends each micro-batch from stage pp-1 to 0
    wrap = [r for r in rows if r["name"] == "forward-send" and r["stage"] == pp - 1]
    assert len(wrap) == DP * STEPS * m * (vpp - 1)
    assert all(r["peer_stage"] == 0 for r in wrap)
    # each direction's sends from a to b are as many as b's recvs from a
    count: dict[tuple, int] = {}
    for r in rows:
        src, dst = (r["rank"], r["peer"]) if r["op"] == "send" else (r["peer"], r["rank"])
        key = (r["step"], src, dst, r["name"].split("-")[0])
        count[key] = count.get(key, 0) + (1 if r["op"] == "send" else -1)
    assert set(count.values()) == {0}


def test_chunks_from_megatrons_order_without_mc(tmp_path: Path) -> None:
    """A table without the mc column: each compute's model chunk is Megatron-LM's schedule's; the same
    peers as with it."""
    table = synthetic(DP, PP, m=M, steps=2, vpp=VPP, seed=3)
    layout = ("--dp", DP, "--pp", PP, "--vpp", VPP)
    a, wa = _import(tmp_path, table, *layout, name="mc")
    b, wb = _import(tmp_path, table.drop_columns(["mc"]), *layout, name="nomc")
    assert wa == wb == []

    def peers(store: Path) -> list[tuple]:
        return sorted((r["rank"], r["step"], r["name"], r["peer"]) for r in _transfers(store))

    assert peers(a) == peers(b) and len(peers(a)) > 0


def test_ends_of_the_model_and_strays_are_one_line_each(tmp_path: Path) -> None:
    """A recorded no-op (stage 0's forward-recv of the first chunk, as the study's profiler records them)
    has no peer; a recv after the last compute belongs to no compute. Both are kept as compute, each
    with one line; everything else is still matched."""
    table = synthetic(DP, PP, m=M, steps=2, vpp=VPP)
    d = table.to_pydict()
    first = min(i for i in range(table.num_rows) if d["rank"][i] == 0 and d["step"][i] == 0)
    t0 = min(d["start_ts"][i] for i in range(table.num_rows) if d["rank"][i] == 0 and d["step"][i] == 0)
    end = max(d["start_ts"][i] + d["duration"][i] for i in range(table.num_rows) if d["step"][i] == 0)
    extra = {k: [d[k][first]] * 2 for k in d}
    extra["optype"] = ["forward-recv", "backward-recv"]
    extra["start_ts"], extra["duration"] = [t0, end], [0.0, 0.0]
    extra["mc"], extra["mb_id"], extra["gmc"] = [-1, -1], [-1, -1], [-1, -1]
    both = pa.concat_tables([table, pa.table(extra, schema=table.schema)])
    store, warnings = _import(tmp_path, both, "--dp", DP, "--pp", PP, "--vpp", VPP)
    assert len(warnings) == 2, warnings
    assert "forward-recv of the model's first chunk (stage 0, model chunk 0) has no peer" in warnings[0]
    assert "1 transfer(s) (1 backward-recv) with no compute of their direction" in warnings[1]
    assert len(_transfers(store)) == table.num_rows - sum(
        not o.endswith(("-send", "-recv")) for o in d["optype"]
    )


@pytest.mark.parametrize("layout", [("--vpp", "1"), ()])
def test_chunks_beyond_the_layout_are_refused_in_one_line(tmp_path: Path, layout: tuple[str, ...]) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(synthetic(DP, PP, m=M, steps=1, vpp=VPP), path)
    res = _cli("import", "op-table", path, "--store", tmp_path / "s", "--dp", DP, "--pp", PP, *layout)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "column mc holds model chunk 1, but the layout has vpp 1: give --vpp" in lines[0]


def test_a_transfer_without_its_other_side_is_one_line(tmp_path: Path) -> None:
    """One send from the last stage to the first missing from the table: its recv on stage 0 has no
    other side, said in one line (the what-if pairs a rank pair's transfers in order)."""
    table = synthetic(DP, PP, m=M, steps=2, vpp=VPP)
    d = table.to_pydict()
    wrap = [
        i
        for i in range(table.num_rows)
        if d["optype"][i] == "forward-send" and d["stage"][i] == PP - 1 and d["step"][i] == 1
    ]
    keep = [i for i in range(table.num_rows) if i != wrap[1]]
    store, warnings = _import(tmp_path, table.take(keep), "--dp", DP, "--pp", PP, "--vpp", VPP)
    assert len(warnings) == 1, warnings
    assert "1 pipeline transfer(s) have no other side at their peer" in warnings[0]
    # every other transfer is still comm with its peer
    assert len(_transfers(store)) == sum(o.endswith(("-send", "-recv")) for o in d["optype"]) - 1
