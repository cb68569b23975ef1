"""The torch.export front end of `mobius_fx.trace`: export with dynamic sequence and batch
dimensions where the model allows them, the exported shape guards kept off the graph (checked
once per call, `input_guards`), and an explicit forward signature for models whose forward takes
only `*args, **kwargs` (PEFT wrappers), without which export cannot match dynamic shapes.

    gm, error, dynamic_batch = try_export(model, (ids,), {"attention_mask": mask}, dynamic_batch=True)
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from mobius_fx.errors import first_line

__all__ = ["try_export", "forward_signature", "export_signature", "explicit_forward", "input_guards"]


def try_export(model: nn.Module, args: tuple, kwargs: dict,
                dynamic_batch: bool) -> tuple[fx.GraphModule | None, str, bool]:
    """Export with every dim of every tensor input `Dim.AUTO` (sequence lengths vary between
    calls), else dim 0 only, else static shapes; `dynamic_batch=False`: static only.

    The exported guards (static dims, ranges, equalities between dims, the model's own shape
    conditions) are kept off the graph, as `input_guards(gm)`: the pipeline checks each call
    with them once, on the whole batch (in the graph they would run per stage and micro-batch).
    """
    error = ""
    args, kwargs = _unaliased(args, kwargs)
    attempts = ["all", "batch", None] if dynamic_batch else [None]
    with explicit_forward(model, export_signature(model, args, kwargs)):
        for dims in attempts:
            try:
                shapes = _dynamic_shapes(model, args, kwargs, dims) if dims else None
                if dims and shapes is None:
                    continue
                ep = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=shapes)
                gm = ep.module(check_guards=True)
                _detach_guards(gm)
                _drop_metadata_asserts(gm)
                return gm, "", dims is not None and _has_symbolic_batch(gm)
            except Exception as e:
                error = first_line(e)
                if not dims or "DataDependent" in type(e).__name__:
                    break  # static shapes would not help a data-dependent branch
    return None, error, False


def forward_signature(model: nn.Module) -> inspect.Signature | None:
    """The signature a call of `model` binds against: its forward's, except for a wrapper whose
    forward takes only `*args, **kwargs` and hands them to the model it wraps (PEFT's
    `PeftModel`: `get_base_model()`), whose call binds as the wrapped model's forward would
    bind it. None when the forward has no signature to read."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    if not _only_variadic(sig) or not callable(getattr(model, "get_base_model", None)):
        return sig
    try:
        base = model.get_base_model()
    except Exception:  # a get_base_model of another meaning: the wrapper's own signature
        return sig
    inner = forward_signature(base) if isinstance(base, nn.Module) and base is not model else None
    return inner if inner is not None else sig


def _only_variadic(sig: inspect.Signature) -> bool:
    return bool(sig.parameters) and all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values())


def export_signature(model: nn.Module, args: tuple, kwargs: dict) -> inspect.Signature | None:
    """The signature to export `model` under, None for its forward's own.

    torch.export (2.13) cannot match dynamic shapes to an example that passes values through
    `*args` or `**kwargs` ("Must provide a tree_name when there might be a mismatch"), and then
    traces static shapes, which micro-batches cannot run. Such a model (a PEFT `PeftModel`:
    `forward(*args, **kwargs)`) is exported under an explicit signature: `forward_signature`'s
    (the wrapped model's) when the example binds to it without `*args`/`**kwargs`, else one made
    of the example's own arguments (positional `args_0`, ..., then its keywords by name)."""

    def binds_plainly(sig: inspect.Signature | None) -> bool:
        if sig is None:
            return False
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            return False
        return all(sig.parameters[n].kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
                   or not v for n, v in bound.arguments.items())

    try:
        own = inspect.signature(model.forward)
    except (TypeError, ValueError):
        own = None
    if own is None or binds_plainly(own):
        return None
    sig = forward_signature(model)
    if sig is not own and binds_plainly(sig):
        return sig
    P = inspect.Parameter
    return inspect.Signature([P(f"args_{i}", P.POSITIONAL_ONLY) for i in range(len(args))] +
                             [P(k, P.KEYWORD_ONLY) for k in kwargs])


