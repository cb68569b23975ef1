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
from mobius_fx.planning.costs import LayerCost
from mobius_fx.passes import _partition_mip as M
from mobius_fx.passes.mip_solver import run_solver
from mobius_fx.passes.partition_bounds import lp_bound, stage_count_bound
from mobius_fx.planning.step_model import PartitionProblem, PrefixSums, evaluate, layer_runs
from mobius_fx.planning.step_memory import MEMORY_TOLERANCE, MemoryModel, TiedWeight, stage_memory
from mobius_fx.planning.link_loads import LinkLoad, copy_terms, link_time, slot_bytes
from mobius_fx.planning.step_timeline import SharedLink, queue_before
from mobius_fx.passes.partition_search import brute_force, heuristic
from mobius_fx.passes.partition_solve import solve

TIMES = st.floats(0.05, 2.0, allow_nan=False)
BYTES = st.integers(0, 60)
BANDWIDTH = st.floats(5.0, 100.0, allow_nan=False)


@st.composite
def problems(draw) -> PartitionProblem:
    """2-8 layers drawn from <= 3 kinds (so runs of identical layers occur), <= 5 GPUs,
    <= 3 micro-batches; capacities from "the largest layer alone does not fit" to "the whole
    model fits on one GPU"; backward hops the same as forward ones or drawn apart; a model
    input (sent to stage 0 in forward and again in backward) of 0-60 B; half of them with a
    tied weight that layers of other stages read (`TiedWeight`); some with a switch uplink that
    the uploads or downloads of two or more slots queue on (`SharedLink`); some with a link
    that some slots' copies of each kind cross (`LinkLoad`), slow enough to bind at times."""
    kinds = [dict(fwd_time=draw(TIMES), bwd_time=draw(TIMES), param_bytes=draw(st.integers(1, 60)),
                  grad_bytes=draw(BYTES), output_bytes=draw(BYTES), peak_bytes=draw(BYTES))
             for _ in range(draw(st.integers(1, 3)))]
    seq = draw(st.lists(st.integers(0, len(kinds) - 1), min_size=2, max_size=8))
    layers = tuple(LayerCost(name=f"layer{i}", nodes=(f"n{i}",), fwd_flops=0.0, bwd_flops=0.0, **kinds[k])
                   for i, k in enumerate(seq))
    n, m = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    mm = MemoryModel(m)
    alone = max(stage_memory([l], prev, mm)[1] for l, prev in zip(layers, (None,) + layers))
    total = stage_memory(layers, None, mm)[1]
    lo = max(1, int(alone * draw(st.sampled_from([0.9, 1.0, 1.0, 1.0]))))
    caps = tuple(draw(st.integers(lo, int(max(1.3 * total, alone)) + 1)) for _ in range(n))
    hops = tuple(math.inf if n == 1 else draw(BANDWIDTH) for _ in range(n))
    back = None if n == 1 or draw(st.booleans()) else tuple(draw(BANDWIDTH) for _ in range(n))
    tied = ()
    if draw(st.booleans()):  # a tied weight: owned by layer 0 (an embedding), another one or none
        L = len(layers)
        owner = draw(st.sampled_from([0, -1, draw(st.integers(0, L - 1))]))
        readers = draw(st.sets(st.integers(0, L - 1).filter(lambda i: i != owner), min_size=1, max_size=2))
        tied = (TiedWeight("tied", owner, tuple(sorted(readers)), float(draw(st.integers(1, 40))),
                           draw(st.booleans())),)
    shared = {"up": (), "down": ()}
    for way in shared:  # a switch uplink some slots' copies queue on, one or more at a time
        if n >= 2 and draw(st.booleans()):
            slots = tuple(sorted(draw(st.sets(st.integers(0, n - 1), min_size=2, max_size=n))))
            shared[way] = (SharedLink(way, slots, draw(st.integers(1, len(slots) - 1))),)
    links = ()
    if draw(st.booleans()):
        some = st.sets(st.integers(0, n - 1), max_size=n).map(lambda x: tuple(sorted(x)))
        links = (LinkLoad("shared", draw(st.floats(2.0, 100.0)), draw(some), draw(some),
                          *((draw(some), draw(some)) if n > 1 else ((), ()))),)
    return PartitionProblem(layers, m, tuple(f"gpu{i}" for i in range(n)), caps,
                            tuple(draw(BANDWIDTH) for _ in range(n)), tuple(draw(BANDWIDTH) for _ in range(n)),
                            hops, mm, hop_back=back, input_bytes=draw(BYTES), tied=tied,
                            shared_up=shared["up"], shared_down=shared["down"],
                            duplex=tuple(draw(st.sampled_from([0.5, 0.72, 1.0])) for _ in range(n))
                            if draw(st.booleans()) else None, links=links)


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
def test_every_stage_counts_lower_bounds_are_at_most_its_optimum(p):
    # What `solve` prunes counts with and reports its gap over: the closed form and the LP of
    # the reduced program, each at most the count's brute-force optimum (inf: none fits).
    fast, runs, L = PrefixSums(p), layer_runs(p), len(p.layers)
    for s in range(1, L + 1):
        best = brute_force_count(p, s)
        assert stage_count_bound(p, s, fast) <= best * (1 + 1e-9) + 1e-12
        status, bound = lp_bound(p, fast, runs, s, "highs", 10.0)
        assert status in ("bound", "infeasible")
        assert bound <= best * (1 + 1e-7) + 1e-12


