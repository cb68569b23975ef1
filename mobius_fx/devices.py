"""The device layer: where a pipeline's weights, gradients and activations live, and how they move.

Everything above this module (runtime.py) is one code path; only the copies differ:

- `VirtualDevice` — a GPU of the topology played by the CPU with a byte budget (tests, CI, laptops).
  Uploads make real copies into slots whose storage is freed again on eviction
  (`untyped_storage().resize_(0)`), so a schedule that touches an evicted weight fails loudly.
- `CudaDevice` — a real GPU: per pipeline GPU a compute stream (highest priority: it carries the
  critical path, activation hops included), an upload stream for weights (next priority: the next
  stage's weights are needed before anything that goes back) and a download stream for gradients and
  offloaded inputs (lowest). Events order them; `record_stream` keeps freed memory from being reused
  while another stream still reads it; weights upload from pinned staging copies of the masters (the
  user's tensors are never moved, pinned or replaced).

Both keep the same books: bytes held now and at peak, a budget that raises `BudgetError` when
exceeded, and a log of the bytes moved per kind and direction. The books see every byte: weight
slots and gradient accumulators are booked by the runtime (`alloc`/`free`, `claim`); every other
tensor the GPU holds -- activations handed out (`track`), and everything stage work creates inside
`compute()`: intermediates of the forward and of the recompute, activation and weight gradients,
temporaries -- is charged by a dispatch-mode tracker (`_Books`) per storage (views of one storage
count once) from the op that creates it until the storage dies (a weakref callback).

    dev = VirtualDevice("gpu0", budget=parse_bytes("64MiB"))
    slot = dev.new_slot(master, dtype=None, parameter=True)   # no storage yet
    dev.alloc(nbytes(slot), "stage 0 weights"); dev.ready(dev.upload([slot], [master]), [slot])
    dev.release([slot]); dev.free(nbytes(slot), "stage 0 weights")
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import BudgetError, MobiusError
from .units import fmt_bytes

__all__ = ["HOST", "Device", "VirtualDevice", "CudaDevice", "TransferLog", "make_devices", "nbytes"]

HOST = "host"  # the name of DRAM in schedules and transfer logs


def nbytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's elements (not of its storage, which a view may share)."""
    return t.numel() * t.element_size()


class TransferLog:
    """Bytes and copies moved, per (kind, direction, stage); kind is weight | gradient |
    activation | input (a stage input saved for backward) | buffer, direction h2d | d2h | d2d.

    The runtime says which stage a copy belongs to (`with log.stage(k):`), so the log can be
    compared with the schedule IR per GPU, kind and stage; copies made outside are stage None.
    """

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, int | None], list[int]] = {}
        self._mark: dict[tuple[str, str, int | None], list[int]] = {}
        self._stage = threading.local()

    @contextlib.contextmanager
    def stage(self, k: int | None) -> Iterator[None]:
        old = getattr(self._stage, "k", None)
        self._stage.k = k
        try:
            yield
        finally:
            self._stage.k = old

    def add(self, kind: str, direction: str, nbytes: int, count: int = 1) -> None:
        c = self._counts.setdefault((kind, direction, getattr(self._stage, "k", None)), [0, 0])
        c[0] += count
        c[1] += nbytes

    def bytes(self, kind: str | None = None, direction: str | None = None) -> int:
        return sum(b for (k, d, _), (_, b) in self._counts.items()
                   if (kind is None or k == kind) and (direction is None or d == direction))

    def count(self, kind: str | None = None, direction: str | None = None) -> int:
        return sum(n for (k, d, _), (n, _) in self._counts.items()
                   if (kind is None or k == kind) and (direction is None or d == direction))

    def as_dict(self, *, since_mark: bool = False, by_stage: bool = False) -> dict:
        """{"kind direction": {"count", "bytes"}}, in total or since the last `mark()`; with
        `by_stage`, {"kind direction": {stage: {"count", "bytes"}}}."""
        out: dict = {}
        for (k, d, st), (n, b) in sorted(self._counts.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or -1)):
            n0, b0 = self._mark.get((k, d, st), (0, 0)) if since_mark else (0, 0)
            if not (n - n0 or b - b0):
                continue
            if by_stage:
                out.setdefault(f"{k} {d}", {})[st] = {"count": n - n0, "bytes": b - b0}
            else:
                c = out.setdefault(f"{k} {d}", {"count": 0, "bytes": 0})
                c["count"] += n - n0
                c["bytes"] += b - b0
        return out

    def mark(self) -> None:
        self._mark = {key: list(v) for key, v in self._counts.items()}

    def clear(self) -> None:
        self._counts.clear()
        self._mark.clear()


