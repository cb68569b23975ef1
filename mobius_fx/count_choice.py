"""`plan`'s choice of the micro-batch count when the caller gives none (api.plan): the counts
to time (`count_candidates`), each one's plan on the default count's facts (`count_planner`:
the same trace, layer costs and cuts; the partition and plan passes run again, no MIP), and the
chosen count's plan with its own cuts (`count_replanner`: the same trace and layer costs, the
MIP run again at that count from the default's cuts, time-limited). The ranking is `schedules.choice.choose_count`'s;
the counts' rule `planning.microbatch.candidate_counts`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from mobius_fx.compiler import FunctionPass, PassPipeline
from mobius_fx.options import CompileContext

__all__ = ["chosen_count", "count_candidates", "count_planner", "count_replanner"]


def chosen_count(passes: PassPipeline, ctx: CompileContext, rows: int | None, schedule: str | None) -> tuple[Any, Any]:
    """`plan`'s count when the caller gives none, and the Choice whose line says why and whose
    cuts (`schedules.choice.choose_count` over `count_candidates`, planned by `count_planner`,
    the fastest replanned by `count_replanner`)."""
    from mobius_fx.schedules.choice import choose_count

    from mobius_fx.pass_adapters import overlap_of

    counts, alone = count_candidates(passes, ctx, rows)
    return choose_count(count_planner(passes, ctx), counts, schedule, alone=alone,
                        replan=count_replanner(passes, ctx), kept_why="the caller's (cuts=)",
                        **overlap_of(ctx.settings))  # timed as the plan's optimizer overlap steps it


def count_candidates(passes: PassPipeline, ctx: CompileContext, rows: int | None) -> tuple[tuple[int, ...], str]:
    """The micro-batch counts `plan` times when the caller gives none (`candidate_counts`: the
    default, then divisors of the batch near 2x, 4x, 8x it), and why there is no other when the
    default is alone. Only the default when the partition pass is not the standard one (the
    user's own cannot be asked to keep its cuts)."""
    from mobius_fx.passes.partition import partition_pass
    from mobius_fx.planning.microbatch import candidate_counts

    m = ctx.settings.microbatches
    part = next((q for q in passes.passes if q.name == "partition"), None)
    if getattr(part, "fn", None) is not partition_pass:
        return (m,), "the pipeline's own partition pass: no other count timed"
    counts = candidate_counts(rows, m)
    if len(counts) > 1:
        return counts, ""
    if m <= 1:
        return counts, "no other count timed: one GPU or no batch to split"
    return counts, f"one row each: a batch of {rows} rows splits into no more"


def count_planner(passes: PassPipeline, ctx: CompileContext) -> Callable[[int], Any]:
    """plan_at(m): the default count's plan (`ctx.plan`), or the same trace and layer costs
    planned again at m micro-batches on the default's cuts and GPU order (no trace, no MIP)."""
    from mobius_fx.passes.partition import kept_partition_pass

    default = ctx.settings.microbatches
    again = _planned_again(passes, ctx, kept_partition_pass(ctx.partition, ctx.order, default))
    return lambda m: ctx.plan if m == default else again(m)


def count_replanner(passes: PassPipeline, ctx: CompileContext) -> Callable[[int], Any] | None:
    """replan_at(m): the same trace and layer costs planned at m micro-batches with their own
    cuts (the pipeline's partition pass: the MIP, under the settings' `time_limit` again,
    solved anew for m from the default's cuts, `hinted_partition_pass`; cached by the solver
    under its own key, which holds m, the limit and those cuts), or None when the cuts are
    not the MIP's to make: the caller's `cuts=`, or a partition pass other than the standard one
    (`count_candidates` times no other count then)."""
    from mobius_fx.passes.partition import hinted_partition_pass, partition_pass

    part = next((q for q in passes.passes if q.name == "partition"), None)
    if ctx.settings.cuts is not None or getattr(part, "fn", None) is not partition_pass:
        return None
    return _planned_again(passes, ctx, hinted_partition_pass(ctx.partition))


def _planned_again(passes: PassPipeline, ctx: CompileContext,
                   partition: Callable[[Any, Any], None]) -> Callable[[int], Any]:
    """at(m): `ctx`'s trace and layer costs planned at m micro-batches, by `passes` from the
    partition pass on, with `partition` in its place."""
    part = next(q for q in passes.passes if q.name == "partition")
    rest = PassPipeline([FunctionPass("partition", partition, reads=part.reads, writes=part.writes),
                         *passes.passes[passes.names.index("partition") + 1:]], given=tuple(ctx.facts))

    def at(m: int) -> Any:
        settings = dataclasses.replace(ctx.settings, microbatches=m, microbatches_rule="chosen by the planner")
        other = dataclasses.replace(ctx, settings=settings, partition=None, order=(), plan=None,
                                    facts=set(ctx.facts), timings={}, touched={})
        return rest.run(other).plan

    return at
