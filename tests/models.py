"""A small model zoo for the tests: nothing is downloaded, everything builds from code.

Every builder returns an `nn.Module` in training mode; wrap a call in
`with torch.device("meta"):` to build it without allocating weights (planner-scale tests).

    from tests.models import gpt, gpt_inputs
    with torch.device("meta"):
        model = gpt(hidden=3072, blocks=72, vocab=50257, seq=1024, heads=24)  # ~8.3B, no memory
    (idx,) = gpt_inputs(model, batch=8, device="meta")

| builder | what it exercises |
|---|---|
| `mlp` | nn.Sequential MLP (plain fx path) |
| `GPT` / `gpt` | nanoGPT-style GPT: tied wte/lm_head, a causal mask built with `torch.ones(t, t)` in forward (fx cannot trace it, export can), optional dropout |
| `hf_gpt2`, `hf_llama` | HF `GPT2LMHeadModel` / `LlamaForCausalLM` from tiny configs, `use_cache=False` (export path) |
| `hf_mistral`, `hf_qwen2`, `hf_opt`, `hf_bert`, `hf_t5` | the rest of the HF zoo, 1 layer each (`HF_ZOO`: by name) |
| `ResidualMLP` | a stack of residual MLP blocks in an nn.ModuleList |
| `SkipNet` | a skip connection that crosses several blocks |
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "mlp", "GPTConfig", "GPT", "gpt", "gpt_inputs", "hf_gpt2", "hf_llama", "hf_inputs",
    "hf_mistral", "hf_qwen2", "hf_opt", "hf_bert", "hf_t5", "HF_ZOO",
    "ResidualMLP", "SkipNet", "BranchOnValue", "unique_param_bytes",
]


def unique_param_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters, each tied/shared tensor counted once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedups


# ---------------------------------------------------------------------------- MLP

def mlp(widths: list[int] | tuple[int, ...] = (16, 32, 8), *, bias: bool = True) -> nn.Sequential:
    """Linear/ReLU stack: widths (in, h1, ..., out) -> Sequential(Linear, ReLU, ..., Linear)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b, bias=bias))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


# ---------------------------------------------------------------------------- nanoGPT-style GPT

