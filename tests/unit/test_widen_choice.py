"""Whether the GPUs widen the gradients the optimizer overlap keeps as the fp32 `.grad`
(`Plan.widen_downloads`, planning/host_step.py `widen_fits`): 2 B more per parameter on the
GPU->host links against the host's conversion. Where every GPU's links to the host are its own
and full duplex the extra bytes ride a direction the uploads leave idle, so the GPUs widen;
behind a shared PCIe switch the widening may slow the pipeline or save the host more than it
costs, so the partition pass chooses by the step model (passes/partition.py `widen_choice`),
planning again in the chosen mode. One choice for the MIP's host model, the plan, the simulator
and the runtime's overlap, so they agree."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mobius_fx
from mobius_fx import Topology
from mobius_fx.pass_adapters import plan_widening
from mobius_fx.planning.costs import LayerCost
from mobius_fx.planning.host_step import HostPass, widen_fits
from mobius_fx.planning.plans import build_plan
from mobius_fx.sim.simulator import simulate
from mobius_fx.zoo import GPT, GPTConfig
from passes.partition import WIDEN_MARGIN
from tests.unit.test_landings import FP16, one_switch


def _plan(topo: Topology):
    # 8 layers of 450 MB (fp32 masters; 225 MB streamed in fp16), one per stage, 4 micro-batches
    layers = [LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, 6e-3, 18e-3, int(450e6), int(450e6), int(8e6), int(50e6))
              for i in range(8)]
    return build_plan(layers, tuple(range(8)), order=[g.name for g in topo.gpus], topology=topo, microbatches=4,
                      step_time=1.0, input_bytes=1000, precision=FP16)


def test_the_rule_follows_the_links():
    assert widen_fits(Topology.preset("rtx4090x8")) and widen_fits(None)
    assert not widen_fits(Topology.preset("mobius-testbed")) and not widen_fits(one_switch(4))
    # where the rule widens, widening is the faster simulated step, and where it does not, the slower
    for topo in (one_switch(4), Topology.preset("rtx4090x8")):
        plan = _plan(topo)
        wide, narrow = (simulate(plan, optimizer_overlap="async", widen_downloads=w).step_time for w in (True, False))
        assert (wide <= narrow) == widen_fits(topo), (topo.name, wide, narrow)


@pytest.mark.parametrize("overlap", ["sync", "async"])
def test_the_planner_the_plan_and_the_simulator_follow_one_rule(overlap):
    for topo in (one_switch(4), Topology.preset("rtx4090x8")):
        rule = widen_fits(topo)
        assert HostPass.of(topo, 2, "adamw", overlap).down_scale == (2.0 if rule else 1.0)  # the MIP's host
        got = plan_widening(topo, overlap, True, FP16)
        assert got["widen_downloads"] is rule and ("on the GPUs" if rule else "on the host") in got["widen_rule"]
        plan = _plan(topo)  # widen_downloads None: the rule
        assert simulate(plan, optimizer_overlap=overlap).step_time == \
            simulate(plan, optimizer_overlap=overlap, widen_downloads=rule).step_time


def test_nothing_to_choose_where_nothing_is_widened():
    topo = one_switch(4)
    assert plan_widening(topo, "none", True, FP16) == {}
    assert plan_widening(topo, "async", False, FP16) == {}  # opt.keep_grads = False: no .grad to widen into


def test_the_overlap_starts_from_the_plans_choice(one_thread):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    x = torch.randn(4, 16)
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=2,
                             cuts=[1, 2, 3], verbose=False, dtype=torch.bfloat16)
    assert pipe.plan.widen_rule in str(pipe.plan)
    for widen in (True, False):
        pipe.plan = dataclasses.replace(pipe.plan, widen_downloads=widen)
        opt = pipe.overlap(torch.optim.AdamW(model.parameters()), "sync")
        assert opt.widen_downloads is widen


def _plans(overlap: str, tmp_path) -> dict:
    # 4 blocks of a 1024-wide GPT on the paper's testbed (PCIe switches: the rule does not widen)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=8192, seq=512, hidden=1024, blocks=4, heads=8, dropout=0.0))
        x = torch.randint(0, 8192, (4, 512), device="meta")
    return {w: mobius_fx.plan(model, "mobius-testbed", example_inputs=(x,), microbatches=4, dtype=torch.float16,
                              verbose=False, optimizer_overlap=overlap, time_limit=5, widen_downloads=w,
                              cache_dir=str(tmp_path)) for w in (None, True, False)}


@pytest.mark.parametrize("overlap", ["sync", "async"])
def test_behind_switches_the_planner_takes_the_shorter_step(overlap, tmp_path):
    """Where the rule would not widen, the partition pass times both modes and plans the shorter
    one's cuts: on this case async's hand-over makes widening shorter, sync's fused pass the bf16
    downloads (mutation: the rule alone -> the async case plans the longer step)."""
    plans = _plans(overlap, tmp_path)
    chosen, wide, narrow = plans[None], plans[True], plans[False]
    assert abs(wide.step_time / narrow.step_time - 1) > WIDEN_MARGIN  # the case decides, not the margin
    assert chosen.widen_downloads is (wide.step_time < narrow.step_time)
    assert chosen.step_time <= min(wide.step_time, narrow.step_time) * (1 + 1e-9)
    assert "the step model" in chosen.widen_rule and "the caller's" in wide.widen_rule
    assert wide.widen_downloads is True and narrow.widen_downloads is False
    # the simulator times the plan's mode, the one the runtime's overlap starts from
    assert simulate(chosen, optimizer_overlap=overlap).step_time == \
        simulate(chosen, optimizer_overlap=overlap, widen_downloads=chosen.widen_downloads).step_time
    assert overlap != "async" or chosen.widen_downloads  # the async case widens: its hand-over costs more


def test_where_the_rule_widens_nothing_is_timed_twice():
    from types import SimpleNamespace

    from mobius_fx.options import CompileOptions
    from mobius_fx.precision import Precision
    from passes.partition import widen_open

    bf16 = dataclasses.replace(CompileOptions(dtype=torch.float16), precision=Precision(torch.float16, torch.float32))
    assert widen_open(SimpleNamespace(settings=bf16, topology=Topology.preset("mobius-testbed")))
    assert not widen_open(SimpleNamespace(settings=bf16, topology=Topology.preset("rtx4090x8")))
    assert not widen_open(SimpleNamespace(settings=dataclasses.replace(bf16, widen_downloads=False),
                                          topology=Topology.preset("mobius-testbed")))
    assert not widen_open(SimpleNamespace(settings=dataclasses.replace(bf16, optimizer_overlap="none"),
                                          topology=Topology.preset("mobius-testbed")))


def test_a_variant_keeps_the_compiled_plans_choice(monkeypatch):
    """A variant (another call signature) is planned in the compiled plan's widening mode, the one
    the pipeline's overlap follows for every call (`Pipeline.overlap` reads the compiled plan's):
    its plan, prediction and simulator time what runs. Mutation (`reuse_partition_pass` choosing
    again): a variant whose costs tip the other way says widened while the overlap is not."""
    import mobius_fx.passes.partition as partition
    from tests.unit.test_landings import one_switch

    chosen = partition.widen_choice

    def tipped(ctx, part, gpus, cut=None, order=None):  # every choice after the compiled plan's tips over
        part, gpus = chosen(ctx, part, gpus, cut, order)
        tipped.calls += 1
        return (part if tipped.calls == 1 else dataclasses.replace(part, widen=not part.widen)), gpus

    tipped.calls = 0
    monkeypatch.setattr(partition, "widen_choice", tipped)

    class Biased(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

        def forward(self, x, bias=None):
            x = x if bias is None else x + bias
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Biased()
    pipe = mobius_fx.compile(model, one_switch(2), example_inputs=(torch.randn(4, 16),), microbatches=2,
                             cuts=[1, 2, 3], verbose=False, dtype=torch.bfloat16, device="virtual", max_variants=2)
    assert tipped.calls == 1  # the topology's rule does not widen here: the planner chose
    opt = pipe.overlap(torch.optim.AdamW(model.parameters()), "sync")
    pipe(torch.randn(4, 16), bias=torch.randn(4, 16))  # another signature: a variant of its own
    plans = [v.plan for v in pipe.variants]
    assert len(plans) == 2
    assert [p.widen_downloads for p in plans] == [opt.widen_downloads] * 2, [p.widen_rule for p in plans]
    assert "the compiled plan's choice" in plans[1].widen_rule


def test_the_overlap_applies_the_choice_to_the_mode_it_was_timed_for(one_thread):
    """compile(optimizer_overlap=) times the widening for that mode (Plan.widen_for); pipe.overlap
    applies it in that mode only, and the topology's rule in another (mutation: the choice
    applied to every mode -> the sync overlap widens behind the switch)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    x = torch.randn(4, 16)
    topo = Topology.virtual(gpus=2, memory="64MiB")
    assert not widen_fits(topo)
    pipe = mobius_fx.compile(model, topo, example_inputs=(x,), microbatches=2, cuts=[1, 2, 3], verbose=False,
                             dtype=torch.bfloat16, optimizer_overlap="async")
    assert pipe.plan.widen_for == "async" and "under 'async'" in pipe.plan.widen_rule
    assert mobius_fx.Plan.from_json(pipe.plan.to_json()).widen_for == "async"
    pipe.plan = dataclasses.replace(pipe.plan, widen_downloads=True)
    assert pipe.overlap(torch.optim.AdamW(model.parameters()), "async").widen_downloads is True
    assert pipe.overlap(torch.optim.AdamW(model.parameters()), "sync").widen_downloads is False  # the rule


