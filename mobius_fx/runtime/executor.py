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
(runtime/stage_autograd.py); both read the same IR.

Which schedules run: those registered with a runtime form (mobius_fx/schedules/registry.py
`runtime=`, a transform of the pipeline's Mobius IR): "mobius", "mobius-noprefetch" (each upload
issued after the stage before it on its GPU has finished), "mobius-identity-map" (compiled
on the identity cross map), "gpipe" (`ir_resident.resident`: every stage held on its GPU from its
forward upload to its backward evict, the GPU's slot pool planned from that IR, one slot per
stage) and "roundpipe" (`ir_transforms.round_robin`: a stage's backward on
the GPU RoundPipe's rotation gives it; its `prefetch` there moves the stage's slots, books and
executed ops to that GPU, whose slot pool is planned from that IR, and the stages go back to
their own GPUs after the step) and "zero3-offload" (`ir_data_parallel.data_parallel`: one
replica per GPU on its dealt micro-batches, every stage uploaded to every GPU, each GPU's
gradient downloads summed on the host; the executor follows each op's GPU, and hands a stage's
gradients to the overlap at its last download). `compile(schedule=...)` refuses the others
with the reason.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from mobius_fx.errors import BudgetError, MobiusError
from mobius_fx.kinds import HOST
from mobius_fx.planning.schedule_ir import Op, OpKind, ScheduleIR
from mobius_fx.runtime.device_books import Device, nbytes
from mobius_fx.runtime.stage_state import refuse_changed_masters
from mobius_fx.runtime.step_program import run_program

__all__ = ["StepExecutor", "execute", "step_ir"]


def step_ir(pipe: Any, form: Callable[[ScheduleIR], ScheduleIR] | None = None) -> ScheduleIR:
    """The schedule IR `pipe`'s executor runs: the pipeline's own IR (`Pipeline.schedule_ir`, its
    gradient flags from each stage value's dtype as the traced graph records it; activations 0
    bytes: the executor needs the ops, not their sizes; each stage's optimizer `step` on the
    host after its download), transformed by the schedule's runtime
    form (`schedules.get(name).runtime`; None: Mobius's own)."""
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


def execute(pipe: Any, flat: list, scale: float) -> Any:
    """Run one training step of `pipe` (a step pipeline, inside its `_forward`) on its inputs
    `flat`, the backward seeded with `scale` x the loss; returns the (detached) output. The
    schedule is `pipe.schedule_form`, (name, runtime form), set by `compile(schedule=...)`."""
    rt = pipe._rt
    name, form = pipe.__dict__.get("schedule_form") or ("mobius", None)
    # which masters train decides which stages run backward: a layer frozen or unfrozen since
    # the last step gets the IR of the step as it is now
    trains = tuple(m.requires_grad for st in rt.stages for m in st.masters)
    ex = rt.__dict__.get("_step_executor")
    if ex is None or ex.name != name or ex.trains != trains:
        ex = StepExecutor(pipe, name, form)
        ex.trains = trains
        rt._step_executor = ex
    return ex.run(flat, scale)


