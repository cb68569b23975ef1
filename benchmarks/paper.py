"""The Mobius paper's comparison, on our planner and simulator (same costs for every schedule).

Setting (Feng et al., ASPLOS 2023): GPT-3-like models of 2.7B, 8.3B and 15.8B parameters
(hidden 2560/32 blocks, 3072/72, 4096/78), sequence 1024, batch 8, fp16 weights on the GPUs
and fp32 masters in DRAM, micro-batches = GPUs = 8, on the paper's server (`mobius-testbed`:
two root complexes, each a PCIe 3.0 switch with four 24 GB GPUs on x8 links). A second table
plans a Llama-3.1-8B-like model on `rtx4090x8` (RoundPipe's server).

"pipeline" is forward + backward + gradient download (what the GPUs and PCIe do); "step" adds
the CPU Adam step over the fp32 masters, which every schedule but GPipe pays, with the host
copies around it where the runtime makes them (planning.host_step.HOST_COPY_KINDS). The CPU optimizer's
speed is the simulator's default (--adam-gbps to give one): a fused AdamW measured on the H200
run's 16-core host, 111 GB/s (planning.host_step.CPU_ADAM_BANDWIDTH), the host copies at that host's
measured 27.5 GB/s (HOST_COPY_BANDWIDTH); ZeRO-3 steps with DeepSpeed's CPU Adam at the same
speed (--deepspeed-adam-gbps to give DeepSpeed's own). Host memory is NUMA-local to each stage's
GPU unless --masters names one socket (mobius_fx.sim.tasks.MASTERS).

Every ratio rests on the compute model: the roofline at a share of peak FLOP/s (the device
spec's `efficiency`, 0.6 by default: 48 TF/s on a 3090 Ti). The headline ratios are printed at
each of --efficiency (default 0.6 and a pessimistic 0.22, ~17.6 TF/s on a 3090 Ti), planned
anew at each, through the topology's device spec (costs.py is not touched). The last table
sets cross mapping against the identity map on the paper's server under each host memory
placement.

It also shows the step with the CPU optimizer overlapped (`simulate(optimizer_overlap=)`:
"none", "sync" per stage as gradients land, "async" a step late) for Mobius and RoundPipe.

    python benchmarks/paper.py [--adam-gbps 111] [--efficiency 0.6 0.22] [--time-limit 10]
"""

from __future__ import annotations

import os
import sys
import argparse
import dataclasses
import tempfile
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

import mobius_fx
from mobius_fx import Topology, zoo
from mobius_fx import schedules
from mobius_fx.kinds import OVERLAP_MODES
from mobius_fx.sim.report import compare
from mobius_fx.planning.host_step import CPU_ADAM_BANDWIDTH, HOST_COPY_BANDWIDTH
from mobius_fx.units import fmt_bytes

# The table's rows: the Mobius variants, then RoundPipe (the other streamed pipeline), then GPipe and ZeRO-3
# offload, each kept in the registry's order (mobius_fx.schedules.names()).
SCHEDULES = tuple(sorted(schedules.names(), key=lambda s: (not s.startswith("mobius"), s != "roundpipe")))


def gbps(x: float | None) -> float | None:
    """GB/s from the command line as bytes/s; None (not given) lets the simulator choose."""
    return None if x is None else x * 1e9


def with_efficiency(topo: Topology, efficiency: float) -> Topology:
    """`topo` with every GPU's device spec at `efficiency` of peak FLOP/s (the plan's cost model
    reads the topology's spec)."""
    d = topo.to_dict()
    for node in d["nodes"]:
        if node["kind"] == "gpu":
            spec = dataclasses.replace(topo.gpu(node["name"]).spec, efficiency=efficiency)
            node["spec"] = {"name": spec.name, "flops": dict(spec.flops), "memory_bandwidth": spec.memory_bandwidth,
                            "memory": spec.memory, "efficiency": spec.efficiency}
    return Topology.from_dict(d)


