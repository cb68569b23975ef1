"""Streams, events and the slot pool: the ordering a pipeline GPU's copies and compute follow.

`StreamDevice` (mobius_fx/runtime/device_stream.py) drives four streams per pipeline GPU -- compute, upload
(weights), download (gradients, offloaded inputs, values for the host) and copy (activations
between GPUs and from the host) -- and orders them with events: `event.record(stream)`,
`stream.wait_event(event)`, `event.query()`, `event.synchronize()`. On CUDA these are
`torch.cuda.Stream` and `torch.cuda.Event`. The CPU stand-in (`device="virtual-async"`) uses the
thread-backed ones here, with the same methods:

- `ThreadStream`: a worker thread that runs what is queued on it in order (copies, waits on
  events, event records), each item after a seeded random delay, so the schedule's races show
  up on the CPU: a copy that reads a buffer before the event that fills it, a slot refilled
  while its last use is still running.
- The stand-in's compute stream runs stage work on the issuing thread (PyTorch runs autograd
  there), so a compute wait blocks that thread ("device" wait: on a GPU the stream waits, not
  the host); its events are set by a lag thread after a random delay, as a GPU finishes its
  work after the host issued it.

`HostWaits` counts the blocking waits of the issuing thread by kind: "copy" (the host waits for
a copy to read its result: an output, a gradient handed to the optimizer), "flow" (the host
waits for a slot to be refilled: it may not run further ahead of a GPU), "sync" (a whole stream)
and, on the stand-in only, "device" (the compute stream's waits, run on the host). Worker
threads (named "mobius-...") are not counted. `PENDING` maps a host buffer written
asynchronously to the event that marks it written: a copy up waits for it on its stream, a host
read (`settle`) waits for it on the host.

`SlotPool`: a GPU's fixed pool of stage slots, as many as the schedule IR has stages resident on
that GPU at once, each a byte region sized from the plan, allocated once when the pipeline is
built. A stage's weights are views into one region; a region is refilled only after the events
of its last use (compute, and downloads of buffers it holds) have completed.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from mobius_fx.runtime import host_threads
from mobius_fx.errors import MobiusError

__all__ = ["tick", "HostWaits", "RaceError", "ThreadEvent", "ThreadStream", "Event", "Pending", "PENDING", "SlotPool",
           "Region", "WORKER_PREFIX"]

WORKER_PREFIX = "mobius-"  # threads of the device layer: their waits are not the host's
_SEQ = itertools.count()


def tick() -> int:
    """A global sequence number: orders host waits against the runtime's executed ops."""
    return next(_SEQ)


class RaceError(MobiusError):
    """The stand-in saw an access that no event ordered (a copy before its data, a refill
    before the last use of a slot)."""


def _on_worker() -> bool:
    return threading.current_thread().name.startswith(WORKER_PREFIX)


