"""Helpers of the annotate pass: what it measures with and how (keys of identical ops,
copies of the state a node reads, timing, the roofline model, device and dtype choices).

    t = median_time(lambda: fn(*args), 1, 5, synchronizer([]))   # seconds, median of 5 runs
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mobius_fx.topology.device_specs import DEVICE_SPECS, DeviceSpec

_log = logging.getLogger("mobius_fx")

__all__ = ["node_key", "Unkeyable", "value_spec", "tensor_leaves", "unique_tensors", "value_bytes", "roofline", "meta_like", "all_real", "host_spec", "cuda_devices", "holding", "synchronizer", "median_time", "LiveBytes",
           "last_uses", "report"]


def node_key(node: fx.Node, fn: Any, args: Any, kwargs: Any, state: dict[str, torch.Tensor]) -> Any:
    """Hashable identity of what a node computes, or None if it cannot be keyed safely."""
    try:
        if node.op == "call_module":
            module = fn.module
            target: Any = (type(module), module.extra_repr(), module.training,
                           tuple((k, value_spec(v)) for k, v in sorted(state.items())))
        elif node.op == "call_method":
            target = ("method", node.target)
        else:
            target = node.target
        key = (node.op, target, value_spec(args), value_spec(kwargs))
        hash(key)
        return key
    except (TypeError, Unkeyable):
        return None


class Unkeyable(Exception):
    pass


def value_spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad, x.device.type)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(value_spec(i) for i in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, value_spec(v)) for k, v in x.items()))
    if x is None or isinstance(x, (bool, int, str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return x
    if isinstance(x, float):
        return ("f", repr(x))
    if isinstance(x, slice):
        return ("slice", value_spec(x.start), value_spec(x.stop), value_spec(x.step))
    raise Unkeyable(type(x).__name__)


def tensor_leaves(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def unique_tensors(x: Any) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensor_leaves(x):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def value_bytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in unique_tensors(x))


def roofline(flops: float, nbytes: float, spec: DeviceSpec, dtype: Any) -> float:
    compute = flops / (spec.peak_flops(dtype) * spec.efficiency) if flops else 0.0
    memory = nbytes / spec.memory_bandwidth if nbytes else 0.0
    return max(compute, memory)


def meta_like(t: torch.Tensor, cast: torch.dtype | None = None) -> torch.Tensor:
    """A meta tensor like `t`; a floating one in `cast` when given (as a mixed-precision stage holds it)."""
    dtype = cast if cast is not None and t.is_floating_point() else t.dtype
    out = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")
    if t.requires_grad and (t.is_floating_point() or t.is_complex()):
        out.requires_grad_(True)
    return out


def all_real(gm: fx.GraphModule, flat: list[Any]) -> bool:
    tensors = tensor_leaves(flat) + list(gm.parameters()) + list(gm.buffers())
    return all(not t.is_meta for t in tensors)


def host_spec(gm: fx.GraphModule, flat: list[Any], spec: DeviceSpec) -> DeviceSpec:
    tensors = tensor_leaves(flat) + list(gm.parameters())
    return spec if any(t.is_cuda for t in tensors) else DEVICE_SPECS["cpu"]


def cuda_devices(flat: list[Any]) -> list[int]:
    return sorted({t.device.index or 0 for t in tensor_leaves(flat) if t.is_cuda})


def holding(module: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of `module` and its submodules (same code, hooks and configuration) whose
    parameters and buffers are `state`'s tensors, by local name; `module` is left as it is."""
    memo: dict[int, nn.Module] = {}

    def shell(m: nn.Module) -> nn.Module:
        if id(m) not in memo:
            new = object.__new__(type(m))
            new.__dict__.update(m.__dict__)
            memo[id(m)] = new
            new.__dict__["_parameters"] = dict(m._parameters)
            new.__dict__["_buffers"] = dict(m._buffers)
            new.__dict__["_modules"] = {k: (shell(v) if v is not None else None) for k, v in m._modules.items()}
        return memo[id(m)]

    root = shell(module)
    for name, t in state.items():
        path, _, attr = name.rpartition(".")
        owner = root.get_submodule(path) if path else root
        (owner._parameters if attr in owner._parameters else owner._buffers)[attr] = t
    return root


def synchronizer(tensors: list[torch.Tensor]) -> Callable[[], None]:
    if any(t.is_cuda for t in tensors):
        return torch.cuda.synchronize
    return lambda: None


def median_time(fn: Callable[..., None], warmup: int, repeats: int, sync: Callable[[], None],
                 setup: Callable[[], tuple] | None = None) -> float:
    """Median time of `fn()` (of `fn(*setup())` with `setup`, made before the clock starts)."""
    for _ in range(warmup):
        fn(*(setup() if setup is not None else ()))
    times = []
    for _ in range(repeats):
        a = setup() if setup is not None else ()
        sync()
        t0 = time.perf_counter()
        fn(*a)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages the ops run under it create, while they live, and their peak:
    what a device's books (mobius_fx/runtime/device_books.py) would charge, on meta tensors. Views of one
    storage count once; a storage counts from the op that makes it until it dies."""

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self._live: dict[int, tuple[weakref.ref, int]] = {}

    def _died(self, key: int, ref: weakref.ref) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[0] is ref:
            del self._live[key]
            self.current -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {k for k in map(_storage_id, tensor_leaves((args, kwargs))) if k is not None}
        for t in tensor_leaves(out):
            key = _storage_id(t)
            if key is None or key in self._live or key in given:  # a view or the input itself: nothing new
                continue
            storage = t.untyped_storage()
            n = storage.nbytes()
            self._live[key] = (weakref.ref(storage, functools.partial(self._died, key)), n)
            self.current += n
            self.peak = max(self.peak, self.current)
        return out


def _storage_id(t: torch.Tensor) -> int | None:
    try:
        return id(t.untyped_storage())
    except (RuntimeError, NotImplementedError):  # storage-less layouts
        return None


def last_uses(nodes: list[fx.Node], keep: Callable[[fx.Node], bool] = lambda v: True) -> dict[fx.Node, list[fx.Node]]:
    """node -> the values (those `keep` accepts) whose last use among `nodes`, in order, is that node:
    where a run over `nodes` may free them."""
    last: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        for value in node.all_input_nodes:
            last[value] = node
    frees: dict[fx.Node, list[fx.Node]] = {}
    for value, node in last.items():
        if keep(value):
            frees.setdefault(node, []).append(value)
    return frees


def report(progress: Callable[[str], None] | None, message: str) -> None:
    """Log `message` on the "mobius_fx" logger and hand it to `progress` when given."""
    _log.info(message)
    if progress is not None:
        progress(message)
