"""Cost types: what one node / one layer costs.

`NodeCost` lives in `node.meta["mobius"]` (written by the annotate pass). `LayerCost` is the
partition unit: consecutive nodes grouped along module boundaries. What a device can do
(`DeviceSpec`, the roofline modelled costs use) is the topology's: `mobius_fx.topology.device_specs`.

The functions that compute costs (FLOP counting, measurement, grouping) live in
`mobius_fx.passes.annotate`; this module only holds the shared types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["NodeCost", "LayerCost"]



@dataclass(frozen=True)
class NodeCost:
    """Cost facts of one fx node, stored in `node.meta["mobius"]`.

    Times are seconds for the whole example batch; bytes are of the tensors as traced (the
    planner rescales weight bytes to the streamed dtype). `params` holds the qualified names of
    the parameters this node is the first user of, so a tied parameter is counted once.
    """

    fwd_flops: float
    bwd_flops: float
    fwd_time: float
    bwd_time: float  # backward including the recompute of the forward
    param_bytes: int
    output_bytes: int
    peak_bytes: int  # working memory while the node runs (inputs + outputs + temporaries)
    measured: bool
    layer: str = ""  # name of the layer (partition unit) this node belongs to
    params: tuple[str, ...] = ()
    grad_bytes: int = 0  # bytes of this node's params that require grad


@dataclass(frozen=True)
class LayerCost:
    """One partition unit: consecutive nodes of one module (e.g. `transformer.h.17`).

    `output_bytes` is the activation that crosses the boundary after this layer (what would be
    sent to the next stage if the cut fell here), for the whole example batch. `signature`
    is equal for layers with identical costs and structure, so the partitioner can
    run-length-encode repeated blocks.
    """

    name: str
    nodes: tuple[str, ...]
    fwd_flops: float
    bwd_flops: float
    fwd_time: float
    bwd_time: float
    param_bytes: int
    grad_bytes: int
    output_bytes: int
    peak_bytes: int
    params: tuple[str, ...] = ()  # parameters this layer owns (first user; tied counted once)
    uses: tuple[str, ...] = ()  # every parameter the layer reads (a tied one appears in two layers)
    measured: bool = False
    signature: str = field(default="", compare=False)
    saved_bytes: int = -1  # what its recompute keeps for its backward (annotate's meta run); -1: not known, peak_bytes
