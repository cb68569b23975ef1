"""The ecosystem's fine-tuning path: a model wrapped by the real `peft` library (LoRA) through
`mobius_fx.compile`, called as one calls it (left-padded `attention_mask`, `labels`).

PEFT's `PeftModel.forward(*args, **kwargs)` passes everything on to the base model; torch.export
cannot match dynamic shapes to such a call, so the model is exported under its base model's
signature (`tracing._export_signature`), keeping the user's parameter names and tensors: the
batch and the sequence length stay symbolic, several micro-batches run, and the gradients land
in the user's LoRA parameters, equal to eager. Frozen base weights are fetched but never get a
`.grad` nor send one back.
"""

import copy
import logging

import pytest
import torch
from torch import nn

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.tracing import trace_info
from mobius_fx.zoo import hf_gpt2, hf_llama

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, BATCH = 100, 4
PADS = (2, 1, 1, 2)  # left padding per row: each micro-batch (2 rows) ignores as many labels, before
#                      and after a causal LM's shift, so the mean of micro-batch means is eager's mean
TARGETS = {"llama": (hf_llama, ["q_proj", "v_proj"]), "gpt2": (hf_gpt2, ["c_attn"])}  # GPT-2's are Conv1D


def lora_model(name: str, task_type: str | None = None) -> nn.Module:
    """A tiny HF causal LM (from a config) wrapped by `peft.get_peft_model` with rank-4 LoRA;
    the adapters start non-zero (`init_lora_weights=False`) so every adapter has a gradient.
    Without `task_type` it is a plain `PeftModel` (`forward(*args, **kwargs)`); with
    "CAUSAL_LM" a `PeftModelForCausalLM`, whose forward names its arguments."""
    build, targets = TARGETS[name]
    torch.manual_seed(0)
    base = build(layers=2, positions=64)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False,
                             fan_in_fan_out=name == "gpt2", task_type=task_type)
    return peft.get_peft_model(base, config)


def padded_batch(seq: int, *, pads=PADS, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """(input_ids, {attention_mask, labels}): left padding by `pads` tokens, labels -100 there."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, seq), generator=g)
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    for row, n in enumerate(pads):
        mask[row, :n] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, {"attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _compile(model, ids, kwargs, **kw):
    return mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(ids,),
                             example_kwargs=kwargs, **{"microbatches": 2, "verbose": False, **kw})


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@pytest.mark.parametrize("name,task_type", [("llama", None), ("gpt2", None), ("llama", "CAUSAL_LM")])
def test_lora_model_through_the_pipeline_equals_eager_and_sends_back_only_adapter_gradients(name, task_type):
    model = lora_model(name, task_type)
    eager = copy.deepcopy(model)
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    frozen_before = {n: p.detach().clone() for n, p in frozen.items()}

    pipe = _compile(model, *padded_batch(12))  # compiled for the longer length; shorter calls fit its plan
    info = trace_info(pipe.variants[0].gm)
    assert info.front_end == "export" and info.dynamic_batch  # dynamic shapes, not the static fallback
    for seq in (12, 8):
        ids, kwargs = padded_batch(seq, seed=seq)
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        got = pipe(ids, **kwargs)
        got.loss.backward()
        want = eager(ids, **kwargs)
        want.loss.backward()
        torch.testing.assert_close(got.loss, want.loss)
        torch.testing.assert_close(got.logits, want.logits)
        reference = dict(eager.named_parameters())
        for n, p in adapters.items():  # the gradients land in the user's own LoRA parameters
            assert p.grad is not None, f"{n} got no gradient"
            torch.testing.assert_close(p.grad, reference[n].grad, msg=lambda m, n=n: f"{n}: {m}")
        assert all(p.grad is None for p in frozen.values()), "a frozen base weight got a .grad"

        # what went back to the host in this step: the adapters' gradients, nothing of a stage
        # whose weights are all frozen
        by_stage = pipe.transfer_stats(last_step=True, by_stage=True)
        sent = {}
        for gpu in by_stage.values():
            for stage, row in gpu.get("gradient d2h", {}).items():
                sent[stage] = sent.get(stage, 0) + row["bytes"]
        trainable = {spec.index for spec in pipe.schedule.stages if any(w.tensor.requires_grad for w in spec.weights)}
        assert trainable and len(trainable) < len(pipe.schedule.stages)  # the embeddings and the head are frozen
        assert set(sent) == trainable, (sent, trainable)
        total = pipe.transfer_stats(last_step=True)
        assert sum(g.get("gradient d2h", {}).get("bytes", 0) for g in total.values()) == _bytes(adapters.values())
    assert len(pipe.variants) == 1  # both lengths ran on the one (symbolic) graph
    assert all(torch.equal(p, frozen_before[n]) for n, p in frozen.items())


def test_a_peft_call_binds_as_the_base_models_forward():
    """`PeftModel(*args, **kwargs)` is read with the base model's signature: positional or keyword
    is one argument, a keyword the base model does not take is refused by name, and left padding
    that a causal LM's label shift leaves uneven between micro-batches is warned about."""
    model = lora_model("llama")
    eager = copy.deepcopy(model)
    ids, kwargs = padded_batch(8)
    pipe = _compile(model, ids, kwargs, max_variants=1)
    torch.testing.assert_close(pipe(input_ids=ids, **kwargs).loss, eager(ids, **kwargs).loss)
    with pytest.raises(MobiusError, match="attention_maks"):
        pipe(ids, attention_maks=kwargs["attention_mask"])
    assert "forward" not in model.__dict__  # the export signature was only lent for the trace


def test_uneven_padding_after_the_label_shift_gives_eagers_loss(caplog):
    # pads 3/0 and 2/1: three ignored labels in each micro-batch, but 2 and 1 after the shift; the
    # loss is a sum and a count per micro-batch (planning/loss_ratios.py): eager's token mean, no warning
    model = lora_model("llama")
    pipe = _compile(model, *padded_batch(8))
    ids, kwargs = padded_batch(8, pads=(3, 0, 2, 1))
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        got = pipe(ids, **kwargs).loss
    said = " ".join(r.getMessage() for r in caplog.records if r.name == "mobius_fx")
    assert "ignore (-100)" not in said
    torch.testing.assert_close(got, model(ids, **kwargs).loss, rtol=1e-5, atol=1e-6)


class _Variadic(nn.Module):
    """A forward that takes only *args / **kwargs, without a model behind it to read a signature
    from: exported under the names of the example's own arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, *args, **kwargs):
        return self.proj(args[0]) * kwargs["scale"]


def test_a_variadic_forward_is_traced_with_dynamic_shapes():
    model = _Variadic()
    x, scale = torch.randn(4, 3, 4), torch.randn(4, 3, 1)
    gm = mobius_fx.trace(model, example_inputs=(x,), example_kwargs={"scale": scale}, front_end="export")
    assert trace_info(gm).dynamic_batch and "forward" not in model.__dict__
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["args_0", "scale"]
    x2, s2 = torch.randn(2, 5, 4), torch.randn(2, 5, 1)
    torch.testing.assert_close(gm(x2, scale=s2), model(x2, scale=s2))
