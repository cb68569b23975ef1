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

The run node by node is `annotate_graph_run.GraphRun`; each layer's working memory,
`annotate_layer_peaks.layer_peaks`; what they measure with, `annotate_tools`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from mobius_fx.planning.costs import LayerCost
from mobius_fx.topology.device_specs import DeviceSpec
from mobius_fx.errors import MobiusError
from mobius_fx.precision import Precision, dtype_name, master_dtype
from mobius_fx.passes.annotate_graph_run import GraphRun
from mobius_fx.passes.annotate_layer_peaks import layer_peaks
from mobius_fx.passes.annotate_tools import all_real, host_spec, report, roofline
from mobius_fx.passes.layers import group_layers
from mobius_fx.tracing import flatten_inputs, trace_info

__all__ = ["annotate", "AUTO_MEASURE_BUDGET_S"]

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

    run: GraphRun | None = None
    measure = costs == "measure"
    if not measure:
        report(progress, f"annotate: modelling {len(gm.graph.nodes)} nodes on meta tensors")
        run = GraphRun(gm, flat, names, measure=False, spec=spec, dtype=compute_dtype)
        try:
            run.execute()
        except MobiusError as e:
            if costs == "model" or not real:
                raise
            report(progress, f"annotate auto: cannot model on meta tensors ({e}); measuring instead")
            measure = True
    if costs == "auto" and real and not measure:
        assert run is not None
        host = host_spec(gm, flat, spec)
        estimate = sum(roofline(c.fwd_flops + c.bwd_flops, 3 * run.moved[n], host, compute_dtype)
                       for n, c in run.costs.items()) * (warmup + repeats + 2)
        measure = estimate <= AUTO_MEASURE_BUDGET_S
        report(progress, f"annotate auto: measuring would take ~{estimate:.1f} s -> "
                          f"{'measure' if measure else 'model'}")
    if measure:
        report(progress, f"annotate: measuring {len(gm.graph.nodes)} nodes on the example inputs")
        run = GraphRun(gm, flat, names, measure=True, spec=spec, dtype=compute_dtype,
                   warmup=warmup, repeats=repeats, progress=progress)
        run.execute()
    assert run is not None
    out_bytes, act_bytes, held, scale = _bytes_as_run(gm, flat, names, spec, precision, run, progress)
    layers = group_layers(gm, node_costs=run.costs, out_bytes=out_bytes, act_bytes=act_bytes,
                          param_info=run.param_info)
    if held is None and measure:  # measured in the master dtype: its bytes come from a meta run
        held = GraphRun(gm, flat, names, measure=False, spec=spec, dtype=compute_dtype)
        try:
            held.execute()
        except MobiusError:
            held = None
    layers = layer_peaks(gm, layers, act_bytes, held, scale)
    report(progress, f"annotate: {len(gm.graph.nodes)} nodes -> {len(layers)} layers in "
                      f"{time.perf_counter() - t0:.2f} s ({'measured' if measure else 'modelled'})")
    return layers


def _bytes_as_run(gm: fx.GraphModule, flat: list[Any], names: dict[str, str], spec: DeviceSpec, precision: Precision,
                  run: "GraphRun", progress: Callable[[str], None] | None) -> tuple[dict, dict, "GraphRun | None", int]:
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
    `layer_peaks`."""
    if precision.stream_bytes >= precision.master_bytes:
        return run.out_bytes, run.act_bytes, (None if run.measure else run), 1
    cast = precision.stream
    again = GraphRun(gm, flat, names, measure=False, spec=spec, dtype=cast, cast=cast)
    try:
        again.execute()
    except MobiusError as e:  # a graph only real data can run: the measured bytes stand
        report(progress, f"annotate: cannot run the graph in {dtype_name(cast)} on meta tensors ({e}); "
                          "bytes as traced, scaled")
        return run.out_bytes, run.act_bytes, (None if run.measure else run), 1
    scale = precision.master_bytes // precision.stream_bytes
    return ({n: b * scale for n, b in again.out_bytes.items()}, {n: b * scale for n, b in again.act_bytes.items()},
            again, scale)
