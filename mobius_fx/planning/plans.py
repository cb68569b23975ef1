"""Plan types: the per-graph decisions every pass after `partition` reads.

A `Plan` is frozen and self-contained: stages (which layers, which GPU, sizes and times),
transfers (prefetch / evict / activation / gradient, with routes and modelled times), the
cross-mapped GPU order, the solver report and the layer costs it was made from, so that
`simulate` and `lower_bound` need nothing else. `str(plan)` renders the tables users read.

The memory model (`MemoryModel`, `stage_memory`: `mobius_fx.planning.step_memory`) and the solver
report (`SolverInfo`: `mobius_fx.planning.step_model`) are defined with the model the planner
solves, and imported from there: there is exactly one definition of "a stage fits".
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
from tabulate import tabulate

from mobius_fx.planning.costs import LayerCost
from mobius_fx.planning.host_memory import HostBudget, check_optimizer, host_budget
from mobius_fx.errors import MobiusError
from mobius_fx.kinds import HOST
from mobius_fx.precision import Precision, dtype_name, parse_dtype
from mobius_fx.planning.schedule_ir import ScheduleIR, StageIO, build_schedule
from mobius_fx.planning.step_model import SolverInfo
from mobius_fx.planning.step_memory import MemoryModel, stage_memory, tied_copy_bytes, tied_weights
from mobius_fx.units import fmt_bytes, fmt_time

if TYPE_CHECKING:  # pragma: no cover
    from mobius_fx.topology.server import Topology

__all__ = [
    "Plan", "Stage", "Transfer", "build_plan",
    "TRANSFER_KINDS",
    "TRANSFER_KIND",
]

TRANSFER_KINDS = ("prefetch", "evict", "activation", "gradient")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: consecutive layers run on one GPU, all micro-batches at a time.

    Times are per micro-batch; bytes are as streamed (the plan's dtype). `peak_bytes` is the
    modelled footprint while the stage runs backward (the larger phase), `capacity` the
    GPU's usable memory, `hidden_fraction` the share of its weight upload that the planner
    overlaps with the previous stage's compute on the same GPU.
    """

    index: int
    gpu: str
    root_complex: str
    layers: tuple[str, ...]
    nodes: tuple[str, ...]
    param_bytes: int
    grad_bytes: int
    fwd_time: float
    bwd_time: float
    input_bytes: int
    output_bytes: int
    peak_bytes: int
    capacity: int
    hidden_fraction: float = 0.0
    params: tuple[str, ...] = ()  # every parameter the stage's GPU copy holds


@dataclass(frozen=True)
class Transfer:
    """One kind of data movement of one stage. It happens `count` times per step, each time
    moving `bytes` along `route` (node names of the topology, src first)."""

    kind: str  # prefetch | evict | activation | gradient
    phase: str  # forward | backward
    stage: int
    src: str
    dst: str
    bytes: int
    route: tuple[str, ...]
    time: float  # modelled seconds of one occurrence at the route's bottleneck bandwidth
    count: int = 1