@contextlib.contextmanager
def explicit_forward(model: nn.Module, sig: inspect.Signature | None):
    """Meanwhile `model.forward` is a thin wrapper of itself with signature `sig` (nothing else
    changes: torch.export still traces the user's model, so parameter names and module paths are
    the model's own, and the graph reads the model's very tensors); no-op for None."""
    if sig is None:
        yield
        return
    missing = object()
    saved = model.__dict__.get("forward", missing)  # an instance forward (accelerate's hooks) is kept
    inner = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs)

    forward.__signature__ = sig  # type: ignore[attr-defined]
    model.__dict__["forward"] = forward
    try:
        yield
    finally:
        if saved is missing:
            model.__dict__.pop("forward", None)
        else:
            model.__dict__["forward"] = saved


def _unaliased(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example inputs, each tensor that shares storage with an earlier one cloned.

    torch.export traces aliased inputs as one: for `model(ids, labels=ids)` its graph embeds
    `labels` where the model embeds `input_ids`, which is wrong for any call that passes two
    different tensors. Traced apart, the graph is right for both (and for aliased calls too).
    """
    seen: set = set()

    def apart(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        key = id(x) if x.is_meta or x.untyped_storage().data_ptr() == 0 else x.untyped_storage().data_ptr()
        if key in seen:
            return x.detach().clone().requires_grad_(x.requires_grad)
        seen.add(key)
        return x

    return pytree.tree_map(apart, (tuple(args), dict(kwargs)))


def _detach_guards(gm: fx.GraphModule) -> None:
    """Take export's `_guards_fn` call off the graph; keep it as gm.meta["mobius_guards"]."""
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]
    guards = getattr(gm, "_guards_fn", None)
    for node in calls:
        gm.graph.erase_node(node)
    if guards is not None:
        delattr(gm, "_guards_fn")  # so a direct gm(...) call checks the ranges itself, as before
        gm.meta["mobius_guards"] = guards
    if calls:
        gm.recompile()


def _drop_metadata_asserts(gm: fx.GraphModule) -> None:
    """Erase export's `aten._assert_tensor_metadata` nodes (in `gm` and the bodies of its
    higher-order ops). Export writes one before each `.to(...)` with the trace-time dtype and
    device of its input; the pipeline changes both on purpose (bf16 streaming casts a value as
    it crosses a stage, autocast makes bf16 activations, a stage runs on its GPU), so the
    asserts would refuse correct programs ("Tensor dtype mismatch! Expected: Float"). They
    compute nothing: the `.to` that follows each one is kept."""
    target = torch.ops.aten._assert_tensor_metadata.default
    for mod in list(gm.modules()):
        if not isinstance(mod, fx.GraphModule):
            continue
        asserts = [n for n in mod.graph.nodes if n.op == "call_function" and n.target is target and not n.users]
        for node in asserts:
            mod.graph.erase_node(node)
        if asserts:
            mod.recompile()


def input_guards(gm: fx.GraphModule) -> Callable[..., None] | None:
    """The export guards of `gm` as a function of its flat inputs (placeholder order) that
    raises AssertionError("Guard failed: input_ids.size()[1] <= 64") on a call the graph does
    not hold for; None for a symbolic trace (its graph holds for any shape)."""
    return getattr(gm, "meta", {}).get("mobius_guards")


def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict, dims: str) -> Any:
    """Dim.AUTO on every dim ("all") or dim 0 ("batch") of every tensor input (export keeps a
    dim static where the model needs it so)."""
    from torch.export import Dim

    def spec(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return None
        return {i: Dim.AUTO for i in range(x.dim() if dims == "all" else 1)}

    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not leaves:
        return None
    if kwargs:
        sig = inspect.signature(model.forward)
        bound = sig.bind(*args, **kwargs)
        return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}
    return tuple(pytree.tree_map(spec, a) for a in args)


def _has_symbolic_batch(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() > 0:
            if isinstance(val.shape[0], torch.SymInt):
                return True
    return False