class StepExecutor:
    """Interprets the schedule IR of one compiled step pipeline (see the module docstring); one
    handler per op kind and phase (`_forward_handlers`, `_backward_handlers`)."""

    def __init__(self, pipe: Any, name: str = "mobius", form: Callable[[ScheduleIR], ScheduleIR] | None = None) -> None:
        self.name = name
        self.rt = pipe._rt
        self.schedule = pipe.schedule
        self.program = pipe.program
        self.ir = step_ir(pipe, form)
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
        # where each stage's runs are (RoundPipe's rotation: its backward on another GPU than its
        # forward's; ZeRO-3's replicas: every stage on every GPU), and the GPU of each micro-batch's
        # forward and backward run of each stage
        self.ran_on: dict[tuple[int, str, int], str] = {}
        away: dict[int, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))  # stage -> GPU -> phases
        for o in self.ir.ops:
            if o.kind == OpKind.RUN:
                self.ran_on[(o.stage, o.phase, o.microbatch)] = o.place
                if o.place != self.stages[o.stage].gpu:
                    away[o.stage][o.place].add(o.phase)
        # how many gradient downloads each stage has (ZeRO-3's: one per GPU); the optimizer overlap
        # takes its gradients after the last
        self.download_count: dict[int, int] = defaultdict(int)
        for o in self.ir.ops:
            if o.kind == OpKind.DOWNLOAD:
                self.download_count[o.stage] += 1
        self.moves = bool(away)
        for k in sorted(away):
            gpu = self.stages[k].gpu
            here = self.rt.devices[gpu].torch_device
            for b, phases in sorted(away[k].items()):
                there = self.rt.devices[b].torch_device
                if here != there:
                    phase = "forward" if "forward" in phases else "backward"
                    raise MobiusError(
                        f"schedule '{name}' runs stage {k}'s {phase} on {b} ({there}) "
                        f"{'after its forward' if phase == 'backward' else 'besides its own GPU'} on {gpu} ({here}); "
                        f"the runtime moves a stage only between GPUs sharing one torch device (virtual, "
                        f"virtual-async): a stage's graph has its GPU's device constants (runtime/device_rewrite.py) "
                        f"and its recompute restores its forward GPU's RNG state. Train with schedule='mobius', or "
                        f"try '{name}' on device='virtual-async'")
        self._open_pools(name, form, away)
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

    def _open_pools(self, name: str, form: Callable[[ScheduleIR], ScheduleIR] | None, away: dict[int, dict[str, set[str]]]) -> None:
        """The slots the IR's order gives each (stage, phase) on each GPU: a schedule that runs a
        stage on a second GPU (`away`: stage -> GPU -> phases) sizes that GPU's pool for it too,
        one that keeps more stages on a GPU at once than the pipeline's own IR (GPipe's, every
        stage resident) a slot for each (`Runtime._plan_slots`); a pool over budget says why."""
        own = self.ir.resident_at_most()
        base = self.schedule.ir().resident_at_most() if form is not None else own
        holds = {g for g in self.ir.gpus if own.get(g, 0) > base.get(g, 0)}
        self.slot_home = self.rt._plan_slots(self.ir) if self.moves or holds else None
        if self.slot_home is not None:
            for gpu in self.ir.gpus:
                try:
                    self.rt.devices[gpu].open_pool()
                except BudgetError as e:
                    there = sorted(k for k in away if gpu in away[k])
                    if there:
                        phases = " and ".join(p for p in ("forward", "backward")
                                              if any(p in away[k][gpu] for k in there))
                        e.add_note(f"[mobius_fx] schedule '{name}' uploads stage(s) {there} on {gpu} for their "
                                   f"{phases} (a second GPU besides their own): its slot pool is sized for them too; "
                                   f"train with schedule='mobius', or give {gpu} more memory")
                    if gpu in holds:
                        mine = [k for k, spec in enumerate(self.stages) if spec.gpu == gpu]
                        e.add_note(f"[mobius_fx] schedule '{name}' keeps {own[gpu]} stages resident on {gpu} at once "
                                   f"(stages {mine}; the pipeline's own schedule: {base.get(gpu, 0)}): its slot pool "
                                   f"holds all their weights; train with schedule='mobius', or give {gpu} more memory")
                    raise

    def _handler(self, handlers: dict, o: Op) -> Callable[[Op], None]:
        """The handler of op `o` in its phase; an op kind the executor does not run in that phase is
        refused (the IR is not one it can follow), never skipped."""
        h = handlers.get(o.kind)
        if h is None:
            raise MobiusError(f"op {o}: schedule {self.name!r}'s IR has a {o.kind} op in {o.phase}, which the step "
                              f"executor does not run in that phase; fix the schedule's runtime form "
                              f"(mobius_fx/planning/ir_transforms.py) or compile with schedule='mobius'")
        return h

    # ------------------------------------------------------------------ the step
    def run(self, flat: list, scale: float) -> Any:
        """One step: the step program built from the IR (runtime/step_program.py), whose nodes
        call these handlers."""
        return run_program(self, flat, scale)

    def _prefetch(self, o: Op) -> None:
        """Upload stage k to the GPU of the op: its own, or the one its backward runs on
        (RoundPipe's), which the stage's slots, books and executed ops then follow."""
        st = self.rt.stages[o.stage]
        if not st.resident and st.device.name != o.place:
            st.device = self.rt.devices[o.place]
        self.rt.prefetch(o.stage)

    def _home(self) -> None:
        """Every stage back on its own GPU after the step (the eager-style loop runs Mobius's)."""
        if self.moves:
            for st, spec in zip(self.rt.stages, self.stages):
                if not st.resident:
                    st.device = self.rt.devices[spec.gpu]

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
        self.downloads_left = dict(self.download_count)  # per stage: its downloads not run yet this step

    def _split(self, flat: list) -> None:
        names, m = self.schedule.inputs, self.m
        if m > 1 and names:
            parts = self.rt.split(tuple(flat), m)
            self.per_mb = {name: [parts[j * m + i] for i in range(m)] for j, name in enumerate(names)}
        else:
            self.per_mb = {name: [flat[j]] * m for j, name in enumerate(names)}

    def _gpu(self, k: int) -> str:
        return self.stages[k].gpu

    def _dev(self, k: int) -> Any:
        return self.rt.stages[k].device

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
            elif ref.stage >= 0 and ref.stage == k - 1 and self.ran_on.get((ref.stage, "forward", i)) == o.place:
                args.append(self._take(ref.stage, ref.index, i))
            else:
                raise MobiusError(f"stage {k}, micro-batch {i} on {o.place}: its input {j} ({ref.name}) never "
                                  f"arrived; the schedule IR '{self.name}' has no send bringing it before the run")
        result = self.rt.run(k, i, tuple(args))
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
        held = sorted(k for k, acc in step.acc.items() if acc)  # a stage without weights accumulates nothing
        if held:
            k = held[0]
            raise MobiusError(f"stage {k}'s weight gradients are still on {self._dev(k).name} after the step: the schedule "
                              f"IR '{self.name}' has no download for them")
        left = [k for k, st in enumerate(self.rt.stages) if st.resident]
        if left:
            raise MobiusError(f"stage {left[0]} is still on {self._dev(left[0]).name} after the step: the schedule IR "
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
            if ref.stage == k - 1 and self.ran_on.get((ref.stage, "backward", i)) == o.place:  # the stage before, on this GPU: no copy
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

    def _download(self, o: Op) -> None:
        """Stage k's gradient sums to the host; the masters they complete go to the optimizer
        overlap now (or wait for autograd's accumulation at the end of the step)."""
        rt, k = self.rt, o.stage
        rt._download(k, rt.step)
        self.downloads_left[k] -= 1
        if (rt.overlap is not None or rt.reducer is not None) and self.downloads_left[k] == 0:
            rt._hand_over(k, rt.step)


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
