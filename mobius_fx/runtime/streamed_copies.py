"""`StreamedCopies`: the host copies of the masters in the streamed dtype that the uploads read,
one per master for all the GPUs of a runtime.

The masters stay fp32 (or whatever the model holds) on the host; a GPU's upload reads a copy cast
to the dtype it streams (bf16, fp16), kept across steps and written again only when the master
changed (`take`). Every GPU that uploads a master -- each of ZeRO-3 offload's GPUs, the two ends of
a tied embedding, roundpipe's forward and backward GPUs -- reads the same copy: the store is the
Runtime's (mobius_fx/runtime/engine.py), handed to each of its devices
(`StreamDevice.use_streamed_copies`); a device built on its own keeps a private one. So the host
holds the model once in the streamed dtype (`planning.host_memory`: the "streamed copy" term),
and a writer -- the optimizer overlap's refresh and fused host pass, async's spare -- writes the
one copy every GPU reads next.

The rules, per master (an `Entry`, each with its own lock, made under the store's lock):

- at most one writer at a time, and no reader takes a copy while it is written (the upload
  workers of several GPUs call `take` concurrently: one copies, the others wait and read its
  copy);
- a copy is written again only after every upload that read it is done: each reader records the
  event of its upload (`release`), one per device (a device's later upload is ordered after its
  earlier ones on its upload stream), and a writer waits for all of them; a reader between `take`
  and `release` has not recorded its event yet, so a writer waits for it to (`pending`);
- "used this step" is the store's epoch (`new_step`, once per step), not a device's.

Pinned on CUDA: the copies are allocated by the device that first uploads the master
(`StreamDevice._host_buffer`: page-locked, readable by every GPU's DMA under unified addressing).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

__all__ = ["StreamedCopies", "Entry", "Event", "shared_copies", "new_step", "write_copy"]


class Event(Protocol):
    """What a reader records: the event of its upload (a CUDA or stand-in event)."""

    def synchronize(self) -> None: ...


Allocator = Callable[[torch.Size, torch.dtype], torch.Tensor]


class Entry:
    """One master's streamed copy: `host` (what uploads read), the epoch it was `used` in last
    (None: never), `current` -- (storage pointer, version) of the master it holds, None when
    unknown --, `readers` (device -> event of its last upload that read `host`), `pending`
    (readers that took `host` and have not recorded their event yet) and, under
    pipe.overlap(mode="async"), `spare` (the second copy the update in flight writes) with its
    `spare_readers`; `writes` counts the times a copy was written (by `take`, `refresh`, the host
    pass, async's update). Every field is read and written under `cond`."""

    __slots__ = ("master", "host", "used", "current", "readers", "pending", "spare", "spare_readers", "alloc", "cond",
                 "writes")

    def __init__(self, master: torch.Tensor, host: torch.Tensor, alloc: Allocator) -> None:
        self.master = master
        self.host = host
        self.used: int | None = None
        self.current: tuple[int, int] | None = None
        self.readers: dict[object, Event] = {}
        self.pending = 0
        self.spare: torch.Tensor | None = None
        self.spare_readers: dict[object, Event] = {}
        self.alloc = alloc
        self.cond = threading.Condition(threading.Lock())
        self.writes = 0

    def idle(self) -> None:
        """Wait (holding `cond`) until no reader is between `take` and `release`, then for every
        recorded upload of `host`: it may be written then."""
        self.cond.wait_for(lambda: self.pending == 0)
        _settle(self.readers)


def _settle(readers: dict[object, Event]) -> None:
    for ev in readers.values():
        ev.synchronize()
    readers.clear()


def write_copy(host: torch.Tensor, master: torch.Tensor) -> None:
    """Write `master` into its streamed copy `host` (cast): the one place `take` and `refresh`
    write a copy (the tests slow it down to widen the races the locks close)."""
    with torch.no_grad():
        host.copy_(master.detach())


def _version(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t._version  # the offset counts (a view into a flat buffer)


class StreamedCopies:
    """The streamed copies of one runtime's masters (module docstring), keyed by id(master).
    `private`: a standalone device's own store, whose epoch the device bumps itself."""

    def __init__(self, *, private: bool = False) -> None:
        self.private = private
        self.epoch = 0
        self._entries: dict[int, Entry] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, master: torch.Tensor) -> Entry | None:
        """The entry of `master`, if one was made for it (this very tensor)."""
        entry = self._entries.get(id(master))
        return entry if entry is not None and entry.master is master else None

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    def writes(self) -> int:
        """How many times a copy was written, all entries together."""
        return sum(e.writes for e in self.entries())

    def nbytes(self, spares: bool = False) -> int:
        """The host bytes of the copies (`spares`: of async's second copies too)."""
        out = 0
        for e in self.entries():
            out += e.host.numel() * e.host.element_size()
            if spares and e.spare is not None:
                out += e.spare.numel() * e.spare.element_size()
        return out

    def new_step(self) -> None:
        """A step begins (once per step: the Runtime's `begin_step`; a private store's device)."""
        with self._lock:
            self.epoch += 1

    def _entry(self, master: torch.Tensor, dtype: torch.dtype, alloc: Allocator) -> Entry:
        with self._lock:
            entry = self._entries.get(id(master))
            if entry is None or entry.master is not master or entry.host.dtype != dtype \
                    or entry.host.shape != master.shape:
                entry = Entry(master, alloc(master.shape, dtype), alloc)
                self._entries[id(master)] = entry
            return entry

    def take(self, master: torch.Tensor, dtype: torch.dtype, alloc: Allocator, trust: bool
             ) -> tuple[Entry, torch.Tensor, bool]:
        """(entry, the copy to upload from, whether this call wrote it): `master`'s copy in
        `dtype`, written first when it is not yet current -- never used, or not used this step
        and the master's (storage pointer, version) is not the one it holds (`trust`: record it
        after the write; a buffer's is never recorded: it is copied at its first upload of every
        step). The caller uploads from the copy and then calls `release`, always."""
        entry = self._entry(master, dtype, alloc)
        wrote = False
        with entry.cond:
            while entry.used is None or (entry.used != self.epoch and entry.current != _version(master)):
                if entry.pending:  # an upload of an earlier step has not recorded its event yet
                    entry.cond.wait()
                    continue  # and decide again: another worker may have written it meanwhile
                _settle(entry.readers)
                write_copy(entry.host, master)
                entry.writes += 1
                entry.current = _version(master) if trust and isinstance(master, torch.nn.Parameter) else None
                entry.used = self.epoch
                wrote = True
            entry.used = self.epoch
            entry.pending += 1
            return entry, entry.host, wrote

    @staticmethod
    def release(entry: Entry, host: torch.Tensor, reader: object, event: Event | None) -> None:
        """`reader`'s upload from `host` (what `take` gave) was issued and is done at `event`
        (None: no upload was issued after all)."""
        with entry.cond:
            if event is not None:
                if host is entry.host:
                    entry.readers[reader] = event
                elif host is entry.spare:  # swapped out meanwhile (async)
                    entry.spare_readers[reader] = event
            entry.pending -= 1
            entry.cond.notify_all()

    def refresh(self, master: torch.Tensor) -> int:
        """Write `master`'s new values into its copy (after the optimizer stepped it) unless the
        copy is current already; the bytes written (0: none)."""
        entry = self.get(master)
        if entry is None:
            return 0
        with entry.cond:
            if entry.current == _version(master):
                return 0
            entry.idle()
            write_copy(entry.host, master)
            entry.writes += 1
            entry.current = _version(master)
            return entry.host.numel() * entry.host.element_size()

    @contextlib.contextmanager
    def writing(self, entry: Entry) -> Iterator[torch.Tensor]:
        """The copy of `entry`, to be written in the block (the fused host pass): no upload reads
        it meanwhile, and every upload that read it is done."""
        with entry.cond:
            entry.idle()
            entry.writes += 1
            yield entry.host

    @staticmethod
    def mark_current(entry: Entry, master: torch.Tensor) -> None:
        """The copy holds `master` as it is now (written by the host pass before its version bump)."""
        with entry.cond:
            entry.current = _version(master)

    def forget(self) -> None:
        """Every copy is written again at its first upload of the next step."""
        for entry in self.entries():
            with entry.cond:
                entry.current = None

    def next_copy(self, master: torch.Tensor) -> torch.Tensor | None:
        """mode="async": the second copy of `master` (None when it has no first), once every
        upload that read it is done."""
        entry = self.get(master)
        if entry is None:
            return None
        with entry.cond:
            entry.cond.wait_for(lambda: entry.pending == 0)  # a reader may still record an event on it
            if entry.spare is None or entry.spare.shape != entry.host.shape or entry.spare.dtype != entry.host.dtype:
                entry.spare = entry.alloc(entry.host.shape, entry.host.dtype)
                entry.spare_readers.clear()
            _settle(entry.spare_readers)
            return entry.spare

    def swap_copy(self, master: torch.Tensor, copy: torch.Tensor, trust: bool) -> None:
        """mode="async": `copy` (from `next_copy`) holds `master`'s new values: it becomes the
        copy uploads read (current for the master as it is now, when `trust`), the old one the spare."""
        entry = self.get(master)
        if entry is None:
            return
        with entry.cond:
            entry.cond.wait_for(lambda: entry.pending == 0)
            if entry.spare is not copy:
                return
            entry.host, entry.spare = copy, entry.host
            entry.readers, entry.spare_readers = entry.spare_readers, entry.readers
            entry.writes += 1  # the update in flight wrote it
            entry.current = _version(master) if trust else None


def shared_copies(devices: list[object]) -> StreamedCopies | None:
    """Give `devices` (one runtime's) one shared store and return it: the shared one any of them
    holds already (the pipeline's other runtimes -- variants, the training step -- run on the
    same devices), else a new one; None when none of them keeps streamed copies."""
    held = [getattr(d, "streamed_copies", None) for d in devices]
    store = next((s for s in held if s is not None and not s.private), None)
    if store is None and any(s is not None for s in held):
        store = StreamedCopies()
    for d, s in zip(devices, held):
        if s is not None and s is not store:
            d.use_streamed_copies(store)
    return store


def new_step(devices: list[object]) -> None:
    """A step of a runtime on `devices` begins: each shared store they hold counts it once."""
    stores = {id(s): s for s in (getattr(d, "streamed_copies", None) for d in devices)
              if s is not None and not s.private}
    for s in stores.values():
        s.new_step()
