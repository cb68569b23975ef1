"""Each layer's working memory as the runtime runs it (`LayerCost.saved_bytes`, `peak_bytes`):
`layer_peaks`, which runs each layer again, forward and backward, on the meta values of the
annotate pass's run (`GraphRun`) under `LiveBytes`, with attention as a device's fused kernel runs it.

    layers = layer_peaks(gm, layers, act_bytes, meta_run, scale=1)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from mobius_fx.errors import first_line
from mobius_fx.passes.annotate_graph_run import GraphRun
from mobius_fx.passes.annotate_tools import LiveBytes, last_uses, tensor_leaves, unique_tensors, value_bytes
from mobius_fx.planning.costs import LayerCost

__all__ = ["layer_peaks"]

_log = logging.getLogger("mobius_fx")


def layer_peaks(gm: fx.GraphModule, layers: list[LayerCost], act_bytes: dict[fx.Node, int], held: "GraphRun | None",
                scale: int) -> list[LayerCost]:
    """Each layer's `saved_bytes` and `peak_bytes` (its working memory), as the runtime runs it,
    measured on meta tensors under `LiveBytes` (the books' rule: a storage counts from the op
    that makes it until it dies):

    - saved_bytes: what the layer's recompute (with grad) holds when it ends: its outputs and
      what autograd saved for its backward;
    - peak_bytes: the larger of its forward (no grad) peak plus its live-in activations (what
      crosses its start), and the peak of its recompute and its backward (from ones as its
      outputs' gradients into its inputs) less saved_bytes.

    So a stage holds in backward its layers' saved bytes and one layer's peak above them
    (`MemoryModel.footprint`). The ops inside a node count (the log_softmax `cross_entropy`
    keeps for its backward, the backward's temporaries: issue 26); the weight gradients do
    not (the step model counts them, `grad_copies` x gradients).

    Layers of one signature are run once. Without a meta run of the graph (`held` None) or
    where a layer cannot run again on meta, the bound from the nodes' bytes stands: every
    tensor the layer makes is saved, and the peak is live-in plus twice that."""
    by_name = {n.name: n for n in gm.graph.nodes}
    done: dict[str, int | None] = {}
    out = []
    for layer in layers:
        members = [by_name[x] for x in layer.nodes]
        made = sum(act_bytes.get(n, 0) for n in members)
        live_in = layer.peak_bytes - made  # group_layers: live-in + every tensor the layer makes
        key = layer.signature or layer.name
        if key not in done:
            done[key] = None
            if held is not None:
                try:
                    done[key] = tuple(b * scale for b in _replay(held, members))
                except Exception as e:  # an op meta cannot run again: the nodes' bound stands
                    _log.info("annotate: layer %s cannot run again on meta tensors (%s); its peak is "
                              "bounded from its nodes' bytes", layer.name, first_line(e))
        if done[key] is None:  # every tensor it makes kept, and as many gradients
            out.append(dataclasses.replace(layer, peak_bytes=int(live_in + 2 * made), saved_bytes=int(made)))
            continue
        forward, saved, backward = done[key]
        out.append(dataclasses.replace(layer, peak_bytes=int(max(live_in + forward, backward - saved)),
                                       saved_bytes=int(saved)))
    return out


def _fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    """`scaled_dot_product_attention` as a device runs it: a fused kernel that keeps its output
    and log-sum-exp for backward (flash / memory-efficient attention on CUDA, the flash kernel
    on the CPU). On meta tensors torch picks the math path, which keeps the whole attention
    matrix in fp32, several times: a bound far above what runs."""
    if query.dim() != 4 or query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1]:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
    if key.shape[1] != query.shape[1]:  # grouped-query attention: the key and value heads repeated (a bound)
        key, value = (t.repeat_interleave(query.shape[1] // t.shape[1], dim=1) for t in (key, value))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


_FUSED_ATTENTION: dict[Any, Callable[..., Any]] = {
    torch.nn.functional.scaled_dot_product_attention: _fused_attention,
    torch.ops.aten.scaled_dot_product_attention.default: _fused_attention,
}


def _replay(run: "GraphRun", members: list[fx.Node]) -> tuple[int, int, int]:
    """Bytes `members` (a layer's nodes) hold beyond their inputs, run on `run`'s meta values:
    (the forward's peak without grad, what the recompute with grad holds when it ends -- its
    outputs and what autograd saved --, the peak of that recompute and the backward after it
    from ones as the outputs' gradients into the inputs and the weights, less the weight
    gradients' bytes: the step model counts those, `grad_copies` x gradients)."""
    inside = set(members)
    inputs = list(dict.fromkeys(i for n in members for i in n.all_input_nodes if i not in inside))
    outputs = [n for n in members if n.op != "output" and any(u not in inside or u.op == "output" for u in n.users)]
    frees = last_uses(members, keep=lambda v: v in inside and v not in outputs)

    def fresh(v: Any) -> Any:  # a leaf like v (an activation arriving), a model tensor as it is
        def leaf(t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad and t.grad_fn is None:
                return t  # a weight (or an input that is a leaf already)
            return t.detach().requires_grad_(t.requires_grad)
        return pytree.tree_map_only(torch.Tensor, leaf, v)

    def forward(grad: bool) -> tuple[dict, list[torch.Tensor], list[torch.Tensor]]:
        env = {i: fresh(run.values[i]) for i in inputs}
        leaves = [t for i in inputs if i.op != "get_attr" for t in tensor_leaves(env[i]) if t.requires_grad]
        weights: dict[int, torch.Tensor] = {}
        with torch.set_grad_enabled(grad):
            for n in members + [i for i in inputs if i.op == "get_attr"]:
                if n.op in ("placeholder", "get_attr"):  # the model's inputs and tensors: there already
                    env[n] = fresh(run.values[n])
                    if n.op == "get_attr":
                        weights.update((id(t), t) for t in tensor_leaves(env[n]) if t.requires_grad and t.grad_fn is None)
                    continue
                if n.op == "output":
                    continue
                fn, state = run.node_callable(n)
                weights.update((id(t), t) for t in state.values() if t.requires_grad and t.grad_fn is None)
                fn = _FUSED_ATTENTION.get(fn, fn) if n.op == "call_function" else fn
                args = fx.node.map_arg(n.args, env.__getitem__)
                kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
                args, kwargs = pytree.tree_map_only(torch.device, lambda _: torch.device("meta"), (args, kwargs))
                env[n] = fn(*args, **kwargs)
                for dead in frees.get(n, ()):
                    env.pop(dead, None)
        return env, leaves, [t for t in weights.values() if all(t is not x for x in leaves)]

    with LiveBytes() as books:
        env, _, _ = forward(False)
        del env
    peak = books.peak
    grads = 0
    with LiveBytes() as books:
        env, leaves, weights = forward(True)
        saved = books.current
        outs = [t for n in outputs for t in unique_tensors(env[n]) if t.requires_grad and t.grad_fn is not None]
        if outs and (leaves or weights):
            got = torch.autograd.grad(outs, leaves + weights, [torch.ones_like(t) for t in outs], allow_unused=True)
            grads = sum(value_bytes(g) for g in got[len(leaves):] if g is not None)
            del got
        del env, outs, leaves, weights
    return peak, saved, books.peak - grads
