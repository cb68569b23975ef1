"""nanoGPT's GPT-2 as nanoGPT writes it: `transformer.{wte,wpe,h,ln_f}`, a tied `lm_head`, and a
causal mask built with `torch.ones(t, t)` in forward, which fx's symbolic tracer cannot trace and
torch.export can (the hard case for the trace front). Sized by `nanogpt(hidden, blocks, vocab,
seq, heads)`; wrap the call in `with torch.device("meta"):` for planner-scale sizes.

    with torch.device("meta"):
        model = nanogpt(hidden=3072, blocks=72, vocab=50257, seq=1024, heads=24)  # ~8.3B, no memory
    (idx,) = nanogpt_inputs(model, batch=8, device="meta")

For the model of the paper's sizes (SDPA attention, flat names) see `mobius_fx.zoo.gpt.GPT`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NanoGPT", "NanoGPTConfig", "nanogpt", "nanogpt_inputs"]


@dataclass(frozen=True)
class NanoGPTConfig:
    vocab_size: int = 128
    block_size: int = 16  # longest sequence (positional table size)
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class _CausalSelfAttention(nn.Module):
    def __init__(self, cfg: NanoGPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head = cfg.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        # The mask is built from the run-time length: fx's symbolic tracer cannot pass a Proxy
        # to torch.ones, torch.export can. (nanoGPT registers a buffer; this is the hard case.)
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))  # (T, T)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        att = att.masked_fill(~mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class _MLP(nn.Module):
    def __init__(self, cfg: NanoGPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class _Block(nn.Module):
    def __init__(self, cfg: NanoGPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = _CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's GPT-2: token + position embedding, pre-LN blocks, tied `lm_head`.

    forward(idx) -> logits (B, T, vocab); with targets -> (logits, loss).
    """

    def __init__(self, cfg: NanoGPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([_Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        if not any(p.is_meta for p in self.parameters()):
            self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # (B, T, vocab)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def nanogpt(hidden: int = 32, blocks: int = 2, vocab: int = 128, seq: int = 16, heads: int = 2,
            *, dropout: float = 0.0, bias: bool = True) -> NanoGPT:
    """A GPT-3-like nanoGPT model by size; wrap in `torch.device("meta")` for big ones.

    nanogpt(3072, 72, 50257, 1024, 24) is the ~8.3B model of the planner-scale tests.
    """
    return NanoGPT(NanoGPTConfig(vocab_size=vocab, block_size=seq, n_layer=blocks, n_head=heads,
                         n_embd=hidden, dropout=dropout, bias=bias))


def nanogpt_inputs(model: NanoGPT, *, batch: int = 2, seq: int | None = None, device: str | torch.device | None = None,
                   seed: int = 0) -> tuple[torch.Tensor]:
    """Token ids (batch, seq) for a `NanoGPT` (random, from a private generator)."""
    cfg = model.config
    seq = cfg.block_size if seq is None else seq
    device = device if device is not None else next(model.parameters()).device
    if torch.device(device).type == "meta":
        return (torch.empty(batch, seq, dtype=torch.long, device="meta"),)
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device),)
