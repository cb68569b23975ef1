"""Call signatures: a call read the way the model's `forward` reads it, the form a traced example
passed its arguments in, and whether a traced graph holds for a call's shapes.

A traced graph serves the call it was traced for: the arguments its example gave (by name), the
dtype and rank of each tensor, the value of each non-tensor argument, and shapes — the dims
torch.export kept static, the ranges of its symbolic dims and the relations between them (its
guards, `tracing.input_guards`). A call is read the way the model's `forward` reads it
(`bind_call`): positional or keyword is the same argument; None, or a non-tensor argument equal
to its default, is an argument not given; a keyword `forward` does not take is refused, even
where the model's `**kwargs` would swallow it (HF models type theirs: a name outside that type
is refused, naming the ones it takes). `CallForm` puts a call in the form an example was traced
in; `check_shapes` says why a traced graph does not hold for a call's inputs. Which compiled
variant serves a call, and what a call no variant serves gets: `variants.py`.
"""

from __future__ import annotations

import inspect
import math
import typing
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._sympy.value_ranges import ValueRanges

from mobius_fx.errors import MobiusError
from mobius_fx.export_front import forward_signature, input_guards

__all__ = ["Call", "CallForm", "bind_call", "check_shapes"]


# ----------------------------------------------------------------------------- reading a call

@dataclass(frozen=True)
class Call:
    """One call as the model's forward reads it.

    `values`: the arguments given, by name, in forward's order (a `**kwargs` entry under its own
    name); `key`: what a traced graph fixes about them, hashable (names; for tensors dtype and
    rank; other values as they are); `sizes`: elements per argument (its tensors summed).
    """

    args: tuple
    kwargs: dict
    values: dict
    key: tuple
    generic_key: tuple  # the key a symbolic trace fixes: names and non-tensor values only
    sizes: dict


def bind_call(model: torch.nn.Module, args: tuple, kwargs: dict) -> Call:
    """Read `model(*args, **kwargs)` as its forward does; MobiusError for a call it does not
    take (a missing or unknown argument)."""
    sig = _signature(model)
    owner = f"{type(model).__name__}.forward"
    if sig is None:  # no signature to bind: the call as given
        values = {f"args[{i}]": a for i, a in enumerate(args)} | dict(kwargs)
    else:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise MobiusError(f"this call does not match {owner}{_short(sig)}: {e}; call the pipeline as you call "
                              f"the model") from None
        values = {}
        unknown: list[str] = []
        for name, value in bound.arguments.items():
            p = sig.parameters[name]
            if p.kind is p.VAR_KEYWORD:
                allowed = _typed_kwargs(p)
                for k, v in value.items():
                    if allowed is not None and k not in allowed:
                        unknown.append(k)
                    elif not _absent(v, None):
                        values[k] = v
            elif not _absent(value, p.default):
                values[name] = value
        if unknown:
            named = [n for n, p in sig.parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
            extra = sorted(set(_typed_kwargs(next(p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD))
                               or ()) - set(named))
            raise MobiusError(
                f"{owner} takes no keyword argument {', '.join(map(repr, unknown))}: its arguments are "
                f"{', '.join(named)}" + (f", and through **kwargs {', '.join(extra)}" if extra else "") +
                "; eager PyTorch would pass it into **kwargs and ignore it, the pipeline refuses it so that "
                "nothing you pass is dropped silently: remove it or fix its name")
    return Call(tuple(args), dict(kwargs), values, tuple((n, _describe(v, True)) for n, v in values.items()),
                tuple((n, _describe(v, False)) for n, v in values.items()),
                {n: sum(t.numel() for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor))
                 for n, v in values.items()})


def _signature(model: torch.nn.Module) -> inspect.Signature | None:
    return forward_signature(model)  # a PEFT wrapper's call binds as its base model's forward


def _short(sig: inspect.Signature) -> str:
    return "(" + ", ".join(p.name if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                           else str(p).split(":")[0] for p in sig.parameters.values()) + ")"


def _typed_kwargs(p: inspect.Parameter) -> frozenset[str] | None:
    """The names a typed `**kwargs: Unpack[SomeTypedDict]` takes (HF models); None = any."""
    ann = p.annotation
    if ann is p.empty or isinstance(ann, str):
        return None
    args = typing.get_args(ann)
    if typing.get_origin(ann) is typing.Unpack and args and typing.is_typeddict(args[0]):
        names: set[str] = set()
        for klass in getattr(args[0], "__mro__", (args[0],)):
            names.update(getattr(klass, "__annotations__", {}))
        return frozenset(names)
    return None


def _absent(value: object, default: object) -> bool:
    """None (for an argument whose default is None or that has none), or a non-tensor equal to
    its default: what forward does without the argument."""
    if value is None:
        return default is None or default is inspect.Parameter.empty
    if isinstance(value, tuple) and not value and default is inspect.Parameter.empty:
        return True  # an empty *args
    if isinstance(value, torch.Tensor) or default is inspect.Parameter.empty:
        return False
    try:
        return bool(type(value) is type(default) and value == default)
    except Exception:  # a value without a plain ==
        return False


def _describe(value: object, typed: bool) -> Any:
    leaves, spec = pytree.tree_flatten(value)
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            out.append(("tensor", str(x.dtype), x.dim()) if typed else ("tensor",))
        else:
            try:
                hash(x)
                out.append(("value", x))
            except TypeError:
                out.append(("value", repr(x)))
    return str(spec), tuple(out)


