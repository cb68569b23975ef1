"""The partition pass: cut the layers into pipeline stages (the Mobius MIP over run-length-encoded
layers, or the user's cuts) and map the stages onto the GPUs (cross_map), one pass.

`partition_pass` writes the facts "partition" and "order": it cuts on the topology's GPU order,
maps those stages to a GPU order (passes/cross_map.py, by the bytes each stage uploads), and
times the cuts on that order (routes, bandwidths and GPU memory can differ per GPU); when they
do not fit it, it cuts again for that order (given cuts are refused instead: never cut again).
The plan pass then builds the Plan from these facts alone.

The model it solves — a step's timeline and memory for given cuts, docs/schedule.md — is
stated once, in `mobius_fx.planning.step_model`; this pass searches it three ways that must agree:

* `evaluate(problem, boundaries)` (from the step model) — the model solved exactly for fixed
  cuts. The reference for everything else.
* `brute_force(problem)` — every cut set through `evaluate`; small instances only.
* `solve(problem)` — a mixed-integer program in PuLP (HiGHS or CBC), with the incumbent from
  `heuristic(problem)` (balanced cuts + local search through the same model,
  passes/partition_search.py): a cutoff for
  HiGHS (never a MIP start, which HiGHS 1.16 could "prove" optimal when it was not), a warm
  start for CBC. The search over stage counts lives in passes/partition_solve.py, the
  program and the solver driving in passes/_partition_mip.py.

`solve` considers every stage count S = 1..L (issue 14: N, 2N, ... and a few others missed
the best count by up to 26% and still reported "optimal"). Most counts are settled without a
MIP: each gets a closed-form lower bound (`stage_count_bound`, O(L), passes/partition_bounds.py) and balanced cuts (equal
stages, and for S not a multiple of N equal work per GPU); then, lowest bound first, the LP of
a reduced relaxation of its program (`lp_bound`: first and last micro-batch only; 0.05-0.15 s
for the 15.9B GPT) settles the counts whose bound reaches the incumbent or whose memory rows
are infeasible; the MIP runs on the counts left, lowest bound first, cut off at the incumbent.
The reported gap is the best plan against the least bound over every count, so it holds still
from run to run (0.6% for the 15.9B GPT on mobius-testbed at 20 s; at 10 s on 2 cores some
counts keep only the closed-form bound and the gap says so, ~10%).

The MIP decides only stage boundaries. A model is a few runs of identical layers (a GPT is
embedding + 72 equal blocks + head), so a cut k picks one run r (binary `z[k,r]`, runs from
`step_model.layer_runs`) and how many layers of that run precede it (integer `t[k,r]`).
Prefix sums of every per-layer quantity (`step_model.PrefixSums`) are then linear in (z, t),
and so are stage times, weights, the boundary activation (the output of the run the cut falls
after) and the memory of `stage_memory`, which the MIP and the local search compute with the
same `MemoryModel.footprint` on the same sums (weights, gradients, recompute bytes, boundary
activations). One binary per (layer, stage) does not finish in CBC at 75 layers; this form
has (S-1)·R binaries, plus, for a tied weight read by a layer other than the first or the
last, one binary per stage that layer can fall in (which stage keeps a copy of it).

For fixed cuts the least start times are optimal (`step_model`'s docstring says why), and the
MIP uses the same elimination of the prefetch p, the same rows for the saved inputs (the
bytes of a boundary activation are linear in the cut variables), and drops rows that others
imply for every cut set (`_partition_mip_rows.add_memory_rows` checks each from the footprint's coefficients): `p_k <= free`
and `q_k <= free` follow from the double buffer (W_k <= mem_k), the forward rules from the
backward ones (bwd_mem >= fwd_mem), and a stage's own rule from its double-buffer pair.

    prob = PartitionProblem.from_topology(layers, topo, microbatches=4)
    result = solve(prob)            # PartitionResult(boundaries=(0, 3, 7, ...), makespan=...)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from mobius_fx.errors import PlanError
from mobius_fx.planning.host_step import PLANNED_OPTIMIZERS, HostPass, widen_fits, widened_downloads
from mobius_fx.precision import Precision
from mobius_fx.planning.step_model import Evaluation, PartitionProblem, SolverInfo, evaluate
from mobius_fx.planning.step_memory import tied_weights

from .cross_map import cross_map
from .partition_infeasible import misfit
from .partition_search import PartitionResult
from .partition_solve import solve

if TYPE_CHECKING:  # pragma: no cover
    from mobius_fx.options import CompileContext

__all__ = ["partition_pass", "reuse_partition_pass", "kept_partition_pass", "hinted_partition_pass", "cut_stages", "map_stages", "on_order", "given_partition",
           "problem_of", "widen_open", "widen_choice", "WIDEN_MARGIN", "param_sizes", "input_bytes"]

log = logging.getLogger("mobius_fx")

Cut = Callable[["CompileContext"], PartitionResult]  # the stages on the topology's GPU order
Order = Callable[["CompileContext", PartitionResult], Sequence[str]]  # their GPU order


def partition_pass(gm: Any, ctx: CompileContext, *, cut: Cut | None = None, order: Order | None = None) -> None:
    """The partition pass (reads layers, topology, settings, model, example_inputs; writes
    partition and order): the stages `cut` gives (default `cut_stages`: the MIP, or `cuts=`),
    on the GPU order `order` gives them (default `map_stages`: cross_map), timed on that order
    (`on_order`: cut again when they do not fit it). `cut` and `order` let a caller swap one
    step and keep the rest (`reuse_partition_pass`; a test's fixed GPU order). Where whether the
    GPUs widen the gradient downloads is the planner's to choose (`widen_open`), `widen_choice`
    chooses it, planning again for the other mode when that gives a shorter step."""
    part, gpus = _partitioned(ctx, cut, order)
    given = ctx.settings.widen_downloads
    if given is not None:
        part = dataclasses.replace(part, widen=given, widen_why=f"the caller's (widen_downloads={given})")
    elif widen_open(ctx):
        part, gpus = widen_choice(ctx, part, gpus, cut, order)
    ctx.order = gpus
    ctx.partition = part
    return None


def _partitioned(ctx: CompileContext, cut: Cut | None, order: Order | None) -> tuple[PartitionResult, tuple[str, ...]]:
    part = (cut or cut_stages)(ctx)
    gpus = tuple((order or map_stages)(ctx, part))
    return on_order(ctx, part, gpus), gpus


# Where the topology's rule would not widen the gradient downloads (`widen_fits`: a GPU's link to
# the host shared or half duplex), the widened step must be shorter by this share in the step
# model before the planner widens: a near tie keeps the links' bytes down.
WIDEN_MARGIN = 0.01


class _Widened:
    """A read-only view of a compile's context whose settings set `widen_downloads` (the passes'
    context is recorded, not copied: `compiler._Recorder`); the partition helpers only read it."""

    def __init__(self, ctx: Any, widen: bool) -> None:
        self._ctx = ctx
        self.settings = dataclasses.replace(ctx.settings, widen_downloads=widen)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


def widen_open(ctx: CompileContext) -> bool:
    """Whether widening the gradient downloads is the planner's to choose for `ctx`: the
    caller did not set it (`widen_downloads=None`), the overlap keeping the fp32 `.grad` would
    widen them (sync or async, `keep_grads`, a half-precision stream: `widened_downloads`) and the
    topology's rule says not to (`widen_fits` False: a link shared or half duplex, where 2 more
    bytes per parameter may slow the pipeline, or save the host more than that costs)."""
    s = ctx.settings
    if s.widen_downloads is not None or PLANNED_OPTIMIZERS.get(s.optimizer, 0) == 0:
        return False
    precision = s.precision or Precision()
    return (widened_downloads(s.optimizer_overlap, 4 * precision.scale, 1, s.keep_grads, True)
            and not widen_fits(ctx.topology))


def widen_choice(ctx: CompileContext, part: PartitionResult, gpus: tuple[str, ...], cut: Cut | None = None,
                 order: Order | None = None) -> tuple[PartitionResult, tuple[str, ...]]:
    """`part` (planned downloading the gradients as streamed, the rule's mode on this topology)
    or a partition planned with them widened, whichever the step model times shorter: the same
    cuts are timed widened (no MIP); when that is shorter by `WIDEN_MARGIN`, the cuts are planned
    again widened (the caller's `cut` again where given, else the MIP started from `part`'s cuts;
    never with `cuts=` given) and
    the shorter of the two kept. So the plan's prediction, its pick and the simulator (which
    follows `Plan.widen_downloads`) time the same mode. Returns the partition, with `widen` and
    `widen_why` set, and its GPU order."""
    wide = _Widened(ctx, True)
    ev = evaluate(problem_of(wide, order=gpus), part.boundaries)
    if ev is None or ev.makespan >= part.makespan * (1 - WIDEN_MARGIN):
        timed = "" if ev is None else f", {ev.makespan:.4g} s widened"
        return dataclasses.replace(part, widen=False, widen_why=f"the step model: {part.makespan:.4g} s as "
                                                               f"streamed{timed}"), gpus
    best = PartitionResult(ev.boundaries, ev.makespan, ev.prefetch_fwd, ev.prefetch_bwd, part.solver)
    best_gpus = gpus
    if ctx.settings.cuts is None:
        log.info("partition: widened gradient downloads time %.4g s against %.4g s; partitioning again widened",
                 ev.makespan, part.makespan)
        hint = tuple(part.boundaries)
        try:
            again, again_gpus = _partitioned(wide, cut or (lambda c: cut_stages(c, hint)), order)
        except PlanError:
            again = None
        if again is not None and again.makespan < best.makespan:
            best, best_gpus = again, again_gpus
    why = f"the step model: {best.makespan:.4g} s widened, {part.makespan:.4g} s as streamed"
    return dataclasses.replace(best, widen=True, widen_why=why), best_gpus


def cut_stages(ctx: CompileContext, hint: Sequence[int] | None = None) -> PartitionResult:
    """The MIP's partition on the topology's GPU order (started from the boundaries `hint` when
    they fit: `solve`'s), or with `cuts=` given (`ctx.settings.cuts`) exactly that one."""
    s = ctx.settings
    if s.cuts is not None:
        return given_partition(problem_of(ctx), s.cuts)
    problem = problem_of(ctx)
    log.info("partition: %d layers on %d GPUs, %d micro-batches; MIP time limit %.0f s", len(ctx.layers),
             len(problem.gpus), problem.microbatches, s.time_limit)
    return solve(problem, solver=s.solver, time_limit=s.time_limit, cache_dir=s.cache_dir,
                 progress=lambda msg: log.info("partition: %s", msg), hint=hint)


def map_stages(ctx: CompileContext, part: PartitionResult) -> tuple[str, ...]:
    """cross_map's GPU order (`ctx.settings.cross_map`: the method) for the stages cut at
    `part.boundaries`, weighing what each stage uploads."""
    s = ctx.settings
    cuts = list(part.boundaries) + [len(ctx.layers)]
    stages = [ctx.layers[a:b] for a, b in zip(cuts, cuts[1:])]
    # What each stage uploads: the bytes the cost model weighs against shared links. Activation
    # hops are left out: weighed in, they pulled neighbours under one root complex, which the
    # simulator measured as slower on mobius-testbed (uploads dominate the shared uplinks).
    stage_bytes = [sum(l.param_bytes for l in st) * s.precision.scale for st in stages]
    return tuple(cross_map(ctx.topology, num_stages=len(stages), stage_bytes=stage_bytes, method=s.cross_map))


def on_order(ctx: CompileContext, part: PartitionResult, order: tuple[str, ...]) -> PartitionResult:
    """`part`, cut and timed on the topology's GPU order, timed again on `order` (routes,
    bandwidths and GPU memory can differ per GPU), so the plan is for its order. Stages that do
    not fit `order`'s GPUs are cut again for it (never the old cuts); given cuts are planned as
    given, never cut again: PlanError."""
    s = ctx.settings
    problem = problem_of(ctx, order=order)
    ev = evaluate(problem, part.boundaries)
    if ev is not None:
        return PartitionResult(part.boundaries, ev.makespan, ev.prefetch_fwd, ev.prefetch_bwd, part.solver)
    if s.cuts is not None:
        raise PlanError(f"cuts={list(s.cuts)} fit the GPUs in the topology's order, but cross_map={s.cross_map!r} "
                        f"chose GPU order {order} (stage k runs on its GPU k % {len(order)}), where "
                        f"{misfit(problem, part.boundaries)}; plan them with cross_map='identity', or give other "
                        f"cuts")
    log.info("partition: the stages do not fit GPU order %s; partitioning again for it", order)
    try:
        return solve(problem, solver=s.solver, time_limit=s.time_limit, cache_dir=s.cache_dir,
                     progress=lambda msg: log.info("partition (order %s): %s", order, msg))
    except PlanError as e:
        raise PlanError(f"cross_map chose GPU order {order} (stage k runs on its GPU k % {len(order)}); "
                        f"the partition cut for the topology's order, boundaries {part.boundaries}, does not "
                        f"fit these GPUs in that order and no other partition does: {e}; or keep the "
                        f"topology's order (cross_map='identity')") from None


def given_partition(problem: PartitionProblem, cuts: Sequence[int]) -> PartitionResult:
    """The partition the user gave (`cuts`: the first layer of every stage after the first),
    timed by the step model on `problem`'s GPU order; no MIP runs. `PlanError` when a cut is
    out of range (value, rule, remedy) or the stages do not fit the GPUs (the rule they break)."""
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


def reuse_partition_pass(layers: tuple[str, ...], boundaries: tuple[int, ...],
                         widen: bool | None = None) -> Callable[[Any, Any], None]:
    """The partition pass for a variant of a compiled pipeline (another call signature or shape):
    it keeps `boundaries`, the cuts of the plan it varies, when its layers have the same names
    and those cuts fit the GPUs with this example's costs; otherwise it partitions again. `widen`:
    the compiled plan's `widen_downloads`; where that is the planner's to choose (`widen_open`)
    the variant is planned and timed in that mode, not chosen again: the pipeline's overlap
    widens or not for every variant alike (`Pipeline.overlap` reads the compiled plan's)."""

    def reuse(ctx: CompileContext) -> PartitionResult:
        names = tuple(layer.name for layer in ctx.layers)
        if boundaries and names == tuple(layers):
            ev = evaluate(problem_of(ctx), boundaries)
            if ev is not None:
                log.info("partition: the compiled plan's cuts %s fit this call; kept", tuple(boundaries))
                return PartitionResult(ev.boundaries, ev.makespan, ev.prefetch_fwd, ev.prefetch_bwd,
                                       SolverInfo("reused", "cuts kept", ev.makespan, 0.0))
            why = "do not fit the GPUs with this call's costs"
        else:
            why = f"are for other layers ({len(layers)} layers; this trace has {len(names)})"
        log.warning("mobius_fx: the compiled plan's cuts %s %s; partitioning again", tuple(boundaries), why)
        return cut_stages(ctx)

    def run(gm: Any, ctx: CompileContext) -> None:
        if widen is None or not widen_open(ctx):
            return partition_pass(gm, ctx, cut=reuse)
        part, gpus = _partitioned(_Widened(ctx, widen), reuse, None)
        ctx.order = gpus
        ctx.partition = dataclasses.replace(part, widen=widen, widen_why="the compiled plan's choice, which the "
                                                                         "pipeline's overlap follows for every call")
        return None

    return run


def hinted_partition_pass(like: PartitionResult) -> Callable[[Any, Any], None]:
    """The partition pass for another micro-batch count of the same trace, with its own MIP
    (`api.plan` re-planning the count it chose): `partition_pass` whose MIP starts from the cuts
    of `like` (the default count's partition), so it ends no worse than them under the step model."""
    hint = tuple(like.boundaries)
    return lambda gm, ctx: partition_pass(gm, ctx, cut=lambda c: cut_stages(c, hint))


def kept_partition_pass(like: PartitionResult, order: Sequence[str], microbatches: int) -> Callable[[Any, Any], None]:
    """The partition pass for another micro-batch count of the same trace (`api.plan` choosing
    the count): the cuts of `like` on GPU `order`, the partition made at `microbatches` (the
    default count), timed again at this count; no MIP runs (the solver info says whose cuts).
    PlanError naming the stage when they do not fit."""
    boundaries = tuple(like.boundaries)

    def kept(gm: Any, ctx: CompileContext) -> None:
        timed = ctx  # the default count's widening choice, timed so
        if like.widen is not None and ctx.settings.widen_downloads is None:
            timed = _Widened(ctx, like.widen)
        problem = problem_of(timed, order=order)
        ev = evaluate(problem, boundaries)
        if ev is None:
            raise PlanError(f"microbatches={ctx.settings.microbatches}: the cuts {boundaries} planned at {microbatches} "
                            f"do not fit: {misfit(problem, boundaries)}; give microbatches= to plan this "
                            f"count with its own cuts")
        ctx.order = tuple(order)
        info = dataclasses.replace(like.solver, objective=ev.makespan,
                                   status=f"{like.solver.status}; the cuts of microbatches={microbatches}")
        ctx.partition = PartitionResult(ev.boundaries, ev.makespan, ev.prefetch_fwd, ev.prefetch_bwd, info,
                                        like.widen, like.widen_why)

    return kept


def problem_of(ctx: CompileContext, order: Sequence[str] | None = None) -> PartitionProblem:
    """The step model's numbers for this compile: the layers' costs, the GPUs in `order`, the
    model input's bytes, the tied weights' extra copies (as the plan pass's plan counts them) and
    the host's pass under the settings' optimizer, `optimizer_overlap`, `keep_grads` and
    `widen_downloads` (`HostPass`; None: gradients widened on the GPUs where the topology's rule
    says so, host_step.widen_fits)."""
    s = ctx.settings
    sizes, trainable = param_sizes(ctx)
    precision = s.precision or Precision()
    host = HostPass.of(ctx.topology, 4 * precision.scale, s.optimizer, s.optimizer_overlap, s.keep_grads,
                       s.widen_downloads)
    return PartitionProblem.from_topology(ctx.layers, ctx.topology, microbatches=s.microbatches, order=order,
                                          memory_fraction=s.memory_fraction, precision=s.precision,
                                          input_bytes=input_bytes(ctx),
                                          tied=tied_weights(ctx.layers, sizes, trainable) if sizes else (),
                                          host=host)


def param_sizes(ctx: CompileContext) -> tuple[dict[str, int], list[str]]:
    """Bytes of every parameter of the model by qualified name (tied aliases included), and the
    names of those that take a gradient; empty without a model."""
    sizes, trainable = {}, []
    if ctx.model is not None:
        for name, p in ctx.model.named_parameters(remove_duplicate=False):
            sizes[name] = p.numel() * p.element_size()
            if p.requires_grad:
                trainable.append(name)
    return sizes, trainable


def input_bytes(ctx: CompileContext) -> int:
    """Bytes of the example's tensors (positional and keyword): the model input a step uploads."""
    import torch
    from torch.utils._pytree import tree_leaves

    leaves = tree_leaves((ctx.example_inputs, ctx.example_kwargs))
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
