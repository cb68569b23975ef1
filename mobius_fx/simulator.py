"""Flow-level event simulation of a Plan on a Topology, and the baselines on the same costs.

`simulate(plan)` turns a schedule into tasks (per GPU and micro-batch: forward, backward
with recompute, weight prefetch, evict, activation and gradient transfers, the optimizer
step), replays them on per-GPU streams (compute, upload, download, activation) and on the
topology's directed links with max-min fair sharing (mobius_fx.network), and reports the
step time, per-GPU and per-link busy time, the critical path and a Chrome/Perfetto trace.
Every schedule uses the plan's own costs (stage times, bytes) and the same engine, so the
comparisons are like for like.

    result = mobius_fx.simulate(plan)                    # the plan as the runtime runs it
    result.step_time, result.pipeline_time >= plan.lower_bound()
    mobius_fx.simulate(plan, schedule="zero3-offload").step_time / result.step_time
    result.save_chrome_trace("step.json")                # open in ui.perfetto.dev

Schedules (the docstring of each builder says where its model comes from): "mobius",
"mobius-noprefetch", "mobius-identity-map", "gpipe", "zero3-offload", "roundpipe". The three
"mobius" ones are read from the schedule IR (`plan.schedule()`, mobius_fx/schedule.py): one task
per op, so a change of the schedule is made there; the baselines have their own builders.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

from .costs import dtype_bytes
from .errors import MobiusError, PlanError
from .network import Link, LinkSegment, Task, replay
from .plans import MemoryModel, Plan
from .schedule import HOST, ScheduleIR, build_schedule
from .units import fmt_bytes, fmt_time

__all__ = ["simulate", "SimResult", "SimEvent", "SCHEDULES", "CPU_ADAM_BANDWIDTH", "optimizer_bytes_touched"]

SCHEDULES = ("mobius", "mobius-noprefetch", "mobius-identity-map", "gpipe", "zero3-offload", "roundpipe")

# Bytes of memory traffic per fp32 master parameter in one optimizer step. Adam reads the
# parameter, its gradient and both moments (4 x 4 B) and writes the parameter and both moments
# (3 x 4 B): 28 B. SGD with momentum reads p, g, m and writes p, m: 20 B. The step is memory
# bound on a CPU, so time = params x bytes / sustained bandwidth.
_TOUCHED = {"adam": 28, "adamw": 28, "sgd": 20, "none": 0}
_STATES = {"adam": 8, "adamw": 8, "sgd": 4, "none": 0}  # optimizer state bytes per fp32 param

# Sustained bytes/s a plain torch.optim.Adam reaches over fp32 masters on a 2-socket Xeon
# server ([I] assumption: STREAM triad on 2 x 6-channel DDR4-2666 is ~150-200 GB/s; torch's
# Adam makes several passes over the tensors, so ~1/8 of it is effective). Measured on this
# project's 2-core EPYC VM (torch 2.13 CPU, torch.optim.Adam.step over 50 M fp32 params,
# 28 B/param): 4.7 GB/s with foreach=False, 1.9 GB/s foreach, 15.7 GB/s fused=True.
# Pass `cpu_adam_bandwidth` for your server.
CPU_ADAM_BANDWIDTH = 20e9


def optimizer_bytes_touched(optimizer: str) -> int:
    """Bytes read + written per fp32 parameter by one step of `optimizer` (adam: 28)."""
    try:
        return _TOUCHED[optimizer]
    except KeyError:
        raise MobiusError(f"unknown optimizer {optimizer!r}; use one of {', '.join(_TOUCHED)}") from None


# ------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class SimEvent:
    """One simulated task: compute, a transfer, an evict marker or the optimizer step."""

    name: str
    kind: str  # compute | prefetch | activation | gradient | evict | optimizer
    phase: str  # forward | backward | step
    gpu: str | None
    stream: str | None  # e.g. "gpu0/upload"; None for markers
    stage: int | None
    microbatch: int | None
    start: float
    end: float
    bytes: int = 0
    route: tuple[str, ...] = ()


@dataclass(frozen=True)
class SimResult:
    """What one simulated training step did.

    `pipeline_time` is forward + backward + gradient offload (what the partitioner predicts),
    `step_time` adds the optimizer step. `link_busy` is the seconds each directed link carried
    at least one flow; `critical_path` splits `step_time` over the resources the longest
    chain of dependent tasks used ("<gpu> compute", "<u>-><v>" for the link that held a
    transfer back, "optimizer", "waiting"). `bound` is max(total compute / GPUs, the busiest
    link's bytes / bandwidth) of the work this schedule did (plan.lower_bound for "mobius").
    """

    schedule: str
    step_time: float
    pipeline_time: float
    optimizer_time: float
    gpu_busy: dict[str, float]
    link_bytes: dict[tuple[str, str], int]
    link_busy: dict[tuple[str, str], float]
    critical_path: dict[str, float]
    events: tuple[SimEvent, ...] = field(repr=False)
    bound: float = 0.0
    link_bandwidth: dict[tuple[str, str], float] = field(default_factory=dict, repr=False)
    segments: tuple[LinkSegment, ...] = field(default=(), repr=False, compare=False)

    def summary(self) -> str:
        """A few lines a person reads: times, utilisation, busiest link, critical path."""
        util = {g: b / self.pipeline_time for g, b in self.gpu_busy.items()} if self.pipeline_time else {}
        lines = [f"{self.schedule}: step {fmt_time(self.step_time)} = pipeline {fmt_time(self.pipeline_time)} "
                 f"+ optimizer {fmt_time(self.optimizer_time)} (work bound {fmt_time(self.bound)})"]
        if util:
            lines.append(f"  GPU compute busy: mean {sum(util.values()) / len(util):.0%}, "
                         + ", ".join(f"{g} {u:.0%}" for g, u in util.items()))
        if self.link_bytes:
            busiest = max(self.link_bytes, key=lambda l: self.link_bytes[l] / self.link_bandwidth.get(l, math.inf))
            need = self.link_bytes[busiest] / self.link_bandwidth.get(busiest, math.inf)
            lines.append(f"  busiest link {busiest[0]}->{busiest[1]}: {fmt_bytes(self.link_bytes[busiest])} "
                         f"= {fmt_time(need)} at full bandwidth, busy {fmt_time(self.link_busy.get(busiest, 0.0))}")
        top = sorted(self.critical_path.items(), key=lambda kv: -kv[1])[:4]
        lines.append("  critical path: " + ", ".join(f"{k} {v / self.step_time:.0%}" for k, v in top
                                                     if self.step_time))
        return "\n".join(lines)

    def save_chrome_trace(self, path: str) -> None:
        """Write the step as Chrome/Perfetto JSON: a process per GPU with one thread per
        stream, a "links" process with one thread per directed link, a "host" process."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)

    def chrome_trace(self) -> dict:
        """The trace as a dict ({"traceEvents": [...]}); see `save_chrome_trace`."""
        out: list[dict] = []
        pids: dict[str, int] = {}
        tids: dict[tuple[int, str], int] = {}

        def track(process: str, thread: str) -> tuple[int, int]:
            if process not in pids:
                pids[process] = len(pids) + 1
                out.append({"ph": "M", "name": "process_name", "pid": pids[process], "tid": 0,
                            "args": {"name": process}})
                out.append({"ph": "M", "name": "process_sort_index", "pid": pids[process], "tid": 0,
                            "args": {"sort_index": pids[process]}})
            pid = pids[process]
            if (pid, thread) not in tids:
                tids[(pid, thread)] = len([k for k in tids if k[0] == pid]) + 1
                out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[(pid, thread)],
                            "args": {"name": thread}})
            return pid, tids[(pid, thread)]

        us = 1e6
        for gpu in self.gpu_busy:  # GPU processes first, in topology order
            track(gpu, "compute")
        for e in self.events:
            if e.stream is None:
                if e.kind == "evict" and e.gpu is not None:
                    pid, tid = track(e.gpu, "compute")
                    out.append({"ph": "i", "s": "t", "name": e.name, "cat": "evict", "pid": pid, "tid": tid,
                                "ts": e.start * us})
                continue
            process, _, thread = e.stream.partition("/")
            pid, tid = track(process, thread)
            args: dict[str, Any] = {"phase": e.phase}
            if e.stage is not None:
                args["stage"] = e.stage
            if e.microbatch is not None:
                args["microbatch"] = e.microbatch
            if e.bytes:
                args["bytes"] = e.bytes
                args["route"] = " > ".join(e.route)
            out.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": pid, "tid": tid,
                        "ts": e.start * us, "dur": (e.end - e.start) * us, "args": args})
        for link in sorted(self.link_bytes):
            track("links", f"{link[0]} -> {link[1]}")
        for seg in self.segments:
            pid, tid = track("links", f"{seg.link[0]} -> {seg.link[1]}")
            names = [str(f) for f in seg.flows]
            out.append({"ph": "X", "name": names[0] if len(names) == 1 else f"{len(names)} flows",
                        "cat": "link", "pid": pid, "tid": tid, "ts": seg.start * us,
                        "dur": (seg.end - seg.start) * us, "args": {"flows": names[:16]}})
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"schedule": self.schedule, "step_time_s": self.step_time}}


