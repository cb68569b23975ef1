"""The Mobius paper's comparison, on our planner and simulator (same costs for every schedule).

Setting (Feng et al., ASPLOS 2023): GPT-3-like models of 2.7B, 8.3B and 15.8B parameters
(hidden 2560/32 blocks, 3072/72, 4096/78), sequence 1024, batch 8, fp16 weights on the GPUs
and fp32 masters in DRAM, micro-batches = GPUs = 8, on the paper's server (`mobius-testbed`:
two root complexes, each a PCIe 3.0 switch with four 24 GB GPUs on x8 links). A second table
plans a Llama-3.1-8B-like model on `rtx4090x8` (RoundPipe's server).

"pipeline" is forward + backward + gradient download (what the GPUs and PCIe do); "step" adds
the CPU Adam step over the fp32 masters, which every schedule but GPipe pays. The CPU
optimizer's sustained bandwidth is an assumption (--adam-gbps; default 100 GB/s: a fused,
multi-threaded AdamW on a 2-socket DDR4 server, about 2/3 of its STREAM bandwidth).

    python benchmarks/paper.py [--adam-gbps 100] [--time-limit 10]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from tabulate import tabulate

import mobius_fx
from mobius_fx import Topology, zoo
from mobius_fx.report import compare
from mobius_fx.units import fmt_bytes

SCHEDULES = ("mobius", "mobius-noprefetch", "mobius-identity-map", "roundpipe", "gpipe", "zero3-offload")


def run(model_name: str, topo: Topology, args, cache: str) -> tuple[list, dict]:
    t0 = time.perf_counter()
    model, inputs = zoo.build(model_name, batch=args.batch, seq=args.seq, device="meta")
    plan = mobius_fx.plan(model, topo, example_inputs=inputs, microbatches=len(topo.gpus), dtype=torch.float16,
                          time_limit=args.time_limit, cache_dir=cache, verbose=False)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    res = compare(plan, SCHEDULES, cpu_adam_bandwidth=args.adam_gbps * 1e9).results
    lb = plan.lower_bound()
    mob = res["mobius"]
    rows = []
    for s in SCHEDULES:
        r = res[s]
        if isinstance(r, str):
            rows.append([f"{model_name} ({params:.1f}B)", s, "does not fit", "", "", "", "", ""])
            continue
        rows.append([f"{model_name} ({params:.1f}B)", s, f"{r.pipeline_time:.2f}", f"{r.step_time:.2f}",
                     f"{r.pipeline_time / mob.pipeline_time:.2f}x", f"{r.step_time / mob.step_time:.2f}x",
                     fmt_bytes(sum(r.link_bytes.values())),
                     f"{r.pipeline_time / lb:.2f}"])
    summary = {"model": model_name, "params": params, "stages": plan.num_stages, "plan s": time.perf_counter() - t0,
               "solver": str(plan.solver), "predicted": plan.step_time, "results": res}
    return rows, summary


def speedups(summary: dict) -> list:
    res = summary["results"]
    out = [summary["model"], summary["stages"], f"{summary['predicted']:.2f}", f"{res['mobius'].pipeline_time:.2f}"]
    for other in ("zero3-offload", "mobius-identity-map", "roundpipe"):
        r = res[other]
        if isinstance(r, str):
            out += ["n/a", "n/a"]
        else:
            out += [f"{r.pipeline_time / res['mobius'].pipeline_time:.2f}x", f"{r.step_time / res['mobius'].step_time:.2f}x"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adam-gbps", type=float, default=100.0, help="sustained CPU optimizer bandwidth, GB/s")
    ap.add_argument("--time-limit", type=float, default=10.0, help="the MIP's time budget in seconds (default 10)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--models", nargs="+", default=["gpt3-3b", "gpt3-8b", "gpt3-15b"])
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    headers = ["model", "schedule", "pipeline s", "step s", "pipeline vs mobius", "step vs mobius",
               "bytes on links", "pipeline / lower bound"]
    sp_headers = ["model", "stages", "MIP predicted s", "simulated s", "vs zero3 (pipeline)", "vs zero3 (step)",
                  "vs identity map (pipeline)", "vs identity map (step)", "vs roundpipe (pipeline)",
                  "vs roundpipe (step)"]
    with tempfile.TemporaryDirectory() as cache:
        for title, topo_name, models in (
            ("Table 1: the Mobius paper's server", "mobius-testbed", args.models),
            ("Table 2: RoundPipe's server", "rtx4090x8", ["llama-8b"]),
        ):
            topo = Topology.preset(topo_name)
            rows, sums = [], []
            for m in models:
                r, s = run(m, topo, args, cache)
                rows += r
                sums.append(s)
                print(f"  planned and simulated {m} on {topo_name} in {s['plan s']:.1f} s ({s['solver']})", flush=True)
            print(f"\n{title} ({topo_name}; batch {args.batch} x {args.seq}, fp16 streamed, "
                  f"{len(topo.gpus)} micro-batches, CPU Adam at {args.adam_gbps:.0f} GB/s)")
            print(tabulate(rows, headers=headers))
            print("\nMobius speedups (time of the other schedule / time of mobius):")
            print(tabulate([speedups(s) for s in sums], headers=sp_headers))
            print()
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