def test_the_training_step_is_timed_in_the_compiled_plans_mode(one_thread):
    """pipe.train_step runs under the model pipeline's overlap, which widens as the compiled plan
    chose: the step pipeline's plan is timed in that mode and for that overlap mode (mutation: the
    step compiled with the default settings -> 'sync', chosen again)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=2,
                             cuts=[1, 2, 3], verbose=False, dtype=torch.bfloat16, optimizer_overlap="async",
                             loss_fn=torch.nn.functional.mse_loss, example_target=y)
    step = pipe.step_pipeline.plan
    assert step.widen_for == "async" and step.widen_downloads is pipe.plan.widen_downloads


@pytest.mark.parametrize("overlap", ["sync", "async"])
def test_the_plans_schedule_choice_is_timed_as_its_overlap_steps_it(overlap, tmp_path):
    """The plan's first line compares the schedules as the plan's optimizer overlap will step them,
    its widening included (`pass_adapters.overlap_of`); timed under "none" (bf16 downloads, no host
    pass: the simulator's default) the async case, which widens, read other times (mutation)."""
    from mobius_fx.schedules.choice import choose

    chosen = _plans(overlap, tmp_path)[None]
    line = choose(chosen, optimizer_overlap=overlap, keep_grads=True).line
    assert chosen.schedule_choice == f"{line}; 4 micro-batches (the caller's)"
    if chosen.widen_downloads:
        assert choose(chosen).line != line
