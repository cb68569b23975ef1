"""`solve`: the best partition over every stage count, by closed-form and LP bounds, the local
search and the MIP (passes/partition.py's docstring describes the method), cached on disk.

    result = solve(PartitionProblem.from_topology(layers, topo, microbatches=4), time_limit=10)
"""

from __future__ import annotations

import hashlib
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
from mobius_fx.planning.step_model import PartitionProblem, PrefixSums, SolverInfo, evaluate, layer_runs
from mobius_fx.planning.step_memory import MEMORY_TOLERANCE
from mobius_fx.units import fmt_time

from ._partition_mip import Mip, build_mip, cuts_of, warm_start
from .mip_solver import run_solver
from .partition_bounds import lp_bound, stage_count_bound
from .partition_infeasible import explain_infeasible
from .partition_search import (
    LOCAL_SEARCH_COUNTS, PartitionResult, candidates, improve_count, result_of, seed_cuts,
)

__all__ = ["solve", "MODEL_REVISION"]


# The timing model's revision: part of the cache key, so a plan solved under an older model (a
# different program for the same numbers) is not reused. Bump it with any change to the program.
MODEL_REVISION = ("2026-12-04: memory rows (a neighbour holds its weights and boundary activations), working memory "
                  "once in backward over the layers' saved bytes; duplex share by priority, uploads on a shared "
                  "uplink take the first server; 2026-12-06: the host's pass (HostPass: sync's per-stage passes, "
                  "async's max, none's tail); async's hand-over into the fp32 .grad after the pipeline (HostPass.after, "
                  "keep_grads); the gradients' landings replayed beside the backward uploads (landings.shared_landings); "
                  "2026-12-06 (4th): a stage's weights and its relayed inputs share the GPU's own link (inlink); "
                  "2026-12-07: the inputs relayed while the weights upload delay them (their flows share the link)")


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
          progress: Callable[[str], None] | None = None, gap_rel: float = 1e-4,
          hint: Sequence[int] | None = None) -> PartitionResult:
    """The best partition over the candidate stage counts (default every one, 1..L); raises
    PlanError if none fits.

    `time_limit` (s) is the whole solve's budget: at most 10% (2 s) for the local search, the
    LP bounds until 85%, the MIPs on the counts still open after (passes/partition.py's
    docstring). The reported gap is against the smallest bound over all candidates, those the
    time left with their closed-form bound only included. Results are cached in `cache_dir`
    (default $MOBIUS_FX_CACHE or ~/.cache/mobius_fx/plans), keyed by the problem's numbers and
    these settings. `hint`: stage boundaries to start from (another micro-batch count's plan):
    when they fit, they are their stage count's incumbent, so the result is never worse than
    them under the step model, however short the time.

    solve(prob, time_limit=10).boundaries   # e.g. (0, 3, 7, 11)
    """
    t_start = time.perf_counter()
    name = _pick_solver(solver)
    cands = candidates(problem, stage_counts)
    say = progress or (lambda msg: None)
    settings = {"solver": name, "time_limit": time_limit, "stage_counts": cands, "gap_rel": gap_rel, "v": 6}  # v: the model and solver (bump when either changes)
    if hint is not None:
        settings["hint"] = [int(b) for b in hint]
    path = _cache_dir(cache_dir) / f"{_cache_key(problem, settings)}.json"
    cached = _cached(problem, path, say)
    if cached is not None:
        return cached
    search = _Search(problem, PrefixSums(problem), layer_runs(problem), name, gap_rel, say, t_start + time_limit)
    search.seed(cands, hint)  # 1. every count: its closed-form bound and its balanced cuts (or the hint)
    search.improve(cands, t_start + min(0.1 * time_limit, 2.0))  # 2. the local search (10% of the time, 2 s)
    search.lp_bounds(cands, t_start + 0.85 * time_limit)  # 3. the LP bounds, until 85% of the time
    search.mips()  # 4. the MIP on the counts still open
    ev, info = search.best(cands, t_start)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"boundaries": list(ev.boundaries), "solver": asdict(info)}, default=list))
    except OSError:
        pass  # a read-only cache is not an error; the plan is still good
    return result_of(ev, info)


