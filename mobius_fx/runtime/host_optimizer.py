"""One pass over host memory per parameter and step: torch's Adam, AdamW and SGD (momentum)
stepped by a kernel that reads the gradient as it was downloaded (bf16/fp16, or fp32), updates
the fp32 master and the optimizer's state in place -- kept in torch's own `opt.state[p]`
(`exp_avg`, `exp_avg_sq`, `momentum_buffer`, `step`), so `state_dict()` stays torch's -- and
writes, in the same loop, the streamed copy the next upload reads (bf16/fp16), optionally the
fp32 `.grad` users read after backward, and whether the gradient was all finite. A tied master
(two stages hold it, so two downloads) is stepped in the same pass: it reads both and sums them
as `host_gradients.sum_downloads` does (`step_span`'s `grad2`); `sum_two` is that sum alone in one
pass, for a hand-over that must make `.grad` before the step (async).

Bytes per parameter for AdamW with a bf16 gradient and a bf16 streamed copy: read p, m, v (12) and
the gradient (2), write p, m, v (12) and the copy (2): 28, the bytes torch's own fused AdamW
touches on an fp32 gradient without writing any copy (`benchmarks/cpu_optimizer.py` measures both
beside a STREAM-like triad over the same bytes); + 4 when the fp32 `.grad` is written too.

How it is built, and why (by measurement). First choice: a small C++ extension
(`host_kernel.py`) that is torch's own fused CPU Adam loop (aten/src/ATen/native/cpu/
FusedAdamKernel.cpp: `at::vec::Vectorized` over the ISA torch dispatches to, `at::parallel_for`
over 64-byte units, the same operations in the same order, contracted as torch's build does),
extended to read the 16-bit gradient and to write the streamed copy, the fp32 `.grad`, the
finite flag and `p_out` in the same loop (the copy and `p_out` with non-temporal stores: those
lines are only written, so no read for ownership; a bf16 copy converted with the AVX-512 BF16
instruction where the CPU has it, vectors holding a denormal or NaN with torch's conversion); SGD as torch's per-tensor ops (each
`add(..., alpha=)` one FMA). Built at first use with `torch.utils.cpp_extension.load_inline`
(about 40 s on 2 cores), then loaded from torch's extension cache. It replaced the torch.compile
(inductor) kernel by measurement: on this 2-core host (37.8M GPT-like parameters in 36 tensors)
inductor's pass ran at 0.64-0.78x torch's AdamW(fused=True) (1 and 2 threads), the C++ one at
1.04-1.13x (`python benchmarks/cpu_optimizer.py --sweep-only --sweep-inductor` prints the pass,
inductor's and the triad side by side; docs/host_optimizer.md has the figures). Why inductor's is slower: the finite flag
`isfinite(g).all()` is a reduction it emits as a separate parallel loop over the gradient before
the update loop (a second pass and fork/join per span); each call goes through dynamo's guards,
the AOT wrapper and a new scalars tensor (~45 us per span on a loaded host, against ~10 us for the
extension's call); it writes the copy with ordinary stores; and whether it vectorises at all
depends on its ISA probe (a child process with a timeout: on an overloaded host it was seen to
fail, and the generated code then did not compile). Where the
extension cannot be built (no C++ compiler, a build error) the inductor kernel steps (the same
formula, bit-exact on whole vectors), then eager torch ops: each failure is logged once
(`logging.getLogger("mobius_fx")`), `backend()` says which steps, `reasons()` why the others do
not; where neither compiled kernel builds `compiled()` says False and callers step with torch's
own optimizer and copy as before (`overlap`); `step_span(..., compiled=False)` runs the
formula in eager torch ops (several passes). DeepSpeed's CPU Adam was not chosen: an optional
extension, AdamW only, its own state layout and operation order (not torch's bits).

The hyper-parameters are read from the param group at every step (LR schedulers work): the C++
kernel takes them as arguments (as torch's, in double, rounded to fp32 where torch's rounds them);
inductor's gets them as one fp32 tensor of scalars (`scalars`): a new lr, step or beta does not
recompile (tests/unit/test_host_optimizer.py checks it with `torch._dynamo.config.error_on_recompile`).
One compiled kernel per (optimizer kind, its flags, the gradient's and the copy's dtypes, whether
`.grad` is written); sizes are dynamic.

Exactness. The formulas are torch's fused CPU kernels' (aten/src/ATen/native/cpu/FusedAdamKernel.cpp),
operation for operation, scalars rounded from double to fp32 as there; compiled with
floating-point contraction (`-ffp-contract=fast`), gcc contracts the lerp and the second moment
into the same FMAs as torch's build, and a `where` keeps the decayed parameter from being
contracted into the update, as in torch's. On this machine (gcc 12, AVX-512) AdamW and Adam
equal `fused=True` bit for bit (tests): the C++ kernel on every element (its scalar tail is
torch's), inductor's on whole vectors (it steps the tail with vector code). Against any implementation of the same formula (torch's
`foreach=False` one: addcdiv as p + s*(m/d) instead of p + (s*m)/d, no FMA), per step from the
same state, elementwise with u = 2^-24 (fp32 unit roundoff), the derived bound (`adam_bound`) is

    |dm| <= 4u (|m| + |g|)                      two roundings of m + w(g - m) in each, |w| <= 1
    |dv| <= 8u v'                               <= 4 roundings of non-negative terms in each
    |dp| <= 2u (|p| + |p'|) + 8u (|U| + |s| (|m| + |g|) / d)

where U = s m'/d is the update (s = -lr/(1 - beta1^t), d = sqrt(v')/sqrt(1 - beta2^t) + eps):
each side rounds p*(1 - lr wd) and the final sum once (u each), d carries <= 3 roundings plus
half of v's relative error (<= 7u), the quotient and the product one each, and m' enters with
its absolute error dm scaled by |s|/d. The difference of two implementations is at most twice
one's error. SGD: `sgd_bound`, likewise. Mutations of the formula (bias correction off by one
step, eps inside the square root, coupled instead of decoupled decay, ...) break these bounds
(tests).
"""

