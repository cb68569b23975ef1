"""What the host does per training step, in bytes per parameter and seconds: the one statement
the simulator (mobius_fx/sim/tasks.py) and the planner's step model
(`HostPass`, read by mobius_fx/planning/step_timeline.py and the partition MIP) both charge, as
the runtime does it (runtime/host_optimizer.py, overlap.py, device_stream.py).

    host_pass_bytes("adamw", 2, "sync")            # 28: one fused pass, bf16 in, streamed copy out
    HostPass.of(topology, precision, "adamw", "sync").seconds(8e9 * 2)   # stage pass, 8e9 bf16 grad bytes
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mobius_fx.errors import MobiusError
from mobius_fx.kinds import OVERLAP_MODES

__all__ = ["TOUCHED_BYTES", "STATE_BYTES", "CPU_ADAM_BANDWIDTH", "HOST_COPY_BANDWIDTH", "HOST_COPY_KINDS",
           "RUNTIME_HOST_COPIES", "RUNTIME_HOST_COPIES_REDUCED", "GRAD_COPIES", "NO_HOST_COPIES", "H200_HOST_PARAMS",
           "H200_HOST_ADAMW_SECONDS", "H200_HOST_HANDOVER_SECONDS", "fused_pass", "host_pass_bytes",
           "host_copy_bytes", "optimizer_bytes_touched", "PLANNED_OPTIMIZERS", "HostPass", "widen_fits", "widened_downloads",
           "download_scale"]

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

# What the host does per step, per overlap mode (`kinds.OVERLAP_MODES`), as the runtime does it,
# per parameter of a trainable weight (per 4 master bytes), with weights streamed (and gradients
# downloaded) at `s` bytes per element (4: fp32; 2: bf16/fp16):
#
# - "none" (the user's optimizer after backward, `pipe.overlap` not used): the downloaded
#   gradient made the master's fp32 `.grad` on the main thread ("handover", read s + write 4;
#   none in fp32: the download is the `.grad`), torch's step (TOUCHED_BYTES at the optimizer's
#   speed), and before each stage's first upload of the next step its streamed copy made again
#   from the changed master by the GPU's upload worker ("pin", read 4 + write s:
#   StreamDevice._pinned_copy).
# - "sync" (`pipe.overlap(opt, "sync")`): per stage as soon as its gradient downloads landed,
#   on the optimizer's worker. Half-precision downloads: ONE fused pass per parameter
#   (runtime/host_optimizer.py via overlap.OverlapOptimizer._host_pass) reads the download (s),
#   p, m, v and writes p, m, v and the streamed copy the next upload reads (s): `host_pass_bytes`,
#   28 B for AdamW in bf16, plus the fp32 `.grad` it writes ("grad", 4 B: OverlapOptimizer's
#   keep_grads, default True), at the optimizer's speed. No hand-over, refresh, pin or finite
#   check (the finite flag comes from the GPUs). fp32 downloads: the download is the `.grad`
#   (no hand-over), torch's step (28 B), then the streamed copy written from the master
#   ("refresh", read 4 + write 4: StreamDevice.refresh) on the same worker, at the copies' speed.
#   Data parallel (servers > 1): the all-reduced gradients take the unfused path
#   (overlap.OverlapOptimizer.ready without GPU finite flags): "handover" on the adder thread, the
#   non-finite check ("finite_check", read 4) and torch's step and "refresh" on the optimizer's.
# - "async" (staleness 1): the same fused pass out of place into the shadow the next swap makes
#   the weights, half-precision in, streamed copy out (`host_pass_bytes`: 28 B for AdamW in bf16),
#   running while the next step computes: no shadow copy or pin. What it reads depends on the
#   overlap's `keep_grads` (OverlapOptimizer.keep_grads, default True; `keep_grads=` of
#   `simulate`, `CompileOptions` and `HostPass.of` mirror it):
#   - keep_grads=True (the default): the fp32 `.grad` must exist when backward returns, so as
#     each stage's gradients land the adder thread converts its downloads into it
#     (`OverlapOptimizer.ready`: "handover", read s + write 4, per stage in landing order while
#     the GPUs go on, as sync's pass; backward returns once the last has ended), and the pass
#     reads that fp32 `.grad` -- whatever the loop made of it -- not the
#     s-byte download ("grad", 4 - s more bytes read, at the optimizer's speed: the runtime's
#     `grad_read`);
#   - keep_grads=False: the downloads are held as they are and the pass reads them: nothing else.
#   fp32: the download is the `.grad` (no hand-over); torch's step into the shadow after w(t) is
#   copied there ("shadow", read 4 + write 4, on the optimizer's worker) and the pin of the new
#   master before its first upload ("pin", 8 B).
# Widened downloads (`widened_downloads`: sync and async with keep_grads, half-precision, one
# server; the runtime's `Runtime.widens_gradients`, on by default: `OverlapOptimizer.
# widen_downloads`): each gradient is widened to fp32 on its GPU and downloaded straight into its
# `.grad`, so the host converts nothing -- no "handover" under async, sync's pass writes no `.grad`
# -- and the pass reads the fp32 `.grad` ("grad": 4 - s more bytes read than the download, both
# modes): 28 + 2 B per parameter for AdamW in bf16. The GPU->host link carries 4 B per parameter
# instead of s (`download_scale`; a tied weight's partials: all but the first holder's download s
# bytes, which go back up to that holder's GPU, and it downloads their sum widened (runtime/
# tied_sums.py); the models widen every holder's download: the same bytes, one leg the other way).
# A kind a mode does not make costs 0; `simulate(..., keep_grads=False)` (a loop with
# keep_grads=False) or `host_copies={"handover": 0}` overrides a kind's bytes.
HOST_COPY_KINDS = ("pin", "refresh", "handover", "finite_check", "shadow", "grad")
# The copies a mode makes only for the fp32 `.grad` (`keep_grads`): none without it.
GRAD_COPIES = dict(zip(OVERLAP_MODES, ((), ("grad",), ("handover", "grad"))))  # none, sync, async
RUNTIME_HOST_COPIES = dict(zip(OVERLAP_MODES, (("pin", "handover"), ("grad", "refresh"),
                                               ("pin", "handover", "shadow", "grad"))))  # none, sync, async
# with servers > 1 (data parallel) under "sync": the unfused path
RUNTIME_HOST_COPIES_REDUCED = {"sync": ("handover", "finite_check", "refresh")}
# `simulate(plan, host_copies=NO_HOST_COPIES)`: no host copy at all -- the network and the
# schedule alone, as the planner's step model sees the GPUs (the host pass itself stays).
NO_HOST_COPIES = dict.fromkeys(HOST_COPY_KINDS, 0.0)


def fused_pass(overlap: str, streamed: float, servers: int = 1) -> bool:
    """Whether the runtime steps with the fused host pass (`host_optimizer`) under `overlap`:
    sync and async with half-precision downloads, one server (data parallel's all-reduced
    gradients take the unfused path).

    >>> fused_pass("sync", 2), fused_pass("sync", 4), fused_pass("none", 2), fused_pass("sync", 2, servers=2)
    (True, False, False, False)
    """
    return overlap != "none" and streamed < 4 and not (servers > 1 and overlap == "sync")


def widen_fits(topology: Any) -> bool:
    """Whether the GPUs of `topology` should widen the gradients they download into the fp32
    `.grad` (`Plan.widen_downloads`, the overlap's default `widen_downloads`): where every link
    from a GPU to host memory is its own and full duplex, the 2 extra bytes per parameter ride a
    direction the uploads leave idle; behind a shared PCIe switch uplink, or on a link whose two
    directions interfere (`link_duplex` < 1), they would slow the pipeline's own transfers, so
    the host converts instead. None (no topology): widen.

    >>> from mobius_fx.topology.server import Topology
    >>> widen_fits(Topology.preset("rtx4090x8")), widen_fits(Topology.preset("mobius-testbed"))
    (True, False)
    """
    if topology is None:
        return True
    used: set[tuple[str, str]] = set()
    for g in topology.gpus:
        route = topology.route(g.name, "host")
        for u, v in zip(route, route[1:]):
            if (u, v) in used or topology.link_duplex(u, v) < 1:
                return False
            used.add((u, v))
    return True


def widened_downloads(overlap: str, streamed: float, servers: int = 1, keep_grads: bool = True,
                      widen: bool = True) -> bool:
    """Whether the runtime widens the gradient downloads to fp32 on the GPUs, straight into the
    fp32 `.grad` (`Runtime.widens_gradients`): sync or async keeping `.grad`, the fused pass
    (half precision), one server; `widen` False: `opt.widen_downloads = False`.

    >>> widened_downloads("sync", 2), widened_downloads("async", 2, keep_grads=False), widened_downloads("sync", 4)
    (True, False, False)
    """
    return widen and keep_grads and servers == 1 and fused_pass(overlap, streamed, servers)


def download_scale(overlap: str, streamed: float, servers: int = 1, keep_grads: bool = True,
                   widen: bool = True) -> float:
    """The factor on a stage's gradient download bytes (as streamed) on the GPU->host links: 4 /
    `streamed` where the downloads are widened (`widened_downloads`), else 1."""
    return 4.0 / streamed if widened_downloads(overlap, streamed, servers, keep_grads, widen) else 1.0


def host_pass_bytes(optimizer: str, streamed: float, overlap: str = "none", servers: int = 1) -> float:
    """Bytes read + written per parameter (per 4 master bytes) by the optimizer's own pass
    under `overlap`, not counting the fp32 `.grad` ("grad" of `host_copy_bytes`): the fused pass
    reads the `streamed`-byte gradient instead of a 4-byte one and writes the `streamed`-byte copy
    (AdamW in bf16: 28 - 4 + 2 + 2 = 28); torch's step reads and writes TOUCHED_BYTES.

    >>> host_pass_bytes("adamw", 2, "sync"), host_pass_bytes("sgd", 2, "async"), host_pass_bytes("adam", 2, "none")
    (28, 20, 28)
    """
    touched = optimizer_bytes_touched(optimizer)
    if touched and fused_pass(overlap, streamed, servers):
        return touched - 4 + 2 * streamed
    return touched


def host_copy_bytes(kind: str, streamed: float, optimizer: str = "adam", overlap: str = "none",
                    servers: int = 1, keep_grads: bool = True, widen: bool = True) -> float:
    """Bytes read + written per parameter (per 4 master bytes) of host copy `kind`
    (HOST_COPY_KINDS) with weights streamed at `streamed` bytes per element, as the runtime
    makes it under `overlap` (see RUNTIME_HOST_COPIES; 0 for a kind the mode does not make,
    and for every kind without an optimizer: nothing changes), with the overlap's `keep_grads`
    (False: no fp32 `.grad` under sync or async, `GRAD_COPIES`). "grad" is charged inside the
    fused pass at the optimizer's speed; the others at the host copies' speed.

    >>> [host_copy_bytes(k, 2) for k in HOST_COPY_KINDS], host_copy_bytes("handover", 4)
    ([6, 0, 6, 0, 0, 0], 0)
    >>> [host_copy_bytes(k, 2, overlap="sync") for k in HOST_COPY_KINDS]   # widened: the fp32 .grad read
    [0, 0, 0, 0, 0, 2]
    >>> [host_copy_bytes(k, 2, overlap="async") for k in HOST_COPY_KINDS]
    [0, 0, 0, 0, 0, 2]
    >>> [host_copy_bytes(k, 2, overlap="sync", widen=False) for k in HOST_COPY_KINDS]   # the pass writes .grad
    [0, 0, 0, 0, 0, 4]
    >>> [host_copy_bytes(k, 2, overlap="async", widen=False) for k in HOST_COPY_KINDS]
    [0, 0, 6, 0, 0, 2]
    >>> [host_copy_bytes(k, 2, overlap="async", keep_grads=False) for k in HOST_COPY_KINDS]
    [0, 0, 0, 0, 0, 0]
    >>> [host_copy_bytes(k, 4, overlap="sync") for k in HOST_COPY_KINDS]
    [0, 8, 0, 0, 0, 0]
    >>> [host_copy_bytes(k, 4, overlap="async") for k in HOST_COPY_KINDS]
    [8, 0, 0, 0, 8, 0]
    """
    if kind not in HOST_COPY_KINDS:
        raise MobiusError(f"unknown host copy {kind!r}; the host copies the simulator models are "
                          f"{', '.join(HOST_COPY_KINDS)}")
    if TOUCHED_BYTES.get(optimizer, 0) == 0:
        return 0
    fused = fused_pass(overlap, streamed, servers)
    made = (RUNTIME_HOST_COPIES_REDUCED.get(overlap, RUNTIME_HOST_COPIES[overlap]) if servers > 1
            else RUNTIME_HOST_COPIES[overlap])
    if kind not in made or (not keep_grads and kind in GRAD_COPIES.get(overlap, ())):
        return 0
    widened = widened_downloads(overlap, streamed, servers, keep_grads, widen)
    if kind == "grad":  # sync's pass writes the fp32 .grad; async's (and a widened one) reads it instead
        return (4 if overlap == "sync" and not widened else 4 - streamed) if fused else 0
    if kind in ("pin", "refresh"):
        return 0 if fused else 4 + streamed
    if kind == "handover":
        return 0 if streamed >= 4 or widened else streamed + 4
    if kind == "shadow":
        return 0 if fused else 8
    return {"finite_check": 4}[kind]


def optimizer_bytes_touched(optimizer: str) -> int:
    """Bytes read + written per parameter (per 4 master bytes) by one step of `optimizer` (adam: 28)."""
    try:
        return TOUCHED_BYTES[optimizer]
    except KeyError:
        raise MobiusError(f"unknown optimizer {optimizer!r}; use one of {', '.join(TOUCHED_BYTES)}") from None


# The planner's optimizer names (`CompileOptions.optimizer`, planning/host_memory.OPTIMIZERS) ->
# the bytes torch's step reads + writes per parameter with a 4-byte gradient: Adam/AdamW 28, SGD
# with momentum 20 (TOUCHED_BYTES' "sgd"), plain SGD 12 (read p, g; write p), none 0.
PLANNED_OPTIMIZERS = {"adamw": 28, "adam": 28, "sgd-momentum": 20, "sgd": 12, "none": 0}


@dataclass(frozen=True)
class HostPass:
    """The host's work per step as the planner's step model charges it (step_timeline.timeline,
    the MIP's host rows), in seconds per byte of a stage's weight gradients as streamed (G_k):
    G_k / s parameters (s = streamed bytes per element, one parameter per 4 master bytes), each
    `host_pass_bytes` (+ sync's fp32 `.grad`) at the optimizer's speed and the mode's host copies
    at the copies' speed, as the simulator charges them (`sim.tasks.cpu_optimizer`):

    - "sync": stage k's pass starts once its gradients are on the host (D_k) and the pass of the
      stage before it in landing order has ended, on the one optimizer worker:
      H_k = max(D_k, H_prev) + `per_byte` G_k; the step ends at max(pipeline, max_k H_k) (the
      MIP orders the stages k = S-1, ..., 0, as they usually land);
    - "async": the pass over all stages runs beside the pipeline from the start, and one thread
      converts each stage's downloads into the fp32 `.grad` once they landed, in the order the
      stages queued them as their backward ended (k = S-1, ..., 0; `after` per byte: keep_grads'
      hand-over, 0 without it): A_k = max(D_k, A_{k+1}) + `after` G_k; the step is
      max(pipeline, max_k A_k, `per_byte` x sum G_k);
    - "none": the hand-over and torch's step after the pipeline: pipeline + `per_byte` x sum G_k
      (the pinning before the next step's uploads, which delays them, is not modelled).
    `per_byte` 0 (no optimizer) charges nothing. D_k, when stage k's gradients are all on the host:
    the step model's `landings.shared_landings` (the downloads replayed beside the backward uploads
    they share links with); the MIP's rows read the download ends of `step_timeline` instead.
    """

    mode: str = "sync"
    per_byte: float = 0.0
    after: float = 0.0  # "async": seconds per gradient byte of the hand-over into .grad as stages land
    down_scale: float = 1.0  # the gradient downloads' bytes on the links per byte as streamed (`download_scale`)

    def __post_init__(self) -> None:
        if self.mode not in OVERLAP_MODES:
            raise MobiusError(f"HostPass mode {self.mode!r}; use one of {', '.join(map(repr, OVERLAP_MODES))}")
        if not 1.0 <= self.down_scale < math.inf:
            raise MobiusError(f"HostPass down_scale={self.down_scale!r}; give the gradient downloads' bytes per byte "
                              f"as streamed, >= 1 (2.0: bf16 gradients widened to fp32 on the GPUs)")
        for name in ("per_byte", "after"):
            if not 0 <= getattr(self, name) < math.inf:
                raise MobiusError(f"HostPass {name}={getattr(self, name)!r}; give seconds per gradient byte, "
                                  f"finite and >= 0")
        if self.after and self.mode != "async":
            raise MobiusError(f"HostPass after={self.after!r} under {self.mode!r}; only \"async\" hands over apart "
                              f"from its pass (the others' hand-over is in per_byte)")

    @staticmethod
    def of(topology: Any, stream_bytes: float, optimizer: str = "adamw", overlap: str = "sync",
           keep_grads: bool = True, widen: bool | None = None) -> "HostPass":
        """The pass of `optimizer` (a `PLANNED_OPTIMIZERS` name) under `overlap` with weights
        streamed at `stream_bytes` per element, with the overlap's `keep_grads` (the fp32 `.grad`
        written: OverlapOptimizer.keep_grads) and `widen` (None: `widen_fits(topology)`), at the speeds of `topology`'s measured host section
        (`HostFigures`: its optimizer's bytes/s unless DeepSpeed's, its host copies' bytes/s), else
        CPU_ADAM_BANDWIDTH and HOST_COPY_BANDWIDTH -- the simulator's defaults.

        >>> h = HostPass.of(None, 2, "adamw", "sync")   # widened downloads: 28 + the fp32 .grad read (2 B)
        >>> round(h.per_byte * 2 * 1e9 / (30 / CPU_ADAM_BANDWIDTH * 1e9), 12), h.down_scale
        (1.0, 2.0)
        >>> a = HostPass.of(None, 2, "adamw", "async", widen=False)   # 28 + 2 B beside, the 6 B hand-over
        >>> round(a.per_byte * 2 * CPU_ADAM_BANDWIDTH, 9), round(a.after * 2 * HOST_COPY_BANDWIDTH, 9)
        (30.0, 6.0)
        >>> HostPass.of(None, 2, "adamw", "async").after, HostPass.of(None, 2, "adamw", "async", keep_grads=False).after
        (0.0, 0.0)
        """
        if optimizer not in PLANNED_OPTIMIZERS:
            raise MobiusError(f"optimizer={optimizer!r}; the host pass models {', '.join(PLANNED_OPTIMIZERS)}")
        widen = widen_fits(topology) if widen is None else widen  # the plan's choice (`Plan.widen_downloads`)
        host = getattr(topology, "host", None)
        bw = CPU_ADAM_BANDWIDTH
        if host is not None and host.optimizer_bytes_per_s is not None and host.implementation != "deepspeed":
            bw = float(host.optimizer_bytes_per_s)
        copy_bw = HOST_COPY_BANDWIDTH
        if host is not None and host.host_copy_bytes_per_s is not None:
            copy_bw = float(host.host_copy_bytes_per_s)
        touched = PLANNED_OPTIMIZERS[optimizer]
        s = float(stream_bytes)
        down = download_scale(overlap, s, keep_grads=keep_grads, widen=widen) if touched else 1.0
        if not touched:
            return HostPass(overlap, 0.0)
        fused = fused_pass(overlap, s)
        step = touched - 4 + 2 * s if fused else touched
        step += host_copy_bytes("grad", s, "adam", overlap, keep_grads=keep_grads, widen=widen)

        def copy(kind: str) -> float:
            return host_copy_bytes(kind, s, "adam", overlap, keep_grads=keep_grads, widen=widen) / copy_bw

        # the copies on the host's critical path: sync's refresh (fp32), none's hand-over, async's
        # shadow (fp32) on the optimizer's worker; async's hand-over per stage as it lands, on its
        # own thread; the pinning ("pin") runs on the upload workers during the next pipeline, not
        # charged here
        if overlap == "async":
            return HostPass(overlap, (step / bw + copy("shadow")) / s, copy("handover") / s, down)
        copies = sum(copy(k) for k in ("refresh", "handover", "finite_check"))
        return HostPass(overlap, (step / bw + copies) / s, down_scale=down)

    def seconds(self, grad_bytes: float) -> float:
        """Seconds of the pass over a stage (or stages) with `grad_bytes` gradient bytes as streamed."""
        return grad_bytes * self.per_byte

    def end(self, makespan: float, grads: list[float], done: list[float]) -> float:
        """The step's end: the pipeline's `makespan` with this host work (stage k's streamed
        gradient bytes `grads[k]`, on the host at `done[k]`), as the class docstring says."""
        if self.per_byte <= 0:
            return makespan
        if self.mode == "async":
            return max([makespan, *self.ends(grads, done), self.seconds(sum(grads))])
        if self.mode == "none":
            return makespan + self.seconds(sum(grads))
        return max([makespan, *self.ends(grads, done)])

    def ends(self, grads: list[float], done: list[float]) -> list[float]:
        """Under "sync", H_k: when stage k's pass ends on the one worker, which steps the stages
        in the order their gradients land (`done`; ties: the later stage first), each as soon as
        it is free (k = 0 usually last); under "async", A_k: the hand-overs into `.grad`
        (`after` per byte) on one thread in the order the stages queued them, k = S-1, ..., 0
        (the runtime's FIFO); [] in "none" (and without an optimizer, or a hand-over). In
        landing order is also the order that ends soonest (a single machine with release times)."""
        per = self.per_byte if self.mode == "sync" else self.after if self.mode == "async" else 0.0
        if self.per_byte <= 0 or per <= 0:
            return []
        out, h = [0.0] * len(grads), 0.0
        order = range(len(grads) - 1, -1, -1) if self.mode == "async" else sorted(
            range(len(grads)), key=lambda k: (done[k], -k))
        for k in order:
            h = max(h, done[k]) + grads[k] * per
            out[k] = h
        return out
