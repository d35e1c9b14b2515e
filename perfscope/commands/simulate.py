"""Write simulated runs into a store: the bundled seed study (default), a study described in JSON, a
sweep given by flags, or predictions of a cost model fitted to another store's runs (--fit-from).
Every run written is marked simulated. The JSON format is documented in perfscope.simulate.presets
and sample_traces/README.md."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import PerfscopeError
from ..output import store_target
from ..simulate import RunSpec, run_id_for, write_runs, write_study
from ..simulate.fit import UNRESOLVED_GB_PER_S, FittedModel, fit_model
from ..simulate.model import Backend, Partition
from ..simulate.presets import (
    DEFAULT_SEED,
    DEFAULT_STEPS,
    LATEST_START,
    LATEST_START_NS,
    MAX_STEPS,
    MIN_STEPS,
    PARTITIONS,
    PRESETS,
    field_names,
    load_config_file,
    parse_config,
    with_overrides,
)
from ..store.open import open_store
from ..terminal import format_rows, terminal_width
from ..words import counted, plural

_SWEEP_FLAGS = (
    "partition",
    "backend",
    "world_sizes",
    "batch_sizes",
    "gpus_per_node",
    "steps",
    "experiment",
    "convergence",
    "param",
)
_PREDICTION_GAP_NS = 3600 * 1_000_000_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="folder to write into: new, empty, or an existing store")
    what = p.add_argument_group("what to simulate (default: --preset seed-study)")
    what.add_argument("--preset", choices=sorted(PRESETS), help="a bundled study")
    what.add_argument("--config", metavar="FILE.json", help="a study described in JSON")
    what.add_argument(
        "--fit-from",
        metavar="OTHER_STORE",
        help="fit the cost model to OTHER_STORE's runs and write predictions for --world-sizes",
    )
    p.add_argument("--seed", type=int, help=f"random seed (default: the config's, else {DEFAULT_SEED})")
    sweep = p.add_argument_group("a sweep from flags (also what to predict with --fit-from)")
    sweep.add_argument(
        "--partition", help=f"comma list of preset partitions ({', '.join(PARTITIONS)}); default hpdlf"
    )
    sweep.add_argument("--backend", help="comma list of backends; default horovod-nccl")
    sweep.add_argument("--world-sizes", help="comma list of GPU counts, e.g. 1,2,4,8")
    sweep.add_argument("--batch-sizes", help="comma list of per-rank batch sizes; default 75")
    sweep.add_argument("--gpus-per-node", type=int, help="GPUs per node (ranks fill a node first)")
    sweep.add_argument(
        "--steps", type=int, help=f"steps per run ({MIN_STEPS}-{MAX_STEPS}; default {DEFAULT_STEPS})"
    )
    sweep.add_argument("--experiment", help="experiment name of the runs written")
    sweep.add_argument("--convergence", action="store_true", help="log a loss curve (metrics table)")
    sweep.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a partition parameter (cpu_share_penalty=0.1) or a backend's "
        "(horovod-nccl.inter_gb_per_s=12; backend.coord_us=50 for every backend)",
    )
    fit = p.add_argument_group("which runs --fit-from fits (default: all; one model per cluster and backend)")
    fit.add_argument("--fit-experiment", action="append", default=[], metavar="NAME")
    fit.add_argument("--fit-cluster", action="append", default=[], metavar="NAME")
    fit.add_argument("--fit-backend", action="append", default=[], metavar="NAME")


def _names(flag: str, text: str | None) -> list[str]:
    if text is None:
        return []
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise PerfscopeError(f"{flag}: give a comma-separated list of names, got {text!r}")
    return names


def _numbers(flag: str, text: str | None) -> list[int]:
    if text is None:
        return []
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        raise PerfscopeError(
            f"{flag}: expected whole numbers separated by commas, e.g. 1,2,4,8; got {text!r}"
        ) from None
    if any(v < 1 for v in values):
        raise PerfscopeError(f"{flag}: every value must be at least 1; got {text!r}")
    return values


def _params(items: Sequence[str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """--param KEY=VALUE flags: partition fields, and backend fields by backend name ('backend' = all)."""
    part: dict[str, Any] = {}
    backends: dict[str, dict[str, Any]] = {}
    part_fields, backend_fields = field_names(Partition), field_names(Backend)
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise PerfscopeError(f"--param {item!r}: write it as KEY=VALUE, e.g. cpu_share_penalty=0.1")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a plain string such as a device model
        owner, dot, name = key.rpartition(".")
        if dot:
            if name not in backend_fields:
                raise PerfscopeError(
                    f"--param {key}: {name!r} is not a backend parameter; "
                    f"they are {', '.join(backend_fields)}"
                )
            backends.setdefault(owner, {})[name] = value
        elif key in part_fields:
            part[key] = value
        else:
            raise PerfscopeError(
                f"--param {key}: unknown parameter; partition parameters are {', '.join(part_fields)}, "
                f"backend parameters are BACKEND.NAME with NAME one of {', '.join(backend_fields)}"
            )
    return part, backends


def _backend_overrides(name: str, by_backend: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {**by_backend.get("backend", {}), **by_backend.get(name, {})}


def _check_backend_names(by_backend: dict[str, dict[str, Any]], known: Sequence[str]) -> None:
    unknown = sorted(set(by_backend) - {"backend", *known})
    if unknown:
        raise PerfscopeError(
            f"--param names {plural('backend', len(unknown))} {', '.join(unknown)} that are not simulated "
            f"here ({', '.join(known)})"
        )


def _steps(args: argparse.Namespace) -> int:
    steps = DEFAULT_STEPS if args.steps is None else args.steps
    if not MIN_STEPS <= steps <= MAX_STEPS:
        raise PerfscopeError(f"--steps must be from {MIN_STEPS} to {MAX_STEPS}; got {steps}")
    return steps


def _sweep_config(args: argparse.Namespace) -> dict[str, Any]:
    parts = _names("--partition", args.partition) or ["hpdlf"]
    backends = _names("--backend", args.backend) or ["horovod-nccl"]
    world_sizes = _numbers("--world-sizes", args.world_sizes) or [1, 2, 4, 8]
    batches = _numbers("--batch-sizes", args.batch_sizes) or [75]
    part_params, backend_params = _params(args.param)
    _check_backend_names(backend_params, backends)
    if args.gpus_per_node is not None:
        part_params["gpus_per_node"] = args.gpus_per_node
    partitions: dict[str, Any] = {}
    for name in parts:
        if name not in PARTITIONS:
            raise PerfscopeError(
                f"--partition: unknown partition {name!r}; presets are {', '.join(PARTITIONS)}"
            )
        section = {
            b: _backend_overrides(b, backend_params) for b in backends if b in PARTITIONS[name].backends
        }
        partitions[name] = {**part_params, "backends": {b: v for b, v in section.items() if v}}
    return {
        "partitions": partitions,
        "experiments": [
            {
                "name": args.experiment or "custom-sweep",
                "partitions": parts,
                "backends": backends,
                "world_sizes": world_sizes,
                "batch_sizes": batches,
                "steps": _steps(args),
                "scaling_mode": "weak" if len(world_sizes) > 1 else "",
                "convergence": args.convergence,
            }
        ],
    }


def _prediction_specs(
    fits: list[FittedModel], args: argparse.Namespace, seed: int, source: str
) -> list[RunSpec]:
    world_sizes = _numbers("--world-sizes", args.world_sizes)
    batches = _numbers("--batch-sizes", args.batch_sizes)
    part_params, backend_params = _params(args.param)
    _check_backend_names(backend_params, [f.backend.name for f in fits])
    if args.gpus_per_node is not None:
        part_params["gpus_per_node"] = args.gpus_per_node
    specs = []
    for fit in fits:
        unmeasured = sorted(set(batches) - set(fit.measured_batch_sizes))
        if unmeasured and len(fit.measured_batch_sizes) < 2:
            raise PerfscopeError(
                f"--batch-sizes: {fit.cluster}/{fit.backend.name} was measured at batch "
                f"{fit.measured_batch_sizes[0]} only, so its per-sample and fixed costs cannot be told "
                f"apart and batch {unmeasured[0]} cannot be predicted; measure two or more batch sizes"
            )
        backend = with_overrides(fit.backend, "--param", _backend_overrides(fit.backend.name, backend_params))
        part = with_overrides(fit.partition, "--param", part_params)
        part = replace(part, backends={backend.name: backend})
        experiment = args.experiment or f"{fit.experiment}-predicted"
        tags = {
            "fitted_from": {
                "store": source,
                "runs": list(fit.run_ids),
                "world_sizes": list(fit.world_sizes),
                "smape": None if math.isnan(fit.smape) else round(fit.smape, 4),
                "trusted": fit.trusted,
                "notes": list(fit.notes),
            }
        }
        for batch in batches or list(fit.batch_sizes):
            for n in world_sizes:
                specs.append(
                    RunSpec(
                        run_id=run_id_for(experiment, part.name, backend.name, n, batch, seed),
                        experiment=experiment,
                        partition=part,
                        backend=backend,
                        workload=fit.workload,
                        world_size=n,
                        batch_per_rank=batch,
                        steps=_steps(args),
                        scaling_mode=fit.scaling_mode or "weak",
                        extra_tags=tags,
                    )
                )
    return specs


#: columns of the fitted-parameter table: key of FittedModel.summary() and its heading
_FIT_COLUMNS = (
    ("cluster", "cluster"),
    ("backend", "backend"),
    ("runs", "runs"),
    ("world_sizes", "N measured"),
    ("step_overhead_us", "host µs"),
    ("cpu_share_penalty", "κ"),
    ("kernel_us_per_sample", "kernel µs/sample"),
    ("coord_us", "coord µs"),
    ("intra_alpha_us", "intra α µs"),
    ("intra_gb_per_s", "intra GB/s"),
    ("inter_alpha_us", "inter α µs"),
    ("inter_gb_per_s", "inter GB/s"),
    ("smape", "SMAPE"),
)


def _cell(key: str, value: Any) -> Any:
    if key == "world_sizes":
        return ",".join(map(str, value))
    if key == "smape":
        return "n/a" if math.isnan(value) else f"{value:.1%}"
    if key.endswith("gb_per_s") and value >= UNRESOLVED_GB_PER_S:
        return "unresolved"
    return round(value, 3) if isinstance(value, float) else value


def _print_fits(fits: list[FittedModel]) -> None:
    rows = [[_cell(key, f.summary()[key]) for key, _ in _FIT_COLUMNS] for f in fits]
    print(format_rows([heading for _, heading in _FIT_COLUMNS], rows, width=terminal_width()))
    for f in fits:
        for note in f.notes:
            print(f"note ({f.cluster}, {f.backend.name}): {note}")


def _run_fit(args: argparse.Namespace) -> int:
    for flag in ("partition", "backend", "convergence", "preset", "config"):
        if getattr(args, flag):
            raise PerfscopeError(
                f"--{flag} does not go with --fit-from: the fitted model stands for the measured runs; "
                "choose them with --fit-experiment, --fit-cluster and --fit-backend"
            )
    if not args.world_sizes:
        raise PerfscopeError("--fit-from needs --world-sizes, the GPU counts to predict (e.g. 8,16,32,64)")
    seed = DEFAULT_SEED if args.seed is None else args.seed
    with open_store(args.fit_from, warn=False) as source:
        fits = fit_model(
            source,
            experiments=args.fit_experiment,
            clusters=args.fit_cluster,
            backends=args.fit_backend,
        )
        last = source.query(
            "SELECT max(coalesce(ended_ns, started_ns)) AS t FROM runs WHERE run_id IN (SELECT unnest(?))",
            [[r for f in fits for r in f.run_ids]],
        ).to_pylist()[0]["t"]
        source_root = str(source.root)
    _print_fits(fits)
    specs = _prediction_specs(fits, args, seed, source_root)
    start_ns = ((int(last or 0) + _PREDICTION_GAP_NS) // 1_000_000_000) * 1_000_000_000
    if not 0 <= start_ns <= LATEST_START_NS:
        raise PerfscopeError(
            f"the runs of {source_root} end at {last} ns, too late to simulate after them "
            f"(simulated runs start by {LATEST_START})"
        )
    ids = write_runs(args.store, specs, seed, start_ns)
    experiments = sorted({s.experiment for s in specs})
    print(
        f"wrote {counted(len(ids), 'predicted run')} (simulated, tagged fitted_from) to {args.store}: "
        f"{plural('experiment', len(experiments))} {', '.join(experiments)}"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    store_target(args.store)  # before any slow work; the folder itself is made just before writing
    if args.seed is not None and args.seed < 0:
        raise PerfscopeError(f"--seed must be a whole number >= 0; got {args.seed}")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise PerfscopeError(f"--gpus-per-node must be at least 1; got {args.gpus_per_node}")
    if args.fit_from:
        return _run_fit(args)
    if args.fit_experiment or args.fit_cluster or args.fit_backend:
        raise PerfscopeError("--fit-experiment, --fit-cluster and --fit-backend only apply with --fit-from")
    sweep = any(getattr(args, f) not in (None, False, []) for f in _SWEEP_FLAGS)
    if args.config and (args.preset or sweep):
        raise PerfscopeError(
            "give either --config, or --preset, or sweep flags (--world-sizes ...), not several"
        )
    if sweep and args.preset:
        raise PerfscopeError("sweep flags (--world-sizes ...) describe their own study; drop --preset")
    if sweep:
        cfg = parse_config(_sweep_config(args), seed=args.seed, source="simulate flags")
    elif args.config:
        cfg = parse_config(load_config_file(args.config), seed=args.seed, source=f"config {args.config}")
    else:
        cfg = parse_config(PRESETS[args.preset or "seed-study"](), seed=args.seed)
    ids = write_study(Path(args.store), cfg)
    experiments = ", ".join(e.name for e in cfg.experiments)
    print(
        f"wrote {counted(len(ids), 'simulated run')} (seed {cfg.seed}) to {args.store}: "
        f"{plural('experiment', len(cfg.experiments))} {experiments}"
    )
    return 0