# --------------------------------------------------------------------------- public entry
def simulate(plan: Plan, *, schedule: str = "mobius", topology: Any = None, optimizer: str = "adam",
             cpu_adam_bandwidth: float | None = None) -> SimResult:
    """Replay one training step of `plan` under `schedule` on `topology` (default: the plan's).

    r = simulate(plan)
    print(r.summary())
    simulate(plan, schedule="roundpipe").step_time
    """
    topo = topology if topology is not None else plan.topology
    if topo is None:
        raise MobiusError("the plan carries no topology; pass simulate(plan, topology=Topology.preset(...))")
    if schedule not in _BUILDERS:
        raise MobiusError(f"unknown schedule {schedule!r}; valid schedules: {', '.join(SCHEDULES)}")
    optimizer_bytes_touched(optimizer)
    bw = CPU_ADAM_BANDWIDTH if cpu_adam_bandwidth is None else float(cpu_adam_bandwidth)
    if not bw > 0:
        raise MobiusError(f"cpu_adam_bandwidth={cpu_adam_bandwidth}; give the optimizer's bytes/s (> 0)")
    by_name = {g.name: g for g in topo.gpus}
    missing = [g for g in plan.order if g not in by_name]
    if missing:
        raise MobiusError(f"the plan runs on {', '.join(missing)}, which topology {getattr(topo, 'name', '')!r} "
                          f"lacks ({', '.join(by_name)}); simulate on the plan's topology or re-plan")
    ctx = _Context(plan, topo, optimizer, bw, use_plan_routes=topo is plan.topology)
    _BUILDERS[schedule](ctx)
    return _run(ctx, schedule)