def brute_force_count(p: PartitionProblem, s: int) -> float:
    """The best makespan of the cut sets with `s` stages (inf when none fits)."""
    import itertools
    evs = (evaluate(p, (0, *inner)) for inner in itertools.combinations(range(1, len(p.layers)), s - 1))
    return min((ev.makespan for ev in evs if ev is not None), default=math.inf)


@given(problems(), st.data())
def test_the_mip_with_its_cuts_fixed_equals_evaluate(p, data):
    # The encoding itself, row for row: solve() re-evaluates the cuts it gets back, so a wrong
    # row would only show as a worse choice, which small instances (where the warm start is
    # already optimal) rarely reveal.
    L = len(p.layers)
    inner = data.draw(st.lists(st.integers(1, L - 1), unique=True, max_size=L - 1).map(sorted))
    ev = evaluate(p, (0, *inner))
    if ev is not None:
        _assert_the_mip_with_these_cuts_equals(p, ev)


def _assert_the_mip_with_these_cuts_equals(p: PartitionProblem, ev) -> None:
    """The MIP with its cut variables fixed to `ev`'s cuts solves to `ev`'s makespan."""
    runs = layer_runs(p)
    mip = M.build_mip(p, PrefixSums(p), runs, len(ev.boundaries), mem_tol=MEMORY_TOLERANCE)
    M.warm_start(mip, runs, ev)
    for v in list(mip.z.values()) + [v for v in mip.t.values() if not isinstance(v, int)]:
        v.lowBound = v.upBound = v.varValue
    status, obj, _ = run_solver(mip, "highs", 10.0, 1e-9, False, None)
    assert status == "optimal"
    assert obj * mip.scale == pytest.approx(ev.makespan, rel=1e-6)


@st.composite
def frozen_prefix_problems(draw) -> PartitionProblem:
    """`problems()` whose first layers take no weight gradient (a frozen embedding, a frozen
    prefix of a LoRA model) and the rest do: stages within the prefix run no backward."""
    p = draw(problems())
    frozen = draw(st.integers(1, len(p.layers) - 1))
    layers = tuple(replace(l, grad_bytes=0) if i < frozen else replace(l, grad_bytes=max(1, l.grad_bytes))
                   for i, l in enumerate(p.layers))
    return replace(p, layers=layers, memory=MemoryModel(p.microbatches))


@given(frozen_prefix_problems(), st.data())
def test_with_a_frozen_prefix_the_mip_equals_evaluate_and_brute_force(p, data):
    L = len(p.layers)
    inner = data.draw(st.lists(st.integers(1, L - 1), unique=True, max_size=L - 1).map(sorted))
    ev = evaluate(p, (0, *inner))
    if ev is not None:  # the encoding, row for row, on cuts with and without frozen stages
        _assert_the_mip_with_these_cuts_equals(p, ev)
    best = brute_force(p)
    if best is not None:
        got = _solve(p)
        assert best.makespan * (1 - 1e-9) <= got.makespan <= best.makespan * (1 + _tolerance(got))


