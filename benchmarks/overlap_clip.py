"""What a clipped loop costs under the sync overlap (docs/overlap_semantics.md).

One process, one compiled GPT pipeline (virtual GPUs on the CPU), three loops run in turn,
interleaved round by round so load from other processes falls on all alike:

- `none+clip`: the optimizer stepped serially after backward, `clip_grad_norm_(..., 1.0)` first;
- `sync+clip`: the same loop under `pipe.overlap(opt, "sync")`: gradients handed over during
  backward, the update at opt.step() after the clip (deferred, exact);
- `sync`: no clipping, stages stepped during backward (the overlap at its best).

Prints each loop's median step time (after the sync probe's first step) and its ratio to
`none+clip`. Timings on a shared machine are noise: re-run on a quiet one.

    python benchmarks/overlap_clip.py                       # hidden 256, 6 blocks, 4 GPUs
    python benchmarks/overlap_clip.py --hidden 512 --steps 8 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # runs from a checkout, uninstalled

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mobius_fx  # noqa: E402
from mobius_fx import Topology  # noqa: E402
from mobius_fx.zoo import GPT, GPTConfig  # noqa: E402

LOOPS = {"none+clip": ("none", True), "sync+clip": ("sync", True), "sync": ("sync", False)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per loop per round (after 2 untimed)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, seq=args.seq, hidden=args.hidden, blocks=args.blocks,
                          heads=max(1, args.hidden // 32)))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    topo = Topology.virtual(gpus=args.gpus, memory=2 * nbytes)
    x = torch.randint(0, 256, (args.batch, args.seq))
    pipe = mobius_fx.compile(model, topo, example_inputs=(x,), microbatches=args.microbatches, verbose=False)
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT hidden {args.hidden}, {args.blocks} blocks ({params / 1e6:.1f}M parameters), {args.gpus} virtual "
          f"GPUs, {pipe.plan.num_stages if hasattr(pipe.plan, 'num_stages') else '?'} stages; {args.rounds} rounds "
          f"x {args.steps} steps per loop; {len(os.sched_getaffinity(0))} cores", flush=True)
    times: dict[str, list[float]] = {k: [] for k in LOOPS}
    for r in range(args.rounds):
        order = list(LOOPS) if r % 2 == 0 else list(LOOPS)[::-1]
        for name in order:
            mode, clip = LOOPS[name]
            opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=1e-4), mode=mode)
            for t in range(2 + args.steps):
                t0 = time.perf_counter()
                F.cross_entropy(pipe(x).flatten(0, 1), x.flatten()).backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                if t >= 2:
                    times[name].append(time.perf_counter() - t0)
            print(f"round {r + 1}: {name:9s} median {statistics.median(times[name][-args.steps:]) * 1e3:7.1f} ms/step",
                  flush=True)
    base = statistics.median(times["none+clip"])
    print(f"{'loop':9s} {'median ms':>10s} {'/none+clip':>11s}")
    for name in LOOPS:
        med = statistics.median(times[name])
        print(f"{name:9s} {med * 1e3:10.1f} {med / base:11.3f}")


if __name__ == "__main__":
    main()
