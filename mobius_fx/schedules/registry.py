"""The one registry of the schedules the simulator knows, by name.

Each schedule's module (`mobius_fx/schedules/<name>.py`) registers itself here on import; the
simulator (`simulate(schedule=...)`), the comparison table (`report.compare`), the command line
and `benchmarks/paper.py` read the names from here, in registration order (the table's order).

    from mobius_fx.schedules import register, unregister, names
    register("toy", build, summary="...")     # build(ctx): add the step's tasks to a sim.tasks.Context
    register("toy2", build, runtime=no_prefetch)  # ... and runs for real (compile(schedule="toy2"))
    simulate(plan, schedule="toy"); names()   # (..., "roundpipe", "toy")
    candidates(); candidates(runnable=True)   # what the planner chooses among: ("mobius", ..., "toy"); ("mobius",)
    unregister("toy")
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mobius_fx.errors import MobiusError

__all__ = ["Schedule", "register", "unregister", "get", "names", "data_parallel_names", "candidates", "OPTIMIZERS"]

# Whose CPU optimizer a schedule's step runs (`Schedule.optimizer`): "user" is the user's torch
# optimizer (`simulate(cpu_adam_bandwidth=)`), "deepspeed" DeepSpeedCPUAdam
# (`simulate(deepspeed_adam_bandwidth=)`).
OPTIMIZERS = ("user", "deepspeed")


@dataclass(frozen=True)
class Schedule:
    """A named schedule: `build(ctx)` adds one training step's tasks to `ctx`
    (a `mobius_fx.sim.tasks.Context` over the plan, its topology and the host's figures).

    `data_parallel`: `simulate(servers=R > 1)` takes it (it steps a CPU optimizer per stage);
    `optimizer`: whose CPU optimizer it steps (OPTIMIZERS), so `SimResult` reports that speed;
    `summary`: one line on what it models;
    `runnable`: the runtime executes it (`compile` picks only among these; `plan` and the CLI
    name the fastest of all and say when it is not executable yet);
    `baseline`: a comparison (another system's schedule, an ablation), simulated and tabled
    but never chosen by the planner (`candidates`);
    `runtime`: its IR as the pipeline runtime runs it, a transform of the compiled pipeline's
    Mobius IR (mobius_fx/planning/ir_transforms.py; None: it runs in the simulator only, `refusal`
    says why; `runnable` says whether it has one); `cross_map`: the cross map it needs;
    `runs_as_simulated`: False when the runtime form runs another IR than `build` simulates
    (RoundPipe's: its last stage not fused), so compile's choice among the runnable schedules,
    which goes by simulated time (`candidates(runnable=True)`), leaves it out; `compile(schedule=)`
    still runs it; `fits`: for a schedule whose runtime form holds more on a GPU than the plan
    was made for (GPipe's resident weights), fits(plan) raises PlanError naming the stage, its
    GPU and the bytes when the compiled plan does not fit that form (`choose` calls it)."""

    name: str
    build: Callable[[Any], None]
    data_parallel: bool = False
    optimizer: str = "user"
    summary: str = ""
    runtime: Callable[[Any], Any] | None = None
    cross_map: str | None = None
    refusal: str = ""
    baseline: bool = False
    runs_as_simulated: bool = True
    fits: Callable[[Any], None] | None = None

    @property
    def runnable(self) -> bool:
        """Whether the runtime executes it (`compile` picks only among these)."""
        return self.runtime is not None


_REGISTRY: dict[str, Schedule] = {}


def register(name: str, build: Callable[[Any], None], *, data_parallel: bool = False, optimizer: str = "user",
             summary: str = "", runtime: Callable[[Any], Any] | None = None, cross_map: str | None = None,
             refusal: str = "", baseline: bool = False, runs_as_simulated: bool = True,
             fits: Callable[[Any], None] | None = None) -> Schedule:
    """Make `build` the schedule `name` for `simulate`, the comparison table, the CLI and (unless
    `baseline`) the planner's choice (`runtime`: how the runtime executes it; see `Schedule`)."""
    if not isinstance(name, str) or not name or name != name.strip():
        raise MobiusError(f"a schedule's name is a non-empty string without surrounding spaces, got {name!r}")
    if name in _REGISTRY:
        raise MobiusError(f"schedule {name!r} is registered already (by {_REGISTRY[name].build.__module__}); "
                          f"pick another name, or unregister({name!r}) first")
    if not callable(build):
        raise MobiusError(f"schedule {name!r}: build={build!r} is not callable; give a function of the "
                          f"simulator's context that adds the step's tasks")
    if optimizer not in OPTIMIZERS:
        raise MobiusError(f"schedule {name!r}: optimizer={optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    _REGISTRY[name] = Schedule(name, build, data_parallel, optimizer, summary, runtime, cross_map, refusal,
                               bool(baseline), bool(runs_as_simulated), fits)
    return _REGISTRY[name]


def unregister(name: str) -> None:
    """Forget schedule `name` (a test's toy schedule, after the test)."""
    get(name)
    del _REGISTRY[name]


def get(name: str) -> Schedule:
    """The schedule registered as `name`; a MobiusError naming the valid ones otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise MobiusError(f"unknown schedule {name!r}; valid schedules: {', '.join(_REGISTRY)}") from None


def names() -> tuple[str, ...]:
    """Every registered schedule, in registration order (the comparison table's)."""
    return tuple(_REGISTRY)


def data_parallel_names() -> tuple[str, ...]:
    """The schedules `simulate(servers=R > 1)` runs data parallel."""
    return tuple(n for n, s in _REGISTRY.items() if s.data_parallel)


def candidates(*, runnable: bool = False) -> tuple[str, ...]:
    """The schedules the planner chooses among (every one not a `baseline`), in registration
    order; with `runnable`, only those the runtime executes as they are simulated."""
    return tuple(n for n, s in _REGISTRY.items()
                 if not s.baseline and (not runnable or s.runnable and s.runs_as_simulated))