@given(problems())
def test_every_solution_passes_an_independent_memory_check(p):
    r = _solve_or_none(p)
    if r is None:
        return
    ls, n = p.layers, len(p.gpus)
    edges = list(r.boundaries) + [len(ls)]
    mm, m = p.memory, p.microbatches
    mem = [stage_memory(ls[a:z], ls[a - 1] if a else None, mm) for a, z in zip(edges, edges[1:])]
    # what a stage holds while another on its GPU works: weights, M inputs and outputs
    ins = [m * (ls[a - 1].output_bytes * mm.act_scale / m if a else 0.0) for a in edges[:-1]]
    held = [sum(l.param_bytes for l in ls[a:z]) * mm.weight_scale + ins[k] + ls[z - 1].output_bytes * mm.act_scale
            for k, (a, z) in enumerate(zip(edges, edges[1:]))]
    s = len(mem)
    for k, (fwd, bwd) in enumerate(mem):
        cap = p.capacity[k % n] * (1 + 1e-6)
        assert fwd <= cap and bwd <= cap
        if k + n < s:
            assert fwd + held[k + n] <= cap  # forward: stage k+n prefetched
        # backward: stage k-n prefetched, stage k+n's input gradients not yet taken
        assert bwd + (held[k - n] if k >= n else 0) + (ins[k + n] if k + n < s else 0) <= cap


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
        hop_back=None if p.hop_back is None else tuple(b / k for b in p.hop_back),
        links=tuple(replace(x, bandwidth=x.bandwidth / k) for x in p.links),
    )
    a, b = _solve_or_none(p), _solve_or_none(slow)
    assert (a is None) == (b is None)
    if a is not None:
        assert b.makespan == pytest.approx(k * a.makespan, rel=_tolerance(a) + _tolerance(b) + 1e-9)


@given(problems())
def test_the_makespan_is_the_last_gradient_download(p):
    best = brute_force(p)
    if best is None:
        return
    ev = evaluate(p, best.boundaries)
    n, m, s = len(p.gpus), p.microbatches, len(ev.boundaries)
    edges = list(ev.boundaries) + [len(p.layers)]
    shared = queue_before(p.shared_down, [k % n for k in range(s)], range(s - 1, -1, -1))
    for k in range(s):  # a download starts when the stage's backward and the GPU's previous download end
        part = p.layers[edges[k]:edges[k + 1]]
        frozen = edges[k + 1] <= p.frozen_prefix  # no weight gradient in it or before it: no backward
        ready = ev.bwd_start[k][m - 1] + (0.0 if frozen else sum(l.bwd_time for l in part) / m)
        if k + n < s:
            ready = max(ready, ev.grad_done[k + n])
        for j in shared[k]:  # and the download `servers` places before it on a shared uplink
            ready = max(ready, ev.grad_done[j])
        tied = p.tied_bytes(edges[k], edges[k + 1])[1]  # its tied copies' gradient
        took = (sum(l.grad_bytes for l in part) * p.memory.weight_scale + tied) / p.down[k % n]
        if p.duplex and k >= n and p.duplex[k % n] < 1:  # slowed by the GPU's uploads it overlaps, if any
            assert ev.grad_done[k] >= ready + took - 1e-12
        else:
            assert ev.grad_done[k] == pytest.approx(ready + took, rel=1e-9, abs=1e-12)
    # ... or a link's bytes over its bandwidth, when one carries more (`LinkLoad`)
    per_slot = slot_bytes(p, copy_terms(p, PrefixSums(p).stages(ev.boundaries)))
    assert ev.makespan == pytest.approx(max([*ev.grad_done, *(link_time(x, per_slot) for x in p.links)]), rel=1e-12)


@given(problems())
def test_the_heuristic_is_feasible_and_never_below_the_optimum(p):
    h = heuristic(p)
    if h is None:
        return
    best = brute_force(p)
    assert evaluate(p, h.boundaries) is not None
    assert h.makespan >= best.makespan * (1 - 1e-9)
