"""Stage calls: what a stage does on its GPU when the program runs it, forward and backward.

`StageCalls` is the part of the runtime (`mobius_fx.runtime.engine.Runtime` mixes it in) that runs
one stage call of one micro-batch: in forward without a graph (`StageFunction`), in backward by
recomputation with grad, the input gradients returned and the weight gradients summed on the
GPU, downloaded after the stage's last micro-batch and handed to autograd through `Masters`
(both in `stage_autograd.py`). The state it acts on -- `StageState` (a stage's module, slots
and masters), `Step` (one forward and its backward), `StageCall` -- is in `stage_state.py`;
the host gradients the downloads are summed into, in `host_gradients.py`.

Mixed precision (`dtype=torch.bfloat16 | torch.float16`): every floating weight's GPU copy
is the master cast to `dtype` (CUDA: the cast happens on the host into a pinned copy,
so the upload moves half the bytes), floating inputs are cast as they go up, and each stage
runs — and is recomputed in backward — under `torch.autocast(<its device type>, dtype)`, so
ops on autocast's fp32 list (losses, softmax-with-loss, norms where the backend lists them)
run in fp32 and outputs come back in the dtype autocast gives them (logits bf16, a loss
computed inside the model fp32). Weight gradients are summed over the micro-batches on the
GPU in `dtype` (what the plan budgets, G_k), downloaded in `dtype` and added into the fp32
`param.grad`. With fp16 use `torch.amp.GradScaler("cpu")` on the masters: it unscales the
CPU fp32 gradients and skips the step on inf/NaN. With `dtype=None` weights stay fp32 and a
stage runs under whatever autocast the caller has on; that state is saved per call and
replayed by the backward recomputation (as torch.utils.checkpoint does).

Micro-batches: what is split and how outputs are combined (concatenated, summed, averaged, max,
min) is mobius_fx/planning/microbatch.py's rule (README "Micro-batch semantics"); HF losses with `labels`
whose `ignore_index` tokens are spread unevenly are the mean of micro-batch means (warned).

Batch statistics are per micro-batch: in training mode a BatchNorm (or any layer that
normalises over the batch) sees one micro-batch at a time, so with M > 1 micro-batches it
normalises each by that micro-batch's mean and variance and updates its running statistics M
times, in micro-batch order — exactly eager PyTorch run micro-batch by micro-batch (gradient
accumulation), not eager on the whole batch. With one micro-batch it equals eager. A compile
with M > 1 says so once in the log (a warning) when the model has a BatchNorm layer.
"""


from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from mobius_fx.errors import MobiusError
from mobius_fx.runtime.device_books import Device, nbytes
from mobius_fx.runtime.host_gradients import finite_flag, host_gradient
from mobius_fx.runtime.stage_autograd import Masters, StageFunction
from mobius_fx.runtime.stage_state import OnHost, StageCall, StageState, Step, refuse_changed_masters

__all__ = ["StageCalls", "rebuild", "autocast_for"]


def _own(st: StageState, t: torch.Tensor) -> torch.Tensor:
    """A stage output that is a view of the stage's own weights (`layer.weight[0]`) would be
    read after the stage is evicted and its slot refilled: give it storage of its own."""
    ptr = t.untyped_storage().data_ptr()
    if ptr and any(s.untyped_storage().data_ptr() == ptr for s in st.slots):
        return t.clone()
    return t


def rebuild(leaves: list, pos: list[int], tensors: Sequence[torch.Tensor], spec: pytree.TreeSpec) -> Any:
    out = list(leaves)
    for j, t in zip(pos, tensors):
        out[j] = t
    return pytree.tree_unflatten(out, spec)


