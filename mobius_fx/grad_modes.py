"""Grad-mode regions inside a model's forward, as the front ends must see them.

`with torch.no_grad(): h = self.a(t)` (or `torch.set_grad_enabled(False)`, a `@torch.no_grad()`
method, `torch.inference_mode()`) makes eager PyTorch compute `h` without a graph: `self.a`
gets no gradient. The two front ends differ here:

- `torch.fx.symbolic_trace` runs the context manager once, at trace time, and records nothing:
  its graph would differentiate through the region (`self.a` trained, other gradients wrong).
  `recording()` tells the tracer that forward changed the grad mode, so `trace` refuses the
  symbolic trace and lets torch.export capture the model.
- `torch.export` records `_set_grad_enabled` (as `wrap_with_set_grad_enabled` regions), so its
  graph computes as eager does -- except `torch.inference_mode()`, which it ignores. Inside
  `recording()` an inference-mode region is traced as a no-grad region: for every forward that
  eager accepts the gradients are eager's (inference mode differs from no_grad only in the
  tensors it makes, which eager refuses to save for backward, and in speed).

    with recording() as changes:
        gm = fx.symbolic_trace(model)
    changes  # ['torch.no_grad() / torch.set_grad_enabled(False)'] when forward has such a region
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.autograd.grad_mode import inference_mode

__all__ = ["recording"]

_NO_GRAD = "torch.no_grad() / torch.set_grad_enabled(False)"
_ENABLE = "torch.enable_grad() / torch.set_grad_enabled(True)"
_INFERENCE = "torch.inference_mode()"


@contextlib.contextmanager
def recording(*, set_grad: bool = True):
    """Meanwhile, every grad-mode change a forward makes is appended to the yielded list (one
    description per construct kind), and `torch.inference_mode()` regions act as no_grad ones.
    The grad mode in force when it began is in force again when it ends. `set_grad=False`
    (around torch.export, whose tracer tests `func is torch._C._set_grad_enabled`, so that it
    must stay torch's own): only inference-mode regions are noted and turned into no_grad.
    Only the calling thread's changes count: the patched functions are process-wide, and other
    threads (an optimizer step of `pipe.overlap(mode="async")` in flight while a new call's
    variant is traced) pass straight through to torch's own."""
    changes: list[str] = []
    tracer = threading.get_ident()
    patch_set_grad, set_grad = set_grad, torch._C._set_grad_enabled
    enter, exit_ = inference_mode.__enter__, inference_mode.__exit__
    was = torch.is_grad_enabled()

    def note(what: str) -> None:
        if what not in changes:
            changes.append(what)

    def set_grad_enabled(mode: bool) -> None:
        if threading.get_ident() != tracer:
            return set_grad(mode)
        note(_ENABLE if mode else _NO_GRAD)
        set_grad(mode)

    def inference_enter(self: Any) -> None:
        if not self.mode or threading.get_ident() != tracer:  # inference_mode(False): no change to the gradients
            return enter(self)
        note(_INFERENCE)
        self._mobius_prev = torch.is_grad_enabled()
        set_grad(False)  # torch.export records this one
        return None

    def inference_exit(self: Any, *exc: Any) -> None:
        if not self.mode or "_mobius_prev" not in self.__dict__:  # entered as torch's own (another thread)
            return exit_(self, *exc)
        set_grad(self.__dict__.pop("_mobius_prev"))
        return None

    if patch_set_grad:
        torch._C._set_grad_enabled = set_grad_enabled
    inference_mode.__enter__, inference_mode.__exit__ = inference_enter, inference_exit
    try:
        yield changes
    finally:
        torch._C._set_grad_enabled = set_grad
        inference_mode.__enter__, inference_mode.__exit__ = enter, exit_
        set_grad(was)
