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

__all__ = ["step_code"]


def step_code(pipe: Any) -> str:
    """The step `pipe` (a step pipeline) runs, as code: the code of the step program its executor
    runs (`executor.built_step`: the step IR and its program, built once and kept on the runtime;
    printing builds nothing more and runs nothing)."""
    from mobius_fx.runtime.executor import built_step

    return built_step(pipe)[1].code.strip("\n") + "\n"
