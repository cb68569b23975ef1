"""mobius_fx: fine-tune models larger than your GPUs on one multi-GPU server.

A compiler over torch.fx that implements Mobius (Feng et al., ASPLOS 2023):
trace -> annotate -> partition (MIP + cross_map) -> plan -> insert_transfers -> emit.

    import mobius_fx
    from mobius_fx import Topology
    topo = Topology.virtual(gpus=4, memory="256MiB")
    pipe = mobius_fx.compile(model, topo, example_inputs=(x,), microbatches=4)
    print(pipe.plan)
"""

from __future__ import annotations

import importlib

from mobius_fx.errors import BudgetError, MobiusError, PlanError, TopologyError, TraceError

__version__ = "0.1.0"


def _passes_from_checkout() -> None:
    """Make `mobius_fx.passes` importable when running from a plain checkout.

    An install maps the top-level `passes/` folder to `mobius_fx.passes` (pyproject's
    package-dir); a checkout on `sys.path` without an install has no such mapping, so a GPU box
    with torch but no package index could not run `benchmarks/gpu_check.py`. When the
    package sits in a checkout (a pyproject.toml and a `passes/` folder beside it), the
    subpackage is loaded from that folder under its installed name, so the checkout's own passes
    run even where another copy of the project is installed (its submodules then resolve through
    its `__path__`)."""
    import importlib.util
    import sys
    from pathlib import Path

    name = f"{__name__}.passes"
    root = Path(__file__).resolve().parent.parent
    folder = root / "passes"
    checkout = (root / "pyproject.toml").is_file() and (folder / "__init__.py").is_file()
    if name in sys.modules or not checkout:
        return  # an installed copy: its own mobius_fx/passes
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    globals()["passes"] = module  # as the import system binds a subpackage on its parent


_passes_from_checkout()

# Public name -> module that defines it. Imported on first use so `import mobius_fx` stays
# fast and the CLI can print --help without importing transformers or solvers.
_LAZY = {
    "trace": "tracing",
    "Topology": "topology.server", "GPU": "topology.server",
    "DeviceSpec": "topology.device_specs", "NodeCost": "planning.costs", "LayerCost": "planning.costs",
    "Plan": "planning.plans", "Stage": "planning.plans", "Transfer": "planning.plans", "SolverInfo": "planning.plans",
    "plan": "api", "compile": "api",
    "simulate": "sim.simulator", "SimResult": "sim.simulator",
    "Pipeline": "runtime.pipeline",
    "CompileOptions": "options",
}

__all__ = ["MobiusError", "TraceError", "PlanError", "TopologyError", "BudgetError", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mobius_fx' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
