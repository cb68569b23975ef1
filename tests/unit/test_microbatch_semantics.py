"""Micro-batch semantics (README "Micro-batch semantics", mobius_fx/planning/microbatch.py): with several
micro-batches a pipeline returns eager's outputs and gradients for the whole batch, or refuses.

Issue 28 found the guesses this replaces: a sum averaged over micro-batches, an integer count
taken from micro-batch 0, `mean(0)` concatenated, `t - t.mean(0)` and a (T, T) mask split
silently. Outputs are combined by what made them (found by running the graph on fake tensors at
the whole batch and at one micro-batch); row-mixing values are refused at compile.

The one test that trains runs on both loops (`loop`: the eager-style `loss.backward()` and
`pipe.train_step` with the loss on the last stage, tests/unit/loops.py); the others run forward
only (train_step returns no outputs to compare).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.planning.microbatch import check_batch_dims
from tests.unit.loops import LOOPS, compile_for, step

pytestmark = pytest.mark.usefixtures("one_thread")

# name -> (what forward returns from h = self.l(x) (4 features) and a target y)
OUTPUTS = {
    "rows": lambda h, y: h,
    "sum": lambda h, y: h.sum(),
    "mean": lambda h, y: h.mean(),
    "mse_sum": lambda h, y: F.mse_loss(h, y, reduction="sum"),
    "mse_mean": lambda h, y: F.mse_loss(h, y),
    "cross_entropy": lambda h, y: F.cross_entropy(h, y.argmax(1)),
    "max": lambda h, y: h.max(),
    "amin": lambda h, y: torch.amin(h, dim=(0, 1)),
    "count": lambda h, y: (h > 0).sum(),
    "mean0": lambda h, y: h.mean(0),
    "mean0_sum": lambda h, y: h.mean(0).sum(),
    "sum0_mean": lambda h, y: h.sum(0).mean(),
    "amax0_max": lambda h, y: h.amax(0).max(),
    "sum0": lambda h, y: h.sum(dim=0),
    "scaled": lambda h, y: 0.5 * h.sum() - h.sum() / 4,
    "mean_plus": lambda h, y: h.mean() + F.mse_loss(h, y) + 1.0,
    "cast": lambda h, y: h.sum().double(),
    "weight": lambda h, y: h.new_ones(3) * 0 + 0,  # not reached by the batch: micro-batch 0's
    "zeros_like": lambda h, y: torch.zeros_like(h) + 1,  # shape from the batch, values from none
}

# How a loss made of the output's `.sum()` combines over micro-batches (train_step computes it on
# the last stage, per micro-batch): "const" is not reached by the batch.
LOSS_KIND = {"rows": "sum", "sum": "sum", "mse_sum": "sum", "scaled": "sum", "cast": "sum", "sum0": "sum",
             "zeros_like": "sum", "mean": "mean", "mse_mean": "mean", "cross_entropy": "mean", "mean0": "mean",
             "mean0_sum": "mean", "sum0_mean": "sum", "mean_plus": "mean", "max": "max", "amax0_max": "max",
             "amin": "min", "weight": "const", "count": None}


def _combinable(kinds):
    """Whether `_loss` of these outputs is one kind the micro-batch losses combine by: a sum of
    sums, a sum of means plus constants, one max or one min (a sum plus a mean, a sum plus a
    constant or a max plus a max has no rule: train_step refuses it with several micro-batches)."""
    terms = [LOSS_KIND[k] for k in kinds if LOSS_KIND[k] is not None]
    return (set(terms) <= {"sum"} or set(terms) <= {"mean", "const"}
            or (len(terms) == 1 and terms[0] in ("max", "min")))


class Heads(nn.Module):
    """h = Linear(x); returns a dict of the chosen outputs."""

    def __init__(self, kinds):
        super().__init__()
        self.l = nn.Linear(3, 4)
        self.r = nn.Linear(4, 4)
        self.kinds = tuple(kinds)

    def forward(self, x, y):
        h = self.r(torch.relu(self.l(x)))
        return {k: OUTPUTS[k](h, y) for k in self.kinds}


def _topo():
    return Topology.virtual(gpus=2, memory="16MiB")


def _compile(model, *inputs, microbatches, **kw):
    return mobius_fx.compile(model, _topo(), example_inputs=inputs, microbatches=microbatches, verbose=False, **kw)


def _grads(model):
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def _loss(out):
    return sum(v.float().sum() * (i + 1) for i, v in enumerate(out.values()) if v.is_floating_point())


@pytest.mark.parametrize("loop", LOOPS)
@settings(max_examples=10)
@given(kinds=st.lists(st.sampled_from(sorted(OUTPUTS)), min_size=1, max_size=3, unique=True),
       microbatches=st.sampled_from([1, 2, 4]))
def test_outputs_and_gradients_equal_eager_for_any_mix_of_output_kinds(loop, kinds, microbatches):
    torch.manual_seed(0)
    model = Heads(kinds)
    x, y = torch.randn(8, 3), torch.randn(8, 4)
    want = model(x, y)
    trains = any(v.is_floating_point() and v.requires_grad for v in want.values())
    if trains:
        ref = _loss(want)
        ref.backward()
    wanted = _grads(model)
    model.zero_grad(set_to_none=True)
    if not trains:
        if loop == "train_step":
            return  # no loss to train: the forward-only case is the eager loop's
        pipe = _compile(model, x, y, microbatches=microbatches)
        got, loss = pipe(x, y), None
    else:
        if loop == "train_step" and microbatches > 1 and not _combinable(kinds):
            with pytest.raises(MobiusError, match=r"mixes the rows of the batch.*use microbatches=1"):
                compile_for(loop, model, _topo(), example_inputs=(x, y), microbatches=microbatches, loss=_loss)
            return
        pipe = compile_for(loop, model, _topo(), example_inputs=(x, y), microbatches=microbatches, loss=_loss)
        loss, got = step(loop, pipe, x, y)
        torch.testing.assert_close(loss, ref.detach())
    if got is not None:
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
            torch.testing.assert_close(got[k], want[k], msg=k)
    for a, b in zip(_grads(model), wanted):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kinds", [["sum"], ["max"], ["amin"], ["zeros_like", "cast"], ["zeros_like", "cross_entropy"]],
                         ids="+".join)
def test_a_loss_on_the_last_stage_combines_as_eager_or_is_refused(kinds):
    """train_step's loss, `_loss(out)` per micro-batch: Python's `sum()` starts at 0 (`loss + 0` is
    the loss), `.sum()` of a 0-dim max is the max, `max * 2` a max; `zeros_like(h) + 1` has rows
    (its sum grows with the micro-batch: not a constant, so a sum plus a mean is refused, never
    combined as a mean: it came back 18.9 for eager's 34.9)."""
    torch.manual_seed(0)
    model = Heads(kinds)
    x, y = torch.randn(8, 3), torch.randn(8, 4)
    if not _combinable(kinds):
        with pytest.raises(MobiusError, match=r"mixes the rows of the batch.*use microbatches=1"):
            compile_for("train_step", model, _topo(), example_inputs=(x, y), microbatches=2, loss=_loss)
        return
    ref = _loss(model(x, y))
    ref.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    pipe = compile_for("train_step", model, _topo(), example_inputs=(x, y), microbatches=2, loss=_loss)
    loss, _ = step("train_step", pipe, x, y)
    torch.testing.assert_close(loss, ref.detach())
    for a, b in zip(_grads(model), want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", sorted(OUTPUTS))
def test_each_output_kind_alone_equals_eager_with_two_microbatches(kind):
    torch.manual_seed(0)
    model = Heads([kind])
    x, y = torch.randn(8, 3), torch.randn(8, 4)
    got, want = _compile(model, x, y, microbatches=2)(x, y), model(x, y)
    assert got[kind].shape == want[kind].shape and got[kind].dtype == want[kind].dtype
    torch.testing.assert_close(got[kind], want[kind])


class Mixer(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.l = nn.Linear(3, 4)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.l(x))


MIXING = {
    "centre": (lambda h: h - h.mean(0, keepdim=True), "sub"),
    "first_row": (lambda h: h[0], "getitem"),
    "gram": (lambda h: h.T @ h, "matmul"),
    "softmax_over_batch": (lambda h: h.softmax(0), "softmax"),
    "cumsum_over_batch": (lambda h: torch.cumsum(h, dim=0), "cumsum"),
    "std": (lambda h: h.std(), "std"),
    "max_of_means": (lambda h: h.mean(0).max(), "max"),
    "pairs_of_rows": (lambda h: (h @ h.T) @ h, "matmul"),
    "max_with_indices": (lambda h: h.max(0).values, "getattr"),
    "mean_then_rows": (lambda h: h * h.mean(), "mul"),
    "std_then_rows": (lambda h: h * h.std(), "std"),
    "first_row_then_rows": (lambda h: h + h[0], "getitem"),
    "sum_plus_one": (lambda h: h.sum() + 1, "add"),
    "weighted_ce": (lambda h: F.cross_entropy(h, h.argmax(1).detach(), weight=torch.ones(4)), "cross_entropy"),
}


@pytest.mark.parametrize("name", sorted(MIXING))
def test_row_mixing_values_are_refused_with_several_microbatches_and_eager_with_one(name):
    fn, node = MIXING[name]
    torch.manual_seed(0)
    model = Mixer(fn)
    x = torch.randn(4, 3)
    with pytest.raises(MobiusError, match=rf"{node}.*microbatches=2.*use microbatches=1"):
        _compile(model, x, microbatches=2)
    pipe = _compile(model, x, microbatches=1)
    torch.testing.assert_close(pipe(x), model(x))


def test_a_sum_and_an_integer_count_are_summed_not_averaged_or_taken_from_the_first():
    """The issue's cases: mse_loss(reduction="sum") came back halved, (o > 0).sum() gave 2 for 6."""
    torch.manual_seed(0)
    model = Heads(["mse_sum", "count", "max"])
    x, y = torch.randn(8, 3), torch.randn(8, 4)
    got, want = _compile(model, x, y, microbatches=2)(x, y), model(x, y)
    assert got["count"].dtype == torch.int64 and int(got["count"]) == int(want["count"])
    torch.testing.assert_close(got["mse_sum"], want["mse_sum"])
    torch.testing.assert_close(got["max"], want["max"])


class Masked(nn.Module):
    """x: (B, T, F); mask: (T, T), not batched — with T == B its dim 0 looks like the batch."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x, mask):
        h = self.l(x)
        return (mask @ h) + h


def test_a_mask_whose_dim_0_equals_the_batch_is_warned_about_and_batch_dims_says_it_is_not_batched(caplog):
    torch.manual_seed(0)
    model = Masked()
    x, mask = torch.randn(4, 4, 4), torch.tril(torch.ones(4, 4))
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        with pytest.raises(MobiusError, match="does not run on one micro-batch"):
            _compile(model, x, mask, microbatches=2)  # the (2, 4) half-mask cannot multiply (2, 4, 4)
    assert "batch_dims={'<its argument>': None}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        pipe = _compile(model, x, mask, microbatches=2, batch_dims={"mask": None})
    assert "batch_dims" not in caplog.text
    torch.testing.assert_close(pipe(x, mask), model(x, mask))


class Table(nn.Module):
    """A (B, F) lookup table added to every row: dim 0 equals the batch, but it is not batched."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x, table):
        return self.l(x) + table.sum(0)


def test_batch_dims_none_keeps_an_input_whole_where_the_guess_splits_it():
    torch.manual_seed(0)
    model = Table()
    x, table = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(MobiusError, match=r"sum.*mixes the rows of the batch"):
        _compile(model, x, table, microbatches=2)  # split, table.sum(0) would differ per micro-batch
    pipe = _compile(model, x, table, microbatches=2, batch_dims={"table": None})
    torch.testing.assert_close(pipe(x, table), model(x, table))


@pytest.mark.parametrize("value, phrase", [
    ([("x", 0)], "is a list, not a dict"),
    ({"x": 1}, "batch_dims['x']=1"),
    ({"x": True}, "batch_dims['x']=True"),
    ({0: None}, "key 0 is not an argument name"),
])
def test_batch_dims_must_map_names_to_0_or_none(value, phrase):
    with pytest.raises(MobiusError, match=phrase.replace("[", r"\[").replace("]", r"\]")):
        check_batch_dims(value)
    with pytest.raises(MobiusError, match=phrase.replace("[", r"\[").replace("]", r"\]")):
        mobius_fx.CompileOptions(batch_dims=value)


def test_batch_dims_naming_an_argument_forward_does_not_take_is_refused():
    with pytest.raises(MobiusError, match=r"batch_dims names 'mask', which Heads.forward does not take"):
        _compile(Heads(["sum"]), torch.randn(4, 3), torch.randn(4, 4), microbatches=2, batch_dims={"mask": None})


def test_batchnorm_keeps_its_warning_and_is_not_refused(caplog):
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        pipe = _compile(model, torch.randn(4, 3), microbatches=2)
    assert "normalised by its own statistics" in caplog.text
    assert pipe(torch.randn(4, 3)).shape == (4, 2)


def test_a_pipeline_built_without_example_inputs_finds_the_rule_at_its_first_call():
    """build_pipeline without examples cannot analyse at build time: the first call does it."""
    import torch.fx as fx

    from mobius_fx.build import build_pipeline

    def build(model):
        gm = fx.symbolic_trace(model)
        nodes = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        return build_pipeline(model, gm, stage_nodes=[nodes], stage_gpus=["gpu0"], gpu_budgets={"gpu0": None},
                              microbatches=2, device="virtual")

    torch.manual_seed(0)
    model = Heads(["mse_sum", "count"])
    x, y = torch.randn(8, 3), torch.randn(8, 4)
    got, want = build(model)(x, y), model(x, y)
    torch.testing.assert_close(got["mse_sum"], want["mse_sum"])
    assert int(got["count"]) == int(want["count"])
    pipe = build(Mixer(MIXING["centre"][0]))
    for _ in range(2):  # refused at every call, not only the first
        with pytest.raises(MobiusError, match="mixes the rows of the batch"):
            pipe(torch.randn(4, 3))
