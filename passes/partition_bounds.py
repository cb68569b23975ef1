"""Lower bounds of the makespan of every cut set with S stages (passes/partition_solve.py settles
most stage counts with them, without a MIP): `stage_count_bound` in closed form, O(L), and
`lp_bound`, the LP of a reduced relaxation of S's program (`_partition_mip.build_mip`).
"""

from __future__ import annotations

import math
from typing import Sequence

from mobius_fx.planning.step_model import PartitionProblem, PrefixSums
from mobius_fx.planning.step_memory import MEMORY_TOLERANCE
from mobius_fx.planning.link_loads import grad_link_scale

from ._partition_mip import build_mip
from .mip_solver import solve_relaxation

__all__ = ["stage_count_bound", "lp_bound"]


def stage_count_bound(problem: PartitionProblem, s: int, fast: PrefixSums | None = None) -> float:
    """A lower bound (s) of the makespan of every cut set with `s` stages, in closed form, O(L).

    The step splits at the turn tau = F[S-1][M-1] + f_{S-1}: every forward run ends by it (the
    micro-batch chain) and every backward run, backward upload and gradient download starts
    after it, so makespan >= (bound of tau) + (bound of the rest). Each part is the larger of
    * compute: of the n' = min(S, N) GPUs in use, GPU g is idle before its first run (the fill:
      stage 0's weights and micro-batch 0 through the stages before g's first) and after its
      last (the drain through the stages after it), so n' x part >= M x sum of run times + sum
      over stages of c_k x run time, c_k = max(0, n'-1-k) + max(0, k-(S-n')) the GPUs stage k
      keeps waiting; a layer's c is the least over the stages it can fall in. The backward
      part adds stage 0's gradient download (after stage 0's last run, which every GPU's last
      run precedes). Forward adds stage 0's first upload (weights and model input).
    * links: the copies of a phase cross the GPUs' host links, at most `servers` at a time on
      a shared uplink and one at a time per GPU otherwise: forward all weights, backward the
      layers certainly re-fetched (i < S-N, past the frozen prefix; at full speed, they go
      before the gradients), and all gradients down.
    Memory is ignored (`lp_bound` sees it). Exact for nothing; valid for every cut set, which
    tests/property/test_partition_props.py checks against brute force.
    """
    fast = fast or PrefixSums(problem)
    n, m, L = len(problem.gpus), problem.microbatches, len(problem.layers)
    P = problem.frozen_prefix
    f = [fast.f[i + 1] - fast.f[i] for i in range(L)]
    b = [fast.b[i + 1] - fast.b[i] if i >= P else 0.0 for i in range(L)]
    nu = min(s, n)
    c = lambda k: max(0, nu - 1 - k) + max(0, k - (s - nu))

    def least_c(i: int) -> int:  # c is convex in k: its least on [lo, hi] is at an end or a kink
        lo, hi = max(0, i - (L - s)), min(i, s - 1)
        return min(c(k) for k in {lo, hi, min(max(nu - 1, lo), hi), min(max(s - nu, lo), hi)})

    cs = [least_c(i) for i in range(L)]
    start = (fast.w[1] + problem.input_bytes / m) / problem.up[0]
    fwd_compute = (m * fast.f[L] + sum(ci * fi for ci, fi in zip(cs, f))) / nu + start
    widen = grad_link_scale(problem)  # the runtime's fp32 gradient downloads (`HostPass.down_scale`)
    grad0 = fast.g[1] * widen / problem.down[0] if P == 0 else 0.0
    bwd_compute = (m * sum(b) + sum(ci * bi for ci, bi in zip(cs, b))) / nu + grad0
    # Link capacity in "GPU links' worth": a shared link counts `servers`, a GPU on none 1.
    servers = lambda links: _servers(links, n)
    up_max, down_max = max(problem.up), max(problem.down)
    fwd_link = fast.w[L] / (up_max * servers(problem.shared_up)) + m * min(f)
    refetched = sum(fast.w[i + 1] - fast.w[i] for i in range(P, max(P, s - n)))
    bwd_link = max(refetched / (up_max * servers(problem.shared_up)),
                   fast.g[L] * widen / (down_max * servers(problem.shared_down)))
    return max(fwd_compute, fwd_link) + max(bwd_compute, bwd_link)


def _servers(links: Sequence, n: int) -> int:
    """Copies the host links of n GPU slots carry at a time at full speed, at most: disjoint
    shared links (the scarcest first) count their `servers`, every other slot 1."""
    used, total = set(), 0
    for link in sorted(links, key=lambda l: l.servers / len(l.slots)):
        if not used & set(link.slots):
            used |= set(link.slots)
            total += link.servers
    return total + n - len(used)


def lp_bound(problem: PartitionProblem, fast: PrefixSums, runs: list[tuple[int, int]], s: int, solver: str,
             time_limit: float) -> tuple[str, float]:
    """The LP relaxation of S = s's program reduced to its first and last micro-batches
    (`build_mip(..., bound_only=True)`): ("bound", seconds), ("infeasible", inf) — no cut set
    with s stages fits, the memory rows alone say so — or ("no bound", -inf) out of time."""
    mip = build_mip(problem, fast, runs, s, mem_tol=MEMORY_TOLERANCE, bound_only=True)
    if mip.infeasible:
        return "infeasible", math.inf
    status, value = solve_relaxation(mip, solver, time_limit)
    return status, value * mip.scale * (1 - 1e-7) if status == "bound" else value
