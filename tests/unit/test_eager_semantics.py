"""Eager semantics or a clear refusal (issue 28, items 1, 2, 8, 9 and its unclear errors).

Each test is one class of silent divergence a probe round found: grad-mode regions inside
forward, a second backward without retain_graph, Python attributes changed after compile,
async checkpoints one update behind, and the errors that used to come from deep inside torch
(float8 streaming, double backward, meta inputs, two threads calling one pipeline).

The tests that train run on both loops (`loop`: the eager-style `pipe(x).sum().backward()` and
`pipe.train_step`, tests/unit/loops.py). Eager-only, because train_step has no such call or
state: a second backward (with or without `retain_graph`) and `create_graph` (train_step returns
a detached loss), and the variant switch under a running call (it reads `pipe._rt`, the model
pipeline's variant; train_step runs the step pipeline).
"""

import copy
import threading

import pytest
import torch
from torch import nn

import mobius_fx
from mobius_fx import MobiusError, Topology
from tests.unit.loops import LOOPS, compile_for, step

pytestmark = pytest.mark.usefixtures("one_thread")


def _compile(model, x, tmp_path, microbatches=2, loop="eager", **kw):
    return compile_for(loop, model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,),
                       cache_dir=str(tmp_path), microbatches=microbatches, loss=lambda out: out.sum(), **kw)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same_grads(model, eager):
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


# ----------------------------------------------------------------------------- item 2: backward twice

def test_a_second_backward_without_retain_graph_raises_as_in_eager(tmp_path):
    model, x = _mlp(), torch.randn(4, 4)
    pipe = _compile(model, x, tmp_path)
    loss = pipe(x).sum()
    loss.backward()
    first = _grads(model)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    for g, p in zip(first, model.parameters()):
        assert torch.equal(g, p.grad)  # not doubled


def test_retain_graph_backs_up_twice_as_in_eager(tmp_path):
    model, x = _mlp(), torch.randn(4, 4)
    eager = copy.deepcopy(model)
    pipe = _compile(model, x, tmp_path)
    loss = pipe(x).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    ref = eager(x).sum()
    ref.backward(retain_graph=True)
    ref.backward()
    _same_grads(model, eager)


def test_double_backward_is_refused_clearly_and_the_step_survives(tmp_path):
    model, x = _mlp(), torch.randn(4, 4)
    eager = copy.deepcopy(model)
    pipe = _compile(model, x, tmp_path)
    xx = x.clone().requires_grad_()
    loss = pipe(xx).sum()
    with pytest.raises(MobiusError, match="create_graph=True"):
        torch.autograd.grad(loss, xx, create_graph=True)
    loss.backward()  # the step was kept
    eager(x).sum().backward()
    _same_grads(model, eager)


# ----------------------------------------------------------------------------- unclear errors

@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_streaming_is_refused_at_compile(tmp_path, dtype):
    model, x = _mlp(), torch.randn(4, 4)
    with pytest.raises(MobiusError, match="storage format"):
        _compile(model, x, tmp_path, dtype=dtype)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_meta_input_at_call_time_is_refused(tmp_path, loop):
    model, x = _mlp(), torch.randn(4, 4)
    eager = copy.deepcopy(model)
    pipe = _compile(model, x, tmp_path, loop=loop)
    with pytest.raises(MobiusError, match="meta device"):
        step(loop, pipe, x.to("meta"))
    assert all(p.grad is None for p in model.parameters())
    step(loop, pipe, x)  # still usable
    eager(x).sum().backward()
    _same_grads(model, eager)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_second_thread_calling_a_running_pipeline_is_refused(tmp_path, loop):
    model, x = _mlp(), torch.randn(4, 4)
    pipe = _compile(model, x, tmp_path, loop=loop)
    errors, calls = [], []

    def other_thread():
        try:
            pipe(x)
        except Exception as e:  # noqa: BLE001 -- recorded for the assertion
            errors.append(e)

    def hook(module, args, out):  # runs inside the pipeline's forward (shells share the user's hooks)
        if not calls:
            calls.append(1)
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()

    handle = model[2].register_forward_hook(hook)
    step(loop, pipe, x)
    handle.remove()
    assert calls and len(errors) == 1 and isinstance(errors[0], MobiusError), errors
    assert "one call at a time" in str(errors[0])
    step(loop, pipe, x)  # the lock was released
    pipe(x)  # and the model pipeline's too


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, t, mask=None):
        h = torch.tanh(self.a(t))
        return self.b(h if mask is None else h * mask)


def test_a_second_call_is_refused_before_it_switches_the_variant(tmp_path):
    torch.manual_seed(0)
    model, x = _Masked(), torch.randn(4, 4)
    pipe = _compile(model, x, tmp_path)
    mask = torch.ones(4, 8)
    pipe(x, mask=mask)  # a second variant (another call signature), compiled and run once
    assert len(pipe.variants) == 2
    seen = {}

    def other_thread():
        try:
            pipe(x, mask=mask)
        except MobiusError as e:
            seen["error"] = e

    def hook(module, args, out):
        if "runtime" not in seen:
            seen["runtime"] = pipe._rt
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
            seen["after"] = pipe._rt

    handle = model.a.register_forward_hook(hook)
    out = pipe(x)
    handle.remove()
    assert "one call at a time" in str(seen["error"])
    assert seen["after"] is seen["runtime"]  # the running call's variant stayed in place
    out.sum().backward()


