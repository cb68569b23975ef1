"""The named choices the package offers, each listed once and imported where it is used.

A list kept in two places drifts (one gains a name the other refuses), so every kind list lives
here; `tests/unit/test_architecture.py` fails on a second literal copy anywhere in `mobius_fx`,
`passes/` or `benchmarks/`. This module imports nothing, so the command line, the options and
the passes read it without importing the runtime. The schedules the simulator knows are not a
list but a registry, `mobius_fx.schedules` (`names()`, `data_parallel_names()`): each schedule's
module registers its own name.

- `HOST`: the name of the host's DRAM wherever a place is named (topology, schedule IR, devices).
- `DEVICES`: what plays the GPUs by name (`compile(device=...)`, `make_devices`): "auto" and the
  built-in device kinds, each registered by its own module `runtime/device_<kind>.py`; a kind
  registered later (`mobius_fx.runtime.device_registry.register_device`) is taken too (docs/devices.md).
- `SOLVERS`: the MIP solvers `plan(solver=...)` takes.
- `OVERLAP_MODES`: when the CPU optimizer steps relative to the pipeline ("none": after the
  step; "sync": per stage as its gradients land; "async": a step late), for the runtime
  (`Pipeline.overlap(optimizer, mode=...)`), the simulator (`optimizer_overlap=`) and the CLI.
- `OVERLAP_DEFAULT`: the mode `Pipeline.overlap` steps in when none is given, and the CLI's
  `--optimizer-overlap` default ("sync": the same weights as stepping after backward).
"""

from __future__ import annotations

__all__ = ["HOST", "DEVICES", "SOLVERS", "OVERLAP_MODES", "OVERLAP_DEFAULT"]

HOST = "host"  # the host's DRAM (masters, saved inputs, long-lived values): its name in the topology, the IR and the devices
DEVICES = ("auto", "virtual", "virtual-async", "cuda")
SOLVERS = ("auto", "highs", "cbc")
OVERLAP_MODES = ("none", "sync", "async")
OVERLAP_DEFAULT = "sync"
