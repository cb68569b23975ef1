"""pipe.overlap(opt, "sync") with a loop that edits the gradients between backward and opt.step()
(issue 38 part 3): the stages are stepped during backward SPECULATIVELY -- out of place, the new
master, moments and streamed copy into spare buffers -- and opt.step() commits them (pointer swaps)
where the final gradients are, bit for bit, those the step read (clip_grad_norm_ within max_norm
multiplies by exactly 1.0), or rolls them back (drops the new buffers) and steps from the final
gradients. Either way the weights and torch's state equal serial stepping bit for bit.

Each loop runs on a bf16 pipeline (device="virtual-async": the fused host pass steps the stages)
and, in lockstep, on a twin with the same torch optimizer stepped serially after backward.
Optimizers whose host-pass bits are torch's (SGD with momentum; AdamW(fused=True) on whole
vectors, one thread: docs/host_optimizer.md). Mutations checked by hand (see the commit):
committing without validating fails the small-max_norm tests; a rollback that swaps in the new
moments (the wrong buffer) fails them too.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import mobius_fx
from mobius_fx import Topology
from mobius_fx.runtime import host_optimizer as H
from mobius_fx.runtime.host_counters import COUNTERS, HostCounters
from mobius_fx.zoo import nanogpt, nanogpt_inputs

STEPS = 4

pytestmark = pytest.mark.skipif(not H.compiled(), reason="no compiled host pass: nothing is speculated")


def _loss(out, x):
    return F.cross_entropy(out.flatten(0, 1).float(), x.flatten())


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("overlap_speculation")


def _pair(cache, dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = nanogpt(hidden=32, blocks=2, vocab=64, seq=8)  # every tensor a whole number of 16-float vectors
    twin = copy.deepcopy(model)
    data = [nanogpt_inputs(model, batch=4, seed=s) for s in range(STEPS + 2)]
    topo = Topology.virtual(gpus=2, memory=8 * sum(p.numel() * 4 for p in model.parameters()))
    kw = dict(example_inputs=data[0], microbatches=2, cuts=[1, 2], cache_dir=str(cache), verbose=False,
              dtype=dtype)
    pipe = mobius_fx.compile(model, topo, device="virtual-async", **kw)
    ref_pipe = mobius_fx.compile(twin, topo, device="virtual", **kw)
    return model, twin, data, pipe, ref_pipe


OPTIMIZERS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
}


def _same(model, twin, opt, ref, t):
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), f"step {t}: {name}"
        for (k, v), (k2, w) in zip(opt.state[p].items(), ref.state[q].items()):
            assert k == k2 and torch.equal(v, w), f"step {t}: {name}.{k}"


def _copies_current(pipe, model, committed=0):
    """The streamed copy each device uploads from holds the weights (a commit swapped it in);
    `committed`: the parameters this round committed, each with a copy marked current (nothing left
    for the next upload to copy again; the others, stepped in place by torch, are copied again)."""
    current = set()
    for p in model.parameters():
        for d in pipe.devices.values():
            e = d.streamed_copies.get(p)
            if e is not None and e.current == (p.data_ptr(), p._version):
                assert torch.equal(e.host, p.detach().to(e.host.dtype))
                current.add(id(p))
    assert len(current) >= committed, f"{committed} parameters committed, {len(current)} copies current"


def _lockstep(cache, make, loop, steps=STEPS, dtype=torch.bfloat16):
    model, twin, data, pipe, ref_pipe = _pair(cache, dtype)
    opt = pipe.overlap(make(model.parameters()), mode="sync")
    ref = make(twin.parameters())
    seen = []
    for t, (x,) in enumerate(data[:steps]):
        before = COUNTERS.snapshot()
        loop(t, x, pipe, model, opt)
        opt.counts = HostCounters.since(before, COUNTERS.snapshot())
        loop(t, x, ref_pipe, twin, ref)
        _same(model, twin, opt, ref, t)
        _copies_current(pipe, model, committed=opt.committed)
        seen.append((opt.speculated_in_backward, opt.committed, opt.rolled_back))
    return model, opt, seen


def _clipped(max_norm):
    def loop(t, x, pipe, model, opt):
        _loss(pipe(x), x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
    return loop


def _speculable(model) -> int:
    """Parameters the pass steps: all, the tied embedding too (two downloads: the pass sums them)."""
    return sum(1 for p in model.parameters() if p.requires_grad)


def _tied(model) -> int:
    """Elements of the tied embedding (wte / lm_head: a download from each of the two stages holding it)."""
    return sum(p.numel() for p in model.parameters() if p.dim() == 2 and p.shape[0] == 64)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_clip_within_max_norm_commits_the_speculative_step_bit_for_bit(cache, name, one_thread, caplog):
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        model, opt, seen = _lockstep(cache, OPTIMIZERS[name], _clipped(1e6))
    n = _speculable(model)
    assert seen[0] == (0, 0, 0)  # the probe: serial, it finds the clip
    assert all(s == (n, n, 0) for s in seen[1:]), seen  # stepped during backward, every one committed
    # the bytes: the C++ pass writes the new state out of place in its own pass (no copy); opt.step()
    # reads each speculated fp32 .grad and its bf16 download once (clip_grad_norm_ bumped the version),
    # the tied embedding's two downloads
    spec = sum(p.numel() for p in model.parameters() if id(p) in opt._spare_bufs)
    if H.backend() == "c++":
        assert opt.counts["spec_copy"] == 0, opt.counts
    assert opt.counts["spec_check"] == 6 * spec + 2 * _tied(model), (opt.counts, spec)
    assert opt._speculating is not None and opt._defer is None and opt.stepped_in_backward == 0
    said = [r.getMessage() for r in caplog.records if r.name == "mobius_fx"]
    assert len(said) == 1 and "speculatively" in said[0] and "clip_grad_norm_" in said[0]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_clip_below_the_norm_rolls_back_and_steps_from_the_clipped_gradients(cache, name, one_thread):
    model, opt, seen = _lockstep(cache, OPTIMIZERS[name], _clipped(1e-3))
    n = _speculable(model)
    assert all(s == (n, 0, n) for s in seen[1:]), seen


def test_a_clip_that_switches_between_commit_and_rollback_stays_exact(cache, one_thread):
    """max_norm between the steps' norms: some steps commit, others roll back, state carried on."""
    norms = [1e6, 1e-3, 1e6, 1e-3, 1e6]
    model, opt, seen = _lockstep(cache, OPTIMIZERS["adamw-fused"],
                                 lambda t, x, pipe, model, opt: _clipped(norms[t])(t, x, pipe, model, opt), steps=5)
    n = _speculable(model)
    assert seen[1:] == [(n, 0, n), (n, n, 0), (n, 0, n), (n, n, 0)]


