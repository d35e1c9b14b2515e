"""nccl-tests output -> the store's reference_bw table: the printed format (current and older column
headers), several tables in one file, and every kind of bad input refused with one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from storegen import Comm, make_run

from perfscope.analysis import Selection, run_analysis
from perfscope.charts import CHARTS
from perfscope.cli import main
from perfscope.errors import PerfscopeError
from perfscope.explain import explain
from perfscope.importers.nccl_tests import parse
from perfscope.store.open import open_store

# all_reduce_perf -b 8 -e 128M -f 8 -g 1 on 2 nodes x 4 GPUs, as nccl-tests 2.13 prints it
# (busbw = algbw * 2(n-1)/n = algbw * 1.75 for n = 8).
ALL_REDUCE = """\
# nThread 1 nGpus 1 minBytes 8 maxBytes 134217728 step: 8(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid  41001 on    node-a device  0 [0x07] NVIDIA A100-SXM4-80GB
#  Rank  1 Group  0 Pid  41002 on    node-a device  1 [0x0b] NVIDIA A100-SXM4-80GB
#  Rank  2 Group  0 Pid  41003 on    node-a device  2 [0x48] NVIDIA A100-SXM4-80GB
#  Rank  3 Group  0 Pid  41004 on    node-a device  3 [0x4c] NVIDIA A100-SXM4-80GB
#  Rank  4 Group  0 Pid  52001 on    node-b device  0 [0x07] NVIDIA A100-SXM4-80GB
#  Rank  5 Group  0 Pid  52002 on    node-b device  1 [0x0b] NVIDIA A100-SXM4-80GB
#  Rank  6 Group  0 Pid  52003 on    node-b device  2 [0x48] NVIDIA A100-SXM4-80GB
#  Rank  7 Group  0 Pid  52004 on    node-b device  3 [0x4c] NVIDIA A100-SXM4-80GB
NCCL version 2.18.5+cuda12.2
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
node-a:41001:41001 [0] NCCL INFO Launch mode Parallel
           8             2     float     sum      -1    31.20    0.00    0.00      0    30.85    0.00    0.00      0
         512           128     float     sum      -1    32.40    0.02    0.03      0    32.10    0.02    0.03      0
       32768          8192     float     sum      -1    45.10    0.73    1.27      0    44.80    0.73    1.28      0
     2097152        524288     float     sum      -1   160.00   13.11   22.94      0   158.00   13.27   23.23      0
   134217728      33554432     float     sum      -1  4200.00   31.96   55.92      0  4150.00   32.34   56.59      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 16.2283
#
"""  # noqa: E501 (the benchmark's own line width)

# Two tests in one log, the first in the 2019 format (no root column, 'error' instead of '#wrong').
OLD_AND_GATHER = """\
# nThread 1 nGpus 2 minBytes 1048576 maxBytes 4194304 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
#   Rank  0 Pid   1234 on  gpu01 device  0 [0x00] Tesla V100-SXM2-16GB
#   Rank  1 Pid   1234 on  gpu01 device  1 [0x00] Tesla V100-SXM2-16GB
#                                                     out-of-place                       in-place
#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
     1048576        262144   float     sum    60.00   17.48   17.48  0e+00    61.00   17.19   17.19  0e+00
     4194304       1048576   float     sum   200.00   20.97   20.97  0e+00   199.00   21.08   21.08  0e+00
# Avg bus bandwidth    : 19.18
# Collective test starting: all_gather_perf
# nThread 1 nGpus 2 minBytes 1048576 maxBytes 1048576 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
#   Rank  0 Pid   1234 on  gpu01 device  0 [0x00] Tesla V100-SXM2-16GB
#   Rank  1 Pid   1234 on  gpu01 device  1 [0x00] Tesla V100-SXM2-16GB
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
     1048576        131072     float    none      -1    50.00   20.97   10.49      0    49.00   21.40   10.70      0
