"""The seed-study preset (three Taurus partitions, NCCL and MPI) and the JSON config that describes a study.

Config format (every key optional except `experiments`; units are in the key names)::

    {
      "seed": 2022,
      "start": "2022-08-01T08:00:00Z",
      "workload": {"name": "stress-strain-regressor", "param_count": 153441, "bytes_per_param": 4,
                   "dataset_samples": 750000, "input_bytes_per_sample": 2400},
      "convergence": {"initial_loss": 1.0, "final_loss": 0.02, "half_samples": 8000,
                      "exponent": 0.8, "critical_batch": 300, "noise_cv_at_batch_75": 0.08},
      "partitions": {
        "alpha-ib": {"base": "alpha", "gpus_per_node": 4,
                     "backends": {"horovod-nccl": {"inter_gb_per_s": 12.0}}}
      },
      "experiments": [
        {"name": "what-if", "partitions": ["alpha-ib"], "backends": ["horovod-nccl"],
         "world_sizes": [1, 2, 4, 8, 16], "batch_sizes": [75], "steps": 200,
         "scaling_mode": "weak", "convergence": false}
      ]
    }

A partition either names a `base` (alpha, hpdlf, gpu2) and overrides some of its fields, or gives
every field of `Partition`. Its `backends` override or add collective backends the same way (a new
backend without a base needs every field of `Backend`). An experiment runs every combination of its
partitions, backends, world sizes and batch sizes; `partitions` may name preset partitions directly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import PerfscopeError
from .model import Backend, Convergence, Partition, Workload

DEFAULT_SEED = 2022
#: the seed study was presented in August 2022; simulated runs start then, one after another
DEFAULT_START = "2022-08-01T08:00:00Z"
DEFAULT_STEPS = 200
#: the latest start a study may have: int64 nanoseconds end in 2262, and a long study needs room
LATEST_START = "2200-01-01T00:00:00Z"
LATEST_START_NS = 7_258_118_400 * 1_000_000_000
#: a config file is a few kilobytes; reading stops here (a FIFO or /dev/zero never ends)
MAX_CONFIG_BYTES = 1 << 20
MIN_STEPS = 20  # warm-up (10 steps or 5%) plus enough steady steps for medians
MAX_STEPS = 100_000
SEED_WORLD_SIZES = (1, 2, 3, 4, 6, 8, 10, 12)
SEED_BATCH_PER_RANK = 75
SEED_SWEEP_BATCHES = (75, 150, 250, 500, 1000, 2000, 3000, 5000)
SEED_SWEEP_PARTITION = "hpdlf"
BACKENDS = ("horovod-nccl", "horovod-mpi")

# One software stack for all partitions (a 2022 TensorFlow module set); the seed names none.
_SOFTWARE = {
    "python_version": "3.8.6",
    "torch_version": "",
    "cuda_version": "11.1",
    "nccl_version": "2.8.3",
    "driver_version": "470.57.02",
}

PARTITIONS: dict[str, Partition] = {
    "alpha": Partition(
        name="alpha",
        device_model="NVIDIA A100-SXM4-40GB",
        gpus_per_node=8,
        cpus_per_node=96,
        hostname_pattern="taurusi80{node:02d}",
        first_node=1,
        device_mem_bytes=40 * 1024**3,
        device_peak_flops=19.5e12,
        idle_power_w=55.0,
        max_power_w=400.0,
        sm_clock_mhz=1410.0,
        mem_clock_mhz=1215.0,
        has_nvlink=True,
        kernel_us_per_sample=1.6,
        fill_samples=100.0,
        step_overhead_us=1900.0,
        cpu_share_penalty=0.06,
        optimizer_us=180.0,
        other_us=80.0,
        data_fixed_us=10.0,
        data_us_per_sample=0.35,
        step_cv=0.03,
        rank_cv=0.004,
        comm_cv=0.03,
        backends={
            "horovod-nccl": Backend("horovod-nccl", 100.0, 8.0, 80.0, 10.0, 1.42, True),
            "horovod-mpi": Backend("horovod-mpi", 10.0, 2.0, 24.0, 8.0, 1.03, False),
        },
        software=_SOFTWARE,
        notes="34 nodes of 8 A100-SXM4-40GB (NVLink), 2x AMD EPYC 7352 (96 threads), 2x HDR "
        "InfiniBand; NCCL's inter-node transfers modelled TCP-like (no InfiniBand transport).",
    ),
    "hpdlf": Partition(
        name="hpdlf",
        device_model="NVIDIA GeForce GTX 1080 Ti",
        gpus_per_node=3,
        cpus_per_node=12,
        hostname_pattern="taurusa{node}",
        first_node=3,
        device_mem_bytes=11264 * 1024**2,
        device_peak_flops=11.3e12,
        idle_power_w=15.0,
        max_power_w=250.0,
        sm_clock_mhz=1885.0,
        mem_clock_mhz=5505.0,
        has_nvlink=False,
        kernel_us_per_sample=3.0,
        fill_samples=120.0,
        step_overhead_us=3100.0,
        cpu_share_penalty=0.05,
        optimizer_us=300.0,
        other_us=120.0,
        data_fixed_us=50.0,
        data_us_per_sample=1.0,
        step_cv=0.02,
        rank_cv=0.004,
        comm_cv=0.03,
        backends={
            "horovod-nccl": Backend("horovod-nccl", 100.0, 10.0, 8.0, 60.0, 1.05, True),
            "horovod-mpi": Backend("horovod-mpi", 10.0, 3.0, 20.0, 70.0, 0.85, False),
        },
        software=_SOFTWARE,
        notes="3 GeForce GTX 1080 Ti per node (PCIe, no NVLink), 12 CPU cores per node (assumed); "
        "the seed's 6 GPUs on 2 nodes fixes 3 GPUs per node.",
    ),
    "gpu2": Partition(
        name="gpu2",
        device_model="Tesla K80",
        gpus_per_node=4,
        cpus_per_node=24,
        hostname_pattern="taurusi2{node:03d}",
        first_node=45,
        device_mem_bytes=11441 * 1024**2,
        device_peak_flops=4.37e12,
        idle_power_w=30.0,
        max_power_w=150.0,
        sm_clock_mhz=875.0,
        mem_clock_mhz=2505.0,
        has_nvlink=False,
        kernel_us_per_sample=12.0,
        fill_samples=100.0,
        step_overhead_us=5000.0,
        cpu_share_penalty=0.06,
        optimizer_us=450.0,
        other_us=180.0,
        data_fixed_us=60.0,
        data_us_per_sample=0.9,
        step_cv=0.02,
        rank_cv=0.004,
        comm_cv=0.03,
        backends={
            "horovod-nccl": Backend("horovod-nccl", 100.0, 10.0, 6.0, 15.0, 1.3, True),
            "horovod-mpi": Backend("horovod-mpi", 10.0, 3.0, 16.0, 20.0, 0.85, False),
        },
        software=_SOFTWARE,
        notes="4 Tesla K80 per node (PCIe), 2x Intel Xeon E5-2680 v3 (24 cores), FDR InfiniBand.",
    ),
}

SEED_CONVERGENCE = Convergence(
    initial_loss=1.0,
    final_loss=0.02,
    half_samples=8000.0,
    exponent=0.8,
    critical_batch=300.0,
    noise_cv_at_batch_75=0.08,
)


def seed_study_config() -> dict[str, Any]:
    """The bundled study as a config: the scaling sweep on every partition and backend, and the
    one-GPU batch-size sweep with the convergence curve."""
    return {
        "seed": DEFAULT_SEED,
        "start": DEFAULT_START,
        "experiments": [
            {
                "name": "seed-scaling",
                "partitions": list(PARTITIONS),
                "backends": list(BACKENDS),
                "world_sizes": list(SEED_WORLD_SIZES),
                "batch_sizes": [SEED_BATCH_PER_RANK],
                "steps": DEFAULT_STEPS,
                "scaling_mode": "weak",
            },
            {
                "name": "seed-batch-sweep",
                "partitions": [SEED_SWEEP_PARTITION],
                "backends": ["horovod-nccl"],
                "world_sizes": [1],
                "batch_sizes": list(SEED_SWEEP_BATCHES),
                "steps": DEFAULT_STEPS,
                "scaling_mode": "",
                "convergence": True,
            },
        ],
    }


PRESETS = {"seed-study": seed_study_config}


# ---- config parsing -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExperimentSpec:
    name: str
    partitions: tuple[Partition, ...]
    backends: tuple[str, ...]
    world_sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    steps: int
    scaling_mode: str
    convergence: bool


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    seed: int
    start_ns: int
    workload: Workload
    convergence: Convergence
    experiments: tuple[ExperimentSpec, ...]


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_SCALING_MODES = ("weak", "strong", "")
_EXPERIMENT_KEYS = {
    "name",
    "partitions",
    "backends",
    "world_sizes",
    "batch_sizes",
    "steps",
    "scaling_mode",
    "convergence",
}


def _fail(where: str, what: str) -> PerfscopeError:
    return PerfscopeError(f"{where}: {what}")


def _check_keys(where: str, given: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise _fail(
            where,
            f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(allowed))}",
        )


def _as_mapping(where: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(where, f"must be a JSON object, got {type(value).__name__}")
    return value


def _coerce(where: str, field_type: Any, value: Any) -> Any:
    """Check one dataclass field value against its annotated type ('float', 'int', 'str', 'bool')."""
    kind = field_type if isinstance(field_type, str) else getattr(field_type, "__name__", "")
    if kind == "bool":
        if not isinstance(value, bool):
            raise _fail(where, f"must be true or false, got {value!r}")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise _fail(where, f"must be a string, got {value!r}")
        return value
    if kind in ("int", "float"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(where, f"must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise _fail(where, f"must be a finite number >= 0, got {value!r}")
        if kind == "int":
            if value != int(value):
                raise _fail(where, f"must be a whole number, got {value!r}")
            return int(value)
        return float(value)
    raise _fail(where, f"cannot be set from a config (type {kind})")


def _field_values(
    cls: Any, where: str, base: Any, given: Mapping[str, Any], skip: set[str]
) -> dict[str, Any]:
    """The fields of dataclass `cls` (less `skip`): `base`'s values overridden by the checked `given`."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    _check_keys(where, given, set(fields) | {"base"})
    values = {} if base is None else {n: getattr(base, n) for n in fields}
    for name, value in given.items():
        if name == "base":
            continue
        values[name] = _coerce(f"{where}.{name}", fields[name].type, value)
    missing = sorted(set(fields) - set(values) - {n for n, f in fields.items() if _has_default(f)})
    if missing:
        raise _fail(where, f'missing {", ".join(missing)} (or give "base" to start from a preset)')
    return values


