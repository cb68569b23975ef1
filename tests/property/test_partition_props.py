"""Properties of the partitioner on random small instances: the MIP is exact (equals brute
force, infeasible exactly when brute force finds nothing), and metamorphic relations hold."""

from __future__ import annotations

import math
import tempfile
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mobius_fx import PlanError
from mobius_fx.costs import LayerCost
from mobius_fx.plans import MemoryModel, stage_memory
from mobius_fx.passes.partition import PartitionProblem, brute_force, evaluate, heuristic, solve

TIMES = st.floats(0.05, 2.0, allow_nan=False)
BYTES = st.integers(0, 60)
BANDWIDTH = st.floats(5.0, 100.0, allow_nan=False)


@st.composite
def problems(draw) -> PartitionProblem:
    """2-8 layers drawn from <= 3 kinds (so runs of identical layers occur), <= 3 GPUs,
    <= 3 micro-batches; capacities from "the largest layer alone does not fit" to "the whole
    model fits on one GPU"."""
    kinds = [dict(fwd_time=draw(TIMES), bwd_time=draw(TIMES), param_bytes=draw(st.integers(1, 60)),
                  grad_bytes=draw(BYTES), output_bytes=draw(BYTES), peak_bytes=draw(BYTES))
             for _ in range(draw(st.integers(1, 3)))]
    seq = draw(st.lists(st.integers(0, len(kinds) - 1), min_size=2, max_size=8))
    layers = tuple(LayerCost(name=f"layer{i}", nodes=(f"n{i}",), fwd_flops=0.0, bwd_flops=0.0, **kinds[k])
                   for i, k in enumerate(seq))
    n, m = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    mm = MemoryModel.for_layers(layers, m)
    alone = max(stage_memory([l], prev, mm)[1] for l, prev in zip(layers, (None,) + layers))
    total = stage_memory(layers, None, mm)[1]
    lo = max(1, int(alone * draw(st.sampled_from([0.9, 1.0, 1.0, 1.0]))))
    caps = tuple(draw(st.integers(lo, int(max(1.3 * total, alone)) + 1)) for _ in range(n))
    hops = tuple(math.inf if n == 1 else draw(BANDWIDTH) for _ in range(n))
    return PartitionProblem(layers, m, tuple(f"gpu{i}" for i in range(n)), caps,
                            tuple(draw(BANDWIDTH) for _ in range(n)), tuple(draw(BANDWIDTH) for _ in range(n)),
                            hops, mm)


def _solve(p: PartitionProblem):
    with tempfile.TemporaryDirectory() as d:
        return solve(p, time_limit=10.0, cache_dir=d)


def _solve_or_none(p: PartitionProblem):
    try:
        return _solve(p)
    except PlanError:
        return None


def _tolerance(r) -> float:
    return r.solver.gap + 1e-7


@given(problems())
def test_mip_objective_equals_brute_force(p):
    best = brute_force(p)
    if best is None:
        with pytest.raises(PlanError):
            _solve(p)
        return
    got = _solve(p)
    assert got.makespan >= best.makespan * (1 - 1e-9)
    assert got.makespan <= best.makespan * (1 + _tolerance(got))


@given(problems())
def test_every_solution_passes_an_independent_memory_check(p):
    r = _solve_or_none(p)
    if r is None:
        return
    ls, n = p.layers, len(p.gpus)
    edges = list(r.boundaries) + [len(ls)]
    mem = [stage_memory(ls[a:z], ls[a - 1] if a else None, p.memory) for a, z in zip(edges, edges[1:])]
    for k, (fwd, bwd) in enumerate(mem):
        cap = p.capacity[k % n] * (1 + 1e-6)
        assert fwd <= cap and bwd <= cap
        if k + n < len(mem):
            assert fwd + mem[k + n][0] <= cap  # forward double buffer
            assert bwd + mem[k + n][1] <= cap  # backward double buffer (stage k+n, then k)


@settings(max_examples=12)
@given(problems(), st.sampled_from([1.25, 2.0, 10.0]))
def test_more_gpu_memory_never_worsens_the_makespan(p, factor):
    before = _solve_or_none(p)
    bigger = replace(p, capacity=tuple(int(c * factor) for c in p.capacity))
    after = _solve(bigger) if before is not None else _solve_or_none(bigger)
    if before is not None:
        assert after.makespan <= before.makespan * (1 + _tolerance(before) + _tolerance(after))


@settings(max_examples=12)
@given(problems(), st.sampled_from([0.001, 0.5, 3.0, 1000.0]))
def test_scaling_every_time_scales_the_makespan(p, k):
    slow = replace(
        p,
        layers=tuple(replace(l, fwd_time=l.fwd_time * k, bwd_time=l.bwd_time * k) for l in p.layers),
        up=tuple(b / k for b in p.up), down=tuple(b / k for b in p.down), hop=tuple(b / k for b in p.hop),
    )
    a, b = _solve_or_none(p), _solve_or_none(slow)
    assert (a is None) == (b is None)
    if a is not None:
        assert b.makespan == pytest.approx(k * a.makespan, rel=_tolerance(a) + _tolerance(b) + 1e-9)


@given(problems())
def test_the_heuristic_is_feasible_and_never_below_the_optimum(p):
    h = heuristic(p)
    if h is None:
        return
    best = brute_force(p)
    assert evaluate(p, h.boundaries) is not None
    assert h.makespan >= best.makespan * (1 - 1e-9)
