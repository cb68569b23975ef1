"""pipe.overlap's semantics with the loops people write (issue 38 part 3, issue 39 class 9).

Each loop runs on an overlapped pipeline and, in lockstep, on a second pipeline compiled from a
copy of the model with the same plain optimizer stepped serially after backward: the weights
must be equal bit for bit after every step. The rule checked: under "sync" a loop is exact
(stages stepped during backward when nothing between backward and step needs every gradient;
else the update waits for opt.step(), the gradients still handed over during backward) or
stepped serially with one log line -- never silently different.

`loop` runs a test's backward as `_loss(pipe(x), x).backward()` ("eager") or as
`pipe.train_step(x, target=x)` (tests/unit/loops.py), both pipelines of a lockstep pair alike. On
train_step (to keep the suite's time): the step hooks under "sync", clip_grad_norm_ between
backward and step (the update deferred to opt.step()), the optimizer that reads every gradient
(serial fallback) and the flat books. Eager-only: GradScaler (`scaler.scale(loss).backward()`) and
the NaN loss (`loss * nan` before backward) change the loss before backward, which train_step
does itself; a post-hook alone, a pre-hook and LBFGS's closure use the same deferral and serial
paths as the cases above (the stages stepped during train_step's backward: test_train_step.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import copy

from mobius_fx import Topology
from tests.unit.loops import LOOPS, compile_for, step
from tests.unit.test_overlap import _batches, _loss, _model

pytestmark = pytest.mark.usefixtures("trace_cache")  # tests/conftest.py: each model traced once per module

STEPS = 4


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One compile cache for the module: every test compiles the same two pipelines."""
    return tmp_path_factory.mktemp("overlap_semantics")


def _trainable(model) -> int:
    return sum(1 for p in model.parameters() if p.requires_grad)


def _pair(cache, loop="eager", twin_pipe=True):
    """As test_overlap._pair("gpt"), compiled with `_loss` for `loop` (the twin's pipeline only if asked)."""
    model = _model("gpt")
    twin = copy.deepcopy(model)
    data = _batches(model, "gpt", STEPS + 1)
    x = data[0][0]

    def build(m):
        topo = Topology.virtual(gpus=2, memory=8 * sum(p.numel() * 4 for p in m.parameters()))
        return compile_for(loop, m, topo, loss=_loss, example_target=x, example_inputs=(x,), microbatches=2,
                           cuts=[1, 2, 3], cache_dir=str(cache))

    return model, twin, data, build(model), build(twin) if twin_pipe else None


def _backward(loop):
    """The loop's forward, loss and backward of `pipe` on `x`: returns the loss."""
    return lambda pipe, x: step(loop, pipe, x, target=x)[0]


def _lockstep(cache, make, loop, steps=STEPS, mode="sync", how="eager"):
    """`loop(t, x, pipe, model, opt, backward)` on an overlapped and a plain pipeline; weights equal after each step."""
    model, twin, data, pipe, ref_pipe = _pair(cache, how)
    opt = pipe.overlap(make(model.parameters()), mode=mode)
    ref = make(twin.parameters())
    backward = _backward(how)
    for t, (x,) in enumerate(data[:steps]):
        loop(t, x, pipe, model, opt, backward)
        loop(t, x, ref_pipe, twin, ref, backward)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), f"step {t}: {name}"
    return model, opt


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# ---------------------------------------------------------------- step hooks: once per opt.step()

@pytest.mark.parametrize("mode, loop", [("sync", "eager"), ("async", "eager"), ("sync", "train_step")])
def test_step_hooks_fire_once_per_step(cache, mode, loop):
    """Pre- and post-hooks of the optimizer and torch's global ones, once per opt.step(), in
    torch's order (global pre, own pre, own post, global post), with the optimizer stepped. The
    old sync overlap ran them once per stage stepped during backward (7 post calls for 3 steps)."""
    seen: list[tuple[str, int]] = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: seen.append(("global-pre", id(o)))),
               register_optimizer_step_post_hook(lambda o, a, k: seen.append(("global-post", id(o))))]
    try:
        model, twin, data, pipe, _ = _pair(cache, loop, twin_pipe=False)
        opt = pipe.overlap(_adamw(model.parameters()), mode=mode)
        handles += [opt.register_step_pre_hook(lambda o, a, k: seen.append(("pre", id(o)))),
                    opt.register_step_post_hook(lambda o, a, k: seen.append(("post", id(o))))]
        for t, (x,) in enumerate(data[:STEPS]):
            seen.clear()
            _backward(loop)(pipe, x)
            assert seen == [], t  # none during backward
            seen.clear()
            opt.step()
            opt.zero_grad()
            assert seen == [("global-pre", id(opt)), ("pre", id(opt)), ("post", id(opt)), ("global-post", id(opt))], t
    finally:
        for h in handles:
            h.remove()


def test_post_hooks_alone_leave_the_stages_stepped_during_backward(cache):
    """A post-hook runs after the whole update: the stages still step during backward, exactly."""
    calls = []

    def loop(t, x, pipe, model, opt, backward):
        if t == 0:
            opt.register_step_post_hook(lambda o, a, k: calls.append(o))
        backward(pipe, x)
        opt.step()
        opt.zero_grad()

    model, opt = _lockstep(cache, _adamw, loop)
    assert opt.stepped_in_backward == _trainable(model)
    assert len(calls) == 2 * STEPS  # the overlapped loop's and the reference's, once per step each


