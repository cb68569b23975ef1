"""How good the planner's pick and its prediction are, against the simulator, on small cases.

For each case (a small GPT-like model on the meta device, 8 layers: embedding, 5-6 blocks, head;
a server of 2-4 RTX 3090s behind one or two PCIe switches) every contiguous partition of the
layers (2^7 = 128) is planned with `cuts=` (the same passes as `mobius_fx.plan(..., cuts=)`:
given cuts, cross mapping, re-timed on the mapped order) and simulated with `mobius_fx.simulate`.
The normal planner (the MIP) plans the same case. Times are the whole step (`SimResult.step_time`:
forward + backward + gradient download and the host's optimizer work the step waits for), planned
and simulated under the same `pipe.overlap(opt, mode=...)` (`--overlap`, default "sync", the
examples' default: each stage's fused host pass once its gradients land, writing the streamed
copies, so no host pinning precedes the uploads; the planner charges the passes that end after
the GPUs, `planning/host_step.HostPass`). `--overlap none` simulates the hand-over and step after
the pipeline and the pinning a serial optimizer leaves before each stage's first upload (the
planner does not model the pinning). Columns:

- partitions: how many fit the GPUs (of all contiguous ones);
- MIP pick: its cuts and simulated time; best: the partition the simulator times fastest;
- pick/best: simulated time of the MIP's pick over the best's (target: <= 1.03, "ok"/"FAIL");
- pred/sim: the MIP's predicted time over the simulated time of its pick (target: 0.94-1.00);
- >= LB: whether the prediction is at least `plan.lower_bound()`;
- pipe pred/sim: the pick's GPU pipeline alone (fwd + bwd + gradient downloads), predicted
  (`step_model.evaluate(...).pipeline`) over simulated (`SimResult.pipeline_time`): where
  pred/sim misses, whether the pipeline model or the host's terms miss;
- host after: the host's work the step waits for after the pipeline, simulated (step - pipeline).

`--no-keep-grads` plans and simulates a loop with `opt.keep_grads = False` (no fp32 `.grad` from
the overlap; by default, as the runtime, "sync"'s pass writes it and "async"'s main thread
converts the downloads into it after the pipeline: planning/host_step.py).

Every figure is computed in this run, with a fresh plan cache. Always exits 0.

    python benchmarks/plan_quality.py [--time-limit 10] [--overlap sync|async|none] [--no-keep-grads]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

import mobius_fx
from mobius_fx import PlanError, Topology
from mobius_fx.compiler import PassPipeline, default_pipeline
from mobius_fx.kinds import OVERLAP_MODES
from mobius_fx.options import CompileContext, CompileOptions
from mobius_fx.passes.partition import problem_of
from mobius_fx.planning.step_model import evaluate
from mobius_fx.zoo import GPT, GPTConfig


@dataclass(frozen=True)
class Case:
    name: str
    what: str  # why it is here
    hidden: int
    batch: int
    seq: int
    switches: tuple[tuple[int, ...], ...]  # per root complex, the GPU count under each of its switches
    memory: str = "24GiB"
    gpu_gbps: float = 6.5  # each GPU's x8 link
    uplink_gbps: float = 13.0  # each switch's x16 uplink
    blocks: int = 6
    vocab: int = 8192


CASES = (
    Case("compute-bound", "4 GPUs, one switch, 4 x 1024 tokens", 1024, 4, 1024, ((4,),), blocks=5),
    Case("link-bound", "4 GPUs, one switch, 4 x 256 tokens", 3072, 4, 256, ((4,),)),  # issue 14's case
    Case("link-bound, tiny batch", "4 GPUs, one switch, 4 x 64 tokens", 2048, 4, 64, ((4,),)),
    Case("memory-tight", "2 GPUs, one switch, 1.5 GiB each", 2048, 2, 512, ((2,),), memory="1.5GiB"),
    Case("two switches", "4 GPUs, two switches on two sockets", 1536, 4, 512, ((2,), (2,))),
    Case("3 GPUs, 2 switches", "3 GPUs, switches of 2 and 1 on one socket", 1024, 3, 512, ((2, 1),)),
    Case("2 GPUs, link-bound", "2 GPUs on two sockets, 2 x 128 tokens", 2048, 2, 128, ((1,), (1,))),
    Case("no shared link", "4 GPUs, each on its own x16 link to the socket", 1024, 4, 256, ((1, 1, 1, 1),),
         gpu_gbps=13.0, uplink_gbps=13.0),
    Case("issue 38", "4 GPUs, one switch, 4 x 128 tokens, hidden 1792, GPT-2's vocabulary", 1792, 4, 128, ((4,),),
         blocks=4, vocab=50257),
)
PICK_BEST = 1.03  # the MIP's pick at most this much slower than the best partition, simulated
PRED_SIM = (0.94, 1.00)  # the prediction over the simulated time of the pick


def server(case: Case) -> Topology:
    """The case's server: sockets joined by UPI, switches under each, GPUs under each switch."""
    nodes, links, g = [], [], 0
    for r, switches in enumerate(case.switches):
        nodes.append({"name": f"cpu{r}", "kind": "root_complex"})
        if r:
            links.append({"a": "cpu0", "b": f"cpu{r}", "bandwidth_gbps": 20.0})
        for s, count in enumerate(switches):
            sw = f"sw{r}{s}"
            nodes.append({"name": sw, "kind": "switch"})
            links.append({"a": f"cpu{r}", "b": sw, "bandwidth_gbps": case.uplink_gbps})
            for _ in range(count):
                nodes.append({"name": f"gpu{g}", "kind": "gpu", "memory": case.memory, "spec": "rtx3090"})
                links.append({"a": sw, "b": f"gpu{g}", "bandwidth_gbps": case.gpu_gbps})
                g += 1
    return Topology.from_dict({"name": case.name, "p2p": False, "nodes": nodes, "links": links})


