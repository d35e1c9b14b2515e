"""Samples per step under zero-code recording (`perfscope run`): the batch of the model being trained,
never that of a loss, a metric or an activation called as a module. Every script here is one people
write, launched unchanged through the real `perfscope run` on CPU torch (torchrun on gloo where it has
two ranks); each counts its own samples per optimizer update, and `steps.samples` read back from the
store's Parquet must equal that count. Batch sizes vary from step to step, so no constant can pass."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

import perfscope

torch = pytest.importorskip("torch")

BIN = Path(sys.executable).parent
TIMEOUT_S = 240
STEPS = 5

#: a common head: a seeded stream of batch sizes, the script's own count per update, and its report
HEAD = """
import json, os
import torch
import torch.nn.functional as F
from torch import nn

RANK = int(os.environ.get("RANK", "0"))
torch.manual_seed(0)
g = torch.Generator().manual_seed(RANK + 7)
counts = []  # the script's own count: samples drawn from its data per optimizer update


def size():
    return int(torch.randint(3, 12, (1,), generator=g))


def done():
    # a file per rank: torchrun interleaves the ranks' stdout without line breaks between them
    with open(f"counts-{RANK}.json", "w") as f:
        json.dump(counts, f)
"""

SHAPES = {
    # a loss module, as most tutorials write it
    "loss_module": """
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
criterion = nn.CrossEntropyLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(STEPS):
    n = size()
    x, y = torch.randn(n, 8), torch.randint(0, 4, (n,))
    opt.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    opt.step()
    counts.append(n)
""",
    # the functional loss
    "functional_loss": """
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for _ in range(STEPS):
    n = size()
    x, y = torch.randn(n, 8), torch.randint(0, 4, (n,))
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    counts.append(n)
""",
    # a dict batch given as keywords, a dict out (Hugging Face's shape), a loss module on the logits
    "dict_batch": """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, input_ids, attention_mask):
        h = (self.emb(input_ids) * attention_mask.unsqueeze(-1)).mean(1)
        return {"logits": self.head(h)}


model = Net()
criterion = nn.CrossEntropyLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(STEPS):
    n = size()
    batch = {"input_ids": torch.randint(0, 50, (n, 6)), "attention_mask": torch.ones(n, 6)}
    labels = torch.randint(0, 4, (n,))
    out = model(**batch)
    loss = criterion(out["logits"], labels)
    loss.backward()
    opt.step()
    opt.zero_grad()
    counts.append(n)
""",
    # a tuple/list batch handed whole to the model, a loss module with its own reduction
    "tuple_batch": """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(3, 4)

    def forward(self, batch):
        x, extra = batch
        return self.a(x) + self.b(extra)