# --------------------------------------------------------------------------- task graph
@dataclass
class _Costs:
    """Per stage (or layer unit): times per micro-batch, bytes as streamed."""

    f: list[float]
    b: list[float]
    w: list[float]
    g: list[float]
    inp: list[float]  # boundary input bytes per micro-batch
    out: list[float]
    master: list[float]  # trainable fp32 master bytes (optimizer)
    names: list[str]


@dataclass
class _Slot:
    phase: str  # forward | backward | fused
    stage: int
    gpu: str


class _Context:
    def __init__(self, plan: Plan, topo: Any, optimizer: str, cpu_bw: float, use_plan_routes: bool):
        self.plan, self.topo, self.optimizer, self.cpu_bw = plan, topo, optimizer, cpu_bw
        self.tasks: list[Task] = []
        self.last_compute: dict[str, int] = {}
        self._links: dict[tuple[str, str], tuple[Link, ...]] = {}
        self._routes: dict[tuple[str, str], tuple[str, ...]] = {}
        if use_plan_routes:
            for t in plan.transfers:
                if t.kind != "evict":
                    self._routes[(t.src, t.dst)] = tuple(t.route)
        idx = {g.name: g.index for g in topo.gpus}
        self.gpus = tuple(sorted(plan.order, key=lambda n: idx[n]))  # identity order of the plan's GPUs
        self.scale = dtype_bytes(plan.dtype) / 4.0  # streamed bytes per fp32 master byte
        st = plan.stages
        self.stages = _Costs([s.fwd_time for s in st], [s.bwd_time for s in st], [float(s.param_bytes) for s in st],
                             [float(s.grad_bytes) for s in st], [float(s.input_bytes) for s in st],
                             [float(s.output_bytes) for s in st], [s.grad_bytes / self.scale for s in st],
                             [f"s{s.index}" for s in st])

    def route(self, src: str, dst: str) -> tuple[str, ...]:
        if (src, dst) not in self._routes:
            self._routes[(src, dst)] = (src,) if src == dst else tuple(self.topo.route(src, dst))
        return self._routes[(src, dst)]

    def add(self, task: Task) -> int:
        self.tasks.append(task)
        return len(self.tasks) - 1

    def compute(self, gpu: str, duration: float, name: str, after: list, **meta) -> int:
        deps = [d for d in after if d is not None]
        if gpu in self.last_compute:
            deps.append(self.last_compute[gpu])
        i = self.add(Task(name, f"{gpu}/compute", (), duration, after=deps,
                          meta={"kind": "compute", "gpu": gpu, **meta}))
        self.last_compute[gpu] = i
        return i

    def move(self, stream: str, priority: tuple, src: str, dst: str, nbytes: float, name: str, *,
             after: list = (), after_start: list = (), **meta) -> int | None:
        if nbytes <= 0:
            return None
        route = self.route(src, dst)
        return self.add(Task(name, stream, priority, links=tuple(zip(route, route[1:])), size=float(nbytes),
                             after=[d for d in after if d is not None],
                             after_start=[d for d in after_start if d is not None],
                             meta={"src": src, "dst": dst, "route": route, "bytes": int(nbytes), **meta}))

    def mark(self, name: str, after: list, **meta) -> int:
        return self.add(Task(name, after=[d for d in after if d is not None], meta=meta))


