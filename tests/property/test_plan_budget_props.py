"""A plan that `compile` accepts never fails its budget at run time (issue 26, part 5): over the
test zoo's tiny models, with budgets drawn between the smallest the planner finds feasible and
twice that, with modelled and measured costs, in fp32 and bf16, the compiled pipeline runs a
forward and backward on virtual GPUs without a `BudgetError`, and the books' peak of every
stage (`Pipeline.stage_peaks`) stays within the plan's `Stage.peak_bytes`.

The smallest feasible budget comes from the step model itself: for every cut set of the
annotated layers (tiny models: a few layers, so all of them) the most any memory row asks
(`step_model.memory_rows`: a stage with what its GPU holds for the stages around it), the least of those over the cut
sets, over the memory fraction."""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mobius_fx
from mobius_fx import Topology
from mobius_fx.passes.annotate import annotate
from mobius_fx.planning.step_model import PartitionProblem, PrefixSums
from mobius_fx.planning.step_memory import memory_rows, tied_weights
from mobius_fx.tracing import trace
from mobius_fx.precision import Precision
from mobius_fx.zoo import GPT, GPTConfig, mlp, nanogpt, nanogpt_inputs

# The trace cache on (tests/conftest.py): each zoo model is traced once for the module, by
# `smallest_budget`, and its compiles read the graph back (tracing is not what this checks:
# tests/unit/test_trace_cache.py does). Plans are cached in the module's folder too.
pytestmark = pytest.mark.usefixtures("one_thread", "trace_cache")

FRACTION = 0.9  # compile's default memory_fraction


class _GPTWithFp32Loss(nn.Module):
    """benchmarks/gpu_check.py's model, tiny: the loss on `logits.float()` inside the model."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(GPTConfig(vocab=512, seq=32, hidden=32, blocks=2, heads=2))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def _zoo(name: str):
    """(model, args, loss of the output): fresh each time, seeded."""
    torch.manual_seed(0)
    if name == "gpt-fp32-loss":
        idx = torch.randint(0, 512, (4, 32))
        return _GPTWithFp32Loss(), (idx, torch.roll(idx, 1, 1)), lambda o: o
    if name in ("tied-gpt-loss-inside", "tied-gpt-loss-outside"):
        model = nanogpt(hidden=32, blocks=2, vocab=256, seq=16, heads=2)
        (idx,) = nanogpt_inputs(model, batch=4)
        if name.endswith("inside"):
            return model, (idx, torch.roll(idx, 1, 1)), lambda o: o[1]
        return model, (idx,), lambda o: F.cross_entropy(o.reshape(-1, o.size(-1)), idx.reshape(-1))
    return mlp((16, 64, 64, 8)), (torch.randn(16, 16),), lambda o: o.pow(2).mean()


ZOO = ("gpt-fp32-loss", "tied-gpt-loss-inside", "tied-gpt-loss-outside", "mlp")
_SMALLEST: dict[tuple, int] = {}


def smallest_budget(name: str, gpus: int, dtype, costs: str) -> int:
    """The least GPU memory (bytes) at which some cut set of the model fits the step model."""
    key = (name, gpus, dtype, costs)
    if key not in _SMALLEST:
        model, args, _ = _zoo(name)
        precision = Precision.of_model(model, dtype)
        gm = trace(model, example_inputs=args, cache_dir=Path(os.environ["MOBIUS_FX_CACHE"]) / "traces")
        layers = annotate(gm, example_inputs=args, costs=costs, precision=precision)
        sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters(remove_duplicate=False)}
        inputs = sum(t.numel() * t.element_size() for t in args)
        prob = PartitionProblem.from_topology(layers, Topology.virtual(gpus=gpus, memory=2**40), microbatches=gpus,
                                              memory_fraction=FRACTION, precision=precision, input_bytes=inputs,
                                              tied=tied_weights(layers, sizes))
        fast, L, best = PrefixSums(prob), len(layers), math.inf
        for inner in itertools.chain.from_iterable(itertools.combinations(range(1, L), r) for r in range(L)):
            s = fast.stages((0, *inner))
            best = min(best, max(row for *_, row, _ in memory_rows(s.fmem, s.bmem, s.held, s.grad_in, gpus)))
        _SMALLEST[key] = math.ceil(best / FRACTION) + 64
    return _SMALLEST[key]


@settings(max_examples=20)
@given(st.sampled_from(ZOO), st.integers(1, 2), st.sampled_from([None, torch.bfloat16]),
       st.sampled_from(["model", "measure"]), st.floats(1.0, 2.0))
def test_a_plan_compile_accepts_runs_within_its_budget_and_its_planned_peaks(name, gpus, dtype, costs, factor):
    budget = int(smallest_budget(name, gpus, dtype, costs) * factor)
    model, args, loss = _zoo(name)
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=gpus, memory=budget), example_inputs=args,
                             microbatches=gpus, costs=costs, dtype=dtype, verbose=False, device="virtual")
    loss(pipe(*args)).backward()  # no BudgetError
    plan, m, n = pipe.plan, pipe.plan.microbatches, gpus
    # Every GPU's books within the memory the plan may use (memory_fraction of its budget).
    for g, stats in pipe.memory_stats().items():
        assert stats["peak_bytes"] <= int(budget * FRACTION), (g, stats, budget)
    # Each stage's books peak within its planned peak and the boundary activations of the
    # stages around it on its GPU (`memory_rows`): the books charge a stage's work with every
    # tensor on its GPU but other stages' weights and gradient sums.
    ss = plan.stages
    acts = [m * (s.input_bytes + s.output_bytes) if k else m * s.output_bytes for k, s in enumerate(ss)]
    gin = [m * s.input_bytes if k else 0 for k, s in enumerate(ss)]
    rows = memory_rows([s.peak_bytes for s in ss], [s.peak_bytes for s in ss], acts, gin, n)
    planned = [max(row for k2, _, row, _ in rows if k2 == k) for k in range(len(ss))]
    measured = pipe.stage_peaks()
    assert all(x <= y for x, y in zip(measured, planned)), list(zip(measured, planned))
