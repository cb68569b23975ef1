"""Autograd and state semantics: the pipeline does what eager does, or compile refuses, saying so.

One test per behaviour of issue 15 (points 3 and 4): custom autograd.Functions keep their
backward; in-place buffer updates run every call; state-changing modules update once per step
(not again in the backward's recompute); a parameter changed in place in forward is refused;
`backward(inputs=...)`, `autograd.grad` and parameter hooks see eager's gradients;
`load_state_dict(assign=True)` after compile is followed; train()/eval() on an export graph
warns; compile never changes the model (every parameter and buffer bit for bit), and T5
compiles with the default settings.

The tests that train run on both loops (`loop`: the eager-style `loss.backward()` and
`pipe.train_step`, tests/unit/loops.py). Eager-only, because train_step has no such call:
`backward(inputs=...)` and `torch.autograd.grad` on the masters (train_step always accumulates
into every trainable master's `.grad`), and an input's gradient (train_step returns no graph
to its inputs). T5 with the default settings runs eager only: its step's compile would add ~10 s,
and T5's train_step with labels= is tested on every schedule in test_schedule_matrix.py.
"""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import spectral_norm as old_spectral_norm
from torch.nn.utils.parametrizations import spectral_norm

from mobius_fx import MobiusError, Topology, TraceError
from mobius_fx.passes.annotate import annotate
from mobius_fx.tracing import trace
from tests.unit.loops import LOOPS, compile_for, step

pytestmark = pytest.mark.usefixtures("one_thread")


def _compile(model, x, tmp_path, loop="eager", **kw):
    return compile_for(loop, model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,),
                       cache_dir=str(tmp_path), **kw)


def _same_grads(model, eager):
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}


def _bitwise_same(model, before):
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), k


# ----------------------------------------------------------------------------- autograd.Function