def _context(case: Case, topo: Topology, cache: str, overlap: str = "sync", keep_grads: bool = True,
             **settings) -> CompileContext:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=case.vocab, seq=case.seq, hidden=case.hidden, blocks=case.blocks,
                              heads=case.hidden // 64))
    ids = torch.zeros(case.batch, case.seq, dtype=torch.long, device="meta")
    opts = CompileOptions(dtype=torch.float16, costs="model", cache_dir=cache, verbose=False,
                          optimizer_overlap=overlap, keep_grads=keep_grads, **settings)
    ctx = CompileContext(model=model, topology=topo, example_inputs=(ids,), settings=opts)
    ctx.settings = ctx.settings.resolved(case.batch, len(topo.gpus))  # the default: one micro-batch per GPU
    return ctx


def _cuts(plan) -> tuple[int, ...]:
    sizes = [len(s.layers) for s in plan.stages]
    return tuple(itertools.accumulate(sizes[:-1]))


def run_case(case: Case, cache: str, time_limit: float, overlap: str = "sync", keep_grads: bool = True) -> dict:
    topo = server(case)
    t0 = time.perf_counter()
    mip_ctx = _context(case, topo, cache, overlap, keep_grads, time_limit=time_limit)
    default_pipeline().until("plan").run(mip_ctx)  # trace, annotate and the MIP, as mobius_fx.plan runs them
    mip = mip_ctx.plan
    sim = mobius_fx.simulate(mip, optimizer_overlap=overlap, keep_grads=keep_grads)
    mip_sim = sim.step_time
    if mip.widen_downloads is not None:  # the pipeline timed in the plan's mode of gradient download
        mip_ctx.settings = dataclasses.replace(mip_ctx.settings, widen_downloads=mip.widen_downloads)
    pipe_pred = evaluate(problem_of(mip_ctx, mip.order), [0, *_cuts(mip)]).pipeline
    # Every contiguous partition through the plan's own passes with cuts= given (no re-trace).
    tail = default_pipeline()
    tail = PassPipeline([p for p in tail.passes if p.name in ("partition", "plan")],
                        given=(*tail.given, "graph", "layers"))
    L = len(mip_ctx.layers)
    assert L <= 8, f"{case.name} has {L} layers; keep cases at <= 8 (2^(L-1) partitions)"
    results, fits = [], 0
    for s in range(L):
        for cuts in itertools.combinations(range(1, L), s):
            ctx = CompileContext(model=mip_ctx.model, topology=topo, example_inputs=mip_ctx.example_inputs,
                                 settings=CompileOptions(**{**_settings(mip_ctx.settings), "cuts": cuts}),
                                 gm=mip_ctx.gm, layers=mip_ctx.layers)
            try:
                tail.run(ctx)
            except PlanError:
                continue  # does not fit the GPUs
            fits += 1
            sim_time = mobius_fx.simulate(ctx.plan, optimizer_overlap=overlap, keep_grads=keep_grads).step_time
            results.append((sim_time, cuts, ctx.plan.step_time))
    best_sim, best_cuts, _ = min(results)
    return {"case": case.name, "what": case.what, "layers": L, "gpus": len(topo.gpus),
            "microbatches": mip.microbatches, "partitions": f"{fits} / {2 ** (L - 1)}",
            "mip_cuts": _cuts(mip), "mip_sim": mip_sim, "best_cuts": best_cuts, "best_sim": best_sim,
            "pick_best": mip_sim / best_sim, "pred_sim": mip.step_time / mip_sim,
            "above_lb": mip.step_time >= mip.lower_bound() * (1 - 1e-9), "solver": str(mip.solver),
            "pipe_pred_sim": pipe_pred / sim.pipeline_time, "host_after": mip_sim - sim.pipeline_time,
            "seconds": time.perf_counter() - t0}


