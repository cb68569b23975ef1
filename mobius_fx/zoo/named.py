"""The models the CLI and the paper benchmarks plan, by name, at full size (on the meta device).

`build(name, *, batch, seq, device="meta")` returns `(model, example_inputs)`. Names cover
GPT-2 (small..xl, Hugging Face configs), GPT-3-like 3B/8B/15B (the Mobius paper's sizes,
our nanoGPT-style `GPT`), Llama-like 7B/8B/13B, Llama-3-70B, Qwen2.5-72B and OPT-like 1.3B/6.7B
(Hugging Face configs). Users plan their own model with a `module:factory` spec (`module`
importable from the current directory): `factory(batch=, seq=, device=)` returning
`(model, example_inputs)` or just a model (then the inputs are token ids); or with the path of a
Hugging Face `config.json` (or of the directory holding it): the model is built from the config by
`AutoModelForCausalLM.from_config` on the meta device, nothing is downloaded.

    model, inputs = zoo.build("gpt3-8b", batch=8, seq=1024)   # on the meta device
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from mobius_fx.errors import MobiusError
from mobius_fx.zoo.gpt import GPT, GPTConfig

__all__ = ["MODELS", "build", "model_names", "step_arguments"]


def _gpt(hidden: int, blocks: int, heads: int) -> Callable[..., nn.Module]:
    def make(*, seq: int) -> nn.Module:
        return GPT(GPTConfig(hidden=hidden, blocks=blocks, heads=heads, seq=max(seq, 1024)))
    return make


def _hf(kind: str, **cfg) -> Callable[..., nn.Module]:
    def make(*, seq: int) -> nn.Module:
        import transformers as tf

        if kind == "gpt2":
            config = tf.GPT2Config(n_positions=max(seq, 1024), use_cache=False, **cfg)
            return tf.GPT2LMHeadModel(config)
        if kind == "llama":
            config = tf.LlamaConfig(max_position_embeddings=max(seq, 2048), use_cache=False, **cfg)
            return tf.LlamaForCausalLM(config)
        if kind == "qwen2":
            config = tf.Qwen2Config(max_position_embeddings=max(seq, 32768), use_cache=False, **cfg)
            return tf.Qwen2ForCausalLM(config)
        if kind == "opt":
            config = tf.OPTConfig(max_position_embeddings=max(seq, 2048), use_cache=False, **cfg)
            return tf.OPTForCausalLM(config)
        raise AssertionError(kind)
    return make


MODELS: dict[str, tuple[str, Callable[..., nn.Module]]] = {
    "gpt2": ("GPT-2 small, 124M (HF GPT2Config)", _hf("gpt2", n_embd=768, n_layer=12, n_head=12)),
    "gpt2-medium": ("GPT-2 medium, 355M", _hf("gpt2", n_embd=1024, n_layer=24, n_head=16)),
    "gpt2-large": ("GPT-2 large, 774M", _hf("gpt2", n_embd=1280, n_layer=36, n_head=20)),
    "gpt2-xl": ("GPT-2 XL, 1.5B", _hf("gpt2", n_embd=1600, n_layer=48, n_head=25)),
    "gpt3-3b": ("GPT-3-like 2.7B: hidden 2560, 32 blocks (Mobius paper sizes)", _gpt(2560, 32, 32)),
    "gpt3-8b": ("GPT-3-like 8.3B: hidden 3072, 72 blocks", _gpt(3072, 72, 24)),
    "gpt3-15b": ("GPT-3-like 15.8B: hidden 4096, 78 blocks", _gpt(4096, 78, 32)),
    "llama-7b": ("Llama-like 7B: hidden 4096, 32 layers, MLP 11008, vocab 32000", _hf(
        "llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, num_attention_heads=32,
        vocab_size=32000)),
    "llama-8b": ("Llama-3.1-8B-like: hidden 4096, 32 layers, MLP 14336, vocab 128256, 8 KV heads", _hf(
        "llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256)),
    "llama-13b": ("Llama-like 13B: hidden 5120, 40 layers, MLP 13824", _hf(
        "llama", hidden_size=5120, num_hidden_layers=40, intermediate_size=13824, num_attention_heads=40,
        vocab_size=32000)),
    "llama-70b": ("Llama-3-70B-like: hidden 8192, 80 layers, MLP 28672, vocab 128256, 8 KV heads", _hf(
        "llama", hidden_size=8192, num_hidden_layers=80, intermediate_size=28672, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5)),
    "qwen2.5-72b": ("Qwen2.5-72B-like: hidden 8192, 80 layers, MLP 29568, vocab 152064, 8 KV heads", _hf(
        "qwen2", hidden_size=8192, num_hidden_layers=80, intermediate_size=29568, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=152064, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    "opt-1.3b": ("OPT-like 1.3B: hidden 2048, 24 layers", _hf(
        "opt", hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32, vocab_size=50272,
        word_embed_proj_dim=2048)),
    "opt-6.7b": ("OPT-like 6.7B: hidden 4096, 32 layers", _hf(
        "opt", hidden_size=4096, num_hidden_layers=32, ffn_dim=16384, num_attention_heads=32, vocab_size=50272,
        word_embed_proj_dim=4096)),
}


def model_names() -> list[str]:
    return list(MODELS)


def build(name: str, *, batch: int = 8, seq: int = 1024, device: str | torch.device = "meta"):
    """(model, example_inputs) for a zoo name, a `module:factory` spec or the path of a Hugging Face
    `config.json` (or its directory), on `device`."""
    with torch.device(device):
        if is_config_path(name):
            out = from_config(name, seq=seq)
        elif ":" in name:
            out = _factory(name)(batch=batch, seq=seq, device=device)
            if not (isinstance(out, nn.Module) or (isinstance(out, tuple) and len(out) == 2 and isinstance(
                    out[0], nn.Module) and isinstance(out[1], (tuple, list, torch.Tensor)))):
                raise MobiusError(f"the model factory {name!r} returned {_describe(out)}; {_FACTORY}")
        else:
            if name not in MODELS:
                raise MobiusError(f"unknown model {name!r}; known models: {', '.join(MODELS)}; "
                                  f"or give your own as module:factory, or the path of a Hugging Face config.json")
            out = MODELS[name][1](seq=seq)
        if isinstance(out, tuple):
            return out
        vocab = _vocab(out)
        idx = torch.randint(0, vocab, (batch, seq)) if str(device) != "meta" else torch.zeros(batch, seq, dtype=torch.long)
        return out, (idx,)


_FACTORY = ("a model factory is a function `factory(*, batch, seq, device)` returning `(model, example_inputs)` "
            "or just an nn.Module (then the inputs are token ids)")


def is_config_path(name: str) -> bool:
    """Whether a `--model` value names a Hugging Face config: a `.json` path, or an existing directory
    holding a `config.json`."""
    return name.endswith(".json") or (os.path.isdir(name) and os.path.isfile(os.path.join(name, "config.json")))


def from_config(path: str, *, seq: int) -> nn.Module:
    """The causal LM a Hugging Face `config.json` (or a directory holding one) describes, built by
    `AutoModelForCausalLM.from_config` on the current default device (meta in `build`): no weights
    are read or downloaded. `use_cache` is set False (a traced forward returns no KV cache). The
    masters are fp32 whatever the config's `torch_dtype` (the checkpoint's storage dtype): mixed
    precision fine-tuning keeps fp32 masters; plan bf16 masters with `model.to(torch.bfloat16)`
    (CLI: --master-dtype bf16)."""
    if not os.path.exists(path):
        raise MobiusError(f"model config {path!r} does not exist; give the path of a Hugging Face config.json (or of "
                          f"the directory holding it), a zoo name ({', '.join(MODELS)}) or module:factory")
    try:
        import transformers as tf

        config = tf.AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(path)) if os.path.isfile(path)
                                               and Path(path).name == "config.json" else path)
    except (OSError, ValueError, KeyError) as e:
        raise MobiusError(f"cannot read the model config {path!r} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                          f"give a Hugging Face config.json with a model_type transformers knows") from None
    config.use_cache = False
    if getattr(config, "max_position_embeddings", None) is not None and config.max_position_embeddings < seq:
        raise MobiusError(f"model config {path!r}: max_position_embeddings={config.max_position_embeddings} is below "
                          f"the sequence length {seq}; give a --seq of at most {config.max_position_embeddings}")
    try:
        model = tf.AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise MobiusError(f"model config {path!r} ({config.model_type}) has no causal LM in transformers "
                          f"({str(e).splitlines()[0]}); give the config of a causal language model") from None
    return model.float()  # fp32 masters, as the zoo's (free on the meta device)


def _factory(spec: str) -> Callable[..., object]:
    """The callable a `module:factory` spec names, checked against the factory contract before it is called.
    `module` is imported as `python -m` would, with the current directory first on the path (a console
    script's sys.path[0] is its own bin directory instead)."""
    mod_name, _, fn_name = spec.partition(":")
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        factory = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError, ValueError, SyntaxError) as e:
        raise MobiusError(f"cannot load the model factory {spec!r} ({str(e) or type(e).__name__}); give "
                          f"`module:factory` where `module` is importable from the current directory; "
                          f"{_FACTORY}") from e
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    if not callable(factory):
        raise MobiusError(f"{spec!r} is a {type(factory).__name__}, not callable; {_FACTORY}")
    try:
        inspect.signature(factory).bind(batch=1, seq=1, device="meta")
    except TypeError as e:
        raise MobiusError(f"the model factory {spec!r} cannot be called as factory(batch=, seq=, device=) ({e}); "
                          f"{_FACTORY}") from None
    except ValueError:  # no signature to check (some builtins): call it and see
        pass
    return factory


def _describe(out: object) -> str:
    if isinstance(out, tuple):
        return f"a tuple of {len(out)} ({', '.join(type(x).__name__ for x in out)})"
    return f"a {type(out).__name__}"


def step_arguments(model: nn.Module, inputs: tuple) -> dict:
    """What `mobius_fx.plan` needs to plan `model`'s training step (the loss on the last stage)
    on token ids `inputs`: HF models with a `labels` argument compute their own loss on them,
    the zoo's GPT gets the next-token cross-entropy; {} for a model whose loss is unknown."""
    import inspect

    if not inputs or not isinstance(inputs[0], torch.Tensor) or inputs[0].is_floating_point():
        return {}
    if isinstance(model, GPT):
        from mobius_fx.zoo.gpt import next_token_loss

        return {"loss_fn": next_token_loss, "example_target": inputs[0]}
    try:
        takes_labels = "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_labels = False
    if takes_labels and getattr(getattr(model, "config", None), "vocab_size", None):
        return {"example_kwargs": {"labels": inputs[0]}, "train_step": True}
    return {}


def _vocab(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    for attr in ("vocab", "vocab_size"):
        if cfg is not None and hasattr(cfg, attr):
            return int(getattr(cfg, attr))
    return 2