@dataclass(frozen=True)
class Plan:
    """The pipeline: stages on GPUs, the transfers between them, and how it was decided.

    plan = mobius_fx.plan(model, Topology.virtual(gpus=2), example_inputs=(x,))
    print(plan)            # summary line, stage table, transfer table
    plan.lower_bound()     # no schedule can beat this (seconds per step)
    """

    stages: tuple[Stage, ...]
    transfers: tuple[Transfer, ...]
    order: tuple[str, ...]  # GPU names; stage k runs on order[k % len(order)]
    microbatches: int
    step_time: float  # the partitioner's predicted makespan (s)
    solver: SolverInfo = field(default_factory=SolverInfo)
    layers: tuple[LayerCost, ...] = ()
    precision: Precision = field(default_factory=Precision)  # the streamed and the masters' dtype
    microbatches_rule: str = ""  # why `microbatches` is what it is, when the planner chose it
    optimizer: str = "adamw"  # the optimizer the host memory budget counts the state of (`host_budget`)
    # Which registered schedule runs this plan and why (mobius_fx/schedules/choice.py; the front
    # sets it): the first line `describe` prints. Empty: not chosen (a plan built directly).
    schedule_choice: str = ""
    # Whether the GPUs widen the gradients the optimizer overlap keeps as the fp32 `.grad` and
    # download them straight into it (`OverlapOptimizer.widen_downloads`: 2 B more per parameter
    # on the GPU->host links, no conversion on the host): the planner's choice (passes/partition.py
    # `widen_choice`, the MIP's too; None: the topology's rule, host_step.widen_fits); `widen_rule`
    # says so in `describe` ("" where nothing is widened); `widen_for` the optimizer overlap mode it
    # was timed for ("sync", "async"; `Pipeline.overlap` applies it to that mode only).
    widen_downloads: bool | None = None
    widen_rule: str = ""
    widen_for: str = ""
    topology: "Topology | None" = field(default=None, compare=False, repr=False)
    # The plan's memory model (`MemoryModel(microbatches, precision)`: what its stages' bytes were
    # scaled by); `build_plan` hands over the one it sized the stages with, else it is made here.
    memory: MemoryModel = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        check_optimizer(self.optimizer)
        if not isinstance(self.precision, Precision):
            raise MobiusError(f"Plan.precision={self.precision!r} is not a Precision; build it with "
                              f"Precision.of(dtype, master=...)")
        if self.memory is None:
            object.__setattr__(self, "memory", MemoryModel(self.microbatches, self.precision))
        elif (self.memory.microbatches, self.memory.precision) != (self.microbatches, self.precision):
            raise MobiusError(f"Plan.memory {self.memory} is for other micro-batches or precision than the plan's "
                              f"({self.microbatches}, {self.precision}); leave memory out, it is derived")

    @property
    def dtype(self) -> "torch.dtype":
        """The dtype weights are streamed and computed in on the GPUs (`precision.stream`)."""
        return self.precision.stream

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def schedule(self, gpus: Sequence[str] | None = None) -> ScheduleIR:
        """The step as the schedule IR (per-GPU op lists); `transfers` is a sum over it. With
        `gpus`, stage k runs on gpus[k % len(gpus)] instead (the identity map: `gpus` in CUDA
        order). Built once per plan and `gpus` (the plan is frozen), then shared: do not change it."""
        if gpus is not None and (isinstance(gpus, str) or not gpus):
            raise MobiusError(f"Plan.schedule(gpus={gpus!r}): gpus must be a non-empty sequence of GPU names "
                              f"(e.g. {list(self.order)!r}), or None for the plan's own mapping")
        key = None if gpus is None else tuple(gpus)
        built = self.__dict__.setdefault("_schedules", {})  # a cache beside the frozen fields
        if key not in built:
            ios = StageIO.from_plan(self.stages)
            if key is not None:
                ios = tuple(dataclasses.replace(io, gpu=key[k % len(key)]) for k, io in enumerate(ios))
            built[key] = build_schedule(ios, self.microbatches)
        return built[key]

    @property
    def num_gpus(self) -> int:
        return len(self.order)

    def link_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes per step over each directed link (u, v) of the topology."""
        out: dict[tuple[str, str], int] = {}
        for t in self.transfers:
            for u, v in zip(t.route, t.route[1:]):
                out[(u, v)] = out.get((u, v), 0) + t.bytes * t.count
        return out

    def lower_bound(self) -> float:
        """max(total compute / GPUs, busiest link's bytes / its bandwidth), in seconds.

        No schedule of this plan's work on this topology can take less: the GPUs cannot do
        more than their share of compute at once, and no link carries more than its bandwidth.
        """
        runs = self.schedule().select(kind="run")  # a stage of a frozen prefix runs no backward
        compute = sum(self.stages[o.stage].fwd_time if o.phase == "forward" else self.stages[o.stage].bwd_time
                      for o in runs) / max(1, self.num_gpus)
        link = 0.0
        if self.topology is not None:
            for (u, v), b in self.link_bytes().items():
                link = max(link, b / self.topology.link_bandwidth(u, v))
        return max(compute, link)

    # ---------------------------------------------------------------- tables
    def summary(self) -> str:
        hidden = (sum(s.hidden_fraction * s.param_bytes for s in self.stages)
                  / max(1, sum(s.param_bytes for s in self.stages)))
        return (f"Mobius plan: {self.num_stages} stages on {self.num_gpus} GPUs, "
                f"{self.microbatches} micro-batches"
                f"{f' ({self.microbatches_rule})' if self.microbatches_rule else ''}, {self.precision} on the GPUs; "
                f"predicted step "
                f"{fmt_time(self.step_time)} (lower bound {fmt_time(self.lower_bound())}); "
                f"{fmt_bytes(sum(s.param_bytes for s in self.stages))} of weights, "
                f"{hidden:.0%} of the weight upload hidden; solver: {self.solver}")

    def stage_table(self) -> str:
        rows = []
        for s in self.stages:
            span = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]}"
            rows.append([
                s.index, s.gpu, s.root_complex, f"{span} ({len(s.layers)})", fmt_bytes(s.param_bytes),
                fmt_time(s.fwd_time), fmt_time(s.bwd_time),
                f"{fmt_bytes(s.peak_bytes)} / {fmt_bytes(s.capacity)}", f"{s.hidden_fraction:.0%}",
            ])
        return tabulate(rows, headers=["stage", "gpu", "root", "layers", "weights", "fwd/mb",
                                       "bwd/mb", "peak / capacity", "upload hidden"])

    def transfer_table(self) -> str:
        rows = []
        for t in self.transfers:
            rows.append([t.kind, t.phase, t.stage, f"{t.src} -> {t.dst}",
                         fmt_bytes(t.bytes) + (f" x{t.count}" if t.count > 1 else ""),
                         " > ".join(t.route), fmt_time(t.time)])
        return tabulate(rows, headers=["kind", "phase", "stage", "from -> to", "size", "route", "time"])

    def host_budget(self, optimizer: str | None = None) -> HostBudget:
        """What a step of this plan keeps in host memory, term by term, for `optimizer` (default:
        the plan's, `Plan.optimizer`), and the topology's host DRAM: mobius_fx/planning/host_memory.py."""
        return host_budget(layers=self.layers, stages=self.stages, ir=self.schedule(), precision=self.precision,
                           optimizer=self.optimizer if optimizer is None else optimizer,
                           limit=self.topology.host_memory if self.topology is not None else None)

    def transfer_summary(self) -> str:
        """The transfers per step summed by kind, phase and link (host -> GPU, GPU -> GPU, GPU ->
        host; an eviction frees in place: "on the GPU"), with their count, bytes and modelled time
        (each transfer at its route's bottleneck, added up as if one after another; the schedule
        overlaps them with compute). `transfer_table()` lists every one."""
        rows: dict[tuple[str, str, str], list] = {}
        for t in self.transfers:
            link = "on the GPU" if t.src == t.dst else f"{_end(t.src)} -> {_end(t.dst)}"
            row = rows.setdefault((t.kind, t.phase, link), [0, 0, 0.0])
            row[0] += t.count
            row[1] += t.bytes * t.count
            row[2] += t.time * t.count
        order = {k: i for i, k in enumerate(TRANSFER_KINDS)}
        body = [[kind, phase, link, n, fmt_bytes(b), fmt_time(sec)]
                for (kind, phase, link), (n, b, sec) in sorted(
                    rows.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0][1] != "forward", kv[0][2]))]
        total = [sum(r[0] for r in rows.values()), sum(r[1] for r in rows.values()), sum(r[2] for r in rows.values())]
        body.append(["total", "", "", total[0], fmt_bytes(total[1]), fmt_time(total[2])])
        return tabulate(body, headers=["kind", "phase", "link", "transfers", "bytes per step", "time (serial)"])

    def describe(self, transfers: str = "full") -> str:
        """The summary, the stage table and the transfers: `transfers="full"` (what `str(plan)`
        prints) lists every transfer (`transfer_table`), "summary" sums them by kind, phase and
        link (`transfer_summary`: what compile's log and the CLI show unless asked for the full
        table), "none" leaves them out."""
        if transfers not in ("full", "summary", "none"):
            raise MobiusError(f"Plan.describe(transfers={transfers!r}); use 'full' (every transfer), 'summary' (by "
                              f"kind, phase and link) or 'none'")
        head = self.summary() + "\n" + self.host_memory() + (f"\n{self.widen_rule}" if self.widen_rule else "")
        parts = [(self.schedule_choice + "\n" + head) if self.schedule_choice else head, self.stage_table()]
        if transfers == "full":
            parts.append(self.transfer_table())
        elif transfers == "summary":
            parts.append(self.transfer_summary() + f"\n({len(self.transfers)} transfer rows summed; print(plan) "
                         f"or plan.transfer_table() lists each)")
        return "\n\n".join(parts)

    def host_memory(self) -> str:
        """The host memory line: everything a step keeps in host DRAM (masters, gradients,
        optimizer state, the streamed copy of the weights the uploads read, activations held for
        backward, pinned transfer buffers) against the host's DRAM (`host_budget`)."""
        return (self.host_budget().line() + f"; streamed copy in {dtype_name(self.precision.stream)}, "
                f"pinned on CUDA, kept across steps")

    def __str__(self) -> str:
        return self.describe("full")

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("topology", "memory", "precision")}
        d = json.loads(json.dumps(_plain(d)))
        d["precision"] = self.precision.to_dict()
        d["topology"] = json.loads(self.topology.to_json()) if self.topology is not None else None
        return d

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @staticmethod
    def from_json(text_or_path: str) -> "Plan":
        text = text_or_path
        if not text.lstrip().startswith("{"):
            with open(text_or_path) as f:
                text = f.read()
        try:
            d = json.loads(text)
            topo = None
            if d.get("topology") is not None:
                from mobius_fx.topology.server import Topology
                topo = Topology.from_json(json.dumps(d["topology"]))
            return Plan(
                stages=tuple(Stage(**_tuples(s)) for s in d["stages"]),
                transfers=tuple(Transfer(**_tuples(t)) for t in d["transfers"]),
                order=tuple(d["order"]), microbatches=d["microbatches"], step_time=d["step_time"],
                solver=SolverInfo(**_tuples(d["solver"])),
                layers=tuple(LayerCost(**_tuples(l)) for l in d["layers"]),
                precision=_precision(d), microbatches_rule=d.get("microbatches_rule", ""),  # absent in older JSON
                optimizer=d.get("optimizer", "adamw"),  # absent in older JSON
                schedule_choice=d.get("schedule_choice", ""),  # absent in older JSON
                widen_downloads=d.get("widen_downloads"), widen_rule=d.get("widen_rule", ""),
                widen_for=d.get("widen_for", ""), topology=topo,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise MobiusError(f"not a mobius_fx plan JSON ({type(e).__name__}: {e}); write it with plan.to_json()") from e


def _precision(d: dict) -> Precision:
    """A plan JSON's precision; older files hold only "dtype", the streamed dtype's name, and were
    planned with fp32 masters."""
    if "precision" in d:
        return Precision.from_dict(d["precision"])
    return Precision(parse_dtype(d["dtype"], "dtype"), torch.float32)


def _plain(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float) and x != x:
        return "nan"
    return x


def _tuples(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, list):
            v = tuple(tuple(i) if isinstance(i, list) else i for i in v)
        if v == "nan":
            v = float("nan")
        out[k] = v
    return out


def build_plan(
    layers: Sequence[LayerCost],
    boundaries: Sequence[int],
    *,
    order: Sequence[str],
    topology: "Topology",
    microbatches: int,
    step_time: float,
    precision: Precision | None = None,
    microbatches_rule: str = "",
    memory_fraction: float = 0.9,
    prefetch_fwd: Sequence[float] | None = None,
    solver: SolverInfo | None = None,
    param_sizes: dict[str, int] | None = None,
    trainable: Sequence[str] | None = None,
    input_bytes: int = 0,
    optimizer: str = "adamw",
) -> Plan:
    """Stages and transfers (docs/schedule.md) for layers cut at `boundaries` on `order`.

    `boundaries[k]` is the index of stage k's first layer. `param_sizes` (qualified name ->
    bytes in the master dtype) lets a stage count the exact bytes its GPU copy holds,
    including a tied parameter that another stage owns; without it a stage holds what its
    layers own. `trainable` names the parameters that take gradients (default: all of
    `param_sizes`): a tied one's copy in a second stage gets a gradient there too.
    `input_bytes` is the size of the model's example inputs (the whole batch). `precision`: the
    streamed and the masters' dtype (`CompileOptions.precision`; None: fp32 masters streamed as they
    are); the layers' bytes are in the masters' dtype and the stages' as streamed.
    `microbatches_rule` says why `microbatches` is what it is (the plan's header shows it). The transfers
    are a sum over the plan's schedule IR (`Plan.schedule()`, mobius_fx/planning/schedule_ir.py).
    `optimizer`: the one whose state the plan's host memory budget counts (`Plan.host_budget`).
    """
    layers = tuple(layers)
    m = microbatches
    n = len(order)
    precision = precision or Precision()
    mm = MemoryModel(m, precision)  # the plan's one memory model, carried as Plan.memory
    cuts = list(boundaries) + [len(layers)]
    if cuts[0] != 0 or any(b >= e for b, e in zip(cuts, cuts[1:])):
        raise MobiusError(f"stage boundaries {tuple(boundaries)} must start at 0 and strictly increase below {len(layers)}")
    nstages = len(boundaries)
    gpu_of = {g.name: g for g in topology.gpus}
    stages: list[Stage] = []
    # tied weights a stage reads but another stage's layer owns: its GPU copy, and that copy's
    # gradient, downloaded and summed on the host (the step model's rule, one statement)
    tied = tied_weights(layers, param_sizes, trainable) if param_sizes is not None else ()
    for k in range(nstages):
        ls = layers[cuts[k]:cuts[k + 1]]
        before = layers[cuts[k] - 1] if k > 0 else None
        extra = tied_copy_bytes(tied, cuts[k], cuts[k + 1], mm.weight_scale)
        fwd_mem, bwd_mem = stage_memory(ls, before, mm, extra)
        uses = tuple(dict.fromkeys(p for l in ls for p in (l.uses or l.params)))
        w = sum(l.param_bytes for l in ls) * mm.weight_scale + extra[0]
        grad = sum(l.grad_bytes for l in ls) * mm.weight_scale + extra[1]
        g = gpu_of[order[k % n]]
        hidden = 0.0
        if prefetch_fwd is not None and w > 0:
            hidden = min(1.0, max(0.0, prefetch_fwd[k] / w))
        stages.append(Stage(
            index=k, gpu=g.name, root_complex=g.root_complex,
            layers=tuple(l.name for l in ls), nodes=tuple(nd for l in ls for nd in l.nodes),
            param_bytes=int(w), grad_bytes=int(grad),
            fwd_time=sum(l.fwd_time for l in ls) / m, bwd_time=sum(l.bwd_time for l in ls) / m,
            input_bytes=int((before.output_bytes * mm.act_scale if before else input_bytes) / m),
            output_bytes=int(ls[-1].output_bytes * mm.act_scale / m),
            peak_bytes=int(max(fwd_mem, bwd_mem)),
            capacity=int(g.memory * memory_fraction), hidden_fraction=hidden, params=uses,
        ))
    ir = build_schedule(StageIO.from_plan(stages), m)
    plan = Plan(stages=tuple(stages), transfers=tuple(_transfers(ir, topology)), order=tuple(order),
                microbatches=m, step_time=step_time, solver=solver or SolverInfo(), layers=layers,
                precision=precision, microbatches_rule=microbatches_rule, optimizer=optimizer, topology=topology,
                memory=mm)
    plan.__dict__["_schedules"] = {None: ir}  # Plan.schedule()'s cache: the IR is built once per plan
    return plan


def _end(place: str) -> str:
    """A transfer's end as the summary groups it: the host, or a GPU."""
    return "host" if place == HOST else "GPU"


# A schedule IR op's kind -> its kind in plan.transfers (the IR's other ops move nothing).
TRANSFER_KIND = {"prefetch": "prefetch", "evict": "evict", "send": "activation", "offload": "activation",
                 "restore": "activation", "download": "gradient"}


def _transfers(ir: ScheduleIR, topo: "Topology") -> list[Transfer]:
    """The plan's transfer rows: the IR's copies and evictions, grouped per (kind, phase, stage,
    route, bytes) with their count per step, in the IR's order."""
    rows: dict[tuple, list] = {}
    for o in ir.ops:
        kind = TRANSFER_KIND.get(o.kind)
        if kind is None or (kind != "evict" and (o.bytes <= 0 or not o.direction)):
            continue
        src, dst = (o.place, o.place) if kind == "evict" else (o.src, o.dst)
        key = (kind, o.phase, o.stage, src, dst, o.bytes)
        if key in rows:
            rows[key][1] += 1
        else:
            rows[key] = [key, 1]
    out = []
    for (kind, phase, k, src, dst, nbytes), count in rows.values():
        route = (src,) if src == dst else topo.route(src, dst)
        bw = topo.bandwidth(src, dst) if src != dst else float("inf")
        out.append(Transfer(kind, phase, k, src, dst, int(nbytes), tuple(route), nbytes / bw if bw else 0.0, count))
    return out