_FRESH: dict[Any, tuple[bool, ...]] = {}  # op -> per return: a new tensor (its schema says no alias)


def _fresh_returns(func: Any) -> tuple[bool, ...]:
    try:
        return tuple(r.alias_info is None for r in func._schema.returns)
    except AttributeError:  # not an aten op with a schema
        return ()


class _Books(TorchDispatchMode):
    """The tracker `Device.books()` enters: every op's new output tensors on the device (not
    views, not in-place results: the op's schema says which are aliases) have their storage
    charged to the device's books until the storage dies. A budget error raised here is raised
    by the op, before its result is used; the result, never charged, is freed with it."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no dynamo-disabling wrapper around __torch_dispatch__: a few us per op saved

    def __init__(self, dev: "Device") -> None:
        super().__init__()
        self.dev = dev
        self.paused = False
        self.label = "a stage's"
        self.where = None if dev.torch_device.type == "cpu" else dev.torch_device  # cpu: no host tensors here

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = _FRESH.get(func)
        if fresh is None:
            fresh = _FRESH[func] = _fresh_returns(func)
        if self.paused or True not in fresh:
            return out
        for o, new in zip((out,) if len(fresh) == 1 else out, fresh):
            if not new:
                continue
            if isinstance(o, torch.Tensor):
                self._charge(o, func)
            elif isinstance(o, (list, tuple)):
                for t in o:
                    if isinstance(t, torch.Tensor):
                        self._charge(t, func)
        return out

    def _charge(self, t: torch.Tensor, func: Any) -> None:
        if self.where is not None and t.device != self.where:
            return  # a host copy made during the work (CUDA: pinned offloads)
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
            return
        self.dev._charge(storage, (self.label, func))


def _remedy(what: str) -> str:
    """What helps, by what did not fit: weights shrink with smaller stages; activations and
    saved inputs with fewer rows per stage call."""
    if "weight" in what:
        return "give it more memory (memory_fraction, a larger budget) or cut the model into more, smaller stages"
    return ("the activations of the batch do not fit: call with a smaller batch, or compile with more micro-batches "
            "(fewer rows per stage call), or give the GPU more memory")


class Device:
    """One pipeline GPU: its books (budget, bytes held, peak, transfers) and its copies.

    Subclasses implement the copies; the books are shared. `budget=None` means unlimited.
    """

    kind = "abstract"
    granule = 1  # the allocator's rounding: a storage of n bytes holds n rounded up to this

    def __init__(self, name: str, budget: int | None, torch_device: torch.device) -> None:
        self.name = name
        self.budget = budget
        self.torch_device = torch_device
        self.current_bytes = 0
        self.peak_bytes = 0
        self.log = TransferLog()
        self._lock = threading.RLock()  # re-entrant: a storage may die (and be freed) while it is held
        self._tracked: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (its weakref, bytes charged)
        self._tls = threading.local()  # per thread: the tracker now active (compute()), or None
        self._window = 0  # the peak since the current `working` began
        self.stage_peaks: dict[int, int] = {}  # stage -> its measured peak (see `working`)

    # ------------------------------------------------------------------ books
    def alloc(self, n: int, what: "str | tuple[str, Any]") -> None:
        """Count `n` more bytes held; raises MobiusError (nothing counted) past the budget.
        `what` is said in the error; (whose, op) for the tracker's charges (formatted only then)."""
        with self._lock:
            after = self.current_bytes + n
            if self.budget is not None and after > self.budget:
                if not isinstance(what, str):
                    what = f"{what[0]} working memory ({what[1]})"
                raise BudgetError(
                    f"{self.name} would hold {fmt_bytes(after)} ({after} bytes: {what} needs {fmt_bytes(n)} on top "
                    f"of {fmt_bytes(self.current_bytes)} held) but its budget is {fmt_bytes(self.budget)} "
                    f"({self.budget} bytes); {_remedy(what)}"
                )
            self.current_bytes = after
            if after > self.peak_bytes:
                self.peak_bytes = after
            if after > self._window:
                self._window = after

    def free(self, n: int, what: str = "") -> None:
        with self._lock:
            self.current_bytes -= n

    def track(self, t: torch.Tensor, what: str = "activation") -> None:
        """Charge the storage of `t`, a tensor this device holds, until the storage dies (every
        tensor and view on it) or `untrack_all`; a storage already charged is not charged again."""
        self._charge(t.untyped_storage(), what, empty=True)

    def _charge(self, storage: torch.UntypedStorage, what: Any, empty: bool = False) -> None:
        key = id(storage)
        if key in self._tracked:
            return
        n = -(-storage.nbytes() // self.granule) * self.granule
        if not n and not empty:
            return
        self.alloc(n, what)
        self._tracked[key] = (weakref.ref(storage, functools.partial(self._died, key)), n)

    def _died(self, key: int, ref: weakref.ref) -> None:
        entry = self._tracked.get(key)
        if entry is not None and entry[0] is ref:
            del self._tracked[key]
            self.free(entry[1])

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t`'s storage is charged to this device (an activation it holds)."""
        try:
            return id(t.untyped_storage()) in self._tracked
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
            return False

    def claim(self, t: torch.Tensor, what: str) -> None:
        """Book `nbytes(t)` for the caller, who frees them (a gradient accumulator): charged now,
        or, when the tracker already charges its storage, taken over from the tracker."""
        with self._lock:
            entry = self._tracked.pop(id(t.untyped_storage()), None)
        n = nbytes(t)
        if entry is None:
            self.alloc(n, what)
        elif n > entry[1]:
            self.alloc(n - entry[1], what)
        else:
            self.free(entry[1] - n)

    def accept(self, t: Any) -> Any:
        """A tensor arriving for stage work on this GPU (an output's gradient, from the stage
        after it or from the host), on this GPU and charged to it (inside `compute()`)."""
        if not isinstance(t, torch.Tensor) or self.holds(t):
            return t
        return self._arrive(t)

    def _arrive(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def untrack_all(self) -> None:
        """Forget every charged storage (after an error: the pipeline no longer holds them)."""
        with self._lock:
            held = sum(n for _, n in self._tracked.values())
            self._tracked.clear()
            self.current_bytes -= held

    def stats(self) -> dict[str, int]:
        return {"peak_bytes": self.peak_bytes, "current_bytes": self.current_bytes}

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.current_bytes
            self.stage_peaks.clear()

    # ------------------------------------------------------------------ the tracker
    @contextlib.contextmanager
    def books(self) -> Iterator[None]:
        """Charge every tensor created on this device in this thread, until the context ends, to
        the books (`compute()` enters it); nested: the outer one charges."""
        tls = self._tls
        if getattr(tls, "mode", None) is not None:
            yield
            return
        tls.mode = mode = _Books(self)
        try:
            with mode:
                yield
        finally:
            tls.mode = None

    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        """Copies made here are host memory, not this device's (a virtual GPU's offload)."""
        mode = getattr(self._tls, "mode", None)
        if mode is None or mode.paused:
            yield
            return
        mode.paused = True
        try:
            yield
        finally:
            mode.paused = False

    @contextlib.contextmanager
    def working(self, stage: int, others: int = 0) -> Iterator[None]:
        """Stage `stage` works on this GPU (forward, recompute, gradients, accumulation): inside
        `compute()`, its tensors booked under its name. The GPU's peak during the work, less
        `others` (bytes held for other stages: their weights, their gradient accumulators), is
        the stage's measured peak, `stage_peaks[stage]` (the plan's `Stage.peak_bytes` bounds it)."""
        with self.compute():
            mode = getattr(self._tls, "mode", None)  # None: a Device of yours whose compute() does not track
            label = mode.label if mode is not None else None
            if mode is not None:
                mode.label = f"stage {stage}'s"
            with self._lock:
                outer, self._window = self._window, self.current_bytes
            try:
                yield
            finally:
                with self._lock:
                    peak = self._window - others
                    if peak > self.stage_peaks.get(stage, -1):
                        self.stage_peaks[stage] = peak
                    self._window = max(outer, self._window)
                if mode is not None:
                    mode.label = label

    # ------------------------------------------------------------------ interface
    def compute(self) -> contextlib.AbstractContextManager:
        """Context in which this GPU's compute runs (its compute stream), with `books()` on:
        every tensor the work creates on the GPU is charged while it lives."""
        raise NotImplementedError

    def new_slot(self, like: torch.Tensor, dtype: torch.dtype | None, parameter: bool) -> torch.Tensor:
        """A tensor shaped like `like` on this device, with no storage until uploaded."""
        raise NotImplementedError

    def upload(self, slots: Sequence[torch.Tensor], masters: Sequence[torch.Tensor]) -> Any:
        """Give each slot storage and copy its master in; returns a token for `ready`."""
        raise NotImplementedError

    def ready(self, token: Any, slots: Sequence[torch.Tensor]) -> None:
        """Order compute after the upload `token` (no-op when already done)."""
        raise NotImplementedError

    def cancel(self, token: Any) -> None:
        """Let an upload in flight finish (errors ignored) so its slots can be freed."""

    def new_step(self) -> None:
        """A new forward begins: masters may have changed since the last one (optimizer step)."""

    def release(self, slots: Sequence[torch.Tensor]) -> None:
        """Free the slots' storage (their shapes stay; any use now fails)."""
        for s in slots:
            s.untyped_storage().resize_(0)

    def receive(self, value: torch.Tensor, src: "Device | None", dtype: torch.dtype | None = None,
                kind: str = "activation") -> torch.Tensor:
        """A differentiable copy of an activation from `src` (None: the host) onto this device,
        cast to `dtype` when given; logged as `kind` (a saved input sent again: "input")."""
        raise NotImplementedError

    def to_host(self, value: torch.Tensor) -> torch.Tensor:
        """A differentiable copy of an activation into host memory."""
        raise NotImplementedError

    def offload(self, t: torch.Tensor) -> Any:
        """Save a stage input in host memory until backward (not differentiable)."""
        raise NotImplementedError

    def restore(self, saved: Any) -> torch.Tensor:
        """The saved input back on this device."""
        raise NotImplementedError

    def download(self, t: torch.Tensor, kind: str) -> Callable[[], torch.Tensor]:
        """Start copying `t` to the host; the returned thunk waits and gives the host tensor."""
        raise NotImplementedError

    def rng_state(self) -> torch.Tensor:
        raise NotImplementedError

    @contextlib.contextmanager
    def rng(self, state: torch.Tensor) -> Iterator[None]:
        """Run with the generator this device's random ops use set to `state`, then restore it."""
        raise NotImplementedError
        yield  # pragma: no cover

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        budget = "unlimited" if self.budget is None else fmt_bytes(self.budget)
        return f"{type(self).__name__}({self.name!r}, budget={budget}, held={fmt_bytes(self.current_bytes)})"


def _empty_slot(like: torch.Tensor, dtype: torch.dtype | None, parameter: bool, device: torch.device) -> torch.Tensor:
    dt = dtype if (dtype is not None and like.is_floating_point()) else like.dtype
    t = torch.empty(like.shape, dtype=dt, device=device)
    t.untyped_storage().resize_(0)
    if parameter:
        return nn.Parameter(t, requires_grad=False)
    return t


class _Saved:
    """A stage input kept for backward: its host copy and what orders reading it (a CUDA event;
    on virtual devices the version the input had)."""

    __slots__ = ("host", "event")

    def __init__(self, host: torch.Tensor, event: Any) -> None:
        self.host = host
        self.event = event


class VirtualDevice(Device):
    """A GPU played by the CPU: real copies, a byte budget, freed storage after eviction.

    `asynchronous=True` uploads on a worker thread and hands out futures, as `CudaDevice`
    does, so the runtime's handling of uploads in flight is exercised without a GPU.
    """

    kind = "virtual"

    def __init__(self, name: str, budget: int | None, *, asynchronous: bool = False) -> None:
        super().__init__(name, budget, torch.device("cpu"))
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mobius-upload-{name}") \
            if asynchronous else None

    def compute(self) -> contextlib.AbstractContextManager:
        return self.books()

    def new_slot(self, like, dtype, parameter):
        return _empty_slot(like, dtype, parameter, self.torch_device)

    def upload(self, slots, masters):
        slots, masters = list(slots), list(masters)

        def work() -> None:
            with torch.no_grad():
                for s, m in zip(slots, masters):
                    s.untyped_storage().resize_(nbytes(s))
                    s.copy_(m)

        self.log.add("weight", "h2d", sum(nbytes(s) for s in slots), len(slots))
        if self._worker is not None:
            return self._worker.submit(work)
        work()
        return None

    def ready(self, token, slots):
        if token is not None:
            token.result()

    def cancel(self, token):
        if token is not None:
            try:
                token.result()
            except BaseException:
                pass

    def receive(self, value, src, dtype=None, kind="activation"):
        out = value.to(dtype) if dtype is not None and dtype != value.dtype else value.clone()
        self.log.add(kind, "h2d" if src is None else "d2d", nbytes(out))
        return out

    def to_host(self, value):
        out = value.clone()
        self.log.add("activation", "d2h", nbytes(out))
        return out

    def _arrive(self, t):
        # The copy a GPU receives: host memory and other GPUs' books keep theirs until it dies.
        return t.clone()

    def offload(self, t):
        # A real host copy, as a CUDA device makes (an alias would keep the GPU tensor's storage,
        # and its charge, alive until backward). The input, while it lives, tells whether it was
        # changed in place before backward: an error, as in eager checkpointing.
        self.log.add("input", "d2h", nbytes(t))
        with self.untracked():
            host = t.detach().clone()
        return _Saved(host, (weakref.ref(t), t._version))

    def restore(self, saved):
        ref, version = saved.event
        t = ref()
        if t is not None and t._version != version:
            raise MobiusError(
                f"an input saved for backward on {self.name} was modified in place after the forward used it "
                f"(version {version} -> {t._version}); a stage must not change its inputs in place "
                f"(use the out-of-place op, e.g. relu instead of relu_)")
        self.log.add("input", "h2d", nbytes(saved.host))
        return saved.host.clone()  # the copy on this GPU (charged to it inside compute())

    def download(self, t, kind):
        self.log.add(kind, "d2h", nbytes(t))
        host = t.detach().clone() if kind == "buffer" else t.detach()
        return lambda: host

    def rng_state(self):
        return torch.get_rng_state()

    @contextlib.contextmanager
    def rng(self, state):
        now = torch.get_rng_state()
        torch.set_rng_state(state)
        try:
            yield
        finally:
            torch.set_rng_state(now)


class CudaDevice(Device):
    """A real GPU (one pipeline GPU; several may share one CUDA device, each with its streams).

    Weights upload from pinned host copies of the masters in the streamed dtype. A copy is
    refreshed once per step (masters change in the optimizer step, and writes through `.data`
    do not bump version counters), by a worker thread that also issues the upload, so the
    host-side refresh overlaps the stage the GPU is running.
    """

    kind = "cuda"
    granule = 512  # CUDACachingAllocator rounds every block up to 512 bytes (memory_allocated counts blocks)

    def __init__(self, name: str, budget: int | None, index: int) -> None:
        super().__init__(name, budget, torch.device("cuda", index))
        least, greatest = torch.cuda.Stream.priority_range()
        with torch.cuda.device(index):
            self.compute_stream = torch.cuda.Stream(priority=greatest)
            self.upload_stream = torch.cuda.Stream(priority=(least + greatest) // 2)
            self.download_stream = torch.cuda.Stream(priority=least)
        # id(master) -> [master, step of the last refresh, pinned copy, event of its last upload]
        self._pinned: dict[int, list[Any]] = {}
        self._epoch = 0
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mobius-upload-{name}")

    @contextlib.contextmanager
    def compute(self):
        with torch.cuda.stream(self.compute_stream), self.books():
            yield

    def new_slot(self, like, dtype, parameter):
        return _empty_slot(like, dtype, parameter, self.torch_device)

    def new_step(self):
        self._epoch += 1

    def _staged(self, master: torch.Tensor, dtype: torch.dtype) -> list[Any]:
        """The pinned copy of `master` in `dtype`, refreshed once per step (worker thread only)."""
        entry = self._pinned.get(id(master))
        if entry is None or entry[0] is not master or entry[2].dtype != dtype:
            entry = [master, None, torch.empty(master.shape, dtype=dtype, pin_memory=True), None]
            self._pinned[id(master)] = entry
        if entry[1] != self._epoch:
            if entry[3] is not None:
                entry[3].synchronize()  # an earlier upload may still read the old copy
            entry[2].copy_(master.detach())
            entry[1] = self._epoch
        return entry

    def upload(self, slots, masters):
        slots, masters = list(slots), list(masters)

        def work() -> torch.cuda.Event:
            with torch.cuda.stream(self.upload_stream), torch.no_grad():
                entries = [self._staged(m, s.dtype) for s, m in zip(slots, masters)]
                for s, e in zip(slots, entries):
                    s.untyped_storage().resize_(nbytes(s))  # allocated on the upload stream
                    s.copy_(e[2], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.upload_stream)
            for e in entries:
                e[3] = event
            return event

        self.log.add("weight", "h2d", sum(nbytes(s) for s in slots), len(slots))
        return self._worker.submit(work)

    def ready(self, token, slots):
        if token is None:
            return
        self.compute_stream.wait_event(token.result())
        for s in slots:
            s.record_stream(self.compute_stream)  # its memory is reused only after compute is done with it

    def cancel(self, token):
        if token is not None:
            try:
                token.result()
            except BaseException:  # the upload's own error was reported where it was awaited
                pass

    def release(self, slots):
        with torch.cuda.device(self.torch_device):
            super().release(slots)

    def receive(self, value, src, dtype=None, kind="activation"):
        if src is None:
            with self.compute():
                out = value.to(self.torch_device, dtype=dtype or value.dtype, non_blocking=True)
            self.log.add(kind, "h2d", nbytes(out))
            return out
        assert isinstance(src, CudaDevice)
        if src.torch_device == self.torch_device:
            self.compute_stream.wait_stream(src.compute_stream)
            with self.compute():
                out = value.to(dtype) if dtype is not None and dtype != value.dtype else value.clone()
            value.record_stream(self.compute_stream)
        else:
            # Current streams: the source's compute on its device, ours on ours; the copy runs on
            # the source stream and is fenced both ways (ATen copy_device_to_device).
            with torch.cuda.stream(src.compute_stream), torch.cuda.stream(self.compute_stream):
                out = value.to(self.torch_device, dtype=dtype or value.dtype, non_blocking=True)
        self.log.add("activation", "d2d", nbytes(out))
        return out

    def to_host(self, value):
        with self.compute():
            out = value.to("cpu")  # blocking: the host reads it next
        self.log.add("activation", "d2h", nbytes(out))
        return out

    def _arrive(self, t):
        if t.device == self.torch_device:  # autograd copied it here (the backward of a send)
            self.track(t, "gradient")
            return t
        return t.to(self.torch_device, non_blocking=True)

    def _to_pinned(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Copy `t` into a new pinned host tensor on the download stream, after the compute
        that produced it; returns the host tensor and the event that marks the copy done."""
        self.download_stream.wait_stream(self.compute_stream)
        with torch.cuda.stream(self.download_stream):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.download_stream)
        t.record_stream(self.download_stream)
        return host, event

    def offload(self, t):
        host, event = self._to_pinned(t)
        self.log.add("input", "d2h", nbytes(t))
        return _Saved(host, event)

    def restore(self, saved):
        self.compute_stream.wait_event(saved.event)
        with self.compute():
            out = saved.host.to(self.torch_device, non_blocking=True)
        self.log.add("input", "h2d", nbytes(out))
        return out

    def download(self, t, kind):
        host, event = self._to_pinned(t)
        self.log.add(kind, "d2h", nbytes(t))

        def wait() -> torch.Tensor:
            event.synchronize()
            return host

        return wait

    def rng_state(self):
        return torch.cuda.get_rng_state(self.torch_device)

    @contextlib.contextmanager
    def rng(self, state):
        now = torch.cuda.get_rng_state(self.torch_device)
        torch.cuda.set_rng_state(state, self.torch_device)
        try:
            yield
        finally:
            torch.cuda.set_rng_state(now, self.torch_device)

    def synchronize(self):
        for s in (self.compute_stream, self.upload_stream, self.download_stream):
            s.synchronize()


def make_devices(budgets: Mapping[str, int | None], *, device: "str | Mapping[str, Device]" = "auto",
                 indices: Mapping[str, int] | None = None) -> dict[str, Device]:
    """One `Device` per GPU name. device: "virtual", "cuda", "auto" (CUDA when available), or
    your own `{gpu name: Device}` (it must name every GPU of `budgets`).

    `indices` maps a GPU name to its CUDA index (default: the order of `budgets`, modulo the
    number of CUDA devices, so a 4-GPU topology also runs on one real GPU).
    """
    if isinstance(device, Mapping):
        missing = sorted(set(budgets) - set(device))
        if missing:
            raise MobiusError(f"no Device given for GPU(s) {missing}; pass one Device per GPU name the stages use")
        return {name: device[name] for name in budgets}
    if device not in ("auto", "virtual", "cuda"):
        raise MobiusError(f"device={device!r}; use 'auto', 'virtual' (GPUs played by the CPU) or 'cuda'")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "virtual"
    if device == "virtual":
        return {name: VirtualDevice(name, b) for name, b in budgets.items()}
    if not torch.cuda.is_available():
        raise MobiusError("device='cuda' but torch.cuda.is_available() is False; use device='virtual' to run the "
                          "pipeline on the CPU with virtual GPUs")
    count = torch.cuda.device_count()
    out: dict[str, Device] = {}
    for i, (name, b) in enumerate(budgets.items()):
        index = (indices or {}).get(name, i % count)
        if not 0 <= index < count:
            raise MobiusError(f"GPU {name!r} maps to cuda:{index} but this machine has {count} CUDA device(s); "
                              f"fix the topology's GPU indices")
        out[name] = CudaDevice(name, b, index)
    return out