class HostWaits:
    """The blocking waits the issuing thread made: (seq, kind, what), in order (see module doc)."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, str, str]] = []
        self._lock = threading.Lock()

    def add(self, kind: str, what: str) -> None:
        if _on_worker():
            return
        with self._lock:
            self.entries.append((tick(), kind, what))

    def count(self, kind: str | None = None) -> int:
        return sum(1 for _, k, _ in self.entries if kind is None or k == kind)

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()


# ----------------------------------------------------------------------------- thread-backed streams

class ThreadEvent:
    """An event of a thread-backed stream: `record(stream)` marks the point reached once the
    stream has done everything queued before it; an event never recorded counts as done (as
    a CUDA event does)."""

    def __init__(self, waits: HostWaits | None = None) -> None:
        self._flag = threading.Event()
        self._flag.set()
        self._waits = waits
        self._at: tuple[Any, int] | None = None  # (stream, its n-th recording) of the latest record

    def record(self, stream: "ThreadStream") -> None:
        stream.record_event(self)

    def _arm(self) -> threading.Event:
        self._flag = threading.Event()
        return self._flag

    def wait(self, stream: "ThreadStream") -> None:
        stream.wait_event(self)

    def query(self) -> bool:
        return self._flag.is_set()

    def covers(self, read: tuple[ThreadStream, int]) -> bool:
        """Whether this event's recording comes after `read` ((stream, n-th recording) marking
        an access) on the same stream: waiting for it waits for that access."""
        return self._at is not None and self._at[0] is read[0] and self._at[1] >= read[1]

    def ordered_before(self, stream: "ThreadStream", *, strict: bool = False) -> bool:
        """Whether work queued on `stream` now runs after this event's recording: the stream was
        made to wait for it, or (unless `strict`: only a wait counts, not luck) it has completed."""
        return self._flag in stream.waited or (not strict and self._flag.is_set())

    def synchronize(self, kind: str = "copy", what: str = "event") -> None:
        if self._waits is not None:
            self._waits.add(kind, what)
        self._flag.wait()


_STOP = object()


class ThreadStream:
    """A stream played by a worker thread: queued items run in order, each after a seeded
    random delay (`delay`: the most seconds; `chance`: how often an item is delayed).

    `inline=True` (the stand-in's compute stream): work runs on the calling thread at once,
    after the stream's waits, which block the caller (logged as "device" waits); event records
    go through a lag thread, so the stream's events complete after a delay, in order."""

    def __init__(self, name: str, *, seed: int, delay: float, chance: float, waits: HostWaits,
                 inline: bool = False, priority: int = 0) -> None:
        self.name = name
        self.inline = inline
        self.priority = priority
        self._waits = waits
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.errors: list[BaseException] = []
        # The recordings this stream was made to wait for (an event's flag per recording): what
        # the stand-in's sanitizer reads to tell an access ordered by an event from a lucky one.
        self.waited: weakref.WeakSet = weakref.WeakSet()
        self._records = itertools.count(1)
        rng = random.Random(f"{seed}/{name}")
        # one intra-op thread: it plays a GPU's copy engine (host_threads.py)
        host_threads.start_thread(ThreadStream._loop, (self._q, rng, delay, chance, self.errors),
                                  f"{WORKER_PREFIX}{name}", threads=1)
        weakref.finalize(self, self._q.put, (_STOP, None))

    @staticmethod
    def _loop(q: queue.SimpleQueue, rng: random.Random, delay: float, chance: float,
              errors: list[BaseException]) -> None:
        while True:
            kind, item = q.get()
            if kind is _STOP:
                return
            if delay > 0 and rng.random() < chance:
                time.sleep(rng.uniform(0, delay))
            if kind == "wait":
                item.wait()
            elif kind == "record":
                item.set()
            else:
                try:
                    with torch.no_grad():
                        item()
                except BaseException as e:  # surfaced by StreamDevice.check()
                    errors.append(e)

    def submit(self, fn: Callable[[], None]) -> None:
        """Queue `fn` (inline: run it now)."""
        if self.inline:
            with torch.no_grad():
                fn()
        else:
            self._q.put(("work", fn))

    def wait_event(self, event: ThreadEvent) -> None:
        flag = event._flag
        self.waited.add(flag)
        if self.inline:
            if not _on_worker():
                self._waits.add("device", f"{self.name} waits for an event")
            flag.wait()
        else:
            self._q.put(("wait", flag))

    def wait_stream(self, other: "ThreadStream") -> None:
        ev = ThreadEvent()
        ev.record(other)
        self.wait_event(ev)

    def record_event(self, event: ThreadEvent) -> None:
        event._at = (self, next(self._records))
        self._q.put(("record", event._arm()))

    def synchronize(self) -> None:
        self._waits.add("sync", f"{self.name} synchronized")
        ev = ThreadEvent()
        ev.record(self)
        ev._flag.wait()


# ----------------------------------------------------------------------------- host buffers in flight

# What a stream device records and waits on: a CUDA event, or its thread-backed stand-in.
Event = torch.cuda.Event | ThreadEvent


class Pending:
    """Host buffers written asynchronously (a value sent to the host, an offloaded input),
    by storage: the event that marks the copy done, and the waits log of the device that
    made it. A copy up from such a buffer waits for the event on its stream; a host read
    (`settle`) waits for it on the host."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any, HostWaits | None]] = {}
        self._lock = threading.Lock()

    def add(self, t: torch.Tensor, event: Event, waits: HostWaits | None) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        with self._lock:
            self._entries[key] = (weakref.ref(storage, functools.partial(self._died, key)), event, waits)

    def _died(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] is ref:
                del self._entries[key]

    def event(self, t: torch.Tensor) -> Any:
        """The event that marks `t`'s host buffer written, or None (not pending)."""
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return None
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        with self._lock:
            entry = self._entries.get(id(storage))
        if entry is None or entry[0]() is not storage:
            return None
        return entry[1]

    def settle(self, t: object, what: str) -> None:
        """The host is about to read `t`: wait for its copy (a blocking host copy, logged)."""
        if not isinstance(t, torch.Tensor):
            return
        storage = None
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        with self._lock:
            entry = self._entries.pop(id(storage), None)
        if entry is None or entry[0]() is not storage:
            return
        _, event, waits = entry
        if isinstance(event, ThreadEvent):
            event.synchronize("copy", what)
            return
        if waits is not None:
            waits.add("copy", what)
        event.synchronize()


PENDING = Pending()


# ----------------------------------------------------------------------------- the slot pool

class Region:
    """One stage slot: a byte region on the GPU, the stage it holds and its last use."""

    __slots__ = ("index", "bytes", "tensor", "stage", "last_use", "filled", "readers", "reads")

    def __init__(self, index: int, nbytes: int, tensor: torch.Tensor) -> None:
        self.index = index
        self.bytes = nbytes
        self.tensor = tensor  # uint8, `bytes` long
        self.stage: int | None = None
        self.last_use: list[Any] = []  # events: refill only after all have completed
        self.filled: Any = None  # the event of its last upload (compute waits for it)
        self.readers: list[tuple[Any, int]] = []  # the stand-in's copies that read it: (stream, recording)
        self.reads: list[Any] = []  # events of reads on other streams while resident (part of its last use)


class SlotPool:
    """A GPU's stage slots: `sizes[i]` bytes for slot i, allocated together when the pipeline is
    built and kept step after step. `take` gives a stage a free slot
    (the one the plan assigned it when free and large enough, else the smallest that fits);
    with none free or none large enough -- a backward in an order the IR did not plan -- it
    grows or adds one and counts an overflow."""

    def __init__(self, sizes: Sequence[int], alloc: Callable[[int], torch.Tensor]) -> None:
        self.regions = [Region(i, n, alloc(n)) for i, n in enumerate(sizes)]
        self._alloc = alloc
        self.in_use = 0
        self.max_in_use = 0
        self.overflows = 0
        self.by_stage: dict[int, Region] = {}

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.regions)

    def take(self, stage: int, need: int, prefer: int | None, charge: Callable[[int], None]) -> Region:
        """A free region for `stage` (`need` bytes); `charge(n)` books the bytes the pool must
        grow by first (it raises when they do not fit, and nothing changes)."""
        free = [r for r in self.regions if r.stage is None]
        fit = [r for r in free if r.bytes >= need]
        if prefer is not None and prefer < len(self.regions) and self.regions[prefer] in fit:
            region = self.regions[prefer]
        elif fit:
            region = min(fit, key=lambda r: (r.bytes, r.index))
        elif free:  # none large enough: grow one (its old storage is dropped: the allocator frees
            region = max(free, key=lambda r: r.bytes)  # it after the streams that used it)
            charge(need - region.bytes)
            region.tensor, region.bytes, region.last_use = self._alloc(need), need, []
            self.overflows += 1
        else:  # none free: one more slot than the IR holds
            charge(need)
            region = Region(len(self.regions), need, self._alloc(need))
            self.regions.append(region)
            self.overflows += 1
        region.stage = stage
        region.filled = None
        self.by_stage[stage] = region
        self.in_use += 1
        self.max_in_use = max(self.max_in_use, self.in_use)
        return region

    def give_back(self, stage: int, last_use: list[Event]) -> Region | None:
        region = self.by_stage.pop(stage, None)
        if region is None:
            return None
        region.stage = None
        region.last_use = list(last_use) + region.reads  # and what other streams read of it meanwhile
        region.reads = []
        self.in_use -= 1
        return region


def layout(slots: Sequence[torch.Tensor], align: int) -> tuple[list[int], int]:
    """Byte offsets of `slots` packed into one region (each aligned to `align`), and its size."""
    offsets, at = [], 0
    for s in slots:
        offsets.append(at)
        at += -(-(s.numel() * s.element_size()) // align) * align
    return offsets, at


def views(region: torch.Tensor, slots: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[torch.Tensor]:
    """Each slot's place in `region` (uint8): a contiguous tensor of its dtype and shape."""
    out = []
    for s, at in zip(slots, offsets):
        n = s.numel() * s.element_size()
        out.append(region[at:at + n].view(s.dtype).view(s.shape))
    return out


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield
