"""Partition layers into pipeline stages: the Mobius MIP over run-length-encoded layers.

The schedule model is docs/schedule.md, encoded three ways that must agree:

* `evaluate(problem, boundaries)` — the model solved exactly for fixed cuts (a forward pass
  over stages; see "Why a forward pass is exact" below). The reference for everything else.
* `brute_force(problem)` — every cut set through `evaluate`; small instances only.
* `solve(problem)` — a mixed-integer program in PuLP (HiGHS or CBC), warm-started by
  `heuristic(problem)` (balanced cuts + local search through the same model).

The MIP decides only stage boundaries. A model is a few runs of identical layers (a GPT is
embedding + 72 equal blocks + head), so a cut k picks one run r (binary `z[k,r]`) and how many
layers of that run precede it (integer `t[k,r]`). Prefix sums of every per-layer quantity are
then linear in (z, t), and so are stage times, weights, the boundary activation (the output
of the run the cut falls after) and the memory of `plans.stage_memory`. One binary per
(layer, stage) does not finish in CBC at 75 layers; this form has (S-1)·R binaries.

Why a forward pass is exact for fixed cuts: every constraint reads "start >= something" and
the objective grows with every start time. The prefetch p_k only appears in
`F[k][0] >= E + (W_k - p_k)/up` with E the end of stage k-N, so the largest allowed
p_k = min(W_k, up·span, free) is optimal, which gives
`F[k][0] >= max(E, F[k-N][0] + W_k/up, E + (W_k - free)/up)`: a max of non-decreasing
functions of earlier starts. Hence the least start times (a longest path, computed stage
by stage) are optimal, and delaying an earlier stage to lengthen its span never helps.
The MIP uses the same elimination of p, and drops two implied rows: `p_k <= free` and
`q_k <= free` follow from the double buffer (W_k <= mem_k), and the forward double buffer
follows from the backward one (bwd_mem >= fwd_mem for the same pair of stages).

>>> prob = PartitionProblem.from_topology(layers, topo, microbatches=4)
>>> result = solve(prob)            # PartitionResult(boundaries=(0, 3, 7, ...), makespan=...)
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import pulp

from mobius_fx.costs import LayerCost
from mobius_fx.errors import PlanError
from mobius_fx.plans import MemoryModel, SolverInfo, stage_memory
from mobius_fx.units import fmt_bytes, fmt_time

__all__ = [
    "PartitionProblem", "PartitionResult", "Evaluation", "evaluate", "brute_force", "heuristic",
    "solve", "plan_stage_count_candidates",
]

_MEM_TOL = 1e-6  # relative slack on capacity, the solvers' feasibility tolerance
_SMALL = 8  # at most this many layers: search every stage count
_MAX_ROUNDS = 12  # at most this many multiples of N as candidate stage counts


@dataclass(frozen=True)
class PartitionProblem:
    """Pure numbers the partitioner needs; no Topology, so the solver is testable alone.

    `layers` hold whole-example-batch costs; stage k runs on GPU slot k % N. `up`/`down` are
    DRAM<->GPU bytes/s per slot, `hop[i]` bytes/s from slot i to slot (i+1) % N (inf when it is
    the same GPU). `capacity` is usable bytes per slot; `memory_fraction` only feeds messages.
    """

    layers: tuple[LayerCost, ...]
    microbatches: int
    gpus: tuple[str, ...]
    capacity: tuple[int, ...]
    up: tuple[float, ...]
    down: tuple[float, ...]
    hop: tuple[float, ...]
    memory: MemoryModel
    memory_fraction: float = 1.0

    def __post_init__(self) -> None:
        n = len(self.gpus)
        if not self.layers:
            raise PlanError("the model has no layers to partition; trace and annotate it first")
        if self.microbatches < 1:
            raise PlanError(f"microbatches={self.microbatches}; use at least 1")
        if n < 1 or any(len(x) != n for x in (self.capacity, self.up, self.down, self.hop)):
            raise PlanError(f"{n} GPU slots but capacity/up/down/hop have lengths "
                            f"{len(self.capacity)}/{len(self.up)}/{len(self.down)}/{len(self.hop)}; "
                            "give one value per GPU slot")
        for what, xs in (("up", self.up), ("down", self.down)):
            for g, x in zip(self.gpus, xs):
                if not (0 < x < math.inf):
                    raise PlanError(f"{what} bandwidth of {g} is {x}; give a positive, finite bytes/s")
        for g, c in zip(self.gpus, self.capacity):
            if not c > 0:
                raise PlanError(f"usable memory of {g} is {c} bytes; give a positive capacity "
                                f"(GPU memory x memory_fraction)")
        for g, x in zip(self.gpus, self.hop):
            if not x > 0:
                raise PlanError(f"hop bandwidth from {g} is {x}; give a positive bytes/s (inf for the same GPU)")

    @staticmethod
    def from_topology(layers: Sequence[LayerCost], topology: Any, *, microbatches: int,
                      order: Sequence[str] | None = None, memory_fraction: float = 0.9,
                      dtype: Any = None) -> "PartitionProblem":
        """Read capacities and bandwidths of the GPUs in `order` (default: topology order).

        >>> PartitionProblem.from_topology(layers, Topology.virtual(gpus=2), microbatches=2)
        """
        if not 0 < memory_fraction <= 1:
            raise PlanError(f"memory_fraction={memory_fraction}; use a fraction in (0, 1], e.g. 0.9")
        by_name = {g.name: g for g in topology.gpus}
        names = tuple(order) if order is not None else tuple(by_name)
        unknown = [n for n in names if n not in by_name]
        if unknown or len(set(names)) != len(names):
            raise PlanError(f"order {names} must list distinct GPUs of the topology ({', '.join(by_name)})")
        n = len(names)
        hop = tuple(math.inf if names[i] == names[(i + 1) % n]
                    else float(topology.bandwidth(names[i], names[(i + 1) % n])) for i in range(n))
        return PartitionProblem(
            layers=tuple(layers), microbatches=microbatches, gpus=names,
            capacity=tuple(int(by_name[g].memory * memory_fraction) for g in names),
            up=tuple(float(topology.bandwidth("dram", g)) for g in names),
            down=tuple(float(topology.bandwidth(g, "dram")) for g in names),
            hop=hop, memory=MemoryModel.for_layers(layers, microbatches, dtype),
            memory_fraction=memory_fraction,
        )


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


@dataclass(frozen=True)
class Evaluation:
    """The schedule of fixed cuts: start times F[k][i] / B[k][i], prefetches and memory."""

    boundaries: tuple[int, ...]
    makespan: float
    prefetch_fwd: tuple[float, ...]
    prefetch_bwd: tuple[float, ...]
    fwd_start: tuple[tuple[float, ...], ...]
    bwd_start: tuple[tuple[float, ...], ...]
    fwd_mem: tuple[float, ...]
    bwd_mem: tuple[float, ...]


# ------------------------------------------------------------------------ exact evaluation
@dataclass(frozen=True)
class _Stages:
    """Per-stage numbers of one cut set (times per micro-batch)."""

    f: list[float]
    b: list[float]
    w: list[float]
    g: list[float]
    out: list[float]  # boundary output bytes per micro-batch
    fmem: list[float]
    bmem: list[float]


def _stages_reference(problem: PartitionProblem, cuts: Sequence[int]) -> _Stages:
    ls, mm, m = problem.layers, problem.memory, problem.microbatches
    edges = list(cuts) + [len(ls)]
    st = _Stages([], [], [], [], [], [], [])
    for a, z in zip(edges, edges[1:]):
        part = ls[a:z]
        fm, bm = stage_memory(part, ls[a - 1] if a > 0 else None, mm)
        st.f.append(sum(l.fwd_time for l in part) / m)
        st.b.append(sum(l.bwd_time for l in part) / m)
        st.w.append(sum(l.param_bytes for l in part) * mm.weight_scale)
        st.g.append(sum(l.grad_bytes for l in part) * mm.weight_scale)
        st.out.append(part[-1].output_bytes * mm.act_scale / m)
        st.fmem.append(fm)
        st.bmem.append(bm)
    return st


def _memory_violation(problem: PartitionProblem, st: _Stages) -> float:
    """Sum of relative overshoots of every memory rule of docs/schedule.md (0 = fits)."""
    n, s, cap = len(problem.gpus), len(st.f), problem.capacity
    v = 0.0
    for k in range(s):
        c = cap[k % n] * (1 + _MEM_TOL)
        rows = [st.fmem[k], st.bmem[k]]
        if k + n < s:
            rows.append(st.fmem[k] + st.fmem[k + n])
        if k >= n:
            rows.append(st.bmem[k] + st.bmem[k - n])
        v += sum(max(0.0, r - c) / max(cap[k % n], 1) for r in rows)
    return v


def _timeline(problem: PartitionProblem, st: _Stages, full: bool = False):
    """Least start times of docs/schedule.md for fixed stages; returns makespan (and detail)."""
    n, m, s = len(problem.gpus), problem.microbatches, len(st.f)
    up, cap = problem.up, problem.capacity
    hop_t = [st.out[k] / problem.hop[k % n] if problem.hop[k % n] != math.inf else 0.0 for k in range(s)]
    f, b, w = st.f, st.b, st.w
    F: list[list[float]] = []
    p = [0.0] * s
    for k in range(s):
        sl = k % n
        if k < n:
            t0 = w[k] / up[sl]
        else:
            prev = F[k - n]
            end = prev[m - 1] + f[k - n]
            p[k] = max(0.0, min(w[k], up[sl] * (end - prev[0]), cap[sl] - st.fmem[k - n]))
            t0 = end + (w[k] - p[k]) / up[sl]
        row = [0.0] * m
        before = F[k - 1] if k else None
        gap = f[k - 1] + hop_t[k - 1] if k else 0.0
        t = t0
        for i in range(m):
            if before is not None and before[i] + gap > t:
                t = before[i] + gap
            row[i] = t
            t += f[k]
        F.append(row)
    B: list[list[float]] = [[0.0] * m for _ in range(s)]
    q = [0.0] * s
    for k in range(s - 1, -1, -1):
        sl = k % n
        if k == s - 1:
            t0 = F[k][m - 1] + f[k]
        elif k >= s - n:
            t0 = 0.0
        else:
            nxt = B[k + n]
            end = nxt[m - 1] + b[k + n]
            q[k] = max(0.0, min(w[k], up[sl] * (end - nxt[0]), cap[sl] - st.bmem[k + n]))
            t0 = end + (w[k] - q[k]) / up[sl]
        after = B[k + 1] if k < s - 1 else None
        gap = b[k + 1] + hop_t[k] if k < s - 1 else 0.0
        row, t = B[k], t0
        for i in range(m):
            if after is not None and after[i] + gap > t:
                t = after[i] + gap
            row[i] = t
            t += b[k]
    makespan = B[0][m - 1] + b[0] + st.g[0] / problem.down[0]
    return (makespan, p, q, F, B) if full else makespan


def evaluate(problem: PartitionProblem, boundaries: Sequence[int]) -> Evaluation | None:
    """The schedule model for fixed `boundaries`, solved exactly; None if memory does not fit.

    >>> evaluate(prob, (0, 4, 8)).makespan      # seconds per step of a 3-stage plan
    """
    cuts = tuple(int(c) for c in boundaries)
    if not cuts or cuts[0] != 0 or any(b <= a for a, b in zip(cuts, cuts[1:])) or cuts[-1] >= len(problem.layers):
        raise PlanError(f"boundaries {cuts} must start at 0 and increase strictly below "
                        f"{len(problem.layers)} (the number of layers)")
    st = _stages_reference(problem, cuts)
    if _memory_violation(problem, st) > 0:
        return None
    makespan, p, q, F, B = _timeline(problem, st, full=True)
    return Evaluation(cuts, makespan, tuple(p), tuple(q), tuple(map(tuple, F)), tuple(map(tuple, B)),
                      tuple(st.fmem), tuple(st.bmem))


def _result(ev: Evaluation, info: SolverInfo) -> PartitionResult:
    return PartitionResult(ev.boundaries, ev.makespan, ev.prefetch_fwd, ev.prefetch_bwd, info)


def plan_stage_count_candidates(num_layers: int, num_gpus: int) -> tuple[int, ...]:
    """Stage counts S to try: all of 1..L for small models (L <= 8 or L < N), else N, 2N, ...
    (at most 12 of them, evenly spread, always with N and the largest).

    Multiples of N give every GPU the same number of stages (no idle slot per round).
    `solve` adds the few other S whose balanced cuts score best.

    >>> plan_stage_count_candidates(75, 8)
    (8, 16, 24, 32, 40, 48, 56, 64, 72)
    """
    if num_layers <= _SMALL or num_layers < num_gpus:
        return tuple(range(1, num_layers + 1))
    rounds = num_layers // num_gpus
    if rounds > _MAX_ROUNDS:  # e.g. one GPU: keep N, the largest, and evenly spaced ones between
        picks = {1 + round(i * (rounds - 1) / (_MAX_ROUNDS - 1)) for i in range(_MAX_ROUNDS)}
        return tuple(sorted(r * num_gpus for r in picks))
    return tuple(range(num_gpus, num_layers + 1, num_gpus))


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
class _Fast:
    """Prefix sums, so a cut set's stage numbers cost O(S) in the local search."""

    def __init__(self, problem: PartitionProblem):
        self.problem = problem
        ls, mm, m = problem.layers, problem.memory, problem.microbatches
        acc = lambda xs: list(itertools.accumulate(xs, initial=0.0))
        self.f = acc(l.fwd_time / m for l in ls)
        self.b = acc(l.bwd_time / m for l in ls)
        self.w = acc(l.param_bytes * mm.weight_scale for l in ls)
        self.g = acc(l.grad_bytes * mm.weight_scale for l in ls)
        self.out = [l.output_bytes * mm.act_scale / m for l in ls]
        self.work = mm.working_bytes

    def stages(self, cuts: Sequence[int]) -> _Stages:
        edges, m = list(cuts) + [len(self.out)], self.problem.microbatches
        st = _Stages([], [], [], [], [], [], [])
        for a, z in zip(edges, edges[1:]):
            w, g = self.w[z] - self.w[a], self.g[z] - self.g[a]
            acts = m * ((self.out[a - 1] if a else 0.0) + self.out[z - 1])
            st.f.append(self.f[z] - self.f[a])
            st.b.append(self.b[z] - self.b[a])
            st.w.append(w)
            st.g.append(g)
            st.out.append(self.out[z - 1])
            st.fmem.append(w + self.work + acts)
            st.bmem.append(w + g + 2 * self.work + acts)
        return st

    def score(self, cuts: Sequence[int]) -> tuple[float, float]:
        st = self.stages(cuts)
        v = _memory_violation(self.problem, st)
        return (v, _timeline(self.problem, st)) if v == 0 else (v, math.inf)


