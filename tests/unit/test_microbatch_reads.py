"""Issue 39, classes 1, 2, 3 and 8: what a forward reads of its batch, with several micro-batches.

1-2. A size read from a shape (`loss / x.shape[0]`, `numel()`, `len(x)`, `return y.shape[0]`) is
     the whole batch's where it becomes a value, and the micro-batch's where it shapes a tensor
     (`.view(b, t, ...)`) -- planning/batch_sizes.py, on both front ends.
3.   A mean cross-entropy / NLL over class indices with ignored targets spread unevenly, returned
     by forward, is combined as one sum over one count (planning/loss_ratios.py); used further
     (`ce + aux`), it is the mean of the micro-batch means and a warning says so.
8.   `batch_first=False` RNNs, attention and Transformer layers are refused when the split would
     cut their time dimension (planning/sequence_first.py); `batch_first=True` runs as eager.

Each case is compared with eager on the outputs, the loss and every parameter's gradient.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import mobius_fx
from mobius_fx import MobiusError, Topology

pytestmark = pytest.mark.usefixtures("one_thread")


def _compile(model, inputs, monkeypatch, front_end="fx", microbatches=2):
    if front_end == "export":
        import mobius_fx.tracing as tracing

        monkeypatch.setattr(tracing, "_try_fx", lambda *a: (None, "forced by the test"))
    return mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=inputs,
                             microbatches=microbatches, verbose=False)


def _loss(out):
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    return sum(t.sum() * (i + 1) for i, t in enumerate(leaves))


def _same_as_eager(model, pipe, inputs):
    """Outputs (values, types, shapes), the loss and every gradient equal eager's."""
    got = pipe(*inputs)
    _loss(got).backward()
    mine = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want = model(*inputs)
    _loss(want).backward()
    g, w = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert len(g) == len(w)
    for a, b in zip(g, w):
        assert type(a) is type(b), (a, b)
        if isinstance(b, torch.Tensor):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a, b)
        else:
            assert a == b
    for name, p in model.named_parameters():
        torch.testing.assert_close(mine[name], p.grad, msg=name)


# ----------------------------------------------------------------------------- classes 1-2

