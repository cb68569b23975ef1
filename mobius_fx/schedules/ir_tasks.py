"""The one task builder from the schedule IR (mobius_fx/planning/schedule_ir.py): one simulator task per op.

Every schedule produces the IR and hands it here: the Mobius variants the plan's
(`plan.schedule()`; with stage k moved to gpus[k % N]: `plan.schedule(gpus)`), the baselines
theirs (`looped_ir.LoopedIR`: GPipe, ZeRO-3 offload, RoundPipe).

    tasks_from_ir(ctx, ctx.plan.schedule())   # the plan as the runtime runs it
    check_transfers(ctx)                    # ... moving exactly plan.transfers
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from mobius_fx.errors import MobiusError
from mobius_fx.planning.plans import TRANSFER_KIND
from mobius_fx.planning.schedule_ir import Op, ScheduleIR
from mobius_fx.kinds import HOST
from mobius_fx.sim.tasks import Context, Costs, cpu_optimizer, gpu_optimizer

__all__ = ["tasks_from_ir", "copy_need", "check_transfers"]


def tasks_from_ir(ctx: Context, ir: ScheduleIR, *, costs: Costs | None = None, prefetch: bool = True) -> None:
    """One task per op of a schedule IR (mobius_fx/planning/schedule_ir.py), stage k's times and
    master bytes from `costs` (default: the plan's stages, `ctx.stages`). A `run` computes f or b
    on its GPU; a copy with bytes is a flow on the route src -> dst (`_copy_task`); `evict`/`wait`/
    `hold` are markers; a `step` on a GPU is its optimizer step after the whole pipeline (GPipe's),
    the host's `step`s the one CPU optimizer of `ir.host_optimizer` at the end. Deps are the IR's
    (`starts`: on the start of those ops), through zero-byte copies and, with `ir.through_markers`,
    through markers: a `wait` stands for the stage's weights, but a prefetch it triggers starts
    with the stage's first run (with `prefetch=False`: after its last)."""
    ops, c = ir.ops, costs if costs is not None else ctx.stages
    slot = {(o.phase, o.stage): p for g in ir.gpus for p, o in enumerate(x for x in ir.place(g) if x.kind == "wait")}
    runs: dict[int, list[int]] = defaultdict(list)  # wait -> the runs that wait for it
    for o in ops:
        for d in o.deps if o.kind == "run" else ():
            if ops[d].kind == "wait":
                runs[d].append(o.index)
    task: dict[int, int] = {}
    through: dict[int, list[int]] = {}
    triggers: list[tuple[int, int]] = []
    pins: dict[int, list[int]] = {}  # pin task -> the waits whose first run triggers it (as its upload)
    flush: list[int] = []  # the barrier before the GPUs' optimizer steps
    # a stage downloaded from several GPUs (a dealt head, ZeRO-3's replicas): partials the host
    # sums, downloaded as streamed (the runtime widens only a stage's one download)
    downloads = Counter(o.stage for o in ops if o.kind == "download")

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
        elif o.kind in (*TRANSFER_KIND, "collective") and o.direction and o.bytes > 0:  # a copy (an evict has no direction)
            waits = [d for d in o.deps if o.kind == "prefetch" and ops[d].kind == "wait"]
            task[o.index], pin = _copy_task(ctx, ir, o, c, tag, after, [t for d in o.starts for t in ends(d)],
                                            slot[(o.phase, o.stage)] if o.slot is None else o.slot,
                                            widen=downloads[o.stage] == 1)
            if pin is not None:
                pins.setdefault(pin, waits)
            triggers += [(task[o.index], d) for d in waits]
        elif o.kind in ("evict", "wait", "hold"):
            mark = ctx.mark(f"{o.kind} {tag}", after, kind=o.kind, phase=o.phase, gpu=o.place, stage=o.stage)
            if not ir.through_markers:
                task[o.index] = mark
        elif o.kind == "step" and o.place != HOST:
            flush = flush or [ctx.mark("backward done", list(range(len(ctx.tasks))), kind="barrier")]
            task[o.index] = gpu_optimizer(ctx, o.place, c.master[o.stage], flush)
    for t, w in triggers + [(t, w) for t, ws in pins.items() for w in ws]:
        (ctx.tasks[t].after_start if prefetch else ctx.tasks[t].after).append(task[runs[w][0 if prefetch else -1]])
    _host_optimizer(ctx, ir, c)


def _copy_task(ctx: Context, ir: ScheduleIR, o: Op, c: Costs, tag: str, after: list[int], starts: list[int],
               slot: int, widen: bool = True) -> tuple[int | None, int | None]:
    """Copy `o` as a flow on the route src -> dst (and the pinning of its streamed copy, for a
    prefetch: `Context.pin_copy`), on the receiving GPU's upload stream (prefetch, restore, an
    input sent again), its activation stream (other sends to a GPU) or the sending GPU's
    download stream (offload, download, sends to the host); a collective's host-routed share on
    the GPU's "allgather" (weights) or "reduce-scatter" (gradients) stream. A stream serves its
    copies by `slot` (the op's turn on its GPU), then IR order; on a shared link a copy ranks by
    when the step needs it (`o.need`, else `copy_need`); its host end is the stage's home
    (`ctx.home`, per (GPU, stage) when `ir.sharded`; a collective's is its GPU's own socket).
    Returns the copy's task and the pin task (None: none)."""
    gpu = o.src if o.dst == HOST else o.dst
    pin = ctx.pin_copy(gpu, o.stage, c.master[o.stage], starts) if o.kind == "prefetch" else None
    if o.kind == "collective":
        stream = "allgather" if o.what == "weight" else "reduce-scatter"
    else:
        stream = ("download" if o.dst == HOST else "upload" if o.kind == "prefetch" or o.what == "input"
                  else "activation")
    home = None
    if HOST in (o.src, o.dst) and o.kind != "collective":
        home = ctx.home((gpu, o.stage) if ir.sharded else o.stage, gpu)
    kind = "collective" if o.kind == "collective" else TRANSFER_KIND[o.kind]
    nbytes = o.bytes
    if o.kind == "download" and o.what == "gradient" and ir.host_optimizer == "user" and widen:  # widened on the GPU (fp32)
        nbytes *= getattr(ctx, "down_scale", 1.0)
    t = ctx.move(f"{gpu}/{stream}", (slot, o.index), o.src, o.dst, nbytes, f"{o.kind} {tag}",
                 after=after + ([pin] if pin is not None else []), after_start=starts,
                 need=(copy_need(o, len(ir.stages)) if o.need is None else (o.need,)), home=home,
                 kind=kind, phase=o.phase, gpu=gpu, stage=o.stage, microbatch=o.microbatch, planned=int(o.bytes))
    return t, pin


def _host_optimizer(ctx: Context, ir: ScheduleIR, c: Costs) -> None:
    """The host's `step`s: the user's CPU optimizer per stage (`cpu_optimizer(per_stage=)`), or
    DeepSpeed's CPU Adam after the pipeline, writing the streamed copy as it steps."""
    steps = {o.stage: c.master[o.stage] for o in ir.ops if o.kind == "step" and o.place == HOST}
    if ir.host_optimizer == "user":
        cpu_optimizer(ctx, sum(steps.values()), per_stage=steps)
    elif ir.host_optimizer == "deepspeed":
        cpu_optimizer(ctx, sum(steps.values()), ctx.deepspeed_adam_bw, overlap="none", fused_refresh=True)
    elif ir.host_optimizer is not None:
        raise MobiusError(f"ScheduleIR.host_optimizer={ir.host_optimizer!r}; use 'user' (the user's CPU optimizer), "
                          f"'deepspeed' (DeepSpeedCPUAdam) or None (the GPUs step)")


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
            # the plan's bytes as streamed (`planned`: a widened gradient download moves down_scale x them)
            ours[(t.meta["kind"], t.meta["phase"], t.meta["stage"], t.meta["src"], t.meta["dst"],
                  t.meta.get("planned", t.meta["bytes"]))] += 1
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


