"""Widened gradient downloads (`Runtime.widens_gradients`, issue 38): where the optimizer overlap
keeps the fp32 `.grad` (sync not speculating, async) in a half-precision pipeline, each weight
gradient is widened to fp32 on its GPU and downloaded straight into its `.grad` home, so the host
converts nothing and the fused pass reads the fp32 `.grad` and writes none: 28 + 2 B per parameter.

- `.grad` is bit for bit what the host's conversion of the bf16 download gave (`opt.widen_downloads
  = False`, the path before), after backward and across steps, so the weights and the state are too
  (serial's in sync: test_overlap_host_pass.py; today's async: test_overlap_async_pass.py);
- the host's counters: 30 B per parameter per step in all on a model without tied weights;
- the transfer log books each widened gradient's fp32 bytes, as the schedule IR does.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mobius_fx
from mobius_fx import Topology
from mobius_fx.runtime import device_books, host_optimizer as H
from mobius_fx.runtime.devices import make_devices
from mobius_fx.runtime.host_counters import COUNTERS, HostCounters
from mobius_fx.runtime.host_gradients import is_home
from mobius_fx.zoo import nanogpt, nanogpt_inputs

pytestmark = pytest.mark.usefixtures("trace_cache")  # tests/conftest.py: each model traced once per module


def _loss(out, x):
    return F.cross_entropy(out.flatten(0, 1).float(), x.flatten())


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)


def _gpt_pair(tmp_path, mode, device, steps=4):
    """Two pipelines over copies of one nanoGPT (tied wte / lm_head: two partials, summed on the GPU
    of the stage holding it first when widening, runtime/tied_sums.py, else on the host), one
    widening its downloads (the default), one not."""
    torch.manual_seed(0)
    model = nanogpt(hidden=32, blocks=2, vocab=64, seq=8)
    twin = copy.deepcopy(model)
    data = [nanogpt_inputs(model, batch=4, seed=s) for s in range(steps)]
    topo = Topology.virtual(gpus=2, memory=8 * sum(p.numel() * 4 for p in model.parameters()))
    kw = dict(example_inputs=data[0], microbatches=2, cuts=[1, 2], cache_dir=str(tmp_path), verbose=False,
              dtype=torch.bfloat16, device=device)
    pipe, ref_pipe = mobius_fx.compile(model, topo, **kw), mobius_fx.compile(twin, topo, **kw)
    opt, ref = pipe.overlap(_sgd(model.parameters()), mode=mode), ref_pipe.overlap(_sgd(twin.parameters()), mode=mode)
    opt.widen_downloads = True  # whatever the plan chose for this virtual server (`Plan.widen_downloads`)
    ref.widen_downloads = False  # the path before: bf16 downloads converted on the host
    return model, twin, data, pipe, ref_pipe, opt, ref


@pytest.mark.parametrize("device", ["virtual", "virtual-async"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_widened_grads_equal_the_host_conversion_bit_for_bit(tmp_path, mode, device, monkeypatch, one_thread):
    # a small chunk: the stand-in widens every tensor of more than 100 elements in several chunks
    monkeypatch.setattr(device_books, "WIDEN_CHUNK", 100)
    model, twin, data, pipe, ref_pipe, opt, ref = _gpt_pair(tmp_path, mode, device)
    tied = {id(p) for p in model.parameters() if p.dim() == 2 and p.shape[0] == 64}
    assert len(tied) == 1
    for j, (x,) in enumerate(data):
        _loss(pipe(x), x).backward()
        _loss(ref_pipe(x), x).backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad), (j, name)
            assert j == 0 or is_home(p.grad), name  # the download is the .grad: no conversion, no sum on the host
        d2h = [d.log.as_dict(since_mark=True).get("gradient d2h", {}).get("bytes", 0) for d in pipe.devices.values()]
        d2h_ref = [d.log.as_dict(since_mark=True).get("gradient d2h", {}).get("bytes", 0)
                   for d in ref_pipe.devices.values()]
        h2d = sum(d.log.as_dict(since_mark=True).get("gradient h2d", {}).get("bytes", 0) for d in pipe.devices.values())
        if j >= 1:  # sync's first step is its probe (serial: nothing overlapped, nothing widened)
            n = sum(p.numel() for p in model.parameters())
            t = sum(p.numel() for p in model.parameters() if id(p) in tied)
            # fp32, not bf16, for each one; the tied one's first partial downloaded as streamed
            # and sent back up to the GPU that sums it
            assert sum(d2h) - sum(d2h_ref) == 2 * n and h2d == 2 * t, (d2h, d2h_ref, h2d)
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    opt.synchronize()
    ref.synchronize()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
        for (k, v), (k2, w) in zip(opt.state[p].items(), ref.state[q].items()):
            assert k == k2 and torch.equal(v, w), (name, k)


@pytest.mark.parametrize("kind", ["virtual", "virtual-async"])
def test_widening_is_exact_for_every_bf16_value(kind, monkeypatch):
    # a bf16 value widened on the GPU (chunk by chunk) and downloaded is the host's conversion:
    # every one of the 65536 bit patterns, NaNs as NaNs; the fp32 bytes logged
    monkeypatch.setattr(device_books, "WIDEN_CHUNK", 1000)
    bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    dev = make_devices({"gpu0": None}, device=kind)["gpu0"]
    with dev.compute():
        g = bits.to(dev.torch_device)
    out = torch.empty(bits.shape, dtype=torch.float32)
    assert dev.download(g, "gradient", into=out)() is out
    want = bits.float()
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.view(torch.int32)[~want.isnan()], want.view(torch.int32)[~want.isnan()])
    assert dev.log.as_dict()["gradient d2h"]["bytes"] == 4 * bits.numel()
    dev.synchronize()


def steps_touch_30_bytes(pipe, opt, batches, loss, n: int) -> None:
    """Steps of the eager-style loop with the overlap `opt` widening its downloads: from the fifth
    on (the probe, the state-making first update and its copies behind), the host touches 28 B per
    parameter (AdamW's pass) + 2 (the fp32 `.grad` read), nothing else, over `n` parameters."""
    opt.widen_downloads = True  # whatever the plan chose for this virtual server (`Plan.widen_downloads`)
    for j, args in enumerate(batches):
        before = COUNTERS.snapshot()
        loss(pipe(*args), *args).backward()
        opt.step()
        opt.zero_grad()
        counts = HostCounters.since(before, COUNTERS.snapshot())
        if not H.compiled():
            pytest.skip(f"no compiled host pass here: {H.reason_not_compiled()}")
        if j >= 4:
            total = 28 + HostCounters.outside_optimizer(counts) / n + HostCounters.beside_optimizer(counts) / n
            assert counts["grad_read"] == 2 * n and total == 30, counts  # the fp32 .grad read, nothing else


class _Mlp(nn.Module):
    """Four 64x64 layers, no tied weight: every gradient is downloaded once."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_host_touches_30_bytes_per_parameter_and_the_log_books_the_irs_fp32_downloads(tmp_path, mode, one_thread):
    torch.manual_seed(0)
    model = _Mlp()
    n = sum(p.numel() for p in model.parameters())
    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(s)) for s in range(6)]
    topo = Topology.virtual(gpus=2, memory=16 * n * 4)
    pipe = mobius_fx.compile(model, topo, example_inputs=(xs[0],), microbatches=2, cuts=[1, 2, 3],
                             cache_dir=str(tmp_path), verbose=False, dtype=torch.bfloat16, device="virtual-async")
    opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=1e-3), mode=mode)
    steps_touch_30_bytes(pipe, opt, [(x,) for x in xs], lambda out, x: out.float().pow(2).mean(), n)
    assert pipe._rt.widens_gradients()
    moved = {(gpu, stage): nbytes for (gpu, what, _, stage), (_, nbytes) in pipe.schedule_ir().bytes_moved().items()
             if what == "gradient"}
    got = {(gpu, stage): c["bytes"] for gpu, kinds in pipe.transfer_stats(last_step=True, by_stage=True).items()
           for stage, c in kinds.get("gradient d2h", {}).items()}
    assert got == moved and sum(got.values()) == 4 * n  # fp32 downloads
    narrow = {(gpu, stage): nbytes for (gpu, what, _, stage), (_, nbytes)
              in pipe.schedule_ir(widened=False).bytes_moved().items() if what == "gradient"}
    assert sum(narrow.values()) == 2 * n
    opt.close()
