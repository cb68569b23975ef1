"""pipe.overlap: the CPU optimizer stepped during backward ("sync", exact) or one step late ("async").

"sync" is compared with the same optimizer stepped serially after backward on a second pipeline
compiled from a copy of the model: the pipelines compute the same gradients, and the optimizers
of torch update each parameter from its own gradient and state, so the weights must be equal bit
for bit after every step. "async" is compared with a plain implementation of the delayed update
written here, w(t+1) = update(w(t), grad at w(t-1)), on a pipeline of its own.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.zoo import hf_gpt2, hf_inputs, hf_llama, nanogpt, nanogpt_inputs

STEPS = 7  # StepLR(step_size=3) decays twice; the async test's StepLR(4) once


def _model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "gpt":  # tied wte / lm_head, read by the first and the last stage
        return nanogpt(hidden=32, blocks=3, vocab=64, seq=8)
    if kind == "hf_gpt2":
        return hf_gpt2(layers=2, hidden=32, vocab=64, positions=8)
    return hf_llama(layers=2, hidden=32)


def _batches(model, kind: str, n: int):
    if kind == "gpt":
        return [nanogpt_inputs(model, batch=4, seed=s) for s in range(n)]
    return [hf_inputs(model, batch=4, seq=8, seed=s) for s in range(n)]


def _loss(out, x):
    logits = out if isinstance(out, torch.Tensor) else out["logits"]
    return F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())


def _compile(model, x, tmp_path, microbatches=2):
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    topo = Topology.virtual(gpus=2, memory=8 * nbytes)
    return mobius_fx.compile(model, topo, example_inputs=(x,), microbatches=microbatches, cuts=[1, 2, 3],
                             cache_dir=str(tmp_path), verbose=False)


def _pair(kind, tmp_path, freeze=False):
    model = _model(kind)
    if freeze:  # a frozen parameter in the middle of the model
        frozen = [p for n, p in model.named_parameters() if ".1." in n and ("ln_1" in n or "input_layernorm" in n)]
        assert frozen
        for p in frozen:
            p.requires_grad_(False)
    twin = copy.deepcopy(model)
    data = _batches(model, kind, STEPS)
    return model, twin, data, _compile(model, data[0][0], tmp_path), _compile(twin, data[0][0], tmp_path)


def _optimizer(name, params):
    params = [p for p in params if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    return torch.optim.SGD(params, lr=1e-1, momentum=0.9, weight_decay=1e-3)


@pytest.mark.parametrize("kind,opt_name,freeze", [
    ("gpt", "adamw", True), ("gpt", "sgd", False), ("hf_gpt2", "adamw-fused", False), ("hf_llama", "adamw", True)])
def test_sync_overlap_equals_serial_stepping_bit_for_bit(tmp_path, kind, opt_name, freeze):
    model, twin, data, pipe, ref_pipe = _pair(kind, tmp_path, freeze)
    opt = pipe.overlap(_optimizer(opt_name, model.parameters()), mode="sync")
    ref = _optimizer(opt_name, twin.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=3, gamma=0.5)
    overlapped = []
    for t, (x,) in enumerate(data):
        _loss(pipe(x), x).backward()
        _loss(ref_pipe(x), x).backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):  # .grad final after backward
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
        opt.step()
        ref.step()
        overlapped.append(opt.stepped_in_backward)
        sched.step()
        ref_sched.step()
        opt.zero_grad()
        ref.zero_grad()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), f"step {t}: {name}"
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert overlapped[0] == 0  # the first step watches the loop, serially
    assert all(n == trainable for n in overlapped[1:]), overlapped  # then every parameter during backward
    assert opt.state_dict()["state"].keys() == ref.state_dict()["state"].keys()


def test_clipping_defers_the_update_to_opt_step_said_once(tmp_path, caplog):
    """Not the serial fallback: gradients are still handed over during backward; the update waits
    for opt.step() (tests/unit/test_overlap_semantics.py has the other loops)."""
    model, twin, data, pipe, ref_pipe = _pair("gpt", tmp_path)
    opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=1e-2), mode="sync")
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        for (x,) in data[:4]:
            for p_, m, o in ((pipe, model, opt), (ref_pipe, twin, ref)):
                _loss(p_(x), x).backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
                o.step()
                o.zero_grad()
            assert opt.stepped_in_backward == 0
            for p, q in zip(model.parameters(), twin.parameters()):
                assert torch.equal(p, q)
    assert opt.handed_in_backward == sum(1 for p in model.parameters() if p.requires_grad)
    said = [r for r in caplog.records if r.name == "mobius_fx"]
    assert len(said) == 1 and "clip_grad_norm_" in said[0].getMessage() and "waits for opt.step()" in said[0].getMessage()


def test_grad_scaler_falls_back_and_matches_serial(tmp_path):
    model, twin, data, pipe, ref_pipe = _pair("gpt", tmp_path)
    opt = pipe.overlap(torch.optim.SGD(model.parameters(), lr=0.1), mode="sync")
    ref = torch.optim.SGD(twin.parameters(), lr=0.1)
    scalers = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10), torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for (x,) in data[:4]:
        for p_, o, s in ((pipe, opt, scalers[0]), (ref_pipe, ref, scalers[1])):
            s.scale(_loss(p_(x), x)).backward()
            s.step(o)
            s.update()
            o.zero_grad()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)
    assert opt.stepped_in_backward == 0


def test_gradient_accumulation_falls_back(tmp_path):
    model, twin, data, pipe, ref_pipe = _pair("gpt", tmp_path)
    opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=1e-2), mode="sync")
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for i in range(0, 6, 2):
        for p_, o in ((pipe, opt), (ref_pipe, ref)):
            for (x,) in data[i:i + 2]:
                _loss(p_(x), x).backward()
            o.step()
            o.zero_grad()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)


def _overlapping(tmp_path):
    """A GPT pipeline whose sync overlap has left its serial first step: stages now step during backward."""
    model, twin, data, pipe, _ = _pair("gpt", tmp_path)
    opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=1e-2), mode="sync")
    for (x,) in data[:2]:
        _loss(pipe(x), x).backward()
        opt.step()
        opt.zero_grad()
    return model, data, pipe, opt


def test_a_loop_that_starts_clipping_later_is_refused(tmp_path):
    model, data, pipe, opt = _overlapping(tmp_path)
    x, = data[2]
    _loss(pipe(x), x).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    with pytest.raises(MobiusError, match="already stepped"):
        opt.step()


def test_autograd_grad_does_not_step(tmp_path):
    model, data, pipe, opt = _overlapping(tmp_path)
    before = [p.detach().clone() for p in model.parameters()]
    x, = data[2]
    grads = torch.autograd.grad(_loss(pipe(x), x), [p for p in model.parameters() if p.requires_grad])
    opt.synchronize()
    assert all(g is not None for g in grads)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


def test_async_equals_the_delayed_update(tmp_path):
    """w(t+1) = update(w(t), g(t)) with g(t) the gradient at w(t-1) (w(-1) = w(0)), written plainly:
    a second pipeline holds the lagging weights, a plain optimizer the current ones."""
    model, lag, data, pipe, lag_pipe = _pair("gpt", tmp_path)
    opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), mode="async")
    current = [p.detach().clone().requires_grad_(True) for p in lag.parameters()]
    ref = torch.optim.AdamW(current, lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=4, gamma=0.5)
    for (x,) in data:
        _loss(pipe(x), x).backward()
        opt.step()
        opt.zero_grad()  # .grad holds the gradients step used, as in eager: a loop without this accumulates
        sched.step()
        _loss(lag_pipe(x), x).backward()  # at w(t-1)
        with torch.no_grad():
            for c, p in zip(current, lag.parameters()):
                c.grad = p.grad
                p.grad = None
                p.copy_(c)  # the lagging weights become w(t)
        ref.step()  # current: w(t+1)
        ref_sched.step()
    opt.synchronize()
    for (name, p), c in zip(model.named_parameters(), current):
        torch.testing.assert_close(p, c, rtol=1e-6, atol=1e-6, msg=name)
    # the run differs from the synchronous trajectory: the test is not vacuous
    assert any(not torch.allclose(p, q) for p, q in zip(model.parameters(), lag.parameters()))


def test_overlap_refuses_what_it_cannot_do(tmp_path):
    model, _, data, pipe, _ = _pair("gpt", tmp_path)
    with pytest.raises(MobiusError, match="mode="):
        pipe.overlap(torch.optim.SGD(model.parameters(), lr=0.1), mode="later")
    with pytest.raises(MobiusError, match="LBFGS"):
        pipe.overlap(torch.optim.LBFGS(model.parameters()), mode="async")
    with pytest.raises(MobiusError, match="none of this pipeline"):
        pipe.overlap(torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1))
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    assert pipe.overlap(plain, mode="none") is plain
    opt = pipe.overlap(plain)
    with pytest.raises(MobiusError, match="closure"):
        opt.step(lambda: 0.0)


# ---------------------------------------------------------------- loops that must not go silently wrong

def _lockstep(tmp_path, loop, steps=4, opt_name="sgd", mode="sync"):
    """Run `loop(t, pipe, model, opt, is_overlap)` on an overlapped and a plain pipeline in lockstep;
    the weights must stay bit-identical after every step."""
    model, twin, data, pipe, ref_pipe = _pair("gpt", tmp_path)
    opt = pipe.overlap(_optimizer(opt_name, model.parameters()), mode=mode)
    ref = _optimizer(opt_name, twin.parameters())
    for t, (x,) in enumerate(data[:steps]):
        loop(t, x, pipe, model, opt, True)
        loop(t, x, ref_pipe, twin, ref, False)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), f"step {t}: {name}"
    return opt


def test_an_outside_gradient_leaves_its_parameters_to_opt_step(tmp_path):
    def loop(t, x, pipe, model, opt, _):
        reg = sum((p ** 2).sum() for p in model.transformer.h[0].parameters()) * 1e-3  # saves the weights
        (_loss(pipe(x), x) + reg).backward()
        opt.step()
        opt.zero_grad()

    opt = _lockstep(tmp_path, loop)
    n_reg = len(list(_model("gpt").transformer.h[0].parameters()))
    trainable = sum(1 for p in _model("gpt").parameters() if p.requires_grad)
    assert opt.stepped_in_backward == trainable - n_reg  # the others still overlap


def test_hyper_parameters_changed_after_backward_fall_back(tmp_path, caplog):
    def loop(t, x, pipe, model, opt, _):
        _loss(pipe(x), x).backward()
        for g in opt.param_groups:  # a warm-up written by hand, between backward and step
            g["lr"] = 0.1 * (t + 1) / 4
        opt.step()
        opt.zero_grad()

    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        opt = _lockstep(tmp_path, loop)
    assert opt.stepped_in_backward == 0 and "hyper-parameters" in caplog.text


def test_a_skipped_step_after_a_non_finite_loss_changes_nothing(tmp_path):
    def loop(t, x, pipe, model, opt, _):
        loss = _loss(pipe(x), x) * (float("inf") if t == 2 else 1.0)
        loss.backward()
        if torch.isfinite(loss):
            opt.step()
        opt.zero_grad()

    _lockstep(tmp_path, loop, steps=5)


def test_a_failed_backward_after_stepping_is_refused_until_reloaded(tmp_path):
    model, _, data, pipe, _ = _pair("gpt", tmp_path)
    opt = pipe.overlap(torch.optim.SGD(model.parameters(), lr=0.1), mode="sync")
    for (x,) in data[:2]:
        _loss(pipe(x), x).backward()
        opt.step()
        opt.zero_grad()
    saved_opt, saved_model = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    rt, original = pipe._rt, pipe._rt._recompute

    def flaky(call, st, step, grads, needs):  # stage 0's backward fails (as an out-of-memory would)
        if call.stage == 0:
            raise RuntimeError("injected failure in stage 0")
        return original(call, st, step, grads, needs)

    rt._recompute = flaky
    x, = data[2]
    with pytest.raises(RuntimeError, match="injected") as info:
        _loss(pipe(x), x).backward()
    assert any("already stepped" in n for n in getattr(info.value, "__notes__", []))
    rt._recompute = original
    with pytest.raises(MobiusError, match="partial step"):
        _loss(pipe(x), x).backward()
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    opt.zero_grad()
    _loss(pipe(x), x).backward()  # usable again
    opt.step()


def test_async_zero_grad_and_a_scheduler_on_the_wrapped_optimizer_do_not_touch_the_update_in_flight(tmp_path):
    import time

    def run(zero: bool, set_to_none: bool):
        model, _, data, pipe, _ = _pair("gpt", tmp_path)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(inner, step_size=2, gamma=0.5)  # built before wrapping
        opt = pipe.overlap(inner, mode="async")
        inner.register_step_pre_hook(lambda *a: time.sleep(0.05))  # a step long enough to be mid-flight
        lrs = []
        for (x,) in data[:5]:
            _loss(pipe(x), x).backward()
            opt.step()
            time.sleep(0.02)  # the loop logs ...: the worker is inside its step now
            sched.step()
            if zero:
                opt.zero_grad(set_to_none=set_to_none)
            lrs.append(opt.param_groups[0]["lr"])
        opt.synchronize()
        return [p.detach().clone() for p in model.parameters()], lrs, opt.state_dict()["param_groups"][0]["lr"]

    # zero_grad(set_to_none=False) zeroes a .grad of its own, never the gradient the update in flight reads
    plain, lrs, saved_lr = run(True, True)
    assert lrs == [1e-2, 5e-3, 5e-3, 2.5e-3, 2.5e-3] and saved_lr == lrs[-1]
    with_zeros, _, _ = run(True, False)
    assert all(torch.equal(a, b) for a, b in zip(plain, with_zeros))


def test_a_scheduler_still_reaches_the_optimizer_after_load_state_dict(tmp_path):
    def loop(t, x, pipe, model, opt, overlapped):
        if t == 0:
            opt.load_state_dict(opt.state_dict())  # replaces the wrapped optimizer's param_groups
            opt.sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
        _loss(pipe(x), x).backward()
        opt.step()
        opt.sched.step()
        opt.zero_grad()

    opt = _lockstep(tmp_path, loop)
    assert opt.param_groups[0]["lr"] == opt.inner.param_groups[0]["lr"] == 0.1 * 0.5 ** 4


def test_on_the_cuda_stand_in_the_step_refreshes_the_streamed_copies(tmp_path):
    """device="virtual-async" pins the masters into host copies the uploads read (pinned on
    CUDA). Under pipe.overlap(mode="sync") a stage's step writes its new weights there, so later
    steps copy only what nothing stepped (here: nothing), and the weights still equal serial
    stepping on plain virtual GPUs bit for bit (a copy left stale would show)."""
    model = _model("gpt")
    twin = copy.deepcopy(model)
    data = _batches(model, "gpt", 6)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    topo = Topology.virtual(gpus=2, memory=8 * nbytes)
    kw = dict(example_inputs=data[0], microbatches=2, cuts=[1, 2, 3], cache_dir=str(tmp_path), verbose=False)
    pipe = mobius_fx.compile(model, topo, device="virtual-async", **kw)
    ref_pipe = mobius_fx.compile(twin, topo, device="virtual", **kw)
    opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=1e-2), mode="sync", refresh_copies=True)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    devs = list(pipe.devices.values())
    copies = []
    for (x,) in data:
        before = sum(d.pinned_copies["copies"] for d in devs)
        for p_, o in ((pipe, opt), (ref_pipe, ref)):
            _loss(p_(x), x).backward()
            o.step()
            o.zero_grad()
        copies.append(sum(d.pinned_copies["copies"] for d in devs) - before)
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)
    streamed = len(devs[0].streamed_copies)  # one store, shared by the devices
    assert copies[0] == copies[1] == streamed  # the first step is serial: every copy made at upload
    assert copies[2:] == [0] * (len(data) - 2)  # then the optimizer's step writes them all
    assert sum(d.pinned_copies["refreshed_copies"] for d in devs) >= (len(data) - 2) * streamed


def test_under_refresh_copies_frozen_weights_are_pinned_once_and_again_only_when_changed(tmp_path):
    """refresh_copies=True promises that weights change only in ways version counters see; then
    a weight the optimizer does not step (frozen: a LoRA model's base) keeps its streamed copy
    from step to step, and an in-place change to it (`torch.no_grad(): p.mul_`) is copied again
    -- the pipeline's outputs stay those of the model it holds."""
    model = _model("gpt")
    frozen = [p for n, p in model.named_parameters() if ".0." in n or ".1." in n]  # blocks 0 and 1
    for p in frozen:
        p.requires_grad_(False)
    data = _batches(model, "gpt", 5)
    topo = Topology.virtual(gpus=2, memory=8 * sum(p.numel() * 4 for p in model.parameters()))
    pipe = mobius_fx.compile(model, topo, example_inputs=data[0], microbatches=2, cuts=[1, 2, 3],
                             cache_dir=str(tmp_path), device="virtual-async", verbose=False)
    opt = pipe.overlap(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                       mode="sync", refresh_copies=True)
    devs = list(pipe.devices.values())
    copies = []
    for j, (x,) in enumerate(data):
        before = sum(d.pinned_copies["copies"] for d in devs)
        if j == 4:
            with torch.no_grad():
                frozen[0].mul_(0.5)  # a version counter sees it
        out = pipe(x)
        with torch.no_grad():
            assert torch.equal(out, model(x))
        _loss(out, x).backward()
        opt.step()
        opt.zero_grad()
        copies.append(sum(d.pinned_copies["copies"] for d in devs) - before)
    streamed = len(devs[0].streamed_copies)  # one store, shared by the devices
    assert copies[0] == streamed and copies[2:4] == [0, 0]  # frozen ones too, after their first copy
    assert copies[4] == 1  # the one frozen weight that changed
    # A write in place through .data bumps no version: pipe.refresh_weights() streams it.
    matrix = next(p for p in frozen[1:] if p.dim() == 2)
    matrix.data.mul_(0.5)
    pipe.refresh_weights()
    with torch.no_grad():
        assert torch.equal(pipe(x), model(x))


def test_under_refresh_copies_buffers_a_module_updates_unseen_are_still_copied_every_step():
    """BatchNorm's forward updates its running statistics in place inside its kernel, which
    bumps no version counter: the promise covers parameters only, so an eager re-estimate of
    the statistics (torch.optim.swa_utils.update_bn) reaches the pipeline's next evaluation."""
    from mobius_fx.runtime.device_virtual_async import VirtualAsyncDevice
    from mobius_fx.build import build_pipeline
    from tests.unit.test_virtual_async import even_cut

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16),
                          nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(8, 8)
    gm = torch.fx.symbolic_trace(model)
    devices = {f"gpu{i}": VirtualAsyncDevice(f"gpu{i}", None, seed=i) for i in range(2)}
    pipe = build_pipeline(model, gm, stage_nodes=even_cut(gm, 4), stage_gpus=["gpu0", "gpu1"] * 2, gpu_budgets={},
                          microbatches=2, example_inputs=(x,), device=devices)
    opt = pipe.overlap(torch.optim.SGD(model.parameters(), lr=1e-2), mode="sync", refresh_copies=True)
    for _ in range(3):
        pipe(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        pipe(x)  # stages the buffers
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(64, 8) * 3 + 1)  # new running statistics, no version bump
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("how", ["fused_step", "load_state_dict", "assign_data", "no_grad_inplace",
                                 "data_inplace_refresh", "async_swap"])
