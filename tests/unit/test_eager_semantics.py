"""Eager semantics or a clear refusal (issue 28, items 1, 2, 8, 9 and its unclear errors).

Each test is one class of silent divergence a probe round found: grad-mode regions inside
forward, a second backward without retain_graph, Python attributes changed after compile,
async checkpoints one update behind, and the errors that used to come from deep inside torch
(float8 streaming, double backward, meta inputs, two threads calling one pipeline).
"""

import copy
import threading

import pytest
import torch
from torch import nn

import mobius_fx
from mobius_fx import MobiusError, Topology

pytestmark = pytest.mark.usefixtures("one_thread")


def _compile(model, x, tmp_path, microbatches=2, **kw):
    return mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,),
                             cache_dir=str(tmp_path), verbose=False, microbatches=microbatches, **kw)


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


def test_a_meta_input_at_call_time_is_refused(tmp_path):
    model, x = _mlp(), torch.randn(4, 4)
    pipe = _compile(model, x, tmp_path)
    with pytest.raises(MobiusError, match="meta device"):
        pipe(x.to("meta"))
    pipe(x).sum().backward()  # still usable


def test_a_second_thread_calling_a_running_pipeline_is_refused(tmp_path):
    model, x = _mlp(), torch.randn(4, 4)
    pipe = _compile(model, x, tmp_path)
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
    pipe(x).sum().backward()
    handle.remove()
    assert calls and len(errors) == 1 and isinstance(errors[0], MobiusError), errors
    assert "one call at a time" in str(errors[0])
    pipe(x).sum().backward()  # the lock was released
