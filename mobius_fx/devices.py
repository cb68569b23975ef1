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

Both keep the same books (`mobius_fx.books.Device`): bytes held now and at peak, every tensor
stage work creates charged while it lives, a budget that raises `BudgetError` when exceeded, and a
log of the bytes moved per kind and direction.

    dev = VirtualDevice("gpu0", budget=parse_bytes("64MiB"))
    slot = dev.new_slot(master, dtype=None, parameter=True)   # no storage yet
    dev.alloc(nbytes(slot), "stage 0 weights"); dev.ready(dev.upload([slot], [master]), [slot])
    dev.release([slot]); dev.free(nbytes(slot), "stage 0 weights")
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .books import HOST, Device, SavedInput, TransferLog, empty_slot, nbytes
from .errors import MobiusError

__all__ = ["HOST", "Device", "VirtualDevice", "CudaDevice", "TransferLog", "make_devices", "nbytes"]


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
        return empty_slot(like, dtype, parameter, self.torch_device)

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
        return SavedInput(host, (weakref.ref(t), t._version))

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
        return empty_slot(like, dtype, parameter, self.torch_device)

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
        return SavedInput(host, event)

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
