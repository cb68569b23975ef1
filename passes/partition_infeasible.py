"""Why a partition does not fit the GPUs, with numbers and a remedy: `explain_infeasible` when
no cut set of any candidate stage count fits (`partition_solve.solve`'s PlanError), `misfit`
when given cuts do not (the partition pass's PlanError for `cuts=`).
"""

from __future__ import annotations

import math
import time
from typing import Sequence

from mobius_fx.planning.step_model import PartitionProblem, PrefixSums
from mobius_fx.planning.step_memory import MEMORY_TOLERANCE, memory_rows
from mobius_fx.units import fmt_bytes

from .partition_search import balanced_cuts, local_search

__all__ = ["explain_infeasible", "misfit"]


def _span(problem: PartitionProblem, cuts: Sequence[int], k: int) -> str:
    edges, ls = list(cuts) + [len(problem.layers)], problem.layers
    a, z = edges[k], edges[k + 1] - 1
    return ls[a].name if a == z else f"{ls[a].name}..{ls[z].name}"


def _worst_row(problem: PartitionProblem, cuts: Sequence[int]) -> tuple[float, str]:
    """The most overfull memory rule of a cut set (`step_model.memory_rows`): (need / capacity, description)."""
    st, n = PrefixSums(problem).stages(cuts), len(problem.gpus)
    worst = (-math.inf, "")
    for k, d, need, with_ in memory_rows(st.fmem, st.bmem, st.held, st.grad_in, n):
        cap, gpu = problem.capacity[k % n], problem.gpus[k % n]
        if need / cap > worst[0]:
            phase = ("forward", "backward")[d]
            text = f"stage {k} ({_span(problem, cuts, k)}) needs {fmt_bytes(need)} in {phase}"
            if with_:
                text += f" with what stage{'s' if len(with_) > 1 else ''} {' and '.join(map(str, with_))} hold{'' if len(with_) > 1 else 's'} meanwhile (weights, boundary activations)"
            worst = (need / cap, text + f" on {gpu}, which has {fmt_bytes(cap)} usable")
    return worst


def explain_infeasible(problem: PartitionProblem, cands: Sequence[int], unknown: Sequence[int]) -> str:
    """The binding reason, with numbers, and what to do about it."""
    fast, ls = PrefixSums(problem), problem.layers
    L, n, frac = len(ls), len(problem.gpus), problem.memory_fraction
    big = max(range(n), key=lambda i: problem.capacity[i])
    cap, gname = problem.capacity[big], problem.gpus[big]
    half = problem.memory.weight_scale < 1  # already streamed in half precision
    remedy = ("" if half else "stream weights in half precision (dtype=torch.float16), ") + \
        "use more micro-batches (less working memory each), raise memory_fraction, or use GPUs with more memory"
    # The smallest stage holding each layer (backward needs at least as much as forward).
    need, arg = [math.inf] * L, [(0, 0)] * L
    for a in range(L):
        for z in range(a + 1, L + 1):
            st = fast.stages([a, z] if z < L else [a])
            for i in range(a, z):
                if st.bmem[0] < need[i]:
                    need[i], arg[i] = st.bmem[0], (a, z)
    worst = max(range(L), key=lambda i: need[i])
    if need[worst] > cap * (1 + MEMORY_TOLERANCE):
        a, z = arg[worst]
        st, mm = fast.stages([a, z] if z < L else [a]), fast.mm
        copies = f"{mm.grad_copies}x" if mm.grad_copies != 1 else ""
        acts = problem.microbatches * ((fast.out[a - 1] if a else 0.0) + fast.out[z - 1])
        return (f"layer {ls[worst].name} needs {fmt_bytes(need[worst])} in backward (weights {fmt_bytes(st.w[0])} "
                f"+ gradients {copies}{fmt_bytes(st.g[0])} + recompute {fmt_bytes(fast.r[z] - fast.r[a])} + working "
                f"{fmt_bytes(fast.work(a, z))} + boundary activations {fmt_bytes(acts)}) but the largest GPU, "
                f"{gname}, has {fmt_bytes(cap)} usable (memory_fraction {frac:g} of {fmt_bytes(cap / frac)}); {remedy}")
    # Otherwise: the closest cut set we can find, and the rule it still breaks.
    near: tuple[float, list[int]] | None = None
    deadline = time.perf_counter() + 1.0
    for i, s in enumerate(cands):
        cuts, (viol, _) = local_search(fast, balanced_cuts(fast, s), time.perf_counter()
                                        + max(deadline - time.perf_counter(), 0.0) / (len(cands) - i))
        if near is None or viol < near[0]:
            near = (viol, cuts)
    _, text = _worst_row(problem, near[1])
    extra = (f" (the solver ran out of time on S in {tuple(unknown)} without finding one; raise time_limit)"
             if unknown else "")
    return (f"no partition into S in {tuple(cands)} stages fits the GPUs{extra}: in the closest one found "
            f"(S={len(near[1])}, boundaries {tuple(near[1])}) {text} (memory_fraction {frac:g}); {remedy}, "
            f"or allow other stage counts (stage_counts=...)")


def misfit(problem: PartitionProblem, boundaries: Sequence[int]) -> str:
    """The memory rule of docs/schedule.md that stages cut at `boundaries` break worst, with its
    numbers: a stage alone, or a stage with the next one on its GPU (the double buffer)."""
    ls, n = problem.layers, len(problem.gpus)
    edges = list(boundaries) + [len(ls)]
    st = PrefixSums(problem).stages(boundaries)  # evaluate's numbers, tied copies included
    span = lambda k: ls[edges[k]].name + ("" if edges[k + 1] - edges[k] == 1 else f"..{ls[edges[k + 1] - 1].name}")
    where = lambda k: (f" on {problem.gpus[k % n]}, which has {fmt_bytes(problem.capacity[k % n])} usable "
                       f"(memory_fraction {problem.memory_fraction:g})")
    alone, pairs = [], []  # (need / capacity, text): a stage alone is said first, it is the one to split
    for k, (fm, bm) in enumerate(zip(st.fmem, st.bmem)):
        alone.append((max(fm, bm) / problem.capacity[k % n], f"stage {k} ({span(k)}) needs {fmt_bytes(max(fm, bm))}{where(k)}"))
    for k, d, need, with_ in memory_rows(st.fmem, st.bmem, st.held, st.grad_in, n):
        if with_:
            pairs.append((need / problem.capacity[k % n],
                          f"stage {k} ({span(k)}) needs {fmt_bytes(need)} in {('forward', 'backward')[d]} with what "
                          f"stage{'s' if len(with_) > 1 else ''} {' and '.join(map(str, with_))} on its GPU "
                          f"hold{'' if len(with_) > 1 else 's'} meanwhile (the double buffer: weights and boundary "
                          f"activations){where(k)}"))
    worst = max(alone)
    return worst[1] if worst[0] > 1 or not pairs else max(pairs)[1]
