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
- *measured* — the graph runs node by node on clones of the inputs, parameters and buffers,
  on the device they are on (the model is never run on: compile does not change it, even
  when forward changes a weight in place); each distinct (op, input shapes) is timed once
  (warm-up, then the median of `repeats`) and the time reused for identical nodes (repeated
  blocks), which keeps blocks identical and the pass fast. Forward timing runs under
  `no_grad`, an in-place op on fresh copies of its arguments each run (so it changes the
  values the graph goes on with once, as eager does); backward is `torch.autograd.grad` on the
  node (no `.grad` appears anywhere), and the caller's RNG state is restored.

`bwd_time` always includes the recompute of the forward (Mobius recomputes each stage from its
boundary input): bwd_time = fwd_time + backward.

Parameters are counted once: the first node (graph order) that reads a parameter owns it
(`NodeCost.params`), so tied embedding/lm_head weights and shared modules are not double counted.

Layers — the partition units — follow module boundaries (a GPT with L blocks gives L + 2
layers); `mobius_fx.passes.layers.group_layers` groups them and writes the final `NodeCost`s.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mobius_fx.planning.costs import LayerCost, NodeCost
from mobius_fx.topology.device_specs import DeviceSpec
from mobius_fx.errors import MobiusError
from mobius_fx.precision import Precision, dtype_name, master_dtype
from mobius_fx.passes.annotate_tools import (LiveBytes, all_real, cuda_devices, holding, host_spec, median_time,
                                             meta_like, node_key, roofline, synchronizer, tensor_leaves,
                                             unique_tensors, value_bytes)
from mobius_fx.passes.layers import TINY_LAYER_FRACTION, group_layers
from mobius_fx.tracing import flatten_inputs, trace_info

__all__ = ["annotate", "AUTO_MEASURE_BUDGET_S", "TINY_LAYER_FRACTION"]

_log = logging.getLogger("mobius_fx")

AUTO_MEASURE_BUDGET_S = 10.0  # "auto" measures when the modelled measuring time fits in this


