"""The runtime: runs a compiled Mobius schedule, forward by its program and backward by autograd.

`mobius_fx.pipeline.build_pipeline` cuts the traced graph into stages (`passes.insert_transfers`),
emits the program (`passes.emit`, calling the ops of `mobius_fx.ops`) and returns a `Pipeline`,
an `nn.Module` you call like the model; this module holds the state those ops act on and
imports nothing from the passes:

    pipe = build_pipeline(model, gm, stage_nodes=[...], stage_gpus=["gpu0", "gpu1", "gpu0", "gpu1"],
                          gpu_budgets={"gpu0": 2**28, "gpu1": 2**28}, microbatches=4,
                          example_inputs=(x,), device="virtual")
    loss = loss_fn(pipe(x), y); loss.backward(); opt.step()    # opt over model.parameters()
    print(pipe.code); pipe.memory_stats()

How a step runs:

- Master weights stay in the user's model on the CPU; the model is never moved or modified
  (gradients land in `param.grad`, buffer updates such as BatchNorm statistics are copied
  back once per forward). Each stage owns GPU *slots* for its weights; `prefetch` gives them
  storage and copies the masters in, `evict` frees the storage again.
- Each `run_stage` call with autograd on is one `torch.autograd.Function`. Its forward runs the
  stage without building a graph, offloads its boundary inputs to host memory and saves the RNG
  state. Its backward re-fetches the stage if it was evicted (the stage the same GPU runs next
  in backward is prefetched as the first micro-batch starts), recomputes the stage with grad
  under the saved RNG state (dropout masks match), returns the input gradients and accumulates
  weight gradients on the GPU; after the stage's last micro-batch they go to the host and the
  stage is evicted. The forward creates stage calls stage-major, so autograd (which runs ready
  nodes newest first) finishes each stage before the next: at most two stages per GPU.
- When the backward pass ends (an autograd engine callback), host gradients are added into
  `param.grad` — all at once, so a step that fails leaves `.grad`, the weights and the
  buffers as they were, frees every GPU copy, and the pipeline stays usable.

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

Micro-batches: tensor inputs whose dim 0 is the batch size (dim 0 of the first batched input)
are split into M equal micro-batches; other inputs go to every micro-batch. Output tensors whose
dim 0 is the micro-batch size are concatenated back; other tensors (a 0-dim loss) are averaged
over micro-batches, which equals the full-batch value for a mean over equal-sized micro-batches
(HF losses with `labels`; with `ignore_index` tokens spread unevenly it is the mean of
micro-batch means); non-tensor outputs come from the first micro-batch.

Batch statistics are per micro-batch: in training mode a BatchNorm (or any layer that
normalises over the batch) sees one micro-batch at a time, so with M > 1 micro-batches it
normalises each by that micro-batch's mean and variance and updates its running statistics M
times, in micro-batch order — exactly eager PyTorch run micro-batch by micro-batch (gradient
accumulation), not eager on the whole batch. With one micro-batch it equals eager. A compile
with M > 1 says so once in the log (a warning) when the model has a BatchNorm layer.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.function import once_differentiable
from torch.fx.immutable_collections import immutable_dict, immutable_list

from .devices import HOST, Device, nbytes
from .errors import BudgetError, MobiusError
from .ops import running

__all__ = ["Pipeline", "batch_rows"]

log = logging.getLogger("mobius_fx")

def batch_rows(inputs: Any, microbatches: int) -> int | None:
    """The rows of the batch that micro-batches split: dim 0 of the first tensor input that has
    a dimension (None when no input has one).

    Refused with a MobiusError: an empty batch (dim 0 of size 0), and, with several
    micro-batches, inputs that are all 1-D — an unbatched example whose dim 0 is its features,
    which splitting would cut apart.
    """
    leaves = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not leaves:
        return None
    rows = leaves[0].size(0)
    if rows == 0:
        raise MobiusError(f"the batch is empty (an input of shape {tuple(leaves[0].shape)}: dim 0, the batch, is 0); "
                          f"call the pipeline with at least one row per micro-batch")
    if microbatches > 1 and all(x.dim() == 1 for x in leaves):
        raise MobiusError(f"microbatches={microbatches} splits dim 0 of the inputs, but every tensor input is 1-D "
                          f"(shape {tuple(leaves[0].shape)}), so dim 0 is not a batch: add a batch dimension "
                          f"(x.unsqueeze(0)) and use a batch of at least {microbatches} rows, or use microbatches=1; "
                          f"if dim 0 is a batch of scalars, give them a feature dimension (x.unsqueeze(-1))")
    return rows


# ----------------------------------------------------------------------------- runtime state

class _Stage:
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
        self.slots = [device.new_slot(m, dtype, p) for m, p in zip(masters, self.is_param)]
        for w, slot in zip(spec.weights, self.slots):
            for path, attr in w.slots:
                _bind(self.module, path, attr, slot)
        self.buffer_idx = [j for j, p in enumerate(self.is_param) if not p]
        # Buffers grouped by the module holding them: native batch_norm updates running stats
        # without bumping their version counter, but num_batches_tracked beside them is bumped.
        groups: dict[str, list[int]] = {}
        for j in self.buffer_idx:
            groups.setdefault(spec.weights[j].slots[0][0], []).append(j)
        self.buffer_groups = list(groups.values())
        self.weight_bytes = sum(nbytes(s) for s in self.slots)
        self.shells = spec.shells
        self.resident = False
        self.token: Any = None
        self.versions: list[int] = []
        self.train: list[int] = []  # slots that take gradients (set at each prefetch)


def _bind(module: nn.Module, path: str, attr: str, value: torch.Tensor) -> None:
    owner = module.get_submodule(path) if path else module
    if attr in owner._parameters:
        owner._parameters[attr] = value
    elif attr in owner._buffers:
        owner._buffers[attr] = value
    else:
        object.__setattr__(owner, attr, value)


class _Step:
    """Book-keeping of one forward (and its backward): calls per stage, gradients in flight."""

    def __init__(self, num_stages: int) -> None:
        self.fwd_calls = [0] * num_stages
        self.bwd_calls = [0] * num_stages
        self.acc: dict[int, dict[int, torch.Tensor]] = {}  # stage -> slot -> gradient on its GPU
        self.pending: list[tuple[torch.Tensor, Any]] = []  # (master, thunk giving the host gradient)
        self.buffers: list[tuple[torch.Tensor, Any]] = []  # (master buffer, thunk giving its new value)
        self.state = "forward"  # forward | backward | done | aborted
        self.mb_rows = 0


class _Call:
    """One stage call of one micro-batch, as the autograd Function sees it."""

    __slots__ = ("rt", "step", "stage", "mb", "in_leaves", "in_spec", "in_pos", "out_leaves", "out_spec",
                 "out_pos", "saved", "rng", "amp")

    def __init__(self, rt: "_Runtime", step: _Step, stage: int, mb: int, leaves: list, spec: Any, pos: list[int]):
        self.rt, self.step, self.stage, self.mb = rt, step, stage, mb
        self.in_leaves = [None if j in pos else x for j, x in enumerate(leaves)]
        self.in_spec, self.in_pos = spec, pos
        self.out_leaves: list = []
        self.out_spec: Any = None
        self.out_pos: list[int] = []
        self.saved: list = []
        self.rng: Any = None
        self.amp: tuple[str, bool, torch.dtype] = rt.amp_state(rt.stages[stage].device)


def _rebuild(leaves: list, pos: list[int], tensors: Sequence[torch.Tensor], spec: Any) -> Any:
    out = list(leaves)
    for j, t in zip(pos, tensors):
        out[j] = t
    return pytree.tree_unflatten(out, spec)


def _autocast(amp: tuple[str, bool, torch.dtype]) -> torch.autocast:
    """The autocast a stage call runs (and is recomputed) under. The cast cache stays off: a
    cached cast of a weight slot would outlive the slot's eviction."""
    device_type, enabled, dtype = amp
    return torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False)