def _pipeline(ctx: _Context, c: _Costs, slots: list[_Slot], m: int, *, resident: bool = False,
              offload_activations: bool = True, activations: bool = True, loss_on_host: bool = True,
              grads_to_host: bool = True) -> None:
    """Tasks of a looped pipeline (the baselines): each slot runs all `m` micro-batches of one
    stage on a GPU.

    Per GPU the slots run in list order on its compute stream. A slot's weights upload on the
    GPU's upload stream when the previous slot on that GPU starts, and not before the stage two
    back on that GPU is evicted (at most two resident); a slot that follows the same stage on
    the same GPU reuses its weights. Activations arrive on the receiving GPU's activation
    stream; saved boundary inputs go to DRAM after they arrive and come back (upload stream,
    after the weights) for backward; gradients go to DRAM on the download stream after the last
    micro-batch.
    """
    seq: dict[str, list[int]] = defaultdict(list)
    for j, s in enumerate(slots):
        seq[s.gpu].append(j)
    pos = {j: p for js in seq.values() for p, j in enumerate(js)}
    last_stage = max(s.stage for s in slots)
    comp: dict[tuple[str, int], list[int]] = {}  # (phase, stage) -> compute task per micro-batch
    where: dict[tuple[str, int], str] = {}
    arrive: dict[tuple[int, int], int | None] = {}  # (stage, mb) -> forward input arrival
    save: dict[tuple[int, int], int | None] = {}
    out: dict[int, int | None] = {}
    evict: dict[int, int | None] = {}
    for j, s in enumerate(slots):
        k, gpu, p = s.stage, s.gpu, pos[j]
        mine = seq[gpu]
        prev = slots[mine[p - 1]] if p > 0 else None
        nxt = slots[mine[p + 1]] if p + 1 < len(mine) else None
        reuse = resident or (prev is not None and prev.stage == k)
        fwd = s.phase in ("forward", "fused")
        phase = "forward" if s.phase == "forward" else "backward"
        tag = f"{s.phase[0]}{c.names[k]}"
        trigger_start = [comp[(prev.phase, prev.stage)][0]] if prev is not None else []
        memory = [next((evict[q] for q in reversed(mine[:max(0, p - 1)]) if evict.get(q) is not None), None)]
        up = None
        if not reuse:
            up = ctx.move(f"{gpu}/upload", (p, 0, 0), "dram", gpu, c.w[k], f"prefetch {tag}",
                          after=memory, after_start=trigger_start,
                          kind="prefetch", phase=phase, gpu=gpu, stage=k)
        rows = []
        for i in range(m):
            deps: list[int | None] = [up]
            if fwd and activations:
                if k == 0:
                    src, made = "dram", None
                else:
                    src = where[("forward", k - 1)]
                    made = comp[("forward", k - 1)][i]
                a = None
                if src != gpu:
                    a = ctx.move(f"{gpu}/activation", (p, i), src, gpu, c.inp[k], f"act {tag} mb{i}", after=[made],
                                 kind="activation", phase="forward", gpu=gpu, stage=k, microbatch=i)
                arrive[(k, i)] = a if a is not None else made
                deps.append(arrive[(k, i)])
                if offload_activations and k > 0 and s.phase == "forward":
                    save[(k, i)] = ctx.move(f"{gpu}/download", (p, i, 0), gpu, "dram", c.inp[k],
                                            f"save {tag} mb{i}", after=[arrive[(k, i)]], kind="activation",
                                            phase="forward", gpu=gpu, stage=k, microbatch=i)
            if s.phase == "backward" and activations:
                if offload_activations and k > 0 and (k, i) in save:
                    deps.append(ctx.move(f"{gpu}/upload", (p, 1, i), "dram", gpu, c.inp[k], f"restore {tag} mb{i}",
                                         after=[save[(k, i)], *memory], after_start=trigger_start,
                                         kind="activation", phase="backward", gpu=gpu, stage=k, microbatch=i))
                elif offload_activations and k == 0 and c.inp[0] > 0:  # the model input, sent again from the host
                    deps.append(ctx.move(f"{gpu}/upload", (p, 1, i), "dram", gpu, c.inp[0], f"input {tag} mb{i}",
                                         after=memory, after_start=trigger_start,
                                         kind="activation", phase="backward", gpu=gpu, stage=k, microbatch=i))
                if k == last_stage:
                    src, made = "dram", out.get(i) if out.get(i) is not None else comp[("forward", k)][i]
                else:
                    nb = ("backward", k + 1) if ("backward", k + 1) in comp else ("fused", k + 1)
                    src, made = where[nb], comp[nb][i]
                hop = None
                if src != gpu and (src != "dram" or loss_on_host):
                    hop = ctx.move(f"{gpu}/activation", (p, i), src, gpu, c.out[k], f"grad-in {tag} mb{i}",
                                   after=[made], kind="activation", phase="backward", gpu=gpu, stage=k, microbatch=i)
                deps.append(hop if hop is not None else made)
            dur = c.f[k] if s.phase == "forward" else c.b[k]
            ci = ctx.compute(gpu, dur, f"{tag} mb{i}", deps, phase=phase, stage=k, microbatch=i)
            rows.append(ci)
            if s.phase == "forward" and k == last_stage and activations and loss_on_host:
                out[i] = ctx.move(f"{gpu}/download", (p, i, 1), gpu, "dram", c.out[k], f"output mb{i}", after=[ci],
                                  kind="activation", phase="forward", gpu=gpu, stage=k, microbatch=i)
        comp[(s.phase, k)] = rows
        where[(s.phase, k)] = gpu
        if s.phase != "forward" and grads_to_host:
            ctx.move(f"{gpu}/download", (p, m, 0), gpu, "dram", c.g[k], f"grad {tag}", after=[rows[-1]],
                     kind="gradient", phase="backward", gpu=gpu, stage=k)
        if not resident and not (nxt is not None and nxt.stage == k):
            evict[j] = ctx.mark(f"evict {tag}", [rows[-1]], kind="evict", phase=phase, gpu=gpu, stage=k)


