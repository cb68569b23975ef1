"""The planner's predicted step against the simulated one, for the paper's models.

For GPT-3 2.6B / 8.3B / 15.9B (the Mobius paper's sizes, built on the meta device) at
8 x 1024 tokens with 8 micro-batches and 2 x 1024 tokens with 2, fp16 streamed, on the paper's
server (`mobius-testbed`: four GPUs per PCIe switch), RoundPipe's (`rtx4090x8`: every GPU on its
own root port) and a 4-GPU single-switch box (RTX 3090s on PCIe 4.0 x16 behind one x16
uplink): plan (the MIP, its step model), simulate the plan (flow-level network model), and print
predicted / simulated and predicted / `plan.lower_bound()`. The step compared is the whole step
under `pipe.overlap`'s default "sync" (the host's fused passes the step waits for included), as
the plan predicts it (planning/host_step.HostPass). Simulated, not measured.

    python benchmarks/prediction.py [--models gpt3-3b gpt3-8b] [--topologies mobius-testbed] [--time-limit 10]
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

import mobius_fx
from mobius_fx import Topology, zoo
from mobius_fx.topology.links import PCIE4_X16
from mobius_fx.topology.schema import layout

TOPOLOGIES = ("mobius-testbed", "rtx4090x8", "box4-switch")
CONFIGS = ((8, 1024, 8), (2, 1024, 2))  # batch, sequence, micro-batches


def topology(name: str) -> Topology:
    if name == "box4-switch":  # one socket, one PCIe 4.0 switch, x16 uplink, four x16 GPUs, no P2P
        return Topology.from_dict(layout("box4-switch", [[[0, 1, 2, 3]]], spec="rtx3090", memory="24GiB",
                                         gpu_link=PCIE4_X16, uplink=PCIE4_X16, upi=20e9, p2p=False))
    return Topology.preset(name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt3-3b", "gpt3-8b", "gpt3-15b"])
    ap.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), choices=TOPOLOGIES)
    ap.add_argument("--time-limit", type=float, default=10.0, help="the MIP's budget per plan, seconds")
    args = ap.parse_args(argv)
    rows, ratios, t_all = [], [], time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        for tname in args.topologies:
            topo = topology(tname)
            for name in args.models:
                for batch, seq, m in CONFIGS:
                    t0 = time.perf_counter()
                    model, inputs = zoo.build(name, batch=batch, seq=seq, device="meta")
                    plan = mobius_fx.plan(model, topo, example_inputs=inputs, microbatches=m, dtype=torch.float16,
                                          time_limit=args.time_limit, cache_dir=cache, verbose=False)
                    sim = mobius_fx.simulate(plan, optimizer_overlap="sync").step_time  # the step the plan predicts
                    lb = plan.lower_bound()
                    ratios.append((plan.step_time / sim, plan.step_time / lb))
                    rows.append([tname, name, f"{batch} x {seq}", m, plan.num_stages, f"{plan.step_time:.3f}",
                                 f"{sim:.3f}", f"{plan.step_time / sim:.3f}", f"{plan.step_time / lb:.2f}",
                                 f"{time.perf_counter() - t0:.0f} s"])
                    print(f"  {tname} {name} {batch}x{seq}: done", flush=True)
    print(tabulate(rows, headers=["topology", "model", "tokens", "micro-batches", "stages", "predicted s",
                                  "simulated s", "predicted / simulated", "predicted / lower bound", "plan"]))
    lo, hi = min(r for r, _ in ratios), max(r for r, _ in ratios)
    print(f"\npredicted / simulated: {lo:.3f} .. {hi:.3f}; predicted / lower bound >= {min(b for _, b in ratios):.2f}"
          f"; total {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
