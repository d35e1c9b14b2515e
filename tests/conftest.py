"""Shared pytest fixtures."""

from __future__ import annotations

import os

import pytest
from durations import QUICK_S, key, load
from rooms import on_path

on_path()  # a room's tests may import another room's fixtures (tests/rooms.py)

# Never let a test talk to the outside world by accident, and keep BLAS single-threaded:
# this suite runs multi-process jobs on 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("STREAMLIT_BROWSER_GATHER_USAGE_STATS", "false")


#: Modules whose tests launch real training jobs (multi-process gloo, torchrun, Lightning, transformers),
#: signals and kills, namespaced nodes, Spark or a browser: marked `slow`, as is every test measured at
#: QUICK_S or more (tests/durations.py), so `make test-quick` (`pytest -m "not slow"`) leaves them out
#: while `make test` and CI run everything.
SLOW_MODULES = frozenset(
    {
        "test_clock_alignment",
        "test_collect_accelerate",
        "test_collect_compiled_ddp",
        "test_collect_ddp",
        "test_collect_demo",
        "test_collect_dist_recorder",
        "test_collect_gpu",
        "test_collect_layout",
        "test_collect_profile",
        "test_collect_samples",
        "test_collect_tensor_parallel",
        "test_comm_patterns",
        "test_dashboard_browser",
        "test_explain_measured",
        "test_explain_one_run",
        "test_files_per_host",
        "test_hot_path",
        "test_import_atomic",
        "test_import_kineto_parallel",
        "test_integrations_lightning",
        "test_integrations_transformers",
        "test_memory_limit",
        "test_numbers_ddp",
        "test_numbers_wall_clock",
        "test_nvml_once_per_host",
        "test_recording_resilience",
        "test_recording_ux",
        "test_rendezvous_timeout",
        "test_report_browser",
        "test_run_command",
        "test_s3_hostile",
        "test_s3_store",
        "test_spark",
        "test_store_kill",
        "test_sync_groups",
        "test_threads_confound",
        "test_threads_shown",
        "test_trackers",
        "test_two_nodes",
        "test_what_if_pipeline",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    times = load()
    for item in items:
        module = item.module.__name__ if item.module is not None else ""
        if module in SLOW_MODULES or times.get(key(module, item.name), 0.0) >= QUICK_S:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _main_module_restored() -> object:
    """Streamlit's AppTest runs a page as `__main__` and leaves it there: every later test then has an
    unguarded temporary script as its main module, which worker processes (forkserver, spawn) import
    again, and perfscope's Kineto import reads its files in turn for such a caller. Each test starts
    with pytest's own main module."""
    import sys

    main = sys.modules.get("__main__")
    yield
    if main is not None and sys.modules.get("__main__") is not main:
        sys.modules["__main__"] = main
