"""The autograd Functions of a pipeline step: `StageFunction` (one stage call: forward without a
graph, backward by recomputation, both run by `engine.Runtime`), `Masters` (the
masters' place in the graph: it hands autograd the host gradients) and `GradLog` (logs a
gradient's copy as it flows back through a send).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from mobius_fx.errors import MobiusError
from mobius_fx.runtime.device_books import Device, nbytes
from mobius_fx.runtime.stage_state import StageCall, Step

__all__ = ["StageFunction", "Masters", "GradLog", "logged_grad", "refuse_double_backward"]


class GradLog(torch.autograd.Function):
    """Identity that logs the gradient's copy when it flows back through a send."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, dev: Device, direction: str, stage: int | None):
        ctx.dev, ctx.direction, ctx.stage = dev, direction, stage
        return t.view_as(t)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if grad is not None:
            with ctx.dev.log.stage(ctx.stage):
                ctx.dev.log.add("activation", ctx.direction, nbytes(grad))
        return grad, None, None, None


def logged_grad(t: torch.Tensor, dev: Device, direction: str, stage: int | None) -> torch.Tensor:
    return GradLog.apply(t, dev, direction, stage) if t.requires_grad else t


class StageFunction(torch.autograd.Function):
    """One stage call: forward without a graph, backward by recomputation (see engine.py's docstring)."""

    @staticmethod
    def forward(ctx, call: StageCall, anchor: torch.Tensor, *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.call = call
        outs, nondiff = call.rt._forward(call, tensors)
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        # What a call keeps for backward lives outside autograd (offloaded to the host), so a
        # second backward would run it again and double every gradient. Reading saved_tensors
        # asks autograd whether this node's graph was freed (a backward without retain_graph):
        # then it raises torch's own "Trying to backward through the graph a second time".
        ctx.saved_tensors  # noqa: B018
        refuse_double_backward()
        return _stage_backward(ctx, *grads)


def refuse_double_backward() -> None:
    """Refuse `backward(create_graph=True)` / `autograd.grad(..., create_graph=True)` (grad mode
    is on in a backward only then): a stage's backward is a recomputation whose own graph is not
    kept, so gradients of gradients (a gradient penalty, Hessian-vector products) cannot flow."""
    if torch.is_grad_enabled():
        raise MobiusError("backward with create_graph=True (double backward: a gradient penalty, a Hessian-vector "
                          "product) is not supported by a Mobius pipeline: each stage's backward recomputes the stage "
                          "and returns plain gradients, with no graph to differentiate again. Compute higher-order "
                          "gradients with the eager model, or call backward without create_graph (the step is kept: "
                          "backward can run again)")


@once_differentiable
def _stage_backward(ctx, *grads):
    call = ctx.call
    return (None, None, *call.rt._backward(call, grads, ctx.needs_input_grad[2:]))


class Masters(torch.autograd.Function):
    """The masters' place in the autograd graph: every stage call of a step hangs off its output,
    so its backward runs after the step's last stage backward and hands autograd the host
    gradients. `loss.backward()` accumulates them into `.grad` (hooks run), `backward(inputs=[...])`
    only into those asked for, `torch.autograd.grad(loss, params)` returns them; a backward that
    needs no master (the gradient of an input alone) leaves `.grad` alone (`Runtime._finish`)."""

    @staticmethod
    def forward(ctx, rt: Any, step: Step, anchor: torch.Tensor, *masters: torch.Tensor):
        ctx.rt, ctx.step, ctx.ids = rt, step, [id(m) for m in masters]
        return anchor.detach().clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, _):
        grads = ctx.rt._gradients(ctx.step)
        return (None, None, None, *(grads.get(i) for i in ctx.ids))
