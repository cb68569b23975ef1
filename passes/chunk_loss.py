"""The `chunk_loss` pass: a training step's cross-entropy computed a chunk of rows at a time.

In the graph of a training step (mobius_fx/train_step.py: the model and its loss traced as one),
a cross-entropy over 2-D logits (`F.cross_entropy`, `nn.CrossEntropyLoss`, export's
`aten.cross_entropy_loss`) becomes `mobius_fx.losses.chunked_cross_entropy`, and an fp32 upcast
of the logits feeding it (`logits.float()`, as HF's `ForCausalLMLoss` does, through views) is
skipped: the loss reads the logits in the dtype the stage computed them in, and no fp32 copy of
a micro-batch's logits is ever held (only one chunk of `losses.CHUNK_BYTES`). Losses with a class
`weight` or `label_smoothing` are left as they are.

    n = chunk_cross_entropy(gm)   # the number of losses rewritten
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from mobius_fx.losses import chunked_cross_entropy

__all__ = ["chunk_cross_entropy", "chunk_loss_pass"]

_aten = torch.ops.aten
_VIEWS = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.flatten.using_ints}
_VIEW_METHODS = {"view", "reshape", "flatten"}
_REDUCTION = {0: "none", 1: "mean", 2: "sum"}


def _loss_call(node: fx.Node, gm: fx.GraphModule) -> dict | None:
    """The arguments of a cross-entropy call we can chunk, or None."""
    if node.op == "call_function" and node.target is _aten.cross_entropy_loss.default:
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
        given = dict(zip(names, node.args), **node.kwargs)
        reduction = _REDUCTION.get(given.get("reduction", 1))
    elif node.op == "call_function" and node.target is F.cross_entropy:
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
                 "label_smoothing")
        given = dict(zip(names, node.args), **node.kwargs)
        if given.get("size_average") is not None or given.get("reduce") is not None:
            return None
        reduction = given.get("reduction", "mean")
    elif node.op == "call_module" and type(gm.get_submodule(str(node.target))) is nn.CrossEntropyLoss:
        mod = gm.get_submodule(str(node.target))
        given = dict(zip(("input", "target"), node.args), **node.kwargs)
        given.update(weight=mod.weight, ignore_index=mod.ignore_index, label_smoothing=mod.label_smoothing)
        reduction = mod.reduction
    else:
        return None
    if given.get("weight") is not None or given.get("label_smoothing", 0.0) or reduction not in ("mean", "sum", "none"):
        return None
    ignore = given.get("ignore_index", -100)
    if not isinstance(ignore, int) or not isinstance(given.get("input"), fx.Node):
        return None
    return {"input": given["input"], "target": given["target"], "ignore_index": ignore, "reduction": reduction}


def _is_upcast(node: fx.Node) -> bool:
    """An fp32 cast of a floating value: `x.float()`, `x.to(torch.float32)`, export's `aten.to`/`_to_copy`."""
    if node.op == "call_method" and node.target == "float" and len(node.args) == 1 and not node.kwargs:
        return True
    if node.op == "call_method" and node.target == "to":
        return list(node.args[1:]) == [torch.float32] and not node.kwargs
    if node.op == "call_function" and node.target in (_aten.to.dtype, _aten._to_copy.default):
        dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
        extra = {k for k in node.kwargs if k != "dtype"}
        return dtype == torch.float32 and not extra and len(node.args) <= 2
    return False


def _skip_upcast(graph: fx.Graph, value: fx.Node) -> fx.Node:
    """`value` with an fp32 upcast behind its views removed: the same views applied to the value
    before the cast (its own dtype); `value` itself when there is no such cast."""
    chain, n = [], value
    while ((n.op == "call_function" and n.target in _VIEWS) or (n.op == "call_method" and n.target in _VIEW_METHODS)):
        chain.append(n)
        n = n.args[0]
    if not _is_upcast(n):
        return value
    cur = n.args[0]
    for v in reversed(chain):
        with graph.inserting_after(cur):
            cur = graph.create_node(v.op, v.target, (cur, *v.args[1:]), dict(v.kwargs))
        cur.meta = dict(v.meta)
    return cur


def chunk_cross_entropy(gm: fx.GraphModule) -> int:
    """Rewrite `gm`'s chunkable cross-entropies in place (module docstring); the number rewritten."""
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        call = _loss_call(node, gm)
        if call is None:
            continue
        logits = _skip_upcast(graph, call["input"])
        with graph.inserting_before(node):
            new = graph.call_function(chunked_cross_entropy, (logits, call["target"]),
                                      {"ignore_index": call["ignore_index"], "reduction": call["reduction"]})
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        done += 1
        _erase_dead(graph, call["input"])
    if done:
        graph.lint()
        gm.recompile()
    return done


def _erase_dead(graph: fx.Graph, node: Any) -> None:
    """Erase `node` and the views and casts feeding it that nothing uses any more."""
    while isinstance(node, fx.Node) and not node.users and node.op in ("call_function", "call_method"):
        src = node.args[0] if node.args else None
        graph.erase_node(node)
        node = src


def chunk_loss_pass(gm: fx.GraphModule, ctx: Any) -> fx.GraphModule | None:
    """The pass (`fn(gm, ctx)`): the step's graph with its cross-entropy chunked."""
    return gm if chunk_cross_entropy(gm) else None
