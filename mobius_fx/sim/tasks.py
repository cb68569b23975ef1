"""The simulator's task graph: per-GPU streams, transfers on the topology's routes, the host's
optimizer step and copies, and the data-parallel all-reduce. The schedules
(mobius_fx/schedules/) add their tasks to a `Context`.

    ctx = Context(plan, topo, "adam", 111e9, use_plan_routes=True)
    i = ctx.compute("gpu0", 1e-3, "F0 mb0", after=[])
    ctx.move("gpu0/upload", (0, 0, 0), "host", "gpu0", 1e6, "prefetch s0")
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from mobius_fx.sim.network import Link, Task
from mobius_fx.planning.plans import Plan
from mobius_fx.kinds import HOST
from mobius_fx.planning.host_step import (HOST_COPY_BANDWIDTH, HOST_COPY_KINDS, TOUCHED_BYTES, download_scale,
                                         host_copy_bytes, host_pass_bytes)

__all__ = ["Costs", "Context", "cpu_optimizer", "gpu_optimizer", "ring_allreduce_time", "gradient_allreduce",
           "NETWORK_LATENCY", "MASTERS"]

# The host's bytes per parameter and speeds (TOUCHED_BYTES, CPU_ADAM_BANDWIDTH, HOST_COPY_KINDS,
# RUNTIME_HOST_COPIES, host_pass_bytes, host_copy_bytes, ...) are the planner's too: they live in
# mobius_fx/planning/host_step.py, the one statement of what the runtime's host does per step.

# Where host memory (a stage's masters, its gradients, its saved inputs) lives, per socket:
# "local": in the DRAM of the socket of the GPU that first moves it (first touch by that GPU's
# upload worker, bound to its socket: what a NUMA-aware runtime gets; for the Mobius schedules
# the socket of the GPU the stage is mapped to, so cross or identity mapping alike read local
# DRAM; data-parallel ZeRO-3 keeps each rank's partition on its own socket); or a root complex
# name ("cpu0"): everything in that socket's DRAM (a process that allocates the model from one
# socket, without NUMA binding), so a GPU on another socket reaches it over the inter-socket
# (UPI) link. Transfers to or from host memory then route through that socket.
MASTERS = "local"


# Data parallel across servers (`simulate(servers=R, network=...)`, mobius_fx/runtime/data_parallel.py):
# each stage's averaged gradients are a ring all-reduce over the servers' NICs. NETWORK_LATENCY
# is the default latency term alpha of one ring step (seconds): 0, so the simulated collective is
# the bandwidth term alone, 2(R-1)/R x bytes / bandwidth. Per-stage buckets are hundreds of MiB
# for the models Mobius is for, so a TCP round trip of tens of microseconds per step (gloo over
# Ethernet) changes nothing visible; pass `network_latency` to `simulate` to charge it.
NETWORK_LATENCY = 0.0


@dataclass
class Costs:
    """Per stage (or layer unit): times per micro-batch, bytes as streamed."""

    f: list[float]
    b: list[float]
    w: list[float]
    g: list[float]
    inp: list[float]  # boundary input bytes per micro-batch
    out: list[float]
    master: list[float]  # trainable master bytes (the gradients in the masters' dtype: the optimizer's)
    names: list[str]


class Context:
    """The task list under construction, with the costs, routes and host memory placement
    (`masters`, see MASTERS) every builder shares.

    `cpu_bw` is the user's torch optimizer's bytes/s, `deepspeed_adam_bw` the "zero3-offload"
    baseline's DeepSpeedCPUAdam (None: the same speed), `copy_bw` the host copies' bytes/s and
    `copies` their bytes per 4 master bytes by kind (HOST_COPY_KINDS; a kind not given:
    `host_copy_bytes`, as the runtime makes it with the overlap's `keep_grads`)."""

    def __init__(self, plan: Plan, topo: Any, optimizer: str, cpu_bw: float, use_plan_routes: bool, *,
                 masters: str = MASTERS, deepspeed_adam_bw: float | None = None,
                 overlap: str = "none", servers: int = 1, network: float = float("inf"),
                 network_latency: float = NETWORK_LATENCY, copy_bw: float = HOST_COPY_BANDWIDTH,
                 copies: dict[str, float] | None = None, keep_grads: bool = True, widen: bool = True):
        self.plan, self.topo, self.optimizer, self.cpu_bw = plan, topo, optimizer, cpu_bw
        self.overlap = overlap  # one of kinds.OVERLAP_MODES: when the CPU optimizer steps (see cpu_optimizer)
        self.copy_bw = copy_bw
        # Whether uploads pin the streamed copies first (`pin_copy`, where the mode's "pin" has
        # bytes): not where the optimizer's step writes them (DeepSpeed's CPU Adam writes its fp16
        # copy itself: zero3_offload turns this off).
        self.pin_before_upload = True
        self._pins: dict[int, int] = {}  # stage -> its pin task this step
        # Data-parallel servers, each server's NIC bandwidth (bytes/s per direction) and the
        # latency of one ring step (s): see gradient_allreduce.
        self.servers, self.network, self.network_latency = servers, network, network_latency
        self.masters = masters
        self.deepspeed_adam_bw = cpu_bw if deepspeed_adam_bw is None else deepspeed_adam_bw
        self._socket = {g.name: g.root_complex for g in topo.gpus}
        self._home: dict[Any, str] = {}
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
        self.scale = plan.precision.scale  # streamed bytes per master byte
        st = plan.stages
        self.stages = Costs([s.fwd_time for s in st], [s.bwd_time for s in st], [float(s.param_bytes) for s in st],
                             [float(s.grad_bytes) for s in st], [float(s.input_bytes) for s in st],
                             [float(s.output_bytes) for s in st], [s.grad_bytes / self.scale for s in st],
                             [f"s{s.index}" for s in st])
        self.streamed = 4.0 * self.scale  # streamed bytes per element
        self.keep_grads = keep_grads  # the overlap's fp32 .grad (OverlapOptimizer.keep_grads): host_copy_bytes
        self.widen = widen  # the overlap's widened downloads (OverlapOptimizer.widen_downloads): host_step
        self.given_copies = dict(copies or {})
        self.copies = self.copies_for(overlap)
        # the gradient downloads' bytes on the links per byte as streamed: 2 where the runtime widens
        # them to fp32 on the GPUs (sync / async keeping .grad, half precision: `download_scale`)
        self.down_scale = download_scale(overlap, self.streamed, servers, keep_grads, widen)

    def copies_for(self, overlap: str) -> dict[str, float]:
        """Host copy kind -> its bytes per 4 master bytes under `overlap` (`host_copy_bytes`, as
        the runtime makes them), overridden by the `copies` given."""
        out = {k: float(host_copy_bytes(k, self.streamed, self.optimizer, overlap, self.servers, self.keep_grads,
                                        self.widen))
               for k in HOST_COPY_KINDS}
        out.update(self.given_copies)
        return out

    def copy_seconds(self, kind: str, master_bytes: float, copies: dict[str, float] | None = None) -> float:
        """Seconds host copy `kind` takes over `master_bytes` of masters (its bytes per 4 of them,
        `copies` or the context's mode's) at `copy_bw`."""
        return master_bytes / 4.0 * (self.copies if copies is None else copies)[kind] / self.copy_bw

    def pin_copy(self, gpu: str, stage: int, master_bytes: float, after_start: list = ()) -> int | None:
        """The pinning of stage `stage`'s streamed copy (its `master_bytes` of trainable
        masters; frozen weights are pinned once, not every step) by the upload worker of the
        first GPU that uploads it, on the "<gpu>/pin" resource, once per step: the GPUs share one
        streamed copy per master (runtime/streamed_copies.py), so a stage another GPU uploads too
        -- roundpipe's backward, ZeRO-3 offload's every GPU -- waits for the same pin. Started
        when the upload is triggered (`after_start`). The stage's uploads wait for the task
        returned; None when nothing is pinned (`pin_before_upload` off, no bytes)."""
        seconds = self.copy_seconds("pin", master_bytes) if self.pin_before_upload else 0.0
        if seconds <= 0:
            return None
        if stage not in self._pins:
            self._pins[stage] = self.add(Task(
                f"pin s{stage} {gpu}", f"{gpu}/pin", (stage,), seconds,
                after_start=[d for d in after_start if d is not None],
                meta={"kind": "host-copy", "copy": "pin", "phase": "forward", "gpu": gpu, "stage": stage}))
        return self._pins[stage]

    def route(self, src: str, dst: str) -> tuple[str, ...]:
        if (src, dst) not in self._routes:
            self._routes[(src, dst)] = (src,) if src == dst else tuple(self.topo.route(src, dst))
        return self._routes[(src, dst)]

    def home(self, key: Any, gpu: str) -> str:
        """The root complex whose DRAM holds `key`'s host copies (a stage, or (gpu, stage) for
        a data-parallel rank's own partition), first moved by `gpu` (see MASTERS)."""
        if self.masters != "local":
            return self.masters
        return self._home.setdefault(key, self._socket[gpu])

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
             after: list = (), after_start: list = (), need: tuple = (), home: str | None = None,
             **meta) -> int | None:
        """A transfer task on `stream` (served in `priority` order). `need` ranks it against the
        other flows on its links (smaller: needed sooner, goes first); `home` is the root
        complex whose DRAM the host end is (None: the GPU's own socket)."""
        if nbytes <= 0:
            return None
        route = self.route(src, dst)
        gpu = dst if src == HOST else src if dst == HOST else None
        if home is not None and gpu is not None and home != self._socket[gpu]:
            route = self.route(home, gpu) if src == HOST else self.route(gpu, home)
        return self.add(Task(name, stream, priority, links=tuple(zip(route, route[1:])), size=float(nbytes),
                             after=[d for d in after if d is not None],
                             after_start=[d for d in after_start if d is not None], link_priority=tuple(need),
                             meta={"src": src, "dst": dst, "route": route, "bytes": int(nbytes), **meta}))

    def mark(self, name: str, after: list, **meta) -> int:
        return self.add(Task(name, after=[d for d in after if d is not None], meta=meta))


