""""mobius-noprefetch": Mobius without prefetch.

A stage's upload starts only once its GPU has finished the previous stage (the GPU idles while
its weights arrive). Same IR and transfers as "mobius"; only when uploads may start differs.
"""

from __future__ import annotations

from mobius_fx.planning.ir_transforms import no_prefetch
from mobius_fx.sim.tasks import Context
from mobius_fx.schedules.ir_tasks import check_transfers, tasks_from_ir
from mobius_fx.schedules.registry import register

__all__ = ["build"]


def build(ctx: Context) -> None:
    """The plan's schedule IR as tasks, each upload after the last run before it on its GPU."""
    tasks_from_ir(ctx, ctx.plan.schedule(), prefetch=False)
    check_transfers(ctx)


register("mobius-noprefetch", build, data_parallel=True, summary="Mobius with uploads after the previous stage",
         runtime=no_prefetch, baseline=True)
