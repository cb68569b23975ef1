"""The host's passes outside the optimizer (issue 27), counted by mobius_fx.runtime.host_counters.

Under pipe.overlap(mode="sync") on the CUDA stand-in, once the first (serial, probing) step is
behind: no master is pinned again at upload (the optimizer's worker refreshed the streamed
copies), gradients are converted into storage kept across steps (no new fp32 `.grad` per step),
`.grad` is None after zero_grad(set_to_none=True) as torch users expect, and a gradient a user
kept from an earlier step is never overwritten. The weights stay those of serial stepping.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import mobius_fx
from mobius_fx import Topology
from mobius_fx.runtime import overlap
from mobius_fx.runtime.host_counters import COUNTERS, HostCounters
from mobius_fx.zoo import nanogpt, nanogpt_inputs

pytestmark = pytest.mark.usefixtures("trace_cache")  # tests/conftest.py: each model traced once per module


@pytest.fixture(autouse=True)
def _span_path(monkeypatch):
    """These tests cover the span-by-span hand-over with its refresh pass: the path of optimizers
    the fused host pass does not step, and of every one where it cannot be built, for bf16
    downloads (the widened ones are the fp32 `.grad` already: torch's step reads them whole). The
    pass (on by default) is tested in test_overlap_host_pass.py, the widened downloads in
    test_overlap_widened.py."""
    monkeypatch.setattr(overlap, "HOST_PASS", False)
    monkeypatch.setattr(overlap, "WIDEN_DOWNLOADS", False)


def _loss(out, x):
    return F.cross_entropy(out.flatten(0, 1).float(), x.flatten())


def _fused_pair(tmp_path, opt_name, vocab=64):
    torch.manual_seed(0)
    model = nanogpt(hidden=32, blocks=3, vocab=vocab, seq=8)
    twin = copy.deepcopy(model)
    data = [nanogpt_inputs(model, batch=4, seed=s) for s in range(5)]
    topo = Topology.virtual(gpus=2, memory=8 * sum(p.numel() * 4 for p in model.parameters()))
    kw = dict(example_inputs=data[0], microbatches=2, cuts=[1, 2, 3], verbose=False,  # the module's cache: traced once
              dtype=torch.bfloat16)
    pipe = mobius_fx.compile(model, topo, device="virtual-async", **kw)
    ref_pipe = mobius_fx.compile(twin, topo, device="virtual", **kw)

    def make(params):
        params = list(params)
        if opt_name == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        if opt_name == "adamw-fused":
            return torch.optim.AdamW(params, lr=1e-2, fused=True)
        if opt_name == "adam-amsgrad-groups":  # two groups, the second without weight decay
            decay = [p for p in params if p.dim() >= 2]
            rest = [p for p in params if p.dim() < 2]
            return torch.optim.Adam([{"params": decay, "weight_decay": 0.01}, {"params": rest}], lr=1e-2,
                                    amsgrad=True)
        if opt_name == "sgd-momentum":
            return torch.optim.SGD(params, lr=1e-1, momentum=0.9, nesterov=True, weight_decay=1e-3)
        return torch.optim.SGD(params, lr=1e-1)

    opt = pipe.overlap(make(model.parameters()), mode="sync")
    opt.widen_downloads = overlap.WIDEN_DOWNLOADS  # the switch a test sets, not the plan's choice for this server
    return model, twin, data, pipe, ref_pipe, opt, make(twin.parameters())


def test_steady_sync_steps_pin_nothing_and_reuse_gradient_storage(tmp_path):
    model, twin, data, pipe, ref_pipe, opt, ref = _fused_pair(tmp_path, "adamw")
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    kept, homes = None, []
    for j, (x,) in enumerate(data):
        for p_, o in ((pipe, opt), (ref_pipe, ref)):
            before = COUNTERS.snapshot()
            _loss(p_(x), x).backward()
            if o is opt:
                homes.append([p.grad.data_ptr() for p in params])
                if j == 3:
                    kept = params[0].grad  # a user keeps this step's gradient
                    kept_value = kept.clone()
            o.step()
            o.zero_grad()
            if o is opt:  # the counters are the process's: the reference pipeline's are left out
                counts = HostCounters.since(before, COUNTERS.snapshot())
        assert all(p.grad is None for p in params)
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q), j
        if j >= 2:  # the probe (0) and the first overlapping step (1) are behind
            assert counts["pin"] == 0 and counts["grad_add"] == 0
            assert counts["grad_alloc"] == (params[0].numel() * 4 if j == 4 else 0)  # only the kept one anew
            assert counts["refresh"] >= n * 6  # read fp32, write bf16, beside the optimizer
    assert homes[2] == homes[3]  # the same storage, step after step
    assert homes[4][0] != homes[3][0] and homes[4][1:] == homes[3][1:]
    assert torch.equal(kept, kept_value)  # step 4 did not write into the gradient the user kept


@pytest.mark.parametrize("opt_name,span,widen", [("adamw", 100, False), ("adamw-fused", overlap.UNIT, False),
                                                 ("adam-amsgrad-groups", 100, False), ("sgd-momentum", 100, False),
                                                 ("sgd", 1000, False), ("adamw", 100, True)])
def test_the_fused_hand_over_steps_bit_for_bit_as_serial_and_nothing_outside_the_optimizer(
        tmp_path, monkeypatch, opt_name, span, widen):
    """Steady sync steps of a bf16-streamed pipeline: the gradients reach `.grad` inside the
    stage's optimizer step, span by span (spans of 100 elements here: parameters cut mid-way, at
    no vector width, and small ones batched together; whole units of the fused kernel for
    fused=True, over a vocabulary whose embedding is two units), with the bits of serial
    stepping; `.grad` is final when backward returns; the host makes no pass outside the
    optimizer (<= 1 byte per parameter per step: 0 measured, no conversion, no finiteness read on
    the host)."""
    monkeypatch.setattr(overlap, "SPAN", span)
    monkeypatch.setattr(overlap, "WIDEN_DOWNLOADS", widen)  # True: the fp32 .grad from the GPUs, torch's step
    vocab = 2 * overlap.UNIT // 32 if span == overlap.UNIT else 64
    model, twin, data, pipe, ref_pipe, opt, ref = _fused_pair(tmp_path, opt_name, vocab)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    for j, (x,) in enumerate(data):
        before = COUNTERS.snapshot()
        _loss(pipe(x), x).backward()
        mine = HostCounters.since(before, COUNTERS.snapshot())  # the pipeline's backward alone
        _loss(ref_pipe(x), x).backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):  # final after backward
            assert torch.equal(p.grad, q.grad), (j, name)
        before = COUNTERS.snapshot()
        opt.step()
        opt.zero_grad()
        mine = {k: v + HostCounters.since(before, COUNTERS.snapshot())[k] for k, v in mine.items()}
        ref.step()
        ref.zero_grad()
        assert all(p.grad is None for p in params)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), (j, name)
        if j >= 2:  # the probe (0) and the first overlapping step (1) are behind
            assert opt.stepped_in_backward == len(params)
            assert HostCounters.outside_optimizer(mine) <= n, mine  # <= 1 byte per parameter
            tied = sum(p.numel() for p in params if p.dim() == 2 and p.shape[0] == vocab)
            # the bf16 downloads converted span by span (6 B); widened: none, the tied weight's two
            # partials too are summed on the GPU of the stage holding it first (runtime/tied_sums.py)
            assert mine["finite_check"] == 0, mine
            assert (mine["grad_fused"] == 0 < tied) if widen else (mine["grad_fused"] >= 6 * n), mine
    for p, q in zip(params, twin.parameters()):  # the state too (Adam's step counts, moments)
        for (k, v), (k2, w) in zip(opt.state[p].items(), ref.state[q].items()):
            assert k == k2 and torch.equal(v, w), k


def test_a_non_finite_gradient_seen_on_the_gpu_steps_no_stage(tmp_path):
    """The finiteness read on the GPUs: a step whose loss is infinite hands every stage's
    gradients over (`.grad` as eager's) but steps none during backward; the loop skips the step
    and the weights stay those of serial stepping."""
    model, twin, data, pipe, ref_pipe, opt, ref = _fused_pair(tmp_path, "adamw")
    for j, (x,) in enumerate(data):
        scale = float("inf") if j == 3 else 1.0
        before = COUNTERS.snapshot()
        loss = _loss(pipe(x), x) * scale
        loss.backward()
        counts = HostCounters.since(before, COUNTERS.snapshot())
        (_loss(ref_pipe(x), x) * scale).backward()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p.grad.isnan(), q.grad.isnan())
            assert torch.equal(p.grad.nan_to_num(), q.grad.nan_to_num())
        if j == 3:
            assert opt._stepped == set() and counts["finite_check"] == 0
        if torch.isfinite(loss):
            opt.step()
            ref.step()
        opt.zero_grad()
        ref.zero_grad()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q), j


def test_optimizer_steps_bump_the_versions_of_pipeline_masters_only(tmp_path):
    """The process-wide post-hook that tells the streamed copies a fused optimizer changed a
    master leaves the parameters of an optimizer unrelated to any pipeline alone."""
    torch.manual_seed(0)
    model = nanogpt(hidden=32, blocks=2, vocab=64, seq=8)
    x, = nanogpt_inputs(model, batch=4, seed=0)
    topo = Topology.virtual(gpus=2, memory=8 * sum(p.numel() * 4 for p in model.parameters()))
    pipe = mobius_fx.compile(model, topo, example_inputs=(x,), microbatches=2, cache_dir=str(tmp_path),
                             verbose=False, device="virtual-async", dtype=torch.bfloat16)
    other = torch.nn.Linear(8, 8)
    others = torch.optim.AdamW(other.parameters(), lr=1e-2, fused=True)
    other(torch.randn(2, 8)).sum().backward()
    before = [p._version for p in other.parameters()]
    others.step()
    assert [p._version for p in other.parameters()] == before  # fused: no bump of its own, none from the hook
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _loss(pipe(x), x).backward()
    masters = list(model.parameters())
    versions = [p._version for p in masters]
    opt.step()
    assert all(p._version > v for p, v in zip(masters, versions))