def _has_default(f: dataclasses.Field[Any]) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _partition(name: str, given: Mapping[str, Any]) -> Partition:
    where = f"partitions.{name}"
    base_name = given.get("base", name if name in PARTITIONS else None)
    if base_name is not None and base_name not in PARTITIONS:
        raise _fail(
            f"{where}.base", f"unknown preset partition {base_name!r}; presets: {', '.join(PARTITIONS)}"
        )
    base = PARTITIONS[base_name] if base_name is not None else None
    values = _field_values(
        Partition,
        where,
        base,
        {k: v for k, v in given.items() if k != "backends"},
        {"name", "backends", "software"},
    )
    backends = dict(base.backends) if base is not None else {}
    for bname, bgiven in _as_mapping(f"{where}.backends", given.get("backends", {})).items():
        bgiven = _as_mapping(f"{where}.backends.{bname}", bgiven)
        if not _NAME.match(bname):
            raise _fail(f"{where}.backends.{bname}", "names are 1-64 letters, digits, '.', '_' or '-'")
        bbase_name = bgiven.get("base", bname if bname in backends else None)
        if bbase_name is not None and bbase_name not in backends:
            raise _fail(f"{where}.backends.{bname}.base", f"no backend {bbase_name!r} to start from")
        bbase = backends.get(bbase_name) if bbase_name is not None else None
        backend = Backend(
            name=bname, **_field_values(Backend, f"{where}.backends.{bname}", bbase, bgiven, {"name"})
        )
        _check_backend(f"{where}.backends.{bname}", backend)
        backends[bname] = backend
    if not backends:
        raise _fail(where, 'needs at least one backend under "backends"')
    part = Partition(
        name=name,
        backends=backends,
        software=dict(base.software) if base is not None else dict(_SOFTWARE),
        **values,
    )
    _check_partition(where, part)
    return part


