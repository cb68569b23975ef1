"""GPipe's runtime form: the pipeline's Mobius IR with every stage's weights resident on its GPU
for the whole step (mobius_fx/schedules/gpipe.py registers it as "gpipe"'s `runtime=`).

    ir2 = resident(ir)            # each stage uploaded once, held after its forward, evicted after its backward
    check_resident_fits(plan)     # PlanError naming the stage, its GPU and the bytes when a GPU cannot hold them

In the Mobius IR (planning/schedule_ir.py `build_schedule`) only the last forward stage on a GPU
stays for its backward: a `hold` instead of its `evict`, no backward `prefetch`, its backward
`wait` on its forward upload. `resident` does that for every stage that runs its backward where
it ran its forward: all forwards, then all backwards, in the Mobius IR's order, and the same
activation, saved-input and gradient copies; the weights move once per step (no evict after
the forward, no upload for the backward), so a GPU holds all its stages at once.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from mobius_fx.errors import MobiusError, PlanError
from mobius_fx.planning.ir_transforms import rebuilt, with_fields
from mobius_fx.planning.schedule_ir import OpKind, ScheduleIR
from mobius_fx.units import fmt_bytes

__all__ = ["resident", "resident_need", "check_resident_fits"]


def resident(ir: ScheduleIR) -> ScheduleIR:
    """`ir` with every stage that runs backward on its forward GPU held there from its forward
    upload to its backward evict: its forward `evict` becomes a `hold`, its backward `prefetch`
    is dropped and its backward `wait` waits for the forward upload; an upload no longer waits
    for a held stage to leave (it never leaves in forward). Stages without a backward (frozen)
    or with it on another GPU keep their ops. Same activation and gradient copies."""
    ops = ir.ops
    runs = {(o.stage, o.phase): o.place for o in ops if o.kind == OpKind.RUN}
    held = {k for (k, phase), g in runs.items() if phase == "backward" and runs.get((k, "forward")) == g}
    upload = {o.stage: o.index for o in ops if o.kind == OpKind.PREFETCH and o.phase == "forward"}
    missing = sorted(held - set(upload))
    if missing:
        raise MobiusError(f"resident: stage {missing[0]} runs forward without a forward prefetch in this IR; give "
                          f"the pipeline's Mobius IR (Pipeline.schedule_ir or build_schedule)")
    dropped = {o.index for o in ops if o.kind == OpKind.PREFETCH and o.phase == "backward" and o.stage in held}
    holds = {o.index for o in ops if o.kind == OpKind.EVICT and o.phase == "forward" and o.stage in held}
    kept = [o for o in ops if o.index not in dropped]
    new = {o.index: n for n, o in enumerate(kept)}
    out = []
    for o in kept:
        deps: set[int] = set()
        for d in o.deps:
            if d in dropped:  # only a backward wait waits for a backward upload: now for the forward one
                deps.add(new[upload[ops[d].stage]])
            elif not (d in holds and o.kind == OpKind.PREFETCH):
                deps.add(new[d])
        out.append(with_fields(o, index=new[o.index], kind=OpKind.HOLD if o.index in holds else o.kind,
                               deps=tuple(sorted(deps)), starts=tuple(sorted(new[s] for s in o.starts if s in new))))
    return rebuilt(ir, out, "resident")


def resident_need(plan: Any) -> list[tuple[int, str, float, float]]:
    """Per stage of `plan` (`plans.Plan`): (stage, its GPU, the bytes that GPU holds while the
    stage works under `resident`, the GPU's capacity). While stage k works, its GPU holds
    k's own footprint (`Stage.peak_bytes`: weights, gradients, recompute, boundary activations,
    working memory, the larger phase) and the weights of the stages before it there (held
    since their forward) and, in forward, of the next one (prefetched as k starts); the stages
    after it have left in backward."""
    out = []
    on: dict[str, list[Any]] = defaultdict(list)
    for s in plan.stages:
        on[s.gpu].append(s)
    for s in plan.stages:
        mine = on[s.gpu]
        at = mine.index(s)
        others = sum(t.param_bytes for t in mine[:at]) + (mine[at + 1].param_bytes if at + 1 < len(mine) else 0)
        out.append((s.index, s.gpu, float(s.peak_bytes + others), float(s.capacity)))
    return out


def check_resident_fits(plan: Any) -> None:
    """A PlanError naming the first stage whose GPU cannot hold it under `resident` (`resident_need`)."""
    for k, gpu, need, cap in resident_need(plan):
        if need > cap:
            s = plan.stages[k]
            mine = [t for t in plan.stages if t.gpu == gpu]
            raise PlanError(
                f"gpipe stage {k} ({s.layers[0] if s.layers else 'no layers'} .. {s.layers[-1] if s.layers else ''}) "
                f"on {gpu} needs {fmt_bytes(need)} (its own {fmt_bytes(s.peak_bytes)} + the resident weights of "
                f"the other stages there {fmt_bytes(need - s.peak_bytes)}) but {gpu} has {fmt_bytes(cap)}; GPipe keeps "
                f"the weights of all {len(mine)} stages on {gpu} for the whole step ({fmt_bytes(sum(t.param_bytes for t in mine))}): "
                f"use the 'mobius' schedule, which streams them, or more or larger GPUs")
