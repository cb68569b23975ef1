"""Test-only models and helpers; the models the tests share with the benchmarks and examples
live in the package's zoo (`mobius_fx.zoo`: `nanogpt`, `mlp`, `ResidualMLP`, `SkipNet`, the
tiny HF models, `training_cases`).

| name | what it is for |
|---|---|
| `BranchOnValue` | a branch on a tensor's value: neither fx nor export can capture it (the trace error) |
| `unique_param_bytes` | a model's parameter bytes, tied tensors once |
| `bf16_roundings`, `BF16_UNIT_ROUNDOFF` | the bf16 error bound the mixed-precision tests derive their tolerances from |
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BranchOnValue", "unique_param_bytes", "BF16_UNIT_ROUNDOFF", "bf16_roundings"]


def unique_param_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters, each tied/shared tensor counted once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedups


class BranchOnValue(nn.Module):
    """Takes a branch on a tensor's value: neither fx nor export (non-strict) can capture it."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:
            return self.a(x)
        return self.b(x)


# ---------------------------------------------------------------------------- reduced-precision error

BF16_UNIT_ROUNDOFF = torch.finfo(torch.bfloat16).eps / 2  # 2**-8: bf16 keeps 8 significant bits (7 stored)


def bf16_roundings(model: nn.Module, microbatches: int = 1) -> int:
    """Roundings to bf16 on the longest path from the input to a weight gradient, when the
    weights, activations and gradients of `model` are bf16 (autocast and bf16 weight copies):

    - a leaf module with weights (Linear, HF Conv1D, Embedding): its weight, its output, its
      input-gradient and its weight-gradient (4); a LayerNorm: weight, output, input-gradient (3,
      its reductions run in fp32);
    - a leaf without weights (activation, dropout): its output and its input-gradient (2);
    - an attention module's functional part (q k^T, softmax, times v): 6;
    - summing the micro-batches' gradients in bf16: M - 1.

    First order these relative errors (each at most `BF16_UNIT_ROUNDOFF`) add up, the layers'
    Jacobians being O(1) at default init: ||g_bf16 - g_fp32|| <= roundings * u * ||g_fp32||.
    Functional ops of a model's own forward (e.g. GELUs written as F.gelu) are not counted.
    """
    count = microbatches - 1
    for m in model.modules():
        if "Attention" in type(m).__name__:
            count += 6
        if list(m.children()):
            continue
        if isinstance(m, nn.LayerNorm):
            count += 3
        elif any(True for _ in m.parameters(recurse=False)):
            count += 4
        else:
            count += 2
    return count

