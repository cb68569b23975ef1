"""Cold and warm `plan` of a named model, each in a fresh process, with an empty cache first.

    python benchmarks/compile_cache.py --model llama3-70b          # Llama-3-70B from its config, meta device
    python benchmarks/compile_cache.py --model gpt3-8b --topology mobius-testbed

The cold run traces, annotates and solves the MIP; the warm run (a new process, as a resumed job
is) reads the traced graph and the layer costs from the trace cache and the cuts from the plan
cache (mobius_fx/compile_cache.py). Each run prints where its time went (building the model on
the meta device, then each pass); the last line is warm / cold. Times depend on the machine's
load: compare the two within one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LLAMA3_70B = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                  intermediate_size=28672, vocab_size=128256, rope_theta=500000.0)


def llama3_70b(*, batch: int, seq: int, device: str):
    """Llama-3-70B from its Hugging Face config (hidden 8192, 80 layers, 64 heads, 8 KV heads,
    MLP 28672, vocab 128256) and token ids; nothing is downloaded."""
    import transformers as tf

    config = tf.LlamaConfig(max_position_embeddings=max(seq, 8192), use_cache=False, **LLAMA3_70B)
    with torch.device(device):
        model = tf.LlamaForCausalLM(config)
    return model, (torch.zeros(batch, seq, dtype=torch.long, device=device),)


def one_run(args) -> dict:
    """Build the model on the meta device and plan it; the seconds of each step."""
    from mobius_fx import zoo
    from mobius_fx.api import _run
    from mobius_fx.compiler import default_pipeline

    t0 = time.perf_counter()
    name = "__main__:llama3_70b" if args.model == "llama3-70b" else args.model
    model, inputs = zoo.build(name, batch=args.batch, seq=args.seq, device="meta")
    built = time.perf_counter() - t0
    t1 = time.perf_counter()
    ctx = _run(default_pipeline().until("plan"), model=model, topology=args.topology, example_inputs=inputs,
               example_kwargs=None, dtype=torch.float16, cache_dir=args.cache_dir, cache=True, verbose=False,
               host_memory_fraction=None)  # fp32 masters + AdamW of a 70B do not fit the preset's host: timed anyway
    info = ctx.gm.meta["mobius_trace"]
    return {"build": built, **ctx.timings, "plan total": time.perf_counter() - t1, "nodes": len(ctx.gm.graph.nodes),
            "stages": len(ctx.plan.stages), "trace cached": info.cached, "front end": info.front_end,
            "cuts": list(ctx.plan.boundaries) if hasattr(ctx.plan, "boundaries") else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-70b", help="llama3-70b, a zoo name or module:factory")
    p.add_argument("--topology", default="rtx4090x8")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--cache-dir", default=None, help="(default: a fresh temporary directory)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_run(args)))
        return
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="mobius_fx_cache_")
    runs = {}
    for label in ("cold", "warm"):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--model", args.model, "--topology",
               args.topology, "--batch", str(args.batch), "--seq", str(args.seq), "--cache-dir", cache_dir]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs[label] = {**json.loads(out.strip().splitlines()[-1]), "process": time.perf_counter() - t0}
    cold, warm = runs["cold"], runs["warm"]
    print(f"{args.model} on {args.topology}, batch {args.batch} x {args.seq}, cache {cache_dir}")
    print(f"{'step':<14}{'cold s':>10}{'warm s':>10}")
    for step in ("build", "trace", "annotate", "partition", "plan", "plan total", "process"):
        print(f"{step:<14}{cold[step]:>10.2f}{warm[step]:>10.2f}")
    print(f"nodes {cold['nodes']} ({cold['front end']}), stages {cold['stages']}; warm trace cached: "
          f"{warm['trace cached']}; same cuts: {cold['cuts'] == warm['cuts']}")
    print(f"warm / cold (plan total): {warm['plan total'] / cold['plan total']:.3f}; "
          f"(whole process): {warm['process'] / cold['process']:.3f}")


if __name__ == "__main__":
    main()
