"""The per-op tracker of a device's books (memory_books="ops"; mobius_fx/runtime/device_books.py):
a dispatch mode that charges every new storage a stage's work creates on the device, from the op
that makes it until it dies. `Device.books()` enters it; Python runs on every op
(`Device.dispatch_calls` counts them)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpTracker", "Books"]


class Books(Protocol):
    """What the tracker reads and charges of a device (`device_books.Device` is one)."""

    torch_device: torch.device
    dispatch_calls: int

    def _charge(self, storage: torch.UntypedStorage, why: tuple[str, object]) -> None: ...

_FRESH: dict[torch._ops.OpOverload, tuple[bool, ...]] = {}  # op -> per return: a new tensor (its schema says no alias)


def _fresh_returns(func: torch._ops.OpOverload) -> tuple[bool, ...]:
    try:
        return tuple(r.alias_info is None for r in func._schema.returns)
    except AttributeError:  # not an aten op with a schema
        return ()


class OpTracker(TorchDispatchMode):
    """The tracker `Device.books()` enters (memory_books="ops"): every op's new output tensors on the device (not
    views, not in-place results: the op's schema says which are aliases) have their storage
    charged to the device's books until the storage dies. A budget error raised here is raised
    by the op, before its result is used; the result, never charged, is freed with it."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no dynamo-disabling wrapper around __torch_dispatch__: a few us per op saved

    def __init__(self, dev: Books) -> None:
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

    def _charge(self, t: torch.Tensor, func: torch._ops.OpOverload) -> None:
        if self.where is not None and t.device != self.where:
            return  # a host copy made during the work (CUDA: pinned offloads)
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
            return
        self.dev._charge(storage, (self.label, func))

