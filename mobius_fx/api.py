"""The two entry points: `plan` (trace, annotate, partition, cross-map) and `compile` (plan,
then rewrite and emit the pipeline you train with)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import sys
from collections.abc import Mapping
from typing import Any, Sequence

import torch

from mobius_fx.build import Wiring
from mobius_fx.compiler import PassPipeline, default_pipeline
from mobius_fx.runtime.data_parallel import GradientReducer, default_group
from mobius_fx.errors import MobiusError, PlanError
from mobius_fx.options import CompileContext, CompileOptions
from mobius_fx.planning.ir_transforms import ScheduleForm
from mobius_fx.planning.plans import Plan
from mobius_fx.pass_adapters import overlap_of
from mobius_fx.schedules.choice import choose as choose_schedule
from mobius_fx.runtime.device_books import Device
from mobius_fx.topology.server import Topology
from mobius_fx.train_step import StepCompiler

__all__ = ["plan", "compile"]

log = logging.getLogger("mobius_fx")


def _topology(topology: Any):
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, str):
        if topology.endswith(".json") or topology.lstrip().startswith("{"):
            return Topology.from_json(topology)
        return Topology.preset(topology)
    raise MobiusError(f"topology {topology!r} is neither a Topology, a preset name nor a JSON file; "
                      f"use Topology.preset(...), Topology.virtual(...) or Topology.from_json(path)")


@contextlib.contextmanager
def _verbosity(verbose: bool):
    """With verbose=True, show INFO progress on stderr while a compile runs.

    To route mobius_fx's progress through your own logging setup instead, pass verbose=False
    and configure the "mobius_fx" logger (or attach a handler to it: then it is used as is).
    """
    if not verbose or log.handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[mobius_fx] %(message)s"))
    old_level, old_propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
        log.propagate = old_propagate


def _run(passes: PassPipeline, *, model, topology, example_inputs, example_kwargs, gm=None,
         wiring: _CompileWiring | None = None, **settings) -> CompileContext:
    """Validate the user's arguments (`CompileOptions`) and run `passes` on a CompileContext of them.

    `wiring`: compile's, what the emit pass wires into the Pipeline it builds (`_CompileWiring`).
    Everything that can be refused without running the model is refused here, before tracing:
    bad settings, a model or inputs on the meta device given to `compile`, and example inputs
    that micro-batches cannot split.
    """
    options = CompileOptions(**settings)
    if not isinstance(model, torch.nn.Module):
        raise MobiusError(f"model is a {type(model).__name__}, not a torch.nn.Module; pass the module to plan or "
                          f"compile")
    options = options.for_model(model)  # the one Precision: dtype= and the masters' dtype, read from the model
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise MobiusError(f"example_inputs is a {type(example_inputs).__name__}; pass a tensor or a tuple of the "
                          f"model's positional inputs, e.g. example_inputs=(x,)")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise MobiusError(f"example_kwargs is a {type(example_kwargs).__name__}; pass a dict of keyword inputs")
    from mobius_fx.runtime.call_signatures import bind_call

    bind_call(model, tuple(example_inputs), dict(example_kwargs or {}))  # refuses an argument forward does not take
    ctx = CompileContext(model=model, topology=_topology(topology), example_inputs=tuple(example_inputs),
                         example_kwargs=dict(example_kwargs or {}), settings=options, gm=gm, wiring=wiring)
    _check_batch(ctx)
    with _verbosity(options.verbose):
        passes.run(ctx)
        if ctx.pipeline is not None and isinstance(ctx.plan, Plan):
            _log_plan(ctx.plan)
    return ctx


def _log_plan(plan: Plan) -> None:
    """Compile's log of the plan it built: the stage table and the transfers summed by kind, phase
    and link at INFO; every transfer (the full table, as `print(pipe.plan)`) at DEBUG."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s", plan.describe("full"))
    elif log.isEnabledFor(logging.INFO):
        log.info("%s", plan.describe("summary"))


