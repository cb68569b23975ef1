"""The runtime: runs a compiled Mobius schedule, forward by its program and backward by autograd.

`mobius_fx.build.build_pipeline` cuts the traced graph into stages (`passes.insert_transfers`),
emits the program (`passes.emit`, calling the ops of `mobius_fx.planning.stage_contract`) and returns a `Pipeline`,
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
  storage and copies the masters in, `evict` frees the storage again. On stream devices (CUDA
  and its CPU stand-in, mobius_fx/runtime/device_stream.py `StreamDevice`) that storage is a slot of a fixed
  per-GPU pool: as many slots as the schedule IR has stages resident on the GPU at once, each
  sized for the largest stage the IR's order puts in it (`_plan_slots`), refilled only after
  the events of its last use.
- Each `run_stage` call with autograd on is one `torch.autograd.Function`. Its forward runs the
  stage without building a graph, offloads its boundary inputs to host memory and saves the RNG
  state. Its backward re-fetches the stage if it was evicted (the stage the same GPU runs next
  in backward is prefetched as the first micro-batch starts), recomputes the stage with grad
  under the saved RNG state (dropout masks match), returns the input gradients and accumulates
  weight gradients on the GPU; after the stage's last micro-batch they go to the host and the
  stage is evicted. The forward creates stage calls stage-major, so autograd (which runs ready
  nodes newest first) finishes each stage before the next: at most two stages per GPU.
- Every stage call of a step hangs off one `Masters` node whose inputs are the trainable
  masters; autograd runs it after the step's last stage backward, and it hands autograd the
  host gradients — all at once, so a step that fails leaves `.grad`, the weights and the
  buffers as they were, frees every GPU copy, and the pipeline stays usable. Autograd puts
  them where eager would: `.grad` (hooks run), only the tensors of `backward(inputs=...)`, or
  the result of `torch.autograd.grad`; a backward that needs no master drops them.
- A forward that changes buffers (an EMA, spectral_norm's power iteration) changes them once:
  the backward's recompute starts from the buffers as that call's forward found them.
- Each step streams the tensors the model holds then: a parameter replaced after compile
  (`load_state_dict(sd, assign=True)`) is followed; one of another shape or dtype is refused.

Stage calls (the second half of `Runtime`, "stage calls": once the mixin `StageCalls` in a file of
its own): what a stage does on its GPU when the program or the step executor runs it, one stage
call of one micro-batch: in forward without a graph (`StageFunction`), in backward by
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

The `Pipeline` module users call: mobius_fx/runtime/pipeline.py.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
import torch.fx as fx
from torch.fx.immutable_collections import immutable_dict, immutable_list

from mobius_fx.errors import BudgetError, MobiusError
from mobius_fx.kinds import HOST
from mobius_fx.planning.microbatch import split as split_inputs
from mobius_fx.planning.schedule_ir import ScheduleIR
from mobius_fx.planning.stage_contract import Schedule
from mobius_fx.precision import Precision
from mobius_fx.runtime import host_threads, streamed_copies, tied_sums
from mobius_fx.runtime.device_books import Device, nbytes
from mobius_fx.runtime.host_gradients import GradHomes, finite_flag, host_gradient
from mobius_fx.runtime.microbatch_outputs import combine, guess_kind
from mobius_fx.runtime.placement import sent_device
from mobius_fx.runtime.python_state import sync_shells, user_path
from mobius_fx.runtime.stage_autograd import Masters, StageFunction, logged_grad
from mobius_fx.runtime.stage_state import OnHost, StageCall, StageState, Step, refuse_changed_masters
from mobius_fx.runtime.streams import PENDING, tick

__all__ = ["Runtime", "rebuild", "autocast_for", "NormsInFp32"]

log = logging.getLogger("mobius_fx")



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


class Runtime:
    """Executes the schedule ops on the devices, for one Pipeline."""

    def __init__(self, schedule: Schedule, devices: dict[str, Device], masters: list[list[torch.Tensor]],
                 precision: Precision) -> None:
        self.schedule = schedule
        self.m = schedule.microbatches
        self.devices = devices
        self.precision = precision
        self.dtype = dtype = precision.cast  # what uploads and activations are cast to; None: nothing is
        self.stages = [StageState(spec, devices[spec.gpu], ms, dtype) for spec, ms in zip(schedule.stages, masters)]
        self.step: Step | None = None
        ir = schedule.ir()
        self._bwd_prefetch: dict[int, list[int]] = {}  # stage -> stages the IR prefetches as it starts backward
        for o in ir.select(kind="prefetch", phase="backward"):
            waits = [ir.ops[d].stage for d in o.deps if ir.ops[d].kind == "wait"]
            self._bwd_prefetch.setdefault(waits[0], []).append(o.stage)
        self._diff_outputs: dict[int, list[bool] | None] = {}  # stage -> per output: may carry a gradient
        self._slot_home = self._plan_slots(ir)  # (stage, phase, GPU) -> the slot the IR's order gives it there
        for gpu in ir.gpus:  # the pools are allocated once, now, and reused step after step
            devices[gpu].open_pool()
        # one streamed copy per master on the host, read by every GPU that uploads it (streamed_copies.py)
        self.streamed_copies = streamed_copies.shared_copies(list(devices.values()))
        # the user's modules the stages call as leaves (through shells): their Python attributes are followed
        self.shell_users = {id(user) for st in self.stages for user, _ in st.shells}
        self.planned_rows = 0  # rows of the example batch the plan was made for (0: unknown)
        self.batch_dims: dict | None = None  # compile's batch_dims= (mobius_fx/planning/microbatch.py)
        self.analysed = False  # whether microbatch_outputs.prepare ran (at compile, or at the first call)
        self.output_kinds: list | None = None  # how each output leaf combines (microbatch_outputs.analyse); None: guess
        self.grad_homes = GradHomes()  # host gradient storage kept across steps (the optimizer overlap's hand-over)
        self.holders: dict[int, tuple[int, ...]] = {}  # id(master) -> the stages holding it (`widened`, tied_sums.py)
        for k, st in enumerate(self.stages):
            for m in {id(m) for m in st.masters}:
                self.holders[m] = (*self.holders.get(m, ()), k)
        self._from_host: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # GPU copy -> its host original
        self._lock = threading.RLock()
        self._anchor = torch.zeros((), requires_grad=True)
        self._places: list[list[tuple[nn.Module, str, str] | None]] = []  # where the model holds each master (watch)
        # What this step executed, in order: (kind, gpu, stage, phase, micro-batch or None) for
        # each prefetch, wait, run and evict that acted (`Pipeline.executed_ops`).
        self.executed: list[tuple[str, str, int, str, int | None]] = []
        self.stamps: list[int] = []  # streams.tick() of each executed op: orders them with the devices' host waits

    def _did(self, kind: str, k: int, i: int | None = None) -> None:
        phase = "backward" if self.step is not None and self.step.state == "backward" else "forward"
        self.executed.append((kind, self.stages[k].device.name, k, phase, i))
        self.stamps.append(tick())

    def _plan_slots(self, ir: ScheduleIR, replaced: dict[str, list[int]] | None = None
                    ) -> dict[tuple[int, str, str], int]:
        """Walk each GPU's ops in the IR's order, giving each prefetched stage the first slot
        free then: the slots' count is the IR's resident stages on the GPU, each sized for the
        largest stage it takes; tell each device (`Device.plan_slots`; the plans they replaced
        into `replaced`, by GPU) and return the slot of each (stage, phase, GPU)."""
        home: dict[tuple[int, str, str], int] = {}
        for gpu in ir.gpus:
            dev = self.devices[gpu]
            sizes: list[int] = []
            on: dict[int, int] = {}
            for o in ir.place(gpu):
                if o.kind == "prefetch":
                    used = set(on.values())
                    slot = next(i for i in range(len(sizes) + 1) if i not in used)
                    if slot == len(sizes):
                        sizes.append(0)
                    sizes[slot] = max(sizes[slot], dev.slot_bytes(self.stages[o.stage].slots))
                    on[o.stage] = home[(o.stage, o.phase, gpu)] = slot
                elif o.kind == "evict":
                    on.pop(o.stage, None)
            before = dev.plan_slots(sizes)
            if replaced is not None:
                replaced[gpu] = before
        return home

    # ------------------------------------------------------------------ weights
    def prefetch(self, k: int) -> None:
        st = self.stages[k]
        if st.resident:
            return
        for j, master in enumerate(st.masters):
            if st.is_param[j]:
                st.slots[j].requires_grad_(master.requires_grad)
        phase = "backward" if self.step is not None and self.step.state == "backward" else "forward"
        with st.device.log.stage(k):
            st.token = st.device.fill(k, st.slots, st.masters, st.weight_bytes, self._slot_home.get((k, phase, st.device.name)))
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
        st.device.vacate(k, st.slots, st.weight_bytes)
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

    def send(self, value: object, gpu: str, stage: int | None = None) -> Any:
        if isinstance(value, torch.Tensor):
            return self._send(value, gpu, stage)
        if isinstance(value, (int, float, bool, str, type(None))):
            return value
        where = None if gpu == HOST else self.devices[gpu].torch_device
        return pytree.tree_map_only((torch.Tensor, torch.device), lambda t: self._send(t, gpu, stage)
                                    if isinstance(t, torch.Tensor) else sent_device(t, where), value)

    def _send(self, t: torch.Tensor, gpu: str, stage: int | None) -> torch.Tensor:
        """Copy `t` to `gpu` (or the host) for `stage`, as the schedule IR says: the copy and,
        in backward, the gradient coming back are logged under that stage (a push to the next
        stage's GPU sends its gradient back to the producer, stage - 1)."""
        src = self._where(t)
        if t.requires_grad and not self._carries_grad(t):
            t = t.detach()  # no gradient can flow back through it: none is computed, copied or waited for
        if gpu == HOST:
            if src is None:
                return t
            with src.log.stage(stage):
                out = src.to_host(t)
            return logged_grad(out, src, "h2d", stage)
        dst = self.devices[gpu]
        if src is dst:
            return t
        cast = self.dtype if (src is None and self.dtype is not None and t.is_floating_point()) else None
        with dst.log.stage(stage):
            raw = dst.receive(t, src, cast)
        if src is None:
            out = logged_grad(raw, dst, "d2h", stage)
            self._from_host[id(out)] = (weakref.ref(out), t)
        else:
            out = logged_grad(raw, src, "d2d", None if stage is None else stage - 1)
        dst.track(out)
        return out

    def carries_grad(self, stage: int, index: int) -> bool:
        """Whether output `index` of stage `stage` may carry a gradient back (see `_carries_grad`);
        the schedule IR's `StageInput.needs_grad` for a value made by a stage."""
        flags = self._differentiable_outputs(stage)
        return True if flags is None or index >= len(flags) else flags[index]

    def _carries_grad(self, t: torch.Tensor) -> bool:
        """Whether a stage output may carry a gradient back. A stage call's outputs all require
        grad to autograd (it is one Function), but one that no floating input and no parameter
        of the stage reaches (a causal mask built from token ids, rotary tables from a buffer)
        gets none in eager: sent on as is, its receivers would compute and send back a gradient
        nobody uses -- through the host, with a wait, when it skips stages."""
        call = getattr(t.grad_fn, "call", None)
        if not isinstance(call, StageCall):
            return True
        flags = self._differentiable_outputs(call.stage)
        if flags is None or len(call.out_leaves) != len(flags) or t.output_nr >= len(call.out_pos):
            return True
        return flags[call.out_pos[t.output_nr]]

    def _differentiable_outputs(self, k: int) -> list[bool] | None:
        """Per output of stage k's graph: whether a floating input or a floating parameter of
        the stage reaches it (None: not a flat tuple of values, no answer)."""
        if k in self._diff_outputs:
            return self._diff_outputs[k]
        module = self.stages[k].module
        graph = getattr(module, "graph", None)
        flags = None
        if graph is not None:
            reach: dict[Any, bool] = {}

            def floating(node: fx.Node) -> bool | None:
                val = node.meta.get("val", node.meta.get("tensor_meta"))
                dtype = getattr(val, "dtype", None)
                return None if dtype is None else (dtype.is_floating_point or dtype.is_complex)

            for node in graph.nodes:
                if node.op == "placeholder":
                    reach[node] = floating(node) is not False
                elif node.op == "get_attr":
                    try:
                        obj = module.get_parameter(str(node.target))
                    except (AttributeError, TypeError):
                        obj = None
                    reach[node] = isinstance(obj, nn.Parameter) and (obj.is_floating_point() or obj.is_complex())
                elif node.op == "output":
                    out = node.args[0]
                    if isinstance(out, (tuple, list)):
                        flags = [reach.get(a, False) if isinstance(a, torch.fx.Node) else False for a in out]
                else:
                    r = any(reach.get(a, True) for a in node.all_input_nodes)
                    if node.op == "call_module":
                        r = r or any(p.is_floating_point() for p in module.get_submodule(str(node.target)).parameters())
                    reach[node] = r and floating(node) is not False
        self._diff_outputs[k] = flags
        return flags

    def split(self, inputs: tuple, m: int) -> tuple:
        """Split the call's inputs into micro-batches (mobius_fx/planning/microbatch.py: the batch is dim
        0 of the first batched input; `batch_dims` marks inputs batched or not)."""
        marks = self.step.marks if self.step is not None else {}
        out, mb = split_inputs(inputs, m, marks)
        if self.step is not None:
            self.step.mb_rows = mb
        return out

    def merge(self, outputs: list) -> Any:
        """One output from the micro-batches' outputs, each leaf combined as compile's analysis
        of the graph says (mobius_fx/runtime/microbatch_outputs.py `analyse`: concatenated, summed, averaged,
        max, min or micro-batch 0's); without an analysis, guessed (warned once at compile)."""
        for t in pytree.tree_leaves(outputs):  # values sent to the host asynchronously: the host reads them now
            PENDING.settle(t, "a model output")
        outputs = [_thaw(o) for o in outputs]
        if len(outputs) == 1:
            return outputs[0]
        flats = [pytree.tree_flatten(o) for o in outputs]
        spec = flats[0][1]
        rows = self.step.mb_rows if self.step is not None else -1
        kinds = self.output_kinds
        merged = []
        for j, leaves in enumerate(zip(*(f[0] for f in flats))):
            kind = kinds[j] if kinds is not None and j < len(kinds) else guess_kind(leaves[0], rows)
            merged.append(combine(kind, list(leaves)))
        return pytree.tree_unflatten(merged, spec)

    # ------------------------------------------------------------------ steps
    def watch(self, model: nn.Module) -> None:
        """Note where `model` holds each master (module, attribute), for `follow`."""
        where: dict[int, tuple[nn.Module, str, str]] = {}
        for path, mod in model.named_modules(remove_duplicate=False):
            for attr, t in (*mod._parameters.items(), *mod._buffers.items()):
                if t is not None:
                    where.setdefault(id(t), (mod, attr, user_path(model, f"{path}.{attr}" if path else attr)))
        self._places = [[where.get(id(m)) for m in st.masters] for st in self.stages]

    def follow(self) -> None:
        """Stream what the model holds now: a parameter or buffer replaced since `watch`
        (`load_state_dict(sd, assign=True)`, `module.weight = nn.Parameter(...)`) becomes its
        slot's master; one of another shape, dtype or device, or gone, is refused."""
        for st, places in zip(self.stages, self._places):
            for j, place in enumerate(places):
                if place is None:
                    continue
                mod, attr, name = place
                now, old = (mod._parameters if st.is_param[j] else mod._buffers).get(attr), st.masters[j]
                shape, dtype, device = st.kinds[j]  # the master's at compile
                if now is not None and (now.shape, now.dtype, now.device) == (shape, dtype, device):
                    st.masters[j] = now  # itself, or a replacement of its kind
                    continue
                if now is None:
                    what = "removed"
                elif now is old:  # model.double(), model.to(torch.bfloat16), p.data = another shape
                    what = f"changed in place to a {now.dtype} tensor of shape {tuple(now.shape)} on {now.device}"
                else:
                    what = f"replaced by a {now.dtype} tensor of shape {tuple(now.shape)} on {now.device}"
                raise MobiusError(f"the model's {'parameter' if st.is_param[j] else 'buffer'} `{name}` was {what} "
                                  f"after compile; the pipeline streams a {dtype} tensor of shape {tuple(shape)} on "
                                  f"{device} there (its plan, GPU slots and streamed copies were made for it): load "
                                  f"weights of that shape and dtype (load_state_dict without assign=True copies into "
                                  f"the compiled tensors), or compile the model again after changing it; to compute "
                                  f"in another precision keep the weights fp32 and compile with dtype=torch.bfloat16")

    def begin_step(self) -> None:
        host_threads.steer(self.devices.values())  # torch's thread counts: the plan's, for the cores free now
        if self.overlap is not None:
            self.overlap.before_forward()
        self.follow()
        with self._lock:
            old = self.step
            if old is not None and old.state == "backward":  # a backward that never finished
                self._drop(old)
            for k, st in enumerate(self.stages):
                if st.resident:
                    self.evict(k)
            self._from_host.clear()
            self.executed.clear()
            self.stamps.clear()
            for dev in self.devices.values():
                dev.new_step()
                dev.log.mark()
            streamed_copies.new_step(list(self.devices.values()))  # once per step, however many GPUs share it
            for st in self.stages:
                for user, shell in st.shells:  # train()/eval() and plain attributes (Dropout.p) changed since
                    sync_shells(user, shell)
            self.step = Step(len(self.stages))

    def end_forward(self) -> None:
        step = self.step
        with torch.no_grad():
            for master, thunk in step.buffers:
                master.copy_(thunk())
        step.buffers.clear()
        if not any(step.fwd_calls):
            step.state = "done"

    def _drop(self, step: Step) -> None:
        for k, acc in step.acc.items():
            for g in acc.values():
                self.stages[k].device.free(nbytes(g))
        step.acc.clear()
        self._forget_restored(step)
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

    def abort(self, step: Step | None = None) -> None:
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
                    st.device.vacate(k, st.slots, st.weight_bytes)
                    st.resident = False
            for dev in self.devices.values():
                dev.untrack_all()

    # ================================================================== stage calls

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
        # a stage with no gradient of its own may still be handed partials by the IR's sends
        widen = (bool(acc) or any(s == k for s, _ in step.partials)) and self._widens(step)
        sums = tied_sums.sums_at(self.stages, self.holders, k, step) if widen else {}
        for j in sums:  # a tied weight's partials summed here, into its `.grad` home (runtime/tied_sums.py)
            parts, master = tied_sums.partials(self.stages, self.holders, k, j, step), st.masters[j]
            g = acc.pop(j, None)
            if g is None:  # no gradient of its own this step: the host sums the partials, as streamed
                step.pending += [(master, lambda h=h: h) for h in parts]
                continue
            into = self.grad_homes.take(master, pinned=st.device.pins_host)
            with st.device.log.stage(k):
                step.pending.append((master, st.device.download(g, "gradient", into, addends=parts)))
            st.device.free(nbytes(g))  # booked by the backward (`claim`)
            del parts, g
        for j, g in acc.items():
            master = st.masters[j]
            # widened on the GPU straight into the master's `.grad` home: the host converts nothing
            into = (self.grad_homes.take(master, pinned=st.device.pins_host)
                    if widen and k not in step.split_downloads and self.widened(master, g.dtype)
                    and g.shape == master.shape else None)  # partials from several GPUs: as streamed
            with st.device.log.stage(k):
                step.pending.append((master, st.device.download(g, "gradient", into)))
            st.device.free(nbytes(g))
        del acc

    def widens_gradients(self) -> bool:
        """Whether a backward now would download the weight gradients the optimizer overlap
        hands over widened to the masters' dtype (fp32) on the GPUs, each straight into the
        storage the overlap keeps for `.grad` (`GradHomes`, pinned on CUDA): `pipe.overlap(opt,
        "sync" or "async")` with `keep_grads` (the fp32 `.grad` the loop reads), not speculating,
        `opt.widen_downloads` on (`OverlapOptimizer.widens`), no data-parallel reducer, a
        half-precision stream. Then each such gradient costs the GPU->host link the master's
        bytes (4 per parameter, not 2) and the host no conversion: `.grad` is the download, bit
        for bit what the host's conversion gave (a widening is exact)."""
        hook = self.overlap
        return (hook is not None and self.reducer is None and self.grad_homes is not None
                and self.dtype is not None and self.dtype.itemsize < 4
                and bool(getattr(hook, "widens", lambda: False)()) and hook.overlapping())

    def widened(self, master: torch.Tensor, streamed: torch.dtype) -> bool:
        """Whether `master`'s gradient, streamed in `streamed`, is downloaded widened (when the
        backward widens at all, `widens_gradients`): a trainable fp32 parameter held by ONE stage,
        streamed narrower (`widenable`). A tied weight's partials are downloaded as streamed and
        the stage holding it first sums them on its GPU into one widened download
        (runtime/tied_sums.py). The schedule IR books the same bytes (`Pipeline.schedule_ir`)."""
        return tied_sums.widenable(master, streamed) and len(self.holders.get(id(master), ())) == 1

    def _widens(self, step: Step) -> bool:
        """`widens_gradients`, decided once per backward (at its first flush)."""
        if step.widen is None:
            step.widen = self._overlaps(step) and self.widens_gradients()
        return step.widen

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


def _thaw(x: object) -> Any:
    """fx hands structured args over as immutable_list/immutable_dict; give users plain ones."""
    if isinstance(x, immutable_list):
        return [_thaw(v) for v in x]
    if isinstance(x, immutable_dict):
        return {k: _thaw(v) for k, v in x.items()}
    if type(x) is tuple:
        return tuple(_thaw(v) for v in x)
    return x
