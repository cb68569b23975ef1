"""Shapes may vary between calls, like eager; a shape the model cannot take is a MobiusError
that names the dimension — never a silently wrong result (mobius_fx/runtime/variants.py, call_signatures.py).

torch.export traces every dim of the inputs symbolic where the model allows (so sequence length
and batch vary without a new trace) and its guards check each call. A shape a graph does not hold
for gets a variant traced for it (or, with `max_variants` reached or under `build_pipeline`, a
MobiusError naming the input, the dimension and what the graph holds for). A call larger than
planned is costed again: the plan is kept when its stages fit, re-planned (and said so) when not.
The HF zoo at two lengths, masked and unmasked, is in test_call_signatures.py.
"""

import copy
import logging

import pytest
import torch
from torch import nn

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.build import build_pipeline
from mobius_fx.zoo import ResidualMLP, hf_bert, hf_opt

pytestmark = pytest.mark.usefixtures("one_thread")


def _said(caplog, level=logging.WARNING) -> str:
    """What mobius_fx logged at `level` or above (torch's own debug records left out)."""
    return " ".join(r.getMessage() for r in caplog.records if r.name == "mobius_fx" and r.levelno >= level)


def _compile(model, args=(), kwargs=None, memory="64MiB", **kw):
    kw = {"microbatches": 2, "verbose": False, **kw}
    return mobius_fx.compile(model, Topology.virtual(gpus=2, memory=memory), example_inputs=args,
                             example_kwargs=kwargs, **kw)


def _ids(batch, seq, seed=0):
    return torch.randint(1, 100, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_opt_at_other_lengths_and_batches_matches_eager_without_a_new_trace(caplog):
    """The issue's case: OPT compiled at length 16 and called at 8 returned logits of length 16.
    Now lengths 8 and 24 and a batch of 8 run on the one traced graph and equal eager."""
    torch.manual_seed(0)
    model = hf_opt()
    eager = copy.deepcopy(model)
    pipe = _compile(model, kwargs={"input_ids": _ids(4, 16)})
    for batch, seq in [(4, 8), (4, 24), (8, 12)]:
        ids = _ids(batch, seq, seed=seq)
        model.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)
        with caplog.at_level(logging.WARNING, logger="mobius_fx"):
            got = pipe(input_ids=ids).logits
        want = eager(input_ids=ids).logits
        assert got.shape == (batch, seq, 100)
        torch.testing.assert_close(got, want)
        got.pow(2).mean().backward(), want.pow(2).mean().backward()
        assert _grads(model).keys() == _grads(eager).keys()
        for n, g in _grads(eager).items():
            torch.testing.assert_close(_grads(model)[n], g, msg=lambda m: f"{n}: {m}")
    assert len(pipe.variants) == 1 and not _said(caplog)


class BranchOnLength(nn.Module):
    """Reverses the sequence when it is longer than 6: torch.fx cannot trace the branch, export
    traces it for the example's side (a guard: length >= 7)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):  # (batch, seq, 4)
        if x.size(1) > 6:
            x = x.flip(1)
        return self.fc2(torch.relu(self.fc1(x)))


def test_a_length_the_graph_does_not_hold_for_gets_a_variant_that_matches_eager(caplog):
    torch.manual_seed(0)
    model = BranchOnLength()
    pipe = _compile(model, (torch.randn(4, 8, 4),))
    assert pipe._gm.meta["mobius_trace"].front_end == "export"
    x = torch.randn(4, 4, 4)
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        torch.testing.assert_close(pipe(x), model(x))
    said = _said(caplog)
    assert "x dim 1 is 4; the traced graph holds for 7 <= dim 1" in said and "compiling a variant" in said
    for seq in (5, 12):  # each on a graph traced before
        x = torch.randn(4, seq, 4)
        torch.testing.assert_close(pipe(x), model(x))
    assert len(pipe.variants) == 2


class BranchOnParity(nn.Module):
    """Reverses sequences of even length: export keeps the length symbolic, guarded by
    `x.size()[1] % 2 == 0`, a condition no range of the length expresses."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.size(1) % 2 == 0:
            x = x.flip(1)
        return self.fc(x)


def test_a_length_that_fails_a_guard_of_the_model_gets_a_variant_that_matches_eager(caplog):
    torch.manual_seed(0)
    model = BranchOnParity()
    pipe = _compile(model, (torch.randn(4, 8, 4),))
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        for seq in (5, 6, 7):
            x = torch.randn(4, seq, 4)
            torch.testing.assert_close(pipe(x), model(x))
    assert "holds only where x.size()[1] % 2 == 0 (a guard of torch.export); this call has x (4, 5, 4)" in _said(caplog)
    assert len(pipe.variants) == 2


