"""What a traced graph must keep of eager semantics (tracing.py): custom autograd.Functions
recorded as one call each under symbolic_trace (`autograd_functions`, `function_call`), and the
refusals of what the pipeline would run differently: a Function export traced through
(`refuse_traced_functions`), a parameter changed in place in forward (`refuse_parameter_writes`).
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from mobius_fx.errors import TraceError

__all__ = ["function_call", "autograd_functions", "describe", "refuse_traced_functions", "refuse_parameter_writes",
           "forward_effects", "Effects", "refuse_effects", "refuse_input_writes", "graph_checks"]

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


class Effects:
    """What a traced forward did besides computing (`forward_effects`): tensor hooks it
    registered and attributes of the model's modules it assigned or whose containers it changed."""

    def __init__(self) -> None:
        self.tensor_hooks: list[str] = []  # "the hook's name (file:line of the call)"
        self.assigned: list[tuple[str, nn.Module, str]] = []  # (module path, module, attribute)
        self.mutated: list[tuple[str, nn.Module, str]] = []  # a list, dict or set attribute changed
        self.silent_hooks: list[tuple[str, str, str]] = []  # (module path, kind, hook): ran, returned None


def _user_frame(depth: int) -> Any:
    """The frame `depth` levels up, None when it is torch's (or this package's) own code."""
    frame = sys._getframe(depth + 1)
    module = frame.f_globals.get("__name__", "")
    own = module.split(".")[0] == "torch" or (module.startswith("mobius_fx.") and not module.startswith("mobius_fx.zoo"))
    return None if own else frame


def _containers(model: nn.Module) -> list[tuple[str, nn.Module, str, Any, Any]]:
    """(path, module, attribute, the container, a shallow copy) for each list, dict and set a
    module holds as a plain attribute."""
    skip = frozenset(nn.Module().__dict__)
    out = []
    for path, module in model.named_modules():
        for key, value in module.__dict__.items():
            if key not in skip and type(value) in (list, dict, set):
                out.append((path, module, key, value, type(value)(value) if type(value) is not dict else dict(value)))
    return out


def _changed(value: Any, saved: Any) -> bool:
    if len(value) != len(saved):
        return True
    if isinstance(value, dict):
        return list(value) != list(saved) or any(value[k] is not saved[k] for k in saved)
    if isinstance(value, set):
        return value != saved
    return any(a is not b for a, b in zip(value, saved))


@contextlib.contextmanager
def forward_effects(model: nn.Module):
    """Meanwhile record what forward does besides computing (yields an `Effects`), and undo its
    changes to the model's Python state afterwards: an attribute a traced forward assigns
    (`self.aux = loss`, which under symbolic_trace would leave an fx Proxy in the model) gets its
    old value back, and a list, dict or set it changed its old contents. Assignments made by
    torch's own code (spectral_norm's pre-hook) are not recorded."""
    effects = Effects()
    paths = {id(m): p for p, m in model.named_modules()}
    saved: dict[tuple[int, str], Any] = {}
    missing = object()
    containers = _containers(model)
    before = [(p, m, dict(m.__dict__)) for p, m in model.named_modules()]
    by_torch: set[tuple[int, str]] = set()  # attributes torch's own code set (spectral_norm's `weight`)
    setattr_ = nn.Module.__setattr__
    register_hook = torch.Tensor.register_hook

    def setattr_recorded(self: nn.Module, name: str, value: Any) -> None:
        if id(self) in paths and (id(self), name) not in saved:
            if _user_frame(1) is None:
                by_torch.add((id(self), name))
            else:
                saved[(id(self), name)] = self.__dict__.get(name, missing)
                effects.assigned.append((paths[id(self)], self, name))
        setattr_(self, name, value)

    def register_hook_recorded(self: torch.Tensor, hook: Any) -> Any:
        frame = _user_frame(1)
        if frame is not None:
            name = getattr(hook, "__qualname__", type(hook).__name__)
            effects.tensor_hooks.append(f"{name} ({frame.f_code.co_filename}:{frame.f_lineno})")
        return register_hook(self, hook)

    nn.Module.__setattr__ = setattr_recorded  # type: ignore[method-assign]
    torch.Tensor.register_hook = register_hook_recorded  # type: ignore[method-assign]
    hooks = _watch_module_hooks(model, effects)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield effects
    finally:
        for table, key, hook in hooks:
            if key in table:
                table[key] = hook
        nn.Module.__setattr__ = setattr_  # type: ignore[method-assign]
        torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]
        for _, module, name in effects.assigned:
            old = saved[(id(module), name)]
            if old is missing:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = old
        _restore_dicts(before, by_torch, effects)
        _export_assignments(model, caught if "caught" in locals() else [], effects)
        for path, module, key, value, copy in containers:
            if _changed(value, copy):
                effects.mutated.append((path, module, key))
                value.clear()
                if isinstance(value, list):
                    value.extend(copy)
                else:
                    value.update(copy)