def _cpu_optimizer(ctx: _Context, master_bytes: float) -> None:
    t = master_bytes / 4.0 * _TOUCHED[ctx.optimizer] / ctx.cpu_bw
    ctx.add(Task("optimizer step", "host/optimizer", (), t, after=list(range(len(ctx.tasks))),
                 meta={"kind": "optimizer", "phase": "step"}))


_KIND = {"prefetch": "prefetch", "send": "activation", "offload": "activation", "restore": "activation",
         "download": "gradient"}  # an IR copy's kind in plan.transfers


def _schedule(plan: Plan, gpus: tuple[str, ...] | None = None) -> ScheduleIR:
    """plan.schedule(), with stage k on gpus[k % N] when `gpus` is given."""
    ir = plan.schedule()
    if gpus is None:
        return ir
    return build_schedule([dataclasses.replace(io, gpu=gpus[k % len(gpus)]) for k, io in enumerate(ir.stages)],
                          ir.microbatches)


def _from_ir(ctx: _Context, ir: ScheduleIR, *, prefetch: bool = True) -> None:
    """One task per op of a schedule IR (mobius_fx/schedule.py). A `run` computes f or b on its
    GPU; a copy with bytes is a flow on the route src -> dst, on the receiving GPU's upload stream
    (prefetch, restore, an input sent again), its activation stream (other sends to a GPU) or the
    sending GPU's download stream (offload, download, sends to the host), served by slot (a stage's
    forward or backward on that GPU), then IR order; `evict`/`wait`/`hold` are markers; the host
    `step`s are the one CPU optimizer task at the end. Deps are the IR's, through markers and
    zero-byte copies: a `wait` stands for the stage's weights, but a prefetch it triggers starts
    with the stage's first run (with `prefetch=False`: after its last)."""
    ops, c = ir.ops, ctx.stages
    slot = {(o.phase, o.stage): p for g in ir.gpus for p, o in enumerate(x for x in ir.place(g) if x.kind == "wait")}
    runs: dict[int, list[int]] = defaultdict(list)  # wait -> the runs that wait for it
    for o in ops:
        for d in o.deps if o.kind == "run" else ():
            if ops[d].kind == "wait":
                runs[d].append(o.index)
    task: dict[int, int] = {}
    through: dict[int, list[int]] = {}
    triggers: list[tuple[int, int]] = []

    def ends(d: int) -> list[int]:  # the tasks whose ends op d stands for
        if d not in task and d not in through:
            through[d] = [t for e in ops[d].deps for t in ends(e)]
        return [task[d]] if d in task else through[d]

    for o in ops:
        after = [t for d in o.deps if not (o.kind == "prefetch" and ops[d].kind == "wait") for t in ends(d)]
        tag = f"{o.phase[0]}{c.names[o.stage]}" + ("" if o.microbatch is None else f" mb{o.microbatch}")
        if o.kind == "run":
            task[o.index] = ctx.compute(o.place, c.f[o.stage] if o.phase == "forward" else c.b[o.stage], tag, after,
                                        phase=o.phase, stage=o.stage, microbatch=o.microbatch)
        elif o.kind in _KIND and o.direction and o.bytes > 0:
            gpu = o.src if o.dst == HOST else o.dst
            stream = ("download" if o.dst == HOST else "upload" if o.kind == "prefetch" or o.what == "input"
                      else "activation")
            task[o.index] = ctx.move(f"{gpu}/{stream}", (slot[(o.phase, o.stage)], o.index),
                                     "dram" if o.src == HOST else o.src, "dram" if o.dst == HOST else o.dst, o.bytes,
                                     f"{o.kind} {tag}", after=after, kind=_KIND[o.kind], phase=o.phase, gpu=gpu,
                                     stage=o.stage, microbatch=o.microbatch)
            triggers += [(task[o.index], d) for d in o.deps if o.kind == "prefetch" and ops[d].kind == "wait"]
        elif o.kind in ("evict", "wait", "hold"):
            ctx.mark(f"{o.kind} {tag}", after, kind=o.kind, phase=o.phase, gpu=o.place, stage=o.stage)
    for t, w in triggers:
        (ctx.tasks[t].after_start if prefetch else ctx.tasks[t].after).append(task[runs[w][0 if prefetch else -1]])
    _cpu_optimizer(ctx, sum(c.master[o.stage] for o in ops if o.kind == "step"))


def _mobius(ctx: _Context) -> None:
    """The plan as the runtime runs it: its schedule IR (docs/schedule.md), CPU optimizer after
    the last gradient. Moves exactly `plan.transfers` (checked), so `plan.lower_bound()` bounds it."""
    _from_ir(ctx, _schedule(ctx.plan))
    _check_transfers(ctx)


def _noprefetch(ctx: _Context) -> None:
    """Mobius without prefetch: a stage's upload starts only once its GPU has finished the
    previous stage (the GPU idles while its weights arrive). Same transfers as "mobius"."""
    _from_ir(ctx, _schedule(ctx.plan), prefetch=False)
    _check_transfers(ctx)


