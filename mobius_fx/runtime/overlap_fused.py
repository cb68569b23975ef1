"""The sync overlap's fused hand-over and step (`FusedStep`, a part of `OverlapOptimizer`).

A stage's parameters whose optimizer the host pass knows (torch's Adam, AdamW, SGD:
`host_optimizer.kind_of`) are stepped by it, one parameter per call, in ONE pass over host
memory: it reads the downloaded half-precision gradient, updates the fp32 master and torch's
own state, and writes the fp32 `.grad` (its home, kept across steps) and the streamed copy the
next upload reads (`StreamDevice._pinned`), so no refresh pass follows for them
(`_host_pass`; `HOST_PASS = False` or `MOBIUS_FX_HOST_PASS=0` turns it off; where it cannot be
built, the log says so once and the path below runs).

The others: the downloaded gradients converted into `.grad` span by span, each span right
before the wrapped optimizer's own step runs over views of that span of the parameter, gradient
and state (Adam, AdamW and SGD, whose updates are elementwise). See mobius_fx/runtime/overlap.py."""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import torch

from mobius_fx.runtime.device_books import nbytes
from mobius_fx.runtime.host_counters import COUNTERS
from mobius_fx.runtime import host_optimizer
from mobius_fx.runtime.host_gradients import convert_span
from mobius_fx.runtime.overlap_watch import raw_step, stepped_masters

__all__ = ["FusedStep", "UNIT", "SPAN_UNITS", "SPAN", "HOST_PASS"]

# Whether sync's stage step uses the fused host pass (`host_optimizer`) where it can.
HOST_PASS = os.environ.get("MOBIUS_FX_HOST_PASS", "1") != "0"
ALIGN = 64  # bytes: every tensor the compiled pass reads or writes starts at this alignment


# The optimizers whose step `_step_fused` runs span by span: each element is updated from its own
# gradient and state, and from per-parameter scalars (Adam's `step`) the same for every span.
# Exact classes (a subclass may change the update); the kind says when a parameter's state is made.
_CHUNKED = {torch.optim.Adam: "adam", torch.optim.AdamW: "adam", torch.optim.SGD: "sgd"}

# Spans of `_step_fused`. torch's fused CPU optimizers (`fused=True`) step a tensor in units of
# UNIT elements, one thread per unit, vectorised with a scalar tail only at the tensor's end (whose
# bits differ from the vector path's): spans of whole units split it the same way. Its other
# implementations are TensorIterator loops whose elements get the same bits wherever they fall.
# A span gives each of the worker's threads SPAN_UNITS units: for each thread the fp32 parameter,
# gradient and moments of its share (1 MiB) and the half-precision download stay in its core's
# cache between the conversion and the step, and every thread works, as on a whole tensor.
UNIT = 32768
SPAN_UNITS = 2
SPAN: int | None = None  # elements per span; None: UNIT * SPAN_UNITS * the worker's threads


def _span() -> int:
    return SPAN if SPAN is not None else UNIT * SPAN_UNITS * max(1, torch.get_num_threads())


def _raw_step(cls: type) -> Callable[[Any], Any] | None:
    """`cls.step` without torch's wrappers (the step hooks, the grad-mode switch): `_step_fused`
    runs no step hook (opt.step() runs them once) and calls this once per span, under no_grad."""
    step = getattr(cls, "step", None) if cls in _CHUNKED else None
    if step is None or not getattr(step, "hooked", False):
        return None
    raw = inspect.unwrap(step)
    return raw if raw is not step else None


