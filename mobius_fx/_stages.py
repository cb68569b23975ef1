"""The standard passes as `fn(gm, ctx)` adapters for the declared pipeline (compiler.py).

Each reads its inputs from the CompileContext and writes its facts back; the heavy lifting
lives in the pass modules (mobius_fx.passes.*), tracing.py, plans.py and runtime.py.
"""

from __future__ import annotations

import logging
from .options import CompileContext

__all__ = ["trace_pass", "annotate_pass", "partition_pass", "given_partition", "misfit", "reuse_partition_pass",
           "cross_map_pass", "plan_pass", "insert_transfers_pass", "emit_pass"]

log = logging.getLogger("mobius_fx")


def trace_pass(gm, ctx: CompileContext):
    from .tracing import trace

    return trace(ctx.model, example_inputs=ctx.example_inputs, example_kwargs=ctx.example_kwargs or None)


def annotate_pass(gm, ctx: CompileContext):
    from .passes.annotate import annotate

    s = ctx.settings
    spec = s.device_spec or ctx.topology.gpus[0].spec
    ctx.layers = tuple(annotate(gm, example_inputs=ctx.example_inputs, example_kwargs=ctx.example_kwargs or None,
                                costs=s.costs, device_spec=spec, precision=s.precision))
    return None


def _problem(ctx: CompileContext, order=None):
    """The step model's numbers for this compile: the layers' costs, the GPUs in `order`, the
    model input's bytes and the tied weights' extra copies (as `plan_pass`'s plan counts them)."""
    from .passes.partition import PartitionProblem
    from .step_model import tied_weights

    s = ctx.settings
    sizes, trainable = _param_sizes(ctx)
    return PartitionProblem.from_topology(ctx.layers, ctx.topology, microbatches=s.microbatches, order=order,
                                          memory_fraction=s.memory_fraction, precision=s.precision,
                                          input_bytes=_input_bytes(ctx),
                                          tied=tied_weights(ctx.layers, sizes, trainable) if sizes else ())


def _param_sizes(ctx: CompileContext) -> tuple[dict[str, int], list[str]]:
    """Bytes of every parameter of the model by qualified name (tied aliases included), and the
    names of those that take a gradient; empty without a model."""
    sizes, trainable = {}, []
    if ctx.model is not None:
        for name, p in ctx.model.named_parameters(remove_duplicate=False):
            sizes[name] = p.numel() * p.element_size()
            if p.requires_grad:
                trainable.append(name)
    return sizes, trainable


def partition_pass(gm, ctx: CompileContext):
    """The MIP's partition, or with `cuts=` given (`ctx.settings.cuts`) exactly that one."""
    from .passes.partition import solve

    s = ctx.settings
    if s.cuts is not None:
        ctx.partition = given_partition(_problem(ctx), s.cuts)
        return None
    problem = _problem(ctx)
    log.info("partition: %d layers on %d GPUs, %d micro-batches; MIP time limit %.0f s", len(ctx.layers),
             len(problem.gpus), problem.microbatches, s.time_limit)
    ctx.partition = solve(problem, solver=s.solver, time_limit=s.time_limit,
                          cache_dir=s.cache_dir, progress=lambda msg: log.info("partition: %s", msg))
    return None


def given_partition(problem, cuts):
    """The partition the user gave (`cuts`: the first layer of every stage after the first),
    timed by the step model on `problem`'s GPU order; no MIP runs. `PlanError` when a cut is
    out of range (value, rule, remedy) or the stages do not fit the GPUs (the rule they break)."""
    import time

    from .errors import PlanError
    from .passes.partition import PartitionResult, evaluate
    from .plans import SolverInfo

    t0, L = time.perf_counter(), len(problem.layers)
    bad = [c for c in cuts if not 0 < c < L]
    if bad:
        raise PlanError(f"cuts={list(cuts)}: {bad[0]} is not a layer index in 1..{L - 1} (this model has {L} "
                        f"layers, plan.layers[0..{L - 1}], and a cut is the first layer of a stage after the first); "
                        f"give cuts below {L}, e.g. from mobius_fx.plan(...).layers")
    boundaries = (0, *cuts)
    ev = evaluate(problem, boundaries)
    if ev is None:
        raise PlanError(f"cuts={list(cuts)} do not fit the GPUs: {misfit(problem, boundaries)}; move the cuts (more, "
                        f"smaller stages), stream in half precision, raise memory_fraction, or let the planner cut "
                        f"(cuts=None)")
    info = SolverInfo("given cuts", f"{list(cuts)}, no MIP run", ev.makespan, float("nan"), time.perf_counter() - t0,
                      0, 0, (len(boundaries),))
    log.info("partition: the given cuts %s, %d stages; predicted step %.4g s", list(cuts), len(boundaries), ev.makespan)
    return PartitionResult(ev.boundaries, ev.makespan, ev.prefetch_fwd, ev.prefetch_bwd, info)