def run(model_name: str, topo: Topology, args, cache: str) -> tuple[list, dict]:
    t0 = time.perf_counter()
    model, inputs = zoo.build(model_name, batch=args.batch, seq=args.seq, device="meta")
    plan = mobius_fx.plan(model, topo, example_inputs=inputs, microbatches=len(topo.gpus), dtype=torch.float16,
                          time_limit=args.time_limit, cache_dir=cache, verbose=False)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    res = compare(plan, SCHEDULES, cpu_adam_bandwidth=gbps(args.adam_gbps),
                  deepspeed_adam_bandwidth=gbps(args.deepspeed_adam_gbps), masters=args.masters).results
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
    # the plan's prediction is the step under pipe.overlap's default "sync" (the host's passes the
    # step waits for included, planning/host_step.HostPass): set beside the simulated sync step
    sync = mobius_fx.simulate(plan, optimizer_overlap="sync", masters=args.masters,
                              cpu_adam_bandwidth=gbps(args.adam_gbps)).step_time
    summary = {"model": model_name, "params": params, "stages": plan.num_stages, "plan s": time.perf_counter() - t0,
               "solver": str(plan.solver), "predicted": plan.step_time, "sync": sync, "results": res, "plan": plan}
    return rows, summary


def speedups(summary: dict) -> list:
    res = summary["results"]
    out = [summary["model"], summary["stages"], f"{summary['predicted']:.2f}", f"{summary['sync']:.2f}",
           f"{res['mobius'].pipeline_time:.2f}"]
    for other in ("zero3-offload", "mobius-identity-map", "roundpipe"):
        r = res[other]
        if isinstance(r, str):
            out += ["n/a", "n/a"]
        else:
            out += [f"{r.pipeline_time / res['mobius'].pipeline_time:.2f}x", f"{r.step_time / res['mobius'].step_time:.2f}x"]
    return out


def cross_vs_identity(plan, args) -> list:
    """Simulated pipeline (and step) of cross mapping and the identity map under each host
    memory placement: both local, both on cpu0, and cross local against identity on cpu0."""
    def sim(schedule: str, masters: str):
        return mobius_fx.simulate(plan, schedule=schedule, masters=masters, cpu_adam_bandwidth=gbps(args.adam_gbps))

    rows = []
    for cross_m, ident_m in (("local", "local"), ("cpu0", "cpu0"), ("local", "cpu0")):
        c, i = sim("mobius", cross_m), sim("mobius-identity-map", ident_m)
        rows.append([f"cross: {cross_m}, identity: {ident_m}", f"{c.pipeline_time:.3f}", f"{i.pipeline_time:.3f}",
                     f"{(i.pipeline_time / c.pipeline_time - 1) * 100:+.1f}%", f"{c.step_time:.2f}",
                     f"{i.step_time:.2f}", f"{(i.step_time / c.step_time - 1) * 100:+.1f}%"])
    return rows


