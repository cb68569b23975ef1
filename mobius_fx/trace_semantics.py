"""What a traced graph must keep of eager semantics (tracing.py): custom autograd.Functions
recorded as one call each under symbolic_trace (`autograd_functions`, `function_call`), and the
refusals of what the pipeline would run differently: a Function export traced through
(`refuse_traced_functions`), a parameter changed in place in forward (`refuse_parameter_writes`).
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

from mobius_fx.errors import TraceError

__all__ = ["function_call", "autograd_functions", "describe", "refuse_traced_functions", "refuse_parameter_writes"]

_APPLY_CALLS: dict[type, Callable[..., Any]] = {}


def function_call(fn_cls: type) -> Callable[..., Any]:
    """The graph's target for `fn_cls.apply`: one plain function per Function class (fx would
    print torch's bound classmethod as a torch name the generated code cannot find)."""
    call = _APPLY_CALLS.get(fn_cls)
    if call is None:
        def call(*args: Any, **kwargs: Any) -> Any:
            return fn_cls.apply(*args, **kwargs)

        call.__name__ = call.__qualname__ = f"{fn_cls.__name__}_apply"
        call.autograd_function = fn_cls  # type: ignore[attr-defined]
        _APPLY_CALLS[fn_cls] = call
    return call


@contextlib.contextmanager
def autograd_functions(*, as_calls: bool):
    """Patch `torch.autograd.Function.apply` meanwhile: yields the list of Function classes the
    forward applies; with `as_calls` (symbolic_trace), an apply on traced values is recorded as
    one node calling `Fn.apply`, so the graph keeps the Function's own backward (traced through,
    its forward's ops would be differentiated instead: a gradient-reversal layer would give +g)."""
    applied: list[type] = []
    original = inspect.getattr_static(torch.autograd.Function, "apply")

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls not in applied:
            applied.append(cls)
        if as_calls:
            proxy = next((a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, fx.Proxy)), None)
            if proxy is not None:
                return proxy.tracer.create_proxy("call_function", function_call(cls), args, kwargs)
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[assignment]
    try:
        yield applied
    finally:
        torch.autograd.Function.apply = original  # type: ignore[assignment]


def describe(model: nn.Module, name: str) -> str:
    """"buffer `c.count` (in module `c`, Count)" for a parameter or buffer name of `model`."""
    path, _, attr = name.rpartition(".")
    try:
        owner = model.get_submodule(path)
    except AttributeError:
        return f"`{name}`"
    kind = "parameter" if attr in owner._parameters else "buffer"
    return f"{kind} `{name}` (in module `{path or '<root>'}`, {type(owner).__name__})"


def refuse_traced_functions(model: nn.Module, applied: list[type], fx_error: str) -> None:
    """Refuse a custom autograd.Function an export graph traced through (`applied`): export
    drops its backward, so the pipeline would differentiate it differently from eager."""
    # torch's own Functions (reentrant checkpointing) differentiate like the ops they run
    own = [c for c in applied if not c.__module__.startswith("torch.")]
    if own:
        names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in own)
        raise TraceError(f"{type(model).__name__}'s forward applies the custom torch.autograd.Function {names}; "
                         f"torch.export traces through its forward and drops its backward, so gradients would differ "
                         f"from eager (a gradient reversal would give +g). torch.fx.symbolic_trace keeps each Function "
                         f"as one call with its backward: make the model traceable by symbolic_trace (it failed: "
                         f"{fx_error}), or write the Function's gradient with differentiable ops")


def refuse_parameter_writes(model: nn.Module, gm: fx.GraphModule, written: list[str], names: dict[str, str]) -> None:
    """Refuse a forward that changes a parameter in place (`written`: the names of gm's tensors
    a run changed; `names`: gm name -> the model's): the pipeline runs forward on copies."""
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    changed = [names.get(n, n) for n in written if n in params]
    if changed:
        raise TraceError(f"{type(model).__name__}'s forward changes {describe(model, changed[0])} in place; the "
                         f"pipeline runs forward on copies of the weights (the change would not reach the model) and "
                         f"runs it again in backward's recompute. Change parameters outside forward (e.g. after "
                         f"optimizer.step(), under torch.no_grad()), or keep such state in a buffer "
                         f"(register_buffer): in-place buffer updates are copied back once per call")
