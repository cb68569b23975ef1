"""The step model the planner solves: the one statement, in code, of a training step's time and
memory under a partition (docs/schedule.md writes it out in formulas).

Every encoding of the model reads it from here, so they cannot drift apart:

* memory: `MemoryModel.footprint` and `stage_memory`, the (forward, backward) bytes of a
  stage: "a stage fits" for the plan tables, the partitioner, the rows of its MIP
  (passes/_partition_mip.py) and the simulator's GPipe check (in step_memory.py);
* the problem: `PartitionProblem`, the pure numbers a partition is solved for (no Topology);
* stage sums: `PrefixSums` of every per-layer quantity the model reads, so a cut set's
  `StageTotals` cost O(S) (the local search) and are linear in the MIP's cut variables;
  `layer_runs`, the runs of layers the model cannot tell apart (the MIP decides over runs);
* shared links: `SharedLink` / `shared_links`, a switch uplink several GPUs' weight uploads or
  gradient downloads cross, which carries `servers` of them at a time in the order the pipeline
  needs them (`queue_before`, `queue_window`; in step_timeline.py);
* tied weights: `TiedWeight` / `tied_weights`, the extra copy (and gradient) a stage keeps of
  a parameter another stage's layer owns, `tied_copy_bytes` its bytes (`plans.build_plan` too;
  in step_memory.py);
* the timeline: `memory_violation` (the memory rules, `memory_rows`; in step_memory.py) and
  `timeline` (least start times; in step_timeline.py), and
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

from mobius_fx.planning.costs import LayerCost
from mobius_fx.planning.host_step import HostPass
from mobius_fx.errors import PlanError
from mobius_fx.planning.microbatch import check_count
from mobius_fx.precision import Precision
from mobius_fx.planning.step_memory import MemoryModel, TiedWeight, memory_violation, stage_memory, tied_copy_bytes
from mobius_fx.planning.link_loads import LinkLoad, link_loads
from mobius_fx.planning.step_timeline import Evaluation, SharedLink, shared_links, timeline

__all__ = ["SolverInfo", "PartitionProblem", "StageTotals", "PrefixSums", "layer_runs", "evaluate"]


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
class PartitionProblem:
    """Pure numbers the partitioner needs; no Topology, so the solver is testable alone.

    `layers` hold whole-example-batch costs; stage k runs on GPU slot k % N. `up`/`down` are
    host<->GPU bytes/s per slot, `hop[i]` bytes/s from slot i to slot (i+1) % N (forward
    activations; inf when it is the same GPU), `hop_back[i]` bytes/s from slot (i+1) % N back
    to slot i (backward gradients; None: the same as `hop`, for symmetric links). `capacity`
    is usable bytes per slot; `memory_fraction` only feeds messages. `input_bytes` is the
    model's example input for the whole batch as sent (stage 0 receives `input_bytes / M` per
    micro-batch in forward and again in backward); 0 when unknown. `tied`: the parameters
    layers read without owning them (`tied_weights`), whose extra copies cost bytes.
    `shared_up` / `shared_down`: links the weight uploads / gradient downloads of several
    slots share (`shared_links`); their copies queue on them (`queue_before`). `duplex[i]`:
    the share of each direction slot i's host route keeps while both directions are busy (the
    least `Topology.link_duplex` on it; None: 1, full duplex), which its backward weight copies
    and its gradient downloads get (docs/schedule.md). `links`: every link the step's copies
    cross and which (`link_loads`); the makespan is at least each one's bytes over its
    bandwidth (`link_time`), as `Plan.lower_bound` counts them. `host`: the CPU optimizer's work
    the step waits for (`host_step.HostPass`: sync's per-stage passes after the gradients land,
    async's pass beside the pipeline, none's after it); None: the pipeline alone (fwd + bwd +
    gradient downloads).
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
    tied: tuple[TiedWeight, ...] = ()
    shared_up: tuple[SharedLink, ...] = ()
    shared_down: tuple[SharedLink, ...] = ()
    duplex: tuple[float, ...] | None = None
    links: tuple[LinkLoad, ...] = ()
    host: HostPass | None = None
    # Bytes/s of each GPU's own link from the host where the activations relayed to it from the
    # GPU before it (through the host or a switch) cross it too (inf where they come another way,
    # a direct link): stage k's weights and its first i+1 inputs are on it no sooner than their
    # bytes over this rate after the upload began (`step_timeline`'s forward, the MIP's `inlink_f`
    # rows). None: not charged.
    inlink: tuple[float, ...] | None = None

    @property
    def frozen_prefix(self) -> int:
        """P: the layers before the first one with a weight gradient — its own, or a trainable
        tied weight's that it reads (its stage then gets a gradient for that copy or owns it).
        A stage within them runs no backward (docs/schedule.md, frozen stages)."""
        reads = {r for t in self.tied if t.trainable for r in (*t.readers, t.owner) if r >= 0}
        return next((i for i, l in enumerate(self.layers) if l.grad_bytes or i in reads), len(self.layers))

    def tied_bytes(self, start: int, end: int) -> tuple[float, float]:
        """(weight, gradient) bytes as streamed of the tied copies the stage [start, end) keeps."""
        return tied_copy_bytes(self.tied, start, end, self.memory.weight_scale)

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
        check_count(self.microbatches, error=PlanError)
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
        if self.duplex is not None and (len(self.duplex) != n or not all(0.5 <= x <= 1 for x in self.duplex)):
            raise PlanError(f"duplex={self.duplex}; give one share in [0.5, 1] per GPU slot ({n}), or None")
        for link in (*self.shared_up, *self.shared_down):
            if link.servers < 1 or not link.slots or any(not 0 <= i < n for i in link.slots):
                raise PlanError(f"shared link {link.name}: slots {link.slots}, {link.servers} at a time; give slots "
                                f"below {n} and at least 1 at a time (build it with step_model.shared_links)")
        for x in self.links:
            if not (0 < x.bandwidth < math.inf and all(0 <= i < n for i in (*x.up, *x.down, *x.hop, *x.hop_back))):
                raise PlanError(f"link {x.name}: {x.bandwidth} bytes/s, slots {x.up}/{x.down}/{x.hop}/{x.hop_back}; "
                                f"give a positive, finite bandwidth and slots below {n} (build it with "
                                "step_model.link_loads)")
        L = len(self.layers)
        for t in self.tied:
            if not (-1 <= t.owner < L and t.readers and all(0 <= r < L and r != t.owner for r in t.readers)
                    and 0 <= t.nbytes < math.inf):
                raise PlanError(f"tied weight {t.name!r}: owner {t.owner}, readers {t.readers}, {t.nbytes} bytes; "
                                f"give layer indices below {L} (owner -1 when no layer owns it), one or more "
                                "readers other than the owner and bytes >= 0 (build it with step_model.tied_weights)")
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
                      precision: Precision | None = None, input_bytes: float = 0.0,
                      tied: Sequence[TiedWeight] = (), host: HostPass | None = None) -> "PartitionProblem":
        """Read capacities and bandwidths of the GPUs in `order` (default: topology order);
        `input_bytes`: the model's example inputs, whole batch (what `plans.build_plan` takes);
        `tied`: `tied_weights(layers, param sizes, trainable)`; `precision`: the streamed and
        master dtypes (`CompileOptions.precision`; None: fp32 masters streamed as they are), which
        the problem's `memory` (its one `MemoryModel`) scales the layers' bytes by; `host`: the
        host's work per step (`HostPass.of(topology, ...)`; None: not charged).

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

        def duplex(g: str) -> float:
            r = topology.route("host", g)
            return min((float(topology.link_duplex(u, v)) for u, v in zip(r, r[1:])), default=1.0)

        hop = tuple(bw(names[i], names[(i + 1) % n]) for i in range(n))
        hop_back = tuple(bw(names[(i + 1) % n], names[i]) for i in range(n))

        def own_link(j: int) -> float:  # slot j's link from the host, when the hop into j crosses it too
            g, frm = names[j], names[(j - 1) % n]
            r, h = topology.route("host", g), (topology.route(frm, g) if frm != g else ())
            if len(r) < 2 or len(h) < 2 or tuple(h[-2:]) != tuple(r[-2:]):
                return math.inf
            return float(topology.link_bandwidth(r[-2], r[-1]))
        return PartitionProblem(
            layers=tuple(layers), microbatches=microbatches, gpus=names,
            capacity=tuple(int(by_name[g].memory * memory_fraction) for g in names),
            up=tuple(float(topology.bandwidth("host", g)) for g in names),
            down=tuple(float(topology.bandwidth(g, "host")) for g in names),
            hop=hop, memory=MemoryModel(microbatches, precision or Precision()),
            inlink=tuple(own_link(j) for j in range(n)),
            memory_fraction=memory_fraction, hop_back=hop_back, input_bytes=float(input_bytes),
            tied=tuple(tied), shared_up=shared_links(topology, names, "up"),
            shared_down=shared_links(topology, names, "down"), duplex=tuple(duplex(g) for g in names),
            links=link_loads(topology, names), host=host,
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
    held: list[float] = field(default_factory=list)  # held_k: W_k + M·(in_k + out_k) (`MemoryModel.held`)
    grad_in: list[float] = field(default_factory=list)  # M·in_k: its input gradients, until stage k-1 takes them
    frozen: list[bool] = field(default_factory=list)  # stage k and all before it have no weight gradient:
    # no gradient reaches it, so it runs no backward (no refetch, no recompute): `frozen_stages`


class _RangeMax:
    """max(xs[a:z]) in O(1) after O(L log L) setup (a sparse table), 0 for an empty range."""

    def __init__(self, xs: Sequence[float]):
        self.table = [list(xs)]
        j = 1
        while 2 * j <= len(xs):
            prev = self.table[-1]
            self.table.append([max(prev[i], prev[i + j]) for i in range(len(xs) - 2 * j + 1)])
            j *= 2

    def __call__(self, a: int, z: int) -> float:
        if z <= a:
            return 0.0
        k = (z - a).bit_length() - 1
        return max(self.table[k][a], self.table[k][z - (1 << k)])


class PrefixSums:
    """Prefix sums of every per-layer number the model reads, so a cut set's `StageTotals`
    cost O(S) (the local search) and are linear in where the cuts fall (the MIP).

    `x[i]` sums layers 0..i-1 (`x[0] = 0`): `f`, `b` seconds per micro-batch, `w`, `g`
    weight and gradient bytes as streamed, `r` recompute bytes (`MemoryModel.recompute_bytes`);
    `out[i]` is layer i's output bytes per micro-batch; `work(a, z)` the working memory of
    the stage of layers [a, z) (`MemoryModel.stage_working`, a range max in O(1));
    `mm` the problem's `MemoryModel`.
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
        self.work = _RangeMax([mm.working(l) for l in ls])
        self.mm = mm
        self.frozen = problem.frozen_prefix

    def stages(self, cuts: Sequence[int]) -> StageTotals:
        """The numbers of the stages that start at `cuts` (equal to `stage_memory` and sums)."""
        edges, m = list(cuts) + [len(self.out)], self.problem.microbatches
        st = StageTotals([], [], [], [], [], [], [])
        for a, z in zip(edges, edges[1:]):
            tw, tg = self.problem.tied_bytes(a, z) if self.problem.tied else (0.0, 0.0)
            w, g = self.w[z] - self.w[a] + tw, self.g[z] - self.g[a] + tg
            acts = m * ((self.out[a - 1] if a else 0.0) + self.out[z - 1])
            fm, bm = self.mm.footprint(w, g, self.r[z] - self.r[a], acts, self.work(a, z))  # = stage_memory
            st.f.append(self.f[z] - self.f[a])
            st.b.append(self.b[z] - self.b[a])
            st.w.append(w)
            st.g.append(g)
            st.out.append(self.out[z - 1])
            st.fmem.append(fm)
            st.bmem.append(bm)
            st.held.append(self.mm.held(w, acts))
            st.grad_in.append(m * (self.out[a - 1] if a else 0.0))
            st.frozen.append(z <= self.frozen)
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
    key = lambda l: (l.fwd_time, l.bwd_time, l.param_bytes, l.grad_bytes, l.output_bytes, l.peak_bytes, l.saved_bytes)
    runs: list[tuple[int, int]] = []
    for i, l in enumerate(problem.layers):
        if runs and key(problem.layers[runs[-1][0]]) == key(l):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


