"""Plan the 15B GPT-3-like model on the Mobius paper's server, and compare schedules.

The model is built on the meta device (nothing is allocated), its costs are modelled for the
server's RTX 3090 Ti GPUs, the MIP cuts it into stages, cross mapping orders the GPUs, and
the simulator replays one training step under every schedule.

    python examples/plan_paper_server.py [--model gpt3-15b] [--topology mobius-testbed]
"""

from __future__ import annotations

import os
import sys
import argparse

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

import mobius_fx
from mobius_fx import Topology, zoo
from mobius_fx.sim.report import compare


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt3-15b", help=", ".join(zoo.model_names()))
    ap.add_argument("--topology", default="mobius-testbed", help=", ".join(Topology.PRESETS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    args = ap.parse_args(argv)

    topo = Topology.preset(args.topology)
    print(topo.tree())
    print()
    model, inputs = zoo.build(args.model, batch=args.batch, seq=args.seq, device="meta")
    # The paper's setting: fp16 weights on the GPUs, fp32 masters in DRAM, one micro-batch per GPU
    # at its batch of 8 on 8 GPUs (with a larger --batch the planner also times more micro-batches
    # and keeps the fastest: the plan's first line says which; docs/schedule_choice.md).
    plan = mobius_fx.plan(model, topo, example_inputs=inputs, dtype=torch.float16)
    print(plan)
    print()
    cmp = compare(plan)
    print(cmp.table())
    print()
    for other in ("zero3-offload", "mobius-identity-map", "roundpipe"):
        s = cmp.speedup(other)
        if s is not None:
            print(f"mobius vs {other}: {s:.2f}x")


if __name__ == "__main__":
    main()