def ring_allreduce_time(nbytes: float, servers: int, bandwidth: float, latency: float = NETWORK_LATENCY) -> float:
    """Seconds a ring all-reduce of `nbytes` takes across `servers` over NICs of `bandwidth`
    bytes/s per direction: 2(R-1) steps (R-1 of reduce-scatter, R-1 of all-gather), each
    sending and receiving a 1/R chunk at once (full duplex), so 2(R-1) x latency +
    2(R-1)/R x nbytes / bandwidth. 0 for one server or no bytes.

    >>> ring_allreduce_time(1e9, 4, 12.5e9)   # 1 GB over 4 servers on 100 Gbit/s: 1.5 GB each way
    0.12
    """
    if servers <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (servers - 1) * latency + 2 * (servers - 1) / servers * nbytes / bandwidth


def _gradient_tasks(ctx: Context) -> dict[int, list[int]]:
    """Stage -> its gradient downloads (one per GPU holding a copy) in the task list so far."""
    grads: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(ctx.tasks):
        if t.meta.get("kind") == "gradient":
            grads[t.meta["stage"]].append(i)
    return grads


def gradient_allreduce(ctx: Context, per_stage: dict[int, float]) -> dict[int, int]:
    """The inter-server traffic of `ctx.servers` data-parallel servers, as one server sees it
    (every server runs the same plan on its own slice of the global batch, so all are alike).

    Per stage of `per_stage` (stage -> its trainable master bytes: its gradients in the masters'
    dtype), once its
    gradients are in host memory (its gradient downloads have ended, from every GPU holding a
    copy; with none, after every task so far), one all-reduce task of `ring_allreduce_time` on
    the "host/nic" stream: one collective at a time, in the order stages complete (the later
    stage first when two are ready together), as data_parallel.GradientReducer's single
    communication thread runs gloo's all_reduce, one bucket per stage. Algorithm: ring
    (reduce-scatter then all-gather, 2(R-1) steps); each server sends and receives
    2(R-1)/R x bytes. Assumptions: the NIC is full duplex, `ctx.network` bytes/s in each
    direction, the only traffic on it, and the network between servers never the bottleneck
    (a non-blocking switch); each ring step costs `ctx.network_latency` more (default
    NETWORK_LATENCY, 0); the reduction's additions, gloo's CPU threads and the NIC's own PCIe
    and DRAM traffic are free (not charged to the optimizer or the topology's links).
    Returns stage -> its all-reduce task (stages with no bytes have none); none for one server.
    """
    if ctx.servers <= 1:
        return {}
    grads = _gradient_tasks(ctx)
    everything = list(range(len(ctx.tasks)))
    ring = 2 * (ctx.servers - 1) / ctx.servers
    out: dict[int, int] = {}
    for k, nbytes in sorted(per_stage.items(), reverse=True):  # the last stage's gradients land first
        if nbytes <= 0:
            continue
        out[k] = ctx.add(Task(f"all-reduce s{k}", "host/nic", (-k,),
                              ring_allreduce_time(nbytes, ctx.servers, ctx.network, ctx.network_latency),
                              after=grads.get(k) or everything,
                              meta={"kind": "allreduce", "phase": "backward", "stage": k,
                                    "bytes": int(round(ring * nbytes)), "route": ("host", "nic")}))
    return out


