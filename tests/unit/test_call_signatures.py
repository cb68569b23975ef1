"""A pipeline honours every argument a call passes, like eager (mobius_fx/runtime/variants.py, call_signatures.py).

Keyword arguments given at call time but not at compile time (`attention_mask` with left
padding, `labels=`) get a variant traced for them; arguments given at compile time but not at
call time too; positional or keyword is the same argument; an argument `forward` does not take
is refused. Where no variant may be made (`build_pipeline`, `max_variants`), the call is refused
with a MobiusError that names the argument and the remedy — never dropped, never a raw error.
"""

import copy
import logging

import pytest
import torch
from torch import nn

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.build import build_pipeline
from mobius_fx.zoo import TINY_HF, hf_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def _said(caplog, level=logging.WARNING) -> str:
    """What mobius_fx logged at `level` or above (torch's own debug records left out)."""
    return " ".join(r.getMessage() for r in caplog.records if r.name == "mobius_fx" and r.levelno >= level)

VOCAB, BATCH, SEQ = 100, 4, 16


def _topo():
    return Topology.virtual(gpus=2, memory="64MiB")


def _compile(model, args=(), kwargs=None, **kw):
    kw = {"microbatches": 2, "verbose": False, **kw}
    return mobius_fx.compile(model, _topo(), example_inputs=args, example_kwargs=kwargs, **kw)


def hf_call(name: str, *, seq: int = SEQ, masked: bool = False, labels: bool = False, seed: int = 0) -> dict:
    """Keyword inputs of zoo model `name`: token ids (T5: and decoder ids), optionally a
    left-padded attention mask (rows 0 and 2 padded by 5 and 3 tokens) and labels (padding -100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, seq), generator=g)
    call = {"input_ids": ids}
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    mask[0, :5] = 0
    mask[2, :3] = 0
    if masked:
        call["attention_mask"] = mask
    if name == "t5":  # the decoder's tokens: given, or shifted from the labels
        dec = torch.randint(1, VOCAB, (BATCH, seq // 2), generator=g)
        call["labels" if labels else "decoder_input_ids"] = dec
    elif labels:
        call["labels"] = ids
    return call


def _loss(out) -> torch.Tensor:
    return out.loss if out.loss is not None else out.logits.float().pow(2).mean()


def _step(run, model, call: dict):
    """Outputs of one forward/backward of `run` (the model or its pipeline) on `call`, and the
    gradients it left in `model`'s parameters."""
    model.zero_grad(set_to_none=True)
    out = run(**call)
    _loss(out).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_matches_eager(eager, pipe, model, call):
    want, want_grads = _step(eager, eager, call)
    got, got_grads = _step(pipe, model, call)
    assert type(got) is type(want)
    torch.testing.assert_close(got.logits, want.logits)
    if want.loss is not None:
        torch.testing.assert_close(got.loss, want.loss)
    else:
        assert got.loss is None
    assert got_grads.keys() == want_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], msg=lambda m: f"{n}: {m}")
    model.zero_grad(set_to_none=True)
    return got


# ----------------------------------------------------------------------------- the HF zoo

@pytest.mark.parametrize("name", list(TINY_HF))
def test_hf_zoo_masks_labels_and_lengths_at_call_time_match_eager(name, caplog):
    """Compiled on token ids alone (length 16). Called with a left-padded mask and labels at
    another length: the variant traced for them gives eager's logits, loss and gradients (the
    mask used to be dropped: max diff 0.66, and labels gave loss=None). Other lengths, with or
    without the mask, run on the graphs already traced (export keeps the sequence symbolic)."""
    torch.manual_seed(0)
    model = TINY_HF[name]()
    model.train()
    eager = copy.deepcopy(model)
    pipe = _compile(model, kwargs=hf_call(name))
    assert pipe.variants[0].values.keys() == hf_call(name).keys()
    assert_matches_eager(eager, pipe, model, hf_call(name, seq=8, seed=1))  # a shorter sequence: no trace
    assert len(pipe.variants) == 1

    masked = hf_call(name, seq=12, masked=True, labels=True, seed=2)
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        got = assert_matches_eager(eager, pipe, model, masked)
    said = _said(caplog)
    assert "`attention_mask`" in said and "`labels`" in said and "compiling a variant" in said
    assert got.loss is not None and len(pipe.variants) == 2
    # The mask matters here: the unmasked logits differ from these (a dropped mask would fail).
    unmasked = {k: v for k, v in masked.items() if k != "attention_mask"}
    with torch.no_grad(), pytest.raises(AssertionError):
        torch.testing.assert_close(eager(**unmasked).logits, got.logits)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        assert_matches_eager(eager, pipe, model, hf_call(name, seq=SEQ, masked=True, labels=True, seed=3))
        assert_matches_eager(eager, pipe, model, hf_call(name, seq=SEQ, seed=4))
    assert len(pipe.variants) == 2 and not _said(caplog)  # each served by a graph traced before

    # Labels that ignore (-100) more tokens in one micro-batch than in the other: the loss is
    # eager's mean over all tokens (one sum over one count, planning/loss_ratios.py), with no warning.
    masked["labels"] = masked["labels"].clone()
    masked["labels"][0, :5] = -100
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        assert_matches_eager(eager, pipe, model, masked)
    assert "ignore (-100)" not in _said(caplog)
    assert len(pipe.variants) == 2


