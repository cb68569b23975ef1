"""The books see every byte: on virtual GPUs every tensor a stage creates is charged while it
lives, the plan's predicted peak bounds what the books measure, and memory_stats lists every GPU.

Each stage's measured peak (`Pipeline.stage_peaks()`) is the most its GPU held while the stage
worked, less what the GPU held for other stages; the plan's `Stage.peak_bytes` must bound it.
"""

import copy

import pytest
import torch
import torch.fx as fx
from torch import nn

import mobius_fx
from mobius_fx import BudgetError, Topology
from mobius_fx.runtime.device_virtual import VirtualDevice
from mobius_fx.build import build_pipeline
from mobius_fx.zoo import expand16, training_cases

pytestmark = pytest.mark.usefixtures("one_thread", "trace_cache")

_COMPUTE = ("call_function", "call_method", "call_module")


def weight_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


ZOO = {case.name: case for case in training_cases()}


@pytest.mark.parametrize("device", ["virtual", "virtual-async"])
@pytest.mark.parametrize("name", list(ZOO))
def test_every_zoo_models_predicted_stage_peak_bounds_the_measured_one(name, device):
    """On "virtual-async" (the CUDA path) the slot pool is held throughout: all of it but the
    stage's own weights counts as held for other stages (free slots included). The module's
    cache (no `cache_dir=`: $MOBIUS_FX_CACHE, tests/conftest.py): the two devices' compiles of a
    model trace and annotate it once."""
    _, model, args, kwargs, loss, m = ZOO[name]
    model = copy.deepcopy(model)
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=args,
                             example_kwargs=kwargs, microbatches=m, costs="model", verbose=False, device=device)
    loss(pipe(*args, **kwargs)).backward()
    measured = pipe.stage_peaks()
    predicted = [s.peak_bytes for s in pipe.plan.stages]
    assert all(n > 0 for n in measured)  # every stage ran and was measured
    assert all(p >= n for p, n in zip(predicted, measured)), list(zip(predicted, measured))


def test_a_stage_whose_hidden_activation_is_16x_its_weights_shows_it_in_its_peak(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), expand16())
    x = torch.randn(512, 8)
    block = weight_bytes(model[1])
    hidden = 512 * 128 * 4  # the Linear's output (and the ReLU's, as big)
    assert hidden >= 16 * block
    gm = fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    pipe = build_pipeline(model, gm, stage_nodes=[names[:1], names[1:]], stage_gpus=["gpu0", "gpu1"],
                          gpu_budgets={}, microbatches=1, example_inputs=(x,), device="virtual")
    pipe(x).pow(2).mean().backward()
    assert pipe.stage_peaks()[1] >= block + hidden
    assert pipe.memory_stats()["gpu1"]["peak_bytes"] >= block + hidden
    # and the plan predicts it
    plan = mobius_fx.plan(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=1,
                          costs="model", cache_dir=str(tmp_path), verbose=False)
    stage = next(s for s in plan.stages if "1" in s.layers)  # layer "1": the expanding block
    assert stage.peak_bytes >= block + hidden


def test_fresh_weight_gradients_are_counted_before_they_are_summed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64))  # weights dominate: 16.25 KiB against 512 B of activations
    x = torch.randn(2, 64)
    w = weight_bytes(model)
    gm = fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    pipe = build_pipeline(model, gm, stage_nodes=[names], stage_gpus=["gpu0"], gpu_budgets={}, microbatches=2,
                          example_inputs=(x,), device="virtual")
    pipe(x).sum().backward()
    # the weights, their gradient sum and the second micro-batch's fresh gradients, all at once
    assert pipe.memory_stats()["gpu0"]["peak_bytes"] >= 3 * w


def test_a_budget_the_old_books_passed_raises_a_budget_error_in_backward_and_the_pipeline_recovers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), expand16(), nn.Linear(8, 8), expand16())
    eager = copy.deepcopy(model)
    x = torch.randn(256, 8)
    gm = fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    cut = [names[:1], names[1:4], names[4:5], names[5:]]

    def build(budget):
        return build_pipeline(model, gm, stage_nodes=cut,
                              stage_gpus=["gpu0", "gpu1"] * 2, gpu_budgets={"gpu0": budget, "gpu1": budget},
                              microbatches=2, example_inputs=(x,), device="virtual")

    probe = build(None)
    out = probe(x)
    forward = max(s["peak_bytes"] for s in probe.memory_stats().values())
    out.pow(2).mean().backward()
    whole = max(s["peak_bytes"] for s in probe.memory_stats().values())
    # What the books used to count on a GPU: two stages' weights, one stage's gradients and the
    # boundary activations of every micro-batch (in and out of both of its stages).
    old = 3 * max(weight_bytes(model[i]) for i in range(4)) + 8 * 256 * 8 * 4
    budget = (forward + whole) // 2
    assert old < forward < budget < whole
    model.zero_grad(set_to_none=True)
    pipe = build(budget)
    out = pipe(x)  # the forward fits
    with pytest.raises(BudgetError, match=r"would hold .* working memory"):
        out.pow(2).mean().backward()
    assert all(s["current_bytes"] == 0 for s in pipe.memory_stats().values())
    for dev in pipe.devices.values():
        dev.budget = None
    model.zero_grad(set_to_none=True)
    pipe(x).pow(2).mean().backward()
    eager(x).pow(2).mean().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert all(s["current_bytes"] == 0 for s in pipe.memory_stats().values())


def test_memory_stats_lists_every_gpu_of_the_topology_used_or_not(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))  # at most two stages for four GPUs
    x = torch.randn(4, 8)
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=4, memory="64MiB"), example_inputs=(x,), microbatches=2,
                             cache_dir=str(tmp_path), verbose=False)
    pipe(x).sum().backward()
    used = {s.gpu for s in pipe.plan.stages}
    stats = pipe.memory_stats()
    assert list(stats) == ["gpu0", "gpu1", "gpu2", "gpu3"]
    assert len(used) < 4
    assert all(stats[g] == {"peak_bytes": 0, "current_bytes": 0} for g in stats if g not in used)


def test_the_books_charge_each_storage_once_while_it_lives_and_not_host_copies():
    dev = VirtualDevice("gpu0", None)
    with dev.compute():
        x = torch.ones(1000)  # 4000 bytes
        views = [x[10:], x.view(10, 100), x.unsqueeze(0)]
        y = x * 2  # another 4000
        x.add_(1)  # in place: nothing new
        with dev.untracked():
            host = y.clone()  # a host copy (an offload)
    assert dev.current_bytes == 8000 and dev.holds(views[0])
    del x, views
    assert dev.current_bytes == 4000
    del y
    assert dev.current_bytes == 0 and dev.peak_bytes == 8000 and host.sum() == 2000
