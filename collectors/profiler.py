"""`perfscope.profile(...)`: the context manager a training script opens on every rank. It owns the
run's lifecycle (identity, store writer, poller, hooks) and the public recording API."""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from perfscope.store.objectstore import Uploader, is_s3_url, start_upload
from perfscope.store.writer import StoreWriter

from . import ddp, horovod, identity, manual
from .clocks import HostClock, HostMarks, perf_ns
from .device_memory import DeviceMemory
from .device_memory import for_torch as device_memory_for_torch
from .dist_recorder import DistRecorder
from .faults import Faults
from .flops import StepFlopCounter
from .host_metrics import HostSampler
from .layout import Layout, LayoutError
from .layout import resolve as resolve_layout
from .nvml import GpuTelemetry, NoGpus, open_gpus
from .nvtx_ranges import NvtxRanges
from .phases import IDLE, Timeline, infer_samples
from .poller import HostClaim, Poller
from .rendezvous import Placement, place
from .run_metadata import cuda_device_name, loader_facts, ranks_row, runs_row, split_keywords, tags_json
from .settings import autocast_now
from .step_rows import CANONICAL, END, NAME

DATA = CANONICAL["data"]

#: set to 1 to turn perfscope.profile into a pass-through without touching the script
DISABLE_ENV = "PERFSCOPE_DISABLE"

#: the first rows of short steps are handed to the store writer after this much step time (so the
#: first segment comes at once); after that the steps are held frozen and the writer builds their
#: rows at each roll (Timeline.wake, take_rows): a SIGKILL loses no more than the writer's interval
HOLD_ROWS_S = 0.05

#: a phase this long after its step began, outside prof.steps: one warning that prof.step() is missing
NO_STEP_WARN_S = 120.0
#: module forward calls the DDP finder looks at before it stops looking (`_find_ddp_models`): the
#: first steps of any model, at about a microsecond a call
FIND_DDP_CALLS = 20_000

#: called with every Profiler as it starts recording (`perfscope run` steps aside for a script's own)
START_LISTENERS: list[Callable[[Profiler], None]] = []


class Phase:
    """A named phase, reusable and re-entrant: `with prof.phase("forward"): ...`.

    An exception inside is recorded in the span's `error` column and propagates untouched.
    Entry and exit do Timeline.enter's and Timeline.exit's common case themselves (host timing, no
    NVTX, a step open for less than NO_STEP_WARN_S, all in one comparison with the timeline's
    `deadline`), touching as little as they can: a phase runs right after a torch op has filled the
    CPU's caches, where every object and line of code it touches costs several times what it does
    in a loop of phases alone (BENCHMARKS.md, "the hot path by part")."""

    __slots__ = ("_canon", "_prof", "_tl", "name")

    def __init__(self, prof: Profiler, name: str) -> None:
        self._prof = prof
        self.name = name
        self._canon = CANONICAL.get(name, -1)
        #: the profile's timeline once it records (its deadline is -1 when it does not), else IDLE
        self._tl: Timeline = prof._timeline or IDLE

    def __enter__(self) -> Phase:
        tl = self._tl
        t = perf_ns()
        try:
            if t <= tl.deadline:
                stack = tl.stack
                span = [self.name, stack[-1] if stack else None, len(stack), t, t, None, None, self._canon]
                stack.append(span)  # see step_rows.py for the span's fields
                tl.cur.spans.append(span)  # type: ignore[union-attr]  # deadline >= 0: a step is open
                return self
            tl = self._prof._live  # type: ignore[assignment]
            if tl is not None:
                tl.enter(self.name)
        except Exception as exc:
            self._prof._internal_error(exc)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        tl = self._tl
        try:
            stack = tl.stack
            if exc_type is None and tl.deadline >= 0 and stack and stack[-1][NAME] == self.name:
                stack.pop()[END] = perf_ns()
                return
            live = self._prof._live
            if live is not None:
                live.exit_named(self.name, exc_type)
        except Exception as err:
            self._prof._internal_error(err)