def _balanced_cuts(fast: _Fast, s: int) -> list[int]:
    """Cut where the cumulative compute crosses k/S of the total (strictly increasing)."""
    L = len(fast.out)
    work = [fast.f[i] + fast.b[i] for i in range(L + 1)]
    cuts, total = [0], work[L]
    for k in range(1, s):
        target = total * k / s
        lo, hi = cuts[-1] + 1, L - (s - k)
        j = min(range(lo, hi + 1), key=lambda c: abs(work[c] - target))
        cuts.append(j)
    return cuts


def _shifted(cuts: list[int], i: int, j: int, d: int, L: int) -> list[int] | None:
    """Cuts i..j moved by d (one layer passes from one end of the segment to the other)."""
    trial = cuts[:i] + [c + d for c in cuts[i:j + 1]] + cuts[j + 1:]
    if trial[i] <= trial[i - 1] or (j + 1 < len(trial) and trial[j + 1] <= trial[j]) or trial[j] >= L:
        return None
    return trial


def _local_search(fast: _Fast, cuts: list[int], deadline: float) -> tuple[list[int], tuple[float, float]]:
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


def _heuristic_for(fast: _Fast, s: int, deadline: float) -> tuple[list[int], float] | None:
    cuts, (viol, makespan) = _local_search(fast, _balanced_cuts(fast, s), deadline)
    return (cuts, makespan) if viol == 0 else None


