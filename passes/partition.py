"""Partition layers into pipeline stages: the Mobius MIP over run-length-encoded layers.

The model it solves — a step's timeline and memory for given cuts, docs/schedule.md — is
stated once, in `mobius_fx.step_model`; this pass searches it three ways that must agree:

* `evaluate(problem, boundaries)` (from the step model) — the model solved exactly for fixed
  cuts. The reference for everything else.
* `brute_force(problem)` — every cut set through `evaluate`; small instances only.
* `solve(problem)` — a mixed-integer program in PuLP (HiGHS or CBC), with the incumbent from
  `heuristic(problem)` (balanced cuts + local search through the same model): a cutoff for
  HiGHS (never a MIP start, which HiGHS 1.16 could "prove" optimal when it was not), a warm
  start for CBC. The program and the solver driving live in passes/_partition_mip.py.

`solve` considers every stage count S = 1..L (issue 14: N, 2N, ... and a few others missed
the best count by up to 26% and still reported "optimal"). Most counts are settled without a
MIP: each gets a closed-form lower bound (`stage_count_bound`, O(L)) and balanced cuts (equal
stages, and for S not a multiple of N equal work per GPU); then, lowest bound first, the LP of
a reduced relaxation of its program (`lp_bound`: first and last micro-batch only; 0.05-0.15 s
for the 15.9B GPT) settles the counts whose bound reaches the incumbent or whose memory rows
are infeasible; the MIP runs on the counts left, lowest bound first, cut off at the incumbent.
The reported gap is the best plan against the least bound over every count, so it holds still
from run to run (0.6% for the 15.9B GPT on mobius-testbed at 20 s; at 10 s on 2 cores some
counts keep only the closed-form bound and the gap says so, ~10%).

The MIP decides only stage boundaries. A model is a few runs of identical layers (a GPT is
embedding + 72 equal blocks + head), so a cut k picks one run r (binary `z[k,r]`, runs from
`step_model.layer_runs`) and how many layers of that run precede it (integer `t[k,r]`).
Prefix sums of every per-layer quantity (`step_model.PrefixSums`) are then linear in (z, t),
and so are stage times, weights, the boundary activation (the output of the run the cut falls
after) and the memory of `stage_memory`, which the MIP and the local search compute with the
same `MemoryModel.footprint` on the same sums (weights, gradients, recompute bytes, boundary
activations). One binary per (layer, stage) does not finish in CBC at 75 layers; this form
has (S-1)·R binaries, plus, for a tied weight read by a layer other than the first or the
last, one binary per stage that layer can fall in (which stage keeps a copy of it).

For fixed cuts the least start times are optimal (`step_model`'s docstring says why), and the
MIP uses the same elimination of the prefetch p, the same rows for the saved inputs (the
bytes of a boundary activation are linear in the cut variables), and drops rows that others
imply for every cut set (`_partition_mip.py` checks each from the footprint's coefficients): `p_k <= free`
and `q_k <= free` follow from the double buffer (W_k <= mem_k), the forward rules from the
backward ones (bwd_mem >= fwd_mem), and a stage's own rule from its double-buffer pair.

    prob = PartitionProblem.from_topology(layers, topo, microbatches=4)
    result = solve(prob)            # PartitionResult(boundaries=(0, 3, 7, ...), makespan=...)
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import pulp

from mobius_fx.errors import PlanError
from mobius_fx.kinds import SOLVERS
from mobius_fx.step_model import (
    MEMORY_TOLERANCE, Evaluation, PartitionProblem, PrefixSums, SolverInfo, evaluate, layer_runs, memory_rows,
)
from mobius_fx.units import fmt_bytes, fmt_time

from ._partition_mip import Mip, build_mip, cuts_of, run_solver, solve_relaxation, warm_start

__all__ = [
    "PartitionProblem", "PartitionResult", "Evaluation", "evaluate", "brute_force", "heuristic",
    "solve", "plan_stage_count_candidates", "stage_count_bound", "lp_bound",
]

_LOCAL = 8  # the local search improves the seeds of this many counts (the best seeds first)


@dataclass(frozen=True)
class PartitionResult:
    """Stage boundaries (index of each stage's first layer), predicted makespan (s), the
    prefetched bytes per stage (forward p_k: 0 for k < N; backward q_k: 0 for the resident
    k >= S-N) and the solver report."""

    boundaries: tuple[int, ...]
    makespan: float
    prefetch_fwd: tuple[float, ...]
    prefetch_bwd: tuple[float, ...]
    solver: SolverInfo


def _result(ev: Evaluation, info: SolverInfo) -> PartitionResult:
    return PartitionResult(ev.boundaries, ev.makespan, ev.prefetch_fwd, ev.prefetch_bwd, info)


def plan_stage_count_candidates(num_layers: int, num_gpus: int) -> tuple[int, ...]:
    """Stage counts S `solve` considers: every one, 1..L. (It settles most of them by a lower
    bound, `stage_count_bound` or `lp_bound`, without a MIP; issue 14: trying only N, 2N, ...
    and a few others missed the best count by up to 26%.)

    >>> plan_stage_count_candidates(5, 2)
    (1, 2, 3, 4, 5)
    """
    return tuple(range(1, num_layers + 1))


# ------------------------------------------------------------------ per-count lower bounds
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
    grad0 = fast.g[1] / problem.down[0] if P == 0 else 0.0
    bwd_compute = (m * sum(b) + sum(ci * bi for ci, bi in zip(cs, b))) / nu + grad0
    # Link capacity in "GPU links' worth": a shared link counts `servers`, a GPU on none 1.
    servers = lambda links: _servers(links, n)
    up_max, down_max = max(problem.up), max(problem.down)
    fwd_link = fast.w[L] / (up_max * servers(problem.shared_up)) + m * min(f)
    refetched = sum(fast.w[i + 1] - fast.w[i] for i in range(P, max(P, s - n)))
    bwd_link = max(refetched / (up_max * servers(problem.shared_up)),
                   fast.g[L] / (down_max * servers(problem.shared_down)))
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
    return _result(best, SolverInfo("brute force", "optimal", best.makespan, 0.0, time.perf_counter() - t0,
                                    count, 0, tuple(range(1, min(L, max_stages or L) + 1))))


# ---------------------------------------------------------------------------- heuristic
def _balanced_cuts(fast: PrefixSums, s: int, gpus: int | None = None) -> list[int]:
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


def _seed(fast: PrefixSums, s: int) -> tuple[list[int], tuple[float, float]]:
    """The better-scoring of the two balanced cut sets (equal stages, equal GPUs)."""
    n = len(fast.problem.gpus)
    seeds = [_balanced_cuts(fast, s)] + ([_balanced_cuts(fast, s, n)] if s % n else [])
    return min(((c, fast.score(c)) for c in seeds), key=lambda x: x[1])


def _shifted(cuts: list[int], i: int, j: int, d: int, L: int) -> list[int] | None:
    """Cuts i..j moved by d (one layer passes from one end of the segment to the other)."""
    trial = cuts[:i] + [c + d for c in cuts[i:j + 1]] + cuts[j + 1:]
    if trial[i] <= trial[i - 1] or (j + 1 < len(trial) and trial[j + 1] <= trial[j]) or trial[j] >= L:
        return None
    return trial


def _local_search(fast: PrefixSums, cuts: list[int], deadline: float) -> tuple[list[int], tuple[float, float]]:
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


def _heuristic_for(fast: PrefixSums, s: int, deadline: float,
                   start: list[int] | None = None) -> tuple[list[int], float] | None:
    cuts, (viol, makespan) = _local_search(fast, start or _seed(fast, s)[0], deadline)
    return (cuts, makespan) if viol == 0 else None


def heuristic(problem: PartitionProblem, *, stage_counts: Sequence[int] | None = None,
              time_limit: float = 5.0) -> PartitionResult | None:
    """Balanced-compute cuts improved by local search on the exact model (the warm start).

    Feasible but not proven optimal; None if no candidate stage count found a fitting plan.

    heuristic(prob).makespan        # seconds, an upper bound on solve(prob).makespan
    """
    t0 = time.perf_counter()
    fast = PrefixSums(problem)
    cands = _candidates(problem, stage_counts)
    seeds = {s: _seed(fast, s) for s in cands}
    order = sorted(cands, key=lambda s: (seeds[s][1], s))[:_LOCAL]  # the local search on the best seeds
    best = min(((c, sc[1]) for c, sc in seeds.values() if sc[0] == 0), key=lambda x: x[1], default=None)
    for i, s in enumerate(order):
        left = t0 + time_limit - time.perf_counter()
        found = _heuristic_for(fast, s, time.perf_counter() + max(left, 0.0) / (len(order) - i), seeds[s][0])
        if found and (best is None or found[1] < best[1]):
            best = found
    if best is None:
        return None
    ev = evaluate(problem, best[0])
    return _result(ev, SolverInfo("heuristic", "feasible", ev.makespan, math.nan, time.perf_counter() - t0,
                                  0, 0, cands))


def _candidates(problem: PartitionProblem, stage_counts: Sequence[int] | None) -> tuple[int, ...]:
    """`stage_counts`, or every count (`plan_stage_count_candidates`)."""
    L = len(problem.layers)
    if stage_counts is None:
        return plan_stage_count_candidates(L, len(problem.gpus))
    bad = [s for s in stage_counts if not 1 <= s <= L]
    if bad or not stage_counts:
        raise PlanError(f"stage_counts {tuple(stage_counts)} must be non-empty and within 1..{L} "
                        f"(the number of layers)")
    return tuple(sorted(set(int(s) for s in stage_counts)))


# ------------------------------------------------------------------------- infeasibility
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


def _explain_infeasible(problem: PartitionProblem, cands: Sequence[int], unknown: Sequence[int]) -> str:
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
        cuts, (viol, _) = _local_search(fast, _balanced_cuts(fast, s), time.perf_counter()
                                        + max(deadline - time.perf_counter(), 0.0) / (len(cands) - i))
        if near is None or viol < near[0]:
            near = (viol, cuts)
    _, text = _worst_row(problem, near[1])
    extra = (f" (the solver ran out of time on S in {tuple(unknown)} without finding one; raise time_limit)"
             if unknown else "")
    return (f"no partition into S in {tuple(cands)} stages fits the GPUs{extra}: in the closest one found "
            f"(S={len(near[1])}, boundaries {tuple(near[1])}) {text} (memory_fraction {frac:g}); {remedy}, "
            f"or allow other stage counts (stage_counts=...)")


# ------------------------------------------------------------------------------ solve
# The timing model's revision: part of the cache key, so a plan solved under an older model (a
# different program for the same numbers) is not reused. Bump it with any change to the program.
MODEL_REVISION = ("2026-12-04: memory rows (a neighbour holds its weights and boundary activations), working memory "
                  "once in backward over the layers' saved bytes; duplex share by priority, uploads on a shared "
                  "uplink take the first server")


def _cache_key(problem: PartitionProblem, settings: dict) -> str:
    blob = json.dumps({"problem": asdict(problem), "settings": settings, "model": MODEL_REVISION}, sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("MOBIUS_FX_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mobius_fx" / "plans"


def _pick_solver(solver: str) -> str:
    if solver not in SOLVERS:
        raise PlanError(f"solver={solver!r}; use one of {', '.join(map(repr, SOLVERS))}")
    highs_ok = pulp.HiGHS().available()
    if solver == "highs" and not highs_ok:
        raise PlanError("solver='highs' but highspy is not installed; pip install highspy or use solver='cbc'")
    return "highs" if solver == "auto" and highs_ok else ("cbc" if solver == "auto" else solver)


def solve(problem: PartitionProblem, *, solver: str = "auto", time_limit: float = 20.0,
          stage_counts: Sequence[int] | None = None, cache_dir: str | os.PathLike | None = None,
          progress: Callable[[str], None] | None = None, gap_rel: float = 1e-4) -> PartitionResult:
    """The best partition over the candidate stage counts (default every one, 1..L); raises
    PlanError if none fits.

    `time_limit` (s) is the whole solve's budget: at most 10% (2 s) for the local search, the
    LP bounds until 85%, the MIPs on the counts still open after (the module docstring). The
    reported gap is against the smallest bound over all candidates, those the time left with
    their closed-form bound only included. Results are cached in `cache_dir` (default
    $MOBIUS_FX_CACHE or ~/.cache/mobius_fx/plans), keyed by the problem's numbers and these
    settings.

    solve(prob, time_limit=10).boundaries   # e.g. (0, 3, 7, 11)
    """
    t_start = time.perf_counter()
    name = _pick_solver(solver)
    cands = _candidates(problem, stage_counts)
    say = progress or (lambda msg: None)
    settings = {"solver": name, "time_limit": time_limit, "stage_counts": cands, "gap_rel": gap_rel, "v": 6}  # v: the model and solver (bump when either changes)
    path = _cache_dir(cache_dir) / f"{_cache_key(problem, settings)}.json"
    if path.exists():
        try:
            d = json.loads(path.read_text())
            ev = evaluate(problem, d["boundaries"])
            if ev is not None:
                say(f"reusing cached plan {path}")
                info = SolverInfo(**{**d["solver"], "stage_counts": tuple(d["solver"]["stage_counts"]),
                                     "cached": True})
                return _result(ev, info)
        except (KeyError, TypeError, ValueError, PlanError):
            pass  # a stale or foreign file: solve again and overwrite it

    fast, runs = PrefixSums(problem), layer_runs(problem)
    deadline = t_start + time_limit
    # 1. Every count: its closed-form bound and its balanced cuts (one evaluation or two).
    states = {s: _Candidate(s, bound=stage_count_bound(problem, s, fast)) for s in cands}
    for s in cands:
        cuts, (viol, makespan) = _seed(fast, s)
        if viol == 0:
            states[s].cuts, states[s].makespan = tuple(cuts), makespan
    incumbent = lambda: min(c.makespan for c in states.values())
    settled = lambda c: c.status in ("optimal", "infeasible", "cut off") or c.bound >= incumbent() * (1 - gap_rel)
    # 2. The local search on the best seeds (at most 10% of the time, 2 s).
    heur_end = t_start + min(0.1 * time_limit, 2.0)
    local = sorted((s for s in cands if not settled(states[s])), key=lambda s: (states[s].makespan, s))[:_LOCAL]
    for i, s in enumerate(local):
        left = max(heur_end - time.perf_counter(), 0.0)
        c = states[s]
        found = _heuristic_for(fast, s, time.perf_counter() + left / (len(local) - i), list(c.cuts) if c.cuts else None)
        if found and found[1] < c.makespan:
            c.cuts, c.makespan = tuple(found[0]), found[1]
    # 3. The LP bound of every count the closed form left open, lowest bound (then best plan)
    #    first, until 85% of the time: most counts end here, their bound above the incumbent or
    #    infeasible. (An LP bound costs less than a MIP's root, which a short MIP run on a large
    #    program may not reach; with the LP bounds the gap holds still from run to run.)
    lp_end, t0 = t_start + 0.85 * time_limit, time.perf_counter()
    by_closed_form = [s for s in cands if settled(states[s])]
    by_lp, no_lp = [], []
    for s in sorted(cands, key=lambda s: (states[s].bound, states[s].makespan, s)):
        c = states[s]
        if settled(c):
            continue
        if time.perf_counter() >= lp_end:
            no_lp.append(s)
            continue
        status, bound = lp_bound(problem, fast, runs, s, name, deadline - time.perf_counter())
        if status == "infeasible":
            c.status = "infeasible"
        c.bound = max(c.bound, bound)
        if settled(c):
            by_lp.append(s)
    say(f"{len(cands)} stage counts: {len(by_closed_form)} settled by the closed-form bound, {len(by_lp)} by the "
        f"LP bound ({time.perf_counter() - t0:.2f} s), {len(no_lp)} without an LP bound (time), "
        f"best so far {fmt_time(incumbent()) if incumbent() < math.inf else 'none'}")
    # 4. The MIP on the counts still open, lowest bound first, cut off at the incumbent; passes
    #    over them until every one is settled or the time is up.
    while True:
        open_ = sorted((c for c in states.values() if not settled(c)), key=lambda c: (c.bound, c.s))
        if not open_ or deadline - time.perf_counter() < 0.2:
            break
        for i, c in enumerate(open_):
            if settled(c):
                continue
            left = max(deadline - time.perf_counter(), 0.0)
            if left < 0.05 and i:
                break
            _attempt(states, c.s, problem, fast, runs, name, left / (len(open_) - i), gap_rel, say)
    if incumbent() == math.inf:  # out of time without a plan: one more run per count (a late plan
        # beats none; the error below needs every count settled or tried)
        for c in sorted((c for c in states.values() if not settled(c)), key=lambda c: (c.bound, c.s)):
            _attempt(states, c.s, problem, fast, runs, name, 0.5, gap_rel, say)
            if incumbent() < math.inf:
                break
    best = min(states.values(), key=lambda c: c.makespan)
    if best.cuts is None or best.makespan == math.inf:
        unknown = sorted(c.s for c in states.values() if c.status != "infeasible")
        raise PlanError(_explain_infeasible(problem, cands, unknown))
    lower = min(c.bound for c in states.values())  # every count's: the gap is over all of them
    gap = max(0.0, (best.makespan - lower) / best.makespan) if best.makespan > 0 else 0.0
    # (1 + 1e-9): CBC proves only the bound obj * (1 - gap_rel), which rounds to just above gap_rel
    timed_out = any(not settled(c) for c in states.values())
    status = "optimal" if gap <= gap_rel * (1 + 1e-9) else ("time limit" if timed_out else "feasible")
    ev = evaluate(problem, best.cuts)
    if best.mip is None:  # settled without a MIP run: the size of its program all the same
        best.mip = build_mip(problem, fast, runs, best.s, mem_tol=MEMORY_TOLERANCE)
    lp = best.mip.lp
    info = SolverInfo(name, status, ev.makespan, gap, time.perf_counter() - t_start,
                      lp.numVariables(), lp.numConstraints(), cands)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"boundaries": list(ev.boundaries), "solver": asdict(info)}, default=list))
    except OSError:
        pass  # a read-only cache is not an error; the plan is still good
    return _result(ev, info)


@dataclass
class _Candidate:
    """Search state of one stage count S across solver passes (costs in seconds)."""

    s: int
    cuts: tuple[int, ...] | None = None
    makespan: float = math.inf
    bound: float = -math.inf
    status: str = "not solved"
    mip: Mip | None = None


def _attempt(states: dict[int, _Candidate], s: int, problem: PartitionProblem, fast: PrefixSums,
             runs: list[tuple[int, int]], name: str, limit: float, gap_rel: float,
             say: Callable[[str], None]) -> None:
    """One solver run for stage count s, cut off at the best makespan of any candidate (CBC:
    warm-started from s's best cut set; HiGHS gets no start); updates states[s]."""
    c, t0 = states[s], time.perf_counter()
    if c.mip is None:
        c.mip = build_mip(problem, fast, runs, s, mem_tol=MEMORY_TOLERANCE)
    mip = c.mip
    warm = c.cuts is not None and name == "cbc"
    if warm:
        warm_start(mip, runs, evaluate(problem, c.cuts))
    incumbent = min(x.makespan for x in states.values())
    cutoff = incumbent / mip.scale if incumbent < math.inf else None
    if mip.infeasible:
        status, obj, bound = "infeasible", math.inf, math.inf
    else:
        status, obj, bound = run_solver(mip, name, limit, gap_rel, warm, cutoff)
    c.bound = max(c.bound, bound * mip.scale)
    c.status = status
    if obj < math.inf and status != "cut off":
        ev = evaluate(problem, cuts_of(mip, runs))
        if ev is None:  # accepted within the solver's tolerance, rejected by the exact check
            c.status += " (solver point failed the exact memory check)"
        elif ev.makespan < c.makespan:
            c.cuts, c.makespan = ev.boundaries, ev.makespan
    say(f"S={s}: {c.status}, best {fmt_time(c.makespan) if c.makespan < math.inf else 'none'}, "
        f"bound {fmt_time(max(c.bound, 0.0))}, {time.perf_counter() - t0:.2f} s")
