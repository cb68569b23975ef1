"""The key of a traced graph in the trace cache (`mobius_fx/trace_store.py`): a hash of everything
the trace depends on, so a changed model, input or tracer misses instead of being trusted.

It covers:

- the model's structure: every module's qualified name, class, `training` flag, hooks and simple
  attributes (ints, floats, strings, dtypes, ...: `eps`, `p`, `head_dim`), including those of the
  plain objects modules hold (an HF `config`, read in forward: `_attn_implementation`);
- its tensors: every parameter and buffer's name, shape, dtype, device and `requires_grad`, and
  which names share one tensor (tied weights);
- its code: the source file of every class in the modules' MROs (forward and the helpers beside
  it: `apply_rotary_pos_emb` lives in `modeling_llama.py`) and the version of each package those
  classes come from (torch, transformers, ...);
- the example inputs: their structure, each tensor's shape, dtype, device and `requires_grad`,
  each other value's repr;
- the tracer: `front_end`, `dynamic_batch`, this package's own source (every module of
  `mobius_fx` and `passes/`), Python's version and `KEY_REVISION`.

What it does not see: an edit to a helper in another file that is not a package with a version
(your own package's `utils.py` called from forward): pass `cache=False` (or clear the cache
directory) while editing such code.

    key = trace_key(model, (ids,), {}, front_end="auto", dynamic_batch=True)   # 64 hex digits
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["trace_key", "inputs_fingerprint", "KEY_REVISION", "Unkeyable"]

# Bump with any change to what a cached graph holds or how it is rebuilt (mobius_fx/trace_store.py).
KEY_REVISION = "2026-12-05: graph nodes, placeholder shapes, ranges, guards, pytree codegen, state by name"

_SIMPLE = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
_PACKAGE_ROOTS = (Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent / "passes")


class Unkeyable(Exception):
    """The model cannot be keyed (a class without a source file): it is traced, never cached."""


def trace_key(model: nn.Module, args: tuple, kwargs: dict, *, front_end: str, dynamic_batch: bool) -> str:
    """The trace cache's key for tracing `model` on these example inputs (64 hex digits);
    `Unkeyable` when a class of the model has no source to hash."""
    blob = {
        "revision": KEY_REVISION,
        "python": sys.version,
        "package": _package_source(),
        "front_end": front_end,
        "dynamic_batch": dynamic_batch,
        "model": _model_fingerprint(model),
        "inputs": inputs_fingerprint(args, kwargs),
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def inputs_fingerprint(args: tuple, kwargs: dict) -> list:
    """The example inputs as the trace sees them: structure, then per leaf its tensor facts or repr."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    out: list = [str(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            out.append(["tensor", list(x.shape), str(x.dtype), x.device.type, x.requires_grad])
        else:
            out.append([type(x).__qualname__, repr(x)])
    return out


def _model_fingerprint(model: nn.Module) -> dict:
    objects: dict[int, Any] = {}  # plain objects (configs) held by modules, fingerprinted once
    modules = []
    classes: set[type] = set()
    for name, m in model.named_modules(remove_duplicate=False):
        classes.update(c for c in type(m).__mro__ if c is not object)
        modules.append([name, _qualname(type(m)), m.training, _hooks(m), _attributes(m, objects)])
    canonical: dict[int, str] = {}
    tensors = []
    for kind, named in (("p", model.named_parameters(remove_duplicate=False)),
                        ("b", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            first = canonical.setdefault(id(t), name)
            tensors.append([kind, name, list(t.shape), str(t.dtype), t.device.type, t.requires_grad, first])
    return {"modules": modules, "tensors": tensors, "code": sorted(_class_source(c) for c in classes)}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _hooks(m: nn.Module) -> list[str]:
    """The functions hooked on `m` and an instance `forward` (accelerate's), by qualified name."""
    out = []
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
        for fn in getattr(m, attr, {}).values():
            out.append(f"{attr}:{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(type(fn)))}")
    if "forward" in m.__dict__:
        fn = m.__dict__["forward"]
        out.append(f"forward:{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(type(fn)))}")
    return out


def _simple(value: Any) -> Any:
    """`value` as JSON-able data when it is simple (scalars, and tuples/lists/dicts of them), else None."""
    if isinstance(value, _SIMPLE):
        return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        items = [_simple(v) for v in value]
        return items if all(i is not None or v is None for i, v in zip(items, value)) else None
    if isinstance(value, dict) and len(value) <= 64 and all(isinstance(k, str) for k in value):
        items = {k: _simple(v) for k, v in value.items()}
        return items if all(items[k] is not None or value[k] is None for k in value) else None
    return None


def _attributes(m: nn.Module, objects: dict[int, Any]) -> list:
    """`m`'s simple attributes, and a hash of each plain object it holds (its class and its own
    simple attributes; hashed once per object, into `objects`). Attributes named `*hash*` are left
    out: they differ between processes (HF's GenerationConfig keeps `_original_object_hash`)."""
    out = []
    for k, v in sorted(vars(m).items()):
        if k in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set") or "hash" in k:
            continue
        s = _simple(v)
        if s is not None or v is None:
            out.append([k, s])
        elif not isinstance(v, (nn.Module, torch.Tensor)) and hasattr(v, "__dict__") and not callable(v):
            if id(v) not in objects:
                fields = sorted([a, _simple(x)] for a, x in vars(v).items()
                                if "hash" not in a and (_simple(x) is not None or x is None))
                blob = json.dumps([_qualname(type(v)), fields], sort_keys=True, default=str)
                objects[id(v)] = hashlib.sha256(blob.encode()).hexdigest()
            out.append([k, objects[id(v)]])
    if hasattr(m, "_non_persistent_buffers_set"):
        out.append(["non-persistent", sorted(m._non_persistent_buffers_set)])
    return out


@functools.lru_cache(maxsize=None)
def _class_source(cls: type) -> str:
    """A hash of the file defining `cls` and its package's version (torch's and the standard
    library's classes: their version; Python's is in the key)."""
    top = cls.__module__.split(".")[0]
    version = str(getattr(sys.modules.get(top), "__version__", ""))
    if top in ("torch", "builtins") or top in sys.stdlib_module_names:
        return f"{_qualname(cls)} {top} {version}"
    try:
        path = inspect.getsourcefile(cls)
        data = Path(path).read_bytes() if path else inspect.getsource(cls).encode()
    except (TypeError, OSError) as e:
        raise Unkeyable(f"the source of {_qualname(cls)} cannot be read ({e}), so a cached trace of it could not "
                        f"tell a changed class from this one") from None
    return f"{_qualname(cls)} {version} {hashlib.sha256(data).hexdigest()}"


@functools.lru_cache(maxsize=None)
def _package_source() -> str:
    """A hash of this package's own source (the tracer, the graph store, the passes)."""
    h = hashlib.sha256()
    for root in _PACKAGE_ROOTS:
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()
