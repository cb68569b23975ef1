"""The planner's choice of schedule: the fastest registered candidate that fits, and why.

    c = choose(plan)                       # every candidate (registry.candidates())
    c.name, c.line                         # "split-head", "schedule: split-head (simulated fwd+bwd ...)"
    choose(plan, runnable=True)            # only those the runtime executes (what compile runs)
    choose(plan, "roundpipe")              # the user's: checked that it exists and fits

"Fastest" is the simulated forward + backward (`SimResult.pipeline_time`: the GPUs and the links,
gradients in host memory), not the step: the host optimizer is the same for every candidate.
Baselines (`Schedule.baseline`: GPipe, ZeRO-3 offload, the Mobius ablations) are never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mobius_fx.errors import MobiusError, PlanError
from mobius_fx.schedules.registry import candidates, get
from mobius_fx.schedules.registry import names as registered

__all__ = ["Choice", "choose"]


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