def test_every_documented_way_of_changing_weights_reaches_the_streamed_copies(tmp_path, how):
    """The streamed copies are kept across steps and made again only for masters whose storage
    or version changed. Each documented way of changing weights outside the pipeline must reach
    the GPUs: a fused optimizer (which bumps no version itself), load_state_dict, `p.data = t`,
    an in-place edit under no_grad, an in-place write through `.data` followed by
    `pipe.refresh_weights()`, and async's pointer swap (two storages alternating)."""
    model = _model("gpt")
    data = _batches(model, "gpt", 4)
    topo = Topology.virtual(gpus=2, memory=8 * sum(p.numel() * 4 for p in model.parameters()))
    pipe = mobius_fx.compile(model, topo, example_inputs=data[0], microbatches=2, cuts=[1, 2, 3],
                             cache_dir=str(tmp_path), device="virtual-async", verbose=False)
    if how == "async_swap":
        opt = pipe.overlap(torch.optim.SGD(model.parameters(), lr=0.1), mode="async")
    else:
        opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=0.1, fused=how == "fused_step"), mode="none")
    snapshot = copy.deepcopy(model.state_dict())
    for j, (x,) in enumerate(data):
        _loss(pipe(x), x).backward()
        opt.step()
        opt.zero_grad()
        if how == "async_swap":
            opt.synchronize()
        with torch.no_grad():
            pipe(x)  # streams the weights as they are now: the change below is the only one since
        if how == "fused_step":
            _loss(model(x), x).backward()  # eager: the pipeline's forward is not what changes them
            opt.step()
            opt.zero_grad()
        elif how == "load_state_dict":
            model.load_state_dict(snapshot)
        elif how == "assign_data":
            for p in model.parameters():
                p.data = p.data * 0.5
        elif how == "no_grad_inplace":
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        elif how == "data_inplace_refresh":
            for p in model.parameters():
                p.data.mul_(0.5)
            pipe.refresh_weights()
        with torch.no_grad():
            assert torch.equal(pipe(x), model(x)), j  # the pipeline runs on the weights the model holds


