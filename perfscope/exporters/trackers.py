"""Send what perfscope measured to the experiment trackers a team already watches: MLflow, Weights &
Biases and TensorBoard. One tracker run per perfscope run, holding its per-step phase times, its row
of the scaling table and the findings that cite it.

The data come from the analyses (`step_series`, `scaling`, the explainer) in `payloads`; each
writer only formats them for its library, imported when used (the `trackers` extra)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..analysis import Selection, run_analysis
from ..errors import PerfscopeError
from ..explain import explain
from ..store.open import open_store
from ..store.reader import Store

TRACKERS = ("mlflow", "wandb", "tensorboard")
#: per-step metrics, in ms: the step as the job saw it (its slowest rank) and each phase's rank mean
PHASES = ("data", "forward", "backward", "sync_exposed", "optimizer", "other")
#: columns of a run's scaling row sent as summary metrics (names kept; _ns columns turned into _ms)
SUMMARY = (
    "world_size", "speedup", "efficiency", "per_gpu_speedup", "throughput_samples_per_s", "step_ns",
    "sync_share", "data_share", "lost_ns",
)  # fmt: skip
#: run metadata sent as parameters
PARAMS = ("experiment", "backend", "cluster", "model", "scaling_mode", "world_size", "batch_size_per_rank")


@dataclass
class RunPayload:
    """What one tracker run receives: plain data, formatted by the writers."""

    run_id: str
    experiment: str
    params: dict[str, str] = field(default_factory=dict)
    steps: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    summary: dict[str, float] = field(default_factory=dict)
    findings: list[dict[str, Any]] = field(default_factory=list)

    def findings_markdown(self) -> str:
        if not self.findings:
            return "No findings."
        return "\n\n".join(
            f"**{i}. [{f['severity'].upper()}] {f['title']}**\n\n{f['text']}\n\n"
            f"What to do: {f['recommendation']}"
            for i, f in enumerate(self.findings, 1)
        )


def payloads(store: Store, sel: Selection | None = None) -> list[RunPayload]:
    """One payload per run of the selection, in the scaling table's order. Speedup and findings
    compare a run with the others of its group, so they are computed without the run filter."""
    sel = sel or Selection()
    wanted = set(sel.run_ids)
    sel = dataclasses.replace(sel, run_ids=())
    scaling = [
        r for r in run_analysis("scaling", store, sel).to_pylist() if not wanted or r["run_id"] in wanted
    ]
    per_step: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for row in run_analysis("step_series", store, sel).to_pylist():
        per_step[row["run_id"]][row["step"]].append(row)
    findings = [f.to_dict() for f in explain(store, sel)]
    out = []
    for row in scaling:
        run_id = row["run_id"]
        p = RunPayload(run_id=run_id, experiment=str(row.get("experiment") or "default"))
        p.params = {k: str(row[k]) for k in PARAMS if row.get(k) not in (None, "")}
        for key in SUMMARY:
            value = row.get(key)
            if isinstance(value, (int, float)):
                p.summary[key.removesuffix("_ns") + "_ms" if key.endswith("_ns") else key] = (
                    value / 1e6 if key.endswith("_ns") else float(value)
                )
        for step, ranks in sorted(per_step.get(run_id, {}).items()):
            metrics = {"step_ms": max(r["step_ns"] or 0 for r in ranks) / 1e6}
            for phase in PHASES:
                metrics[f"{phase}_ms"] = sum(r[f"{phase}_ns"] or 0 for r in ranks) / len(ranks) / 1e6
            p.steps.append((int(step), metrics))
        p.findings = [f for f in findings if run_id in f["evidence"]["run_ids"]]
        out.append(p)
    return out


def export(store: Store, tracker: str, destination: str | None, sel: Selection | None = None) -> list[str]:
    """Write every run of the selection to `tracker`; returns where each went."""
    if tracker not in TRACKERS:
        raise PerfscopeError(f"unknown tracker {tracker!r}: choose one of {', '.join(TRACKERS)}")
    if tracker == "mlflow":  # before the analyses: a store MLflow cannot open here is one line now
        _needs_database_packages(mlflow_uri(destination), destination)
    runs = payloads(store, sel)
    if not runs:
        raise PerfscopeError("no runs to export in this selection")
    writer = {"mlflow": to_mlflow, "wandb": to_wandb, "tensorboard": to_tensorboard}[tracker]
    return [writer(p, destination) for p in runs]


def _library(name: str, module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PerfscopeError(
            f"--to {name} needs the {name} package: pip install 'perfscope[trackers]'"
        ) from exc


#: MLflow stores kept in a database: MLflow opens them through SQLAlchemy, and alembic for its
#: schema, which mlflow-skinny does not install.
DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
DB_PACKAGES = ("sqlalchemy", "alembic")


def mlflow_uri(destination: str | None) -> str:
    """Where `--to mlflow` writes: `-o` (a tracking URI, or a folder: a file store), else the URI
    the user's MLflow reads by default (MLFLOW_TRACKING_URI, else MLflow's own default store)."""
    mlflow = _library("mlflow", "mlflow")
    uri = destination or mlflow.get_tracking_uri()
    if "://" not in uri and not uri.startswith("file:"):
        uri = Path(uri).resolve().as_uri()
    return str(uri)


def _is_file_store(uri: str) -> bool:
    return uri.startswith("file:")


def _needs_database_packages(uri: str, destination: str | None) -> None:
    """A database store without SQLAlchemy fails deep inside MLflow: refuse first, in one line."""
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme not in DB_SCHEMES:
        return
    missing = [m for m in DB_PACKAGES if not _importable(m)]
    if missing:
        where = uri if destination else f"{uri} (MLflow's default store)"
        raise PerfscopeError(
            f"--to mlflow writes to {where}, a database that MLflow opens with "
            f"{' and '.join(missing)}, not installed (mlflow-skinny has neither): "
            f"pip install {' '.join(missing)}; or give -o FOLDER to write an MLflow file store"
        )


def _importable(module: str) -> bool:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def mlflow_note(destination: str | None) -> str | None:
    """One line for the user when the MLflow they have cannot open what was written as it is: a
    folder (file) store, which MLflow 3 opens only with MLFLOW_ALLOW_FILE_STORE=true."""
    uri = mlflow_uri(destination)
    if not _is_file_store(uri):
        return None
    from mlflow import environment_variables as env

    allow = getattr(env, "MLFLOW_ALLOW_FILE_STORE", None)
    if allow is None or allow.get():  # an MLflow that opens folders as they are, or already allowed
        return None
    return (
        f"the MLflow installed here opens the folder store {uri} only with MLFLOW_ALLOW_FILE_STORE=true "
        f"(MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {uri}); "
        "-o sqlite:///mlflow.db writes the database store it reads as it is"
    )


@contextlib.contextmanager
def _allow_file_store(uri: str) -> Iterator[None]:
    """MLflow 3 writes a folder store only with MLFLOW_ALLOW_FILE_STORE=true: set it while perfscope
    writes, and put the environment back (a training job's included) afterwards."""
    if not _is_file_store(uri):
        yield
        return
    old = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = old


def to_mlflow(p: RunPayload, destination: str | None) -> str:
    """An MLflow run named after the perfscope run, in the experiment of the same name."""
    mlflow = _library("mlflow", "mlflow")
    from mlflow.entities import Metric, Param, RunTag

    uri = mlflow_uri(destination)
    _needs_database_packages(uri, destination)
    with _allow_file_store(uri):
        client = mlflow.MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(p.experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(p.experiment)
        run = client.create_run(exp_id, run_name=p.run_id, tags={"perfscope.run_id": p.run_id})
        rid = run.info.run_id
        metrics = [Metric(f"perfscope/{k}", v, 0, s) for s, m in p.steps for k, v in m.items()]
        metrics += [Metric(f"perfscope/summary/{k}", v, 0, 0) for k, v in p.summary.items()]
        params = [Param(k, v) for k, v in p.params.items()]
        tags = [RunTag("perfscope.findings", str(len(p.findings)))]
        for i in range(0, max(len(metrics), 1), 1000):  # MLflow's batch limit
            client.log_batch(
                rid,
                metrics=metrics[i : i + 1000],
                params=params if i == 0 else [],
                tags=tags if i == 0 else [],
            )
        client.log_text(rid, json.dumps(p.findings, indent=2), "perfscope/findings.json")
        client.log_text(rid, p.findings_markdown(), "perfscope/findings.md")
        client.set_terminated(rid)
    return f"mlflow {uri} run {rid}"


def to_wandb(p: RunPayload, directory: str | None) -> str:
    """A W&B run (offline unless WANDB_MODE says otherwise: nothing leaves the machine by surprise)."""
    wandb = _library("wandb", "wandb")
    target = Path(directory or "wandb-perfscope").resolve()
    target.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=p.experiment, name=p.run_id, id=_wandb_id(p.run_id), dir=str(target), config=p.params,
        mode=os.environ.get("WANDB_MODE", "offline"), reinit="create_new",
        settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
    )  # fmt: skip
    try:
        for step, metrics in p.steps:
            run.log({f"perfscope/{k}": v for k, v in metrics.items()}, step=step)
        run.summary.update({f"perfscope/summary/{k}": v for k, v in p.summary.items()})
        table = wandb.Table(columns=["severity", "title", "text", "recommendation", "confidence"])
        for f in p.findings:
            table.add_data(f["severity"], f["title"], f["text"], f["recommendation"], f["confidence"])
        run.log({"perfscope/findings": table})
        where = str(Path(run.dir).parent)
    finally:
        run.finish()
    return f"wandb {where}"


def _wandb_id(run_id: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in run_id)[:64]


def to_tensorboard(p: RunPayload, log_dir: str | None) -> str:
    """TensorBoard event files in LOG_DIR/<run id>: scalars per step, summary scalars, findings as text."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise PerfscopeError(
            "--to tensorboard needs torch and tensorboard: pip install 'perfscope[torch,trackers]'"
        ) from exc
    target = Path(log_dir or "runs").resolve() / p.run_id
    writer = SummaryWriter(log_dir=str(target))
    try:
        for step, metrics in p.steps:
            for k, v in metrics.items():
                writer.add_scalar(f"perfscope/{k}", v, step)
        for k, v in p.summary.items():
            writer.add_scalar(f"perfscope/summary/{k}", v, 0)
        writer.add_text("perfscope/findings", p.findings_markdown(), 0)
        writer.add_text("perfscope/params", json.dumps(p.params), 0)
    finally:
        writer.close()
    return f"tensorboard {target}"


def export_command(args: Any) -> int:
    """`perfscope report STORE --to TRACKER [-o DESTINATION] [--experiment ...] [--runs ...]`."""
    sel = Selection(experiments=tuple(args.experiment), run_ids=tuple(args.runs), source=args.source)
    with open_store(args.store) as store:
        for where in export(store, args.to, args.output, sel):
            print(f"sent to {where}", file=sys.stderr)
    note = mlflow_note(args.output) if args.to == "mlflow" else None
    if note:
        print(f"perfscope report: note: {note}", file=sys.stderr)
    return 0
