"""The step model the planner solves: the one statement, in code, of a training step's time and
memory under a partition (docs/schedule.md writes it out in formulas).

Every encoding of the model reads it from here, so they cannot drift apart:

* memory: `MemoryModel.footprint` and `stage_memory`, the (forward, backward) bytes of a
  stage: "a stage fits" for the plan tables (`mobius_fx.plans` re-exports both), the
  partitioner, the rows of its MIP (passes/_partition_mip.py) and the simulator's GPipe check;
* the problem: `PartitionProblem`, the pure numbers a partition is solved for (no Topology);
* stage sums: `PrefixSums` of every per-layer quantity the model reads, so a cut set's
  `StageTotals` cost O(S) (the local search) and are linear in the MIP's cut variables;
  `layer_runs`, the runs of layers the model cannot tell apart (the MIP decides over runs);
* the timeline: `memory_violation` (the memory rules) and `timeline` (least start times), and
  `evaluate`, the model solved exactly for fixed cuts: the reference every solver is checked on;
* `SolverInfo`, the report of a solve, which a `Plan` carries.

Why a forward pass is exact for fixed cuts: every constraint reads "start >= something" and
the objective grows with every start time. The prefetch p_k only appears in
`F[k][0] >= E + (W_k - p_k)/up` with E the end of stage k-N, so the largest allowed
p_k = min(W_k, up·span, free) is optimal, which gives
`F[k][0] >= max(E, F[k-N][0] + W_k/up, E + (W_k - free)/up)`: a max of non-decreasing
functions of earlier starts. Hence the least start times (a longest path, computed stage
by stage) are optimal, and delaying an earlier stage to lengthen its span never helps.
The end of the step is the last gradient download: downloads queue per GPU,
`D_k = max(B[k][M-1] + b_k, D_{k+N}) + G_k/down_k`, again a max of earlier times. So are
the rows of the saved inputs (offloads queued on a GPU's download stream, restores on its
upload stream after them and after the weights, the backward prefetch after the restores
before it; docs/schedule.md), each a lower bound of what the IR's order forces, so the model
stays a relaxation of the simulator.

    prob = PartitionProblem.from_topology(layers, topo, microbatches=4)
    evaluate(prob, (0, 4, 8)).makespan      # seconds per step of a 3-stage plan
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from .costs import LayerCost, dtype_bytes
from .errors import PlanError

__all__ = [
    "MEMORY_TOLERANCE", "SolverInfo", "MemoryModel", "stage_memory", "PartitionProblem", "Evaluation",
    "StageTotals", "PrefixSums", "layer_runs", "memory_violation", "Timeline", "timeline", "evaluate",
]

MEMORY_TOLERANCE = 1e-6  # relative slack on capacity, the solvers' feasibility tolerance


@dataclass(frozen=True)
class SolverInfo:
    """What the partitioner did: solver, status, objective (s), gap, wall time, problem size."""

    name: str = "none"
    status: str = "not solved"
    objective: float = float("nan")
    gap: float = float("nan")  # relative gap between incumbent and bound (0 = proven optimal)
    wall_time: float = 0.0
    variables: int = 0
    constraints: int = 0
    stage_counts: tuple[int, ...] = ()  # candidate stage counts S tried
    cached: bool = False

    def __str__(self) -> str:
        gap = "n/a" if self.gap != self.gap or self.gap == float("inf") else f"{self.gap:.1%}"  # NaN or inf
        return (f"{self.name} {self.status} (gap {gap}, {self.wall_time:.2f} s, "
                f"{self.variables} vars, {self.constraints} constraints{', cached' if self.cached else ''})")


@dataclass(frozen=True)
class MemoryModel:
    """Bytes scale factors and the constant working-memory term of a plan, and the stage
    footprint formula (`footprint`) that `stage_memory`, the partitioner and its MIP share.

    Layer costs are traced in the model's own dtype (fp32 masters); weights and activations
    on the GPU are `weight_scale`/`act_scale` times that when streaming in half precision.
    """

    microbatches: int
    weight_scale: float = 1.0
    act_scale: float = 1.0
    working_bytes: float = 0.0  # largest layer's working memory for one micro-batch

    @staticmethod
    def for_layers(layers: Sequence[LayerCost], microbatches: int, dtype: Any = None,
                   master_dtype: Any = "float32") -> "MemoryModel":
        scale = dtype_bytes(dtype) / dtype_bytes(master_dtype) if dtype is not None else 1.0
        work = max((l.peak_bytes for l in layers), default=0) * scale / microbatches
        return MemoryModel(microbatches, scale, scale, work)

    @property
    def grad_copies(self) -> int:
        """Copies of a stage's weight gradients on its GPU in backward: the sum so far and,
        with several micro-batches, the fresh gradients of the micro-batch being added to it
        (autograd hands a stage call's weight gradients back all at once)."""
        return 2 if self.microbatches > 1 else 1

    def recompute_bytes(self, layer: LayerCost) -> float:
        """What recomputing `layer` with grad keeps until its backward, for one micro-batch: at
        most its live-in activations and every tensor its nodes produce (`peak_bytes`)."""
        return layer.peak_bytes * self.act_scale / self.microbatches

    def footprint(self, weights: Any, grads: Any, recompute: Any, boundary: Any) -> tuple[Any, Any]:
        """(forward, backward) bytes of a stage from its sums over its layers: weights, weight
        gradients, `recompute_bytes`, and M x (boundary input + output) activations. Linear
        in them, so the MIP can call it with PuLP expressions.

        forward  = weights + working + boundary
        backward = weights + grad_copies x gradients + recompute + working + boundary

        working (the largest layer's, one micro-batch) bounds the forward's live intermediates
        and backward's activation gradients in flight; recompute is everything the stage's
        recompute keeps for backward, summed over its layers; boundary covers the stage's
        inputs (forward) and the input and output gradients of its M calls (backward).
        """
        work = self.working_bytes
        return weights + work + boundary, weights + self.grad_copies * grads + recompute + work + boundary


def stage_memory(layers: Sequence[LayerCost], before: LayerCost | None, mm: MemoryModel) -> tuple[float, float]:
    """(forward, backward) GPU footprint of a stage made of `layers`, in bytes (`MemoryModel.footprint`).

    `before` is the layer just before the stage (its output is the stage input), None for
    stage 0. Linear in the layers, so the MIP can use the same formula. What the runtime's
    books measure per stage (`Pipeline.stage_peaks()`) stays at or below the larger of the two.
    """
    m = mm.microbatches
    w = sum(l.param_bytes for l in layers) * mm.weight_scale
    g = sum(l.grad_bytes for l in layers) * mm.weight_scale
    r = sum(mm.recompute_bytes(l) for l in layers)
    act_in = (before.output_bytes if before is not None else 0) * mm.act_scale / m
    act_out = layers[-1].output_bytes * mm.act_scale / m if layers else 0.0
    return mm.footprint(w, g, r, m * (act_in + act_out))


@dataclass(frozen=True)
class PartitionProblem:
    """Pure numbers the partitioner needs; no Topology, so the solver is testable alone.

    `layers` hold whole-example-batch costs; stage k runs on GPU slot k % N. `up`/`down` are
    DRAM<->GPU bytes/s per slot, `hop[i]` bytes/s from slot i to slot (i+1) % N (forward
    activations; inf when it is the same GPU), `hop_back[i]` bytes/s from slot (i+1) % N back
    to slot i (backward gradients; None: the same as `hop`, for symmetric links). `capacity`
    is usable bytes per slot; `memory_fraction` only feeds messages. `input_bytes` is the
    model's example input for the whole batch as sent (stage 0 receives `input_bytes / M` per
    micro-batch in forward and again in backward); 0 when unknown.
    """

    layers: tuple[LayerCost, ...]
    microbatches: int
    gpus: tuple[str, ...]
    capacity: tuple[int, ...]
    up: tuple[float, ...]
    down: tuple[float, ...]
    hop: tuple[float, ...]
    memory: MemoryModel
    memory_fraction: float = 1.0
    hop_back: tuple[float, ...] | None = None
    input_bytes: float = 0.0

    @property
    def backward_hop(self) -> tuple[float, ...]:
        """Bytes/s of the gradient hop from slot (i+1) % N to slot i: `hop_back`, else `hop`.

        (None is kept as None rather than filled in, so `dataclasses.replace(p, hop=...)`
        changes both directions of a symmetric problem.)
        """
        return self.hop if self.hop_back is None else self.hop_back

    def __post_init__(self) -> None:
        n = len(self.gpus)
        if not self.layers:
            raise PlanError("the model has no layers to partition; trace and annotate it first")
        if self.microbatches < 1:
            raise PlanError(f"microbatches={self.microbatches}; use at least 1")
        if n < 1 or any(len(x) != n for x in (self.capacity, self.up, self.down, self.hop)):
            raise PlanError(f"{n} GPU slots but capacity/up/down/hop have lengths "
                            f"{len(self.capacity)}/{len(self.up)}/{len(self.down)}/{len(self.hop)}; "
                            "give one value per GPU slot")
        for what, xs in (("up", self.up), ("down", self.down)):
            for g, x in zip(self.gpus, xs):
                if not (0 < x < math.inf):
                    raise PlanError(f"{what} bandwidth of {g} is {x}; give a positive, finite bytes/s")
        for g, c in zip(self.gpus, self.capacity):
            if not c > 0:
                raise PlanError(f"usable memory of {g} is {c} bytes; give a positive capacity "
                                f"(GPU memory x memory_fraction)")
        for g, x in zip(self.gpus, self.hop):
            if not x > 0:
                raise PlanError(f"hop bandwidth from {g} is {x}; give a positive bytes/s (inf for the same GPU)")
        if not 0 <= self.input_bytes < math.inf:
            raise PlanError(f"input_bytes={self.input_bytes}; give the model input's bytes (>= 0, 0 when unknown)")
        if self.hop_back is not None:
            if len(self.hop_back) != n:
                raise PlanError(f"{n} GPU slots but hop_back has length {len(self.hop_back)}; give one value "
                                "per GPU slot (or None for the same as hop)")
            for i, x in enumerate(self.hop_back):
                if not x > 0:
                    raise PlanError(f"hop_back bandwidth from {self.gpus[(i + 1) % n]} to {self.gpus[i]} is {x}; "
                                    "give a positive bytes/s (inf for the same GPU)")

    @staticmethod
    def from_topology(layers: Sequence[LayerCost], topology: Any, *, microbatches: int,
                      order: Sequence[str] | None = None, memory_fraction: float = 0.9,
                      dtype: Any = None, input_bytes: float = 0.0) -> "PartitionProblem":
        """Read capacities and bandwidths of the GPUs in `order` (default: topology order);
        `input_bytes`: the model's example inputs, whole batch (what `plans.build_plan` takes).

        PartitionProblem.from_topology(layers, Topology.virtual(gpus=2), microbatches=2)
        """
        if not 0 < memory_fraction <= 1:
            raise PlanError(f"memory_fraction={memory_fraction}; use a fraction in (0, 1], e.g. 0.9")
        by_name = {g.name: g for g in topology.gpus}
        names = tuple(order) if order is not None else tuple(by_name)
        unknown = [n for n in names if n not in by_name]
        if unknown or len(set(names)) != len(names):
            raise PlanError(f"order {names} must list distinct GPUs of the topology ({', '.join(by_name)})")
        n = len(names)

        def bw(a: str, b: str) -> float:
            return math.inf if a == b else float(topology.bandwidth(a, b))

        hop = tuple(bw(names[i], names[(i + 1) % n]) for i in range(n))
        hop_back = tuple(bw(names[(i + 1) % n], names[i]) for i in range(n))
        return PartitionProblem(
            layers=tuple(layers), microbatches=microbatches, gpus=names,
            capacity=tuple(int(by_name[g].memory * memory_fraction) for g in names),
            up=tuple(float(topology.bandwidth("host", g)) for g in names),
            down=tuple(float(topology.bandwidth(g, "host")) for g in names),
            hop=hop, memory=MemoryModel.for_layers(layers, microbatches, dtype),
            memory_fraction=memory_fraction, hop_back=hop_back, input_bytes=float(input_bytes),
        )


# ------------------------------------------------------------------- stage sums
@dataclass(frozen=True)
class StageTotals:
    """Per-stage numbers of one cut set, index k = stage k (docs/schedule.md's notation)."""

    f: list[float]  # f_k: forward seconds per micro-batch
    b: list[float]  # b_k: backward seconds per micro-batch (with recompute)
    w: list[float]  # W_k: weight bytes as streamed
    g: list[float]  # G_k: weight-gradient bytes
    out: list[float]  # out_k: boundary output bytes per micro-batch
    fmem: list[float]  # fwd_mem_k: `MemoryModel.footprint`, forward
    bmem: list[float]  # bwd_mem_k: `MemoryModel.footprint`, backward
    frozen: list[bool] = field(default_factory=list)  # stage k and all before it have no weight gradient:
    # no gradient reaches it, so it runs no backward (no refetch, no recompute): `frozen_stages`


class PrefixSums:
    """Prefix sums of every per-layer number the model reads, so a cut set's `StageTotals`
    cost O(S) (the local search) and are linear in where the cuts fall (the MIP).

    `x[i]` sums layers 0..i-1 (`x[0] = 0`): `f`, `b` seconds per micro-batch, `w`, `g`
    weight and gradient bytes as streamed, `r` recompute bytes (`MemoryModel.recompute_bytes`);
    `out[i]` is layer i's output bytes per micro-batch; `mm` the problem's `MemoryModel`.
    """

    def __init__(self, problem: PartitionProblem):
        self.problem = problem
        ls, mm, m = problem.layers, problem.memory, problem.microbatches
        acc = lambda xs: list(itertools.accumulate(xs, initial=0.0))
        self.f = acc(l.fwd_time / m for l in ls)
        self.b = acc(l.bwd_time / m for l in ls)
        self.w = acc(l.param_bytes * mm.weight_scale for l in ls)
        self.g = acc(l.grad_bytes * mm.weight_scale for l in ls)
        self.r = acc(mm.recompute_bytes(l) for l in ls)
        self.out = [l.output_bytes * mm.act_scale / m for l in ls]
        self.mm = mm

    def stages(self, cuts: Sequence[int]) -> StageTotals:
        """The numbers of the stages that start at `cuts` (equal to `stage_memory` and sums)."""
        edges, m = list(cuts) + [len(self.out)], self.problem.microbatches
        st = StageTotals([], [], [], [], [], [], [])
        for a, z in zip(edges, edges[1:]):
            w, g = self.w[z] - self.w[a], self.g[z] - self.g[a]
            acts = m * ((self.out[a - 1] if a else 0.0) + self.out[z - 1])
            fm, bm = self.mm.footprint(w, g, self.r[z] - self.r[a], acts)  # = stage_memory
            st.f.append(self.f[z] - self.f[a])
            st.b.append(self.b[z] - self.b[a])
            st.w.append(w)
            st.g.append(g)
            st.out.append(self.out[z - 1])
            st.fmem.append(fm)
            st.bmem.append(bm)
            st.frozen.append(self.g[z] == 0)
        return st

    def score(self, cuts: Sequence[int]) -> tuple[float, float]:
        """(memory violation, makespan): (0, seconds) if the cuts fit, else (> 0, inf)."""
        st = self.stages(cuts)
        v = memory_violation(self.problem, st)
        return (v, timeline(self.problem, st)) if v == 0 else (v, math.inf)


def layer_runs(problem: PartitionProblem) -> list[tuple[int, int]]:
    """(start, length) of maximal runs of layers the model cannot tell apart: equal in every
    number it reads (times, weights, gradients, output and, through the recompute memory, peak
    bytes). The MIP decides its cuts over these runs."""
    key = lambda l: (l.fwd_time, l.bwd_time, l.param_bytes, l.grad_bytes, l.output_bytes, l.peak_bytes)
    runs: list[tuple[int, int]] = []
    for i, l in enumerate(problem.layers):
        if runs and key(problem.layers[runs[-1][0]]) == key(l):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


# ---------------------------------------------------------------- the timeline
@dataclass(frozen=True)
class Evaluation:
    """The schedule of fixed cuts: start times F[k][i] / B[k][i], prefetches, memory,
    `grad_done[k]` = D_k, when stage k's gradients are in DRAM (makespan = max of them), and
    the helper times of the saved-input rows (`Timeline`): `host_copy_start[k][i]` = V_k,i for
    the stages resident through the turn (() for the others), `host_copies_done[k]` = E_k,
    `weights_back[k]` = A_k and `restores_done[k]` = R_k."""

    boundaries: tuple[int, ...]
    makespan: float
    prefetch_fwd: tuple[float, ...]
    prefetch_bwd: tuple[float, ...]
    fwd_start: tuple[tuple[float, ...], ...]
    bwd_start: tuple[tuple[float, ...], ...]
    fwd_mem: tuple[float, ...]
    bwd_mem: tuple[float, ...]
    grad_done: tuple[float, ...]
    host_copy_start: tuple[tuple[float, ...], ...] = ()
    host_copies_done: tuple[float, ...] = ()
    weights_back: tuple[float, ...] = ()
    restores_done: tuple[float, ...] = ()


@dataclass(frozen=True)
class Timeline:
    """`timeline(..., full=True)`: the least times of docs/schedule.md for fixed stages.

    p / q: bytes prefetched forward / backward; F / B: forward / backward start of the i-th
    micro-batch run of each stage (backward in run order); D: end of each stage's gradient
    download; V: start of micro-batch i's copies to the host (offload, model output) of each
    stage resident through the turn (k >= S-N; no key for the others); E: end of the copies of
    stage k and those before it on its GPU (read for k < S-N); A: stage k's weights back for
    backward (k < S-N); R: the least end of the uploads up to and including stage k's restores
    (its backward prefetch and the restores of the stages after it on its GPU included).
    """

    makespan: float
    p: list[float]
    q: list[float]
    F: list[list[float]]
    B: list[list[float]]
    D: list[float]
    V: dict[int, list[float]]
    E: list[float]
    A: list[float]
    R: list[float]


def _reference_totals(problem: PartitionProblem, cuts: Sequence[int]) -> StageTotals:
    """`StageTotals` summed layer by layer through `stage_memory` (what `evaluate` trusts)."""
    ls, mm, m = problem.layers, problem.memory, problem.microbatches
    edges = list(cuts) + [len(ls)]
    st = StageTotals([], [], [], [], [], [], [])
    for a, z in zip(edges, edges[1:]):
        part = ls[a:z]
        fm, bm = stage_memory(part, ls[a - 1] if a > 0 else None, mm)
        st.f.append(sum(l.fwd_time for l in part) / m)
        st.b.append(sum(l.bwd_time for l in part) / m)
        st.w.append(sum(l.param_bytes for l in part) * mm.weight_scale)
        st.g.append(sum(l.grad_bytes for l in part) * mm.weight_scale)
        st.out.append(part[-1].output_bytes * mm.act_scale / m)
        st.fmem.append(fm)
        st.bmem.append(bm)
        st.frozen.append(not any(l.grad_bytes for l in ls[:z]))
    return st


def memory_violation(problem: PartitionProblem, st: StageTotals) -> float:
    """Sum of relative overshoots of every memory rule of docs/schedule.md (0 = fits): each
    stage in forward and in backward, and the double buffer (a stage plus the next one on its
    GPU), within `MEMORY_TOLERANCE` of capacity."""
    n, s, cap = len(problem.gpus), len(st.f), problem.capacity
    v = 0.0
    for k in range(s):
        c = cap[k % n] * (1 + MEMORY_TOLERANCE)
        rows = [st.fmem[k], st.bmem[k]]
        if k + n < s:
            rows.append(st.fmem[k] + st.fmem[k + n])
        if k >= n:
            rows.append(st.bmem[k] + st.bmem[k - n])
        v += sum(max(0.0, r - c) / max(cap[k % n], 1) for r in rows)
    return v


def timeline(problem: PartitionProblem, st: StageTotals, full: bool = False):
    """Least start times of docs/schedule.md for fixed stages (exact: see the module docstring).

    Returns the makespan, or with `full` a `Timeline` (prefetched bytes, start times, download
    ends and the saved-input helpers V, E, A and R). Memory is not checked here
    (`memory_violation`); the prefetches use the free memory.
    """
    n, m, s = len(problem.gpus), problem.microbatches, len(st.f)
    up, down, cap = problem.up, problem.down, problem.capacity
    # out_k over the link stage k -> k+1 (forward) and k+1 -> k (backward); 0 on the same GPU
    hop_t = [st.out[k] / problem.hop[k % n] for k in range(s)]
    # A frozen stage (no weight gradient in it or before it) runs no backward: no gradient
    # reaches it, its weights are not fetched again, it recomputes nothing, and its input is
    # neither saved nor restored.
    live = [not x for x in st.frozen] if st.frozen else [True] * s
    hop_back_t = [st.out[k] / problem.backward_hop[k % n] if live[k] else 0.0 for k in range(s)]
    f, w = st.f, st.w
    b = [x if on else 0.0 for x, on in zip(st.b, live)]
    wb = [x if on else 0.0 for x, on in zip(st.w, live)]  # weights fetched again for backward
    # Saved inputs (schedule.py): in_k per micro-batch (k = 0: the model input as sent). Stage
    # k > 0 offloads it to the host after each forward run (d_k) and restores it before each
    # backward run (r_k); stage 0's model input is sent again (r_0). The last stage copies its
    # output to the host (h) and gets its gradient back (e).
    in0 = problem.input_bytes / m
    inp = [in0, *st.out[:s - 1]]
    r = [inp[k] / up[k % n] if live[k] else 0.0 for k in range(s)]
    d = [inp[k] / down[k % n] if live[k] and k else 0.0 for k in range(s)]
    out_down = st.out[s - 1] / down[(s - 1) % n]
    out_up = st.out[s - 1] / up[(s - 1) % n] if live[s - 1] else 0.0
    F: list[list[float]] = []
    p = [0.0] * s
    for k in range(s):
        sl = k % n
        if k < n:
            t0 = w[k] / up[sl]
        else:
            prev = F[k - n]
            end = prev[m - 1] + f[k - n]
            p[k] = max(0.0, min(w[k], up[sl] * (end - prev[0]), cap[sl] - st.fmem[k - n]))
            t0 = end + (w[k] - p[k]) / up[sl]
        row = [0.0] * m
        t, fk = t0, f[k]
        if k:
            before, gap = F[k - 1], f[k - 1] + hop_t[k - 1]
            for i in range(m):
                if before[i] + gap > t:
                    t = before[i] + gap
                row[i] = t
                t += fk
        else:  # the model inputs of micro-batches 0..i and the weights share stage 0's host link
            for i in range(m):
                if (w[0] + (i + 1) * in0) / up[0] > t:
                    t = (w[0] + (i + 1) * in0) / up[0]
                row[i] = t
                t += fk
        F.append(row)
    # Copies to the host leave on each GPU's download stream in stage and micro-batch order
    # (a stage's are released before the next stage's on the GPU, and served first): stage k's
    # offload (d_k), then, for the last stage, its output (h), each after its forward run.
    # V[k][i] is when micro-batch i's copies start, for a stage resident through the turn
    # (k >= S-N), whose restores wait for them. The other stages' copies only delay the
    # resident one's: E[k] bounds when those of stage k (and the stages before it on its GPU)
    # are done, by the first and the last micro-batch's (both exact when forward runs follow
    # each other without a gap; the MIP keeps two rows instead of M).
    copy = d[:]
    copy[s - 1] += out_down
    V: dict[int, list[float]] = {}
    E = [-math.inf] * s
    for k in range(1 if s > 1 else 0, s):
        before, c, row = E[k - n] if k >= n else -math.inf, copy[k], F[k]
        if k < s - n:
            E[k] = max(before + m * c, row[0] + f[k] + m * c, row[m - 1] + f[k] + c)
            continue
        v, t = [], before
        for i in range(m):
            if row[i] + f[k] > t:
                t = row[i] + f[k]
            v.append(t)
            t += c
        V[k] = v
    B: list[list[float]] = [[0.0] * m for _ in range(s)]
    q = [0.0] * s
    A = [0.0] * s  # stage k's weights back for backward (k < S-N), at the least
    R = [0.0] * s  # the restores of stage k (and the uploads before them on its GPU) done, at the least
    for k in range(s - 1, -1, -1):
        sl = k % n
        # ready[j] / first, last: the least start of the j-th backward run (micro-batch M-1-j)
        # from the uploads it waits for: the restores of micro-batches M-1..M-1-j, serial on the
        # upload stream, each after its offload and after the stage's weights.
        ready, last = None, -math.inf
        if k >= s - n:  # resident: restore j after offload M-1-j (and the later ones after theirs)
            t0 = F[k][m - 1] + f[k] if k == s - 1 else 0.0
            if k:
                v, dk, rk = V[k], d[k], r[k]
                ready = [v[m - 1 - j] + dk + (j + 1) * rk for j in range(m)]
                R[k] = max(v[i] + dk + (m - i) * rk for i in range(m))
            else:  # a resident stage 0: the model input is sent again after the first upload
                ready = [w[0] / up[0] + (j + 1) * r[0] for j in range(m)]
            if k == s - 1:  # the output's gradient comes back from the host after the output went
                v = V[k]
                ready = [max(x, v[m - 1 - j] + copy[k] + (j + 1) * out_up) for j, x in enumerate(ready)]
        else:  # the prefetch starts with stage k+N's backward and queues after its restores (its
            # offloads are older than the resident stage's, so they are implied); the first
            # run waits for one restore, the last for all M (the MIP keeps these two rows)
            nxt = B[k + n]
            end = nxt[m - 1] + b[k + n]
            q[k] = max(0.0, min(wb[k], up[sl] * (end - nxt[0]), cap[sl] - st.bmem[k + n]))
            t0 = end + (wb[k] - q[k]) / up[sl]
            A[k] = max(R[k + n], nxt[0]) + wb[k] / up[sl]
            R[k] = last = A[k] + m * r[k]
            if A[k] + r[k] > t0:
                t0 = A[k] + r[k]
        row, t, bk = B[k], t0, b[k]
        if k < s - 1:
            after, gap = B[k + 1], b[k + 1] + hop_back_t[k]
            if ready is None:
                for i in range(m):
                    if after[i] + gap > t:
                        t = after[i] + gap
                    row[i] = t
                    t += bk
            else:
                for i in range(m):
                    if after[i] + gap > t:
                        t = after[i] + gap
                    if ready[i] > t:
                        t = ready[i]
                    row[i] = t
                    t += bk
        else:
            for i in range(m):
                if ready[i] > t:
                    t = ready[i]
                row[i] = t
                t += bk
        if last > row[m - 1]:  # the last run waits for all M restores
            row[m - 1] = last
    D = [0.0] * s  # gradient downloads queue per GPU: stage k's after stage k+N's
    for k in range(s - 1, -1, -1):
        done = B[k][m - 1] + b[k]
        if k + n < s and D[k + n] > done:
            done = D[k + n]
        D[k] = done + st.g[k] / problem.down[k % n]
    makespan = max(D)
    return Timeline(makespan, p, q, F, B, D, V, E, A, R) if full else makespan


def evaluate(problem: PartitionProblem, boundaries: Sequence[int]) -> Evaluation | None:
    """The schedule model for fixed `boundaries`, solved exactly; None if memory does not fit.

    evaluate(prob, (0, 4, 8)).makespan      # seconds per step of a 3-stage plan
    """
    cuts = tuple(int(c) for c in boundaries)
    if not cuts or cuts[0] != 0 or any(b <= a for a, b in zip(cuts, cuts[1:])) or cuts[-1] >= len(problem.layers):
        raise PlanError(f"boundaries {cuts} must start at 0 and increase strictly below "
                        f"{len(problem.layers)} (the number of layers)")
    st = _reference_totals(problem, cuts)
    if memory_violation(problem, st) > 0:
        return None
    tl = timeline(problem, st, full=True)
    return Evaluation(cuts, tl.makespan, tuple(tl.p), tuple(tl.q), tuple(map(tuple, tl.F)), tuple(map(tuple, tl.B)),
                      tuple(st.fmem), tuple(st.bmem), tuple(tl.D),
                      tuple(tuple(tl.V.get(k, ())) for k in range(len(cuts))), tuple(tl.E), tuple(tl.A),
                      tuple(tl.R))
