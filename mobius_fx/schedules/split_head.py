""""split-head": fine round-robin slots, the loss stage dealt by micro-batch to every GPU (see `schedule_ir`).

The runtime runs it in another form (`runtime=`, mobius_fx/planning/ir_split_head.py): on the
compiled pipeline's own stages (it cannot re-cut them into one-layer slots without compiling
again), every stage but the last as Mobius runs it, the last stage dealt by micro-batch; so
`runs_as_simulated=False` and compile's own choice leaves it out.
"""

from __future__ import annotations

from mobius_fx.errors import PlanError
from mobius_fx.planning.ir_split_head import split_head
from mobius_fx.planning.schedule_ir import ScheduleIR
from mobius_fx.sim.tasks import Context, Costs
from mobius_fx.units import fmt_bytes
from mobius_fx.schedules.ir_tasks import tasks_from_ir
from mobius_fx.schedules.layer_units import grouped, layer_units
from mobius_fx.schedules.looped_ir import LoopedIR, Slot
from mobius_fx.schedules.registry import register

__all__ = ["build", "schedule_ir", "slots", "memory_need", "LOSS_BYTES"]

# The most a plan's last stage outputs per micro-batch when it computes the loss (a loss, a token
# count): more is a model output, sent to the host for its loss and its gradient back.
LOSS_BYTES = 64


def build(ctx: Context) -> None:
    """The split-head schedule IR (`schedule_ir`) as tasks, after its memory check."""
    ir, costs = schedule_ir(ctx)
    tasks_from_ir(ctx, ir, costs=costs)


def schedule_ir(ctx: Context, *, layers_per_slot: int = 1, heads: int | None = None,
                hold: bool | None = None) -> tuple[ScheduleIR, Costs]:
    """A pipeline of fine slots whose loss stage is dealt, micro-batch by micro-batch, to the GPUs.

    What paces a looped pipeline (RoundPipe's, Mobius's) is its slowest slot: every micro-batch
    passes every slot one after another, so a slot that takes longer per micro-batch than the
    others stretches every slot after it, and the first and last slots' per-micro-batch times
    are the fill and drain bubbles. The loss stage (final norm, LM head and loss; as costly per
    micro-batch as two or three transformer layers' forward and backward, and as heavy in weights)
    is the slowest. Here:

    - the plan's layers are re-cut into slots of `layers_per_slot` layers (`layer_units`; one
      by default), forward and backward alike, so fill and drain cost a layer's time per
      micro-batch, not a stage's;
    - forward slot j runs on GPU j mod N (GPUs by index); every micro-batch, in order;
    - the loss stage is `heads` slots (default N), one per GPU continuing the rotation, slot a
      running micro-batches a, a + heads, ... ("fused", as RoundPipe's last slot: its forward
      doubles as the backward's recompute and computes the loss on the GPU, so no logits leave
      it): each uploads the head's weights once and downloads its own partial weight
      gradient (the host adds the partials as it takes them over: those adds are host work
      this model does not charge, its downloads are charged);
    - backward slots continue the rotation, every micro-batch in order.

    A plan whose last stage outputs more than LOSS_BYTES per micro-batch (a model output, not a
    training step's loss) is modelled with that output sent to the host and its gradient back:
    each GPU's part of the loss stage then runs its forwards, then its backwards.

    `hold` (default: when every GPU has room, `_hold_fits`): each layer's backward runs on the
    GPU that ran its forward, which keeps its weights and its saved inputs in between (weights
    uploaded once a step, all as early as the upload stream allows; nothing offloaded); else
    backward slots continue the rotation and every slot uploads its weights.

    Every other slot is as in `LoopedIR.pipeline`: weights uploaded while the slot before it on
    the GPU runs (two resident at most), saved boundary inputs to host memory and back,
    activations between GPUs through the host where there is no peer-to-peer, gradients to
    host memory after each slot. The host optimizer steps per stage as `simulate`'s
    `optimizer_overlap` says. Raises PlanError when a slot does not fit its GPU
    (`memory_need`).
    """
    u = layer_units(ctx)
    m = ctx.plan.microbatches
    _, groups = slots(len(u.f), ctx.gpus, m, layers_per_slot=layers_per_slot, heads=heads)
    c = grouped(u, groups)
    fused = c.out[-1] <= LOSS_BYTES  # the loss on the GPUs; else the model output goes to the host
    if hold is None:
        hold = _hold_fits(ctx, u, c, groups, m)
    order, _ = slots(len(u.f), ctx.gpus, m, layers_per_slot=layers_per_slot, heads=heads, hold=hold, fused=fused)
    if hold and not _hold_fits(ctx, u, c, groups, m):
        raise PlanError("split-head with hold=True: a GPU cannot hold all its slots' weights from forward to "
                        "backward; leave hold out (it streams them twice then)")
    if not hold:
        _check_memory(ctx, u, c, groups, order, m)
    ir = LoopedIR()
    ir.pipeline(c, order, m, loss_on_host=not fused, hold=hold, offload_activations=not hold)
    ir.host_steps(c)
    return ir.build(m), c


