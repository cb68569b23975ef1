"""The schedules the simulator knows, one module each, registered by name in one registry.

    mobius_fx/schedules/registry.py        register(name, build), get(name), names(), candidates()
    mobius_fx/schedules/choice.py          choose(plan): the fastest candidate that fits, and why
    mobius_fx/schedules/mobius.py          "mobius": the plan's schedule IR, as the runtime runs it
    mobius_fx/schedules/mobius_noprefetch.py    "mobius-noprefetch": ... uploads after the stage before
    mobius_fx/schedules/mobius_identity_map.py  "mobius-identity-map": ... stage k on GPU k % N
    mobius_fx/schedules/gpipe.py           "gpipe": every weight resident
    mobius_fx/schedules/zero3_offload.py   "zero3-offload": DeepSpeed ZeRO-3 with CPU offload
    mobius_fx/schedules/roundpipe.py       "roundpipe": RoundPipe-style round-robin dispatch
    mobius_fx/schedules/split_head.py      "split-head": one-layer slots, the loss stage dealt to every GPU
    mobius_fx/schedules/ir_tasks.py        the one task builder, from the schedule IR
    mobius_fx/schedules/looped_ir.py       the schedule IR of a looped pipeline (slots): the baselines'
    mobius_fx/schedules/layer_units.py     per-layer costs, for the baselines that re-cut a plan

Importing this package registers the schedules above, in this order (the comparison table's).
To add one: a module that calls `register("name", build)` and is imported (here, or by the
user before `simulate(plan, schedule="name")`); `simulate`, `report.compare` and the CLI's
table then run it. `build(ctx)` produces one step's schedule IR (mobius_fx/planning/schedule_ir.py)
and hands it to `ir_tasks.tasks_from_ir`, which adds its tasks to the `sim.tasks.Context`.
"""

from __future__ import annotations

# Registered on import, in the comparison table's order (keep it: not alphabetical).
from mobius_fx.schedules import mobius  # noqa: F401  (isort: skip: the order registers the table's rows)
from mobius_fx.schedules import mobius_noprefetch  # noqa: F401
from mobius_fx.schedules import mobius_identity_map  # noqa: F401
from mobius_fx.schedules import gpipe  # noqa: F401
from mobius_fx.schedules import zero3_offload  # noqa: F401
from mobius_fx.schedules import roundpipe  # noqa: F401
from mobius_fx.schedules import split_head  # noqa: F401
from mobius_fx.schedules.registry import (OPTIMIZERS, Schedule, candidates, data_parallel_names, get, names, register,
                                         unregister)

__all__ = ["Schedule", "register", "unregister", "get", "names", "data_parallel_names", "candidates", "OPTIMIZERS"]