def _settings(opts: CompileOptions) -> dict:
    return {name: getattr(opts, name) for name in CompileOptions.names()}


def _ok(passed: bool) -> str:
    return "ok" if passed else "FAIL"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-limit", type=float, default=10.0, help="the MIP's budget per case, seconds")
    ap.add_argument("--overlap", choices=OVERLAP_MODES, default="sync",
                    help="the optimizer placement planned and simulated: sync (the default), async or none")
    ap.add_argument("--no-keep-grads", dest="keep_grads", action="store_false",
                    help="plan and simulate a loop with opt.keep_grads = False (no fp32 .grad from the overlap)")
    ap.add_argument("--cases", default=None,
                    help="comma-separated case names to run (default: all)")
    args = ap.parse_args(argv)
    rows, out = [], []
    with tempfile.TemporaryDirectory() as cache:  # fresh: every MIP really solved
        os.environ["MOBIUS_FX_CACHE"] = cache
        for case in CASES:
            if args.cases and case.name not in args.cases.split(","):
                continue
            try:
                r = run_case(case, cache, args.time_limit, args.overlap, args.keep_grads)
            except PlanError as e:  # reported, not fatal: the table shows the other cases
                print(f"{case.name}: the planner failed: {e}", flush=True)
                continue
            out.append(r)
            print(f"{case.name}: {r['seconds']:.1f} s ({r['solver']})", flush=True)
            rows.append([r["case"], r["what"], r["gpus"], r["microbatches"], r["partitions"],
                         f"{list(r['mip_cuts'])} {_ms(r['mip_sim'])}", f"{list(r['best_cuts'])} {_ms(r['best_sim'])}",
                         f"{r['pick_best']:.3f} {_ok(r['pick_best'] <= PICK_BEST)}",
                         f"{r['pred_sim']:.3f} {_ok(PRED_SIM[0] <= r['pred_sim'] <= PRED_SIM[1])}",
                         "yes" if r["above_lb"] else "NO", f"{r['pipe_pred_sim']:.3f}", _ms(r["host_after"])])
    print()
    print(f"MIP pick vs every contiguous partition, simulated (the whole step: fwd+bwd+gradient download and the "
          f"host's optimizer work; fp16 on RTX 3090s; optimizer overlap {args.overlap!r}, "
          f"keep_grads={args.keep_grads}, "
          f"planned and simulated):")
    print(tabulate(rows, headers=["case", "server and batch", "GPUs", "micro-batches", "partitions fitting",
                                  "MIP pick (cuts, sim.)", "best (cuts, sim.)", "pick/best", "pred/sim", ">= LB",
                                  "pipe pred/sim", "host after"]))
    if out:
        worst_pick = max(out, key=lambda r: r["pick_best"])
        worst_pred = max(out, key=lambda r: abs(r["pred_sim"] - 1))
        print(f"worst pick/best: {worst_pick['pick_best']:.3f} ({worst_pick['case']}); target <= {PICK_BEST}")
        print(f"worst pred/sim: {worst_pred['pred_sim']:.3f} ({worst_pred['case']}); target "
              f"{PRED_SIM[0]:.2f}-{PRED_SIM[1]:.2f}")
        fails = [r["case"] for r in out if not (r["pick_best"] <= PICK_BEST and PRED_SIM[0] <= r["pred_sim"] <= PRED_SIM[1])]
        print(f"cases failing a check: {', '.join(fails) if fails else 'none'} ({len(out) - len(fails)} / {len(out)} pass)")
        below = [r["case"] for r in out if not r["above_lb"]]
        print(f"predicted below plan.lower_bound(): {', '.join(below) if below else 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