def _restore_dicts(before: list[tuple[str, nn.Module, dict]], by_torch: set[tuple[int, str]], effects: Effects) -> None:
    """Put every module's `__dict__` back as it was before tracing (an attribute set around
    `nn.Module.__setattr__`, `object.__setattr__(self, "aux", v)`, would keep an fx Proxy);
    one the user's code set is recorded in `effects.assigned`."""
    recorded = {(id(m), n) for _, m, n in effects.assigned}
    for path, module, old in before:
        now = module.__dict__
        for key in [k for k in now if k not in old or now[k] is not old[k]] + [k for k in old if k not in now]:
            # export puts a copy back of containers (the container check's) and equal values (`normalized_shape`)
            quiet = type(old.get(key)) in (list, dict, set) or (key in old and key in now and _equal(old[key], now[key]))
            if (id(module), key) not in by_torch and (id(module), key) not in recorded and not quiet:
                effects.assigned.append((path, module, key))
            if key in old:
                now[key] = old[key]
            else:
                del now[key]


def _export_assignments(model: nn.Module, caught: list, effects: Effects) -> None:
    """torch.export puts back a tensor attribute forward assigned (`object.__setattr__` too)
    and says so in a warning ("The tensor attribute self.aux was assigned during export"): record
    each such attribute in `effects.assigned`; re-issue every other warning caught meanwhile."""
    recorded = {(p, n) for p, _, n in effects.assigned}
    for w in caught:
        found = re.match(r"The tensor attributes? (.*) (?:was|were) assigned during export", str(w.message))
        if found is None:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
            continue
        for full in found.group(1).split(", "):
            path, _, name = full.removeprefix("self.").rpartition(".")
            if "[" in full or (path, name) in recorded:
                continue  # an item of a container: the container check's
            try:
                effects.assigned.append((path, model.get_submodule(path), name))
            except AttributeError:
                continue


def _equal(a: Any, b: Any) -> bool:
    """Whether two plain values are equal (tensors and fx Proxies never are, unless identical)."""
    if any(isinstance(v, (torch.Tensor, fx.Proxy)) for v in (a, b)):
        return a is b
    try:
        return bool(a == b)
    except Exception:  # a value without a plain equality
        return False


def _watch_module_hooks(model: nn.Module, effects: Effects) -> list[tuple[dict, Any, Any]]:
    """Wrap the user's forward and forward-pre hooks of the model's submodules so that one
    that runs while tracing (a module traced through) and returns None is recorded in
    `effects.silent_hooks`: whatever it does besides (a log, a list of activations) happens once,
    at trace time. Returns (dict, key, the hook) to put back."""
    saved = []
    for path, module in model.named_modules():
        if not path:
            continue  # the model's own hooks: refused by the runtime (module_hooks.py)
        for attr, kind in (("_forward_pre_hooks", "forward-pre hook"), ("_forward_hooks", "forward hook")):
            table = module.__dict__.get(attr)
            for key, hook in list((table or {}).items()):
                fn = getattr(hook, "__func__", hook)
                owner = getattr(fn, "__module__", None) or type(fn).__module__
                if owner.split(".")[0] == "torch" or (owner.startswith("mobius_fx.")
                                                      and not owner.startswith("mobius_fx.zoo")):
                    continue
                saved.append((table, key, hook))
                table[key] = _recording(hook, effects, path, kind)
    return saved