class _OnHost:
    """A stage input that came from the host: kept there for backward (no offload copy)."""

    __slots__ = ("host", "version")

    def __init__(self, host: torch.Tensor, version: int) -> None:
        self.host, self.version = host, version


class _GradLog(torch.autograd.Function):
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


def _logged_grad(t: torch.Tensor, dev: Device, direction: str, stage: int | None) -> torch.Tensor:
    return _GradLog.apply(t, dev, direction, stage) if t.requires_grad else t


class _StageFunction(torch.autograd.Function):
    """One stage call: forward without a graph, backward by recomputation (see module docstring)."""

    @staticmethod
    def forward(ctx, call: _Call, anchor: torch.Tensor, *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.call = call
        outs, nondiff = call.rt._forward(call, tensors)
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        call = ctx.call
        return (None, None, *call.rt._backward(call, grads, ctx.needs_input_grad[2:]))


class _Runtime:
    """Executes the schedule ops on the devices, for one Pipeline."""

    def __init__(self, schedule: Any, devices: dict[str, Device], masters: list[list[torch.Tensor]],
                 dtype: torch.dtype | None) -> None:
        self.schedule = schedule
        self.m = schedule.microbatches
        self.devices = devices
        self.dtype = dtype
        self.stages = [_Stage(spec, devices[spec.gpu], ms, dtype) for spec, ms in zip(schedule.stages, masters)]
        self.step: _Step | None = None
        ir = schedule.ir()
        self._bwd_prefetch: dict[int, list[int]] = {}  # stage -> stages the IR prefetches as it starts backward
        for o in ir.select(kind="prefetch", phase="backward"):
            waits = [ir.ops[d].stage for d in o.deps if ir.ops[d].kind == "wait"]
            self._bwd_prefetch.setdefault(waits[0], []).append(o.stage)
        self.planned_rows = 0  # rows of the example batch the plan was made for (0: unknown)
        self._from_host: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # GPU copy -> its host original
        self._lock = threading.RLock()
        self._anchor = torch.zeros((), requires_grad=True)
        # What this step executed, in order: (kind, gpu, stage, phase, micro-batch or None) for
        # each prefetch, wait, run and evict that acted (`Pipeline.executed_ops`).
        self.executed: list[tuple[str, str, int, str, int | None]] = []

    def _did(self, kind: str, k: int, i: int | None = None) -> None:
        phase = "backward" if self.step is not None and self.step.state == "backward" else "forward"
        self.executed.append((kind, self.stages[k].device.name, k, phase, i))

    # ------------------------------------------------------------------ weights
    def prefetch(self, k: int) -> None:
        st = self.stages[k]
        if st.resident:
            return
        st.device.alloc(st.weight_bytes, f"stage {k}'s weights")
        try:
            for j, master in enumerate(st.masters):
                if st.is_param[j]:
                    st.slots[j].requires_grad_(master.requires_grad)
            with st.device.log.stage(k):
                st.token = st.device.upload(st.slots, st.masters)
        except BaseException:
            st.device.release(st.slots)
            st.device.free(st.weight_bytes)
            raise
        st.resident = True
        self._did("prefetch", k)
        if st.token is None:
            st.versions = [s._version for s in st.slots]
        st.train = [j for j, s in enumerate(st.slots) if st.is_param[j] and s.requires_grad]

    def wait(self, k: int, strict: bool = True) -> None:
        st = self.stages[k]
        if not st.resident:
            if strict:
                raise MobiusError(f"wait({k}): stage {k}'s weights were never prefetched to {st.device.name}; the "
                                  f"schedule must prefetch a stage before waiting for it")
            self.prefetch(k)
        if st.token is not None:
            st.device.ready(st.token, st.slots)
            st.token = None
            st.versions = [s._version for s in st.slots]  # the upload's copies are done
        self._did("wait", k)

    def evict(self, k: int) -> None:
        st = self.stages[k]
        if not st.resident:
            return
        if st.token is not None:
            st.device.ready(st.token, st.slots)
            st.token = None
        st.device.release(st.slots)
        st.device.free(st.weight_bytes)
        st.resident = False
        self._did("evict", k)

    def hold(self, k: int) -> None:
        if self.step is None or self.step.fwd_calls[k] == 0:
            self.evict(k)  # no backward will come for this stage

    # ------------------------------------------------------------------ activations
    def _where(self, t: torch.Tensor) -> Device | None:
        for dev in self.devices.values():
            if dev.holds(t):
                return dev
        return None

    def send(self, value: Any, gpu: str, stage: int | None = None) -> Any:
        if isinstance(value, torch.Tensor):
            return self._send(value, gpu, stage)
        if isinstance(value, (int, float, bool, str, type(None))):
            return value
        return pytree.tree_map_only(torch.Tensor, lambda t: self._send(t, gpu, stage), value)

    def _send(self, t: torch.Tensor, gpu: str, stage: int | None) -> torch.Tensor:
        """Copy `t` to `gpu` (or the host) for `stage`, as the schedule IR says: the copy and,
        in backward, the gradient coming back are logged under that stage (a push to the next
        stage's GPU sends its gradient back to the producer, stage - 1)."""
        src = self._where(t)
        if gpu == HOST:
            if src is None:
                return t
            with src.log.stage(stage):
                out = src.to_host(t)
            return _logged_grad(out, src, "h2d", stage)
        dst = self.devices[gpu]
        if src is dst:
            return t
        cast = self.dtype if (src is None and self.dtype is not None and t.is_floating_point()) else None
        with dst.log.stage(stage):
            raw = dst.receive(t, src, cast)
        if src is None:
            out = _logged_grad(raw, dst, "d2h", stage)
            self._from_host[id(out)] = (weakref.ref(out), t)
        else:
            out = _logged_grad(raw, src, "d2d", None if stage is None else stage - 1)
        dst.track(out)
        return out

    def split(self, inputs: tuple, m: int) -> tuple:
        rows = batch_rows(inputs, m)
        if rows is None:
            raise MobiusError(f"microbatches={m} but no input is a tensor with a batch dimension to split; pass "
                              f"batched tensors or use microbatches=1")
        if rows % m:
            raise MobiusError(f"the batch has {rows} rows (dim 0 of the first batched input) and does not split into "
                              f"{m} equal micro-batches; micro-batches must divide the batch: use a batch size that "
                              f"is a multiple of {m}, or microbatches that divide {rows}")
        mb = rows // m
        if self.step is not None:
            self.step.mb_rows = mb

        def parts(x: Any) -> list:
            if isinstance(x, torch.Tensor) and x.dim() > 0 and x.size(0) == rows:
                return list(x.split(mb))
            return [x] * m

        out: list = []
        for x in inputs:
            if isinstance(x, torch.Tensor):
                out.extend(parts(x))
                continue
            flat, spec = pytree.tree_flatten(x)
            chunks = [parts(leaf) for leaf in flat]
            out.extend(pytree.tree_unflatten([c[i] for c in chunks], spec) for i in range(m))
        return tuple(out)

    def merge(self, outputs: list) -> Any:
        outputs = [_thaw(o) for o in outputs]
        if len(outputs) == 1:
            return outputs[0]
        flats = [pytree.tree_flatten(o) for o in outputs]
        spec = flats[0][1]
        rows = self.step.mb_rows if self.step is not None else -1
        merged = []
        for leaves in zip(*(f[0] for f in flats)):
            x = leaves[0]
            if not isinstance(x, torch.Tensor):
                merged.append(x)
            elif x.dim() > 0 and x.size(0) == rows:
                merged.append(torch.cat(leaves))
            elif x.is_floating_point() or x.is_complex():
                merged.append(torch.stack(leaves).mean(0))
            else:
                merged.append(x)
        return pytree.tree_unflatten(merged, spec)

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
                call = _Call(self, step, k, i, leaves, spec, pos)
                with self._working(k):
                    outs = _StageFunction.apply(call, self._anchor, *tensors)
                result = _rebuild(call.out_leaves, call.out_pos, outs, call.out_spec)
                step.fwd_calls[k] += 1
            else:
                with torch.no_grad(), self._working(k), _autocast(self.amp_state(dev)):
                    result = st.module(*args)
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

    def _forward(self, call: _Call, tensors: tuple) -> tuple[tuple, list]:
        st = self.stages[call.stage]
        dev = st.device
        call.rng = dev.rng_state()
        with dev.log.stage(call.stage):
            call.saved = [self._save(dev, t) for t in tensors]
        versions = [t._version for t in tensors]
        with _autocast(call.amp):
            out = st.module(*_rebuild(call.in_leaves, call.in_pos, tensors, call.in_spec))
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
        outs = tuple(leaves[j].detach() if id(leaves[j]) in ids else leaves[j] for j in pos)
        call.out_spec, call.out_pos = spec, pos
        call.out_leaves = [None if j in pos else x for j, x in enumerate(leaves)]
        return outs, [o for o in outs if not (o.is_floating_point() or o.is_complex())]

    def _save(self, dev: Device, t: torch.Tensor) -> Any:
        """Keep a stage input for backward: one that came from the host stays there (the host
        copy is sent again); one made on a GPU is offloaded to host memory."""
        ref = self._from_host.get(id(t))
        if ref is not None and ref[0]() is t:
            return _OnHost(ref[1], ref[1]._version)
        return dev.offload(t)

    def _restore(self, dev: Device, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _OnHost):
            return dev.restore(saved)
        if saved.host._version != saved.version:
            raise MobiusError(f"an input of a stage on {dev.name} was modified in place on the host after the forward "
                              f"used it (version {saved.version} -> {saved.host._version}); change inputs out of place")
        cast = self.dtype if (self.dtype is not None and saved.host.is_floating_point()) else None
        return dev.receive(saved.host.detach(), None, cast, kind="input")

    def _backward(self, call: _Call, grads: tuple, needs: Sequence[bool]) -> list:
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
                raise

    def _backward_call(self, call: _Call, step: _Step, grads: tuple, needs: Sequence[bool]) -> list:
        if step.state != "backward":  # first stage call of this backward pass
            step.state = "backward"
            step.bwd_calls = [0] * len(self.stages)
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._finish, step))
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
            in_grads = self._recompute(call, st, step, grads, needs)
        step.bwd_calls[k] += 1
        if step.bwd_calls[k] >= step.fwd_calls[k]:
            self._flush(k, step)
        return in_grads

    def _recompute(self, call: _Call, st: _Stage, step: _Step, grads: tuple, needs: Sequence[bool]) -> list:
        """Stage `call.stage`'s backward inside its GPU's work context: the output gradients
        received, recompute with grad, the input gradients (returned) and the weight gradients
        (summed into `step.acc`). A function of its own so that every temporary dies when it
        returns."""
        k, dev = call.stage, st.device
        grads = [dev.accept(g) for g in grads]  # the copies that arrive on this GPU
        with dev.log.stage(k):
            inputs = [self._restore(dev, s) for s in call.saved]
        for t, need in zip(inputs, needs):
            if need:
                t.requires_grad_(True)
        args = _rebuild(call.in_leaves, call.in_pos, inputs, call.in_spec)
        with torch.enable_grad(), dev.rng(call.rng), _autocast(call.amp):
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

    def _flush(self, k: int, step: _Step) -> None:
        """Send stage k's weight gradients to the host and evict the stage."""
        st = self.stages[k]
        for j, g in step.acc.pop(k, {}).items():
            with st.device.log.stage(k):
                step.pending.append((st.masters[j], st.device.download(g, "gradient")))
            st.device.free(nbytes(g))
        self.evict(k)

    def _finish(self, step: _Step) -> None:
        """End of a backward pass: flush what is left, then add the gradients into `param.grad`."""
        with self._lock:
            if step.state != "backward":
                return
            try:
                for k in list(step.acc):
                    self._flush(k, step)
                for k, st in enumerate(self.stages):
                    if st.resident:
                        self.evict(k)
                staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
                for master, thunk in step.pending:
                    g = thunk()
                    if id(master) in staged:
                        staged[id(master)][1].add_(g.to(master.dtype))
                    else:
                        staged[id(master)] = (master, g.to(device=master.device, dtype=master.dtype))
                step.pending.clear()
                with torch.no_grad():
                    for master, g in staged.values():
                        if master.grad is None:
                            master.grad = g
                        else:
                            master.grad.add_(g)
                step.state = "done"
            except BaseException:
                self.abort(step)
                raise

    # ------------------------------------------------------------------ steps
    def begin_step(self) -> None:
        with self._lock:
            old = self.step
            if old is not None and old.state == "backward":  # a backward that never finished
                self._drop(old)
            for k, st in enumerate(self.stages):
                if st.resident:
                    self.evict(k)
            self._from_host.clear()
            self.executed.clear()
            for dev in self.devices.values():
                dev.new_step()
                dev.log.mark()
            for st in self.stages:
                for user, shell in st.shells:
                    shell.training = user.training
            self.step = _Step(len(self.stages))

    def end_forward(self) -> None:
        step = self.step
        with torch.no_grad():
            for master, thunk in step.buffers:
                master.copy_(thunk())
        step.buffers.clear()
        if not any(step.fwd_calls):
            step.state = "done"

    def _drop(self, step: _Step) -> None:
        for k, acc in step.acc.items():
            for g in acc.values():
                self.stages[k].device.free(nbytes(g))
        step.acc.clear()
        step.pending.clear()
        step.buffers.clear()
        step.state = "aborted"

    def explain(self, e: BaseException) -> None:
        """Say so on a budget error when this call's batch is larger than the one planned for."""
        rows = self.step.mb_rows * self.m if self.step is not None else 0
        if isinstance(e, BudgetError) and self.planned_rows and rows > self.planned_rows:
            e.add_note(f"[mobius_fx] this call's batch has {rows} rows; the plan and its budgets were made for "
                       f"{self.planned_rows}: call with at most {self.planned_rows} rows, or compile with the batch "
                       f"you train with")

    def abort(self, step: _Step | None = None) -> None:
        """After an error: drop the step (default: the current one) and free every GPU copy;
        masters and `.grad` stay untouched."""
        with self._lock:
            step = step if step is not None else self.step
            if step is not None:
                self._drop(step)
            for k, st in enumerate(self.stages):
                if st.resident:
                    st.device.cancel(st.token)
                    st.token = None
                    st.device.release(st.slots)
                    st.device.free(st.weight_bytes)
                    st.resident = False
            for dev in self.devices.values():
                dev.untrack_all()


