"""The planner's choice of schedule: the fastest registered candidate that fits, and why.

    c = choose(plan)                       # every candidate (registry.candidates())
    c.name, c.line                         # "split-head", "schedule: split-head (simulated fwd+bwd ...)"
    choose(plan, runnable=True)            # only those the runtime executes (what compile runs)
    choose(plan, "roundpipe")              # the user's: checked that it exists and fits
    plan, c = choose_count(plan_at, (8, 16, 32))   # and the micro-batch count: plan_at(m) -> Plan
    plan, c = choose_count(plan_at, (8, 16, 32), replan=replan_at)   # the chosen count's own cuts too

"Fastest" is the simulated forward + backward (`SimResult.pipeline_time`: the GPUs and the links,
gradients in host memory), not the step: the host optimizer is the same for every candidate.
Baselines (`Schedule.baseline`: GPipe, ZeRO-3 offload, the Mobius ablations) are never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from mobius_fx.errors import MobiusError, PlanError
from mobius_fx.schedules.registry import candidates, get
from mobius_fx.schedules.registry import names as registered

__all__ = ["Choice", "choose", "choose_count"]

log = logging.getLogger("mobius_fx")


@dataclass(frozen=True)
class Choice:
    """The chosen schedule, the line that says why, and each candidate's simulated fwd+bwd in
    seconds (or why it was not simulated or does not fit)."""

    name: str
    line: str
    times: dict[str, float | str] = field(default_factory=dict)

    @property
    def runnable(self) -> bool:
        return get(self.name).runnable


def _fmt(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 0.1 else f"{seconds * 1e3:.3g} ms"


def choose(plan: Any, schedule: str | None = None, *, runnable: bool = False, **simulate_kwargs: Any) -> Choice:
    """The schedule for `plan`: `schedule` when given (it must be registered, and, with
    `runnable`, executable by the runtime; a PlanError when it does not fit), else the candidate
    (`registry.candidates(runnable=runnable)`) with the least simulated fwd+bwd among those that
    fit. When only one candidate is left nothing is simulated. `simulate_kwargs` go to `simulate`."""
    from mobius_fx.sim.simulator import simulate  # the simulator imports this package

    if schedule is not None:
        s = get(schedule)
        if runnable and not s.runnable:
            raise MobiusError(f"schedule={schedule!r} is simulated but the runtime does not execute it yet; "
                              f"compile runs one of {', '.join(n for n in registered() if get(n).runnable)}: pass one of those, "
                              f"or leave schedule out (plan(..., schedule={schedule!r}) simulates it)")
        if runnable and s.fits is not None:  # its runtime form on this plan (GPipe: every weight resident)
            try:
                s.fits(plan)
            except PlanError as e:
                raise PlanError(f"schedule={schedule!r} does not fit this model: {e}") from None
        try:
            t = simulate(plan, schedule=schedule, **simulate_kwargs).pipeline_time
        except PlanError as e:  # the simulated form is another IR than the one the runtime runs
            if not (runnable and not s.runs_as_simulated):
                raise
            why = str(e).splitlines()[0]
            return Choice(schedule, f"schedule: {schedule} (the caller's; its simulated form does not fit: {why})",
                          {schedule: "does not fit: " + why})
        return Choice(schedule, f"schedule: {schedule} (the caller's; simulated fwd+bwd {_fmt(t)})", {schedule: t})
    names = candidates(runnable=runnable)
    if not names:
        raise MobiusError("no schedule to choose from: every registered schedule is a baseline"
                          + (" or not executable by the runtime" if runnable else "")
                          + "; register one with mobius_fx.schedules.register(name, build)")
    if len(names) == 1:
        why = ("the only candidate compile picks by itself; compile(schedule=) runs the others the runtime executes"
               if runnable else "the only candidate registered")
        return Choice(names[0], f"schedule: {names[0]} ({why})", {names[0]: "not simulated"})
    times: dict[str, float | str] = {}
    for n in names:
        try:
            times[n] = simulate(plan, schedule=n, **simulate_kwargs).pipeline_time
        except MobiusError as e:  # PlanError included: the schedule does not fit
            times[n] = "does not fit: " + str(e).splitlines()[0]
    fits = {n: t for n, t in times.items() if isinstance(t, float)}
    if not fits:
        raise MobiusError(f"no candidate schedule fits this plan: " +
                          "; ".join(f"{n}: {t}" for n, t in times.items()))
    best = min(fits, key=lambda n: (fits[n], names.index(n)))
    others = ", ".join(f"{n} {_fmt(t)}" if isinstance(t, float) else f"{n} does not fit"
                       for n, t in times.items() if n != best)
    line = f"schedule: {best} (simulated fwd+bwd {_fmt(fits[best])} vs {others}; the fastest that fits"
    entry = get(best)
    if not entry.runnable or not entry.runs_as_simulated:
        ran = [n for n in fits if n in candidates(runnable=True)]
        pick = f"{min(ran, key=fits.get)} ({_fmt(fits[min(ran, key=fits.get)])})" if ran else "none of these"
        line += ("; not executable by the runtime yet: compile runs " + pick if not entry.runnable else
                 f"; the runtime runs it in another form (compile(schedule={best!r})): compile by itself runs {pick}")
    return Choice(best, line + ")", times)


NO_BUBBLE = 1.02  # a count whose fwd+bwd is within this of its plan's lower bound leaves no bubble to shrink
REPLANNED = 1  # how many of the fastest counts on the default's cuts choose_count plans again with their own MIP

Timed = tuple[Any, Choice, float]  # a count's plan, its schedule's Choice, that schedule's simulated fwd+bwd


def choose_count(plan_at: Callable[[int], Any], counts: Sequence[int], schedule: str | None = None, *,
                 alone: str = "", replan: Callable[[int], Any] | None = None, replanned: int | None = None,
                 kept_why: str = "", **simulate_kwargs: Any) -> tuple[Any, Choice]:
    """The micro-batch count the planner picks when the caller gives none, with its plan.

    `counts` (the default first, then ascending: `planning.microbatch.candidate_counts`) are
    planned by `plan_at(m)` in turn (the default's plan, the others on the default's cuts), each
    with its schedule chosen by `choose` (the simulated fwd+bwd that ranks the schedules); the
    fastest count wins, the fewer micro-batches on a tie.
    Raising stops at the first count slower than the best so far (the bubble no longer
    shrinks; each micro-batch adds its own costs) or once the best is within `NO_BUBBLE` of its
    plan's lower bound, so plan() simulates no more counts than it needs. A count whose plan or
    every schedule does not fit (MobiusError) is passed over; when none fits, the first error is
    raised.

    Then the `replanned` (default `REPLANNED`) fastest counts other than the default are planned
    again with their own cuts by `replan(m)` (api.plan: the MIP solved at m, time-limited) and
    their schedule chosen anew (`_replanned`); a count keeps its own cuts when its chosen schedule
    runs faster on them, or as fast (split-head re-cuts into one-layer slots and reads no cuts)
    while the fastest schedule compile runs by itself does; then the fastest count wins again.
    Without `replan` the default's cuts stay (the caller's `cuts=`: `kept_why` names them).

    The Choice's line is the schedule's, then the count and why, then the cuts, e.g. "; 32
    micro-batches (simulated fwd+bwd 2.27 s vs 2.76 s at 8, 2.38 s at 16; fwd+bwd / lower bound
    1.35 at 8, 1.11 at 32: the fill/drain bubble shrinks); cuts: its own MIP's (2.27 s vs 2.41 s
    on the cuts planned at 8)"; with one count, `alone` says why no other was timed. The plan's
    `microbatches_rule` says the count was chosen."""
    default = counts[0]
    tried, stop = _time_counts(plan_at, counts, schedule, simulate_kwargs)
    fits = {m: r for m, r in tried.items() if not isinstance(r, str)}
    if len(counts) == 1:
        plan, c, t = fits[default]
        why = f"{default} micro-batches ({'; '.join(x for x in (plan.microbatches_rule, alone) if x) or 'the default'})"
        return plan, Choice(c.name, f"{c.line}; {why}", c.times)
    kept = dict(fits)  # each count on the default's cuts
    own: dict[int, Timed | str] = {}
    if replan is not None:
        ranked = sorted(fits, key=lambda m: (fits[m][2], m))[:REPLANNED if replanned is None else replanned]
        own = _replanned([m for m in ranked if m != default], kept, replan, default, schedule, simulate_kwargs)
        fits.update({m: r for m, r in own.items() if not isinstance(r, str) and _rank(r) < _rank(kept[m])})
    best = min(fits, key=lambda m: (fits[m][2], m))
    plan, c, t = fits[best]
    others = ", ".join(f"{_fmt(fits[m][2])} at {m}" if m in fits else f"{m} does not fit"
                       for m in tried if m != best)
    why = f"{best} micro-batches (simulated fwd+bwd {_fmt(t)} vs {others}"
    if best != default and default in fits:
        d_plan, _, d_t = fits[default]
        why += (f"; fwd+bwd / lower bound {d_t / d_plan.lower_bound():.2f} at {default}, "
                f"{t / plan.lower_bound():.2f} at {best}: the fill/drain bubble shrinks")
    elif best == default:
        why += f"; the default ({plan.microbatches_rule or 'one per GPU'}) is the fastest"
    cuts = _cuts_clause(best, default, kept[best], own.get(best), fits[best] is not kept[best], kept_why)
    counted = ", ".join(map(str, tried))
    rule = f"chosen: the fastest simulated fwd+bwd of {counted}"
    if best == default and plan.microbatches_rule:
        rule = f"{plan.microbatches_rule}, the fastest simulated fwd+bwd of {counted}"
    plan = dataclasses.replace(plan, microbatches_rule=rule)
    return plan, Choice(c.name, f"{c.line}; {why}{stop}); cuts: {cuts}", c.times)


def _timed(plan_of: Callable[[int], Any], m: int, schedule: str | None, simulate_kwargs: dict) -> Timed:
    """m micro-batches planned by `plan_of`, its schedule chosen, and that schedule's fwd+bwd."""
    from mobius_fx.sim.simulator import simulate  # the simulator imports this package

    p = plan_of(m)
    c = choose(p, schedule, **simulate_kwargs)
    t = c.times.get(c.name)
    if not isinstance(t, float):  # one candidate: choose simulated nothing
        t = simulate(p, schedule=c.name, **simulate_kwargs).pipeline_time
    return p, c, t


