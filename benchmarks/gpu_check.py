"""One script to run on a machine with an NVIDIA GPU: the GPU tests, the PCIe bandwidth, and a
GPT larger than its (artificial) GPU budget trained for a few steps, against the simulator.

What it does and prints, in order (every figure is computed in this run; each line says
whether it is [measured] on this machine, [simulated] by `mobius_fx.simulate`, [planned] by
the partitioner, counted by the runtime's books, or [assumed]):

1. `python -m pytest -q tests/gpu -o addopts=""` in a subprocess: passed / failed / skipped /
   errors counts (the whole output goes to OUT/pytest.txt, its tail is printed on failure).
2. Host <-> device bandwidth of every CUDA device, pinned host memory, each direction alone and
   both at once (median of `--copy-repeats` copies of `--copy-mib` MiB, timed with
   `torch.cuda.Event`), written as a topology JSON of this machine (`Topology.from_json` reads
   it; one root complex, each GPU on its own link with [h2d, d2h] GB/s and the duplex share
   measured with both directions busy) to `--topology-out`.
3. A nanoGPT-style `mobius_fx.zoo.GPT` of about `--params` parameters (default 3B; fp32 masters
   allocated on the CPU, nothing downloaded) with a cross-entropy loss, compiled with
   `mobius_fx.compile(..., dtype=torch.bfloat16)` onto `--gpus` pipeline GPUs of `--memory`
   each (far below the model's bf16 size; names beyond the CUDA device count share a device:
   gpu0 and gpu1 both on cuda:0 on a one-GPU machine, under one "switch" whose uplink is that
   device's measured link), trained `--steps` steps with AdamW on the CPU masters, once per
   schedule of `--schedules` (default mobius and roundpipe: `compile(schedule=)`), by
   `pipe.train_step` (the loss computed on the last GPU; `--loop eager` for `loss =
   pipe(...); loss.backward()`) with the optimizer under `pipe.overlap(opt, --overlap)` (default
   "sync"). Prints, per schedule:
   measured step time (median over the steps after the first) against the simulated step
   (`simulate(plan).step_time`: pipeline + CPU optimizer) and the measured forward+backward
   against the simulated `pipeline_time`; measured peak (the CUDA allocator's, `CudaAllocator.max_allocated`,
   per CUDA device, across the stages' peak resets) against the plan's peak (per pipeline GPU, the largest stage footprint
   with the weights and boundary activations of the stages around it on that GPU: the double
   buffer the planner budgets, `plan_gpu_peaks`),
   and the runtime books' peak; weight and gradient bytes moved in the last step
   (`pipe.transfer_stats(last_step=True)`) against the pipeline's schedule IR
   (`pipe.schedule_ir().bytes_moved()`) and the plan's IR. Each as a ratio measured / other.
4. The limits (benchmarks/gpu_limits.py): the same model resident on one GPU (fwd+bwd, bf16,
   when it fits: the compute limit) and the link bound (bytes moved each way / the measured
   bandwidth that way); Mobius's measured fwd+bwd and step as a ratio to both. The peer a user
   would pick instead, on the same GPU: the same model (the masters the GPT phase trained),
   batch and AdamW under PyTorch FSDP2 (`fully_shard` + `CPUOffloadPolicy`, one rank),
   `--steps` steps; its fwd+bwd, optimizer, step and GPU peak beside Mobius's (`--skip-peer`
   leaves it out). The host's own figures (the AdamW bytes/s of the GPT phase, the host copy
   bytes/s, the cores) go into the topology JSON's "host" section.

Without CUDA it prints that it found no GPU and what it would do, and exits 0.
`--dry-run` plans and simulates step 3 with assumed bandwidths (`--assume-gbps`) on the meta
device, no GPU needed; `--device virtual` runs step 3 for real on virtual GPUs (the CPU), a
smoke test of the measuring code for small `--params`.

    python benchmarks/gpu_check.py [--out DIR]                 # on the GPU machine (sized for < 5 min)
    python benchmarks/gpu_check.py --dry-run                   # anywhere: plan + simulate only
    python benchmarks/gpu_check.py --skip-tests --params 1e9 --steps 4 --memory 2GiB

Exit status: 0 when every phase ran and the GPU tests passed (or no GPU was found), 1 when a
phase failed or a GPU test failed. Figures also go to OUT/gpu_check.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # gpu_limits, cpu_optimizer

import mobius_fx  # noqa: E402
from mobius_fx import Topology  # noqa: E402
from mobius_fx.kinds import OVERLAP_MODES  # noqa: E402
from mobius_fx.runtime.memory_sources import CudaAllocator
from mobius_fx.topology.device_specs import DEVICE_SPECS  # noqa: E402
from mobius_fx.topology.links import GB  # noqa: E402
from mobius_fx.units import fmt_bytes, fmt_time, parse_bytes  # noqa: E402
from mobius_fx.zoo import GPT, GPTConfig  # noqa: E402

import cpu_optimizer  # noqa: E402
import gpu_limits  # noqa: E402
from gpu_limits import Limits, LinkBound  # noqa: E402

NO_GPU = "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False)"
HEAD_DIM = 128  # hidden = heads x 128, as GPT-3's larger models

# (product-name fragment, DeviceSpec preset), first match wins
_SPECS = (("h200", "h200"), ("3090 ti", "rtx3090ti"), ("3090", "rtx3090"), ("4090", "rtx4090"),
          ("v100", "v100-16gb"), ("a100", "a100-40gb-pcie"))


# ------------------------------------------------------------------- the model
class GPTWithLoss(nn.Module):
    """`mobius_fx.zoo.GPT` and its next-token cross-entropy: the pipeline returns the loss, so
    the logits (batch x seq x vocab) stay on the GPU that computes them."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(config)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx)  # (b, t, vocab)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def gpt_params(hidden: int, blocks: int, *, vocab: int, seq: int) -> int:
    """Parameters of `zoo.GPT` (tied head): embeddings, 12h^2 + 13h per block, the final norm."""
    return vocab * hidden + seq * hidden + blocks * (12 * hidden * hidden + 13 * hidden) + 2 * hidden


