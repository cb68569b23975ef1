"""Where a device in memory_books="allocator" measures a stage's work (mobius_fx/runtime/device_books.py): a
`MemorySource` says the bytes allocated now and the most allocated at once since a `Mark` --
the device's own books (`BookedBytes`, virtual devices) or CUDA's caching allocator
(`CudaAllocator`, one per CUDA device, shared by the pipeline GPUs on it).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["Mark", "MemorySource", "BookedBytes", "CudaAllocator"]


class Mark:
    """An open measuring window of a `MemorySource`: the bytes allocated when it began (`start`)
    and the most allocated at once since (`peak`)."""

    __slots__ = ("start", "peak")

    def __init__(self, start: int) -> None:
        self.start = start
        self.peak = start


class MemorySource:
    """Where a device in memory_books="allocator" measures a stage's work: bytes allocated now,
    and the most allocated at once since a mark. Windows may nest and may be open on several
    devices sharing the source (pipeline GPUs on one CUDA device); each sees every allocation
    made while it is open, on any thread."""

    what = "the allocator"  # said in a BudgetError

    def allocated(self) -> int:
        """Bytes allocated now."""
        raise NotImplementedError

    def mark(self) -> Mark:
        """Open a window: its start is the bytes allocated now."""
        raise NotImplementedError

    def peak_since(self, mark: Mark) -> int:
        """Close `mark`'s window and return the most bytes allocated at once while it was open."""
        raise NotImplementedError


class BookedBytes(MemorySource):
    """A device's own books as the source (virtual devices in memory_books="allocator"): what
    the runtime books per tensor -- slots, gradient sums, activations handed out -- and nothing
    a stage's work creates in between, which only the "ops" tracker or a real allocator sees."""

    what = "the runtime's books"

    def __init__(self, dev: Any) -> None:  # a books.Device
        self.dev = dev

    def allocated(self) -> int:
        return self.dev.current_bytes

    def mark(self) -> Mark:
        return self.dev._open_mark()

    def peak_since(self, mark: Mark) -> int:
        return self.dev._close_mark(mark)


class CudaAllocator(MemorySource):
    """CUDA's caching allocator on one CUDA device (`of(index)`: one per device, shared by the
    pipeline GPUs on it): `torch.cuda.memory_allocated` now; the peak since a mark from
    `max_memory_allocated` after `reset_peak_memory_stats` at the mark. The reset is device-wide,
    so torch's own peak then covers only the time since the latest window began: this source
    folds every peak it reads into `max_allocated()` (reset by `reset_max()`), the device's most
    allocated at once as torch would have said it."""

    what = "the CUDA caching allocator"
    _by_index: dict[int, "CudaAllocator"] = {}
    _guard = threading.Lock()

    @classmethod
    def of(cls, index: int) -> "CudaAllocator":
        with cls._guard:
            src = cls._by_index.get(index)
            if src is None:
                src = cls._by_index[index] = cls(index)
            return src

    def __init__(self, index: int) -> None:
        self.index = index
        self._lock = threading.Lock()
        self._open: list[Mark] = []
        self._high = 0

    def _stats(self) -> tuple[int, int]:
        """(allocated now, peak since the last reset), from one read of the allocator's stats."""
        a = torch.cuda.memory_stats_as_nested_dict(self.index)["allocated_bytes"]["all"]
        return a["current"], a["peak"]

    def _fold(self, peak: int) -> None:
        for m in self._open:
            if peak > m.peak:
                m.peak = peak
        if peak > self._high:
            self._high = peak

    def allocated(self) -> int:
        return self._stats()[0]

    def mark(self) -> Mark:
        with self._lock:
            now, peak = self._stats()
            self._fold(peak)
            torch.cuda.reset_peak_memory_stats(self.index)  # the peak is now `now`
            m = Mark(now)
            self._open.append(m)
            return m

    def peak_since(self, mark: Mark) -> int:
        with self._lock:
            self._fold(self._stats()[1])
            self._open.remove(mark)
            return mark.peak

    def max_allocated(self) -> int:
        """The most bytes allocated at once on the device since `reset_max()` (or since this
        source first read it): what `torch.cuda.max_memory_allocated` says without the resets."""
        with self._lock:
            self._fold(self._stats()[1])
            return self._high

    def reset_max(self) -> None:
        """Start `max_allocated()` (and torch's peak) again from the bytes allocated now."""
        with self._lock:
            self._fold(self._stats()[1])  # open windows keep what they saw
            torch.cuda.reset_peak_memory_stats(self.index)
            self._high = self._stats()[0]
