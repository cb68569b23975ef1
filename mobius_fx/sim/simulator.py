"""Flow-level event simulation of a Plan on a Topology, and the baselines on the same costs.

`simulate(plan)` turns a schedule into tasks (per GPU and micro-batch: forward, backward
with recompute, weight prefetch, evict, activation and gradient transfers, the optimizer
step), replays them on per-GPU streams (compute, upload, download, activation) and on the
topology's directed links with max-min fair sharing (mobius_fx.sim.network: the transfer needed
first goes first on a shared link, the two directions of a PCIe switch link interfere; host
memory lives on a socket, `masters`), and reports the step time, per-GPU and per-link busy
time, the critical path and a Chrome/Perfetto trace. With `servers=R, network=...` it is one
server of R running the plan data parallel: each stage's gradients are ring all-reduced over
the server's NIC before its CPU optimizer step (mobius_fx.sim.tasks.gradient_allreduce).
Every schedule uses the plan's own costs (stage times, bytes) and the same engine, so the
comparisons are like for like.

    result = mobius_fx.simulate(plan)                    # the plan as the runtime runs it
    result.step_time, result.pipeline_time >= plan.lower_bound()
    mobius_fx.simulate(plan, schedule="zero3-offload").step_time / result.step_time
    result.save_chrome_trace("step.json")                # open in ui.perfetto.dev
    r4 = mobius_fx.simulate(plan, servers=4, network="100Gbps")  # one of 4 data-parallel servers
    result.step_time / r4.step_time                       # scaling efficiency (4x the global batch)

Schedules: those of the registry, `mobius_fx.schedules.names()` -- one module each under
mobius_fx/schedules/ (each docstring says where its model comes from), on the task graph of
mobius_fx/sim/tasks.py. Each produces the schedule IR (mobius_fx/planning/schedule_ir.py: the "mobius"
ones the plan's, `plan.schedule()`; the baselines theirs from slots, schedules/looped_ir.py), which the one
task builder (schedules/ir_tasks.py) turns into tasks, one per op: a change of a schedule is made in its IR.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from mobius_fx import schedules
from mobius_fx.errors import MobiusError
from mobius_fx.kinds import OVERLAP_MODES
from mobius_fx.sim.arguments import (check_gpus, host_copies_of, host_rates, keep_grads_of, masters_of, network_of,
                                     topology_of)
from mobius_fx.sim.network import Link, LinkSegment, Task, replay
from mobius_fx.planning.plans import Plan
from mobius_fx.sim.tasks import MASTERS, Context
from mobius_fx.planning.host_step import CPU_ADAM_BANDWIDTH, HOST_COPY_BANDWIDTH, optimizer_bytes_touched, widen_fits
from mobius_fx.units import fmt_bytes, fmt_time

__all__ = ["simulate", "SimResult", "SimEvent"]



# ------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class SimEvent:
    """One simulated task: compute, a transfer, an evict marker or the optimizer step."""

    name: str
    kind: str  # compute | prefetch | activation | gradient | collective | allreduce | evict | optimizer | host-copy
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
    `step_time` adds what the host does after it: `optimizer_time`, the gradient hand-over and
    the optimizer step with the copies around it (planning.host_step.HOST_COPY_KINDS; `host_copy_time`
    is the seconds all host copies ran, the pinning before uploads included; `host_busy` those
    and the optimizer's passes together). The host ran at
    `optimizer_bandwidth` (the schedule's CPU optimizer: DeepSpeed's for "zero3-offload") and
    `host_copy_bandwidth` bytes/s; `host_sources` says where each figure came from: "given"
    (an argument of `simulate`), "measured on this host" (the topology's "host" section) or
    "default" (planning.host_step.CPU_ADAM_BANDWIDTH, HOST_COPY_BANDWIDTH). With `servers` > 1 (data parallel, see `simulate`)
    `step_time` = `pipeline_time` + `allreduce_exposed` (how much longer the last stage's
    all-reduce ends than the pipeline) + `optimizer_time` (what the optimizer adds after that);
    `allreduce_time` is the seconds the NIC carried all-reduces, `nic_bytes` what this server
    sent (and received) on it. `link_busy` is the seconds each directed link carried
    at least one flow; `critical_path` splits `step_time` over the resources the longest
    chain of dependent tasks used ("<gpu> compute", "<u>-><v>" for the link that held a
    transfer back, "optimizer", "host copies", "network" for the all-reduces, "waiting"). `bound` is
    max(total compute / GPUs, the busiest link's bytes / bandwidth) of the work this schedule
    did (plan.lower_bound for "mobius").
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
    servers: int = 1
    network: float = math.inf  # bytes/s per direction of each server's NIC
    allreduce_time: float = 0.0
    allreduce_exposed: float = 0.0
    nic_bytes: int = 0
    optimizer_bandwidth: float = CPU_ADAM_BANDWIDTH
    host_copy_bandwidth: float = HOST_COPY_BANDWIDTH
    host_sources: dict[str, str] = field(default_factory=dict)
    host_copy_time: float = 0.0
    host_busy: float = 0.0  # seconds the host's optimizer pass and copies ran, all together

    def host_line(self) -> str:
        """Which host figures the step was simulated with, and where they came from."""
        return (f"host: CPU optimizer {self.optimizer_bandwidth / 1e9:.1f} GB/s "
                f"({self.host_sources.get('optimizer', 'default')}), host copies "
                f"{self.host_copy_bandwidth / 1e9:.1f} GB/s ({self.host_sources.get('host copies', 'default')}), "
                f"busy {fmt_time(self.host_busy)} (optimizer {fmt_time(self.host_busy - self.host_copy_time)}, "
                f"copies {fmt_time(self.host_copy_time)})")

    def summary(self) -> str:
        """A few lines a person reads: times, utilisation, busiest link, critical path."""
        util = {g: b / self.pipeline_time for g, b in self.gpu_busy.items()} if self.pipeline_time else {}
        lines = [f"{self.schedule}: step {fmt_time(self.step_time)} = pipeline {fmt_time(self.pipeline_time)} "
                 f"+ optimizer {fmt_time(self.optimizer_time)} (work bound {fmt_time(self.bound)})"]
        if self.servers > 1:
            lines[0] = (f"{self.schedule}, one of {self.servers} data-parallel servers: "
                        f"step {fmt_time(self.step_time)} = pipeline {fmt_time(self.pipeline_time)} + all-reduce exposed "
                        f"{fmt_time(self.allreduce_exposed)} + optimizer {fmt_time(self.optimizer_time)} (work bound "
                        f"{fmt_time(self.bound)})")
            lines.append(f"  NIC: ring all-reduce of {fmt_bytes(self.nic_bytes)} each way at "
                         f"{self.network * 8 / 1e9:.4g} Gbit/s, busy {fmt_time(self.allreduce_time)}")
        if util:
            lines.append(f"  GPU compute busy: mean {sum(util.values()) / len(util):.0%}, "
                         + ", ".join(f"{g} {u:.0%}" for g, u in util.items()))
        if self.link_bytes:
            busiest = max(self.link_bytes, key=lambda l: self.link_bytes[l] / self.link_bandwidth.get(l, math.inf))
            need = self.link_bytes[busiest] / self.link_bandwidth.get(busiest, math.inf)
            lines.append(f"  busiest link {busiest[0]}->{busiest[1]}: {fmt_bytes(self.link_bytes[busiest])} "
                         f"= {fmt_time(need)} at full bandwidth, busy {fmt_time(self.link_busy.get(busiest, 0.0))}")
        lines.append("  " + self.host_line())
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
             cpu_adam_bandwidth: float | None = None, deepspeed_adam_bandwidth: float | None = None,
             masters: str | None = None, optimizer_overlap: str = "none", servers: int = 1,
             network: float | str | None = None, network_latency: float | None = None,
             host_copy_bandwidth: float | None = None, host_copies: Mapping[str, float] | None = None,
             keep_grads: bool = True, widen_downloads: bool | None = None) -> SimResult:
    """Replay one training step of `plan` under `schedule` on `topology` (default: the plan's).

    The host as measured: `cpu_adam_bandwidth` (bytes/s, as planning.host_step.TOUCHED_BYTES counts
    them) is the CPU optimizer of the Mobius schedules and RoundPipe's (the user's torch
    optimizer); None takes the topology's "host" section (`HostFigures.optimizer_bytes_per_s`,
    written by benchmarks/cpu_optimizer.py --topology-out and benchmarks/gpu_check.py; unless its
    implementation is "deepspeed"), else CPU_ADAM_BANDWIDTH (a fused AdamW measured on the H200
    run's 16-core host, 111 GB/s). `deepspeed_adam_bandwidth` is the "zero3-offload" baseline's
    DeepSpeedCPUAdam; None takes a host section measured with implementation "deepspeed", else
    the same speed as Mobius's optimizer (no assumed speed-up). The host's work per overlap mode
    is the runtime's (sim.tasks.cpu_optimizer, planning/host_step.py): "sync"/"async" with
    half-precision gradients one fused pass per parameter (28 B AdamW); "none" (and fp32) torch's
    step and the copies around it, at `host_copy_bandwidth` (None: the host section's
    `host_copy_bytes_per_s`, else HOST_COPY_BANDWIDTH). `keep_grads` is the overlap's (True: the
    fp32 `.grad` as the runtime makes it, planning/host_step.py; False: `opt.keep_grads = False`); so is `widen_downloads` (None: the plan's, host_step.widen_fits). `host_copies` sets a
    kind's bytes per parameter (per 4 master bytes; HOST_COPY_KINDS); the result names the figures.

    `masters`: where host memory lives, "local" (default: each stage on the socket of the GPU
    that first moves it) or a root complex ("cpu0": all on that socket; GPUs elsewhere cross
    the inter-socket link) -- see mobius_fx.sim.tasks.MASTERS. `optimizer_overlap`: "none"
    (the CPU optimizer after the step), "sync" (each stage stepped once its gradients are on
    the host) or "async" (staleness 1: the step is max(pipeline + hand-over, the optimizer's pass)), for the Mobius
    schedules and RoundPipe's; "zero3-offload" keeps DeepSpeed's step after the pipeline and
    GPipe steps on the GPUs (sim.tasks.cpu_optimizer).

    `servers` = R > 1 simulates one server of R running the plan data parallel
    (mobius_fx/runtime/data_parallel.py; the Mobius schedules and RoundPipe's): every server runs the
    same step on its own slice of an R x larger global batch, so one server's step is the
    cluster's. Once a stage's gradients are in host memory (its gradient downloads, from every
    GPU holding a copy, have ended), its gradients (its trainable master bytes) are averaged across the
    servers by a ring all-reduce (reduce-scatter + all-gather, 2(R-1) steps): 2(R-1)/R x bytes
    sent and as many received on the server's NIC, taking 2(R-1)/R x bytes / `network` +
    2(R-1) x `network_latency` (`ring_allreduce_time`), one stage at a time on a "host/nic"
    resource, in the order stages complete, overlapped with the backward of earlier stages.
    The stage's CPU optimizer step comes after its all-reduce ("sync"; "none": after all of
    them; "async": stepping the previous step's averaged gradients, from the start).
    Assumptions: a full-duplex NIC of `network` bytes/s in each direction (a number of bytes/s
    or a string, "100Gbps", "25Gbit/s", "12.5GB/s": units.parse_network; math.inf: an ideal
    network, the all-reduces take no time), a non-blocking network between the servers,
    `network_latency` seconds per ring step (default NETWORK_LATENCY = 0: the bandwidth term
    alone), the NIC's PCIe and DRAM traffic and gloo's CPU work not charged, nor the time to
    copy a bucket together. `servers=1` is one server, exactly as without it.

    r = simulate(plan)
    print(r.summary())
    simulate(plan, schedule="roundpipe").step_time
    simulate(plan, schedule="mobius-identity-map", masters="cpu0").step_time
    """
    if not isinstance(plan, Plan):
        raise MobiusError(f"simulate needs a Plan, got {plan!r} (a {type(plan).__name__}); pass the result of "
                          f"mobius_fx.plan(model, topology, example_inputs=...)")
    topo = topology_of(plan, topology)
    spec = schedules.get(schedule)
    optimizer_bytes_touched(optimizer)
    bw, ds_bw, copy_bw, sources = host_rates(topo, cpu_adam_bandwidth, deepspeed_adam_bandwidth, host_copy_bandwidth)
    copies, keep_grads = host_copies_of(host_copies), keep_grads_of(keep_grads)
    if optimizer_overlap not in OVERLAP_MODES:
        raise MobiusError(f"optimizer_overlap={optimizer_overlap!r}; use one of {', '.join(map(repr, OVERLAP_MODES))}: "
                          f"the optimizer after the step, per stage as gradients land, or a step late")
    masters = masters_of(MASTERS if masters is None else masters, topo)
    net, alpha = network_of(spec, servers, network, network_latency)
    check_gpus(plan, topo)
    widen = next(w for w in (widen_downloads, getattr(plan, "widen_downloads", None), widen_fits(topo)) if w is not None)
    ctx = Context(plan, topo, optimizer, bw, use_plan_routes=topo is plan.topology, masters=masters,
                  deepspeed_adam_bw=ds_bw, overlap=optimizer_overlap, servers=servers, network=net,
                  network_latency=float(alpha), copy_bw=copy_bw, copies=copies, keep_grads=keep_grads, widen=widen)
    spec.build(ctx)
    deepspeed = spec.optimizer == "deepspeed"
    if deepspeed:
        sources["optimizer"] = sources.pop("deepspeed")
    else:
        sources.pop("deepspeed")
    return dataclasses.replace(_run(ctx, schedule), host_sources=sources, host_copy_bandwidth=copy_bw,
                               optimizer_bandwidth=ctx.deepspeed_adam_bw if deepspeed else bw)


# ---------------------------------------------------------------------------------- run
def _run(ctx: Context, schedule: str) -> SimResult:
    tasks = ctx.tasks
    bws: dict[Link, float] = {}

    def capacity(link: Link) -> float:
        if link not in bws:
            bws[link] = float(ctx.topo.link_bandwidth(*link))
        return bws[link]

    rep = replay(tasks, capacity, duplex=lambda link: ctx.topo.link_duplex(*link))
    host = ("optimizer", "host-copy")  # the host's own work: after the pipeline or beside it
    opt_ids = [i for i, t in enumerate(tasks) if t.meta.get("kind") in host]
    copy_ids = [i for i, t in enumerate(tasks) if t.meta.get("kind") == "host-copy"]
    nic_ids = [i for i, t in enumerate(tasks) if t.meta.get("kind") == "allreduce"]
    pipe_end = max((rep.end[i] for i, t in enumerate(tasks) if t.meta.get("kind") not in (*host, "allreduce")),
                   default=0.0)
    comm_end = max([pipe_end] + [rep.end[i] for i in nic_ids])
    step = max([comm_end] + [rep.end[i] for i in opt_ids])
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
    return SimResult(schedule=schedule, step_time=step, pipeline_time=pipe_end, optimizer_time=step - comm_end,
                     gpu_busy=gpu_busy, link_bytes=link_bytes, link_busy=rep.link_busy,
                     critical_path=_critical_path(tasks, rep, step), events=events, bound=bound,
                     link_bandwidth=dict(bws),
                     segments=tuple(LinkSegment(g.link, g.start, g.end, tuple(tasks[i].name for i in g.flows))
                                    for g in rep.segments),
                     servers=ctx.servers, network=ctx.network,
                     allreduce_time=sum(rep.end[i] - rep.start[i] for i in nic_ids),
                     allreduce_exposed=comm_end - pipe_end, nic_bytes=sum(tasks[i].meta["bytes"] for i in nic_ids),
                     host_copy_time=sum(rep.end[i] - rep.start[i] for i in copy_ids),
                     host_busy=sum(rep.end[i] - rep.start[i] for i in opt_ids))


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
            elif kind == "host-copy":
                out["host copies"] += dur
            elif kind == "allreduce":
                out["network"] += dur
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
