"""The command line: `python -m mobius_fx plan ...` and `python -m mobius_fx topology ...`.

    mobius-fx plan --model gpt3-8b --topology mobius-testbed --microbatches 8
    mobius-fx plan --model gpt2 --topology rtx4090x8 --cuts 1,5,9     # a given partition
    mobius-fx plan --model gpt3-15b --topology mobius-testbed --servers 4 --network 100Gbps
    mobius-fx plan --model path/to/config.json --topology rtx4090x8 --master-dtype bf16 --dtype bf16
    mobius-fx topology rtx4090x8
    mobius-fx topology --detect --json server.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from mobius_fx.errors import MobiusError
from mobius_fx.kinds import OVERLAP_DEFAULT, OVERLAP_MODES

__all__ = ["main"]



def _checked(kind: type, ok, rule: str):
    """An argparse `type=` that refuses, before any planning, a value that is not a finite `kind` with `ok(value)`."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not ok(value):
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: it must be {rule}")
        return value
    return parse


def _out_path(text: str) -> str:
    """An argparse `type=` for an output file: refused before planning if it could not be written."""
    path, parent = Path(text), Path(text).parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path, e.g. {str(path / 'out.json')!r}")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the directory {str(parent)!r} does not exist; "
                                         f"create it first or give another path")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {str(path if path.exists() else parent)!r} is not "
                                         f"writable; give a path in a directory you can write to")
    existed = path.exists()
    try:  # what access() cannot tell (/proc, read-only mounts): open it as the write will, then undo
        with open(path, "a"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text!r} ({e.strerror or e}); give a path to a regular file "
                                         f"in a directory you can write to") from None
    if not existed and path.is_file():
        path.unlink()
    return text


def _write(what: str, path: str, write: Callable[[], Any]) -> None:
    """Run `write` (the file at `path`); an OSError (a full disk, /dev/full) becomes a MobiusError."""
    try:
        write()
    except OSError as e:
        raise MobiusError(f"could not write the {what} to {path!r} ({e.strerror or e}); the planning itself "
                          f"succeeded: give another --json/--trace path with space to write to") from None


def _dtype(text: str):
    """An argparse `type=` for --dtype: the torch dtype `text` names (precision.parse_dtype, the one alias
    table), refused before planning when it is not one weights can be streamed in."""
    from mobius_fx.precision import Precision

    try:
        return Precision.check_request(text)
    except MobiusError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _host_fraction(text: str) -> float | None:
    """An argparse `type=` for --host-memory-fraction: a number in (0, 1], or "off" (not checked)."""
    if text.strip().lower() in ("off", "none"):
        return None
    return _checked(float, lambda v: 0 < v <= 1, "a number in (0, 1], or 'off' to plan without checking")(text)


_POSITIVE_INT = _checked(int, lambda v: v > 0, "a positive integer")
_SIZE = _checked(int, lambda v: 0 < v < 2**31, "a positive integer below 2**31")


def _network(text: str) -> float:
    """An argparse `type=` for --network: bytes/s from "100Gbps", "25Gbit/s", "12.5GB/s" (units.parse_network)."""
    from mobius_fx.units import parse_network

    try:
        return parse_network(text, "")
    except MobiusError as e:
        raise argparse.ArgumentTypeError(str(e).strip()) from None


