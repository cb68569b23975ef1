"""Python values a compiled graph baked in, checked at every call.

A trace runs `forward` once: a Python attribute it reads (`self.temperature`, an int
`self.top_k`, `F.dropout(x, self.p)` inside a module the tracer traced through) becomes a
constant of the graph. Changed on the model after compile, eager PyTorch would use the new
value; the graph would silently keep the old one. So `PythonState` snapshots, at compile, every
plain Python attribute of every module of the model (None, bool, int, float, str, dtype,
device, and tuples, lists and small dicts of these; torch's own bookkeeping and `training`,
which the pipeline follows, left out) and, at each call, finds what changed:

- on a module the pipeline runs as a leaf (a torch.fx `call_module`: the stage calls a shallow
  copy of it, a *shell*, with the module's own code), the runtime copies the new values into
  its shells before each step (`sync_shells`), so a change computes as in eager
  (`Dropout.p = 0.0` on the fx path);
- anywhere else (a value torch.fx or torch.export folded into the graph) the call is refused
  with a `MobiusError` naming the attribute, its compiled and its current value, and the
  remedy: compile again, or keep the value in a buffer or pass it as an argument.

An attribute set on an instance where forward read the class's value (`model.scale = 2` over
`class M: scale = 1`) counts as a change too. The check reads each module's `__dict__` once:
microseconds for a few hundred modules.

    state = PythonState(model)
    model.temperature = 0.5
    state.check(synced=set())  # MobiusError: `temperature` was 1.0 at compile, is 0.5 now
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
from torch import nn

from mobius_fx.errors import MobiusError

__all__ = ["PythonState", "plain", "reads_training", "sync_shells", "user_path"]

_MISSING = object()
_NOT_PLAIN = object()
# nn.Module's own bookkeeping (parameters, buffers, children, hook dicts, `training`): not
# values a forward computes with, or followed by the pipeline on its own
_TORCH_KEYS = frozenset(nn.Module().__dict__) | {"training"}
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def plain(value: object, depth: int = 0) -> Any:
    """A comparable frozen copy of a plain Python value, `_NOT_PLAIN` for anything else
    (tensors, modules, functions, configs). NaN compares equal to NaN."""
    if isinstance(value, _SCALARS):
        if isinstance(value, float) and math.isnan(value):
            return ("nan",)
        return (type(value), value)
    if depth < 2 and isinstance(value, (tuple, list)) and len(value) <= 64:
        items = tuple(plain(v, depth + 1) for v in value)
        return _NOT_PLAIN if any(i is _NOT_PLAIN for i in items) else (type(value), items)
    if depth < 2 and isinstance(value, dict) and len(value) <= 64:
        items = tuple((plain(k, depth + 1), plain(v, depth + 1)) for k, v in value.items())
        return _NOT_PLAIN if any(_NOT_PLAIN in kv for kv in items) else (dict, items)
    return _NOT_PLAIN


def _attributes(module: nn.Module) -> dict[str, tuple[Any, Any]]:
    """name -> (the value object, its frozen copy), for every plain instance attribute."""
    out = {}
    for key, value in module.__dict__.items():
        if key in _TORCH_KEYS:
            continue
        frozen = plain(value)
        if frozen is not _NOT_PLAIN:
            out[key] = (value, frozen)
    return out


def sync_shells(user: nn.Module, shell: nn.Module) -> None:
    """Give a stage's shell of a leaf module the module's current plain attributes (and mode)."""
    shell.training = user.training
    # register_full_backward_hook sets this flag on the module (the hook dicts are shared)
    shell.__dict__["_is_full_backward_hook"] = user.__dict__.get("_is_full_backward_hook")
    for key, value in user.__dict__.items():
        if key not in _TORCH_KEYS and shell.__dict__.get(key, _MISSING) is not value and plain(value) is not _NOT_PLAIN:
            shell.__dict__[key] = value


def reads_training(module: nn.Module) -> bool:
    """Whether code of the module's own classes (not torch's) reads an attribute `training`
    (`if self.training:`, `dropout_p=self.p if self.training else 0.0`): torch.fx bakes such a
    read of a module it traces through into its graph, so that train()/eval() no longer reach it."""
    def names(code: types.CodeType) -> bool:
        return "training" in code.co_names or any(names(c) for c in code.co_consts if hasattr(c, "co_names"))

    for cls in type(module).__mro__:
        if cls is object or cls.__module__.startswith("torch."):
            continue
        for fn in vars(cls).values():
            code = getattr(getattr(fn, "__func__", fn), "__code__", None)
            if code is not None and names(code):
                return True
    return False


def user_path(model: nn.Module, path: str) -> str:
    """`path` (a `named_modules` / `named_parameters` name in `model`) as the user names it: a model
    wrapping the user's (`train_step`'s LossModel: `user_root = "model"`) drops that prefix."""
    root = getattr(type(model), "user_root", "")
    if root and (path == root or path.startswith(root + ".")):
        return path[len(root) + 1:]
    return path


class PythonState:
    """The plain Python attributes of a model's modules at compile; see the module docstring."""

    def __init__(self, model: nn.Module) -> None:
        self.entries: list[tuple[str, nn.Module, dict[str, tuple[Any, Any]], int]] = []
        for path, module in model.named_modules():
            attrs = _attributes(module)
            self.entries.append((user_path(model, path), module, attrs, len(module.__dict__)))

    def check(self, synced: set[int]) -> None:
        """Raise a MobiusError for the first attribute changed since compile on a module whose
        id is not in `synced` (the leaf modules whose shells the runtime keeps up to date)."""
        for path, module, attrs, size in self.entries:
            if id(module) in synced:
                continue
            d = module.__dict__
            for key, (obj, frozen) in attrs.items():
                now = d.get(key, _MISSING)
                if now is obj and isinstance(obj, _SCALARS):
                    continue
                if now is _MISSING:
                    now = getattr(type(module), key, _MISSING)
                if now is _MISSING or plain(now) != frozen:
                    self._refuse(path, module, key, obj, now)
            if len(d) != size:  # an instance attribute added (or removed) since compile
                for key, value in d.items():
                    if key in attrs or key in _TORCH_KEYS:
                        continue
                    before = getattr(type(module), key, _MISSING)
                    if before is not _MISSING and plain(before) is not _NOT_PLAIN and plain(value) != plain(before):
                        self._refuse(path, module, key, before, value)

    @staticmethod
    def _refuse(path: str, module: nn.Module, key: str, old: object, new: object) -> None:
        name = f"{path}.{key}" if path else key
        now = "deleted" if new is _MISSING else f"is {new!r} now"
        raise MobiusError(
            f"the model's attribute `{name}` ({type(module).__name__}) was {old!r} when the model was compiled and "
            f"{now}; the compiled graph computes with the value it had when traced (a Python value forward reads "
            f"becomes a constant of the graph), so this call would silently differ from the model. Compile the model "
            f"again after changing it (mobius_fx.compile), or keep a value that changes between calls in a tensor: "
            f"a buffer (register_buffer) or a forward argument")