class _Guard:
    """`with self._guard:` around our own bookkeeping: an exception of ours stops recording with a
    warning instead of reaching the training loop. (Not for the user's code: that propagates.)"""

    __slots__ = ("_prof",)

    def __init__(self, prof: Profiler) -> None:
        self._prof = prof

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if exc_type is None or not issubclass(exc_type, Exception):
            return False
        assert isinstance(exc, Exception)
        self._prof._internal_error(exc)
        return True


class StepBlock:
    """What `prof.step()` returns. The call itself has ended the step; as a context manager,
    `with prof.step(): ...` makes the block one step instead: it ends when the block ends, and the
    time between blocks (waiting for the next batch) counts in the next block's step. An exception
    leaving the block fails its step: its spans are kept with their error, it gets no steps row."""

    __slots__ = ("_prof",)

    def __init__(self, prof: Profiler) -> None:
        self._prof = prof

    def __enter__(self) -> StepBlock:
        prof = self._prof
        if prof._first_end is not None:  # the first block: its step starts now, not at the profile's start
            prof._first_end = None
            with prof._guard:
                prof._timeline.begin_loop()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        prof = self._prof
        if not prof._recording or prof._in_steps:
            return
        if exc_type is not None:
            with prof._guard:
                prof._timeline.abandon_open_step()
            return
        prof._end_step(None)
        prof._block_ended = True