model = Net()
criterion = nn.MSELoss()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(STEPS):
    n = size()
    batch = [torch.randn(n, 8), torch.randn(n, 3)]
    target = torch.randn(n, 4)
    loss = criterion(model(tuple(batch)), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    counts.append(n)
""",
    # a parameter-less module computing accuracy, called while training with gradients on
    "metric_module": """
class Accuracy(nn.Module):
    def forward(self, logits, y):
        return (logits.argmax(-1) == y).float().mean()


model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
accuracy = Accuracy()
act = nn.Softmax(dim=-1)  # an activation used as a module, outside the model
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(STEPS):
    n = size()
    x, y = torch.randn(n, 8), torch.randint(0, 4, (n,))
    logits = model(x)
    loss = F.nll_loss(act(logits).log(), y)
    acc = accuracy(logits, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    counts.append(n)
""",
    # the model called twice on one batch (two augmented views), one backward: one batch of samples
    "model_twice": """
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
criterion = nn.CrossEntropyLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(STEPS):
    n = size()
    x, y = torch.randn(n, 8), torch.randint(0, 4, (n,))
    view1, view2 = x + 0.1 * torch.randn_like(x), x.flip(-1)
    loss = criterion(model(view1), y) + criterion(model(view2), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    counts.append(n)
""",
    # two trained modules called one after the other (a backbone and a head) with an activation
    # module between them: the batch once
    "backbone_and_head": """
backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
head = nn.Linear(16, 4)
gelu = nn.GELU()
criterion = nn.CrossEntropyLoss()
opt = torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=0.1)
for _ in range(STEPS):
    n = size()
    x, y = torch.randn(n, 8), torch.randint(0, 4, (n,))
    loss = criterion(head(gelu(backbone(x))), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    counts.append(n)
""",
    # a frozen teacher in training mode (its parameters need no update but autograd is on) beside a
    # student: the student's batch; the teacher sees a batch twice as big (two crops per sample)
    "frozen_teacher": """
teacher = nn.Linear(8, 4)
for p in teacher.parameters():
    p.requires_grad_(False)
student = nn.Linear(8, 4)
criterion = nn.KLDivLoss(reduction="batchmean")
opt = torch.optim.SGD(student.parameters(), lr=0.1)
for _ in range(STEPS):
    n = size()
    x = torch.randn(n, 8)
    soft = teacher(torch.cat([x, x.flip(-1)])).view(2, n, 4).mean(0).softmax(-1)
    loss = criterion(student(x).log_softmax(-1), soft)
    opt.zero_grad()
    loss.backward()
    opt.step()
    counts.append(n)
""",
    # activation checkpointing: the autograd engine runs the block's forward again inside backward
    "checkpointed": """
from torch.utils.checkpoint import checkpoint

block = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
head = nn.Linear(16, 4)
criterion = nn.CrossEntropyLoss()
opt = torch.optim.SGD([*block.parameters(), *head.parameters()], lr=0.1)
for _ in range(STEPS):
    n = size()
    x, y = torch.randn(n, 8, requires_grad=True), torch.randint(0, 4, (n,))
    loss = criterion(head(checkpoint(block, x, use_reentrant=REENTRANT)), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    counts.append(n)
""",
    # an optimizer that evaluates its closure several times in one step (forward and backward each)
    "lbfgs_closure": """
model = nn.Linear(8, 1)
criterion = nn.MSELoss()
opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
for _ in range(STEPS):
    n = size()
    x, y = torch.randn(n, 8), torch.randn(n, 1)

    def closure():
        opt.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    counts.append(n)
""",
}

#: loss and metric modules, a checkpointed block and gradient accumulation at once, on DEVICE: on
#: CUDA the autograd engine (backward hooks, the recomputation) runs on a thread of its own
ON_DEVICE = """
from torch.utils.checkpoint import checkpoint


class Accuracy(nn.Module):
    def forward(self, logits, y):
        return (logits.argmax(-1) == y).float().mean()


block = nn.Sequential(nn.Linear(8, 64), nn.ReLU()).to(DEVICE)
head = nn.Linear(64, 4).to(DEVICE)
criterion, accuracy = nn.CrossEntropyLoss(), Accuracy()
opt = torch.optim.AdamW([*block.parameters(), *head.parameters()], lr=1e-3)
ACCUM = 2
for _ in range(STEPS):
    total = 0
    for _ in range(ACCUM):
        n = size()
        x, y = torch.randn(n, 8, device=DEVICE), torch.randint(0, 4, (n,), device=DEVICE)
        logits = head(checkpoint(block, x, use_reentrant=False))
        (criterion(logits, y) / ACCUM).backward()
        accuracy(logits, y)
        total += n
    opt.step()
    opt.zero_grad()
    counts.append(total)
"""

#: a model returning its tensors nested in a dataclass, a functional loss, gradient accumulation: the
#: backward that ends each micro-batch is found through the nested output
NESTED_OUTPUT = """
import dataclasses


@dataclasses.dataclass
class Out:
    heads: dict
    note: str = "nested"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.cls = nn.Linear(16, 4)

    def forward(self, x):
        return Out(heads={"cls": (self.cls(self.body(x).relu()),)})


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ACCUM = 3
for _ in range(STEPS):
    total = 0
    for _ in range(ACCUM):
        n = size()
        x, y = torch.randn(n, 8), torch.randint(0, 4, (n,))
        (F.cross_entropy(model(x).heads["cls"][0], y) / ACCUM).backward()
        total += n
    opt.step()
    opt.zero_grad()
    counts.append(total)
"""

#: a parameter-less preprocessing module called on the batch before the model
PREPROCESS = """
class Standardize(nn.Module):
    def forward(self, x):
        return (x - x.mean(0)) / (x.std(0) + 1e-5)


prep = Standardize()
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
print(f"PARAMS {sum(p.numel() for p in model.parameters())}", flush=True)
criterion = nn.CrossEntropyLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(STEPS):
    n = size()
    x, y = torch.randn(n, 8), torch.randint(0, 4, (n,))
    loss = criterion(model(prep(x)), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    counts.append(n)
"""

#: gradient accumulation under DDP: `no_sync` for all micro-batches but the last, a loss module
DDP_NO_SYNC = """
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
criterion = nn.CrossEntropyLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ACCUM = 3
for _ in range(STEPS):
    total = 0
    for i in range(ACCUM):
        n = size()
        x, y = torch.randn(n, 8), torch.randint(0, 4, (n,))
        if i < ACCUM - 1:
            with model.no_sync():
                (criterion(model(x), y) / ACCUM).backward()
        else:
            (criterion(model(x), y) / ACCUM).backward()
        total += n
    opt.step()
    opt.zero_grad()
    counts.append(total)
dist.destroy_process_group()
"""


def _cuda() -> bool:
    return bool(torch.cuda.is_available())


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFSCOPE_")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return env


def _record(
    tmp_path: Path, body: str, launch: list[str], *flags: str, **consts: object
) -> dict[int, list[int]]:
    """Run the script under `perfscope run`; the script's own counts by rank (one file per rank)."""
    import subprocess

    consts = {"STEPS": STEPS, **consts}
    header = "".join(f"{k} = {v}\n" for k, v in consts.items())
    script = tmp_path / "train.py"
    script.write_text(header + textwrap.dedent(HEAD) + textwrap.dedent(body) + "done()\n")
    out = subprocess.run(
        [str(BIN / "perfscope"), "run", "--store", "S", "--poll-hz", "0", *flags, "--", *launch, script.name],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (tmp_path / "stdout.txt").write_text(out.stdout)
    assert "Traceback" not in out.stderr and "recording stopped" not in out.stderr, out.stderr[-3000:]
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in tmp_path.glob("counts-*.json")}


def _stored(tmp_path: Path) -> dict[int, list[int]]:
    with perfscope.open_store(tmp_path / "S") as store:
        rows = store.query("SELECT rank, step, samples FROM steps ORDER BY rank, step").to_pylist()
    by_rank: dict[int, list[int]] = {}
    for r in rows:
        by_rank.setdefault(r["rank"], []).append(r["samples"])
    return by_rank


@pytest.mark.parametrize(
    "shape",
    [
        "loss_module",
        "functional_loss",
        "dict_batch",
        "tuple_batch",
        "metric_module",
        "model_twice",
        "backbone_and_head",
        "frozen_teacher",
        "lbfgs_closure",
    ],
)
def test_samples_are_the_trained_models_batch(tmp_path: Path, shape: str) -> None:
    own = _record(tmp_path, SHAPES[shape], [sys.executable])
    assert len(own) == 1 and len(own[0]) == STEPS and len(set(own[0])) > 1  # sizes vary
    assert _stored(tmp_path) == {0: own[0]}


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_recomputation_is_backward(tmp_path: Path, reentrant: bool) -> None:
    own = _record(tmp_path, SHAPES["checkpointed"], [sys.executable], REENTRANT=reentrant)
    assert _stored(tmp_path) == {0: own[0]}
    with perfscope.open_store(tmp_path / "S") as store:
        spans = store.query("SELECT name, parent, count(*) AS n FROM spans GROUP BY ALL").to_pylist()
    # the recomputation inside backward is backward's, never a forward of its own
    assert not [s for s in spans if s["name"] == "forward" and s["parent"] is not None], spans
    assert {s["name"]: s["n"] for s in spans if s["parent"] is None}["backward"] == STEPS


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def test_modules_checkpoint_and_accumulation_on_a_device(tmp_path: Path, device: str) -> None:
    own = _record(tmp_path, ON_DEVICE, [sys.executable], DEVICE=repr(device))
    assert len(own[0]) == STEPS
    assert _stored(tmp_path) == own


def test_gradient_accumulation_with_ddp_no_sync(tmp_path: Path) -> None:
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2"]
    own = _record(tmp_path, DDP_NO_SYNC, torchrun)
    assert sorted(own) == [0, 1] and own[0] != own[1]  # each rank draws its own sizes
    assert _stored(tmp_path) == own


def test_accumulation_with_a_nested_output(tmp_path: Path) -> None:
    own = _record(tmp_path, NESTED_OUTPUT, [sys.executable])
    assert _stored(tmp_path) == own
    with perfscope.open_store(tmp_path / "S") as store:
        bwd = store.query(
            "SELECT step, count(*) AS n FROM spans WHERE name = 'backward' GROUP BY step ORDER BY step"
        ).to_pylist()
    assert [b["n"] for b in bwd] == [3] * STEPS  # each micro-batch's backward is seen


def test_model_facts_from_the_model_not_a_preprocessing_module(tmp_path: Path) -> None:
    own = _record(tmp_path, PREPROCESS, [sys.executable])
    assert _stored(tmp_path) == own
    with perfscope.open_store(tmp_path / "S") as store:
        run = store.query("SELECT param_count, model FROM runs").to_pylist()
    params = [
        line for line in (tmp_path / "stdout.txt").read_text().splitlines() if line.startswith("PARAMS ")
    ]
    # the script's own count of its model's parameters, not the preprocessing module's none
    assert run == [{"param_count": int(params[0].split()[1]), "model": "Sequential"}]


def test_batch_size_given_is_stored(tmp_path: Path) -> None:
    _record(tmp_path, SHAPES["loss_module"], [sys.executable], "--batch-size", "7")
    assert _stored(tmp_path) == {0: [7] * STEPS}


def test_batch_size_given_counts_every_micro_batch_of_an_accumulating_job(tmp_path: Path) -> None:
    """Issue 32: `--batch-size` is the loader's batch (one micro-batch); a step of gradient accumulation
    (3 micro-batches, DDP's no_sync for the first 2) holds 3 of them, so its samples are 3 times it,
    not once (the samples/s was 3-4 times too low); the model's loss module adds no micro-batch."""
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2"]
    own = _record(tmp_path, DDP_NO_SYNC, torchrun, "--batch-size", "7")
    assert sorted(own) == [0, 1]
    assert _stored(tmp_path) == {0: [21] * STEPS, 1: [21] * STEPS}