def slots(units: int, gpus: tuple[str, ...], m: int, *, layers_per_slot: int = 1, heads: int | None = None,
          hold: bool = False, fused: bool = True) -> tuple[list[Slot], list[tuple[int, int]]]:
    """The slots of `units` layer units on `gpus` with `m` micro-batches (see `schedule_ir`), and
    the unit range of each group (a stage of the returned costs): groups of `layers_per_slot`
    units, the last unit alone (the loss stage), dealt to `heads` GPUs (`fused`: one slot each,
    else a forward and a backward slot each)."""
    n = len(gpus)
    heads = max(1, min(n if heads is None else heads, n, m))  # no GPU without micro-batches
    size = max(1, layers_per_slot)
    body = units - 1
    groups = [(a, min(a + size, body)) for a in range(0, body, size)] + [(body, units)]
    last = len(groups) - 1
    out = [Slot("forward", k, gpus[k % n]) for k in range(last)]
    turn = last
    dealt = [(gpus[(turn + a) % n], tuple(range(a, m, heads))) for a in range(heads)]
    if fused:
        out += [Slot("fused", last, g, mbs) for g, mbs in dealt]
    else:  # the output goes to the host (its loss there) and its gradient comes back: forward, then backward
        out += [Slot("forward", last, g, mbs) for g, mbs in dealt]
        out += [Slot("backward", last, g, mbs) for g, mbs in dealt]
    turn += heads
    if hold:  # each stage's backward on the GPU that ran its forward (and kept its weights)
        out += [Slot("backward", k, gpus[k % n]) for k in reversed(range(last))]
    else:
        out += [Slot("backward", k, gpus[(turn + q) % n]) for q, k in enumerate(reversed(range(last)))]
    return out, groups


def memory_need(ctx: Context, u: Costs, c: Costs, groups: list[tuple[int, int]], k: int, nxt: int | None,
                microbatches: int) -> float:
    """Bytes group k's slot needs on its GPU at most: its weights and gradients, the next slot's
    weights (prefetched while it runs; `nxt`), the recompute and working memory of its layers
    (the plan's memory model, as the partitioner uses), and every micro-batch's input and output
    of this slot buffered at once (`microbatches` of them: an upper bound; a slot sends each
    output on and offloads each input as soon as it can)."""
    mm = ctx.plan.memory
    by_name = {l.name: l for l in ctx.plan.layers}
    a, z = groups[k]
    names = u.names[a:z]
    if all(n in by_name for n in names):
        recompute = sum(mm.recompute_bytes(by_name[n]) for n in names)
        work = max((mm.working(by_name[n]) for n in names), default=0.0)
    else:  # units are the plan's stages: the stage's own peak stands for its activations
        recompute = sum(ctx.plan.stages[i].peak_bytes for i in range(a, z))
        work = 0.0
    act = microbatches * (c.inp[k] + c.out[k])
    extra = c.w[nxt] if nxt is not None else 0.0
    return mm.footprint(c.w[k] + extra, c.g[k], recompute, act, work)[1]


def _hold_fits(ctx: Context, u: Costs, c: Costs, groups: list[tuple[int, int]], m: int) -> bool:
    """Whether every GPU holds all its forward slots' weights and saved inputs until their
    backward: their weights, one slot's gradients, every micro-batch's input and output of each,
    the loss stage's part (its weights and gradients) and the largest recompute and working
    memory of its layers, by the plan's memory model."""
    n, head = len(ctx.gpus), len(groups) - 1
    caps = {s.gpu: s.capacity for s in ctx.plan.stages}
    by_name = {g.name: g for g in ctx.topo.gpus}
    mm = ctx.plan.memory
    for g, gpu in enumerate(ctx.gpus):
        mine = [k for k in range(head) if k % n == g]
        w = sum(c.w[k] for k in mine) + c.w[head]
        grads = max([c.g[k] for k in mine] + [c.g[head]])
        act = sum(m * (c.inp[k] + c.out[k]) for k in mine)
        peak = max(memory_need(ctx, u, c, groups, k, None, 0) - mm.footprint(c.w[k], c.g[k], 0.0, 0.0, 0.0)[1]
                   for k in [*mine, head])
        need = mm.footprint(w, grads, 0.0, act, 0.0)[1] + peak
        if need > caps.get(gpu, by_name[gpu].memory):
            return False
    return True


def _check_memory(ctx: Context, u: Costs, c: Costs, groups: list[tuple[int, int]], order: list[Slot],
                  m: int) -> None:
    """PlanError naming the slot, its GPU and its bytes when one does not fit (`memory_need`,
    with the next slot on the same GPU as its prefetch)."""
    caps = {s.gpu: s.capacity for s in ctx.plan.stages}
    by_name = {g.name: g for g in ctx.topo.gpus}
    for j, s in enumerate(order):
        nxt = next((t.stage for t in order[j + 1:] if t.gpu == s.gpu), None)
        per = m if s.microbatches is None else len(s.microbatches)
        need = memory_need(ctx, u, c, groups, s.stage, nxt, per)
        cap = caps.get(s.gpu, by_name[s.gpu].memory)
        if need > cap:
            raise PlanError(f"split-head slot {j} ({s.phase} of {c.names[s.stage]}) needs {fmt_bytes(need)} on "
                            f"{s.gpu} (its weights {fmt_bytes(c.w[s.stage])} and gradients, the next slot's "
                            f"prefetch, {per} micro-batches' inputs and outputs, recompute and working memory) but "
                            f"the GPU has {fmt_bytes(cap)}; use more GPUs, or the 'mobius' schedule (its stages are "
                            f"sized for the GPUs)")


register("split-head", build, data_parallel=True,
         summary="one-layer round-robin slots, the loss stage dealt by micro-batch to every GPU",
         runtime=split_head, runs_as_simulated=False)