class _Recompiler:
    """Compiles the variants of a compiled pipeline (mobius_fx/runtime/variants.py): for a call with
    other arguments or shapes (`variant`: traced and planned again), or one larger than its
    variant was planned for (`replan`: the same graph, costed again). Either keeps the cuts of
    the plan it varies when they fit (`passes.partition.reuse_partition_pass`), on the same devices, with
    the passes and settings the pipeline was compiled with."""

    def __init__(self, passes: PassPipeline, model: torch.nn.Module, topology: Topology, options: CompileOptions) -> None:
        self.passes = passes
        self.model, self.topology, self.options = model, topology, options

    def _passes(self, like, *, graph: bool = False) -> PassPipeline:
        from mobius_fx.compiler import FunctionPass
        from mobius_fx.passes.partition import partition_pass, reuse_partition_pass

        passes = list(self.passes.passes)
        if graph:
            passes = [p for p in passes if p.name != "trace"]
        out = PassPipeline(passes, given=(*self.passes.given, "graph") if graph else self.passes.given)
        part = next((p for p in passes if p.name == "partition"), None)
        if getattr(part, "fn", None) is partition_pass:  # the user's own partitioner stays as it is
            reuse = reuse_partition_pass(like.layers, like.boundaries,
                                         getattr(like.plan, "widen_downloads", None))
            out.replace("partition", FunctionPass("partition", reuse, reads=part.reads, writes=part.writes))
        return out

    def _compile(self, passes: PassPipeline, pipe, call, gm=None, form=None) -> CompileContext:
        settings = {name: getattr(self.options, name) for name in CompileOptions.names()}
        settings.update(device=pipe.devices, verbose=False)
        # a graph traced for another call takes this one laid out as it was traced (a positional
        # argument given by keyword, as Trainer calls model(**batch), goes back to its place)
        args, kwargs = form.arrange(call) if form is not None else (call.args, call.kwargs)
        return _run(passes, model=self.model, topology=self.topology, example_inputs=args,
                    example_kwargs=kwargs, gm=gm, **settings)

    @staticmethod
    def _add(pipe, ctx: CompileContext, call):
        return pipe._add_variant(call.args, call.kwargs, layers=tuple(layer.name for layer in ctx.layers),
                                 boundaries=tuple(ctx.partition.boundaries), state=ctx.pipeline)

    def variant(self, pipe, call):
        ctx = self._compile(self._passes(pipe.variants[0]), pipe, call)
        return self._add(pipe, ctx, call)

    def replan(self, pipe, like, call, *, allow_new: bool = True):
        passes = self._passes(like, graph=True)
        ctx = self._compile(passes.until("partition"), pipe, call, gm=like.gm, form=like.form)
        if tuple(ctx.partition.boundaries) == tuple(like.boundaries):  # the cuts fit: kept
            like.sizes = {n: max(like.sizes.get(n, 0), k) for n, k in {**like.sizes, **call.sizes}.items()}
            return like
        if not allow_new:
            raise PlanError(f"the plan's cuts do not fit this call and max_variants={pipe.max_variants} allows no "
                            f"re-planned variant; compile for the largest call, or with a larger max_variants")
        rest = PassPipeline(passes.passes[passes.names.index("partition") + 1:], given=tuple(ctx.facts))
        rest.run(ctx)
        return self._add(pipe, ctx, call)


def _example_rows(ctx: CompileContext) -> int | None:
    """The example batch's rows (dim 0 of its first batched input), None when it has no batch
    dimension to split (no tensor with a dimension, or all 1-D: features)."""
    from torch.utils._pytree import tree_leaves

    from mobius_fx.planning.microbatch import batch_rows, declared

    inputs = (ctx.example_inputs, ctx.example_kwargs)
    marks = declared(ctx.model, ctx.example_inputs, ctx.example_kwargs, ctx.settings.batch_dims)
    leaves = [x for x in tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.dim() > 0 and marks.get(id(x), True)]
    batched = leaves and (any(x.dim() > 1 for x in leaves) or any(marks.values()))  # all 1-D: features
    return batch_rows(inputs, 1, marks) if batched else None