@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    block_size: int = 16  # longest sequence (positional table size)
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class _CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
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
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = _CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's GPT-2: token + position embedding, pre-LN blocks, tied `lm_head`.

    forward(idx) -> logits (B, T, vocab); with targets -> (logits, loss).
    """

    def __init__(self, cfg: GPTConfig):
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


def gpt(hidden: int = 32, blocks: int = 2, vocab: int = 128, seq: int = 16, heads: int = 2,
        *, dropout: float = 0.0, bias: bool = True) -> GPT:
    """A GPT-3-like nanoGPT model by size; wrap in `torch.device("meta")` for big ones.

    gpt(3072, 72, 50257, 1024, 24) is the ~8.3B model of the planner-scale tests.
    """
    return GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=blocks, n_head=heads,
                         n_embd=hidden, dropout=dropout, bias=bias))


def gpt_inputs(model: GPT, *, batch: int = 2, seq: int | None = None, device: str | torch.device | None = None,
               seed: int = 0) -> tuple[torch.Tensor]:
    """Token ids (batch, seq) for a `GPT` (random, from a private generator)."""
    cfg = model.config
    seq = cfg.block_size if seq is None else seq
    device = device if device is not None else next(model.parameters()).device
    if torch.device(device).type == "meta":
        return (torch.empty(batch, seq, dtype=torch.long, device="meta"),)
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device),)


# ---------------------------------------------------------------------------- HF tiny models

def hf_gpt2(*, layers: int = 2, hidden: int = 32, heads: int = 2, vocab: int = 100, positions: int = 16,
            dropout: float = 0.0):
    """HF GPT2LMHeadModel (tied wte/lm_head) from a tiny config; use_cache=False; eager attention.

    Dropout defaults to 0 (GPT-2's own default is 0.1) so outputs are deterministic in train mode.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=positions,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                     use_cache=False, attn_implementation="eager", bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(cfg)


def hf_llama(*, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2, intermediate: int = 64,
             vocab: int = 100, positions: int = 32):
    """HF LlamaForCausalLM from a tiny config (GQA, RoPE, untied head); use_cache=False."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                      max_position_embeddings=positions, use_cache=False, attn_implementation="eager",
                      bos_token_id=None, eos_token_id=None)
    return LlamaForCausalLM(cfg)


def _hf_decoder(config_cls: str, model_cls: str, *, layers: int, hidden: int, heads: int, kv_heads: int,
                intermediate: int, vocab: int, positions: int):
    import transformers

    cfg = getattr(transformers, config_cls)(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=positions, use_cache=False,
        attn_implementation="eager", bos_token_id=None, eos_token_id=None)
    return getattr(transformers, model_cls)(cfg)


def hf_mistral(*, layers: int = 1, hidden: int = 32, heads: int = 4, kv_heads: int = 2, intermediate: int = 64,
               vocab: int = 100, positions: int = 64):
    """HF MistralForCausalLM from a tiny config (GQA, RoPE, sliding-window attention); use_cache=False."""
    return _hf_decoder("MistralConfig", "MistralForCausalLM", layers=layers, hidden=hidden, heads=heads,
                       kv_heads=kv_heads, intermediate=intermediate, vocab=vocab, positions=positions)


def hf_qwen2(*, layers: int = 1, hidden: int = 32, heads: int = 4, kv_heads: int = 2, intermediate: int = 64,
             vocab: int = 100, positions: int = 64):
    """HF Qwen2ForCausalLM from a tiny config (GQA, RoPE, q/k/v biases); use_cache=False."""
    return _hf_decoder("Qwen2Config", "Qwen2ForCausalLM", layers=layers, hidden=hidden, heads=heads,
                       kv_heads=kv_heads, intermediate=intermediate, vocab=vocab, positions=positions)


def hf_opt(*, layers: int = 1, hidden: int = 32, heads: int = 2, ffn: int = 64, vocab: int = 100, positions: int = 64):
    """HF OPTForCausalLM from a tiny config (learned positions offset by the attention mask); no dropout."""
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_dim=ffn,
                    word_embed_proj_dim=hidden, vocab_size=vocab, max_position_embeddings=positions, dropout=0.0,
                    attention_dropout=0.0, use_cache=False, attn_implementation="eager")
    return OPTForCausalLM(cfg)


def hf_bert(*, layers: int = 1, hidden: int = 32, heads: int = 2, intermediate: int = 64, vocab: int = 100,
            positions: int = 64):
    """HF BertForMaskedLM from a tiny config (bidirectional; at most `positions` tokens); no dropout."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=positions,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return BertForMaskedLM(cfg)


def hf_t5(*, layers: int = 1, hidden: int = 32, heads: int = 4, ffn: int = 64, vocab: int = 100):
    """HF T5ForConditionalGeneration (encoder-decoder, relative positions) from a tiny config; no dropout.
    Called with input_ids and decoder_input_ids, or labels (the decoder input is shifted from them)."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(num_layers=layers, d_model=hidden, d_kv=hidden // heads, num_heads=heads, d_ff=ffn,
                   vocab_size=vocab, dropout_rate=0.0, use_cache=False, attn_implementation="eager",
                   decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(cfg)


# The HF zoo of the call-signature and shape tests: name -> builder of a tiny model (1 layer).
HF_ZOO = {
    "gpt2": lambda: hf_gpt2(layers=1, positions=64), "llama": lambda: hf_llama(layers=1, positions=64),
    "mistral": hf_mistral, "qwen2": hf_qwen2, "opt": hf_opt, "bert": hf_bert, "t5": hf_t5,
}


def hf_inputs(model: nn.Module, *, batch: int = 2, seq: int = 8, seed: int = 0,
              device: str | torch.device | None = None) -> tuple[torch.Tensor]:
    """input_ids (batch, seq) for an HF causal LM (empty on the meta device)."""
    if device is not None and torch.device(device).type == "meta":
        return (torch.empty(batch, seq, dtype=torch.long, device="meta"),)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    return (ids.to(device) if device is not None else ids,)


# ---------------------------------------------------------------------------- residual / skip

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


__all__ += ["BF16_UNIT_ROUNDOFF", "bf16_roundings"]
