"""Per-operation tables of 3D-parallel jobs (`perfscope import op-table FILE --meta META.yaml`): one row
per operation with Megatron-LM's op names, in the schema of the public straggler study
(ByteDance-Seed/StragglerAnalysis): dp_rank, stage, rank, step, optype, start_ts, duration (seconds),
seq_id, and optionally mc, gmc, mb_id. Parquet or CSV.

Compute ops (forward-compute, backward-compute, optimizer, gc ...) become `spans` of their rank's
step (depth 1, the phase as parent) and the step's phase columns; pipeline send/recv become
point-to-point `comm` rows with the peer stage's rank (with interleaving, vpp > 1, the stage of the
next or previous virtual stage of the transfer's model chunk: `_transfer_chunks`); the data-parallel
reduce-scatter / all-gather, the embedding and layernorm all-reduces and the gradient-norm all-reduce
become collectives on their process group (`comm.group_ranks`). Every rank's coordinates go to
`ranks`, the sizes to `runs`.

Ranks are laid out as Megatron-LM does: rank = ((stage·dp + dp_rank)·cp + cp_rank)·tp + tp_rank, so
tp_rank = rank mod tp and cp_rank = (rank div tp) mod cp. A table whose start_ts restarts at every
step (the study's does: a step starts before the one before it is half done) has its steps laid end to
end in step order; one clock for the whole trace is kept as it is, where one rank's next step starts
before another rank's step ends (pipeline stages do).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import PerfscopeError
from .common import (
    MAX_RANKS,
    MAX_ROWS,
    ImportOptions,
    ImportResult,
    RunImport,
    StepTimes,
    _row,
    check_run_id,
    default_run_id,
    shown,
)
from .intervals import length, merge

ORIGIN = "op-table"
REQUIRED = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration", "seq_id")
#: columns read when present: the micro-batch and the local model chunk of a compute op (-1 elsewhere)
OPTIONAL = ("mb_id", "mc")
#: a transfer belongs to the compute of its direction that ended this little after it started (clock
#: rounding: the study's float32 seconds)
SLACK_NS = 100_000
#: keys a meta file may hold (the study's), and the flags they stand for
META_KEYS = {
    "dp_size": "dp",
    "pp_size": "pp",
    "tp_size": "tp",
    "dsp_size": "cp",
    "cp_size": "cp",
    "vpp_size": "vpp",
}
META_IGNORED = ("trial_name", "run_id", "world_size")
#: a meta file is a few lines; anything larger is not one
MAX_META_BYTES = 1 << 16
#: seconds a trace may span: a year
MAX_SECONDS = 3.2e7
#: seconds past which a step is no training step: a table in microseconds or milliseconds read as
#: seconds (its steps 10^6 or 10^3 times too long) is warned about
PLAUSIBLE_STEP_S = 3600.0
MAX_STEP = 10**12

#: Megatron-LM op -> (phase, comm kind): kind None = compute on the rank; 'p2p' = pipeline transfer;
#: else the collective's group: 'dp' (same stage, tp, cp), 'embedding' (first and last stage, same
#: dp, tp, cp), 'tp' (same dp, stage, cp), 'world' (the gradient norm, every rank).
OPS: dict[str, tuple[str, str | None, str | None]] = {
    "forward-compute": ("forward", None, None),
    "backward-compute": ("backward", None, None),
    "optimizer": ("optimizer", None, None),
    "gc": ("other", None, None),
    "forward-send": ("forward", "p2p", "send"),
    "forward-recv": ("forward", "p2p", "recv"),
    "backward-send": ("backward", "p2p", "send"),
    "backward-recv": ("backward", "p2p", "recv"),
    "grads-reduce-scatter": ("sync", "dp", "reduce_scatter_tensor"),
    "params-all-gather": ("forward", "dp", "all_gather_into_tensor"),
    "separate-grads-all-reduce": ("sync", "dp", "allreduce"),
    "embedding-grads-all-reduce": ("sync", "embedding", "allreduce"),
    "layernorm-grads-all-reduce": ("sync", "tp", "allreduce"),
    "optimizer-clip-main-grad": ("optimizer", "world", "allreduce"),
}


def parse_meta(path: Path) -> dict[str, int]:
    """The layout a flat `key: value` YAML meta file gives (the study's meta-*.yaml), or one line."""
    try:
        raw = path.read_bytes()[: MAX_META_BYTES + 1]
    except OSError as exc:
        raise PerfscopeError(f"{path}: cannot read the meta file ({exc.strerror})") from None
    if len(raw) > MAX_META_BYTES:
        raise PerfscopeError(f"{path}: not a meta file (over {MAX_META_BYTES:,} bytes)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise PerfscopeError(f"{path}: the meta file is not UTF-8 text") from None
    out: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if not stripped or stripped == "---":
            continue
        key, sep, value = stripped.partition(":")
        key, value = key.strip(), value.strip().strip("'\"")
        if not sep or not key or not value or line[:1].isspace() or not key.replace("_", "").isalnum():
            raise PerfscopeError(
                f"{path}:{n}: only flat 'key: value' lines are read (dp_size, pp_size, tp_size, "
                f"dsp_size, vpp_size), not {shown(line)}"
            )
        if key == "world_size" and _whole(value):
            out["world"] = int(value)
            continue
        if key in META_IGNORED:
            continue
        if key not in META_KEYS:
            raise PerfscopeError(f"{path}:{n}: unknown key {shown(key)}; known: {', '.join(META_KEYS)}")
        if not _whole(value):
            raise PerfscopeError(f"{path}:{n}: {key} must be a whole number, not {shown(value)}")
        out[META_KEYS[key]] = int(value)
    if "dp" not in out or "pp" not in out:
        raise PerfscopeError(f"{path}: the meta file must give dp_size and pp_size")
    world = out.pop("world", None)
    product = out["dp"] * out["pp"] * out.get("tp", 1) * out.get("cp", 1)
    if world is not None and world != product:
        raise PerfscopeError(
            f"{path}: world_size {world} is not dp·pp·tp·dsp = {product}; the meta file contradicts itself"
        )
    return out


def _whole(value: str) -> bool:
    """Whether a meta value is a whole number int() reads: ASCII digits only ('²' and '٣' are
    digits to str.isdigit, not to int), at most 7 of them."""
    return value.isascii() and value.isdigit() and len(value) <= 7


def check_layout(layout: dict[str, int | None]) -> dict[str, int]:
    """dp, pp, tp, cp, vpp as whole numbers of at least 1 whose product is a possible job; a size not
    given is 1, a size given as 0 is refused (it was read as 1)."""
    out = {}
    for k in ("dp", "pp", "tp", "cp", "vpp"):
        given = layout.get(k)
        out[k] = 1 if given is None else int(given)
    for key in ("dp", "pp"):
        if layout.get(key) is None:
            raise PerfscopeError(
                f"op-table: give --meta META.yaml, or --dp and --pp (and --tp, --cp) ({key})"
            )
    for key, value in out.items():
        if value < 1:
            names = [m for m, flag in META_KEYS.items() if flag == key]
            raise PerfscopeError(
                f"op-table: the {key} size (--{key}, or {' or '.join(names)} in the meta file) is {value}; "
                "every size must be 1 or more"
            )
    world = out["dp"] * out["pp"] * out["tp"] * out["cp"]
    if world > MAX_RANKS:
        raise PerfscopeError(f"op-table: dp·pp·tp·cp = {world:,} ranks; no job has more than {MAX_RANKS:,}")
    return out


def _read(path: Path) -> pa.Table:
    name = path.name.lower()
    try:
        if name.endswith(".csv") or name.endswith(".csv.gz"):
            import pyarrow.csv as pacsv

            return pacsv.read_csv(path)
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        if pf.metadata.num_rows > MAX_ROWS:
            raise PerfscopeError(f"{path}: {pf.metadata.num_rows:,} rows; no op table holds that many")
        missing = [c for c in REQUIRED if c not in pf.schema_arrow.names]
        if missing:
            raise PerfscopeError(f"{path}: not an op table: no column {', '.join(missing)}")
        return pf.read(columns=[c for c in pf.schema_arrow.names if c in (*REQUIRED, *OPTIONAL)])
    except PerfscopeError:
        raise
    except (pa.ArrowException, OSError, ValueError) as exc:
        kind = "CSV" if ".csv" in name else "Parquet"
        raise PerfscopeError(f"{path}: not a readable {kind} op table ({shown(exc, 120)})") from None


def _int_column(t: pa.Table, name: str, path: Path, lo: int, hi: int) -> np.ndarray:
    col = t.column(name)
    if col.null_count:
        raise PerfscopeError(f"{path}: column {name} has {col.null_count:,} empty values")
    try:
        values = np.asarray(col.to_numpy(zero_copy_only=False))
        if values.dtype.kind == "f":
            if not np.isfinite(values).all() or (values != np.round(values)).any():
                raise ValueError
        elif values.dtype.kind not in "iu":
            raise ValueError
    except (ValueError, TypeError, pa.ArrowException):
        raise PerfscopeError(f"{path}: column {name} must hold whole numbers") from None
    if len(values) and (values.min() < lo or values.max() > hi):
        bad = values[(values < lo) | (values > hi)][0]
        raise PerfscopeError(f"{path}: column {name} holds {shown(bad)}; it must be {lo} to {hi:,}")
    return values.astype(np.int64)


def _float_column(t: pa.Table, name: str, path: Path) -> np.ndarray:
    """Seconds as float64; a column of another type (true/false, timestamps, text) is refused: a
    boolean read as 1 s, a timestamp as seconds since 1970."""
    col = t.column(name)
    kind = col.type
    number = pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind)
    if not (number or pa.types.is_null(kind)):  # null: a CSV column of NaN only, refused below
        raise PerfscopeError(
            f"{path}: column {name} must hold numbers (seconds), not values of type {shown(str(kind), 40)}"
        )
    try:
        values = np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)
    except (ValueError, TypeError, pa.ArrowException):
        raise PerfscopeError(f"{path}: column {name} must hold numbers (seconds)") from None
    bad = ~np.isfinite(values) | (values < 0) | (values > MAX_SECONDS)
    if bad.any():
        raise PerfscopeError(
            f"{path}: column {name} holds {shown(values[bad][0])} at row {int(np.argmax(bad)):,}; "
            f"it must be seconds from 0 to {MAX_SECONDS:.0e} (no NaN, no negative)"
        )
    return values


