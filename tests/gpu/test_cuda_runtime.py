"""The CUDA device layer: the same pipeline as on virtual GPUs, on real streams (skipped without CUDA).

Several pipeline GPUs may share one CUDA device (each gets its own compute/upload/download
streams), so these tests also run on a machine with a single GPU.
"""

import copy
import gc

import pytest
import torch
import torch.fx as fx
from torch import nn

from mobius_fx import MobiusError, trace
from mobius_fx.devices import CudaDevice
from mobius_fx.runtime import build_pipeline

try:
    from tests.models import ResidualMLP, gpt, gpt_inputs, hf_gpt2, hf_inputs
except ImportError:  # pragma: no cover
    from models import ResidualMLP, gpt, gpt_inputs, hf_gpt2, hf_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

_COMPUTE = ("call_function", "call_method", "call_module")


@pytest.fixture(autouse=True)
def _exact_fp32():
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def even_cut(gm, stages):
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    bounds = [round(i * len(names) / stages) for i in range(stages + 1)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def cuda_pipeline(model, inputs, kwargs=None, *, stages=4, gpus=2, microbatches=2, gm=None, one_device=False, **kw):
    gm = gm if gm is not None else trace(model, example_inputs=inputs, example_kwargs=kwargs)
    indices = {f"gpu{i}": 0 if one_device else i % torch.cuda.device_count() for i in range(gpus)}
    return build_pipeline(model, gm, stage_nodes=even_cut(gm, stages),
                          stage_gpus=[f"gpu{k % gpus}" for k in range(stages)], gpu_budgets={},
                          microbatches=microbatches, example_inputs=inputs, example_kwargs=kwargs, device="cuda",
                          gpu_indices=indices, **kw)


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("microbatches", [1, 4])
def test_cuda_pipeline_matches_cpu_eager(microbatches):
    torch.manual_seed(0)
    model = ResidualMLP(d_in=16, width=64, depth=6, d_out=8)
    x = torch.randn(8, 16)
    model(x).pow(2).mean().backward()
    eager = grads(model)
    model.zero_grad(set_to_none=True)
    pipe = cuda_pipeline(model, (x,), gm=fx.symbolic_trace(model), stages=6, gpus=3, microbatches=microbatches)
    out = pipe(x)
    assert out.device.type == "cpu"
    out.pow(2).mean().backward()
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
    for name, g in grads(model).items():
        assert g.device.type == "cpu"
        torch.testing.assert_close(g, eager[name], rtol=1e-4, atol=1e-5)
    assert all(s["current_bytes"] == 0 for s in pipe.memory_stats().values())


def test_streams_have_priorities_compute_above_upload_above_download():
    model = ResidualMLP(d_in=8, width=16, depth=2, d_out=4)
    pipe = cuda_pipeline(model, (torch.randn(4, 8),), gm=fx.symbolic_trace(model), stages=2, gpus=2)
    for dev in pipe.devices.values():
        assert isinstance(dev, CudaDevice)
        assert dev.compute_stream.priority <= dev.upload_stream.priority <= dev.download_stream.priority
        assert len({dev.compute_stream, dev.upload_stream, dev.download_stream}) == 3


def test_dropout_on_cuda_with_one_microbatch_matches_cuda_eager():
    torch.manual_seed(0)
    model = gpt(hidden=64, blocks=2, vocab=128, seq=16, heads=2, dropout=0.2)
    (idx,) = gpt_inputs(model, batch=4)
    targets = torch.roll(idx, 1, dims=1)
    reference = copy.deepcopy(model).cuda()
    torch.manual_seed(3)
    logits, loss = reference(idx.cuda(), targets.cuda())
    loss.backward()
    pipe = cuda_pipeline(model, (idx, targets), stages=4, gpus=2, microbatches=1, one_device=True)
    torch.manual_seed(3)  # one CUDA generator, drawn from in the same order as eager
    p_logits, p_loss = pipe(idx, targets)
    p_loss.backward()
    torch.testing.assert_close(p_logits, logits.cpu(), rtol=1e-4, atol=1e-5)
    ref = {n: g.cpu() for n, g in grads(reference).items()}
    for name, g in grads(model).items():
        torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-5)