def gpu_optimizer(ctx: Context, gpu: str, master_bytes: float, after: list[int]) -> int:
    """GPU `gpu`'s optimizer step over the parameters of `master_bytes` master bytes (GPipe's, on
    the GPU), on its "<gpu>/optimizer" resource after `after`: TOUCHED_BYTES per 4 master bytes
    at the GPU's memory bandwidth."""
    spec = next(g.spec for g in ctx.topo.gpus if g.name == gpu)
    seconds = master_bytes / 4.0 * TOUCHED_BYTES[ctx.optimizer] / spec.memory_bandwidth
    return ctx.add(Task(f"optimizer {gpu}", f"{gpu}/optimizer", (), seconds, after=after,
                        meta={"kind": "optimizer", "phase": "step", "gpu": gpu}))


def cpu_optimizer(ctx: Context, master_bytes: float, bandwidth: float | None = None, *,
                  per_stage: dict[int, float] | None = None, overlap: str | None = None,
                  fused_refresh: bool = False) -> None:
    """The optimizer step over `master_bytes` of masters on the CPU, at `bandwidth` bytes/s
    (default: the context's `cpu_bw`, the optimizer's measured speed), on the "host/optimizer"
    resource, with the host copies the runtime makes around it under `overlap` (default the
    context's, one of `kinds.OVERLAP_MODES`; RUNTIME_HOST_COPIES, at `ctx.copy_bw`; the pinning
    before uploads is `Context.pin_copy`'s). Its bytes per 4 master bytes: `host_pass_bytes`,
    plus the fp32 `.grad` the fused pass writes ("grad"), all at `bandwidth`.

    - "none": the gradient hand-over on the main thread ("host/handover") once every task so far
      has ended, then torch's step;
    - "sync": per stage of `per_stage` (stage -> its master bytes), as soon as its gradient
      downloads (every GPU that holds a copy) have landed, on the optimizer's worker, one pass
      (the fused host pass with half-precision downloads; torch's step then the refresh of the
      streamed copy with fp32 ones; data parallel: the hand-over, the finite check, the step
      and the refresh), in the order the stages land, while the GPUs go on with earlier stages
      (without `per_stage`, as "none");
    - "async": staleness 1 (step t's update runs while step t+1 computes): the pass from the
      start beside the pipeline (fp32: after w(t) is copied into the shadow, "shadow"); with
      `keep_grads` each stage's downloads made the fp32 `.grad` once landed (and all-reduced),
      FIFO in stage order S-1..0 on "host/handover" (OverlapOptimizer.ready): the step is
      max(pipeline, hand-overs, pass).
    `fused_refresh`: DeepSpeed's CPU Adam (the "zero3-offload" baseline), torch's formula plus the
    streamed copy written as it steps: TOUCHED_BYTES + the streamed size, at `bandwidth`. The host's
    DRAM traffic is not charged to the links; its resources do not share its memory bandwidth.

    With `ctx.servers` > 1 (and `per_stage`), each stage's gradients are first all-reduced
    across the servers (`gradient_allreduce`): "sync" steps a stage once its all-reduce has
    ended, "none" after every all-reduce; "async" still updates from the start (it steps the
    previous step's gradients, averaged within that step).
    """
    bw = bandwidth or ctx.cpu_bw
    mode = ctx.overlap if overlap is None else overlap
    copies = ctx.copies_for(mode)
    if fused_refresh:
        touched = TOUCHED_BYTES[ctx.optimizer] + (ctx.streamed if TOUCHED_BYTES[ctx.optimizer] else 0)
    else:
        touched = host_pass_bytes(ctx.optimizer, ctx.streamed, mode, ctx.servers) + copies["grad"]
    reduced = gradient_allreduce(ctx, per_stage) if per_stage else {}
    everything = list(range(len(ctx.tasks)))

    def copy(kind: str, name: str, nbytes: float, stream: str, after: list, priority: tuple, **meta) -> list:
        """A host copy task (none when it costs nothing); what comes next waits for the result."""
        seconds = ctx.copy_seconds(kind, nbytes, copies)
        if seconds <= 0:
            return after
        return [ctx.add(Task(name, stream, priority, seconds, after=after,
                             meta={"kind": "host-copy", "copy": kind, "phase": "step", **meta}))]

    def step(name: str, nbytes: float, after: list, priority: tuple, **meta) -> list:
        """The optimizer's pass over `nbytes` of masters."""
        return [ctx.add(Task(name, "host/optimizer", priority, nbytes / 4.0 * touched / bw, after=after,
                             meta={"kind": "optimizer", "phase": "step", **meta}))]

    if mode == "sync" and per_stage:
        grads = _gradient_tasks(ctx)
        for k, nbytes in sorted(per_stage.items(), reverse=True):  # the last stage's gradients land first
            landed = [reduced[k]] if k in reduced else grads.get(k) or everything
            handed = copy("handover", f"hand-over s{k}", nbytes, "host/handover", landed, (-k,), stage=k)
            checked = copy("finite_check", f"finite check s{k}", nbytes, "host/optimizer", handed, (-k, 0), stage=k)
            stepped = step(f"optimizer step s{k}", nbytes, checked, (-k, 1), stage=k)
            copy("refresh", f"refresh s{k}", nbytes, "host/optimizer", stepped, (-k, 2), stage=k)
        return
    if mode == "async":
        step("optimizer step", master_bytes, copy("shadow", "shadow copy", master_bytes, "host/optimizer", [], (0,)),
             (1,))
        if per_stage:
            grads = _gradient_tasks(ctx)
            prev: list = []
            for k, nbytes in sorted(per_stage.items(), reverse=True):  # queued as the stages flush: S-1, ..., 0
                landed = [reduced[k]] if k in reduced else grads.get(k) or everything
                prev = copy("handover", f"hand-over s{k}", nbytes, "host/handover", [*landed, *prev], (-k,),
                            stage=k)[-1:]
        else:
            copy("handover", "hand-over", master_bytes, "host/handover", everything, ())
        return
    handed = copy("handover", "hand-over", master_bytes, "host/handover", everything, ())
    step("optimizer step", master_bytes, sorted(set(everything + handed)), ())