def test_a_forward_before_step_is_refused_once_stages_were_stepped(tmp_path):
    model = _model("gpt")
    data = _batches(model, "gpt", 3)
    topo = Topology.virtual(gpus=2, memory=8 * sum(p.numel() * 4 for p in model.parameters()))
    pipe = mobius_fx.compile(model, topo, example_inputs=data[0], microbatches=2, cuts=[1, 2, 3],
                             cache_dir=str(tmp_path), device="virtual-async", verbose=False)
    opt = pipe.overlap(torch.optim.SGD(model.parameters(), lr=0.1), mode="sync")
    refused = 0
    for (x,) in data:
        _loss(pipe(x), x).backward()
        if opt.stepped_in_backward or opt._stepped:
            with pytest.raises(MobiusError, match="between loss.backward"):
                pipe(x)
            refused += 1
        opt.step()
        opt.zero_grad()
    assert refused


def test_hooks_registered_on_the_overlapped_optimizer_run(tmp_path):
    model, data, pipe, opt = _overlapping(tmp_path)
    seen = []
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(len(o.param_groups[0]["params"])))
    x, = data[2]
    _loss(pipe(x), x).backward()
    opt.step()
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert seen == [trainable]  # once per opt.step(), with the optimizer over every parameter


@pytest.mark.parametrize("end", ["replace", "close"])
def test_a_replaced_or_closed_overlap_is_freed_with_its_optimizer_state(tmp_path, end):
    """The pre-hooks sync mode puts on the AccumulateGrad nodes live as long as the parameters:
    they must not keep a replaced or closed overlap, its optimizer or that optimizer's state alive
    (two dead AdamW states of a 3B model filled a GPU host's memory)."""
    import gc
    import weakref

    # pulp keeps the traceback of its failed optional solver imports (cplex, copt), and with it
    # every frame of the call that first imported it: imported here first, no frame of ours.
    import pulp  # noqa: F401

    model, data, pipe, opt = _overlapping(tmp_path)
    assert opt._handles and opt.inner.state
    gone = [weakref.ref(opt), weakref.ref(opt.inner), weakref.ref(next(iter(opt.inner.state.values()))["exp_avg"])]
    if end == "replace":
        opt = pipe.overlap(torch.optim.SGD(model.parameters(), lr=1e-2), mode="sync")
    else:
        opt.close()
        assert pipe._rt.overlap is None  # a closed overlap is no longer the pipeline's
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gc.collect()
    assert [r() is None for r in gone] == [True] * 3
    for (x,) in data[2:4]:  # the pipeline trains on with the optimizer that replaced it
        _loss(pipe(x), x).backward()
        opt.step()
        opt.zero_grad()