_CHECKING = threading.local()


@contextlib.contextmanager
def graph_checks():
    """Meanwhile a hook that runs is not the tracer's (tracing.py runs the traced graph on
    copies, which calls leaf modules, hooks included): `forward_effects` does not record it."""
    was = getattr(_CHECKING, "on", False)
    _CHECKING.on = True
    try:
        yield
    finally:
        _CHECKING.on = was


def _recording(hook: Any, effects: Effects, path: str, kind: str) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        out = hook(*args, **kwargs)
        if out is None and not getattr(_CHECKING, "on", False):
            effects.silent_hooks.append((path, kind, getattr(hook, "__qualname__", type(hook).__name__)))
        return out

    return run


def refuse_effects(model: nn.Module, effects: Effects, front_end: str) -> None:
    """Refuse what a traced forward did that the pipeline would not repeat (`forward_effects`)."""
    what = type(model).__name__
    for path, module, name in effects.assigned:
        full = f"{path}.{name}" if path else name
        raise TraceError(f"{what}'s forward assigns the attribute `{full}` ({type(module).__name__}); a traced graph "
                         f"records only the tensors forward computes and returns, so the pipeline would never set it "
                         f"(eager sets it at every call: an auxiliary loss kept as `self.aux` would be lost). Return "
                         f"the value from forward instead (e.g. `return out, aux_loss`), or keep state that changes in "
                         f"a buffer updated in place (register_buffer)")
    for path, module, name in effects.mutated:
        full = f"{path}.{name}" if path else name
        raise TraceError(f"{what}'s forward changes the container `{full}` ({type(getattr(module, name)).__name__} of "
                         f"{type(module).__name__}) in place (an append, an item set); a traced graph does not record "
                         f"it, so the pipeline would leave it as it is. Return the values from forward instead")
    for path, kind, name in effects.silent_hooks:
        raise TraceError(f"the {kind} `{name}` on `{path}` returns None: it ran once, when {what} was traced, and "
                         f"the graph keeps only what a hook returns, so whatever else it does (recording activations, "
                         f"logging, editing a value in place) would not happen at the pipeline's calls. Register it "
                         f"on a leaf module (a torch.nn layer: the stages call it, hooks included), or return the "
                         f"value it computes")
    if effects.tensor_hooks and front_end == "export":
        raise TraceError(f"{what}'s forward registers a tensor hook ({effects.tensor_hooks[0]}, "
                         f"`tensor.register_hook`); torch.export drops such hooks, so gradients would differ from "
                         f"eager (a gradient reversal would give +g). Write it as a torch.autograd.Function applied in "
                         f"forward, and make the model traceable by torch.fx.symbolic_trace, which keeps a Function's "
                         f"backward")


def refuse_input_writes(model: nn.Module, args: tuple, kwargs: dict, written: list[int]) -> None:
    """Refuse a forward that changes one of its input tensors in place (`x.clamp_()`; `written`:
    indices into `pytree.tree_leaves((args, kwargs))`): the pipeline runs forward on copies of
    each micro-batch, so the caller's tensor would not see the change eager makes to it."""
    if not written:
        return
    path, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0][written[0]]
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        names = []
    top, key = path[0].idx, path[1]
    name = (names[key.idx] if key.idx < len(names) else f"args[{key.idx}]") if top == 0 else str(key.key)
    raise TraceError(f"{type(model).__name__}'s forward changes its input `{name}{pytree.keystr(path[2:])}` in place "
                     f"(e.g. `x.clamp_()`, `x[...] = v`); the pipeline runs forward on copies of each micro-batch, so "
                     f"the caller's tensor would not see the change eager makes. Use the out-of-place op in forward "
                     f"(`x = x.clamp(...)`), or make the change before the call")
