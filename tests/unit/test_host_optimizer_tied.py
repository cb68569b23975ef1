"""A tied master's two downloads in the fused host pass (`host_optimizer.step_span(..., grad2=)`)
and in the hand-over's one-pass sum (`host_optimizer.sum_two`): the gradient is the first download
widened plus the second added in fp32 -- `host_gradients.sum_downloads`' bits -- and the step is
torch's on that summed `.grad` (times a GradScaler's inverse scale, rounded once, where given), in
every backend the pass has (C++, inductor, eager)."""

from __future__ import annotations

import pytest
import torch

from mobius_fx.runtime import host_optimizer as H
from mobius_fx.runtime.host_gradients import sum_downloads

N = 4096 + 7  # a tail that is not a whole vector: the kernels step it with scalar code

CASES = {
    "adamw": ("adamw", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
    "adam-coupled": ("adam", torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, fused=True)),
    "adamw-maximize-beta0.3": ("adamw", torch.optim.AdamW,
                               dict(lr=1e-2, maximize=True, betas=(0.3, 0.99), fused=True)),
    "sgd-decay": ("sgd", torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)),
    "sgd-nesterov-maximize": ("sgd", torch.optim.SGD,
                              dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True, foreach=False)),
}


def _downloads(gen: torch.Generator, n: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Two downloads whose fp32 sum rounds (magnitudes 1e-4..1, signs mixed) and whose bf16 sum
    would round differently: a sum in the download's dtype shows."""
    def one() -> torch.Tensor:
        return (torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * 4 - 4)).to(dtype)
    return one(), one()


def _backend(which: str, monkeypatch) -> bool:
    monkeypatch.setattr(H, "BACKENDS", (which,) if which != "eager" else ())
    return which != "eager"


def _skip_unless(which: str) -> None:
    if which != "eager" and H.backend() != which:
        pytest.skip(f"the {which} kernel cannot be built here: {H.reasons()}")


def _torch_step(cls, kw: dict, p0: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor, inv: torch.Tensor | None):
    """torch's optimizer: one step from a zero state to make it (gradient g1 + g2 of the previous
    step: any), then the step under test on `.grad = sum_downloads(p, [g1, g2])` (unscaled by
    `inv` as GradScaler.unscale_ does). Returns the state before the step under test, the
    parameter after, its state after, the summed `.grad` before the unscale and the group."""
    ref = torch.nn.Parameter(p0.clone())
    opt = cls([ref], **kw)
    ref.grad = (g2.float() * 0.5).flip(0)
    opt.step()
    before = (ref.detach().clone(), {k: v.clone() for k, v in opt.state[ref].items()})
    with torch.no_grad():
        ref.grad = sum_downloads(ref.detach(), [g1, g2])
    summed = ref.grad.clone()
    if inv is not None:
        found = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_([ref.grad], found, inv)
        assert found.item() == 0
    opt.step()
    return before, ref.detach().clone(), {k: v.clone() for k, v in opt.state[ref].items()}, summed, \
        dict(opt.param_groups[0])