# ---------------------------------------------------------------- the timeline
def _reference_totals(problem: PartitionProblem, cuts: Sequence[int]) -> StageTotals:
    """`StageTotals` summed layer by layer through `stage_memory` (what `evaluate` trusts)."""
    ls, mm, m = problem.layers, problem.memory, problem.microbatches
    edges = list(cuts) + [len(ls)]
    st = StageTotals([], [], [], [], [], [], [])
    frozen = problem.frozen_prefix
    for a, z in zip(edges, edges[1:]):
        part = ls[a:z]
        tied = tied_copy_bytes(problem.tied, a, z, mm.weight_scale)
        fm, bm = stage_memory(part, ls[a - 1] if a > 0 else None, mm, tied)
        st.f.append(sum(l.fwd_time for l in part) / m)
        st.b.append(sum(l.bwd_time for l in part) / m)
        st.w.append(sum(l.param_bytes for l in part) * mm.weight_scale + tied[0])
        st.g.append(sum(l.grad_bytes for l in part) * mm.weight_scale + tied[1])
        st.out.append(part[-1].output_bytes * mm.act_scale / m)
        st.fmem.append(fm)
        st.bmem.append(bm)
        acts_in = (ls[a - 1].output_bytes * mm.act_scale / m) if a else 0.0
        st.held.append(mm.held(st.w[-1], m * (acts_in + st.out[-1])))
        st.grad_in.append(m * acts_in)
        st.frozen.append(z <= frozen)
    return st


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
                      tuple(tl.R), tuple(tl.U), tuple(tl.H), tl.pipeline)