from __future__ import annotations

import logging
import math
import threading
import types
from typing import Any, Callable

import torch

from mobius_fx.runtime import host_kernel

__all__ = ["KINDS", "kind_of", "compiled", "step_span", "sum_two", "adam_scalars", "sgd_scalars", "adam_bound", "sgd_bound",
           "OPTIONS", "reason_not_compiled", "backend", "reasons", "BACKENDS"]

log = logging.getLogger("mobius_fx")

# The optimizers stepped here (exact classes: a subclass may change the update) and their kind.
KINDS = {torch.optim.Adam: "adam", torch.optim.AdamW: "adamw", torch.optim.SGD: "sgd"}

U = 2.0 ** -24  # fp32 unit roundoff

# inductor's options for the kernels: contraction as gcc does in torch's own build (see the module docstring)
OPTIONS: dict[str, Any] = {"cpp.enable_floating_point_contract_flag": "fast"}

_lock = threading.Lock()
_kernels: dict[tuple, Callable[..., Any]] = {}
_broken: dict[str, str] = {}  # backend ("c++", "inductor") -> why it could not be built


def kind_of(opt: torch.optim.Optimizer, group: dict) -> str | None:
    """The kernel kind ("adam", "adamw", "sgd") that steps `group` of `opt` exactly as its own step,
    or None (another optimizer, amsgrad, differentiable, capturable, a GradScaler's grad_scale,
    SGD without momentum's `nesterov`/`dampening` rules are kept: those are stepped)."""
    kind = KINDS.get(type(opt))
    if kind is None or group.get("differentiable") or group.get("capturable"):
        return None
    if kind in ("adam", "adamw"):
        if group.get("amsgrad") or isinstance(group.get("betas", (0, 0))[0], torch.Tensor):
            return None
        if kind == "adam" and group.get("decoupled_weight_decay"):
            kind = "adamw"
    return kind