def _ours(kind: str, group: dict, before, g1: torch.Tensor, g2: torch.Tensor | None, inv: torch.Tensor | None,
          compiled: bool):
    p, st = before[0].clone(), {k: v.clone() for k, v in before[1].items()}
    step = None
    if "step" in st:
        st["step"] += 1
        step = float(st["step"])
    go, copy = torch.full((p.numel(),), 7.0), torch.empty(p.numel(), dtype=torch.bfloat16)
    ok = H.step_span(kind, group, p, g1, st, step=step, grad_out=go, copy_out=copy, compiled=compiled,
                     grad_scale=None if inv is None else float(inv), grad2=g2)
    assert bool(ok) and torch.equal(copy, p.to(torch.bfloat16))  # the copy is the new master's
    return p, st, go


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad-scaler"])
@pytest.mark.parametrize("which", ["c++", "inductor", "eager"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_downloads_step_as_torch_on_the_summed_grad(case, which, scaled, monkeypatch):
    """One pass over both downloads: `.grad` (grad_out) is `sum_downloads`' sum bit for bit, and
    the master, the state and the copy are those of the same backend stepping that fp32 sum as one
    download -- and torch's own step on it: the C++ kernel on every element, inductor's on whole
    vectors (its tail is vector code), eager's formula for SGD within the derived bound (it does
    not contract torch's FMAs). inv = 1/192 rounds: a sum taken after the unscale shows."""
    kind, cls, kw = CASES[case]
    compiled = _backend(which, monkeypatch)
    gen = torch.Generator().manual_seed(11)
    p0 = torch.randn(N, generator=gen) * 0.1
    g1, g2 = _downloads(gen, N)
    bf16_sum = (g1 + g2).float()
    summed = sum_downloads(p0, [g1, g2])
    assert not torch.equal(summed, bf16_sum)  # the dtype of the sum matters for these downloads
    inv = torch.tensor(192.0).double().reciprocal().float() if scaled else None
    before, ref_p, ref_st, ref_grad, group = _torch_step(cls, kw, p0, g1, g2, inv)
    assert torch.equal(ref_grad, summed)
    p, st, go = _ours(kind, group, before, g1, g2, inv, compiled)
    _skip_unless(which)
    assert torch.equal(go.view(torch.int32), summed.view(torch.int32))  # .grad: the sum, before the unscale
    # the same backend from the summed fp32 gradient as one download: the same bits
    q, qst, qgo = _ours(kind, group, before, summed, None, inv, compiled)
    assert torch.equal(p, q) and all(torch.equal(st[k], qst[k]) for k in st) and torch.equal(go, qgo)
    names = [k for k in ref_st if k != "step"]
    if which == "eager":
        return  # eager's formula rounds as its own ops do (test_host_optimizer.py bounds it against torch's)
    body = N if which == "c++" or kind == "sgd" else N - N % 64
    assert torch.equal(p[:body], ref_p[:body]), case
    assert all(torch.equal(st[k][:body], ref_st[k][:body]) for k in names), case


@pytest.mark.parametrize("which", ["c++", "inductor", "eager"])
def test_two_downloads_out_of_place_as_in_place(which, monkeypatch):
    """The speculative and async passes step out of place (`p_out`, `state_out`) from both
    downloads: the bits of the in-place pass, the old master and state untouched."""
    compiled = _backend(which, monkeypatch)
    gen = torch.Generator().manual_seed(12)
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "maximize": False}
    p0 = torch.randn(N, generator=gen)
    st0 = {"exp_avg": torch.randn(N, generator=gen) * 1e-3, "exp_avg_sq": torch.rand(N, generator=gen) * 1e-6}
    g1, g2 = _downloads(gen, N)
    p, st = p0.clone(), {k: v.clone() for k, v in st0.items()}
    H.step_span("adamw", group, p, g1, st, step=4.0, compiled=compiled, grad2=g2)
    q, qst = p0.clone(), {k: v.clone() for k, v in st0.items()}
    out, sout = torch.empty(N), {k: torch.empty(N) for k in st0}
    H.step_span("adamw", group, q, g1, qst, step=4.0, compiled=compiled, grad2=g2, p_out=out, state_out=sout)
    _skip_unless(which)
    assert torch.equal(out, p) and all(torch.equal(sout[k], st[k]) for k in st0)
    assert torch.equal(q, p0) and all(torch.equal(qst[k], st0[k]) for k in st0)


@pytest.mark.parametrize("which", ["c++", "inductor", "eager"])
def test_the_finite_flag_of_two_downloads_is_their_sums(which, monkeypatch):
    """A non-finite value in the second download (body or tail) clears the flag; so does a sum of
    two finite downloads that overflows fp32."""
    compiled = _backend(which, monkeypatch)
    gen = torch.Generator().manual_seed(13)
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "maximize": False}
    big = torch.finfo(torch.bfloat16).max
    for where, bad, other in [(None, None, None), (17, float("nan"), None), (N - 3, float("inf"), None),
                              (40, big, big)]:
        g1, g2 = _downloads(gen, N)
        if where is not None:
            g2[where] = bad
            if other is not None:
                g1[where] = other
        flag = H.step_span("adamw", group, torch.randn(N, generator=gen), g1,
                           {"exp_avg": torch.zeros(N), "exp_avg_sq": torch.zeros(N)}, step=2.0, compiled=compiled,
                           grad2=g2)
        _skip_unless(which)
        assert bool(flag) == (where is None), (where, bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sum_two_is_sum_downloads_bit_for_bit(dtype, monkeypatch):
    """The hand-over's one pass (async's `take`, sync's hand-over into a fresh `.grad`): the fp32
    sum `sum_downloads` makes in two passes, bit for bit (NaN, inf and overflow too), on a size
    several threads split, with a tail."""
    monkeypatch.setattr(H, "BACKENDS", ("c++",))
    gen = torch.Generator().manual_seed(14)
    n = 2 * 16384 + 5
    a, b = _downloads(gen, n, dtype)
    big = torch.finfo(dtype).max
    for i, (x, y) in enumerate([(float("nan"), 1.0), (float("inf"), -float("inf")), (big, big), (-0.0, 0.0)]):
        a[100 * i + 3], b[100 * i + 3] = x, y
        a[n - 1 - i], b[n - 1 - i] = x, y
    out = torch.full((n,), 7.0)
    if not H.sum_two(out, a, b):
        pytest.skip(f"the C++ kernel cannot be built here: {H.reasons()}")
    want = sum_downloads(torch.empty(n), [a, b])
    same = out.view(torch.int32) == want.view(torch.int32)
    # bit for bit but for a NaN's payload: torch's scalar fp16 conversion (its copy's tail) widens a NaN
    # to 0x7fffffff, the extension's (built with F16C) to the quiet 0x7fc00000
    assert bool((same | (out.isnan() & want.isnan())).all()), out[~same][:8]
    assert bool(same[:n - n % 16].all()) and int(out.isnan().sum()) == 4
    assert not H.sum_two(out, a, b.float())  # two dtypes: not taken (the caller's sum_downloads)
