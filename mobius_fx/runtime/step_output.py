"""The step's output and the seeds of its backward, for the step executor (runtime/executor.py).

The last stage's micro-batch outputs (a loss's sums and counts: scalars) arrive on the host;
they are combined there as compile's analysis of the graph says (runtime/microbatch_outputs.py,
`Runtime.merge`) with autograd on, from leaves standing for the host copies, so the gradient of
the whole batch's loss with respect to each host copy comes out of autograd exactly as eager's
combination gives it (a mean, a sum, a ratio of sums) -- the gradients the executor sends back.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.utils._pytree as pytree

from mobius_fx.errors import MobiusError
from mobius_fx.planning.stage_contract import merge_microbatches, split_microbatches
from mobius_fx.runtime.streams import PENDING

__all__ = ["step_output"]


def step_output(ex: Any, scale: float) -> Any:
    """The step's output from the micro-batches' host copies (`ex.hosted`), combined as
    compile's analysis says, differentiated on the host from `scale`: each host copy's gradient
    (into `ex.ghost`) seeds the executor's backward."""
    merge = next(n for n in ex.program.graph.nodes if n.op == "call_function" and n.target is merge_microbatches)
    leaves: list[tuple[tuple[int, int, int], int, torch.Tensor]] = []

    def value(node: object) -> Any:
        if not isinstance(node, torch.fx.Node):
            return node
        meta = node.meta.get("mobius", {})
        if meta.get("op") == "send":  # a host copy of a stage output
            src = node.args[0]
            key = (meta["stage"], src.args[1], meta["microbatch"])
            host = ex.hosted[key]
            for t in pytree.tree_leaves(host):
                PENDING.settle(t, "a model output")
            grads = ex.rt.carries_grad(key[0], key[1])
            flat, spec = pytree.tree_flatten(host)
            out, n = [], 0
            for t in flat:
                if isinstance(t, torch.Tensor):
                    if grads and (t.is_floating_point() or t.is_complex()):
                        t = t.detach().requires_grad_()
                        leaves.append((key, n, t))
                    n += 1
                out.append(t)
            return pytree.tree_unflatten(out, spec)
        if node.op == "placeholder":
            return ex.per_mb[node.name][0]
        if node.target is operator.getitem and getattr(node.args[0], "target", None) is split_microbatches:
            j, i = divmod(node.args[1], ex.m)
            return ex.per_mb[ex.schedule.inputs[j]][i]
        raise MobiusError(f"internal: the step's output reads {node.format_node()}, which the executor cannot place")

    per_mb = [torch.fx.node.map_aggregate(s, value) for s in merge.args[0]]
    with torch.enable_grad():
        out = ex.rt.merge(per_mb)
    roots = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if roots and leaves:
        if len(roots) != 1 or roots[0].dim() != 0:
            raise MobiusError(f"train_step's output has {len(roots)} differentiable tensors "
                              f"({[tuple(r.shape) for r in roots]}); it must be one 0-dim loss: compile with loss_fn=fn returning a scalar (the batch's loss), or, for an HF "
                              f"model, pass labels= so that it returns `.loss`")
        grads = torch.autograd.grad(roots, [t for _, _, t in leaves], [torch.full_like(roots[0], scale)],
                                    allow_unused=True)
        for (key, n, t), g in zip(leaves, grads):
            if g is not None:
                count = _tensors(ex.hosted[key])
                ex.ghost.setdefault(key, [None] * count)
                ex.ghost[key][n] = g if ex.ghost[key][n] is None else ex.ghost[key][n] + g
    return out


def _tensors(v: object) -> int:
    return sum(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(v))
