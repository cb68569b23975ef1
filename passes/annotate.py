"""The annotate pass: what each node costs, and the layers the partitioner cuts between.

Two sources behind one interface:

- *modelled* — the graph runs node by node on meta tensors (no memory, no data) under
  `torch.utils.flop_counter.FlopCounterMode`. Forward FLOPs come from the forward, backward FLOPs
  from running that node's backward (`torch.autograd.grad` on meta) under the same counter; where
  a node's backward cannot run (an in-place op on a leaf), backward = 2 × forward, the usual rule
  for matmul-like ops. Time is a roofline on a `DeviceSpec`:
  `max(flops / (peak(dtype) · efficiency), bytes_moved / memory_bandwidth)`, where
  bytes_moved = inputs + outputs for the forward and twice that for the backward (read the
  output gradient and saved inputs, write input and weight gradients); view-like nodes move
  nothing. Per-kernel launch latency is ignored.
- *measured* — the graph runs node by node on the real tensors and device it was given;
  each distinct (op, input shapes) is timed once (warm-up, then the median of `repeats`) and
  the time reused for identical nodes (repeated blocks), which keeps blocks identical and the
  pass fast. Forward timing runs under `no_grad`; backward is `torch.autograd.grad` on the node
  (so no `.grad` appears on the model), buffers are cloned (BatchNorm statistics stay as they
  were), and the caller's RNG state is restored.

`bwd_time` always includes the recompute of the forward (Mobius recomputes each stage from its
boundary input): bwd_time = fwd_time + backward.

Parameters are counted once: the first node (graph order) that reads a parameter owns it
(`NodeCost.params`), so tied embedding/lm_head weights and shared modules are not double counted.

Layers — the partition units — follow module boundaries: a repeated block (a child of an
nn.ModuleList / nn.Sequential, e.g. `transformer.h.17`) is one layer, other nodes group by the
module below the "spine" of containers (`transformer.wte`, `lm_head`), functional glue joins the
layer before it, and tiny non-block layers merge with their non-block neighbours, so a GPT with
L blocks gives L + 2 layers. `_group_layers` has the exact rules, including `output_bytes`
(what a cut after the layer carries) and `signature` (equal for repeated blocks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mobius_fx.costs import DEVICE_SPECS, DeviceSpec, LayerCost, NodeCost
from mobius_fx.errors import MobiusError
from mobius_fx.tracing import flatten_inputs, module_stack, trace_info

__all__ = ["annotate", "AUTO_MEASURE_BUDGET_S", "TINY_LAYER_FRACTION"]

_log = logging.getLogger("mobius_fx")

AUTO_MEASURE_BUDGET_S = 10.0  # "auto" measures when the modelled measuring time fits in this
TINY_LAYER_FRACTION = 0.05  # a non-block layer below this share of a median block is merged

_COMPUTE_OPS = ("call_function", "call_method", "call_module")


def annotate(gm: fx.GraphModule, *, example_inputs: Sequence[Any] = (), example_kwargs: dict[str, Any] | None = None,
             costs: str = "model", device_spec: DeviceSpec | str = "rtx3090", dtype: torch.dtype | str | None = None,
             warmup: int = 2, repeats: int = 5,
             progress: Callable[[str], None] | None = None) -> list[LayerCost]:
    """Write `node.meta["mobius"] = NodeCost(...)` on every node and return the layers.

    `costs`: "model" (roofline on `device_spec`, works on meta tensors), "measure" (time on
    the device the tensors are on), or "auto": measure when every example input, parameter
    and buffer is a real tensor (not meta) and the modelled time of measuring
    (fwd + bwd × (warmup + repeats + 2), on the "cpu" spec for CPU tensors, `device_spec` for
    CUDA) is at most `AUTO_MEASURE_BUDGET_S`; model otherwise. `dtype` selects the peak
    FLOP/s of the roofline (default: the dtype of most parameter bytes). Times and bytes are
    for the whole example batch.

    A node whose op cannot run on meta tensors (data-dependent shapes) makes "model" fail;
    "auto" with real inputs then measures instead.

    >>> model, x = nn.Sequential(nn.Linear(64, 64), nn.ReLU()), torch.randn(8, 64)
    >>> gm = trace(model, example_inputs=(x,))
    >>> layers = annotate(gm, example_inputs=(x,), device_spec="rtx4090")
    >>> [layer.name for layer in layers], layers[0].fwd_flops
    (['0', '1'], 65536.0)
    """
    if costs not in ("model", "measure", "auto"):
        raise MobiusError(f"costs={costs!r} is not a cost source; use 'model', 'measure' or 'auto'")
    spec = DeviceSpec.preset(device_spec) if isinstance(device_spec, str) else device_spec
    if warmup < 0 or repeats < 1:
        raise MobiusError(f"warmup={warmup}, repeats={repeats}: need warmup >= 0 and repeats >= 1")
    t0 = time.perf_counter()
    names = trace_info(gm).names
    flat = flatten_inputs(gm, tuple(example_inputs), dict(example_kwargs or {}))
    compute_dtype = dtype if dtype is not None else _main_dtype(gm)
    real = _all_real(gm, flat)
    if costs == "measure" and not real:
        raise MobiusError("costs='measure' needs real tensors, but the example inputs or the model's "
                          "parameters are on the meta device; use costs='model' (or 'auto')")

    run: _Run | None = None
    measure = costs == "measure"
    if not measure:
        _report(progress, f"annotate: modelling {len(gm.graph.nodes)} nodes on meta tensors")
        run = _Run(gm, flat, names, measure=False, spec=spec, dtype=compute_dtype)
        try:
            run.execute()
        except MobiusError as e:
            if costs == "model" or not real:
                raise
            _report(progress, f"annotate auto: cannot model on meta tensors ({e}); measuring instead")
            measure = True
    if costs == "auto" and real and not measure:
        assert run is not None
        host = _host_spec(gm, flat, spec)
        estimate = sum(_roofline(c.fwd_flops + c.bwd_flops, 3 * run.moved[n], host, compute_dtype)
                       for n, c in run.costs.items()) * (warmup + repeats + 2)
        measure = estimate <= AUTO_MEASURE_BUDGET_S
        _report(progress, f"annotate auto: measuring would take ~{estimate:.1f} s -> "
                          f"{'measure' if measure else 'model'}")
    if measure:
        _report(progress, f"annotate: measuring {len(gm.graph.nodes)} nodes on the example inputs")
        run = _Run(gm, flat, names, measure=True, spec=spec, dtype=compute_dtype,
                   warmup=warmup, repeats=repeats, progress=progress)
        run.execute()
    assert run is not None

    layers = _group_layers(gm, run.costs, run.out_bytes, run.act_bytes, run.param_info)
    _report(progress, f"annotate: {len(gm.graph.nodes)} nodes -> {len(layers)} layers in "
                      f"{time.perf_counter() - t0:.2f} s ({'measured' if measure else 'modelled'})")
    return layers


# ----------------------------------------------------------------------------- execution

class _Run:
    """Runs the graph node by node on meta (modelled) or real (measured) tensors.

    Identical nodes — same op, same module configuration, same input shapes/dtypes/strides and
    the same constant arguments — cost the same, so FLOP counting, backward and timing run once
    per distinct node and are reused (a 72-block model costs one block's work).
    """

    def __init__(self, gm: fx.GraphModule, flat_inputs: list[Any], names: dict[str, str], *, measure: bool,
                 spec: DeviceSpec, dtype: Any, warmup: int = 0, repeats: int = 1,
                 progress: Callable[[str], None] | None = None):
        self.gm = gm
        self.flat_inputs = flat_inputs
        self.measure = measure
        self.spec = spec
        self.dtype = dtype
        self.warmup = warmup
        self.repeats = repeats
        self.progress = progress
        self.counter = FlopCounterMode(display=False)
        self.cache: dict[Any, tuple[float, float, float, float, tuple[bool, ...] | None]] = {}
        # name -> (canonical model name, tensor) for every gm parameter/buffer (aliases included)
        self.attrs: dict[str, tuple[str, torch.Tensor]] = {}
        for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
            self.attrs[name] = (names.get(name, name), t)
        self.param_ids = {id(p) for p in gm.parameters()}
        self._copies: dict[int, torch.Tensor] = {}
        self.out_bytes: dict[fx.Node, int] = {}
        self.act_bytes: dict[fx.Node, int] = {}  # bytes of fresh (non-alias) outputs
        self.moved: dict[fx.Node, int] = {}
        # node -> (params it reads: canonical name -> (bytes, requires_grad))
        self.param_info: dict[fx.Node, dict[str, tuple[int, bool]]] = {}
        self.costs: dict[fx.Node, NodeCost] = {}

    # -- values
    def _value(self, t: torch.Tensor, *, is_buffer: bool) -> torch.Tensor:
        """What the graph sees for a model tensor: a meta copy (modelled); the tensor itself
        (parameters, measured) or a private clone (buffers, measured)."""
        key = id(t)
        if key not in self._copies:
            if not self.measure:
                self._copies[key] = _meta_like(t)
            elif is_buffer or not isinstance(t, nn.Parameter):
                self._copies[key] = t.detach().clone()
            else:
                self._copies[key] = t
        return self._copies[key]

    def _attr(self, target: str) -> Any:
        if target in self.attrs:
            _, t = self.attrs[target]
            return self._value(t, is_buffer=id(t) not in self.param_ids)
        obj: Any = self.gm
        for part in target.split("."):
            obj = getattr(obj, part)
        return self._value(obj, is_buffer=True) if isinstance(obj, torch.Tensor) else obj

    def _input(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if not self.measure:
            return _meta_like(x)
        return x.detach().clone().requires_grad_(x.requires_grad)

    # -- main loop
    def execute(self) -> dict[fx.Node, NodeCost]:
        graph = self.gm.graph
        nodes = list(graph.nodes)
        last_use: dict[fx.Node, fx.Node] = {}
        for node in nodes:
            for inp in node.all_input_nodes:
                last_use[inp] = node
        frees: dict[fx.Node, list[fx.Node]] = {}
        for value, user in last_use.items():
            frees.setdefault(user, []).append(value)

        env: dict[fx.Node, Any] = {}
        inputs = iter(self.flat_inputs)
        misses = 0
        with torch.random.fork_rng(devices=_cuda_devices(self.flat_inputs)):
            for i, node in enumerate(nodes):
                try:
                    cost = self._node(node, env, inputs)
                except MobiusError:
                    raise
                except Exception as e:
                    mode = "measuring" if self.measure else "modelling costs on meta tensors"
                    hint = ("; this op may need real data (data-dependent shapes): try costs='measure' "
                            "with real example inputs" if not self.measure else "")
                    raise MobiusError(f"annotate failed while {mode} at node {node.format_node()}: "
                                      f"{type(e).__name__}: {_first_line(e)}{hint}") from e
                self.costs[node] = cost
                for dead in frees.get(node, ()):
                    env.pop(dead, None)
                if self.measure and self.progress is not None and len(self.cache) > misses and len(self.cache) % 50 == 0:
                    misses = len(self.cache)
                    _report(self.progress, f"annotate: measured {misses} distinct ops ({i + 1}/{len(nodes)} nodes)")
        return self.costs

    def _node(self, node: fx.Node, env: dict[fx.Node, Any], inputs) -> NodeCost:
        zero = NodeCost(0.0, 0.0, 0.0, 0.0, 0, 0, 0, self.measure)
        if node.op == "placeholder":
            value = self._input(next(inputs))
            env[node] = value
            nbytes = _bytes(value)
            self.out_bytes[node] = self.act_bytes[node] = nbytes
            self.moved[node] = 0
            self.param_info[node] = {}
            return dataclasses.replace(zero, output_bytes=nbytes)
        if node.op == "get_attr":
            env[node] = self._attr(str(node.target))
            self.out_bytes[node] = self.act_bytes[node] = 0
            self.moved[node] = 0
            self.param_info[node] = {}
            return zero
        if node.op == "output":
            self.out_bytes[node] = self.act_bytes[node] = 0
            self.moved[node] = 0
            self.param_info[node] = {}
            return zero

        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if not self.measure:
            args, kwargs = pytree.tree_map_only(torch.device, lambda _: torch.device("meta"), (args, kwargs))
        fn, module_state = self._callable(node)
        params = self._params_read(node)
        self.param_info[node] = params

        in_tensors = _unique_tensors((args, kwargs, list(module_state.values())))
        key = _node_key(node, fn, args, kwargs, module_state)
        cached = self.cache.get(key) if key is not None else None
        if cached is None:
            out, entry = self._first_run(fn, args, kwargs, in_tensors)
            if key is not None:
                self.cache[key] = entry
        else:
            with torch.no_grad():
                out = fn(*args, **kwargs)
            entry = cached
        fwd_flops, bwd_flops, fwd_m, bwd_m, grad_flags = entry
        out_list = _unique_tensors(out)
        in_ids = {id(t) for t in in_tensors}
        # fresh outputs: not an input handed back (getitem, in-place) nor a view of one
        fresh = [t for t in out_list if id(t) not in in_ids and not t._is_view()]
        env[node] = self._store(out, grad_flags, in_tensors)

        out_bytes = sum(_bytes(t) for t in out_list)
        act = sum(_bytes(t) for t in fresh)
        in_bytes = sum(_bytes(t) for t in in_tensors)
        moved = in_bytes + act if fresh else 0
        self.out_bytes[node], self.act_bytes[node], self.moved[node] = out_bytes, act, moved
        if self.measure:
            fwd_time, bwd_time = fwd_m, fwd_m + bwd_m
        else:
            fwd_time = _roofline(fwd_flops, moved, self.spec, self.dtype)
            needs_grad = grad_flags is not None and any(grad_flags)
            bwd_time = fwd_time + (_roofline(bwd_flops, 2 * moved, self.spec, self.dtype) if needs_grad else 0.0)
        return NodeCost(fwd_flops=float(fwd_flops), bwd_flops=float(bwd_flops), fwd_time=fwd_time,
                        bwd_time=bwd_time, param_bytes=0, output_bytes=out_bytes, peak_bytes=in_bytes + act,
                        measured=self.measure)

    def _callable(self, node: fx.Node) -> tuple[Callable[..., Any], dict[str, torch.Tensor]]:
        if node.op == "call_function":
            return node.target, {}
        if node.op == "call_method":
            name = str(node.target)
            return (lambda self_, *a, **k: getattr(self_, name)(*a, **k)), {}
        module = self.gm.get_submodule(str(node.target))
        state: dict[str, torch.Tensor] = {}
        for local, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
            is_buffer = id(t) not in self.param_ids
            if self.measure and not is_buffer:
                continue  # parameters are used as they are
            state[local] = self._value(t, is_buffer=is_buffer)

        def call(*a: Any, **k: Any) -> Any:
            if not state:  # measured, no buffers: call the module as it is
                return module(*a, **k)
            return torch.func.functional_call(module, state, a, k, strict=False, tie_weights=False)

        call.module = module  # type: ignore[attr-defined]
        full_state = dict(state)  # what the module computes with (key, inputs of the backward)
        if self.measure:
            full_state.update(module.named_parameters(remove_duplicate=False))
        return call, full_state

    def _params_read(self, node: fx.Node) -> dict[str, tuple[int, bool]]:
        """Canonical names of the parameters this node reads directly, with bytes and grad flag."""
        out: dict[str, tuple[int, bool]] = {}
        targets: list[str] = []
        if node.op == "call_module":
            module = self.gm.get_submodule(str(node.target))
            targets += [f"{node.target}.{n}" for n, _ in module.named_parameters(remove_duplicate=False)]
        targets += [str(a.target) for a in node.all_input_nodes if a.op == "get_attr"]
        for target in targets:
            entry = self.attrs.get(target)
            if entry is None or id(entry[1]) not in self.param_ids:
                continue
            name, t = entry
            out.setdefault(name, (t.numel() * t.element_size(), bool(t.requires_grad)))
        return out

    def _first_run(self, fn: Callable[..., Any], args: Any, kwargs: Any,
                   in_tensors: list[torch.Tensor]) -> tuple[Any, tuple[float, float, float, float, tuple[bool, ...] | None]]:
        """Count FLOPs (forward, backward) and, when measuring, time the node."""
        counter = self.counter
        grad_ins = [t for t in in_tensors if t.requires_grad]
        bwd_flops = 0.0
        grad_flags: tuple[bool, ...] | None
        try:
            with counter:
                out = fn(*args, **kwargs)
            fwd_flops = float(counter.get_total_flops())
            outs = [t for t in _unique_tensors(out) if t.requires_grad and t.grad_fn is not None]
            grad_flags = tuple(t.requires_grad for t in _tensor_leaves(out))
            if outs and grad_ins:
                grads = [torch.ones_like(t) for t in outs]
                with counter:
                    torch.autograd.grad(outs, grad_ins, grads, allow_unused=True, retain_graph=self.measure)
                bwd_flops = float(counter.get_total_flops())
        except RuntimeError:
            # e.g. an in-place op on a leaf that requires grad: count the forward alone and use
            # the 2x rule for the backward.
            with torch.no_grad(), counter:
                out = fn(*args, **kwargs)
            fwd_flops = float(counter.get_total_flops())
            bwd_flops = 2.0 * fwd_flops
            outs, grads = [], []
            grad_flags = tuple((t.is_floating_point() and bool(grad_ins)) for t in _tensor_leaves(out))
        fwd_m = bwd_m = 0.0
        if self.measure:
            sync = _synchronizer(in_tensors)

            def forward() -> None:
                with torch.no_grad():
                    fn(*args, **kwargs)

            fwd_m = _median_time(forward, self.warmup, self.repeats, sync)
            if outs and grad_ins:
                def backward() -> None:
                    torch.autograd.grad(outs, grad_ins, grads, allow_unused=True, retain_graph=True)

                bwd_m = _median_time(backward, self.warmup, self.repeats, sync)
        return out, (fwd_flops, bwd_flops, fwd_m, bwd_m, grad_flags)

    def _store(self, out: Any, grad_flags: tuple[bool, ...] | None, in_tensors: list[torch.Tensor]) -> Any:
        """Detach outputs into fresh leaves that keep their requires_grad flag (so the next
        node's backward stops at its own inputs)."""
        leaves, spec = pytree.tree_flatten(out)
        flags = iter(grad_flags or ())
        any_grad = any(t.requires_grad for t in in_tensors)
        new = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                flag = next(flags, any_grad and leaf.is_floating_point())
                d = leaf.detach()
                if flag and (d.is_floating_point() or d.is_complex()):
                    d.requires_grad_(True)
                new.append(d)
            else:
                new.append(leaf)
        return pytree.tree_unflatten(new, spec)


# ----------------------------------------------------------------------------- layers

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


def _group_layers(gm: fx.GraphModule, node_costs: dict[fx.Node, NodeCost], out_bytes: dict[fx.Node, int],
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
    """
    nodes = list(gm.graph.nodes)
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

    # contiguous runs -> raw layers
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

    # ownership (graph order)
    owner: dict[str, fx.Node] = {}
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

    # liveness: output_bytes of each layer
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

def _node_key(node: fx.Node, fn: Any, args: Any, kwargs: Any, state: dict[str, torch.Tensor]) -> Any:
    """Hashable identity of what a node computes, or None if it cannot be keyed safely."""
    try:
        if node.op == "call_module":
            module = fn.module
            target: Any = (type(module), module.extra_repr(), module.training,
                           tuple((k, _spec(v)) for k, v in sorted(state.items())))
        elif node.op == "call_method":
            target = ("method", node.target)
        else:
            target = node.target
        key = (node.op, target, _spec(args), _spec(kwargs))
        hash(key)
        return key
    except (TypeError, _Unkeyable):
        return None


class _Unkeyable(Exception):
    pass


def _spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad, x.device.type)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_spec(i) for i in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _spec(v)) for k, v in x.items()))
    if x is None or isinstance(x, (bool, int, str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return x
    if isinstance(x, float):
        return ("f", repr(x))
    if isinstance(x, slice):
        return ("slice", _spec(x.start), _spec(x.stop), _spec(x.step))
    raise _Unkeyable(type(x).__name__)


def _tensor_leaves(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _unique_tensors(x: Any) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in _tensor_leaves(x):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _bytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _unique_tensors(x))


def _round(x: float) -> str:
    return f"{float(x):.4g}"


def _roofline(flops: float, nbytes: float, spec: DeviceSpec, dtype: Any) -> float:
    compute = flops / (spec.peak_flops(dtype) * spec.efficiency) if flops else 0.0
    memory = nbytes / spec.memory_bandwidth if nbytes else 0.0
    return max(compute, memory)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    if t.requires_grad and (t.is_floating_point() or t.is_complex()):
        out.requires_grad_(True)
    return out


def _param_names(gm: fx.GraphModule) -> list[str]:
    names = trace_info(gm).names
    return [names.get(n, n) for n, _ in gm.named_parameters()]


def _main_dtype(gm: fx.GraphModule) -> torch.dtype:
    totals: dict[torch.dtype, int] = {}
    for p in gm.parameters():
        if p.is_floating_point():
            totals[p.dtype] = totals.get(p.dtype, 0) + p.numel()
    return max(totals, key=totals.__getitem__) if totals else torch.float32


def _all_real(gm: fx.GraphModule, flat: list[Any]) -> bool:
    tensors = _tensor_leaves(flat) + list(gm.parameters()) + list(gm.buffers())
    return all(not t.is_meta for t in tensors)


def _host_spec(gm: fx.GraphModule, flat: list[Any], spec: DeviceSpec) -> DeviceSpec:
    tensors = _tensor_leaves(flat) + list(gm.parameters())
    return spec if any(t.is_cuda for t in tensors) else DEVICE_SPECS["cpu"]


def _cuda_devices(flat: list[Any]) -> list[int]:
    return sorted({t.device.index or 0 for t in _tensor_leaves(flat) if t.is_cuda})


def _synchronizer(tensors: list[torch.Tensor]) -> Callable[[], None]:
    if any(t.is_cuda for t in tensors):
        return torch.cuda.synchronize
    return lambda: None


def _median_time(fn: Callable[[], None], warmup: int, repeats: int, sync: Callable[[], None]) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)[:300]


def _report(progress: Callable[[str], None] | None, message: str) -> None:
    _log.info(message)
    if progress is not None:
        progress(message)
