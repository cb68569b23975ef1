""""gpipe": GPipe with every weight resident (see `build`).

The runtime runs `planning.ir_resident.resident` of the pipeline's Mobius IR (its `runtime=`):
the plan's stages as they are, each uploaded once per step and held on its GPU from its forward
to its backward (no evict after the forward, no upload for the backward), all forwards then all
backwards in the Mobius IR's order, saved inputs offloaded as in Mobius, the optimizer on the
host. Deviation from `build` (what the simulator runs, `runs_as_simulated=False`): the simulator
re-cuts the model into N compute-balanced stages and steps the optimizer on the GPUs. When the
stages of a GPU do not fit it resident, `compile(schedule="gpipe")` raises, naming the stage,
its GPU and the bytes (`ir_resident.check_resident_fits`).
"""

from __future__ import annotations

from mobius_fx.errors import PlanError
from mobius_fx.planning.ir_resident import check_resident_fits, resident
from mobius_fx.planning.plans import Plan
from mobius_fx.planning.step_memory import MemoryModel
from mobius_fx.planning.schedule_ir import ScheduleIR
from mobius_fx.sim.tasks import Context, Costs
from mobius_fx.planning.host_step import STATE_BYTES
from mobius_fx.units import fmt_bytes
from mobius_fx.schedules.ir_tasks import tasks_from_ir
from mobius_fx.schedules.layer_units import grouped, layer_units
from mobius_fx.schedules.looped_ir import LoopedIR, Slot
from mobius_fx.schedules.registry import register

__all__ = ["build", "schedule_ir"]


def build(ctx: Context) -> None:
    """GPipe's schedule IR (`schedule_ir`) as tasks."""
    ir, costs = schedule_ir(ctx)
    tasks_from_ir(ctx, ir, costs=costs)


def schedule_ir(ctx: Context) -> tuple[ScheduleIR, Costs]:
    """GPipe (Huang et al., 2019; torchgpipe) with every weight resident: the plan's layers
    re-cut into N stages balanced by compute, stage j on the j-th GPU, all forwards then all
    backwards (with recompute), activations hop between GPUs, no weight traffic. The
    optimizer runs on the GPUs, as GPipe does: each GPU steps its own stage at its memory
    bandwidth after the backward. Raises PlanError when a stage's weights, gradients,
    optimizer state and activations do not fit its GPU."""
    plan, n, m = ctx.plan, len(ctx.gpus), ctx.plan.microbatches
    u = layer_units(ctx)
    groups = _balanced(u, n)
    c = grouped(u, groups, lambda j, a, z: f"g{j}")
    mm, recompute, work = _gpipe_memory(plan, u)
    caps = {s.gpu: s.capacity for s in plan.stages}
    by_name = {g.name: g for g in ctx.topo.gpus}
    states = STATE_BYTES[ctx.optimizer] + (4 if ctx.scale != 1.0 else 0)  # + fp32 master copy when streaming half
    for j, (a, z) in enumerate(groups):
        gpu = ctx.gpus[j]
        cap = caps.get(gpu, by_name[gpu].memory)
        opt = c.master[j] / 4.0 * states
        act = m * (c.inp[j] + c.out[j])
        need = mm.footprint(c.w[j], c.g[j], sum(recompute[a:z]), act, max(work[a:z], default=0.0))[1] + opt
        rest = need - opt - c.w[j] - c.g[j]  # activations, recompute, working memory, a micro-batch's fresh grads
        if need > cap:
            raise PlanError(
                f"gpipe stage {j} ({u.names[a]} .. {u.names[z - 1]}) on {gpu} needs {fmt_bytes(need)} (weights "
                f"{fmt_bytes(c.w[j])} + grads {fmt_bytes(c.g[j])} + {ctx.optimizer} state {fmt_bytes(opt)} + "
                f"activations, recompute and working memory {fmt_bytes(rest)}) but {gpu} has {fmt_bytes(cap)}; GPipe keeps every "
                f"weight resident, so this model does not fit {n} GPU(s): use the 'mobius' schedule or more GPUs")
    slots = [Slot("forward", j, ctx.gpus[j]) for j in range(len(groups))]
    slots += [Slot("backward", j, ctx.gpus[j]) for j in reversed(range(len(groups)))]
    ir = LoopedIR()
    ir.pipeline(c, slots, m, resident=True, offload_activations=False, grads_to_host=False)
    ir.gpu_steps(ctx.gpus[:len(groups)])
    return ir.build(m, host_optimizer=None), c


def _balanced(u: Costs, n: int) -> list[tuple[int, int]]:
    """Contiguous groups of units, at most n, minimising the largest compute (f + b)."""
    cost = [f + b for f, b in zip(u.f, u.b)]
    size = len(cost)
    if size <= n:
        return [(i, i + 1) for i in range(size)]

    def cut(limit: float) -> list[tuple[int, int]] | None:
        groups, a, acc = [], 0, 0.0
        for i, x in enumerate(cost):
            if acc + x > limit and i > a:
                groups.append((a, i))
                a, acc = i, 0.0
            acc += x
        groups.append((a, size))
        return groups if len(groups) <= n else None

    lo, hi = max(cost), sum(cost)
    for _ in range(60):
        mid = (lo + hi) / 2
        if cut(mid) is None:
            lo = mid
        else:
            hi = mid
    return cut(hi) or [(0, size)]


def _gpipe_memory(plan: Plan, u: Costs) -> tuple[MemoryModel, list[float], list[float]]:
    """The plan's memory model (`MemoryModel.footprint`, as the partitioner uses), each
    unit's recompute bytes and its working memory (`MemoryModel.working`; a group's is the
    largest of its units'): from the layer table, or, when the units are the plan's stages,
    what of a stage's backward peak the footprint's other terms leave (working memory 0, in it)."""
    m, mm = plan.microbatches, plan.memory
    by_name = {l.name: l for l in plan.layers}
    if plan.layers and all(n in by_name for n in u.names):
        return (mm, [mm.recompute_bytes(by_name[n]) for n in u.names],
                [mm.working(by_name[n]) for n in u.names])
    rest = [max(0.0, s.peak_bytes - mm.footprint(s.param_bytes, s.grad_bytes, 0.0,
                                                  m * (s.input_bytes + s.output_bytes), 0.0)[1])
            for s in plan.stages]
    return mm, rest, [0.0] * len(rest)


register("gpipe", build, summary="every weight resident, N stages balanced by compute, optimizer on the GPUs",
         baseline=True, runtime=resident, fits=check_resident_fits, runs_as_simulated=False)
