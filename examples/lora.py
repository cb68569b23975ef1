"""LoRA-style fine-tuning: frozen base weights, small trainable adapters.

The base model's weights have requires_grad=False: the pipeline fetches them to the GPUs
but never sends a gradient back; only the adapters get `.grad` and optimizer steps.

    python examples/lora.py
"""

from __future__ import annotations

import os
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

import mobius_fx
from mobius_fx import Topology
from mobius_fx.zoo import GPT, GPTConfig


class LoRALinear(nn.Module):
    """y = base(x) + (x A^T) B^T * scale, with base frozen and B zero-initialised."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) / rank)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.a), self.b) * self.scale


def add_lora(model: GPT, rank: int = 4) -> list[nn.Parameter]:
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.h:
        block.attn.qkv = LoRALinear(block.attn.qkv, rank)
        block.attn.proj = LoRALinear(block.attn.proj, rank)
    return [p for p in model.parameters() if p.requires_grad]


def main() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, seq=32, hidden=64, blocks=4, heads=2))
    adapters = add_lora(model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    total = sum(p.numel() for p in model.parameters())
    print(f"{total / 1e3:.0f}K parameters, {sum(p.numel() for p in adapters) / 1e3:.1f}K trainable (adapters)")

    x = torch.randint(0, 256, (8, 32))  # (batch, seq)
    y = torch.roll(x, -1, dims=1)
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="8MiB"), example_inputs=(x,),
                             microbatches=2, verbose=False)
    opt = torch.optim.AdamW(adapters, lr=1e-2)
    for step in range(1, 31):
        loss = F.cross_entropy(pipe(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item():.3f}")

    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert all(model.get_parameter(n).grad is None for n in frozen), "a frozen weight got a gradient"
    assert all(torch.equal(model.get_parameter(n), base[n]) for n in frozen), "a frozen weight changed"
    stats = pipe.transfer_stats(last_step=True)
    sent_back = sum(v["bytes"] for gpu in stats.values() for k, v in gpu.items() if k.startswith("gradient"))
    uploaded = sum(v["bytes"] for gpu in stats.values() for k, v in gpu.items() if k.startswith("weight"))
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapters)
    assert sent_back == adapter_bytes, (sent_back, adapter_bytes)
    print(f"last step: {uploaded / 1e3:.0f} KB of weights fetched to the GPUs, {sent_back / 1e3:.1f} KB of gradients "
          f"sent back (= the adapters' {adapter_bytes / 1e3:.1f} KB)")
    print(f"{len(frozen)} frozen tensors: no .grad, unchanged, never sent back")


if __name__ == "__main__":
    main()
