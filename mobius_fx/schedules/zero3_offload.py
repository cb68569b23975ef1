""""zero3-offload": DeepSpeed ZeRO-3 with CPU offload, data parallel (see `build`)."""

from __future__ import annotations

from mobius_fx.planning.ir_data_parallel import data_parallel
from mobius_fx.planning.schedule_ir import ScheduleIR
from mobius_fx.sim.tasks import Context, Costs
from mobius_fx.schedules.ir_tasks import tasks_from_ir
from mobius_fx.schedules.layer_units import layer_units
from mobius_fx.schedules.looped_ir import LoopedIR, Slot
from mobius_fx.schedules.registry import register

__all__ = ["build", "schedule_ir"]


def build(ctx: Context) -> None:
    """ZeRO-3 offload's schedule IR (`schedule_ir`) as tasks; nothing pinned before the uploads."""
    ir, costs = schedule_ir(ctx)
    ctx.pin_before_upload = False  # DeepSpeed's CPU Adam wrote the fp16 copy the uploads read
    tasks_from_ir(ctx, ir, costs=costs)


def schedule_ir(ctx: Context) -> tuple[ScheduleIR, Costs]:
    """DeepSpeed ZeRO-3 with CPU offload (ZeRO-Offload/ZeRO-Infinity, Rajbhandari et al.
    SC'21; Ren et al. ATC'21), data parallel: each GPU runs 1/N of the batch through every
    layer, fetching each layer's weights from DRAM in forward and again in backward (one layer
    prefetched ahead, as DeepSpeed's prefetch does), and sends each layer's gradients to DRAM;
    DeepSpeed's own CPU Adam (DeepSpeedCPUAdam) runs after the last one, at
    `ctx.deepspeed_adam_bw`: the Mobius optimizer's speed unless DeepSpeed's was measured on the
    machine (the topology's host section with implementation "deepspeed") or given
    (`simulate(deepspeed_adam_bandwidth=)`). Its kernel writes the fp16 copy of the weights as
    it steps (those bytes count in the step), so nothing is pinned before the uploads; the
    gradients it steps are made fp32 on the host first (the "handover" host copy).
    All N GPUs fetch the same bytes, so shared switch uplinks and root complexes carry N x
    the traffic.

    The collectives as DeepSpeed runs them: a layer's all-gather gives each GPU the whole
    layer (the H2D upload), and its reduce-scatter sends each GPU's whole gradient out (the
    D2H download). On GPUs without peer-to-peer (`topology.p2p` False: GeForce cards) NCCL
    routes both through host memory, so each GPU also sends its share of the ring to the host
    with every all-gather ((N-1)/N of the layer, D2H) and receives it with every
    reduce-scatter ((N-1)/N of the gradient, H2D): `LoopedIR.pipeline(host_collectives=...)`.
    With peer-to-peer (or NVLink) that half goes GPU to GPU and is not modelled. Each rank
    keeps its own partition in host memory (`sharded`: on its socket under masters="local").
    Simplifications: one pass per GPU (no gradient accumulation), no activation traffic, the
    last layer stays resident across the turn, the reduction and NCCL's ring hops across the
    inter-socket link are free, NCCL's host buffers are on each GPU's own socket.

    The runtime runs `ir_data_parallel.data_parallel` of the pipeline's Mobius IR (registered as
    this schedule's runtime form): one replica per GPU on its micro-batches (dealt round-robin),
    every stage uploaded to every GPU in forward and again in backward, each GPU's gradients
    downloaded and summed on the host. Deviations (`runs_as_simulated=False`: compile's automatic
    choice leaves it out; `compile(schedule="zero3-offload")` runs it): the pipeline's stages, not
    layers; the user's optimizer (or the overlap) steps, not DeepSpeedCPUAdam; the all-gathers and
    reduce-scatters are plain uploads and downloads (no `collective` ops, nothing routed through
    host buffers); saved inputs offloaded to the host as in Mobius; the replicas one stage apart
    (a wavefront: each upload after the GPU before evicted the stage) and no last stage kept across
    the turn."""
    n = len(ctx.gpus)
    u = layer_units(ctx)
    m = ctx.plan.microbatches
    c = Costs([f * m / n for f in u.f], [b * m / n for b in u.b], u.w, u.g, u.inp, u.out, u.master, u.names)
    routed = 0.0 if ctx.topo.p2p or n == 1 else (n - 1) / n
    ir = LoopedIR()
    for gpu in ctx.gpus:
        slots = [Slot("forward", k, gpu) for k in range(len(u.f))]
        slots += [Slot("backward", k, gpu) for k in reversed(range(len(u.f)))]
        ir.pipeline(c, slots, 1, offload_activations=False, activations=False, host_collectives=routed)
    ir.host_steps(c)  # DeepSpeed steps after the step, writing the fp16 copy in its kernel
    return ir.build(1, sharded=True, host_optimizer="deepspeed"), c


register("zero3-offload", build, optimizer="deepspeed", summary="every GPU fetches every layer; DeepSpeedCPUAdam",
         baseline=True, runtime=data_parallel, runs_as_simulated=False)
