"""The command line: `python -m mobius_fx plan ...` and `python -m mobius_fx topology ...`.

    mobius-fx plan --model gpt3-8b --topology mobius-testbed --microbatches 8
    mobius-fx topology rtx4090x8
    mobius-fx topology --detect --json server.json
"""

from __future__ import annotations

import argparse
import sys
import time

from .errors import MobiusError

__all__ = ["main"]

_DTYPES = {"fp32": None, "float32": None, "fp16": "float16", "float16": "float16", "bf16": "bfloat16",
           "bfloat16": "bfloat16"}


def _parser() -> argparse.ArgumentParser:
    from . import zoo
    from .topology import Topology

    presets = ", ".join(Topology.PRESETS)
    p = argparse.ArgumentParser(prog="mobius-fx", description=(
        "Plan and inspect Mobius pipelines: fine-tune models larger than your GPUs on one server."))
    sub = p.add_subparsers(dest="command", metavar="{plan,topology}")
    sub.required = True

    pl = sub.add_parser("plan", help="plan a model on a server and compare schedules (no GPU needed)",
                        description="Build the model on the meta device, plan its Mobius pipeline, print the stage "
                                    "and transfer tables, the simulated step time and the schedule comparison.")
    pl.add_argument("--model", required=True, help=f"one of: {', '.join(zoo.model_names())}; or module:factory")
    pl.add_argument("--topology", required=True, help=f"a preset ({presets}) or a topology JSON file")
    pl.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default: one per GPU)")
    pl.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    pl.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    pl.add_argument("--dtype", default="fp16", choices=sorted(_DTYPES),
                    help="dtype streamed to and computed on the GPUs; masters stay fp32 (default fp16, as the paper)")
    pl.add_argument("--memory-fraction", type=float, default=0.9, help="share of GPU memory a plan may use")
    pl.add_argument("--time-limit", type=float, default=20.0, help="the MIP's time budget in seconds (default 20)")
    pl.add_argument("--adam-gbps", type=float, default=None,
                    help="sustained bandwidth of the CPU optimizer in GB/s (default: a plain torch.optim.Adam, 20)")
    pl.add_argument("--json", metavar="OUT", help="write the plan as JSON")
    pl.add_argument("--trace", metavar="OUT", help="write a Chrome/Perfetto trace of the simulated step")
    pl.add_argument("--quiet", action="store_true", help="no progress messages")

    tp = sub.add_parser("topology", help="print a server topology as a tree",
                        description="Print a topology (preset, JSON file, or detected) as a tree with link "
                                    "bandwidths and GPU memories.")
    tp.add_argument("source", nargs="?", help=f"a preset ({presets}) or a topology JSON file")
    tp.add_argument("--detect", action="store_true", help="detect this machine's GPUs (NVML or nvidia-smi)")
    tp.add_argument("--json", metavar="OUT", help="write the topology as JSON")
    return p


def _load_topology(source: str):
    from .topology import Topology

    if source.endswith(".json"):
        return Topology.from_json(source)
    return Topology.preset(source)


def _cmd_plan(args) -> int:
    import torch

    from . import api, zoo
    from .report import compare

    topo = _load_topology(args.topology)
    micro = args.microbatches or len(topo.gpus)
    t0 = time.perf_counter()
    model, inputs = zoo.build(args.model, batch=args.batch, seq=args.seq, device="meta")
    dtype = _DTYPES[args.dtype]
    p = api.plan(model, topo, example_inputs=inputs, microbatches=micro,
                 dtype=getattr(torch, dtype) if dtype else None, memory_fraction=args.memory_fraction,
                 time_limit=args.time_limit, verbose=not args.quiet)
    print(p)
    cmp = compare(p, cpu_adam_bandwidth=args.adam_gbps * 1e9 if args.adam_gbps else None)
    print()
    print(f"Simulated on {topo.name} ({args.model}, batch {args.batch} x {args.seq} tokens, {micro} micro-batches):")
    print(cmp.table())
    if args.json:
        p.to_json(args.json)
        print(f"plan written to {args.json}")
    if args.trace:
        cmp.results["mobius"].save_chrome_trace(args.trace)
        print(f"Chrome trace written to {args.trace} (open in ui.perfetto.dev or chrome://tracing)")
    print(f"planned in {time.perf_counter() - t0:.1f} s")
    return 0


def _cmd_topology(args) -> int:
    from .topology import Topology

    if args.detect:
        topo = Topology.detect()
    elif args.source:
        topo = _load_topology(args.source)
    else:
        print("give a preset name, a JSON file or --detect; presets: " + ", ".join(Topology.PRESETS), file=sys.stderr)
        return 2
    print(topo.tree())
    if args.json:
        with open(args.json, "w") as f:
            f.write(topo.to_json())
        print(f"topology written to {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"plan": _cmd_plan, "topology": _cmd_topology}[args.command](args)
    except MobiusError as e:
        print(f"mobius-fx: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