class FusedStep:
    """`OverlapOptimizer`'s span-by-span step of a stage (`_step_fused`, called by `ready`)."""

    def _fusable(self, p: torch.Tensor, gs: list[torch.Tensor], group: dict, homes: Any) -> bool:
        """Whether `p` can be handed over and stepped span by span (`_step_fused`): its downloads
        need a conversion into a fresh `.grad` (a gradient home), the optimizer is one whose
        update is elementwise and whose state for `p` is made (`_CHUNKED`), and every tensor is
        contiguous, so a span of each is the same elements."""
        if homes is None or p.grad is not None or not gs or gs[0].dtype == p.dtype or p.is_sparse:
            return False
        if not p.is_contiguous() or any(not g.is_contiguous() or g.shape != p.shape or g.device != p.device
                                        for g in gs):
            return False
        kind = _CHUNKED.get(type(self.inner))
        if kind is None or group.get("differentiable") or group.get("capturable"):
            return False
        if group.get("fused") and _span() % UNIT:
            return False  # spans of part units would split the fused kernel's work differently
        state = self.inner.state.get(p)
        if kind == "adam" and not state:
            return False  # made by its first step: whole
        if kind == "sgd" and group.get("momentum", 0) != 0 and (state or {}).get("momentum_buffer") is None:
            return False
        for v in (state or {}).values():
            if not isinstance(v, torch.Tensor):
                return False
            if not (v.dim() == 0 or (v.shape == p.shape and v.is_contiguous() and v.device == p.device)):
                return False
        return True

    def _step_fused(self, downloads: list[tuple[torch.Tensor, list[torch.Tensor]]], hp: list[dict],
                    homes: Any) -> None:
        """Hand over and step a stage's parameters in one pass (`ready`, finiteness known from the
        GPUs): for the parameters `_fusable` allows, span by span (`_span()` elements), the
        downloaded gradient is converted into the span of `.grad` (its home, kept across steps)
        and the wrapped optimizer's own step (`_raw_step`) runs at once over views of that span
        of the parameter, its gradient and its state, while the span is in cache. The optimizers
        in `_CHUNKED` update every element from its own gradient and state and the per-parameter
        scalars (`step`), so the spans give the bits of one whole step (tests/unit/test_host_path.py
        checks it against serial stepping). Each span steps its own copy of the scalar state,
        written back once. The others (first step, a `.grad` the loop kept, another optimizer)
        are handed over and stepped whole, as `_step_only` does. No step hook runs here:
        opt.step() runs them once for the whole update."""
        where = {id(q): i for i, g in enumerate(hp) for q in g["params"]}
        fused, whole, passed = [], [], []
        for p, gs in downloads:
            if id(p) in where and self._fusable(p, gs, hp[where[id(p)]], homes):
                kind = self._passable(p, gs, hp[where[id(p)]], homes)
                if kind is not None:
                    passed.append((p, gs, kind))
                else:
                    fused.append((p, gs))
            else:
                whole.append((p, gs))
        if passed and _raw_step(type(self.inner)) is None:
            fused += [(p, gs) for p, gs, _ in passed]
            passed = []
        self._hand(whole, homes)
        params = [p for p, _ in downloads]
        want = {id(p) for p in params}
        sub = self._sub([{**g, "params": [p for p in g["params"] if id(p) in want]} for g in hp])
        raw = _raw_step(type(self.inner))
        if not (fused or passed) or raw is None:
            self._hand(fused, homes)
            raw_step(type(self.inner))(sub)  # no step hooks: opt.step() runs them once (`_pre_hooks`)
            stepped_masters(sub)
            return
        rest = {id(p) for p, _ in whole}
        written: list[tuple[torch.Tensor, list]] = []

        def body(opt: torch.optim.Optimizer, *_: Any, **__: Any) -> None:
            with torch.no_grad():
                if rest:
                    raw(self._sub([{**g, "params": [p for p in g["params"] if id(p) in rest]} for g in hp]))
                if fused:
                    self._chunks(fused, hp, where, homes, raw)
                if passed:
                    written.extend(self._host_pass(passed, hp, where, homes))

        body(sub)  # no step hooks: opt.step() runs them once (`_pre_hooks`)
        stepped_masters(sub)  # the version bump the global post-hook would give
        for p, entry in written:  # after that bump: the copy the pass wrote is current
            entry[4] = (p.data_ptr(), p._version)

    def _chunks(self, fused: list[tuple[torch.Tensor, list[torch.Tensor]]], hp: list[dict], where: dict[int, int],
                homes: Any, raw: Callable[[Any], Any]) -> None:
        """`_step_fused`'s spans: batches of at most `_span()` elements (one span of a large
        parameter, or several small parameters), each converted then stepped."""
        state = self.inner.state
        chunk = _span()
        spans: list[tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, int, int]] = []
        for p, gs in fused:
            home = homes.take(p)
            p.grad = home
            n = p.numel()
            spans += [(p, gs, home, a, min(n, a + chunk)) for a in range(0, n, chunk)]
            COUNTERS.add("grad_fused", sum(nbytes(g) for g in gs) + nbytes(home) * (2 * len(gs) - 1))
        scalars: dict[int, dict] = {}
        i = 0
        while i < len(spans):
            j, size = i, 0
            while j < len(spans) and (j == i or size + spans[j][4] - spans[j][3] <= chunk):
                size += spans[j][4] - spans[j][3]
                j += 1
            sub = self._sub([])
            groups: dict[int, list[torch.Tensor]] = {}
            for p, gs, home, a, b in spans[i:j]:
                convert_span(home, gs, a, b)
                q = p.detach().view(-1)[a:b]
                q.grad = home.view(-1)[a:b]
                own = {k: (v.view(-1)[a:b] if v.dim() else v.clone()) for k, v in state.get(p, {}).items()}
                sub.state[q] = own
                scalars[id(p)] = (p, own)
                groups.setdefault(where[id(p)], []).append(q)
            sub.param_groups = [{**hp[g], "params": qs} for g, qs in sorted(groups.items())]
            raw(sub)
            sub.state.clear()  # no view of a gradient home outlives its span (a home held is not reused)
            sub.param_groups = []
            del sub, groups
            i = j
        for p, own in scalars.values():  # every span stepped the same scalars: the last one's are theirs
            for k, v in own.items():
                if v.dim() == 0:
                    state[p][k].copy_(v)

    # ------------------------------------------------------------------ the fused host pass
    def _passable(self, p: torch.Tensor, gs: list[torch.Tensor], group: dict, homes: Any) -> str | None:
        """The host pass's kind for `p` (`_fusable` already holds), or None: the pass is on and
        built, the optimizer and group are ones it steps as torch does (`host_optimizer.kind_of`),
        one download, an fp32 master with its state made, every tensor aligned."""
        if not (HOST_PASS and getattr(self, "host_pass", True) and host_optimizer.compiled()):
            return None
        kind = host_optimizer.kind_of(self.inner, group)
        if kind is None or len(gs) != 1 or p.dtype != torch.float32 or not gs[0].is_floating_point():
            return None
        state = self.inner.state.get(p) or {}
        names = (("exp_avg", "exp_avg_sq") if kind != "sgd"
                 else (("momentum_buffer",) if float(group.get("momentum", 0)) != 0 else ()))
        tensors = [p, gs[0]] + [state.get(k) for k in names]
        if kind != "sgd" and not isinstance(state.get("step"), torch.Tensor):
            return None
        if any(t is None or t.dtype not in (torch.float32, gs[0].dtype) or t.data_ptr() % ALIGN for t in tensors):
            return None
        return kind

    def _streamed(self, p: torch.Tensor) -> list | None:
        """The first streamed copy of `p` a device keeps (`StreamDevice._pinned` entry), if any."""
        for dev in self._pipeline._rt.devices.values():
            entry = getattr(dev, "_pinned", {}).get(id(p))
            if (entry is not None and entry[0] is p and entry[2].shape == p.shape and entry[2].is_contiguous()
                    and entry[2].data_ptr() % ALIGN == 0):
                return entry
        return None

    def _host_pass(self, passed: list[tuple[torch.Tensor, list[torch.Tensor], str]], hp: list[dict],
                   where: dict[int, int], homes: Any) -> list[tuple[torch.Tensor, list]]:
        """Step each parameter in one pass (`host_optimizer.step_span`): the download in, the
        master, torch's state, `.grad` (its home) and the streamed copy out. Returns the
        (parameter, streamed-copy entry) pairs it wrote, for `_step_fused` to mark current."""
        state = self.inner.state
        written = []
        keep = self.keep_grads
        for p, gs, kind in passed:
            home = homes.take(p) if keep else None
            p.grad = home
            st = state[p]
            step = None
            if kind != "sgd":
                st["step"] += 1  # once per parameter, as torch's step
                step = float(st["step"])
            entry = self._streamed(p) if self.refresh_copies else None
            if entry is not None and entry[3] is not None:
                entry[3].synchronize()  # the stage's last upload has read the old copy
            flat = {k: (v.view(-1) if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in st.items()}
            ok = host_optimizer.step_span(kind, hp[where[id(p)]], p.detach().view(-1), gs[0].reshape(-1), flat,
                                          step=step, grad_out=None if home is None else home.view(-1),
                                          copy_out=None if entry is None else entry[2].view(-1))
            if not bool(ok):
                self.host_pass_nonfinite = True  # the GPUs said finite: a download went wrong
            if home is None:  # no .grad: the step hooks' version bump (host_counters) skips it
                torch.autograd.graph.increment_version(p)
            else:
                # beside the optimizer's own 28 B/param: the fp32 .grad written (the download read
                # replaces the fp32 gradient's read, the copy written within the same bytes)
                COUNTERS.add("grad_fused", nbytes(home))
            if entry is not None:
                written.append((p, entry))
        return written