# Avg bus bandwidth    : 10.59
"""  # noqa: E501


def _write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


def test_parse_current_format(tmp_path):
    (t,) = parse(_write(tmp_path, "all_reduce_perf.log", ALL_REDUCE))
    assert t.op == "all_reduce" and not t.op_guessed
    assert (t.rank_count, t.nodes) == (8, 2)
    assert [r.size_bytes for r in t.rows] == [8, 512, 32768, 2097152, 134217728]
    big = t.rows[-1]
    assert big.dtype == "float" and big.redop == "sum" and big.root == -1
    assert big.oop_time_us == pytest.approx(4200.0) and big.ip_busbw_gb_per_s == pytest.approx(56.59)
    # busbw = algbw * 2(n-1)/n, as the benchmark defines it
    assert big.oop_busbw_gb_per_s == pytest.approx(big.oop_algbw_gb_per_s * 1.75, rel=0.01)
    assert t.avg_busbw_gb_per_s == pytest.approx(16.2283)


def test_parse_old_format_and_two_tables(tmp_path):
    old, gather = parse(_write(tmp_path, "cluster-log.txt", OLD_AND_GATHER))
    # the old table's collective is told from its columns: count x 4 bytes = size, sum, no root
    assert old.op == "all_reduce" and old.op_guessed
    assert old.rank_count == 2 and old.nodes == 1 and old.rows[0].root is None
    assert old.rows[1].ip_busbw_gb_per_s == pytest.approx(21.08)
    assert gather.op == "all_gather" and not gather.op_guessed
    assert [r.size_bytes for r in gather.rows] == [1048576]


def test_import_writes_reference_rows(tmp_path, capsys):
    log = _write(tmp_path, "all_reduce_perf.log", ALL_REDUCE)
    store = tmp_path / "store"
    assert main(["import", "nccl-tests", str(log), "--store", str(store)]) == 0
    assert "nccl-tests" in capsys.readouterr().out
    with open_store(store) as st:
        rows = st.query(
            "SELECT cluster, op, ranks, nodes, bytes, oop_time_ns, ip_busbw_gb_per_s, hostnames, "
            "device_model FROM reference_bw ORDER BY bytes"
        ).to_pylist()
        runs = st.query("SELECT count(*) AS n FROM runs").to_pylist()[0]["n"]
    assert len(rows) == 5 and runs == 0  # a reference, not a run
    top = rows[-1]
    assert top["op"] == "allreduce" and top["ranks"] == 8 and top["nodes"] == 2
    assert top["bytes"] == 134217728 and top["oop_time_ns"] == 4_200_000
    assert top["ip_busbw_gb_per_s"] == pytest.approx(56.59)
    assert top["hostnames"] == "node-a,node-b" and top["device_model"] == "NVIDIA A100-SXM4-80GB"
    # the same file again is refused rather than doubled
    assert main(["import", "nccl-tests", str(log), "--store", str(store)]) == 2
    assert "imported before" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("empty.txt", b"", "no nccl-tests header"),
        ("garbage.txt", b"hello world\nthis is not a benchmark\n", "no nccl-tests header"),
        ("binary.bin", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary data"),
        ("huge.txt", b"#" + b"x" * (100 << 10) + b"\n", "longer than"),
        ("kineto.json", b'{"traceEvents": [{"ph": "X", "name": "aten::mm"}]}', "no nccl-tests header"),
        ("cut.txt", ALL_REDUCE.split("           8 ")[0].encode(), "no result lines"),
        ("big.txt", ALL_REDUCE.split("           8 ")[0].encode() + b" 99999999999999999999999 2 float sum "
         b"-1 1 0 0 0 1 0 0 0\n", "no result lines"),
        ("x.txt", "\n".join(ALL_REDUCE.splitlines()[12:]).replace("sum      -1", "sum      -1 1 2").encode(),
         "no result lines"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(tmp_path, capsys, name, content, says):
    path = _write(tmp_path, name, content)
    with pytest.raises(PerfscopeError, match=says):
        parse(path)
    assert main(["import", "nccl-tests", str(path), "--store", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err
    assert not (tmp_path / "s" / "reference_bw").exists() or not any(
        (tmp_path / "s" / "reference_bw").iterdir()
    )


def test_non_finite_numbers_are_not_measurements(tmp_path, capsys):
    text = ALL_REDUCE.replace("4200.00   31.96   55.92", "    inf     nan   1e400")
    store = tmp_path / "s"
    assert (
        main(
            [
                "import",
                "nccl-tests",
                str(_write(tmp_path, "all_reduce_perf.log", text)),
                "--store",
                str(store),
            ]
        )
        == 0
    )
    with open_store(store) as st:
        top = st.query("SELECT * FROM reference_bw WHERE bytes = 134217728").to_pylist()[0]
    assert top["oop_time_ns"] is None and top["oop_busbw_gb_per_s"] is None
    assert top["ip_busbw_gb_per_s"] == pytest.approx(56.59)


def test_unknown_collective_is_refused(tmp_path):
    # no benchmark name anywhere and a count that fits no collective
    text = ALL_REDUCE.replace("       8             2     float", "       8             7     float")
    dropped = ("  512 ", "32768", "2097152", "134217728 ")
    lines = [ln for ln in text.splitlines() if not any(d in ln for d in dropped)]
    with pytest.raises(PerfscopeError, match="cannot tell which collective"):
        parse(_write(tmp_path, "bench.log", "\n".join(lines)))


# -- the reference in the analyses: the network rule and the bus-bandwidth chart ---------------------


def _nccl_study(root: Path) -> None:
    """Two NCCL runs on GPUs whose 4 MiB allreduces move 1 GB/s (algbw): busbw 1.0 and 1.5 GB/s."""
    for n in (2, 4):
        make_run(root, f"n{n}", world_size=n, comm=Comm([2**22], lambda nb: nb / 1e9 * 1e9))


def _findings(store: Path) -> list:
    with open_store(store) as st:
        flat = [g for f in explain(st) for g in f.flatten()]  # also those collapsed across places
        return [f for f in flat if f.id.startswith("network-under-delivering:")]


def test_rule_compares_with_the_reference_instead_of_the_floor(tmp_path):
    store = tmp_path / "s"
    _nccl_study(store)
    # without a reference: 1-1.5 GB/s for NCCL on GPUs trips the fixed 3 GB/s floor
    assert [f.id for f in _findings(store)] == ["network-under-delivering:c1/nccl/intra-node"]
    log = _write(tmp_path, "all_reduce_perf.log", ALL_REDUCE)
    assert main(["import", "nccl-tests", str(log), "--store", str(store)]) == 0
    with open_store(store) as st:
        ref = {r["run_id"]: r for r in run_analysis("reference_busbw", st, Selection()).to_pylist()}
    # 4 MiB lies between the benchmark's 2 MiB (23.23 GB/s) and 128 MiB (56.59 GB/s), log2-linear
    expected = 23.23 + (22 - 21) / (27 - 21) * (56.59 - 23.23)
    assert ref["n4"]["ref_busbw_gb_per_s"] == pytest.approx(expected, rel=1e-6)
    assert ref["n4"]["busbw_gb_per_s"] == pytest.approx(1.5, rel=1e-3)
    assert ref["n4"]["delivered_share"] == pytest.approx(1.5 / expected, rel=1e-3)
    assert ref["n4"]["ref_ranks"] == 8
    found = _findings(store)
    assert sorted(f.id for f in found) == [
        "network-under-delivering:n2/reference",
        "network-under-delivering:n4/reference",
    ]  # and the fixed floor no longer speaks for these runs
    n4 = next(f for f in found if "n4" in f.id)
    assert "nccl-tests measured" in n4.text and "all_reduce_perf.log" in n4.text
    assert n4.numbers["ref_busbw_gb_per_s"] == pytest.approx(expected, rel=1e-6)


def test_rule_is_silent_when_the_job_matches_its_reference(tmp_path):
    store = tmp_path / "s"
    _nccl_study(store)
    # a slow cluster: the benchmark itself reached only 1.6 GB/s, so 1-1.5 GB/s is no anomaly
    slow = ALL_REDUCE.replace("13.27   23.23", "0.91    1.60").replace("32.34   56.59", "0.94    1.65")
    assert main(["import", "nccl-tests", str(_write(tmp_path, "all_reduce_perf.log", slow)), "--store",
                 str(store)]) == 0  # fmt: skip
    assert _findings(store) == []


def test_busbw_chart_draws_the_reference(tmp_path):
    store = tmp_path / "s"
    _nccl_study(store)
    assert main(["import", "nccl-tests", str(_write(tmp_path, "all_reduce_perf.log", ALL_REDUCE)),
                 "--store", str(store)]) == 0  # fmt: skip
    spec = CHARTS["busbw"]
    with open_store(store) as st:
        tables = {a: run_analysis(a, st, Selection()) for a in spec.analyses}
    with_ref = spec.build(tables).to_dict(validate=False)
    without = spec.build({**tables, "reference_busbw": None}).to_dict(validate=False)
    assert len(with_ref["layer"]) == len(without["layer"]) + 2
    assert "nccl-tests busbw" in json.dumps(with_ref) and "nccl-tests busbw" not in json.dumps(without)
    assert re.search(r'"ref_busbw_gb_per_s": 28\.79', json.dumps(with_ref))
