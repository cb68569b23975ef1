"""The two training loops a semantics test runs on (issue 37: "the existing semantics tests pass on
both the eager-style loop and `train_step`").

    @pytest.mark.parametrize("loop", LOOPS)
    def test_x(loop):
        pipe = compile_for(loop, model, topo, loss=lambda out: out.sum(), example_inputs=(x,))
        loss, out = step(loop, pipe, x)      # one forward + loss + backward, either way

- "eager": `loss = loss(pipe(x), target); loss.backward()` -- autograd through the pipeline's
  forward program; `out` is the pipeline's output.
- "train_step": `loss = pipe.train_step(x, target=target)` -- forward, the loss on the last stage
  and backward as one generated program (runtime/executor.py); `out` is None (the outputs never
  leave the GPUs, so a test compares the loss and the gradients there).

`loss` is `fn(out)` or `fn(out, target)`; without one, the loss is the model's own (HF `labels=`).
For the train_step loop the step pipeline is compiled at compile (an example target is given), so
what a test does "after compile" happens after the step's compile too.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

import mobius_fx
from mobius_fx.train_step import model_loss

LOOPS = ("eager", "train_step")

NO_TARGET = torch.zeros(())  # what train_step passes a loss that reads no target (0-dim: not split)


def _two_args(loss: Callable | None) -> Callable | None:
    if loss is None:
        return None
    try:
        n = len(inspect.signature(loss).parameters)
    except (TypeError, ValueError):
        n = 2
    if n >= 2:
        return loss
    fn = getattr(loss, "_loop_loss", None)
    if fn is None:
        def fn(out: Any, target: Any) -> torch.Tensor:
            return loss(out)
        loss._loop_loss = fn  # one function per loss: the pipeline and the eager loop call the same
    return fn


def compile_for(loop: str, model: torch.nn.Module, topology: Any, *, loss: Callable | None = None,
                example_target: Any = None, **kw: Any) -> Any:
    """`mobius_fx.compile(model, topology, **kw)` with `loss_fn=loss`; the train_step loop also
    compiles its step pipeline now (with `example_target`, or the dummy target of a loss reading
    none), unless the model returns its own loss (then at its first step)."""
    assert loop in LOOPS, loop
    kw.setdefault("verbose", False)
    fn = _two_args(loss)
    if fn is not None:
        kw["loss_fn"] = fn
        if loop == "train_step":
            kw["example_target"] = NO_TARGET if example_target is None else example_target
    return mobius_fx.compile(model, topology, **kw)


def step(loop: str, pipe: Any, *args: Any, target: Any = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """One forward, loss and backward of `pipe` (compiled by `compile_for`); (the loss detached,
    the outputs or None)."""
    fn = pipe._step.loss_fn  # the loss compile_for gave compile
    if fn is not None and target is None:
        target = NO_TARGET
    if loop == "train_step":
        return pipe.train_step(*args, target=target, **kwargs), None
    assert loop == "eager", loop
    out = pipe(*args, **kwargs)
    loss = model_loss(out) if fn is None else fn(out, target)
    loss.backward()
    return loss.detach(), out
