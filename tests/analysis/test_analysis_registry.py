"""Every registered analysis on one shared store: it runs, names its definition, matches its doc,
and degrades to an empty table (never an exception) when the store lacks its data."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from storegen import DEFAULT_PHASES, MS, Comm, Gpu, Host, make_run, row

from perfscope.analysis import ANALYSES, DEFINITIONS, META_ANALYSIS, META_DEFINITION, Selection, run_analysis
from perfscope.analysis.groups import GROUP_COLUMNS
from perfscope.store.open import open_store
from perfscope.store.writer import StoreWriter

DOC = Path(__file__).resolve().parents[2] / "docs" / "analysis.md"


@pytest.fixture(scope="module")
def rich_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("rich")
    for n in (1, 2, 4, 8):
        make_run(
            root,
            f"n{n}",
            world_size=n,
            gpus_per_node=4,
            grad_bytes=2**22,
            flops_per_step=1e12,
            device_peak_flops=1e15,
            dataset_samples=10_000,
            gpu=Gpu(),
            host=Host(),
            phases={**DEFAULT_PHASES, "sync_exposed": MS * n},
            comm=Comm([2**21, 2**21], lambda nb, n=n: 1e9 * (2 * (n - 1) * 5e-6 + nb / 5e9)),
            metrics={"loss": lambda s: 1.0 / (s + 1)},
            cuda_peak_fn=lambda r, s: 2**34,
        )
    make_run(root, "b64", world_size=1, batch_size_per_rank=64, metrics={"loss": lambda s: 1.0 / (s + 2)})
    make_run(root, "mpi2", world_size=2, backend="mpi")
    ref = StoreWriter(root, "nccl-tests-ref", writer_id="gen-ref")  # the cluster's nccl-tests reference
    for size in (2**20, 2**22, 2**24):
        values = {"cluster": "", "op": "allreduce", "ranks": 8, "nodes": 2, "bytes": size}
        ref.append("reference_bw", row("reference_bw", **values, ip_busbw_gb_per_s=4.0, source_file="ar.txt"))
    ref.close()
    return root


@pytest.fixture(scope="module")
def bare_store(tmp_path_factory):
    """Only runs and steps: no comm, no GPU, no host samples, no metrics."""
    root = tmp_path_factory.mktemp("bare")
    make_run(root, "a", world_size=1, device=False, device_model="cpu")
    make_run(root, "b", world_size=2, device=False, device_model="cpu")
    return root


def _documented_columns() -> dict[str, list[str]]:
    out = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| `(\w+)` \| [^|]+ \| [^|]+ \| (.+) \|$", line)
        if not m or m.group(1) not in ANALYSES:
            continue
        text = re.sub(r"\([^)]*\)", "", m.group(2))
        cols: list[str] = []
        for part in text.split(","):
            name = part.strip()
            if name == "group columns":
                cols += GROUP_COLUMNS
            elif re.fullmatch(r"\w+", name):
                cols.append(name)
        out[m.group(1)] = cols
    return out


def test_every_analysis_is_documented():
    documented = _documented_columns()
    assert set(documented) == set(ANALYSES)


@pytest.fixture(scope="module")
def rich(rich_store):
    with open_store(rich_store) as store:
        yield store


@pytest.mark.parametrize("name", sorted(ANALYSES))
def test_analysis_runs_names_its_definition_and_matches_its_doc(rich, name):
    table = run_analysis(name, rich)
    meta = table.schema.metadata
    assert meta[META_ANALYSIS] == name.encode()
    assert meta[META_DEFINITION].decode() == " ".join(DEFINITIONS[k] for k in ANALYSES[name].definition)
    # a clean store has nothing to report; the patterns are checked on real jobs (test_comm_patterns.py),
    # what_if on runs with a parallel layout (test_what_if.py)
    # (what_if_unreplayed: only runs the replay cannot read, test_what_if_bounded.py)
    if name not in (
        "quality",
        "pipeline_stages",
        "parameter_server",
        "periodic_sync",
        "what_if",
        "what_if_unreplayed",
    ):
        assert table.num_rows > 0, f"{name} returned nothing on a store that has its data"
    missing = [c for c in _documented_columns()[name] if c not in table.column_names]
    assert not missing, f"{name} lacks documented columns {missing}"
    if "run_id" in table.column_names and name not in {
        "gpu_timeline",
        "host_timeline",
        "collective_wait",
        "step_series",
    }:
        assert "source" in table.column_names, f"{name} lists runs without saying measured/simulated"


@pytest.mark.parametrize("name", sorted(ANALYSES))
def test_analysis_without_its_data_returns_a_table(bare_store, name):
    with open_store(bare_store) as store:
        table = run_analysis(name, store)
        empty = run_analysis(name, store, Selection(experiments=("no-such-experiment",)))
    assert table.num_columns > 0
    assert empty.num_rows == 0 or name == "quality"


def test_results_are_cached_and_refreshed_with_the_store(tmp_path):
    make_run(tmp_path, "a", world_size=1)
    with open_store(tmp_path) as store:
        first = run_analysis("run_summary", store)
        assert run_analysis("run_summary", store) is first
        make_run(tmp_path, "b", world_size=2)
        store.refresh()
        assert run_analysis("run_summary", store).num_rows == 2