def test_step_hooks_fire_once_per_step_while_speculating(cache, one_thread):
    calls = []

    def loop(t, x, pipe, model, opt):
        if t == 0:
            opt.register_step_post_hook(lambda o, a, k: calls.append(id(o)))
        _clipped(1e6)(t, x, pipe, model, opt)

    model, opt, seen = _lockstep(cache, OPTIMIZERS["sgd-momentum"], loop)
    assert len(calls) == 2 * STEPS  # the overlapped loop's and the reference's, once per opt.step() each
    assert seen[-1][1] == _speculable(model)


def test_a_skipped_non_finite_step_drops_the_speculation(cache, one_thread):
    """A NaN loss at step 2 whose step the loop skips (clip's norm non-finite): nothing of it lands;
    the steps after it speculate again."""
    def loop(t, x, pipe, model, opt):
        loss = _loss(pipe(x), x) * (float("nan") if t == 2 else 1.0)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
        if torch.isfinite(norm):
            opt.step()
        opt.zero_grad()

    model, opt, seen = _lockstep(cache, OPTIMIZERS["adamw-fused"], loop, steps=5)
    assert opt._defer is None and seen[-1] == (_speculable(model),) * 2 + (0,)


def test_a_forward_between_backward_and_step_sees_the_old_weights(cache, one_thread):
    """Speculating, the model keeps its old weights until opt.step(): an evaluation forward in
    between runs on them, as in a serial loop (not refused: no stage's weights changed)."""
    outs = {}

    def loop(t, x, pipe, model, opt):
        _loss(pipe(x), x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
        with torch.no_grad():
            outs.setdefault(t, []).append(pipe(x).float())
        opt.step()
        opt.zero_grad()

    model, opt, seen = _lockstep(cache, OPTIMIZERS["sgd-momentum"], loop)
    assert all(torch.equal(a, b) for a, b in outs.values())
    assert seen[-1][1] == _speculable(model)


def _scaled(max_norm, inf_at=(), init_scale=2.0 ** 8):
    """The GradScaler loop: scale(loss).backward(); unscale_; clip_grad_norm_; scaler.step; update.
    `max_norm`: a number, or one per step. An infinite loss at the steps `inf_at` (the scaler skips
    them and halves its scale); the scale doubles after every 2 steps without inf
    (growth_interval=2): the scale changes between steps both ways. `loop.scales[id(opt)]`: the scale each step's loss was multiplied by."""
    scalers, scales = {}, {}

    def loop(t, x, pipe, model, opt):
        scaler = scalers.setdefault(id(opt), torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2))
        loss = _loss(pipe(x), x) * (float("inf") if t in inf_at else 1.0)
        scales.setdefault(id(opt), []).append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm[t] if isinstance(max_norm, list) else max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    loop.scales = scales
    return loop


