"""The async overlap (`AsyncUpdate`, a part of `OverlapOptimizer`): RoundPipe's staleness-1 update,
computed into shadow copies of the weights on the optimizer's worker while the next step runs on
the old ones, swapped in at the next `opt.step()` or when the model is read (hooks on the model).
See mobius_fx/runtime/overlap.py."""

from __future__ import annotations

import torch
from torch import nn

from mobius_fx.runtime.overlap_watch import WeakHook

__all__ = ["AsyncUpdate"]


class AsyncUpdate:
    """`OverlapOptimizer`'s methods of mode="async"."""

    def _hook_model(self) -> None:
        """async: the model's state_dict() and load_state_dict() (of any of its modules) and an eager call
        of the model first finish the update in flight, so `{"model": m.state_dict(), "opt":
        opt.state_dict()}` is one step, and a loaded checkpoint is not overwritten by it."""
        model = self._pipeline.model
        reading = WeakHook(self, "_reading")
        self._handles += [m.register_state_dict_pre_hook(reading) for m in model.modules()]
        self._handles += [m.register_load_state_dict_pre_hook(reading) for m in model.modules()]
        self._handles.append(model.register_forward_pre_hook(reading))
        # a gradient arriving for a parameter whose .grad the update in flight reads: unshare it first
        self._handles += [p.register_hook(WeakHook(self, "_arriving", p)) for p in self._params()
                          if p.requires_grad]

    def _reading(self, *_: object) -> None:
        """A (load_)state_dict and forward pre-hook on the model (async): its weights are read or
        replaced, so the update in flight lands first. Not while torch.export traces the model (a
        variant compiled for a new call): it runs on fake tensors then, and a weight swap there
        would change the trajectory the user chose (staleness 1) for no read of theirs."""
        if not torch.compiler.is_compiling():
            self.synchronize()

    def _arriving(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """A tensor hook on each parameter (async): runs as its gradient arrives, before autograd
        accumulates it into `.grad`; a loop that zeroed `.grad` (set_to_none) pays nothing."""
        q = self._shadows.get(id(p))
        if q is not None and p.grad is not None and p.grad is q.grad:
            p.grad = p.grad.clone()

    def unshare_grads(self, zero: bool = False) -> None:
        """async: after `step()` a parameter's `.grad` is the gradient that step uses, as in eager
        (the update in flight reads the very tensor). Before anything writes into it -- the next
        backward accumulating (a loop without zero_grad, as eager accumulates), zero_grad(
        set_to_none=False) -- the parameter gets a copy (zeros, for `zero`) of its own
        (`_arriving` does it for backward, only when a gradient arrives)."""
        for p in self._flight_params:
            q = self._shadows.get(id(p))
            if q is not None and p.grad is not None and p.grad is q.grad:
                p.grad = torch.zeros_like(p.grad) if zero else p.grad.clone()

    def _step_async(self) -> None:
        self._finish_flight()
        params = [p for p in self._params() if p.grad is not None]
        if not params:
            return
        shadows = []
        for p in params:
            q = self._shadows.get(id(p))
            if q is None or q.shape != p.shape or q.dtype != p.dtype:
                q = self._shadows[id(p)] = nn.Parameter(torch.empty_like(p, memory_format=torch.preserve_format),
                                                        requires_grad=p.requires_grad)
            q.grad = p.grad  # p.grad shows it too, as eager's does after step (unshare_grads before a write)
            shadows.append(q)
        ids = {id(p) for p in params}
        groups = [{**g, "params": [self._shadows[id(p)] for p in g["params"] if id(p) in ids]}
                  for g in self.param_groups]
        state = self.inner.state
        for p, q in zip(params, shadows):
            if p in state:
                state[q] = state.pop(p)

        def update() -> None:
            with torch.no_grad():
                for p, q in zip(params, shadows):
                    q.copy_(p)  # w(t); the model keeps running on p meanwhile
            self._step_only(shadows, groups)

        self._flight_params = params
        self._flight = self._submit(self._stepper, update)

    def _finish_flight(self) -> None:
        """Wait for the async update in flight and make it the model's weights."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        flight.result()
        params, self._flight_params = self._flight_params, []
        state = self.inner.state
        for p in params:
            q = self._shadows[id(p)]
            if q in state:
                state[p] = state.pop(q)
            q.grad = None
        self._raise()
        with torch.no_grad():
            for p in params:
                q = self._shadows[id(p)]
                p.data, q.data = q.data, p.data  # a pointer swap: the model now holds w(t+1)
