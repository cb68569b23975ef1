"""mobius_fx.compile end to end: plan, rewrite, emit, then train like eager."""

import copy

import pytest
import torch
import torch.nn.functional as F

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.zoo import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("trace_cache")  # tests/conftest.py: each model traced once per module


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=64, seq=16, hidden=32, blocks=4, heads=2))


def _topo(model, gpus=2):
    return Topology.virtual(gpus=gpus, memory=4 * sum(p.numel() * 4 for p in model.parameters()))


@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_compiled_gpt_trains_like_eager(tmp_path, microbatches):
    model = _gpt()
    eager = copy.deepcopy(model)
    x = torch.randint(0, 64, (4, 16))
    pipe = mobius_fx.compile(model, _topo(model), example_inputs=(x,), microbatches=microbatches,
                             cache_dir=str(tmp_path), verbose=False)
    out = pipe(x)
    ref = eager(x)
    torch.testing.assert_close(out, ref)
    F.cross_entropy(out.flatten(0, 1), x.flatten()).backward()
    F.cross_entropy(ref.flatten(0, 1), x.flatten()).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert all(s["current_bytes"] == 0 for s in pipe.memory_stats().values())


def test_compile_leaves_weights_and_grads_as_they_were(tmp_path):
    model = _gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mobius_fx.compile(model, _topo(model), example_inputs=(torch.randint(0, 64, (4, 16)),),
                      cache_dir=str(tmp_path), verbose=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_batch_that_does_not_divide_into_microbatches_says_so(tmp_path):
    model = _gpt()
    pipe = mobius_fx.compile(model, _topo(model), example_inputs=(torch.randint(0, 64, (4, 16)),), microbatches=4,
                             cache_dir=str(tmp_path), verbose=False)
    with pytest.raises(MobiusError, match=r"6.*4"):
        pipe(torch.randint(0, 64, (6, 16)))


def test_code_shows_the_schedule_and_plan_is_attached(tmp_path):
    model = _gpt()
    pipe = mobius_fx.compile(model, _topo(model), example_inputs=(torch.randint(0, 64, (4, 16)),), microbatches=2,
                             cache_dir=str(tmp_path), verbose=False)
    assert pipe.plan.num_stages >= 2
    assert "prefetch" in pipe.code and "run_stage" in pipe.code and "evict" in pipe.code