# the probe, a rollback (it clips), a commit (clip factor 1.0) at a scale grown since, an infinite
# loss (skipped by the scaler), a commit at the scale backed off since, a rollback
SCALED_NORMS = [1e6, 1e-3, 1e6, 1e6, 1e6, 1e-3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_grad_scaler_with_clip_is_speculated_and_exact(cache, name, dtype, one_thread, caplog):
    """A GradScaler loop with clip_grad_norm_ under sync: the stages are stepped speculatively
    during backward from the download times the fp32 inverse of the scale the loss was multiplied
    by (read fresh each backward: the scale grows and backs off between steps), and opt.step()
    commits them where the clip left the unscaled gradients alone (factor 1.0), else rolls back;
    the step with an infinite loss is skipped by the scaler (its speculation dropped at the next
    backward). Every weight and state tensor equals serial stepping after every step; speculation,
    not deferral, ran."""
    loop = _scaled(SCALED_NORMS, inf_at=(3,))
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        model, opt, seen = _lockstep(cache, OPTIMIZERS[name], loop, steps=len(SCALED_NORMS), dtype=dtype)
    n = _speculable(model)
    commit, rollback = (n, n, 0), (n, 0, n)
    assert [seen[t] for t in (0, 1, 2, 4, 5)] == [(0, 0, 0), rollback, commit, commit, rollback], seen
    assert opt._speculating is not None and opt._defer is None and opt._serial is None
    assert opt.stepped_in_backward == 0
    ours, ref = loop.scales.values()
    assert ours == ref == [2.0 ** 8, 2.0 ** 8, 2.0 ** 9, 2.0 ** 9, 2.0 ** 8, 2.0 ** 8]  # grown, skipped, backed off
    said = [r.getMessage() for r in caplog.records if r.name == "mobius_fx"]
    assert len(said) == 1 and "speculatively" in said[0] and "GradScaler" in said[0], said


def test_a_first_step_the_grad_scaler_skips_still_leads_to_speculation(cache, one_thread):
    """fp16's GradScaler often skips its first steps (init_scale 2**16 overflows): the probe round's
    step skipped and the gradients zeroed, the next backward probes again (nothing was stepped),
    and the loop is then speculated, not deferred for good; serial's bits throughout."""
    model, opt, seen = _lockstep(cache, OPTIMIZERS["adamw-fused"], _scaled(1e6, inf_at=(0,)), steps=STEPS)
    n = _speculable(model)
    assert opt._defer is None and opt._speculating is not None, (opt._defer, seen)
    assert seen[-1] == (n, n, 0), seen


def test_grad_scaler_with_clip_at_one_is_speculated_and_exact(cache, one_thread):
    """The acceptance loop (clip_grad_norm_(..., 1.0), a GradScaler, fp16) at a scale that is not a
    power of two (its inverse rounds): every step speculated, committed or rolled back as the
    norm says, serial's bits either way."""
    model, opt, seen = _lockstep(cache, OPTIMIZERS["adamw-fused"], _scaled(1.0, init_scale=3.0 * 2 ** 6),
                                 dtype=torch.float16)
    n = _speculable(model)
    assert all(s[0] == n and s[1] + s[2] == n for s in seen[1:]), seen


def test_an_unscale_without_the_scalers_step_is_compared_not_trusted(cache, one_thread):
    """unscale_ edits `.grad` in place without a version bump. A loop that unscales and calls
    opt.step() itself (not scaler.step: the overlap sees no scaler, so its pass does not unscale):
    the probe notes the silent edit, so each speculative step is compared bit for bit -- rolled back,
    it read the scaled gradient -- never taken as unchanged by its version."""
    scalers = {}

    def loop(t, x, pipe, model, opt):
        scaler = scalers.setdefault(id(opt), torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
        scaler.scale(_loss(pipe(x), x)).backward()
        scaler.unscale_(opt)
        opt.step()
        scaler.update()
        opt.zero_grad()

    model, opt, seen = _lockstep(cache, OPTIMIZERS["sgd-momentum"], loop)
    n = _speculable(model)
    assert opt._silent_edits and seen[1:] == [(n, 0, n)] * (STEPS - 1), seen


def _pre_hook_clip(make, max_norm):
    def made(ps):
        ps = list(ps)
        opt = make(ps)

        def clip(o, args, kwargs):
            torch.nn.utils.clip_grad_norm_(ps, max_norm)
        opt.register_step_pre_hook(clip)
        return opt
    return made


def _plain(t, x, pipe, model, opt):
    _loss(pipe(x), x).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("max_norm, commits", [(1e6, True), (1e-3, False)], ids=["commit", "rollback"])
def test_clipping_in_a_step_pre_hook_is_speculated_and_exact(cache, name, max_norm, commits, one_thread, caplog):
    """clip_grad_norm_ as a step pre-hook: the stages are stepped speculatively during backward
    (from the second step: the first is the probe); opt.step() runs the hook, then checks and
    commits or rolls back."""
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        model, opt, seen = _lockstep(cache, _pre_hook_clip(OPTIMIZERS[name], max_norm), _plain)
    n = _speculable(model)
    assert seen[0] == (0, 0, 0) and seen[1:] == [(n, n, 0) if commits else (n, 0, n)] * (STEPS - 1), seen
    assert opt._speculating is not None and opt._defer is None and opt.stepped_in_backward == 0
    said = [r.getMessage() for r in caplog.records if r.name == "mobius_fx"]
    assert len(said) == 1 and "pre-hook" in said[0] and "speculatively" in said[0], said


def test_a_pre_hook_that_edits_the_weights_rolls_back(cache, one_thread):
    """A pre-hook that changes a parameter in place (its version moves) after the speculative step
    read it: that parameter is rolled back and stepped from the edited weights, as serial."""
    def make(ps):
        ps = list(ps)
        opt = OPTIMIZERS["sgd-momentum"](ps)

        def shrink(o, a, k):
            with torch.no_grad():
                ps[1].mul_(0.5)
        opt.register_step_pre_hook(shrink)
        return opt

    model, opt, seen = _lockstep(cache, make, _plain)
    n = _speculable(model)
    assert seen[1:] == [(n, n - 1, 1)] * (STEPS - 1), seen


def test_speculate_false_defers_instead(cache, one_thread):
    def make(ps):
        return OPTIMIZERS["sgd-momentum"](ps)

    model, twin, data, pipe, ref_pipe = _pair(cache)
    opt = pipe.overlap(make(model.parameters()), mode="sync")
    opt.speculate = False
    ref = make(twin.parameters())
    for t, (x,) in enumerate(data[:3]):
        for m, p_, o in ((model, pipe, opt), (twin, ref_pipe, ref)):
            _clipped(1e6)(t, x, p_, m, o)
        _same(model, twin, opt, ref, t)
    assert opt._defer is not None and opt._speculating is None and opt.speculated_in_backward == 0


@pytest.mark.parametrize("kind,group,names", [
    ("adamw", dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1, eps=1e-8), ("exp_avg", "exp_avg_sq")),
    ("adam", dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1, eps=1e-8), ("exp_avg", "exp_avg_sq")),
    ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=1e-3, dampening=0.0, nesterov=True), ("momentum_buffer",)),
])
@pytest.mark.parametrize("compiled", [True, False])
def test_the_pass_out_of_place_writes_the_in_place_bits_and_keeps_the_old_state(kind, group, names, compiled):
    """`step_span(..., p_out=, state_out=)`: the new parameter and state equal the in-place step's
    bits (a scalar tail included: 16 * 37 + 5 elements), the old ones are left untouched."""
    torch.manual_seed(0)
    n = 16 * 37 + 5
    p, g = torch.randn(n), torch.randn(n).bfloat16()
    st = {k: torch.rand(n) for k in names}
    ip, ist = p.clone(), {k: v.clone() for k, v in st.items()}
    H.step_span(kind, group, ip, g, ist, step=3.0, compiled=compiled)
    old_p, old = p.clone(), {k: v.clone() for k, v in st.items()}
    op, ost = torch.empty(n), {k: torch.empty(n) for k in names}
    H.step_span(kind, group, p, g, st, step=3.0, p_out=op, state_out=ost, compiled=compiled)
    assert torch.equal(op, ip) and all(torch.equal(ost[k], ist[k]) for k in names)
    assert torch.equal(p, old_p) and all(torch.equal(st[k], old[k]) for k in names)


