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
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from mobius_fx.errors import MobiusError, PlanError
from mobius_fx.kinds import OVERLAP_DEFAULT, OVERLAP_MODES, SOLVERS
from mobius_fx.planning.microbatch import check_batch_dims, check_count, default_microbatches
from mobius_fx.precision import Precision

if TYPE_CHECKING:  # pragma: no cover  (build imports the runtime: no need to load it for the options)
    from mobius_fx.build import Wiring

__all__ = ["CompileOptions", "CompileContext"]

_COSTS = ("auto", "model", "measure")
_CROSS_MAPS = ("contention", "paper", "identity")


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


def _cuts(value: Any) -> tuple[int, ...] | None:
    """`cuts=`: None (the MIP cuts) or the first layer index of every stage after the first,
    strictly increasing from 1. That they lie below the layer count is checked once the model is
    traced (mobius_fx.passes.partition.given_partition)."""
    if value is None:
        return None
    rule = ("cuts are the index (in plan.layers) of the first layer of every stage after the first: ints >= 1, "
            "strictly increasing, e.g. cuts=[1, 5] for stages [0,1), [1,5), [5,L); cuts=[] is one stage")
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise PlanError(f"cuts={value!r} is not a list of layer indices; {rule}")
    cuts = tuple(value)
    bad = [c for c in cuts if isinstance(c, bool) or not isinstance(c, numbers.Integral)]
    if bad:
        raise PlanError(f"cuts={list(cuts)!r} holds {bad[0]!r}, which is not an int; {rule}")
    cuts = tuple(int(c) for c in cuts)
    if cuts and cuts[0] < 1:
        raise PlanError(f"cuts={list(cuts)} starts at {cuts[0]}, but stage 0 always starts at layer 0, so the "
                          f"first cut must be >= 1; {rule}")
    wrong = next((i for i in range(1, len(cuts)) if cuts[i] <= cuts[i - 1]), None)
    if wrong is not None:
        raise PlanError(f"cuts={list(cuts)} is not strictly increasing ({cuts[wrong - 1]} then {cuts[wrong]}); "
                          f"{rule}; sort them and drop repeats")
    return cuts