# ------------------------------------------------------------------ the formulas (one per kind)
def _gradient(g16: torch.Tensor, grad_out: torch.Tensor | None, maximize: bool,
              g2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's fp32 gradient from the streamed one (plus `g2`, a tied master's second download,
    added in fp32 as `host_gradients.sum_downloads` does: one rounding), written to `grad_out` (the
    fp32 `.grad`) when given, negated under `maximize`, and whether it is all finite (a 0-d bool)."""
    g = g16.float()
    if g2 is not None:
        g = g + g2.float()
    if grad_out is not None:
        grad_out.copy_(g)
    ok = torch.isfinite(g).all()
    return (-g if maximize else g), ok


def _adam(p: torch.Tensor, g16: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor | None,
          copy_out: torch.Tensor | None, s: torch.Tensor, decoupled: bool, decay: bool, maximize: bool,
          small_w: bool, p_out: torch.Tensor | None = None, g2: torch.Tensor | None = None) -> torch.Tensor:
    """One Adam/AdamW step of flat fp32 `p`, `m`, `v` from gradient `g16`, in place (the new `p`
    into `p_out` instead when given); `s` = the fp32 scalars of `adam_scalars`. Returns whether
    `g16` is all finite (a 0-d bool)."""
    g, ok = _gradient(g16, grad_out, maximize, g2)
    wdf, w1, b2, c2, bc2s, eps, nss = s[0], s[1], s[2], s[3], s[4], s[5], s[6]
    p1 = p
    if decay:
        if decoupled:  # p * (1 - lr*wd), kept out of the update's FMA as in torch's kernel
            p1 = torch.where(p == p, p * wdf, p)
        else:  # Adam: the gradient coupled with the weight decay
            g = g + p * wdf
    m1 = m + w1 * (g - m) if small_w else g + (w1 - 1) * (g - m)  # lerp, as torch's
    v1 = (c2 * g) * g + v * b2
    den = v1.sqrt() / bc2s + eps
    p2 = p1 + (nss * m1) / den
    (p if p_out is None else p_out).copy_(p2)
    m.copy_(m1)
    v.copy_(v1)
    if copy_out is not None:
        copy_out.copy_(p2)
    return ok


def _sgd(p: torch.Tensor, g16: torch.Tensor, buf: torch.Tensor | None, grad_out: torch.Tensor | None,
         copy_out: torch.Tensor | None, s: torch.Tensor, decay: bool, nesterov: bool, maximize: bool,
         p_out: torch.Tensor | None = None, g2: torch.Tensor | None = None) -> torch.Tensor:
    """One SGD step (momentum when `buf` is given) of flat fp32 `p` from `g16`, in place (the new `p`
    into `p_out` instead when given), as torch's
    per-tensor step (`a.add(b, alpha=c)` is fma(b, c, a) there); `s` = `sgd_scalars`."""
    g, ok = _gradient(g16, grad_out, maximize, g2)
    wd, mom, damp1, neg_lr = s[0], s[1], s[2], s[3]
    if decay:
        g = g + p * wd
    if buf is not None:
        b1 = torch.where(buf == buf, buf * mom, buf) + g * damp1
        buf.copy_(b1)
        g = g + b1 * mom if nesterov else b1
    p2 = p + g * neg_lr
    (p if p_out is None else p_out).copy_(p2)
    if copy_out is not None:
        copy_out.copy_(p2)
    return ok


def adam_scalars(group: dict, step: float, kind: str) -> tuple[torch.Tensor, bool, bool]:
    """The fp32 scalars of `_adam` for `group` at `step` (already incremented), rounded from the
    doubles torch's fused kernel computes; and its flags (decay, small_w)."""
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    first = 1 - lr * wd if kind == "adamw" else wd
    w = 1 - beta1
    s = torch.tensor([first, w, beta2, 1 - beta2, math.sqrt(bc2), eps, -(lr / bc1)], dtype=torch.float32)
    return s, wd != 0, abs(float(torch.tensor(w, dtype=torch.float32))) < 0.5


def sgd_scalars(group: dict) -> torch.Tensor:
    lr, wd, mom, damp = (float(group[k]) for k in ("lr", "weight_decay", "momentum", "dampening"))
    return torch.tensor([wd, mom, 1 - damp, -lr], dtype=torch.float32)


# ------------------------------------------------------------------ building
# The compiled kernels, tried in this order (see the module docstring); "eager" (torch ops) after them.
BACKENDS: tuple[str, ...] = ("c++", "inductor")

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes the C++ kernel reads and writes


def reason_not_compiled() -> str | None:
    """Why no compiled kernel is used in this process (None: one is, or none was tried yet)."""
    if compiled():
        return None
    return "; ".join(f"{b}: {_broken.get(b, 'not enabled (host_optimizer.BACKENDS)')}" for b in ("c++", "inductor"))


def backend() -> str:
    """The kernel `step_span` uses: "c++" (host_kernel), "inductor" (torch.compile) or "eager" (torch
    ops, several passes): the first of `BACKENDS` not known to fail to build."""
    for b in BACKENDS:
        if b not in _broken:
            return b
    return "eager"


def reasons() -> dict[str, str]:
    """Why each backend that failed to build did (logged once each)."""
    return dict(_broken)