def gpt_config(params: float, *, vocab: int = 50257, seq: int = 1024, hidden: int | None = None,
               blocks: int | None = None) -> GPTConfig:
    """The GPT of about `params` parameters: hidden a multiple of 128 (heads of 128), blocks
    = hidden / 80 as GPT-3 2.7B (2560 x 32), the (hidden, blocks) nearest `params`. A given
    `hidden` or `blocks` is kept and the other chosen to come nearest `params`."""
    if not params > 0:
        raise ValueError(f"--params {params}: give a positive parameter count, e.g. 3e9")
    cands = []
    for h in ([hidden] if hidden else range(HEAD_DIM, 16385, HEAD_DIM)):
        if blocks:
            cands.append((h, blocks))
        elif hidden:  # the hidden size is given: as many blocks as the size asks
            cands += [(h, b) for b in range(1, 1025)]
        else:
            ideal = max(1, round(h / 80))
            cands += [(h, b) for b in {max(1, ideal - 1), ideal, ideal + 1}]
    h, b = min(cands, key=lambda hb: (abs(gpt_params(*hb, vocab=vocab, seq=seq) - params), hb))
    return GPTConfig(vocab=vocab, seq=seq, hidden=h, blocks=b, heads=max(1, h // HEAD_DIM), dropout=0.0)


def build_model(config: GPTConfig, *, batch: int, device: str, seed: int = 0):
    """(model, (idx, targets)) on `device` ("meta" to plan, "cpu" for the fp32 masters)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPTWithLoss(config)
    if device == "meta":
        idx = torch.zeros(batch, config.seq, dtype=torch.long, device="meta")
        return model, (idx, idx.clone())
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab, (batch, config.seq + 1), generator=g)
    return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


# -------------------------------------------------------------- topologies
@dataclass(frozen=True)
class LinkFigures:
    """One CUDA device's host link: bytes/s each way alone, and the share of each direction
    left while both are busy (None: not measured, the library's default applies)."""

    h2d: float
    d2h: float
    duplex: float | None = None


def _link(a: str, b: str, bw: LinkFigures) -> dict[str, Any]:
    down, up = bw.h2d / GB, bw.d2h / GB
    link: dict[str, Any] = {"a": a, "b": b, "kind": "pcie", "bandwidth_gbps": down if down == up else [down, up]}
    if bw.duplex is not None:
        link["duplex"] = min(1.0, max(0.5, float(bw.duplex)))
    return link


def machine_topology_dict(devices: Sequence[tuple[str, int]], links: Sequence[LinkFigures], *, spec: str,
                          name: str = "measured") -> dict[str, Any]:
    """This machine in the topology JSON schema (mobius_fx.topology.server): one root complex, CUDA
    device i as gpu{i} (index i, its total memory) on its own link with the measured figures.
    `devices`: (product name, total bytes) per CUDA device."""
    nodes: list[dict[str, Any]] = [{"name": "cpu0", "kind": "root_complex"}]
    nodes += [{"name": f"gpu{i}", "kind": "gpu", "index": i, "memory": int(mem), "spec": spec}
              for i, (_, mem) in enumerate(devices)]
    return {"name": name, "p2p": False, "nodes": nodes,
            "links": [_link("cpu0", f"gpu{i}", bw) for i, bw in enumerate(links)],
            "comment": "gpu_check.py: " + "; ".join(f"gpu{i} {prod}" for i, (prod, _) in enumerate(devices))}


def cuda_indices(gpus: int, count: int) -> list[int]:
    """The CUDA device of pipeline GPU i: i mod the device count (as mobius_fx.runtime.devices.make_devices)."""
    if gpus < 1 or count < 1:
        raise ValueError(f"gpus={gpus}, CUDA devices={count}: need at least one of each")
    return [i % count for i in range(gpus)]


def budget_topology_dict(gpus: int, memory: int, links: Sequence[LinkFigures], *, spec: str,
                         name: str = "gpu-check") -> dict[str, Any]:
    """`gpus` pipeline GPUs of `memory` bytes each, gpu i on CUDA device i mod len(links). The
    names sharing a device hang under one switch whose uplink is that device's link (the one
    physical link they share); a device with one name links it straight to the root complex."""
    where = cuda_indices(gpus, len(links))
    nodes: list[dict[str, Any]] = [{"name": "cpu0", "kind": "root_complex"}]
    out_links: list[dict[str, Any]] = []
    for dev, bw in enumerate(links):
        names = [f"gpu{i}" for i in range(gpus) if where[i] == dev]
        if not names:
            continue
        top = "cpu0"
        if len(names) > 1:
            top = f"sw{dev}"
            nodes.append({"name": top, "kind": "switch"})
            out_links.append(_link("cpu0", top, bw))
        out_links += [_link(top, n, bw) for n in names]
    nodes += [{"name": f"gpu{i}", "kind": "gpu", "index": i, "memory": int(memory), "spec": spec} for i in range(gpus)]
    return {"name": name, "p2p": False, "nodes": nodes, "links": out_links}


def spec_for(product: str) -> tuple[str, bool]:
    """(DeviceSpec preset, whether it was recognised) for a CUDA product name."""
    for key, preset in _SPECS:
        if key in product.lower():
            return preset, True
    return "h200", False


# ------------------------------------------------------------ reading the plan
def plan_gpu_peaks(plan: Any) -> dict[str, int]:
    """Per pipeline GPU, the plan's peak: the largest memory rule of the step model
    (`step_model.memory_rows`) on that GPU, each stage at its footprint (`Stage.peak_bytes`)
    with what the stages around it on the GPU hold meanwhile (weights, boundary activations)."""
    from mobius_fx.planning.step_memory import memory_rows

    m, by_gpu = plan.microbatches, {}
    for s in plan.stages:
        by_gpu.setdefault(s.gpu, []).append(s)
    out = {}
    for g, ss in by_gpu.items():
        peak = [int(s.peak_bytes) for s in ss]
        held = [s.param_bytes + m * (s.input_bytes + s.output_bytes) for s in ss]
        rows = memory_rows(peak, peak, held, [m * s.input_bytes for s in ss], 1)  # the stages of one GPU, in order
        out[g] = int(max(row for *_, row, _ in rows))
    return out


def ir_bytes(ir: Any, what: str, direction: str) -> int:
    """Bytes of `what` ("weight", "gradient", ...) in `direction` ("h2d", "d2h") a schedule IR
    moves per step, all GPUs (a tied weight's partial sent back up is "gradient" h2d)."""
    return sum(b for (_, w, d, _), (_, b) in ir.bytes_moved().items() if w == what and d == direction)


def logged_bytes(stats: dict[str, dict], kind: str) -> int:
    """Bytes of "kind direction" ("weight h2d") in `pipe.transfer_stats()`, all GPUs."""
    return sum(k.get(kind, {}).get("bytes", 0) for k in stats.values())


# ---------------------------------------------------------------- formatting
def fmt_params(n: float) -> str:
    """"2.65B", "124.4M", "235.4K"."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return f"{n:g}"


def ratio(measured: float | None, other: float | None) -> str:
    """"1.23x" (measured / other), or "n/a" when either is missing or the other is 0."""
    if measured is None or other is None or not other or math.isnan(measured) or math.isnan(other):
        return "n/a"
    return f"{measured / other:.2f}x"


def parse_pytest_summary(text: str) -> dict[str, int]:
    """Counts from pytest's last summary line ("3 passed, 1 failed, 2 skipped in 4.2s");
    every key present, 0 when absent."""
    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors", "xfailed", "xpassed")}
    summary = re.compile(r"\b(passed|failed|skipped|errors?|no tests ran)\b")
    lines = [ln for ln in text.strip().splitlines() if summary.search(ln)]
    if not lines:
        return counts
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", lines[-1]):
        key = "errors" if word.startswith("error") else word
        if key in counts:
            counts[key] += int(n)
    return counts


@dataclass
class PeakRow:
    """One CUDA device (or one virtual GPU): what it held at peak against the plan."""

    device: str
    names: tuple[str, ...]
    plan_bytes: int  # sum of the plan's peaks of the names on it
    budget_bytes: int  # sum of their budgets
    books_bytes: int  # sum of the runtime books' peaks of the names on it
    allocator_bytes: int | None = None  # torch.cuda.max_memory_allocated, less what was there before but the slot pool


@dataclass
class RunFigures:
    """What the GPT phase found; the simulated and planned figures always, the measured ones
    when it trained (`step_times` non-empty)."""

    config: GPTConfig
    params: int
    topology: str
    device: str
    plan_summary: str
    planned_step: float
    sim_pipeline: float
    sim_step: float
    sim_optimizer: float
    stages: int
    microbatches: int
    plan_peaks: dict[str, int]
    budgets: dict[str, int]
    bandwidth_source: str = "measured"
    step_times: list[float] = field(default_factory=list)
    pipeline_times: list[float] = field(default_factory=list)
    optimizer_times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    peaks: list[PeakRow] = field(default_factory=list)
    moved: dict[str, int] = field(default_factory=dict)  # "weight h2d", "gradient d2h": runtime's log
    ir: dict[str, int] = field(default_factory=dict)  # same keys: the pipeline's schedule IR
    plan_ir: dict[str, int] = field(default_factory=dict)  # same keys: the plan's schedule IR
    timings: dict[str, float] = field(default_factory=dict)
    note: str = ""  # how the measurement differs from what was simulated
    adamw: str = ""  # the AdamW kernel that stepped ("fused", "foreach", "for-loop")
    moved_by_device: dict[int, dict[str, int]] = field(default_factory=dict)  # CUDA device -> moved, as `moved`
    schedule: str = "mobius"  # compile(schedule=): the schedule the runtime ran
    loop: str = "train_step"  # "train_step" (pipe.train_step) or "eager" (loss = pipe(...); loss.backward())
    overlap: str = "none"  # pipe.overlap's mode ("none": opt.step() after backward)


def _median_after_first(xs: Sequence[float]) -> float | None:
    rest = list(xs[1:]) if len(xs) > 1 else list(xs)
    return statistics.median(rest) if rest else None


# What the planned figure counts, beside the simulated ones (a dry run prints them side by side)
_PLANNED = ("plan.step_time: the partitioner's model of the step under pipe.overlap's default 'sync': fwd+bwd, the "
            "stages' compute and the weight uploads it cannot hide, and the fused host passes that end after the GPUs "
            "(planning/host_step.HostPass)")


def format_run(r: RunFigures) -> str:
    """The GPT phase's lines, each figure labelled [measured], [simulated], [planned] or [books];
    without training (a dry run) the planned and simulated ones only."""
    c = r.config
    trained = bool(r.step_times)
    lines = [f"GPT: {fmt_params(r.params)} parameters (hidden {c.hidden}, {c.blocks} blocks, {c.heads} heads, vocab "
             f"{c.vocab}, seq {c.seq}), {fmt_bytes(2 * r.params)} in bf16, on {len(r.budgets)} pipeline GPUs of "
             f"{fmt_bytes(max(r.budgets.values()))} ({r.device}); bandwidths {r.bandwidth_source}; schedule "
             f"{r.schedule!r}, loop {r.loop}, overlap {r.overlap!r}",
             f"  [planned]   {r.plan_summary}"]
    if r.note:
        lines.append(f"  note: {r.note}")
    step, pipe = _median_after_first(r.step_times), _median_after_first(r.pipeline_times)
    opt = _median_after_first(r.optimizer_times)
    rows = [("step (fwd+bwd+AdamW)", step, r.sim_step, "simulate(plan).step_time: fwd+bwd below plus the host's "
             "work after it, the gradient hand-over, the CPU AdamW and the host copies around them"),
            ("fwd+bwd", pipe, r.sim_pipeline, "simulate(plan).pipeline_time: forward, backward and the gradient "
             "offload, each transfer on the links it shares with the others in flight; no optimizer"),
            ("opt.step() after backward", opt, r.sim_optimizer, "simulate(plan).optimizer_time: the host's work after the "
             "pipeline ends (the optimizer and hand-over not overlapped)")]
    if trained:
        timed = max(1, len(r.step_times) - 1)
        lines.append(f"  [measured]  losses {', '.join(f'{x:.4f}' for x in r.losses)}")
        lines.append(f"  time per step (measured: wall clock, after torch.cuda.synchronize on CUDA; median of the "
                     f"last {timed} of {len(r.step_times)} steps)")
        for what, meas, sim, src in rows:
            lines.append(f"    {what:<21} [measured] {fmt_time(meas):>9} vs [simulated] {fmt_time(sim):>9}  ratio "
                         f"{ratio(meas, sim):>6}  ({src})")
        lines.append(f"    {'fwd+bwd':<21} [measured] {fmt_time(pipe):>9} vs [planned]   {fmt_time(r.planned_step):>9}"
                     f"  ratio {ratio(pipe, r.planned_step):>6}  ({_PLANNED})")
    else:
        lines.append("  time per step")
        for what, _, sim, src in rows:
            lines.append(f"    {what:<21} [simulated] {fmt_time(sim):>9}  ({src})")
        lines.append(f"    {'fwd+bwd':<21} [planned]   {fmt_time(r.planned_step):>9}  ({_PLANNED})")
    lines.append("  peak GPU memory (plan: per pipeline GPU the largest of a stage's Stage.peak_bytes with the weights and "
                 "boundary activations of the stages around it on that GPU, the double buffer it is planned for "
                 "(step_model.memory_rows); summed over the GPUs sharing a device)")
    if trained:
        for p in r.peaks:
            alloc = (f"[measured] {fmt_bytes(p.allocator_bytes)} (max_memory_allocated less the bytes held before, "
                     f"the slot pool kept since compile counted in)"
                     if p.allocator_bytes is not None else "[measured] n/a (no CUDA allocator)")
            lines.append(f"    {p.device} ({', '.join(p.names)}): {alloc} vs [planned] {fmt_bytes(p.plan_bytes)}  "
                         f"ratio {ratio(p.allocator_bytes, p.plan_bytes)}; [books] {fmt_bytes(p.books_bytes)} "
                         f"(pipe.memory_stats peak)  ratio {ratio(p.books_bytes, p.plan_bytes)}; budget "
                         f"{fmt_bytes(p.budget_bytes)}")
    else:
        lines += [f"    {g}: [planned] {fmt_bytes(b)} of a {fmt_bytes(r.budgets[g])} budget"
                  for g, b in r.plan_peaks.items()]
    if trained:
        lines.append("  bytes moved in the last step (measured: the runtime's transfer log, pipe.transfer_stats("
                     "last_step=True); IR: pipe.schedule_ir().bytes_moved(); plan: plan.schedule())")
        for kind in ("weight h2d", "gradient d2h"):
            got, ir, pl = r.moved.get(kind), r.ir.get(kind), r.plan_ir.get(kind)
            lines.append(f"    {kind:<13} [measured] {_b(got):>11} vs [IR] {_b(ir):>11}  ratio {ratio(got, ir)}; "
                         f"vs [plan] {_b(pl):>11}  ratio {ratio(got, pl)}")
    else:
        lines.append("  bytes moved per step [planned] (plan.schedule()): "
                     + ", ".join(f"{k} {_b(v)}" for k, v in r.plan_ir.items()))
    if r.timings:
        lines.append("  phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in r.timings.items()))
    return "\n".join(lines)


def _b(n: int | None) -> str:
    return "n/a" if n is None else fmt_bytes(n)


def format_bandwidth(devices: Sequence[tuple[str, int]], links: Sequence[LinkFigures], *, mib: int,
                     repeats: int) -> str:
    lines = [f"host <-> device bandwidth [measured], pinned host memory, median of {repeats} copies of {mib} MiB:"]
    for i, ((prod, mem), bw) in enumerate(zip(devices, links)):
        duplex = "n/a" if bw.duplex is None else f"{bw.duplex:.2f}"
        lines.append(f"  cuda:{i} {prod} ({fmt_bytes(mem)}): h2d {bw.h2d / GB:.1f} GB/s, d2h {bw.d2h / GB:.1f} GB/s, "
                     f"both at once keep {duplex} of each")
    return "\n".join(lines)


# ------------------------------------------------------------ measuring (CUDA)
def measure_link(index: int, nbytes: int, repeats: int) -> LinkFigures:
    """Host <-> cuda:index over pinned memory: median bytes/s each way (torch.cuda.Event timed
    copies on a side stream) and the share each keeps when both run at once."""
    with torch.cuda.device(index):
        host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        dev = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}") for _ in range(2)]
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def timed(stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor,
                  start: torch.cuda.Event | None = None) -> tuple[torch.cuda.Event, torch.cuda.Event]:
            with torch.cuda.stream(stream):
                if start is None:
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                else:
                    stream.wait_event(start)
                dst.copy_(src, non_blocking=True)
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
            return start, end

        def seconds(pair: tuple[torch.cuda.Event, torch.cuda.Event]) -> float:
            pair[1].synchronize()
            return pair[0].elapsed_time(pair[1]) / 1e3

        torch.cuda.synchronize()
        for _ in range(2):  # warm up both directions
            seconds(timed(s1, dev[0], host[0]))
            seconds(timed(s1, host[1], dev[1]))
        h2d = statistics.median(nbytes / seconds(timed(s1, dev[0], host[0])) for _ in range(repeats))
        d2h = statistics.median(nbytes / seconds(timed(s1, host[1], dev[1])) for _ in range(repeats))
        shares = []
        for _ in range(repeats):
            a = timed(s1, dev[0], host[0])
            b = timed(s2, host[1], dev[1], start=a[0])
            shares.append(min(nbytes / seconds(a) / h2d, nbytes / seconds(b) / d2h))
        torch.cuda.synchronize()
    return LinkFigures(h2d=h2d, d2h=d2h, duplex=min(1.0, max(0.5, statistics.median(shares))))


def run_gpu_tests(out: Path, timeout: float) -> tuple[dict[str, int], int | None]:
    """`python -m pytest -q tests/gpu -o addopts=""`: its counts and exit code (None: timed out)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "tests/gpu", "-o", "addopts="]
    print(f"$ {' '.join(cmd[2:])}  (timeout {timeout:.0f} s)", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:  # its output so far (bytes on POSIX, whatever `text` says)
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        rc = None
    (out / "pytest.txt").write_text(text)
    counts = parse_pytest_summary(text)
    state = "timed out" if rc is None else f"exit {rc}"
    print(f"tests/gpu [measured]: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped, "
          f"{counts['errors']} errors ({state}, {time.perf_counter() - t0:.0f} s; output in {out / 'pytest.txt'})",
          flush=True)
    if rc not in (0, 5):
        print("  last lines:\n" + "\n".join("    " + ln for ln in text.strip().splitlines()[-40:]), flush=True)
    return counts, rc


# ------------------------------------------------------------------ the GPT run
def plan_only(args: argparse.Namespace, topo: Topology, *, bandwidth_source: str) -> RunFigures:
    """Plan the GPT on the meta device for `topo` and simulate it: nothing runs, no GPU needed."""
    config = gpt_config(args.params, vocab=args.vocab, seq=args.seq, hidden=args.hidden, blocks=args.blocks)
    model, inputs = build_model(config, batch=args.batch, device="meta")
    t0 = time.perf_counter()
    # compile's count (the GPT phase compiles with it), not the one plan() would choose by itself
    count = args.microbatches or max(d for d in range(1, len(topo.gpus) + 1) if args.batch % d == 0)
    plan = mobius_fx.plan(model, topo, example_inputs=inputs, microbatches=count, dtype=torch.bfloat16,
                          costs="model", time_limit=args.time_limit, verbose=False)
    return _figures(config, model, topo, plan, device="meta device, planned only", bandwidth_source=bandwidth_source,
                    timings={"plan": time.perf_counter() - t0}, note=sharing_note(cuda_indices(len(topo.gpus), 1)))


def sharing_note(where: Sequence[int], *, prefix: str = "cuda:") -> str:
    """What the simulator does not see when pipeline GPUs share a device (`where[i]`: GPU i's)."""
    shared = {d: [f"gpu{i}" for i, w in enumerate(where) if w == d] for d in sorted(set(where))}
    shared = {d: ns for d, ns in shared.items() if len(ns) > 1}
    if not shared:
        return ""
    names = "; ".join(f"{', '.join(ns)} share {prefix}{d}" for d, ns in shared.items())
    return (f"{names}: the simulator gives each pipeline GPU compute of its own (the shared link is modelled as a "
            f"switch uplink), so a measured time above the simulated one is expected where compute overlaps")


def _figures(config: GPTConfig, model: nn.Module, topo: Topology, plan: Any, *, device: str, bandwidth_source: str,
             timings: dict[str, float], note: str = "", schedule: str = "mobius", overlap: str = "none") -> RunFigures:
    sim = mobius_fx.simulate(plan, schedule=schedule, optimizer_overlap=overlap)
    plan_ir = plan.schedule()
    return RunFigures(
        config=config, params=sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
        topology=topo.name, device=device, plan_summary=plan.summary(), planned_step=plan.step_time,
        sim_pipeline=sim.pipeline_time, sim_step=sim.step_time, sim_optimizer=sim.optimizer_time,
        stages=plan.num_stages, microbatches=plan.microbatches, plan_peaks=plan_gpu_peaks(plan),
        budgets={g.name: g.memory for g in topo.gpus}, bandwidth_source=bandwidth_source,
        plan_ir={"weight h2d": ir_bytes(plan_ir, "weight", "h2d"), "gradient d2h": ir_bytes(plan_ir, "gradient", "d2h")},
        timings=timings, note=note, schedule=schedule, overlap=overlap)


def _adamw(params: list[nn.Parameter], kind: str, lr: float) -> torch.optim.Optimizer:
    if kind == "fused":
        try:
            return torch.optim.AdamW(params, lr=lr, fused=True)
        except (RuntimeError, ValueError, TypeError) as e:  # a torch without the fused CPU kernel
            print(f"  AdamW(fused=True) refused on the CPU ({e}); using foreach", flush=True)
            kind = "foreach"
    return torch.optim.AdamW(params, lr=lr, foreach=kind == "foreach")


def train_gpt(args: argparse.Namespace, topo: Topology, *, device: str, bandwidth_source: str,
              hand_back: dict[str, Any] | None = None, schedule: str = "mobius") -> RunFigures:
    """Build the GPT's fp32 masters on the CPU, compile it onto `topo` (`device`: "cuda" or
    "virtual") under `schedule`, train `args.steps` steps (`args.loop`: `pipe.train_step` or the
    eager-style loop; `args.overlap`: pipe.overlap's mode) and gather the measured, simulated and
    planned figures.
    With `hand_back`, the model (its masters, gradients freed) and inputs are put there once the
    pipeline and the optimizer are gone, for the peer to train without building them again."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    config = gpt_config(args.params, vocab=args.vocab, seq=args.seq, hidden=args.hidden, blocks=args.blocks)
    model, (idx, targets) = build_model(config, batch=args.batch, device="cpu", seed=args.seed)
    timings["build masters"] = time.perf_counter() - t0
    cuda = device == "cuda"
    names = [g.name for g in topo.gpus]
    # the CUDA device of each pipeline GPU; on virtual GPUs each name is a device of its own
    where = cuda_indices(len(names), torch.cuda.device_count()) if cuda else list(range(len(names)))
    target: Any = device
    if cuda and len(set(where)) < len(names):  # names share a CUDA device: hand compile the devices
        from mobius_fx.runtime.devices import make_devices

        target = make_devices({g.name: g.memory for g in topo.gpus}, device="cuda",
                              indices=dict(zip(names, where)))
    t0 = time.perf_counter()
    pipe = mobius_fx.compile(model, topo, example_inputs=(idx, targets), microbatches=args.microbatches,
                             dtype=torch.bfloat16, costs="model", time_limit=args.time_limit, device=target,
                             verbose=False, schedule=schedule)
    timings["compile"] = time.perf_counter() - t0
    fig = _figures(config, model, topo, pipe.plan, device=device, bandwidth_source=bandwidth_source, timings=timings,
                   note=sharing_note(where) if cuda else "virtual GPUs: every figure measured here describes the CPU",
                   schedule=schedule, overlap=args.overlap)
    fig.loop = args.loop
    opt = _adamw(list(model.parameters()), args.adamw, args.lr)
    fig.adamw = gpu_limits.adamw_kind(opt)
    if args.overlap != "none":
        opt = pipe.overlap(opt, args.overlap)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    base: dict[int, int] = {}
    if cuda:
        sync()
        for i in sorted(set(where)):
            base[i] = torch.cuda.memory_allocated(i)
            CudaAllocator.of(i).reset_max()  # the pipeline resets torch's peak at each stage's work
    pipe.reset_peak_memory_stats()
    t_steps = time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        if args.loop == "train_step":
            loss = pipe.train_step(idx, targets)  # the model's 0-dim output is the loss: computed on the last GPU
        else:
            loss = pipe(idx, targets)
            loss.backward()
        sync()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        fig.pipeline_times.append(t1 - t0)
        fig.optimizer_times.append(t2 - t1)
        fig.step_times.append(t2 - t0)
        fig.losses.append(float(loss.detach()))
        print(f"  step {step}: fwd+bwd {t1 - t0:.2f} s, opt.step() {t2 - t1:.2f} s, loss {fig.losses[-1]:.4f}", flush=True)
    timings["steps"] = time.perf_counter() - t_steps
    stats = pipe.transfer_stats(last_step=True)
    ir = pipe.schedule_ir()
    fig.moved = {"weight h2d": logged_bytes(stats, "weight h2d"), "gradient d2h": logged_bytes(stats, "gradient d2h")}
    fig.ir = {"weight h2d": ir_bytes(ir, "weight", "h2d"), "gradient d2h": ir_bytes(ir, "gradient", "d2h")}
    books = pipe.memory_stats()
    groups: dict[Any, list[str]] = {}
    for n, i in zip(names, where):
        groups.setdefault(i, []).append(n)
    for i, ns in groups.items():
        fig.moved_by_device[i] = {k: sum(stats[n].get(k, {}).get("bytes", 0) for n in ns)
                                  for k in ("weight h2d", "gradient d2h")}
        fig.peaks.append(PeakRow(
            device=f"cuda:{i}" if cuda else f"virtual {ns[0]}", names=tuple(ns),
            plan_bytes=sum(fig.plan_peaks.get(n, 0) for n in ns), budget_bytes=sum(fig.budgets[n] for n in ns),
            books_bytes=sum(books[n]["peak_bytes"] for n in ns),
            # the slot pools were allocated when compiled, so `base` holds them: count them in again
            allocator_bytes=(CudaAllocator.of(i).max_allocated() - base[i]
                             + sum(books[n].get("slot_pool_bytes", 0) for n in ns)) if cuda else None))
    if args.overlap != "none":
        opt.close()  # type: ignore[attr-defined]
    if hand_back is not None:
        del pipe, opt  # the slot pools and the AdamW state
        model.zero_grad(set_to_none=True)
        hand_back.update(model=model, inputs=(idx, targets))
    return fig


# ------------------------------------------------------------------ the limits
def device_link_bound(moved_by_device: dict[int, dict[str, int]], links: Sequence[LinkFigures]) -> LinkBound | None:
    """The link bound of a step (gpu_limits.link_bound): per CUDA device, the weight bytes it
    received and the gradient bytes it sent over its own link; the slowest device's. None when
    nothing was moved or no link is known."""
    bounds = [gpu_limits.link_bound(m.get("weight h2d", 0), m.get("gradient d2h", 0), links[i].h2d, links[i].d2h)
              for i, m in sorted(moved_by_device.items()) if i < len(links)]
    return max(bounds, key=lambda b: b.time, default=None)


def mobius_gpu_peak(fig: RunFigures) -> int | None:
    """The allocator's peak summed over the CUDA devices the pipeline used (None off CUDA)."""
    got = [p.allocator_bytes for p in fig.peaks]
    return sum(got) if got and all(b is not None for b in got) else None  # type: ignore[misc]


def format_limits(fig: RunFigures, lim: Limits) -> str:
    """gpu_limits.format_limits with this run's Mobius medians (none for a plan only)."""
    return gpu_limits.format_limits(
        lim, fwd_bwd=_median_after_first(fig.pipeline_times), step=_median_after_first(fig.step_times),
        optimizer=_median_after_first(fig.optimizer_times), gpu_peak=mobius_gpu_peak(fig),
        budget=sum(fig.budgets.values()) if fig.step_times else None, steps=len(fig.step_times),
        simulated=fig.sim_pipeline, label="Mobius" if fig.schedule == "mobius" else f"{fig.schedule} sched.")


def peer_reason(args: argparse.Namespace, where: str) -> str:
    """Why the peer does not run: --skip-peer, or `where` cannot run it."""
    return "--skip-peer" if args.skip_peer else where


def measure_host(args: argparse.Namespace, fig: RunFigures) -> gpu_limits.HostFigures:
    """The host section: the GPT phase's AdamW over its masters, the slowest host copy around a
    bf16-streamed step (cpu_optimizer.copy_speeds over --host-copy-params), the cores."""
    params = cpu_optimizer.gpt_like(args.host_copy_params, hidden=min(1024, max(16, int((args.host_copy_params / 12) ** 0.5))))
    copy = min(cpu_optimizer.copy_speeds(params, steps=3).values())
    del params
    if fig.overlap != "none":  # opt.step() timed only the tail the overlap left: time the fused pass itself
        fused = cpu_optimizer.sweep(args.host_copy_params, steps=3, threads=[torch.get_num_threads()],
                                    hidden=min(1024, max(16, int((args.host_copy_params / 12) ** 0.5))))
        if fused is not None:
            return dataclasses.replace(fused, host_copy_bytes_per_s=copy, cores=gpu_limits.cores())
    return gpu_limits.host_figures(params=fig.params, optimizer_times=fig.optimizer_times, implementation=fig.adamw,
                                   host_copy_bps=copy, cores=gpu_limits.cores())


def format_host_bound(figs: Sequence[RunFigures], host: gpu_limits.HostFigures) -> str:
    """Each run's measured step against max(its fwd+bwd, the host pass over its masters at the
    measured bytes/s): what an overlap that hides the host leaves (issue 38's bar: <= 1.2)."""
    bps = host.optimizer_bytes_per_s
    if not bps:
        return "step against max(fwd+bwd, host pass): n/a (no host pass speed measured)"
    lines = [f"step against max(fwd+bwd, host pass) [measured; host pass = 28 B a parameter / {bps / GB:.1f} GB/s]"]
    for f in figs:
        step, fb = _median_after_first(f.step_times), _median_after_first(f.pipeline_times)
        host_pass = 28 * f.params / bps
        bound = max(fb or 0.0, host_pass)
        lines.append(f"  {f.schedule:<18} step {fmt_time(step):>9}, fwd+bwd {fmt_time(fb):>9}, host pass "
                     f"{fmt_time(host_pass):>9}: step / max = {ratio(step, bound)} (overlap {f.overlap!r})")
    return "\n".join(lines)


def format_host(host: gpu_limits.HostFigures) -> str:
    opt = host.optimizer_bytes_per_s
    copy = host.host_copy_bytes_per_s
    return (f"host [measured]: {host.optimizer} ({host.implementation}) "
            f"{'n/a' if opt is None else f'{opt / GB:.1f} GB/s'} over the masters (28 B a parameter), slowest host "
            f"copy {'n/a' if copy is None else f'{copy / GB:.1f} GB/s'}, {host.cores} cores")


def write_topology(path: Path, machine: dict[str, Any], host: gpu_limits.HostFigures | None) -> Topology:
    """Write the machine's topology (with the host section when given) to `path`; checks that
    `Topology.from_json` reads it back equal."""
    topo = Topology.from_dict(machine).with_host(host)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(topo.to_json())
    back = Topology.from_json(path)
    if back != topo:  # pragma: no cover - a schema bug
        raise RuntimeError(f"{path}: Topology.from_json does not read back what was written")
    return topo


def limits_phase(args: argparse.Namespace, figs: Sequence[RunFigures], links: Sequence[LinkFigures],
                 kept: dict[str, Any], report: dict[str, Any]) -> bool:
    """On CUDA after the GPT phase: the resident model and the peer, measured once, and each
    schedule's run against them and its own link bound (the bytes it moved), printed and put in
    `report`; True when a part failed."""
    failed = False
    fig = figs[0]
    lim = Limits(link=device_link_bound(fig.moved_by_device, links),
                 why={"link": "the bandwidth phase failed"} if not links else {})
    t0 = time.perf_counter()
    try:
        lim.resident = gpu_limits.measure_resident(lambda: GPTWithLoss(fig.config), kept["inputs"], params=fig.params,
                                                   steps=args.steps)
    except Exception:
        failed = True
        lim.why["resident"] = "failed (traceback above)"
        print("resident phase FAILED:\n" + traceback.format_exc(), flush=True)
    report.setdefault("phase seconds", {})["resident"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if args.skip_peer:
        lim.why["peer"] = "--skip-peer"
    else:
        model = kept.pop("model")
        lim.peer, err = gpu_limits.run_peer_reported(model, list(model.gpt.h), kept["inputs"], steps=args.steps,
                                                      kind=fig.adamw or args.adamw, lr=args.lr)
        del model
        if lim.peer is None:
            failed = True
            lim.why["peer"] = "failed (traceback above)"
            print("peer phase FAILED:\n" + err, flush=True)
        report["phase seconds"]["peer"] = time.perf_counter() - t0
    report["limits"] = {}
    for f in figs:
        mine = dataclasses.replace(lim, link=device_link_bound(f.moved_by_device, links))
        print(f"schedule {f.schedule!r}:\n" + format_limits(f, mine), flush=True)
        report["limits"][f.schedule] = mine
    return failed


# -------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None,
                    help="directory for pytest.txt, gpu_check.json and the topology (default: $OUT if set, else a "
                         "new temporary directory)")
    ap.add_argument("--topology-out", default=None,
                    help="where to write the measured topology JSON (default: OUT/topology.json)")
    ap.add_argument("--dry-run", action="store_true",
                    help="plan and simulate the GPT on the meta device with assumed bandwidths (--assume-gbps); no "
                         "GPU, nothing measured")
    ap.add_argument("--device", choices=("cuda", "virtual"), default="cuda",
                    help="where the GPT trains: 'cuda' (default), or 'virtual' (GPUs played by the CPU, a smoke test "
                         "of the measuring code for a small --params; no tests, no bandwidth)")
    ap.add_argument("--skip-tests", action="store_true", help="do not run tests/gpu")
    ap.add_argument("--skip-peer", action="store_true",
                    help="do not run the peer (the same model under PyTorch FSDP2 with CPUOffloadPolicy)")
    ap.add_argument("--host-copy-params", type=float, default=64e6,
                    help="parameters of the timed host copies recorded in the topology's host section (default 64e6)")
    ap.add_argument("--pytest-timeout", type=float, default=180.0,
                    help="seconds tests/gpu may take before it is stopped and reported as timed out (default 180)")
    ap.add_argument("--copy-mib", type=int, default=256, help="MiB per timed host<->device copy (default 256)")
    ap.add_argument("--copy-repeats", type=int, default=5, help="timed copies per direction, median (default 5)")
    ap.add_argument("--params", type=float, default=3e9,
                    help="GPT size in parameters, e.g. 3e9 (default) or 1e9; sets hidden and blocks")
    ap.add_argument("--hidden", type=int, default=None, help="GPT hidden size (overrides the one --params picks)")
    ap.add_argument("--blocks", type=int, default=None, help="GPT blocks (overrides the count --params picks)")
    ap.add_argument("--vocab", type=int, default=50257, help="vocabulary size (default 50257, GPT-2's)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="micro-batches per step (default: the library's, one per pipeline GPU)")
    ap.add_argument("--gpus", type=int, default=2,
                    help="pipeline GPUs (default 2); GPU i runs on CUDA device i mod the device count, so on one GPU "
                         "they all share cuda:0")
    ap.add_argument("--memory", default="3GiB",
                    help="the artificial budget per pipeline GPU (default 3GiB; the default 3B model is 5.6 GiB in "
                         "bf16)")
    ap.add_argument("--spec", default="auto", choices=("auto", *sorted(DEVICE_SPECS)),
                    help="DeviceSpec for the cost model (default: guessed from the CUDA product name; h200 when "
                         "unknown, and said so)")
    ap.add_argument("--assume-gbps", type=float, default=50.0,
                    help="host<->device GB/s each way assumed by --dry-run and --device virtual (default 50, "
                         "about PCIe 5.0 x16)")
    ap.add_argument("--steps", type=int, default=3,
                    help="training steps (default 3); the first is left out of the medians")
    ap.add_argument("--adamw", choices=("fused", "foreach", "for-loop"), default="fused",
                    help="the CPU AdamW implementation (default fused, foreach where fused is refused)")
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="the partitioner's MIP budget, seconds (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and tokens (default 0)")
    ap.add_argument("--schedules", default="mobius,roundpipe", type=_schedules,
                    help="comma-separated schedules to compile and train, one run each (default mobius,roundpipe; "
                         "any runnable name of mobius_fx.schedules.names())")
    ap.add_argument("--loop", choices=("train_step", "eager"), default="train_step",
                    help="train_step (default: pipe.train_step runs forward, the loss on the last GPU and backward) "
                         "or eager (loss = pipe(...); loss.backward())")
    ap.add_argument("--overlap", choices=OVERLAP_MODES, default="sync",
                    help="pipe.overlap's mode for the CPU AdamW (default sync: exact, stages stepped during backward)")
    return ap


def _schedules(text: str) -> tuple[str, ...]:
    """--schedules: registered names the runtime can run, checked before anything is built."""
    from mobius_fx import schedules

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("give at least one schedule, e.g. mobius,roundpipe")
    for n in names:
        if n not in schedules.names():
            raise argparse.ArgumentTypeError(f"unknown schedule {n!r}; registered: {', '.join(schedules.names())}")
        if not schedules.get(n).runnable:
            raise argparse.ArgumentTypeError(f"schedule {n!r} runs in the simulator only ({schedules.get(n).refusal})")
    return names


def _out_dir(args: argparse.Namespace) -> Path:
    out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_check-"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def _plan_of_work(args: argparse.Namespace) -> str:
    config = gpt_config(args.params, vocab=args.vocab, seq=args.seq, hidden=args.hidden, blocks=args.blocks)
    n = gpt_params(config.hidden, config.blocks, vocab=config.vocab, seq=config.seq)
    return (f"On a GPU it would: (1) run tests/gpu with pytest and count passes and failures; (2) time pinned "
            f"host<->device copies of {args.copy_mib} MiB both ways and write them into a topology JSON; (3) train a "
            f"{fmt_params(n)}-parameter GPT (hidden {config.hidden}, {config.blocks} blocks; "
            f"{fmt_bytes(2 * n)} in bf16) on {args.gpus} pipeline GPUs of {args.memory} for {args.steps} steps under each "
            f"schedule of {', '.join(args.schedules)} ({args.loop}, overlap {args.overlap!r}) and "
            f"print measured step time, peak memory and bytes moved against the simulator, the plan and the schedule "
            f"IR; (4) time the same GPT resident on the GPU (the compute limit) and, unless --skip-peer, under PyTorch "
            f"FSDP2 with CPU offload (the peer), print each time against the compute limit and the link bound, and "
            f"write the host's figures (AdamW and host copy bytes/s, cores) into the topology JSON. Run with --dry-run "
            f"to plan and simulate that GPT here.")


def _json_default(x: Any) -> Any:
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return str(x)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    memory = parse_bytes(args.memory, "--memory")
    if args.steps < 1 or args.gpus < 1 or args.copy_mib < 1 or args.copy_repeats < 1:
        raise SystemExit("--steps, --gpus, --copy-mib and --copy-repeats must be at least 1")
    cuda = torch.cuda.is_available()
    assumed = LinkFigures(args.assume_gbps * GB, args.assume_gbps * GB)
    report: dict[str, Any] = {"argv": list(argv if argv is not None else sys.argv[1:])}

    if args.dry_run:
        spec = "h200" if args.spec == "auto" else args.spec
        topo = Topology.from_dict(budget_topology_dict(args.gpus, memory, [assumed], spec=spec, name="gpu-check-dry"))
        print(f"gpu_check --dry-run: planning and simulating only (no GPU used; {args.assume_gbps:g} GB/s each way "
              f"[assumed], spec {spec}, {args.gpus} pipeline GPUs of {fmt_bytes(memory)} on one device)", flush=True)
        fig = plan_only(args, topo, bandwidth_source=f"assumed {args.assume_gbps:g} GB/s")
        print(format_run(fig))
        lim = Limits(link=gpu_limits.link_bound(fig.plan_ir["weight h2d"], fig.plan_ir["gradient d2h"], assumed.h2d,
                                                assumed.d2h), link_source=f"planned, {args.assume_gbps:g} GB/s assumed",
                     why={"resident": "a dry run measures nothing", "peer": peer_reason(args, "a dry run runs nothing")})
        print(format_limits(fig, lim))
        return 0
    if args.device == "virtual":
        out = _out_dir(args)
        topo = Topology.from_dict(budget_topology_dict(args.gpus, memory, [assumed] * args.gpus, spec="cpu",
                                                       name="gpu-check-virtual"))
        print("gpu_check --device virtual: training on virtual GPUs (the CPU); measured figures describe the CPU",
              flush=True)
        figs, lims = [], {}
        for name in args.schedules:
            fig = train_gpt(args, topo, device="virtual", bandwidth_source=f"assumed {args.assume_gbps:g} GB/s",
                            schedule=name)
            print(format_run(fig))
            lim = Limits(link=device_link_bound(fig.moved_by_device, [assumed] * args.gpus),
                         link_source=f"{args.assume_gbps:g} GB/s assumed",
                         why={"resident": "virtual GPUs: no CUDA device to be resident on",
                              "peer": peer_reason(args, "virtual GPUs: FSDP2 with CPU offload needs a CUDA device")})
            print(format_limits(fig, lim))
            figs.append(fig)
            lims[name] = lim
        fig = figs[0]
        host = measure_host(args, fig)
        print(format_host(host))
        print(format_host_bound(figs, host))
        path = Path(args.topology_out) if args.topology_out else out / "topology.json"
        write_topology(path, budget_topology_dict(args.gpus, memory, [assumed] * args.gpus, spec="cpu",
                                                  name="gpu-check-virtual"), host)
        print(f"topology of the virtual GPUs (links assumed) with the host section written to {path}", flush=True)
        report.update(gpt={f.schedule: f for f in figs}, limits=lims, host=host.to_dict(), topology=str(path))
        (out / "gpu_check.json").write_text(json.dumps(report, default=_json_default, indent=1))
        return 0
    if not cuda:
        print(f"{NO_GPU}; torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}). Nothing measured; "
              f"exiting 0.", flush=True)
        print(_plan_of_work(args))
        return 0

    out = _out_dir(args)
    failed = False
    print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s): "
          + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) + f"; out {out}",
          flush=True)
    t_all = time.perf_counter()
    if not args.skip_tests:
        t0 = time.perf_counter()
        counts, rc = run_gpu_tests(out, args.pytest_timeout)
        report["tests"] = {**counts, "exit": rc}
        report.setdefault("phase seconds", {})["tests"] = time.perf_counter() - t0
        failed |= rc not in (0, 5)

    devices = [(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
               for i in range(torch.cuda.device_count())]
    spec, known = (args.spec, True) if args.spec != "auto" else spec_for(devices[0][0])
    if not known:
        print(f"  no DeviceSpec preset for {devices[0][0]!r}: assuming {spec}'s FLOP/s; pass --spec", flush=True)
    links: list[LinkFigures] = []
    try:
        links = [measure_link(i, args.copy_mib * 2**20, args.copy_repeats) for i in range(len(devices))]
        print(format_bandwidth(devices, links, mib=args.copy_mib, repeats=args.copy_repeats), flush=True)
        machine_dict = machine_topology_dict(devices, links, spec=spec)
        path = Path(args.topology_out) if args.topology_out else out / "topology.json"
        machine = write_topology(path, machine_dict, None)
        print(f"topology of this machine written to {path} (Topology.from_json reads it back equal; its host section "
              f"after the GPT phase):\n" + machine.tree(), flush=True)
        report["bandwidth"] = [dataclasses.asdict(b) for b in links]
        report["topology"] = str(path)
    except Exception:
        failed = True
        print("bandwidth phase FAILED:\n" + traceback.format_exc(), flush=True)
        links = [assumed] * len(devices)
        print(f"  the GPT phase assumes {args.assume_gbps:g} GB/s instead", flush=True)

    figs: list[RunFigures] = []
    kept: dict[str, Any] = {}  # the GPT's model and inputs, handed to the peer
    source = "measured" if "bandwidth" in report else f"assumed {args.assume_gbps:g} GB/s"
    topo = Topology.from_dict(budget_topology_dict(args.gpus, memory, links, spec=spec))
    print(f"GPT phase on {args.gpus} pipeline GPUs of {fmt_bytes(memory)} (topology {topo.name}):\n{topo.tree()}",
          flush=True)
    for k, name in enumerate(args.schedules):
        try:
            t0 = time.perf_counter()
            last = k == len(args.schedules) - 1
            fig = train_gpt(args, topo, device="cuda", bandwidth_source=source, hand_back=kept if last else None,
                            schedule=name)
            print(format_run(fig), flush=True)
            report.setdefault("gpt", {})[name] = fig
            report.setdefault("phase seconds", {})[f"gpt {name}"] = time.perf_counter() - t0
            figs.append(fig)
        except Exception:
            failed = True
            print(f"GPT phase under schedule {name!r} FAILED:\n" + traceback.format_exc(), flush=True)
    fig = figs[0] if figs else None
    if fig is not None:
        if "model" not in kept:  # the last schedule failed: the peer trains a model built again
            config = gpt_config(args.params, vocab=args.vocab, seq=args.seq, hidden=args.hidden, blocks=args.blocks)
            model, inputs = build_model(config, batch=args.batch, device="cpu", seed=args.seed)
            kept.update(model=model, inputs=inputs)
        try:
            failed |= limits_phase(args, figs, links if "bandwidth" in report else [], kept, report)
        except Exception:
            failed = True
            print("limits phase FAILED:\n" + traceback.format_exc(), flush=True)
        kept.clear()
        try:
            t0 = time.perf_counter()
            host = measure_host(args, fig)
            print(format_host(host), flush=True)
            print(format_host_bound(figs, host), flush=True)
            report["host"] = host.to_dict()
            if "topology" in report:
                write_topology(Path(report["topology"]), machine_dict, host)
                print(f"  host section written to {report['topology']} (read back equal)", flush=True)
            report["phase seconds"]["host"] = time.perf_counter() - t0
        except Exception:
            failed = True
            print("host phase FAILED:\n" + traceback.format_exc(), flush=True)
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in report.get("phase seconds", {}).items())
    print(f"gpu_check: {'FAILED' if failed else 'done'} in {time.perf_counter() - t_all:.0f} s"
          + (f" ({phases})" if phases else ""), flush=True)
    (out / "gpu_check.json").write_text(json.dumps(report, default=_json_default, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
