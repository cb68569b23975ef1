"""`compile(..., loss_fn=fn)` and `pipe.train_step(...)`: the loss on the last stage.

The step leaves the masters' `.grad` as `loss_fn(model(x), y).backward()` does, returns the
batch's loss detached, moves exactly what its schedule IR says, and never sends the outputs the
loss is computed from (an LLM's logits) to the host: only the loss leaves the GPUs.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.planning.batch_sizes import set_microbatches
from mobius_fx.tracing import flatten_inputs
from mobius_fx.zoo.tiny_hf import hf_gpt2, hf_llama
from tests.property.test_conformance_props import _moved
from tests.unit.test_schedule_ir import _check_executed_order, _values

pytestmark = pytest.mark.usefixtures("one_thread")

TOPO = Topology.virtual(gpus=2, memory="64MiB")


class Classifier(nn.Module):
    def __init__(self, width=16, classes=50, blocks=3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _host_activation_bytes(pipe):
    """Bytes of activations each GPU sent to the host in the last step, by stage."""
    stats = pipe.transfer_stats(last_step=True, by_stage=True)
    return {g: {k: c["bytes"] for k, c in kinds.get("activation d2h", {}).items()} for g, kinds in stats.items()}


def _assert_grads_equal(got, want):
    assert got.keys() == want.keys()
    for n in want:  # fp32, micro-batch sums in another order: a few ulps of the largest entry
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6 * (1 + want[n].abs().max().item()))


def _check_ir(step_pipe, args, kwargs, m):
    """The step's runtime moved exactly what its schedule IR says, in the IR's order."""
    flat = flatten_inputs(step_pipe._gm, args, kwargs)
    mb = [t[: t.size(0) // m] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in flat]
    gm = copy.deepcopy(step_pipe._gm)  # a micro-batch's values as the stages compute them: a mean loss
    set_microbatches(gm.graph, m)  # leaves each micro-batch as its sum and count (planning/loss_ratios.py)
    gm.recompile()
    ir = step_pipe.schedule_ir(_values(gm, *mb))
    got, expected = _moved(step_pipe, ir)
    assert got == expected
    _check_executed_order(step_pipe, ir)


@pytest.mark.parametrize("device", ["virtual", "virtual-async"])
def test_loss_fn_step_equals_eager_and_only_the_loss_leaves(device):
    torch.manual_seed(0)
    model = Classifier()
    x, y = torch.randn(8, 16), torch.randint(0, 50, (8,))
    pipe = mobius_fx.compile(model, TOPO, example_inputs=(x,), microbatches=2, cuts=[1, 2, 3], device=device,
                             loss_fn=F.cross_entropy, example_target=y, verbose=False)
    assert pipe.step_pipeline is not None  # compiled at compile: example_target serves it
    loss = pipe.train_step(x, target=y)
    got = _grads(model)
    model.zero_grad()
    ref = F.cross_entropy(model(x), y)
    ref.backward()
    assert not loss.requires_grad
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
    _assert_grads_equal(got, _grads(model))
    last = pipe.step_pipeline.plan.num_stages - 1
    sent = _host_activation_bytes(pipe)
    assert sum(per.get(last, 0) for per in sent.values()) == 2 * 2 * 4  # per micro-batch: the loss's fp32 sum and count, no logits
    _check_ir(pipe.step_pipeline, (x,), {"target": y}, 2)


def test_hf_labels_step_sends_no_logits_and_equals_eager():
    torch.manual_seed(0)
    model = hf_gpt2(layers=2, vocab=1000, positions=16)
    ids = torch.randint(0, 1000, (4, 16))
    pipe = mobius_fx.compile(model, TOPO, example_inputs=(ids,), microbatches=2, device="virtual-async",
                             verbose=False)
    assert pipe.step_pipeline is None  # compiled at the first train_step
    out = pipe(ids, labels=ids)  # the model's own call: the logits come back, so they travel
    assert sum(b for per in _host_activation_bytes(pipe).values() for b in per.values()) >= out.logits.numel() * 4
    model.zero_grad()
    loss = pipe.train_step(ids, labels=ids)
    got = _grads(model)
    model.zero_grad()
    ref = model(ids, labels=ids).loss
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
    _assert_grads_equal(got, _grads(model))
    sent = _host_activation_bytes(pipe)
    last = pipe.step_pipeline.plan.num_stages - 1
    assert sum(per.get(last, 0) for per in sent.values()) == 2 * 2 * 4  # the loss's sum and count, not 2 x 2 x 16 x 1000 x 4 B
    assert pipe.step_pipeline.plan.stages[-1].output_bytes < out.logits.numel() * 4 // 2
    from mobius_fx.losses import chunked_cross_entropy

    assert [n for n in pipe.step_pipeline._gm.graph.nodes if n.target is chunked_cross_entropy]  # passes/chunk_loss.py


def test_llama_step_equals_eager_over_two_steps_with_the_sync_overlap():
    torch.manual_seed(0)
    model = hf_llama(layers=2, vocab=200)
    ref_model = hf_llama(layers=2, vocab=200)
    ref_model.load_state_dict(model.state_dict())
    ids = torch.randint(0, 200, (4, 8))
    pipe = mobius_fx.compile(model, TOPO, example_inputs=(ids,), microbatches=2, device="virtual-async",
                             verbose=False)
    opt = pipe.overlap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), mode="sync")
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    for i in range(3):  # the first round runs serially (the overlap watches the loop), then overlapped
        opt.zero_grad()
        loss = pipe.train_step(ids, labels=ids)
        opt.step()
        if i:
            assert opt.stepped_in_backward == len(list(model.parameters()))  # stepped during train_step's backward
        ref_opt.zero_grad()
        ref = ref_model(ids, labels=ids).loss
        ref.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_a_forward_only_call_still_runs_the_model():
    torch.manual_seed(0)
    model = Classifier()
    x, y = torch.randn(8, 16), torch.randint(0, 50, (8,))
    pipe = mobius_fx.compile(model, TOPO, example_inputs=(x,), microbatches=2, loss_fn=F.cross_entropy,
                             verbose=False)
    pipe.train_step(x, target=y)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))


def test_train_step_refuses_what_it_cannot_do():
    torch.manual_seed(0)
    model = Classifier()
    x, y = torch.randn(8, 16), torch.randint(0, 50, (8,))
    plain = mobius_fx.compile(model, TOPO, example_inputs=(x,), microbatches=2, verbose=False)
    with pytest.raises(MobiusError, match="without loss_fn"):
        plain.train_step(x, target=y)
    with pytest.raises(MobiusError, match="returns its loss"):
        plain.train_step(x)
    with_loss = mobius_fx.compile(model, TOPO, example_inputs=(x,), microbatches=2, loss_fn=F.cross_entropy,
                                  verbose=False)
    with pytest.raises(MobiusError, match="needs target="):
        with_loss.train_step(x)
    with torch.no_grad(), pytest.raises(MobiusError, match="gradients are disabled"):
        with_loss.train_step(x, target=y)
    rows = mobius_fx.compile(model, TOPO, example_inputs=(x,), microbatches=2, verbose=False,
                             loss_fn=lambda out, t: F.cross_entropy(out, t, reduction="none"))
    with pytest.raises(MobiusError, match="0-dim"):
        rows.train_step(x, target=y)
    with pytest.raises(MobiusError, match="without loss_fn"):
        mobius_fx.compile(model, TOPO, example_inputs=(x,), microbatches=2, example_target=y, verbose=False)
    assert all(p.grad is None for p in model.parameters())  # nothing ran backward into the model


def test_a_mean_cross_entropy_with_uneven_ignore_index_is_eagers_token_mean():
    """Labels ignored (-100) unevenly across the micro-batches: the step's loss is the mean over
    the batch's counted tokens, as eager's, not the mean of the micro-batch means."""
    torch.manual_seed(0)
    model = hf_gpt2(layers=1, vocab=100, positions=16)
    ids = torch.randint(0, 100, (4, 16))
    labels = ids.clone()
    labels[:2, :12] = -100  # micro-batch 0 counts 2 x 3 tokens, micro-batch 1 counts 2 x 15
    pipe = mobius_fx.compile(model, TOPO, example_inputs=(ids,), microbatches=2, verbose=False)
    loss = pipe.train_step(ids, labels=labels)
    got = _grads(model)
    model.zero_grad()
    ref = model(ids, labels=labels).loss
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
    _assert_grads_equal(got, _grads(model))
