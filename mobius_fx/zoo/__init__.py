"""The model zoo: models built from code (nothing is downloaded), for the CLI, the benchmarks,
the examples and the tests. Every builder returns an `nn.Module` in training mode; build under
`with torch.device("meta"):` to plan without allocating weights.

| module | what it holds |
|---|---|
| `named` | `build(name, batch=, seq=, device=)`, `MODELS`, `model_names()`: the full-size models the CLI plans (GPT-2, GPT-3-like, Llama-like, OPT-like) and `module:factory` specs |
| `gpt` | `GPT` / `GPTConfig`: a nanoGPT-style decoder with SDPA attention (the paper's sizes, the examples) |
| `nanogpt` | `NanoGPT` / `nanogpt` / `nanogpt_inputs`: nanoGPT's GPT-2 as written, mask built in forward (fx cannot trace it, export can) |
| `tiny_hf` | `hf_gpt2`, `hf_llama`, `hf_mistral`, `hf_qwen2`, `hf_opt`, `hf_bert`, `hf_t5` (tiny configs), `TINY_HF`, `hf_inputs` |
| `small` | `mlp`, `ResidualMLP`, `SkipNet`, `expand16` |
| `cases` | `training_cases()`: small models with inputs, loss and micro-batches, to compile and train |

    model, inputs = zoo.build("gpt3-8b", batch=8, seq=1024)   # on the meta device
"""

from __future__ import annotations

from mobius_fx.zoo.cases import TrainingCase, training_cases
from mobius_fx.zoo.gpt import GPT, GPTConfig
from mobius_fx.zoo.named import MODELS, build, model_names, step_arguments
from mobius_fx.zoo.nanogpt import NanoGPT, NanoGPTConfig, nanogpt, nanogpt_inputs
from mobius_fx.zoo.small import ResidualMLP, SkipNet, expand16, mlp
from mobius_fx.zoo.tiny_hf import (TINY_HF, hf_bert, hf_gpt2, hf_inputs, hf_llama, hf_mistral, hf_opt, hf_qwen2,
                                   hf_t5)

__all__ = [
    "GPT", "GPTConfig", "MODELS", "build", "model_names", "step_arguments", "NanoGPT", "NanoGPTConfig", "nanogpt", "nanogpt_inputs",
    "TINY_HF", "hf_bert", "hf_gpt2", "hf_inputs", "hf_llama", "hf_mistral", "hf_opt", "hf_qwen2", "hf_t5",
    "ResidualMLP", "SkipNet", "expand16", "mlp", "TrainingCase", "training_cases",
]
