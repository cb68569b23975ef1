"""What the memory books cost per training step: memory_books="ops" (a dispatch mode, Python on
every op of stage work) against "allocator" (each stage's work measured by the allocator, no
Python per op), on one pipeline, variants interleaved step by step, best of N.

A GPT (mobius_fx.zoo.GPT) on 2 pipeline GPUs (on CUDA: one per CUDA device, at most 2), AdamW
after backward. Per variant it prints the
best and median fwd+bwd wall time over the measured steps, the Python dispatch calls per step
(`Device.dispatch_calls`) and the largest stage peak measured (`Pipeline.stage_peaks()`).

    python benchmarks/memory_books.py                         # device="virtual-async", ~10M parameters
    python benchmarks/memory_books.py --device cuda --params 1e8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mobius_fx  # noqa: E402
from mobius_fx import Topology  # noqa: E402
from mobius_fx.kinds import DEVICES  # noqa: E402
from mobius_fx.zoo import GPT, GPTConfig  # noqa: E402


def _config(params: float) -> GPTConfig:
    blocks, vocab, hidden = 8, 4096, 64
    while 12 * blocks * (hidden + 64) ** 2 + vocab * (hidden + 64) <= params:
        hidden += 64
    return GPTConfig(vocab=vocab, seq=64, hidden=hidden, blocks=blocks, heads=max(1, hidden // 64), dropout=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=10e6, help="about how many parameters (default 1e7)")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per variant, after one warm-up step")
    ap.add_argument("--device", choices=[d for d in DEVICES if d != "auto"], default="virtual-async")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    pipes = {}
    for books in ("ops", "allocator"):
        torch.manual_seed(0)
        model = GPT(_config(args.params))
        x = torch.randint(0, model.config.vocab, (4, model.config.seq))
        nbytes = sum(p.numel() * 4 for p in model.parameters())
        gpus = 2 if args.device != "cuda" else min(2, torch.cuda.device_count())  # a virtual topology maps gpu i to cuda:i
        topo = Topology.virtual(gpus=gpus, memory=nbytes + 2**26)
        pipe = mobius_fx.compile(model, topo, example_inputs=(x,), microbatches=2, device=args.device,
                                 memory_books=books, verbose=False)
        pipes[books] = (pipe, model, torch.optim.AdamW(model.parameters(), lr=1e-4), x)
    n = sum(p.numel() for p in pipes["ops"][1].parameters())
    times: dict[str, list[float]] = {b: [] for b in pipes}
    calls: dict[str, list[int]] = {b: [] for b in pipes}
    for step in range(args.steps + 1):
        for books, (pipe, model, opt, x) in pipes.items():  # interleaved: the same noise for both
            devs = list(pipe.devices.values())
            d0 = sum(d.dispatch_calls for d in devs)
            opt.zero_grad(set_to_none=True)
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = F.cross_entropy(pipe(x).flatten(0, 1).float(), x.flatten())
            loss.backward()
            if args.device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            opt.step()
            if step:  # the first step makes the streamed copies
                times[books].append(wall)
                calls[books].append(sum(d.dispatch_calls for d in devs) - d0)
    print(f"{n / 1e6:.1f}M parameters, device={args.device!r}, {args.steps} steps each, interleaved")
    for books, (pipe, *_rest) in pipes.items():
        print(f"  memory_books={books!r:12s} fwd+bwd best {min(times[books]):.3f} s, median "
              f"{statistics.median(times[books]):.3f} s; dispatch calls per step {max(calls[books])}; largest "
              f"stage peak {max(pipe.stage_peaks()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