def misfit(problem, boundaries) -> str:
    """The memory rule of docs/schedule.md that stages cut at `boundaries` break worst, with its
    numbers: a stage alone, or a stage with the next one on its GPU (the double buffer)."""
    from .step_model import PrefixSums, memory_rows
    from .units import fmt_bytes

    ls, n = problem.layers, len(problem.gpus)
    edges = list(boundaries) + [len(ls)]
    st = PrefixSums(problem).stages(boundaries)  # evaluate's numbers, tied copies included
    span = lambda k: ls[edges[k]].name + ("" if edges[k + 1] - edges[k] == 1 else f"..{ls[edges[k + 1] - 1].name}")
    where = lambda k: (f" on {problem.gpus[k % n]}, which has {fmt_bytes(problem.capacity[k % n])} usable "
                       f"(memory_fraction {problem.memory_fraction:g})")
    alone, pairs = [], []  # (need / capacity, text): a stage alone is said first, it is the one to split
    for k, (fm, bm) in enumerate(zip(st.fmem, st.bmem)):
        alone.append((max(fm, bm) / problem.capacity[k % n], f"stage {k} ({span(k)}) needs {fmt_bytes(max(fm, bm))}{where(k)}"))
    for k, d, need, with_ in memory_rows(st.fmem, st.bmem, st.held, st.grad_in, n):
        if with_:
            pairs.append((need / problem.capacity[k % n],
                          f"stage {k} ({span(k)}) needs {fmt_bytes(need)} in {('forward', 'backward')[d]} with what "
                          f"stage{'s' if len(with_) > 1 else ''} {' and '.join(map(str, with_))} on its GPU "
                          f"hold{'' if len(with_) > 1 else 's'} meanwhile (the double buffer: weights and boundary "
                          f"activations){where(k)}"))
    worst = max(alone)
    return worst[1] if worst[0] > 1 or not pairs else max(pairs)[1]


def reuse_partition_pass(layers: tuple[str, ...], boundaries: tuple[int, ...]):
    """A partition pass for a variant of a compiled pipeline (another call signature or shape):
    it keeps `boundaries`, the cuts of the plan it varies, when its layers have the same names
    and those cuts fit the GPUs with this example's costs; otherwise it partitions again."""

    def reuse(gm, ctx: CompileContext):
        from .passes.partition import PartitionResult, evaluate
        from .plans import SolverInfo

        names = tuple(layer.name for layer in ctx.layers)
        if boundaries and names == tuple(layers):
            ev = evaluate(_problem(ctx), boundaries)
            if ev is not None:
                log.info("partition: the compiled plan's cuts %s fit this call; kept", tuple(boundaries))
                ctx.partition = PartitionResult(ev.boundaries, ev.makespan, ev.prefetch_fwd, ev.prefetch_bwd,
                                                SolverInfo("reused", "cuts kept", ev.makespan, 0.0))
                return None
            why = "do not fit the GPUs with this call's costs"
        else:
            why = f"are for other layers ({len(layers)} layers; this trace has {len(names)})"
        log.warning("mobius_fx: the compiled plan's cuts %s %s; partitioning again", tuple(boundaries), why)
        return partition_pass(gm, ctx)

    return reuse


