"""Every registered schedule on the training step of an 8B model, simulated (no GPU is used).

The step is planned with the loss on the last stage (`mobius_fx.plan(..., train_step=True)`, the
plan `pipe.train_step` runs: only the loss leaves the GPUs), so the table also shows whether
any logits cross a link (column "logits on links": the bytes of vocabulary-sized activations
any link carries; 0 is the goal). For each case and micro-batch count: each schedule's fwd+bwd,
its ratio to `plan.lower_bound()` (max(compute / GPUs, busiest link / its bandwidth)), the step
with the CPU optimizer under `--overlap` (default "async", RoundPipe's own), and tokens/s
= batch x seq / step. Beside them, RoundPipe's published figure for Llama-3.1-8B on 8 x RTX 4090
(24,275 tokens/s, its README; their hardware, their batch and sequence length, which its README
does not give here: compare orders of magnitude, not digits).

All figures are SIMULATED on the preset topology with modelled costs; none is measured.

    python benchmarks/schedules.py [--cases llama-8b,gpt3-8b] [--microbatches 8,16,32] [--overlap async]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

import mobius_fx  # noqa: E402
from mobius_fx import schedules, zoo  # noqa: E402
from mobius_fx.kinds import OVERLAP_MODES  # noqa: E402

CASES = {  # name -> (model, topology, batch, seq)
    "llama-8b": ("llama-8b", "rtx4090x8", 64, 1024),
    "gpt3-8b": ("gpt3-8b", "rtx4090x8", 32, 1024),
}
ROUNDPIPE_PUBLISHED = 24_275  # tokens/s, Llama-3.1-8B full fine-tuning, 8 x RTX 4090 (RoundPipe README)


def _logit_bytes(plan, vocab: int) -> int:
    """Bytes of the transfers whose per-micro-batch size is a multiple of the vocabulary's:
    the logits (or their gradient) leaving a stage."""
    total = 0
    for t in plan.transfers:  # t.bytes: one occurrence (one micro-batch's value), t.count per step
        if t.kind == "activation" and vocab and t.bytes and t.bytes % vocab == 0 and t.bytes >= vocab * 16:
            total += t.bytes * t.count
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="llama-8b,gpt3-8b")
    ap.add_argument("--microbatches", default="8,16,32")
    ap.add_argument("--overlap", default="async", choices=OVERLAP_MODES)
    ap.add_argument("--time-limit", type=float, default=20.0)
    args = ap.parse_args()
    rows, tokens_rows = [], []
    for case in args.cases.split(","):
        name, topo, batch, seq = CASES[case]
        for m in (int(x) for x in args.microbatches.split(",")):
            t0 = time.perf_counter()
            model, inputs = zoo.build(name, batch=batch, seq=seq, device="meta")
            vocab = zoo.named._vocab(model)
            plan = mobius_fx.plan(model, topo, example_inputs=inputs, microbatches=m, dtype=torch.float16,
                                  time_limit=args.time_limit, verbose=False, **zoo.step_arguments(model, inputs))
            lb = plan.lower_bound()
            logits = _logit_bytes(plan, vocab)
            print(f"[{case} m={m}] planned {plan.num_stages} stages in {time.perf_counter() - t0:.0f} s", flush=True)
            for sched in schedules.names():
                try:
                    r = mobius_fx.simulate(plan, schedule=sched, optimizer_overlap=args.overlap)
                except mobius_fx.MobiusError as e:
                    rows.append([case, m, sched, "does not fit", "", "", "", str(e).splitlines()[0][:70]])
                    continue
                tps = batch * seq / r.step_time
                rows.append([case, m, sched, f"{r.pipeline_time:.2f} s", f"{r.pipeline_time / lb:.2f}",
                             f"{r.step_time:.2f} s", f"{tps:,.0f}", f"logits on links: {logits} B"])
                if case == "llama-8b":
                    tokens_rows.append([f"{sched} (m={m})", f"{tps:,.0f}", "simulated, rtx4090x8 preset, "
                                        f"{batch}x{seq}"])
    print()
    print(tabulate(rows, headers=["case", "micro-batches", "schedule", "fwd+bwd", "/ lower bound", "step",
                                  "tokens/s", "note"]))
    if tokens_rows:
        tokens_rows.append(["RoundPipe (published)", f"{ROUNDPIPE_PUBLISHED:,}", "[published, their hardware]"])
        print()
        print("Llama-8B on 8 x RTX 4090, tokens/s (step = fwd+bwd + what the CPU optimizer adds under "
              f"--overlap {args.overlap}):")
        print(tabulate(tokens_rows, headers=["schedule", "tokens/s", "source"]))


if __name__ == "__main__":
    main()
