"""How planning time grows with model depth: trace, annotate, MIP (time and gap).

GPT-3-like models (hidden 3072, 24 heads, vocab 50257) with 24, 48 and 96 blocks, batch
8 x 1024 tokens, fp16 streamed, on the meta device, planned on `mobius-testbed` with 8
micro-batches. Every figure is measured in this run.

    python benchmarks/plan_scaling.py [--blocks 24 48 96] [--topology mobius-testbed]
"""

from __future__ import annotations

import os
import sys
import argparse
import tempfile
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

from mobius_fx import Topology
from mobius_fx.compiler import default_pipeline
from mobius_fx.options import CompileContext, CompileOptions
from mobius_fx.zoo import GPT, GPTConfig


def plan_one(blocks: int, topo: Topology, microbatches: int, cache_dir: str) -> dict:
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(GPTConfig(hidden=3072, blocks=blocks, heads=24))
        ids = torch.zeros(8, 1024, dtype=torch.long)
    build = time.perf_counter() - t0
    ctx = CompileContext(model=model, topology=topo, example_inputs=(ids,), settings=CompileOptions(
        microbatches=microbatches, dtype=torch.float16, cache_dir=cache_dir, costs="model"))
    default_pipeline().until("plan").run(ctx)
    plan, t = ctx.plan, ctx.timings
    return {
        "blocks": blocks, "params (B)": sum(p.numel() for p in model.parameters()) / 1e9,
        "layers": len(ctx.layers), "stages": plan.num_stages, "build s": build, "trace s": t["trace"],
        "annotate s": t["annotate"], "MIP + cross_map s": t["partition"], "gap": plan.solver.gap,
        "status": plan.solver.status,
        "step (pred.)": plan.step_time, "total s": build + sum(t.values()),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=[24, 48, 96])
    ap.add_argument("--topology", default="mobius-testbed")
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args(argv)
    topo = Topology.preset(args.topology)
    rows = []
    with tempfile.TemporaryDirectory() as cache:  # a fresh cache: every MIP is really solved
        for b in args.blocks:
            r = plan_one(b, topo, args.microbatches, cache)
            rows.append([r["blocks"], f"{r['params (B)']:.1f}", r["layers"], r["stages"], f"{r['trace s']:.2f}",
                         f"{r['annotate s']:.2f}", f"{r['MIP + cross_map s']:.2f}", f"{r['gap']:.1%}", r["status"],
                         f"{r['step (pred.)']:.2f}", f"{r['total s']:.1f}"])
            print(f"planned {b} blocks in {r['total s']:.1f} s", flush=True)
    print()
    print(f"Planning GPT-3-like models (hidden 3072) on {topo.name}, {args.microbatches} micro-batches, fp16:")
    print(tabulate(rows, headers=["blocks", "params (B)", "layers", "stages", "trace s", "annotate s", "MIP + cross_map s",
                                  "gap", "status", "pred. step s", "total s"]))


if __name__ == "__main__":
    main()