def annotate(gm: fx.GraphModule, *, example_inputs: Sequence[Any] = (), example_kwargs: dict[str, Any] | None = None,
             costs: str = "model", device_spec: DeviceSpec | str = "rtx3090", precision: Precision | None = None,
             warmup: int = 2, repeats: int = 5,
             progress: Callable[[str], None] | None = None) -> list[LayerCost]:
    """Write `node.meta["mobius"] = NodeCost(...)` on every node and return the layers.

    `costs`: "model" (roofline on `device_spec`, works on meta tensors), "measure" (time on
    the device the tensors are on), or "auto": measure when every example input, parameter
    and buffer is a real tensor (not meta) and the modelled time of measuring
    (fwd + bwd × (warmup + repeats + 2), on the "cpu" spec for CPU tensors, `device_spec` for
    CUDA) is at most `AUTO_MEASURE_BUDGET_S`; model otherwise. `precision` (`CompileOptions.precision`;
    None: the masters' dtype, `precision.master_dtype` of the graph's parameters, streamed as it
    is): its `stream` selects the peak FLOP/s of the roofline, and bytes are counted as the
    stages hold them streamed in it (`_bytes_as_run`), in the masters' units. Times and bytes
    are for the whole example batch.

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
    precision = precision or Precision.of(None, master=master_dtype(gm.parameters()))
    compute_dtype = precision.stream
    real = all_real(gm, flat)
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
        host = host_spec(gm, flat, spec)
        estimate = sum(roofline(c.fwd_flops + c.bwd_flops, 3 * run.moved[n], host, compute_dtype)
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
    out_bytes, act_bytes, held, scale = _bytes_as_run(gm, flat, names, spec, precision, run, progress)
    layers = group_layers(gm, node_costs=run.costs, out_bytes=out_bytes, act_bytes=act_bytes,
                          param_info=run.param_info)
    if held is None and measure:  # measured in the master dtype: its bytes come from a meta run
        held = _Run(gm, flat, names, measure=False, spec=spec, dtype=compute_dtype)
        try:
            held.execute()
        except MobiusError:
            held = None
    layers = _layer_peaks(gm, layers, act_bytes, held, scale)
    _report(progress, f"annotate: {len(gm.graph.nodes)} nodes -> {len(layers)} layers in "
                      f"{time.perf_counter() - t0:.2f} s ({'measured' if measure else 'modelled'})")
    return layers


def _bytes_as_run(gm: fx.GraphModule, flat: list[Any], names: dict[str, str], spec: DeviceSpec, precision: Precision,
                  run: "_Run", progress: Callable[[str], None] | None) -> tuple[dict, dict, "_Run | None", int]:
    """(out_bytes, act_bytes, meta run, scale) per node in the master dtype's units: what `MemoryModel` scales by
    `act_scale` (`precision.scale`, stream / master bytes) to get the bytes the stage holds when it runs in
    the streamed dtype.

    In the master dtype's trace, a conversion to fp32 (`logits.float()` before a loss) hands its
    input back and costs nothing, and an op on it (log_softmax) looks as big as every other
    activation; run in bf16 (fp32 masters), the conversion makes a new fp32 tensor and the loss works in fp32,
    twice what the scaled trace says (issue 26: a plan `compile` accepted failed its budget at
    the first step). So with a stream narrower than the masters the graph runs once more on meta
    tensors with its floating weights and inputs in the streamed dtype, and each tensor counts
    its bytes there, over the scale (an fp32 tensor counts double with fp32 masters). Streamed
    in the masters' dtype, the run's own bytes stand.
    The meta run the bytes come from (None when they were measured) and the scale go on to
    `_layer_peaks`."""
    if precision.stream_bytes >= precision.master_bytes:
        return run.out_bytes, run.act_bytes, (None if run.measure else run), 1
    cast = precision.stream
    again = _Run(gm, flat, names, measure=False, spec=spec, dtype=cast, cast=cast)
    try:
        again.execute()
    except MobiusError as e:  # a graph only real data can run: the measured bytes stand
        _report(progress, f"annotate: cannot run the graph in {dtype_name(cast)} on meta tensors ({e}); "
                          "bytes as traced, scaled")
        return run.out_bytes, run.act_bytes, (None if run.measure else run), 1
    scale = precision.master_bytes // precision.stream_bytes
    return ({n: b * scale for n, b in again.out_bytes.items()}, {n: b * scale for n, b in again.act_bytes.items()},
            again, scale)


# ----------------------------------------------------------------------------- layer peaks

def _layer_peaks(gm: fx.GraphModule, layers: list[LayerCost], act_bytes: dict[fx.Node, int], held: "_Run | None",
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
                    _log.info("annotate: layer %s cannot run again on meta tensors (%s: %s); its peak is "
                              "bounded from its nodes' bytes", layer.name, type(e).__name__, _first_line(e))
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


def _replay(run: "_Run", members: list[fx.Node]) -> tuple[int, int, int]:
    """Bytes `members` (a layer's nodes) hold beyond their inputs, run on `run`'s meta values:
    (the forward's peak without grad, what the recompute with grad holds when it ends -- its
    outputs and what autograd saved --, the peak of that recompute and the backward after it
    from ones as the outputs' gradients into the inputs and the weights, less the weight
    gradients' bytes: the step model counts those, `grad_copies` x gradients)."""
    inside = set(members)
    inputs = list(dict.fromkeys(i for n in members for i in n.all_input_nodes if i not in inside))
    outputs = [n for n in members if n.op != "output" and any(u not in inside or u.op == "output" for u in n.users)]
    last: dict[fx.Node, fx.Node] = {}
    for n in members:
        for i in n.all_input_nodes:
            last[i] = n
    frees: dict[fx.Node, list[fx.Node]] = {}
    for v, n in last.items():
        if v in inside and v not in outputs:
            frees.setdefault(n, []).append(v)

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
                fn, state = run._callable(n)
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


# ----------------------------------------------------------------------------- execution

class _Run:
    """Runs the graph node by node on meta (modelled) or real (measured) tensors.

    Identical nodes — same op, same module configuration, same input shapes/dtypes/strides and
    the same constant arguments — cost the same, so FLOP counting, backward and timing run once
    per distinct node and are reused (a 72-block model costs one block's work).
    """

    def __init__(self, gm: fx.GraphModule, flat_inputs: list[Any], names: dict[str, str], *, measure: bool,
                 spec: DeviceSpec, dtype: Any, warmup: int = 0, repeats: int = 1,
                 progress: Callable[[str], None] | None = None, cast: torch.dtype | None = None):
        self.gm = gm
        self.cast = cast  # meta copies of floating weights and inputs in this dtype (`_bytes_as_run`)
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
        self.values: dict[fx.Node, Any] = {}  # node -> its value, meta runs only

    # -- values
    def _value(self, t: torch.Tensor, *, is_buffer: bool) -> torch.Tensor:
        """What the graph sees for a model tensor: a meta copy (modelled) or a private clone
        (measured; parameters keep their requires_grad), one per tensor (tied weights stay
        tied). The model's own tensors are never run on: an in-place op in forward would change
        them once per timing run."""
        key = id(t)
        if key not in self._copies:
            if not self.measure:
                self._copies[key] = meta_like(t, self.cast)
            else:
                copy = t.detach().clone()
                if not is_buffer and isinstance(t, nn.Parameter):
                    copy.requires_grad_(t.requires_grad)
                self._copies[key] = copy
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
            return meta_like(x, self.cast)
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
        with torch.random.fork_rng(devices=cuda_devices(self.flat_inputs)):
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
                if not self.measure:  # meta: free to keep, `_layer_peaks` runs layers again from them
                    self.values[node] = env.get(node)
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
            nbytes = value_bytes(value)
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

        in_tensors = unique_tensors((args, kwargs, list(module_state.values())))
        key = node_key(node, fn, args, kwargs, module_state)
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
        out_list = unique_tensors(out)
        in_ids = {id(t) for t in in_tensors}
        # fresh outputs: not an input handed back (getitem, in-place) nor a view of one
        fresh = [t for t in out_list if id(t) not in in_ids and not t._is_view()]
        env[node] = self._store(out, grad_flags, in_tensors)

        out_bytes = sum(value_bytes(t) for t in out_list)
        act = sum(value_bytes(t) for t in fresh)
        in_bytes = sum(value_bytes(t) for t in in_tensors)
        moved = in_bytes + act if fresh else 0
        self.out_bytes[node], self.act_bytes[node], self.moved[node] = out_bytes, act, moved
        if self.measure:
            fwd_time, bwd_time = fwd_m, fwd_m + bwd_m
        else:
            fwd_time = roofline(fwd_flops, moved, self.spec, self.dtype)
            needs_grad = grad_flags is not None and any(grad_flags)
            bwd_time = fwd_time + (roofline(bwd_flops, 2 * moved, self.spec, self.dtype) if needs_grad else 0.0)
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
            state[local] = self._value(t, is_buffer=id(t) not in self.param_ids)
        # measured: a shallow copy of the module holding the copies, called as it is (no
        # functional_call overhead in the timing)
        holder = holding(module, state) if self.measure else None

        def call(*a: Any, **k: Any) -> Any:
            if holder is not None:
                return holder(*a, **k)
            return torch.func.functional_call(module, state, a, k, strict=False, tie_weights=False)

        call.module = module  # type: ignore[attr-defined]
        return call, dict(state)  # what the module computes with (key, inputs of the backward)

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
        versions = [t._version for t in in_tensors]
        ran = False
        try:
            with counter:
                out = fn(*args, **kwargs)
            ran = True
            fwd_flops = float(counter.get_total_flops())
            outs = [t for t in unique_tensors(out) if t.requires_grad and t.grad_fn is not None]
            grad_flags = tuple(t.requires_grad for t in tensor_leaves(out))
            if outs and grad_ins:
                grads = [torch.ones_like(t) for t in outs]
                with counter:
                    torch.autograd.grad(outs, grad_ins, grads, allow_unused=True, retain_graph=self.measure)
                bwd_flops = float(counter.get_total_flops())
        except RuntimeError:
            # e.g. an in-place op on a leaf that requires grad: count the forward alone and use
            # the 2x rule for the backward. The forward runs again only if it did not run: an
            # in-place op must change its input once, as in eager.
            if not ran:
                with torch.no_grad(), counter:
                    out = fn(*args, **kwargs)
                fwd_flops = float(counter.get_total_flops())
            bwd_flops = 2.0 * fwd_flops
            outs, grads = [], []
            grad_flags = tuple((t.is_floating_point() and bool(grad_ins)) for t in tensor_leaves(out))
        fwd_m = bwd_m = 0.0
        if self.measure:
            sync = synchronizer(in_tensors)

            setup = None
            if any(t._version != v for t, v in zip(in_tensors, versions)):
                # an in-place op: each timing run gets fresh copies of the arguments, so the op is
                # not applied again to the values the graph goes on with (T5's bucket indices)
                def setup() -> tuple:
                    with torch.no_grad():
                        return pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))

            def forward(a: Any = args, k: Any = kwargs) -> None:
                with torch.no_grad():
                    fn(*a, **k)

            fwd_m = median_time(forward, self.warmup, self.repeats, sync, setup)
            if outs and grad_ins:
                def backward() -> None:
                    torch.autograd.grad(outs, grad_ins, grads, allow_unused=True, retain_graph=True)

                bwd_m = median_time(backward, self.warmup, self.repeats, sync)
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


# ----------------------------------------------------------------------------- helpers

def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)[:300]


def _report(progress: Callable[[str], None] | None, message: str) -> None:
    _log.info(message)
    if progress is not None:
        progress(message)
