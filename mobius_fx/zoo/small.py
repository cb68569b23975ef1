"""Small models of plain layers, each with a shape the planner and the runtime must handle:
`mlp` (an nn.Sequential, the plain fx path), `ResidualMLP` (residual blocks in an
nn.ModuleList), `SkipNet` (a skip across every block: each cut carries two activations) and
`expand16` (a hidden activation 16x the weights: memory is activations, not weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ResidualMLP", "SkipNet", "expand16", "mlp"]


def mlp(widths: list[int] | tuple[int, ...] = (16, 32, 8), *, bias: bool = True) -> nn.Sequential:
    """Linear/ReLU stack: widths (in, h1, ..., out) -> Sequential(Linear, ReLU, ..., Linear)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b, bias=bias))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def expand16(d: int = 8, hidden: int = 128) -> nn.Sequential:
    """A small Linear expanding 16x, then contracting: the hidden activation dwarfs the weights."""
    return nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))


class _ResBlock(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    """inp -> blocks (x + MLP(LN(x))) -> out; the blocks are an nn.ModuleList."""

    def __init__(self, d_in: int = 8, width: int = 16, depth: int = 4, d_out: int = 4, hidden: int | None = None):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList([_ResBlock(width, hidden or 2 * width) for _ in range(depth)])
        self.out = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class SkipNet(nn.Module):
    """A long skip: the stem's output is added back after `depth` blocks, so every cut inside
    the blocks must carry two activations (the running one and the skip)."""

    def __init__(self, d_in: int = 8, width: int = 16, depth: int = 4, d_out: int = 4):
        super().__init__()
        self.stem = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])
        self.head = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        h = s
        for block in self.blocks:
            h = block(h)
        return self.head(h + s)
