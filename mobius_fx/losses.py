"""A chunked cross-entropy: the loss of a language model's logits without their fp32 copy.

`F.cross_entropy(logits.float(), target)` (what HF's `ForCausalLMLoss` and most training loops
compute) holds three vocabulary-sized tensors besides the logits: the fp32 upcast, the fp32
log-softmax it saves for backward and the fp32 gradient. For Llama-8B (vocab 128,256) that is
3 x 4 B x 128,256 ≈ 1.5 MB per token, 12 GiB for a micro-batch of 8 x 1024 tokens. This one
reads the logits in their own dtype a chunk of rows at a time, computes each row's log-sum-exp
in fp32, and saves only the logits (already held) and one fp32 number per row; backward
recomputes each chunk's softmax in fp32 and writes the gradient in the logits' dtype. Peak extra
memory: one chunk (`CHUNK_BYTES` of fp32) instead of three full copies.

Each row's arithmetic is the same as eager's (max-shifted log-sum-exp, minus the target's
logit, in fp32), so the loss equals `F.cross_entropy(logits.float(), target, ...)` to fp32
rounding. Supported: 2-D (rows, classes) logits, integer targets, `ignore_index`, reduction
"mean" | "sum" | "none", no `weight`, no `label_smoothing`; anything else falls back to
`F.cross_entropy` on the fp32 upcast.

    loss = chunked_cross_entropy(logits.view(-1, vocab), labels.view(-1))  # logits bf16 or fp32
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["chunked_cross_entropy", "CHUNK_BYTES"]

CHUNK_BYTES = 1 << 27  # fp32 bytes of one chunk of rows (128 MiB): the extra memory the loss holds at once


def _rows_per_chunk(classes: int) -> int:
    return max(1, CHUNK_BYTES // (4 * max(1, classes)))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                reduction: str) -> torch.Tensor:
        rows, classes = logits.shape
        step = _rows_per_chunk(classes)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)  # (rows,)
        per_row = torch.empty(rows, dtype=torch.float32, device=logits.device)  # (rows,)
        valid = target != ignore_index  # (rows,)
        safe = torch.where(valid, target, torch.zeros_like(target))
        for i in range(0, rows, step):
            x = logits[i:i + step].float()  # (chunk, classes)
            lse[i:i + step] = torch.logsumexp(x, dim=1)
            per_row[i:i + step] = lse[i:i + step] - x.gather(1, safe[i:i + step, None]).squeeze(1)
        per_row = torch.where(valid, per_row, torch.zeros_like(per_row))
        count = valid.sum()
        ctx.save_for_backward(logits, safe, valid, lse, count)
        ctx.reduction = reduction
        if reduction == "none":
            return per_row
        total = per_row.sum()
        return total if reduction == "sum" else total / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        logits, safe, valid, lse, count = ctx.saved_tensors
        rows, classes = logits.shape
        step = _rows_per_chunk(classes)
        if ctx.reduction == "none":
            scale = grad.float() * valid  # (rows,)
        else:
            g = grad.float() / count if ctx.reduction == "mean" else grad.float()
            scale = valid.float() * g  # (rows,)
        out = torch.empty_like(logits)  # (rows, classes), the logits' dtype
        for i in range(0, rows, step):
            p = torch.exp(logits[i:i + step].float() - lse[i:i + step, None])  # softmax, (chunk, classes)
            p.scatter_add_(1, safe[i:i + step, None], torch.full_like(p[:, :1], -1.0))
            out[i:i + step] = p * scale[i:i + step, None]
        return out, None, None, None


def chunked_cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                          ignore_index: int = -100, reduction: str = "mean",
                          label_smoothing: float = 0.0) -> torch.Tensor:
    """`F.cross_entropy(input.float(), target, ...)` computed a chunk of rows at a time in fp32
    (module docstring), its result in fp32."""
    if (weight is not None or label_smoothing or input.dim() != 2 or target.dim() != 1
            or target.is_floating_point() or reduction not in ("mean", "sum", "none")):
        return F.cross_entropy(input.float(), target, weight=weight, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
    return _ChunkedCrossEntropy.apply(input, target, ignore_index, reduction)
