""""mobius-identity-map": Mobius with the identity mapping.

Stage k on the k % N-th GPU by CUDA index (no cross mapping), as in the paper's cross-mapping
ablation; the plan's IR with its stages moved, transfers re-routed accordingly.
"""

from __future__ import annotations

from mobius_fx.planning.ir_transforms import unchanged
from mobius_fx.sim.tasks import Context
from mobius_fx.schedules.ir_tasks import tasks_from_ir
from mobius_fx.schedules.registry import register

__all__ = ["build"]


def build(ctx: Context) -> None:
    """The plan's schedule IR with stage k on ctx.gpus[k % N], as tasks."""
    tasks_from_ir(ctx, ctx.plan.schedule(ctx.gpus))


register("mobius-identity-map", build, data_parallel=True, summary="Mobius with stage k on GPU k % N",
         runtime=unchanged, cross_map="identity", baseline=True)
