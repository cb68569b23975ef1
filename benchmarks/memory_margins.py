"""The plan's predicted peak per stage against what the books measure, over the zoo's training cases.

Each model of `mobius_fx.zoo.training_cases()` (the cases `tests/unit/test_books.py` checks) is
compiled (`mobius_fx.compile`) on 2 virtual GPUs, twice: with a tight budget (twice its weights
+ 1 MiB) and a roomy one (64 MiB), so the planner picks different cuts;
one training step runs and each stage's measured peak (`Pipeline.stage_peaks()`: the most its
GPU's books held while it worked, less what the GPU held for other stages) is compared with
`plan.stages[k].peak_bytes`. The README quotes min / median / max of predicted / measured.

    python benchmarks/memory_margins.py            # fp32
    python benchmarks/memory_margins.py --bf16     # weights and activations streamed in bf16
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

import mobius_fx  # noqa: E402
from mobius_fx import Topology  # noqa: E402
from mobius_fx.zoo import training_cases  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if args.bf16 else None
    ratios = []
    for name, model0, inputs, kwargs, loss, m in training_cases():
        weights = sum(p.numel() * 4 for p in model0.parameters())
        for memory in (2 * weights + 2**20, 64 * 2**20):
            model = copy.deepcopy(model0)
            try:
                pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory=memory), example_inputs=inputs,
                                         example_kwargs=kwargs, microbatches=m, dtype=dtype, verbose=False)
                loss(pipe(*inputs, **kwargs)).backward()
            except Exception as e:  # noqa: BLE001 - reported, not hidden
                print(f"{name:10s} memory {memory}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            row = []
            for s, measured in zip(pipe.plan.stages, pipe.stage_peaks()):
                ratios.append(s.peak_bytes / measured)
                row.append(f"{s.peak_bytes / measured:.2f}")
            print(f"{name:10s} memory {memory / 2**20:5.1f} MiB, {pipe.plan.num_stages} stages: predicted / measured "
                  f"per stage {' '.join(row)}")
    print(f"predicted / measured over {len(ratios)} stages: min {min(ratios):.2f}, median "
          f"{statistics.median(ratios):.2f}, max {max(ratios):.2f}")


if __name__ == "__main__":
    main()