@pytest.mark.parametrize("change, what", [
    (lambda m: m.double(), r"`0.weight` was changed in place to a torch.float64 tensor.*streams a torch.float32"),
    (lambda m: m.to(torch.bfloat16), r"`0.weight` was changed in place to a torch.bfloat16 tensor"),
    (lambda m: setattr(m[2].weight, "data", torch.zeros(8, 3)), r"`2.weight` was changed in place to a torch.float32 "
                                                                r"tensor of shape \(8, 3\).*of shape \(8, 8\)"),
])
@pytest.mark.parametrize("loop", LOOPS)
def test_a_parameter_of_another_kind_after_compile_is_refused(tmp_path, change, what, loop):
    model, x = _mlp(), torch.randn(4, 4)
    pipe = _compile(model, x, tmp_path, loop=loop)
    step(loop, pipe, x)
    change(model)
    with pytest.raises(MobiusError, match=what + r".*compile the model again"):
        step(loop, pipe, x.to(next(model.parameters()).dtype))


def test_a_parameter_replaced_by_one_of_its_kind_is_used(tmp_path):
    model, x = _mlp(), torch.randn(4, 4)
    pipe = _compile(model, x, tmp_path)
    model[2].weight = nn.Parameter(torch.zeros(8, 8))
    torch.testing.assert_close(pipe(x), model(x))


# ----------------------------------------------------------------------------- item 1: grad-mode regions

class _Regions(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    @torch.no_grad()
    def frozen(self, t):
        return self.a(t)

    def forward(self, t):
        if self.kind == "no_grad":
            with torch.no_grad():
                h = self.a(t)
        elif self.kind == "set_grad_enabled":
            with torch.set_grad_enabled(False):
                h = self.a(t)
            h = h + self.a(t)  # the same layer again, with grad: only this use trains it
        elif self.kind == "inference_mode":
            with torch.inference_mode():
                h = self.a(t)
            h = h.clone()  # eager refuses to save an inference tensor for backward
        else:
            h = self.frozen(t)
        return self.c(torch.tanh(self.b(h)))


@pytest.mark.parametrize("kind", ["no_grad", "set_grad_enabled", "inference_mode", "decorator"])
@pytest.mark.parametrize("loop", LOOPS)
def test_grad_mode_regions_in_forward_compute_as_in_eager(tmp_path, kind, loop):
    torch.manual_seed(0)
    model, x = _Regions(kind), torch.randn(4, 4)
    eager = copy.deepcopy(model)
    pipe = _compile(model, x, tmp_path, loop=loop)
    assert torch.is_grad_enabled()  # tracing left the caller's grad mode alone
    step(loop, pipe, x)
    eager(x).sum().backward()
    _same_grads(model, eager)
    if kind != "set_grad_enabled":
        assert model.a.weight.grad is None  # never trained, as in eager


def test_symbolic_trace_alone_refuses_a_grad_mode_region_naming_it():
    from mobius_fx.tracing import trace

    with pytest.raises(mobius_fx.TraceError, match=r"grad mode \(torch.no_grad\(\)"):
        trace(_Regions("no_grad"), example_inputs=(torch.randn(4, 4),), front_end="fx")


# ----------------------------------------------------------------------------- item 8: Python state

class _Scaled(nn.Module):
    scale = 1.0  # a class attribute forward reads

    def __init__(self):
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 3)
        self.temperature, self.k = 1.0, 2

    def forward(self, t):
        h = self.drop(self.a(t)) / self.temperature * self.scale
        return self.b(h)[:, :self.k]


def _force_export(monkeypatch):
    import mobius_fx.tracing as tracing

    monkeypatch.setattr(tracing, "_try_fx", lambda *a: (None, "forced by the test"))


@pytest.mark.parametrize("front_end", ["fx", "export"])
@pytest.mark.parametrize("attr, value", [("temperature", 0.5), ("k", 1), ("scale", 2.0)])
@pytest.mark.parametrize("loop", LOOPS)
def test_a_python_attribute_changed_after_compile_is_refused(tmp_path, monkeypatch, front_end, attr, value, loop):
    torch.manual_seed(0)
    model, x = _Scaled(), torch.randn(4, 4)
    if front_end == "export":
        _force_export(monkeypatch)
    pipe = _compile(model, x, tmp_path, loop=loop)
    assert pipe._gm.meta["mobius_trace"].front_end == front_end
    if loop == "train_step":
        assert pipe.step_pipeline._gm.meta["mobius_trace"].front_end == front_end
    step(loop, pipe, x)
    old = getattr(model, attr)
    setattr(model, attr, value)
    with pytest.raises(MobiusError, match=rf"`{attr}` \(_Scaled\) was {old!r} .* is {value!r} now.*Compile the model"):
        step(loop, pipe, x)
    setattr(model, attr, old)
    step(loop, pipe, x)  # back to the compiled value: runs again