# ---------------------------------------------------------------- clipping, GradScaler, inf/NaN skipping

@pytest.mark.parametrize("how", LOOPS)
def test_clip_grad_norm_between_backward_and_step_is_exact_without_serial_fallback(cache, caplog, how):
    def loop(t, x, pipe, model, opt, backward):
        backward(pipe, x)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        model, opt = _lockstep(cache, _adamw, loop, how=how)
    assert opt._serial is None and opt._defer is not None
    assert opt.handed_in_backward == _trainable(model) and opt.stepped_in_backward == 0
    said = [r.getMessage() for r in caplog.records if r.name == "mobius_fx"]
    assert len(said) == 1 and "clip_grad_norm_" in said[0] and "serially" not in said[0]


def test_clipping_as_a_step_pre_hook_is_exact(cache):
    """A pre-hook runs before any update: with one, the update waits for opt.step() (from the
    first step on, no probe needed), and the hook clips the final gradients."""
    def make(params):
        params = list(params)
        opt = _adamw(params)

        def clip(o, args, kwargs):
            torch.nn.utils.clip_grad_norm_(params, 1.0)

        opt.register_step_pre_hook(clip)
        return opt

    def loop(t, x, pipe, model, opt, backward):
        backward(pipe, x)
        opt.step()
        opt.zero_grad()

    model, opt = _lockstep(cache, make, loop)
    assert opt.handed_in_backward == _trainable(model) and opt.stepped_in_backward == 0


def test_grad_scaler_unscale_clip_and_inf_skip_are_exact(cache):
    """scaler.scale(loss).backward(); unscale_; clip_grad_norm_(1.0); scaler.step; update, with
    a step whose loss is infinite (the scaler skips it and halves its scale)."""
    scalers = {}

    def loop(t, x, pipe, model, opt, backward):
        scaler = scalers.setdefault(id(opt), torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
        loss = _loss(pipe(x), x) * (float("inf") if t == 2 else 1.0)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    model, opt = _lockstep(cache, _adamw, loop, steps=5)
    assert opt.handed_in_backward == _trainable(model) and opt._serial is None
    assert [s.get_scale() for s in scalers.values()] == [2.0 ** 7] * 2  # the infinite step was skipped


def test_a_clip_factor_above_one_and_nan_gradients_stay_exact(cache):
    """A large max_norm (clip factor clamped to 1.0) and a NaN loss whose step the loop skips."""
    def loop(t, x, pipe, model, opt, backward):
        loss = _loss(pipe(x), x) * (float("nan") if t == 1 else 1.0)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
        if torch.isfinite(norm):
            opt.step()
        opt.zero_grad()

    _lockstep(cache, _adamw, loop, steps=4)


# ---------------------------------------------------------------- optimizers that cannot step per stage

class GlobalNormSGD(torch.optim.SGD):
    """An SGD whose step normalises every gradient by the norm over all parameters: stepped stage
    by stage it would use each stage's norm, not the model's."""

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad / norm, alpha=-g["lr"])


@pytest.mark.parametrize("how", LOOPS)
def test_an_optimizer_that_reads_every_gradient_is_stepped_serially_said_once(cache, caplog, how):
    def loop(t, x, pipe, model, opt, backward):
        backward(pipe, x)
        opt.step()
        opt.zero_grad()

    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        model, opt = _lockstep(cache, lambda ps: GlobalNormSGD(ps, lr=0.1), loop, how=how)
    said = [r.getMessage() for r in caplog.records if r.name == "mobius_fx"]
    assert len(said) == 1 and "GlobalNormSGD" in said[0] and "serially" in said[0]
    assert opt.stepped_in_backward == 0


def test_lbfgs_under_sync_is_stepped_serially_with_its_closure(cache):
    def make(params):
        return torch.optim.LBFGS(list(params), lr=0.5, max_iter=3)

    def loop(t, x, pipe, model, opt, backward):
        def closure():
            opt.zero_grad()
            loss = _loss(pipe(x), x)
            loss.backward()
            return loss
        opt.step(closure)

    _lockstep(cache, make, loop, steps=2)


# ---------------------------------------------------------------- the books stay flat

@pytest.mark.parametrize("loop", LOOPS)
def test_memory_books_do_not_grow_across_overlapped_steps(cache, loop):
    """Each stage's finiteness flag (a byte computed on its GPU) was kept booked while the step
    holding it lived: current_bytes grew by a byte per stage per step."""
    model, _, data, pipe, _ = _pair(cache, loop, twin_pipe=False)
    opt = pipe.overlap(_adamw(model.parameters()), mode="sync")
    held = []
    for (x,) in data[:5]:
        _backward(loop)(pipe, x)
        opt.step()
        opt.zero_grad()
        held.append({gpu: s["current_bytes"] for gpu, s in pipe.memory_stats().items()})
    assert opt.stepped_in_backward == _trainable(model)  # the flags were computed: stages stepped in backward
    assert all(h == held[0] for h in held), held
