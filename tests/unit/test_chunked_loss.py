"""The chunked cross-entropy (mobius_fx/losses.py) and the pass that puts it in a training step's
graph (passes/chunk_loss.py): eager's loss and gradient, without an fp32 copy of the logits."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mobius_fx import losses
from mobius_fx.losses import chunked_cross_entropy
from mobius_fx.passes.chunk_loss import chunk_cross_entropy
from mobius_fx.tracing import trace
from mobius_fx.train_step import LossModel
from mobius_fx.zoo.tiny_hf import hf_gpt2


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(losses, "CHUNK_BYTES", 4 * 37 * 3)  # 3 rows of 37 classes a chunk: several chunks, a ragged last
    return 3


def _case(rows=20, classes=37, ignored=(1, 5, 6, 19), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, classes, generator=g) * 3).to(dtype).requires_grad_()
    target = torch.randint(0, classes, (rows,), generator=g)
    target[list(ignored)] = -100
    return logits, target


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_equals_eager_in_fp32(small_chunks, reduction):
    logits, target = _case()
    got = chunked_cross_entropy(logits, target, reduction=reduction)
    g = torch.randn_like(got)
    (dg,) = torch.autograd.grad(got, logits, g)
    ref = F.cross_entropy(logits, target, reduction=reduction)
    (dref,) = torch.autograd.grad(ref, logits, g)
    # per row: the same max-shifted log-sum-exp in fp32 (a few ulps of the row's loss); the mean
    # divides the same sum by the same count
    torch.testing.assert_close(got, ref, rtol=4e-7 * 8, atol=1e-6)
    torch.testing.assert_close(dg, dref, rtol=1e-6, atol=1e-7)


def test_bf16_logits_give_the_fp32_upcasts_loss_and_a_bf16_gradient(small_chunks):
    logits, target = _case(dtype=torch.bfloat16)
    got = chunked_cross_entropy(logits, target)
    (dg,) = torch.autograd.grad(got, logits)
    ref = F.cross_entropy(logits.float(), target)
    (dref,) = torch.autograd.grad(ref, logits)
    assert got.dtype == torch.float32 and dg.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, rtol=4e-6, atol=1e-6)
    torch.testing.assert_close(dg.float(), dref.float(), rtol=2 ** -7, atol=1e-6)  # one bf16 rounding of each entry


def test_what_it_cannot_chunk_falls_back_to_cross_entropy():
    logits, target = _case()
    w = torch.rand(37)
    torch.testing.assert_close(chunked_cross_entropy(logits, target, weight=w), F.cross_entropy(logits, target, weight=w))
    torch.testing.assert_close(chunked_cross_entropy(logits, target, label_smoothing=0.1),
                               F.cross_entropy(logits, target, label_smoothing=0.1))
    probs = torch.softmax(torch.randn(20, 37), 1)
    torch.testing.assert_close(chunked_cross_entropy(logits, probs), F.cross_entropy(logits, probs))


def test_the_saved_state_is_the_logits_and_one_number_per_row():
    logits, target = _case(rows=64, classes=500)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        chunked_cross_entropy(logits, target)
    big = [t for t in saved if t.numel() >= logits.numel()]
    assert len(big) == 1 and big[0] is logits or big[0].data_ptr() == logits.data_ptr()
    assert sum(t.numel() for t in saved if t.numel() < logits.numel()) <= 4 * 64 + 1


class TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50)

    def forward(self, ids):
        return self.head(self.emb(ids))


def _nodes(gm, fn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


def test_the_pass_rewrites_an_fx_loss_fn_and_keeps_eager_values():
    model = TokenModel()
    ids = torch.randint(0, 50, (4, 8))
    wrapper = LossModel(model, lambda out, t: F.cross_entropy(out.float().view(-1, 50), t.view(-1)))
    gm = trace(wrapper, example_inputs=(ids,), example_kwargs={"target": ids})
    ref = gm(ids, target=ids)
    assert chunk_cross_entropy(gm) == 1
    assert _nodes(gm, chunked_cross_entropy) and not _nodes(gm, F.cross_entropy)
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "float"]  # the upcast is gone
    torch.testing.assert_close(gm(ids, target=ids), ref)


def test_the_pass_rewrites_hf_causal_lm_loss_and_drops_its_upcast():
    torch.manual_seed(0)
    model = hf_gpt2(layers=1, vocab=100, positions=16)
    ids = torch.randint(0, 100, (4, 16))
    ids[0, :5] = -100
    gm = trace(LossModel(model), example_inputs=(ids.clamp(min=0),), example_kwargs={"labels": ids})
    casts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.to.dtype]
    assert chunk_cross_entropy(gm) == 1
    assert len([n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.to.dtype]) \
        == len(casts) - 1  # the logits' fp32 upcast
    torch.testing.assert_close(gm(ids.clamp(min=0), labels=ids), model(ids.clamp(min=0), labels=ids).loss)
