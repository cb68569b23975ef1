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

from mobius_fx.errors import MobiusError
from mobius_fx.sim.network import Link, Task
from mobius_fx.planning.plans import Plan
from mobius_fx.kinds import HOST

__all__ = ["Costs", "Context", "cpu_optimizer", "gpu_optimizer", "optimizer_bytes_touched",
           "ring_allreduce_time", "gradient_allreduce", "NETWORK_LATENCY", "TOUCHED_BYTES", "STATE_BYTES",
           "CPU_ADAM_BANDWIDTH", "HOST_COPY_BANDWIDTH", "HOST_COPY_KINDS", "RUNTIME_HOST_COPIES", "NO_HOST_COPIES",
           "MASTERS", "host_copy_bytes"]

# Master bytes: the simulator knows each stage's trainable master bytes (`Costs.master`: its
# gradient bytes in the masters' dtype, `Stage.grad_bytes / Precision.scale`), not a count of
# parameters. Every per-parameter figure below (TOUCHED_BYTES, STATE_BYTES, `host_copy_bytes`,
# `simulate(host_copies=)`) is charged per 4 master bytes (`master_bytes / 4.0`), and "streamed
# bytes per element" is 4 x Precision.scale: one parameter per 4 bytes, exact for fp32 masters;
# with 2-byte masters the same bytes count half as many parameters.
#
# Bytes of memory traffic per parameter (per 4 master bytes) in one optimizer step. Adam reads
# the parameter, its gradient and both moments (4 x 4 B) and writes the parameter and both
# moments (3 x 4 B): 28 B. SGD with momentum reads p, g, m and writes p, m: 20 B. The step is
# memory bound on a CPU, so time = master bytes / 4 x bytes / sustained bandwidth.
TOUCHED_BYTES = {"adam": 28, "adamw": 28, "sgd": 20, "none": 0}
STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 4, "none": 0}  # optimizer state bytes per 4 master bytes

# The default optimizer speed when the topology has no measured "host" section (`HostFigures`,
# written by benchmarks/cpu_optimizer.py --topology-out and benchmarks/gpu_check.py): torch's
# fused AdamW (`torch.optim.AdamW(..., fused=True)`, one pass over the state) as measured on the
# 16-core host of the H200 run (../shared/gpu-reports/2026-12-04-h200/fsdp.log: "AdamW(fused)
# 0.756 s", the median of the 3 steps after the first, over the 3,000,238,080 fp32 masters of the
# gpu_check GPT; gpu_check.json's own steps after the first: 0.955, 0.762, 0.751 s; the profiled
# step 0.721 s). Bytes/s as TOUCHED_BYTES counts them:
#     3,000,238,080 x 28 B / 0.756 s = 84.0e9 B / 0.756 s = 111.1e9 B/s.
# (The assumption before it was 20 GB/s for a plain Adam, 5.6x slower: the simulator charged
# 7.52 s for the 0.72-0.76 s measured.) On this project's 2-core VM the same script measured
# 41 GB/s fused (7.7 per tensor, 7.9 foreach) on a quiet day and 1.85 GB/s while other jobs
# shared the cores: a VM's figure is not a server's default. Run the script on your server.
H200_HOST_PARAMS = 3_000_238_080  # the masters the H200 host stepped
H200_HOST_ADAMW_SECONDS = 0.756  # its fused AdamW step, median of 3 steps after the first
CPU_ADAM_BANDWIDTH = H200_HOST_PARAMS * TOUCHED_BYTES["adamw"] / H200_HOST_ADAMW_SECONDS  # 111.1e9 B/s