def _identity(ctx: _Context) -> None:
    """Mobius with the identity mapping (stage k on the k % N-th GPU by CUDA index, no cross
    mapping), as in the paper's cross-mapping ablation; transfers re-routed accordingly."""
    _from_ir(ctx, _schedule(ctx.plan, ctx.gpus))


def _roundpipe(ctx: _Context) -> None:
    """RoundPipe-style stateless round-robin dispatch (Luo et al., arXiv 2604.27085, 2026).

    Slot i goes to GPU (g0 + i) mod N (g0 = 0, GPUs by CUDA index); every slot runs all
    micro-batches; backward slots continue the rotation after the forward ones, so no GPU waits
    at the forward/backward turn. The last stage is RoundPipe's fused first backward slot: its
    forward doubles as the recompute (it costs b_{S-1} per micro-batch, uploads once, computes
    the loss on the GPU and keeps its input). Every other slot uploads its weights (prefetched
    while the previous slot on that GPU runs, two resident at most), saved inputs go to DRAM
    and come back, gradients go to DRAM. Simplifications: the plan's stages are the slots
    (RoundPipe also cuts backward slots ~1/3 the size of forward ones), its priority packing of
    transfers is the stream priority here, and its optimizer is run synchronously after the
    step (RoundPipe-sync); the async variant would hide `optimizer_time`.
    """
    s, n = ctx.plan.num_stages, len(ctx.gpus)
    slots = [_Slot("forward", k, ctx.gpus[k % n]) for k in range(s - 1)]
    slots.append(_Slot("fused", s - 1, ctx.gpus[(s - 1) % n]))
    slots += [_Slot("backward", k, ctx.gpus[(2 * s - 2 - k) % n]) for k in reversed(range(s - 1))]
    _pipeline(ctx, ctx.stages, slots, ctx.plan.microbatches, loss_on_host=False)
    _cpu_optimizer(ctx, sum(ctx.stages.master))


def _gpipe(ctx: _Context) -> None:
    """GPipe (Huang et al., 2019; torchgpipe) with every weight resident: the plan's layers
    re-cut into N stages balanced by compute, stage j on the j-th GPU, all forwards then all
    backwards (with recompute), activations hop between GPUs, no weight traffic. The
    optimizer runs on the GPUs, as GPipe does: each GPU steps its own stage at its memory
    bandwidth after the backward. Raises PlanError when a stage's weights, gradients,
    optimizer state and activations do not fit its GPU."""
    plan, n, m = ctx.plan, len(ctx.gpus), ctx.plan.microbatches
    u = _units(ctx)
    groups = _balanced(u, n)
    c = _Costs([], [], [], [], [], [], [], [])
    for j, (a, z) in enumerate(groups):
        for lst, src in ((c.f, u.f), (c.b, u.b), (c.w, u.w), (c.g, u.g), (c.master, u.master)):
            lst.append(sum(src[a:z]))
        c.inp.append(u.inp[a])
        c.out.append(u.out[z - 1])
        c.names.append(f"g{j}")
    mm, recompute = _gpipe_memory(plan, u)
    caps = {s.gpu: s.capacity for s in plan.stages}
    by_name = {g.name: g for g in ctx.topo.gpus}
    states = _STATES[ctx.optimizer] + (4 if ctx.scale != 1.0 else 0)  # + fp32 master copy when streaming half
    for j, (a, z) in enumerate(groups):
        gpu = ctx.gpus[j]
        cap = caps.get(gpu, by_name[gpu].memory)
        opt = c.master[j] / 4.0 * states
        act = m * (c.inp[j] + c.out[j])
        need = mm.footprint(c.w[j], c.g[j], sum(recompute[a:z]), act)[1] + opt
        rest = need - opt - c.w[j] - c.g[j]  # activations, recompute, working memory, a micro-batch's fresh grads
        if need > cap:
            raise PlanError(
                f"gpipe stage {j} ({u.names[a]} .. {u.names[z - 1]}) on {gpu} needs {fmt_bytes(need)} (weights "
                f"{fmt_bytes(c.w[j])} + grads {fmt_bytes(c.g[j])} + {ctx.optimizer} state {fmt_bytes(opt)} + "
                f"activations, recompute and working memory {fmt_bytes(rest)}) but {gpu} has {fmt_bytes(cap)}; GPipe keeps every "
                f"weight resident, so this model does not fit {n} GPU(s): use the 'mobius' schedule or more GPUs")
    slots = [_Slot("forward", j, ctx.gpus[j]) for j in range(len(groups))]
    slots += [_Slot("backward", j, ctx.gpus[j]) for j in reversed(range(len(groups)))]
    _pipeline(ctx, c, slots, m, resident=True, offload_activations=False, grads_to_host=False)
    barrier = ctx.mark("backward done", list(range(len(ctx.tasks))), kind="barrier")
    for j in range(len(groups)):
        gpu = ctx.gpus[j]
        t = c.master[j] / 4.0 * _TOUCHED[ctx.optimizer] / by_name[gpu].spec.memory_bandwidth
        ctx.add(Task(f"optimizer {gpu}", f"{gpu}/optimizer", (), t, after=[barrier],
                     meta={"kind": "optimizer", "phase": "step", "gpu": gpu}))


