"""pipe.overlap with the rest of the pipeline: compiled variants (a call with another signature)
and copies of the model (found by the review of the merged change)."""

from __future__ import annotations

import copy
import gc
import io
import weakref

import torch
from torch import nn

import mobius_fx
from mobius_fx import Topology


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = self.b(torch.relu(self.a(x)))
        return y if scale is None else y * scale


def _pipe() -> tuple[nn.Module, object, torch.Tensor]:
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(4, 8)
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=2,
                             verbose=False)
    return model, pipe, x


def test_a_model_under_an_async_overlap_deep_copies_and_saves_with_inert_hooks():
    model, pipe, x = _pipe()
    opt = pipe.overlap(torch.optim.SGD(model.parameters(), lr=1e-2), mode="async")
    pipe(x).sum().backward()
    opt.step()
    twin = copy.deepcopy(model)  # a best-model copy mid-training
    torch.save(model, io.BytesIO())
    opt.close()
    twin(x).sum().backward()  # the copy's hooks belong to no overlap: they do nothing
    assert all(p.grad is not None for p in twin.parameters())


def test_a_replaced_overlap_is_freed_when_another_variant_ran():
    model, pipe, x = _pipe()
    opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=1e-2), mode="sync")
    for call in ((x,), (x, torch.tensor(2.0)), (x,)):
        pipe(*call).sum().backward()
        opt.step()
        opt.zero_grad()
    assert len(pipe.variants) == 2
    refs = [weakref.ref(opt), weakref.ref(opt.inner)]
    del opt
    pipe.overlap(torch.optim.SGD(model.parameters(), lr=1e-2), mode="sync")
    gc.collect()
    assert [r() is None for r in refs] == [True, True]


def test_variants_share_the_kept_gradient_storage():
    model, pipe, x = _pipe()
    opt = pipe.overlap(torch.optim.SGD(model.parameters(), lr=1e-2), mode="sync")
    for call in ((x,), (x, torch.tensor(2.0)), (x,), (x, torch.tensor(2.0))):
        pipe(*call).sum().backward()
        opt.step()
        opt.zero_grad()
    homes = {id(v.runtime.grad_homes) for v in pipe.variants}
    assert len(pipe.variants) == 2 and len(homes) == 1
