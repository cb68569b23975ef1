"""`VirtualAsyncDevice` (`device="virtual-async"`): the CPU stand-in of the CUDA path --
`StreamDevice` on thread-backed streams with seeded random delays and an access sanitizer."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from mobius_fx.runtime import host_threads
from mobius_fx.runtime.device_books import widened_chunks
from mobius_fx.runtime.device_common import CpuRng
from mobius_fx.runtime.device_registry import register_device
from mobius_fx.runtime.device_stream import StreamDevice
from mobius_fx.runtime.streams import PENDING, RaceError, ThreadEvent, ThreadStream


def _alias(t: torch.Tensor) -> torch.Tensor:
    """`t`'s memory as a tensor with a version counter of its own."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.size(),
                                                               t.stride())


class _Streamed(torch.autograd.Function):
    """The stand-in's differentiable copy: `there(value)` issues it on thread streams; the
    gradient goes back by `back`, the same choreography the other way."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, there: Any, back: Any) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.back = back
        return there(value.detach())

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return (None if grad is None else ctx.back(grad)), None, None


class VirtualAsyncDevice(CpuRng, StreamDevice):
    """The CPU stand-in of a CUDA GPU (`device="virtual-async"`): `StreamDevice`'s streams,
    events and slot pool on threads (mobius_fx/runtime/streams.py), each queued item delayed at random
    (`seed`; `delay` seconds at most, `chance` of delaying an item), stage work on the issuing
    thread. A refill of a slot whose last use has not completed raises `RaceError` (and is
    listed in `races`); a copy read before its event gives wrong values, which the tests see."""

    def __init__(self, name: str, budget: int | None, *, seed: int = 0, delay: float = 2e-4,
                 chance: float = 0.5) -> None:
        super().__init__(name, budget, torch.device("cpu"))
        self.seed = seed

        def stream(role: str, inline: bool = False) -> ThreadStream:
            return ThreadStream(f"{name}-{role}", seed=seed, delay=delay, chance=chance, waits=self.waits,
                                inline=inline)

        self.compute_stream = stream("compute", inline=True)
        self.copy_stream = stream("copy")
        self.upload_stream = stream("upload")
        self.download_stream = stream("download")

    @classmethod
    def create(cls, budgets, *, indices=None, seed=0):
        """Seeded `seed`, `seed + 1`, ... in the GPUs' order; an upload worker per GPU."""
        host_threads.size_uploads(len(budgets), host_compute=True)
        return {name: cls(name, b, seed=seed + i) for i, (name, b) in enumerate(budgets.items())}

    def compute(self) -> contextlib.AbstractContextManager:
        return self.books()

    def _event(self):
        return ThreadEvent(self.waits)

    def _region(self, n):
        return torch.empty(n, dtype=torch.uint8)

    def _issue_copy(self, stream, value, device, dtype, src_stream=None):
        # A host buffer still pending is read only by a stream made to wait for its event (a host
        # read settles it first); weights, only by a compute stream that waited for their upload
        # (`working`); a slot is refilled only after its last use (`_copy_in`).
        v = value.detach()
        pending = PENDING.event(v)
        if pending is not None and not pending.ordered_before(stream, strict=True):
            self._race(f"{self.name}: a copy on {stream.name} reads a host buffer before the event that marks it "
                       f"written (the stream did not wait for it)")
        out = torch.empty_like(v, dtype=dtype or v.dtype)
        into = _alias(out)  # written later, by the stream's thread: not a version bump autograd would see
        stream.submit(lambda: into.copy_(v))
        region = self._region_of(v)
        if region is not None:  # a slot read on another stream (a buffer's download): its refill must wait for it
            mark = ThreadEvent()
            mark.record(stream)
            region.readers.append(mark._at)
        return out

    def _issue_widen(self, stream, value, into, addends=(), chunk=0):
        v = value.detach()
        pending = PENDING.event(v)
        if pending is not None and not pending.ordered_before(stream, strict=True):
            self._race(f"{self.name}: a download on {stream.name} reads a buffer before the event that marks it "
                       f"written (the stream did not wait for it)")
        dst = _alias(into)  # written later, by the stream's thread: not a version bump autograd would see

        def widen() -> None:
            with torch.no_grad():
                for part, piece in widened_chunks(v, dst, addends, chunk):  # as CUDA's: a chunk converted, then copied
                    part.copy_(piece)
                    del piece

        stream.submit(widen)
        region = self._region_of(v)
        if region is not None:
            mark = ThreadEvent()
            mark.record(stream)
            region.readers.append(mark._at)

    def _read_on(self, region, stream):
        super()._read_on(region, stream)
        mark = ThreadEvent()  # for the sanitizer: a refill not ordered after this read is a race
        mark.record(stream)
        region.readers.append(mark._at)

    def _race(self, msg: str) -> None:
        self.races.append(msg)
        raise RaceError(msg)

    def _copy_in(self, targets, sources, last):
        # Checked when issued (the upload stream was made to wait for the last use: what a GPU's
        # order rests on, whatever the host waited for) and when run (the last use completed).
        if not all(ev.ordered_before(self.upload_stream, strict=True) for ev in last):
            self._race(f"{self.name}: a slot's refill was issued without the upload stream waiting for the events "
                       f"of its last use")
        region = self._region_of(targets[0]) if targets else None
        if region is not None:
            missed = [read for read in region.readers if not any(ev.covers(read) for ev in last)]
            region.readers = []
            if missed:
                self._race(f"{self.name}: a slot was refilled without waiting for a read of it on "
                           f"{missed[0][0].name} (its last use left that stream out)")

        def copy() -> None:
            if not all(ev.query() for ev in last):
                self._race(f"{self.name}: a slot was refilled before the events of its last use completed")
            for t, s in zip(targets, sources):
                t.copy_(s)

        self.upload_stream.submit(copy)

    def working(self, stage, others=0):
        # The stage's weights are read by this work: its compute must have waited for their upload.
        region = self._pool.by_stage.get(stage) if self._pool is not None else None
        if region is not None and (region.filled is None
                                   or not region.filled.ordered_before(self.compute_stream, strict=True)):
            self._race(f"{self.name}: stage {stage} computes on its slot before the compute stream waited for the "
                       f"slot's upload")
        return super().working(stage, others)

    def _differentiable(self, value, there, back):
        if value.requires_grad and torch.is_grad_enabled():
            return _Streamed.apply(value, there, back)
        return there(value)

    def accept(self, t):
        if not isinstance(t, torch.Tensor) or self.holds(t):
            return t
        return t.clone()  # the copy a GPU receives (charged to it inside compute())


register_device("virtual-async", VirtualAsyncDevice)
