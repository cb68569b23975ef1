"""Fine-tune a small GPT on real text through a Mobius pipeline — the README's main job.

By default: a byte-level GPT with tied embeddings, 4 virtual GPUs on the CPU (each with a
byte budget the runtime enforces; every stage is uploaded, used and evicted), English prose from the
Python standard library's docstrings (no download), AdamW on the CPU master weights.

    python examples/finetune_gpt.py                       # about two minutes on 2 cores
    python examples/finetune_gpt.py --data my.txt --steps 500 --topology virtual:8
    python examples/finetune_gpt.py --topology server.json   # a real server (CUDA)
    python examples/finetune_gpt.py --optimizer-overlap async  # RoundPipe's one-step-late update

The optimizer runs through `pipe.overlap(opt, mode)`: "sync" (the default) steps each stage's
parameters on a CPU worker as soon as its gradients are complete during backward -- the same
weights as stepping after backward, bit for bit; "async" runs step t's update while step t+1
computes on weights one update old; "none" steps serially after backward.

On several servers, launch one process per server with torchrun (each trains the same plan on
its own batches of --batch rows; gradients are averaged as each stage's are complete):

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 --master-addr HOST0 --master-port 29500 \
        examples/finetune_gpt.py --topology server.json      # on HOST0; --node-rank 1 on the other
    torchrun --standalone --nproc-per-node 2 examples/finetune_gpt.py --steps 50   # try it on one machine
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

import mobius_fx  # noqa: E402
from corpus import load_text  # noqa: E402
from mobius_fx import Topology  # noqa: E402
from mobius_fx.zoo import GPT, GPTConfig  # noqa: E402


def _topology(spec: str, model_bytes: int) -> Topology:
    if spec.startswith("virtual:"):
        gpus = int(spec.split(":", 1)[1])
        # Each virtual GPU gets a budget of twice the model's weights, which the planner's
        # conservative memory model (two stages' weights, gradients, working memory and
        # boundary activations) needs; Mobius streams every stage in and out regardless.
        return Topology.virtual(gpus=gpus, memory=2 * model_bytes, root_complexes=2 if gpus > 2 else 1)
    if spec.endswith(".json"):
        return Topology.from_json(spec)
    return Topology.preset(spec)


@torch.no_grad()
def sample(model: GPT, prompt: bytes, n: int, seq: int, temperature: float = 0.8) -> str:
    model.eval()
    idx = torch.tensor([list(prompt)], dtype=torch.long)  # (1, t)
    for _ in range(n):
        logits = model(idx[:, -seq:])[:, -1, :] / temperature  # (1, vocab)
        idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
    model.train()
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="a UTF-8 text file (default: the standard library's docstrings)")
    ap.add_argument("--topology", default="virtual:4", help="virtual:N, a preset name, or a topology JSON file")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--progress-every", type=float, default=10.0,
                    help="when stderr is not a terminal (a log file or a pipe: no progress bar shows there), a "
                         "progress line every this many seconds (default 10; 0: none)")
    ap.add_argument("--transfers", action="store_true",
                    help="print every transfer of the plan (default: summed by kind, phase and link)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optimizer-overlap", choices=("sync", "async", "none"), default="sync",
                    help="when the CPU optimizer steps: during backward, stage by stage (sync, exact), one step late "
                         "(async) or after backward (none)")
    ap.add_argument("--shard", action="store_true",
                    help="under torchrun: each process keeps optimizer state for and steps 1/R of the parameters")
    args = ap.parse_args(argv)

    world, rank, gen = int(os.environ.get("WORLD_SIZE", "1")), 0, None
    if world > 1:  # launched by torchrun: data parallel over the processes (gloo: the masters are on the CPU)
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)
    text = load_text(data=args.data)
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()  # (n_bytes,)
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    say(f"corpus: {len(data) / 1e3:.0f} KB of text ({'--data ' + args.data if args.data else 'stdlib docstrings'})")

    model = GPT(GPTConfig(vocab=256, seq=args.seq, hidden=args.hidden, blocks=args.blocks,
                          heads=max(1, args.hidden // 32)))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    topo = _topology(args.topology, model_bytes)

    def batch(src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.randint(0, len(src) - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([src[j:j + args.seq] for j in i.tolist()])  # (b, t)
        y = torch.stack([src[j + 1:j + args.seq + 1] for j in i.tolist()])  # (b, t)
        return x, y

    x0, _ = batch(train)
    pipe = mobius_fx.compile(model, topo, example_inputs=(x0,), microbatches=args.microbatches, verbose=False)
    say(pipe.plan.describe("full" if args.transfers else "summary"))  # print(pipe.plan): both full tables
    say()
    if world > 1:
        say(f"data parallel: {world} processes, {args.batch} rows each ({world * args.batch} per step), gradients "
            f"averaged per stage{'; optimizer sharded' if args.shard else ''}")
    # CPU masters, plain torch.optim, stepped off the pipeline's critical path
    opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=args.lr), mode=args.optimizer_overlap,
                       shard=args.shard)
    say(f"optimizer: AdamW on the CPU masters, overlap mode {args.optimizer_overlap!r}"
          + {"sync": " (stages stepped during backward; exact)", "async": " (one step late, as RoundPipe)",
             "none": " (serial, after backward)"}[args.optimizer_overlap])

    @torch.no_grad()
    def val_loss() -> float:
        x, y = batch(val)
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()

    first = val_loss()
    say(f"step 0: validation loss {first:.3f} (model {model_bytes / 2**20:.1f} MiB, "
          f"{len(topo.gpus)} GPUs of {topo.gpus[0].memory / 2**20:.1f} MiB)")
    t0 = time.perf_counter()
    # disable=None: a live bar on a terminal, none in logs (the loss lines still print)
    bar = tqdm(range(1, args.steps + 1), desc="fine-tuning", unit="step", dynamic_ncols=True,
               disable=None if rank == 0 else True)
    lines = rank == 0 and args.progress_every > 0 and not sys.stderr.isatty()  # no bar: a line every so often
    last_line = t0
    for step in bar:
        x, y = batch(train)
        logits = pipe(x)  # (b, t, vocab), streamed through the pipeline
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if lines and time.perf_counter() - last_line >= args.progress_every and step < args.steps:
            last_line = time.perf_counter()
            per = (last_line - t0) / step
            print(f"step {step}/{args.steps}: train loss {loss.item():.3f}, {per:.2f} s/step, about "
                  f"{per * (args.steps - step):.0f} s left", flush=True)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            tqdm.write(f"step {step}: train loss {loss.item():.3f}, validation loss {val_loss():.3f}")
    if args.optimizer_overlap == "async":
        opt.synchronize()  # the last update into the model before evaluating it
    last = val_loss()
    elapsed = time.perf_counter() - t0
    peak = max(s["peak_bytes"] for s in pipe.memory_stats().values())
    say(f"validation loss {first:.3f} -> {last:.3f} ({(first - last) / first:.0%} lower) in {elapsed:.0f} s; "
        f"peak per-GPU memory {peak / 2**20:.1f} MiB of {topo.gpus[0].memory / 2**20:.1f} MiB")
    if rank == 0:
        print("sample:", repr(sample(model, b"The ", 200, args.seq)))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