def _time_counts(plan_at: Callable[[int], Any], counts: Sequence[int], schedule: str | None,
                 simulate_kwargs: dict) -> tuple[dict[int, Timed | str], str]:
    """Each count `plan_at` plans, timed in turn until raising stops (choose_count's rule), or
    why it does not fit; and why the counts left were not timed. Raises the first error when
    no count fits."""
    tried: dict[int, Timed | str] = {}
    first_error: MobiusError | None = None
    for m in counts:
        fits = {k: r for k, r in tried.items() if not isinstance(r, str)}
        if fits:
            last, stop = max(fits), ""
            best_t = min(r[2] for r in fits.values())
            if fits[last][2] > best_t:
                stop = f"{last} was slower than {min(fits, key=lambda k: fits[k][2])}"
            elif fits[last][2] <= NO_BUBBLE * fits[last][0].lower_bound():
                stop = f"{last} is within {NO_BUBBLE:.2f}x the lower bound"
            if stop:
                return tried, f"; {', '.join(str(k) for k in counts if k > last)} not timed: {stop}"
        try:
            tried[m] = _timed(plan_at, m, schedule, simulate_kwargs)
        except MobiusError as e:
            first_error = first_error or e
            tried[m] = "does not fit: " + str(e).splitlines()[0]
    if all(isinstance(r, str) for r in tried.values()):
        assert first_error is not None
        raise first_error
    return tried, ""