def test_accumulation_started_while_speculating_drops_it_and_defers(cache, one_thread):
    """From step 2 the loop accumulates two backward passes per step: the first pass's speculative
    steps are dropped at the second backward (they read only its gradients) and the update waits
    for opt.step() from then on; every step stays serial's."""
    def loop(t, x, pipe, model, opt):
        for _ in range(2 if t >= 2 else 1):
            _loss(pipe(x), x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
        opt.step()
        opt.zero_grad()

    model, opt, seen = _lockstep(cache, OPTIMIZERS["sgd-momentum"], loop)
    assert seen[1][1] == _speculable(model) and seen[2:] == [(0, 0, 0)] * (STEPS - 2), seen
    assert opt._defer is not None


@pytest.mark.parametrize("kind,group,names", [
    ("adamw", dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1, eps=1e-8), ("exp_avg", "exp_avg_sq")),
    ("adam", dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1, eps=1e-8), ("exp_avg", "exp_avg_sq")),
    ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=1e-3, dampening=0.0, nesterov=True), ("momentum_buffer",)),
])
@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("gdtype", [torch.bfloat16, torch.float16])
def test_the_pass_unscales_the_gradient_as_grad_scaler_does(kind, group, names, compiled, gdtype):
    """`step_span(..., grad_scale=inv)`: the step reads the widened gradient times `inv`, rounded once
    in fp32 -- torch's `_amp_foreach_non_finite_check_and_unscale_` -- the bits of a step from that
    unscaled fp32 gradient (out of place too, a scalar tail included); `grad_out` gets the widened
    gradient itself (the scaler unscales it in place). inv = 1/192 is not a power of two: the product
    rounds, so a multiply fused into the update's first add (contraction) would show."""
    torch.manual_seed(0)
    n = 16 * 37 + 5
    scale = torch.tensor(192.0)
    inv = scale.double().reciprocal().float()  # as GradScaler.unscale_
    p, g = torch.randn(n), (torch.randn(n) * 192).to(gdtype)
    st = {k: torch.rand(n) for k in names}
    unscaled = g.float()
    found = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_([unscaled], found, inv)
    assert found.item() == 0 and not torch.equal(unscaled, g.float() * 0.005)  # rounded: not 1/200's
    ref_p, ref_st = p.clone(), {k: v.clone() for k, v in st.items()}
    H.step_span(kind, group, ref_p, unscaled, ref_st, step=3.0, compiled=compiled)
    for out_of_place in (False, True):
        q, qst, go = p.clone(), {k: v.clone() for k, v in st.items()}, torch.empty(n)
        kw = dict(p_out=torch.empty(n), state_out={k: torch.empty(n) for k in names}) if out_of_place else {}
        H.step_span(kind, group, q, g, qst, step=3.0, compiled=compiled, grad_out=go, grad_scale=float(inv), **kw)
        new_p, new_st = (kw["p_out"], kw["state_out"]) if out_of_place else (q, qst)
        assert torch.equal(new_p, ref_p) and all(torch.equal(new_st[k], ref_st[k]) for k in names)
        assert torch.equal(go, g.float())
