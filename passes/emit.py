"""emit: the pipeline's program, a GraphModule whose `.code` is the schedule a person reads.

The schedule graph from `insert_transfers` becomes a `GraphModule` with a code generator that
prints the runtime ops by their short names (`prefetch(2)`, not `mobius_fx_runtime_prefetch(2)`),
drops the `x = None` noise after ops that return nothing, and heads each stage with a comment:

    # ---- stage 1 on gpu1: linear_1 .. relu_1 (2 ops), weights 1.06 KiB
    wait(1)
    prefetch(3)
    stage1_0 = run_stage(1, 0, relu_0_gpu1);  relu_0_gpu1 = None
    ...
    evict(1)

Backward is driven by autograd (each stage call is an autograd Function); `backward_summary`
writes the order it follows as comments, appended to `Pipeline.code`.

    program = emit(schedule)
    print(program.code)
"""

from __future__ import annotations

import re
from typing import Any

import torch.fx as fx
from torch import nn
from torch.fx.graph import CodeGen

from mobius_fx.planning.stage_contract import OPS, Schedule
from mobius_fx.units import fmt_bytes

__all__ = ["emit", "backward_summary"]

_QUIET = re.compile(r"^(\s*)(\w+) = ((?:prefetch|wait|evict|hold_for_backward)\(.*\));  \2 = None$")
_WAIT = re.compile(r"^\s*wait\((\d+)\)$")


class _ScheduleCodeGen(CodeGen):
    """CodeGen that prints runtime ops by name and annotates stages (see module docstring)."""

    def __init__(self, summary: str, headers: dict[int, str]) -> None:
        super().__init__()
        self._summary = summary
        self._headers = headers
        self._body_transformer = self._tidy

    def _gen_python_code(self, nodes: Any, root_module: str, namespace: Any, *args: Any, **kwargs: Any):
        for name, fn in OPS.items():  # claim the short names before any node takes them
            namespace.create_name(name, fn)
        return super()._gen_python_code(nodes, root_module, namespace, *args, **kwargs)

    def _tidy(self, body: list[str]) -> list[str]:
        out = [f"# {self._summary}"]
        for line in "".join(body).split("\n"):
            m = _QUIET.match(line)
            if m:
                line = m.group(1) + m.group(3)
            w = _WAIT.match(line)
            if w and int(w.group(1)) in self._headers:
                out.append(f"# ---- {self._headers[int(w.group(1))]}")
            out.append(line)
        return ["\n".join(out)]


def _stage_header(schedule: Schedule, k: int) -> str:
    st = schedule.stages[k]
    span = st.nodes[0] if len(st.nodes) == 1 else f"{st.nodes[0]} .. {st.nodes[-1]}"
    weights = sum(w.tensor.numel() * w.tensor.element_size() for w in st.weights)
    ops = f"{len(st.nodes)} op{'s' if len(st.nodes) != 1 else ''}"
    return f"stage {k} on {st.gpu}: {span} ({ops}), weights {fmt_bytes(weights)}"


def emit(schedule: Schedule) -> fx.GraphModule:
    """The program GraphModule of `schedule` (lint-clean; its side-effect ops survive DCE).

    It runs only inside `Pipeline.__call__`, which provides the runtime the ops act on.
    """
    graph = schedule.graph
    s, n, m = schedule.num_stages, len(schedule.gpus), schedule.microbatches
    summary = (f"Mobius schedule: {s} stages on {n} GPUs ({', '.join(schedule.gpus)}), {m} micro-batch"
               f"{'es' if m != 1 else ''}; stage k+{n} is prefetched while stage k runs")
    graph.set_codegen(_ScheduleCodeGen(summary, {k: _stage_header(schedule, k) for k in range(s)}))
    program = fx.GraphModule(nn.Module(), graph, class_name="MobiusProgram")
    program.graph.lint()
    return program


def backward_summary(schedule: Schedule) -> str:
    """Comment lines: the backward part of the schedule IR, per GPU in the order it runs
    (autograd runs the stage calls in reverse; each stage recomputes its forward from its saved
    inputs under the saved RNG state, then sends its weight gradients to the host)."""
    ir = schedule.ir()
    lines = ["# backward, from the schedule IR (Bk.i: backward of stage k, micro-batch i, with recompute):"]
    for gpu in ir.gpus:
        ops = [o for o in ir.place(gpu) if o.phase == "backward" and o.kind in ("wait", "prefetch", "run", "download",
                                                                               "evict")]
        lines.append(f"#   {gpu}: " + "; ".join(_short(o) for o in ops))
    return "\n".join(lines)


def _short(o) -> str:
    if o.kind == "run":
        return f"B{o.stage}.{o.microbatch}"
    if o.kind == "download":
        return f"gradients({o.stage}) -> host"
    return f"{o.kind}({o.stage})"
