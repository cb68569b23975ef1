"""The `Pipeline`: the `nn.Module` a compiled model becomes. Calling it runs the schedule's
program (the ops of mobius_fx.planning.stage_contract on a `runtime.Runtime`); `mobius_fx.build.build_pipeline` builds it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from mobius_fx.runtime.device_books import Device, nbytes
from mobius_fx.errors import MobiusError
from mobius_fx.planning.plans import Plan
from mobius_fx.planning.stage_contract import Schedule, running
from mobius_fx.kinds import OVERLAP_DEFAULT, OVERLAP_MODES
from mobius_fx.planning.microbatch import batch_rows, declared
from mobius_fx.runtime.microbatch_outputs import prepare
from mobius_fx.runtime.module_hooks import HookState
from mobius_fx.runtime.python_state import PythonState, reads_training
from mobius_fx.runtime.engine import Runtime
from mobius_fx.runtime.model_face import ModelFace

log = logging.getLogger("mobius_fx")

__all__ = ["Pipeline"]

_NO_COPY = ("a Pipeline cannot be {op}: it holds GPU weight slots (storage freed between stages), streams and "
            "worker threads that belong to this process; copy or save the model instead (copy.deepcopy(model), "
            "torch.save(model.state_dict(), path) — the pipeline's weights are the model's) and compile the copy "
            "again with mobius_fx.compile")


class Pipeline(ModelFace, nn.Module):
    """A model compiled into a Mobius pipeline; call it like the model.

    Attributes: `plan` (the Plan it was built from, or None), `code` (the schedule as Python),
    `program` (the schedule GraphModule), `schedule` (stages and their modules), `model` (the
    user's model: `pipe.parameters()` are its master weights; `pipe.train()`/`eval()` reach it
    and, at the next call, the stages' leaf modules; a graph from torch.export has the mode it
    was traced in baked in, and a call in another mode warns). Outputs come back on the host,
    in the dtype autocast gives them when a `dtype` was given (matmul outputs in that dtype,
    fp32-list ops such as a loss in fp32). The pipeline cannot be moved or cast (`.to`, `.cuda`, `.half`): it copies the CPU
    masters to the GPUs itself; `.to()` its own device is a no-op, and Trainer and accelerate take it as a
    model (runtime/model_face.py, mobius_fx/trainer.py).

    pipe = build_pipeline(model, gm, stage_nodes=..., stage_gpus=..., gpu_budgets=..., microbatches=2,
                          example_inputs=(x,), device="virtual")
    pipe(x).sum().backward()     # gradients in model.parameters()' .grad
    pipe.memory_stats()["gpu0"]  # {'peak_bytes': ..., 'current_bytes': 0}
    """

    def __init__(self, model: nn.Module, gm: fx.GraphModule, schedule: Schedule, program: fx.GraphModule,
                 runtime: Runtime, plan: Plan | None, code: str) -> None:
        super().__init__()
        self.model = model
        self.plan = plan
        self.code = code
        object.__setattr__(self, "program", program)
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "_rt", runtime)
        object.__setattr__(self, "_gm", gm)
        object.__setattr__(self, "_warned_modes", None)
        object.__setattr__(self, "_calling", threading.Lock())  # one forward at a time (see forward)
        object.__setattr__(self, "_python_state", PythonState(model))  # attributes the graph baked in
        object.__setattr__(self, "_hooks", HookState(model, runtime.shell_users))  # hooks it cannot follow
        runtime.watch(model)
        self._show_model(model)  # forward's signature, config, .to(own device): runtime/model_face.py

    @property
    def code(self) -> str:
        """The schedule as Python: a model pipeline's forward program (what `pipe(x)` runs, with
        its backward as comments) and, once a training step is compiled (`loss_fn=`, or after the
        first `train_step`), that step's program after it -- the whole step, uploads to optimizer
        steps; a training step's (`step_pipeline`) own code is that step program as the executor
        runs it now (runtime/step_code.py: rebuilt when which layers train changes)."""
        from mobius_fx.runtime.step_code import step_code

        if self.__dict__.get("_step_code"):
            return step_code(self)
        step = self.step_pipeline
        if step is None:
            return self.__dict__["_code"]
        return (self.__dict__["_code"].rstrip("\n") + "\n\n\n# ---- the training step, as `pipe.train_step` runs it "
                "(`pipe.step_pipeline.code`):\n" + step_code(step))

    @code.setter
    def code(self, value: str) -> None:
        object.__setattr__(self, "_code", value)

    def forward(self, *args: object, **kwargs: object) -> Any:
        """Run the schedule on this call's inputs. One call at a time: a pipeline's GPU slots,
        streams and step book-keeping belong to the step in progress, so a second call from
        another thread (or from inside the first) is refused, not interleaved with it."""
        with self._one_call():
            return self._forward(args, kwargs)

    @contextlib.contextmanager
    def _one_call(self) -> Iterator[None]:
        """Hold the pipeline for one call, or refuse a second call while one runs."""
        if not self._calling.acquire(blocking=False):
            raise MobiusError("this pipeline is already running a forward (in another thread, or a hook that calls it "
                              "from inside its own forward); a pipeline runs one call at a time: call it from one "
                              "thread (a lock around pipe(...)), or compile one pipeline per thread, each over its "
                              "own copy of the model")
        try:
            yield
        finally:
            self._calling.release()

    def _forward(self, args: tuple, kwargs: dict) -> Any:
        from mobius_fx.tracing import flatten_inputs, trace_info

        meta = [tuple(t.shape) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_meta]
        if meta:
            raise MobiusError(f"an input of shape {meta[0]} is on the meta device (no data): a pipeline computes on "
                              f"real tensors; pass CPU tensors (meta inputs are for mobius_fx.plan, which only plans)")
        self._python_state.check(self._rt.shell_users)
        self._hooks.check()
        traced = trace_info(self._gm)
        if traced.modes and traced.front_end == "export":
            self._check_modes(traced.modes)
        elif traced.modes:  # fx: only `self.training` reads in modules it traced through are baked in
            cache = self.__dict__.setdefault("_mode_readers", {})
            readers = cache.get(id(self._rt))
            if readers is None:  # per runtime (a variant's stages have their own leaf modules)
                readers = cache[id(self._rt)] = tuple(id(m) not in self._rt.shell_users and reads_training(m)
                                                      for m in self.model.modules())
            self._check_modes(traced.modes, readers)
        flat = flatten_inputs(self._gm, args, kwargs)
        rt = self._rt
        marks = declared(self.model, args, kwargs, rt.batch_dims)
        rows = batch_rows(flat, self.schedule.microbatches, marks)  # refuses an empty batch before anything runs
        if not rt.analysed:  # built without example inputs: how outputs combine is found on this first call
            prepare(rt, self._gm, flat, self.schedule.microbatches, marks, self.model)
        rt.begin_step()
        rt.step.marks = marks
        rt.step.mb_rows = (rows or 0) // self.schedule.microbatches
        try:
            scale = self.__dict__.get("_executing")
            if scale is not None:  # train_step: the whole step, op by op from the schedule IR
                from mobius_fx.runtime.executor import execute

                out = execute(self, flat, scale)
            else:
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

    def _check_modes(self, traced: tuple[bool, ...], only: tuple[bool, ...] | None = None) -> None:
        """Warn, once per change, when the model's train/eval modes are not those its export
        graph was traced in: the graph goes on computing in the traced ones. `only` (torch.fx):
        the modules whose mode the graph baked in (their own code reads `self.training`; the
        leaf modules the stages call follow train()/eval())."""
        now = tuple(m.training for m in self.model.modules())
        if only is not None and len(only) == len(now):
            now = tuple(n if o else t for n, t, o in zip(now, traced, only))
        if now == traced or now == self._warned_modes or len(now) != len(traced):
            return
        object.__setattr__(self, "_warned_modes", now)
        name, was, module = next((n or "the model", t, m) for (n, m), t, k in zip(self.model.named_modules(), traced, now)
                                 if k != t)
        mode, other = ("train", "eval") if was else ("eval", "train")
        if only is not None:
            warnings.warn(f"{name} is in {other} mode, but its code reads `self.training` ({type(module).__name__}), "
                          f"which torch.fx baked into this pipeline's graph in the {mode} mode it was traced in: it "
                          f"still computes as in {mode} mode there. Compile the model again after model.{other}() to "
                          f"run it in {other} mode (a pipeline per mode), or make the branch a module of its own "
                          f"(nn.Dropout follows train()/eval())", stacklevel=3)
            return
        warnings.warn(f"{name} is in {other} mode, but this pipeline's graph came from torch.export, which fixed the "
                      f"{mode} mode it was traced in: it still computes as in {mode} mode (dropout, batch statistics, "
                      f"`self.training` branches). Compile the model again after model.{other}() to run it in "
                      f"{other} mode (a pipeline per mode), or make it traceable by torch.fx, whose graphs follow "
                      f"train()/eval()", stacklevel=3)

    def train_step(self, *args: object, target: object = None, **kwargs: object) -> torch.Tensor:
        """Forward, the loss and backward of one batch, with the loss on the last stage: only the
        loss leaves the GPUs, never the outputs it is computed from (an LLM's logits).

            pipe = mobius_fx.compile(model, topo, example_inputs=(x,), loss_fn=F.cross_entropy)
            loss = pipe.train_step(x, target=y)        # then opt.step(), or the overlap steps it
            loss = pipe.train_step(ids, labels=ids)    # HF: the model's own loss, no loss_fn

        Afterwards the masters' `.grad` is what `loss_fn(model(x), y).backward()` leaves; the
        returned loss is the whole batch's, detached. The step is its own compiled pipeline
        (mobius_fx/train_step.py), on this pipeline's devices, with its optimizer overlap."""
        return self._train_step(args, kwargs, target)

    def _train_step(self, args: tuple, kwargs: dict, target: object, scale: float = 1.0) -> torch.Tensor:
        """`train_step`, its backward from `scale` x the loss (HF Trainer's gradient accumulation:
        mobius_fx/trainer.py); the loss it returns is not scaled."""
        step = self.__dict__.get("_step")
        if step is None:
            raise MobiusError("train_step needs a pipeline made by mobius_fx.compile (it compiles the model with its "
                              "loss); this one was built by build_pipeline: call it and backward the loss yourself")
        if not torch.is_grad_enabled():
            raise MobiusError("train_step runs backward, but gradients are disabled here (torch.no_grad or "
                              "inference_mode); call pipe(x) for a forward only, or call train_step outside no_grad")
        a, k = step.arguments(args, kwargs, target)
        with self._one_call():
            program = step.get(a, k)
            rt, srt = self._rt, program._rt
            # the optimizer overlap, the data-parallel reducer and the host gradient storage are this pipeline's
            srt.overlap, srt.reducer, srt.grad_homes = rt.overlap, rt.reducer, rt.grad_homes
            object.__setattr__(program, "_executing", scale)  # forward, loss and backward: runtime/executor.py
            try:
                loss = program(*a, **k)
            finally:
                object.__setattr__(program, "_executing", None)
        return loss.detach()

    @property
    def step_pipeline(self) -> "Pipeline | None":
        """The compiled training step (`train_step`; its `plan` and `code`), or None before its first
        call when compile had no `example_target`."""
        step = self.__dict__.get("_step")
        return None if step is None else step.pipeline

    def __deepcopy__(self, memo: dict) -> "Pipeline":
        raise MobiusError(_NO_COPY.format(op="copied (copy.deepcopy)"))

    def __reduce_ex__(self, protocol: int):
        raise MobiusError(_NO_COPY.format(op="pickled or saved (pickle, torch.save, copy.copy)"))

    def schedule_ir(self, values: Mapping[str, torch.Tensor] | None = None, *, optimizer: bool = False,
                    widened: bool | None = None):
        """The step this pipeline runs, as the schedule IR (mobius_fx/planning/schedule_ir.py): weight and
        gradient bytes from its GPU slots; activation bytes from `values`, one micro-batch's
        tensor (real or meta) per value name of the traced graph (absent: 0 bytes). A value's
        gradient flows back when it is floating, not a model input, and a floating input or
        parameter of the stage that makes it reaches it (`Runtime.carries_grad`). `transfer_stats(
        last_step=True, by_stage=True)` after a training step equals `ir.bytes_moved()`.
        `widened`: whether the gradient downloads are widened to the masters' dtype on the GPUs
        (the optimizer overlap's, `Runtime.widens_gradients`; None: whether a backward now would):
        then a master one stage holds downloads its fp32 bytes, and a tied one's partials go back
        to the GPU of the stage holding it first, which downloads their sum (`TiedSum`); a stage
        a schedule downloads from several GPUs (split-head's, ZeRO-3's) is not widened.
        """
        from mobius_fx.planning.schedule_ir import StageIO, TiedSum, build_schedule
        from mobius_fx.runtime.tied_sums import tied_sums

        if values is not None and not isinstance(values, Mapping):
            raise MobiusError(f"schedule_ir(values={values!r}): values is a {type(values).__name__}; pass a dict of "
                              f"the traced graph's value names to one micro-batch's tensor (real or meta), or None "
                              f"for 0 activation bytes")
        bad = [k for k, t in (values or {}).items() if not isinstance(t, torch.Tensor)]
        if bad:
            raise MobiusError(f"schedule_ir(values=...): values[{bad[0]!r}] is a {type(values[bad[0]]).__name__}, "
                              f"not a tensor; give one micro-batch's tensor (real or meta) per value name")
        values = dict(values or {})
        if widened is None:
            widened = self._rt.widens_gradients()

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

        rt = self._rt.stages
        # a tied weight's partials summed on the GPU of the stage holding it first (runtime/tied_sums.py)
        tied = [tuple(TiedSum(srcs, nbytes(rt[k].slots[j]), rt[k].slots[j].numel() * rt[k].masters[j].element_size()
                              - nbytes(rt[k].slots[j]))
                      for j, srcs in tied_sums(rt, self._rt.holders, k).items()) if widened else ()
                for k in range(len(rt))]
        ios = StageIO.from_runtime(
            specs, self.schedule.to_host, weight_bytes=[st.weight_bytes for st in rt],
            grad_bytes=[sum(nbytes(s) if not (widened and self._rt.widened(st.masters[j], s.dtype))
                            else s.numel() * st.masters[j].element_size()
                            for j, s in enumerate(st.slots) if st.is_param[j] and st.masters[j].requires_grad)
                        for st in rt], tied_sums=tied,
            partial_grad_bytes=[sum(nbytes(s) for j, s in enumerate(st.slots) if st.is_param[j] and st.masters[j].requires_grad)
                                for st in rt],
            size=lambda ref: size(value(ref)),
            carries_grad=lambda ref: (ref.stage >= 0 and floating(value(ref))
                                      and self._rt.carries_grad(ref.stage, ref.index)),
            output_size=lambda k, j: size(specs[k].outputs[j]), output_grad=self._rt.carries_grad)
        return build_schedule(ios, self.schedule.microbatches, optimizer=optimizer)

    def overlap(self, optimizer: torch.optim.Optimizer, mode: str = OVERLAP_DEFAULT, *,
                shard: bool = False, refresh_copies: bool = True) -> torch.optim.Optimizer:
        """The optimizer to use in the training loop instead of `optimizer`, stepped off the
        pipeline's critical path (mobius_fx/runtime/overlap.py): "sync" steps each stage's parameters on a
        CPU worker as soon as its gradients are complete during backward (bit-identical to a serial
        step; when the loop clips or unscales gradients, or the optimizer has a step pre-hook, the
        update waits for opt.step() -- gradients still handed over during backward -- said once in
        the log; an optimizer whose update is not per parameter is stepped serially, said once:
        docs/overlap_semantics.md); "async" runs step t's update while step t+1 computes on weights one update old
        (RoundPipe's staleness 1); "none" returns `optimizer` unchanged. A pipeline overlaps one
        optimizer at a time: a new call waits for the previous one's work and detaches it.
        `shard=True` (data parallel, mode "sync"): each rank keeps optimizer state for and steps
        only its share of the parameters (balanced by bytes), their gradients reduced to it
        alone, and the new weights are broadcast from their owners at `step()` (ZeRO-1): R ranks
        divide the CPU optimizer's time and state by R; `.grad` is None on the other ranks, and
        `state_dict()` holds this rank's share (save one per rank). `refresh_copies=True`
        (the default; mode "sync", CUDA and virtual-async): each stage's step writes its new
        weights into the streamed copy the next step uploads, on the optimizer's worker, so the
        next step's uploads copy nothing (`refresh_weights()` says which edits of weights need a
        call of it).

            opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=1e-4), mode="sync")
            for x, y in data:
                loss = loss_fn(pipe(x), y); loss.backward(); opt.step(); opt.zero_grad()
        """
        from mobius_fx.runtime.overlap import OverlapOptimizer

        if mode not in OVERLAP_MODES:
            raise MobiusError(f"overlap mode={mode!r}; use one of {', '.join(OVERLAP_MODES)}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise MobiusError(f"pipe.overlap needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        masters = {id(m) for st in self._rt.stages for m, p in zip(st.masters, st.is_param) if p}
        theirs = [p for g in optimizer.param_groups for p in g["params"]]
        if not any(id(p) in masters for p in theirs):
            raise MobiusError(f"the optimizer's {len(theirs)} parameters include none of this pipeline's master weights; "
                              f"build it over the compiled model's parameters (model.parameters() or pipe.parameters())")
        old = object.__getattribute__(self, "_overlap") if "_overlap" in self.__dict__ else None
        if old is not None:
            old.close()  # its work finished, its worker threads ended
        self._rt.overlap = None
        object.__setattr__(self, "_overlap", None)
        if mode == "none" and not shard:
            return optimizer
        if self._rt.reducer is not None:
            self._rt.reducer.owners = None
        opt = OverlapOptimizer(self, optimizer, mode, shard=shard, refresh_copies=refresh_copies)
        if self.plan is not None and not self._widens_for(mode):
            opt.widen_downloads = False  # the plan's choice (`Plan.widen_rule`); the user may set it again
        object.__setattr__(self, "_overlap", opt)
        self._rt.overlap = opt  # sync steps stages during backward; async takes the gradients its update reads
        return opt

    def _widens_for(self, mode: str) -> bool:
        """Whether the overlap in `mode` may widen the gradient downloads on the GPUs: the plan's
        choice when it was timed for `mode` (`Plan.widen_for`), else the topology's rule
        (`host_step.widen_fits`: each GPU's links to the host its own and full duplex), said once
        in the log with the remedy (compile with optimizer_overlap=mode, which times the choice)."""
        plan = self.plan
        chosen = getattr(plan, "widen_downloads", None)
        if chosen is not None and getattr(plan, "widen_for", "") in ("", mode):
            return chosen
        from mobius_fx.planning.host_step import widen_fits

        rule = widen_fits(getattr(plan, "topology", None))
        if chosen is not None and chosen != rule:
            log.info("mobius_fx: the plan chose %s gradient downloads for optimizer_overlap=%r; under %r the "
                     "topology's rule downloads them %s (compile(..., optimizer_overlap=%r) times the choice for it)",
                     "widened" if chosen else "bf16", plan.widen_for, mode, "widened" if rule else "as streamed",
                     mode)
        return rule

    def check_placement(self, device: str = "cuda") -> int:
        """Replay every stage graph as it would run on `device` ("cuda": each GPU at its CUDA
        index; "cuda:1": all on that one) with fake tensors, and return the number of ops
        replayed: no memory and no GPU are needed, so a CPU-only machine checks a CUDA run.
        The stages are rewritten as binding them to that device rewrites them (device
        constants follow the stage, mobius_fx/runtime/placement.py) and get their inputs as the
        runtime hands them (every tensor input copied to the stage's device, non-tensors as
        they are, weights and buffers uploaded there). Raises a MobiusError naming the stage,
        the node and the two devices when one op would see tensors of two devices (a 0-dim
        CPU tensor is allowed, as torch allows it). Every compiled variant is checked. A
        training step compiled with a schedule that runs stages on other GPUs than their own
        (`compile(schedule="roundpipe" | "split-head" | "zero3-offload")`: `pipe.step_pipeline`)
        has those copies replayed too, each on its GPU's device, its graph moved there as the
        runtime moves it (for the variant that ran last; the executor checks a variant's copies
        on CUDA as it starts). `compile(..., device="cuda")` runs it before allocating anything
        (the copies: the step executor, before it allocates them).

        pipe = mobius_fx.compile(model, topology, example_inputs=(x,), device="virtual")
        pipe.check_placement("cuda")   # e.g. 412
        """
        from mobius_fx.runtime.placement import check_placement, target_devices

        variants = getattr(self, "_variants", None) or [None]
        total = 0
        for v in variants:
            schedule, rt = (self.schedule, self._rt) if v is None else (v.schedule, v.runtime)
            placement = rt.placement
            given = {g: d.torch_device for g, d in rt.devices.items()}
            targets = target_devices(schedule.gpus, given, placement.indices, device)
            total += check_placement(schedule, placement.example, targets, placement.traced,
                                     copies=self._copies() if v is None or v.runtime is self._rt else None)
        return total

    def _copies(self) -> dict[int, set[str]] | None:
        """{stage: the other GPUs its schedule runs it on} for a training step compiled with a
        schedule that moves stages (`compile(schedule=)`), else None."""
        form = self.__dict__.get("schedule_form")
        if form is None or form[1] is None:
            return None
        from mobius_fx.runtime.executor import away_from_home, built_step

        copies: dict[int, set[str]] = {}
        for k, g in away_from_home(built_step(self)[0], [spec.gpu for spec in self.schedule.stages]):
            copies.setdefault(k, set()).add(g)
        return copies

    def memory_stats(self) -> dict[str, dict[str, int]]:
        """Bytes each GPU of the topology holds now and held at peak, one entry per GPU, used by a
        stage or not. The books see every byte: weight slots, gradient sums, and every tensor a
        stage's work creates on the GPU (forward intermediates, recompute, activation and fresh
        weight gradients, temporaries) while it lives, each storage counted once. On CUDA and
        "virtual-async" the weight-slot pool is held from compile time on (`slot_pool_bytes`,
        part of `current_bytes` between steps; `release_slots()` frees it)."""
        return {name: dev.stats() for name, dev in self._rt.devices.items()}

    def stage_peaks(self) -> list[int]:
        """Per stage, the most its GPU held while the stage worked (forward calls, backward
        calls), less what the GPU held for other stages meanwhile (their weights and gradient
        sums): what the plan's `Stage.peak_bytes` predicts (0 for a stage that has not run)."""
        return [st.device.stage_peaks.get(k, 0) for k, st in enumerate(self._rt.stages)]

    def refresh_weights(self) -> None:
        """Stream every master again at its next upload. The streamed (pinned, `dtype=`) copies
        are kept across steps and made again only for masters whose storage or version counter
        changed: optimizer steps (fused ones too), `load_state_dict`, `p.data = t`, and in-place
        edits under `torch.no_grad()` are all seen. A write in place through `.data`
        (`p.data.clamp_(-c, c)`, a WGAN's clipping) bumps no version counter and keeps the
        storage: call this after one (on "virtual" every step copies anyway)."""
        for dev in self._rt.devices.values():
            forget = getattr(dev, "forget_pinned_copies", None)
            if forget is not None:
                forget()

    def release_slots(self) -> None:
        """Free the weight-slot pool each GPU keeps from compile time on (CUDA and
        "virtual-async"), e.g. before evaluating something else on the GPUs; the next step
        allocates it again. Refused while a backward is still to come for the stages a forward
        holds (between forward and backward); a forward whose graph was dropped lets them go."""
        rt = self._rt
        step = rt.step
        if step is not None and step.state == "forward" and not any(r() is not None for refs in step.calls.values()
                                                                     for r in refs):
            with rt._lock:  # its graph is gone (a loss computed with grad, then dropped): no backward can come
                for k, st in enumerate(rt.stages):
                    if st.resident:
                        rt.evict(k)
        if any(st.resident for st in rt.stages):
            held = [k for k, st in enumerate(rt.stages) if st.resident]
            raise MobiusError(f"stages {held} are resident (a forward whose backward has not run); run its "
                              f"backward before release_slots()")
        for dev in rt.devices.values():
            dev.close_pool()

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