# The host-side copies the runtime makes outside the optimizer's step (`HOST_COPY_KINDS`), at
# HOST_COPY_BANDWIDTH bytes/s (read + written) unless the topology's host section measured it
# (`host_copy_bytes_per_s`): on the same H200 host the gradient hand-over (`MastersBackward` in
# profile.log: every bf16 gradient made a new fp32 tensor, 6 B per parameter) took 653.7 ms,
#     3,000,238,080 x 6 B / 0.6537 s = 18.0e9 B / 0.6537 s = 27.5e9 B/s,
# the slowest copy of that step (the pin cast ran ~470 ms, ~38 GB/s) -- the slowest, as
# cpu_optimizer.py's host section takes its slowest copy.
H200_HOST_HANDOVER_SECONDS = 0.6537
HOST_COPY_BANDWIDTH = H200_HOST_PARAMS * 6 / H200_HOST_HANDOVER_SECONDS  # 27.5e9 B/s

# The copies, per parameter of a trainable weight (per 4 master bytes), each where the runtime makes it
# (`host_copy_bytes` gives its bytes with weights streamed at `s` bytes per element):
# - "pin": the master copied (cast) into the streamed copy an upload reads, by the GPU's
#   upload worker before the stage's first upload of the step (StreamDevice._pinned_copy: again every
#   step the optimizer changed the master), read 4 + write s -- unless the step refreshed it;
# - "refresh": the same copy written by pipe.overlap(mode="sync")'s worker right after a stage's
#   step (refresh_copies=True, its default), so nothing is pinned: on the optimizer's resource;
# - "handover": a downloaded gradient made the master's fp32 `.grad` (host_gradient), read s +
#   write 4, none when gradients stream in fp32; on the main thread after backward ("none",
#   "async"); in "sync" span by span inside the stage's step (overlap.OverlapOptimizer._step_fused: each span is
#   converted right before the optimizer steps it), charged as the step's extra DRAM traffic
#   (the streamed bytes: the fp32 span is read back from cache) at the optimizer's speed;
# - "finite_check": "sync" with fp32 downloads reads each stage's gradients for a non-finite
#   value before stepping it (4 B), on the optimizer's resource (with half-precision downloads
#   the GPUs sum them before the download: no host pass);
# - "shadow": "async" copies w(t) into the shadow it steps (read 4, write 4), before the step.
# RUNTIME_HOST_COPIES are the kinds today's runtime makes; a kind left out (or `simulate(...,
# host_copies={"handover": 0})`) costs nothing -- when the runtime fuses a pass into the
# optimizer's step, count its bytes in the step instead (TOUCHED_BYTES).
HOST_COPY_KINDS = ("pin", "refresh", "handover", "finite_check", "shadow")
RUNTIME_HOST_COPIES = HOST_COPY_KINDS
# `simulate(plan, host_copies=NO_HOST_COPIES)`: no host copy at all -- the network and the
# schedule alone, as the planner's step model sees them (it models no host copies).
NO_HOST_COPIES = dict.fromkeys(HOST_COPY_KINDS, 0.0)


def host_copy_bytes(kind: str, streamed: float, optimizer: str = "adam") -> float:
    """Bytes read + written per parameter (per 4 master bytes) of host copy `kind` (HOST_COPY_KINDS) with
    weights streamed at `streamed` bytes per element, as the runtime makes it (0 for a kind left
    out of RUNTIME_HOST_COPIES, and for every kind without an optimizer: nothing changes).

    >>> [host_copy_bytes(k, 2) for k in HOST_COPY_KINDS], host_copy_bytes("handover", 4)
    ([6, 6, 6, 4, 8], 0)
    """
    if kind not in HOST_COPY_KINDS:
        raise MobiusError(f"unknown host copy {kind!r}; the host copies the simulator models are "
                          f"{', '.join(HOST_COPY_KINDS)}")
    if TOUCHED_BYTES.get(optimizer, 0) == 0 or kind not in RUNTIME_HOST_COPIES:
        return 0
    if kind == "handover":
        return 0 if streamed >= 4 else streamed + 4
    return {"pin": 4 + streamed, "refresh": 4 + streamed, "finite_check": 4, "shadow": 8}[kind]

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


