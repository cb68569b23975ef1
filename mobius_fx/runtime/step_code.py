"""`pipe.step_pipeline.code`: the training step as the program that runs, the Python code of the
step program `pipe.train_step` executes (runtime/step_program.py: a torch.fx GraphModule built
from the schedule IR, one node per op, each executed by its handler in runtime/executor.py).

    print(pipe.step_pipeline.code)
    # def forward(self, inputs, scale):
    #     # the training step, schedule 'mobius': 4 stages on gpu0, gpu1; 2 micro-batches; ...
    #     microbatches = split(inputs, names=('x', 'target'))
    #     # ---- forward
    #     op0 = prefetch(op=0, stage=0, at='gpu0', move='weight host->gpu0 1056B')
    #     op1 = wait(op0, op=1, stage=0, at='gpu0')
"""

from __future__ import annotations

from typing import Any

from mobius_fx.runtime.step_program import build_program

__all__ = ["step_code"]


def step_code(pipe: Any) -> str:
    """The step `pipe` (a step pipeline) runs, as code: the step program of its executor's IR
    (`executor.step_ir`), as `StepExecutor` builds it."""
    from mobius_fx.runtime.executor import step_ir

    name, form = pipe.__dict__.get("schedule_form") or ("mobius", None)
    return build_program(step_ir(pipe, form), tuple(pipe.schedule.inputs), name).code.strip("\n") + "\n"
