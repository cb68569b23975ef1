"""pipe.overlap with the rest of the pipeline: compiled variants (a call with another signature)
and copies of the model (found by the review of the merged change)."""

from __future__ import annotations

import copy
import gc
import io
import weakref

import pytest
import torch
from torch import nn

import mobius_fx
from mobius_fx import Topology

pytestmark = pytest.mark.usefixtures("trace_cache")  # tests/conftest.py: each model traced once per module


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


def test_reading_the_model_under_an_async_overlap_lands_the_update_in_flight():
    """async: model.state_dict() (a hook on the model) waits for the update opt.step() launched and
    puts it in the model, without opt.synchronize(): w1 = w0 - lr * g0 for SGD."""
    model, pipe, x = _pipe()
    lr = 1e-2
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = pipe.overlap(torch.optim.SGD(model.parameters(), lr=lr), mode="async")
    pipe(x).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    state = model.state_dict()
    for n, g in grads.items():
        assert not torch.equal(state[n], before[n]), n  # the update landed, not the weights it started from
        # SGD adds -lr * g in fp32 (weights ~0.3, ulp ~3e-8): a few ulps apart at most
        torch.testing.assert_close(state[n], before[n] - lr * g, rtol=0, atol=1e-6, msg=n)
    opt.close()


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
