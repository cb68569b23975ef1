"""What running the training step as a generated program costs per op (runtime/step_program.py).

`pipe.train_step` runs a torch.fx GraphModule with one node per schedule-IR op, each calling its
executor handler. The baseline is a plain loop over the same IR calling the same handlers, in
the same order, with the same step nodes around them (`_loop_program`), swapped in for the
GraphModule; both run in this process, interleaved, median of the timed steps. Two figures:

- the whole step (`train_step`) of a small MLP on virtual GPUs, where the handlers' work is
  tiny, so the dispatch shows;
- the dispatch alone: both with every handler a no-op.

    python benchmarks/step_program.py                    # 8 stages, 4 micro-batches, 30 steps
    python benchmarks/step_program.py --blocks 15 --microbatches 8 --steps 20

Timings on a shared machine are noise: read the ratio, and re-run on a quiet one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

import mobius_fx  # noqa: E402
from mobius_fx import Topology  # noqa: E402
from mobius_fx.runtime import step_program  # noqa: E402


class MLP(nn.Module):
    def __init__(self, blocks: int, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


def _noop(*args: object, **kwargs: object) -> None:
    return None


class _LoopProgram:
    """The step as a loop over the IR: the program's nodes, in its order, without the GraphModule."""

    def __init__(self, program) -> None:
        self.ir = program.ir
        self.nodes = [(n.target, n.kwargs.get("op")) for n in program.graph.nodes if n.op == "call_function"]

    def __call__(self, flat: list, scale: float):
        run = step_program._run()
        out = None
        for target, op in self.nodes:
            if op is not None:
                run.op(op)
            elif target is step_program.split:
                target(flat)
            elif target is step_program.loss_on_host:
                out = target(scale=scale)
            else:
                target()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP(a.blocks)
    m = a.microbatches
    x, y = torch.randn(8 * m, 16), torch.randint(0, 10, (8 * m,))  # 8 rows: no dimension of 16 looks like the batch
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=m,
                             cuts=list(range(1, a.blocks + 1)), verbose=False, device="virtual",
                             loss_fn=F.cross_entropy, example_target=y)
    pipe.train_step(x, target=y)
    ex = pipe.step_pipeline._rt._step_executor
    program, loop = ex.step_gm, _LoopProgram(ex.step_gm)
    ops = len(ex.ir.ops)

    def whole_step() -> dict[str, float]:
        times: dict[str, list[float]] = {"program": [], "loop": []}
        try:
            for i in range(a.steps):  # each first in turn
                for name, prog in (("program", program), ("loop", loop))[::1 if i % 2 else -1]:
                    ex.step_gm = prog
                    model.zero_grad()
                    t = time.perf_counter()
                    pipe.train_step(x, target=y)
                    times[name].append(time.perf_counter() - t)
        finally:
            ex.step_gm = program
        return {k: statistics.median(v[2:]) for k, v in times.items()}

    def dispatch_only() -> dict[str, float]:
        """The program and the loop called directly, every op and step node a no-op."""
        gm = step_program.build_program(ex.ir, tuple(ex.schedule.inputs), ex.name)
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target not in step_program.STEP_OPS.values():
                n.target = _noop
        gm.recompile()
        bare = _LoopProgram(gm)
        bare.nodes = [(_noop if op is None else t, op) for t, op in bare.nodes]
        times: dict[str, list[float]] = {"program": [], "loop": []}
        saved = step_program._Run.op
        step_program._Run.op = lambda self, index: None
        token = step_program._RUNNING.set(step_program._Run(ex, {}))
        try:
            for i in range(a.steps * 20):
                for name, prog in (("program", gm), ("loop", bare))[::1 if i % 2 else -1]:
                    t = time.perf_counter()
                    prog([x, y], 1.0)
                    times[name].append(time.perf_counter() - t)
        finally:
            step_program._RUNNING.reset(token)
            step_program._Run.op = saved
        return {k: statistics.median(v[2:]) for k, v in times.items()}

    print(f"{a.blocks + 1} stages on 2 virtual GPUs, {m} micro-batches: {ops} IR ops per step")
    for what, run in (("train_step", whole_step), ("dispatch only (no-op handlers)", dispatch_only)):
        t = run()
        print(f"{what:32s} program {t['program'] * 1e3:8.3f} ms  loop {t['loop'] * 1e3:8.3f} ms  "
              f"program/loop {t['program'] / t['loop']:.3f}  (program-loop)/op {(t['program'] - t['loop']) / ops * 1e6:+.2f} us")


if __name__ == "__main__":
    main()
