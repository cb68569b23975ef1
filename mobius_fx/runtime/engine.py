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

Stage calls (mixed precision, micro-batches, batch statistics): mobius_fx/runtime/stage_calls.py.
The `Pipeline` module users call: mobius_fx/runtime/pipeline.py.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
import torch.fx as fx
from torch.fx.immutable_collections import immutable_dict, immutable_list

from mobius_fx.runtime import host_threads
from mobius_fx.runtime.device_books import Device, nbytes
from mobius_fx.kinds import HOST
from mobius_fx.errors import BudgetError, MobiusError
from mobius_fx.runtime.placement import sent_device
from mobius_fx.precision import Precision
from mobius_fx.runtime.python_state import sync_shells, user_path
from mobius_fx.runtime.host_gradients import GradHomes
from mobius_fx.runtime.stage_autograd import logged_grad
from mobius_fx.runtime.stage_calls import StageCalls
from mobius_fx.runtime.stage_state import StageCall, StageState, Step
from mobius_fx.runtime.microbatch_outputs import combine, guess_kind
from mobius_fx.planning.microbatch import split as split_inputs
from mobius_fx.runtime.streams import PENDING, tick
from mobius_fx.planning.schedule_ir import ScheduleIR
from mobius_fx.planning.stage_contract import Schedule

__all__ = ["Runtime"]

log = logging.getLogger("mobius_fx")

class Runtime(StageCalls):
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
        # the user's modules the stages call as leaves (through shells): their Python attributes are followed
        self.shell_users = {id(user) for st in self.stages for user, _ in st.shells}
        self.planned_rows = 0  # rows of the example batch the plan was made for (0: unknown)
        self.batch_dims: dict | None = None  # compile's batch_dims= (mobius_fx/planning/microbatch.py)
        self.analysed = False  # whether microbatch_outputs.prepare ran (at compile, or at the first call)
        self.output_kinds: list | None = None  # how each output leaf combines (microbatch_outputs.analyse); None: guess
        self.grad_homes = GradHomes()  # host gradient storage kept across steps (the optimizer overlap's hand-over)
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

    def _plan_slots(self, ir: ScheduleIR) -> dict[tuple[int, str, str], int]:
        """Walk each GPU's ops in the IR's order, giving each prefetched stage the first slot
        free then: the slots' count is the IR's resident stages on the GPU, each sized for the
        largest stage it takes; tell each device (`Device.plan_slots`) and return the slot of
        each (stage, phase, GPU)."""
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
            dev.plan_slots(sizes)
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


def _thaw(x: object) -> Any:
    """fx hands structured args over as immutable_list/immutable_dict; give users plain ones."""
    if isinstance(x, immutable_list):
        return [_thaw(v) for v in x]
    if isinstance(x, immutable_dict):
        return {k: _thaw(v) for k, v in x.items()}
    if type(x) is tuple:
        return tuple(_thaw(v) for v in x)
    return x
