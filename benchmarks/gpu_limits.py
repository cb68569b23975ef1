"""The limits `gpu_check.py` holds a measured Mobius step to, and the peer a user would pick
instead, run on the same GPU in the same script.

Why: a step time alone says nothing; against what the hardware allows it says how far off it
is. Two limits bound the fwd+bwd of a model too large for its GPU budget:

- compute: the same model resident on one GPU (bf16 weights, forward + backward, no streaming)
  -- no pipeline can be faster than that (`measure_resident`, when the model fits the GPU);
- link: the bytes the step must move over the host link, each way, at the link's measured
  bandwidth (`link_bound`; both directions may run at once, so the bound is the slower one).

And the peer: the same model, batch and optimizer under PyTorch FSDP2 (`fully_shard` with
`CPUOffloadPolicy`, one rank: weights, gradients and the optimizer in CPU memory -- ZeRO-3
offload in PyTorch itself), `run_peer`; its step time and GPU peak beside Mobius's.

The CUDA parts (`measure_resident`, `run_peer`) need a GPU; everything they report goes through
the pure functions here (`link_bound`, `resident_fits`, `format_limits`, `host_figures`), which
tests/unit/test_gpu_check.py runs on the CPU.
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from mobius_fx.topology.links import GB
from mobius_fx.topology.schema import HostFigures
from mobius_fx.units import fmt_bytes, fmt_time

ADAMW_KINDS = ("fused", "foreach", "for-loop")


def median_after_first(xs: Sequence[float]) -> float | None:
    """The median of the steps after the first (its warm-up: allocator, kernels, page faults);
    the one step when there is only one; None for none."""
    rest = list(xs[1:]) if len(xs) > 1 else list(xs)
    return statistics.median(rest) if rest else None


def ratio(measured: float | None, other: float | None) -> str:
    """"1.23x" (measured / other), or "n/a" when either is missing or the other is 0."""
    if measured is None or other is None or not other or measured != measured or other != other:
        return "n/a"
    return f"{measured / other:.2f}x"


# ------------------------------------------------------------------ the link
@dataclass(frozen=True)
class LinkBound:
    """The link limit of a step: `h2d_bytes` at `h2d_bps` and `d2h_bytes` at `d2h_bps`."""

    h2d_bytes: int
    d2h_bytes: int
    h2d_bps: float
    d2h_bps: float

    @property
    def h2d_time(self) -> float:
        return self.h2d_bytes / self.h2d_bps

    @property
    def d2h_time(self) -> float:
        return self.d2h_bytes / self.d2h_bps

    @property
    def time(self) -> float:
        """The slower direction: both may run at once, so no step moves its bytes faster."""
        return max(self.h2d_time, self.d2h_time)


def link_bound(h2d_bytes: int, d2h_bytes: int, h2d_bps: float, d2h_bps: float) -> LinkBound:
    """The link bound of a step moving `h2d_bytes` to the GPU and `d2h_bytes` back, at the
    given bytes/s each way. Several pipeline GPUs on one CUDA device share its one link, so
    pass all their bytes with that link's figures."""
    if not (h2d_bps > 0 and d2h_bps > 0):
        raise ValueError(f"link bandwidths {h2d_bps!r} / {d2h_bps!r} bytes/s: both must be positive")
    if h2d_bytes < 0 or d2h_bytes < 0:
        raise ValueError(f"bytes moved {h2d_bytes!r} / {d2h_bytes!r}: cannot be negative")
    return LinkBound(int(h2d_bytes), int(d2h_bytes), float(h2d_bps), float(d2h_bps))


# ------------------------------------------------------------- the compute limit
@dataclass
class ResidentFigures:
    """The model resident on one GPU in bf16: fwd+bwd per step, the allocator's peak; or why not."""

    times: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    skipped: str = ""  # why it did not run ("does not fit ...")

    @property
    def time(self) -> float | None:
        return median_after_first(self.times)


def resident_fits(params: int, free_bytes: int) -> str:
    """"" when `params` bf16 weights and their bf16 gradients (4 bytes a parameter) fit in
    `free_bytes`, else why not; activations come on top, so a model that passes may still run
    out of memory (`measure_resident` reports that as well)."""
    need = 4 * params
    if need <= free_bytes:
        return ""
    return (f"does not fit: {fmt_bytes(need)} of bf16 weights and gradients alone, {fmt_bytes(free_bytes)} free on "
            f"the GPU")


