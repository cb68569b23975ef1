""""roundpipe": a RoundPipe-style stateless round-robin dispatch (see `build`)."""

from __future__ import annotations

from mobius_fx.planning.ir_transforms import round_robin
from mobius_fx.planning.schedule_ir import ScheduleIR
from mobius_fx.sim.tasks import Context, Costs
from mobius_fx.schedules.ir_tasks import tasks_from_ir
from mobius_fx.schedules.looped_ir import LoopedIR, Slot
from mobius_fx.schedules.registry import register

__all__ = ["build", "schedule_ir"]


def build(ctx: Context) -> None:
    """RoundPipe's schedule IR (`schedule_ir`) as tasks."""
    tasks_from_ir(ctx, schedule_ir(ctx)[0])


def schedule_ir(ctx: Context) -> tuple[ScheduleIR, Costs]:
    """RoundPipe-style stateless round-robin dispatch (Luo et al., arXiv 2604.27085, 2026).

    Slot i goes to GPU (g0 + i) mod N (g0 = 0, GPUs by CUDA index); every slot runs all
    micro-batches; backward slots continue the rotation after the forward ones, so no GPU waits
    at the forward/backward turn. The last stage is RoundPipe's fused first backward slot: its
    forward doubles as the recompute (it costs b_{S-1} per micro-batch, uploads once, computes
    the loss on the GPU and keeps its input). Every other slot uploads its weights (prefetched
    while the previous slot on that GPU runs, two resident at most), saved inputs go to DRAM
    and come back, gradients go to DRAM. Simplifications: the plan's stages are the slots
    (RoundPipe also cuts backward slots ~1/3 the size of forward ones), its priority packing of
    transfers is the stream priority here, and its optimizer steps as `simulate`'s
    `optimizer_overlap` says ("async" is RoundPipe's own asynchronous optimizer).

    The runtime runs `ir_transforms.round_robin` of the pipeline's Mobius IR (registered as this
    schedule's runtime form): the same GPUs per forward and backward stage, but the last stage
    not fused (its backward recomputes it from its restored input, the loss on the host) and
    the plan's stages uncut (`runs_as_simulated=False`: compile's automatic choice, which goes
    by this simulation's figures, leaves it out; `compile(schedule="roundpipe")` runs it).
    """
    s, n = ctx.plan.num_stages, len(ctx.gpus)
    slots = [Slot("forward", k, ctx.gpus[k % n]) for k in range(s - 1)]
    slots.append(Slot("fused", s - 1, ctx.gpus[(s - 1) % n]))
    slots += [Slot("backward", k, ctx.gpus[(2 * s - 2 - k) % n]) for k in reversed(range(s - 1))]
    ir = LoopedIR()
    ir.pipeline(ctx.stages, slots, ctx.plan.microbatches, loss_on_host=False)
    ir.host_steps(ctx.stages)
    return ir.build(ctx.plan.microbatches), ctx.stages


register("roundpipe", build, data_parallel=True, summary="round-robin slots over the GPUs, fused last stage",
         runtime=round_robin, runs_as_simulated=False)