class Profiler:
    """One rank's recording of one run. Create it with `perfscope.profile(...)`."""

    def __init__(
        self,
        store: str | os.PathLike[str],
        *,
        experiment: str = "default",
        batch_size: int | None = None,
        count_flops: bool = False,
        timing: str = "auto",
        poll_hz: float = 10.0,
        gpu_telemetry: bool = True,
        nvtx: bool = True,
        run_id: str | None = None,
        roll_interval_s: float = 1.0,
        **metadata: Any,
    ) -> None:
        if timing not in ("auto", "host", "cuda"):
            raise ValueError("perfscope.profile: timing must be 'auto', 'host' or 'cuda'")
        if batch_size is not None and "batch_size_per_rank" not in metadata:
            metadata["batch_size_per_rank"] = batch_size
        #: this rank's part: 'worker', 'server' or 'stage:K'; None lets the analyses infer it
        self._role = _role(metadata.pop("role", None))
        #: the parallel layout as given (degrees or a DeviceMesh), read when the rank row is written
        self._parallel = metadata.pop("parallel", None)
        self._layout: Layout | None = None
        self._columns, extra = split_keywords({"experiment": experiment, **metadata})
        self._tags = tags_json(self._columns.pop("tags", None), extra)
        self.store = store
        self.batch_size = self._columns.get("batch_size_per_rank")
        self.count_flops = count_flops and self._columns.get("flops_per_step") is None
        self._timing = timing
        self._poll_hz = poll_hz
        self._gpu_telemetry = gpu_telemetry
        self._nvtx_enabled = nvtx
        self._run_id_arg = run_id
        self._roll_interval_s = roll_interval_s
        self._recording = False
        self._live: Timeline | None = None  # the timeline while recording: what the hot path checks
        self._guard = _Guard(self)
        self._started = False
        self._closed = False
        self._start_rows_written = False
        self._in_steps = 0
        self._block = StepBlock(self)
        self._block_ended = False  # the last step ended with a `with prof.step():` block
        self._step_called = False
        self._steady = False  # step() has only the step to end (see its end)
        self._first_end: tuple[int, Any, int | None] | None = None  # see step()
        self._phases: dict[str, Phase] = {}
        self._hooks: list[Any] = []
        self._dist: DistRecorder | None = None
        self._facts: ddp.ModelFacts | None = None
        self._watched: set[int] = set()  # the models watch() instrumented, by id
        self._loader: tuple[Any, ...] | None = None  # the loop's DataLoader settings (loader_facts)
        self._ddp_finder: Any = None  # the module hook that watches a DDP model the script did not
        self._memory: DeviceMemory | None = None  # the CUDA allocator's peaks per step, on CUDA only
        self._autocast: str | None = None  # autocast in the first module forward (settings.autocast_now)
        self._flops = StepFlopCounter()
        self._poller: Poller | None = None
        self._claim: HostClaim | None = None
        self._gpus: GpuTelemetry = NoGpus()
        self._writer: StoreWriter | None = None
        self._uploader: Uploader | None = None  # a store at s3://: the thread uploading the staging folder
        self._timeline: Timeline = None  # type: ignore[assignment]  # set by start()
        self.faults = Faults(0)
        self.placement: Placement | None = None
        self.run_id: str | None = None
        self.rank = 0
        self.clock = HostClock()
        self.started_ns = self.clock.now()
        self._hostname = ""

    @property
    def world_size(self) -> int:
        return self.placement.world_size if self.placement is not None else 1

    @property
    def recording(self) -> bool:
        """False when perfscope is disabled, failed to start, or the run is closed."""
        return self._recording

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self) -> Profiler:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        self.close()

    def start(self) -> Profiler:
        """Agree on the run with the other ranks, open the store writer, start the poller. A
        failure here leaves a profiler that runs the training code unrecorded, with one warning."""
        if self._started:
            return self
        self._started = True
        if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
            return self
        for listener in list(START_LISTENERS):
            with contextlib.suppress(Exception):
                listener(self)
        try:
            self._start()
            self._recording = True
            self._live = self._timeline
            for phase in self._phases.values():  # made before the start
                phase._tl = self._timeline
        except Exception as exc:
            self.faults.report(
                "start_failed",
                f"perfscope: could not start recording ({type(exc).__name__}: {exc}); "
                "the training runs unrecorded.",
            )
        return self

    def _start(self) -> None:
        me = identity.from_environment()
        self.faults = Faults(me.rank)
        local = self.store
        if is_s3_url(self.store):  # recorded into a local staging folder that a thread uploads
            self._uploader = start_upload(str(self.store), warn=self.faults.report)
            local = self._uploader.staging
        placement = place(me, self._run_id_arg, self.faults, on_gpu=_cuda_available(), store=local)
        self.placement = placement
        self.run_id = placement.run_id
        self.rank = placement.rank
        self.faults.rank = placement.rank
        self.faults.claim_in(local, placement.run_id, placement.world_size)
        self.clock = HostClock(placement.clock_offset_ns)
        self.faults.wall_ns = self.clock.now
        self.started_ns = self.clock.now()
        self._writer = StoreWriter(
            local,
            placement.run_id,
            writer_id=f"r{placement.rank}-p{me.pid}-{secrets.token_hex(3)}",
            roll_interval_s=self._roll_interval_s,
            clean_leftovers=placement.rank == 0,
        )
        self.faults.attach(self._writer)
        self._hostname = me.hostname
        # rows go straight to the writer: one call less per table and step
        self._timeline = Timeline(
            placement.rank, HostMarks(), self.clock, self._writer.extend, default_samples=self.batch_size
        )
        self._timeline.hold_ns = int(HOLD_ROWS_S * 1e9)
        self._timeline.wake = self._writer.pull_soon  # the writer builds the rows of short steps
        self._writer.add_source(self._pull_rows, flat=True)
        self._timeline.emit_flat = self._writer.extend_flat  # what the training thread builds too
        self._timeline.watch_long_steps(int(NO_STEP_WARN_S * 1e9))
        self._timeline.on_long_step = self._no_step_ended
        if self._timing == "cuda" or (self._timing == "auto" and _cuda_in_use()):
            self._use_cuda_timing()
        ranges = NvtxRanges(self._nvtx_enabled)
        if ranges.enabled:
            self._timeline.use_nvtx(ranges)
        self._start_poller(placement, me.hostname)
        self._record_dist()
        self._find_ddp_models()

    def _find_ddp_models(self) -> None:
        """Watch a DDP model the script does not give to prof.watch, as `perfscope run` does: without
        its buckets recorded, a rank waiting in DDP's allreduce for a slower peer would read as
        backward compute, and the victim would be named the straggler. A module forward hook, removed
        once it has seen a DDP model or FIND_DDP_CALLS module calls (the first steps)."""
        torch = sys.modules.get("torch")
        if torch is None:
            return
        calls = [0]

        def seen(module: Any, args: Any) -> None:
            calls[0] += 1
            try:
                if calls[0] == 1:  # the first module forward: inside the model's, under its autocast
                    self._autocast = autocast_now()
                if ddp.is_ddp(module) and id(module) not in self._watched:
                    self.watch(module)
                    self._stop_finding_ddp()
                elif calls[0] >= FIND_DDP_CALLS:
                    self._stop_finding_ddp()
            except Exception as exc:
                self._stop_finding_ddp()
                self._internal_error(exc)

        try:
            self._ddp_finder = torch.nn.modules.module.register_module_forward_pre_hook(seen)
        except Exception:
            self._ddp_finder = None  # an old torch without global hooks: watch() as before

    def _stop_finding_ddp(self) -> None:
        finder, self._ddp_finder = self._ddp_finder, None
        if finder is not None:
            with contextlib.suppress(Exception):
                finder.remove()

    def _record_dist(self) -> None:
        """Record every torch.distributed call from now on (after the rendezvous, which is ours),
        once a process group exists: at start, or when the training loop starts."""
        if self._dist is None and self._timeline is not None:
            try:
                self._dist = DistRecorder.for_process(self._timeline, self.faults)
            except Exception as exc:
                self.faults.report(
                    "dist_recorder_failed", f"perfscope: torch.distributed calls are not recorded ({exc!r})."
                )
            if self._dist is not None:
                self._hooks.append(self._dist)

    def _start_poller(self, placement: Placement, hostname: str) -> None:
        if self._poll_hz <= 0:
            return
        assert self._writer is not None and self.run_id is not None
        self._claim = HostClaim(self.run_id, hostname, placement.local_rank, placement.local_pids)
        if not self._claim.owner:
            return
        self._gpus = open_gpus(self.faults, enabled=self._gpu_telemetry)
        self._poller = Poller(
            self._writer,
            gpus=self._gpus,
            host=HostSampler(self._claim.pids),
            hz=self._poll_hz,
            hostname=hostname,
            node_rank=placement.node_rank,
            wall_ns=self.clock.now,
            faults=self.faults,
        ).start()

    def close(self) -> None:
        """Finish the run on this rank: resolve pending timings, stop the poller, write the final
        rows and flush. No collective: a dead rank elsewhere cannot hang it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_finding_ddp()
        was_recording, self._recording, self._live = self._recording, False, None
        if self._timeline is not None:
            self._timeline.stop_live()
        for hook in self._hooks:
            hook.active = False
        self._memory = None
        if self._writer is None:
            return
        steps = [
            self._end_first_step,
            lambda: self._dist.stop() if self._dist is not None else None,
            lambda: self._timeline.close() if was_recording else self._timeline.flush(),
            self._stop_flops,
            lambda: self._poller.stop() if self._poller is not None else None,
            lambda: self._claim.release() if self._claim is not None else None,
            self._write_start_rows,
            lambda: self._write_runs_row(ended_ns=self.clock.now()),
        ]
        for step in steps:
            try:
                step()
            except Exception as exc:
                self.faults.report("close_failed", f"perfscope: a step of closing the run failed ({exc!r}).")
        if self._timeline is not None and self._timeline.unresolved:
            self.faults.report(
                "timing_unresolved",
                f"perfscope: {self._timeline.unresolved} step(s) could not be resolved before close "
                "(device events or collectives not finished); their rows are incomplete.",
            )
        self._writer.close(timeout_s=15.0)
        if self._uploader is not None:
            self._uploader.close()

    def flush(self) -> None:
        """Write everything recorded so far into the store now (it is written every second anyway)."""
        if self._writer is not None:
            if self._recording:
                with self._guard:
                    self._timeline.flush()
            self._writer.flush()

    # -- the recording API ------------------------------------------------------------------------
    def phase(self, name: str) -> Phase:
        """A phase of the step. 'data', 'forward', 'backward', 'sync' and 'optimizer' fill their
        columns of `steps`; any other name is a user span (written to `spans`, counted in other_ns)."""
        p = self._phases.get(name)
        if p is None:
            p = self._phases[name] = Phase(self, name)
        return p

    span = phase

    def steps(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Iterate `loader`, one step per batch. The wait for each batch is the 'data' phase; a step
        ends when the loop body asks for the next batch (or leaves the loop)."""
        if not self._recording:
            yield from loader
            return
        self._note_dataset(loader)
        self._write_start_rows()
        self._end_first_step()
        tl = self._timeline
        it = iter(loader)
        self._in_steps += 1
        self._steady = False
        try:
            with self._guard:
                tl.begin_loop()
            while True:
                span = None
                t = perf_ns()
                if t <= tl.deadline:  # Phase.__enter__'s quick path, for the wait on the next batch
                    stack = tl.stack
                    span = ["data", stack[-1] if stack else None, len(stack), t, t, None, None, DATA]
                    stack.append(span)
                    tl.cur.spans.append(span)  # type: ignore[union-attr]  # deadline >= 0: a step is open
                elif self._recording:
                    try:
                        span = tl.enter("data")
                    except Exception as exc:
                        self._internal_error(exc)
                try:
                    batch = next(it)
                except StopIteration:
                    if span is not None:
                        with self._guard:
                            tl.cancel(span)
                    return
                except BaseException as exc:
                    if span is not None:
                        with self._guard:
                            tl.exit(span, type(exc))
                    raise
                samples = None
                if span is not None:
                    try:
                        stack = tl.stack
                        if tl.deadline >= 0 and stack and stack[-1] is span:
                            stack.pop()[END] = perf_ns()
                        else:
                            tl.exit(span, None)
                        samples = infer_samples(batch)
                        if self.count_flops and tl.index == 0 and not self._flops.running:
                            self._flops.start()
                    except Exception as exc:
                        self._internal_error(exc)
                try:
                    yield batch
                except GeneratorExit:
                    # the loop was left (`break`): a step whose body ran is complete; one left right
                    # after its batch arrived (`if i == n: break`) or that failed is no step
                    # (an exception escaping the loop body also closes the generator, before any
                    # enclosing `with` sees it: that step's spans are kept, with their error)
                    if self._recording:
                        with self._guard:
                            ran, failed = tl.open_step_state()
                            if not ran:
                                tl.discard_open_step()
                            elif failed:
                                tl.abandon_open_step()
                            else:
                                self._end_step(samples)
                    raise
                live = self._live
                if live is not None:
                    try:  # _end_step's common case, one call less on every step
                        live.end_step(samples)
                        if self._memory is not None:
                            self._memory.step(live.index - 1)
                        if self._flops.running:
                            self._stop_flops()
                    except Exception as exc:
                        self._internal_error(exc)
        finally:
            self._in_steps -= 1

    def step(self, samples: int | None = None) -> StepBlock:
        """End the step in progress, for loops that do not iterate through prof.steps: call it once
        at the end of every training step, after the optimizer update:

            for x, y in loader:
                with prof.phase("forward"):
                    loss = loss_fn(model(x), y)
                ...
                optimizer.step()
                optimizer.zero_grad()
                prof.step()

        or wrap the step's body in a block, `with prof.step(): ...` (see StepBlock). `samples`
        overrides the profile's batch_size for this step. A first call before anything was
        recorded starts the clock instead (the time before the loop is no step)."""
        tl = self._live
        if tl is not None and self._steady and tl.cur is not None and not tl.cur.empty():
            self._block_ended = False  # the common case, kept short: see the end of this method
            try:
                tl.end_step(samples)
                if self._memory is not None:
                    self._memory.step(tl.index - 1)
            except Exception as exc:
                self._internal_error(exc)
            return self._block
        if not self._recording:
            return self._block
        if self._in_steps:
            self.faults.report(
                "step_inside_steps",
                "perfscope: prof.step() was called inside `for batch in prof.steps(loader)`, which already "
                "ends a step per batch; the extra call is ignored.",
            )
            return self._block
        self._write_start_rows()
        tl = self._timeline
        cur = tl.cur
        if cur is None or cur.empty():
            if self._block_ended:  # the wait for the next batch since a block ended: in the next step
                self._block_ended = False
                return self._block
            if tl.index == 0 and not self._step_called:
                # nothing recorded yet: the end of step 0, unless a `with` block follows at once
                # (then the time before the loop is no step): decided at the block's entry or the
                # next call, whichever comes first
                self._step_called = True
                with self._guard:
                    tl.open_since_start()  # step 0 began when the profile opened, whatever comes next
                self._first_end = (perf_ns(), tl.marks.mark(), samples)
                return self._block
        self._step_called = True
        self._end_first_step()
        self._block_ended = False
        self._end_step(samples)
        if self.count_flops and self._timeline.index == 1 and not self._flops.running:
            try:
                self._flops.start()  # loops without a loader: count the second step, the first fully seen
            except Exception as exc:
                self._internal_error(exc)
        # nothing above but ending the step is left to do at the next call (prof.steps clears it)
        self._steady = (
            self._start_rows_written
            and self._first_end is None
            and not self._flops.running
            and not (self.count_flops and tl.index <= 1)
        )
        return self._block

    def log(self, **values: Any) -> None:
        """User metrics of the step in progress: `prof.log(loss=loss.item(), accuracy=acc)`."""
        tl = self._live
        if tl is not None:
            try:
                tl.log_values(values)
            except Exception as exc:
                self._internal_error(exc)

    def watch(self, model: Any, *, comm_hook: Any = None, comm_state: Any = None) -> Any:
        """Count the model's parameters and gradient bytes; on a DDP model, record every bucket's
        collective through a comm hook. A hook of your own (fp16 compression, PowerSGD ...) must be
        given here, since DDP accepts one: `prof.watch(model, comm_hook=fp16_compress_hook)`.
        Returns the model."""
        if not self._recording:
            if comm_hook is not None and ddp.is_ddp(model):
                model.register_comm_hook(comm_state, comm_hook)  # what the user asked for, unrecorded
            return model
        if id(model) in self._watched:  # watched already (by the DDP finder, or twice)
            if comm_hook is not None:
                self.faults.report(
                    "watch_late",
                    "perfscope: prof.watch(model, comm_hook=...) came after the model's first forward, "
                    "which perfscope had already watched; the comm hook is not registered. Call "
                    "prof.watch before the training loop.",
                )
            return model
        self._watched.add(id(model))
        registered = False
        try:
            self._facts = facts = ddp.model_facts(model)
            if facts.device_type == "cuda" and self._timing == "auto":
                self._use_cuda_timing()
            if facts.is_ddp:
                state = ddp.instrument_ddp(
                    model, self._timeline, self.faults, comm_hook=comm_hook, comm_state=comm_state
                )
                registered = state is not None
                if state is not None:
                    self._hooks.append(state)
        except Exception as exc:
            self._internal_error(exc)
        if (
            comm_hook is not None
            and not registered
            and ddp.is_ddp(model)
            and ddp.registered_hook_name(model) is None
        ):
            model.register_comm_hook(comm_state, comm_hook)
        return model

    def collective(self, op: str, nbytes: int) -> manual.CollectiveBlock:
        """Time a hand-written collective: `with prof.collective("allreduce", t.nbytes): ...`.
        It is exposed sync: a `sync` phase opens around it unless one is open."""
        return manual.CollectiveBlock(self._timeline if self._recording else None, op, nbytes)

    def all_reduce(self, tensor: Any, *, op: Any = None, group: Any = None, average: bool = False) -> Any:
        """torch.distributed.all_reduce(tensor), recorded as exposed sync; see `collective`."""
        return manual.all_reduce(
            self._timeline if self._recording else None, tensor, op=op, group=group, average=average
        )

    def horovod_optimizer(self, optimizer: Any, *, hvd: Any = None, **kwargs: Any) -> Any:
        """`hvd.DistributedOptimizer(optimizer, **kwargs)` with its allreduces and its synchronize()
        recorded. Horovod is imported here, not before."""
        if not self._recording:
            if hvd is None:
                import importlib

                hvd = importlib.import_module("horovod.torch")
            return hvd.DistributedOptimizer(optimizer, **kwargs)
        opt = horovod.distributed_optimizer(optimizer, self._timeline, self.faults, hvd=hvd, **kwargs)
        recorder = getattr(opt, "_perfscope", None)
        if recorder is not None:
            self._hooks.append(recorder)
        return opt

    # -- internals --------------------------------------------------------------------------------
    def _end_step(self, samples: int | None) -> None:
        try:
            self._timeline.end_step(samples)
            if self._memory is not None:
                self._memory.step(self._timeline.index - 1)
            if self._flops.running:
                self._stop_flops()  # FLOPs are counted over one step
        except Exception as exc:
            self._internal_error(exc)

    def _stop_flops(self) -> None:
        if self._flops.running:
            flops = self._flops.stop()
            if flops is not None and self._columns.get("flops_per_step") is None:
                self._columns["flops_per_step"] = flops

    def _pull_rows(self) -> dict[str, list[Any]]:
        """The rows of the steps the timeline holds, built on the writer's thread as flat value lists
        (StoreWriter.add_source's `flat`)."""
        try:
            return self._timeline.take_rows(flat=True)
        except Exception as exc:
            self._internal_error(exc)
            return {}

    def _end_first_step(self) -> None:
        """End step 0 where the first prof.step() call was (no block followed it)."""
        if self._first_end is not None:
            end_host, end, samples = self._first_end
            self._first_end = None
            with self._guard:
                self._timeline.end_step_at(end_host, end, samples)

    def _no_step_ended(self, open_ns: int) -> None:
        """The step in progress has been open for `open_ns` while phases go on: a loop that forgot
        prof.step(). One warning (and events row); recording goes on."""
        if self._in_steps:
            return  # prof.steps ends every step: this one is just long
        self.faults.report(
            "no_step",
            f"perfscope: phases have been recorded for {open_ns / 1e9:.0f} s without a step ending; "
            "call prof.step() at the end of each training step (after optimizer.step()), wrap the "
            "step in `with prof.step():`, or iterate `for batch in prof.steps(loader)`. "
            "A step's rows are written when it ends.",
        )

    def _internal_error(self, exc: Exception) -> None:
        """A bug of ours in the hot path: stop recording rather than risk the job."""
        self._recording = False
        self._live = None
        self._memory = None
        if self._timeline is not None:
            self._timeline.stop_live()
        for hook in self._hooks:
            hook.active = False
        with contextlib.suppress(Exception):
            self._flops.stop()  # the counting mode slows every op it sees: never leave it on
        self.faults.report(
            "internal_error",
            f"perfscope: recording stopped after an internal error ({type(exc).__name__}: {exc}); "
            "training continues unrecorded. Please report this.",
        )

    def _note_dataset(self, loader: Any) -> None:
        if self._loader is None:
            with contextlib.suppress(Exception):
                self._loader = loader_facts(loader)
        if self._columns.get("dataset_samples") is None:
            with contextlib.suppress(Exception):
                self._columns["dataset_samples"] = len(loader.dataset)

    def _use_cuda_timing(self) -> None:
        tl = self._timeline
        if tl.marks.clock != "cuda":
            from .cuda_timing import CudaMarks

            tl.use_marks(CudaMarks.for_torch())

    def _device(self) -> tuple[int | None, str]:
        facts = self._facts
        index = facts.device_index if facts is not None else None
        if index is None and self._timeline is not None and self._timeline.marks.clock == "cuda":
            torch = sys.modules.get("torch")
            with contextlib.suppress(Exception):
                index = int(torch.cuda.current_device()) if torch is not None else None
        if index is None:
            return None, "cpu"
        names = self._gpus.device_names
        return index, cuda_device_name(index) or (names[index] if index < len(names) else "cuda")

    def _write_start_rows(self) -> None:
        """The `ranks` row, and on rank 0 the `runs` row: once, when the training loop starts (by
        then watch() has told the model facts), else at close."""
        if self._start_rows_written or self._writer is None or self.placement is None:
            return
        self._start_rows_written = True
        if self._recording and self._memory is None:  # by the loop's start the model is on its device
            self._memory = device_memory_for_torch(
                self._device()[0], self.rank, self._writer.append, self.clock.now, self.faults
            )
        if self._recording:
            self._record_dist()
            if self._dist is not None:  # DTensor's collectives, imported by now
                with contextlib.suppress(Exception):
                    self._dist.watch_functional()
        try:
            self._write_rank_and_run_rows()
        except Exception as exc:
            self.faults.report("metadata_failed", f"perfscope: could not write the run's metadata ({exc!r}).")

    def _read_layout(self) -> None:
        """This rank's coordinates (collectors/layout.py): from parallel=, else Megatron's
        parallel_state once the training loop starts; a layout that does not fit is one warning."""
        assert self.placement is not None
        try:
            self._layout = resolve_layout(self._parallel, self.placement.rank, self.placement.world_size)
        except Exception as exc:
            what = "parallel=" if self._parallel is not None else "Megatron's parallel_state"
            reason = str(exc) if isinstance(exc, LayoutError) else f"{type(exc).__name__}: {exc}"
            self.faults.report(
                "layout_unusable",
                f"perfscope: the parallel layout from {what} is not recorded ({reason}); "
                "dp_rank, pp_stage, tp_rank, cp_rank stay NULL.",
            )

    def _write_rank_and_run_rows(self) -> None:
        assert self._writer is not None and self.placement is not None
        index, name = self._device()
        self._read_layout()
        coords = self._layout.rank_columns() if self._layout is not None else None
        row = ranks_row(
            self.placement, self._hostname, index, name, self.started_ns, self._role, coords, self._loader
        )
        self._writer.append("ranks", row)
        self._write_runs_row(ended_ns=None)

    def _write_runs_row(self, *, ended_ns: int | None) -> None:
        if self._writer is None or self.placement is None or not self.placement.writes_runs_row:
            return
        columns = self._columns
        if self._layout is not None:  # degrees given by keyword (dp_size=...) win
            columns = {**self._layout.run_columns(), **{k: v for k, v in columns.items() if v is not None}}
        row = runs_row(
            self.placement,
            columns,
            self._facts,
            started_ns=self.started_ns,
            ended_ns=ended_ns,
            hostname=self._hostname,
            device_model=self._device()[1],
            driver_version=self._gpus.driver_version,
            tags=self._tags,
            autocast=self._autocast,
        )
        self._writer.append("runs", row)


