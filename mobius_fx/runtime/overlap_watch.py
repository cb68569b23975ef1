"""What `OverlapOptimizer` (mobius_fx/runtime/overlap.py) watches the training loop and autograd
with: hooks that hold it weakly, the AccumulateGrad node of a parameter and whether the backward
running now reaches it, a checksum of a gradient's bits, the hyper-parameters a round was stepped
with, whether a GradScaler is the caller, which rank steps each parameter (shard=True), which
optimizers update each parameter from its own gradient and state alone (`per_parameter`), and
the optimizer's step hooks, run once per `opt.step()` (`pre_hooks`, `post_hooks`, `raw_step`)."""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

__all__ = ["WeakHook", "accumulator", "engine_accumulates", "has_grad_hooks", "fingerprint", "partition_owners",
           "hyper_params", "same_hyper", "called_by_grad_scaler", "PER_PARAMETER", "per_parameter", "raw_step",
           "pre_hooks", "post_hooks", "stepped_masters"]

# The optimizers the sync overlap steps stage by stage, during backward: torch's own, whose step
# updates each parameter from its own gradient, its own state and the group's hyper-parameters
# (scalars the same for every parameter), so stepping the parameters in several calls gives the
# bits of one call. Matched by the step function the optimizer's class runs (a subclass that
# keeps its parent's step is one of them; one that overrides step is not). Every other optimizer
# -- LBFGS, which re-evaluates the loss over all parameters, or one whose step reads all
# gradients (a global norm, a trust ratio over the model) -- is stepped whole at opt.step(),
# serially, said once in the log (`OverlapOptimizer.__init__`): never silently differently.
PER_PARAMETER: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in ("Adam", "AdamW", "SGD", "Adagrad", "Adamax", "NAdam", "RAdam",
                                            "RMSprop", "Adadelta", "ASGD", "Rprop", "Adafactor")
    if hasattr(torch.optim, name))


class WeakHook:
    """A hook that calls `method` of an overlap held weakly, and nothing once it is gone. Copying
    or pickling the model it hangs on (`copy.deepcopy(model)` for a best-model copy,
    `torch.save(model)`) gives an inert hook: the copy is not the overlap's."""

    def __init__(self, owner: object, method: str, *args: object) -> None:
        self._ref = weakref.ref(owner) if owner is not None else None
        self._method, self._args = method, args

    def __call__(self, *a: object) -> Any:
        owner = self._ref() if self._ref is not None else None
        if owner is not None:
            return getattr(owner, self._method)(*self._args, *a)
        return None

    def __deepcopy__(self, memo: dict) -> "WeakHook":
        return WeakHook(None, self._method)

    def __reduce__(self) -> tuple:
        return (WeakHook, (None, self._method))


def accumulator(p: torch.Tensor) -> Any:
    """The AccumulateGrad node autograd runs for leaf `p` (kept alive by the caller)."""
    with torch.enable_grad():  # called inside backward, where grad mode is off
        return p.view_as(p).grad_fn.next_functions[0][0]


def engine_accumulates(node: torch.autograd.graph.Node) -> bool:
    """True when the backward pass running now will accumulate into this leaf's `.grad`:
    `loss.backward()` and `backward(inputs=[... p ...])` do; `torch.autograd.grad` does not (torch
    refuses to answer for leaves there, which means no)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


def has_grad_hooks(p: torch.Tensor) -> bool:
    return bool(getattr(p, "_backward_hooks", None)) or bool(getattr(p, "_post_accumulate_grad_hooks", None))


def fingerprint(g: torch.Tensor) -> int:
    """A checksum of `g`'s bits, for the first step's watch: some in-place kernels
    (GradScaler's unscale) do not bump the version counter."""
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(g.element_size())
    if bits is None or g.is_sparse:
        return g._version
    return int(g.detach().contiguous().view(bits).sum(dtype=torch.int64))


def partition_owners(params: list[torch.Tensor], world: int) -> dict[int, int]:
    """shard=True: which rank steps each parameter (trainable ones), balancing bytes greedily in
    the optimizer's order, the same on every rank."""
    load = [0] * world
    owners: dict[int, int] = {}
    for p in params:
        if p.requires_grad and id(p) not in owners:
            r = min(range(world), key=lambda i: (load[i], i))
            owners[id(p)] = r
            load[r] += p.numel() * p.element_size()
    return owners


def hyper_params(groups: list[dict]) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def same_hyper(a: list[dict], b: list[dict]) -> bool:
    def same(x: object, y: object) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        return x == y
    return len(a) == len(b) and all(g.keys() == h.keys() and all(same(g[k], h[k]) for k in g) for g, h in zip(a, b))


def called_by_grad_scaler() -> bool:
    """Whether opt.step() was called by torch.amp.GradScaler.step (directly or through an LR
    scheduler's wrapper of step)."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith("grad_scaler.py"):
            return True
        frame = frame.f_back
    return False


def per_parameter(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt`'s step is one of `PER_PARAMETER`'s (the sync overlap may split it by stage)."""
    step = raw_step(type(opt))
    return any(step is raw_step(cls) for cls in PER_PARAMETER)


def raw_step(cls: type) -> Any:
    """`cls.step` without torch's hook wrapper (`Optimizer.profile_hook_step`): the overlap runs
    the step hooks itself, once per `opt.step()`, however many calls the update takes."""
    step = cls.step
    return step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else step


def stepped_masters(sub: torch.optim.Optimizer) -> None:
    """What `host_counters.watch_optimizer_steps`' global post-hook does after a step, done by the
    overlap after each of its own calls of the step (`raw_step`, which runs no hook): the pipeline
    masters it stepped get a new version, before their streamed copies are refreshed."""
    from mobius_fx.runtime.host_counters import masters_stepped
    masters_stepped(sub, (), {})


def pre_hooks(opt: torch.optim.Optimizer) -> list:
    """The step pre-hooks torch would run before `opt.step()`: the global ones, then opt's."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks
    return [*_global_optimizer_pre_hooks.values(), *opt._optimizer_step_pre_hooks.values()]


def post_hooks(opt: torch.optim.Optimizer) -> list:
    """The step post-hooks torch would run after `opt.step()`: opt's, then the global ones (but
    the pipeline's own, which the overlap runs after each of its calls: `stepped_masters`)."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    from mobius_fx.runtime.host_counters import masters_stepped
    return [*opt._optimizer_step_post_hooks.values(), *(h for h in _global_optimizer_post_hooks.values()
                                                        if h is not masters_stepped)]