def test_hf_gpt2_on_cuda_in_bfloat16_is_close_to_fp32_eager():
    torch.manual_seed(0)
    model = hf_gpt2(layers=2, hidden=64, heads=2, vocab=128, positions=16)
    (ids,) = hf_inputs(model, batch=4, seq=16)
    reference = copy.deepcopy(model)
    out = reference(ids, labels=ids)
    out.loss.backward()
    pipe = cuda_pipeline(model, (ids,), {"labels": ids}, stages=4, gpus=2, microbatches=2, dtype=torch.bfloat16)
    p_out = pipe(ids, labels=ids)
    p_out.loss.float().backward()
    torch.testing.assert_close(p_out.loss.float(), out.loss, rtol=2e-2, atol=2e-2)
    for name, g in grads(model).items():
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, grads(reference)[name], rtol=0.1, atol=5e-3)


_ARMED = {"backward": False}


class _Tripwire(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        if _ARMED["backward"]:
            raise RuntimeError("tripwire in backward")
        return g


@fx.wrap
def tripwire(x):
    return _Tripwire.apply(x)


class _Fragile(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x):
        h = tripwire(torch.tanh(self.b(torch.relu(self.a(x)))))
        return self.d(torch.tanh(self.c(h)))


def test_an_error_in_a_stage_backward_frees_every_cuda_copy_and_the_pipeline_recovers():
    torch.manual_seed(0)
    model = _Fragile()
    x = torch.randn(8, 16)
    gm = fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    cuts = [names.index("b"), names.index("tripwire"), names.index("c")]
    bounds = [0, *cuts, len(names)]
    pipe = build_pipeline(model, gm, stage_nodes=[names[a:b] for a, b in zip(bounds, bounds[1:])],
                          stage_gpus=["gpu0", "gpu1"] * 2, gpu_budgets={}, microbatches=2, example_inputs=(x,),
                          device="cuda", gpu_indices={"gpu0": 0, "gpu1": 0})
    pipe(x).sum().backward()  # warm the allocator
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    _ARMED["backward"] = True
    try:
        with pytest.raises(RuntimeError, match="tripwire in backward"):
            pipe(x).sum().backward()
    finally:
        _ARMED["backward"] = False
    gc.collect()
    torch.cuda.synchronize()
    assert all(s["current_bytes"] == 0 for s in pipe.memory_stats().values())
    assert torch.cuda.memory_allocated() <= before
    assert all(p.grad is None for p in model.parameters())
    pipe(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_budget_smaller_than_a_stage_raises_before_allocating():
    model = ResidualMLP(d_in=16, width=64, depth=4, d_out=8)
    x = torch.randn(8, 16)
    gm = fx.symbolic_trace(model)
    pipe = build_pipeline(model, gm, stage_nodes=even_cut(gm, 4), stage_gpus=["gpu0", "gpu1"] * 2,
                          gpu_budgets={"gpu0": 1024, "gpu1": 1024}, microbatches=2, example_inputs=(x,),
                          device="cuda", gpu_indices={"gpu0": 0, "gpu1": 0})
    with pytest.raises(MobiusError, match="budget"):
        pipe(x)


def test_adamw_steps_on_cuda_follow_the_cpu_loss_curve():
    torch.manual_seed(0)
    model = gpt(hidden=64, blocks=2, vocab=128, seq=16, heads=2)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 128, (4, 17), generator=g) for _ in range(2)] * 5
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in data]
    pipe = cuda_pipeline(model, batches[0], stages=4, gpus=2, microbatches=2)

    def train(fn, params):
        opt = torch.optim.AdamW(params, lr=1e-2)
        losses = []
        for idx, targets in batches:
            opt.zero_grad(set_to_none=True)
            _, loss = fn(idx, targets)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return torch.tensor(losses)

    torch.testing.assert_close(train(pipe, model.parameters()), train(reference, reference.parameters()),
                               rtol=0, atol=1e-3)
