"""`perfscope simulate` writes real stores: every table, marked simulated, deterministic, checked configs."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from perfscope.cli import main
from perfscope.errors import PerfscopeError
from perfscope.simulate import write_study
from perfscope.simulate.presets import parse_config
from perfscope.store.open import open_store
from perfscope.store.schema import TABLES

SMALL: dict[str, Any] = {
    "seed": 5,
    "partitions": {"tiny": {"base": "gpu2", "gpus_per_node": 2}},
    "experiments": [
        {
            "name": "scale",
            "partitions": ["tiny"],
            "backends": ["horovod-nccl", "horovod-mpi"],
            "world_sizes": [1, 2, 3],
            "batch_sizes": [75],
            "steps": 30,
        },
        {
            "name": "sweep",
            "partitions": ["hpdlf"],
            "world_sizes": [1],
            "batch_sizes": [75, 300],
            "steps": 25,
            "scaling_mode": "",
            "convergence": True,
        },
    ],
}


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sim") / "store"
    write_study(root, parse_config(SMALL))
    return root


def _dump(root: Path) -> dict[str, pa.Table]:
    with open_store(root) as store:
        return {
            name: store.query(f"SELECT * FROM {name} ORDER BY ALL")
            for name in TABLES
            if store.row_count(name)
        }


def test_same_seed_writes_identical_data(small_store: Path, tmp_path: Path) -> None:
    write_study(tmp_path / "again", parse_config(SMALL))
    first, second = _dump(small_store), _dump(tmp_path / "again")
    assert first.keys() == second.keys()
    for name in first:
        assert first[name].equals(second[name]), name


def test_another_seed_writes_other_data(small_store: Path, tmp_path: Path) -> None:
    write_study(tmp_path / "other", parse_config(SMALL, seed=6))
    first, other = _dump(small_store), _dump(tmp_path / "other")
    assert first["steps"].num_rows == other["steps"].num_rows
    assert first["steps"].column("step_ns") != other["steps"].column("step_ns")


def test_every_table_is_written_with_consistent_rows(small_store: Path) -> None:
    with open_store(small_store) as store:
        q = store.query
        runs = q("SELECT * FROM runs ORDER BY run_id").to_pylist()
        assert len(runs) == 2 * 3 + 2
        steps_expected = sum(r["world_size"] * (30 if r["experiment"] == "scale" else 25) for r in runs)
        assert store.row_count("steps") == steps_expected
        comm_expected = sum(r["world_size"] * 30 for r in runs if r["world_size"] > 1)
        assert store.row_count("comm") == comm_expected
        # one allreduce of all gradients per step, same seq everywhere, entries differ by rank
        comm = q(
            "SELECT count(DISTINCT seq) AS seqs, min(bytes) AS lo, max(bytes) AS hi, "
            "count(DISTINCT start_ns) AS starts, count(*) AS n FROM comm"
        ).to_pylist()[0]
        assert comm["seqs"] == 1 and comm["lo"] == comm["hi"] == 153_441 * 4
        assert comm["starts"] > comm["n"] // 2
        # the phases add up to the step on every row
        bad = q(
            "SELECT count(*) AS n FROM steps WHERE data_ns + forward_ns + backward_ns + sync_exposed_ns"
            " + optimizer_ns + other_ns != step_ns OR comm_total_ns < sync_exposed_ns - 0"
        ).to_pylist()[0]["n"]
        assert bad == 0
        # sequential placement: ranks 0-1 on the first host, rank 2 on the second
        ranks = q(
            "SELECT rank, node_rank, local_rank, r.hostname FROM ranks r JOIN runs USING (run_id) "
            "WHERE runs.world_size = 3 AND runs.backend = 'horovod-nccl' ORDER BY rank"
        ).to_pylist()
        assert [(r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0)]
        assert ranks[0]["hostname"] == ranks[1]["hostname"] != ranks[2]["hostname"]
        gpus = q(
            "SELECT run_id, count(DISTINCT (hostname, gpu_index)) AS g, "
            "bool_and(util_gpu_pct BETWEEN 0 AND 100) AS ok, "
            "min(energy_mj) < max(energy_mj) AS counting FROM gpu_samples GROUP BY run_id"
        ).to_pylist()
        assert {g["run_id"]: g["g"] for g in gpus} == {r["run_id"]: r["world_size"] for r in runs}
        assert all(g["ok"] and g["counting"] for g in gpus)
        assert store.row_count("host_samples") > 0
        # the loss curve only where the experiment asked for it
        metrics = q(
            "SELECT DISTINCT r.experiment, m.name FROM metrics m JOIN runs r USING (run_id)"
        ).to_pylist()
        assert metrics == [{"experiment": "sweep", "name": "loss"}]


def test_every_run_is_marked_simulated_with_metadata(small_store: Path) -> None:
    with open_store(small_store) as store:
        runs = store.query("SELECT * FROM runs").to_pylist()
        events = store.query("SELECT run_id, kind FROM events").to_pylist()
    for r in runs:
        assert r["source"] == "simulated"
        assert json.loads(r["tags"])["simulated"] is True
        # origin is NULL for everything but imported traces
        # the parallel layout's sizes are given only for 3D-parallel jobs (profile(parallel=...), op tables)
        layout = ("dp_size", "pp_size", "tp_size", "cp_size")
        # and what the collector reads from a real model and process (settings: issue 34)
        settings = (
            "param_dtypes", "autocast", "compiled", "ddp_bucket_cap_mb", "ddp_gradient_as_bucket_view",
            "ddp_find_unused_parameters", "ddp_static_graph", "env",
        )  # fmt: skip
        empty = [
            k for k, v in r.items() if v is None and k not in ("torch_version", "origin", *layout, *settings)
        ]
        assert empty == [], f"{r['run_id']} leaves {empty} empty"
        assert r["global_batch_size"] == r["batch_size_per_rank"] * r["world_size"]
        assert r["grad_bytes"] == 4 * r["param_count"] == 4 * 153_441
        assert r["dataset_samples"] == 750_000
    assert {e["run_id"] for e in events if e["kind"] == "simulated"} == {r["run_id"] for r in runs}
    assert {r["scaling_mode"] for r in runs if r["experiment"] == "scale"} == {"weak"}


def test_refuses_a_folder_that_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(PerfscopeError, match="not empty and not a perfscope store"):
        write_study(tmp_path, parse_config(SMALL))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_adds_to_a_store_but_never_twice(small_store: Path, tmp_path: Path) -> None:
    root = tmp_path / "s"
    root.mkdir()  # an empty folder is fine
    write_study(root, parse_config(SMALL))
    with pytest.raises(PerfscopeError, match="already holds"):
        write_study(root, parse_config(SMALL))
    write_study(root, parse_config(SMALL, seed=9))
    with open_store(root) as store:
        assert store.query("SELECT count(*) AS n FROM runs").to_pylist()[0]["n"] == 16


def _with(path: str, value: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(SMALL)
    node: Any = cfg
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node.setdefault(k, {})
    node[keys[-1]] = value
    return cfg


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_with("experiments.0.world_sizes", [0, 2]), r"world_sizes: entries must be whole numbers from 1"),
        (_with("experiments.0.world_sizes", "1,2"), r"world_sizes: must be a non-empty list"),
        (_with("experiments.0.steps", 5), r"steps: must be a whole number from 20"),
        (_with("experiments.0.backends", ["gloo"]), r"has no backend 'gloo'"),
        (_with("experiments.0.partitions", ["nope"]), r"unknown partition 'nope'"),
        (_with("experiments.0.scaling_mode", "fast"), r"scaling_mode: must be 'weak', 'strong'"),
        (_with("experiments.0.name", "a b"), r"name: must be 1-64 letters"),
        (_with("experiments.0.colour", 1), r"unknown key\(s\) 'colour'"),
        (_with("partitions.tiny.gpus_per_node", 0), r"gpus_per_node: must be at least 1"),
        (_with("partitions.tiny.gpus_per_node", 2.5), r"gpus_per_node: must be a whole number"),
        (_with("partitions.tiny.step_cv", "high"), r"step_cv: must be a number"),
        (_with("partitions.tiny.base", "summit"), r"unknown preset partition 'summit'"),
        (
            _with("partitions.tiny.backends", {"horovod-nccl": {"inter_gb_per_s": 0}}),
            r"inter_gb_per_s: must be > 0",
        ),
        (_with("partitions.tiny.hostname_pattern", "n{rack}"), r"hostname_pattern: must be a format string"),
        (_with("partitions.fresh", {"gpus_per_node": 2}), r"partitions.fresh: missing .*give \"base\""),
        (_with("convergence.initial_loss", 0.001), r"initial_loss must be larger than final_loss"),
        (_with("start", "yesterday"), r"start: is not an ISO date-time"),
        (_with("seed", -1), r"seed: must be a whole number >= 0"),
        (_with("experiments", []), r"experiments: must be a non-empty list"),
        ([1, 2], r"top level: must be a JSON object"),
    ],
)
def test_bad_configs_say_what_is_wrong(config: Any, message: str) -> None:
    with pytest.raises(PerfscopeError, match=message) as err:
        parse_config(config)
    assert err.value.message.startswith("simulation config: ")


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["simulate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world-sizes", "1,two"], "--world-sizes: expected whole numbers"),
        (["--world-sizes", "0,2"], "--world-sizes: every value must be at least 1"),
        (["--partition", "summit", "--world-sizes", "1,2"], "--partition: unknown partition 'summit'"),
        (["--param", "warp=9"], "--param warp: unknown parameter"),
        (["--param", "nonsense"], "write it as KEY=VALUE"),
        (["--param", "horovod-nccl.speed=1"], "'speed' is not a backend parameter"),
        (["--param", "gloo.coord_us=1"], "names backend gloo"),
        (["--param", "gpus_per_node=-2"], "gpus_per_node: must be a finite number >= 0"),
        (["--steps", "3", "--world-sizes", "1"], "--steps must be from 20"),
        (["--config", "x.json", "--world-sizes", "1"], "give either --config, or --preset"),
        (["--fit-cluster", "alpha"], "only apply with --fit-from"),
        (["--fit-from", "elsewhere"], "--fit-from needs --world-sizes"),
        (
            ["--fit-from", "elsewhere", "--world-sizes", "8", "--partition", "alpha"],
            "--partition does not go with",
        ),
        (["--config", "missing.json"], "cannot read the config missing.json"),
    ],
)
def test_bad_flags_say_what_is_wrong(
    args: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = _cli(capsys, str(tmp_path / "out"), *args)
    assert code == 2
    assert message in err
    assert not (tmp_path / "out").exists()


def test_config_file_that_is_not_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{'experiments': }")
    code, _, err = _cli(capsys, str(tmp_path / "out"), "--config", str(bad))
    assert code == 2 and "is not valid JSON (line 1" in err


def test_cli_sweep_and_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(
        capsys,
        str(tmp_path / "sweep"),
        "--partition",
        "alpha",
        "--backend",
        "horovod-nccl,horovod-mpi",
        "--world-sizes",
        "1,2,4",
        "--gpus-per-node",
        "2",
        "--steps",
        "25",
        "--param",
        "backend.coord_us=10",
        "--experiment",
        "what-if",
    )
    assert code == 0 and "wrote 6 simulated runs" in out
    with open_store(tmp_path / "sweep") as store:
        runs = store.query(
            "SELECT experiment, nodes, gpus_per_node, tags FROM runs WHERE world_size = 4"
        ).to_pylist()
    assert {(r["experiment"], r["nodes"], r["gpus_per_node"]) for r in runs} == {("what-if", 2, 2)}
    assert {json.loads(r["tags"])["backend_model"]["coord_us"] for r in runs} == {10.0}

    cfg = tmp_path / "study.json"
    cfg.write_text(json.dumps(SMALL))
    code, out, _ = _cli(capsys, str(tmp_path / "cfg"), "--config", str(cfg), "--seed", "11")
    assert code == 0 and "wrote 8 simulated runs (seed 11)" in out


def _fit_config() -> dict[str, Any]:
    """A study designed to be fitted: five world sizes inside a node, four across, and a batch sweep.
    With one message size, coordination and the ring terms need that many points to separate."""
    part = {
        "base": "alpha",
        "fill_samples": 80.0,
        "step_cv": 0.02,
        "comm_cv": 0.01,
        "backends": {
            "horovod-nccl": {
                "coord_us": 120.0,
                "intra_alpha_us": 12.0,
                "intra_gb_per_s": 6.0,
                "inter_alpha_us": 40.0,
                "inter_gb_per_s": 2.5,
            }
        },
    }
    return {
        "seed": 3,
        "partitions": {"fitme": part},
        "experiments": [
            {
                "name": "scale",
                "partitions": ["fitme"],
                "world_sizes": [1, 2, 3, 4, 6, 8, 12, 16, 24, 32],
                "steps": 120,
            },
            {
                "name": "batches",
                "partitions": ["fitme"],
                "world_sizes": [1],
                "batch_sizes": [32, 64, 128, 256, 512, 1024],
                "steps": 120,
                "scaling_mode": "",
            },
        ],
    }


def test_fit_recovers_the_parameters_of_a_simulated_store(tmp_path: Path) -> None:
    from perfscope.simulate.fit import fit_model

    cfg = parse_config(_fit_config())
    write_study(tmp_path / "s", cfg)
    truth = cfg.experiments[0].partitions[0]
    backend = truth.backends["horovod-nccl"]
    with open_store(tmp_path / "s") as store:
        (fit,) = fit_model(store)
    got, gb = fit.partition, fit.backend
    assert fit.experiment == "scale" and fit.batch_sizes == (75,)
    assert got.gpus_per_node == 8 and gb.name == "horovod-nccl" and gb.ring_in_gpu_kernel
    rel = pytest.approx
    assert got.step_overhead_us == rel(truth.step_overhead_us, rel=0.05)
    assert got.cpu_share_penalty == rel(truth.cpu_share_penalty, rel=0.2)
    assert got.kernel_us_per_sample == rel(truth.kernel_us_per_sample, rel=0.05)
    assert got.data_us_per_sample == rel(truth.data_us_per_sample, rel=0.1)
    assert got.optimizer_us == rel(truth.optimizer_us, rel=0.05)
    assert got.step_cv == rel(truth.step_cv, rel=0.25)
    assert gb.coord_us == rel(backend.coord_us, rel=0.1)
    assert gb.intra_alpha_us == rel(backend.intra_alpha_us, rel=0.15)
    assert gb.intra_gb_per_s == rel(backend.intra_gb_per_s, rel=0.15)
    assert gb.inter_alpha_us == rel(backend.inter_alpha_us, rel=0.1)
    assert gb.inter_gb_per_s == rel(backend.inter_gb_per_s, rel=0.1)
    assert fit.smape < 0.03 and fit.trusted and fit.notes == ()


def test_fit_from_cli_predicts_other_world_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "measured"
    write_study(src, parse_config(_fit_config()))
    code, out, err = _cli(
        capsys, str(tmp_path / "pred"), "--fit-from", str(src), "--world-sizes", "32,64", "--steps", "30"
    )
    assert code == 0, err
    assert "wrote 2 predicted runs" in out and "scale-predicted" in out
    with open_store(tmp_path / "pred") as store:
        runs = store.query("SELECT * FROM runs ORDER BY world_size").to_pylist()
        steps = store.query("SELECT run_id, count(DISTINCT rank) AS r FROM steps GROUP BY ALL").to_pylist()
    assert [(r["world_size"], r["nodes"], r["source"]) for r in runs] == [
        (32, 4, "simulated"),
        (64, 8, "simulated"),
    ]
    tags = json.loads(runs[0]["tags"])
    assert tags["simulated"] is True and tags["fitted_from"]["store"] == str(src.resolve())
    assert len(tags["fitted_from"]["runs"]) == 16
    assert {s["r"] for s in steps} == {32, 64}
    # predictions are never fitted again
    code, _, err = _cli(
        capsys, str(tmp_path / "again"), "--fit-from", str(tmp_path / "pred"), "--world-sizes", "8"
    )
    assert code == 2 and "no runs with steps match" in err


def _json_blocks(text: str) -> list[str]:
    return re.findall(r"```json\n(.*?)```", text, flags=re.S)


def test_documented_config_examples_are_valid() -> None:
    import perfscope.simulate.presets as presets

    readme = (Path(__file__).resolve().parents[2] / "sample_traces" / "README.md").read_text()
    (from_readme,) = _json_blocks(readme)
    doc = presets.__doc__ or ""
    from_doc = doc[doc.index("{") : doc.index("A partition either")]
    for text in (from_readme, from_doc):
        cfg = parse_config(json.loads(text))
        (exp,) = cfg.experiments
        assert exp.name == "what-if" and exp.partitions[0].gpus_per_node == 4
        assert exp.partitions[0].backends["horovod-nccl"].inter_gb_per_s == 12.0


def test_fit_refuses_a_batch_it_cannot_predict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundled = Path(__file__).resolve().parents[2] / "sample_traces" / "seed-study"
    args = [
        "--fit-from",
        str(bundled),
        "--fit-cluster",
        "gpu2",
        "--world-sizes",
        "16",
        "--batch-sizes",
        "300",
    ]
    code, _, err = _cli(capsys, str(tmp_path / "out"), *args)
    assert code == 2
    assert "was measured at batch 75 only" in err and "batch 300 cannot be predicted" in err
    assert not (tmp_path / "out").exists()


def test_a_run_id_too_long_for_a_folder_is_refused_before_any_run(tmp_path: Path) -> None:
    """Three 64-character names make a 220-byte run id: refused in one line before anything is written
    (issue 33: a long run id was accepted, then every write failed)."""
    e, p, b = "e" * 64, "p" * 64, "b" * 64
    cfg = {
        "seed": 5,
        "partitions": {p: {"base": "gpu2", "backends": {b: {"base": "horovod-nccl"}}}},
        "experiments": [{"name": e, "partitions": [p], "backends": [b], "world_sizes": [1], "steps": 20}],
    }
    root = tmp_path / "s"
    with pytest.raises(PerfscopeError, match=r"bytes long .* shorten the experiment, partition or backend"):
        write_study(root, parse_config(cfg))
    assert not list(root.glob("*/run_id=*"))
