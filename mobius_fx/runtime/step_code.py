"""`pipe.step_pipeline.code`: the training step as the program that runs, the schedule IR's ops
in issue order, one line per op, each executed by its handler in mobius_fx/runtime/executor.py.

    print(pipe.step_pipeline.code)
    # the training step, schedule 'mobius': 4 stages on gpu0, gpu1; 2 micro-batches ...
    # ---- forward
    prefetch(0)                      # gpu0: weight host->gpu0 1056B
    wait(0)                          # gpu0
    send(0, mb=0, value=0)           # gpu0: activation host->gpu0
    run_forward(0, mb=0)             # gpu0
"""

from __future__ import annotations

from typing import Any

from mobius_fx.planning.schedule_ir import Op

__all__ = ["step_code"]


def step_code(pipe: Any) -> str:
    """The step `pipe` (a step pipeline) runs, as text: its executor's IR (`executor.step_ir`)."""
    from mobius_fx.runtime.executor import step_ir

    name, form = pipe.__dict__.get("schedule_form") or ("mobius", None)
    ir = step_ir(pipe, form)
    m, s = ir.microbatches, len(ir.stages)
    lines = [f"# the training step, schedule {name!r}: {s} stage{'s' if s != 1 else ''} on {', '.join(ir.gpus)}; "
             f"{m} micro-batch{'es' if m != 1 else ''}; the loss on the last stage",
             "# the schedule IR's ops in issue order (activation bytes are a call's: pipe.schedule_ir(values));",
             "# run_backward recomputes the stage from its restored inputs under the saved RNG state, then autograd",
             "# inside the stage; download hands the stage's gradients to the host (and to pipe.overlap's step)"]
    phase = None
    for o in ir.ops:
        if o.phase != phase:
            lines.append(f"# ---- {o.phase}")
            phase = o.phase
        lines.append(f"{_call(o):32s} # {_where(o)}")
    return "\n".join(lines) + "\n"


def _call(o: Op) -> str:
    kind = str(o.kind)
    if kind == "run":
        kind = "run_forward" if o.phase == "forward" else "run_backward"
    args = [str(o.stage)]
    if o.microbatch is not None:
        args.append(f"mb={o.microbatch}")
    if o.value is not None:
        args.append(f"value={o.value}")
    return f"{kind}({', '.join(args)})"


def _where(o: Op) -> str:
    move = f": {o.what} {o.src}->{o.dst}" + (f" {o.bytes}B" if o.bytes else "") if o.src else ""
    deps = f" (after {', '.join(map(str, o.deps))})" if o.deps else ""
    return f"op {o.index} @{o.place}{move}{deps}"
