"""Eager semantics or a clear refusal, round three (issue 39, classes 4-7, its unclear errors and
what was left quiet).

- class 4: a weight changed in place between a forward and its backward (`opt.step()` or a
  `no_grad` edit before `loss.backward()`) is refused at the backward, naming the parameter
  (eager raises "modified by an inplace operation"; the pipeline would recompute the stage from
  the new weight);
- class 5: module hooks the pipeline cannot run (on a module the tracer traced through, or on the
  top-level model) are refused by name at compile or at the call; leaf hooks are followed, a
  full backward hook registered after compile included;
- class 6: a tensor hook registered inside forward, which torch.export drops, is refused at compile;
- class 7: a forward that assigns an attribute, changes a container or an input in place is
  refused at compile, and the model is left as it was (no fx Proxy left in it);
- a parameter or constant returned as an output, and sparse embeddings, are refused by name;
- a buffer updated in place once per micro-batch is warned about at compile.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mobius_fx import MobiusError
from mobius_fx.errors import TraceError
from mobius_fx.tracing import trace

from tests.unit.test_eager_semantics import _compile, _mlp  # noqa: E402  (the same small cases)

pytestmark = pytest.mark.usefixtures("one_thread")




def _same_grads(model, eager):
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


# ----------------------------------------------------------------------------- class 4: weights edited before backward

@pytest.mark.parametrize("edit", ["optimizer_step", "no_grad_edit"])
def test_a_weight_changed_between_forward_and_backward_is_refused_as_in_eager(tmp_path, edit):
    model, x = _mlp(), torch.randn(4, 4)
    eager = copy.deepcopy(model)
    pipe = _compile(model, x, tmp_path)

    def change(m):
        if edit == "optimizer_step":
            m.zero_grad()
            for p in m.parameters():
                p.grad = torch.ones_like(p)
            torch.optim.SGD(m.parameters(), lr=0.1).step()
            m.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                m[2].weight.add_(0.5)

    ref = eager(x).sum()
    change(eager)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ref.backward()  # what eager does
    loss = pipe(x).sum()
    change(model)
    with pytest.raises(MobiusError, match=r"parameter `\d\.weight` was modified in place after the forward"):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())  # nothing half-done
    # the pipeline stays usable: a forward after the change and its backward are eager's
    pipe(x).sum().backward()
    eager.zero_grad(set_to_none=True)
    eager(x).sum().backward()
    _same_grads(model, eager)


def test_a_weight_changed_after_backward_is_the_usual_loop(tmp_path):
    model, x = _mlp(), torch.randn(4, 4)
    eager = copy.deepcopy(model)
    pipe = _compile(model, x, tmp_path)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    for _ in range(2):
        for m, f, opt in ((model, pipe, opts[0]), (eager, eager, opts[1])):
            opt.zero_grad()
            f(x).square().sum().backward()
            opt.step()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q)


# ----------------------------------------------------------------------------- class 5: module hooks

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blk, self.head = Block(), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.blk(x))


@pytest.mark.parametrize("register", [
    lambda m: m.blk.register_forward_hook(lambda mod, a, o: o * 2),
    lambda m: m.blk.register_forward_pre_hook(lambda mod, a: None),
    lambda m: m.blk.register_forward_hook(lambda mod, a, k, o: None, with_kwargs=True),
    lambda m: m.blk.register_full_backward_hook(lambda mod, gi, go: None),
    lambda m: m.register_forward_hook(lambda mod, a, o: o * 2),
], ids=["forward", "forward_pre", "forward_kwargs", "full_backward", "top_level"])
def test_a_hook_on_a_traced_through_module_after_compile_is_refused_at_the_call(tmp_path, register):
    model, x = Net(), torch.randn(4, 4)
    pipe = _compile(model, x, tmp_path)
    handle = register(model)
    with pytest.raises(MobiusError, match=r"(`blk` \(Block\)|top-level model \(Net\)) after compile"):
        pipe(x)
    handle.remove()
    pipe(x).sum().backward()  # usable again once it is gone


@pytest.mark.parametrize("register", [
    lambda m: m.blk.register_full_backward_hook(lambda mod, gi, go: None),
    lambda m: m.blk.register_full_backward_pre_hook(lambda mod, go: None),
    lambda m: m.register_forward_pre_hook(lambda mod, a: None),
], ids=["full_backward", "backward_pre", "top_level"])
def test_a_hook_the_pipeline_cannot_run_is_refused_at_compile(tmp_path, register):
    model, x = Net(), torch.randn(4, 4)
    register(model)
    with pytest.raises(MobiusError, match=r"hook `.*` is registered on .* at compile"):
        _compile(model, x, tmp_path)


def test_removing_a_hook_traced_into_the_graph_is_refused(tmp_path):
    model, x = Net(), torch.randn(4, 4)
    eager = copy.deepcopy(model)
    handle = model.blk.register_forward_hook(lambda mod, a, o: o * 2)
    eager.blk.register_forward_hook(lambda mod, a, o: o * 2)
    pipe = _compile(model, x, tmp_path)
    torch.testing.assert_close(pipe(x), eager(x))  # compiled in: eager's result
    handle.remove()
    with pytest.raises(MobiusError, match="removed from `blk`"):
        pipe(x)


@pytest.mark.parametrize("kind", ["forward", "forward_pre"])
def test_a_recording_hook_on_a_traced_through_module_is_refused_at_compile(tmp_path, kind):
    model, x = Net(), torch.randn(4, 4)
    seen = []
    if kind == "forward":
        model.blk.register_forward_hook(lambda mod, a, o: seen.append(o))
    else:
        model.blk.register_forward_pre_hook(lambda mod, a: seen.append(a))
    with pytest.raises(TraceError, match=r"hook `.*<lambda>` on `blk` returns None: it ran once"):
        _compile(model, x, tmp_path)


def test_a_recording_hook_on_a_leaf_runs_at_every_call(tmp_path):
    model, x = Net(), torch.randn(4, 4)
    seen = []
    model.blk.a.register_forward_hook(lambda mod, a, o: seen.append(o.detach().clone()))
    pipe = _compile(model, x, tmp_path, microbatches=1)
    seen.clear()
    with torch.no_grad():
        out = pipe(x)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], model.blk.a(x))


def test_a_full_backward_hook_on_a_leaf_registered_after_compile_runs_as_in_eager(tmp_path):
    model, x = Net(), torch.randn(4, 4)
    eager = copy.deepcopy(model)
    pipe = _compile(model, x, tmp_path, microbatches=1)
    calls = []

    def halve(mod, grad_in, grad_out):  # changes the gradient flowing into the layer's input
        calls.append(grad_out[0].shape)
        return (grad_in[0] * 0.5,)

    model.blk.b.register_full_backward_hook(halve)
    eager.blk.b.register_full_backward_hook(halve)
    pipe(x).sum().backward()
    eager(x).sum().backward()
    assert calls == [torch.Size([4, 4])] * 2  # once in the pipeline, once in eager
    _same_grads(model, eager)


# ----------------------------------------------------------------------------- class 6: tensor hooks in forward

class Reversal(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda g: -g)  # gradient reversal
        return self.b(h)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_tensor_hook_registered_in_forward_is_refused_on_the_export_path(tmp_path, microbatches):
    model, x = Reversal(), torch.randn(4, 4)
    with pytest.raises(TraceError, match=r"registers a tensor hook \(Reversal\.forward\.<locals>\.<lambda>"):
        _compile(model, x, tmp_path, microbatches=microbatches)


# ----------------------------------------------------------------------------- class 7: side effects

class AuxLoss(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.aux = 0.0

    def forward(self, x):
        h = self.a(x)
        self.aux = h.square().mean()  # an MoE-style auxiliary loss
        return self.b(h)


class Records(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.seen, self.stats = [], {}

    def forward(self, x):
        h = self.a(x)
        self.seen.append(h)
        return h


class ClampsInput(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)

    def forward(self, x, y=None):
        x.clamp_(-0.1, 0.1)
        return self.a(x)


class AuxAround(AuxLoss):
    def forward(self, x):
        h = self.a(x)
        object.__setattr__(self, "aux", h.square().mean())  # around nn.Module.__setattr__
        return self.b(h)


@pytest.mark.parametrize("front_end", ["fx", "export"])
@pytest.mark.parametrize("cls", [AuxLoss, AuxAround])
def test_an_attribute_assigned_in_forward_is_refused_and_left_as_it_was(front_end, cls):
    model, x = cls(), torch.randn(4, 4)
    with pytest.raises(TraceError, match=r"assigns the attribute `aux`.*Return the value from forward"):
        trace(model, example_inputs=(x,), front_end=front_end)
    assert model.aux == 0.0 and type(model.aux) is float  # no fx Proxy, no fake tensor left behind


def test_an_attribute_assigned_in_forward_is_refused_at_compile(tmp_path):
    model, x = AuxLoss(), torch.randn(4, 4)
    with pytest.raises(TraceError, match="`aux`"):
        _compile(model, x, tmp_path)
    assert model.aux == 0.0


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_a_container_changed_in_forward_is_refused_and_left_as_it_was(front_end):
    model, x = Records(), torch.randn(4, 4)
    with pytest.raises(TraceError, match=r"changes the container `seen` \(list of Records\)"):
        trace(model, example_inputs=(x,), front_end=front_end)
    assert model.seen == [] and model.stats == {}


def test_an_input_changed_in_place_by_forward_is_refused_by_name(tmp_path):
    model, x = ClampsInput(), torch.randn(4, 4)
    before = x.clone()
    with pytest.raises(TraceError, match=r"changes its input `x` in place"):
        _compile(model, x, tmp_path)
    assert torch.equal(x, before)  # compile did not change the caller's tensor either


def test_torch_own_attribute_updates_in_forward_are_not_side_effects(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 2))
    eager = copy.deepcopy(model)
    x = torch.randn(4, 4)
    pipe = _compile(model, x, tmp_path, microbatches=1)  # spectral_norm's pre-hook sets `weight` each call
    torch.testing.assert_close(pipe(x), eager(x))


# ----------------------------------------------------------------------------- unclear errors

class ReturnsWeight(nn.Module):
    def __init__(self, constant=False):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.constant = nn.Linear(4, 4), constant

    def forward(self, x):
        return self.a(x), (torch.tensor(3.0) if self.constant else self.a.weight)


@pytest.mark.parametrize("constant,match", [(False, r"its parameter `a.weight` as an output.*model\.a\.weight"),
                                            (True, "a constant tensor")])
def test_a_parameter_or_constant_output_is_refused_by_name(tmp_path, constant, match):
    with pytest.raises(MobiusError, match=match):
        _compile(ReturnsWeight(constant), torch.randn(4, 4), tmp_path, microbatches=1)


class SparseEmbedding(nn.Module):
    def __init__(self, functional=False):
        super().__init__()
        torch.manual_seed(0)
        self.functional = functional
        self.emb, self.head = nn.Embedding(10, 4, sparse=not functional), nn.Linear(4, 2)

    def forward(self, ids):
        h = F.embedding(ids, self.emb.weight, sparse=True) if self.functional else self.emb(ids)
        return self.head(h)


@pytest.mark.parametrize("functional,match", [(False, r"module `emb` \(Embedding\) has sparse=True"),
                                              (True, r"sparse=True over parameter `emb.weight`")])
def test_a_sparse_embedding_is_refused_at_compile(tmp_path, functional, match):
    with pytest.raises(MobiusError, match=match):
        _compile(SparseEmbedding(functional), torch.randint(0, 10, (4, 3)), tmp_path)


def test_a_frozen_sparse_embedding_runs_for_inference(tmp_path):
    model, ids = SparseEmbedding(), torch.randint(0, 10, (4, 3))
    model.emb.weight.requires_grad_(False)
    pipe = _compile(model, ids, tmp_path)
    torch.testing.assert_close(pipe(ids), model(ids))


# ----------------------------------------------------------------------------- left quiet: per-micro-batch buffers

class Counts(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.a(x)


def test_a_buffer_updated_per_micro_batch_is_warned_at_compile(tmp_path, recwarn):
    model, x = Counts(), torch.randn(4, 4)
    with pytest.warns(UserWarning, match=r"buffer `calls` in place: with 2 micro-batches the update runs once per "):
        pipe = _compile(model, x, tmp_path)
    pipe(x)
    assert model.calls.item() == 2  # what the warning says


def test_a_buffer_updated_once_per_call_is_not_warned(tmp_path, recwarn):
    model, x = Counts(), torch.randn(4, 4)
    _compile(model, x, tmp_path / "one", microbatches=1)
    assert not [w for w in recwarn if "micro-batch" in str(w.message)]
