"""The books on CUDA (skipped without CUDA): by default (memory_books="allocator") no Python runs
per op -- `Device.dispatch_calls` stays 0 over training steps -- and each stage's work is measured
by the caching allocator (`mobius_fx.runtime.memory_sources.CudaAllocator`, one per CUDA device, shared by the two
pipeline GPUs on cuda:0 here, as `benchmarks/gpu_check.py` runs them). The allocator's peak stays
within the budgets, a measured peak over a budget raises `BudgetError` naming the stage, and the
debug setting "ops" (the dispatch-mode books) gives the same values.
"""

import copy
import gc

import pytest
import torch
import torch.fx as fx
from torch import nn

from mobius_fx import BudgetError, trace
from mobius_fx.runtime.memory_sources import CudaAllocator
from mobius_fx.build import build_pipeline
from mobius_fx.zoo import nanogpt, nanogpt_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

_COMPUTE = ("call_function", "call_method", "call_module")


def even_cut(gm, stages):
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    bounds = [round(i * len(names) / stages) for i in range(stages + 1)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def two_on_cuda0(model, x, *, budget=None, books="auto", stages=4):
    """Stage k on pipeline GPU gpu{k % 2}, both names on cuda:0."""
    gm = trace(model, example_inputs=(x,))
    return build_pipeline(model, gm, stage_nodes=even_cut(gm, stages), stage_gpus=["gpu0", "gpu1"] * (stages // 2),
                          gpu_budgets={"gpu0": budget, "gpu1": budget}, microbatches=2, example_inputs=(x,),
                          device="cuda", gpu_indices={"gpu0": 0, "gpu1": 0}, memory_books=books)


def train(pipe, model, x, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        logits = pipe(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
        loss.backward()
        opt.step()
        out.append(loss.detach())
    torch.cuda.synchronize()
    return torch.stack(out)


def test_cuda_runs_no_python_per_op_by_default_and_the_allocator_peak_stays_within_the_budget():
    torch.manual_seed(0)
    model = nanogpt(hidden=256, blocks=4, vocab=512, seq=128)
    debug = copy.deepcopy(model)
    (x,) = nanogpt_inputs(model, batch=8, device="cpu")
    budget = 2**30  # each pipeline GPU; both on cuda:0
    pipe = two_on_cuda0(model, x, budget=budget)
    devs = list(pipe.devices.values())
    assert {d.memory_books for d in devs} == {"allocator"}
    assert {id(d.memory_source or d._default_source()) for d in devs} == {id(CudaAllocator.of(0))}
    train(pipe, model, x, 1)  # warm up: the allocator's pools, cuBLAS workspaces
    gc.collect()
    torch.cuda.synchronize()
    src = CudaAllocator.of(0)
    base = torch.cuda.memory_allocated(0)  # the two slot pools among it
    src.reset_max()
    losses = train(pipe, model, x, 2)
    assert sum(d.dispatch_calls for d in devs) == 0
    assert not src._open  # every stage's window closed
    peaks = pipe.stage_peaks()
    assert all(p > 0 for p in peaks), peaks
    stats = pipe.memory_stats()
    assert all(s["peak_bytes"] <= budget for s in stats.values()), stats
    pools = sum(s["slot_pool_bytes"] for s in stats.values())
    assert src.max_allocated() - base + pools <= 2 * budget, (src.max_allocated(), base, pools)
    # the debug setting: the dispatch-mode books, Python on every op, the same losses; the
    # allocator sees at least every storage the books charge (each an allocation of its own)
    ops = two_on_cuda0(debug, x, budget=budget, books="ops")
    train(ops, debug, x, 1)
    torch.testing.assert_close(train(ops, debug, x, 2), losses, rtol=0, atol=1e-5)
    assert sum(d.dispatch_calls for d in ops.devices.values()) > 0
    assert all(a >= 0.9 * o for a, o in zip(peaks, ops.stage_peaks())), (peaks, ops.stage_peaks())


def test_a_measured_peak_over_the_budget_raises_naming_the_stage_and_the_pipeline_recovers():
    """A stage whose hidden activation is 16x what crosses its boundaries: a budget that holds the
    slots and every activation the runtime books, but not the stage's working memory."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 64), nn.Linear(64, 64))
    x = torch.randn(4096, 64)
    gm = fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    cut = [names[:1], names[1:4], names[4:]]

    def build(budget):
        return build_pipeline(model, gm, stage_nodes=cut, stage_gpus=["gpu0", "gpu1", "gpu0"],
                              gpu_budgets={"gpu0": budget, "gpu1": budget}, microbatches=2, example_inputs=(x,),
                              device="cuda", gpu_indices={"gpu0": 0, "gpu1": 0})

    probe = build(None)
    probe(x).pow(2).mean().backward()
    torch.cuda.synchronize()
    stats = probe.memory_stats()["gpu1"]
    pool, peak = stats["slot_pool_bytes"], stats["peak_bytes"]
    boundary = 2048 * 64 * 4  # one micro-batch's activation in or out of the middle stage
    hidden = 2048 * 1024 * 4
    assert peak - pool >= 2 * hidden  # the Linear's output and the ReLU's, measured
    budget = pool + hidden + 4 * boundary  # the books hold a few boundaries at most; the work, 2 hidden and more
    assert budget < peak
    del probe
    gc.collect()
    model.zero_grad(set_to_none=True)
    pipe = build(budget)
    with pytest.raises(BudgetError, match=r"gpu1: stage 1's work peaked at .* measured by the CUDA caching "
                                          r"allocator\) but the budget is"):
        pipe(x).pow(2).mean().backward()
    assert not CudaAllocator.of(0)._open
    torch.cuda.synchronize()
    assert all(s["current_bytes"] == s["slot_pool_bytes"] for s in pipe.memory_stats().values())
    assert all(p.grad is None for p in model.parameters())
    for dev in pipe.devices.values():
        dev.budget = None
    pipe(x).pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