def _zero3(ctx: _Context) -> None:
    """DeepSpeed ZeRO-3 with CPU offload (ZeRO-Offload/ZeRO-Infinity, Rajbhandari et al.
    SC'21; Ren et al. ATC'21), data parallel: each GPU runs 1/N of the batch through every
    layer, fetching each layer's weights from DRAM in forward and again in backward (one layer
    prefetched ahead, as DeepSpeed's prefetch does), and sends each layer's gradients to DRAM
    (N x the gradient bytes, reduced on the host); Adam runs on the CPU after the last one.
    All N GPUs fetch the same bytes, so shared switch uplinks and root complexes carry N x
    the traffic. Simplifications: one pass per GPU (no gradient accumulation), the all-gather
    and reduce-scatter are modelled as each GPU's own DRAM transfers, no activation traffic,
    the last layer stays resident across the turn, the host-side gradient sum is free."""
    n = len(ctx.gpus)
    u = _units(ctx)
    m = ctx.plan.microbatches
    c = _Costs([f * m / n for f in u.f], [b * m / n for b in u.b], u.w, u.g, u.inp, u.out, u.master, u.names)
    for gpu in ctx.gpus:
        slots = [_Slot("forward", k, gpu) for k in range(len(u.f))]
        slots += [_Slot("backward", k, gpu) for k in reversed(range(len(u.f)))]
        _pipeline(ctx, c, slots, 1, offload_activations=False, activations=False)
    _cpu_optimizer(ctx, sum(u.master))


_BUILDERS: dict[str, Callable[[_Context], None]] = {
    "mobius": _mobius, "mobius-noprefetch": _noprefetch, "mobius-identity-map": _identity,
    "gpipe": _gpipe, "zero3-offload": _zero3, "roundpipe": _roundpipe,
}


# ------------------------------------------------------------------------------- helpers
def _check_transfers(ctx: _Context) -> None:
    """The "mobius" schedules must move exactly plan.transfers (kind, phase, stage, ends, bytes, count)."""
    ours: Counter = Counter()
    for t in ctx.tasks:
        if t.meta.get("kind") in ("prefetch", "activation", "gradient"):
            ours[(t.meta["kind"], t.meta["phase"], t.meta["stage"], t.meta["src"], t.meta["dst"], t.meta["bytes"])] += 1
    theirs: Counter = Counter()
    for t in ctx.plan.transfers:
        if t.kind != "evict" and t.bytes > 0 and t.src != t.dst:
            theirs[(t.kind, t.phase, t.stage, t.src, t.dst, int(t.bytes))] += t.count
    if ours != theirs:
        extra = list((ours - theirs).items())[:3]
        lacking = list((theirs - ours).items())[:3]
        raise MobiusError(f"the simulated Mobius schedule and plan.transfers differ (docs/schedule.md): "
                          f"simulated but not in the plan {extra}, in the plan but not simulated {lacking}; "
                          f"rebuild the plan with plans.build_plan")


def _units(ctx: _Context) -> _Costs:
    """Per-layer costs (per micro-batch, streamed bytes) scaled so each stage's layers sum to
    the stage's own numbers; the stages themselves when the plan has no layer table."""
    plan = ctx.plan
    by_name = {l.name: l for l in plan.layers}
    if not plan.layers or any(n not in by_name for s in plan.stages for n in s.layers):
        return ctx.stages
    c = _Costs([], [], [], [], [], [], [], [])
    m = plan.microbatches
    for s in plan.stages:
        ls = [by_name[n] for n in s.layers]

        def share(total: float, parts: list[float]) -> list[float]:
            tot = sum(parts)
            return [total * x / tot for x in parts] if tot > 0 else [total / len(parts)] * len(parts)

        c.f += share(s.fwd_time, [l.fwd_time for l in ls])
        c.b += share(s.bwd_time, [l.bwd_time for l in ls])
        c.w += share(s.param_bytes, [l.param_bytes for l in ls])
        gs = share(s.grad_bytes, [l.grad_bytes for l in ls])
        c.g += gs
        c.master += [g / ctx.scale for g in gs]
        outs = [l.output_bytes * ctx.scale / m for l in ls[:-1]] + [float(s.output_bytes)]
        c.inp += [float(s.input_bytes)] + outs[:-1]
        c.out += outs
        c.names += [l.name for l in ls]
    return c


def _balanced(u: _Costs, n: int) -> list[tuple[int, int]]:
    """Contiguous groups of units, at most n, minimising the largest compute (f + b)."""
    cost = [f + b for f, b in zip(u.f, u.b)]
    size = len(cost)
    if size <= n:
        return [(i, i + 1) for i in range(size)]

    def cut(limit: float) -> list[tuple[int, int]] | None:
        groups, a, acc = [], 0, 0.0
        for i, x in enumerate(cost):
            if acc + x > limit and i > a:
                groups.append((a, i))
                a, acc = i, 0.0
            acc += x
        groups.append((a, size))
        return groups if len(groups) <= n else None

    lo, hi = max(cost), sum(cost)
    for _ in range(60):
        mid = (lo + hi) / 2
        if cut(mid) is None:
            lo = mid
        else:
            hi = mid
    return cut(hi) or [(0, size)]