def heuristic(problem: PartitionProblem, *, stage_counts: Sequence[int] | None = None,
              time_limit: float = 5.0) -> PartitionResult | None:
    """Balanced-compute cuts improved by local search on the exact model (the warm start).

    Feasible but not proven optimal; None if no candidate stage count found a fitting plan.

    >>> heuristic(prob).makespan        # seconds, an upper bound on solve(prob).makespan
    """
    t0 = time.perf_counter()
    fast = _Fast(problem)
    cands = _candidates(problem, stage_counts)
    best = None
    for i, s in enumerate(cands):
        left = t0 + time_limit - time.perf_counter()
        found = _heuristic_for(fast, s, time.perf_counter() + max(left, 0.0) / (len(cands) - i))
        if found and (best is None or found[1] < best[1]):
            best = found
    if best is None:
        return None
    ev = evaluate(problem, best[0])
    return _result(ev, SolverInfo("heuristic", "feasible", ev.makespan, math.nan, time.perf_counter() - t0,
                                  0, 0, cands))


def _candidates(problem: PartitionProblem, stage_counts: Sequence[int] | None, extra: int = 4) -> tuple[int, ...]:
    """`stage_counts`, or plan_stage_count_candidates plus the `extra` other S whose balanced
    cuts score best (one evaluation per S: e.g. S = L, one layer per stage, can beat every
    multiple of N when blocks are small)."""
    L = len(problem.layers)
    if stage_counts is None:
        base = plan_stage_count_candidates(L, len(problem.gpus))
        fast = _Fast(problem)
        scored = sorted((fast.score(_balanced_cuts(fast, s)), s) for s in range(1, L + 1) if s not in base)
        return tuple(sorted(set(base) | {s for (v, m), s in scored[:extra] if v == 0}))
    bad = [s for s in stage_counts if not 1 <= s <= L]
    if bad or not stage_counts:
        raise PlanError(f"stage_counts {tuple(stage_counts)} must be non-empty and within 1..{L} "
                        f"(the number of layers)")
    return tuple(sorted(set(int(s) for s in stage_counts)))