def _check_batch(ctx: CompileContext) -> None:
    """Choose the micro-batch count when none is given (`CompileOptions.resolved`: one per GPU of
    the topology when the batch divides, else the batch's largest divisor below that), then
    refuse example inputs that the micro-batches cannot split into equal parts along dim 0 —
    for `plan` and `compile` alike, meta tensors or real ones."""
    from mobius_fx.planning.microbatch import batch_rows, check_divides, declared, divisors_near

    inputs = (ctx.example_inputs, ctx.example_kwargs)
    marks = declared(ctx.model, ctx.example_inputs, ctx.example_kwargs, ctx.settings.batch_dims)
    if ctx.settings.microbatches is None:
        ctx.settings = ctx.settings.resolved(_example_rows(ctx), len(ctx.topology.gpus))
    m = ctx.settings.microbatches
    rows = batch_rows(inputs, m, marks)
    check_divides(rows, m, batch=f"the example batch has {rows} rows (dim 0 of the first batched input) and",
                  count=f"microbatches={m}", error=PlanError,
                  remedy=lambda: (f"use {' or '.join(f'microbatches={d}' for d in divisors_near(rows, m))} (the "
                                  f"divisors of {rows} nearest {m}), or a batch size that is a multiple of {m}"))


def _refuse_meta(model: Any, example_inputs: Any, example_kwargs: dict | None) -> None:
    if isinstance(model, torch.nn.Module) and not isinstance(example_inputs, (str, bytes)):
        inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
        where = _on_meta(model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (), example_kwargs or {})
        if where is not None:
            raise MobiusError(f"compile needs real weights and inputs, but {where} is on the meta device (the pipeline "
                              f"copies the weights to the GPUs and runs them); use mobius_fx.plan(...) to plan a meta "
                              f"model, or build it on the CPU to compile it")


def _on_meta(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict) -> str | None:
    from torch.utils._pytree import tree_leaves

    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:
            return f"parameter or buffer {name!r}"
    for t in tree_leaves((example_inputs, example_kwargs)):
        if isinstance(t, torch.Tensor) and t.is_meta:
            return "an example input"
    return None


# True while compile builds a training step's pipeline (`Pipeline.train_step`'s): its `code` is the step
# the executor runs (runtime/step_code.py), not the forward program.
_COMPILING_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("mobius_fx_compiling_step", default=False)

_D = CompileOptions()  # the one set of defaults, shown in the signatures below


