"""Trace + annotate time at planner scale: GPT-3-like models built on the meta device.

    python benchmarks/annotate_scale.py            # the ~8.3B model and a ~1.3B one
    python benchmarks/annotate_scale.py --quick    # a small one only (CI smoke)

Nothing is allocated: weights and activations are meta tensors, costs are modelled (roofline
on the rtx3090 spec). The planner's budget is 60 s end to end; trace + annotate should be a
small part of it.
"""

from __future__ import annotations

import os
import argparse
import sys
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

from mobius_fx.passes.annotate import annotate  # noqa: E402
from mobius_fx.tracing import trace  # noqa: E402
from mobius_fx.units import fmt_bytes, fmt_time  # noqa: E402
from mobius_fx.zoo import nanogpt, nanogpt_inputs  # noqa: E402

# name, (hidden, blocks, vocab, seq, heads), batch
CONFIGS = {
    "gpt3-8.3B": ((3072, 72, 50257, 1024, 24), 8),
    "gpt3-1.3B": ((2048, 24, 50257, 1024, 16), 8),
    "gpt-small": ((256, 4, 1000, 128, 4), 4),
}


def run(name: str) -> list[object]:
    (hidden, blocks, vocab, seq, heads), batch = CONFIGS[name]
    with torch.device("meta"):
        model = nanogpt(hidden, blocks, vocab, seq, heads)
    inputs = nanogpt_inputs(model, batch=batch, device="meta")
    t0 = time.perf_counter()
    gm = trace(model, example_inputs=inputs)
    t1 = time.perf_counter()
    layers = annotate(gm, example_inputs=inputs, costs="model", device_spec="rtx3090")
    t2 = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(layer.param_bytes for layer in layers)
    fwd = sum(layer.fwd_time for layer in layers)
    bwd = sum(layer.bwd_time for layer in layers)
    runs = 1 + sum(1 for a, b in zip(layers, layers[1:]) if a.signature != b.signature)
    return [name, f"{params / 1e9:.2f}B", fmt_bytes(param_bytes), len(gm.graph.nodes), len(layers), runs,
            gm.meta["mobius_trace"].front_end, f"{t1 - t0:.2f}", f"{t2 - t1:.2f}", fmt_time(fwd), fmt_time(bwd)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the small model")
    parser.add_argument("--models", nargs="*", default=None, choices=sorted(CONFIGS))
    ns = parser.parse_args()
    names = ns.models or (["gpt-small"] if ns.quick else ["gpt3-8.3B", "gpt3-1.3B"])
    rows = [run(n) for n in names]
    print(tabulate(rows, headers=["model", "params", "param bytes", "nodes", "layers", "RLE runs", "front end",
                                  "trace s", "annotate s", "fwd (3090)", "bwd+recompute (3090)"]))


if __name__ == "__main__":
    main()
