"""The schedule IR: one step of a Mobius pipeline as plain data, per GPU and for the host.

Everything that needs to know what a step does reads this, instead of deriving it again: the
plan's transfer table is a sum over its ops, the runtime's backward takes its prefetches from
it, `pipe.code` prints it, and the conformance tests compare what the runtime moved with it.
The simulator's baselines are lists of the same ops (mobius_fx/schedules/looped_ir.py).

A step is a list of `Op`s in issue order. Each op belongs to one place (a GPU name, or "host"
for the CPU optimizer), moves `bytes` from `src` to `dst` when it is a copy, and names the ops
it waits for (`deps`, indices into the list). The order per GPU is Mobius's (docs/schedule.md):

- forward, GPipe order per GPU: all M micro-batches of stage k, then stage k+N; the first
  stage of each GPU is uploaded at the start, stage k+N is prefetched when stage k starts, a
  stage is evicted after its last micro-batch except the last one on its GPU, which stays
  resident for backward;
- backward in reverse stage order, micro-batches newest first (autograd's order), each stage
  recomputed from its saved inputs; stage k−N is prefetched when stage k starts its backward;
  after its last micro-batch a stage's weight gradients go to the host and it is evicted;
- host: one optimizer op per stage that has gradients, after that stage's download.

Values between stages, one copy per value: an input made by the stage just before is pushed
GPU to GPU (no copy when both run on one GPU); model inputs, and values made two or more stages
earlier, come from host memory (their producer copies them there). Every input is needed again
by the backward recomputation: one that came from a GPU is offloaded to host memory after the
forward and restored for backward; one that came from the host stays there and is sent again.
Gradients flow back the way the values came.

    ir = build_schedule([StageIO("gpu0", 1000, 1000, (StageInput(-1, 64, needs_grad=False),)),
                         StageIO("gpu1", 1000, 1000, (StageInput(0, 64),), host_outputs=(12,))],
                        microbatches=2)
    print(ir)                      # per-GPU timeline
    ir.bytes_moved()               # {(gpu, kind, direction, stage): (count, bytes)}
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from mobius_fx.kinds import HOST
from mobius_fx.errors import MobiusError
from mobius_fx.planning.microbatch import check_count

__all__ = ["Op", "OpKind", "StageIO", "StageInput", "TiedSum", "ScheduleIR", "build_schedule", "ScheduleBuilder", "neighbours",
           "OP_KINDS", "PHASES"]



class OpKind(StrEnum):
    """What an op does. A member equals its value ("run" == OpKind.RUN), so code may compare
    either; `Op` holds the member."""

    PREFETCH = "prefetch"  # weights host -> GPU
    WAIT = "wait"  # a stage's weights are on its GPU
    RUN = "run"  # a forward or backward (recompute included) of one micro-batch
    SEND = "send"  # a value or gradient between GPUs, or to or from the host
    OFFLOAD = "offload"  # a saved input GPU -> host after the forward
    RESTORE = "restore"  # ... and back for the backward
    DOWNLOAD = "download"  # a stage's weight gradients GPU -> host
    EVICT = "evict"  # a stage's weights leave its GPU
    HOLD = "hold"  # the last forward stage on a GPU stays for its backward
    STEP = "step"  # the optimizer step of one stage: on the host, or on its GPU (GPipe's)
    COLLECTIVE = "collective"  # a GPU's share of a collective routed through host memory (ZeRO-3)


OP_KINDS = tuple(OpKind)
# The phases of a step, each with the letter an op's printed form gives it ("F2.1": forward of
# stage 2, micro-batch 1).
PHASES = {"forward": "F", "backward": "B", "optimizer": "O"}
_PHASE_OF = {v: k for k, v in PHASES.items()}
# `str(op)`: "12: send F3.1 @gpu0 activation gpu0->gpu1 1000B v0 <- 11,12" (index, kind, phase,
# stage[.micro-batch], place, [what src->dst bytes], [value], [slot], [need], [deps], [starts]).
_OP_TEXT = re.compile(r"(?P<index>\d+): (?P<kind>[a-z]+) (?P<phase>[A-Z])(?P<stage>\d+)(?:\.(?P<mb>\d+))? "
                      r"@(?P<place>\S+)(?: (?P<what>[a-z]+) (?P<src>\S+?)->(?P<dst>\S+) "
                      r"(?P<bytes>\d+(?:\.\d*)?(?:e[+-]?\d+)?)B)?(?: v(?P<value>\d+))?(?: slot(?P<slot>\d+))?"
                      r"(?: need(?P<need>\d+))?(?: <- (?P<deps>\d+(?:,\d+)*))?(?: <-start (?P<starts>\d+(?:,\d+)*))?")


@dataclass(frozen=True)
class StageInput:
    """One tensor input of a stage: made by stage `source` (-1: a model input), `bytes` per
    micro-batch as it travels (the streamed dtype for floating values)."""

    source: int
    bytes: int
    needs_grad: bool = True  # whether a gradient flows back to its producer


@dataclass(frozen=True)
class TiedSum:
    """A tied weight's gradient (a parameter several stages hold) completed on the GPU of the
    stage that holds it first (its backward runs last): every download `sources` made of its
    partial (`bytes` each, as streamed) is sent back from the host to that GPU, summed there in
    the masters' dtype with the stage's own partial, and downloaded once, widened: that download
    moves `extra` bytes more than the stage's streamed gradients (`Pipeline.schedule_ir` makes
    them: runtime/tied_sums.py)."""

    sources: tuple[int, ...]
    bytes: int
    extra: int


@dataclass(frozen=True)
class StageIO:
    """What the schedule needs to know of one stage: where it runs and what it moves."""

    gpu: str
    weight_bytes: int  # its GPU copy of the weights (tied weights it reads included)
    grad_bytes: int  # its trainable weights' gradients, downloaded once per step
    inputs: tuple[StageInput, ...] = ()
    host_outputs: tuple[int, ...] = ()  # bytes per micro-batch of each output copied to the host
    #                                     (model outputs, values read two or more stages later)
    host_grads: tuple[bool, ...] = ()  # per host output: whether a gradient comes back for it
    #                                    (empty: all do; a causal mask built from token ids does not)
    tied_sums: tuple[TiedSum, ...] = ()  # tied weights' gradients summed on its GPU before its download
    # bytes of one partial download where a schedule downloads the stage's gradients from several
    # GPUs (split-head's dealt stage, ZeRO-3 offload's replicas): as streamed, never widened (the
    # host sums the partials); None: grad_bytes
    partial_grad_bytes: int | None = None

    def partial_bytes(self) -> int:
        """What each of several partial downloads of this stage's gradients moves."""
        return self.grad_bytes if self.partial_grad_bytes is None else self.partial_grad_bytes

    # One constructor per place a step's stages are described; each gives the whole step's
    # stages, in order, for `build_schedule`.
    @classmethod
    def from_plan(cls, stages: Sequence[Any]) -> tuple["StageIO", ...]:
        """A plan's stages (`plans.Stage`): a chain, each stage reading the one before it (stage 0
        the model input) and the last one's output going to the host; bytes as planned."""
        last = len(stages) - 1
        return tuple(cls(gpu=s.gpu, weight_bytes=s.param_bytes, grad_bytes=s.grad_bytes,
                         inputs=(StageInput(s.index - 1, s.input_bytes, needs_grad=s.index > 0),),
                         host_outputs=(s.output_bytes,) if s.index == last else ())
                     for s in stages)

    @classmethod
    def from_graph(cls, stages: Sequence[Any], to_host: Sequence[Sequence[int]], *,
                   weight_bytes: Sequence[int] | None = None,
                   grad_bytes: Sequence[int] | None = None) -> tuple["StageIO", ...]:
        """The stages of a traced graph as `insert_transfers` splits it (each with `gpu`,
        `index` and its `inputs`' producing `stage`), `to_host[k]` stage k's outputs copied to
        the host: order and dependencies, activations 0 bytes, weights and gradients as given
        (default 0)."""
        return tuple(cls(st.gpu, weight_bytes[k] if weight_bytes is not None else 0,
                         grad_bytes[k] if grad_bytes is not None else 0,
                         tuple(StageInput(r.stage, 0) for r in st.inputs),
                         tuple(0 for _ in to_host[st.index]) if to_host else ())
                     for k, st in enumerate(stages))

    @classmethod
    def from_runtime(cls, stages: Sequence[Any], to_host: Sequence[Sequence[int]], *,
                     weight_bytes: Sequence[int], grad_bytes: Sequence[int],
                     size: Callable[[Any], int], carries_grad: Callable[[Any], bool],
                     output_size: Callable[[int, int], int],
                     output_grad: Callable[[int, int], bool],
                     tied_sums: Sequence[tuple[TiedSum, ...]] = (),
                     partial_grad_bytes: Sequence[int] | None = None) -> tuple["StageIO", ...]:
        """A compiled pipeline's stages as its runtime holds them: `stages` as for `from_graph`,
        the bytes of its GPU slots (`weight_bytes`, `grad_bytes` per stage), `size(ref)` /
        `carries_grad(ref)` of an input, `output_size(k, j)` / `output_grad(k, j)` of output j of
        stage k sent to the host, `tied_sums[k]` the tied gradients stage k sums (default none),
        `partial_grad_bytes[k]` one partial download of its gradients (default: grad_bytes)."""
        return tuple(cls(gpu=st.gpu, weight_bytes=weight_bytes[k], grad_bytes=grad_bytes[k],
                         inputs=tuple(StageInput(r.stage, size(r), needs_grad=carries_grad(r)) for r in st.inputs),
                         host_outputs=tuple(output_size(st.index, j) for j in to_host[st.index]),
                         host_grads=tuple(output_grad(st.index, j) for j in to_host[st.index]),
                         tied_sums=tuple(tied_sums[k]) if tied_sums else (),
                         partial_grad_bytes=partial_grad_bytes[k] if partial_grad_bytes is not None else None)
                     for k, st in enumerate(stages))