class Reads(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.l = nn.Linear(3, 4)
        self.fn = fn

    def forward(self, x, y):
        return self.fn(torch.tanh(self.l(x)), x, y)


def _vae(h, x, y):  # reconstruction and KL summed, normalised by the batch
    kl = -0.5 * (1 + h - h.pow(2) - h.exp()).sum()
    return (F.mse_loss(h, y, reduction="sum") + kl) / x.size(0)


READS = {
    "div_shape0": lambda h, x, y: F.mse_loss(h, y, reduction="sum") / x.shape[0],
    "div_size0": lambda h, x, y: h.sum() / x.size(0),
    "div_numel": lambda h, x, y: h.pow(2).sum() / h.numel(),
    "mean_times_b": lambda h, x, y: h.mean() * x.shape[0],
    "vae": _vae,
    "token_normalised": lambda h, x, y: (h * (y > 0)).sum() / (y.size(0) * y.size(1)),
    "b_plus_one": lambda h, x, y: h.sum() / (x.size(0) + 1),
    "view_then_div": lambda h, x, y: h.view(x.size(0), 2, 2).sum(-1).pow(2).sum() / h.size(0),
    "shape_tuple_out": lambda h, x, y: (h, h.shape),
    "size_out": lambda h, x, y: (h * 2, h.size(0), x.size()),
    "full_shaped_and_filled": lambda h, x, y: h + torch.full((x.size(0), 1), x.size(0)),
}


@pytest.mark.parametrize("front_end", ["fx", "export"])
@pytest.mark.parametrize("name", sorted(READS))
def test_sizes_read_in_forward_are_the_whole_batchs_where_they_become_values(name, front_end, monkeypatch):
    torch.manual_seed(0)
    model = Reads(READS[name])
    inputs = (torch.randn(8, 3), torch.randn(8, 4))
    _same_as_eager(model, _compile(model, inputs, monkeypatch, front_end), inputs)


class Tokens(nn.Module):
    """nanoGPT's pattern: `b, t = idx.size()` shapes the activations; the loss divides by b * t."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.pos = nn.Embedding(5, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, idx):
        b, t = idx.size()
        h = self.emb(idx) + self.pos(torch.arange(t))
        h = h.view(b, t, 2, 4).flip(-1).reshape(b, t, 8)
        logits = self.head(h)
        return logits, torch.tensor(b), (logits.logsumexp(-1).sum() / (b * t))


@pytest.mark.parametrize("front_end", ["export"])  # torch.tensor(b) needs export
@pytest.mark.parametrize("microbatches", [2, 4])
def test_sizes_kept_per_micro_batch_where_they_shape_tensors(front_end, microbatches, monkeypatch):
    torch.manual_seed(0)
    model = Tokens()
    idx = torch.randint(0, 11, (8, 5))
    _same_as_eager(model, _compile(model, (idx,), monkeypatch, front_end, microbatches), (idx,))


def per_row(t, b):  # a function of the user's that symbolic_trace keeps as one call: what b is to it is unknown
    return t / b


torch.fx.wrap("per_row")


def test_a_size_flowing_where_no_rule_classifies_it_is_refused_naming_the_node(monkeypatch):
    model = Reads(lambda h, x, y: per_row(h, x.size(0)))
    inputs = (torch.randn(8, 3), torch.randn(8, 4))
    with pytest.raises(MobiusError, match=r"per_row.*reads the batch size .*8 for the whole batch and 4.*microbatches=1"):
        _compile(model, inputs, monkeypatch)
    _same_as_eager(model, _compile(model, inputs, monkeypatch, microbatches=1), inputs)


# ----------------------------------------------------------------------------- class 3

class Classifier(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.l = nn.Linear(3, 5)
        self.ce = nn.CrossEntropyLoss()
        self.nll = nn.NLLLoss(ignore_index=4)
        self.fn = fn

    def forward(self, x, t):
        return self.fn(self, self.l(x), t)


LOSSES = {
    "cross_entropy": lambda s, h, t: F.cross_entropy(h, t),
    "label_smoothing": lambda s, h, t: F.cross_entropy(h, t, label_smoothing=0.1),
    "nll_loss": lambda s, h, t: F.nll_loss(h.log_softmax(-1), t),
    "module": lambda s, h, t: s.ce(h, t),
    "module_ignore_4": lambda s, h, t: s.nll(h.log_softmax(-1), t.clamp(min=0)),
    "with_logits": lambda s, h, t: (h, F.cross_entropy(h, t, ignore_index=-100)),
    "sequence": lambda s, h, t: F.cross_entropy(h.view(-1, 2, 5).transpose(1, 2), t.view(-1, 2)),
}
UNEVEN = torch.tensor([0, -100, -100, 1, 2, 3, 4, 1])  # micro-batch 0 counts 2 targets, 1 counts 4


@pytest.mark.parametrize("front_end", ["fx", "export"])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_mean_loss_over_unevenly_ignored_targets_is_eagers(name, front_end, monkeypatch):
    torch.manual_seed(0)
    model = Classifier(LOSSES[name])
    inputs = (torch.randn(8, 3), UNEVEN)
    _same_as_eager(model, _compile(model, inputs, monkeypatch, front_end), inputs)


def test_a_mean_loss_used_further_warns_that_it_is_the_mean_of_the_means(monkeypatch, caplog):
    model = Classifier(lambda s, h, t: F.cross_entropy(h, t) + 0.1 * h.pow(2).mean())
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        _compile(model, (torch.randn(8, 3), UNEVEN), monkeypatch)
    assert "mean of the micro-batches' means" in caplog.text and "cross_entropy" in caplog.text
    assert "return the loss itself as an output" in caplog.text


# ----------------------------------------------------------------------------- class 8

class Sequence(nn.Module):
    def __init__(self, kind, batch_first):
        super().__init__()
        self.kind, self.inp = kind, nn.Linear(4, 4)
        make = {
            "LSTM": lambda: nn.LSTM(4, 4, batch_first=batch_first),
            "GRU": lambda: nn.GRU(4, 4, batch_first=batch_first),
            "RNN": lambda: nn.RNN(4, 4, batch_first=batch_first),
            "MultiheadAttention": lambda: nn.MultiheadAttention(4, 2, batch_first=batch_first),
            "TransformerEncoderLayer": lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0,
                                                                          batch_first=batch_first),
            "TransformerDecoderLayer": lambda: nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0,
                                                                          batch_first=batch_first),
        }
        self.m = make[kind]()

    def forward(self, x):
        h = self.inp(x)
        if self.kind in ("LSTM", "GRU", "RNN"):
            return self.m(h)[0]
        if self.kind == "MultiheadAttention":
            return self.m(h, h, h, need_weights=False)[0]
        if self.kind == "TransformerDecoderLayer":
            return self.m(h, h)
        return self.m(h)


KINDS = ["LSTM", "GRU", "RNN", "MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer"]


@pytest.mark.parametrize("front_end", ["fx", "export"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_sequence_first_module_is_refused_where_the_split_cuts_time(kind, front_end, monkeypatch):
    torch.manual_seed(0)
    model = Sequence(kind, batch_first=False)
    x = torch.randn(6, 4, 4)  # (T, B, F)
    with pytest.raises(MobiusError, match=rf"{kind} `m` has batch_first=False.*cut in time.*batch_first=True"):
        _compile(model, (x,), monkeypatch, front_end)
    _same_as_eager(model, _compile(model, (x,), monkeypatch, front_end, microbatches=1), (x,))


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_first_module_splits_its_batch_as_eager(kind, monkeypatch):
    torch.manual_seed(0)
    model = Sequence(kind, batch_first=True)
    x = torch.randn(4, 6, 4)  # (B, T, F)
    _same_as_eager(model, _compile(model, (x,), monkeypatch), (x,))
