"""The host's work outside the optimizer, per step (issue 27): before and after, next to the ideal.

A GPT (mobius_fx.zoo.GPT, ~100M parameters by default) fine-tuned through a pipeline on
`device="virtual-async"` (the CUDA path's streams, events and slot pool on the CPU), AdamW
stepped by `pipe.overlap(mode="sync")`. Per step it prints, from the runtime's own counters
(mobius_fx/runtime/host_counters.py):

- host bytes per parameter read and written by passes outside the optimizer: pinned copies of
  the masters into the streamed copies, gradient conversions, fresh gradient memory, additions
  into `.grad`, gradients read for a non-finite value; shown apart, beside the optimizer: the
  copies its worker writes right after a stage's step (`refresh`) and the gradients converted
  into `.grad` span by span inside the stage's step (`grad_fused`: the fp32 `.grad` torch users
  read after backward, written while the optimizer reads it from cache);
- Python dispatch calls of the memory books (`Device.dispatch_calls`: one per op of stage work);
- the main thread's blocking waits (`StreamDevice.waits`).

"before" is the behaviour before issue 27 (every master copied at its first upload of every
step, no refresh, a new fp32 gradient per master per step converted in a pass of its own, every
gradient read on the host for a non-finite value); "spans" the issue-27 path (gradients converted
span by span inside the stage's step, the streamed copy refreshed by a pass of its own after it:
the fused host pass off, `overlap.HOST_PASS = False`); "after" the defaults now: the GPUs widen
each gradient to fp32 and download it straight into its `.grad` (`Runtime.widens_gradients`), and
the fused host pass (mobius_fx/runtime/host_optimizer.py) steps each parameter in one pass that
reads that fp32 `.grad` (`grad_read`: 2 B more than the bf16 download) and writes the streamed
copy; "bf16 dl" the same with `opt.widen_downloads = False` (bf16 downloads: sync's pass reads
them and writes the fp32 `.grad`, `grad_fused`; async converts them into `.grad` on the adder
thread, `grad_convert`, and its pass reads that). The ideal is 0 bytes outside the
optimizer; "no .grad" the same with `opt.keep_grads = False` (the pass writes no fp32 `.grad`:
for loops that do not read it after backward). The row "total" is the bytes touched per
parameter per step: the optimizer's own 28 (AdamW) + outside + beside, ideally 28. Under
`--mode async` the same pass steps each parameter into its shadow (overlap.py): "before" and
"spans" are the path before it (w(t) copied into the shadow -- `shadow` -- and torch's step over
it), "after" reads the fp32 `.grad` the GPUs widened (`grad_read`: its 2 extra bytes), "bf16 dl"
the one converted as each stage's gradients complete, "no .grad" reads the bf16 downloads
themselves.

The tied embedding (`wte`, used again as the LM head: held by two stages, so two partial
gradients; ~4% of the parameters at the default size): "after" sums them on the GPU of the stage
holding it first (the head's partial downloaded bf16 and sent back up: runtime/tied_sums.py) and
downloads the sum widened into `.grad`, like every other gradient; with bf16 downloads ("bf16 dl")
sync's pass reads both and sums them as it steps (`grad_fused`: the second download read + its fp32
`.grad` written, 6 B per parameter of it) and async's hand-over sums them into `.grad` in one pass
(`grad_convert`: read 2 + 2, write 4); "no .grad" reads both in the pass (2 B). One streamed copy
per master, which both GPUs upload.

    python benchmarks/host_path.py                  # ~100M parameters, bf16 streamed, 3 steps (async: 5)
    python benchmarks/host_path.py --params 5e6 --steps 4 --dtype fp32
    python benchmarks/host_path.py --mode async     # the async overlap (RoundPipe's staleness-1 update)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mobius_fx  # noqa: E402
from mobius_fx import Topology  # noqa: E402
from mobius_fx.kinds import OVERLAP_MODES  # noqa: E402
from mobius_fx.runtime import overlap  # noqa: E402
from mobius_fx.runtime.host_counters import BESIDE, COUNTERS, HostCounters  # noqa: E402
from mobius_fx.zoo import GPT, GPTConfig  # noqa: E402


def _config(params: float) -> GPTConfig:
    """A GPT of about `params` parameters: 12 blocks (12 h^2 each) and a 4096-token vocabulary."""
    blocks, vocab = 8, 4096
    hidden = 64
    while 12 * blocks * (hidden + 64) ** 2 + vocab * (hidden + 64) <= params:
        hidden += 64
    return GPTConfig(vocab=vocab, seq=64, hidden=hidden, blocks=blocks, heads=max(1, hidden // 64), dropout=0.0)


def run(label: str, params: float, steps: int, dtype: torch.dtype | None, before: bool, host_pass: bool = True,
        mode: str = "sync", keep_grads: bool = True, widen: bool = True) -> list[dict]:
    overlap.HOST_PASS = host_pass and not before
    torch.manual_seed(0)
    model = GPT(_config(params))
    n = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, model.config.vocab, (4, model.config.seq))
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    topo = Topology.virtual(gpus=2, memory=nbytes + 2**26)
    pipe = mobius_fx.compile(model, topo, example_inputs=(x,), microbatches=2, device="virtual-async",
                             dtype=dtype, verbose=False)
    devs = list(pipe.devices.values())
    if before:  # the behaviour before issue 27
        for d in devs:
            d.trust_versions = False
        pipe._rt.grad_homes = None
    opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=1e-4), mode=mode, refresh_copies=not before)
    opt.fuse = not before  # before: whole gradients converted, then read on the host, then stepped
    opt.keep_grads = keep_grads  # False: no fp32 .grad written by the fused host pass (overlap.py)
    opt.widen_downloads = widen  # False: bf16 gradient downloads, converted into .grad on the host
    rows = []
    for step in range(steps):
        c0 = COUNTERS.snapshot()
        d0 = sum(d.dispatch_calls for d in devs)
        t0 = time.perf_counter()
        logits = pipe(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        wall = time.perf_counter() - t0
        c = HostCounters.since(c0, COUNTERS.snapshot())
        rows.append({"step": step, "params": n, "outside": HostCounters.outside_optimizer(c) / n,
                     "refresh": c["refresh"] / n, "fused": c["grad_fused"] / n, "read": c["grad_read"] / n,
                     "beside": HostCounters.beside_optimizer(c) / n, "counts": c,
                     "dispatch": sum(d.dispatch_calls for d in devs) - d0,
                     "waits": sum(d.waits.count() for d in devs), "wall": wall})
        print(f"{label:6s} step {step}: outside the optimizer {rows[-1]['outside']:5.2f} B/param "
              f"({', '.join(f'{k} {v / n:.2f}' for k, v in c.items() if v and k not in BESIDE) or 'nothing'}), "
              f"beside it (refresh {rows[-1]['refresh']:.2f}, grad_fused {rows[-1]['fused']:.2f}, "
              f"grad_read {rows[-1]['read']:.2f}) B/param, "
              f"dispatch calls {rows[-1]['dispatch']}, "
              f"main-thread waits {rows[-1]['waits']}, {wall:.2f} s", flush=True)
    opt.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=100e6, help="about how many parameters (default 1e8)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per run (default 3 for sync, whose first step runs serially: its probe; 5 for async, "
                         "whose first update makes the state and whose pass's copies are uploaded two steps later)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="the streamed dtype")
    ap.add_argument("--mode", choices=[m for m in OVERLAP_MODES if m != "none"], default="sync",
                    help="the overlap mode (default sync)")
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 5 if args.mode == "async" else 3
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    runs = (("before", True, False, True, False), ("spans", False, False, True, False),
            ("bf16 dl", False, True, True, False), ("after", False, True, True, True),
            ("no .grad", False, True, False, True))
    results = {label: run(label, args.params, args.steps, dtype, before, host_pass, args.mode, keep, widen)
               for label, before, host_pass, keep, widen in runs}
    last = {k: v[-1] for k, v in results.items()}
    labels = [label for label, *_ in runs]
    print(f"\nsteady state (step {args.steps - 1}), {last['after']['params'] / 1e6:.1f}M parameters, "
          f"{args.dtype} streamed, mode={args.mode}, bytes per parameter per step:")
    print(f"{'':28s}{'ideal':>10s}" + "".join(f"{k:>10s}" for k in labels))

    def row(name: str, ideal: str, key: str, fmt: str = ">10.2f") -> None:
        print(f"{name:28s}{ideal:>10s}" + "".join(f"{last[k][key]:{fmt}}" for k in labels))

    row("outside the optimizer", "0.00", "outside")
    row("beside it: refresh", "-", "refresh")
    row("beside it: grad_fused", "-", "fused")
    row("beside it: grad_read", "-", "read")
    for k in labels:
        last[k]["total"] = 28 + last[k]["outside"] + last[k]["beside"]
    row("total (28 + the above)", "28.00", "total")
    row("dispatch calls", "-", "dispatch", ">10d")
    row("main-thread waits", "0", "waits", ">10d")
    row("step wall time (s)", "-", "wall")
    if args.mode == "async":
        print("async: 'before' and 'spans' are today's path before the pass (the downloads converted into a new "
              "(before) or kept (spans) fp32 .grad, w(t) copied into the shadow: 'shadow', torch's step reading the "
              "fp32 .grad: +2 B not counted there, the copy pinned again at upload); 'after' the pass reading the "
              "fp32 .grad the GPUs widened (keep_grads, the default: 'grad_read' is its +2 B); 'bf16 dl' the one "
              "converted as each stage completes; "
              "'no .grad' "
              "the pass reading the bf16 downloads themselves")

if __name__ == "__main__":
    main()