@dataclass(frozen=True)
class Op:
    """One operation of a step. `kind` is an OpKind (a string is taken as one); `place` is the
    GPU whose list it is in (or "host"); copies have `src`, `dst`, `what` (weight | activation |
    gradient | input) and `bytes` (an int; a float where a baseline's costs are shares of a
    stage's), other ops none of them. Printed, it parses back: `Op.parse(str(op)) == op`.

    `slot`, `need` and `starts` say what the simulator otherwise derives (ir_tasks.tasks_from_ir):
    which of its GPU's turns the op belongs to (its streams serve turn by turn), when the step
    needs a copy (a rank; smaller goes first on a shared link) and the ops whose *start* it
    waits for (`deps`: whose end).

    >>> op = Op(7, "send", "gpu0", 3, "forward", 1, "gpu0", "gpu1", "activation", 1000, (5, 6), 0)
    >>> str(op)
    '7: send F3.1 @gpu0 activation gpu0->gpu1 1000B v0 <- 5,6'
    >>> Op.parse(str(op)) == op, Op.parse("2: run B0.0 @gpu1 <- 1").kind is OpKind.RUN
    (True, True)
    """

    index: int
    kind: str
    place: str
    stage: int
    phase: str  # forward | backward | optimizer
    microbatch: int | None = None
    src: str = ""
    dst: str = ""
    what: str = ""
    bytes: int | float = 0
    deps: tuple[int, ...] = ()
    value: int | None = None  # which input of `stage` a send/offload/restore carries, or which of
    #                           its host outputs a copy to the host carries (their positions)
    slot: int | None = None  # its GPU's turn (None: the turn of the stage's `wait`)
    need: int | None = None  # when the step needs this copy (None: ir_tasks.copy_need)
    starts: tuple[int, ...] = ()  # ops whose start it waits for

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", OpKind(self.kind))
        except ValueError:
            raise MobiusError(f"op kind {self.kind!r} is not one of {', '.join(OP_KINDS)}") from None
        if self.phase not in PHASES:
            raise MobiusError(f"op phase {self.phase!r} is not one of {', '.join(PHASES)}")
        named = [bool(x) for x in (self.src, self.dst, self.what)]
        if any(named) and not all(named) or not any(named) and self.bytes \
                or not 0 <= self.bytes < float("inf"):
            raise MobiusError(f"op {self.index} ({self.kind}) has src={self.src!r}, dst={self.dst!r}, "
                              f"what={self.what!r}, bytes={self.bytes!r}: a copy names all of src, dst and what, "
                              f"with finite bytes >= 0 (0: a copy of unknown size), and any other op none of "
                              f"them and 0 bytes; give all four or none")

    @classmethod
    def parse(cls, text: str) -> "Op":
        """The op `text` prints (`str(op)`), e.g. "7: send F3.1 @gpu0 activation gpu0->gpu1 1000B v0 <- 5,6"."""
        m = _OP_TEXT.fullmatch(text.strip())
        if m is None or m["phase"] not in _PHASE_OF:
            raise MobiusError(f"{text!r} is not an op as Op prints one: 'INDEX: KIND PHASE-LETTER STAGE[.MB] @PLACE"
                              f"[ WHAT SRC->DST BYTESB][ vVALUE][ slotN][ needN][ <- DEP,DEP][ <-start OP,OP]', "
                              f"phase letters {', '.join(_PHASE_OF)}, e.g. '7: run F3.1 @gpu0 <- 5,6'")
        g = m.groupdict()
        num = lambda key: None if g[key] is None else int(g[key])  # noqa: E731
        ints = lambda key: tuple(int(d) for d in g[key].split(",")) if g[key] else ()  # noqa: E731
        copy = g["what"] is not None
        size = (int(g["bytes"]) if g["bytes"].isdigit() else float(g["bytes"])) if copy else 0
        return cls(int(g["index"]), g["kind"], g["place"], int(g["stage"]), _PHASE_OF[g["phase"]], num("mb"),
                   g["src"] if copy else "", g["dst"] if copy else "", g["what"] if copy else "", size,
                   ints("deps"), num("value"), num("slot"), num("need"), ints("starts"))

    @property
    def direction(self) -> str:
        """h2d | d2h | d2d for copies, "" otherwise."""
        if not self.src or self.src == self.dst:
            return ""
        return {(True, False): "h2d", (False, True): "d2h"}.get((self.src == HOST, self.dst == HOST), "d2d")

    def __str__(self) -> str:
        mb = f".{self.microbatch}" if self.microbatch is not None else ""
        move = f" {self.what} {self.src}->{self.dst} {self.bytes}B" if self.src else ""
        value = f" v{self.value}" if self.value is not None else ""
        value += (f" slot{self.slot}" if self.slot is not None else "") + (f" need{self.need}" if self.need is not None else "")
        deps = f" <- {','.join(map(str, self.deps))}" if self.deps else ""
        deps += f" <-start {','.join(map(str, self.starts))}" if self.starts else ""
        return f"{self.index}: {self.kind} {PHASES[self.phase]}{self.stage}{mb} @{self.place}{move}{value}{deps}"