def _gpipe_memory(plan: Plan, u: _Costs) -> tuple[MemoryModel, list[float]]:
    """The plan's memory model (`MemoryModel.footprint`, as the partitioner uses) and each
    unit's recompute bytes: from the layer table, or, when the units are the plan's stages,
    what of a stage's backward peak the footprint's other terms leave."""
    m = plan.microbatches
    by_name = {l.name: l for l in plan.layers}
    if plan.layers and all(n in by_name for n in u.names):
        mm = MemoryModel.for_layers(plan.layers, m, plan.dtype)
        return mm, [mm.recompute_bytes(by_name[n]) for n in u.names]
    mm = MemoryModel(m)
    rest = [max(0.0, s.peak_bytes - mm.footprint(s.param_bytes, s.grad_bytes, 0.0,
                                                  m * (s.input_bytes + s.output_bytes))[1])
            for s in plan.stages]
    return mm, rest


# ---------------------------------------------------------------------------------- run
def _run(ctx: _Context, schedule: str) -> SimResult:
    tasks = ctx.tasks
    bws: dict[Link, float] = {}

    def capacity(link: Link) -> float:
        if link not in bws:
            bws[link] = float(ctx.topo.link_bandwidth(*link))
        return bws[link]

    rep = replay(tasks, capacity)
    opt_ids = [i for i, t in enumerate(tasks) if t.meta.get("kind") == "optimizer"]
    pipe_end = max((rep.end[i] for i, t in enumerate(tasks) if t.meta.get("kind") != "optimizer"), default=0.0)
    step = max([pipe_end] + [rep.end[i] for i in opt_ids])
    gpu_busy = {g: 0.0 for g in ctx.gpus}
    for i, t in enumerate(tasks):
        if t.meta.get("kind") == "compute":
            gpu_busy[t.meta["gpu"]] += rep.end[i] - rep.start[i]
    events = tuple(SimEvent(t.name, t.meta.get("kind", "marker"), t.meta.get("phase", ""), t.meta.get("gpu"),
                            t.stream, t.meta.get("stage"), t.meta.get("microbatch"), rep.start[i], rep.end[i],
                            t.meta.get("bytes", 0), t.meta.get("route", ()))
                   for i, t in enumerate(tasks) if t.meta.get("kind") not in ("barrier", "wait", "hold"))
    link_bytes = {l: int(round(b)) for l, b in rep.link_bytes.items()}
    for l in link_bytes:
        capacity(l)
    compute_total = sum(gpu_busy.values())
    bound = max([compute_total / max(1, len(ctx.gpus))] + [b / bws[l] for l, b in link_bytes.items()])
    return SimResult(schedule=schedule, step_time=step, pipeline_time=pipe_end, optimizer_time=step - pipe_end,
                     gpu_busy=gpu_busy, link_bytes=link_bytes, link_busy=rep.link_busy,
                     critical_path=_critical_path(tasks, rep, step), events=events, bound=bound,
                     link_bandwidth=dict(bws),
                     segments=tuple(LinkSegment(g.link, g.start, g.end, tuple(tasks[i].name for i in g.flows))
                                    for g in rep.segments))


def _critical_path(tasks: list[Task], rep: Any, step: float) -> dict[str, float]:
    """Walk back from the task that ends last through the dependency that released each task."""
    out: dict[str, float] = defaultdict(float)
    if not tasks:
        return {}
    cur = max(range(len(tasks)), key=lambda i: rep.end[i])
    counted = True
    t_at = rep.end[cur]
    while cur is not None:
        t = tasks[cur]
        s = rep.start[cur]
        if counted:
            kind = t.meta.get("kind")
            dur = rep.end[cur] - s
            if kind == "compute":
                out[f"{t.meta['gpu']} compute"] += dur
            elif kind == "optimizer":
                out["optimizer"] += dur
            elif cur in rep.flow_links:
                for (u, v), sec in rep.flow_links[cur].items():
                    out[f"{u}->{v}"] += sec
                rest = dur - sum(rep.flow_links[cur].values())
                if abs(rest) > 0:
                    out["waiting"] += rest
            elif dur > 0:
                out["waiting"] += dur
        t_at = s
        best, best_time, best_counted = None, -math.inf, True
        for d in t.after:
            if rep.end[d] > best_time:
                best, best_time, best_counted = d, rep.end[d], True
        for d in t.after_start:
            if rep.start[d] > best_time:
                best, best_time, best_counted = d, rep.start[d], False
        prev = rep.stream_prev[cur]
        if prev is not None and rep.end[prev] > best_time:
            best, best_time, best_counted = prev, rep.end[prev], True
        if best is None:
            out["waiting"] += t_at  # a root task that started late (not_before) or at 0
            break
        out["waiting"] += t_at - best_time
        if not best_counted:
            t_at = best_time
        cur, counted = best, best_counted
    return {k: v for k, v in out.items() if v > 0 or k != "waiting"}