def cross_map_pass(gm, ctx: CompileContext):
    from .passes.cross_map import cross_map

    s = ctx.settings
    cuts = list(ctx.partition.boundaries) + [len(ctx.layers)]
    stages = [ctx.layers[a:b] for a, b in zip(cuts, cuts[1:])]
    # What each stage uploads: the bytes the cost model weighs against shared links. Activation
    # hops are left out: weighed in, they pulled neighbours under one root complex, which the
    # simulator measured as slower on mobius-testbed (uploads dominate the shared uplinks).
    stage_bytes = [sum(l.param_bytes for l in st) * s.precision.scale for st in stages]
    ctx.order = tuple(cross_map(ctx.topology, num_stages=len(stages), stage_bytes=stage_bytes,
                                method=s.cross_map))
    return None


def plan_pass(gm, ctx: CompileContext):
    from .errors import PlanError
    from .passes.partition import evaluate, solve
    from .plans import build_plan

    s = ctx.settings
    part = ctx.partition
    # The partitioner cut and timed the stages on the identity order; re-time them on the mapped
    # order (routes, bandwidths and GPU memory can differ per GPU) so the plan is for its order.
    problem = _problem(ctx, order=ctx.order)
    ev = evaluate(problem, part.boundaries)
    if ev is None and s.cuts is not None:  # given cuts are planned as given, never cut again
        raise PlanError(f"cuts={list(s.cuts)} fit the GPUs in the topology's order, but cross_map={s.cross_map!r} "
                        f"chose GPU order {ctx.order} (stage k runs on its GPU k % {len(ctx.order)}), where "
                        f"{misfit(problem, part.boundaries)}; plan them with cross_map='identity', or give other "
                        f"cuts")
    if ev is not None:
        step_time, prefetch = ev.makespan, ev.prefetch_fwd
    else:  # the cuts do not fit the mapped order's GPUs: cut again for that order, never the old cuts
        log.info("plan: the partition's stages do not fit GPU order %s; partitioning again for it", ctx.order)
        try:
            part = solve(problem, solver=s.solver, time_limit=s.time_limit, cache_dir=s.cache_dir,
                         progress=lambda msg: log.info("partition (order %s): %s", ctx.order, msg))
        except PlanError as e:
            raise PlanError(f"cross_map chose GPU order {ctx.order} (stage k runs on its GPU k % {len(ctx.order)}); "
                            f"the partition cut for the topology's order, boundaries {part.boundaries}, does not "
                            f"fit these GPUs in that order and no other partition does: {e}; or keep the "
                            f"topology's order (cross_map='identity')") from None
        step_time, prefetch = part.makespan, part.prefetch_fwd
    sizes, trainable = _param_sizes(ctx)
    ctx.plan = build_plan(ctx.layers, part.boundaries, order=ctx.order, topology=ctx.topology,
                          microbatches=s.microbatches, microbatches_rule=s.microbatches_rule,
                          step_time=step_time, precision=s.precision,
                          memory_fraction=s.memory_fraction, prefetch_fwd=prefetch,
                          solver=part.solver, param_sizes=sizes, trainable=trainable,
                          input_bytes=_input_bytes(ctx))
    return None


def _input_bytes(ctx: CompileContext) -> int:
    import torch
    from torch.utils._pytree import tree_leaves

    leaves = tree_leaves((ctx.example_inputs, ctx.example_kwargs))
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def insert_transfers_pass(gm, ctx: CompileContext):
    from .passes.insert_transfers import insert_transfers

    p = ctx.plan
    ctx.stages = insert_transfers(gm, stage_nodes=[s.nodes for s in p.stages], stage_gpus=[s.gpu for s in p.stages],
                                  microbatches=p.microbatches)
    return None


def emit_pass(gm, ctx: CompileContext):
    from .pipeline import build_pipeline

    s = ctx.settings
    ctx.pipeline = build_pipeline(ctx.model, gm, schedule=ctx.stages, plan=ctx.plan, example_inputs=ctx.example_inputs,
                                  example_kwargs=ctx.example_kwargs or None, device=s.device,
                                  batch_dims=s.batch_dims, memory_books=s.memory_books)
    return None
