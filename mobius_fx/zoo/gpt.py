"""A nanoGPT-style decoder (GPT-2/GPT-3 architecture) sized by its config: the model of the
Mobius paper's sizes (`named.MODELS` "gpt3-3b/8b/15b"), of the examples and of most tests.

Attention is `F.scaled_dot_product_attention` (causal), so both fx and export trace it.

    model = GPT(GPTConfig(vocab=256, seq=32, hidden=64, blocks=4, heads=2))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 50257
    seq: int = 1024
    hidden: int = 768
    blocks: int = 12
    heads: int = 12
    dropout: float = 0.0
    tied: bool = True


class _Attention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.qkv = nn.Linear(c.hidden, 3 * c.hidden)
        self.proj = nn.Linear(c.hidden, c.hidden)
        self.dropout = c.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)  # 3 x (b, t, c)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))  # (b, h, t, d)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)  # (b, h, t, d)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))  # (b, t, c)


class _Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.hidden)
        self.attn = _Attention(c)
        self.ln_2 = nn.LayerNorm(c.hidden)
        self.mlp = nn.Sequential(nn.Linear(c.hidden, 4 * c.hidden), nn.GELU(), nn.Linear(4 * c.hidden, c.hidden),
                                 nn.Dropout(c.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A nanoGPT-style decoder (GPT-2/GPT-3 architecture) with tied embedding and head.

    `forward(idx)` takes token ids (batch, seq) and returns logits (batch, seq, vocab).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.hidden)
        self.wpe = nn.Embedding(config.seq, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(_Block(config) for _ in range(config.blocks))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        if config.tied:
            self.lm_head.weight = self.wte.weight
        if not any(p.is_meta for p in self.parameters()):
            self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)  # (t,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (b, t, c)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (b, t, vocab)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def next_token_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The language-model loss of `GPT`'s logits (b, t, vocab) on token ids `idx` (b, t): each
    position predicts the next token; mean cross-entropy over the b x (t - 1) predictions."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())  # (b*(t-1), vocab), (b*(t-1),)