@pytest.mark.parametrize("loop", LOOPS)
def test_a_leaf_modules_attribute_changed_after_compile_is_followed_on_the_fx_path(tmp_path, loop):
    torch.manual_seed(0)
    model, x = _Scaled(), torch.randn(4, 4)
    pipe = _compile(model, x, tmp_path, loop=loop)
    model.drop.p = 0.0  # Dropout is a leaf to torch.fx: its stage calls it with its current p
    eager = copy.deepcopy(model)
    loss, out = step(loop, pipe, x)
    ref = eager(x)
    if out is not None:
        torch.testing.assert_close(out, ref)
    torch.testing.assert_close(loss, ref.sum().detach())
    ref.sum().backward()
    _same_grads(model, eager)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_leaf_modules_attribute_baked_by_export_is_refused(tmp_path, monkeypatch, loop):
    model, x = _Scaled(), torch.randn(4, 4)
    _force_export(monkeypatch)
    pipe = _compile(model, x, tmp_path, loop=loop)
    model.drop.p = 0.0
    with pytest.raises(MobiusError, match=r"`drop.p` \(Dropout\) was 0.5"):
        step(loop, pipe, x)


# ----------------------------------------------------------------------------- item 9: async checkpoints

def _async(tmp_path, seed=0, slow=0.0, loop="eager"):
    import time

    model, x = _mlp(seed), torch.randn(4, 4)
    pipe = _compile(model, x, tmp_path, loop=loop)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if slow:
        inner.register_step_pre_hook(lambda *a: time.sleep(slow))  # the update stays in flight meanwhile
    return model, x, pipe, pipe.overlap(inner, mode="async")


@pytest.mark.parametrize("loop", LOOPS)
def test_an_async_checkpoint_holds_the_weights_of_the_optimizer_state_it_is_saved_with(tmp_path, loop):
    model, x, pipe, opt = _async(tmp_path, slow=0.05, loop=loop)
    for _ in range(2):
        step(loop, pipe, x)
        opt.step()
        opt.zero_grad()
    ckpt = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    opt.synchronize()
    for name, p in model.named_parameters():  # the weights of the update the optimizer state includes
        assert torch.equal(ckpt["model"][name], p), name
    steps = {int(s["step"]) for s in ckpt["opt"]["state"].values()}
    assert steps == {2}


@pytest.mark.parametrize("loop", LOOPS)
def test_async_grad_after_step_is_the_gradient_the_step_used_and_accumulates_as_in_eager(tmp_path, loop):
    def run(zero):
        model, x, pipe, opt = _async(tmp_path, slow=0.2, loop=loop)
        grads, weights = [], []
        for _ in range(2):
            step(loop, pipe, x)
            grads.append(_grads(model))
            opt.step()
            assert all(torch.equal(a, p.grad) for a, p in zip(grads[-1], model.parameters()))  # eager's .grad
            weights.append([p.detach().clone() for p in model.parameters()])
            if zero:
                opt.zero_grad()
        opt.close()
        return grads, weights

    zeroed, accumulated = run(zero=True), run(zero=False)
    # both ran their two forwards on w(0): without zero_grad the second .grad is the sum, as in eager
    for a0, a1, b1 in zip(zeroed[0][0], zeroed[0][1], accumulated[0][1]):
        torch.testing.assert_close(b1, a0 + a1)
    # and the update in flight read the first gradient untouched: w(1) is the same in both runs
    for a, b in zip(zeroed[1][1], accumulated[1][1]):
        assert torch.equal(a, b)


class _TrainingBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, t):
        h = self.a(t)
        if self.training:  # torch.fx bakes this branch into the graph
            h = h * 2
        return self.b(h)


def test_eval_on_a_module_whose_own_code_reads_training_warns_on_the_fx_path(tmp_path, recwarn):
    plain, x = _mlp(), torch.randn(4, 4)
    pipe = _compile(plain, x, tmp_path / "plain")
    plain.eval()
    pipe(x)  # only leaf modules, which follow eval(): nothing to say
    assert not [w for w in recwarn if "self.training" in str(w.message)]
    model = _TrainingBranch()
    pipe = _compile(model, x, tmp_path / "branch")
    assert pipe._gm.meta["mobius_trace"].front_end == "fx"
    model.eval()
    with pytest.warns(UserWarning, match=r"reads `self.training` \(_TrainingBranch\).*Compile the model again"):
        pipe(x)


def test_grad_mode_changes_of_other_threads_are_not_the_traced_forwards():
    # The patched grad-mode functions are process-wide: an async optimizer step (torch's step sets
    # the grad mode) running while a new call's variant is traced must not count as the forward's.
    import threading

    from mobius_fx import grad_modes

    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait(10)
        with torch.no_grad():
            pass
        with torch.inference_mode():
            pass
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with grad_modes.recording() as changes:
        inside.set()
        assert done.wait(10)
    t.join(10)
    assert changes == []
    assert torch.is_grad_enabled()
