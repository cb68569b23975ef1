"""One rank of the data-parallel tests (tests/unit/test_data_parallel.py), and the training both
the ranks and the single-process reference run.

    python tests/distributed/dp_worker.py --rank R --world W --store FILE --out FILE [--overlap sync]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import mobius_fx  # noqa: E402
from mobius_fx import Topology  # noqa: E402
from mobius_fx.zoo import nanogpt  # noqa: E402

GLOBAL_BATCH, SEQ, STEPS, MICROBATCHES = 12, 8, 5, 2
LR, MOMENTUM = 0.1, 0.9


def build_model(rank: int = 0) -> torch.nn.Module:
    """The test model: tied wte/lm_head, one frozen LayerNorm. Ranks other than 0 start from
    other weights on purpose: compile must broadcast rank 0's."""
    torch.manual_seed(0 if rank == 0 else 100 + rank)
    model = nanogpt(hidden=32, blocks=3, vocab=64, seq=SEQ)
    for p in model.transformer.h[1].ln_1.parameters():
        p.requires_grad_(False)
    return model


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(STEPS)]


def train(model: torch.nn.Module, rank: int, world: int, overlap: str, process_group=None, *, shard: bool = False,
          steps: range = range(STEPS), opt_state: dict | None = None, fail_at: int | None = None,
          report: dict | None = None, save=None, save_after: int | None = None) -> dict:
    """Train `steps` of the common data on this rank's rows; returns the final weights. `report`
    (a dict) receives the optimizer's state_dict, how many parameters this rank stepped, each
    step's loss (`losses`: step -> this rank's loss), and --
    with `fail_at`, on the ranks that did not fail -- the error and whether the weights were
    left as the step before. `save(model, opt_state)` is called once `save_after` steps are done
    (training goes on: the run is both the checkpoint's and the uninterrupted one)."""
    data = batches()
    rows = GLOBAL_BATCH // world
    x0 = data[0][rank * rows:(rank + 1) * rows]
    topo = Topology.virtual(gpus=2, memory=8 * sum(p.numel() * 4 for p in model.parameters()))
    pipe = mobius_fx.compile(model, topo, example_inputs=(x0,), microbatches=MICROBATCHES, cuts=[1, 2, 3],
                             verbose=False, process_group=process_group)
    opt = pipe.overlap(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR,
                                       momentum=MOMENTUM, weight_decay=1e-2), mode=overlap, shard=shard)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    losses = {}
    for t in steps:
        x = data[t][rank * rows:(rank + 1) * rows]
        loss = F.cross_entropy(pipe(x).flatten(0, 1), x.flatten())
        losses[t] = loss.item()
        if t == fail_at:
            if rank == world - 1:
                raise SystemExit(f"rank {rank}: failing on purpose in step {t}")
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            try:
                loss.backward()
            except mobius_fx.MobiusError as e:
                report.update(error=str(e), intact=all(torch.equal(p, before[n]) for n, p in model.named_parameters()),
                              grads_untouched=all(p.grad is None for p in model.parameters()))
                return before
            raise AssertionError("the backward of a step whose peer died did not fail")
        loss.backward()
        opt.step()
        opt.zero_grad()
        if save is not None and t + 1 == save_after:
            if hasattr(opt, "synchronize"):
                opt.synchronize()
            save(model, opt.state_dict())
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    if report is not None:
        report.update(opt_state=opt.state_dict(), owned=getattr(opt, "owned", None), losses=losses)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--overlap", default="none")
    ap.add_argument("--shard", action="store_true")
    ap.add_argument("--steps", type=int, nargs=2, default=(0, STEPS), help="train steps [a, b)")
    ap.add_argument("--resume", help="a checkpoint saved by --save: model and optimizer state")
    ap.add_argument("--save", help="rank 0 saves the model and optimizer state here after training; with --shard "
                                   "each rank saves its share of the optimizer state beside it, in FILE.rank<R>")
    ap.add_argument("--save-after", type=int, help="with --save: save once this many steps are done, and train on")
    ap.add_argument("--fail-at", type=int, help="the last rank exits in this step, after its forward")
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        model = build_model(args.rank)
        opt_state = None
        if args.resume:  # docs/checkpointing.md
            ckpt = torch.load(args.resume)
            model.load_state_dict(ckpt["model"])
            opt_state = torch.load(f"{args.resume}.rank{args.rank}") if args.shard else ckpt["optimizer"]
        report: dict = {}

        def save(model: torch.nn.Module, state: dict) -> None:
            if args.shard:  # each rank holds the optimizer state of its own share of the parameters
                torch.save(state, f"{args.save}.rank{args.rank}")
            if args.rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": None if args.shard else state}, args.save)

        weights = train(model, args.rank, args.world, args.overlap, shard=args.shard, steps=range(*args.steps),
                        opt_state=opt_state, fail_at=args.fail_at, report=report,
                        save=save if args.save and args.save_after is not None else None, save_after=args.save_after)
        if args.save and args.save_after is None:
            save(model, report["opt_state"])
        torch.save({"weights": weights, **{k: v for k, v in report.items() if k != "opt_state"},
                    "state_entries": len(report.get("opt_state", {}).get("state", {}))}, args.out)
        if args.fail_at is not None:  # a survivor whose peer died: its process group cannot be torn down,
            sys.stdout.flush()        # and gloo's threads abort the interpreter's exit now and then
            sys.stderr.flush()        # ("terminate called without an active exception"): leave at once
            os._exit(0)
    finally:
        if args.fail_at is None:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
