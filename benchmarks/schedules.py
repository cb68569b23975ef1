"""Every registered schedule on the training step of the issue's cases, SIMULATED (no GPU is used).

Each case is planned with the loss on the last stage (`mobius_fx.plan(..., train_step=True)`, the
plan `pipe.train_step` runs: only the loss leaves the GPUs), so the table also shows whether
any logits cross a link ("logits on links": the bytes of vocabulary-sized activations the plan
moves; 0 is the goal). Per case and schedule: the simulated fwd+bwd (`SimResult.pipeline_time`:
forward, backward and the gradient downloads), its ratio to `plan.lower_bound()` (max(compute /
GPUs, the Mobius plan's busiest link / its bandwidth)), the step with the CPU optimizer under
`--overlap` (default "async", RoundPipe's own) and tokens/s = batch x seq / step. The planner
chooses each case's micro-batch count (`plan` without `microbatches=`: the default and the
divisors of the batch near 2x, 4x, 8x it, by simulated fwd+bwd; column "mb"; a winner other than
the default is re-planned with its own MIP, kept when faster, docs/schedule_choice.md). Below: the
planner's choice (`plan.schedule_choice`) and the acceptance check of issue 37: the fastest
pipeline schedule (GPipe and ZeRO-3 offload, baselines, and the Mobius ablations not counted)
at most 1.10 x the lower bound on Llama-8B 64 x 1024, 1.15 x on the others, beside each case's
floor (`floor`: every weight uploaded once before the first backward can start, then the
backward's compute on every GPU; no schedule that recomputes as the plan's costs do beats it).

Then tokens/s for Llama-8B on `rtx4090x8` at every schedule, beside RoundPipe's published
24,275 tokens/s (Llama-3.1-8B, 8 x RTX 4090, their README). Their README does not give that
run's batch and sequence length (their benchmark/train.py takes them as arguments); the table
uses the issue's 64 x 1024 (`--roundpipe-batch`, `--roundpipe-seq` to change it).

All figures are SIMULATED on preset topologies with modelled costs; none is measured. The exit
status is 1 when a case misses its acceptance ratio: the paper's batch of 8 on mobius-testbed
does (8 rows allow at most 8 micro-batches; the floor alone is 1.07-1.15 x the lower bound
there; docs/schedule_choice.md gives the figures and the batch that passes). `--cases` without
the three "-testbed" batch-8 cases is the set that passes.

    python benchmarks/schedules.py [--cases llama-8b,gpt3-8b,gpt3-3b-testbed,...] [--overlap async]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

import mobius_fx  # noqa: E402
from mobius_fx import schedules, zoo  # noqa: E402
from mobius_fx.kinds import OVERLAP_MODES  # noqa: E402

CASES = {  # name -> (model, topology, batch, seq, the acceptance ratio); the planner chooses the micro-batch count
    "llama-8b": ("llama-8b", "rtx4090x8", 64, 1024, 1.10),
    "gpt3-8b": ("gpt3-8b", "rtx4090x8", 32, 1024, 1.15),
    "gpt3-3b-testbed": ("gpt3-3b", "mobius-testbed", 8, 1024, 1.15),  # the paper's batch
    "gpt3-8b-testbed": ("gpt3-8b", "mobius-testbed", 8, 1024, 1.15),
    "gpt3-15b-testbed": ("gpt3-15b", "mobius-testbed", 8, 1024, 1.15),
    "gpt3-3b-testbed-32": ("gpt3-3b", "mobius-testbed", 32, 1024, 1.15),  # 4 x the paper's batch
    "gpt3-8b-testbed-32": ("gpt3-8b", "mobius-testbed", 32, 1024, 1.15),
    "gpt3-15b-testbed-32": ("gpt3-15b", "mobius-testbed", 32, 1024, 1.15),
}
ROUNDPIPE_PUBLISHED = 24_275  # tokens/s, Llama-3.1-8B full fine-tuning, 8 x RTX 4090 (RoundPipe README)


def _logit_bytes(plan, vocab: int) -> int:
    """Bytes of the transfers whose per-micro-batch size is a multiple of the vocabulary's:
    the logits (or their gradient) leaving a stage."""
    total = 0
    for t in plan.transfers:  # t.bytes: one occurrence (one micro-batch's value), t.count per step
        if t.kind == "activation" and vocab and t.bytes and t.bytes % vocab == 0 and t.bytes >= vocab * 16:
            total += t.bytes * t.count
    return total


def floor(plan, model) -> float:
    """A floor under any schedule's fwd+bwd that recomputes in backward as the plan's costs do:
    the first backward needs the loss of a micro-batch, so every weight (each once, fp16) has
    crossed the host's links to the GPUs (at most their max-flow bandwidth) before it starts, and
    then all of the backward's compute is left (bwd / GPUs). Only the fill and drain are left out."""
    import networkx as nx

    topo = plan.topology
    g = topo.graph.copy()
    for rc in topo.root_complexes:
        g.add_edge("host*", rc, bandwidth=float("inf"))
    for gpu in topo.gpus:
        g.add_edge(gpu.name, "gpus*", bandwidth=float("inf"))
    flow = nx.maximum_flow_value(g, "host*", "gpus*", capacity="bandwidth")
    weights = sum(p.numel() for p in model.parameters()) * plan.precision.stream.itemsize  # tied ones once
    bwd = sum(plan.stages[o.stage].bwd_time for o in plan.schedule().select(kind="run") if o.phase == "backward")
    return weights / flow + bwd / plan.num_gpus