# ------------------------------------------------------------------------------------ MIP
def _runs(problem: PartitionProblem) -> list[tuple[int, int]]:
    """(start, length) of maximal runs of layers with equal cost numbers (what the model reads)."""
    key = lambda l: (l.fwd_time, l.bwd_time, l.param_bytes, l.grad_bytes, l.output_bytes)
    runs: list[tuple[int, int]] = []
    for i, l in enumerate(problem.layers):
        if runs and key(problem.layers[runs[-1][0]]) == key(l):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


@dataclass
class _Mip:
    lp: pulp.LpProblem
    s: int
    scale: float  # seconds per objective unit
    z: dict  # (k, r) -> var; cut k falls after a layer of run r
    t: dict  # (k, r) -> var or int multiplier (layers of run r before cut k)
    F: list
    B: list
    T: pulp.LpVariable
    infeasible: bool = False  # a constant memory row already fails (e.g. S = 1 too big)


def _var(lp: pulp.LpProblem, name: str, lo: float | None = None, hi: float | None = None,
         cat: str = pulp.LpContinuous) -> pulp.LpVariable:
    if hasattr(lp, "add_variable"):  # PuLP >= 3.3 (the 4.0 API)
        return lp.add_variable(name, lo, hi, cat=cat)
    return pulp.LpVariable(name, lo, hi, cat=cat)  # pragma: no cover - older PuLP