def _cuts(text: str) -> tuple[int, ...]:
    """An argparse `type=` for --cuts "1,5,9" ("" or "none" for one stage), checked as `plan(cuts=)` checks it."""
    from mobius_fx.options import CompileOptions

    parts = [] if text.strip().lower() in ("", "none") else [p.strip() for p in text.split(",")]
    try:
        cuts = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: give comma-separated layer indices, e.g. --cuts 1,5 "
                                         f"(stages [0,1), [1,5), [5,L)), or --cuts none for one stage") from None
    try:
        return CompileOptions(cuts=cuts).cuts
    except MobiusError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    from mobius_fx import zoo
    from mobius_fx.options import CompileOptions
    from mobius_fx.topology.server import Topology

    presets = ", ".join(Topology.PRESETS)
    p = argparse.ArgumentParser(prog="mobius-fx", description=(
        "Plan and inspect Mobius pipelines: fine-tune models larger than your GPUs on one server."))
    sub = p.add_subparsers(dest="command", metavar="{plan,topology}")
    sub.required = True

    pl = sub.add_parser("plan", help="plan a model on a server and compare schedules (no GPU needed)",
                        description="Build the model on the meta device, plan its Mobius pipeline, print the stage "
                                    "and transfer tables, the simulated step time and the schedule comparison.")
    pl.add_argument("--model", required=True, help=f"one of: {', '.join(zoo.model_names())}; or module:factory "
                                                    f"(importable from the current directory); or the path of a "
                                                    f"Hugging Face config.json (or its directory), built on the meta "
                                                    f"device, nothing downloaded")
    pl.add_argument("--topology", required=True, help=f"a preset ({presets}) or a topology JSON file")
    pl.add_argument("--microbatches", default=None,
                    type=_checked(int, lambda v: v > 0, "a positive integer; omit it to let the planner choose"),
                    help="micro-batches per step, dividing --batch (default: the planner chooses among one per GPU "
                         "(or the largest divisor of --batch below the GPU count) and the divisors of --batch near "
                         "2x, 4x, 8x it, by simulated fwd+bwd)")
    pl.add_argument("--cuts", type=_cuts, default=None, metavar="I,J,...",
                    help="plan this partition instead of solving for one: the first layer index of every stage "
                         "after the first, e.g. 1,5 (stages [0,1), [1,5), [5,L)); 'none' is one stage")
    pl.add_argument("--schedule", default=None,
                    help="the registered schedule to run the plan (default: the candidate with the least simulated "
                         "forward + backward that fits; the plan's first line says which and why)")
    pl.add_argument("--batch", type=_SIZE, default=8, help="sequences per step (default 8)")
    pl.add_argument("--seq", type=_SIZE, default=1024, help="tokens per sequence (default 1024)")
    pl.add_argument("--dtype", default="fp16", type=_dtype, metavar="{fp16,bf16,fp32,...}",
                    help="dtype streamed to and computed on the GPUs: a torch dtype name or an alias "
                         "(mobius_fx.precision.DTYPE_ALIASES); the masters keep the model's dtype (fp32) "
                         "(default fp16, as the paper)")
    pl.add_argument("--master-dtype", default=None, type=_dtype, metavar="{fp32,bf16,...}",
                    help="the masters' dtype in host memory (default: the model's own, fp32); bf16 masters halve the "
                         "masters, gradients and optimizer state in the host memory budget")
    from mobius_fx.planning.host_memory import OPTIMIZERS

    pl.add_argument("--optimizer", choices=OPTIMIZERS, default=CompileOptions.optimizer,
                    help=f"the optimizer whose state the host memory budget counts (default "
                         f"{CompileOptions.optimizer}: 2x the trainable masters; sgd-momentum 1x; sgd and none 0)")
    pl.add_argument("--host-memory-fraction", type=_host_fraction, default=CompileOptions.host_memory_fraction,
                    metavar="F",
                    help=f"share of the topology's host DRAM (its JSON's \"host\": {{\"memory\": ...}}) the plan "
                         f"may need, in (0, 1], or 'off' (default {CompileOptions.host_memory_fraction}); a plan "
                         f"needing more is refused, naming the remedies")
    pl.add_argument("--memory-fraction", type=_checked(float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
                    default=CompileOptions.memory_fraction,
                    help=f"share of GPU memory a plan may use, in (0, 1] (default {CompileOptions.memory_fraction})")
    pl.add_argument("--time-limit", type=_checked(float, lambda v: v > 0, "a positive number of seconds"),
                    default=CompileOptions.time_limit,
                    help=f"the MIP's time budget in seconds (default {CompileOptions.time_limit:g})")
    pl.add_argument("--adam-gbps", type=_checked(float, lambda v: v > 0, "a positive number of GB/s; omit it for the measured default"),
                    default=None,
                    help="sustained bandwidth of the CPU optimizer in GB/s (default: the topology's measured host section, "
                         "else a fused AdamW measured on a 16-core H200 host, 111)")
    pl.add_argument("--optimizer-overlap", choices=OVERLAP_MODES, default=OVERLAP_DEFAULT,
                    help="when the CPU optimizer steps in the simulated comparison: per stage as its gradients land "
                         "(sync), a step late (async) or after the step (none); Mobius and RoundPipe (default "
                         f"{OVERLAP_DEFAULT}, as Pipeline.overlap)")
    pl.add_argument("--no-keep-grads", dest="keep_grads", action="store_false",
                    help="plan and simulate a loop that sets opt.keep_grads = False (no fp32 .grad from the overlap: "
                         "4 B per parameter less under sync, no hand-over after the pipeline under async)")
    pl.add_argument("--servers", type=_checked(int, lambda v: v > 0, "a positive integer (servers, 1 or more)"),
                    default=None, metavar="R",
                    help="also simulate R servers running this plan data parallel (each its own slice of an R x "
                         "larger batch, gradients ring all-reduced over --network) and print the cluster table "
                         "for 1, 2, 4, ... R servers")
    pl.add_argument("--network", type=_network, default=None, metavar="BANDWIDTH",
                    help="each server's NIC bandwidth per direction, with --servers: bits or bytes per second, "
                         "e.g. 100Gbps, 25Gbit/s, 12.5GB/s")
    pl.add_argument("--json", metavar="OUT", type=_out_path, help="write the plan as JSON")
    pl.add_argument("--trace", metavar="OUT", type=_out_path,
                    help="write a Chrome/Perfetto trace of the simulated step")
    pl.add_argument("--forward-only", action="store_true",
                    help="plan the model's forward as called (its outputs, e.g. the logits, go to the host); by "
                         "default a language model's training step is planned, the loss on the last stage "
                         "(pipe.train_step): HF models get labels, the zoo's GPT the next-token cross-entropy")
    pl.add_argument("--transfers", action="store_true",
                    help="print every transfer of the plan (the full transfer table, as print(plan) does); by "
                         "default the transfers are summed by kind, phase and link")
    pl.add_argument("--quiet", action="store_true", help="no progress messages")
    pl.add_argument("--no-cache", dest="cache", action="store_false",
                    help="trace and annotate the model anew instead of reading its graph and layer costs from the "
                         "cache ($MOBIUS_FX_CACHE/traces or ~/.cache/mobius_fx/traces; MOBIUS_FX_TRACE_CACHE=0 "
                         "does the same)")

    tp = sub.add_parser("topology", help="print a server topology as a tree",
                        description="Print a topology (preset, JSON file, or detected) as a tree with link "
                                    "bandwidths and GPU memories.")
    tp.add_argument("source", nargs="?", help=f"a preset ({presets}) or a topology JSON file")
    tp.add_argument("--detect", action="store_true", help="detect this machine's GPUs (NVML or nvidia-smi)")
    tp.add_argument("--json", metavar="OUT", type=_out_path, help="write the topology as JSON")
    return p


def _load_topology(source: str):
    from mobius_fx.topology.server import Topology

    if source in Topology.PRESETS:
        return Topology.preset(source)
    if source.endswith(".json") or os.path.exists(source):
        return Topology.from_json(Path(source))
    raise MobiusError(f"{source!r} is neither a topology preset nor an existing file; give a preset "
                      f"({', '.join(Topology.PRESETS)}) or the path of a topology JSON file")


def _cmd_plan(args) -> int:
    from mobius_fx import api, zoo
    from mobius_fx.sim.report import compare

    from mobius_fx.planning.microbatch import check_divides, divisors_near

    if (args.servers is None) != (args.network is None):
        raise MobiusError("--servers R and --network go together: the cluster table needs how many servers and how "
                          "fast each one's NIC is; give both, e.g. --servers 4 --network 100Gbps, or neither")
    topo = _load_topology(args.topology)
    micro = args.microbatches
    if micro is not None:
        check_divides(args.batch, micro, batch=f"--batch {args.batch}",
                      remedy=lambda: (f"give {' or '.join(f'--microbatches {d}' for d in divisors_near(args.batch, micro))}, "
                                      f"a --batch that is a multiple of {micro}, or omit --microbatches (one per GPU, or "
                                      f"the largest divisor of the batch below the GPU count)"))
    t0 = time.perf_counter()
    model, inputs = zoo.build(args.model, batch=args.batch, seq=args.seq, device="meta")
    if args.master_dtype is not None:
        model = model.to(args.master_dtype)  # on the meta device: nothing is allocated
    step = {} if args.forward_only else zoo.step_arguments(model, inputs)
    p = api.plan(model, topo, example_inputs=inputs, microbatches=micro, cuts=args.cuts, **step,
                 dtype=args.dtype, memory_fraction=args.memory_fraction,
                 time_limit=args.time_limit, verbose=not args.quiet, optimizer=args.optimizer,
                 host_memory_fraction=args.host_memory_fraction, cache=args.cache, schedule=args.schedule,
                 optimizer_overlap=args.optimizer_overlap, keep_grads=args.keep_grads)
    print(p.describe("full" if args.transfers else "summary"))
    cmp = compare(p, cpu_adam_bandwidth=args.adam_gbps * 1e9 if args.adam_gbps is not None else None,
                  optimizer_overlap=args.optimizer_overlap, keep_grads=args.keep_grads)
    print()
    print(f"Simulated on {topo.name} ({args.model}, batch {args.batch} x {args.seq} tokens, {p.microbatches} "
          f"micro-batches; CPU optimizer overlap: {args.optimizer_overlap}):")
    print(cmp.table())
    if args.servers is not None:
        from mobius_fx.sim.report import cluster

        cl = cluster(p, args.servers, args.network, tokens=args.batch * args.seq,
                     cpu_adam_bandwidth=args.adam_gbps * 1e9 if args.adam_gbps is not None else None,
                     optimizer_overlap=args.optimizer_overlap, keep_grads=args.keep_grads)
        print()
        print(f"Simulated data parallel, mobius schedule, one server's step among R (batch {args.batch} x {args.seq} "
              f"tokens per server; ring all-reduce per stage over a {args.network * 8 / 1e9:.4g} Gbit/s = "
              f"{args.network / 1e9:.4g} GB/s full-duplex NIC; CPU optimizer overlap: {args.optimizer_overlap}):")
        print(cl.table())
        print("scaling efficiency = throughput_R / (R x throughput_1); step = pipeline + all-reduce exposed + "
              "optimizer")
    if args.json:
        _write("plan", args.json, lambda: p.to_json(args.json))
        print(f"plan written to {args.json}")
    if args.trace:
        _write("trace", args.trace, lambda: cmp.results["mobius"].save_chrome_trace(args.trace))
        print(f"Chrome trace written to {args.trace} (open in ui.perfetto.dev or chrome://tracing)")
    print(f"planned in {time.perf_counter() - t0:.1f} s")
    return 0


def _cmd_topology(args) -> int:
    from mobius_fx.topology.server import Topology

    if args.detect and args.source:
        raise MobiusError(f"both a source ({args.source!r}) and --detect given; give one of them, not both")
    if args.detect:
        topo = Topology.detect()
    elif args.source:
        topo = _load_topology(args.source)
    else:
        raise MobiusError("no topology given; give a preset name, a JSON file or --detect; presets: "
                          + ", ".join(Topology.PRESETS))
    print(topo.tree())
    if args.json:
        def write() -> None:
            with open(args.json, "w") as f:
                f.write(topo.to_json())

        _write("topology", args.json, write)
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
