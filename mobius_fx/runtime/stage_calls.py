"""Stage calls: what a stage does on its GPU when the program runs it, forward and backward.

`StageCalls` is the part of the runtime (`mobius_fx.runtime.engine.Runtime` mixes it in) that runs
one stage call of one micro-batch: in forward without a graph (`StageFunction`), in backward by
recomputation with grad, the input gradients returned and the weight gradients summed on the
GPU, downloaded after the stage's last micro-batch and handed to autograd through `Masters`.
The state it acts on -- `StageState` (a stage's module, slots and masters), `Step` (one
forward and its backward), `StageCall` -- is defined here too.

Mixed precision (`dtype=torch.bfloat16 | torch.float16`): every floating weight's GPU copy
is the master cast to `dtype` (CUDA: the cast happens on the host into a pinned staging copy,
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

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.function import once_differentiable

from mobius_fx.runtime.devices import Device, nbytes
from mobius_fx.errors import MobiusError
from mobius_fx.runtime.host_counters import COUNTERS, watch_masters

__all__ = ["StageCalls", "StageState", "Step", "StageCall", "StageFunction", "Masters", "GradLog", "OnHost",
           "bind", "rebuild", "autocast_for", "logged_grad", "host_gradient", "sum_downloads", "convert_span",
           "finite_flag", "GradHomes"]


class StageState:
    """A stage at run time: its module, its weight slots on its device and their masters."""

    def __init__(self, spec: Any, device: Device, masters: list[torch.Tensor], dtype: torch.dtype | None) -> None:
        if getattr(spec.module, "_mobius_bound", False):
            raise MobiusError(f"stage {spec.index}'s module already runs in another Pipeline; a schedule backs one "
                              f"pipeline: run insert_transfers again (or build_pipeline without schedule=)")
        spec.module._mobius_bound = True
        self.index = spec.index
        self.spec = spec
        self.device = device
        self.module = spec.module
        self.masters = masters
        self.is_param = [isinstance(m, nn.Parameter) for m in masters]
        self.kinds = [(m.shape, m.dtype, m.device) for m in masters]  # checked by Runtime.follow
        watch_masters(m for m, p in zip(masters, self.is_param) if p)  # their optimizer steps bump versions
        self.slots = [device.new_slot(m, dtype, p) for m, p in zip(masters, self.is_param)]
        for w, slot in zip(spec.weights, self.slots):
            for path, attr in w.slots:
                bind(self.module, path, attr, slot)
        self.buffer_idx = [j for j, p in enumerate(self.is_param) if not p]
        # Buffers grouped by the module holding them: native batch_norm updates running stats
        # without bumping their version counter, but num_batches_tracked beside them is bumped.
        groups: dict[str, list[int]] = {}
        for j in self.buffer_idx:
            groups.setdefault(spec.weights[j].slots[0][0], []).append(j)
        self.buffer_groups = list(groups.values())
        self.changing: set[int] = set()  # buffer slots a forward has changed: copied before each call
        self.weight_bytes = sum(nbytes(s) for s in self.slots)
        self.shells = spec.shells
        self.resident = False
        self.token: Any = None
        self.versions: list[int] = []
        self.train: list[int] = []  # slots that take gradients (set at each prefetch)


class GradHomes:
    """Per master, host storage its gradient is converted into, kept across steps: a step does not
    allocate (and fault in) a new fp32 gradient per master after `zero_grad(set_to_none=True)`
    freed the last. `.grad` is still None between `zero_grad` and the next backward, as torch
    users expect; the hand-over points it at the master's home again. A home someone else still
    holds (`g = p.grad` kept across steps, a view of it, async's update in flight) is left to
    them and a new one made, so no gradient a user kept is overwritten."""

    def __init__(self) -> None:
        self._homes: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def take(self, master: torch.Tensor) -> torch.Tensor:
        entry = self._homes.get(id(master))
        if entry is not None and entry[0]() is master and entry[1].shape == master.shape \
                and entry[1].dtype == master.dtype and _alone(entry[1]):
            return entry[1]
        home = torch.empty_like(master, memory_format=torch.contiguous_format)
        COUNTERS.add("grad_alloc", nbytes(home))
        self._homes[id(master)] = (weakref.ref(master), home)
        return home


def _alone(t: torch.Tensor) -> bool:
    """Only GradHomes holds `t` (no Python reference, no view, no `.grad` slot elsewhere)."""
    import sys
    return sys.getrefcount(t) <= 3 and torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2


def host_gradient(master: torch.Tensor, thunks: Sequence[Any], homes: GradHomes | None = None) -> torch.Tensor | None:
    """A master's host gradient: the downloads of every stage that holds it (each thunk gives
    one, in the streamed dtype, or None), summed in order in the master's dtype on its device;
    None when there is none. The runtime (`_gradients`), the optimizer overlap and the
    data-parallel reducer all sum this one way, so their results are bit for bit the same.
    A download already in the master's dtype is the gradient itself (no pass); one to convert is
    converted into the master's home in `homes` when given (kept across steps), else into new
    memory. The passes are counted (`host_counters.COUNTERS`)."""
    return sum_downloads(master, [g for g in (thunk() for thunk in thunks) if g is not None], homes)


def sum_downloads(master: torch.Tensor, downloads: Sequence[torch.Tensor],
                  homes: GradHomes | None = None) -> torch.Tensor | None:
    """`host_gradient` of downloads already waited for (None entries dropped by the caller)."""
    total = None
    for g in downloads:
        if total is None:
            if g.dtype == master.dtype and g.device == master.device:
                total = g
                COUNTERS.add("grad_alloc", nbytes(g))  # the download's own buffer, handed on
            else:
                if homes is not None:
                    total = homes.take(master)
                else:
                    total = torch.empty_like(master, memory_format=torch.contiguous_format)
                    COUNTERS.add("grad_alloc", nbytes(total))
                with torch.no_grad():
                    total.copy_(g)
                COUNTERS.add("grad_convert", nbytes(g) + nbytes(total))
        else:
            with torch.no_grad():  # in the master's dtype: the same bits as adding g.to(master.dtype), no temporary
                total.add_(g.to(device=master.device) if g.device != master.device else g)
            COUNTERS.add("grad_convert", nbytes(g) + 2 * nbytes(total))
    return total


def convert_span(home: torch.Tensor, downloads: Sequence[torch.Tensor], a: int, b: int) -> None:
    """Elements [a, b) of `sum_downloads` (the first download copied and converted, the others
    added in the master's dtype: the same operations, so the same bits) into `home`, a
    contiguous gradient home: the optimizer overlap converts a gradient span by span, each right
    before the optimizer steps it, while it is in cache."""
    span = home.view(-1)[a:b]
    span.copy_(downloads[0].reshape(-1)[a:b])
    for g in downloads[1:]:
        span.add_(g.reshape(-1)[a:b])


def finite_flag(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool on the gradients' device: False when any element of `grads` is non-finite.
    Sums in fp32 (a reduction, no temporary the size of a gradient): a NaN or an infinity
    always makes the sum non-finite; finite values so large that their sum overflows read as
    non-finite too, which only makes the optimizer overlap leave those stages to opt.step()."""
    return torch.stack([g.sum(dtype=torch.float32) for g in grads]).sum().isfinite()


def _own(st: StageState, t: torch.Tensor) -> torch.Tensor:
    """A stage output that is a view of the stage's own weights (`layer.weight[0]`) would be
    read after the stage is evicted and its slot refilled: give it storage of its own."""
    ptr = t.untyped_storage().data_ptr()
    if ptr and any(s.untyped_storage().data_ptr() == ptr for s in st.slots):
        return t.clone()
    return t


def bind(module: nn.Module, path: str, attr: str, value: torch.Tensor) -> None:
    owner = module.get_submodule(path) if path else module
    if attr in owner._parameters:
        owner._parameters[attr] = value
    elif attr in owner._buffers:
        owner._buffers[attr] = value
    else:
        object.__setattr__(owner, attr, value)


class Step:
    """Book-keeping of one forward (and its backward): calls per stage, gradients in flight."""

    def __init__(self, num_stages: int) -> None:
        self.fwd_calls = [0] * num_stages
        self.bwd_calls = [0] * num_stages
        self.acc: dict[int, dict[int, torch.Tensor]] = {}  # stage -> slot -> gradient on its GPU
        self.calls: dict[int, list[weakref.ref]] = {}  # stage -> its calls that saved inputs (weak: autograd owns them)
        self.pending: list[tuple[torch.Tensor, Any]] = []  # (master, thunk giving the host gradient)
        self.buffers: list[tuple[torch.Tensor, Any]] = []  # (master buffer, thunk giving its new value)
        self.state = "forward"  # forward | backward | done | aborted
        self.mb_rows = 0
        self.marks: dict[int, bool] = {}  # id(input tensor) -> batched, from batch_dims (mobius_fx/planning/microbatch.py)
        self.hub: torch.Tensor | None = None  # Masters' output: every stage call hangs off it
        # pipe.overlap(mode="sync"): whether this backward hands complete gradients to the
        # optimizer (decided at its first flush), the stages flushed, the masters handed over
        # and, per master, the stages holding it that ran
        self.overlap: bool | None = None
        self.flushed: set[int] = set()
        self.handed: set[int] = set()
        self.holders: dict[int, set[int]] = {}
        # per stage flushed with gradients while overlapping: a thunk giving whether all of them
        # are finite, computed on its GPU before the download (None: the device cannot; the
        # optimizer then reads the gradients on the host)
        self.finite: dict[int, Any] = {}


class StageCall:
    """One stage call of one micro-batch, as the autograd Function sees it."""

    __slots__ = ("rt", "step", "stage", "mb", "in_leaves", "in_spec", "in_pos", "out_leaves", "out_spec",
                 "out_pos", "saved", "restored", "rng", "amp", "state", "__weakref__")

    def __init__(self, rt: Any, step: Step, stage: int, mb: int, leaves: list, spec: Any, pos: list[int]):
        self.rt, self.step, self.stage, self.mb = rt, step, stage, mb
        self.in_leaves = [None if j in pos else x for j, x in enumerate(leaves)]
        self.in_spec, self.in_pos = spec, pos
        self.out_leaves: list = []
        self.out_spec: Any = None
        self.out_pos: list[int] = []
        self.saved: list = []
        self.restored: tuple[list, list] | None = None  # (inputs back on the GPU, their copies' events)
        self.rng: Any = None
        self.amp: tuple[str, bool, torch.dtype] = rt.amp_state(rt.stages[stage].device)
        self.state: list[tuple[int, torch.Tensor]] = []  # (buffer slot, its value before the forward changed it)


def rebuild(leaves: list, pos: list[int], tensors: Sequence[torch.Tensor], spec: Any) -> Any:
    out = list(leaves)
    for j, t in zip(pos, tensors):
        out[j] = t
    return pytree.tree_unflatten(out, spec)


def autocast_for(amp: tuple[str, bool, torch.dtype]) -> torch.autocast:
    """The autocast a stage call runs (and is recomputed) under. The cast cache stays off: a
    cached cast of a weight slot would outlive the slot's eviction."""
    device_type, enabled, dtype = amp
    return torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False)