def plan(model: torch.nn.Module, topology: Any, *, example_inputs: Any, example_kwargs: dict | None = None,
         microbatches: int | None = _D.microbatches, cuts: Sequence[int] | None = _D.cuts, costs: str = _D.costs,
         dtype: torch.dtype | None = _D.dtype,
         memory_fraction: float = _D.memory_fraction, solver: str = _D.solver, time_limit: float = _D.time_limit,
         cross_map: str = _D.cross_map, cache_dir: str | None = _D.cache_dir, verbose: bool = _D.verbose,
         pipeline: PassPipeline | None = None, optimizer: str = _D.optimizer,
         host_memory_fraction: float | None = _D.host_memory_fraction, cache: bool = _D.cache,
         loss_fn: Any = None, example_target: Any = None, train_step: bool = False,
         schedule: str | None = None, optimizer_overlap: str = _D.optimizer_overlap,
         keep_grads: bool = _D.keep_grads, widen_downloads: bool | None = _D.widen_downloads) -> Plan:
    """Plan a Mobius pipeline for `model` on `topology`; nothing is run on a GPU.

    Works on the meta device, so a 15B model plans on a laptop:

        with torch.device("meta"):
            model = GPT(GPTConfig(hidden=3072, blocks=72))
        p = mobius_fx.plan(model, "mobius-testbed", example_inputs=(ids,), microbatches=8)
        print(p)

    `microbatches`: per step, binding when given. Without it the planner chooses: it times the
    default (one per GPU when the batch, dim 0 of the example inputs, divides into that many,
    else the largest divisor of the batch below the GPU count) and the divisors of the batch
    near 2x, 4x and 8x it (`planning.microbatch.candidate_counts`), each on the same trace and
    the default's cuts, by the simulated fwd+bwd that ranks the schedules, keeps the fastest
    (`schedules.choice.choose_count`) and, if it is not the default, plans it again with its own
    MIP (`time_limit` again), kept when faster. The first line says the count, why and whose
    cuts, the header the rule. `compile` keeps the default rule: give it `microbatches=plan.microbatches`.
    A count that does not divide the batch raises `PlanError`.
    `cuts`: plan this partition instead of solving for one — the index in `plan.layers` of
    the first layer of every stage after the first (`cuts=[]`: one stage; `cuts=[1, 5]`: stages
    [0,1), [1,5), [5,L)). No MIP runs; the stages are cross-mapped and timed as usual, and
    `PlanError` says when they do not fit the GPUs. Compare partitions with `simulate`.
    `dtype` is the dtype weights are streamed and computed in on the GPUs (the masters stay
    in DRAM in the model's own dtype; None, the default, streams that dtype; a dtype wider than
    the masters' is refused; `plan.precision` records both); `memory_fraction` the share of each GPU's memory the plan may use; `solver`
    "auto" | "highs" | "cbc"; `time_limit` the MIP's whole budget in seconds (shared by the
    candidate stage counts; the gap reached is reported in `plan.solver`). `optimizer` ("adamw",
    "adam", "sgd-momentum", "sgd", "none") is the one whose state the host memory budget counts
    (`plan.host_budget()`, printed with the plan); a plan that needs more than
    `host_memory_fraction` (default 0.9) of the topology's host DRAM raises `PlanError` naming the
    remedies (None: not checked). Every setting is
    checked by `CompileOptions` (one set of defaults) before any work: a bad value raises
    `MobiusError` saying the value, the rule and the remedy.
    `cache` (default True): read the traced graph and the layer costs from the cache under
    `cache_dir` (default $MOBIUS_FX_CACHE or ~/.cache/mobius_fx) when this model, its inputs and
    these settings were planned before, and keep them there otherwise (mobius_fx/compile_cache.py,
    docs/checkpointing.md); False, or MOBIUS_FX_TRACE_CACHE=0, traces and annotates anew.
    `loss_fn` + `example_target`, or `train_step=True` for a model that returns its own loss (HF
    models with `labels` in `example_kwargs`): plan the training step `pipe.train_step` runs, with
    the loss on the last stage, so only the loss leaves the GPUs (no logits on any link).
    `schedule`: the registered schedule to run the plan (`mobius_fx.schedules.names()`); by
    default the candidate (`schedules.candidates()`, baselines left out) with the least simulated
    forward + backward that fits. The plan's first line (`plan.schedule_choice`) says which and
    why, and when the runtime does not execute it yet (compile then runs the fastest it does).
    `optimizer_overlap`: the mode `pipe.overlap` will step the optimizer in ("none", "sync",
    "async"); the step model times the host's pass that way (planning/host_step.py), with
    `keep_grads`, `widen_downloads`: as the overlap's (default True; None: chosen, see `CompileOptions`).
    """
    if loss_fn is not None or example_target is not None or train_step:
        pipeline = step_passes(pipeline or default_pipeline())
        step = StepCompiler(model, loss_fn, lambda *_: None)
        model = step.wrapper
        example_inputs, example_kwargs = step.arguments(
            (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs),
            dict(example_kwargs or {}), example_target)
    passes = (pipeline or default_pipeline()).until("plan")
    ctx = _run(passes, model=model, topology=topology, example_inputs=example_inputs, example_kwargs=example_kwargs,
               microbatches=microbatches, cuts=cuts, verbose=verbose, costs=costs, dtype=dtype, solver=solver,
               memory_fraction=memory_fraction, time_limit=time_limit, cross_map=cross_map, cache_dir=cache_dir,
               optimizer=optimizer, host_memory_fraction=host_memory_fraction, cache=cache,
               optimizer_overlap=optimizer_overlap, keep_grads=keep_grads, widen_downloads=widen_downloads)
    if microbatches is None:  # the caller's count is binding; without one the planner times a few
        from mobius_fx.count_choice import chosen_count

        with _verbosity(ctx.settings.verbose):
            p, choice = chosen_count(passes, ctx, _example_rows(ctx), schedule)
        return dataclasses.replace(p, schedule_choice=choice.line)
    p = ctx.plan
    line = choose_schedule(p, schedule, **overlap_of(ctx.settings)).line  # as the plan's overlap steps it
    return dataclasses.replace(p, schedule_choice=f"{line}; {p.microbatches} micro-batches (the caller's)")


