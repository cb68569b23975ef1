"""A schedule added in this one file (registered by name, no other file edited) is seen by
`simulate`, the comparison table (`report.compare`) and the command line's table.

The toy schedule streams every stage through one GPU (the plan's first): the plan's schedule IR
with its stages moved, through the one task builder from the IR."""

import sys
import types

import pytest
import torch

from mobius_fx import schedules
from mobius_fx.__main__ import main
from mobius_fx.planning.costs import LayerCost
from mobius_fx.errors import MobiusError
from mobius_fx.planning.plans import build_plan
from mobius_fx.sim.report import compare
from mobius_fx.schedules.ir_tasks import tasks_from_ir
from mobius_fx.sim.simulator import simulate
from mobius_fx.topology.server import Topology
from mobius_fx.zoo import GPT, GPTConfig

TOY = "toy-one-gpu"


def one_gpu(ctx):
    """Every stage of the plan on its first GPU, in the plan's order (one GPU streams them all)."""
    tasks_from_ir(ctx, ctx.plan.schedule([ctx.plan.order[0]]))


@pytest.fixture
def toy():
    schedules.register(TOY, one_gpu, summary="every stage on one GPU")
    yield TOY
    schedules.unregister(TOY)


@pytest.fixture
def plan():
    topo = Topology.virtual(gpus=2, memory="24GiB", bandwidth=10e9)
    layers = [LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, 0.01, 0.03, 50_000_000, 50_000_000, 1_000_000, 1_000_000)
              for i in range(4)]
    return build_plan(layers, [0, 1, 2, 3], order=["gpu0", "gpu1"], topology=topo, microbatches=2, step_time=0.0,
                      input_bytes=1000, memory_fraction=0.99)


def test_simulate_runs_a_registered_schedule(toy, plan):
    r = simulate(plan, schedule=toy)
    mobius = simulate(plan, schedule="mobius")
    assert r.schedule == toy
    assert r.gpu_busy["gpu1"] == 0 and r.gpu_busy["gpu0"] > 0  # all compute on the one GPU
    assert r.gpu_busy["gpu0"] == pytest.approx(sum(mobius.gpu_busy.values()), rel=1e-12)  # the same work
    assert not [e for e in r.events if e.gpu == "gpu1"]
    assert r.pipeline_time >= r.gpu_busy["gpu0"] * (1 - 1e-12)
    assert toy in schedules.names() and toy not in schedules.data_parallel_names()
    with pytest.raises(MobiusError, match=f"not '{toy}'"):  # registered without data_parallel=True
        simulate(plan, schedule=toy, servers=2, network="100Gbps")


def test_the_comparison_table_has_its_row(toy, plan):
    cmp = compare(plan)
    assert set(cmp.results) == set(schedules.names()) and toy in cmp.results
    rows = [line.split()[0] for line in cmp.table().splitlines()[2:] if line.strip()]
    assert rows[: len(schedules.names())] == list(schedules.names())  # the registry's order, the toy last
    assert cmp.speedup(toy) == pytest.approx(cmp.step_time(toy) / cmp.step_time("mobius"))


def test_the_command_line_shows_it(toy, monkeypatch, capsys):
    cfg = GPTConfig(vocab=100, seq=16, hidden=32, blocks=4, heads=2)

    def tiny(*, batch, seq, device):
        with torch.device(device):
            return GPT(cfg), (torch.zeros(batch, cfg.seq, dtype=torch.long),)

    monkeypatch.setitem(sys.modules, "toy_schedule_models", types.SimpleNamespace(tiny=tiny))
    assert main(["plan", "--model", "toy_schedule_models:tiny", "--topology", "mobius-testbed", "--batch", "8",
                 "--seq", "16", "--cuts", "1,3", "--quiet"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(toy + " "))
    assert "x" in row.split()[5]  # its "step vs mobius" cell, e.g. 1.73x


def test_unregistered_it_is_gone(plan):
    schedules.register(TOY, one_gpu)
    schedules.unregister(TOY)
    assert TOY not in schedules.names()
    with pytest.raises(MobiusError, match=f"unknown schedule '{TOY}'; valid schedules: mobius"):
        simulate(plan, schedule=TOY)


def test_a_name_is_registered_once(toy):
    with pytest.raises(MobiusError, match=f"schedule '{toy}' is registered already"):
        schedules.register(toy, one_gpu)
    with pytest.raises(MobiusError, match="is not callable"):
        schedules.register("toy-2", "not a function")
