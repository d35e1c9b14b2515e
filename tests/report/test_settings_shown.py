"""The job's settings (run_settings) where a user looks: the report's Settings section and the
dashboard Run page's Settings table, both in the same words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from storegen import Host, make_run
from test_dashboard_app import clean, column, open_page

from perfscope.analysis import Selection
from perfscope.report import collect
from perfscope.report.model import TableBlock
from perfscope.store.open import open_store

SETTINGS = {
    "param_dtypes": "bfloat16,float32",
    "autocast": "cuda:bfloat16",
    "compiled": True,
    "ddp_bucket_cap_mb": 25.0,
    "ddp_gradient_as_bucket_view": False,
    "ddp_find_unused_parameters": True,
    "ddp_static_graph": False,
    "env": json.dumps({"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4"}),
}
DDP_WORDS = "bucket_cap_mb=25, gradient_as_bucket_view=False, find_unused_parameters=True, static_graph=False"


@pytest.fixture(scope="module")
def settings_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("settings") / "store"
    make_run(root, "set-n2", world_size=2, cpu_count=16, torch_threads=4, runs_extra=SETTINGS)
    make_run(root, "old-n1", world_size=1)  # recorded nothing of its settings but the host's CPUs
    return root


def test_the_report_has_a_settings_section(settings_store: Path) -> None:
    with open_store(settings_store) as store:
        report = collect(store, Selection()).report
    (section,) = [s for s in report.sections if s.id == "settings"]
    (table,) = [b for b in section.blocks if isinstance(b, TableBlock)]
    by_run = {r["run_id"]: r for r in table.rows}
    row = by_run["set-n2"]
    assert row["DDP"] == DDP_WORDS and row["autocast"] == "cuda:bfloat16" and row["torch.compile"] == "yes"
    assert row["parameter dtypes"] == "bfloat16,float32" and row["host CPUs"] == "16"
    assert row["environment"] == "NCCL_DEBUG=INFO, OMP_NUM_THREADS=4" and row["threads per rank"] == "torch 4"
    assert "DDP" not in by_run["old-n1"] and by_run["old-n1"]["host CPUs"] == "64"


def test_the_run_page_shows_the_settings(settings_store: Path) -> None:
    at = clean(open_page(settings_store, "run", run="set-n2"))
    tables = [df.value for df in at.dataframe if list(df.value.columns) == ["setting", "value"]]
    assert tables, "no Settings table on the Run page"
    shown = dict(zip(tables[0]["setting"], tables[0]["value"], strict=True))
    assert shown["DDP"] == DDP_WORDS and shown["autocast"] == "cuda:bfloat16"


def test_the_telemetry_tab_shows_memory_per_rank(tmp_path: Path) -> None:
    root = tmp_path / "store"
    # rank 1's RSS grows by 4 MiB per step
    make_run(root, "mem-n2", world_size=2, host=Host(), rss_fn=lambda r, s: 2**31 + (4 << 20) * s * r)
    at = clean(open_page(root, "run", run="mem-n2", run_tab="Telemetry"))
    trend = dict(zip(column(at, "rank", "trend (MiB/step)"), column(at, "trend (MiB/step)"), strict=True))
    assert trend[1] == pytest.approx(4.0) and trend[0] == pytest.approx(0.0)