def compile(model: torch.nn.Module, topology: Any, *, example_inputs: Any, example_kwargs: dict | None = None,
            microbatches: int | None = _D.microbatches, cuts: Sequence[int] | None = _D.cuts,
            dtype: torch.dtype | None = _D.dtype, costs: str = _D.costs,
            memory_fraction: float = _D.memory_fraction, solver: str = _D.solver, time_limit: float = _D.time_limit,
            cross_map: str = _D.cross_map, cache_dir: str | None = _D.cache_dir, device: str = _D.device,
            verbose: bool = _D.verbose, max_variants: int = _D.max_variants, pipeline: PassPipeline | None = None,
            process_group: Any = None, batch_dims: dict | None = _D.batch_dims,
            memory_books: str = _D.memory_books, optimizer: str = _D.optimizer,
            host_memory_fraction: float | None = _D.host_memory_fraction, cache: bool = _D.cache,
            loss_fn: Any = None, example_target: Any = None, schedule: str | None = None,
            optimizer_overlap: str = _D.optimizer_overlap, keep_grads: bool = _D.keep_grads,
            widen_downloads: bool | None = _D.widen_downloads):
    """Compile `model` into a Mobius pipeline you train with your usual loop.

        pipe = mobius_fx.compile(model, Topology.virtual(gpus=4, memory="256MiB"),
                                 example_inputs=(x,), microbatches=4)
        loss = loss_fn(pipe(x), y); loss.backward(); opt.step()   # opt over model.parameters()

    The master weights stay in `model` on the CPU; gradients land in `param.grad`.
    `microbatches` and `cuts` are as for `plan`, but without `microbatches` compile takes the
    default rule (one micro-batch per GPU when the example batch divides; every call's batch
    must then split the same way) and times no other count: pass `microbatches=plan.microbatches`
    to run the count `plan` chose.
    `device`: "auto" (CUDA when the topology is real and CUDA is present, else virtual GPUs on
    the CPU), "virtual", "virtual-async" (the CPU stand-in of the CUDA path: its streams, events and
    slot pool on threads with seeded random delays, so races and host syncs show up without a
    GPU) or "cuda". On CUDA, every stage is first replayed on fake CUDA tensors
    (`Pipeline.check_placement`): an op that would see two devices is named before anything is
    allocated. A model or inputs on the meta device are refused: `plan` them.
    Call the pipeline as you call the model: every argument a call passes is honoured. A call
    with keyword arguments the example did not have (`attention_mask=`, `labels=`), or without
    some it had, or with shapes its graph does not hold for (export keeps sequence lengths and
    the batch symbolic where the model allows), gets a variant traced and planned for it, cached,
    reusing the plan's cuts when they fit (a warning says so); `max_variants=1` refuses such calls
    instead (`MobiusError` naming the argument or dimension). An argument the model's forward
    does not take is refused.
    A Pipeline cannot be copied or pickled; copy or save the model and compile again.
    `process_group`: data parallel across ranks (mobius_fx/runtime/data_parallel.py): every rank runs
    this plan on its own slice of the batch and gradients are averaged across the group as each
    stage's are complete; default: the world group when torch.distributed is initialised with
    more than one rank; `False`: none.
    `cache`: as for `plan` (a second compile of the same model reads its graph, layer costs and
    cuts from disk: docs/checkpointing.md).
    `batch_dims`: which forward arguments carry the batch, {name: 0 or None} (None: not batched,
    every micro-batch gets it whole); by default dim 0 of the first batched input is the batch and
    every input with a dim 0 of its size is split. How outputs are combined across micro-batches,
    and what is refused: README "Micro-batch semantics" (mobius_fx/planning/microbatch.py).
    `memory_books`: how each GPU measures its stages' work against its budget. "allocator" (the
    default on CUDA): no Python per op; each stage's work is measured by CUDA's caching allocator
    (the peak since the work began, on top of what the GPU held then) and a peak over the budget
    raises `BudgetError` when the work ends, naming the stage; the allocator's OutOfMemoryError
    is the hard limit. "ops" (the default on virtual devices; on CUDA a debug setting): every
    tensor the work creates is charged from the op that makes it, which raises `BudgetError`
    before its result is used (a `TorchDispatchMode`: Python on every op, counted in
    `Device.dispatch_calls`). "auto": per device. On CUDA, "allocator" resets the device's peak
    statistics at each stage's work (`torch.cuda.reset_peak_memory_stats`); the device's peak
    over a step is `mobius_fx.runtime.memory_sources.CudaAllocator.of(index).max_allocated()`.
    `loss_fn`: fn(outputs, target) -> the batch's 0-dim loss, for `pipe.train_step(*args,
    target=y, **kwargs)`, which runs forward, the loss and backward as one pipeline whose last
    stage computes the loss, so the outputs (an LLM's logits) never leave the GPUs
    (mobius_fx/train_step.py). Without it, `train_step` uses the model's own loss (HF models
    called with `labels=`). The step is compiled at its first call, or here when
    `example_target` (a target for `example_inputs`) is given.
    `optimizer` and `host_memory_fraction`: the host memory budget, as for `plan`; a pipeline
    whose host would not hold it is refused before anything is emitted.
    `schedule`: the schedule `train_step` runs, any name in `mobius_fx.schedules.names()` that has
    a runtime form ("mobius", the default; "mobius-noprefetch"; "mobius-identity-map", which also
    maps the stages on the identity cross map; "gpipe", every stage's weights resident on its GPU
    for the whole step, refused naming the stage, its GPU and the bytes where they do not fit;
    "roundpipe", stage k's backward on GPU (2S-2-k) mod N, its last stage not fused, virtual devices
    only): the step executor (mobius_fx/runtime/executor.py) runs that schedule's IR op by op
    (docs/executor.md). The others run in the simulator only and are refused here, with the reason
    (and whether they would fit, naming the stage and its bytes when not). The
    eager-style loop (`pipe(x)`, `loss.backward()`) runs Mobius's forward program and autograd.
    `optimizer_overlap`, `keep_grads`, `widen_downloads`: as for `plan`, the mode you will give
    `pipe.overlap` (default "sync"): the planner times the host's pass that way and chooses whether
    the GPUs widen the gradient downloads for it (the plan's "gradients:" line); `pipe.overlap` in
    another mode falls back to the topology's rule for them.
    """
    _refuse_meta(model, example_inputs, example_kwargs)
    if example_target is not None and loss_fn is None:
        raise MobiusError("example_target was given without loss_fn; the target is what loss_fn compares the "
                          "outputs with: pass loss_fn=fn too, or drop example_target")
    passes, topology = pipeline or default_pipeline(), _topology(topology)
    form = None
    if schedule is not None:
        form, cross_map = _schedule_form(schedule, cross_map, lambda: _run(
            passes.until("plan"), model=model, topology=topology, example_inputs=example_inputs,
            example_kwargs=example_kwargs, microbatches=microbatches, cuts=cuts, verbose=False, costs=costs,
            dtype=dtype, memory_fraction=memory_fraction, solver=solver, time_limit=time_limit, cross_map=cross_map,
            cache_dir=cache_dir, optimizer=optimizer, host_memory_fraction=host_memory_fraction, cache=cache).plan,
            optimizer)
    reducer = None
    group = default_group(process_group)
    if group is not None:
        reducer = GradientReducer(group)
        reducer.broadcast([*model.parameters(), *model.buffers()])  # every rank starts from rank 0's model
    wiring = _CompileWiring(passes, topology, loss_fn, example_target, reducer, memory_books, form,
                            _COMPILING_STEP.get())
    ctx = _run(passes, model=model, topology=topology, example_inputs=example_inputs, example_kwargs=example_kwargs,
               microbatches=microbatches, cuts=cuts, verbose=verbose, costs=costs, dtype=dtype,
               memory_fraction=memory_fraction, solver=solver, time_limit=time_limit, cross_map=cross_map,
               cache_dir=cache_dir, device=device, max_variants=max_variants, batch_dims=batch_dims,
               memory_books=memory_books, optimizer=optimizer, host_memory_fraction=host_memory_fraction,
               cache=cache, wiring=wiring, optimizer_overlap=optimizer_overlap, keep_grads=keep_grads,
               widen_downloads=widen_downloads)
    return ctx.pipeline


