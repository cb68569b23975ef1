"""The partition searches that go through the exact model (`step_model.evaluate`): every cut
set (`brute_force`, small instances) and balanced cuts improved by local search (`heuristic`,
the MIP's incumbent in `partition_solve.solve`); with `PartitionResult`, what every search
returns, and the stage counts they consider.

    heuristic(prob).makespan        # seconds, an upper bound on solve(prob).makespan
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from dataclasses import dataclass
from typing import Sequence

from mobius_fx.errors import PlanError
from mobius_fx.planning.step_model import PartitionProblem, PrefixSums, SolverInfo, evaluate
from mobius_fx.planning.step_timeline import Evaluation

__all__ = ["PartitionResult", "result_of", "plan_stage_count_candidates", "candidates", "brute_force", "heuristic",
           "balanced_cuts", "seed_cuts", "local_search", "improve_count", "LOCAL_SEARCH_COUNTS"]

LOCAL_SEARCH_COUNTS = 8  # the local search improves the seeds of this many counts (the best seeds first)


@dataclass(frozen=True)
class PartitionResult:
    """Stage boundaries (index of each stage's first layer), predicted makespan (s), the
    prefetched bytes per stage (forward p_k: 0 for k < N; backward q_k: 0 for the resident
    k >= S-N) and the solver report. `widen`: whether the step model timed the gradient
    downloads widened to fp32 on the GPUs (None: the topology's rule, `host_step.widen_fits`;
    set by the partition pass where it chose, `partition.widen_choice`), and `widen_why` why."""

    boundaries: tuple[int, ...]
    makespan: float
    prefetch_fwd: tuple[float, ...]
    prefetch_bwd: tuple[float, ...]
    solver: SolverInfo
    widen: bool | None = None
    widen_why: str = ""


def result_of(ev: Evaluation, info: SolverInfo) -> PartitionResult:
    return PartitionResult(ev.boundaries, ev.makespan, ev.prefetch_fwd, ev.prefetch_bwd, info)


def plan_stage_count_candidates(num_layers: int, num_gpus: int) -> tuple[int, ...]:
    """Stage counts S `solve` considers: every one, 1..L. (It settles most of them by a lower
    bound, `stage_count_bound` or `lp_bound`, without a MIP; issue 14: trying only N, 2N, ...
    and a few others missed the best count by up to 26%.)

    >>> plan_stage_count_candidates(5, 2)
    (1, 2, 3, 4, 5)
    """
    return tuple(range(1, num_layers + 1))



def brute_force(problem: PartitionProblem, *, max_stages: int | None = None) -> PartitionResult | None:
    """The optimum over every cut set with up to `max_stages` stages (small instances only)."""
    t0, L = time.perf_counter(), len(problem.layers)
    best, count = None, 0
    for s in range(1, min(L, max_stages or L) + 1):
        for inner in itertools.combinations(range(1, L), s - 1):
            count += 1
            ev = evaluate(problem, (0, *inner))
            if ev is not None and (best is None or ev.makespan < best.makespan):
                best = ev
    if best is None:
        return None
    return result_of(best, SolverInfo("brute force", "optimal", best.makespan, 0.0, time.perf_counter() - t0,
                                    count, 0, tuple(range(1, min(L, max_stages or L) + 1))))


# ---------------------------------------------------------------------------- heuristic
def balanced_cuts(fast: PrefixSums, s: int, gpus: int | None = None) -> list[int]:
    """Cut where the cumulative compute crosses each stage's share of the total (strictly
    increasing): equal shares, or with `gpus` = N equal shares per GPU, which differ when S
    is not a multiple of N (S = 3 on 2 GPUs: 1/4, 1/2, 1/4, so GPU 0, running stages 0 and
    2, works as long as GPU 1)."""
    L = len(fast.out)
    work = [fast.f[i] + fast.b[i] for i in range(L + 1)]
    if gpus is None:
        shares = [1 / s] * s
    else:
        nu = min(s, gpus)
        shares = [1 / (nu * len(range(k % gpus, s, gpus))) for k in range(s)]
    cuts, total, target = [0], work[L], 0.0
    for k in range(1, s):
        target += total * shares[k - 1]
        lo, hi = cuts[-1] + 1, L - (s - k)
        j = bisect.bisect_left(work, target, lo, hi + 1)  # work[j-1] < target <= work[j]
        cuts.append(min((c for c in (j - 1, j) if lo <= c <= hi), key=lambda c: abs(work[c] - target)))
    return cuts


def seed_cuts(fast: PrefixSums, s: int) -> tuple[list[int], tuple[float, float]]:
    """The better-scoring of the two balanced cut sets (equal stages, equal GPUs)."""
    n = len(fast.problem.gpus)
    seeds = [balanced_cuts(fast, s)] + ([balanced_cuts(fast, s, n)] if s % n else [])
    return min(((c, fast.score(c)) for c in seeds), key=lambda x: x[1])


def _shifted(cuts: list[int], i: int, j: int, d: int, L: int) -> list[int] | None:
    """Cuts i..j moved by d (one layer passes from one end of the segment to the other)."""
    trial = cuts[:i] + [c + d for c in cuts[i:j + 1]] + cuts[j + 1:]
    if trial[i] <= trial[i - 1] or (j + 1 < len(trial) and trial[j + 1] <= trial[j]) or trial[j] >= L:
        return None
    return trial


def local_search(fast: PrefixSums, cuts: list[int], deadline: float) -> tuple[list[int], tuple[float, float]]:
    """First-improvement local search on the exact model until no move helps or time is up.

    Moves: one cut by +-1/+-2 (cheap, O(S)), then a segment of cuts i..j by +-1, which moves
    one layer from stage i-1 to stage j or back (O(S^2); it reshapes stage sizes, e.g. small
    stages first to shorten the pipeline fill, which single-cut moves cannot reach).
    """
    L, best = len(fast.out), fast.score(cuts)
    while time.perf_counter() < deadline:
        moves = [(k, k, d) for k in range(1, len(cuts)) for d in (1, -1, 2, -2)]
        moves += [(i, j, d) for i in range(1, len(cuts)) for j in range(i + 1, len(cuts)) for d in (1, -1)]
        for count, (i, j, d) in enumerate(moves):
            if count % 64 == 0 and time.perf_counter() >= deadline:
                return cuts, best
            trial = _shifted(cuts, i, j, d, L)
            if trial is None:
                continue
            sc = fast.score(trial)
            if sc < best:
                cuts, best = trial, sc
                break
        else:
            return cuts, best
    return cuts, best


def improve_count(fast: PrefixSums, s: int, deadline: float,
                   start: list[int] | None = None) -> tuple[list[int], float] | None:
    cuts, (viol, makespan) = local_search(fast, start or seed_cuts(fast, s)[0], deadline)
    return (cuts, makespan) if viol == 0 else None


def heuristic(problem: PartitionProblem, *, stage_counts: Sequence[int] | None = None,
              time_limit: float = 5.0) -> PartitionResult | None:
    """Balanced-compute cuts improved by local search on the exact model (the warm start).

    Feasible but not proven optimal; None if no candidate stage count found a fitting plan.

    heuristic(prob).makespan        # seconds, an upper bound on solve(prob).makespan
    """
    t0 = time.perf_counter()
    fast = PrefixSums(problem)
    cands = candidates(problem, stage_counts)
    seeds = {s: seed_cuts(fast, s) for s in cands}
    order = sorted(cands, key=lambda s: (seeds[s][1], s))[:LOCAL_SEARCH_COUNTS]  # the local search on the best seeds
    best = min(((c, sc[1]) for c, sc in seeds.values() if sc[0] == 0), key=lambda x: x[1], default=None)
    for i, s in enumerate(order):
        left = t0 + time_limit - time.perf_counter()
        found = improve_count(fast, s, time.perf_counter() + max(left, 0.0) / (len(order) - i), seeds[s][0])
        if found and (best is None or found[1] < best[1]):
            best = found
    if best is None:
        return None
    ev = evaluate(problem, best[0])
    return result_of(ev, SolverInfo("heuristic", "feasible", ev.makespan, math.nan, time.perf_counter() - t0,
                                  0, 0, cands))


def candidates(problem: PartitionProblem, stage_counts: Sequence[int] | None) -> tuple[int, ...]:
    """`stage_counts`, or every count (`plan_stage_count_candidates`)."""
    L = len(problem.layers)
    if stage_counts is None:
        return plan_stage_count_candidates(L, len(problem.gpus))
    bad = [s for s in stage_counts if not 1 <= s <= L]
    if bad or not stage_counts:
        raise PlanError(f"stage_counts {tuple(stage_counts)} must be non-empty and within 1..{L} "
                        f"(the number of layers)")
    return tuple(sorted(set(int(s) for s in stage_counts)))