@dataclass(frozen=True)
class CompileOptions:
    """What a plan or compile may be told, each checked here.

    `microbatches`: micro-batches per step; None (the default) takes one per GPU when the batch
    divides, else the largest divisor of the batch below the GPU count (`default_microbatches`;
    `resolved` fills it in and `microbatches_rule` says which rule chose it). `cuts`: None
    (the MIP partitions) or a given partition, the index of the first layer of every stage after
    the first (`[]` is one stage); the plan is built and timed for exactly those stages. `costs`: "model" (roofline,
    works on meta tensors), "measure" or "auto". `dtype`: the streamed dtype on the GPUs (the
    masters stay in DRAM in their own dtype; None streams that one); `precision` (set by `for_model`,
    not given): the `Precision` record of `dtype` and the model's masters every pass reads. `memory_fraction`: the share of each GPU a plan may use. `solver`:
    "auto" | "highs" | "cbc". `time_limit`: the MIP's whole budget in seconds. `cross_map`:
    "contention" | "paper" | "identity". `cache_dir`: where solved partitions are kept (and, under
    `traces/`, traced graphs and layer costs). `cache`: reuse traced graphs and layer costs from
    the cache (mobius_fx/compile_cache.py; also off with MOBIUS_FX_TRACE_CACHE=0).
    `device`: "auto" | "virtual" | "virtual-async" (the CPU stand-in of the CUDA path) | "cuda" or
    `{gpu name: Device}` (compile only). `device_spec`: the cost model's device (default: the
    topology's first GPU). `verbose`: progress on stderr.
    `max_variants` (compile only): how many call signatures a pipeline compiles a variant for
    (other keyword arguments, or shapes its graph does not hold for: mobius_fx/runtime/variants.py);
    1 keeps the compiled signature fixed and refuses any other call with a MobiusError.
    `batch_dims`: None (guess: README "Micro-batch semantics") or {forward argument name: 0 (batched
    along dim 0, split into micro-batches) or None (not batched: whole to every micro-batch)}.
    `memory_books` (compile only): how each GPU measures its stages' work (mobius_fx/runtime/device_books.py):
    "ops" charges every tensor per op (Python on every op), "allocator" measures each stage's
    work by the allocator and checks the budget when it ends, "auto" (the default) is "ops" on
    virtual devices and "allocator" on CUDA.
    `optimizer`: the optimizer you step the masters with, for the host memory budget ("adamw" (the
    default), "adam", "sgd-momentum", "sgd" or "none": mobius_fx/planning/host_memory.py; it plans
    the bytes only, the optimizer itself is yours). `host_memory_fraction`: the share of the
    topology's host DRAM (`Topology.host_memory`) the plan may need, in (0, 1] (default 0.9); a plan
    that needs more is refused with a `PlanError` naming the remedies; None plans without checking.
    `optimizer_overlap`: how the CPU optimizer will step (`Pipeline.overlap`'s mode, "sync" by
    default, "async" or "none"), so the planner charges the host work the step waits for
    (mobius_fx/planning/host_step.py, `HostPass`) at the topology's measured host speeds.
    `keep_grads`: whether the overlap writes the fp32 `.grad` (`OverlapOptimizer.keep_grads`, True
    by default, as the runtime; False for a loop that sets `opt.keep_grads = False`): under "sync"
    the fused pass writes it (4 B per parameter), under "async" the main thread converts the
    downloads into it after the pipeline (6 B per parameter in bf16, before the update launches).
    `widen_downloads`: whether the GPUs widen the gradients the overlap keeps as the fp32 `.grad`
    to fp32 and download them straight into it (`OverlapOptimizer.widen_downloads`; 2 more bytes
    per parameter on the GPU->host links, no conversion on the host). None (the default): the
    planner's choice (passes/partition.py `widen_choice`: widened where each GPU's links to the
    host are its own and full duplex, elsewhere whichever gives the shorter step in the step model).
    """

    microbatches: int | None = None
    cuts: tuple[int, ...] | None = None
    costs: str = "auto"
    dtype: torch.dtype | None = None
    precision: Precision | None = None  # the dtypes of this model's pipeline (`for_model`), None until a model is given
    memory_fraction: float = 0.9
    solver: str = "auto"
    time_limit: float = 20.0
    cross_map: str = "contention"
    cache_dir: str | None = None
    cache: bool = True
    device: Any = "auto"
    device_spec: Any = None
    verbose: bool = True
    max_variants: int = 8
    batch_dims: Any = None
    memory_books: str = "auto"
    optimizer: str = "adamw"
    host_memory_fraction: float | None = 0.9
    optimizer_overlap: str = OVERLAP_DEFAULT
    keep_grads: bool = True
    widen_downloads: bool | None = None
    microbatches_rule: str = ""  # why microbatches is what it is, when plan/compile chose it (`resolved`)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if self.microbatches is not None:
            check_count(self.microbatches)
        set_("cuts", _cuts(self.cuts))
        _choice("costs", self.costs, _COSTS)
        set_("dtype", Precision.check_request(self.dtype))
        if self.precision is not None and not isinstance(self.precision, Precision):
            raise MobiusError(f"precision={self.precision!r} is not a Precision; it is set by `for_model` from dtype= "
                              f"and the model's parameters (give dtype= instead)")
        if self.precision is not None and self.precision.stream != (self.dtype or self.precision.master):
            raise MobiusError(f"precision streams {self.precision.stream} but dtype={self.dtype} asks for "
                              f"{self.dtype or self.precision.master}; the precision record is built from dtype by "
                              f"`for_model`, so a copy that changes dtype (dataclasses.replace(opts, dtype=...)) must "
                              f"drop it: replace(opts, dtype=..., precision=None), then for_model(model)")
        set_("memory_fraction", _positive_float("memory_fraction", self.memory_fraction,
                                                "the share of each GPU's memory a plan may use", at_most=1.0))
        _choice("solver", self.solver, SOLVERS)
        set_("time_limit", _positive_float("time_limit", self.time_limit, "the MIP's budget in seconds"))
        _choice("cross_map", self.cross_map, _CROSS_MAPS)
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, bytes)) \
                and not hasattr(self.cache_dir, "__fspath__"):
            raise MobiusError(f"cache_dir={self.cache_dir!r} is not a path; pass a directory path or None")
        if not isinstance(self.cache, bool):
            raise MobiusError(f"cache={self.cache!r}; it must be True (reuse traced graphs and layer costs kept on disk) "
                              f"or False (trace and annotate anew)")
        if not isinstance(self.device, Mapping):
            from mobius_fx.runtime.device_registry import device_choices

            _choice("device", self.device, device_choices())
        if not isinstance(self.verbose, bool):
            raise MobiusError(f"verbose={self.verbose!r}; it must be True or False")
        _positive_int("max_variants", self.max_variants,
                      "compiled variants per pipeline, one per call signature; 1 = a fixed signature")
        set_("batch_dims", check_batch_dims(self.batch_dims))
        from mobius_fx.runtime.device_books import check_memory_books

        check_memory_books(self.memory_books)
        from mobius_fx.planning.host_memory import check_host_memory_fraction, check_optimizer

        check_optimizer(self.optimizer)
        set_("host_memory_fraction", check_host_memory_fraction(self.host_memory_fraction))
        _choice("optimizer_overlap", self.optimizer_overlap, OVERLAP_MODES)
        if not isinstance(self.keep_grads, bool):
            raise MobiusError(f"keep_grads={self.keep_grads!r}; it must be True (the overlap writes the fp32 .grad, "
                              f"the runtime's default) or False (a loop with opt.keep_grads = False)")
        if self.widen_downloads is not None and not isinstance(self.widen_downloads, bool):
            raise MobiusError(f"widen_downloads={self.widen_downloads!r}; it must be None (the planner chooses), True "
                              f"(the GPUs widen the gradients to fp32 before downloading them) or False (downloaded "
                              f"as streamed, widened on the host)")
        if not isinstance(self.microbatches_rule, str):
            raise MobiusError(f"microbatches_rule={self.microbatches_rule!r}; it must be a str (set by `resolved`)")

    def resolved(self, rows: int | None, gpus: int) -> "CompileOptions":
        """These options with `microbatches` chosen by `default_microbatches` when it is None
        (`rows`: the example batch, None when it has no batch dimension; `gpus`: the topology's);
        a given value is kept as given."""
        if self.microbatches is not None:
            return self
        m, why = default_microbatches(rows, gpus)
        return replace(self, microbatches=m, microbatches_rule=why)

    def for_model(self, model: torch.nn.Module) -> "CompileOptions":
        """These options with `precision` built for `model` (once per compile, `api._run`):
        weights streamed in `dtype`, the masters' dtype read from the model's parameters
        (None streams them in their own). Refused (MobiusError) when `dtype` is wider than
        the masters."""
        return replace(self, precision=Precision.of_model(model, self.dtype))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass
class CompileContext:
    """Everything a compile carries between passes: inputs, settings and the facts passes write.

    `facts` names what is available so far; passes read inputs from attributes here. Each field
    is the fact of its name, except `gm` ("graph"), `example_kwargs` ("example_inputs") and
    `wiring` ("settings": compile's, what the emit pass wires into the Pipeline it builds);
    `settings.precision` is built for `model` here when the settings do not hold it yet;
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
    wiring: Callable[[CompileContext], Wiring] | None = None  # mobius_fx.compile's: the build's Wiring of this context
    facts: set = field(default_factory=lambda: {"model", "topology", "example_inputs", "settings"})
    timings: dict = field(default_factory=dict)
    touched: dict = field(default_factory=dict)  # pass name -> Touched, as run

    def __post_init__(self) -> None:
        if self.settings.precision is None and isinstance(self.model, torch.nn.Module):
            self.settings = self.settings.for_model(self.model)  # the one Precision of this model's compile
