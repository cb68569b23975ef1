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
from tests.models import gpt  # noqa: E402

GLOBAL_BATCH, SEQ, STEPS, MICROBATCHES = 12, 8, 5, 2
LR, MOMENTUM = 0.1, 0.9


def build_model(rank: int = 0) -> torch.nn.Module:
    """The test model: tied wte/lm_head, one frozen LayerNorm. Ranks other than 0 start from
    other weights on purpose: compile must broadcast rank 0's."""
    torch.manual_seed(0 if rank == 0 else 100 + rank)
    model = gpt(hidden=32, blocks=3, vocab=64, seq=SEQ)
    for p in model.transformer.h[1].ln_1.parameters():
        p.requires_grad_(False)
    return model


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(STEPS)]


def train(model: torch.nn.Module, rank: int, world: int, overlap: str, process_group=None) -> dict:
    data = batches()
    rows = GLOBAL_BATCH // world
    x0 = data[0][rank * rows:(rank + 1) * rows]
    topo = Topology.virtual(gpus=2, memory=8 * sum(p.numel() * 4 for p in model.parameters()))
    pipe = mobius_fx.compile(model, topo, example_inputs=(x0,), microbatches=MICROBATCHES, cuts=[1, 2, 3],
                             verbose=False, process_group=process_group)
    opt = pipe.overlap(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR,
                                       momentum=MOMENTUM, weight_decay=1e-2), mode=overlap)
    for x in data:
        x = x[rank * rows:(rank + 1) * rows]
        F.cross_entropy(pipe(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--overlap", default="none")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        weights = train(build_model(args.rank), args.rank, args.world, args.overlap)
        torch.save(weights, args.out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