def optimizer_bytes_touched(optimizer: str) -> int:
    """Bytes read + written per parameter (per 4 master bytes) by one step of `optimizer` (adam: 28)."""
    try:
        return TOUCHED_BYTES[optimizer]
    except KeyError:
        raise MobiusError(f"unknown optimizer {optimizer!r}; use one of {', '.join(TOUCHED_BYTES)}") from None


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
    `host_copy_bytes`, as the runtime makes it)."""

    def __init__(self, plan: Plan, topo: Any, optimizer: str, cpu_bw: float, use_plan_routes: bool, *,
                 masters: str = MASTERS, deepspeed_adam_bw: float | None = None,
                 overlap: str = "none", servers: int = 1, network: float = float("inf"),
                 network_latency: float = NETWORK_LATENCY, copy_bw: float = HOST_COPY_BANDWIDTH,
                 copies: dict[str, float] | None = None):
        self.plan, self.topo, self.optimizer, self.cpu_bw = plan, topo, optimizer, cpu_bw
        self.overlap = overlap  # one of kinds.OVERLAP_MODES: when the CPU optimizer steps (see cpu_optimizer)
        self.copy_bw = copy_bw
        # Whether uploads pin the streamed copies first (`pin_copy`): not where the optimizer's step
        # writes them ("sync" refreshes them; DeepSpeed's CPU Adam writes its fp16 copy itself).
        self.pin_before_upload = overlap != "sync"
        self._pins: dict[tuple[str, int], int] = {}  # (gpu, stage) -> its pin task this step
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
        streamed = 4.0 * self.scale
        self.copies = {k: host_copy_bytes(k, streamed, optimizer) for k in HOST_COPY_KINDS}
        self.copies.update(copies or {})

    def copy_seconds(self, kind: str, master_bytes: float) -> float:
        """Seconds host copy `kind` takes over `master_bytes` of masters (its bytes per 4 of them) at `copy_bw`."""
        return master_bytes / 4.0 * self.copies[kind] / self.copy_bw

    def pin_copy(self, gpu: str, stage: int, master_bytes: float, after_start: list = ()) -> int | None:
        """The pinning of stage `stage`'s streamed copy (its `master_bytes` of trainable
        masters; frozen weights are pinned once, not every step) by `gpu`'s upload worker, on the
        "<gpu>/pin" resource, once per step and GPU (each GPU keeps its own copies), started
        when the upload is triggered (`after_start`). The stage's uploads wait for the task
        returned; None when nothing is pinned (`pin_before_upload` off, no bytes)."""
        seconds = self.copy_seconds("pin", master_bytes) if self.pin_before_upload else 0.0
        if seconds <= 0:
            return None
        if (gpu, stage) not in self._pins:
            self._pins[(gpu, stage)] = self.add(Task(
                f"pin s{stage} {gpu}", f"{gpu}/pin", (stage,), seconds,
                after_start=[d for d in after_start if d is not None],
                meta={"kind": "host-copy", "copy": "pin", "phase": "forward", "gpu": gpu, "stage": stage}))
        return self._pins[(gpu, stage)]

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
    """The optimizer step over `master_bytes` of masters on the CPU (TOUCHED_BYTES per 4 of them), at `bandwidth` bytes/s
    (default: the context's `cpu_bw`, the user's torch optimizer), on the "host/optimizer"
    resource, with the host copies around it where the runtime makes them (HOST_COPY_KINDS, at
    `ctx.copy_bw`; the pinning before uploads is `Context.pin_copy`'s).

    `overlap` (default the context's, one of `kinds.OVERLAP_MODES`):
    - "none": the gradient hand-over on the main thread ("host/handover") once every task so far
      has ended, then the step;
    - "sync": per stage of `per_stage` (stage -> its master bytes), as soon as its gradient
      downloads (every GPU that holds a copy) have landed, on the optimizer's worker the step
      with the hand-over fused into it (half-precision downloads: the streamed bytes more per
      parameter) or after the finite check (fp32 ones), then the refresh of the stage's
      streamed copy, while the GPUs go on with earlier stages
      (without `per_stage`, as "none");
    - "async": the steady state of a staleness-1 update (step t's update runs while step t+1
      computes): the hand-over after the pipeline as in "none", and from the start the shadow
      copy of w(t) then the step, so the step takes max(pipeline + hand-over, shadow + update).
    `fused_refresh`: a kernel that writes the streamed copy as it steps (DeepSpeed's CPU Adam):
    those bytes (the streamed size) count in the step, at `bandwidth`. The DRAM traffic of the
    step and the copies is not charged to the links, and the host's resources do not share its
    memory bandwidth with one another (each runs at its own measured speed).

    With `ctx.servers` > 1 (and `per_stage`), each stage's gradients are first all-reduced
    across the servers (`gradient_allreduce`): "sync" hands a stage over once its all-reduce has
    ended, "none" after every all-reduce; "async" still updates from the start (it steps the
    previous step's gradients, averaged within that step).
    """
    bw = bandwidth or ctx.cpu_bw
    touched = TOUCHED_BYTES[ctx.optimizer] + (4.0 * ctx.scale if fused_refresh and TOUCHED_BYTES[ctx.optimizer] else 0)
    mode = ctx.overlap if overlap is None else overlap
    reduced = gradient_allreduce(ctx, per_stage) if per_stage else {}
    everything = list(range(len(ctx.tasks)))

    def copy(kind: str, name: str, nbytes: float, stream: str, after: list, priority: tuple, **meta) -> list:
        """A host copy task (none when it costs nothing); what comes next waits for the result."""
        seconds = ctx.copy_seconds(kind, nbytes)
        if seconds <= 0:
            return after
        return [ctx.add(Task(name, stream, priority, seconds, after=after,
                             meta={"kind": "host-copy", "copy": kind, "phase": "step", **meta}))]

    def step(name: str, nbytes: float, after: list, priority: tuple, extra: float = 0.0, **meta) -> list:
        """The optimizer's pass over `nbytes` of masters, touching `extra` more bytes per one."""
        return [ctx.add(Task(name, "host/optimizer", priority, nbytes / 4.0 * (touched + extra) / bw, after=after,
                             meta={"kind": "optimizer", "phase": "step", **meta}))]

    if mode == "sync" and per_stage:
        grads = _gradient_tasks(ctx)
        for k, nbytes in sorted(per_stage.items(), reverse=True):  # the last stage's gradients land first
            landed = [reduced[k]] if k in reduced else grads.get(k) or everything
            if ctx.scale < 1 and ctx.copies["handover"] > 0:
                # half-precision gradients: the runtime converts them span by span inside the
                # stage's step (overlap.OverlapOptimizer._step_fused), reading their finiteness on the GPUs (no host
                # pass). DRAM traffic: the streamed gradient read and the fp32 `.grad` written,
                # which the step then reads from cache instead of from memory: `streamed` bytes per
                # parameter more than the step's own, at the optimizer's speed
                checked, extra = landed, 4.0 * ctx.scale
            else:  # fp32 downloads are the gradients; the host reads them for a non-finite value
                checked, extra = copy("finite_check", f"finite check s{k}", nbytes, "host/optimizer", landed,
                                      (-k, 0), stage=k), 0.0
            stepped = step(f"optimizer step s{k}", nbytes, checked, (-k, 1), extra, stage=k)
            copy("refresh", f"refresh s{k}", nbytes, "host/optimizer", stepped, (-k, 2), stage=k)
        return
    handed = copy("handover", "hand-over", master_bytes, "host/handover", everything, ())
    if mode == "async":
        step("optimizer step", master_bytes, copy("shadow", "shadow copy", master_bytes, "host/optimizer", [], (0,)),
             (1,))
        return
    step("optimizer step", master_bytes, sorted(set(everything + handed)), ())
