"""Does the overlapped CPU optimizer hide behind the pipeline in simulation? (issue 38's
"Simulated" acceptance.)

For each case (gpt3-8b on `rtx4090x8` at 32 x 1024 tokens; the paper's three GPT-3-like models on
`mobius-testbed` at 8 x 1024, benchmarks/paper.py's setting), fp16 streamed, fp32 masters: plan,
then simulate the Mobius schedule under `--overlap` (default "async"). Printed per case: the
pipeline (fwd+bwd), the step, the fused host pass alone (the masters' parameters x 28 B, AdamW's
one pass with a 2-byte gradient in and the 2-byte streamed copy out, mobius_fx/planning/host_step.py,
over the optimizer's bandwidth: the topology's measured host section, else
CPU_ADAM_BANDWIDTH, 111 GB/s), the host's busy time (`SimResult.host_busy`: the optimizer's
passes and every host copy), and the two checks:

- step <= 1.05 x max(fwd+bwd, fused pass);
- host busy <= 1.2 x the fused pass (28 B per parameter; with the fp32 .grad: 30 B).

Planned and simulated with the overlap's `keep_grads` (default True, the runtime's: the fp32 `.grad`
written). Column "widened": whether the plan has the GPUs widen each gradient to fp32 and download
it straight into `.grad` (4 B per parameter on the GPU->host links instead of 2; the host converts
nothing and the pass reads that .grad, 2 B more), as the planner chose (`--widen auto`: widened
where each GPU's links to the host are its own and full duplex, elsewhere the mode the step model
times shorter, passes/partition.py `widen_choice`) or `--widen on|off`. `--no-keep-grads`: a loop
with `opt.keep_grads = False` (bf16 downloads read by the pass). The column "hand-over" is the
host's conversion of downloads into `.grad` ("none"'s; async's with bf16 downloads).

Simulated, not measured; every figure from this run. Always exits 0.

    python benchmarks/host_overlap.py [--overlap async|sync|none] [--widen auto|on|off] [--no-keep-grads]
                                      [--cases gpt3-8b@rtx4090x8,...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

import mobius_fx
from mobius_fx import Topology, zoo
from mobius_fx.kinds import OVERLAP_MODES

CASES = (("gpt3-8b", "rtx4090x8", 32), ("gpt3-3b", "mobius-testbed", 8), ("gpt3-8b", "mobius-testbed", 8),
         ("gpt3-15b", "mobius-testbed", 8))
STEP_OVER = 1.05
BUSY_OVER = 1.2


def run_case(model_name: str, topo_name: str, batch: int, overlap: str, cache: str, keep_grads: bool = True,
             widen: bool | None = None) -> list:
    topo = Topology.preset(topo_name)
    model, inputs = zoo.build(model_name, batch=batch, seq=1024, device="meta")
    plan = mobius_fx.plan(model, topo, example_inputs=inputs, microbatches=len(topo.gpus), dtype=torch.float16,
                          time_limit=10.0, cache_dir=cache, verbose=False, optimizer_overlap=overlap,
                          keep_grads=keep_grads, widen_downloads=widen)
    r = mobius_fx.simulate(plan, optimizer_overlap=overlap, keep_grads=keep_grads)
    handover = sum(e.end - e.start for e in r.events if e.stream == "host/handover")
    params = sum(s.grad_bytes / plan.precision.scale for s in plan.stages) / 4  # per 4 master bytes, as simulated
    fused = params * 28 / r.optimizer_bandwidth
    step_ok = r.step_time <= STEP_OVER * max(r.pipeline_time, fused)
    busy_ok = r.host_busy <= BUSY_OVER * fused
    widened = {True: "yes", False: "no", None: "-"}[plan.widen_downloads]
    return [f"{model_name} on {topo_name}, {batch} x 1024", f"{params / 1e9:.2f}B", widened, f"{r.pipeline_time:.2f}",
            f"{r.step_time:.2f}", f"{plan.step_time:.2f}", f"{fused:.2f}", f"{handover:.2f}", f"{r.host_busy:.2f}",
            f"{r.step_time / max(r.pipeline_time, fused):.3f} {'ok' if step_ok else 'FAIL'}",
            f"{r.host_busy / fused:.3f} {'ok' if busy_ok else 'FAIL'}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--overlap", choices=OVERLAP_MODES, default="async")
    ap.add_argument("--cases", default=None, help="comma-separated model@topology (default: all four)")
    ap.add_argument("--no-keep-grads", dest="keep_grads", action="store_false",
                    help="plan and simulate a loop with opt.keep_grads = False (no fp32 .grad from the overlap)")
    ap.add_argument("--widen", choices=("auto", "on", "off"), default="auto",
                    help="the gradient downloads: the planner's choice (auto, the plan's 'gradients:' line), or forced "
                         "widened to fp32 on the GPUs (on) or as streamed (off)")
    args = ap.parse_args(argv)
    want = set(args.cases.split(",")) if args.cases else None
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for model_name, topo_name, batch in CASES:
            if want is None or f"{model_name}@{topo_name}" in want:
                rows.append(run_case(model_name, topo_name, batch, args.overlap, cache, args.keep_grads,
                                     {"auto": None, "on": True, "off": False}[args.widen]))
                print(f"{rows[-1][0]}: done", flush=True)
    print(f"\nThe Mobius schedule, simulated, optimizer overlap {args.overlap!r}, keep_grads={args.keep_grads} "
          f"(seconds; fused pass = parameters x 28 B / the optimizer's bandwidth; planned: the plan's prediction; "
          f"widened: the plan's gradient downloads, --widen {args.widen}):")
    print(tabulate(rows, headers=["case", "parameters", "widened", "fwd+bwd", "step", "planned", "fused pass", "hand-over",
                                  "host busy",
                                  f"step / max (<= {STEP_OVER})", f"busy / pass (<= {BUSY_OVER})"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
