"""`VirtualDevice` (`device="virtual"`): a GPU of the topology played by the CPU with a byte
budget; copies made at once, storage freed on eviction (see `mobius_fx.runtime.devices`)."""

from __future__ import annotations

import contextlib
import weakref

import torch

from mobius_fx.runtime.device_books import Device, nbytes, widened_chunks
from mobius_fx.runtime.device_common import CpuRng, SavedInput, check_unchanged
from mobius_fx.runtime.device_registry import register_device


class VirtualDevice(CpuRng, Device):
    """A GPU played by the CPU: real copies made at once, a byte budget, freed storage after
    eviction. (`VirtualAsyncDevice` plays the CUDA path's streams, events and slot pool.)"""

    def __init__(self, name: str, budget: int | None) -> None:
        super().__init__(name, budget, torch.device("cpu"))

    def compute(self) -> contextlib.AbstractContextManager:
        return self.books()

    def fill(self, stage, slots, masters, nbytes_, prefer=None):
        # Booked first (nothing copied past the budget), then copied at once: no token.
        self.alloc(nbytes_, f"stage {stage}'s weights")
        try:
            with torch.no_grad():
                for s, m in zip(slots, masters):
                    s.untyped_storage().resize_(nbytes(s))
                    s.copy_(m)
        except BaseException:
            self._release(slots)
            self.free(nbytes_)
            raise
        self.log.add("weight", "h2d", sum(nbytes(s) for s in slots), len(slots))
        return None

    def ready(self, token, slots):
        pass  # the copies were made in fill

    def vacate(self, stage, slots, nbytes_):
        self._release(slots)
        self.free(nbytes_)

    @staticmethod
    def _release(slots) -> None:
        """Free the slots' storage (their shapes stay; any use now fails)."""
        for s in slots:
            s.untyped_storage().resize_(0)

    def accept(self, t):
        if not isinstance(t, torch.Tensor) or self.holds(t):
            return t
        return t.clone()  # the copy a GPU receives: host memory and other GPUs' books keep theirs until it dies

    def receive(self, value, src, dtype=None, kind="activation"):
        out = value.to(dtype) if dtype is not None and dtype != value.dtype else value.clone()
        self.log.add(kind, "h2d" if src is None else "d2d", nbytes(out))
        return out

    def to_host(self, value):
        out = value.clone()
        self.log.add("activation", "d2h", nbytes(out))
        return out

    def offload(self, t):
        # A real host copy, as a CUDA device makes (an alias would keep the GPU tensor's storage,
        # and its charge, alive until backward). The input, while it lives, tells whether it was
        # changed in place before backward: an error, as in eager checkpointing.
        self.log.add("input", "d2h", nbytes(t))
        with self.untracked():
            host = t.detach().clone()
        return SavedInput(host, (weakref.ref(t), t._version))

    def restore(self, saved):
        check_unchanged(self.name, *saved.event)
        self.log.add("input", "h2d", nbytes(saved.host))
        return saved.host.clone()  # the copy on this GPU (charged to it inside compute())

    def download(self, t, kind, into=None, addends=()):
        if into is not None:  # widened on the GPU, a chunk at a time (the transient booked), into the host tensor
            per = self.widen_bytes(into, t, addends)
            chunk = self.widen_chunk(t.numel(), per) if per else 0
            n = chunk * per
            self.alloc(n, "a downloaded gradient widened on the GPU")
            try:
                with torch.no_grad():
                    for part, value in widened_chunks(t.detach(), into, [a.detach() for a in addends], chunk):
                        part.copy_(value)
                        del value
            finally:
                self.free(n)
            self.log.add(kind, "d2h", nbytes(into))
            return lambda: into
        self.log.add(kind, "d2h", nbytes(t))
        host = t.detach().clone() if kind == "buffer" else t.detach()
        return lambda: host

    def fetch(self, t):
        """A small value the runtime reads on the host (a stage's gradient finiteness flag): not
        a transfer of the plan, so not logged. Read now (a virtual GPU computes synchronously):
        the thunk keeps no tensor charged to this device, which would stay booked while the
        step that holds the thunk lives (`current_bytes` grew by a byte per stage per step)."""
        value = bool(t)
        return lambda: value


register_device("virtual", VirtualDevice)
