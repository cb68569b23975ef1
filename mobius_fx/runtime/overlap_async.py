"""The async overlap (`AsyncUpdate`, a part of `OverlapOptimizer`): RoundPipe's staleness-1 update,
computed into shadow copies of the weights on the optimizer's worker while the next step runs on
the old ones, swapped in at the next `opt.step()` or when the model is read (hooks on the model).
See mobius_fx/runtime/overlap.py."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mobius_fx.runtime import host_optimizer, overlap_fused
from mobius_fx.runtime.device_books import nbytes
from mobius_fx.runtime.host_counters import COUNTERS
from mobius_fx.runtime.host_gradients import sum_downloads
from mobius_fx.runtime.overlap_fused import ALIGN
from mobius_fx.runtime.overlap_watch import WeakHook, accumulator, engine_accumulates

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

    def _reading(self, *_: Any) -> None:
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

    # ------------------------------------------------------------------ the gradients the update reads
    def take(self, master: torch.Tensor, thunks: list) -> bool:
        """The runtime's end of backward (`StageCalls._gradients`), per master, before it would
        hand autograd the master's gradient: async takes it instead where autograd would only put
        it in an empty `.grad` -- a parameter of this optimizer whose `.grad` is None, that this
        backward accumulates into, with no gradient hook of the user's. With `keep_grads` (the
        default) it is converted into `.grad` as autograd would, into storage kept across steps
        (`GradHomes`, two per master: the update in flight reads the other); without, the
        downloads (the streamed dtype, bf16) are held as they are and the update reads them
        (`_step_async`): no `.grad` then, no conversion pass. Returns whether it took it."""
        if self.mode != "async" or not self.fuse or self._error is not None or torch.is_grad_enabled():
            return False
        homes = self._pipeline._rt.grad_homes
        mine = self._mine
        if homes is None or mine is None or mine.get(id(master)) is not master or master.grad is not None \
                or id(master) in self._outside or _user_grad_hooks(master) or master.is_sparse:
            return False
        node = self._nodes.get(id(master))
        if node is None:
            node = self._nodes[id(master)] = accumulator(master)
        if not engine_accumulates(node):
            return False
        downloads = [g for g in (t() for t in thunks) if g is not None]
        if not downloads or any(g.shape != master.shape or g.is_sparse for g in downloads):
            return False
        self._stream_size[id(master)] = downloads[0].element_size()
        if self.keep_grads or downloads[0].dtype == master.dtype:
            grad = sum_downloads(master, downloads, homes)
            if grad is None:
                return False
            master.grad = grad
            return True
        self._held[id(master)] = (master, downloads)
        return True

    def _materialize(self, zero: bool = False) -> None:
        """The held downloads (`take`) into `.grad`, where autograd would have put them: before
        a second backward accumulates onto them, or zero_grad(set_to_none=False) zeroes them."""
        held, self._held = self._held, {}
        homes = self._pipeline._rt.grad_homes
        with torch.no_grad():
            for p, downloads in held.values():
                total = sum_downloads(p, downloads, homes)
                if total is not None:
                    p.grad = total if p.grad is None else p.grad + total

    def drop_held(self) -> None:
        """zero_grad(set_to_none=True) between backward and step: the held gradients go, as `.grad` would."""
        self._held = {}

    # ------------------------------------------------------------------ the update
    def _async_passable(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> str | None:
        """The host pass's kind for stepping `p` into its shadow from `grad` (the held download,
        or `.grad`), or None (torch's own step, with the shadow copied first)."""
        if not (overlap_fused.HOST_PASS and getattr(self, "host_pass", True) and host_optimizer.compiled()):
            return None
        kind = host_optimizer.kind_of(self.inner, group)
        if kind is None or p.dtype != torch.float32 or not p.is_contiguous() or p.is_sparse:
            return None
        if grad.is_sparse or not grad.is_contiguous() or grad.shape != p.shape or not grad.is_floating_point() \
                or grad.device != p.device:
            return None
        state = self.inner.state.get(p) or {}
        names = (("exp_avg", "exp_avg_sq") if kind != "sgd"
                 else (("momentum_buffer",) if float(group.get("momentum", 0)) != 0 else ()))
        if kind != "sgd" and not isinstance(state.get("step"), torch.Tensor):
            return None  # the first step makes the state: torch's
        tensors = [p, grad] + [state.get(k) for k in names]
        if any(t is None or t.dtype not in (torch.float32, grad.dtype) or t.shape != p.shape
               or not t.is_contiguous() or t.data_ptr() % ALIGN for t in tensors):
            return None
        return kind

    def _step_async(self) -> None:
        """Launch the staleness-1 update of the gradients this step leaves: w(t+1) into each
        parameter's shadow, on the optimizer's worker, while the next step runs on w(t). Where
        the host pass steps a parameter (`_async_passable`: torch's Adam, AdamW, SGD, their state
        made) it does so in ONE pass: it reads w(t), the gradient (the held bf16 download, or the
        fp32 `.grad` with `keep_grads`) and the state, writes w(t+1) into the shadow (out of
        place: the model keeps w(t) until the swap), the state in place and the second streamed
        copy (`StreamDevice.next_copy`) that the uploads after the swap read. The others: w(t)
        copied into the shadow, then the optimizer's own step over it."""
        self._finish_flight()
        held, self._held = self._held, {}
        homes = self._pipeline._rt.grad_homes
        for pid, (p, downloads) in list(held.items()):
            if p.grad is not None:  # a gradient from outside the pipeline came after `take`: summed, as autograd would
                self._outside.add(pid)
                with torch.no_grad():
                    p.grad = p.grad + sum_downloads(p, downloads, None)
                del held[pid]
        params = [p for p in self._params() if p.grad is not None or id(p) in held]
        if not params:
            return
        where = {id(q): i for i, g in enumerate(self.param_groups) for q in g["params"]}
        hp = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]  # this step's hyper-parameters
        passed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, str, dict]] = []
        copied: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in params:
            q = self._shadows.get(id(p))
            if q is None or q.shape != p.shape or q.dtype != p.dtype:
                q = self._shadows[id(p)] = nn.Parameter(torch.empty_like(p, memory_format=torch.preserve_format),
                                                        requires_grad=p.requires_grad)
            grad = p.grad
            if id(p) in held:
                downloads = held[id(p)][1]
                grad = downloads[0] if len(downloads) == 1 else sum_downloads(p, downloads, homes)
            group = hp[where[id(p)]]
            # the pass where the gradient came in a narrower dtype than the master's (bf16 streamed), as
            # sync's: it saves the conversion there; an fp32 pipeline keeps torch's step, its bits and all
            narrow = self._stream_size.get(id(p), p.element_size()) < p.element_size()
            kind = (self._async_passable(p, grad, group)
                    if narrow and q.is_contiguous() and q.data_ptr() % ALIGN == 0 else None)
            if kind is None and p.grad is None:  # torch's step reads .grad: the held download converted into it
                p.grad = grad if grad.dtype == p.dtype else sum_downloads(p, held[id(p)][1], homes)
            q.grad = p.grad  # p.grad shows it too, as eager's does after step (unshare_grads before a write)
            if kind is not None:
                passed.append((p, q, grad, kind, group))
            else:
                copied.append((p, q))
        state = self.inner.state
        for p in params:
            q = self._shadows[id(p)]
            if p in state:
                state[q] = state.pop(p)
        ids = {id(p) for p in params}
        groups = [{**g, "params": [self._shadows[id(p)] for p in g["params"] if id(p) in ids]}
                  for g in self.param_groups]
        devices = list(self._pipeline._rt.devices.values()) if self._write_copies else []
        written: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        sizes = dict(self._stream_size)

        def update() -> None:
            self._update_shadows(passed, copied, groups, devices, written, sizes)

        self._flight_params = params
        self._flight_copies = written
        self._flight = self._submit(self._stepper, update)

    def _update_shadows(self, passed: list, copied: list, groups: list[dict], devices: list, written: list,
                        sizes: dict[int, int]) -> None:
        """The update `_step_async` launched, on the optimizer's worker: the host pass over each
        parameter of `passed` (w(t) read, w(t+1) into its shadow, the streamed copy into the
        first device's second copy, noted in `written`), then w(t) copied into the shadows of
        `copied` and the optimizer's own step over them with the hyper-parameters of `groups`."""
        state = self.inner.state
        with torch.no_grad():
            for p, q, grad, kind, group in passed:
                st = state[q] if q in state else {}
                step = None
                if kind != "sgd":
                    st["step"] += 1  # once per parameter, as torch's step
                    step = float(st["step"])
                copy = None
                for dev in devices:
                    nxt = getattr(dev, "next_copy", None)
                    buf = nxt(p) if nxt is not None else None
                    if buf is not None and buf.is_contiguous() and buf.data_ptr() % ALIGN == 0:
                        copy = buf
                        written.append((dev, p, buf))
                        break
                flat = {k: (v.view(-1) if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in st.items()}
                host_optimizer.step_span(kind, group, p.detach().view(-1), grad.reshape(-1), flat, step=step,
                                         copy_out=None if copy is None else copy.view(-1), p_out=q.detach().view(-1))
                wide = grad.element_size() - sizes.get(id(p), grad.element_size())
                if wide > 0:  # the fp32 .grad read instead of the streamed-dtype download
                    COUNTERS.add("grad_read", wide * grad.numel())
            for p, q in copied:
                q.copy_(p)  # w(t); the model keeps running on p meanwhile
                COUNTERS.add("shadow", 2 * nbytes(q))
        if copied:
            self._step_only([q for _, q in copied], groups)

    def _finish_flight(self) -> None:
        """Wait for the async update in flight and make it the model's weights."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        flight.result()
        params, self._flight_params = self._flight_params, []
        copies, self._flight_copies = self._flight_copies, []
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
        for dev, p, buf in copies:  # ... and the streamed copy the pass wrote is the one uploads read
            dev.swap_copy(p, buf)


def _user_grad_hooks(p: torch.Tensor) -> bool:
    """Whether `p` has a gradient hook other than async's own (`_arriving`): autograd must run it."""
    hooks = getattr(p, "_backward_hooks", None) or {}
    if any(not (isinstance(h, WeakHook) and h._method == "_arriving") for h in hooks.values()):
        return True
    return bool(getattr(p, "_post_accumulate_grad_hooks", None))
