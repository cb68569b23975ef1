"""Runtime overhead: a Mobius pipeline on virtual GPUs against eager PyTorch doing the same work.

The model is nanoGPT's GPT-2 (`mobius_fx.zoo.nanogpt`: tied embedding / lm_head, ~23M parameters
by default), traced with mobius_fx.trace and cut at block boundaries into 8 stages on 4 virtual
GPUs (stage k on gpu k mod 4). The baseline runs the same stages eagerly, each under
torch.utils.checkpoint (the same recompute in backward) and, for M micro-batches, the same
micro-batches with gradient accumulation. Both run on the CPU with the same thread count, steps
interleaved, median of the timed steps. What the ratio measures is everything the runtime adds:
weight copies in and out of the virtual GPUs (real memcpy), activation copies and offloads,
gradient hand-back into `param.grad`, the autograd Function and book-keeping.

    python benchmarks/runtime_overhead.py                 # M = 1 and M = 4, 5 timed steps each
    python benchmarks/runtime_overhead.py --steps 7 --hidden 512 --blocks 6 --microbatches 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

from mobius_fx import trace  # noqa: E402
from mobius_fx.build import build_pipeline  # noqa: E402
from mobius_fx.module_paths import module_path
from mobius_fx.zoo import nanogpt  # noqa: E402

_COMPUTE = ("call_function", "call_method", "call_module")


def stage_nodes(gm: torch.fx.GraphModule, blocks: int) -> list[list[str]]:
    """Stage 0: embeddings; stage 1+i: block i; last stage: ln_f, lm_head and the loss."""
    stages: list[list[str]] = [[] for _ in range(blocks + 2)]
    current, seen_block = 0, False
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE:
            continue
        path = module_path(node)
        if path.startswith("transformer.h."):
            current, seen_block = 1 + int(path.split(".")[2]), True
        elif seen_block and not path.startswith("transformer.h."):
            current = blocks + 1
        stages[current].append(node.name)
    return stages


def eager_checkpointed(model, idx, targets):
    """NanoGPT.forward (mobius_fx/zoo/nanogpt.py), each pipeline stage under torch.utils.checkpoint."""
    t = idx.size(1)
    tr = model.transformer

    def embed(idx):
        pos = torch.arange(0, t, dtype=torch.long)
        return tr.drop(tr.wte(idx) + tr.wpe(pos))

    def head(x, targets):
        logits = model.lm_head(tr.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    x = checkpoint(embed, idx, use_reentrant=False)
    for block in tr.h:
        x = checkpoint(block, x, use_reentrant=False)
    return checkpoint(head, x, targets, use_reentrant=False)


def eager_step(model, idx, targets, microbatches):
    model.zero_grad(set_to_none=True)
    for i, t in zip(idx.chunk(microbatches), targets.chunk(microbatches)):
        _, loss = eager_checkpointed(model, i, t)
        (loss / microbatches).backward()


def pipe_step(pipe, model, idx, targets):
    model.zero_grad(set_to_none=True)
    _, loss = pipe(idx, targets)
    loss.backward()


def measure(args, microbatches: int) -> float:
    torch.manual_seed(0)
    model = nanogpt(hidden=args.hidden, blocks=args.blocks, vocab=args.vocab, seq=args.seq, heads=args.heads)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    gm = trace(model, example_inputs=(idx, targets))
    nodes = stage_nodes(gm, args.blocks)
    pipe = build_pipeline(model, gm, stage_nodes=nodes, stage_gpus=[f"gpu{k % args.gpus}" for k in range(len(nodes))],
                          gpu_budgets={}, microbatches=microbatches, example_inputs=(idx, targets), device="virtual")
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT {params / 1e6:.1f}M parameters, batch {args.batch}x{args.seq}, {len(nodes)} stages on "
          f"{args.gpus} virtual GPUs, {microbatches} micro-batch(es), {torch.get_num_threads()} threads")
    eager_times, pipe_times = [], []
    runs = {"eager": lambda: eager_step(model, idx, targets, microbatches),
            "pipe": lambda: pipe_step(pipe, model, idx, targets)}
    for rep in range(args.warmup + args.steps):
        took = {}
        for name in (("eager", "pipe") if rep % 2 == 0 else ("pipe", "eager")):  # alternate who goes first
            t0 = time.perf_counter()
            runs[name]()
            took[name] = time.perf_counter() - t0
        if rep >= args.warmup:
            eager_times.append(took["eager"])
            pipe_times.append(took["pipe"])
    e, p = statistics.median(eager_times), statistics.median(pipe_times)
    # Each pipeline step runs right after its eager twin, so a busy machine slows both: the
    # median of the per-pair ratios is the figure least moved by other load.
    ratio = statistics.median(b / a for a, b in zip(eager_times, pipe_times))
    peak = max(s["peak_bytes"] for s in pipe.memory_stats().values())
    def ms(times: list[float]) -> str:
        return ", ".join(f"{t * 1e3:.0f}" for t in times)

    print(f"  eager + per-stage checkpoint: median {e * 1e3:.0f} ms  ({ms(eager_times)})")
    print(f"  mobius_fx pipeline (virtual): median {p * 1e3:.0f} ms  ({ms(pipe_times)})")
    print(f"  ratio pipeline / eager: {ratio:.3f} (median of pairs; of medians {p / e:.3f}); "
          f"largest virtual-GPU peak {peak / 2**20:.1f} MiB")
    return ratio


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ratios = [measure(args, m) for m in args.microbatches]
    print("runtime overhead ratios: " + ", ".join(f"M={m}: {r:.3f}" for m, r in zip(args.microbatches, ratios)))


if __name__ == "__main__":
    main()