# ----------------------------------------------------------------------------- a traced form

@dataclass(frozen=True)
class CallForm:
    """How a traced example passed its arguments, so any call with the same key can be put in
    exactly that form (`flatten_inputs` then gives each placeholder its value)."""

    positional: tuple[str, ...]  # names the example passed positionally, in order
    keywords: tuple[str, ...]  # names it passed by keyword, in order
    fill: dict = field(default_factory=dict)  # name -> the example's value where it gave none
    var_positional: str | None = None

    @classmethod
    def of(cls, model: torch.nn.Module, args: tuple, kwargs: dict) -> "CallForm | None":
        sig = _signature(model)
        if sig is None:
            return None
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            return None
        positional, var = [], None
        left = len(args)
        for name, p in sig.parameters.items():
            if left <= 0:
                break
            if p.kind is p.VAR_POSITIONAL:
                positional.append(name)
                var = name
                break
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                positional.append(name)
                left -= 1
        fill = {n: bound.arguments.get(n) for n in positional}
        fill.update(kwargs)
        return cls(tuple(positional), tuple(kwargs), fill, var)

    def arrange(self, call: Call) -> tuple[tuple, dict]:
        args: list = []
        for name in self.positional:
            if name == self.var_positional:
                args.extend(call.values.get(name, ()))
            else:
                args.append(call.values.get(name, self.fill.get(name)))
        return tuple(args), {n: call.values.get(n, self.fill.get(n)) for n in self.keywords}

    def label(self, path: tuple) -> str:
        """The user's name of a flat input at pytree `path` of ((args), {kwargs})."""
        if not path:
            return "the input"
        rest = pytree.keystr(path[2:]) if len(path) > 2 else ""
        if getattr(path[0], "idx", None) == 1 and len(path) > 1:
            return f"{getattr(path[1], 'key', path[1])}{rest}"
        if len(path) > 1 and isinstance(getattr(path[1], "idx", None), int):
            i = path[1].idx
            fixed = [n for n in self.positional if n != self.var_positional]
            name = fixed[i] if i < len(fixed) else f"{self.var_positional or 'args'}[{i - len(fixed)}]"
            return f"{name}{rest}"
        return pytree.keystr(path)


# ----------------------------------------------------------------------------- shapes

def check_shapes(gm: fx.GraphModule, flat: list, labels: list[str]) -> str | None:
    """Why `gm` does not hold for these flat inputs (placeholder order), naming the input and
    the dimension; None when it does. Static dims, dtypes and ranks, the ranges of symbolic
    dims (the batch, dim 0, may be as small as 1: micro-batches split it) and equalities
    between them, then export's guards. A symbolic trace holds for any shape (None)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat):
        return None
    ranges = getattr(gm, "range_constraints", None) or {}
    seen: dict[Any, tuple[int, str, int]] = {}
    for ph, x, label in zip(placeholders, flat, labels):
        val = ph.meta.get("val")
        if not isinstance(val, torch.Tensor) or not isinstance(x, torch.Tensor):
            continue
        if x.dim() != val.dim():
            return (f"{label} has {x.dim()} dimensions (shape {tuple(x.shape)}); it was traced with {val.dim()} "
                    f"(shape {_shape(val)})")
        if x.dtype != val.dtype:
            return f"{label} is {x.dtype}; it was traced as {val.dtype}"
        for i, (size, want) in enumerate(zip(x.shape, val.shape)):
            if isinstance(want, torch.SymInt) and want.node.expr.is_number:
                want = int(want.node.expr)  # specialised
            if not isinstance(want, torch.SymInt):
                if size != want:
                    return (f"{label} dim {i} is {size}; the traced graph has it fixed at {want} (torch.export kept it "
                            f"static: the model's code pins it, the example's size was 0 or 1, or export could not "
                            f"trace the model with dynamic shapes)")
                continue
            expr = want.node.expr
            if not getattr(expr, "is_Symbol", False):
                continue  # a derived size: export's guards check it
            if expr in seen and seen[expr][0] != size:
                other, olabel, oi = seen[expr]
                return (f"{label} dim {i} is {size} but {olabel} dim {oi} is {other}; the traced graph has them "
                        f"equal")
            seen.setdefault(expr, (size, label, i))
            lo, hi = _bounds(ranges.get(expr))
            if i == 0:
                lo = min(lo, 1)
            if size < lo or size > hi:
                span = f"{lo} <= dim {i}" + (f" <= {hi}" if hi < math.inf else "")
                return f"{label} dim {i} is {size}; the traced graph holds for {span}"
    guards = input_guards(gm)
    if guards is not None:
        try:
            guards(*flat)
        except AssertionError as e:
            sizes = ", ".join(f"{lb} {tuple(x.shape)}" for lb, x in zip(labels, flat) if isinstance(x, torch.Tensor))
            cond = str(e).strip().removeprefix("Guard failed:").strip()
            return f"the traced graph holds only where {cond} (a guard of torch.export); this call has {sizes}"
    return None


def _bounds(vr: ValueRanges | None) -> tuple[float, float]:
    if vr is None:
        return 0, math.inf
    out = []
    for b, unbounded in ((vr.lower, 0), (vr.upper, math.inf)):
        try:
            out.append(int(b))
        except Exception:  # sympy's (int_)oo: unbounded
            out.append(unbounded)
    return out[0], out[1]


def _shape(val: torch.Tensor) -> str:
    return "(" + ", ".join(str(d) for d in val.shape) + ("," if val.dim() == 1 else "") + ")"
