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
KEY_REVISION = "2026-12-06: graph nodes, placeholder shapes, ranges, guards, pytree codegen, state by name, function attributes"

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
        elif callable(v) and not isinstance(v, (nn.Module, torch.Tensor, type)):
            out.append([k, _callable_key(v, k)])
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


def _callable_key(fn: Any, name: str, depth: int = 0) -> str:
    """A hash of what a function attribute does (a model that calls `self.fn(x)` in forward bakes
    `fn` into its graph): a Python function's module, name, bytecode (nested functions' too),
    constants, defaults and the values it closes over; a partial's function and arguments; a bound
    method's function and the object it is bound to; a built-in or library routine by its qualified
    name; a callable object by its class and attributes. Values are keyed by `_value_key` (a
    tensor by its shape, dtype and bytes). `Unkeyable` for what none of these describes."""
    if depth > 6:
        raise Unkeyable(f"attribute {name!r} nests functions too deep to key")
    if isinstance(fn, torch.Tensor):
        return _value_key(fn, name, depth + 1)
    if isinstance(fn, functools.partial):
        parts: list = ["partial", _callable_key(fn.func, name, depth + 1),
                       [_value_key(a, name, depth + 1) for a in fn.args],
                       {k: _value_key(a, name, depth + 1) for k, a in sorted(fn.keywords.items())}]
    elif inspect.ismethod(fn):
        parts = ["method", _callable_key(fn.__func__, name, depth + 1), _value_key(fn.__self__, name, depth + 1)]
    elif getattr(fn, "__code__", None) is not None:
        cells = []
        for c in fn.__closure__ or ():
            try:
                cells.append(_value_key(c.cell_contents, name, depth + 1))
            except ValueError:  # an empty cell
                cells.append(None)
        parts = ["function", getattr(fn, "__module__", ""), fn.__qualname__, _code_key(fn.__code__),
                 [_value_key(d, name, depth + 1) for d in (fn.__defaults__ or ())],
                 {k: _value_key(d, name, depth + 1) for k, d in sorted((fn.__kwdefaults__ or {}).items())}, cells]
    elif inspect.isbuiltin(fn) or inspect.isroutine(fn):
        parts = ["library", getattr(fn, "__module__", None) or type(fn).__module__,
                 getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or _qualname(type(fn))]
    elif hasattr(fn, "__dict__") and not isinstance(fn, nn.Module):
        parts = ["object", _qualname(type(fn)),
                 sorted((a, _value_key(x, name, depth + 1)) for a, x in vars(fn).items() if "hash" not in a)]
    else:
        raise Unkeyable(f"attribute {name!r} is a callable {_qualname(type(fn))} whose behaviour cannot be keyed")
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _code_key(code: Any) -> list:
    """A code object's bytecode, names and constants, nested code objects (lambdas, inner
    functions) included."""
    consts = [_code_key(c) if inspect.iscode(c) else _simple(c) if _simple(c) is not None else repr(type(c))
              for c in code.co_consts]
    return [code.co_code.hex(), list(code.co_names), consts]


def _value_key(v: Any, name: str, depth: int) -> Any:
    """A value a function attribute holds (closed over, a default, a partial's argument, a bound
    method's object): plain data as it is, a tensor by shape, dtype and bytes, a function or
    object by `_callable_key`, a module by its class (its state is keyed with the model's when it
    is one of the model's modules); `Unkeyable` otherwise (a tensor on the meta device)."""
    simple = _simple(v)
    if simple is not None or v is None:
        return simple
    if isinstance(v, torch.Tensor):
        if v.device.type == "meta" or v.is_sparse or v.numel() > 1 << 24:
            raise Unkeyable(f"attribute {name!r} holds a {tuple(v.shape)} tensor whose values cannot be keyed")
        data = v.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return ["tensor", list(v.shape), str(v.dtype), hashlib.sha256(data).hexdigest()]
    if isinstance(v, nn.Module):
        return ["module", _qualname(type(v))]
    if isinstance(v, type):
        return ["class", _qualname(v)]
    if callable(v) or hasattr(v, "__dict__"):
        return _callable_key(v, name, depth)
    raise Unkeyable(f"attribute {name!r} holds a {_qualname(type(v))} whose value cannot be keyed")


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