def compiled() -> bool:
    """Whether a compiled kernel may be used (False once every one in `BACKENDS` failed to build:
    each logged once)."""
    return backend() != "eager"


def _kernel(key: tuple) -> Callable[..., Any]:
    with _lock:
        k = _kernels.get(key)
        if k is None:
            fn = _adam if key[0] in ("adam", "adamw") else _sgd
            # a code object of its own per key: dynamo keeps its compiled graphs, and counts them against
            # its recompile limit (8), per code object; the keys (kinds, flags, dtypes, a tied master's
            # second download, p_out) would otherwise share one limit, and the 9th would fail to build
            fn = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                                    fn.__closure__)
            k = _kernels[key] = torch.compile(fn, dynamic=True, fullgraph=True, options=dict(OPTIONS))
        return k


_THEN = {"c++": "stepping with the torch.compile (inductor) kernel instead",
         "inductor": "the optimizer steps with torch's own kernels and the streamed copy is written by a separate "
                     "pass"}


def _failed(which: str, e: BaseException) -> None:
    with _lock:
        if which not in _broken:
            text = str(e).strip()
            _broken[which] = f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"
            nxt = next((b for b in BACKENDS[BACKENDS.index(which) + 1:] if b not in _broken), "eager") \
                if which in BACKENDS else "eager"
            then = _THEN["c++"] if nxt == "inductor" else _THEN["inductor"]
            log.warning("mobius_fx: the fused host optimizer pass could not be built with %s (%s); %s "
                        "(a C++ compiler is needed: install g++ or set CXX)",
                        "a C++ extension (torch.utils.cpp_extension)" if which == "c++" else "torch.compile",
                        _broken[which], then)


def _reset_for_tests() -> None:
    global _cpp
    with _lock:
        _broken.clear()
        _kernels.clear()
        _cpp = None


_TRUE, _FALSE = torch.tensor(True), torch.tensor(False)  # the C++ path's flags (read them; do not write them)
_cpp: Any = None  # the built extension (host_kernel.load()), once loaded


def _cpp_kernel() -> Any:
    global _cpp
    if _cpp is None:
        _cpp = host_kernel.load()
    return _cpp