def _schedule_form(name: str, cross_map: str, plan_of: Any, optimizer: str) -> tuple[ScheduleForm, str]:
    """(name, its runtime form) and the cross map for `compile(schedule=name)`; a MobiusError
    naming the schedule, the reason and the remedy when it has no runtime form (and whether it
    fits, its IR built on `plan_of()`'s plan: a PlanError names the stage and its bytes when not)."""
    from mobius_fx import schedules

    entry = schedules.get(name)
    if entry.runtime is not None:
        return (name, entry.runtime), entry.cross_map or cross_map
    runnable = [n for n in schedules.names() if schedules.get(n).runtime is not None]
    from mobius_fx.planning.host_step import STATE_BYTES
    from mobius_fx.sim.tasks import Context

    p = plan_of()
    try:  # its own IR, as the simulator builds it: a schedule that does not fit says which stage and bytes
        entry.build(Context(p, p.topology, optimizer if optimizer in STATE_BYTES else "adamw", 1e10,
                            use_plan_routes=True))
    except PlanError as e:
        raise MobiusError(f"schedule={name!r} does not fit this model: {e}") from None
    fits = " (it would fit these GPUs)"
    why = entry.refusal or "it has no runtime form (registered for the simulator only)"
    raise MobiusError(f"schedule={name!r} cannot run on the pipeline runtime{fits}: {why}. It runs in the simulator "
                      f"(mobius_fx.simulate(plan, schedule={name!r})); to train, compile with schedule= one of "
                      f"{', '.join(runnable)}")


