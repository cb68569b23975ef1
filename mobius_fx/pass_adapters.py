"""The standard passes that live outside `passes/` as `fn(gm, ctx)` adapters for the declared
pipeline (compiler.py): trace, annotate, plan, insert_transfers and emit.

Each reads its inputs from the CompileContext and writes its facts back; the heavy lifting
lives in tracing.py, the pass modules (mobius_fx.passes.*), planning/plans.py and build.py. The
partition pass (partition + cross map) is `mobius_fx.passes.partition.partition_pass`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mobius_fx.options import CompileContext

__all__ = ["trace_pass", "annotate_pass", "plan_pass", "insert_transfers_pass", "emit_pass", "overlap_of"]


def trace_pass(gm, ctx: CompileContext):
    """Trace the model, or read its graph from the trace cache (mobius_fx/compile_cache.py); then,
    with micro-batches, sizes read inside forward are the whole batch's where they become values
    (planning/batch_sizes.py), and mean losses over class indices a sum and a count each
    (planning/loss_ratios.py)."""
    from mobius_fx.compile_cache import trace_dir
    from mobius_fx.planning import batch_sizes, loss_ratios, microbatch
    from mobius_fx.tracing import flatten_inputs, trace

    args, kwargs = tuple(ctx.example_inputs), dict(ctx.example_kwargs or {})
    gm = trace(ctx.model, example_inputs=args, example_kwargs=kwargs or None, cache_dir=trace_dir(ctx.settings))
    if (args or kwargs) and ctx.settings.microbatches != 1:
        marks = microbatch.declared(ctx.model, args, kwargs, ctx.settings.batch_dims)
        flat = flatten_inputs(gm, args, kwargs)
        try:
            values = batch_sizes.fake_values(gm, flat)
        except Exception:  # noqa: BLE001 (not runnable on fake tensors: microbatch_outputs warns at build)
            values = None
        if values is not None:
            batch_sizes.rewrite(gm, flat, marks, values)
            loss_ratios.rewrite(gm, values)
    return gm


def annotate_pass(gm, ctx: CompileContext):
    """Annotate the graph, or read its layers and node costs from the cache (modelled costs only)."""
    from mobius_fx.compile_cache import cached_layers, store_layers
    from mobius_fx.passes.annotate import annotate

    s = ctx.settings
    layers = cached_layers(gm, ctx)
    if layers is None:
        spec = s.device_spec or ctx.topology.gpus[0].spec
        layers = tuple(annotate(gm, example_inputs=ctx.example_inputs, example_kwargs=ctx.example_kwargs or None,
                                costs=s.costs, device_spec=spec, precision=s.precision))
        store_layers(gm, ctx, layers)
    ctx.layers = layers
    return None


def plan_pass(gm, ctx: CompileContext):
    """The Plan of the partition pass's facts: its cuts on its GPU order, timed on that order."""
    from mobius_fx.passes.partition import input_bytes, param_sizes
    from mobius_fx.planning.plans import build_plan
    from mobius_fx.schedules.choice import choose

    s, part = ctx.settings, ctx.partition
    sizes, trainable = param_sizes(ctx)
    ctx.plan = build_plan(ctx.layers, part.boundaries, order=ctx.order, topology=ctx.topology,
                          microbatches=s.microbatches, microbatches_rule=s.microbatches_rule,
                          step_time=part.makespan, precision=s.precision,
                          memory_fraction=s.memory_fraction, prefetch_fwd=part.prefetch_fwd,
                          solver=part.solver, param_sizes=sizes, trainable=trainable,
                          input_bytes=input_bytes(ctx), optimizer=s.optimizer)
    # the host's memory: refused here, before anything is emitted (plan and compile alike)
    ctx.plan.host_budget().check(s.host_memory_fraction, microbatches=s.microbatches)
    ctx.plan = dataclasses.replace(ctx.plan, **plan_widening(ctx.topology, s.optimizer_overlap, s.keep_grads,
                                                             s.precision, part))
    # what the runtime will run (compile), timed as the plan's optimizer overlap and gradient
    # downloads will step it; `api.plan` chooses again among every candidate
    form = getattr(ctx.wiring, "form", None)  # compile(schedule=): the caller's
    choice = choose(ctx.plan, form[0] if form else None, runnable=True, **overlap_of(s))
    ctx.plan = dataclasses.replace(ctx.plan, schedule_choice=choice.line)
    return None


def overlap_of(s: Any) -> dict[str, Any]:
    """`simulate`'s arguments for the optimizer overlap the plan is made for (settings `s`): the
    schedules are compared as that mode steps them (the plan's own widening: its `widen_downloads`)."""
    return {"optimizer_overlap": s.optimizer_overlap, "keep_grads": s.keep_grads}


def plan_widening(topology, overlap: str, keep_grads: bool, precision, part=None) -> dict:
    """{"widen_downloads", "widen_for", "widen_rule"} for the Plan: whether the GPUs widen the gradients the
    optimizer overlap keeps as the fp32 `.grad`: the partition's choice (`part.widen`, the
    partition pass's `widen_choice` by the step model where the topology's links are shared or
    half duplex, or the caller's `widen_downloads`), else the topology's rule (planning/host_step.py
    `widen_fits`: where each GPU's links to the host are its own and full duplex), the mode the
    MIP's host model (`HostPass.of`) timed and the simulator follows; {} where nothing is widened."""
    from mobius_fx.planning.host_step import widen_fits, widened_downloads

    stream = (precision.stream if precision is not None else None)
    if stream is None or not widened_downloads(overlap, stream.itemsize, 1, keep_grads, True):
        return {}
    chosen = getattr(part, "widen", None)
    widen = widen_fits(topology) if chosen is None else chosen
    if chosen is None:
        why = ("each GPU's links to the host are its own and full duplex" if widen else
               "a GPU's link to the host is shared or half duplex: 2 more bytes per parameter there would slow the "
               "pipeline")
    else:
        why = part.widen_why
    how = ("widened to fp32 on the GPUs, downloaded straight into .grad" if widen else
           "downloaded as streamed, widened into .grad on the host")
    return {"widen_downloads": widen, "widen_for": overlap,
            "widen_rule": f"gradients: {how} under {overlap!r} ({why}); opt.widen_downloads overrides"}


def insert_transfers_pass(gm, ctx: CompileContext):
    from mobius_fx.passes.insert_transfers import insert_transfers

    p = ctx.plan
    ctx.stages = insert_transfers(gm, stage_nodes=[s.nodes for s in p.stages], stage_gpus=[s.gpu for s in p.stages],
                                  microbatches=p.microbatches)
    return None


def emit_pass(gm, ctx: CompileContext):
    from mobius_fx.build import build_pipeline

    s = ctx.settings
    wiring = ctx.wiring(ctx) if ctx.wiring is not None else None  # mobius_fx.compile's (build.Wiring)
    ctx.pipeline = build_pipeline(ctx.model, gm, schedule=ctx.stages, plan=ctx.plan, example_inputs=ctx.example_inputs,
                                  example_kwargs=ctx.example_kwargs or None, device=s.device,
                                  batch_dims=s.batch_dims, memory_books=s.memory_books, wiring=wiring)
    return None