def test_with_max_variants_1_that_length_is_refused_naming_the_dimension_and_the_remedy():
    model = BranchOnLength()
    pipe = _compile(model, (torch.randn(4, 8, 4),), max_variants=1)
    with pytest.raises(MobiusError, match=r"x dim 1 is 4; the traced graph holds for 7 <= dim 1.*max_variants=1"
                                          r".*pad sequences to a length it was compiled for"):
        pipe(torch.randn(4, 4, 4))
    x = torch.randn(4, 9, 4)
    torch.testing.assert_close(pipe(x), model(x))


def test_a_batch_of_one_runs_on_the_graph_traced_for_four():
    """Export traces the batch for sizes >= 2 (sizes 0 and 1 it would specialise); micro-batches
    already run it on fewer rows, so a batch of 1 is no new shape (here with a fixed signature)."""
    torch.manual_seed(0)
    model = BranchOnLength()
    pipe = _compile(model, (torch.randn(4, 8, 4),), microbatches=1, max_variants=1)
    x = torch.randn(1, 8, 4)
    torch.testing.assert_close(pipe(x), model(x))


class PinnedLength(nn.Module):
    """Its weights fix the length: a (length, width) scale and a reshape to length*width features
    (a tensor made from a traced size keeps torch.fx out). Eager fails on any other length."""

    def __init__(self, seq=8, width=4):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(seq, width))
        self.fc = nn.Linear(seq * width, 3)

    def forward(self, x):
        b, t, c = x.shape
        return self.fc((x * self.scale * torch.ones(t, c)).reshape(b, -1))


def test_a_wrong_length_is_a_mobius_error_naming_the_dimension():
    torch.manual_seed(0)
    model = PinnedLength()
    x = torch.randn(4, 8, 4)
    pipe = _compile(model, (x,))
    with pytest.raises(MobiusError, match=r"x dim 1 is 4; the traced graph has it fixed at 8.*tracing the model for "
                                          r"this call failed too"):
        pipe(torch.randn(4, 4, 4))
    gm = mobius_fx.trace(model, example_inputs=(x,))
    strict = build_pipeline(model, gm, stage_nodes=None, stage_gpus=None, schedule=None, plan=pipe.plan,
                            example_inputs=(x,), device="virtual")
    with pytest.raises(MobiusError, match=r"x dim 2 is 5; the traced graph has it fixed at 4.*build_pipeline"):
        strict(torch.randn(4, 8, 5))
    with pytest.raises(MobiusError, match=r"x is a 2-D torch.float32 tensor here; the pipeline was traced with a 3-D"):
        strict(torch.randn(4, 32))
    torch.testing.assert_close(strict(x), model(x))


def test_bert_longer_than_its_position_table_is_a_mobius_error_naming_the_dimension_and_the_bound():
    model = hf_bert(positions=64)
    pipe = _compile(model, kwargs={"input_ids": _ids(4, 16)})
    with pytest.raises(MobiusError, match=r"input_ids dim 1 is 80; the traced graph holds for 2 <= dim 1 <= 64.*"
                                          r"tracing the model for this call failed too"):
        pipe(input_ids=_ids(4, 80))
    with torch.no_grad():
        torch.testing.assert_close(pipe(input_ids=_ids(4, 64)).logits, model(input_ids=_ids(4, 64)).logits)


# ----------------------------------------------------------------------------- plans for larger calls

def _mlp():
    torch.manual_seed(0)
    return ResidualMLP(d_in=8, width=64, depth=8, d_out=4)


def test_a_longer_call_whose_stages_still_fit_keeps_the_plan(caplog):
    model = _mlp()
    pipe = _compile(model, (torch.randn(4, 8, 8),), memory="2MiB")
    plan = pipe.plan
    x = torch.randn(4, 16, 8)
    with caplog.at_level(logging.INFO, logger="mobius_fx"):
        out = pipe(x)
    torch.testing.assert_close(out, model(x))
    said = _said(caplog, logging.INFO)
    assert "larger than planned (x 512 elements (planned 256)); the plan's stages still fit" in said
    assert pipe.plan is plan and len(pipe.variants) == 1 and pipe.variants[0].sizes == {"x": 512}


def test_a_longer_call_whose_stages_do_not_fit_is_replanned_and_says_so(caplog):
    model = _mlp()
    eager = copy.deepcopy(model)
    pipe = _compile(model, (torch.randn(4, 8, 8),), memory="1MiB")
    pipe.variants[0].boundaries = (0, 5)  # as if the plan had cut the model in two stages
    x = torch.randn(4, 16, 8)
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        out = pipe(x)
    said = _said(caplog)
    assert "cuts (0, 5) do not fit" in said and "re-planned" in said
    assert len(pipe.variants) == 2 and pipe.plan is pipe.variants[1].plan and pipe.plan.num_stages > 2
    out.sum().backward()
    want = eager(x)
    want.sum().backward()
    torch.testing.assert_close(out, want)
    for n, g in _grads(eager).items():
        torch.testing.assert_close(_grads(model)[n], g)
