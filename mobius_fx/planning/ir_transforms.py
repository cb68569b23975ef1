"""Transforms of a schedule IR into another schedule's (mobius_fx/planning/schedule_ir.py): what
a schedule registered on the Mobius IR (mobius_fx/schedules/) changes, so that the simulator and
the runtime's executor (mobius_fx/runtime/executor.py) run the same ops.

    unchanged(ir) is ir
    ir2 = no_prefetch(ir)      # Mobius without prefetch: same copies, uploads after the stage before
    ir3 = round_robin(ir)      # RoundPipe: backward k on GPU (2S-2-k) mod N, the rotation continued
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from mobius_fx.errors import MobiusError
from mobius_fx.planning.schedule_ir import Op, OpKind, ScheduleIR

__all__ = ["unchanged", "no_prefetch", "round_robin", "with_fields", "rebuilt", "ScheduleForm"]

# The schedule a step pipeline's executor runs: its registered name and its runtime form (a
# transform of the pipeline's Mobius IR; None: that IR unchanged). `compile(schedule=)` makes it.
ScheduleForm = tuple[str, Callable[[ScheduleIR], ScheduleIR] | None]


def unchanged(ir: ScheduleIR) -> ScheduleIR:
    """The IR as it is (a schedule that runs the Mobius IR itself)."""
    return ir


def no_prefetch(ir: ScheduleIR) -> ScheduleIR:
    """`ir` with every upload a `wait` triggers (the next stage on the GPU, prefetched while the
    stage runs) moved after that stage's last op on its GPU in that phase (its evict, hold or last
    run) and made to depend on its last run: Mobius without prefetch. Same copies, same bytes."""
    ops = ir.ops
    moved: dict[int, int] = {}  # prefetch -> the op it now follows
    for o in ops:
        if o.kind != OpKind.PREFETCH:
            continue
        waits = [d for d in o.deps if ops[d].kind == OpKind.WAIT and ops[d].place == o.place]
        if not waits:
            continue
        s, phase = ops[waits[0]].stage, ops[waits[0]].phase
        mine = [p for p in ops if p.place == o.place and p.stage == s and p.phase == phase]
        anchor = next((p.index for p in reversed(mine) if p.kind in (OpKind.EVICT, OpKind.HOLD)), None)
        last_run = max(p.index for p in mine if p.kind == OpKind.RUN)
        moved[o.index] = anchor if anchor is not None else last_run
        ops = ops[:o.index] + (with_fields(o, deps=tuple(sorted({*o.deps, last_run}))),) + ops[o.index + 1:]
    order: list[int] = []
    after: dict[int, list[int]] = defaultdict(list)
    for p, a in moved.items():
        after[a].append(p)
    for o in ops:
        if o.index in moved:
            continue
        order.append(o.index)
        order += after.get(o.index, [])
    new = {old: n for n, old in enumerate(order)}
    out = tuple(with_fields(ops[old], index=new[old], deps=tuple(sorted(new[d] for d in ops[old].deps)),
                      starts=tuple(sorted(new[d] for d in ops[old].starts))) for old in order)
    return rebuilt(ir, out, "no_prefetch")


def rebuilt(ir: ScheduleIR, ops: Sequence[Op], who: str, **fields: Any) -> ScheduleIR:
    """The ScheduleIR of a transform of `ir`: `ops` (each depending on earlier ones only, else an
    internal error naming the transform `who`), their places indexed, the rest of `ir`'s fields
    unless `fields` gives them."""
    for o in ops:
        if any(d >= o.index for d in o.deps):
            raise MobiusError(f"internal: {who} put op {o} before one it depends on")
    by_place: dict[str, list[int]] = defaultdict(list)
    for o in ops:
        by_place[o.place].append(o.index)
    kw = dict(stages=ir.stages, microbatches=ir.microbatches, gpus=ir.gpus, next_on_gpu=ir.next_on_gpu,
              prev_on_gpu=ir.prev_on_gpu, sharded=ir.sharded, host_optimizer=ir.host_optimizer,
              through_markers=ir.through_markers)
    kw.update(fields)
    return ScheduleIR(ops=tuple(ops), by_place={p: tuple(v) for p, v in by_place.items()}, **kw)


def with_fields(o: Op, **kw: Any) -> Op:
    """`o` with the fields `kw` replaced."""
    fields = dict(index=o.index, kind=o.kind, place=o.place, stage=o.stage, phase=o.phase, microbatch=o.microbatch,
                  src=o.src, dst=o.dst, what=o.what, bytes=o.bytes, deps=o.deps, value=o.value, slot=o.slot,
                  need=o.need, starts=o.starts)
    fields.update(kw)
    return Op(**fields)


def round_robin(ir: ScheduleIR, gpus: Sequence[str] | None = None) -> ScheduleIR:
    """RoundPipe's rotation (mobius_fx/schedules/roundpipe.py) on the pipeline's Mobius IR: the
    same stages, forward stage k on the k-th GPU of the rotation (the Mobius IR's own forward
    order; a cross-mapped pipeline's GPUs are the rotation's order), and the backward slots
    continuing the rotation: stage k's backward on GPU (2S - 2 - k) mod N. Rebuilt from `ir`'s
    stages (`build_schedule(backward_gpus=)`): a stage whose backward runs on another GPU is
    evicted after its forward and uploaded there for its backward, its saved inputs go to the
    host (as in Mobius) and come back to that GPU, the gradients of its outputs are sent there
    and its weight gradients downloaded from there.

    Deviation from the simulator's RoundPipe (`schedules.roundpipe.schedule_ir`): the last
    stage is not fused -- its forward runs as in Mobius (the loss on the host, the weights held
    on its GPU, which is also its backward GPU), and its backward recomputes from the restored
    input; the simulator's fused slot skips that recompute and keeps the input on the GPU.

    `gpus`: the rotation (default: the GPUs `ir`'s stages run on, in stage order). With fewer
    stages than GPUs the simulator rotates over all of them (`gpus=ctx.gpus`: backward slots on
    GPUs that run no forward); the runtime form, on the pipeline's IR, over those its stages use."""
    from mobius_fx.planning.schedule_ir import build_schedule

    stages = ir.stages
    if not stages:
        raise MobiusError("round_robin needs a pipeline's schedule IR (its stages as StageIO); got one without "
                          "stages (a simulator baseline's): build it with Pipeline.schedule_ir or build_schedule")
    rotation = list(gpus) if gpus is not None else list(dict.fromkeys(st.gpu for st in stages))
    n, s = len(rotation), len(stages)
    for k, st in enumerate(stages):
        if st.gpu != rotation[k % n]:
            raise MobiusError(f"round_robin: stage {k} runs on {st.gpu}, but RoundPipe's rotation over "
                              f"{', '.join(rotation)} puts it on {rotation[k % n]}: a round-robin plan has stage k on "
                              f"GPU k mod N; compile without a custom stage placement")
    backward = [rotation[(2 * s - 2 - k) % n] for k in range(s)]
    out = build_schedule(stages, ir.microbatches, optimizer=any(o.kind == OpKind.STEP for o in ir.ops),
                         backward_gpus=backward)
    return ScheduleIR(ops=out.ops, stages=out.stages, microbatches=out.microbatches, gpus=out.gpus,
                      next_on_gpu=out.next_on_gpu, prev_on_gpu=out.prev_on_gpu, by_place=out.by_place,
                      sharded=ir.sharded, host_optimizer=ir.host_optimizer, through_markers=ir.through_markers)