def autocast_for(amp: tuple[str, bool, torch.dtype]) -> Any:
    """The autocast a stage call runs (and is recomputed) under. The cast cache stays off: a
    cached cast of a weight slot would outlive the slot's eviction. On the CPU (the GPUs'
    stand-ins) in a narrower dtype, layer norms run in fp32 too, as CUDA's autocast runs them
    (`NormsInFp32`)."""
    device_type, enabled, dtype = amp
    cast = torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False)
    if device_type == "cpu" and enabled and dtype in (torch.bfloat16, torch.float16):
        stack = contextlib.ExitStack()
        stack.enter_context(cast)
        stack.enter_context(NormsInFp32())
        return stack
    return cast


@functools.lru_cache(maxsize=None)
def _norms() -> frozenset:
    aten = torch.ops.aten
    return frozenset({torch.nn.functional.layer_norm, torch.layer_norm, aten.layer_norm.default,
                      aten.native_layer_norm.default})


class NormsInFp32(torch.overrides.TorchFunctionMode):
    """Layer norms in fp32, as CUDA's autocast has them (its fp32 list): input, weight and bias
    cast up, the result fp32. The CPU's autocast leaves layer_norm in the dtypes it is given and
    refuses an fp32 input with bf16 weights ("mixed dtype (CPU)"), which HF GPT-2 in bf16 gives
    it; the virtual GPUs compute as the GPUs they stand in for do."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _norms():
            up = (lambda a: a.float() if isinstance(a, torch.Tensor) and a.is_floating_point()
                  and a.dtype != torch.float32 else a)
            args, kwargs = tuple(up(a) for a in args), {k: up(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


class StageCalls:
    """Stage calls on their GPUs, forward and backward (mixed into `runtime.Runtime`, whose
    weights, activations and step state these methods use)."""

    executing: Any = None  # the step executor's run in progress (runtime/executor.py), None: the program's calls
    overlap: Any = None  # the OverlapOptimizer: stepping stages during backward ("sync"), taking gradients ("async")
    reducer: Any = None  # the data_parallel.GradientReducer averaging gradients across ranks (compile(process_group=))

    # ------------------------------------------------------------------ stage calls
    def amp_state(self, dev: Device) -> tuple[str, bool, torch.dtype]:
        """(device type, enabled, dtype) of the autocast a stage on `dev` runs under: the
        pipeline's dtype when it has one, else whatever autocast the caller has on for that
        device type (saved per call, so the backward recomputation replays it)."""
        kind = dev.torch_device.type
        if self.dtype is not None:
            return kind, True, self.dtype
        return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)

    def run(self, k: int, i: int, args: tuple) -> Any:
        st = self.stages[k]
        if not st.resident or st.token is not None:
            raise MobiusError(f"stage {k} ran on {st.device.name} before its weights were there; the schedule must "
                              f"prefetch and wait for a stage before running it")
        dev = st.device
        step = self.step
        self._did("run", k, i)
        leaves, spec = pytree.tree_flatten(args)
        pos = [j for j, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        tensors = [leaves[j] for j in pos]
        executing = self.executing  # the step executor's calls (runtime/executor.py): no autograd graph
        try:
            if (k in executing.backward if executing is not None
                    else torch.is_grad_enabled() and (st.train or any(t.requires_grad for t in tensors))):
                call = StageCall(self, step, k, i, leaves, spec, pos)
                step.calls.setdefault(k, []).append(weakref.ref(call))
                if k not in step.param_versions:  # checked at the stage's backward (refuse_changed_masters)
                    step.param_versions[k] = [(j, m._version) for j, m in enumerate(st.masters) if st.is_param[j]]
                if executing is not None:  # the executor runs its backward op by op from `call`
                    with torch.no_grad(), self._working(k):
                        outs, _ = self._forward(call, tensors)
                    executing.calls[(k, i)] = call
                else:
                    if step.hub is None:
                        trainable = {id(m): m for s in self.stages for m, p in zip(s.masters, s.is_param)
                                     if p and m.requires_grad}
                        step.hub = Masters.apply(self, step, self._anchor, *trainable.values())
                    with self._working(k):
                        outs = StageFunction.apply(call, step.hub, *tensors)
                result = rebuild(call.out_leaves, call.out_pos, outs, call.out_spec)
                step.fwd_calls[k] += 1
            else:
                with torch.no_grad(), self._working(k), autocast_for(self.amp_state(dev)):
                    result = pytree.tree_map_only(torch.Tensor, lambda t: _own(st, t), st.module(*args))
        except Exception as e:
            if hasattr(e, "add_note"):
                hint = ""
                if self.m > 1 and any(w in str(e) for w in ("shape", "size", "view")):
                    hint = ("; a graph traced with a fixed batch size cannot run micro-batches: trace it with a "
                            "dynamic batch dimension (mobius_fx.trace does) or use microbatches=1")
                e.add_note(f"[mobius_fx] raised by stage {k} ({st.spec.nodes[0]} .. {st.spec.nodes[-1]}) on "
                           f"{dev.name}, micro-batch {i} of {self.m}{hint}")
            raise
        for t in pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor):
                dev.track(t)
        if i == self.m - 1:
            self._collect_buffers(k)
        return result

    def _working(self, k: int) -> Any:
        """The context of stage k's work on its GPU (`Device.working`): every tensor it creates
        is charged to the GPU while it lives; what the GPU holds for other stages meanwhile
        (their weights, their gradient accumulators) is left out of stage k's measured peak."""
        st = self.stages[k]
        dev = st.device
        pool = dev.pool_bytes()
        if pool is not None:  # a fixed slot pool: all of it but this stage's weights is held for others
            others = max(0, pool - (st.weight_bytes if st.resident else 0))
        else:
            others = sum(o.weight_bytes for j, o in enumerate(self.stages) if j != k and o.device is dev and o.resident)
        if self.step is not None:
            others += sum(nbytes(g) for j, acc in self.step.acc.items() if j != k and self.stages[j].device is dev
                          for g in acc.values())
        return dev.working(k, others)

    def _collect_buffers(self, k: int) -> None:
        st = self.stages[k]
        for group in st.buffer_groups:
            if any(st.slots[j]._version != st.versions[j] for j in group):  # updated in place by the forward
                for j in group:
                    with st.device.log.stage(k):
                        self.step.buffers.append((st.masters[j], st.device.download(st.slots[j], "buffer")))

    def _forward(self, call: StageCall, tensors: tuple) -> tuple[tuple, list]:
        st = self.stages[call.stage]
        dev = st.device
        call.rng = dev.rng_state()
        with dev.log.stage(call.stage):
            call.saved = [self._save(dev, t) for t in tensors]
        versions = [t._version for t in tensors]
        # Buffers this call changes (an EMA, a step counter, spectral_norm's power iteration) are
        # put back as it found them before its recompute, so the update runs once per step.
        found = {j: st.slots[j]._version for j in st.buffer_idx}
        before = {j: st.slots[j].detach().clone() for j in st.changing}
        with autocast_for(call.amp):
            out = st.module(*rebuild(call.in_leaves, call.in_pos, tensors, call.in_spec))
        for group in st.buffer_groups:
            if any(st.slots[j]._version != found[j] for j in group):
                for j in group:
                    if j not in before:  # first change seen: the slot held its master's value (masters
                        with dev.untracked():  # change only at the end of the forward), kept on the host
                            before[j] = st.masters[j].detach().clone()
                        st.changing.add(j)
                    call.state.append((j, before[j]))
        del before
        for t, v in zip(tensors, versions):
            if t.requires_grad and t._version != v:  # the recompute would change a leaf in place
                raise MobiusError(
                    f"stage {call.stage} changed one of its inputs in place: an input saved for backward on "
                    f"{dev.name} was modified in place after the forward used it (version {v} -> {t._version}); "
                    f"a stage must not change its inputs in place (use the out-of-place op, e.g. relu instead "
                    f"of relu_)")
        leaves, spec = pytree.tree_flatten(out)
        pos = [j for j, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        ids = {id(t) for t in tensors}
        outs = tuple(_own(st, leaves[j].detach() if id(leaves[j]) in ids else leaves[j]) for j in pos)
        call.out_spec, call.out_pos = spec, pos
        call.out_leaves = [None if j in pos else x for j, x in enumerate(leaves)]
        return outs, [o for o in outs if not (o.is_floating_point() or o.is_complex())]

    def _save(self, dev: Device, t: torch.Tensor) -> Any:
        """Keep a stage input for backward: one that came from the host stays there (the host
        copy is sent again); one made on a GPU is offloaded to host memory."""
        ref = self._from_host.get(id(t))
        if ref is not None and ref[0]() is t:
            return OnHost(ref[1], ref[1]._version)
        return dev.offload(t)

    def _restore(self, dev: Device, saved: object) -> torch.Tensor:
        if not isinstance(saved, OnHost):
            return dev.restore(saved)
        if saved.host._version != saved.version:
            raise MobiusError(f"an input of a stage on {dev.name} was modified in place on the host after the forward "
                              f"used it (version {saved.version} -> {saved.host._version}); change inputs out of place")
        cast = self.dtype if (self.dtype is not None and saved.host.is_floating_point()) else None
        return dev.receive(saved.host.detach(), None, cast, kind="input")

    def _restore_ahead(self, k: int, step: Step) -> None:
        """Stage k's backward starts (its weights waited for): restore the saved inputs of all its
        micro-batches now, in the order backward uses them, as the schedule IR's restores depend
        on the stage's wait alone. The copies run on the copy stream while earlier micro-batches
        compute; each micro-batch's compute waits only for its own (`Device.deferred`)."""
        dev = self.stages[k].device
        calls = [c for c in (r() for r in step.calls.get(k, ())) if c is not None and c.saved]
        with dev.log.stage(k):
            for call in reversed(calls):
                with dev.deferred() as events:
                    inputs = [self._restore(dev, s) for s in call.saved]
                call.restored = (inputs, list(events))

    def _forget_restored(self, step: Step, k: int | None = None) -> None:
        """Drop restored inputs no backward call used (stage k, or all)."""
        for j, refs in step.calls.items():
            if k is None or j == k:
                for r in refs:
                    c = r()
                    if c is not None:
                        c.restored = None
        if k is None:
            step.calls.clear()
        else:
            step.calls.pop(k, None)

    def _backward(self, call: StageCall, grads: tuple, needs: Sequence[bool]) -> list:
        with self._lock:
            step = call.step
            if step.state == "aborted":
                raise MobiusError("backward through a pipeline step that failed or was abandoned; run the forward "
                                  "again")
            try:
                return self._backward_call(call, step, grads, needs)
            except BaseException as e:
                self.backward_failed(step, e)
                raise

    def backward_failed(self, step: Step, e: BaseException, explain: bool = True) -> None:
        """A backward of `step` failed with `e`: GPU copies freed, the overlap told, `e` explained
        (`explain`; the step executor's caller, `Pipeline._forward`, explains its own)."""
        self.abort(step)
        if explain:
            self.explain(e)
        if self.overlap is not None:
            self.overlap.aborted(e)

    def _backward_call(self, call: StageCall, step: Step, grads: tuple, needs: Sequence[bool]) -> list:
        if step.state != "backward":  # first stage call of this backward pass
            step.state = "backward"
            step.bwd_calls = [0] * len(self.stages)
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._finish, step))
            if self.overlap is not None:
                self.overlap.backward_started()
        k = call.stage
        st = self.stages[k]
        if step.bwd_calls[k] == 0:
            refuse_changed_masters(st, step.param_versions.get(k, []), self._places[k] if self._places else [])
        if step.bwd_calls[k] == 0 or not st.resident:
            self.wait(k, strict=False)
            for p in self._bwd_prefetch.get(k, ()):  # what the IR prefetches when this stage starts backward
                if step.fwd_calls[p] > 0 and step.bwd_calls[p] == 0:
                    self.prefetch(p)
        elif st.token is not None:
            self.wait(k, strict=False)
        # All of the stage's work -- the restored inputs, the recompute, autograd.grad, the
        # accumulation -- is charged to its GPU while it lives (Device.working).
        self._did("run", k, call.mb)
        with self._working(k):
            if step.bwd_calls[k] == 0:
                self._restore_ahead(k, step)
            in_grads = self._recompute(call, st, step, grads, needs)
        step.bwd_calls[k] += 1
        if step.bwd_calls[k] >= step.fwd_calls[k]:
            self._flush(k, step)
        return in_grads

    def _recompute(self, call: StageCall, st: StageState, step: Step, grads: tuple, needs: Sequence[bool]) -> list:
        """Stage `call.stage`'s backward inside its GPU's work context: the output gradients
        received, recompute with grad, the input gradients (returned) and the weight gradients
        (summed into `step.acc`). A function of its own so that every temporary dies when it
        returns."""
        k, dev = call.stage, st.device
        grads = [dev.accept(g) for g in grads]  # the copies that arrive on this GPU
        if call.restored is not None:
            (inputs, events), call.restored = call.restored, None
            dev.join(events)
        else:
            with dev.log.stage(k):
                inputs = [self._restore(dev, s) for s in call.saved]
        for t, need in zip(inputs, needs):
            if need:
                t.requires_grad_(True)
        args = rebuild(call.in_leaves, call.in_pos, inputs, call.in_spec)
        with torch.no_grad():
            for j, value in call.state:  # the buffers as the forward found them (see _forward)
                st.slots[j].copy_(value)
        with torch.enable_grad(), dev.rng(call.rng), autocast_for(call.amp):
            out = st.module(*args)
        leaves = pytree.tree_leaves(out)
        outs = [leaves[j] for j in call.out_pos]
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        want = [t for t, need in zip(inputs, needs) if need]
        train = [st.slots[j] for j in st.train]
        wrt = want + train
        del out, leaves, outs, args, inputs
        if pairs and wrt:
            res = list(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))
        else:
            res = [None] * len(wrt)
        del pairs, grads
        acc = step.acc.setdefault(k, {})
        for n, j in enumerate(st.train):
            g, res[len(want) + n] = res[len(want) + n], None  # each fresh gradient dies once summed
            if g is None:
                continue
            if j in acc:
                acc[j].add_(g)
            else:
                g = g.contiguous() if g._base is None else g.clone()
                dev.claim(g, f"stage {k}'s weight gradients")  # booked until _flush frees it
                acc[j] = g
            del g
        it = iter(res[:len(want)])
        return [next(it) if need else None for need in needs]

    def _flush(self, k: int, step: Step) -> None:
        """Send stage k's weight gradients to the host (`_download`), evict the stage and hand
        the gradients now complete over (`_hand_over`)."""
        self._download(k, step)
        self.evict(k)
        if self.overlap is not None or self.reducer is not None:
            self._hand_over(k, step)

    def _download(self, k: int, step: Step) -> None:
        """Send stage k's weight gradients to the host (the schedule IR's `download`). While the
        optimizer overlap steps stages during backward, whether they are all finite is computed
        first on the GPU (`finite_flag`) and sent with them: the host reads no gradient to find out."""
        st = self.stages[k]
        self._forget_restored(step, k)
        acc = step.acc.pop(k, {})
        if (acc and self._overlaps(step) and self.reducer is None and getattr(self.overlap, "fuse", True)
                and getattr(self.overlap, "mode", "sync") == "sync"):  # async's hand-over steps nothing
            fetch = getattr(st.device, "fetch", None)
            flag = None
            if fetch is not None:
                with self._working(k):
                    flag = finite_flag(list(acc.values()))
                flag = fetch(flag)
            if k in step.finite:  # a stage downloaded from several GPUs (split-head): finite when every part is
                a = step.finite[k]
                flag = None if a is None or flag is None else (lambda a=a, b=flag: a() and b())
            step.finite[k] = flag
        for j, g in acc.items():
            with st.device.log.stage(k):
                step.pending.append((st.masters[j], st.device.download(g, "gradient")))
            st.device.free(nbytes(g))
        del acc

    def _overlaps(self, step: Step) -> bool:
        """Whether this backward hands complete gradients to the optimizer overlap (decided at
        its first flush, with the stages holding each master)."""
        hook, reducer = self.overlap, self.reducer
        if step.overlap is None:
            step.overlap = hook is not None and hook.overlapping()
            if step.overlap or reducer is not None:
                for i, s in enumerate(self.stages):
                    if step.fwd_calls[i] > 0:
                        for m in s.masters:
                            step.holders.setdefault(id(m), set()).add(i)
        return step.overlap

    def _hand_over(self, k: int, step: Step) -> None:
        """Stage k's gradients are on their way to the host. The masters whose gradients are now
        complete (every stage holding a copy flushed) are averaged across ranks (data parallel,
        `reducer`) and/or handed to the optimizer stepping during backward (pipe.overlap
        mode="sync"), which adds them into `.grad` and steps them while the GPUs go on. Autograd
        (`Masters`) then hands over only the others, averaged when data parallel."""
        hook, reducer = self.overlap, self.reducer
        if not self._overlaps(step) and reducer is None:
            return
        step.flushed.add(k)
        st = self.stages[k]
        ready: dict[int, torch.Tensor] = {}
        for m, is_param in zip(st.masters, st.is_param):
            if (is_param and m.requires_grad and id(m) not in step.handed and id(m) not in ready
                    and step.holders.get(id(m), set()) <= step.flushed):
                ready[id(m)] = m
        if not ready:
            return
        thunks: dict[int, list] = {i: [] for i in ready}
        keep = []
        for master, thunk in step.pending:
            if id(master) in thunks:
                thunks[id(master)].append(thunk)
            else:
                keep.append((master, thunk))
        step.handed.update(ready)
        # data parallel: every rank reduces the same masters in the same order, gradient or not
        groups = [(m, thunks[i]) for i, m in ready.items() if reducer is not None or thunks[i]]
        if reducer is not None:
            groups = reducer.reduce(groups)
        give = [(m, t) for m, t in groups if t and step.overlap and hook.wants(m)]
        given = {id(m) for m, _ in give}
        step.pending[:] = keep + [(m, t) for m, ts in groups if id(m) not in given for t in ts]
        if give:
            # the finiteness of the stages whose gradients these are (None: read them on the host)
            stages = set().union(*(step.holders.get(id(m), set()) for m, _ in give)) & set(step.finite)
            flags = [step.finite[j] for j in sorted(stages)]
            hook.ready(give, None if reducer is not None or any(f is None for f in flags) else flags)

    def _finish(self, step: Step) -> None:
        """End of a backward pass (an engine callback): a backward that did not ask `Masters`
        for the masters' gradients (`torch.autograd.grad(loss, x)`) drops them, as eager would
        not have computed them."""
        self._gradients(step)
        if self.overlap is not None:
            self.overlap.backward_done()

    def _gradients(self, step: Step) -> dict[int, torch.Tensor]:
        """Flush what is left; the host gradient of each master (by id), once per backward."""
        with self._lock:
            if step.state != "backward":
                return {}
            try:
                for k in list(step.acc):
                    self._flush(k, step)
                self._forget_restored(step)
                for k, st in enumerate(self.stages):
                    if st.resident:
                        self.evict(k)
                by_master: dict[int, tuple[torch.Tensor, list]] = {}
                for master, thunk in step.pending:
                    by_master.setdefault(id(master), (master, []))[1].append(thunk)
                handed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
                take = getattr(self.overlap, "take", None)  # async: the overlap takes what its update reads
                for i, (master, thunks) in by_master.items():
                    if take is not None and take(master, thunks):
                        continue
                    g = host_gradient(master, thunks)
                    if g is not None:
                        handed[i] = (master, g)
                step.pending.clear()
                step.state = "done"
                if self.overlap is not None:
                    self.overlap.handed_by_autograd(handed)
                return {i: g for i, (_, g) in handed.items()}
            except BaseException:
                self.abort(step)
                raise