def _plan(name: str, topo: str, batch: int, seq: int, time_limit: float, overlap: str = "async"):
    model, inputs = zoo.build(name, batch=batch, seq=seq, device="meta")
    plan = mobius_fx.plan(model, topo, example_inputs=inputs, dtype=torch.float16, optimizer_overlap=overlap,  # the planner chooses the count
                          time_limit=time_limit, verbose=False, **zoo.step_arguments(model, inputs))
    return plan, zoo.named._vocab(model), floor(plan, model)


def _run_case(case: str, model: str, topo: str, batch: int, seq: int, overlap: str, time_limit: float):
    """The case's plan, lower bound, floor, rows (one per schedule) and results {schedule: SimResult | error}."""
    t0 = time.perf_counter()
    plan, vocab, fl = _plan(model, topo, batch, seq, time_limit, overlap)
    lb = plan.lower_bound()
    print(f"[{case}] planned {plan.num_stages} stages, {plan.microbatches} micro-batches ({plan.microbatches_rule}) "
          f"in {time.perf_counter() - t0:.0f} s; lower bound {lb:.3f} s, floor {fl / lb:.3f} x it; "
          f"logits on links: {_logit_bytes(plan, vocab)} B", flush=True)
    rows, res = [], {}
    for sched in schedules.names():
        try:
            r = mobius_fx.simulate(plan, schedule=sched, optimizer_overlap=overlap)
        except mobius_fx.MobiusError as e:
            res[sched] = str(e).splitlines()[0]
            rows.append([case, plan.microbatches, sched, "does not fit", "", "", "", res[sched][:60]])
            continue
        res[sched] = r
        kind = "baseline" if schedules.get(sched).baseline else "candidate"
        rows.append([case, plan.microbatches, sched, f"{r.pipeline_time:.3f} s", f"{r.pipeline_time / lb:.3f}", f"{r.step_time:.2f} s",
                     f"{batch * seq / r.step_time:,.0f}", kind])
    return plan, lb, fl, rows, res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--overlap", default="async", choices=OVERLAP_MODES)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--roundpipe-batch", type=int, default=64)
    ap.add_argument("--roundpipe-seq", type=int, default=1024)
    args = ap.parse_args(argv)
    rows, checks, choices = [], [], []
    failed = 0
    for case in args.cases.split(","):
        model, topo, batch, seq, target = CASES[case]
        plan, lb, fl, case_rows, res = _run_case(case, model, topo, batch, seq, args.overlap, args.time_limit)
        rows += case_rows
        fits = {n: r.pipeline_time for n, r in res.items()
                if not isinstance(r, str) and not schedules.get(n).baseline}
        best = min(fits, key=fits.get)
        ok = fits[best] <= target * lb
        failed += not ok
        verdict = "PASS" if ok else ("FAIL (floor above the target)" if fl > target * lb else "FAIL")
        checks.append([case, plan.microbatches, best, f"{fits[best] / lb:.3f}", f"{fl / lb:.3f}", f"<= {target:.2f}",
                       verdict])
        choices.append((case, plan.schedule_choice))
    print()
    print(f"SIMULATED fwd+bwd per schedule (step: CPU optimizer overlap {args.overlap}; the planner's micro-batch count):")
    print(tabulate(rows, headers=["case", "mb", "schedule", "fwd+bwd", "/ lower bound", "step", "tokens/s", "kind"]))
    print()
    print("The planner's choice (plan.schedule_choice, the plan's first line):")
    for case, line in choices:
        print(f"  {case}: {line}")
    print()
    print("Issue 37 acceptance, SIMULATED: the fastest pipeline schedule's fwd+bwd / plan.lower_bound(); floor: the\n"
          "fwd+bwd no schedule that recomputes can beat (every weight uploaded once before the first backward, then\n"
          "the backward's compute on every GPU; fill and drain left out), / the lower bound")
    print(tabulate(checks, headers=["case", "mb", "fastest", "ratio", "floor", "target", ""]))

    # Llama-8B tokens/s at RoundPipe's setting, with its published figure beside
    b, s = args.roundpipe_batch, args.roundpipe_seq
    plan, lb, _, _, res = _run_case("llama-8b (tokens/s)", "llama-8b", "rtx4090x8", b, s, args.overlap,
                                    args.time_limit)
    tok = [[n, f"{b * s / r.step_time:,.0f}", f"{r.step_time:.2f} s", f"simulated, rtx4090x8 preset, {b}x{s}, "
            f"{plan.microbatches} micro-batches"] for n, r in res.items() if not isinstance(r, str)]
    tok.append(["RoundPipe", f"{ROUNDPIPE_PUBLISHED:,}", "", "[published, their hardware] (their README gives no "
                "batch or sequence length)"])
    print()
    print(f"Llama-8B on 8 x RTX 4090, tokens/s = batch x seq / step (CPU optimizer overlap {args.overlap}):")
    print(tabulate(tok, headers=["schedule", "tokens/s", "step", "source"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