def _text_column(col: pa.ChunkedArray, name: str, path: Path) -> np.ndarray:
    """Op names as Python str: text, or bytes that are UTF-8 text (a CSV cell of other bytes reads
    as binary, as does a Parquet BYTE_ARRAY without a string annotation); anything else refused."""
    try:
        text = col.cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise PerfscopeError(f"{path}: column {name} must be UTF-8 text (the op names)") from None
    return np.asarray(text.to_numpy(zero_copy_only=False), dtype=object)


def _peer_stage(s: int, c: int, to_next: bool, pp: int, vpp: int) -> int | None:
    """The stage at the other end of a pipeline transfer made by stage `s` for its model chunk `c`
    (Megatron-LM's interleaved layout: virtual stage c·pp + s), toward the next virtual stage
    (`to_next`: a forward send, a backward recv) or the previous one; None at the model's ends."""
    v = c * pp + s + (1 if to_next else -1)
    if pp == 1 or not 0 <= v < pp * vpp:
        return None
    return v % pp


def _transfer_chunks(
    ops: np.ndarray,
    optype: np.ndarray,
    start_ns: np.ndarray,
    dur_ns: np.ndarray,
    mc: np.ndarray | None,
    pp: int,
    vpp: int,
) -> dict[int, int | None]:
    """The model chunk of each pipeline transfer of one rank's step (`ops`, in start order) under
    interleaving: a send carries the output of the last compute of its direction that ended before it
    started, a recv feeds the next compute of its direction. A compute's chunk is its `mc`, else
    Megatron-LM's schedule's: the k-th forward runs chunk (k mod pp·vpp) div pp, the k-th backward
    the reverse. None: no such compute (a transfer before the first or after the last)."""
    out: dict[int, int | None] = {}
    for direction, forward in (("forward", True), ("backward", False)):
        sends = [i for i in ops.tolist() if optype[i] == f"{direction}-send"]
        recvs = [i for i in ops.tolist() if optype[i] == f"{direction}-recv"]
        if not sends and not recvs:
            continue
        comp = np.array([i for i in ops.tolist() if optype[i] == f"{direction}-compute"], dtype=np.int64)
        k = np.arange(len(comp))
        chunks = (k % (pp * vpp)) // pp
        if not forward:
            chunks = vpp - 1 - chunks
        if mc is not None and len(comp):
            chunks = np.where(mc[comp] >= 0, mc[comp], chunks)
        c_start = start_ns[comp]
        c_end = np.maximum.accumulate(start_ns[comp] + dur_ns[comp]) if len(comp) else c_start
        for i in sends:
            j = int(np.searchsorted(c_end, start_ns[i] + SLACK_NS, side="right")) - 1
            out[i] = int(chunks[j]) if j >= 0 else None
        for i in recvs:
            j = int(np.searchsorted(c_start, start_ns[i], side="left"))
            out[i] = int(chunks[j]) if j < len(comp) else None
    return out


