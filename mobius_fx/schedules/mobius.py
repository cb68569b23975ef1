""""mobius": the plan as the runtime runs it (docs/schedule.md).

Its schedule IR (`plan.schedule()`), one task per op, the CPU optimizer after the last gradient.
Moves exactly `plan.transfers` (checked), so `plan.lower_bound()` bounds it.
"""

from __future__ import annotations

from mobius_fx.planning.ir_transforms import unchanged
from mobius_fx.sim.tasks import Context
from mobius_fx.schedules.ir_tasks import check_transfers, tasks_from_ir
from mobius_fx.schedules.registry import register

__all__ = ["build"]


def build(ctx: Context) -> None:
    """The plan's schedule IR as tasks; checked to move exactly `plan.transfers`."""
    tasks_from_ir(ctx, ctx.plan.schedule())
    check_transfers(ctx)


register("mobius", build, data_parallel=True, summary="the plan as the runtime runs it (cross-mapped, prefetching)",
         runtime=unchanged)
