"""The `Device` interface and a GPU's books (what it holds, its budget, and what moved): the
interface the runtime (`engine.py`, `pipeline.py`) drives and each device kind
(`device_<kind>.py`, registered by name in `device_registry.py`) implements.

`Device` is an abstract class. Its abstract methods are the copies, slots, streams and RNG that
differ per kind -- `compute`, `fill`, `ready`, `vacate`, `accept`, `receive`, `to_host`,
`offload`, `restore`, `download`, `fetch`, `rng_state`, `rng` --; each docstring is the
contract the runtime relies on, and `tests/unit/test_device_conformance.py` holds every
registered kind to it. The rest is shared: the books below, and the defaults of a kind without a
slot pool or streams (`plan_slots` .. `close_pool`, `deferred`/`join`, `cancel`, `new_step`,
`synchronize`, `refresh`), which such a kind leaves as they are.

The runtime books, per tensor: weight slots and gradient accumulators (`alloc`/`free`,
`claim`) and activations it hands out (`track`, until the storage dies: a weakref callback).
What a stage's work creates inside `compute()` -- intermediates of the forward and of the
recompute, activation and weight gradients, temporaries -- is measured one of two ways, the
device's `memory_books`:

- "ops" (the default on virtual devices, where it is the measurement): a dispatch-mode tracker
  (`device_tracker.OpTracker`) charges each new storage (views count once) from the op that creates it until it
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

import abc
import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from mobius_fx.errors import BudgetError, MobiusError
from mobius_fx.runtime.device_common import empty_slot
from mobius_fx.runtime.device_tracker import OpTracker
from mobius_fx.runtime.memory_sources import BookedBytes, Mark, MemorySource
from mobius_fx.runtime.streamed_copies import StreamedCopies
from mobius_fx.runtime.transfer_log import TransferLog
from mobius_fx.units import fmt_bytes

__all__ = ["Device", "nbytes", "MEMORY_BOOKS", "check_memory_books", "WIDEN_CHUNK", "MIN_WIDEN_CHUNK",
           "widened_chunks"]

MEMORY_BOOKS = ("auto", "ops", "allocator")

# Elements a download `into=` a wider host tensor converts on the GPU at a time: the transient it
# holds there is at most WIDEN_CHUNK elements of the wider dtype (16 MiB in fp32), whatever the
# tensor's size, and less where less is free (`Device.widen_chunk`, down to MIN_WIDEN_CHUNK). The
# planner's memory model does not charge it: a download takes what its stage's work left free.
WIDEN_CHUNK = 1 << 22
MIN_WIDEN_CHUNK = 1 << 12


def widened_chunks(value: torch.Tensor, into: torch.Tensor, addends: Sequence[torch.Tensor] = (),
                   chunk: int = 0):
    """(part of `into`, what goes into it) per `chunk` elements (default `WIDEN_CHUNK`) of a widened
    download (`Device.download(into=, addends=)`): `value`'s chunk, or with `addends` (host tensors
    of its shape: a tied weight's partials) their chunks brought to `value`'s device and summed in
    `into`'s dtype in order, `value` added last -- chunk-sized temporaries there, made when the pair
    is drawn (on CUDA: on the stream that draws it)."""
    step = chunk or WIDEN_CHUNK
    src, dst, adds = value.reshape(-1), into.view(-1), [a.reshape(-1) for a in addends]
    for a in range(0, src.numel(), step):
        part = src[a:a + step]
        if adds:
            total = adds[0][a:a + step].to(value.device, into.dtype, non_blocking=True)
            for x in adds[1:]:
                total.add_(x[a:a + step].to(value.device, non_blocking=True))
            part = total.add_(part)
        yield dst[a:a + step], part
        del part


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



def _remedy(what: str) -> str:
    """What helps, by what did not fit: weights shrink with smaller stages; activations and
    saved inputs with fewer rows per stage call."""
    if "weight" in what:
        return "give it more memory (memory_fraction, a larger budget) or cut the model into more, smaller stages"
    return ("the activations of the batch do not fit: call with a smaller batch, or compile with more micro-batches "
            "(fewer rows per stage call), or give the GPU more memory")


class Device(abc.ABC):
    """One pipeline GPU: its books (budget, bytes held, peak, transfers) and its copies.

    Each kind implements the abstract methods (the copies); the books are shared. `budget=None`
    means unlimited. `memory_books` says how a stage's work is measured ("ops" or "allocator",
    module docstring; `set_memory_books`), `memory_source` where "allocator" reads it from.

    What the runtime reads besides the methods: `name` (the GPU's name in the topology),
    `torch_device` (where its tensors live), `budget`, `current_bytes`, `peak_bytes`,
    `stage_peaks` (stage -> its measured peak, `working`), `log` (the `TransferLog`: every copy
    a kind makes is logged there, as the schedule IR books it -- what, direction, bytes -- under
    the stage the runtime names with `log.stage(k)`), and `kind` (its registered name).

    Streams: a kind may queue its copies and compute (CUDA streams, the stand-in's threads).
    Then "ordered after" below means on the device, not on the host: a later use on the
    device's compute (or download) stream sees the copy's result; the host blocks only where a
    method says so (`download`'s and `fetch`'s thunks, `synchronize`). A kind that copies at
    once (`VirtualDevice`) satisfies every ordering trivially.
    """

    kind = "abstract"
    pins_host = False  # host buffers its copies read or write are page-locked (CUDA): GradHomes(pinned=)
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
        """Count `n` bytes fewer held (what `alloc` or `claim` booked for the caller)."""
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

    def untrack_all(self) -> None:
        """Forget every charged storage (after an error: the pipeline no longer holds them)."""
        with self._lock:
            held = sum(n for _, n in self._tracked.values())
            self._tracked.clear()
            self.current_bytes -= held

    def stats(self) -> dict[str, int]:
        """The books now: {"peak_bytes", "current_bytes"} (a kind may add its own keys)."""
        return {"peak_bytes": self.peak_bytes, "current_bytes": self.current_bytes}

    def reset_peak(self) -> None:
        """The peak is what is held now; the stages' measured peaks are forgotten."""
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
        tls.mode = mode = OpTracker(self)
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

    # ------------------------------------------------------------------ making a kind's devices
    @classmethod
    def unavailable(cls) -> str | None:
        """Why devices of this kind cannot be made on this machine (None: they can): CUDA's
        without a GPU. `make_devices` refuses with it; the conformance suite skips with it."""
        return None

    @classmethod
    def create(cls, budgets: Mapping[str, int | None], *, indices: Mapping[str, int] | None = None,
               seed: int = 0) -> dict[str, "Device"]:
        """One device of this kind per GPU name, with its byte budget (`make_devices(device=kind)`);
        `indices`: a GPU's hardware index where the kind has several, `seed`: the first GPU's
        seed where the kind draws random numbers (each next GPU's: one more). Here: `cls(name,
        budget)` per GPU; a kind whose constructor takes more overrides it."""
        return {name: cls(name, b) for name, b in budgets.items()}

    # ------------------------------------------------------------------ the interface: weights
    @abc.abstractmethod
    def compute(self) -> contextlib.AbstractContextManager:
        """Context in which this GPU's compute runs (its compute stream), with `books()` on:
        every tensor the work creates on the GPU is charged while it lives (memory_books="ops").
        `working(stage)` enters it; a use of a stage's slots inside it comes after `ready`."""

    def new_slot(self, like: torch.Tensor, dtype: torch.dtype | None, parameter: bool) -> torch.Tensor:
        """A tensor shaped like `like` on this device (floating point: in `dtype` when given),
        with no storage until a `fill` gives it some; an `nn.Parameter` (no grad) if `parameter`.
        The runtime binds it into the stage's module once and keeps it: `fill` and `vacate` change
        its storage, never the tensor object."""
        return empty_slot(like, dtype, parameter, self.torch_device)

    @abc.abstractmethod
    def fill(self, stage: int, slots: Sequence[torch.Tensor], masters: Sequence[torch.Tensor], nbytes: int,
             prefer: int | None = None) -> Any:
        """Make stage `stage` resident: give its `slots` storage (`nbytes` of weights, or a slot
        of the pool `open_pool` booked; `prefer`: the slot the plan gives it) and start copying
        each master (a host tensor) into its slot; returns the token `ready` takes (None: the copy
        is done). Books before it copies: past the budget it raises `BudgetError` (alloc's
        message) with nothing booked and no slot given storage. Logs one "weight" h2d copy per
        slot, `sum(nbytes(slot))` bytes. A slot of the pool is refilled only after the events of
        its last use (`vacate`) completed: a read of the old weights never sees the new ones."""

    @abc.abstractmethod
    def ready(self, token: Any, slots: Sequence[torch.Tensor]) -> None:
        """Order this GPU's compute after the upload `token` (from `fill`; None: no-op): compute
        issued after `ready` reads the masters' values in the slots. On a stream device the host
        may wait only for the copy to be issued, not for it to run. Raises the upload's error."""

    def cancel(self, token: Any) -> None:
        """An error ends the step with the upload `token` in flight: let it finish (its errors
        ignored) so `vacate` can free the slots. Here: nothing is in flight."""

    @abc.abstractmethod
    def vacate(self, stage: int, slots: Sequence[torch.Tensor], nbytes: int) -> None:
        """Stage `stage` leaves the GPU (after `ready`, or `cancel`): its slots lose their storage
        (any later use fails) and the bytes `fill` booked for it are freed (a pooled slot goes back
        to the pool, whose bytes stay booked). On a stream device the memory is reused only after
        the work already issued on it (compute, downloads of it) completed: evicting frees only
        after the last use."""

    def plan_slots(self, sizes: Sequence[int], *, exact: bool = False) -> list[int]:
        """The bytes of each stage slot the schedule holds at once on this GPU (a device with a
        fixed slot pool sizes it from them, taking the larger of two plans; `exact`: this plan,
        to put back one a refused pool replaced); returns the plan it replaced. Here: nothing to
        do, no plan."""
        return []

    def open_pool(self) -> None:
        """Allocate and book the slot pool `plan_slots` sized, kept from now on (when compiling;
        past the budget: `BudgetError` naming "the weight slots"). A device without a pool books
        each stage's weights in `fill`: nothing to do."""

    def pool_bytes(self) -> int | None:
        """The bytes of the slot pool, held whichever stages are resident (None: no pool, each
        resident stage's weights are booked as it fills them)."""
        return None

    def close_pool(self) -> bool:
        """Free the slot pool if no stage is resident; whether there was one to free."""
        return False

    def slot_bytes(self, slots: Sequence[torch.Tensor]) -> int:
        """The bytes a stage with these slots takes in a slot (a pool packs with alignment)."""
        return sum(nbytes(s) for s in slots)

    def new_step(self) -> None:
        """A new step begins: masters may have changed since the last one (optimizer step)."""

    def refresh(self, masters: Sequence[torch.Tensor]) -> None:
        """The optimizer just stepped `masters`: a device keeping host copies of them to upload
        from writes them now (`StreamDevice`). Here: none kept, nothing to do."""

    @property
    def streamed_copies(self) -> StreamedCopies | None:
        """The store of the host copies of the masters in the streamed dtype this device uploads
        from, shared with the other devices of its Runtime (`StreamDevice`); None: it keeps none."""
        return None

    def use_streamed_copies(self, copies: StreamedCopies) -> None:
        """Upload from `copies` from now on: the Runtime's store, one copy per master for all its
        devices (`streamed_copies.shared_copies`). Here: none kept, nothing to do."""

    def forget_pinned_copies(self) -> None:
        """The masters changed in a way no version counter shows: any kept host copy is made
        again at its next upload (`Pipeline.refresh_weights`). Here: none kept."""

    def grad_onto(self, grad: torch.Tensor, frm: "Device | None", dtype: torch.dtype) -> torch.Tensor:
        """A gradient for stage work on this GPU from GPU `frm` (None: host memory), in `dtype`
        (the step executor's backward sends): a kind with streams copies it on its copy stream,
        ordered after `frm`'s work (`StreamDevice`). Here (a device that computes where the value
        is): the gradient itself, taken as the stage's work accepts it."""
        return grad if grad.dtype == dtype else grad.to(dtype)

    def grad_to_host(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A gradient from this GPU into host memory in `dtype` (a skip connection's gradient
        summed on the host): a kind with streams copies it on its download stream into a pinned
        buffer (`StreamDevice`). Here: a copy in `dtype`."""
        return grad.detach().to(dtype, copy=True)

    def next_copy(self, master: torch.Tensor) -> torch.Tensor | None:
        """pipe.overlap(mode="async"): a second host copy of `master` in the streamed dtype that the
        update in flight may write w(t+1) into while this step's uploads read the first, once no
        upload reads it any more (`StreamDevice`); None: no copy kept here, the update writes none."""
        return None

    def swap_copy(self, master: torch.Tensor, copy: torch.Tensor) -> None:
        """The async update that wrote `copy` (from `next_copy`) landed: it becomes the copy the
        next uploads of `master` read (`StreamDevice`). Here: none kept, nothing to do."""

    # ------------------------------------------------------------------ the interface: activations
    @abc.abstractmethod
    def accept(self, t: Any) -> Any:
        """A value arriving for stage work on this GPU (an output's gradient, from the stage
        after it or from the host): a tensor this GPU `holds` comes back as it is; another tensor
        comes back as a copy on this GPU, ordered before this GPU's later compute (charged to it
        inside `compute()`); a non-tensor as it is. Not logged (autograd's copy was)."""

    @abc.abstractmethod
    def receive(self, value: torch.Tensor, src: "Device | None", dtype: torch.dtype | None = None,
                kind: str = "activation") -> torch.Tensor:
        """A differentiable copy of `value` from `src` (a device of this kind; None: the host)
        onto this GPU, cast to `dtype` when given, ordered after `src`'s compute that made it
        and before this GPU's later compute (inside `deferred()`: before the compute after
        `join` of its event). Its gradient goes back to `value`'s place. Logs one `kind` copy,
        "h2d" from the host, "d2d" from a GPU, of the result's bytes. The runtime books the
        result (`track`); the copy itself books nothing."""

    @abc.abstractmethod
    def to_host(self, value: torch.Tensor) -> torch.Tensor:
        """A differentiable copy of `value` (on this GPU) into host memory, ordered after the
        compute that made it. A kind that copies asynchronously registers the result as pending
        (`streams.PENDING.add`): a later `receive` of it from the host (on any device) is ordered
        after the copy, and the host reads it after `PENDING.settle` (the runtime does, for the
        model's outputs). Logs one "activation" d2h copy."""

    @abc.abstractmethod
    def offload(self, t: torch.Tensor) -> Any:
        """Save a stage input (on this GPU) in host memory until backward (not differentiable,
        not booked on the GPU: called inside `working`, its host copy is not charged); returns
        what `restore` takes. Logs one "input" d2h copy."""

    @abc.abstractmethod
    def restore(self, saved: Any) -> torch.Tensor:
        """The input `offload` saved, back on this GPU, ordered before later compute (inside
        `deferred()`: before the compute after `join`). Raises MobiusError when the input was
        changed in place after the forward used it (as eager checkpointing does). Logs one
        "input" h2d copy."""

    def deferred(self) -> contextlib.AbstractContextManager[list]:
        """Copies onto this device issued inside do not order its compute after them yet: they
        add their completion events to the list yielded, and `join(events)` orders compute after
        them when their result is used (a stage's saved inputs, restored for all its micro-batches
        when its backward starts, each waited for by its own micro-batch). Here: copies are made
        at once, with no events."""
        return contextlib.nullcontext([])

    def join(self, events: Sequence[Any]) -> None:
        """Order this device's compute after `events` (from `deferred`)."""

    @abc.abstractmethod
    def download(self, t: torch.Tensor, kind: str, into: torch.Tensor | None = None,
                 addends: Sequence[torch.Tensor] = ()) -> Callable[[], torch.Tensor]:
        """Start copying `t` (on this GPU: a weight gradient, a buffer's slot) to the host,
        ordered after the compute that made it; returns a thunk that waits for the copy (the
        host blocks there, nowhere else) and gives the host tensor, whose values are `t`'s when
        `download` was called: a later `vacate` and refill of `t`'s slot does not change them.
        Logs one `kind` d2h copy of `t`'s bytes. The caller frees what it booked for `t`.

        `into`: a contiguous host tensor of `t`'s shape (pinned where `pins_host`), possibly of
        a wider dtype, that the copy is written into and the thunk gives: `t` is converted on
        this GPU, `WIDEN_CHUNK` elements at a time (the transient booked while it lives), and
        `into`'s bytes are logged (the runtime's widened gradient downloads: `Runtime._download`).
        `addends` (with `into`): host tensors of `t`'s shape (a tied weight's partials the other
        stages downloaded, runtime/tied_sums.py), brought back to this GPU chunk by chunk and
        summed in `into`'s dtype, in order, with `t` last, as it widens (`widened_chunks`), so the
        GPU never holds more than chunk-sized pieces of them (`widen_chunk` sizes the chunks to
        the memory free); the caller has waited for them to land and logs their copies (the
        schedule IR's sends)."""

    def widen_chunk(self, numel: int, per_element: int) -> int:
        """Elements a widened download converts at a time, each taking `per_element` bytes on this
        GPU: `WIDEN_CHUNK` (or `numel`, if fewer), or as many as its free budget holds, down to
        `MIN_WIDEN_CHUNK` (then the booking raises `BudgetError`, naming the download)."""
        chunk = min(numel, WIDEN_CHUNK)
        if self.budget is not None and chunk * per_element > self.budget - self.current_bytes:
            chunk = max(min(numel, MIN_WIDEN_CHUNK), (self.budget - self.current_bytes) // per_element)
        return max(1, chunk)

    @staticmethod
    def widen_bytes(into: torch.Tensor, t: torch.Tensor, addends: Sequence[torch.Tensor]) -> int:
        """Bytes per element a widened download of `t` into `into` holds on the GPU: the wider
        chunk, and one addend's chunk as it arrives (0 when nothing is widened or summed)."""
        if into.dtype == t.dtype and not addends:
            return 0
        return into.element_size() + max((a.element_size() for a in addends), default=0)

    @abc.abstractmethod
    def fetch(self, t: torch.Tensor) -> Callable[[], bool]:
        """A one-element flag (a stage's gradients all finite) read on the host: returns a thunk
        giving `bool(t)`, ordered after the compute that made it; not a transfer of the plan, so
        not logged, and nothing stays booked for it."""

    # ------------------------------------------------------------------ the interface: randomness, sync
    @abc.abstractmethod
    def rng_state(self) -> torch.Tensor:
        """The state of the generator this device's random ops use (saved per stage call)."""

    @abc.abstractmethod
    def rng(self, state: torch.Tensor) -> contextlib.AbstractContextManager[None]:
        """Run with the generator this device's random ops use set to `state` (a recompute draws
        what the forward drew), then restore the state it had before."""

    def rng_differs(self, other: "Device") -> str | None:
        """Why a generator state saved here (`rng_state`) and restored on `other` (`other.rng`)
        might not draw what it drew here (a stage's recompute on another GPU than its forward);
        None when it draws the same. Here: the same torch device draws the same, any other might
        not (a kind whose generators are interchangeable says so)."""
        if other.torch_device == self.torch_device:
            return None
        return (f"{self.name} ({self.torch_device}) and {other.name} ({other.torch_device}) are different devices of "
                f"kind {type(self).__name__}/{type(other).__name__}, which do not say their generators draw alike")

    def synchronize(self) -> None:
        """Block the host until all work queued on this device completed; raise the first error
        a queue met. Here: nothing is queued."""

    def __repr__(self) -> str:
        budget = "unlimited" if self.budget is None else fmt_bytes(self.budget)
        return f"{type(self).__name__}({self.name!r}, budget={budget}, held={fmt_bytes(self.current_bytes)})"
