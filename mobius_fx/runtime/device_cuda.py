"""`CudaDevice` (`device="cuda"`): `StreamDevice` on a real GPU's `torch.cuda` streams and
events, weights uploaded from pinned copies of the masters."""

from __future__ import annotations

import contextlib

import torch

from mobius_fx.errors import MobiusError
from mobius_fx.runtime import host_threads
from mobius_fx.runtime.device_books import widened_chunks
from mobius_fx.runtime.memory_sources import CudaAllocator
from mobius_fx.runtime.device_registry import register_device
from mobius_fx.runtime.device_stream import StreamDevice


class CudaDevice(StreamDevice):
    """A real GPU (one pipeline GPU; several may share one CUDA device, each with its streams).

    Weights upload from pinned host copies of the masters in the streamed dtype, kept across
    steps (`StreamDevice._pinned_copy`), one per master shared by every GPU of the Runtime
    (`streamed_copies.StreamedCopies`; pinned memory is readable by every GPU's DMA): made again
    by an upload worker only for masters that changed, or written by the optimizer overlap right
    after a stage's step (`refresh`).
    """

    granule = 512  # CUDACachingAllocator rounds every block up to 512 bytes (memory_allocated counts blocks)
    align = 512
    default_books = "allocator"  # no Python per op on the critical path; "ops" is the debug measurement

    def __init__(self, name: str, budget: int | None, index: int) -> None:
        super().__init__(name, budget, torch.device("cuda", index))
        least, greatest = torch.cuda.Stream.priority_range()
        with torch.cuda.device(index):
            # Compute and activation copies carry the critical path; the next stage's weights come
            # next; gradients and offloads, needed last, go at the lowest priority.
            self.compute_stream = torch.cuda.Stream(priority=greatest)
            self.copy_stream = torch.cuda.Stream(priority=greatest)
            self.upload_stream = torch.cuda.Stream(priority=(least + greatest) // 2)
            self.download_stream = torch.cuda.Stream(priority=least)

    @classmethod
    def unavailable(cls):
        if not torch.cuda.is_available():
            return ("torch.cuda.is_available() is False; use device='virtual' to run the pipeline on the CPU with "
                    "virtual GPUs")
        return None

    @classmethod
    def create(cls, budgets, *, indices=None, seed=0):
        """GPU i on cuda:`indices[name]` (default: its position modulo the CUDA devices, so a
        4-GPU topology also runs on one real GPU)."""
        reason = cls.unavailable()
        if reason is not None:
            raise MobiusError(f"device={cls.kind!r} but {reason}")
        host_threads.size_uploads(len(budgets), host_compute=False)
        count = torch.cuda.device_count()
        out = {}
        for i, (name, b) in enumerate(budgets.items()):
            index = (indices or {}).get(name, i % count)
            if not 0 <= index < count:
                raise MobiusError(f"GPU {name!r} maps to cuda:{index} but this machine has {count} CUDA device(s); "
                                  f"fix the topology's GPU indices")
            out[name] = cls(name, b, index)
        return out

    @contextlib.contextmanager
    def compute(self):
        with torch.cuda.stream(self.compute_stream), self.books():  # books(): a no-op in "allocator"
            yield

    def _default_source(self):
        return CudaAllocator.of(self.torch_device.index)  # shared by the pipeline GPUs on this CUDA device

    def _event(self):
        return torch.cuda.Event()

    def _region(self, n):
        with torch.cuda.stream(self.upload_stream):
            t = torch.empty(n, dtype=torch.uint8, device=self.torch_device)
        for s in (self.compute_stream, self.download_stream, self.copy_stream):
            t.record_stream(s)  # freed (end of step) only after the work queued on them
        return t

    def _issue_copy(self, stream, value, device, dtype, src_stream=None):
        outer = torch.cuda.stream(src_stream) if src_stream is not None else contextlib.nullcontext()
        with outer, torch.cuda.stream(stream):
            if device.type == "cpu":  # non_blocking: ATen pins the destination and copies asynchronously
                return value.to("cpu", dtype=dtype or value.dtype, non_blocking=True)
            if value.device == device:
                return value.to(dtype) if dtype is not None and dtype != value.dtype else value.clone()
            return value.to(device, dtype=dtype or value.dtype, non_blocking=True)

    def _issue_widen(self, stream, value, into, addends=(), chunk=0):
        with torch.cuda.stream(stream), torch.no_grad():
            for part, piece in widened_chunks(value, into, addends, chunk):
                # non_blocking with a dtype change: ATen converts on the GPU (a chunk-sized temporary
                # on `stream`, reused only after it) and copies the result into the pinned `into`;
                # with addends (pinned host tensors), each chunk of theirs copied up and summed into
                # that temporary on `stream` too; the last chunk's freed before the next is made
                part.copy_(piece, non_blocking=True)
                del piece

    def _used_by(self, t, stream):
        if t.is_cuda:
            t.record_stream(stream)

    def _differentiable(self, value, there, back):
        return there(value)  # torch's copies are differentiable (their backward copies back)

    pins_host = True

    def _host_buffer(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def _copy_in(self, targets, sources, last):
        with torch.cuda.stream(self.upload_stream), torch.no_grad():
            for t, s in zip(targets, sources):
                t.copy_(s, non_blocking=True)

    def accept(self, t):
        if not isinstance(t, torch.Tensor) or self.holds(t):
            return t
        if t.device == self.torch_device:  # autograd copied it here (the backward of a send)
            self.track(t, "gradient")
            return t
        return t.to(self.torch_device, non_blocking=True)

    def rng_state(self):
        return torch.cuda.get_rng_state(self.torch_device)

    def rng_differs(self, other):
        """A CUDA generator's state is its Philox seed and offset (`torch.cuda.get_rng_state`:
        16 bytes, no device in it: aten/src/ATen/cuda/CUDAGeneratorImpl.cpp `get_state`; its
        `set_state` on another GPU's generator sets those two); a random kernel's draws are a
        function of that state, its sizes and its launch grid, which torch sizes from the
        device's SM count and threads per SM (aten/src/ATen/native/cuda/Dropout.cu: `grid.x =
        min(multiProcessorCount * blocks_per_sm, ...)`; the offset advanced by a count from that
        grid). So the state of cuda:0 restored on cuda:1 draws the same numbers when both are the
        same GPU model (name, compute capability, SM count, threads per SM); others might not."""
        if not isinstance(other, CudaDevice):
            return super().rng_differs(other)
        if other.torch_device == self.torch_device:
            return None
        mine, theirs = cuda_model(self.torch_device), cuda_model(other.torch_device)
        if mine == theirs:
            return None
        return (f"{self.name} ({self.torch_device}: {mine}) and {other.name} ({other.torch_device}: {theirs}) are "
                f"different GPU models, and torch sizes a random kernel's launch grid (hence which random numbers "
                f"it draws where) from the GPU's SM count")

    @contextlib.contextmanager
    def rng(self, state):
        now = torch.cuda.get_rng_state(self.torch_device)
        torch.cuda.set_rng_state(state, self.torch_device)
        try:
            yield
        finally:
            torch.cuda.set_rng_state(now, self.torch_device)


def cuda_model(device: torch.device) -> tuple:
    """What a CUDA random kernel's draws depend on besides the generator state and the sizes:
    (name, compute capability, SM count, threads per SM)."""
    p = torch.cuda.get_device_properties(device)
    return (p.name, (p.major, p.minor), p.multi_processor_count, getattr(p, "max_threads_per_multi_processor", None))


register_device("cuda", CudaDevice)