@dataclass(frozen=True)
class ScheduleIR:
    """A step as ops in issue order; `by_place` lists each GPU's (and the host's) op indices."""

    ops: tuple[Op, ...]
    stages: tuple[StageIO, ...]
    microbatches: int
    gpus: tuple[str, ...]  # in order of first use
    next_on_gpu: tuple[int | None, ...]  # the stage its GPU runs after it in forward
    prev_on_gpu: tuple[int | None, ...]  # the stage its GPU ran before it in forward
    by_place: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False)
    sharded: bool = False  # host memory per (GPU, stage): each data-parallel rank its own partition
    host_optimizer: str | None = "user"  # whose CPU optimizer steps the host `step`s (schedules.OPTIMIZERS);
    #                                      None: no host step (the GPUs step, `step` ops on GPUs)
    through_markers: bool = True  # an op that names a marker (evict, wait, hold) waits, in the simulator,
    #   for the marker's own deps (the Mobius IR) or for the marker (the looped pipelines'): the order of events

    def place(self, name: str) -> list[Op]:
        return [self.ops[i] for i in self.by_place.get(name, ())]

    def select(self, *, kind: str | None = None, phase: str | None = None, stage: int | None = None) -> list[Op]:
        return [o for o in self.ops if (kind is None or o.kind == kind) and (phase is None or o.phase == phase)
                and (stage is None or o.stage == stage)]

    def copies(self) -> list[Op]:
        """The ops that move bytes (between a GPU and the host or two GPUs)."""
        return [o for o in self.ops if o.direction and o.bytes > 0]

    def bytes_moved(self) -> dict[tuple[str, str, str, int], tuple[int, int]]:
        """(GPU, what, direction, stage) -> (copies, bytes) per step; the GPU is the one that
        receives (h2d, d2d) or sends (d2h) — the runtime's books are kept the same way."""
        out: dict[tuple[str, str, str, int], list[int]] = defaultdict(lambda: [0, 0])
        for o in self.copies():
            gpu = o.src if o.direction == "d2h" else o.dst
            c = out[(gpu, o.what, o.direction, o.stage)]
            c[0] += 1
            c[1] += o.bytes
        return {k: (n, b) for k, (n, b) in sorted(out.items())}

    def resident_at_most(self) -> dict[str, int]:
        """Per GPU, the most stages whose weights are on it at once, walking its ops in order."""
        most: dict[str, int] = {}
        for gpu in self.gpus:
            on: set[int] = set()
            peak = 0
            for o in self.place(gpu):
                if o.kind == "prefetch":
                    on.add(o.stage)
                elif o.kind == "evict":
                    on.discard(o.stage)
                peak = max(peak, len(on))
            most[gpu] = peak
        return most

    def timeline(self) -> str:
        """One line per op, grouped per GPU and phase: what a person reads to check a schedule."""
        lines = []
        for place in (*self.gpus, HOST):
            ops = self.place(place)
            if not ops:
                continue
            lines.append(f"{place}:")
            phase = None
            row: list[str] = []
            for o in ops:
                if o.phase != phase:
                    if row:
                        lines.append(f"  {phase:9s} " + "; ".join(row))
                    phase, row = o.phase, []
                row.append(_short(o))
            if row:
                lines.append(f"  {phase:9s} " + "; ".join(row))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.timeline()


