"""The planner chooses whether the GPUs widen the gradients the optimizer overlap keeps as the fp32
`.grad` (`Plan.widen_downloads`, `pass_adapters.widen_choice`): by the simulated step, both ways.
Widening adds 2 B per parameter on the GPU->host links and saves the host's conversion; behind
one shared PCIe switch the links lose, on 8 RTX 4090s with a link each the host does. The runtime's
overlap starts from the plan's choice, and `simulate` charges it by default."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mobius_fx
from mobius_fx import Topology
from mobius_fx.pass_adapters import widen_choice
from mobius_fx.planning.costs import LayerCost
from mobius_fx.planning.plans import build_plan
from mobius_fx.sim.simulator import simulate
from tests.unit.test_landings import FP16, one_switch


def _plan(topo: Topology):
    # 8 layers of 450 MB (fp32 masters; 225 MB streamed in fp16), one per stage, 4 micro-batches
    layers = [LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, 6e-3, 18e-3, int(450e6), int(450e6), int(8e6), int(50e6))
              for i in range(8)]
    return build_plan(layers, tuple(range(8)), order=[g.name for g in topo.gpus], topology=topo, microbatches=4,
                      step_time=1.0, input_bytes=1000, precision=FP16)


@pytest.mark.parametrize("overlap", ["sync", "async"])
def test_the_choice_is_the_faster_simulated_step(overlap):
    chosen = {}
    for name, topo in (("one switch", one_switch(4)), ("rtx4090x8", Topology.preset("rtx4090x8"))):
        plan = _plan(topo)
        got = widen_choice(plan, "mobius", overlap, True)
        wide, narrow = (simulate(plan, optimizer_overlap=overlap, widen_downloads=w).step_time for w in (True, False))
        assert got["widen_downloads"] == (wide <= narrow), (name, wide, narrow)
        assert ("widened to fp32 on the GPUs" if wide <= narrow else "widened into .grad on the host") in got["widen_rule"]
        chosen[name] = got["widen_downloads"]
        # simulate charges the plan's choice unless told otherwise
        mine = dataclasses.replace(plan, **got)
        assert simulate(mine, optimizer_overlap=overlap).step_time == min(wide, narrow)
    assert chosen == {"one switch": False, "rtx4090x8": True}


def test_no_choice_where_nothing_is_widened():
    plan = _plan(one_switch(4))
    assert widen_choice(plan, "mobius", "none", True) == {}
    assert widen_choice(plan, "mobius", "async", False) == {}  # opt.keep_grads = False: no .grad to widen into


def test_the_overlap_starts_from_the_plans_choice(one_thread):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    x = torch.randn(4, 16)
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=2,
                             cuts=[1, 2, 3], verbose=False, dtype=torch.bfloat16)
    for widen in (True, False):
        pipe.plan = dataclasses.replace(pipe.plan, widen_downloads=widen)
        opt = pipe.overlap(torch.optim.AdamW(model.parameters()), "sync")
        assert opt.widen_downloads is widen
    assert "gradients:" not in str(pipe.plan) or pipe.plan.widen_rule in str(pipe.plan)
