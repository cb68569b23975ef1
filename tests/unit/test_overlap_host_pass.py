"""pipe.overlap(opt, "sync") with the fused host pass (mobius_fx/runtime/host_optimizer.py,
overlap.OverlapOptimizer._host_pass): a stage's parameters stepped in one pass that reads the bf16
download and writes the master, torch's state, `.grad` and the streamed copy the next upload
reads -- no refresh pass, no pin at upload -- with the bits of serial stepping where the formula
is torch's (SGD; AdamW(fused=True) on whole vectors) and within the derived bound of AdamW's
default (for-loop) step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.runtime import host_optimizer as H
from mobius_fx.runtime.host_counters import COUNTERS, HostCounters
from mobius_fx.zoo import nanogpt, nanogpt_inputs

pytestmark = pytest.mark.usefixtures("trace_cache")  # tests/conftest.py: each model traced once per module


def _loss(out, x):
    return F.cross_entropy(out.flatten(0, 1).float(), x.flatten())


def _pair(tmp_path, make):
    torch.manual_seed(0)
    model = nanogpt(hidden=32, blocks=2, vocab=64, seq=8)  # every tensor a whole number of 16-float vectors
    twin = copy.deepcopy(model)
    data = [nanogpt_inputs(model, batch=4, seed=s) for s in range(5)]
    topo = Topology.virtual(gpus=2, memory=8 * sum(p.numel() * 4 for p in model.parameters()))
    kw = dict(example_inputs=data[0], microbatches=2, cuts=[1, 2], verbose=False,  # the module's cache: traced once
              dtype=torch.bfloat16)
    pipe = mobius_fx.compile(model, topo, device="virtual-async", **kw)
    ref_pipe = mobius_fx.compile(twin, topo, device="virtual", **kw)
    opt = pipe.overlap(make(model.parameters()), mode="sync")
    opt.widen_downloads = True  # the widened path, whatever the rule says for this virtual server (a switch)
    return model, twin, data, pipe, ref_pipe, opt, make(twin.parameters())


def _copies_current(pipe, model):
    for p in model.parameters():
        for d in pipe.devices.values():
            e = d.streamed_copies.get(p)
            if e is not None:
                assert torch.equal(e.host, p.detach().to(e.host.dtype))


@pytest.mark.parametrize("name,make", [
    ("sgd-nesterov-decay", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
])
def test_the_host_pass_steps_bit_for_bit_as_serial_and_writes_the_streamed_copy(tmp_path, name, make, one_thread):
    # one intra-op thread: torch's fused AdamW steps each thread's chunk with a scalar tail, so with
    # more threads the elements it steps in scalar code (and rounds otherwise) depend on the split
    model, twin, data, pipe, ref_pipe, opt, ref = _pair(tmp_path, make)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    for j, (x,) in enumerate(data):
        before = COUNTERS.snapshot()
        _loss(pipe(x), x).backward()
        counts = HostCounters.since(before, COUNTERS.snapshot())  # the pipeline's backward alone
        _loss(ref_pipe(x), x).backward()
        for (pn, p), q in zip(model.named_parameters(), twin.parameters()):  # .grad: the tied one's the sum
            assert torch.equal(p.grad, q.grad), (j, pn)
        before = COUNTERS.snapshot()
        opt.step()
        opt.zero_grad()
        counts = {k: v + HostCounters.since(before, COUNTERS.snapshot())[k] for k, v in counts.items()}
        ref.step()
        ref.zero_grad()
        for (pn, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), (j, pn)
        if not H.compiled():
            pytest.skip(f"no compiled host pass here: {H.reason_not_compiled()}")
        if j >= 2:  # the probe (0) and the first overlapping step (1) are behind
            _copies_current(pipe, model)  # (after a serial step they are made again at the next upload)
            assert opt.stepped_in_backward == len(params)
            # the tied embedding's two partials are summed on the GPU of the stage holding it first and
            # downloaded widened, as every other gradient (runtime/tied_sums.py; with bf16 downloads the
            # pass reads both and writes its .grad, 2 + 4 B: test_overlap_widened.py's twin)
            tied = sum(p.numel() for p in params if p.dim() == 2 and p.shape[0] == 64)
            assert counts["pin"] == 0 and counts["refresh"] == 0, counts
            # the pass: reads the fp32 .grad widened on the GPUs (+2 B over the bf16 download), writes none
            assert counts["grad_fused"] == 0 < tied and counts["grad_convert"] == 0, counts
            assert counts["grad_read"] == 2 * n, counts
    for p, q in zip(params, twin.parameters()):
        for (k, v), (k2, w) in zip(opt.state[p].items(), ref.state[q].items()):
            assert k == k2 and torch.equal(v, w), k


@pytest.mark.parametrize("fused", [False, True])
def test_adamw_steps_within_the_derived_bound_of_serial(tmp_path, fused):
    """AdamW's default (for-loop) step rounds the square root differently from the compiled
    loop: each step of the pipeline, from the same state, is within `host_optimizer.adam_bound`
    of torch's (the twin is set to the pipeline's weights and state before every step). With
    fused=True the kernels agree bit for bit on full vectors (test_host_optimizer.py), but in the
    whole suite the pipeline-level run was once off in the last bit (torch's fused AdamW rounds the
    tail of each of its parallel chunks in scalar code): held to the same bound here."""
    model, twin, data, pipe, ref_pipe, opt, ref = _pair(tmp_path, lambda ps: torch.optim.AdamW(
        ps, lr=1e-2, weight_decay=0.1, fused=fused))
    pairs = list(zip(model.parameters(), twin.parameters()))
    for j, (x,) in enumerate(data):
        with torch.no_grad():
            for p, q in pairs:
                q.copy_(p)
                if p in opt.state:
                    ref.state[q] = {k: v.clone() for k, v in opt.state[p].items()}
        before = {id(q): (q.detach().clone(), {k: v.clone() for k, v in ref.state[q].items()}) for _, q in pairs}
        _loss(pipe(x), x).backward()
        _loss(ref_pipe(x), x).backward()
        grads = {id(q): q.grad.clone() for _, q in pairs}
        opt.step()
        opt.zero_grad()
        ref.step()
        ref.zero_grad()
        for p, q in pairs:
            bp, bs = before[id(q)]
            if not bs:  # the first step makes the state
                assert torch.equal(p, q)
                continue
            rs = ref.state[q]
            b = H.adam_bound(bp, grads[id(q)], bs["exp_avg"], bs["exp_avg_sq"], q.detach(), rs["exp_avg"],
                             rs["exp_avg_sq"], ref.param_groups[0], float(rs["step"]))
            assert ((p.detach().double() - q.detach().double()).abs() <= b["p"]).all(), j
            assert ((opt.state[p]["exp_avg"].double() - rs["exp_avg"].double()).abs() <= b["m"]).all(), j
            assert ((opt.state[p]["exp_avg_sq"].double() - rs["exp_avg_sq"].double()).abs() <= b["v"]).all(), j
            assert torch.equal(opt.state[p]["step"], rs["step"])
        if j >= 2:
            _copies_current(pipe, model)


def test_a_non_finite_gradient_met_by_the_host_pass_refuses_the_next_step(tmp_path, monkeypatch):
    """The GPUs sum each stage's gradients for a non-finite value before the download; a download
    the host pass then finds non-finite (corrupted on the way) was stepped already, so the overlap
    is marked dirty and the next step refuses instead of training on from NaN weights."""
    model, twin, data, pipe, ref_pipe, opt, ref = _pair(tmp_path, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    (x,) = data[0]
    _loss(pipe(x), x).backward()  # the first step makes the optimizer's state; the pass steps from the second
    opt.step()
    opt.zero_grad()
    real, calls = H.step_span, []
    monkeypatch.setattr(H, "step_span", lambda *a, **k: (calls.append(real(*a, **k)), torch.tensor(False))[1])
    with pytest.raises(MobiusError, match="non-finite gradient .* the GPUs had reported finite"):
        _loss(pipe(x), x).backward()  # the pass steps the stages during backward ...
        opt.step()  # ... and this step, or the next call at the latest, refuses
        _loss(pipe(x), x).backward()
    assert calls