def _unscaled(grad: torch.Tensor, grad_out: torch.Tensor | None,
              inv: float, grad2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`step_span`'s `grad_scale` for the kernels after the C++ one, in a pass of its own: the widened
    gradient (plus `grad2` in fp32) into `grad_out` (then None), and times `inv` in fp32 as torch's
    unscale_ kernel (a new tensor: `grad` is left as it is)."""
    wide = grad.to(torch.float32, copy=True)
    if grad2 is not None:
        wide.add_(grad2)  # fp32 + widened grad2, one rounding: sum_downloads' bits
    if grad_out is not None:
        grad_out.copy_(wide)
    return wide.mul_(torch.tensor(inv, dtype=torch.float32)), None


def _cpp_step(kind: str, group: dict, p: torch.Tensor, grad: torch.Tensor, state: dict, step: float | None,
              grad_out: torch.Tensor | None, copy_out: torch.Tensor | None, p_out: torch.Tensor | None,
              state_out: dict | None, grad_scale: float | None, grad2: torch.Tensor | None) -> torch.Tensor | None:
    """`step_span` by the C++ kernel: its finite flag, or None where it cannot be built (logged once)
    or does not take a tensor (checked before any write): the next backend steps the span then."""
    adam = kind == "adamw" or kind == "adam"
    try:
        k = _cpp or _cpp_kernel()
    except Exception as e:  # noqa: BLE001 - no C++ compiler, a build error: the next backend
        _failed("c++", e)
        return None
    try:
        if adam:
            b1, b2 = group["betas"]
            ok = k.adam(p, grad, state["exp_avg"], state["exp_avg_sq"], grad_out, copy_out, p_out,
                        float(group["lr"]), float(b1), float(b2), float(group["weight_decay"]),
                        float(group["eps"]), float(step), kind == "adamw", bool(group.get("maximize")),
                        None if state_out is None else state_out["exp_avg"],
                        None if state_out is None else state_out["exp_avg_sq"],
                        1.0 if grad_scale is None else float(grad_scale), grad2)
        else:
            mom = float(group["momentum"])
            ok = k.sgd(p, grad, state.get("momentum_buffer") if mom != 0 else None, grad_out, copy_out,
                       p_out, float(group["lr"]), float(group["weight_decay"]), mom,
                       float(group["dampening"]), bool(group.get("nesterov")), bool(group.get("maximize")),
                       None if state_out is None or mom == 0 else state_out["momentum_buffer"],
                       1.0 if grad_scale is None else float(grad_scale), grad2)
    except RuntimeError:  # a tensor it does not take (not contiguous, not on the CPU; checked before any
        return None  # write): the next backend steps this span
    return _TRUE if ok else _FALSE


def step_span(kind: str, group: dict, p: torch.Tensor, grad: torch.Tensor, state: dict, step: float | None = None,
              grad_out: torch.Tensor | None = None, copy_out: torch.Tensor | None = None,
              compiled: bool = True, p_out: torch.Tensor | None = None,
              state_out: dict | None = None, grad_scale: float | None = None,
              grad2: torch.Tensor | None = None) -> torch.Tensor:
    """Step elements of one parameter in one pass: `p` (fp32), `grad` (its gradient, any float
    dtype), the state tensors in `state` (torch's names; views of the same elements) and the
    outputs `grad_out` (fp32 `.grad`) and `copy_out` (the streamed copy) are flat and contiguous.
    `step`: Adam's step count after this step (the caller increments `state["step"]` once per
    parameter, not per span). Returns the finite flag of `grad` (a 0-d bool tensor: read it, do
    not write it). `compiled`: the compiled kernel (`backend()`: built on first use; where one
    cannot be built, logged once, the next in `BACKENDS`, then eager ops), else the formula in
    eager torch ops. `p_out` (fp32, flat, as `p`, not overlapping it): the new parameter is written
    there and `p` is left unchanged (the same bytes: `p` read, `p_out` written), e.g. a shadow copy
    stepped while `p` is in use. `state_out` (the state tensors' names to flat fp32 tensors as
    `p`): the new state is written there and `state`'s tensors are left unchanged (with `p_out`:
    a step out of place, for a speculative step that may be dropped; the C++ kernel reads the old
    and writes the new in the same pass, the others copy the state there first). `grad_scale` (an
    fp32 value: a GradScaler's inverse scale): the step reads the widened gradient times it, rounded
    once in fp32, as torch's `_amp_foreach_non_finite_check_and_unscale_` leaves `.grad` (the finite
    flag is the product's); `grad_out` still gets the widened gradient itself (the `.grad` the
    scaler then unscales). The C++ kernel multiplies in its loop; the others first, in a pass of
    their own. `grad2` (flat, as `grad`, of its dtype): a tied master's second download (two stages
    hold it); the gradient is then `grad` widened plus `grad2` added in fp32, rounded once -- the
    bits of `host_gradients.sum_downloads` -- read in the same pass: `grad_out` gets that sum, and
    `grad_scale` multiplies the sum (as unscale_ does the summed `.grad`). Three or more downloads
    are not taken here (the caller sums them: `sum_downloads`)."""
    adam = kind == "adamw" or kind == "adam"
    # The C++ kernel first, with as little Python as possible around it: between two large spans the
    # interpreter runs with cold caches (~50 us for one small tensor's allocation, measured), while
    # torch's fused step crosses no Python between its tensors.
    if (compiled and "c++" not in _broken and "c++" in BACKENDS and grad.dtype in _FLOATS
            and (copy_out is None or copy_out.dtype in _FLOATS) and (grad2 is None or grad2.dtype == grad.dtype)):
        flag = _cpp_step(kind, group, p, grad, state, step, grad_out, copy_out, p_out, state_out, grad_scale, grad2)
        if flag is not None:
            return flag
    with torch.no_grad():
        if grad_scale is not None and float(grad_scale) != 1.0:
            grad, grad_out = _unscaled(grad, grad_out, float(grad_scale), grad2)
            grad2 = None
        if state_out is not None:  # out of place: the old state copied into the new, stepped there
            for k_, t in state_out.items():
                t.copy_(state[k_])
            state = {**state, **state_out}
        buf = None if adam or float(group["momentum"]) == 0 else state.get("momentum_buffer")
        if adam:
            s, decay, small_w = adam_scalars(group, float(step), kind)
            args = (p, grad, state["exp_avg"], state["exp_avg_sq"], grad_out, copy_out, s)
            flags = (kind == "adamw", decay, bool(group.get("maximize")), small_w)
            fn: Callable[..., Any] = _adam
        else:
            s = sgd_scalars(group)
            args = (p, grad, buf, grad_out, copy_out, s)
            flags = (float(group["weight_decay"]) != 0, bool(group.get("nesterov")), bool(group.get("maximize")))
            fn = _sgd
        out = {} if p_out is None else {"p_out": p_out}
        if grad2 is not None:
            out["g2"] = grad2
        if compiled and "inductor" in BACKENDS and "inductor" not in _broken:
            key = (kind, flags, grad.dtype, None if copy_out is None else copy_out.dtype, grad_out is not None,
                   buf is None if kind == "sgd" else None, p_out is None, None if grad2 is None else grad2.dtype)
            try:
                return _kernel(key)(*args, *flags, **out)
            except Exception as e:  # noqa: BLE001 - no C++ compiler, an inductor error: torch's path
                _failed("inductor", e)
        return fn(*args, *flags, **out)


def sum_two(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """A tied master's two downloads summed into `out` (its fp32 `.grad` home) in ONE pass: read
    `a` and `b`, write `out` = `a` widened + `b` in fp32 (one rounding: `host_gradients.sum_downloads`'
    bits, which copies then adds: read a, write out, read b, read and write out). The C++ kernel
    (`host_kernel`'s `sum2`); False (nothing written) where it is not built or does not take the
    tensors (flat views of one size, one 16-bit or fp32 dtype, contiguous, on the CPU): the caller
    sums with `sum_downloads` then."""
    if "c++" in _broken or "c++" not in BACKENDS or a.dtype != b.dtype or a.dtype not in _FLOATS \
            or out.dtype != torch.float32:
        return False
    try:
        k = _cpp or _cpp_kernel()
    except Exception as e:  # noqa: BLE001 - no C++ compiler, a build error: logged once, the caller's sum
        _failed("c++", e)
        return False
    try:
        k.sum2(out.view(-1), a.reshape(-1), b.reshape(-1))
    except RuntimeError:  # checked before any write
        return False
    return True


# ------------------------------------------------------------------ the derived bounds (see the module docstring)
def adam_bound(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, p_new: torch.Tensor,
               m_new: torch.Tensor, v_new: torch.Tensor, group: dict, step: float) -> dict[str, torch.Tensor]:
    """Elementwise bounds on the difference of two implementations of one Adam(W) step from the
    same state (p, g, m, v: before, fp32; *_new: one implementation's result)."""
    p, g, m, v = (t.double() for t in (p, g.float(), m, v))
    p_new, m_new, v_new = (t.double() for t in (p_new, m_new, v_new))
    lr, eps = float(group["lr"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    s = -lr / (1 - beta1 ** step)
    d = v_new.sqrt() / math.sqrt(1 - beta2 ** step) + eps
    upd = s * m_new / d
    mg = m.abs() + g.abs()
    return {"m": 4 * U * mg, "v": 8 * U * v_new,
            "p": 2 * U * (p.abs() + p_new.abs()) + 8 * U * (upd.abs() + abs(s) * mg / d)}


def sgd_bound(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None, p_new: torch.Tensor,
              buf_new: torch.Tensor | None, group: dict) -> dict[str, torch.Tensor]:
    """Elementwise bounds on the difference of two implementations of one SGD step from the same
    state: each rounds the decayed gradient, the momentum (buf*mom, + d(1-damp)), the nesterov
    term and p + (-lr) d at most twice per operation; terms may cancel, so every bound is in
    the sum of the magnitudes that enter."""
    lr, wd, mom, damp = (float(group[k]) for k in ("lr", "weight_decay", "momentum", "dampening"))
    p, g = p.double(), g.float().double()
    d = g.abs() + abs(wd) * p.abs()  # |g + wd p| <= d (before rounding)
    out: dict[str, torch.Tensor] = {}
    if buf is not None:
        b = buf.double().abs() * abs(mom) + d * abs(1 - damp)  # >= |buf'|
        out["momentum_buffer"] = 4 * U * b + 4 * U * d * abs(1 - damp)
        e_buf = out["momentum_buffer"]
        dd = d + abs(mom) * b if group.get("nesterov") else b
        e_d = (4 * U * d + e_buf * abs(mom) + 4 * U * dd) if group.get("nesterov") else e_buf
    else:
        dd, e_d = d, 4 * U * d
    out["p"] = 2 * U * (p.abs() + p_new.double().abs()) + abs(lr) * (e_d + 4 * U * dd)
    return out