def test_a_kwarg_given_at_compile_time_and_not_at_call_time_gets_a_variant_and_unknown_ones_are_refused():
    """Compiled with a mask and `labels=ids` (the very tensor of input_ids, as HF users write it).
    Called with other labels: eager's loss (export used to trace the two as one input, so the
    graph embedded the labels). Called without mask and labels: eager's result (it used to be a
    raw KeyError). Positional is the same as keyword: no variant for it. A keyword HF's forward
    would swallow into **kwargs and ignore is refused, naming the arguments."""
    torch.manual_seed(0)
    model = hf_llama(layers=1, positions=64)
    eager = copy.deepcopy(model)
    masked = hf_call("llama", masked=True, labels=True)
    assert masked["labels"] is masked["input_ids"]
    pipe = _compile(model, kwargs=masked)
    other = {**masked, "labels": torch.roll(masked["input_ids"], 1, dims=1)}
    assert_matches_eager(eager, pipe, model, other)
    assert_matches_eager(eager, pipe, model, hf_call("llama", seed=1))  # no attention_mask, no labels
    assert len(pipe.variants) == 2
    assert pipe.variants[1].runtime.devices == pipe.variants[0].runtime.devices  # the same GPUs, the same books
    with torch.no_grad():
        by_position = pipe(other["input_ids"], other["attention_mask"], labels=other["labels"])
        torch.testing.assert_close(by_position.loss, eager(**other).loss)

    with pytest.raises(MobiusError, match=r"no keyword argument 'attn_mask'.*attention_mask.*fix its name"):
        pipe(**masked, attn_mask=torch.ones(BATCH, SEQ))
    with pytest.raises(MobiusError, match=r"does not match LlamaForCausalLM.forward"):
        pipe(torch.ones(1), input_ids=torch.ones(1))
    assert len(pipe.variants) == 2


# ----------------------------------------------------------------------------- refused calls, plain models

def test_an_unknown_keyword_is_refused_at_compile_time_before_tracing(monkeypatch):
    from mobius_fx import pass_adapters

    def refuse(*a, **k):
        raise AssertionError("tracing started; the bad keyword should have been refused first")

    monkeypatch.setattr(pass_adapters, "trace_pass", refuse)
    with pytest.raises(MobiusError, match=r"no keyword argument 'bogus'"):
        _compile(hf_llama(layers=1), kwargs={**hf_call("llama"), "bogus": torch.ones(2)})


class Gated(nn.Module):
    """A plain model with an optional tensor keyword and a float option (torch.fx traces it)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, gate=None, scale: float = 1.0):
        h = torch.relu(self.fc1(x))
        if gate is not None:
            h = h * gate
        return self.fc2(h) * scale


def _gated():
    torch.manual_seed(0)
    return Gated(), torch.randn(4, 8), torch.rand(4, 16)


def test_on_the_fx_path_an_optional_tensor_and_a_new_option_value_get_variants():
    model, x, gate = _gated()
    pipe = _compile(model, (x,))
    assert pipe._gm.meta["mobius_trace"].front_end == "fx"
    torch.testing.assert_close(pipe(x, gate=gate), model(x, gate=gate))
    torch.testing.assert_close(pipe(x, scale=2.0), model(x, scale=2.0))
    torch.testing.assert_close(pipe(x, gate, 2.0), model(x, gate, 2.0))
    torch.testing.assert_close(pipe(x, scale=1.0), model(x))  # the default: the compiled graph
    assert len(pipe.variants) == 4


def test_build_pipeline_refuses_a_call_it_was_not_traced_for_naming_the_argument_and_the_remedy():
    model, x, gate = _gated()
    gm = mobius_fx.trace(model, example_inputs=(x,))
    pipe = build_pipeline(model, gm, stage_nodes=[["fc1", "relu"], ["fc2", "mul"]], stage_gpus=["gpu0", "gpu1"],
                          gpu_budgets={}, microbatches=2, example_inputs=(x,), device="virtual")
    with pytest.raises(MobiusError, match=r"`gate` is given in this call but was not when the pipeline was traced"
                                          r".*give `gate` at compile time too \(example_kwargs=\{'gate': ...\}\)"
                                          r".*mobius_fx.compile traces a variant"):
        pipe(x, gate=gate)
    with pytest.raises(MobiusError, match=r"`scale` is given in this call but was not when the pipeline was traced"):
        pipe(x, scale=2.0)  # 1.0, the default, is what was traced
    torch.testing.assert_close(pipe(x), model(x))  # still usable


def test_max_variants_caps_the_variants_and_names_the_argument_and_the_remedy():
    model, x, gate = _gated()
    pipe = _compile(model, (x,), max_variants=2)
    pipe(x, gate=gate)
    with pytest.raises(MobiusError, match=r"`scale` is given in this call.*max_variants=2.*compile with a larger "
                                          r"max_variants"):
        pipe(x, scale=2.0)
    fixed = _compile(model, (x,), kwargs={"gate": gate}, max_variants=1)
    with pytest.raises(MobiusError, match=r"`gate` was given when the pipeline was traced but not in this call"
                                          r".*max_variants=1.*pass `gate` as the example did"):
        fixed(x)
    torch.testing.assert_close(fixed(x, gate=gate), model(x, gate=gate))
