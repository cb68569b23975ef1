"""Hugging Face models through mobius_fx: tiny GPT-2, Llama, OPT and BERT built from configs.

Each model is traced with torch.export (transformers >= 5 has no fx tracer), compiled into a
Mobius pipeline on 2 virtual GPUs, run for one training step, and its gradients are checked
against eager PyTorch on an identical copy. Nothing is downloaded.

    python examples/hf_models.py
"""

from __future__ import annotations

import os
import sys
import copy

import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

import mobius_fx
from mobius_fx import Topology

VOCAB = 128


def models() -> dict[str, torch.nn.Module]:
    common = dict(vocab_size=VOCAB)
    return {
        "gpt2": tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=4, n_head=2, n_positions=64, use_cache=False,
                                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)),
        "llama": tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                    num_attention_heads=4, num_key_value_heads=2,
                                                    max_position_embeddings=64, use_cache=False, **common)),
        "opt": tf.OPTForCausalLM(tf.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=2,
                                              max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0,
                                              attention_dropout=0.0, use_cache=False, **common)),
        "bert": tf.BertForMaskedLM(tf.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                 num_attention_heads=2, max_position_embeddings=64,
                                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common)),
    }


def check(name: str, model: torch.nn.Module, microbatches: int = 2) -> float:
    """One step through the pipeline vs eager; returns the largest gradient difference."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, 16))  # (batch, seq)
    eager = copy.deepcopy(model)
    model.train(), eager.train()
    logits = eager(input_ids=ids).logits  # (b, t, vocab)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()

    topo = Topology.virtual(gpus=2, memory="8MiB")  # a byte budget per virtual GPU, enforced by the runtime
    pipe = mobius_fx.compile(model, topo, example_inputs=(), example_kwargs={"input_ids": ids},
                             microbatches=microbatches, verbose=False)
    out = pipe(input_ids=ids)
    torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), ids.flatten()).backward()

    worst = 0.0
    eager_params = dict(eager.named_parameters())
    for pname, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager_params[pname].grad, rtol=1e-4, atol=1e-5, msg=f"{name}: {pname}")
        worst = max(worst, (p.grad - eager_params[pname].grad).abs().max().item())
    torch.testing.assert_close(out.logits, logits, rtol=1e-4, atol=1e-5)
    print(f"{name:6s} {pipe.plan.num_stages} stages on {len(topo.gpus)} GPUs, {microbatches} micro-batches: "
          f"outputs and all {len(eager_params)} gradients match eager (max |diff| {worst:.1e})")
    return worst


def main() -> None:
    for name, model in models().items():
        check(name, model)


if __name__ == "__main__":
    main()