def _warn_long_steps(imp: RunImport, steps: np.ndarray, seconds: np.ndarray) -> None:
    """One line when a step lasts longer than any training step plausibly does (PLAUSIBLE_STEP_S):
    the table is most likely in microseconds or milliseconds, read as seconds."""
    i = int(np.argmax(seconds))
    if float(seconds[i]) > PLAUSIBLE_STEP_S:
        imp.warn(
            f"step {int(steps[i])} lasts {float(seconds[i]):,.0f} s; no training step takes over "
            f"{PLAUSIBLE_STEP_S / 3600:.0f} h: start_ts and duration are read as seconds (a table in "
            "milliseconds or microseconds must be divided by 1e3 or 1e6 first)"
        )


def _phase_times(phases: dict[str, list[tuple[int, int]]], step_ns: int) -> dict[str, int]:
    """Each phase's time in a rank's step: the union of its ops' intervals (ops that overlap or run at one
    instant count once), and the phases together never past the step (scaled down to it where ops of
    different phases overlap)."""
    took = {k: int(length(merge(np.array(iv, dtype=np.float64)))) if iv else 0 for k, iv in phases.items()}
    total = sum(took.values())
    if total > step_ns:
        took = {k: v * step_ns // total for k, v in took.items()}
    return took


def import_files(paths: Sequence[Path], opts: ImportOptions) -> ImportResult:
    """`perfscope import op-table` without a layout: refused in one line (the table cannot say it)."""
    raise PerfscopeError("op-table: give --meta META.yaml, or --dp N --pp N [--tp N --cp N]")


def import_op_table(
    paths: Sequence[Path], opts: ImportOptions, layout: dict[str, int | None], meta: Path | None = None
) -> ImportResult:
    """Import one op table as one run, with the parallel layout from `meta` or `layout`."""
    if len(paths) != 1:
        raise PerfscopeError("op-table: give one table (it holds every rank)")
    if meta is not None:
        given = {k: v for k, v in layout.items() if v is not None}
        if given:
            raise PerfscopeError("op-table: give --meta or the sizes (--dp, --pp ...), not both")
        layout = dict(parse_meta(meta))
    lay = check_layout(layout)
    path = paths[0]
    t = _read(path)
    missing = [c for c in REQUIRED if c not in t.column_names]
    if missing:
        raise PerfscopeError(f"{path}: not an op table: no column {', '.join(missing)}")
    if t.num_rows == 0:
        raise PerfscopeError(f"{path}: the op table has no rows")
    dp, pp, tp, cp = lay["dp"], lay["pp"], lay["tp"], lay["cp"]
    world = dp * pp * tp * cp
    dp_rank = _int_column(t, "dp_rank", path, 0, dp - 1)
    stage = _int_column(t, "stage", path, 0, pp - 1)
    rank = _int_column(t, "rank", path, 0, world - 1)
    step = _int_column(t, "step", path, 0, MAX_STEP)
    _int_column(t, "seq_id", path, 0, MAX_ROWS)
    start = _float_column(t, "start_ts", path)
    dur = _float_column(t, "duration", path)
    optype_col = t.column("optype")
    if optype_col.null_count:
        raise PerfscopeError(f"{path}: column optype has {optype_col.null_count:,} empty values")
    optype = _text_column(optype_col, "optype", path)
    vpp = lay["vpp"]
    mc: np.ndarray | None = None
    if "mc" in t.column_names:  # the local model chunk of a compute op, -1 (or empty) elsewhere
        i_mc = t.column_names.index("mc")
        t = t.set_column(i_mc, "mc", t.column("mc").fill_null(-1))
        mc = _int_column(t, "mc", path, -1, MAX_ROWS)
        if len(mc) and int(mc.max()) >= vpp:
            raise PerfscopeError(
                f"{path}: column mc holds model chunk {int(mc.max())}, but the layout has vpp {vpp}: "
                "give --vpp (or vpp_size in the meta file)"
            )

    # each rank has one place in the layout, and it is Megatron-LM's
    coords: dict[int, tuple[int, int]] = {}
    pairs = np.unique(np.stack([rank, dp_rank, stage], axis=1), axis=0)
    for r, d, s in pairs.tolist():
        if r in coords:
            raise PerfscopeError(f"{path}: rank {r} appears at two places (dp rank, stage) of the layout")
        if (r // (tp * cp)) != s * dp + d:
            raise PerfscopeError(
                f"{path}: rank {r} at dp rank {d}, stage {s} does not fit the layout dp {dp} x pp {pp} x "
                f"tp {tp} x cp {cp} (Megatron-LM's rank order); check the sizes"
            )
        coords[r] = (d, s)

    run_id = check_run_id(opts.run_id or default_run_id(ORIGIN, opts.experiment, [path]))
    unknown = sorted({o for o in set(optype.tolist()) if o not in OPS})

    # steps laid end to end when each restarts its clock
    steps = np.unique(step)
    end = start + dur
    order = np.searchsorted(steps, step)
    lo = np.full(len(steps), np.inf)
    hi = np.zeros(len(steps))
    np.minimum.at(lo, order, start)
    np.maximum.at(hi, order, end)
    # a clock restarted at each step: a step starts before the one before it is half done (on one clock,
    # steps of different ranks overlap only at their edges: the last stage ends step k after the
    # first has begun step k + 1)
    overlapping = len(steps) > 1 and bool((lo[1:] < (lo[:-1] + hi[:-1]) / 2).any())
    offsets = np.concatenate([[0.0], np.cumsum(hi - lo)[:-1]]) - lo if overlapping else np.zeros(len(steps))
    if float((hi + offsets).max()) > MAX_SECONDS:
        raise PerfscopeError(
            f"{path}: its steps laid end to end span over {MAX_SECONDS:.0e} s; no job runs that long"
        )
    base_ns = int(path.stat().st_mtime) * 10**9
    start_ns = base_ns + np.round((start + offsets[order]) * 1e9).astype(np.int64)
    dur_ns = np.round(dur * 1e9).astype(np.int64)
    step_start_ns = base_ns + np.round((lo + offsets) * 1e9).astype(np.int64)

    def rank_of(d: int, s: int, r: int) -> int:
        inner = r % (tp * cp)
        return (s * dp + d) * tp * cp + inner

    #: each process group's size and members' text, made once: spelled out for each of its calls, a
    #: group of 262,144 data-parallel ranks took 1.7 MB and a list of as many ints per row
    groups: dict[tuple[Any, ...], tuple[int, str]] = {}

    def group(kind: str, r: int, d: int, s: int, peer: int | None) -> tuple[int, str]:
        """The size and members' text of the group of rank `r` (dp rank `d`, stage `s`) for a call of
        `kind` ('p2p' with `peer`, 'dp', 'embedding', 'tp', else the world)."""
        inner = r % (tp * cp)
        key: tuple[Any, ...]
        if kind == "p2p" and peer is not None:
            key = (kind, min(r, peer), max(r, peer))
        elif kind in ("dp", "embedding", "tp"):
            key = (
                (kind, s, inner)
                if kind == "dp"
                else (kind, d, inner)
                if kind == "embedding"
                else (kind, r - r % tp)
            )
        else:
            key = ("world",)
        got = groups.get(key)
        if got is None:
            if key[0] == "p2p":
                members = list(key[1:])
            elif kind == "dp":
                members = [rank_of(k, s, r) for k in range(dp)]
            elif kind == "embedding":
                members = sorted({rank_of(d, 0, r), rank_of(d, pp - 1, r)})
            elif kind == "tp":
                members = [r - r % tp + k for k in range(tp)]
            else:
                members = list(range(world))
            got = groups[key] = (len(members), ",".join(map(str, members)))
        return got

    with RunImport(opts, ORIGIN, run_id) as imp:
        for r in sorted(coords):
            d, s = coords[r]
            row = {"rank": r, "hostname": "", "clock_offset_ns": 0, "device_name": "",
                   "dp_rank": d, "pp_stage": s, "tp_rank": r % tp, "cp_rank": (r // tp) % cp}  # fmt: skip
            imp.rows("ranks", [_row("ranks", row)])
        imp.result.ranks = len(coords)
        if unknown:
            imp.warn(
                f"{len(unknown):,} op type(s) perfscope does not know as Megatron-LM's "
                f"({', '.join(shown(u, 30) for u in unknown[:5])}{' ...' if len(unknown) > 5 else ''}): "
                "kept as compute of phase 'other'"
            )

        unplaced: dict[str, int] = {}  # interleaved transfers whose model chunk is unknown, by op
        # per (step, sender, receiver, direction): sends less recvs, 0 where every transfer has its other side
        balance: dict[tuple[int, int, int, bool], int] = {}
        idx = np.lexsort((start, step, rank))
        bounds = np.flatnonzero(np.diff(rank[idx]) | np.diff(step[idx])) + 1
        for chunk in np.split(idx, bounds):
            r, st = int(rank[chunk[0]]), int(step[chunk[0]])
            d, s = coords[r]
            # each phase's ops' intervals, in ns from the step's start (exact in float64)
            phases: dict[str, list[tuple[int, int]]] = {"forward": [], "backward": [], "optimizer": []}
            s0 = int(step_start_ns[np.searchsorted(steps, st)])
            comm_iv = []
            comm_total = 0
            seq = 0
            model_chunk = _transfer_chunks(chunk, optype, start_ns, dur_ns, mc, pp, vpp) if vpp > 1 else {}
            for i in chunk.tolist():
                op = optype[i]
                phase, kind, fn = OPS.get(op, ("other", None, None))
                if kind is None:
                    if phase in phases:
                        phases[phase].append((int(start_ns[i]) - s0, int(start_ns[i] + dur_ns[i]) - s0))
                    imp.span(r, st, op, int(start_ns[i]), int(dur_ns[i]), clock="cuda", parent=phase, depth=1)
                    continue
                peer: int | None = None
                if kind == "p2p":
                    to_next = op.startswith("forward") == (fn == "send")
                    c = model_chunk.get(i, 0) if vpp > 1 else 0
                    ps = _peer_stage(s, c, to_next, pp, vpp) if c is not None else None
                    if ps is None:
                        if c is None:
                            unplaced[op] = unplaced.get(op, 0) + 1
                        else:
                            end = "last" if to_next else "first"
                            edge = (
                                f"{op} at the {end} stage has no peer: kept as compute"
                                if vpp == 1
                                else f"{op} of the model's {end} chunk (stage {s}, model chunk {c}) has no "
                                "peer: kept as compute"
                            )
                            if edge not in imp.result.warnings:
                                imp.warn(edge)
                        imp.span(
                            r, st, op, int(start_ns[i]), int(dur_ns[i]), clock="cuda", parent=phase, depth=1
                        )
                        continue
                    peer = rank_of(d, ps, r)
                    sender, receiver = (r, peer) if fn == "send" else (peer, r)
                    key = (st, sender, receiver, op.startswith("forward"))
                    balance[key] = balance.get(key, 0) + (1 if fn == "send" else -1)
                size, members = group(kind, r, d, s, peer)
                comm_iv.append((start_ns[i], start_ns[i] + dur_ns[i]))
                comm_total += int(dur_ns[i])
                imp.comm(
                    r, st, seq, str(fn), None, int(start_ns[i]), int(dur_ns[i]), clock="cuda",
                    extra={"peer": peer, "group_size": size, "exposed_ns": int(dur_ns[i]),
                           "is_async": False, "phase": phase, "name": op, "group_ranks": members},
                )  # fmt: skip
                seq += 1
            last = int((start_ns[chunk] + dur_ns[chunk]).max())
            took = _phase_times(phases, max(0, last - s0))
            imp.step(
                r,
                st,
                StepTimes(
                    start_ns=s0,
                    step_ns=max(0, last - s0),
                    forward_ns=took["forward"],
                    backward_ns=took["backward"],
                    optimizer_ns=took["optimizer"],
                    sync_exposed_ns=int(length(merge(np.array(comm_iv, dtype=np.float64)))) if comm_iv else 0,
                    comm_total_ns=comm_total,
                    comm_count=seq,
                ),
                clock="cuda",
            )
        _warn_long_steps(imp, steps, hi - lo)
        if overlapping:
            imp.warn("start_ts restarts at every step: steps are laid end to end in step order")
        unpaired = sum(abs(v) for v in balance.values())
        if unpaired:
            imp.warn(
                f"{unpaired:,} pipeline transfer(s) have no other side at their peer (a send without its "
                "recv or the reverse, in the same step and direction): the what-if pairs each rank pair's "
                "transfers in order and may pair these wrongly"
            )
        if unplaced:
            counts = ", ".join(f"{n:,} {shown(o, 30)}" for o, n in sorted(unplaced.items()))
            imp.warn(
                f"interleaved pipeline (vpp {vpp}): {sum(unplaced.values()):,} transfer(s) ({counts}) with "
                "no compute of their direction to belong to (a send after one, a recv before one): their "
                "model chunk, so their peer stage, is unknown; kept as compute"
            )
        return imp.finish(
            world_size=world,
            started_ns=int(step_start_ns[0]),
            backend="nccl",
            dp_size=dp,
            pp_size=pp,
            tp_size=tp,
            cp_size=cp,
            tags={"source_file": path.name, **({"vpp_size": lay["vpp"]} if lay["vpp"] > 1 else {})},
        )
