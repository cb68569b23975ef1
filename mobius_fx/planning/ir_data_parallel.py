"""ZeRO-3 offload's runtime form: the pipeline's Mobius IR as N data-parallel replicas, one per GPU.

DeepSpeed ZeRO-3 with CPU offload (mobius_fx/schedules/zero3_offload.py) runs one replica of the
whole model on each GPU, each on its share of the batch: every stage's weights are gathered onto
every GPU in forward and again in backward, every GPU's weight gradients are reduced on the host,
and no activation crosses GPUs. `data_parallel` rewrites a pipeline's schedule IR into that step,
in ops the step executor (mobius_fx/runtime/executor.py) already runs:

- micro-batches dealt round-robin: GPU g (the g-th of the IR's GPUs) runs micro-batches g, g+N,
  g+2N, ... (a GPU left without one runs nothing);
- per GPU, every stage in turn, as `build_schedule` lays out a pipeline whose stages all run on
  that GPU: the all-gather is the stage's upload (`prefetch`, the next stage prefetched while one
  runs), its saved inputs offloaded to the host and restored for backward (`offload`/`restore`),
  model inputs and values read two or more stages later from the host, the loss's host copy and
  its gradient as in Mobius; no `send` between GPUs;
- the reduce-scatter is each GPU's gradient `download` of each stage (N per stage), summed on the
  host (the runtime sums every download of a master: `host_gradients.host_gradient`); the host
  `step` of a stage waits for all N.

Deviations from DeepSpeed, from when the runtime held one GPU copy of a stage at a time (the
executor now keeps a copy per GPU, `StageState.copy_on`, so lockstep would run too; kept as
tested): GPU g+1 uploads stage k after GPU g has evicted it (each such `prefetch` depends on
the stage's previous `evict`), so the replicas run one stage apart, as a wavefront, not in
lockstep; and no GPU keeps its last stage across the forward/backward turn (each uploads it again
for backward: one more upload of the last stage per GPU than the simulator's ZeRO-3).

    dp = data_parallel(pipe.schedule_ir())          # replicas on the IR's GPUs
    dp.select(kind="download", stage=0)             # one per GPU
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

from mobius_fx.errors import MobiusError
from mobius_fx.kinds import HOST
from mobius_fx.planning.ir_transforms import rebuilt, with_fields
from mobius_fx.planning.schedule_ir import Op, OpKind, ScheduleIR, build_schedule

__all__ = ["data_parallel", "dealt"]

_PHASE_RANK = {"forward": 0, "backward": 1, "optimizer": 2}


def dealt(microbatches: int, gpus: int) -> list[list[int]]:
    """The micro-batches each of `gpus` GPUs runs, dealt round-robin: GPU g gets g, g+N, ..."""
    return [list(range(g, microbatches, gpus)) for g in range(gpus)]


def data_parallel(ir: ScheduleIR, gpus: Sequence[str] | None = None) -> ScheduleIR:
    """`ir`'s stages run as one data-parallel replica per GPU (see the module docstring).

    `gpus`: the replicas' GPUs (default: those `ir`'s stages run on, in order of first use)."""
    stages = ir.stages
    if not stages:
        raise MobiusError("data_parallel needs a pipeline's schedule IR (its stages as StageIO); got one without "
                          "stages (a simulator baseline's): build it with Pipeline.schedule_ir or build_schedule")
    names = list(gpus) if gpus is not None else list(dict.fromkeys(st.gpu for st in stages))
    if not names or len(set(names)) != len(names):
        raise MobiusError(f"data_parallel runs one replica per GPU: give distinct GPU names, got {names}")
    m = ir.microbatches
    optimizer = any(o.kind == OpKind.STEP for o in ir.ops)
    keyed: list[tuple[tuple, Op]] = []  # (order key, op with replica-local indices)
    offset: dict[str, int] = {}  # GPU -> the index of its replica's first op in `keyed`
    template: ScheduleIR | None = None
    for g, (gpu, mbs) in enumerate(zip(names, dealt(m, len(names)))):
        if not mbs:
            continue
        # each replica downloads every stage's gradients, partials the host sums (a tied weight's
        # too: no `tied_sums`), as streamed where there are several (`StageIO.partial_grad_bytes`)
        several = sum(1 for x in dealt(m, len(names)) if x) > 1
        rep = build_schedule([dataclasses.replace(st, gpu=gpu, tied_sums=(), grad_bytes=st.partial_bytes() if several
                                                  else st.grad_bytes, partial_grad_bytes=None) for st in stages],
                             len(mbs), optimizer=False,
                             hold=False)
        template = template or rep
        offset[gpu] = len(keyed)
        waits: dict[str, int] = defaultdict(int)
        for o in rep.ops:
            if o.kind == OpKind.WAIT:
                waits[o.phase] += 1
            turn = max(waits[o.phase] - 1, 0)  # the stage turn on this GPU the op belongs to
            # replica g runs its turn t in round t + g: one stage behind replica g - 1
            key = (_PHASE_RANK[o.phase], turn + g, g, o.index)
            keyed.append((key, with_fields(o, microbatch=None if o.microbatch is None else mbs[o.microbatch],
                                           index=offset[gpu] + o.index,
                                           deps=tuple(offset[gpu] + d for d in o.deps))))
    if template is None:  # build_schedule refuses m < 1, so GPU 0 always has micro-batch 0
        raise MobiusError(f"internal: data_parallel dealt none of {m} micro-batches to {names}")
    keyed.sort(key=lambda e: e[0])
    new = {o.index: n for n, (_, o) in enumerate(keyed)}
    ops: list[Op] = []
    last_evict: dict[int, int] = {}  # stage -> its latest evict, on whichever GPU
    downloads: dict[int, list[int]] = defaultdict(list)
    for n, (_, o) in enumerate(keyed):
        deps = {new[d] for d in o.deps}
        if o.kind == OpKind.PREFETCH and o.stage in last_evict:
            deps.add(last_evict[o.stage])  # the wavefront: after the GPU before let it go
        op = with_fields(o, index=n, deps=tuple(sorted(deps)))
        ops.append(op)
        if op.kind == OpKind.EVICT:
            last_evict[op.stage] = n
        elif op.kind == OpKind.DOWNLOAD:
            downloads[op.stage].append(n)
    if optimizer:  # the host steps a stage once every GPU's gradients of it arrived (the reduce)
        for k in sorted(downloads):
            ops.append(Op(len(ops), OpKind.STEP, HOST, k, "optimizer", deps=tuple(downloads[k])))
    return rebuilt(ir, ops, "data_parallel", stages=stages, microbatches=m,
                   gpus=tuple(g for g in names if g in offset), next_on_gpu=template.next_on_gpu,
                   prev_on_gpu=template.prev_on_gpu)