def _build_mip(problem: PartitionProblem, fast: _Fast, runs: list[tuple[int, int]], s: int) -> _Mip:
    n, m, L = len(problem.gpus), problem.microbatches, len(problem.layers)
    # Normalise: times in units of `scale` seconds, memory rows in units of capacity.
    scale = max(fast.f[L] + fast.b[L] + fast.w[L] / min(problem.up) + fast.g[L] / min(problem.down), 1e-30)
    lp = pulp.LpProblem(f"mobius_partition_S{s}", pulp.LpMinimize)
    z, t = {}, {}
    # A linear form of the prefix sums at each cut: {"f": expr, "b":..., "w":..., "g":..., "a":...}
    at: list[dict[str, Any]] = [{q: 0.0 for q in "fbwga"}]
    for k in range(1, s):
        lo_layer, hi_layer = k - 1, L - s + k - 1  # the layer just before cut k
        forms = {q: pulp.LpAffineExpression() for q in "fbwga"}
        pos = pulp.LpAffineExpression()
        for r, (start, length) in enumerate(runs):
            t_lo, t_hi = max(1, lo_layer - start + 1), min(length, hi_layer - start + 1)
            if t_lo > t_hi:
                continue
            zv = _var(lp, f"z_{k}_{r}", 0, 1, pulp.LpBinary)
            z[k, r] = zv
            if t_lo == t_hi:
                tv: Any = t_lo * zv
                t[k, r] = t_lo
            else:
                tv = _var(lp, f"t_{k}_{r}", 0, t_hi, pulp.LpInteger)
                t[k, r] = tv
                lp += tv >= t_lo * zv
                lp += tv <= t_hi * zv
            pos += start * zv + tv
            per = {"f": fast.f[start + 1] - fast.f[start], "b": fast.b[start + 1] - fast.b[start],
                   "w": fast.w[start + 1] - fast.w[start], "g": fast.g[start + 1] - fast.g[start]}
            for q in "fbwg":
                base = {"f": fast.f, "b": fast.b, "w": fast.w, "g": fast.g}[q][start]
                forms[q] += base * zv + per[q] * tv
            forms["a"] += fast.out[start] * zv
        lp += pulp.lpSum(zv for (kk, _), zv in z.items() if kk == k) == 1, f"one_run_{k}"
        forms["pos"] = pos
        at.append(forms)
    at.append({"f": fast.f[L], "b": fast.b[L], "w": fast.w[L], "g": fast.g[L], "a": fast.out[L - 1], "pos": L})
    at[0]["pos"] = 0
    for k in range(1, s):  # cuts in order, runs in order
        lp += at[k + 1]["pos"] - at[k]["pos"] >= 1, f"order_{k}"
        if k + 1 < s:
            for r in range(len(runs)):
                a = [z[k, rr] for rr in range(r + 1) if (k, rr) in z]
                b = [z[k + 1, rr] for rr in range(r + 1) if (k + 1, rr) in z]
                if b:
                    lp += pulp.lpSum(a) >= pulp.lpSum(b), f"run_order_{k}_{r}"
    part = lambda q, k: at[k + 1][q] - at[k][q]
    f = [part("f", k) * (1 / scale) for k in range(s)]
    b = [part("b", k) * (1 / scale) for k in range(s)]
    w = [part("w", k) for k in range(s)]
    bmem = [part("w", k) + part("g", k) + 2 * fast.work + m * (at[k]["a"] + at[k + 1]["a"]) for k in range(s)]
    infeasible = False
    for k in range(s):
        cap = problem.capacity[k % n] * (1 + _MEM_TOL)
        row = (bmem[k] + bmem[k + n] if k + n < s else bmem[k]) * (1 / cap)
        if not isinstance(row, pulp.LpAffineExpression) or not row.keys():
            infeasible |= float(row if not isinstance(row, pulp.LpAffineExpression) else row.constant) > 1
        elif k + n < s or k < n:  # a stage k >= n is in the pair (k - n, k) already
            lp += row <= 1, f"memory_{k}"
    hop = [0.0 if problem.hop[k % n] == math.inf else 1 / (problem.hop[k % n] * scale) for k in range(s)]
    F = [[_var(lp, f"F_{k}_{i}", 0) for i in range(m)] for k in range(s)]
    B = [[_var(lp, f"B_{k}_{i}", 0) for i in range(m)] for k in range(s)]
    for k in range(s):
        upk = 1 / (problem.up[k % n] * scale)
        if k < n:
            lp += F[k][0] >= w[k] * upk, f"upload_{k}"
        else:
            lp += F[k][0] >= F[k - n][m - 1] + f[k - n], f"gpu_free_f{k}"
            lp += F[k][0] >= F[k - n][0] + w[k] * upk, f"prefetch_f{k}"
        for i in range(m):
            if i:
                lp += F[k][i] >= F[k][i - 1] + f[k], f"mb_f{k}_{i}"
            if k:
                lp += F[k][i] >= F[k - 1][i] + f[k - 1] + at[k]["a"] * hop[k - 1], f"act_f{k}_{i}"
    for k in range(s - 1, -1, -1):
        upk = 1 / (problem.up[k % n] * scale)
        if k == s - 1:
            lp += B[k][0] >= F[k][m - 1] + f[k], "turn"
        elif k < s - n:
            lp += B[k][0] >= B[k + n][m - 1] + b[k + n], f"gpu_free_b{k}"
            lp += B[k][0] >= B[k + n][0] + w[k] * upk, f"prefetch_b{k}"
        for i in range(m):
            if i:
                lp += B[k][i] >= B[k][i - 1] + b[k], f"mb_b{k}_{i}"
            if k < s - 1:
                lp += B[k][i] >= B[k + 1][i] + b[k + 1] + at[k + 1]["a"] * hop[k], f"grad_b{k}_{i}"
    T = _var(lp, "makespan", 0)
    lp += T >= B[0][m - 1] + b[0] + part("g", 0) * (1 / (problem.down[0] * scale)), "end"
    lp += T
    return _Mip(lp, s, scale, z, t, F, B, T, infeasible)


