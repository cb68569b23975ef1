"""What a clipped loop costs under the sync overlap (docs/overlap_semantics.md).

One process, one compiled GPT pipeline (bf16, virtual GPUs with streams on the CPU:
device="virtual-async", so the fused host pass steps the stages), the loops run in turn,
interleaved round by round so load from other processes falls on all alike:

- `none+clip`: the optimizer stepped serially after backward, `clip_grad_norm_` first;
- `defer+clip`: the same loop under `pipe.overlap(opt, "sync")` with `opt.speculate = False`:
  gradients handed over during backward, the update at opt.step() after the clip (exact);
- `spec+commit`: the same under "sync" as it is by default: stages stepped speculatively during
  backward, out of place; `max_norm` large (the clip factor is 1.0), so opt.step() commits them;
- `spec+rollback`: the same with `max_norm` tiny: every step clips, opt.step() rolls back and steps
  from the clipped gradients (the worst case of speculation);
- `sync`: no clipping, stages stepped during backward (the overlap at its best);
- `none+scaler`, `defer+scaler`, `spec+scaler`: the GradScaler loop (`scaler.scale(loss).backward();
  scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt); scaler.update()`, `max_norm` large)
  serially, deferred (`opt.speculate = False`) and speculated (the pass unscales the download by the
  scaler's inverse scale; opt.step() compares every `.grad` with it and commits).

Prints each loop's median step time (after the sync probe's first step), its ratio to
`none+clip` and to `sync`, and how many parameters the last step committed or rolled back.
Timings on a shared machine are noise: re-run on a quiet one.

    python benchmarks/overlap_clip.py                       # hidden 256, 6 blocks, 4 GPUs
    python benchmarks/overlap_clip.py --hidden 512 --steps 8 --rounds 3
    python benchmarks/overlap_clip.py --dtype fp16          # the streamed dtype (GradScaler's usual one)
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

# loop -> (overlap mode, max_norm or None for no clipping, speculate, GradScaler)
LOOPS = {"none+clip": ("none", 1e6, True, False), "defer+clip": ("sync", 1e6, False, False),
         "spec+commit": ("sync", 1e6, True, False), "spec+rollback": ("sync", 1e-6, True, False),
         "sync": ("sync", None, True, False), "none+scaler": ("none", 1e6, True, True),
         "defer+scaler": ("sync", 1e6, False, True), "spec+scaler": ("sync", 1e6, True, True)}


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
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="the streamed dtype")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, seq=args.seq, hidden=args.hidden, blocks=args.blocks,
                          heads=max(1, args.hidden // 32)))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    topo = Topology.virtual(gpus=args.gpus, memory=2 * nbytes)
    x = torch.randint(0, 256, (args.batch, args.seq))
    pipe = mobius_fx.compile(model, topo, example_inputs=(x,), microbatches=args.microbatches, verbose=False,
                             device="virtual-async",
                             dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float16)
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT hidden {args.hidden}, {args.blocks} blocks ({params / 1e6:.1f}M parameters), {args.gpus} virtual "
          f"GPUs, {pipe.plan.num_stages if hasattr(pipe.plan, 'num_stages') else '?'} stages; {args.rounds} rounds "
          f"x {args.steps} steps per loop; {len(os.sched_getaffinity(0))} cores", flush=True)
    times: dict[str, list[float]] = {k: [] for k in LOOPS}
    outcome: dict[str, tuple[int, int]] = {}
    for r in range(args.rounds):
        order = list(LOOPS) if r % 2 == 0 else list(LOOPS)[::-1]
        for name in order:
            mode, max_norm, speculate, scaled = LOOPS[name]
            opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), mode=mode)
            if mode == "sync":
                opt.speculate = speculate
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaled else None
            for t in range(2 + args.steps):
                t0 = time.perf_counter()
                loss = F.cross_entropy(pipe(x).flatten(0, 1).float(), x.flatten())
                (loss if scaler is None else scaler.scale(loss)).backward()
                if scaler is not None:
                    scaler.unscale_(opt)
                if max_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()
                if t >= 2:
                    times[name].append(time.perf_counter() - t0)
            outcome[name] = (getattr(opt, "committed", 0), getattr(opt, "rolled_back", 0))
            print(f"round {r + 1}: {name:13s} median {statistics.median(times[name][-args.steps:]) * 1e3:7.1f} ms/step",
                  flush=True)
    base, best = statistics.median(times["none+clip"]), statistics.median(times["sync"])
    scaled_base = statistics.median(times["none+scaler"])
    print(f"{'loop':13s} {'median ms':>10s} {'/none+clip':>11s} {'/sync':>7s} {'/none+scaler':>13s} {'committed':>10s} "
          f"{'rolled back':>12s}")
    for name in LOOPS:
        med = statistics.median(times[name])
        print(f"{name:13s} {med * 1e3:10.1f} {med / base:11.3f} {med / best:7.3f} {med / scaled_base:13.3f} "
              f"{outcome[name][0]:10d} {outcome[name][1]:12d}")


if __name__ == "__main__":
    main()