def _replanned(counts: Sequence[int], kept: dict[int, Timed], replan: Callable[[int], Any], default: int,
               schedule: str | None, simulate_kwargs: dict) -> dict[int, Timed | str]:
    """Each of `counts` planned again with its own cuts by `replan` and timed, or why not (it
    does not fit); logged, since each runs a MIP (time-limited)."""
    own: dict[int, Timed | str] = {}
    for m in counts:
        log.info("choosing the micro-batch count: %d micro-batches ran %s on the cuts planned at %d; planning %d "
                 "with its own cuts (MIP)", m, _fmt(kept[m][2]), default, m)
        t0 = time.perf_counter()
        try:
            own[m] = _timed(replan, m, schedule, simulate_kwargs)
        except MobiusError as e:
            own[m] = "does not fit: " + str(e).splitlines()[0]
            log.info("choosing the micro-batch count: %d with its own cuts %s", m, own[m])
            continue
        log.info("choosing the micro-batch count: %d with its own cuts ran %s (%s on the default's; compile's %s) "
                 "after %.1f s; %s kept", m, _fmt(own[m][2]), _fmt(kept[m][2]), _said(own[m], kept[m]),
                 time.perf_counter() - t0, "its own cuts" if _rank(own[m]) < _rank(kept[m]) else "the default's")
    return own