def _warm(mip: _Mip, problem: PartitionProblem, runs: list[tuple[int, int]], cuts: Sequence[int]) -> None:
    """Set initial values of every variable from a feasible cut set."""
    for v in mip.lp.variables():
        v.setInitialValue(0)
    for k in range(1, mip.s):
        layer = cuts[k] - 1
        r = next(i for i, (a, n) in enumerate(runs) if a <= layer < a + n)
        mip.z[k, r].setInitialValue(1)
        if isinstance(mip.t[k, r], pulp.LpVariable):
            mip.t[k, r].setInitialValue(layer - runs[r][0] + 1)
    ev = evaluate(problem, cuts)
    for k in range(mip.s):
        for i in range(problem.microbatches):
            mip.F[k][i].setInitialValue(ev.fwd_start[k][i] / mip.scale)
            mip.B[k][i].setInitialValue(ev.bwd_start[k][i] / mip.scale)
    mip.T.setInitialValue(ev.makespan / mip.scale)


def _cuts_of(mip: _Mip, runs: list[tuple[int, int]]) -> tuple[int, ...]:
    cuts = [0]
    for k in range(1, mip.s):
        r = max((key[1] for key in mip.z if key[0] == k), key=lambda r: mip.z[k, r].value() or 0)
        tv = mip.t[k, r]
        cuts.append(runs[r][0] + (round(tv.value()) if isinstance(tv, pulp.LpVariable) else tv))
    return tuple(cuts)


class _WarmHiGHS(pulp.HiGHS):
    """PuLP's highspy interface plus a MIP start (PuLP 3.3 does not pass one to highspy)."""

    def __init__(self, *args, warm: bool = False, **kw):
        super().__init__(*args, **kw)
        self.warm = warm

    def callSolver(self, lp):
        h = lp.solverModel
        if self.warm:
            import numpy as np
            cols = lp.variables()
            vals = np.array([v.varValue if v.varValue is not None else 0.0 for v in cols], dtype=np.float64)
            h.setSolution(len(cols), np.arange(len(cols), dtype=np.int32), vals)
        h.run()


def _run_solver(mip: _Mip, solver: str, time_limit: float, gap_rel: float, warm: bool,
                cutoff: float | None) -> tuple[str, float, float]:
    """Solve; return (status, objective, best bound), both in objective units (inf if none)."""
    lp = mip.lp
    if solver == "highs":
        import highspy
        opts = {"mip_feasibility_tolerance": 1e-7}
        if cutoff is not None:
            opts["objective_bound"] = cutoff
        cmd = _WarmHiGHS(msg=False, timeLimit=max(time_limit, 0.05), gapRel=gap_rel, warm=warm, **opts)
        lp.solve(cmd)
        h = lp.solverModel
        st, info = h.getModelStatus(), h.getInfo()
        K = highspy.HighsModelStatus
        has_sol = info.primal_solution_status == 2 and mip.T.value() is not None
        obj = mip.T.value() if has_sol else math.inf
        bound = info.mip_dual_bound if info.mip_dual_bound == info.mip_dual_bound else -math.inf
        if has_sol:  # HiGHS 1.16 can report both values shifted by a presolve offset after a
            bound += obj - info.objective_function_value  # restart; the columns are right
        # With a cutoff the search only covers objectives below it: whatever it proves is
        # "optimum >= min(bound, cutoff)", and finishing without beating it settles S.
        cut = cutoff if cutoff is not None else math.inf
        if st == K.kOptimal:
            if obj > cut * (1 + 1e-9):
                return "cut off", obj, cut
            return "optimal", obj, min(bound, obj)
        if st in (K.kInfeasible, K.kUnboundedOrInfeasible, K.kObjectiveBound):
            return ("cut off", obj, cut) if cutoff is not None else ("infeasible", math.inf, math.inf)
        return ("time limit" if obj < math.inf else "no solution"), obj, min(bound, cut)
    with tempfile.TemporaryDirectory() as tmp:  # CBC: no cutoff; its bound is read from the log
        log = os.path.join(tmp, "cbc.log")
        with warnings.catch_warnings():  # PuLP 3.3 deprecates its bundled CBC; it is still the
            warnings.simplefilter("ignore", DeprecationWarning)  # one CBC that is always there
            cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=round(max(time_limit, 0.2), 2), gapRel=gap_rel,
                                    warmStart=warm, logPath=log)
        lp.solve(cmd)
        text = Path(log).read_text() if os.path.exists(log) else ""
    result = re.search(r"^Result - (.*)$", text, re.M)
    result = result.group(1).lower() if result else ""
    if "infeasible" in result or pulp.LpStatus[lp.status] == "Infeasible":
        return "infeasible", math.inf, math.inf
    obj = pulp.value(lp.objective) if lp.sol_status in (1, 2) else math.inf
    if "optimal" in result:
        return "optimal", obj, obj * (1 - gap_rel)
    found = re.findall(r"best possible ([-+0-9.eE]+)", text)
    bound = float(found[-1]) if found else -math.inf
    return ("time limit" if obj < math.inf else "no solution"), obj, min(bound, obj)


