"""Mean losses over class-index targets, exact across micro-batches: a sum and a count each.

`F.cross_entropy` / `F.nll_loss` (and their modules and aten forms) with the default
`reduction="mean"` divide by the number of targets that are not `ignore_index` (-100 by
default). With micro-batches, averaging the micro-batches' means is the mean of the whole batch
only when every micro-batch holds as many counted targets; with -100 spread unevenly it is not.

`rewrite` replaces such a loss that is an output of the graph by `mean_ratio(sum, count)`: the
same loss with `reduction="sum"`, and the number of counted targets (`counted_targets`). In the
traced graph (`microbatches=1`) `mean_ratio` is `sum / count`, the loss itself; in a stage's copy
(`insert_transfers` sets the count) it returns the pair `stack([sum, count])`, and the pipeline
combines the micro-batches' pairs as `Σ sum / Σ count` (microbatch_outputs' kind "ratio"), with
autograd flowing through both: the value and every gradient are the whole batch's.

Reusable piece (the loss-on-the-last-stage work relies on it): any value computed per
micro-batch as a (numerator, denominator) pair goes through `mean_ratio(num, den, microbatches=m)`
and comes back whole through `combine_ratio(pairs)`.

A loss that feeds anything but the output (`ce + aux`, `0.5 * ce`) keeps the mean of the
micro-batch means; `microbatch_outputs.analyse` warns about it at compile, naming the node.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

__all__ = ["rewrite", "mean_ratio", "counted_targets", "combine_ratio", "is_index_mean_loss", "op_name", "INDEX_LOSSES"]

# (name as microbatch_outputs._name reads it) -> (position of the target, its reduction's "sum")
INDEX_LOSSES = {"cross_entropy": "sum", "nll_loss": "sum", "cross_entropy_loss": 2, "nll_loss_nd": 2,
                "nll_loss2d": 2, "CrossEntropyLoss": "sum", "NLLLoss": "sum"}


def counted_targets(target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """How many class-index targets a mean loss divides by (those that are not `ignore_index`)."""
    return (target != ignore_index).sum()


def mean_ratio(total: torch.Tensor, count: torch.Tensor, microbatches: int = 1) -> torch.Tensor:
    """`total / count` for the whole batch (`microbatches=1`); per micro-batch, the pair
    `stack([total, count])` that `combine_ratio` divides once for the whole batch."""
    if microbatches == 1:
        return total / count
    dtype = torch.promote_types(total.dtype, torch.float32)
    return torch.stack([total.to(dtype), count.to(dtype)])


mean_ratio.per_microbatch = True  # type: ignore[attr-defined]  # batch_sizes.set_microbatches sets its count


def combine_ratio(pairs: list[torch.Tensor]) -> torch.Tensor:
    """The whole batch's `Σ total / Σ count` from the micro-batches' `mean_ratio` pairs."""
    stacked = torch.stack(pairs)
    return stacked[:, 0].sum() / stacked[:, 1].sum()


def _setting(node: fx.Node, name: str, module: Any, key: str) -> Any:
    """`key` ("weight", "reduction", "ignore_index") of the loss `node` (a module's attribute)."""
    if module is not None:
        return getattr(module, key)
    if name in ("cross_entropy", "nll_loss"):  # F.cross_entropy / F.nll_loss
        default = {"weight": None, "reduction": "mean", "ignore_index": -100}[key]
        return _fx_kwargs(node).get(key, default)
    pos, default = {"weight": (2, None), "reduction": (3, 1), "ignore_index": (4, -100)}[key]  # the aten schema
    return node.kwargs.get(key, node.args[pos] if len(node.args) > pos else default)


def is_index_mean_loss(node: fx.Node, gm: fx.GraphModule, name: str, values: dict) -> bool:
    """Whether `node` is a mean cross-entropy/NLL loss without `weight` over class-index targets
    (an integer target tensor: the count it divides by depends on `ignore_index`)."""
    if name not in INDEX_LOSSES or len(node.args) < 2 or not isinstance(node.args[1], fx.Node):
        return False
    module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
    target = values.get(node.args[1])
    if not isinstance(target, torch.Tensor) or target.is_floating_point():
        return False
    return _setting(node, name, module, "reduction") in ("mean", 1) and _setting(node, name, module, "weight") is None


def op_name(node: fx.Node, gm: fx.GraphModule) -> str:
    """A call node's op: a module's class name, a method's or function's name, an aten op's packet."""
    t = node.target
    if node.op == "call_module":
        return type(gm.get_submodule(str(t))).__name__
    if node.op == "call_method":
        return str(t)
    packet = getattr(t, "overloadpacket", None)
    if packet is not None:
        return str(getattr(packet, "__name__", t)).split(".")[-1]
    return str(getattr(t, "__name__", t))


def rewrite(gm: fx.GraphModule, values: dict) -> list[fx.Node]:
    """Replace each mean class-index loss (`is_index_mean_loss`) that only the output reads by
    `mean_ratio(sum, counted_targets)`; returns the new `mean_ratio` nodes. `values`: a fake run's
    node values (for the targets' dtype)."""
    out = []
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_module"):
            continue
        name = op_name(node, gm)
        if not is_index_mean_loss(node, gm, name, values) or any(u.op != "output" for u in node.users):
            continue
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        ignore = _setting(node, name, module, "ignore_index")
        with gm.graph.inserting_before(node):
            if module is not None:
                kwargs = {"ignore_index": ignore, "reduction": "sum"}
                if name == "CrossEntropyLoss":
                    kwargs["label_smoothing"] = module.label_smoothing
                fn = F.cross_entropy if name == "CrossEntropyLoss" else F.nll_loss
                total = gm.graph.call_function(fn, node.args[:2], kwargs)
            else:
                total = gm.graph.create_node(node.op, node.target, node.args, {**node.kwargs})
                if name in ("cross_entropy", "nll_loss"):
                    total.args, total.kwargs = node.args[:2], {**_fx_kwargs(node), "reduction": "sum"}
                else:
                    total.args = node.args[:3] + (2,) + node.args[4:] if len(node.args) > 3 else node.args
                    if len(node.args) <= 3:
                        total.kwargs = {**node.kwargs, "reduction": 2}
            count = gm.graph.call_function(counted_targets, (node.args[1], ignore))
            ratio = gm.graph.call_function(mean_ratio, (total, count))
        for new in (total, count, ratio):
            new.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
        node.replace_all_uses_with(ratio)
        gm.graph.erase_node(node)
        out.append(ratio)
    if out:
        gm.graph.lint()
        gm.recompile()
    return out


def _fx_kwargs(node: fx.Node) -> dict:
    """F.cross_entropy / F.nll_loss's keyword arguments of `node`, positional ones named."""
    names = ["weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing"]
    kwargs = dict(zip(names, node.args[2:]))
    kwargs.update(node.kwargs)
    return kwargs
