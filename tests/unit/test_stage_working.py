"""A stage's working memory is the largest of its own layers' (issue 26): the step model
(`stage_memory`, `PrefixSums`), the MIP's rows and brute force agree on it. Charging every
stage the whole model's largest refused a 3B GPT whose loss alone needs it."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from mobius_fx.passes import _partition_mip as M
from mobius_fx.passes.mip_solver import run_solver
from mobius_fx.passes.partition_search import brute_force
from mobius_fx.planning.step_model import PrefixSums, evaluate, layer_runs
from mobius_fx.passes.partition_solve import solve
from mobius_fx.planning.step_memory import MEMORY_TOLERANCE, stage_memory
from tests.unit.test_partition import mip_makespan
from tests.unit.test_step_model import layer, problem


def blocks_and_head(cap: float, gpus: int = 2):
    """Four blocks (working memory 9 B), two light layers (0 B) and a head (4 B): runs of several layers, so the MIP's cuts fall inside runs (t variables), and a
    cut at the end of the heavy run starts a stage that does not hold it (`ends_` binaries)."""
    ls = ([layer(f"h{i}", params=3, out=1, peak=9) for i in range(4)] + [layer(f"l{i}", params=2, out=1)
          for i in range(2)] + [layer("head", params=1, out=1, peak=4)])
    return problem(ls, gpus=gpus, m=1, cap=cap)


def test_a_stage_is_charged_its_own_layers_working_memory():
    p = blocks_and_head(1e9)
    ls, mm = p.layers, p.memory
    # forward = weights + work + boundary, backward = weights + grads + recompute + work + boundary
    assert stage_memory(ls[4:6], ls[3], mm) == (4 + 0 + 2, 4 + 4 + 0 + 0 + 2)  # light layers: no working memory
    assert stage_memory(ls[5:7], ls[4], mm) == (3 + 4 + 2, 3 + 3 + 4 + 4 + 2)  # the head's 4 B
    assert stage_memory(ls[0:2], None, mm) == (6 + 9 + 1, 6 + 6 + 18 + 9 + 1)  # the blocks' 9 B
    fast = PrefixSums(p)
    for a, z in itertools.combinations(range(8), 2):
        assert fast.work(a, z) == max(mm.working(l) for l in ls[a:z])


@pytest.mark.parametrize("cap", [70, 80])
def test_the_mip_charges_each_stage_its_own_working_memory_like_evaluate(cap):
    p = blocks_and_head(cap)
    fast, runs = PrefixSums(p), layer_runs(p)
    assert runs == [(0, 4), (4, 2), (6, 1)]
    fits = 0
    for s in range(1, 8):
        for inner in itertools.combinations(range(1, 7), s - 1):
            cuts = (0, *inner)
            edges = [*cuts, 7]
            st = fast.stages(cuts)
            for k, (a, z) in enumerate(zip(edges, edges[1:])):
                assert (st.fmem[k], st.bmem[k]) == pytest.approx(stage_memory(p.layers[a:z], p.layers[a - 1] if a else None,
                                                                              p.memory))
            ev = evaluate(p, cuts)
            if ev is None:  # the MIP with these cuts fixed is infeasible too
                mip = M.build_mip(p, fast, runs, s, mem_tol=MEMORY_TOLERANCE)
                if not mip.infeasible:
                    M.warm_start(mip, runs, evaluate(replace(p, capacity=(10**9,) * 2), cuts))
                    for v in list(mip.z.values()) + [v for v in mip.t.values() if not isinstance(v, int)]:
                        v.lowBound = v.upBound = v.varValue
                    assert run_solver(mip, "highs", 10.0, 1e-9, False, None)[0] == "infeasible", cuts
                continue
            fits += 1
            assert mip_makespan(p, cuts) == pytest.approx(ev.makespan, rel=1e-7), cuts
    assert 0 < fits < 2 ** 6


def test_a_cut_at_the_end_of_the_heavy_run_frees_the_next_stage_of_its_working_memory():
    # With a cut after the last block, the stage after it (l0, l1, head) needs only the head's
    # 4 B: the MIP's `ends_` binary drops the blocks' 9 B, else (0, 1, 4) would not fit 70 B.
    p = blocks_and_head(70)
    mip = M.build_mip(p, PrefixSums(p), layer_runs(p), 3, mem_tol=MEMORY_TOLERANCE)
    assert any(str(k).startswith("ends_") for k in mip.work)
    ev = evaluate(p, (0, 1, 4))
    assert ev is not None and ev.bwd_mem[2] == 5 + 5 + 4 + 4 + 2  # weights, grads, recompute, the head's 4 B, in + out
    assert mip_makespan(p, (0, 1, 4)) == pytest.approx(ev.makespan, rel=1e-7)


def test_solve_matches_brute_force_with_per_stage_working_memory(tmp_path):
    p = blocks_and_head(70)
    best = brute_force(p)
    got = solve(p, cache_dir=tmp_path, time_limit=10)
    assert got.makespan == pytest.approx(best.makespan, rel=1e-9)
    assert got.solver.status == "optimal"