def _span(problem: PartitionProblem, cuts: Sequence[int], k: int) -> str:
    edges, ls = list(cuts) + [len(problem.layers)], problem.layers
    a, z = edges[k], edges[k + 1] - 1
    return ls[a].name if a == z else f"{ls[a].name}..{ls[z].name}"


def _worst_row(problem: PartitionProblem, cuts: Sequence[int]) -> tuple[float, str]:
    """The most overfull memory rule of a cut set: (need / capacity, description)."""
    st, n, s = _Fast(problem).stages(cuts), len(problem.gpus), len(cuts)
    worst = (-math.inf, "")
    for k in range(s):
        cap, gpu = problem.capacity[k % n], problem.gpus[k % n]
        rows = [(st.bmem[k], f"stage {k} ({_span(problem, cuts, k)}) needs {{}} in backward")]
        if k + n < s:
            rows.append((st.bmem[k] + st.bmem[k + n],
                         f"stages {k} and {k + n} ({_span(problem, cuts, k)} and {_span(problem, cuts, k + n)}) "
                         f"need {{}} together in backward (the double buffer)"))
        for need, text in rows:
            if need / cap > worst[0]:
                worst = (need / cap, text.format(fmt_bytes(need)) + f" on {gpu}, which has {fmt_bytes(cap)} usable")
    return worst


