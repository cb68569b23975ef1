"""The named choices the package offers, each listed once and imported where it is used.

A list kept in two places drifts (one gains a name the other refuses), so every kind list lives
here; `tests/unit/test_architecture.py` fails on a second literal copy anywhere in `mobius_fx`,
`passes/` or `benchmarks/`. This module imports nothing, so the command line, the options and
the passes read it without importing the runtime.

- `DEVICES`: what plays the GPUs (`compile(device=...)`, `make_devices`).
- `SOLVERS`: the MIP solvers `plan(solver=...)` takes.
- `SCHEDULES`: the step schedules the simulator knows (`simulate(schedule=...)`), in the
  comparison table's order; `DATA_PARALLEL_SCHEDULES` those `simulate(servers=R > 1)` takes.
- `OVERLAP_MODES`: when the CPU optimizer steps relative to the pipeline ("none": after the
  step; "sync": per stage as its gradients land; "async": a step late), for the runtime
  (`Pipeline.overlap(optimizer, mode=...)`), the simulator (`optimizer_overlap=`) and the CLI.
"""

from __future__ import annotations

__all__ = ["DEVICES", "SOLVERS", "SCHEDULES", "DATA_PARALLEL_SCHEDULES", "OVERLAP_MODES"]

DEVICES = ("auto", "virtual", "virtual-async", "cuda")
SOLVERS = ("auto", "highs", "cbc")
SCHEDULES = ("mobius", "mobius-noprefetch", "mobius-identity-map", "gpipe", "zero3-offload", "roundpipe")
OVERLAP_MODES = ("none", "sync", "async")
# The schedules `simulate(servers=R > 1)` runs data-parallel (GPipe and ZeRO-3 offload are
# simulated on one server only).
DATA_PARALLEL_SCHEDULES = tuple(s for s in SCHEDULES if s not in ("gpipe", "zero3-offload"))