def _cached(problem: PartitionProblem, path: Path, say: Callable[[str], None]) -> PartitionResult | None:
    """The plan cached at `path` when it still fits `problem` (timed anew), else None."""
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
        ev = evaluate(problem, d["boundaries"])
        if ev is not None:
            say(f"reusing cached plan {path}")
            info = SolverInfo(**{**d["solver"], "stage_counts": tuple(d["solver"]["stage_counts"]), "cached": True})
            return result_of(ev, info)
    except (KeyError, TypeError, ValueError, PlanError):
        pass  # a stale or foreign file: solve again and overwrite it
    return None


@dataclass
class _Candidate:
    """Search state of one stage count S across solver passes (costs in seconds)."""

    s: int
    cuts: tuple[int, ...] | None = None
    makespan: float = math.inf
    bound: float = -math.inf
    status: str = "not solved"
    mip: Mip | None = None


@dataclass
class _Search:
    """`solve`'s state: every stage count's `_Candidate`, settled one way or another in turn."""

    problem: PartitionProblem
    fast: PrefixSums
    runs: list
    name: str  # the solver
    gap_rel: float
    say: Callable[[str], None]
    deadline: float
    states: dict = None  # s -> _Candidate

    def incumbent(self) -> float:
        return min(c.makespan for c in self.states.values())

    def settled(self, c: _Candidate) -> bool:
        return c.status in ("optimal", "infeasible", "cut off") or c.bound >= self.incumbent() * (1 - self.gap_rel)

    def seed(self, cands: Sequence[int], hint: Sequence[int] | None = None) -> None:
        """Every count's closed-form bound and its balanced cuts (one evaluation or two), or
        `hint` for its count when it fits and the seed does not or scores worse."""
        self.states = {s: _Candidate(s, bound=stage_count_bound(self.problem, s, self.fast)) for s in cands}
        seeds = {s: seed_cuts(self.fast, s) for s in cands}
        hint = list(hint or ())
        if hint and hint[0] == 0 and hint == sorted(set(hint)) and hint[-1] < len(self.problem.layers) \
                and len(hint) in seeds:
            score = self.fast.score(list(hint))
            if score[0] == 0 and tuple(score) < tuple(seeds[len(hint)][1]):  # fits; a seed that does not loses
                seeds[len(hint)] = (list(hint), score)
        for s, (cuts, (viol, makespan)) in seeds.items():
            if viol == 0:
                self.states[s].cuts, self.states[s].makespan = tuple(cuts), makespan

    def improve(self, cands: Sequence[int], end: float) -> None:
        """The local search on the best seeds of the counts left open, until `end`."""
        states = self.states
        local = sorted((s for s in cands if not self.settled(states[s])),
                       key=lambda s: (states[s].makespan, s))[:LOCAL_SEARCH_COUNTS]
        for i, s in enumerate(local):
            left = max(end - time.perf_counter(), 0.0)
            c = states[s]
            found = improve_count(self.fast, s, time.perf_counter() + left / (len(local) - i),
                                  list(c.cuts) if c.cuts else None)
            if found and found[1] < c.makespan:
                c.cuts, c.makespan = tuple(found[0]), found[1]

    def lp_bounds(self, cands: Sequence[int], end: float) -> None:
        """The LP bound of every count the closed form left open, lowest bound (then best plan)
        first, until `end`: most counts end here, their bound above the incumbent or infeasible.
        (An LP bound costs less than a MIP's root, which a short MIP run on a large program may
        not reach; with the LP bounds the gap holds still from run to run.)"""
        states, t0 = self.states, time.perf_counter()
        by_closed_form = [s for s in cands if self.settled(states[s])]
        by_lp, no_lp = [], []
        for s in sorted(cands, key=lambda s: (states[s].bound, states[s].makespan, s)):
            c = states[s]
            if self.settled(c):
                continue
            if time.perf_counter() >= end:
                no_lp.append(s)
                continue
            status, bound = lp_bound(self.problem, self.fast, self.runs, s, self.name,
                                     self.deadline - time.perf_counter())
            if status == "infeasible":
                c.status = "infeasible"
            c.bound = max(c.bound, bound)
            if self.settled(c):
                by_lp.append(s)
        best = self.incumbent()
        self.say(f"{len(cands)} stage counts: {len(by_closed_form)} settled by the closed-form bound, {len(by_lp)} "
                 f"by the LP bound ({time.perf_counter() - t0:.2f} s), {len(no_lp)} without an LP bound (time), "
                 f"best so far {fmt_time(best) if best < math.inf else 'none'}")

    def mips(self) -> None:
        """The MIP on the counts still open, lowest bound first, cut off at the incumbent; passes
        over them until every one is settled or the time is up."""
        while True:
            open_ = sorted((c for c in self.states.values() if not self.settled(c)), key=lambda c: (c.bound, c.s))
            if not open_ or self.deadline - time.perf_counter() < 0.2:
                break
            for i, c in enumerate(open_):
                if self.settled(c):
                    continue
                left = max(self.deadline - time.perf_counter(), 0.0)
                if left < 0.05 and i:
                    break
                self.attempt(c.s, left / (len(open_) - i))
        if self.incumbent() == math.inf:  # out of time without a plan: one more run per count (a late
            # plan beats none; the error in `best` needs every count settled or tried)
            for c in sorted((c for c in self.states.values() if not self.settled(c)), key=lambda c: (c.bound, c.s)):
                self.attempt(c.s, 0.5)
                if self.incumbent() < math.inf:
                    break

    def best(self, cands: Sequence[int], t_start: float) -> tuple:
        """(the best plan's Evaluation, its SolverInfo); PlanError when no count has a plan."""
        states, problem = self.states, self.problem
        best = min(states.values(), key=lambda c: c.makespan)
        if best.cuts is None or best.makespan == math.inf:
            unknown = sorted(c.s for c in states.values() if c.status != "infeasible")
            raise PlanError(explain_infeasible(problem, cands, unknown))
        lower = min(c.bound for c in states.values())  # every count's: the gap is over all of them
        gap = max(0.0, (best.makespan - lower) / best.makespan) if best.makespan > 0 else 0.0
        # (1 + 1e-9): CBC proves only the bound obj * (1 - gap_rel), which rounds to just above gap_rel
        timed_out = any(not self.settled(c) for c in states.values())
        status = "optimal" if gap <= self.gap_rel * (1 + 1e-9) else ("time limit" if timed_out else "feasible")
        ev = evaluate(problem, best.cuts)
        if best.mip is None:  # settled without a MIP run: the size of its program all the same
            best.mip = build_mip(problem, self.fast, self.runs, best.s, mem_tol=MEMORY_TOLERANCE)
        lp = best.mip.lp
        return ev, SolverInfo(self.name, status, ev.makespan, gap, time.perf_counter() - t_start,
                              lp.numVariables(), lp.numConstraints(), cands)

    def attempt(self, s: int, limit: float) -> None:
        """One solver run for stage count s, cut off at the best makespan of any candidate (CBC:
        warm-started from s's best cut set; HiGHS gets no start); updates states[s]."""
        problem, runs, name = self.problem, self.runs, self.name
        c, t0 = self.states[s], time.perf_counter()
        if c.mip is None:
            c.mip = build_mip(problem, self.fast, runs, s, mem_tol=MEMORY_TOLERANCE)
        mip = c.mip
        warm = c.cuts is not None and name == "cbc"
        if warm:
            warm_start(mip, runs, evaluate(problem, c.cuts))
        incumbent = self.incumbent()
        cutoff = incumbent / mip.scale if incumbent < math.inf else None
        if mip.infeasible:
            status, obj, bound = "infeasible", math.inf, math.inf
        else:
            status, obj, bound = run_solver(mip, name, limit, self.gap_rel, warm, cutoff)
        c.bound = max(c.bound, bound * mip.scale)
        c.status = status
        if obj < math.inf and status != "cut off":
            ev = evaluate(problem, cuts_of(mip, runs))
            if ev is None:  # accepted within the solver's tolerance, rejected by the exact check
                c.status += " (solver point failed the exact memory check)"
            elif ev.makespan < c.makespan:
                c.cuts, c.makespan = ev.boundaries, ev.makespan
        self.say(f"S={s}: {c.status}, best {fmt_time(c.makespan) if c.makespan < math.inf else 'none'}, "
                 f"bound {fmt_time(max(c.bound, 0.0))}, {time.perf_counter() - t0:.2f} s")
