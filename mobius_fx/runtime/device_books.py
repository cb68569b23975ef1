"""The `Device` interface and a GPU's books (what it holds, its budget, and what moved): the
interface the runtime (`engine.py`) drives and each device kind (`device_<kind>.py`) implements.

The runtime books, per tensor: weight slots and gradient accumulators (`alloc`/`free`,
`claim`) and activations it hands out (`track`, until the storage dies: a weakref callback).
What a stage's work creates inside `compute()` -- intermediates of the forward and of the
recompute, activation and weight gradients, temporaries -- is measured one of two ways, the
device's `memory_books`:

- "ops" (the default on virtual devices, where it is the measurement): a dispatch-mode tracker
  (`_Books`) charges each new storage (views count once) from the op that creates it until it
  dies. Python runs on every op (`Device.dispatch_calls` counts them); a charge past the budget
  raises `BudgetError` from the op that made it, before its result is used.
- "allocator" (the default on CUDA): no Python per op. The stage's work window (`working`) is
  measured by the device's `MemorySource` -- "bytes allocated now, the most allocated at once
  since a mark": on CUDA the caching allocator (`CudaAllocator`, one per CUDA device, shared by
  the pipeline GPUs on it); on virtual devices the books themselves (`BookedBytes`, which see
  only what the runtime books). The stage's measured peak is what the GPU held when the work
  began plus the most the source allocated on top during it; one over the budget raises
  `BudgetError` when the work ends, naming the stage and the figures. The hard limit is the
  allocator's own: an allocation the CUDA device cannot serve raises torch's OutOfMemoryError
  from the op.

Either way the plan's per-stage peak (`Stage.peak_bytes`) comes from the IR's accounting
(mobius_fx/planning/costs.py, step_model.py) and bounds `stage_peaks`. `TransferLog` counts the bytes moved
per kind, direction and stage, as the schedule IR books them.

    dev = VirtualDevice("gpu0", budget=parse_bytes("64MiB"))     # mobius_fx.runtime.device_virtual
    with dev.working(stage=0):                                   # charges what the work creates
        y = layer(x)
    dev.stats()                                                  # {"peak_bytes": ..., "current_bytes": ...}
    dev.set_memory_books("allocator")                            # measured per work window instead
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mobius_fx.errors import BudgetError, MobiusError
from mobius_fx.runtime.memory_sources import BookedBytes, CudaAllocator, Mark, MemorySource
from mobius_fx.kinds import HOST
from mobius_fx.runtime.transfer_log import TransferLog
from mobius_fx.units import fmt_bytes

__all__ = ["HOST", "Device", "TransferLog", "SavedInput", "empty_slot", "nbytes", "MEMORY_BOOKS", "MemorySource",
           "Mark", "BookedBytes", "CudaAllocator", "check_memory_books"]

MEMORY_BOOKS = ("auto", "ops", "allocator")


def check_memory_books(value: Any) -> str:
    """`memory_books=`: "auto" (per device: "ops" on virtual devices, "allocator" on CUDA),
    "ops" or "allocator"; anything else is refused with the rule and the remedy."""
    if not isinstance(value, str) or value not in MEMORY_BOOKS:
        raise MobiusError(
            f"memory_books={value!r} is not one of 'auto', 'ops', 'allocator': 'ops' charges every tensor a stage's "
            f"work creates from the op that makes it (Python on every op; the default on virtual devices, and the "
            f"debug setting on CUDA), 'allocator' measures each stage's work by the allocator (CUDA's caching "
            f"allocator; the default on CUDA) and checks the budget when the work ends; 'auto' picks per device")
    return value

def nbytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's elements (not of its storage, which a view may share)."""
    return t.numel() * t.element_size()


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
        self.dev.dispatch_calls += 1  # Python on every op of stage work (benchmarks/host_path.py)
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
    `memory_books` says how a stage's work is measured ("ops" or "allocator", module docstring;
    `set_memory_books`), `memory_source` where "allocator" reads it from.
    """

    kind = "abstract"
    granule = 1  # the allocator's rounding: a storage of n bytes holds n rounded up to this
    default_books = "ops"  # memory_books="auto" on this kind of device

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
        self._marks: list[Mark] = []  # the books' open windows (`working`, `BookedBytes`): each sees every alloc
        self.stage_peaks: dict[int, int] = {}  # stage -> its measured peak (see `working`)
        self.dispatch_calls = 0  # ops the books' dispatch mode saw (Python per op)
        self.memory_books = self.default_books
        self.memory_source: MemorySource | None = None  # None: `_default_source()` when first needed

    # ------------------------------------------------------------------ how stage work is measured
    def set_memory_books(self, mode: str) -> None:
        """"ops": every tensor a stage's work creates charged per op (dispatch mode); "allocator":
        each stage's work measured by `memory_source` and checked when it ends; "auto": this
        device's default (`default_books`: "ops" on virtual devices, "allocator" on CUDA)."""
        mode = check_memory_books(mode)
        self.memory_books = self.default_books if mode == "auto" else mode

    def _default_source(self) -> MemorySource:
        """The source of memory_books="allocator" when none was set: the books themselves."""
        return BookedBytes(self)

    def _open_mark(self) -> Mark:
        with self._lock:
            m = Mark(self.current_bytes)
            self._marks.append(m)
            return m

    def _close_mark(self, m: Mark) -> int:
        with self._lock:
            self._marks.remove(m)
            return m.peak

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
            for m in self._marks:
                if after > m.peak:
                    m.peak = after

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
        """With memory_books="ops": charge every tensor created on this device in this thread,
        until the context ends, to the books (`compute()` enters it); nested: the outer one
        charges. With "allocator": nothing (no Python per op; `working` measures the work)."""
        tls = self._tls
        if getattr(tls, "mode", None) is not None or self.memory_books != "ops":
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
        the stage's measured peak, `stage_peaks[stage]` (the plan's `Stage.peak_bytes` bounds it).

        With memory_books="ops" the peak is the books' (every tensor charged per op; the budget
        is enforced by the op that would pass it). With "allocator" it is the bytes the books
        held when the work began plus the most `memory_source` allocated on top during it (or
        the books' own peak, if higher); over the budget, the work's end raises `BudgetError`
        naming the stage and the figures."""
        source = None
        if self.memory_books == "allocator":
            source = self.memory_source
            if source is None:
                source = self.memory_source = self._default_source()
        with self.compute():
            mode = getattr(self._tls, "mode", None)  # None: "allocator", or a Device whose compute() does not track
            label = mode.label if mode is not None else None
            if mode is not None:
                mode.label = f"stage {stage}'s"
            with self._lock:
                held = self.current_bytes
                booked = self._open_mark()
            measure = source.mark() if source is not None else None
            try:
                yield
            finally:
                used = source.peak_since(measure) - measure.start if source is not None else 0
                with self._lock:
                    self._close_mark(booked)
                    peak = max(booked.peak, held + used)
                    for m in self._marks:  # an enclosing window saw this one's peak too
                        if peak > m.peak:
                            m.peak = peak
                    if peak > self.peak_bytes:
                        self.peak_bytes = peak
                    if peak - others > self.stage_peaks.get(stage, -1):
                        self.stage_peaks[stage] = peak - others
                if mode is not None:
                    mode.label = label
            if source is not None and self.budget is not None and peak > self.budget:
                raise BudgetError(
                    f"{self.name}: stage {stage}'s work peaked at {fmt_bytes(peak)} ({peak} bytes: "
                    f"{fmt_bytes(held)} held when it began + {fmt_bytes(used)} more at most during it, measured by "
                    f"{source.what}) but the budget is {fmt_bytes(self.budget)} ({self.budget} bytes); "
                    f"{_remedy('working memory')} (memory_books='allocator' checks when a stage's work ends; "
                    f"memory_books='ops' raises from the op that would pass the budget)")

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

    def plan_slots(self, sizes: Sequence[int]) -> None:
        """The bytes of each stage slot the schedule holds at once on this GPU (a device with a
        fixed slot pool sizes it from them; here: nothing to do)."""

    def open_pool(self) -> None:
        """Allocate the slot pool `plan_slots` sized, kept from now on (when compiling; a device
        without a pool books each stage's weights as it fills them: nothing to do)."""

    def pool_bytes(self) -> int | None:
        """The bytes of the slot pool, held whichever stages are resident (None: no pool, each
        resident stage's weights are booked as it fills them)."""
        return None

    def close_pool(self) -> bool:
        """Free the slot pool if no stage is resident; whether there was one to free."""
        return False

    def slot_bytes(self, slots: Sequence[torch.Tensor]) -> int:
        """The bytes a stage with these slots takes in a slot."""
        return sum(nbytes(s) for s in slots)

    def fill(self, stage: int, slots: Sequence[torch.Tensor], masters: Sequence[torch.Tensor], nbytes: int,
             prefer: int | None = None) -> Any:
        """Make stage `stage` resident (`nbytes` of weights; `prefer`: the slot the plan gives
        it) and upload its masters; returns the token for `ready`. Here: book the bytes, upload."""
        self.alloc(nbytes, f"stage {stage}'s weights")
        try:
            return self.upload(slots, masters)
        except BaseException:
            self.release(slots)
            self.free(nbytes)
            raise

    def vacate(self, stage: int, slots: Sequence[torch.Tensor], nbytes: int) -> None:
        """Stage `stage` leaves the GPU: free its slots (an upload in flight was awaited)."""
        self.release(slots)
        self.free(nbytes)

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

    @contextlib.contextmanager
    def deferred(self) -> Iterator[list]:
        """Copies onto this device issued inside do not order its compute after them yet: they
        add their completion events to the list yielded, and `join(events)` orders compute after
        them when their result is used (a stage's saved inputs, restored for all its micro-batches
        when its backward starts, each waited for by its own micro-batch). Devices that copy at
        once have no events."""
        yield []

    def join(self, events: Sequence[Any]) -> None:
        """Order this device's compute after `events` (from `deferred`)."""

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



def empty_slot(like: torch.Tensor, dtype: torch.dtype | None, parameter: bool, device: torch.device) -> torch.Tensor:
    dt = dtype if (dtype is not None and like.is_floating_point()) else like.dtype
    t = torch.empty(like.shape, dtype=dt, device=device)
    t.untyped_storage().resize_(0)
    if parameter:
        return nn.Parameter(t, requires_grad=False)
    return t


class SavedInput:
    """A stage input kept for backward: its host copy and what orders reading it (a CUDA event;
    on virtual devices the version the input had)."""

    __slots__ = ("host", "event")

    def __init__(self, host: torch.Tensor, event: Any) -> None:
        self.host = host
        self.event = event