def _role(role: Any) -> str | None:
    if role is None:
        return None
    text = str(role)
    if text in ("worker", "server") or (text.startswith("stage:") and text[6:].isdigit()):
        return text
    raise ValueError(f"perfscope.profile: role must be 'worker', 'server' or 'stage:K', not {role!r}")


def _cuda_available() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:
        return False


def _cuda_in_use() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())
    except Exception:
        return False


def profile(
    store: str | os.PathLike[str],
    *,
    experiment: str = "default",
    batch_size: int | None = None,
    count_flops: bool = False,
    **options: Any,
) -> Profiler:
    """Record this rank's training into the store folder `store` (or an s3://bucket/prefix, uploaded
    from a local staging folder: docs/object_storage.md); use as a context manager on every rank:

        with perfscope.profile("traces/", experiment="resnet-scaling", batch_size=75) as prof:
            prof.watch(model)
            for batch in prof.steps(loader):
                with prof.phase("forward"):
                    loss = model(batch)
                ...
                prof.log(loss=loss.item())

    A loop that does not iterate prof.steps ends each step with `prof.step()` as the last line of
    its body (after optimizer.zero_grad()), or wraps the body in `with prof.step():`.

    Keywords: any column of the `runs` table (cluster, backend, scaling_mode, tags,
    flops_per_step, device_peak_flops, dataset_samples, model, global_batch_size ...); any other
    keyword becomes a tag (`target="loss=0.5"` or `target={"loss": 0.5}` is the run's
    time-to-metric target, see docs/analysis.md). `parallel`: the job's layout, as degrees
    ({"dp": 2, "pp": 2, "tp": 1}: a mesh of these dimensions in that order, the last fastest) or a
    DeviceMesh with dimensions named dp/pp/tp/cp; without it Megatron's parallel_state when
    initialised (collectors/layout.py). `role`: 'worker', 'server' or 'stage:K'.
    Options: count_flops (count one step's FLOPs
    with torch's counter), timing ('auto', 'host' or 'cuda'), poll_hz (telemetry rate, 0 turns
    the poller off), gpu_telemetry, nvtx, run_id, roll_interval_s. Recording problems become
    warnings; the training itself is never interrupted by perfscope.
    """
    return Profiler(store, experiment=experiment, batch_size=batch_size, count_flops=count_flops, **options)
