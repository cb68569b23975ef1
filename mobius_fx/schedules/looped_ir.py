"""The schedule IR of a looped pipeline, the form the baselines (GPipe, ZeRO-3 offload, RoundPipe)
take: slots, each all micro-batches of one stage on one GPU, as ops of the one schedule IR
(mobius_fx/planning/schedule_ir.py) that `ir_tasks.tasks_from_ir` turns into simulator tasks.

    ir = LoopedIR()
    ir.pipeline(costs, [Slot("forward", 0, "gpu0"), Slot("backward", 0, "gpu0")], m)
    ir.host_steps(costs)                          # the CPU optimizer, per stage
    tasks_from_ir(ctx, ir.build(m), costs=costs)

Each op carries what the simulator cannot derive from a slot-free IR: its GPU's turn (`slot`,
the slot's position among that GPU's), when a copy is needed (`need`, the list position of the
slot that reads it) and the ops whose start it waits for (`starts`). A copy of no bytes is no op.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from mobius_fx.kinds import HOST
from mobius_fx.planning.schedule_ir import Op, ScheduleIR
from mobius_fx.sim.tasks import Costs

__all__ = ["Slot", "LoopedIR"]


@dataclass(frozen=True)
class Slot:
    """All micro-batches of stage `stage` on `gpu` (or those in `microbatches`, in that order:
    one stage's micro-batches dealt to several GPUs): its forward, its backward, or both
    ("fused": a forward that doubles as the backward's recompute, RoundPipe's last stage)."""

    phase: str  # forward | backward | fused
    stage: int
    gpu: str
    microbatches: tuple[int, ...] | None = None  # None: all of them, in order


@dataclass
class _Loop:
    """One `LoopedIR.pipeline` call: its slots, flags, and what earlier slots left for later ones."""

    c: Costs
    slots: Sequence[Slot]
    m: int
    resident: bool
    offload_activations: bool
    activations: bool
    loss_on_host: bool
    grads_to_host: bool
    host_collectives: float
    hold: bool = False
    seq: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # GPU -> its slots
    comp: dict[tuple[str, int], dict[int, int]] = field(default_factory=dict)  # (phase, stage) -> mb -> its run
    where: dict[tuple[str, int], dict[int, str]] = field(default_factory=dict)  # (phase, stage) -> mb -> its GPU
    first: dict[int, int] = field(default_factory=dict)  # slot -> its first run
    save: dict[tuple[int, int], int | None] = field(default_factory=dict)  # (stage, mb) -> offload of its input
    out: dict[int, int | None] = field(default_factory=dict)  # mb -> the model output sent to the host
    evict: dict[int, int] = field(default_factory=dict)  # slot -> its evict

    def __post_init__(self) -> None:
        for j, s in enumerate(self.slots):
            self.seq[s.gpu].append(j)
        self.pos = {j: p for js in self.seq.values() for p, j in enumerate(js)}
        self.last_stage = max(s.stage for s in self.slots)
        self.bslot = {(s.stage, i): j for j, s in enumerate(self.slots) if s.phase != "forward"
                      for i in self.mbs(s)}  # (stage, mb) -> the slot that reads its saved input
        self.done = len(self.slots)  # gradients: needed by the optimizer, after every slot

    def mbs(self, s: Slot) -> Sequence[int]:
        """The micro-batches slot `s` runs, in order."""
        return range(self.m) if s.microbatches is None else s.microbatches

    def reader(self, k: int, i: int) -> int:
        """The list position of the slot that reads stage k's saved input of micro-batch i (its
        backward, or its fused slot); after every slot when none does."""
        return self.bslot.get((k, i), self.done)


class LoopedIR:
    """A schedule IR under construction from looped pipelines (one or more: ZeRO-3 runs one per
    GPU), then the optimizer's ops; `build()` returns it."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.places: dict[str, list[int]] = defaultdict(list)
        self.gradients: dict[int, list[int]] = defaultdict(list)  # stage -> its gradient downloads

    def op(self, kind: str, place: str, stage: int, phase: str, deps: Sequence[int | None] = (),
           starts: Sequence[int | None] = (), **kw) -> int:
        i = len(self.ops)
        self.ops.append(Op(i, kind, place, stage, phase, deps=tuple(d for d in deps if d is not None),
                           starts=tuple(d for d in starts if d is not None), **kw))
        self.places[place].append(i)
        return i

    def copy(self, kind: str, gpu: str, stage: int, phase: str, src: str, dst: str, what: str, nbytes: float, *,
             slot: int, need: int, deps: Sequence[int | None] = (), starts: Sequence[int | None] = (),
             microbatch: int | None = None) -> int | None:
        """A copy of `nbytes` in `gpu`'s list; none (None) when there is nothing to move."""
        if nbytes <= 0:
            return None
        return self.op(kind, gpu, stage, phase, deps, starts, microbatch=microbatch, src=src, dst=dst, what=what,
                       bytes=nbytes, slot=slot, need=need)

    def pipeline(self, c: Costs, slots: Sequence[Slot], m: int, *, resident: bool = False,
                 offload_activations: bool = True, activations: bool = True, loss_on_host: bool = True,
                 grads_to_host: bool = True, host_collectives: float = 0.0, hold: bool = False) -> None:
        """The ops of a looped pipeline: each slot runs all `m` micro-batches of one stage on a GPU
        (costs `c`, per stage).

        Per GPU the slots run in list order. A slot's weights upload when the previous slot on
        that GPU starts, and not before the stage two back on that GPU is evicted (at most two
        resident; `resident`: every weight stays, nothing uploads or leaves); a slot that follows
        the same stage on the same GPU reuses its weights. Activations arrive from the GPU (or
        the host) that made them; saved boundary inputs (`offload_activations`) go to host memory
        after they arrive and come back for backward, the model input is sent again; the model
        output goes to the host for the loss (`loss_on_host`) and its gradient comes back;
        gradients go to the host after the last micro-batch (`grads_to_host`). `activations`
        False: no activation traffic at all. Copies rank by the slot that needs them (its list
        position; saved inputs by their backward slot, gradients last).
        `host_collectives` = f adds the host-routed half of ZeRO-3's collectives (GPUs without
        peer-to-peer, NCCL through host memory): with each upload of w bytes (the all-gather's
        receive side) the GPU sends f x w to host memory (its all-gather send) and the slot waits
        for both; with each gradient download of g bytes (the reduce-scatter's send side) it
        receives f x g from host memory. For a ring over N GPUs, f = (N-1)/N.
        `hold`: a stage whose backward runs later on the GPU that ran its forward keeps its weights
        there in between (uploaded once, evicted after its backward), and every upload starts as
        soon as its GPU's upload stream is free, in slot order, waiting for no eviction: the
        caller checks that what a GPU holds fits it.
        """
        loop = _Loop(c, slots, m, resident, offload_activations, activations, loss_on_host, grads_to_host,
                     host_collectives, hold)
        for j in range(len(slots)):
            self._slot(loop, j)

    def _slot(self, loop: _Loop, j: int) -> None:
        """Slot j of `loop`: its weights, then per micro-batch its inputs, its run and its output,
        then its gradients and its evict."""
        s, c = loop.slots[j], loop.c
        k, gpu, p = s.stage, s.gpu, loop.pos[j]
        mine = loop.seq[gpu]
        prev = loop.slots[mine[p - 1]] if p > 0 else None
        nxt = loop.slots[mine[p + 1]] if p + 1 < len(mine) else None
        phase = "forward" if s.phase == "forward" else "backward"
        trigger = [loop.first[mine[p - 1]]] if prev is not None else []
        memory = next((loop.evict[q] for q in reversed(mine[:max(0, p - 1)]) if q in loop.evict), None)
        fwd = loop.where.get(("forward", k), {})
        held = loop.hold and s.phase == "backward" and {fwd.get(i) for i in loop.mbs(s)} == {gpu}
        keep = loop.hold and s.phase == "forward" and any(loop.slots[q].stage == k and loop.slots[q].phase == "backward"
                                                          for q in mine[p + 1:])
        up = gather = None
        if not (loop.resident or held or (prev is not None and prev.stage == k)):
            up = self.copy("prefetch", gpu, k, phase, HOST, gpu, "weight", c.w[k], slot=p, need=j,
                           deps=[None if loop.hold else memory], starts=[] if loop.hold else trigger)
        if up is not None and loop.host_collectives > 0:
            gather = self.copy("collective", gpu, k, phase, gpu, HOST, "weight", loop.host_collectives * c.w[k],
                               slot=p, need=j, starts=[up])
        rows = []
        for i in loop.mbs(s):
            deps: list[int | None] = [up, gather]
            if s.phase != "backward" and loop.activations:
                deps.append(self._forward_input(loop, j, i))
            if s.phase == "backward" and loop.activations:
                deps += self._backward_inputs(loop, j, i, memory, trigger)
            rows.append(self.op("run", gpu, k, phase, deps, microbatch=i))
            if s.phase == "forward" and k == loop.last_stage and loop.activations and loop.loss_on_host:
                loop.out[i] = self.copy("send", gpu, k, "forward", gpu, HOST, "activation", c.out[k], slot=p,
                                        need=loop.reader(k, i), deps=[rows[-1]], microbatch=i)
        loop.comp.setdefault((s.phase, k), {}).update(zip(loop.mbs(s), rows))
        loop.where.setdefault((s.phase, k), {}).update((i, gpu) for i in loop.mbs(s))
        loop.first[j] = rows[0]
        if s.phase != "forward" and loop.grads_to_host:
            grad = self.copy("download", gpu, k, "backward", gpu, HOST, "gradient", c.g[k], slot=p, need=loop.done,
                             deps=[rows[-1]])
            self.gradients[k] += [grad] if grad is not None else []
            if loop.host_collectives > 0:
                self.copy("collective", gpu, k, "backward", HOST, gpu, "gradient", loop.host_collectives * c.g[k],
                          slot=p, need=loop.done, deps=[rows[-1]])
        if not loop.resident and not keep and not (nxt is not None and nxt.stage == k):
            loop.evict[j] = self.op("evict", gpu, k, phase, [rows[-1]])

    def _forward_input(self, loop: _Loop, j: int, i: int) -> int | None:
        """What micro-batch i of forward (or fused) slot j waits for: its input from the GPU (or the
        host) that made it; the input saved to the host for backward."""
        s, c, p = loop.slots[j], loop.c, loop.pos[j]
        k, gpu = s.stage, s.gpu
        src, made = (HOST, None) if k == 0 else (loop.where[("forward", k - 1)][i], loop.comp[("forward", k - 1)][i])
        arrive = None
        if src != gpu:
            arrive = self.copy("send", gpu, k, "forward", src, gpu, "activation", c.inp[k], slot=p, need=j,
                               deps=[made], microbatch=i)
        arrive = arrive if arrive is not None else made
        if loop.offload_activations and k > 0 and s.phase == "forward":
            loop.save[(k, i)] = self.copy("offload", gpu, k, "forward", gpu, HOST, "input", c.inp[k], slot=p,
                                          need=loop.reader(k, i), deps=[arrive], microbatch=i)
        return arrive

    def _backward_inputs(self, loop: _Loop, j: int, i: int, memory: int | None, trigger: list[int]) -> list:
        """What micro-batch i of backward slot j waits for: its saved input back from the host (or
        the model input sent again), and the gradient of its output."""
        s, c, p = loop.slots[j], loop.c, loop.pos[j]
        k, gpu = s.stage, s.gpu
        deps: list[int | None] = []
        if loop.offload_activations and k > 0 and (k, i) in loop.save:
            deps.append(self.copy("restore", gpu, k, "backward", HOST, gpu, "input", c.inp[k], slot=p, need=j,
                                  deps=[loop.save[(k, i)], memory], starts=trigger, microbatch=i))
        elif loop.offload_activations and k == 0:  # the model input, sent again from the host
            deps.append(self.copy("send", gpu, k, "backward", HOST, gpu, "input", c.inp[0], slot=p, need=j,
                                  deps=[memory], starts=trigger, microbatch=i))
        if k == loop.last_stage:
            src = HOST
            made = loop.out.get(i) if loop.out.get(i) is not None else loop.comp[("forward", k)][i]
        else:
            nb = ("backward", k + 1) if ("backward", k + 1) in loop.comp else ("fused", k + 1)
            src, made = loop.where[nb][i], loop.comp[nb][i]
        hop = None
        if src != gpu and (src != HOST or loop.loss_on_host):
            hop = self.copy("send", gpu, k, "backward", src, gpu, "activation", c.out[k], slot=p, need=j,
                            deps=[made], microbatch=i)
        deps.append(hop if hop is not None else made)
        return deps

    def host_steps(self, c: Costs) -> None:
        """The host's optimizer step of every stage with trainable weights, after its gradients."""
        for k, master in enumerate(c.master):
            if master:
                self.op("step", HOST, k, "optimizer", self.gradients.get(k, []))

    def gpu_steps(self, gpus: Sequence[str]) -> None:
        """Stage j's optimizer step on gpus[j] (GPipe's), after the whole pipeline (every op so far)."""
        flush = list(range(len(self.ops)))
        for j, gpu in enumerate(gpus):
            self.op("step", gpu, j, "optimizer", flush)

    def build(self, microbatches: int, *, sharded: bool = False, host_optimizer: str | None = "user") -> ScheduleIR:
        """The schedule IR of the ops so far, each slot `microbatches` micro-batches (`sharded`,
        `host_optimizer`: as ScheduleIR's; its stages are the costs' units, not `StageIO`s)."""
        gpus = tuple(dict.fromkeys(o.place for o in self.ops if o.place != HOST))
        return ScheduleIR(ops=tuple(self.ops), stages=(), microbatches=microbatches, gpus=gpus, next_on_gpu=(),
                          prev_on_gpu=(),
                          by_place={p: tuple(v) for p, v in self.places.items()}, sharded=sharded,
                          host_optimizer=host_optimizer, through_markers=False)
