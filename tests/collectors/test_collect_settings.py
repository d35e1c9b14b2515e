"""The job's settings in `runs` (collectors/settings.py): DDP's knobs, parameter dtypes, autocast,
torch.compile and the NCCL/OpenMP variables, read from a real DDP job on gloo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perfscope import open_store
from perfscope.collectors.settings import ENV_MAX_CHARS, ENV_MAX_VARS, env_settings, model_settings

torch = pytest.importorskip("torch")
from collect_helpers import ddp_worker, make_model, results_ok, run_ranks  # noqa: E402


def test_ddp_settings_dtypes_autocast_and_env_are_recorded(tmp_path: Path) -> None:
    options = {
        "steps": 3,
        "watch": False,  # the profiler's DDP finder finds the model
        "autocast": True,
        "ddp": {"bucket_cap_mb": 0.5, "find_unused_parameters": True, "gradient_as_bucket_view": True},
        "env": {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "lo", "MKL_NUM_THREADS": None},
    }
    results_ok(run_ranks(ddp_worker, 2, str(tmp_path), options))
    with open_store(tmp_path) as store:
        (run,) = store.query("SELECT * FROM runs").to_pylist()
    assert run["ddp_bucket_cap_mb"] == pytest.approx(0.5)
    assert (
        run["ddp_find_unused_parameters"],
        run["ddp_gradient_as_bucket_view"],
        run["ddp_static_graph"],
    ) == (
        True,
        True,
        False,
    )
    assert run["param_dtypes"] == "float32" and run["compiled"] is False
    assert run["autocast"] == "cpu:bfloat16"
    # collect_helpers sets OMP_NUM_THREADS=1 on every rank; the job unset MKL_NUM_THREADS; a machine's
    # own NCCL_* variables may be there too
    env = json.loads(run["env"])
    assert {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}.items() <= env.items()
    assert "MKL_NUM_THREADS" not in env and all(k.startswith("NCCL_") or k == "OMP_NUM_THREADS" for k in env)


def test_without_autocast_or_ddp_settings_read_as_such(tmp_path: Path) -> None:
    results_ok(run_ranks(ddp_worker, 2, str(tmp_path), {"steps": 2, "manual_sync": True}))
    with open_store(tmp_path) as store:
        (run,) = store.query("SELECT * FROM runs").to_pylist()
    assert run["autocast"] == "" and run["param_dtypes"] == "float32"
    assert run["ddp_bucket_cap_mb"] is None and run["ddp_find_unused_parameters"] is None


def test_compiled_models_and_mixed_dtypes() -> None:
    model = make_model()
    model[4].to(torch.bfloat16)  # the last layer in bf16: fewer parameters than the fp32 rest
    plain = model_settings(model)
    assert plain["param_dtypes"] == "float32,bfloat16" and plain["compiled"] is False
    compiled = model_settings(torch.compile(model, backend="eager"))  # lazy: nothing is traced here
    assert compiled["compiled"] is True and compiled["param_dtypes"] == "float32,bfloat16"
    assert compiled["ddp_bucket_cap_mb"] is None


def test_env_settings_are_bounded() -> None:
    env = {f"NCCL_X{i:03d}": "v" * 500 for i in range(100)} | {"PATH": "/bin", "OMP_NUM_THREADS": "4"}
    got = json.loads(env_settings(env) or "")
    assert len(got) == ENV_MAX_VARS and "PATH" not in got
    assert all(len(v) <= ENV_MAX_CHARS for v in got.values())
    assert env_settings({"PATH": "/bin"}) is None
