"""Transformer models through the whole front end (mobius_fx.trace -> pipeline) train like eager."""

import copy

import pytest
import torch
import torch.fx as fx

from mobius_fx import trace
from mobius_fx.build import build_pipeline
from mobius_fx.zoo import hf_gpt2, hf_inputs, hf_llama, nanogpt, nanogpt_inputs

_COMPUTE = ("call_function", "call_method", "call_module")

pytestmark = pytest.mark.usefixtures("one_thread")



def even_cut(gm: fx.GraphModule, stages: int) -> list[list[str]]:
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    bounds = [round(i * len(names) / stages) for i in range(stages + 1)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def compile_(model, inputs, kwargs=None, *, stages=4, gpus=2, microbatches=2):
    gm = trace(model, example_inputs=inputs, example_kwargs=kwargs)
    return build_pipeline(model, gm, stage_nodes=even_cut(gm, stages),
                          stage_gpus=[f"gpu{k % gpus}" for k in range(stages)], gpu_budgets={},
                          microbatches=microbatches, example_inputs=inputs, example_kwargs=kwargs, device="virtual")


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(a, b, **tol):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=lambda m: f"{name}: {m}", **tol)


def test_nanogpt_with_tied_weights_through_export_matches_eager():
    torch.manual_seed(0)
    model = nanogpt(hidden=32, blocks=2, vocab=64, seq=8, heads=2)
    (idx,) = nanogpt_inputs(model, batch=4)
    targets = torch.roll(idx, 1, dims=1)
    pipe = compile_(model, (idx, targets), stages=4, gpus=2, microbatches=2)
    assert pipe._gm.meta["mobius_trace"].front_end == "export"
    logits, loss = model(idx, targets)
    loss.backward()
    eager = grads(model)
    model.zero_grad(set_to_none=True)
    p_logits, p_loss = pipe(idx, targets)
    p_loss.backward()
    torch.testing.assert_close(p_logits, logits)
    torch.testing.assert_close(p_loss, loss)
    assert_grads_close(grads(model), eager)
    # wte is read by the first stage (embedding) and the last (lm_head): one master, one summed grad
    users = [k for k, st in enumerate(pipe.schedule.stages)
             if any(w.tensor is model.transformer.wte.weight for w in st.weights)]
    assert users == [0, 3]


@pytest.mark.parametrize("builder", [hf_gpt2, hf_llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_hf_causal_lm_through_export_matches_eager(builder, microbatches):
    torch.manual_seed(0)
    model = builder()
    model.train()
    (ids,) = hf_inputs(model, batch=4, seq=8)
    eager_model = copy.deepcopy(model)
    out = eager_model(ids, labels=ids)
    out.loss.backward()
    pipe = compile_(model, (ids,), {"labels": ids}, stages=4, gpus=2, microbatches=microbatches)
    p_out = pipe(ids, labels=ids)
    assert type(p_out) is type(out)
    p_out.loss.backward()
    torch.testing.assert_close(p_out.logits, out.logits)
    torch.testing.assert_close(p_out.loss, out.loss)
    assert_grads_close(grads(model), grads(eager_model))
    if builder is hf_gpt2:  # tied wte / lm_head: one master with both stages' gradients
        assert model.lm_head.weight is model.transformer.wte.weight
    assert all(s["current_bytes"] == 0 for s in pipe.memory_stats().values())


def test_twenty_adamw_steps_on_a_tiny_gpt_follow_the_eager_loss_curve():
    torch.manual_seed(0)
    model = nanogpt(hidden=32, blocks=2, vocab=64, seq=8, heads=2, dropout=0.1)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 64, (4, 9), generator=g) for _ in range(2)] * 10  # two batches to learn
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    pipe = compile_(model, batches[0], stages=4, gpus=2, microbatches=1)

    def train(fn, params):
        opt = torch.optim.AdamW(params, lr=1e-2)
        torch.manual_seed(5)  # same dropout masks for both runs
        losses = []
        for idx, targets in batches:
            opt.zero_grad(set_to_none=True)
            _, loss = fn(idx, targets)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return torch.tensor(losses)

    eager = train(reference, reference.parameters())
    piped = train(pipe, model.parameters())
    assert eager[-1] < eager[0] - 0.5  # it learns
    torch.testing.assert_close(piped, eager, rtol=0, atol=1e-4)
