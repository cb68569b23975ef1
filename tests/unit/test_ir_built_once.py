"""The schedule IR is built once per compiled variant and read by everyone (issue 37, deliver 1).

Every build of a Mobius IR walks a `ScheduleBuilder` (`build_schedule`, and the dealt
`ir_split_head` builder), so counting `ScheduleBuilder.walk` counts the builds. Across
`compile` + two `train_step`s + `pipe.step_pipeline.code` + `pipe(x)` + an eager backward:

- `insert_transfers`, once per compiled pipeline (the model's and the training step's): the
  Schedule's IR, from which the pass lowers the forward program and which the engine (backward
  prefetches, slot plan), `emit` (the backward summary) and the executor (resident stages) read
  through `Schedule.ir()`;
- `step_ir`, once: the step IR (gradient flags as the runtime sees them, the trainable masters'
  gradient bytes, `step` ops, the schedule's runtime form), with its step program, which the
  executor runs and `pipe.step_pipeline.code` prints; built again only when which masters train
  changes, once for the new set;
- `build_plan`, once per compiled pipeline: the planner's IR of the plan's chain of stages in
  planned bytes (`Plan.schedule`), a planning estimate, not read by the runtime.
"""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import mobius_fx
from mobius_fx import Topology
from mobius_fx.planning.schedule_ir import ScheduleBuilder
from mobius_fx.runtime.executor import built_step
from tests.unit.test_train_step import Classifier

pytestmark = pytest.mark.usefixtures("one_thread")

BUILDERS = ("insert_transfers", "step_ir", "build_plan")


def _counting(monkeypatch) -> list[str]:
    """Each IR build from now on, named by the builder that asked for it (its call stack when none of
    `BUILDERS` is on it, so a failure says who built one more)."""
    builds: list[str] = []
    walk = ScheduleBuilder.walk

    def counted(self):
        names = [f.name for f in traceback.extract_stack()[:-1]]
        who = next((n for n in reversed(names) if n in BUILDERS), None)
        builds.append(who or " < ".join(reversed(names[-8:])))
        return walk(self)

    monkeypatch.setattr(ScheduleBuilder, "walk", counted)
    return builds


def test_each_ir_is_built_once_and_read_by_everyone(monkeypatch):
    builds = _counting(monkeypatch)
    torch.manual_seed(0)
    model = Classifier(blocks=3)
    x, y = torch.randn(8, 16), torch.randint(0, 50, (8,))
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=2,
                             cuts=[1, 2, 3], verbose=False, device="virtual-async", loss_fn=F.cross_entropy,
                             example_target=y)
    for _ in range(2):
        pipe.train_step(x, target=y)
    sp = pipe.step_pipeline
    code = sp.code
    F.cross_entropy(pipe(x), y).backward()
    assert Counter(builds) == {"build_plan": 2, "insert_transfers": 2, "step_ir": 1}, builds

    # read by everyone: one IR per Schedule, one step IR and program, which the executor runs and the code prints
    for p in (pipe, sp):
        assert p.schedule.ir() is p.schedule.ir()
    ex = sp._rt._step_executor
    ir, program = built_step(sp)
    assert ex.ir is ir and ex.step_gm is program and code == program.code.strip("\n") + "\n"
    # the model pipeline's code: its forward program (what pipe(x) runs), then that whole step
    forward = pipe.__dict__["_code"]
    assert pipe.code.startswith(forward.rstrip("\n")) and pipe.code.endswith(code) and "prefetch" in forward
    assert Counter(builds) == {"build_plan": 2, "insert_transfers": 2, "step_ir": 1}, builds

    # a layer frozen: the step IR of the new set of trainable masters, once for the steps that follow
    for q in model.blocks[0].parameters():
        q.requires_grad_(False)
    for _ in range(2):
        pipe.train_step(x, target=y)
    assert Counter(builds) == {"build_plan": 2, "insert_transfers": 2, "step_ir": 2}, builds
    assert sp._rt._step_executor.ir is built_step(sp)[0] is not ir
    # the printed step is the one that now runs (the frozen layer's stage runs no backward)
    assert sp.code == built_step(sp)[1].code.strip("\n") + "\n" != code