def _check_backend(where: str, b: Backend) -> None:
    for f in ("intra_gb_per_s", "inter_gb_per_s"):
        if getattr(b, f) <= 0:
            raise _fail(f"{where}.{f}", "must be > 0 (a link moves data)")


def _check_partition(where: str, p: Partition) -> None:
    if p.gpus_per_node < 1:
        raise _fail(f"{where}.gpus_per_node", "must be at least 1")
    if p.cpus_per_node < 1:
        raise _fail(f"{where}.cpus_per_node", "must be at least 1")
    if p.max_power_w < p.idle_power_w:
        raise _fail(f"{where}.max_power_w", "must be at least idle_power_w")
    if p.kernel_us_per_sample <= 0:
        raise _fail(f"{where}.kernel_us_per_sample", "must be > 0")
    try:
        p.hostname(0)
    except (KeyError, IndexError, ValueError) as exc:
        raise _fail(f"{where}.hostname_pattern", f"must be a format string with {{node}} ({exc})") from None


def _int_list(where: str, value: Any, *, lo: int, hi: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise _fail(where, f"must be a non-empty list of whole numbers, got {value!r}")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise _fail(where, f"entries must be whole numbers from {lo} to {hi}, got {v!r}")
        out.append(v)
    if len(set(out)) != len(out):
        raise _fail(where, f"has repeated entries: {value!r}")
    return tuple(out)


def _experiment(i: int, given: Any, partitions: Mapping[str, Partition]) -> ExperimentSpec:
    where = f"experiments[{i}]"
    given = _as_mapping(where, given)
    _check_keys(where, given, _EXPERIMENT_KEYS)
    name = given.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _fail(f"{where}.name", f"must be 1-64 letters, digits, '.', '_' or '-', got {name!r}")
    where = f"experiments[{i}] ({name})"
    names = given.get("partitions", list(partitions) or list(PARTITIONS))
    if not isinstance(names, list) or not names:
        raise _fail(f"{where}.partitions", "must be a non-empty list of partition names")
    parts = []
    for pname in names:
        if pname in partitions:
            parts.append(partitions[pname])
        elif pname in PARTITIONS:
            parts.append(PARTITIONS[pname])
        else:
            known = sorted(set(partitions) | set(PARTITIONS))
            raise _fail(f"{where}.partitions", f"unknown partition {pname!r}; known: {', '.join(known)}")
    backends = given.get("backends", ["horovod-nccl"])
    if not isinstance(backends, list) or not backends or not all(isinstance(b, str) for b in backends):
        raise _fail(f"{where}.backends", "must be a non-empty list of backend names")
    for part in parts:
        for b in backends:
            if b not in part.backends:
                raise _fail(
                    f"{where}.backends",
                    f"partition {part.name!r} has no backend {b!r}; it has {', '.join(part.backends)}",
                )
    mode = given.get("scaling_mode", "weak")
    if mode not in _SCALING_MODES:
        raise _fail(f"{where}.scaling_mode", f"must be 'weak', 'strong' or '', got {mode!r}")
    steps = given.get("steps", DEFAULT_STEPS)
    if isinstance(steps, bool) or not isinstance(steps, int) or not MIN_STEPS <= steps <= MAX_STEPS:
        raise _fail(
            f"{where}.steps", f"must be a whole number from {MIN_STEPS} to {MAX_STEPS}, got {steps!r}"
        )
    convergence = given.get("convergence", False)
    if not isinstance(convergence, bool):
        raise _fail(f"{where}.convergence", f"must be true or false, got {convergence!r}")
    return ExperimentSpec(
        name=name,
        partitions=tuple(parts),
        backends=tuple(backends),
        world_sizes=_int_list(f"{where}.world_sizes", given.get("world_sizes"), lo=1, hi=65_536),
        batch_sizes=_int_list(f"{where}.batch_sizes", given.get("batch_sizes", [75]), lo=1, hi=10_000_000),
        steps=steps,
        scaling_mode=mode,
        convergence=convergence,
    )


def _start_ns(value: Any) -> int:
    if not isinstance(value, str):
        raise _fail("start", f"must be an ISO date-time string, got {value!r}")
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise _fail("start", f"is not an ISO date-time such as {DEFAULT_START!r}: {value!r}") from None
    if when.tzinfo is None:
        raise _fail("start", f"needs a time zone (e.g. a trailing Z): {value!r}")
    start_ns = int(when.timestamp()) * 1_000_000_000
    if not 0 <= start_ns <= LATEST_START_NS:
        raise _fail(
            "start", f"must be from 1970 to {LATEST_START[:4]} (nanosecond times end in 2262): {value!r}"
        )
    return start_ns


def parse_config(config: Any, *, seed: int | None = None, source: str = "simulation config") -> StudyConfig:
    """Validate a config (a parsed JSON object); every mistake is a PerfscopeError naming the key."""
    try:
        return _parse_config(config, seed)
    except PerfscopeError as exc:
        raise PerfscopeError(f"{source}: {exc.message}") from None


def with_overrides(base: Any, where: str, given: Mapping[str, Any]) -> Any:
    """A copy of a Partition or Backend with some fields changed, checked like a config entry."""
    if isinstance(base, Partition):
        out = dataclasses.replace(
            base, **_field_values(Partition, where, base, given, {"name", "backends", "software"})
        )
        _check_partition(where, out)
        return out
    out = dataclasses.replace(base, **_field_values(Backend, where, base, given, {"name"}))
    _check_backend(where, out)
    return out


def field_names(cls: Any) -> list[str]:
    """Parameters a config or --param may set on a Partition or Backend."""
    return [f.name for f in dataclasses.fields(cls) if f.name not in ("name", "backends", "software")]


def _parse_config(config: Any, seed: int | None) -> StudyConfig:
    config = _as_mapping("top level", config)
    _check_keys(
        "top level", config, {"seed", "start", "workload", "convergence", "partitions", "experiments"}
    )
    cfg_seed = config.get("seed", DEFAULT_SEED)
    if isinstance(cfg_seed, bool) or not isinstance(cfg_seed, int) or cfg_seed < 0:
        raise _fail("seed", f"must be a whole number >= 0, got {cfg_seed!r}")
    workload = Workload(
        **_field_values(
            Workload, "workload", Workload(), _as_mapping("workload", config.get("workload", {})), set()
        )
    )
    if workload.param_count < 1 or workload.dataset_samples < 1:
        raise _fail("workload", "param_count and dataset_samples must be at least 1")
    convergence = Convergence(
        **_field_values(
            Convergence,
            "convergence",
            SEED_CONVERGENCE,
            _as_mapping("convergence", config.get("convergence", {})),
            set(),
        )
    )
    if not convergence.initial_loss > convergence.final_loss:
        raise _fail("convergence", "initial_loss must be larger than final_loss")
    if convergence.half_samples <= 0 or convergence.critical_batch <= 0:
        raise _fail("convergence", "half_samples and critical_batch must be > 0")
    partitions = {
        name: _partition(name, _as_mapping(f"partitions.{name}", given))
        for name, given in _as_mapping("partitions", config.get("partitions", {})).items()
    }
    for name in partitions:
        if not _NAME.match(name):
            raise _fail(f"partitions.{name}", "names are 1-64 letters, digits, '.', '_' or '-'")
    experiments = config.get("experiments")
    if not isinstance(experiments, list) or not experiments:
        raise _fail("experiments", "must be a non-empty list of experiments (see the format above)")
    parsed = tuple(_experiment(i, e, partitions) for i, e in enumerate(experiments))
    if len({e.name for e in parsed}) != len(parsed):
        raise _fail("experiments", "experiment names must differ")
    return StudyConfig(
        seed=cfg_seed if seed is None else seed,
        start_ns=_start_ns(config.get("start", DEFAULT_START)),
        workload=workload,
        convergence=convergence,
        experiments=parsed,
    )


def load_config_file(path: str | Path) -> Any:
    """The parsed JSON of a config file; a file too large, not UTF-8, not JSON or nested too deep for
    the parser is a PerfscopeError."""
    try:
        if Path(path).is_dir():
            raise PerfscopeError(f"cannot read the config {path}: it is a folder")
        # a FIFO nobody writes to would block the open for ever; reads block again once it is open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise PerfscopeError(f"cannot read the config {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise PerfscopeError(
            f"the config {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB; is it a config?"
        )
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise PerfscopeError(f"the config {path} is not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise PerfscopeError(
            f"the config {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    except RecursionError:
        raise PerfscopeError(f"the config {path} is nested too deeply to be a study config") from None