def _explain_infeasible(problem: PartitionProblem, cands: Sequence[int], unknown: Sequence[int]) -> str:
    """The binding reason, with numbers, and what to do about it."""
    fast, ls = _Fast(problem), problem.layers
    L, n, frac = len(ls), len(problem.gpus), problem.memory_fraction
    big = max(range(n), key=lambda i: problem.capacity[i])
    cap, gname = problem.capacity[big], problem.gpus[big]
    remedy = ("stream weights in half precision (dtype=torch.float16), use more micro-batches (less working "
              "memory each), raise memory_fraction, or use GPUs with more memory")
    # The smallest stage holding each layer (backward needs at least as much as forward).
    need, arg = [math.inf] * L, [(0, 0)] * L
    for a in range(L):
        for z in range(a + 1, L + 1):
            st = fast.stages([a, z] if z < L else [a])
            for i in range(a, z):
                if st.bmem[0] < need[i]:
                    need[i], arg[i] = st.bmem[0], (a, z)
    worst = max(range(L), key=lambda i: need[i])
    if need[worst] > cap * (1 + _MEM_TOL):
        a, z = arg[worst]
        st = fast.stages([a, z] if z < L else [a])
        acts = st.bmem[0] - st.w[0] - st.g[0] - 2 * fast.work
        return (f"layer {ls[worst].name} needs {fmt_bytes(need[worst])} in backward (weights {fmt_bytes(st.w[0])} "
                f"+ gradients {fmt_bytes(st.g[0])} + working 2x{fmt_bytes(fast.work)} + boundary activations "
                f"{fmt_bytes(acts)}) but the largest GPU, {gname}, has {fmt_bytes(cap)} usable (memory_fraction "
                f"{frac:g} of {fmt_bytes(cap / frac)}); {remedy}")
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
def _cache_key(problem: PartitionProblem, settings: dict) -> str:
    blob = json.dumps({"problem": asdict(problem), "settings": settings}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("MOBIUS_FX_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mobius_fx" / "plans"


def _pick_solver(solver: str) -> str:
    if solver not in ("auto", "highs", "cbc"):
        raise PlanError(f"solver={solver!r}; use 'auto', 'highs' or 'cbc'")
    highs_ok = pulp.HiGHS().available()
    if solver == "highs" and not highs_ok:
        raise PlanError("solver='highs' but highspy is not installed; pip install highspy or use solver='cbc'")
    return "highs" if solver == "auto" and highs_ok else ("cbc" if solver == "auto" else solver)


def solve(problem: PartitionProblem, *, solver: str = "auto", time_limit: float = 20.0,
          stage_counts: Sequence[int] | None = None, cache_dir: str | os.PathLike | None = None,
          progress: Callable[[str], None] | None = None, gap_rel: float = 1e-4) -> PartitionResult:
    """The best partition over the candidate stage counts, by MIP; raises PlanError if none fits.

    `time_limit` (s) is the whole solve's budget, shared by the candidates S (best heuristic
    first; each later one must beat the incumbent). The reported gap is against the smallest
    bound over all candidates. Results are cached in `cache_dir` (default $MOBIUS_FX_CACHE or
    ~/.cache/mobius_fx/plans), keyed by the problem's numbers and these settings.

    >>> solve(prob, time_limit=10).boundaries
    (0, 3, 7, 11)
    """
    t_start = time.perf_counter()
    name = _pick_solver(solver)
    cands = _candidates(problem, stage_counts)
    say = progress or (lambda msg: None)
    settings = {"solver": name, "time_limit": time_limit, "stage_counts": cands, "gap_rel": gap_rel, "v": 1}
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

    fast, runs = _Fast(problem), _runs(problem)
    heur_end = t_start + min(0.15 * time_limit, 3.0)
    states: dict[int, _Candidate] = {}
    for i, s in enumerate(cands):
        left = max(heur_end - time.perf_counter(), 0.0)
        found = _heuristic_for(fast, s, time.perf_counter() + left / (len(cands) - i))
        states[s] = _Candidate(s, cuts=tuple(found[0]) if found else None,
                               makespan=found[1] if found else math.inf)
    deadline = t_start + time_limit
    # Pass 1: every candidate, best heuristic first, with half the time; each must beat the
    # incumbent. Pass 2: the rest of the time to candidates still open, lowest bound first.
    first = sorted(cands, key=lambda s: (states[s].makespan, s))
    pass1_end = time.perf_counter() + 0.5 * max(deadline - time.perf_counter(), 0.0)
    for i, s in enumerate(first):
        if time.perf_counter() >= deadline and any(c.makespan < math.inf for c in states.values()):
            say(f"S={s}: skipped, time_limit reached")  # no bound: the reported gap says so
            continue
        left = max(pass1_end - time.perf_counter(), 0.0)
        _attempt(states, s, problem, fast, runs, name, left / (len(first) - i), gap_rel, say)
    while True:
        best = min(states.values(), key=lambda c: c.makespan)
        open_ = sorted((c for c in states.values() if c.status not in ("optimal", "infeasible", "cut off")
                        and c.bound < best.makespan * (1 - gap_rel)), key=lambda c: c.bound)
        left = deadline - time.perf_counter()
        if not open_ or left < 0.2:
            break
        for i, c in enumerate(open_):
            left = max(deadline - time.perf_counter(), 0.0)
            _attempt(states, c.s, problem, fast, runs, name, left / (len(open_) - i), gap_rel, say)
        if deadline - time.perf_counter() < 0.2:
            break
    best = min(states.values(), key=lambda c: c.makespan)
    if best.cuts is None or best.makespan == math.inf:
        unknown = sorted(c.s for c in states.values() if c.status != "infeasible")
        raise PlanError(_explain_infeasible(problem, cands, unknown))
    lower = min(c.bound for c in states.values())
    gap = max(0.0, (best.makespan - lower) / best.makespan) if best.makespan > 0 else 0.0
    status = "optimal" if gap <= gap_rel else ("time limit" if any(c.status == "time limit" for c in states.values())
                                               else "feasible")
    ev = evaluate(problem, best.cuts)
    lp = best.mip.lp if best.mip is not None else None
    info = SolverInfo(name, status, ev.makespan, gap, time.perf_counter() - t_start,
                      lp.numVariables() if lp else 0, lp.numConstraints() if lp else 0, cands)
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
    mip: _Mip | None = None


def _attempt(states: dict[int, _Candidate], s: int, problem: PartitionProblem, fast: _Fast,
             runs: list[tuple[int, int]], name: str, limit: float, gap_rel: float,
             say: Callable[[str], None]) -> None:
    """One solver run for stage count s, warm-started from its best cut set, cut off at the
    best makespan of any candidate; updates states[s]."""
    c, t0 = states[s], time.perf_counter()
    if c.mip is None:
        c.mip = _build_mip(problem, fast, runs, s)
    mip = c.mip
    if c.cuts is not None:
        _warm(mip, problem, runs, c.cuts)
    incumbent = min(x.makespan for x in states.values())
    cutoff = incumbent / mip.scale if incumbent < math.inf else None
    if mip.infeasible:
        status, obj, bound = "infeasible", math.inf, math.inf
    else:
        status, obj, bound = _run_solver(mip, name, limit, gap_rel, c.cuts is not None, cutoff)
    c.bound = max(c.bound, bound * mip.scale)
    c.status = status
    if obj < math.inf and status != "cut off":
        ev = evaluate(problem, _cuts_of(mip, runs))
        if ev is None:  # accepted within the solver's tolerance, rejected by the exact check
            c.status += " (solver point failed the exact memory check)"
        elif ev.makespan < c.makespan:
            c.cuts, c.makespan = ev.boundaries, ev.makespan
    say(f"S={s}: {c.status}, best {fmt_time(c.makespan) if c.makespan < math.inf else 'none'}, "
        f"bound {fmt_time(max(c.bound, 0.0))}, {time.perf_counter() - t0:.2f} s")