def _runs(c: Choice) -> tuple[str, float] | None:
    """The fastest schedule compile runs by itself (`candidates(runnable=True)`) among those
    `c` timed, and its fwd+bwd; None when it timed none."""
    ran = {n: t for n, t in c.times.items() if isinstance(t, float) and n in candidates(runnable=True)}
    return min(ran.items(), key=lambda x: (x[1], x[0])) if ran else None


def _said(own: Timed, kept: Timed) -> str:
    """The fastest schedule compile runs by itself on each cuts: 'mobius 7.2 s vs 7.5 s'."""
    mine, theirs = _runs(own[1]), _runs(kept[1])
    return f"{mine[0]} {_fmt(mine[1])} vs {theirs[0]} {_fmt(theirs[1])}" if mine and theirs else "not timed"


def _rank(r: Timed) -> tuple[float, float]:
    """What a count's plans on other cuts are ranked by: the chosen schedule's fwd+bwd, then
    (a tie: split-head reads no cuts) the fwd+bwd of the fastest schedule compile runs by itself."""
    ran = _runs(r[1])
    return r[2], ran[1] if ran else r[2]


def _cuts_clause(best: int, default: int, kept: Timed, own: Timed | str | None, chose_own: bool,
                 kept_why: str) -> str:
    """Whose cuts the chosen count's plan has, and why (choose_count's line)."""
    if best == default:
        return kept_why or "its own MIP's"
    if own is None:
        return kept_why or f"those planned at {default} (its own MIP not run)"
    if isinstance(own, str):
        return f"those planned at {default} (its own MIP's {own})"
    if own[2] != kept[2]:
        return (f"its own MIP's ({_fmt(own[2])} vs {_fmt(kept[2])} on the cuts planned at {default})" if chose_own else
                f"those planned at {default} (its own MIP's: {_fmt(own[2])}, no faster)")
    if _rank(own) == _rank(kept):
        return f"those planned at {default} (its own MIP's: {_fmt(own[2])}, no faster)"
    tie = f"{_fmt(own[2])} on either; {_said(own, kept)}"
    return (f"its own MIP's ({tie} on the cuts planned at {default})" if chose_own else
            f"those planned at {default} (its own MIP's: {tie} on these)")
