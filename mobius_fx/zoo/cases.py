"""Small models to compile and train one step on virtual GPUs, each with its inputs, its loss
and its micro-batch count: the cases on which the plan's predicted per-stage peak is checked
against what the books measure (`tests/unit/test_books.py`, `benchmarks/memory_margins.py`).

    for name, model, args, kwargs, loss, microbatches in training_cases():
        pipe = mobius_fx.compile(model, topology, example_inputs=args, example_kwargs=kwargs,
                                 microbatches=microbatches)
        loss(pipe(*args, **kwargs)).backward()
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from mobius_fx.zoo.gpt import GPT, GPTConfig
from mobius_fx.zoo.nanogpt import nanogpt, nanogpt_inputs
from mobius_fx.zoo.small import ResidualMLP, SkipNet, expand16, mlp
from mobius_fx.zoo.tiny_hf import hf_gpt2, hf_inputs, hf_llama

__all__ = ["TrainingCase", "training_cases"]


class TrainingCase(NamedTuple):
    name: str
    model: nn.Module
    args: tuple
    kwargs: dict[str, Any]
    loss: Callable[[Any], torch.Tensor]  # the model's output -> a scalar to call backward on
    microbatches: int


def training_cases() -> list[TrainingCase]:
    """The cases, built afresh (weights drawn after `torch.manual_seed(0)`, so the same each call; the
    caller's random state is restored):
    both GPTs (the tied nanoGPT with targets, its loss the model's own), HF GPT-2 and Llama with
    labels, an MLP, residual and skip stacks, and two 16x-expanding blocks."""
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        torch.manual_seed(0)
        cases = [TrainingCase("zoo-gpt", GPT(GPTConfig(vocab=256, seq=32, hidden=64, blocks=4, heads=2)),
                              (torch.randint(0, 256, (8, 32)),), {}, lambda o: o.pow(2).mean(), 4)]
        model = nanogpt(hidden=32, blocks=2, vocab=64, seq=8, heads=2)
        (idx,) = nanogpt_inputs(model, batch=4)
        cases.append(TrainingCase("tied-gpt", model, (idx, torch.roll(idx, 1, 1)), {}, lambda o: o[1], 2))
        for name, build in (("hf-gpt2", hf_gpt2), ("hf-llama", hf_llama)):
            model = build()
            (ids,) = hf_inputs(model, batch=4, seq=8)
            cases.append(TrainingCase(name, model, (ids,), {"labels": ids}, lambda o: o.loss, 2))
        square = lambda o: o.pow(2).mean()  # noqa: E731
        cases += [
            TrainingCase("mlp", mlp((16, 64, 64, 8)), (torch.randn(16, 16),), {}, square, 2),
            TrainingCase("residual", ResidualMLP(d_in=8, width=16, depth=4, d_out=4), (torch.randn(8, 8),), {}, square, 2),
            TrainingCase("skip", SkipNet(d_in=8, width=16, depth=4, d_out=4), (torch.randn(8, 8),), {}, square, 2),
            TrainingCase("expand16", nn.Sequential(expand16(), expand16()), (torch.randn(256, 8),), {}, square, 2),
        ]
        return cases