def measure_resident(build: Callable[[], nn.Module], inputs: Sequence[torch.Tensor], *, params: int, steps: int,
                     device: str = "cuda", index: int = 0) -> ResidentFigures:
    """`build()` (called under `torch.device(cuda:index)` with bf16 as the default dtype, so the
    weights are made there in bf16) trained fwd+bwd `steps` times on `inputs` moved to the GPU;
    times after `torch.cuda.synchronize`. Out of memory is reported, not raised. `device="cpu"`
    runs the same loop on the CPU (a structure check where there is no GPU; no peak)."""
    cuda = device == "cuda"
    dev = torch.device("cuda", index) if cuda else torch.device("cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    sync()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        why = resident_fits(params, torch.cuda.mem_get_info(dev)[0])
        if why:
            return ResidentFigures(skipped=why)
    fig = ResidentFigures()
    model = None
    try:
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(dev):
                model = build()
        finally:
            torch.set_default_dtype(dtype)
        args = [t.to(dev) for t in inputs]
        base = torch.cuda.memory_allocated(dev) if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            model(*args).backward()
            sync()
            fig.times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        if cuda:  # the weights were there before the first step: count them in again
            fig.peak_bytes = torch.cuda.max_memory_allocated(dev) - base + sum(
                p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    except torch.OutOfMemoryError as e:
        fig.skipped = f"does not fit: out of memory ({str(e).splitlines()[0][:120]})"
    finally:
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return fig


# ---------------------------------------------------------------------- the peer
@dataclass
class PeerFigures:
    """PyTorch FSDP2 with CPU offload on one GPU: per step fwd+bwd and optimizer times, the
    allocator's peak, and the optimizer kernel that ran."""

    optimizer: str = ""
    pipeline_times: list[float] = field(default_factory=list)
    optimizer_times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def fwd_bwd(self) -> float | None:
        return median_after_first(self.pipeline_times)

    @property
    def step(self) -> float | None:
        return median_after_first([a + b for a, b in zip(self.pipeline_times, self.optimizer_times)])

    @property
    def opt(self) -> float | None:
        return median_after_first(self.optimizer_times)


PEER = ("PyTorch FSDP2 (fully_shard + CPUOffloadPolicy, one rank: weights, gradients and the optimizer in CPU "
        "memory, bf16 compute)")


def adamw(params: list[nn.Parameter], kind: str, lr: float) -> torch.optim.Optimizer:
    """torch AdamW of `kind` ("fused", "foreach", "for-loop")."""
    if kind not in ADAMW_KINDS:
        raise ValueError(f"AdamW kind {kind!r}; use one of {', '.join(ADAMW_KINDS)}")
    return torch.optim.AdamW(params, lr=lr, fused=True if kind == "fused" else None, foreach=kind == "foreach")


def adamw_kind(opt: torch.optim.Optimizer) -> str:
    """Which of ADAMW_KINDS an AdamW steps with."""
    d = opt.defaults
    return "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for-loop"


def run_peer(model: nn.Module, units: Sequence[nn.Module], inputs: Sequence[torch.Tensor], *, steps: int, kind: str,
             lr: float, device: str = "cuda", index: int = 0) -> PeerFigures:
    """Train `model` (fp32 on the CPU; `model(*inputs)` returns the loss) `steps` steps under FSDP2
    on cuda:index: each of `units` (the blocks) and then the root sharded with `CPUOffloadPolicy`
    (pinned), bf16 parameters and fp32 reduction, one rank (a file store, so no port is taken).
    AdamW of `kind` over the sharded (CPU) parameters, falling back along ADAMW_KINDS when torch
    refuses one for DTensor parameters, as the peer's user would. The model is sharded in place:
    it is not usable as a plain module afterwards. `device="cpu"` runs the same loop on the CPU
    without offload (nothing to offload to), which checks its structure where there is no GPU
    (tests/unit/test_gpu_check.py); its figures describe the CPU."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("the FSDP2 peer with CPU offload needs CUDA (torch.cuda.is_available() is False); pass "
                           "device='cpu' for a structure check")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialised; the peer runs as one rank "
                           "of a group of its own")
    dev = torch.device("cuda", index) if cuda else torch.device("cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    fig = PeerFigures()
    store = tempfile.NamedTemporaryFile(prefix="gpu_check-fsdp-", delete=False)
    store.close()
    os.unlink(store.name)  # the file store creates it
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=f"file://{store.name}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh(dev.type, (1,))
        kw: dict[str, Any] = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                            reduce_dtype=torch.float32))
        if cuda:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        t0 = time.perf_counter()
        for unit in units:
            fully_shard(unit, **kw)
        fully_shard(model, **kw)
        fig.notes.append(f"sharded in {time.perf_counter() - t0:.1f} s")
        args = [t.to(dev) for t in inputs]
        kinds = list(ADAMW_KINDS[ADAMW_KINDS.index(kind):])
        opt = None
        gc.collect()
        sync()
        base = torch.cuda.memory_allocated(dev) if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        for _ in range(steps):
            while opt is None:
                try:
                    opt = adamw(list(model.parameters()), kinds[0], lr)
                except (RuntimeError, ValueError, TypeError) as e:
                    fig.notes.append(f"AdamW({kinds.pop(0)}) refused: {str(e).splitlines()[0][:100]}")
                    if not kinds:
                        raise
            opt.zero_grad(set_to_none=True)
            sync()
            t0 = time.perf_counter()
            loss = model(*args)
            loss.backward()
            sync()
            t1 = time.perf_counter()
            while True:
                try:
                    opt.step()
                    break
                except (RuntimeError, ValueError, TypeError) as e:  # e.g. a fused kernel without DTensor support
                    fig.notes.append(f"AdamW({kinds.pop(0)}) failed at its step: {str(e).splitlines()[0][:100]}")
                    if not kinds:
                        raise
                    opt = adamw(list(model.parameters()), kinds[0], lr)
            sync()
            t2 = time.perf_counter()
            fig.pipeline_times.append(t1 - t0)
            fig.optimizer_times.append(t2 - t1)
            fig.losses.append(float(loss.detach()))
            print(f"  peer step {len(fig.losses) - 1}: fwd+bwd {t1 - t0:.2f} s, AdamW {t2 - t1:.2f} s, loss "
                  f"{fig.losses[-1]:.4f}", flush=True)
        fig.optimizer = f"AdamW({adamw_kind(opt)})" if opt is not None else ""
        fig.peak_bytes = torch.cuda.max_memory_allocated(dev) - base if cuda else None
        del opt
    finally:
        dist.destroy_process_group()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return fig


def run_peer_reported(*args: Any, **kw: Any) -> tuple[PeerFigures | None, str]:
    """`run_peer`, its failure turned into (None, the traceback's last lines)."""
    try:
        return run_peer(*args, **kw), ""
    except Exception:  # noqa: BLE001 - reported, and the run marked failed, by the caller
        return None, traceback.format_exc()


# ------------------------------------------------------------------- the host
def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_figures(*, params: int, optimizer_times: Sequence[float], implementation: str,
                 host_copy_bps: float | None, cores: int, touched: int = 28) -> HostFigures:
    """The host section of the topology JSON from a run: AdamW over `params` fp32 masters took
    `optimizer_times` (median after the first) at `touched` bytes a parameter (sim.tasks.
    TOUCHED_BYTES["adamw"])."""
    t = median_after_first(optimizer_times)
    return HostFigures(optimizer="adamw", implementation=implementation,
                       optimizer_bytes_per_s=touched * params / t if t else None,
                       host_copy_bytes_per_s=host_copy_bps, cores=cores)


# ----------------------------------------------------------------- formatting
@dataclass
class Limits:
    """What the limits phase found: each part None when not measured, and why in `why`."""

    resident: ResidentFigures | None = None
    link: LinkBound | None = None
    link_source: str = "measured"
    peer: PeerFigures | None = None
    why: dict[str, str] = field(default_factory=dict)  # "resident" / "peer" -> why it is missing


def format_limits(lim: Limits, *, fwd_bwd: float | None, step: float | None, optimizer: float | None,
                  gpu_peak: int | None, budget: int | None, steps: int, simulated: float | None = None,
                  label: str = "Mobius") -> str:
    """The limits and peer lines: each measured time of Mobius (and of the peer) as a ratio to the
    compute limit and to the link bound, then the peer beside Mobius. `fwd_bwd`, `step` and
    `optimizer` are Mobius's medians (None when not trained: a dry run); `simulated` the
    simulator's fwd+bwd, held to the same limits."""
    lines = ["  limits of this model and batch (fwd+bwd)"]
    res = lim.resident
    if res is not None and res.time is not None and not res.skipped:
        peak = f"; peak {fmt_bytes(res.peak_bytes)}" if res.peak_bytes is not None else ""
        lines.append(f"    compute: resident on one GPU, bf16 [measured] {_t(res.time):>9}  (median of the last "
                     f"{max(1, len(res.times) - 1)} of {len(res.times)} steps{peak})")
    else:
        why = (res.skipped if res is not None and res.skipped else lim.why.get("resident", "not measured"))
        lines.append(f"    compute: resident on one GPU, bf16: n/a ({why})")
    if lim.link is not None:
        lk = lim.link
        lines.append(f"    link: weights h2d {fmt_bytes(lk.h2d_bytes)} / {lk.h2d_bps / GB:.1f} GB/s = "
                     f"{_t(lk.h2d_time)}, gradients d2h {fmt_bytes(lk.d2h_bytes)} / {lk.d2h_bps / GB:.1f} GB/s"
                     f" = {_t(lk.d2h_time)}; bound [{lim.link_source}] {_t(lk.time)} (the slower way)")
    else:
        lines.append(f"    link: n/a ({lim.why.get('link', 'no bandwidth measured')})")
    compute = res.time if res is not None else None
    link = lim.link.time if lim.link is not None else None
    rows = [(f"{label} fwd+bwd [measured]", fwd_bwd), (f"{label} step [measured]", step),
            (f"{label} fwd+bwd [simulated]", simulated)]
    if lim.peer is not None:
        rows += [("FSDP2 fwd+bwd [measured]", lim.peer.fwd_bwd), ("FSDP2 step [measured]", lim.peer.step)]
    for what, t in rows:
        if t is not None:
            lines.append(f"    {what:<40} {_t(t):>9}  {ratio(t, compute):>7} the compute limit, {ratio(t, link):>7} "
                         f"the link bound")
    if lim.peer is None:
        lines.append(f"  the peer, {PEER}: not run ({lim.why.get('peer', 'not measured')})")
        return "\n".join(lines)
    p = lim.peer
    lines.append(f"  the peer, {PEER}, on the same GPU, model, batch and optimizer ({p.optimizer}; median of the last "
                 f"{max(1, steps - 1)} of {steps} steps each)")
    lines.append(f"    {'':<26} {'fwd+bwd':>9}  {'optimizer':>9}  {'step':>9}  GPU peak")
    budget_note = f" (budget {fmt_bytes(budget)})" if budget else ""
    lines.append(f"    {label:<26} {_t(fwd_bwd):>9}  {_t(optimizer):>9}  {_t(step):>9}  "
                 f"{fmt_bytes(gpu_peak) if gpu_peak is not None else 'n/a'}{budget_note}")
    lines.append(f"    {'FSDP2 offload':<26} {_t(p.fwd_bwd):>9}  {_t(p.opt):>9}  {_t(p.step):>9}  "
                 f"{fmt_bytes(p.peak_bytes) if p.peak_bytes is not None else 'n/a'}")
    lines.append(f"    {label + ' / FSDP2':<26} {ratio(fwd_bwd, p.fwd_bwd):>9}  {ratio(optimizer, p.opt):>9}  "
                 f"{ratio(step, p.step):>9}  {ratio(gpu_peak, p.peak_bytes)}")
    if p.notes:
        lines.append("    peer notes: " + "; ".join(p.notes))
    return "\n".join(lines)


def _t(seconds: float | None) -> str:
    return "n/a" if seconds is None else fmt_time(seconds)