def step_passes(passes: PassPipeline) -> PassPipeline:
    """`passes` for a training step's graph: its cross-entropy chunked after tracing
    (passes/chunk_loss.py: no fp32 copy of the logits)."""
    from mobius_fx.compiler import FunctionPass
    from mobius_fx.passes.chunk_loss import chunk_loss_pass

    out = PassPipeline(list(passes.passes), given=passes.given)
    if "trace" in out.names and "chunk_loss" not in out.names:
        out.insert_after("trace", FunctionPass("chunk_loss", chunk_loss_pass, reads=("graph",), writes=("graph",)))
    return out


class _CompileWiring:
    """What a compile wires into the Pipeline its emit pass builds (`build.Wiring`), made from the
    compile's context when the pass runs (`CompileContext.wiring`): the variants' recompiler with
    the passes and settings of this compile, at most `max_variants`; the data-parallel reducer;
    and the training step (`Pipeline.train_step`): the model and its loss compiled as one more
    pipeline, with the same settings, on the same devices, now when `example_target` lets the
    example call serve it, else at the first `train_step`."""

    def __init__(self, passes: PassPipeline, topology: Topology, loss_fn: Any, example_target: Any,
                 reducer: GradientReducer | None, memory_books: str, form: ScheduleForm | None = None,
                 is_step: bool = False) -> None:
        self.passes, self.topology, self.loss_fn, self.example_target = passes, topology, loss_fn, example_target
        self.reducer, self.memory_books, self.form, self.is_step = reducer, memory_books, form, is_step

    def __call__(self, ctx: CompileContext) -> Wiring:
        settings, topology, model = ctx.settings, self.topology, ctx.model
        example = (ctx.example_inputs, ctx.example_kwargs)
        passes, memory_books, loss_fn, example_target = self.passes, self.memory_books, self.loss_fn, self.example_target
        name = self.form[0] if self.form is not None else None

        # the step pipeline runs under this pipeline's overlap (`Pipeline.overlap`), which widens the
        # gradient downloads as this plan chose: the step's plan is timed so, not chosen again
        chosen = getattr(ctx.plan, "widen_downloads", None)
        widen = settings.widen_downloads if chosen is None else chosen

        def step(devices: Mapping[str, Device]) -> StepCompiler:
            s = settings

            def compile_step(wrapper, args: tuple, kwargs: dict):
                token = _COMPILING_STEP.set(True)  # the pipeline built is a step pipeline (its code: the step)
                try:
                    return compile(wrapper, topology, example_inputs=args, example_kwargs=kwargs,
                               microbatches=s.microbatches, cuts=s.cuts, dtype=s.dtype, costs=s.costs,
                               memory_fraction=s.memory_fraction, solver=s.solver, time_limit=s.time_limit,
                               cross_map=s.cross_map, cache_dir=s.cache_dir, device=dict(devices), verbose=s.verbose,
                               max_variants=s.max_variants, pipeline=step_passes(passes), process_group=False,
                               batch_dims=s.batch_dims, memory_books=memory_books, optimizer=s.optimizer,
                               host_memory_fraction=s.host_memory_fraction, cache=s.cache, schedule=name,
                               optimizer_overlap=s.optimizer_overlap, keep_grads=s.keep_grads,
                               widen_downloads=widen)
                finally:
                    _COMPILING_STEP.reset(token)

            return StepCompiler(model, loss_fn, compile_step)

        return Wiring(recompiler=_Recompiler(passes, model, topology, settings), max_variants=settings.max_variants,
                      reducer=self.reducer, step=step, step_example=None if example_target is None else (*example, example_target),
                      schedule_form=self.form, step_code=self.is_step)
