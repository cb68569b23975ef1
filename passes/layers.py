"""Layers: the units the partitioner cuts between, grouped along module boundaries.

A layer is a contiguous run of graph nodes that the partitioner keeps together: stage
boundaries fall only between layers. Grouping along module boundaries keeps the MIP small (a
model of L blocks gives ~L layers, not thousands of nodes) and keeps repeated blocks identical,
so the partitioner can run-length-encode them.

The rules: a repeated block (a child of an nn.ModuleList / nn.Sequential, e.g.
`transformer.h.17`) is one layer, other nodes group by the module below the "spine" of
containers (`transformer.wte`, `lm_head`), functional glue joins the layer before it, and tiny
non-block layers merge with their non-block neighbours, so a GPT with L blocks gives L + 2
layers. `group_layers` has the exact rules, including `output_bytes` (what a cut after the
layer carries) and `signature` (equal for repeated blocks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import statistics
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from mobius_fx.planning.costs import LayerCost, NodeCost
from mobius_fx.tracing import trace_info
from mobius_fx.module_paths import module_stack

__all__ = ["group_layers", "TINY_LAYER_FRACTION"]

_log = logging.getLogger("mobius_fx")

TINY_LAYER_FRACTION = 0.05  # a non-block layer below this share of a median block is merged

_COMPUTE_OPS = ("call_function", "call_method", "call_module")


def group_layers(gm: fx.GraphModule, *, node_costs: dict[fx.Node, NodeCost], out_bytes: dict[fx.Node, int],
                 act_bytes: dict[fx.Node, int],
                 param_info: dict[fx.Node, dict[str, tuple[int, bool]]]) -> list[LayerCost]:
    """Group nodes into layers along module boundaries and write the final `NodeCost`s.

    - Keys come from `_layer_key`. Glue nodes (no module) join the layer before them; leading
      ones (placeholders) the first layer; a `get_attr` joins its first user's layer.
    - A contiguous run of one key is one layer; a key that comes back later (a shared module
      called again, a tied head) starts a new layer named `key@1`, `key@2`, ...
    - Tiny non-block layers (parameters and forward FLOPs both at most `TINY_LAYER_FRACTION` of
      the median block's) merge with their non-block neighbours: within a run of non-block
      layers between blocks, a tiny layer joins the one before it (at the start of the run,
      the next non-tiny one); a run of only tiny layers becomes one layer. So a GPT gives
      blocks + 2 layers: `transformer.wte+wpe+drop`, `h.0` … `h.71`, `transformer.ln_f+lm_head`.
      Blocks never merge (their identical signatures let the partitioner run-length-encode).
    - Parameters: the first node reading a parameter owns it (`NodeCost.params`).
    - `LayerCost.output_bytes`: bytes of every value produced at or before the layer and read
      after it (or returned) — what a cut after this layer carries, skip connections included.
    - `LayerCost.peak_bytes`: the layer's live-in activations plus every tensor its nodes
      produce (an upper bound of what recomputing the layer with grad keeps until backward).

    `annotate` calls this with the per-node costs it ran; `param_info` maps a node to the
    parameters it reads (canonical name -> (bytes, requires_grad)).

    layers = group_layers(gm, node_costs=costs, out_bytes=out, act_bytes=act, param_info=info)
    [layer.name for layer in layers]  # a 2-block GPT-2: ['transformer.wte+wpe+drop', 'transformer.h.0',
                                      #                   'transformer.h.1', 'transformer.ln_f+lm_head']
    """
    nodes = list(gm.graph.nodes)
    runs = _key_runs(nodes)
    owner: dict[str, fx.Node] = {}  # parameter -> the first node reading it (graph order)
    for n in nodes:
        for name in param_info.get(n, {}):
            owner.setdefault(name, n)
    raw = [_Layer(gm, name, members, _is_block(_run_key(name)), node_costs, param_info, owner, act_bytes)
           for name, members in runs]
    unused = sorted(set(_param_names(gm)) - set(owner))
    if unused:
        _log.warning("annotate: %d parameter(s) are never read by the graph and belong to no layer: %s",
                     len(unused), ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else ""))
    merged = _merge_tiny(raw)
    result = _with_output_bytes(nodes, merged, out_bytes)
    # write the final NodeCosts (layer name, ownership)
    by_name = {n.name: n for n in nodes}
    for layer in result:
        for name in layer.nodes:
            n = by_name[name]
            owned = tuple(p for p in param_info.get(n, {}) if owner[p] is n)
            info = param_info.get(n, {})
            n.meta["mobius"] = dataclasses.replace(
                node_costs[n], layer=layer.name, params=owned,
                param_bytes=sum(info[p][0] for p in owned),
                grad_bytes=sum(info[p][0] for p in owned if info[p][1]))
    return result


def _key_runs(nodes: list[fx.Node]) -> list[tuple[str, list[fx.Node]]]:
    """The nodes in contiguous runs of one layer key (`_layer_key`; glue nodes take the key
    before them, leading ones the first, a `get_attr` its first user's), each run named by its
    key, `key@1`, `key@2`, ... when the key comes back later."""
    spine = _spine(nodes)
    keys: list[str | None] = [_layer_key(n, spine) if n.op in _COMPUTE_OPS else None for n in nodes]
    index = {n: i for i, n in enumerate(nodes)}
    for i, n in enumerate(nodes):
        if n.op == "get_attr" and n.users:
            first = min(n.users, key=index.__getitem__)
            keys[i] = keys[index[first]] if first.op in _COMPUTE_OPS else None
    first_key = next((k for k in keys if k is not None), "model")
    filled: list[str] = []
    current = first_key
    for k in keys:
        current = k if k is not None else current
        filled.append(current)
    runs: list[tuple[str, list[fx.Node]]] = []
    seen: dict[str, int] = {}
    previous: str | None = None
    for n, k in zip(nodes, filled):
        if k == previous:
            runs[-1][1].append(n)
            continue
        count = seen.get(k, 0)
        seen[k] = count + 1
        runs.append((k if count == 0 else f"{k}@{count}", [n]))
        previous = k
    return runs


def _with_output_bytes(nodes: list[fx.Node], merged: list, out_bytes: dict[fx.Node, int]) -> list[LayerCost]:
    """Each layer's LayerCost, with the bytes of every value produced at or before it and read
    after it (its output_bytes: what a cut after it carries) and those before it (live in)."""
    layer_of: dict[fx.Node, int] = {}
    for li, layer in enumerate(merged):
        for n in layer.nodes:
            layer_of[n] = li
    count = len(merged)
    carry = [0] * (count + 1)
    for n in nodes:
        if n.op in ("get_attr", "output") or not n.users or not out_bytes.get(n):
            continue
        last = max(count if u.op == "output" else layer_of[u] for u in n.users)
        first = layer_of[n]
        if last > first:
            carry[first] += out_bytes[n]
            carry[last] -= out_bytes[n]
    running = 0
    result: list[LayerCost] = []
    live_in = 0
    for li, layer in enumerate(merged):
        running += carry[li]
        result.append(layer.cost(output_bytes=running, live_in=live_in))
        live_in = running
    return result


def _layer_key(node: fx.Node, spine: set[str]) -> str | None:
    """The module a node groups by, or None for glue (functional code of the root/spine).

    Walking the node's module stack outermost first: a repeated block (a path ending in an
    index, i.e. a child of an nn.ModuleList / nn.Sequential, e.g. `transformer.h.17`) is the
    key; a module on the "spine" (an ancestor of a block container, e.g. HF's `transformer`) is
    descended into; any other module is the key (`transformer.wte`, `lm_head`).
    """
    for path, _cls in module_stack(node):
        if _is_block(path):
            return path
        if path in spine:
            continue
        return path
    return None


class _Layer:
    """A layer under construction: a run of nodes, the names of the runs merged into it."""

    def __init__(self, gm: fx.GraphModule, name: str, nodes: list[fx.Node], block: bool,
                 node_costs: dict[fx.Node, NodeCost], param_info: dict[fx.Node, dict[str, tuple[int, bool]]],
                 owner: dict[str, fx.Node], act_bytes: dict[fx.Node, int]):
        self.gm = gm
        self.names = [name]
        self.nodes = nodes
        self.block = block
        self.node_costs = node_costs
        self.param_info = param_info
        self.owner = owner
        self.act_bytes = act_bytes

    @property
    def param_bytes(self) -> int:
        return sum(b for n in self.nodes for p, (b, _) in self.param_info.get(n, {}).items() if self.owner[p] is n)

    @property
    def fwd_flops(self) -> float:
        return sum(self.node_costs[n].fwd_flops for n in self.nodes)

    def absorb(self, other: "_Layer", *, before: bool) -> None:
        self.nodes = other.nodes + self.nodes if before else self.nodes + other.nodes
        self.names = other.names + self.names if before else self.names + other.names

    def cost(self, *, output_bytes: int, live_in: int) -> LayerCost:
        costs = [self.node_costs[n] for n in self.nodes]
        params: list[str] = []
        uses: list[str] = []
        pbytes = gbytes = 0
        for n in self.nodes:
            for p, (b, g) in self.param_info.get(n, {}).items():
                if p not in uses:
                    uses.append(p)
                if self.owner[p] is n:
                    params.append(p)
                    pbytes += b
                    gbytes += b if g else 0
        name = _join_names(self.names)
        peak = live_in + sum(self.act_bytes.get(n, 0) for n in self.nodes)
        fields = dict(
            name=name, nodes=tuple(n.name for n in self.nodes),
            fwd_flops=sum(c.fwd_flops for c in costs), bwd_flops=sum(c.bwd_flops for c in costs),
            fwd_time=sum(c.fwd_time for c in costs), bwd_time=sum(c.bwd_time for c in costs),
            param_bytes=pbytes, grad_bytes=gbytes, output_bytes=output_bytes, peak_bytes=peak,
            params=tuple(params), uses=tuple(uses), measured=any(c.measured for c in costs),
        )
        return LayerCost(**fields, signature=self._signature(fields))

    def _signature(self, fields: dict[str, Any]) -> str:
        """Class of the layer's module + a digest of its node structure and rounded costs."""
        parts: list[str] = []
        for n in self.nodes:
            if n.op == "call_module":
                target = type(self.gm.get_submodule(str(n.target))).__name__
            elif n.op == "call_function":
                target = getattr(n.target, "__name__", str(n.target))
            elif n.op == "get_attr":
                target = "attr"
            else:
                target = str(n.target) if n.op == "call_method" else ""
            c = self.node_costs[n]
            parts.append(f"{n.op}:{target}:{c.output_bytes}:{_round(c.fwd_flops)}:{_round(c.bwd_flops)}")
        for p in fields["uses"]:
            parts.append(f"p{self.param_info_bytes(p)}:{p in fields['params']}")
        for k in ("fwd_flops", "bwd_flops", "fwd_time", "bwd_time", "param_bytes", "grad_bytes", "output_bytes",
                  "peak_bytes"):
            parts.append(f"{k}={_round(fields[k])}")
        digest = hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]
        return f"{self._class_name()}#{digest}"

    def param_info_bytes(self, p: str) -> int:
        for n in self.nodes:
            if p in self.param_info.get(n, {}):
                return self.param_info[n][p][0]
        return 0

    def _class_name(self) -> str:
        key = _run_key(self.names[0])
        for n in self.nodes:
            for path, cls in module_stack(n):
                if path == key:
                    return cls
        return "glue"


def _merge_tiny(layers: list[_Layer]) -> list[_Layer]:
    blocks = [layer for layer in layers if layer.block]
    if not blocks or len(layers) < 2:
        return layers
    median_params = statistics.median(layer.param_bytes for layer in blocks)
    median_flops = statistics.median(layer.fwd_flops for layer in blocks)

    def tiny(layer: _Layer) -> bool:
        return (not layer.block and layer.param_bytes <= TINY_LAYER_FRACTION * median_params
                and layer.fwd_flops <= TINY_LAYER_FRACTION * median_flops)

    out: list[_Layer] = []
    run: list[_Layer] = []  # consecutive non-block layers
    for layer in layers + [None]:  # type: ignore[list-item]
        if layer is not None and not layer.block:
            run.append(layer)
            continue
        out.extend(_merge_run(run, tiny))
        run = []
        if layer is not None:
            out.append(layer)
    return out


def _merge_run(run: list[_Layer], tiny: Callable[[_Layer], bool]) -> list[_Layer]:
    """Within a run of non-block layers, each tiny layer joins the layer before it (or the next
    non-tiny one at the start of the run); a run of only tiny layers becomes one layer."""
    groups: list[_Layer] = []
    pending: list[_Layer] = []
    for layer in run:
        if tiny(layer):
            if groups:
                groups[-1].absorb(layer, before=False)
            else:
                pending.append(layer)
            continue
        for p in reversed(pending):
            layer.absorb(p, before=True)
        pending = []
        groups.append(layer)
    if pending:
        head = pending[0]
        for p in pending[1:]:
            head.absorb(p, before=False)
        groups.append(head)
    return groups


def _spine(nodes: list[fx.Node]) -> set[str]:
    """Proper ancestors of every block path seen in the graph (modules we descend into)."""
    spine: set[str] = set()
    for n in nodes:
        for path, _ in module_stack(n):
            if _is_block(path):
                parts = path.split(".")
                for i in range(1, len(parts)):
                    spine.add(".".join(parts[:i]))
    return spine


def _is_block(path: str) -> bool:
    return path.rsplit(".", 1)[-1].isdigit()


def _run_key(name: str) -> str:
    return name.split("@", 1)[0]


def _join_names(names: list[str]) -> str:
    """["transformer.wte", "transformer.wpe"] -> "transformer.wte+wpe"."""
    out = names[0]
    prefix = names[0].rsplit(".", 1)[0] + "." if "." in names[0] else ""
    for n in names[1:]:
        out += "+" + (n[len(prefix):] if prefix and n.startswith(prefix) else n)
    return out


# ----------------------------------------------------------------------------- helpers

def _param_names(gm: fx.GraphModule) -> list[str]:
    names = trace_info(gm).names
    return [names.get(n, n) for n, _ in gm.named_parameters()]


def _round(x: float) -> str:
    return f"{float(x):.4g}"