def _short(o: Op) -> str:
    if o.kind == "run":
        return f"{'F' if o.phase == 'forward' else 'B'}{o.stage}.{o.microbatch}"
    if o.kind in ("send", "offload", "restore", "download"):
        mb = f".{o.microbatch}" if o.microbatch is not None else ""
        return f"{o.kind} {o.what} {o.stage}{mb} {o.src}->{o.dst}"
    return f"{o.kind}({o.stage})"


def neighbours(gpus: Sequence[str]) -> tuple[list[int | None], list[int | None]]:
    """For stages on `gpus` (stage k on gpus[k]): the stage its GPU runs next, and before."""
    nxt: list[int | None] = [None] * len(gpus)
    prev: list[int | None] = [None] * len(gpus)
    last: dict[str, int] = {}
    for k, g in enumerate(gpus):
        if g in last:
            nxt[last[g]] = k
            prev[k] = last[g]
        last[g] = k
    return nxt, prev


def build_schedule(stages: Sequence[StageIO], microbatches: int, *, optimizer: bool = True,
                   backward_gpus: Sequence[str] | None = None, hold: bool = True) -> ScheduleIR:
    """The ops of one step of `stages` with `microbatches` micro-batches (see the module docstring);
    `backward_gpus[k]`: the GPU of stage k's backward (None: its own; `ir_transforms.round_robin`);
    `hold=False`: no stage stays on its GPU across the turn (each is evicted after its forward and
    uploaded again for its backward; `ir_data_parallel.data_parallel`'s replicas)."""
    stages = tuple(stages)
    m = microbatches
    check_count(m)
    if not stages:
        raise MobiusError(f"a schedule needs at least one stage (got none, for {m} micro-batches)")
    for k, st in enumerate(stages):
        for inp in st.inputs:
            if not -1 <= inp.source < k:
                raise MobiusError(f"stage {k} reads an input of stage {inp.source}; a stage reads model inputs (-1) "
                                  f"or values of earlier stages")
    if backward_gpus is not None and len(backward_gpus) != len(stages):
        raise MobiusError(f"backward_gpus names {len(backward_gpus)} GPUs for {len(stages)} stages; give one per stage")
    b = ScheduleBuilder(stages, m, backward_gpus, hold)
    b.walk()
    if optimizer:
        for k in sorted(b.downloads):
            b.op("step", HOST, k, "optimizer", [b.downloads[k]])
    return ScheduleIR(ops=tuple(b.ops), stages=stages, microbatches=m, gpus=tuple(dict.fromkeys(b.gpu)),
                      next_on_gpu=tuple(b.nxt), prev_on_gpu=tuple(b.prev),
                      by_place={p: tuple(v) for p, v in b.places.items()})


