"""The step executor: `pipe.train_step` runs its schedule IR op by op, forward and backward.

The schedule IR (mobius_fx/planning/schedule_ir.py) is the whole step as plain data: uploads,
waits, each stage's forward and backward per micro-batch, the sends of activations and of their
gradients, the offloads and restores of saved inputs, the gradient downloads and the evictions.
`StepExecutor` runs it as one generated program (runtime/step_program.py: a torch.fx
GraphModule with one node per op, in issue order, each op's dependencies its node's arguments)
whose nodes call one handler per `OpKind` and phase, on the runtime's existing machinery
(`engine.Runtime`: its stage slots, the devices' streams and events, precision casts, RNG
save/restore for the recompute, buffers updated once, the host gradient storage), so what the
runtime does is the IR by construction, and any schedule whose IR the runtime can hold runs:

    pipe = mobius_fx.compile(model, topo, example_inputs=(x,), loss_fn=F.cross_entropy,
                             schedule="mobius-noprefetch")
    loss = pipe.train_step(x, target=y)       # every op of step_ir(pipe.step_pipeline, ...)

- forward `run` (k, i): the stage call without an autograd graph, its inputs saved for backward
  (to the host when they came from a GPU: the IR's `offload`, issued by the run as the stage
  reads them; kept on the host when they came from there);
- the step's output: the micro-batches' host copies combined as compile's analysis says, with
  autograd on the host only (scalars: a loss's sums and counts), which gives each host copy its
  gradient -- the seeds of the backward;
- backward `run` (k, i): the saved inputs back on the GPU (`restore`, or `send ... input` for
  those kept on the host), the stage recomputed under its saved RNG and autocast state with
  autograd inside the stage, the input gradients routed as the IR's gradient `send`s say, the
  weight gradients summed on the GPU;
- `download` (k): the stage's gradient sums to the host and, when they are complete, handed to
  the optimizer overlap (`pipe.overlap(opt, mode="sync")` steps them then: the IR's `step` is
  where the overlap puts it, or the user's `opt.step()`);
- the program runs as the backward of one autograd node over the trainable masters, so at the
  end autograd itself accumulates the host gradients into `.grad`, exactly as `loss.backward()`
  leaves them (hooks run; the optimizer overlap sees a backward reaching them).

The eager-style loop (`loss_fn(pipe(x), y).backward()`) keeps its autograd path
(runtime/stage_autograd.py); both read the same IR. Each IR is built once (docs/executor.md,
"Where each IR is built"): the Schedule's by `insert_transfers` (`Schedule.ir()`), the step IR
and its program by `built_step`, once per (schedule, which masters train).

Which schedules run: those registered with a runtime form (mobius_fx/schedules/registry.py
`runtime=`, a transform of the pipeline's Mobius IR): "mobius", "mobius-noprefetch" (each upload
issued after the stage before it on its GPU has finished), "mobius-identity-map" (compiled
on the identity cross map), "gpipe" (`ir_resident.resident`: every stage held on its GPU from its
forward upload to its backward evict, the GPU's slot pool planned from that IR, one slot per
stage), "roundpipe" (`ir_transforms.round_robin`: a stage's backward on the GPU RoundPipe's
rotation gives it), "split-head" (`ir_split_head.split_head`: the last stage's micro-batches
dealt to the GPUs, each GPU's partial weight gradient summed on the host) and "zero3-offload"
(`ir_data_parallel.data_parallel`: one replica per GPU on its dealt micro-batches, every stage
uploaded to every GPU, each GPU's gradient downloads summed on the host). An op on a stage at a
GPU other than its own runs on the stage's copy there (`_use`: slots of its own on that GPU, its
books and executed ops that GPU's; on another torch device, such as cuda:1 for a stage of
cuda:0, a module of its own with that device's constants: `_check_moves`, docs/executor.md
"Stages on other GPUs"), whose slot pool is planned from that IR; the stages' own
states are back after the step; a stage's gradients go to the optimizer overlap at its last
download. `compile(schedule=...)` refuses the others with the reason.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from mobius_fx.errors import BudgetError, MobiusError
from mobius_fx.kinds import HOST
from mobius_fx.planning.schedule_ir import Op, OpKind, ScheduleIR
from mobius_fx.runtime.device_books import Device, nbytes
from mobius_fx.runtime.device_rewrite import random_nodes
from mobius_fx.runtime.engine import Runtime
from mobius_fx.runtime.stage_state import Step, refuse_changed_masters
from mobius_fx.runtime import tied_sums
from mobius_fx.runtime.step_program import build_program, run_program
from mobius_fx.units import fmt_bytes

__all__ = ["StepExecutor", "away_from_home", "built_step", "execute", "step_ir"]

# The op kinds that act on a stage's state on the op's GPU (its weights, its gradient sums): the
# executor runs them on the stage's copy there (`StepExecutor._use`).
_ON_A_STAGE = (OpKind.PREFETCH, OpKind.WAIT, OpKind.RUN, OpKind.EVICT, OpKind.HOLD, OpKind.DOWNLOAD)


def step_ir(pipe: Any, form: Callable[[ScheduleIR], ScheduleIR] | None = None) -> ScheduleIR:
    """The schedule IR `pipe`'s executor runs: the pipeline's own IR (`Pipeline.schedule_ir`, its
    gradient flags from each stage value's dtype as the traced graph records it; activations 0
    bytes: the executor needs the ops, not their sizes; each stage's optimizer `step` on the
    host after its download), transformed by the schedule's runtime
    form (`schedules.get(name).runtime`; None: Mobius's own). Built anew at each call: the runtime
    reads the one `built_step` keeps."""
    values: dict[str, torch.Tensor] = {}
    for spec in pipe.schedule.stages:
        out = next(n for n in spec.module.graph.nodes if n.op == "output").args[0]
        nodes = list(out) if isinstance(out, (tuple, list)) and len(out) == len(spec.outputs) else [None] * len(spec.outputs)
        for name, node in zip(spec.outputs, nodes):
            meta = getattr(node, "meta", {})
            dtype = getattr(meta.get("val", meta.get("tensor_meta")), "dtype", None)
            # unknown: taken as floating, so a gradient may flow (one that does not is simply not sent)
            values[name] = torch.empty(0, dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32,
                                       device="meta")
    ir = pipe.schedule_ir(values, optimizer=True)  # with each stage's `step`, where the optimizer takes it
    return ir if form is None else form(ir)


def _form(pipe: Any) -> tuple[str, Callable[[ScheduleIR], ScheduleIR] | None]:
    """`pipe.schedule_form`, (name, runtime form), set by `compile(schedule=...)`; Mobius's by default."""
    return pipe.__dict__.get("schedule_form") or ("mobius", None)


def _trains(rt: Runtime) -> tuple[bool, ...]:
    """Which masters train now: it decides which stages run backward, so a layer frozen or
    unfrozen since the last step gets the IR of the step as it is now."""
    return tuple(m.requires_grad for st in rt.stages for m in st.masters)


def built_step(pipe: Any) -> tuple[ScheduleIR, fx.GraphModule]:
    """The step IR (`step_ir`) of `pipe` (a step pipeline) under its schedule and its step program
    (runtime/step_program.py `build_program`), built once per (schedule, which masters train) and
    kept on its runtime: the executor runs them, `pipe.code` (step_code.py) prints that program.
    Nothing here runs or allocates."""
    rt = pipe._rt
    name, form = _form(pipe)
    key = (name, _trains(rt), rt.widens_gradients())  # widened downloads move other bytes (and sum tied weights)
    built = rt.__dict__.get("_built_step")
    if built is None or built[0] != key:
        ir = step_ir(pipe, form)
        built = rt._built_step = (key, ir, build_program(ir, tuple(pipe.schedule.inputs), name))
    return built[1], built[2]


def away_from_home(ir: ScheduleIR, gpus: list[str]) -> dict[tuple[int, str], set[str]]:
    """{(stage, GPU): phases} of the ops `ir` runs on a stage's state at a GPU other than the
    stage's own (`gpus[k]`): where the executor runs a copy of the stage (`StageState.copy_on`)."""
    away: dict[tuple[int, str], set[str]] = defaultdict(set)
    for o in ir.ops:
        if o.kind in _ON_A_STAGE and o.place != gpus[o.stage]:
            away[(o.stage, o.place)].add(o.phase)
    return away


def execute(pipe: Any, flat: list, scale: float) -> Any:
    """Run one training step of `pipe` (a step pipeline, inside its `_forward`) on its inputs
    `flat`, the backward seeded with `scale` x the loss; returns the (detached) output. The
    schedule is `pipe.schedule_form`, (name, runtime form), set by `compile(schedule=...)`; the
    executor is made again when it, which masters train or whether the gradient downloads widen
    changed (`built_step`)."""
    rt = pipe._rt
    ex = rt.__dict__.get("_step_executor")
    if ex is None or ex.name != _form(pipe)[0] or ex.trains != _trains(rt) or ex.widens != rt.widens_gradients():
        ex = rt._step_executor = StepExecutor(pipe)
    return ex.run(flat, scale)


class StepExecutor:
    """Interprets the schedule IR of one compiled step pipeline (see the module docstring); one
    handler per op kind and phase (`_forward_handlers`, `_backward_handlers`)."""

    def __init__(self, pipe: Any) -> None:
        name, form = _form(pipe)
        self.name = name
        self.rt = pipe._rt
        self.schedule = pipe.schedule
        self.program = pipe.program
        self.trains = _trains(self.rt)
        self.widens = self.rt.widens_gradients()  # widened downloads sum a tied weight on a GPU: other ops
        # the step IR and its program, built once (`built_step`; `pipe.code` prints the same program)
        self.ir, self.step_gm = built_step(pipe)
        self.stages = self.schedule.stages
        self.m = self.ir.microbatches
        self.to_host = self.schedule.to_host or tuple(() for _ in self.stages)
        # which inputs carry a gradient back and which stages run backward: the IR's own rule
        self.grad_in: list[list[bool]] = []
        self.has_bwd: list[bool] = []
        for k, io in enumerate(self.ir.stages):
            self.grad_in.append([inp.needs_grad and (inp.source < 0 or self.has_bwd[inp.source]) for inp in io.inputs])
            self.has_bwd.append(io.grad_bytes > 0 or any(self.grad_in[k]))
        self.backward = {o.stage for o in self.ir.ops if o.kind == OpKind.RUN and o.phase == "backward"}
        # the stages whose download sums a tied weight's partials on their GPU (runtime/tied_sums.py),
        # and those downloaded from several GPUs (partials the host sums: never widened)
        self.gpu_sums = {o.stage for o in self.ir.ops if _partial(o)}
        downloads = Counter(o.stage for o in self.ir.ops if o.kind == OpKind.DOWNLOAD)
        self.split_downloads = {k for k, n in downloads.items() if n > 1}
        # the GPU of each (stage, micro-batch)'s forward and backward run: a RUN op's place (RoundPipe
        # runs a stage's backward on another GPU than its forward; split-head deals its last stage
        # by micro-batch)
        self.frun: dict[tuple[int, int], str] = {}
        self.brun: dict[tuple[int, int], str] = {}
        for o in self.ir.ops:
            if o.kind == OpKind.RUN:
                (self.frun if o.phase == "forward" else self.brun)[(o.stage, o.microbatch)] = o.place
        self._place_copies(name, form)
        # per micro-batch, how many ops read each stage output on its GPU (a push, a run on the same GPU, a host copy)
        self.readers: dict[tuple[int, int], int] = defaultdict(int)
        for k, spec in enumerate(self.stages):
            for ref in spec.inputs:
                if ref.stage >= 0 and ref.stage == k - 1:
                    self.readers[(ref.stage, ref.index)] += 1
            for j in self.to_host[k]:
                self.readers[(k, j)] += 1
        self._forward_handlers = {
            OpKind.PREFETCH: self._prefetch, OpKind.WAIT: lambda o: self.rt.wait(o.stage),
            OpKind.RUN: self._run_forward, OpKind.SEND: self._send_forward, OpKind.OFFLOAD: self._offload,
            OpKind.EVICT: lambda o: self.rt.evict(o.stage), OpKind.HOLD: lambda o: self.rt.hold(o.stage),
            OpKind.STEP: self._step, OpKind.COLLECTIVE: self._collective}
        self._backward_handlers = {
            OpKind.PREFETCH: self._prefetch, OpKind.WAIT: self._wait_backward,
            OpKind.RESTORE: self._restore, OpKind.RUN: self._run_backward, OpKind.SEND: self._send_backward,
            OpKind.DOWNLOAD: self._download, OpKind.EVICT: lambda o: self.rt.evict(o.stage),
            OpKind.STEP: self._step, OpKind.COLLECTIVE: self._collective}
        self._optimizer_handlers = {OpKind.STEP: self._step}

    def _place_copies(self, name: str, form: Callable[[ScheduleIR], ScheduleIR] | None) -> None:
        """A copy of each stage the IR runs on a GPU besides its own (`StageState.copy_on`;
        RoundPipe's backward, split-head's dealt last stage, ZeRO-3's replicas; `_check_moves`),
        and the slot pools planned from the IR when it runs stages away from their
        GPU or keeps more stages on a GPU at once than the pipeline's own IR (GPipe's, every stage
        resident: a slot each). A GPU too small for that pool is refused naming the stages, the
        GPU and the bytes."""
        away = away_from_home(self.ir, [spec.gpu for spec in self.stages])
        self.moves = bool(away)
        # the stages whose forward runs on several GPUs (split-head's dealt last stage)
        self.dealt = {k for k in range(len(self.stages)) if len({g for (j, _), g in self.frun.items() if j == k}) > 1}
        self._check_moves(name, away)
        home = {(k, st.device.name): st for k, st in enumerate(self.rt.stages)}
        self.copies: dict[tuple[int, str], Any] = {
            **home, **{(k, g): self.rt.stages[k].copy_on(self.rt.devices[g], self.rt.dtype) for k, g in away}}
        self.home = [self.rt.stages[k] for k in range(len(self.stages))]
        self.acc_of: dict[tuple[int, str], dict] = {}  # (stage, GPU) -> the gradient sums of a copy not in use now
        # the last download of each stage: its gradients are complete on the host then (split-head: one per GPU)
        self.last_download = {o.stage: o.index for o in self.ir.ops if o.kind == OpKind.DOWNLOAD}
        # the slots the IR's order gives each (stage, phase, GPU) (`Runtime._plan_slots`)
        own = self.ir.resident_at_most()
        base = self.schedule.ir().resident_at_most() if form is not None else own
        holds = {g for g in self.ir.gpus if own.get(g, 0) > base.get(g, 0)}
        replaced: dict[str, list[int]] = {}
        self.slot_home = self.rt._plan_slots(self.ir, replaced) if self.moves or holds else None
        if self.slot_home is None:
            return
        for gpu in self.ir.gpus:
            try:
                self.rt.devices[gpu].open_pool()
            except BudgetError as e:
                for g, sizes in replaced.items():  # the pipeline's own pools as they were: it still runs
                    self.rt.devices[g].plan_slots(sizes, exact=True)
                    self.rt.devices[g].open_pool()
                there = sorted(k for k, g in away if g == gpu)
                if there:
                    phases = " and ".join(p for p in ("forward", "backward") if any(
                        p in away[(k, gpu)] for k in there))
                    size = sum(self.rt.stages[k].weight_bytes for k in there)
                    e.add_note(f"[mobius_fx] schedule '{name}' uploads stage(s) {there} on {gpu} for their {phases} "
                               f"({fmt_bytes(size)} of weights) beside the stages it runs as their own GPU: its "
                               f"slot pool is sized for them too; train with schedule='mobius', or give {gpu} more "
                               f"memory")
                if gpu in holds:
                    mine = [k for k, spec in enumerate(self.stages) if spec.gpu == gpu]
                    e.add_note(f"[mobius_fx] schedule '{name}' keeps {own[gpu]} stages resident on {gpu} at once "
                               f"(stages {mine}; the pipeline's own schedule: {base.get(gpu, 0)}): its slot pool "
                               f"holds all their weights; train with schedule='mobius', or give {gpu} more memory")
                raise

    def _check_moves(self, name: str, away: dict[tuple[int, str], set[str]]) -> None:
        """What running stages away from their GPU needs, checked before anything is allocated:

        - a copy on another torch device runs a module of its own (`StageState.copy_on`: its
          graph with that device's constants); on CUDA every copy is first replayed under fake
          tensors (`placement.check_placement` with `copies`), so an op that would see two
          devices is named now;
        - a GPU of another device type is refused (a stage's autocast and RNG are per type);
        - a stage that draws random numbers (dropout; `device_rewrite.random_nodes`) whose
          backward recomputes on another device than its forward ran on needs that device's
          generator, set to the state the forward's had, to draw what the forward drew
          (`Device.rng_differs`: CUDA GPUs of one model do); otherwise it is refused."""
        devices = self.rt.devices
        for (k, g), phases in sorted(away.items()):
            spec = self.stages[k]
            here, there = devices[spec.gpu].torch_device, devices[g].torch_device
            if here.type != there.type:
                what = "backward" if phases == {"backward"} else "forward and backward"
                raise MobiusError(
                    f"schedule '{name}' runs stage {k}'s {what} on {g} ({there}), a device of another type than its "
                    f"own GPU {spec.gpu} ({here}): a stage's autocast and random state are those of its device type. "
                    f"Give every GPU the same device type, or train with schedule='mobius'")
        randoms: dict[int, list[str]] = {}
        for (k, i), fg in sorted(self.frun.items()):
            bg = self.brun.get((k, i))
            if bg is None or bg == fg:
                continue
            why = devices[fg].rng_differs(devices[bg])
            if why is None:
                continue
            if k not in randoms:
                randoms[k] = random_nodes(self.rt.stages[k].module)
            if randoms[k]:
                nodes = randoms[k]
                raise MobiusError(
                    f"schedule '{name}' recomputes stage {k}'s micro-batch {i} on {bg} for its backward after its "
                    f"forward on {fg}, and the stage draws random numbers ({', '.join(nodes[:3])}"
                    f"{' ...' if len(nodes) > 3 else ''}): the recompute must draw what the forward drew, but {why}. "
                    f"Train with schedule='mobius' (each stage's backward on its forward's GPU), on GPUs of one "
                    f"model, or without dropout (p=0, or model.eval())")
        moved = defaultdict(set)
        for k, g in away:
            if devices[g].torch_device != devices[self.stages[k].gpu].torch_device:
                moved[k].add(g)
        placement = getattr(self.rt, "placement", None)
        if moved and placement is not None and placement.example is not None and any(
                devices[g].torch_device.type == "cuda" for gs in moved.values() for g in gs):
            from mobius_fx.runtime.placement import check_placement

            check_placement(self.schedule, placement.example, {g: d.torch_device for g, d in devices.items()},
                            placement.traced, copies=moved)

    def _handler(self, handlers: dict, o: Op) -> Callable[[Op], None]:
        """The handler of op `o` in its phase; an op kind the executor does not run in that phase is
        refused (the IR is not one it can follow), never skipped. An op on a stage's state runs on
        the stage's copy on the op's GPU (`_use`)."""
        h = handlers.get(o.kind)
        if h is None:
            raise MobiusError(f"op {o}: schedule {self.name!r}'s IR has a {o.kind} op in {o.phase}, which the step "
                              f"executor does not run in that phase; fix the schedule's runtime form "
                              f"(mobius_fx/planning/ir_transforms.py) or compile with schedule='mobius'")
        if o.kind in _ON_A_STAGE and self.moves:
            self._use(o.stage, o.place)
        return h

    def _use(self, k: int, gpu: str) -> None:
        """Make stage k's copy on `gpu` the runtime's stage k (`Runtime.stages[k]`): its slots bound
        into the stage's module, its gradient sums in the step's books (the other copy's kept aside)."""
        rt = self.rt
        cur = rt.stages[k]
        if cur.device.name == gpu:
            return
        new = self.copies.get((k, gpu))
        if new is None:
            raise MobiusError(f"internal: the schedule IR '{self.name}' acts on stage {k} on {gpu}, where the executor "
                              f"made no copy of it")
        step = rt.step
        if step is not None:
            acc = step.acc.pop(k, None)
            if acc:
                self.acc_of[(k, cur.device.name)] = acc
            acc = self.acc_of.pop((k, gpu), None)
            if acc:
                step.acc[k] = acc
        rt.stages[k] = new
        new.bind_slots()

    # ------------------------------------------------------------------ the step
    def run(self, flat: list, scale: float) -> Any:
        """One step: the step program built from the IR (runtime/step_program.py), whose nodes
        call these handlers."""
        return run_program(self, flat, scale)

    def _prefetch(self, o: Op) -> None:
        """Upload stage k to the GPU of the op (its copy there, `_use`: its own GPU, the one its
        backward runs on (RoundPipe's), one its micro-batch is dealt to (split-head's))."""
        self.rt.prefetch(o.stage)

    def _home(self) -> None:
        """Every stage's own state back in the runtime after the step (the eager-style loop runs
        Mobius's); after a failed step, the copies elsewhere freed (the runtime's abort frees the
        stages' own)."""
        if not self.moves:
            return
        rt = self.rt
        for (k, g), st in self.copies.items():
            if st is not self.home[k] and st.resident and st is not rt.stages[k]:
                st.device.cancel(st.token)
                st.token = None
                st.device.vacate(k, st.slots, st.weight_bytes)
                st.resident = False
        for k, st in enumerate(self.home):
            cur = rt.stages[k]
            if cur is not st and cur.resident:  # the step failed with this copy in use
                cur.device.cancel(cur.token)
                cur.token = None
                cur.device.vacate(k, cur.slots, cur.weight_bytes)
                cur.resident = False
            self._use(k, st.device.name)
        for (k, g), acc in self.acc_of.items():
            for t in acc.values():
                self.copies[(k, g)].device.free(nbytes(t))
        self.acc_of.clear()

    def _reset(self) -> None:
        self.calls: dict[tuple[int, int], Any] = {}  # (stage, mb) -> its StageCall (filled by Runtime.run)
        self.per_mb: dict[str, list] = {}
        self.outs: dict[tuple[int, int, int], Any] = {}  # (stage, output, mb) -> the value on its GPU
        self.uses: dict[tuple[int, int, int], int] = {}
        self.pushed: dict[tuple[int, int, int], Any] = {}  # (stage, input, mb) -> pushed onto its GPU
        self.fetched: dict[tuple[int, int, int], Any] = {}  # (stage, input, mb) -> sent from the host
        self.hosted: dict[tuple[int, int, int], Any] = {}  # (stage, output, mb) -> its host copy
        self.in_spans: dict[tuple[int, int], list[list[int]]] = {}  # (stage, mb) -> per input, its tensors' positions
        self.out_spans: dict[tuple[int, int], list[list[int]]] = {}  # ... per output
        self.back_in: dict[tuple[int, int], dict[int, torch.Tensor]] = defaultdict(dict)  # restored saved inputs
        self.events: dict[tuple[int, int], list] = defaultdict(list)
        self.gout: dict[tuple[int, int, int], list[list]] = {}  # (stage, output, mb) -> per tensor, gradient parts on its GPU
        self.ghost: dict[tuple[int, int, int], list] = {}  # (stage, output, mb) -> per tensor, its host copy's gradient
        self.outbox: dict[tuple[int, int], list[tuple[str, int, list]]] = defaultdict(list)  # input gradients to send
        self.host_grads_sent: dict[tuple[int, int], int] = defaultdict(int)

    def _split(self, flat: list) -> None:
        names, m = self.schedule.inputs, self.m
        if m > 1 and names:
            parts = self.rt.split(tuple(flat), m)
            self.per_mb = {name: [parts[j * m + i] for i in range(m)] for j, name in enumerate(names)}
        else:
            self.per_mb = {name: [flat[j]] * m for j, name in enumerate(names)}

    # ------------------------------------------------------------------ forward handlers
    def _take(self, k: int, j: int, i: int) -> Any:
        """Stage k's output j of micro-batch i, read once more (dropped after its last reader)."""
        key = (k, j, i)
        if key not in self.outs:
            raise MobiusError(f"the step reads output {j} ({self.stages[k].outputs[j]}) of stage {k}, micro-batch {i}, "
                              f"before stage {k} made it or after its last reader: the schedule IR '{self.name}' "
                              f"orders a send or run before the run it depends on")
        v = self.outs[key]
        self.uses[key] -= 1
        if self.uses[key] <= 0:
            del self.outs[key], self.uses[key]
        return v

    def _run_forward(self, o: Op) -> None:
        k, i, spec = o.stage, o.microbatch, self.stages[o.stage]
        args = []
        for j, ref in enumerate(spec.inputs):
            key = (k, j, i)
            if key in self.fetched:
                args.append(self.fetched.pop(key))
            elif key in self.pushed:
                args.append(self.pushed.pop(key))
            elif ref.stage >= 0 and ref.stage == k - 1 and self.frun.get((ref.stage, i)) == o.place:
                args.append(self._take(ref.stage, ref.index, i))
            else:
                raise MobiusError(f"stage {k}, micro-batch {i} on {o.place}: its input {j} ({ref.name}) never "
                                  f"arrived; the schedule IR '{self.name}' has no send bringing it before the run")
        result = self.rt.run(k, i, tuple(args))
        st = self.rt.stages[k]
        # a dealt stage's buffer the forward changed: seen by the recompute's books (`changing`) or,
        # on a stage run without a backward, by its version since the upload (only dealt stages pay)
        changed = (st.changing | {j for j in st.buffer_idx if j < len(st.versions)
                                  and st.slots[j]._version != st.versions[j]}) if k in self.dealt else set()
        if changed:
            raise MobiusError(f"schedule '{self.name}' deals stage {k}'s micro-batches to several GPUs, but its forward "
                              f"changes buffer(s) {', '.join(st.spec.weights[j].name for j in sorted(changed))} "
                              f"(running statistics, a counter): each GPU's copy would update its own, not micro-batch "
                              f"after micro-batch as eager does; compile with schedule='mobius' or 'roundpipe'")
        self.in_spans[(k, i)] = _spans(args)
        self.out_spans[(k, i)] = _spans(list(result))
        del args
        for j in range(len(spec.outputs)):
            n = self.readers.get((k, j), 0)
            if n:
                self.outs[(k, j, i)], self.uses[(k, j, i)] = result[j], n

    def _send_forward(self, o: Op) -> None:
        k, i, spec, rt = o.stage, o.microbatch, self.stages[o.stage], self.rt
        if o.dst == HOST:  # a host copy of output to_host[k][value]
            j = self.to_host[k][o.value]
            self.hosted[(k, j, i)] = rt.send(self._take(k, j, i), HOST, k)
            return
        ref = spec.inputs[o.value]
        if o.src == HOST:  # a model input, or a value made two or more stages before, from the host
            if ref.stage < 0:
                src = self.per_mb[ref.name][i]
            elif (ref.stage, ref.index, i) in self.hosted:
                src = self.hosted[(ref.stage, ref.index, i)]
            else:
                raise MobiusError(f"stage {k}, micro-batch {i} reads {ref.name} from the host before stage {ref.stage} "
                                  f"sent it there: the schedule IR '{self.name}' lacks that copy")
            self.fetched[(k, o.value, i)] = rt.send(src, o.dst, k)
        else:  # pushed from the stage before
            self.pushed[(k, o.value, i)] = rt.send(self._take(ref.stage, ref.index, i), o.dst, k)

    def _offload(self, o: Op) -> None:
        """The run saved this input as it read it (`Runtime._forward`: to the host when it came
        from a GPU); the op checks that the run did."""
        if (o.stage, o.microbatch) not in self.calls:
            raise MobiusError(f"the schedule IR '{self.name}' offloads input {o.value} of stage {o.stage}, micro-batch "
                              f"{o.microbatch}, but that stage ran without saving inputs for a backward")

    def _step(self, o: Op) -> None:
        """A stage's optimizer step: the optimizer overlap takes each stage's gradients as its
        download completes them (`pipe.overlap(opt, mode="sync")`), or the user's `opt.step()`."""

    def _collective(self, o: Op) -> None:
        raise MobiusError(f"op {o}: the runtime has no handler for collectives (the simulator's ZeRO-3 routes its "
                          f"all-gathers and reduce-scatters through host memory; its runtime form, "
                          f"ir_data_parallel.data_parallel, uses uploads and gradient downloads instead); train with a "
                          f"schedule registered with a runtime form (e.g. 'mobius', 'zero3-offload')")

    # ------------------------------------------------------------------ backward
    def _check_done(self) -> None:
        """Everything the step started ended: every backward ran, every gradient sum went to the
        host, every stage left its GPU."""
        step = self.rt.step
        if self.calls:
            (k, i), *_ = sorted(self.calls)
            raise MobiusError(f"the schedule IR '{self.name}' never runs the backward of stage {k}, micro-batch {i} "
                              f"({len(self.calls)} backward runs missing); every forward run that saved inputs needs one")
        acc = sorted([(k, self.rt.stages[k].device.name) for k, a in step.acc.items() if a]  # a stage without
                     + [key for key, a in self.acc_of.items() if a])  # weights accumulates nothing
        if acc:
            k, gpu = acc[0]
            raise MobiusError(f"stage {k}'s weight gradients are still on {gpu} after the step: the schedule "
                              f"IR '{self.name}' has no download for them")
        left = sorted({(k, st.device.name) for (k, _), st in self.copies.items() if st.resident}
                      | {(k, st.device.name) for k, st in enumerate(self.rt.stages) if st.resident})
        if left:
            raise MobiusError(f"stage {left[0][0]} is still on {left[0][1]} after the step: the schedule IR "
                              f"'{self.name}' never evicts it")

    def _wait_backward(self, o: Op) -> None:
        k, rt = o.stage, self.rt
        step = rt.step
        if step.bwd_calls[k] == 0:
            refuse_changed_masters(rt.stages[k], step.param_versions.get(k, []), rt._places[k] if rt._places else [])
        rt.wait(k)

    def _restore(self, o: Op) -> None:
        """Input `o.value` of stage k's micro-batch i back on its GPU: restored from the host
        (`restore`), or sent again from the host where it was kept (`send ... input`)."""
        k, i, j = o.stage, o.microbatch, o.value
        call = self.calls.get((k, i))
        if call is None:
            raise MobiusError(f"the schedule IR '{self.name}' restores input {j} of stage {k}, micro-batch {i}, whose "
                              f"forward saved nothing (or whose backward already ran)")
        dev = self.rt.devices[o.dst]
        with dev.log.stage(k), dev.deferred() as events:
            for p in self.in_spans[(k, i)][j]:
                self.back_in[(k, i)][p] = self.rt._restore(dev, call.saved[p])
        self.events[(k, i)] += list(events)

    def _run_backward(self, o: Op) -> None:
        k, i, rt = o.stage, o.microbatch, self.rt
        st, step, spec = rt.stages[k], rt.step, self.stages[k]
        call = self.calls.pop((k, i), None)
        if call is None:
            raise MobiusError(f"the schedule IR '{self.name}' runs the backward of stage {k}, micro-batch {i}, which "
                              f"has no forward saved for it (or ran its backward already)")
        got = self.back_in.pop((k, i), {})
        missing = [p for p in range(len(call.saved)) if p not in got]
        if missing:
            spans = self.in_spans[(k, i)]
            which = sorted({j for j, ps in enumerate(spans) if set(ps) & set(missing)})
            raise MobiusError(f"the backward of stage {k}, micro-batch {i} on {o.place} needs its saved input(s) "
                              f"{which} ({', '.join(spec.inputs[j].name for j in which)}) on the GPU, but the schedule "
                              f"IR '{self.name}' never restored them before the run")
        call.restored = ([got[p] for p in range(len(call.saved))], self.events.pop((k, i), []))
        del got
        needs = [False] * len(call.saved)
        for j, ps in enumerate(self.in_spans[(k, i)]):
            if self.grad_in[k][j]:
                for p in ps:
                    needs[p] = True
        rt._did("run", k, i)
        dev = st.device
        with rt._working(k):
            grads: list = []
            for j in range(len(spec.outputs)):
                parts = self.gout.pop((k, j, i), None)
                for n in range(len(self.out_spans[(k, i)][j])):
                    got_n = [dev.accept(g) for g in (parts[n] if parts is not None else []) if g is not None]
                    grads.append(None if not got_n else got_n[0] if len(got_n) == 1 else torch.stack(got_n).sum(0))
            in_grads = rt._recompute(call, st, step, tuple(grads), needs)
            del grads
        step.bwd_calls[k] += 1
        del call
        for j, ref in enumerate(spec.inputs):
            if not self.grad_in[k][j]:
                continue
            gs = [in_grads[p] for p in self.in_spans[(k, i)][j]]
            if ref.stage == k - 1 and self.brun.get((ref.stage, i)) == o.place:  # the stage before, on this GPU: no copy
                self._add(self.gout, (ref.stage, ref.index, i), gs)
            else:
                self.outbox[(k, i)].append(("gpu" if ref.stage == k - 1 else "host", j, gs))

    @staticmethod
    def _add(book: dict, key: tuple, gs: list) -> None:
        parts = book.setdefault(key, [[] for _ in gs])
        for n, g in enumerate(gs):
            parts[n].append(g)

    def _send_backward(self, o: Op) -> None:
        """A copy in backward: a saved input kept on the host, sent again (`what` input); the
        gradient of a host copy, back to the stage that made it (host -> GPU); an input's
        gradient to the GPU of the stage before (GPU -> GPU) or into host memory (GPU -> host),
        where a value that skipped stages came from."""
        if o.what == "input":
            self._restore(o)
            return
        if _partial(o):  # a tied weight's gradient partial back to the GPU that sums it
            tied_sums.fetch_partial(self.rt.stages, self.rt.holders, o.stage, self._downloading())
            return
        k, i = o.stage, o.microbatch
        if o.src == HOST:  # the gradient of host output p of stage k, the next one with a gradient
            n = self.host_grads_sent[(k, i)]
            self.host_grads_sent[(k, i)] += 1
            io = self.ir.stages[k]
            ps = [p for p in range(len(self.to_host[k])) if not io.host_grads or io.host_grads[p]]
            j = self.to_host[k][ps[n]]
            dev = self.rt.devices[o.dst]
            gs = []
            for g in self.ghost.pop((k, j, i), []):
                if g is not None:
                    with dev.log.stage(k):
                        dev.log.add("activation", "h2d", nbytes(g))
                    g = _grad_onto(dev, g, None)
                gs.append(g)
            if gs:
                self._add(self.gout, (k, j, i), gs)
            return
        consumer = k + 1 if o.dst != HOST else k
        kind = "gpu" if o.dst != HOST else "host"
        box = self.outbox[(consumer, i)]
        at = next((n for n, e in enumerate(box) if e[0] == kind), None)
        if at is None:
            raise MobiusError(f"op {o}: stage {consumer}'s backward of micro-batch {i} has no input gradient to send "
                              f"{'to ' + o.dst}; the schedule IR '{self.name}' orders the send before the run")
        _, j, gs = box.pop(at)
        ref = self.stages[consumer].inputs[j]
        src_dev = self.rt.devices[o.src]
        if kind == "gpu":
            dst_dev = self.rt.devices[o.dst]
            out = []
            for g in gs:
                if g is not None:
                    with dst_dev.log.stage(ref.stage):
                        dst_dev.log.add("activation", "d2d", nbytes(g))
                    g = _grad_onto(dst_dev, g, src_dev)
                out.append(g)
            self._add(self.gout, (ref.stage, ref.index, i), out)
        else:
            host = self.hosted.get((ref.stage, ref.index, i))
            dtypes = [t.dtype for t in pytree.tree_leaves(host) if isinstance(t, torch.Tensor)] if host is not None else []
            key = (ref.stage, ref.index, i)
            acc = self.ghost.setdefault(key, [None] * len(gs))
            for n, g in enumerate(gs):
                if g is None:
                    continue
                with src_dev.log.stage(consumer):
                    src_dev.log.add("activation", "d2h", nbytes(g))
                g = _grad_to_host(src_dev, g, dtypes[n] if n < len(dtypes) else g.dtype)
                acc[n] = g if acc[n] is None else acc[n] + g

    def _downloading(self) -> Step:
        """The runtime's step, told what this IR does with the gradients it downloads: which
        stages sum a tied weight's partials on their GPU, which are downloaded from several GPUs."""
        step = self.rt.step
        step.gpu_sums, step.split_downloads = self.gpu_sums, self.split_downloads
        return step

    def _download(self, o: Op) -> None:
        """Stage k's gradient sums to the host; the masters they complete go to the optimizer
        overlap now (or wait for autograd's accumulation at the end of the step)."""
        rt, k = self.rt, o.stage
        rt._download(k, self._downloading())
        if (rt.overlap is not None or rt.reducer is not None) and o.index == self.last_download.get(k):
            rt._hand_over(k, rt.step)  # complete: split-head downloads a partial sum from each GPU it dealt k to


def _partial(o: Op) -> bool:
    """Whether `o` sends a tied weight's gradient partial from the host to the GPU that sums it
    (`schedule_ir.TiedSum`)."""
    return o.kind == OpKind.SEND and o.what == "gradient" and o.src == HOST


def _spans(values: list) -> list[list[int]]:
    """Per value, the positions of its tensors among all the values' tensors (pytree order)."""
    out, n = [], 0
    for v in values:
        count = sum(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(v))
        out.append(list(range(n, n + count)))
        n += count
    return out


def _grad_onto(dev: Device, g: torch.Tensor, frm: Device | None) -> torch.Tensor:
    """A gradient onto `dev` from GPU `frm` (None: the host): a copy on its stream where the
    device has streams; devices that compute in place take it when the stage's work accepts it."""
    return dev.grad_onto(g, frm, g.dtype)


def _grad_to_host(dev: Device, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A gradient from `dev` into host memory, in `dtype` (the host copy's)."""
    return dev.grad_to_host(g, dtype)
