"""`CompileOptions`: the settings `plan`, `compile` and the command line share, validated once.

One frozen dataclass, one set of defaults. Every pass reads its settings from here
(`ctx.settings.microbatches`, ...), so a bad value is refused before any work starts,
with the value, the rule and the remedy:

    >>> CompileOptions(microbatches=4, dtype="bf16").dtype
    torch.bfloat16
    >>> CompileOptions(microbatches=True)
    Traceback (most recent call last):
    ...
    mobius_fx.errors.MobiusError: microbatches=True is a bool; it must be a positive int (micro-batches per step; Mobius uses one per GPU)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .errors import MobiusError

__all__ = ["CompileOptions", "CompileContext"]

_COSTS = ("auto", "model", "measure")
_SOLVERS = ("auto", "highs", "cbc")
_CROSS_MAPS = ("contention", "paper", "identity")
_DEVICES = ("auto", "virtual", "cuda")


def _positive_int(name: str, value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "a bool" if isinstance(value, bool) else f"a {type(value).__name__}"
        raise MobiusError(f"{name}={value!r} is {kind}; it must be a positive int ({what})")
    if value < 1:
        raise MobiusError(f"{name}={value!r}; it must be a positive int ({what})")
    return value


def _positive_float(name: str, value: Any, what: str, *, at_most: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MobiusError(f"{name}={value!r} is not a number; it must be a positive number ({what})")
    if not math.isfinite(value) or value <= 0 or (at_most is not None and value > at_most):
        rule = f"in (0, {at_most:g}]" if at_most is not None else "positive and finite"
        raise MobiusError(f"{name}={value!r}; it must be {rule} ({what})")
    return float(value)


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise MobiusError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")
    return value


def streamed_dtype(dtype: Any) -> torch.dtype | None:
    """The dtype weights are streamed and computed in on the GPUs, as a torch dtype (None: the
    masters' own). Strings such as "bf16", "float16" or "torch.float16" are accepted; a
    non-floating dtype is refused, since weights are trained in it."""
    if dtype is None:
        return None
    value = dtype
    if isinstance(dtype, str):
        from .costs import dtype_name

        value = getattr(torch, dtype_name(dtype), None)
    if not isinstance(value, torch.dtype):
        raise MobiusError(f"dtype={dtype!r} is not a torch dtype; use torch.bfloat16, torch.float16, torch.float32 "
                          f"or None (the masters' dtype)")
    if not value.is_floating_point:
        raise MobiusError(f"dtype={dtype!r} is not a floating dtype; weights are trained in the streamed dtype, so it "
                          f"must be torch.bfloat16, torch.float16 or torch.float32 (quantised weights: keep them "
                          f"frozen in the model and stream in a floating dtype)")
    return value


@dataclass(frozen=True)
class CompileOptions:
    """What a plan or compile may be told, each checked here.

    `microbatches`: micro-batches per step (Mobius runs one per GPU). `costs`: "model" (roofline,
    works on meta tensors), "measure" or "auto". `dtype`: the streamed dtype on the GPUs (fp32
    masters stay in DRAM). `memory_fraction`: the share of each GPU a plan may use. `solver`:
    "auto" | "highs" | "cbc". `time_limit`: the MIP's whole budget in seconds. `cross_map`:
    "contention" | "paper" | "identity". `cache_dir`: where solved partitions are kept.
    `device`: "auto" | "virtual" | "cuda" or `{gpu name: Device}` (compile only). `device_spec`:
    the cost model's device (default: the topology's first GPU). `verbose`: progress on stderr.
    `max_variants` (compile only): how many call signatures a pipeline compiles a variant for
    (other keyword arguments, or shapes its graph does not hold for: mobius_fx/signatures.py);
    1 keeps the compiled signature fixed and refuses any other call with a MobiusError.
    """

    microbatches: int = 1
    costs: str = "auto"
    dtype: torch.dtype | None = None
    memory_fraction: float = 0.9
    solver: str = "auto"
    time_limit: float = 20.0
    cross_map: str = "contention"
    cache_dir: str | None = None
    device: Any = "auto"
    device_spec: Any = None
    verbose: bool = True
    max_variants: int = 8

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        _positive_int("microbatches", self.microbatches, "micro-batches per step; Mobius uses one per GPU")
        _choice("costs", self.costs, _COSTS)
        set_("dtype", streamed_dtype(self.dtype))
        set_("memory_fraction", _positive_float("memory_fraction", self.memory_fraction,
                                                "the share of each GPU's memory a plan may use", at_most=1.0))
        _choice("solver", self.solver, _SOLVERS)
        set_("time_limit", _positive_float("time_limit", self.time_limit, "the MIP's budget in seconds"))
        _choice("cross_map", self.cross_map, _CROSS_MAPS)
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, bytes)) \
                and not hasattr(self.cache_dir, "__fspath__"):
            raise MobiusError(f"cache_dir={self.cache_dir!r} is not a path; pass a directory path or None")
        if not isinstance(self.device, Mapping):
            _choice("device", self.device, _DEVICES)
        if not isinstance(self.verbose, bool):
            raise MobiusError(f"verbose={self.verbose!r}; it must be True or False")
        _positive_int("max_variants", self.max_variants,
                      "compiled variants per pipeline, one per call signature; 1 = a fixed signature")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass
class CompileContext:
    """Everything a compile carries between passes: inputs, settings and the facts passes write.

    `facts` names what is available so far; passes read inputs from attributes here. Each field
    is the fact of its name, except `gm` ("graph") and `example_kwargs` ("example_inputs");
    `facts`, `timings` and `touched` are the pipeline's bookkeeping, not facts.
    """

    model: torch.nn.Module
    topology: Any
    example_inputs: tuple = ()
    example_kwargs: dict = field(default_factory=dict)
    settings: CompileOptions = field(default_factory=CompileOptions)
    gm: torch.fx.GraphModule | None = None
    layers: tuple = ()
    partition: Any = None
    order: tuple = ()
    plan: Any = None
    stages: Any = None
    pipeline: Any = None
    facts: set = field(default_factory=lambda: {"model", "topology", "example_inputs", "settings"})
    timings: dict = field(default_factory=dict)
    touched: dict = field(default_factory=dict)  # pass name -> Touched, as run