class ScheduleBuilder:
    """`build_schedule`'s op list under construction, and what its forward leaves its backward;
    a schedule that changes where some runs go subclasses it (`at`; planning/ir_split_head.py)."""

    def __init__(self, stages: tuple[StageIO, ...], m: int, backward_gpus: Sequence[str] | None = None,
                 hold: bool = True) -> None:
        self.stages, self.m = stages, m
        self.gpu = [s.gpu for s in stages]
        self.nxt, self.prev = neighbours(self.gpu)
        # backward: each stage on bgpu[k]; its neighbours there (Mobius: the forward's)
        self.bgpu = list(backward_gpus) if backward_gpus is not None and list(backward_gpus) != self.gpu else self.gpu
        self.bnxt, self.bprev = neighbours(self.bgpu)
        self.last_evict: dict[str, int] = {}  # GPU -> its last forward evict
        self.ops: list[Op] = []
        self.places: dict[str, list[int]] = defaultdict(list)
        self.fetched: dict[int, int] = {}
        self.evicted: dict[int, int] = {}
        self.run_f: dict[tuple[int, int], int] = {}
        self.hosted: dict[tuple[int, int], int] = {}  # (stage, mb) -> its last copy to the host
        self.hosted_all: dict[tuple[int, int], list[int]] = defaultdict(list)  # (stage, mb) -> all its copies to the host
        self.pushed: dict[tuple[int, int, int], int] = {}  # (consumer, input j, mb) -> the push from the stage before
        self.saved: dict[tuple[int, int, int], int] = {}  # (stage, input j, mb) -> offload op
        self.direct = [[inp.source >= 0 and inp.source == k - 1 for inp in st.inputs] for k, st in enumerate(stages)]
        # Which values carry gradients: an input does when it needs one and its producer runs backward
        # (a model input: when it needs one); a stage runs backward when it has weight gradients or
        # such an input. A frozen stage on plain inputs (a frozen embedding, a frozen prefix of a
        # LoRA model) runs forward only: nothing saved, held, restored or fetched again for it.
        self.grad_in: list[list[bool]] = []
        self.has_bwd: list[bool] = []
        for k, st in enumerate(stages):
            self.grad_in.append([inp.needs_grad and (inp.source < 0 or self.has_bwd[inp.source]) for inp in st.inputs])
            self.has_bwd.append(st.grad_bytes > 0 or any(self.grad_in[k]))
        self.run_b: dict[tuple[int, int], int] = {}
        self.evicted_b: dict[int, int] = {}
        self.grads_back: dict[tuple[int, int], list[int]] = defaultdict(list)  # (stage, mb) -> gradient copies it waits for
        self.downloads: dict[int, int] = {}
        self.grad_downloads: dict[int, list[int]] = defaultdict(list)  # stage -> every download of its gradients
        self.fetched_b: set[int] = set()  # stages whose backward prefetch the stage after them on their GPU issued
        # the last forward stage on a GPU keeps its weights for its backward when that runs there, first
        self.keeps = [hold and self.nxt[k] is None and self.has_bwd[k] and self.bgpu[k] == self.gpu[k] and self.bnxt[k] is None
                      for k in range(len(stages))]

    def op(self, kind: str, place: str, stage: int, phase: str, deps: Sequence[int | None] = (), **kw) -> int:
        i = len(self.ops)
        self.ops.append(Op(i, kind, place, stage, phase, deps=tuple(d for d in deps if d is not None), **kw))
        self.places[place].append(i)
        return i

    def at(self, k: int, i: int, phase: str) -> str:
        """The GPU that runs micro-batch i of stage k in `phase` (here: the stage's; a dealt stage's
        per micro-batch in `ir_split_head`)."""
        return self.gpu[k] if phase == "forward" else self.bgpu[k]

    def up(self, k: int, phase: str, deps: Sequence[int | None]) -> int:
        g = self.gpu[k] if phase == "forward" else self.bgpu[k]
        return self.op("prefetch", g, k, phase, deps, src=HOST, dst=g, what="weight",
                       bytes=self.stages[k].weight_bytes)

    def forward(self, k: int) -> None:
        """Stage k's forward: its wait, the next stage's prefetch on its GPU, its micro-batches
        with the values they read and send, then its evict (or hold for backward)."""
        st, g, m, op = self.stages[k], self.gpu[k], self.m, self.op
        nxt, prev, direct = self.nxt, self.prev, self.direct
        wait = op("wait", g, k, "forward", [self.fetched[k]])
        if nxt[k] is not None:
            self.fetched[nxt[k]] = self.up(nxt[k], "forward",
                                           [self.evicted.get(prev[k]) if prev[k] is not None else None, wait])
        consumer = self.stages[k + 1] if k + 1 < len(self.stages) else None
        for i in range(m):
            deps: list[int | None] = [wait]
            for j, inp in enumerate(st.inputs):
                if direct[k][j]:
                    deps.append(self.pushed.get((k, j, i), self.run_f[(k - 1, i)]))
                else:
                    src_op = self.hosted.get((inp.source, i)) if inp.source >= 0 else None
                    deps.append(op("send", g, k, "forward", [src_op], microbatch=i, src=HOST, dst=g,
                                   what="activation", bytes=inp.bytes, value=j))
            r = op("run", g, k, "forward", deps, microbatch=i)
            self.run_f[(k, i)] = r
            for j, inp in enumerate(st.inputs):
                if direct[k][j] and self.has_bwd[k]:
                    self.saved[(k, j, i)] = op("offload", g, k, "forward", [r], microbatch=i, src=g, dst=HOST,
                                               what="input", bytes=inp.bytes, value=j)
            to = self.at(k + 1, i, "forward") if consumer is not None else g
            if to != g:
                for j, inp in enumerate(consumer.inputs):
                    if direct[k + 1][j]:
                        self.pushed[(k + 1, j, i)] = op("send", g, k + 1, "forward", [r], microbatch=i, src=g,
                                                        dst=to, what="activation", bytes=inp.bytes, value=j)
            for p, b in enumerate(st.host_outputs):
                self.hosted[(k, i)] = op("send", g, k, "forward", [r], microbatch=i, src=g, dst=HOST,
                                         what="activation", bytes=b, value=p)
                self.hosted_all[(k, i)].append(self.hosted[(k, i)])
        last = self.run_f[(k, m - 1)]
        if not self.keeps[k]:
            self.evicted[k] = self.last_evict[g] = op("evict", g, k, "forward", [last])
        else:
            op("hold", g, k, "forward", [last])

    def walk(self) -> None:
        """The step's ops: each GPU's first stage uploaded, every stage's forward in order, then the
        backward of each stage that has one, last stage first (the optimizer's steps are the
        caller's: they depend on where its downloads are)."""
        n = len(self.stages)
        for k in range(n):
            if self.prev[k] is None:
                self.fetched[k] = self.up(k, "forward", [])
        for k in range(n):
            self.forward(k)
        for k in reversed(range(n)):
            if self.has_bwd[k]:
                self.backward(k)

    def backward(self, k: int) -> None:
        """Stage k's backward: its weights (fetched again if they left), the stage before it on
        its GPU prefetched, its micro-batches newest first, its gradients to the host, its evict."""
        st, g, op, nxt, prev = self.stages[k], self.bgpu[k], self.op, self.bnxt, self.bprev
        if not self.keeps[k] and k not in self.fetched_b:  # neither held nor prefetched by a backward before it:
            j = nxt[k]  # fetched again at its own turn, after the last eviction on its GPU
            while j is not None and j not in self.evicted_b:
                j = nxt[j]
            self.fetched[k] = self.up(k, "backward", [self.evicted_b.get(j) if j is not None or self.bgpu is self.gpu
                                                      else self.last_evict.get(g)])
        wait = op("wait", g, k, "backward", [self.fetched.get(k)])
        if prev[k] is not None and self.has_bwd[prev[k]]:  # as in forward: only after the stage before on this GPU left it
            self.fetched_b.add(prev[k])
            self.fetched[prev[k]] = self.up(prev[k], "backward",
                                            [wait, self.evicted_b.get(nxt[k]) if nxt[k] is not None else None])
        for i in reversed(range(self.m)):
            deps = [wait, *self.grads_back.pop((k, i), [])]
            for j, inp in enumerate(st.inputs):
                if self.direct[k][j]:
                    deps.append(op("restore", g, k, "backward", [self.saved[(k, j, i)], wait], microbatch=i,
                                   src=HOST, dst=g, what="input", bytes=inp.bytes, value=j))
                else:
                    deps.append(op("send", g, k, "backward", [wait], microbatch=i, src=HOST, dst=g, what="input",
                                   bytes=inp.bytes, value=j))
            for p, b in enumerate(st.host_outputs):  # the gradient of what went to the host (the loss, long skips)
                if st.host_grads and not st.host_grads[p]:
                    continue
                deps.append(op("send", g, k, "backward", self.hosted_all[(k, i)], microbatch=i, src=HOST, dst=g,
                               what="activation", bytes=b))
            r = op("run", g, k, "backward", deps, microbatch=i)
            self.run_b[(k, i)] = r
            self._grads_out(k, i, r)
        last = self.run_b[(k, 0)]
        sums = self.tied_partials(k, g, last)
        if st.grad_bytes or sums:
            self.downloads[k] = op("download", g, k, "backward", [last, *sums], src=g, dst=HOST, what="gradient",
                                   bytes=st.grad_bytes + sum(t.extra for t in st.tied_sums))
            self.grad_downloads[k].append(self.downloads[k])
        self.evicted_b[k] = op("evict", g, k, "backward", [last])  # the weights; the gradients are a copy of their own

    def tied_partials(self, k: int, g: str, last: int) -> list[int]:
        """Stage k's `tied_sums`: each download of a partial its sources made, sent back from the
        host to `g` after stage k's last backward run `last` (its download sums them)."""
        return [self.op("send", g, k, "backward", [last, d], src=HOST, dst=g, what="gradient", bytes=t.bytes)
                for t in self.stages[k].tied_sums for s in t.sources for d in self.grad_downloads.get(s, ())]

    def _grads_out(self, k: int, i: int, r: int) -> None:
        """Micro-batch i's input gradients of stage k (its backward run r) go back the way the inputs came."""
        g = self.at(k, i, "backward")
        for j, inp in enumerate(self.stages[k].inputs):
            if not self.grad_in[k][j]:
                continue
            if self.direct[k][j]:
                to = self.at(k - 1, i, "backward")
                if to != g:
                    self.grads_back[(k - 1, i)].append(self.op("send", g, k - 1, "backward", [r], microbatch=i, src=g,
                                                               dst=to, what="activation", bytes=inp.bytes))
                else:
                    self.grads_back[(k - 1, i)].append(r)
            else:
                self.op("send", g, k, "backward", [r], microbatch=i, src=g, dst=HOST, what="activation",
                        bytes=inp.bytes)