class OnHost:
    """A stage input that came from the host: kept there for backward (no offload copy)."""

    __slots__ = ("host", "version")

    def __init__(self, host: torch.Tensor, version: int) -> None:
        self.host, self.version = host, version


class GradLog(torch.autograd.Function):
    """Identity that logs the gradient's copy when it flows back through a send."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, dev: Device, direction: str, stage: int | None):
        ctx.dev, ctx.direction, ctx.stage = dev, direction, stage
        return t.view_as(t)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if grad is not None:
            with ctx.dev.log.stage(ctx.stage):
                ctx.dev.log.add("activation", ctx.direction, nbytes(grad))
        return grad, None, None, None


def logged_grad(t: torch.Tensor, dev: Device, direction: str, stage: int | None) -> torch.Tensor:
    return GradLog.apply(t, dev, direction, stage) if t.requires_grad else t


class StageFunction(torch.autograd.Function):
    """One stage call: forward without a graph, backward by recomputation (see module docstring)."""

    @staticmethod
    def forward(ctx, call: StageCall, anchor: torch.Tensor, *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.call = call
        outs, nondiff = call.rt._forward(call, tensors)
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        # What a call keeps for backward lives outside autograd (offloaded to the host), so a
        # second backward would run it again and double every gradient. Reading saved_tensors
        # asks autograd whether this node's graph was freed (a backward without retain_graph):
        # then it raises torch's own "Trying to backward through the graph a second time".
        ctx.saved_tensors  # noqa: B018
        refuse_double_backward()
        return _stage_backward(ctx, *grads)


def refuse_double_backward() -> None:
    """Refuse `backward(create_graph=True)` / `autograd.grad(..., create_graph=True)` (grad mode
    is on in a backward only then): a stage's backward is a recomputation whose own graph is not
    kept, so gradients of gradients (a gradient penalty, Hessian-vector products) cannot flow."""
    if torch.is_grad_enabled():
        raise MobiusError("backward with create_graph=True (double backward: a gradient penalty, a Hessian-vector "
                          "product) is not supported by a Mobius pipeline: each stage's backward recomputes the stage "
                          "and returns plain gradients, with no graph to differentiate again. Compute higher-order "
                          "gradients with the eager model, or call backward without create_graph (the step is kept: "
                          "backward can run again)")


@once_differentiable
def _stage_backward(ctx, *grads):
    call = ctx.call
    return (None, None, *call.rt._backward(call, grads, ctx.needs_input_grad[2:]))


class Masters(torch.autograd.Function):
    """The masters' place in the autograd graph: every stage call of a step hangs off its output,
    so its backward runs after the step's last stage backward and hands autograd the host
    gradients. `loss.backward()` accumulates them into `.grad` (hooks run), `backward(inputs=[...])`
    only into those asked for, `torch.autograd.grad(loss, params)` returns them; a backward that
    needs no master (the gradient of an input alone) leaves `.grad` alone (`Runtime._finish`)."""

    @staticmethod
    def forward(ctx, rt: Any, step: Step, anchor: torch.Tensor, *masters: torch.Tensor):
        ctx.rt, ctx.step, ctx.ids = rt, step, [id(m) for m in masters]
        return anchor.detach().clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, _):
        grads = ctx.rt._gradients(ctx.step)
        return (None, None, None, *(grads.get(i) for i in ctx.ids))


class StageCalls:
    """Stage calls on their GPUs, forward and backward (mixed into `runtime.Runtime`, whose
    weights, activations and step state these methods use)."""

    overlap: Any = None  # the OverlapOptimizer stepping stages during backward (pipe.overlap, mode="sync")
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
        try:
            if torch.is_grad_enabled() and (st.train or any(t.requires_grad for t in tensors)):
                call = StageCall(self, step, k, i, leaves, spec, pos)
                step.calls.setdefault(k, []).append(weakref.ref(call))
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

    def _restore(self, dev: Device, saved: Any) -> torch.Tensor:
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
                self.abort(step)
                self.explain(e)
                if self.overlap is not None:
                    self.overlap.aborted(e)
                raise

    def _backward_call(self, call: StageCall, step: Step, grads: tuple, needs: Sequence[bool]) -> list:
        if step.state != "backward":  # first stage call of this backward pass
            step.state = "backward"
            step.bwd_calls = [0] * len(self.stages)
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._finish, step))
            if self.overlap is not None:
                self.overlap.backward_started()
        k = call.stage
        st = self.stages[k]
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
        """Send stage k's weight gradients to the host and evict the stage. While the optimizer
        overlap steps stages during backward, whether they are all finite is computed first on
        the GPU (`finite_flag`) and sent with them: the host reads no gradient to find out."""
        st = self.stages[k]
        self._forget_restored(step, k)
        acc = step.acc.pop(k, {})
        if acc and self._overlaps(step) and self.reducer is None and getattr(self.overlap, "fuse", True):
            fetch = getattr(st.device, "fetch", None)
            flag = None
            if fetch is not None:
                with self._working(k):
                    flag = finite_flag(list(acc.values()))
                flag = fetch(flag)
            step.finite[k] = flag
        for j, g in acc.items():
            with st.device.log.stage(k):
                step.pending.append((st.masters[j], st.device.download(g, "gradient")))
            st.device.free(nbytes(g))
        del acc
        self.evict(k)
        if self.overlap is not None or self.reducer is not None:
            self._hand_over(k, step)

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
                staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
                for i, (master, thunks) in by_master.items():
                    g = host_gradient(master, thunks)
                    if g is not None:
                        staged[i] = (master, g)
                step.pending.clear()
                step.state = "done"
                if self.overlap is not None:
                    self.overlap.handed_by_autograd(staged)
                return {i: g for i, (_, g) in staged.items()}
            except BaseException:
                self.abort(step)
                raise