def overlaps(name: str, plan, res: dict, args) -> list:
    """The step of Mobius and of the RoundPipe-style schedule with the CPU optimizer after the
    step ("none"), per stage as gradients land ("sync") and a step late ("async", staleness 1),
    as ratios to Mobius's serial step; ZeRO-3 offload's for reference. `res`: `run`'s results,
    the "none" ones already simulated."""
    def step(schedule: str, mode: str):
        return mobius_fx.simulate(plan, schedule=schedule, optimizer_overlap=mode, masters=args.masters,
                                  cpu_adam_bandwidth=gbps(args.adam_gbps),
                                  deepspeed_adam_bandwidth=gbps(args.deepspeed_adam_gbps))

    serial = res["mobius"]
    row = [name, f"{serial.pipeline_time:.2f}"]
    for schedule in ("mobius", "roundpipe"):
        for mode in OVERLAP_MODES:
            r = serial if (schedule, mode) == ("mobius", "none") else step(schedule, mode)
            row.append(f"{r.step_time:.2f} ({r.step_time / serial.step_time:.2f})")
    row.append(f"{res['zero3-offload'].step_time:.2f}")
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adam-gbps", type=float, default=None,
                    help=f"sustained CPU optimizer bandwidth, GB/s (default the simulator's, "
                         f"{CPU_ADAM_BANDWIDTH / 1e9:.0f}: fused AdamW measured on the H200 run's host)")
    ap.add_argument("--deepspeed-adam-gbps", type=float, default=None,
                    help="ZeRO-3's DeepSpeedCPUAdam bandwidth, GB/s (default: the CPU optimizer's)")
    ap.add_argument("--masters", default="local", help="host memory placement: 'local' or a socket ('cpu0')")
    ap.add_argument("--efficiency", type=float, nargs="+", default=[0.6, 0.22],
                    help="shares of peak FLOP/s to print the headline ratios at (the first gives the full tables)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="the MIP's time budget in seconds (default 10)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--models", nargs="+", default=["gpt3-3b", "gpt3-8b", "gpt3-15b"])
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    headers = ["model", "schedule", "pipeline s", "step s", "pipeline vs mobius", "step vs mobius",
               "bytes on links", "pipeline / lower bound"]
    sp_headers = ["model", "stages", "MIP predicted s (sync step)", "simulated sync step s", "simulated fwd+bwd s",
                  "vs zero3 (pipeline)", "vs zero3 (step)",
                  "vs identity map (pipeline)", "vs identity map (step)", "vs roundpipe (pipeline)",
                  "vs roundpipe (step)"]
    servers = (("Table 1: the Mobius paper's server", "mobius-testbed", args.models),
               ("Table 2: RoundPipe's server", "rtx4090x8", ["llama-8b"]))
    headline: list = []
    cross_rows: list = []
    overlap_rows: list = []
    with tempfile.TemporaryDirectory() as cache:
        for e_i, eff in enumerate(args.efficiency):
            for title, topo_name, models in servers:
                topo = with_efficiency(Topology.preset(topo_name), eff)
                spec = topo.gpus[0].spec
                tfs = spec.peak_flops(torch.float16) * eff / 1e12
                rows, sums = [], []
                for m in models:
                    r, s = run(m, topo, args, cache)
                    rows += r
                    sums.append(s)
                    print(f"  planned and simulated {m} on {topo_name} at {eff:.0%} of peak in {s['plan s']:.1f} s "
                          f"({s['solver']})", flush=True)
                    if e_i == 0 and topo_name == "mobius-testbed" and m == "gpt3-8b":
                        cross_rows = cross_vs_identity(s["plan"], args)
                    if e_i == 0:
                        overlap_rows.append(overlaps(f"{m}, {topo_name}", s["plan"], s["results"], args))
                headline += [[topo_name, f"{eff:.0%} ({tfs:.1f} TF/s)"] + speedups(s) for s in sums]
                if e_i:
                    continue
                print(f"\n{title} ({topo_name}; batch {args.batch} x {args.seq}, fp16 streamed, "
                      f"{len(topo.gpus)} micro-batches, {eff:.0%} of peak FLOP/s = {tfs:.1f} TF/s on {spec.name}, "
                      f"masters {args.masters}; {sums[0]['results']['mobius'].host_line()}; ZeRO-3: "
                      f"{sums[0]['results']['zero3-offload'].host_sources['optimizer']})")
                print(tabulate(rows, headers=headers))
                print("\nMobius speedups (time of the other schedule / time of mobius):")
                print(tabulate([speedups(s) for s in sums], headers=sp_headers))
                print()
    print("Headline ratios at each compute efficiency (time of the other schedule / time of mobius; each "
          "efficiency planned anew):")
    print(tabulate(headline, headers=["server", "efficiency"] + sp_headers))
    if cross_rows:
        print(f"\nCross mapping vs the identity map (gpt3-8b on mobius-testbed, {args.efficiency[0]:.0%} of peak; "
              f"host memory 'local': each stage on its GPU's socket, 'cpu0': all on socket 0):")
        print(tabulate(cross_rows, headers=["host memory", "cross pipeline s", "identity pipeline s",
                                            "identity slower by", "cross step s", "identity step s",
                                            "identity slower by (step)"]))
    print(f"\nThe CPU optimizer after the step (none), per stage as gradients land (sync) or a step late "
          f"(async), {args.efficiency[0]:.0%} of peak, CPU Adam at "
          f"{(args.adam_gbps or CPU_ADAM_BANDWIDTH / 1e9):.0f} GB/s, host copies at {HOST_COPY_BANDWIDTH / 1e9:.1f} GB/s; step s "
          f"(ratio to mobius none):")
    print(tabulate(overlap_rows, headers=["model, server", "mobius pipeline s", "mobius none", "mobius sync",
                                          "mobius async", "roundpipe none", "roundpipe sync", "roundpipe async",
                                          "zero3-offload"]))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
