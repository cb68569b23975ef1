"""Per-layer costs of a plan, for the baselines that re-cut it (GPipe) or run layer by layer
(ZeRO-3 offload)."""

from __future__ import annotations

from mobius_fx.sim.tasks import Context, Costs

__all__ = ["layer_units", "grouped"]


def layer_units(ctx: Context) -> Costs:
    """Per-layer costs (per micro-batch, streamed bytes) scaled so each stage's layers sum to
    the stage's own numbers; the stages themselves when the plan has no layer table."""
    plan = ctx.plan
    by_name = {l.name: l for l in plan.layers}
    if not plan.layers or any(n not in by_name for s in plan.stages for n in s.layers):
        return ctx.stages
    c = Costs([], [], [], [], [], [], [], [])
    m = plan.microbatches
    for s in plan.stages:
        ls = [by_name[n] for n in s.layers]

        def share(total: float, parts: list[float]) -> list[float]:
            tot = sum(parts)
            return [total * x / tot for x in parts] if tot > 0 else [total / len(parts)] * len(parts)

        c.f += share(s.fwd_time, [l.fwd_time for l in ls])
        c.b += share(s.bwd_time, [l.bwd_time for l in ls])
        c.w += share(s.param_bytes, [l.param_bytes for l in ls])
        gs = share(s.grad_bytes, [l.grad_bytes for l in ls])
        c.g += gs
        c.master += [g / ctx.scale for g in gs]
        outs = [l.output_bytes * ctx.scale / m for l in ls[:-1]] + [float(s.output_bytes)]
        c.inp += [float(s.input_bytes)] + outs[:-1]
        c.out += outs
        c.names += [l.name for l in ls]
    return c


def grouped(u: Costs, groups: list[tuple[int, int]], name=None) -> Costs:
    """The units' costs summed per group `(a, z)` (units a..z-1; inputs of its first unit,
    outputs of its last), each named `name(j, a, z)` (default: the units' names, "first..last")."""
    c = Costs([], [], [], [], [], [], [], [])
    for j, (a, z) in enumerate(groups):
        for lst, src in ((c.f, u.f), (c.b, u.b), (c.w, u.w), (c.g, u.g), (c.master, u.master)):
            lst.append(sum(src[a:z]))
        c.inp.append(u.inp[a])
        c.out.append(u.out[z - 1])
        c.names.append(name(j, a, z) if name is not None else
                       u.names[a] if z - a == 1 else f"{u.names[a]}..{u.names[z - 1]}")
    return c
