"""The one task builder from the schedule IR (mobius_fx/planning/schedule_ir.py): one simulator task per op.

A schedule that produces the IR (the Mobius variants) hands it to `tasks_from_ir`; the IR of a
plan is `plan.schedule()` (with stage k moved to gpus[k % N]: `plan.schedule(gpus)`).

    tasks_from_ir(ctx, ctx.plan.schedule())   # the plan as the runtime runs it
    check_transfers(ctx)                    # ... moving exactly plan.transfers
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from mobius_fx.errors import MobiusError
from mobius_fx.planning.plans import TRANSFER_KIND
from mobius_fx.planning.schedule_ir import ScheduleIR
from mobius_fx.kinds import HOST
from mobius_fx.sim.tasks import Context, cpu_optimizer

__all__ = ["tasks_from_ir", "copy_need", "check_transfers"]


def tasks_from_ir(ctx: Context, ir: ScheduleIR, *, prefetch: bool = True) -> None:
    """One task per op of a schedule IR (mobius_fx/planning/schedule_ir.py). A `run` computes f or b on its
    GPU; a copy with bytes is a flow on the route src -> dst, on the receiving GPU's upload stream
    (prefetch, restore, an input sent again), its activation stream (other sends to a GPU) or the
    sending GPU's download stream (offload, download, sends to the host), served by slot (a stage's
    forward or backward on that GPU), then IR order; `evict`/`wait`/`hold` are markers; the host
    `step`s are the one CPU optimizer task at the end. Deps are the IR's, through markers and
    zero-byte copies: a `wait` stands for the stage's weights, but a prefetch it triggers starts
    with the stage's first run (with `prefetch=False`: after its last). On a shared link a copy
    ranks by when the step needs it (`copy_need`); its host end is the stage's home (`ctx.home`)."""
    ops, c = ir.ops, ctx.stages
    slot = {(o.phase, o.stage): p for g in ir.gpus for p, o in enumerate(x for x in ir.place(g) if x.kind == "wait")}
    runs: dict[int, list[int]] = defaultdict(list)  # wait -> the runs that wait for it
    for o in ops:
        for d in o.deps if o.kind == "run" else ():
            if ops[d].kind == "wait":
                runs[d].append(o.index)
    task: dict[int, int] = {}
    through: dict[int, list[int]] = {}
    triggers: list[tuple[int, int]] = []
    staging: dict[int, list[int]] = {}  # staging task -> the waits whose first run triggers it (as its upload)

    def ends(d: int) -> list[int]:  # the tasks whose ends op d stands for
        if d not in task and d not in through:
            through[d] = [t for e in ops[d].deps for t in ends(e)]
        return [task[d]] if d in task else through[d]

    for o in ops:
        after = [t for d in o.deps if not (o.kind == "prefetch" and ops[d].kind == "wait") for t in ends(d)]
        tag = f"{o.phase[0]}{c.names[o.stage]}" + ("" if o.microbatch is None else f" mb{o.microbatch}")
        if o.kind == "run":
            task[o.index] = ctx.compute(o.place, c.f[o.stage] if o.phase == "forward" else c.b[o.stage], tag, after,
                                        phase=o.phase, stage=o.stage, microbatch=o.microbatch)
        elif o.kind in TRANSFER_KIND and o.direction and o.bytes > 0:  # a copy (an evict has no direction)
            gpu = o.src if o.dst == HOST else o.dst
            staged = ctx.stage_copy(gpu, o.stage, c.master[o.stage]) if o.kind == "prefetch" else None
            if staged is not None:
                after.append(staged)
                staging.setdefault(staged, [d for d in o.deps if ops[d].kind == "wait"])
            stream = ("download" if o.dst == HOST else "upload" if o.kind == "prefetch" or o.what == "input"
                      else "activation")
            task[o.index] = ctx.move(f"{gpu}/{stream}", (slot[(o.phase, o.stage)], o.index),
                                     o.src, o.dst, o.bytes, f"{o.kind} {tag}", after=after,
                                     need=copy_need(o, len(ir.stages)),
                                     home=ctx.home(o.stage, gpu) if HOST in (o.src, o.dst) else None,
                                     kind=TRANSFER_KIND[o.kind], phase=o.phase, gpu=gpu, stage=o.stage, microbatch=o.microbatch)
            triggers += [(task[o.index], d) for d in o.deps if o.kind == "prefetch" and ops[d].kind == "wait"]
        elif o.kind in ("evict", "wait", "hold"):
            ctx.mark(f"{o.kind} {tag}", after, kind=o.kind, phase=o.phase, gpu=o.place, stage=o.stage)
    for t, w in triggers + [(t, w) for t, ws in staging.items() for w in ws]:
        (ctx.tasks[t].after_start if prefetch else ctx.tasks[t].after).append(task[runs[w][0 if prefetch else -1]])
    steps = {o.stage: c.master[o.stage] for o in ops if o.kind == "step"}
    cpu_optimizer(ctx, sum(steps.values()), per_stage=steps)


def copy_need(o: Any, stages: int) -> tuple[int]:
    """When the step needs copy `o`, as the rank of the run that waits for it: stage k's forward
    is k, its backward 2S-1-k; a saved input is needed by its stage's backward, a value sent to
    the host two stages on (or at the turn), gradients (and input gradients sent to the host)
    by the optimizer, after everything (2S)."""
    back = 2 * stages - 1 - o.stage
    if o.kind == "download" or (o.phase == "backward" and o.dst == HOST):
        return (2 * stages,)
    if o.kind == "offload":
        return (back,)
    if o.dst == HOST:
        return (min(o.stage + 2, stages),)
    return (o.stage,) if o.phase == "forward" else (back,)


def check_transfers(ctx: Context) -> None:
    """The "mobius" schedules must move exactly plan.transfers (kind, phase, stage, ends, bytes, count)."""
    ours: Counter = Counter()
    for t in ctx.tasks:
        if t.meta.get("kind") in ("prefetch", "activation", "gradient"):
            ours[(t.meta["kind"], t.meta["phase"], t.meta["stage"], t.meta["src"], t.meta["dst"], t.meta["bytes"])] += 1
    theirs: Counter = Counter()
    for t in ctx.plan.transfers:
        if t.kind != "evict" and t.bytes > 0 and t.src != t.dst:
            theirs[(t.kind, t.phase, t.stage, t.src, t.dst, int(t.bytes))] += t.count
    if ours != theirs:
        extra = list((ours - theirs).items())[:3]
        lacking = list((theirs - ours).items())[:3]
        raise MobiusError(f"the simulated Mobius schedule and plan.transfers differ (docs/schedule.md): "
                          f"simulated but not in the plan {extra}, in the plan but not simulated {lacking}; "
                          f"rebuild the plan with plans.build_plan")


