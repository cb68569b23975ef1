"""Module hooks a compiled graph cannot follow, refused by name (issue 39, class 5).

The stages call the model's *leaf* modules (a torch.fx `call_module`) through shells that share
the modules' hook dicts, so a forward, forward-pre or backward hook registered on a leaf, before
or after compile, runs as in eager (`python_state.sync_shells` keeps the shell's
`_is_full_backward_hook` flag, which `register_full_backward_hook` sets, in step). Everywhere
else a hook is either compiled into the graph or not run at all:

- a forward or forward-pre hook on a module the tracer traced through (a block of layers) ran
  at trace time and is part of the graph: one registered or removed after compile would not
  change it;
- a backward hook on such a module (`register_full_backward_hook`, before or after compile)
  never fires: the graph keeps no module call to hang it on;
- any hook on the top-level model: the pipeline calls the traced graph, not the model's
  `__call__`.

`HookState` refuses the last two at compile and every change of the first at the call, with a
`MobiusError` naming the module, the hook and the remedy. Global module hooks
(`nn.modules.module.register_module_forward_hook`) reach the leaf modules the stages call.

    hooks = HookState(model, leaves={id(m) for m in leaf_modules})   # MobiusError for a backward hook on a block
    model.block.register_forward_hook(fn)
    hooks.check()   # MobiusError: forward hook `fn` registered on `block` (Block) after compile
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from mobius_fx.errors import MobiusError

__all__ = ["HookState", "KINDS"]

# the hook dicts of a module, and what each holds
KINDS = (("_forward_pre_hooks", "forward-pre hook"), ("_forward_hooks", "forward hook"),
         ("_backward_pre_hooks", "backward-pre hook"), ("_backward_hooks", "backward hook"))
_BACKWARD = ("_backward_pre_hooks", "_backward_hooks")


def _keys(module: nn.Module) -> tuple[tuple[Any, ...], ...]:
    """The ids of the module's hooks per kind, the pipeline's own (mobius_fx's: the async
    optimizer overlap's synchronising pre-hook) left out."""
    return tuple(tuple(k for k, h in (getattr(module, attr, None) or {}).items() if not _own(h)) for attr, _ in KINDS)


def _own(hook: Callable[..., object]) -> bool:
    fn = getattr(hook, "__func__", hook)
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return module.startswith("mobius_fx.") and not module.startswith("mobius_fx.zoo")


def _name(hook: Callable[..., object]) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


class HookState:
    """The hooks of the model's traced-through modules at compile (see the module docstring)."""

    def __init__(self, model: nn.Module, leaves: set[int]) -> None:
        self.entries = [(path, module, _keys(module)) for path, module in model.named_modules()
                        if id(module) not in leaves]
        for path, module, keys in self.entries:
            for (attr, kind), ids in zip(KINDS, keys):
                if ids and (not path or attr in _BACKWARD):
                    self._refuse(path, module, attr, kind, ids[0], "is registered on")

    def check(self) -> None:
        """Raise a MobiusError for the first hook registered on, or removed from, a traced-through
        module (or the model) since compile."""
        for path, module, keys in self.entries:
            now = _keys(module)
            if now == keys:
                continue
            for (attr, kind), before, after in zip(KINDS, keys, now):
                added = [k for k in after if k not in before]
                if added:
                    self._refuse(path, module, attr, kind, added[0], "was registered on")
                removed = [k for k in before if k not in after]
                if removed:
                    raise MobiusError(f"a {kind} was removed from `{path or '<the model>'}` ({type(module).__name__}) "
                                      f"after compile; it ran when the model was traced and is part of the compiled "
                                      f"graph, which goes on computing it. Compile the model again after removing it")

    @staticmethod
    def _refuse(path: str, module: nn.Module, attr: str, kind: str, key: int, verb: str) -> None:
        hook = _name(getattr(module, attr).get(key))
        where = f"`{path}` ({type(module).__name__})" if path else f"the top-level model ({type(module).__name__})"
        when = "after compile" if verb.startswith("was") else "at compile"
        if not path:
            remedy = (f"register it on the pipeline instead (pipe.register_{attr.strip('_')[:-1]}(...)), which "
                      f"calls it around each call with the pipeline as the module")
        elif attr in _BACKWARD:
            remedy = ("register it on the leaf modules inside it (a torch.nn layer the stages call), or use a tensor "
                      "hook on a value forward returns")
        else:
            remedy = ("compile the model again after registering it (a hook present at compile is traced into "
                      "the graph), or register it on a leaf module inside it (a torch.nn layer the stages call)")
        raise MobiusError(f"{kind} `{hook}` {verb} {where} {when}; the pipeline runs the compiled graph, not this "
                          f"module's __call__, so the hook would silently not run. To keep it, {remedy}")