class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class WithFunctions(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = GradReverse.apply(self.a(x))
        return self.c(StraightThrough.apply(self.b(h)) * h)


@pytest.mark.parametrize("loop", LOOPS)
def test_custom_autograd_functions_keep_their_backward(tmp_path, loop):
    torch.manual_seed(0)
    model = WithFunctions()
    eager = copy.deepcopy(model)
    gm = trace(model, example_inputs=(torch.randn(4, 8),))
    assert gm.meta["mobius_trace"].front_end == "fx"
    assert sum(getattr(n.target, "autograd_function", None) is not None for n in gm.graph.nodes) == 2
    pipe = _compile(model, torch.randn(4, 8), tmp_path, loop, microbatches=2, loss=lambda out: out.square().sum())
    x = torch.randn(4, 8)
    xp, xe = x.clone().requires_grad_(loop == "eager"), x.clone().requires_grad_()
    loss, out = step(loop, pipe, xp)
    ref = eager(xe)
    if out is not None:
        torch.testing.assert_close(out, ref)
    ref = ref.square().sum()
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    _same_grads(model, eager)
    if loop == "eager":  # train_step returns no graph to its inputs
        torch.testing.assert_close(xp.grad, xe.grad)
    assert model.a.weight.grad.abs().sum() > 0  # the straight-through estimator passes gradients


class ExportOnlyWithFunction(nn.Module):
    """fx cannot branch on `x.dim()`, so this goes through torch.export."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        if x.dim() == 2:
            x = GradReverse.apply(self.a(x))
        return x


def test_an_export_graph_with_a_custom_autograd_function_is_refused(tmp_path):
    with pytest.raises(TraceError, match=r"GradReverse.*drops its backward.*symbolic_trace keeps each Function"):
        _compile(ExportOnlyWithFunction(), torch.randn(4, 8), tmp_path)


# ----------------------------------------------------------------------------- state

class Counting(nn.Module):
    """A step counter and an EMA updated in place (outside what symbolic_trace records)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        self.count.add_(1)
        h = self.a(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return h * self.count + self.ema


class Totals(nn.Module):
    """A running total symbolic_trace records (its argument is a traced value)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("total", torch.zeros(()))

    def forward(self, x):
        h = self.a(x)
        self.total.add_(h.detach().abs().mean())
        return h * self.total


@pytest.mark.parametrize("block, front_end", [(Counting, "export"), (Totals, "fx")])
@pytest.mark.parametrize("loop", LOOPS)
def test_in_place_buffer_updates_happen_every_call(tmp_path, block, front_end, loop):
    torch.manual_seed(0)
    model = nn.Sequential(block(), nn.ReLU(), nn.Linear(8, 8), block())
    eager = copy.deepcopy(model)
    x = torch.randn(4, 8)
    pipe = _compile(model, x, tmp_path, loop, microbatches=2, loss=lambda out: out.sum())
    assert pipe._gm.meta["mobius_trace"].front_end == front_end
    if loop == "train_step":
        assert pipe.step_pipeline._gm.meta["mobius_trace"].front_end == front_end
    for i in range(3):
        x = torch.randn(4, 8)
        loss, out = step(loop, pipe, x)
        refs = []
        for c in x.chunk(2):  # eager micro-batch by micro-batch (gradient accumulation), as documented
            refs.append(eager(c))
            refs[-1].sum().backward()
        if out is not None:
            torch.testing.assert_close(out, torch.cat(refs), msg=f"step {i}")
        torch.testing.assert_close(loss, sum(r.sum() for r in refs).detach(), msg=f"step {i}")
        _same_grads(model, eager)  # the recompute saw the buffers as the forward did
        for (name, b), r in zip(model.named_buffers(), eager.buffers()):
            torch.testing.assert_close(b, r, msg=f"{name}, step {i}")


def test_the_fx_front_end_refuses_buffer_updates_it_cannot_record():
    model = Counting()
    before = _state(model)
    with pytest.raises(TraceError, match=r"buffer `count` \(in module `<root>`, Counting\).*torch.export records"):
        trace(model, example_inputs=(torch.randn(4, 8),), front_end="fx")
    _bitwise_same(model, before)


@pytest.mark.parametrize("norm", [spectral_norm, old_spectral_norm], ids=["parametrizations", "hook"])
@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("loop", LOOPS)
def test_state_changing_modules_update_once_per_step(tmp_path, norm, microbatches, loop):
    torch.manual_seed(0)
    model = nn.Sequential(norm(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 8), norm(nn.Linear(8, 4)))
    eager = copy.deepcopy(model)
    pipe = _compile(model, torch.randn(4, 8), tmp_path, loop, microbatches=microbatches,
                    loss=lambda out: out.square().sum())
    for i in range(2):
        x = torch.randn(4, 8)
        loss, out = step(loop, pipe, x)
        refs = []
        for c in x.chunk(microbatches):  # eager micro-batch by micro-batch (gradient accumulation)
            refs.append(eager(c))
            refs[-1].square().sum().backward()
        if out is not None:
            torch.testing.assert_close(out, torch.cat(refs))
        torch.testing.assert_close(loss, sum(r.square().sum() for r in refs).detach())
        _same_grads(model, eager)  # the power iteration ran once per call, not again in recompute
        for (name, b), r in zip(model.named_buffers(), eager.buffers()):
            torch.testing.assert_close(b, r, msg=f"{name}, step {i}")


class ScalesItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            self.a.weight.mul_(0.5)
        return self.b(self.a(x))


def test_an_in_place_parameter_update_in_forward_is_refused_at_compile(tmp_path):
    model = ScalesItsWeight()
    before = _state(model)
    with pytest.raises(TraceError, match=r"changes parameter `a.weight` \(in module `a`, Linear\) in place.*"
                                         r"Change parameters outside forward"):
        _compile(model, torch.randn(4, 8), tmp_path)
    _bitwise_same(model, before)


# ----------------------------------------------------------------------------- gradients on the masters

def _mlp_pair(tmp_path, microbatches=2, loop="eager"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    eager = copy.deepcopy(model)
    return model, eager, _compile(model, torch.randn(4, 8), tmp_path, loop, microbatches=microbatches,
                                  loss=lambda out: out.sum())


def test_backward_with_inputs_accumulates_only_into_those_asked_for(tmp_path):
    model, eager, pipe = _mlp_pair(tmp_path)
    x = torch.randn(4, 8)
    pipe(x).sum().backward(inputs=[model[2].weight, model[4].bias])
    eager(x).sum().backward(inputs=[eager[2].weight, eager[4].bias])
    _same_grads(model, eager)
    assert model[0].weight.grad is None and model[2].weight.grad is not None


def test_autograd_grad_on_the_masters_gives_eager_gradients(tmp_path):
    model, eager, pipe = _mlp_pair(tmp_path)
    x = torch.randn(4, 8)
    got = torch.autograd.grad(pipe(x).sum(), list(model.parameters()))
    want = torch.autograd.grad(eager(x).sum(), list(eager.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert all(p.grad is None for p in model.parameters())  # autograd.grad does not accumulate
    xp = x.clone().requires_grad_()
    xe = x.clone().requires_grad_()
    torch.testing.assert_close(torch.autograd.grad(pipe(xp).sum(), xp)[0], torch.autograd.grad(eager(xe).sum(), xe)[0])
    assert all(p.grad is None for p in model.parameters())  # nor does the gradient of an input
    assert all(s["current_bytes"] == 0 for s in pipe.memory_stats().values())


@pytest.mark.parametrize("loop", LOOPS)
def test_parameter_hooks_see_and_change_the_gradient(tmp_path, loop):
    model, eager, pipe = _mlp_pair(tmp_path, loop=loop)
    seen = []
    model[0].weight.register_hook(lambda g: seen.append(g.clone()) or 2 * g)
    eager[0].weight.register_hook(lambda g: 2 * g)
    x = torch.randn(4, 8)
    step(loop, pipe, x)
    eager(x).sum().backward()
    _same_grads(model, eager)
    assert len(seen) == 1 and torch.equal(model[0].weight.grad, 2 * seen[0])


@pytest.mark.parametrize("loop", LOOPS)
def test_load_state_dict_with_assign_after_compile_is_followed(tmp_path, loop):
    model, eager, pipe = _mlp_pair(tmp_path, loop=loop)
    new = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(new, assign=True)
    eager.load_state_dict(new)
    x = torch.randn(4, 8)
    loss, out = step(loop, pipe, x)
    ref = eager(x)
    if out is not None:
        torch.testing.assert_close(out, ref)
    ref.sum().backward()
    torch.testing.assert_close(loss, ref.sum().detach())
    _same_grads(model, eager)


def test_a_parameter_replaced_by_one_of_another_shape_is_refused(tmp_path):
    model, _, pipe = _mlp_pair(tmp_path)
    model[2].weight = nn.Parameter(torch.randn(16, 8))
    with pytest.raises(MobiusError, match=r"`2.weight` was replaced by a torch.float32 tensor of shape \(16, 8\).*"
                                          r"compile the model again"):
        pipe(torch.randn(4, 8))


# ----------------------------------------------------------------------------- train / eval

class DropsOnExport(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4)

    def forward(self, x):
        if x.dim() == 2:  # fx cannot branch on a traced value: export
            x = self.drop(self.a(x))
        return self.b(x)


def test_eval_on_an_export_graph_warns_that_the_mode_is_baked_in(tmp_path, recwarn):
    pipe = _compile(DropsOnExport(), torch.randn(4, 8), tmp_path)
    assert pipe._gm.meta["mobius_trace"].front_end == "export"
    pipe(torch.randn(4, 8))
    assert not [w for w in recwarn if "torch.export" in str(w.message)]
    pipe.eval()
    with pytest.warns(UserWarning, match=r"eval mode.*fixed the train mode.*Compile the model again after "
                                         r"model.eval\(\)"):
        pipe(torch.randn(4, 8))


# ----------------------------------------------------------------------------- compile never changes the model

class ChangesActivationsInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h.mul_(0.5).add_(1.0)
        idx = torch.arange(8).remainder_(3)  # an in-place op on an index, as T5's buckets
        return self.b(self.norm(h)) + h[:, idx]


@pytest.mark.parametrize("make", [ChangesActivationsInPlace, Counting, Totals,
                                  lambda: nn.Sequential(spectral_norm(nn.Linear(8, 8)), nn.Dropout(0.1))],
                         ids=["activations+batchnorm", "counter+ema", "total", "spectral_norm+dropout"])
@pytest.mark.parametrize("costs", ["measure", "model"])
def test_compile_never_changes_the_model(tmp_path, make, costs):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(4, 8)
    before = _state(model)
    rng = torch.get_rng_state()
    _compile(model, x, tmp_path, costs=costs)
    _bitwise_same(model, before)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


def test_measuring_costs_never_runs_on_the_models_tensors():
    """annotate alone, on a graph whose forward scales a weight in place (compile refuses the
    model; the cost pass must still not change it, however often it runs the node)."""
    model = ScalesItsWeight()
    gm = torch.fx.symbolic_trace(model)
    before = _state(model)
    annotate(gm, example_inputs=(torch.randn(4, 8),), costs="measure", warmup=2, repeats=5)
    _bitwise_same(model, before)


def test_t5_compiles_with_the_default_settings(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
                                num_heads=2, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0,
                                pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg)
    eager = copy.deepcopy(model)
    before = _state(model)
    ids, labels = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    pipe = compile_for("eager", model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(),
                       example_kwargs=dict(input_ids=ids, labels=labels), cache_dir=str(tmp_path))
    _bitwise_same(model, before)
    loss, _ = step("eager", pipe, input_ids=ids, labels=labels)  # the model's own loss
    _bitwise_same(model, before)  # a step changes .grad only
    ref = eager(input_ids=ids, labels=labels)
    torch.testing.assert_close(loss, ref.loss.detach())
    ref.loss.backward()
    _same_grads(model, eager)
