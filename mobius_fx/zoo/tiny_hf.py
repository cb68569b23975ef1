"""Tiny Hugging Face models from configs (nothing is downloaded), `use_cache=False`, eager
attention, no dropout: GPT-2 (tied head), Llama (GQA, RoPE), Mistral (sliding window), Qwen2
(q/k/v biases), OPT (learned positions), BERT (bidirectional) and T5 (encoder-decoder).
`TINY_HF` names a 1-layer builder of each; `hf_inputs` makes token ids for a causal LM.

    model = hf_llama(layers=2)
    (ids,) = hf_inputs(model, batch=4, seq=8)
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TINY_HF", "hf_bert", "hf_gpt2", "hf_inputs", "hf_llama", "hf_mistral", "hf_opt", "hf_qwen2", "hf_t5"]


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


# name -> builder of a tiny model (1 layer): the HF models every call-signature test runs.
TINY_HF = {
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
