"""mobius_fx: fine-tune models larger than your GPUs on one multi-GPU server.

A compiler over torch.fx that implements Mobius (Feng et al., ASPLOS 2023):
trace -> annotate -> partition (MIP) -> cross_map -> insert_transfers -> emit.

    import mobius_fx
    from mobius_fx import Topology
    topo = Topology.virtual(gpus=4, memory="256MiB")
    pipe = mobius_fx.compile(model, topo, example_inputs=(x,), microbatches=4)
    print(pipe.plan)
"""

from __future__ import annotations

import importlib

from .errors import BudgetError, MobiusError, PlanError, TopologyError, TraceError

__version__ = "0.1.0"

# Public name -> module that defines it. Imported on first use so `import mobius_fx` stays
# fast and the CLI can print --help without importing transformers or solvers.
_LAZY = {
    "trace": "tracing",
    "Topology": "topology", "GPU": "topology",
    "DeviceSpec": "costs", "NodeCost": "costs", "LayerCost": "costs",
    "Plan": "plans", "Stage": "plans", "Transfer": "plans", "SolverInfo": "plans",
    "plan": "api", "compile": "api",
    "simulate": "simulator", "SimResult": "simulator",
    "Pipeline": "pipeline_module",
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