def _thaw(x: Any) -> Any:
    """fx hands structured args over as immutable_list/immutable_dict; give users plain ones."""
    if isinstance(x, immutable_list):
        return [_thaw(v) for v in x]
    if isinstance(x, immutable_dict):
        return {k: _thaw(v) for k, v in x.items()}
    if type(x) is tuple:
        return tuple(_thaw(v) for v in x)
    return x


# ----------------------------------------------------------------------------- Pipeline

_NO_COPY = ("a Pipeline cannot be {op}: it holds GPU weight slots (storage freed between stages), streams and "
            "worker threads that belong to this process; copy or save the model instead (copy.deepcopy(model), "
            "torch.save(model.state_dict(), path) — the pipeline's weights are the model's) and compile the copy "
            "again with mobius_fx.compile")


class Pipeline(nn.Module):
    """A model compiled into a Mobius pipeline; call it like the model.

    Attributes: `plan` (the Plan it was built from, or None), `code` (the schedule as Python),
    `program` (the schedule GraphModule), `schedule` (stages and their modules), `model` (the
    user's model: `pipe.parameters()` are its master weights; `pipe.train()`/`eval()` reach it
    and, at the next call, the stages' leaf modules; a graph from torch.export has the mode it
    was traced in baked in). Outputs come back on the host, in the dtype autocast gives them
    when a `dtype` was given (matmul outputs in that dtype, fp32-list ops such as a loss in
    fp32). The pipeline cannot be moved or cast (`.to`, `.cuda`, `.half`): it copies the CPU
    masters to the GPUs itself.

    pipe = build_pipeline(model, gm, stage_nodes=..., stage_gpus=..., gpu_budgets=..., microbatches=2,
                          example_inputs=(x,), device="virtual")
    pipe(x).sum().backward()     # gradients in model.parameters()' .grad
    pipe.memory_stats()["gpu0"]  # {'peak_bytes': ..., 'current_bytes': 0}
    """

    def __init__(self, model: nn.Module, gm: fx.GraphModule, schedule: Any, program: fx.GraphModule,
                 runtime: _Runtime, plan: Any, code: str) -> None:
        super().__init__()
        self.model = model
        self.plan = plan
        self.code = code
        object.__setattr__(self, "program", program)
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "_rt", runtime)
        object.__setattr__(self, "_gm", gm)
        try:
            self.__signature__ = inspect.signature(model.forward)
        except (TypeError, ValueError):
            pass

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from .tracing import flatten_inputs

        flat = flatten_inputs(self._gm, args, kwargs)
        rows = batch_rows(flat, self.schedule.microbatches)  # refuses an empty batch before anything runs
        rt = self._rt
        rt.begin_step()
        rt.step.mb_rows = (rows or 0) // self.schedule.microbatches
        try:
            with running(rt):
                out = self.program(*flat)
            rt.end_forward()
        except BaseException as e:
            rt.abort()
            rt.explain(e)
            raise
        if self.schedule.out_spec is not None:
            out = pytree.tree_unflatten(list(out), self.schedule.out_spec)
        return out

    def __deepcopy__(self, memo: dict) -> "Pipeline":
        raise MobiusError(_NO_COPY.format(op="copied (copy.deepcopy)"))

    def __reduce_ex__(self, protocol: int):
        raise MobiusError(_NO_COPY.format(op="pickled or saved (pickle, torch.save, copy.copy)"))

    def schedule_ir(self, values: Mapping[str, torch.Tensor] | None = None, *, optimizer: bool = False):
        """The step this pipeline runs, as the schedule IR (mobius_fx/schedule.py): weight and
        gradient bytes from its GPU slots; activation bytes from `values`, one micro-batch's
        tensor (real or meta) per value name of the traced graph (absent: 0 bytes). A value's
        gradient flows back when it is floating and not a model input. `transfer_stats(
        last_step=True, by_stage=True)` after a training step equals `ir.bytes_moved()`.
        """
        from .schedule import StageInput, StageIO, build_schedule

        values = dict(values or {})

        def size(name: str) -> int:
            t = values.get(name)
            if t is None:
                return 0
            cast = self._rt.dtype if self._rt.dtype is not None and t.is_floating_point() else t.dtype
            return t.numel() * cast.itemsize

        def floating(name: str) -> bool:
            t = values.get(name)
            return t is not None and t.is_floating_point()

        specs = self.schedule.stages

        def value(ref) -> str:  # the traced graph's name of a value crossing stages
            return specs[ref.stage].outputs[ref.index] if ref.stage >= 0 else ref.name

        ios = []
        for spec, st in zip(specs, self._rt.stages):
            grads = sum(nbytes(s) for j, s in enumerate(st.slots) if st.is_param[j] and st.masters[j].requires_grad)
            ios.append(StageIO(
                gpu=spec.gpu, weight_bytes=st.weight_bytes, grad_bytes=grads,
                inputs=tuple(StageInput(ref.stage, size(value(ref)), needs_grad=ref.stage >= 0 and floating(value(ref)))
                             for ref in spec.inputs),
                host_outputs=tuple(size(spec.outputs[j]) for j in self.schedule.to_host[spec.index])))
        return build_schedule(ios, self.schedule.microbatches, optimizer=optimizer)

    def memory_stats(self) -> dict[str, dict[str, int]]:
        """Bytes each GPU of the topology holds now and held at peak, one entry per GPU, used by a
        stage or not. The books see every byte: weight slots, gradient sums, and every tensor a
        stage's work creates on the GPU (forward intermediates, recompute, activation and fresh
        weight gradients, temporaries) while it lives, each storage counted once."""
        return {name: dev.stats() for name, dev in self._rt.devices.items()}

    def stage_peaks(self) -> list[int]:
        """Per stage, the most its GPU held while the stage worked (forward calls, backward
        calls), less what the GPU held for other stages meanwhile (their weights and gradient
        sums): what the plan's `Stage.peak_bytes` predicts (0 for a stage that has not run)."""
        return [st.device.stage_peaks.get(k, 0) for k, st in enumerate(self._rt.stages)]

    def reset_peak_memory_stats(self) -> None:
        for dev in self._rt.devices.values():
            dev.reset_peak()

    def executed_ops(self) -> list[tuple[str, str, int, str, int | None]]:
        """What the last step executed, in order: (kind, gpu, stage, phase, micro-batch) for every
        weight prefetch, wait, stage run (forward, or backward with its recompute; micro-batch
        set) and eviction that acted. A step's order to check against its schedule IR: every run
        after a wait for its stage, every wait after its prefetch, at most the IR's resident
        stages per GPU (tests/unit/test_schedule_ir.py)."""
        return list(self._rt.executed)

    def transfer_stats(self, *, last_step: bool = False, by_stage: bool = False) -> dict[str, dict]:
        """Per GPU: copies and bytes moved per "kind direction" ("weight h2d", "gradient d2h",
        "activation d2d", "input d2h" — a stage input saved for backward —, ...), since the
        pipeline was built or, with `last_step`, since the last forward began (that forward and
        its backward); with `by_stage`, per "kind direction" and stage, as the schedule IR books
        them (`schedule_ir().bytes_moved()`)."""
        return {name: dev.log.as_dict(since_mark=last_step, by_stage=by_stage) for name, dev in self._rt.devices.items()}

    @property
    def devices(self) -> dict[str, Device]:
        return dict(self._rt.devices)

    def _apply(self, fn, recurse=True):  # .to / .cuda / .half / .float ...
        raise MobiusError("a Pipeline keeps the master weights on the CPU and copies them to its GPUs itself; move or "
                          "cast the model before compiling it, not the pipeline")
