"""Split-head on a compiled pipeline's own stages: the runtime form of the "split-head" schedule
(mobius_fx/schedules/split_head.py), a transform of the pipeline's Mobius IR
(mobius_fx/planning/schedule_ir.py) the step executor (mobius_fx/runtime/executor.py) runs.

    ir2 = split_head(ir)       # the last stage's micro-batch i on GPU (h + i) mod N, h its own GPU

The simulated split-head re-cuts the plan into one-layer slots; the runtime cannot re-cut a
compiled pipeline without compiling again, so this form keeps the pipeline's stages:

- every stage but the last runs as in the Mobius IR (its forward and backward on its own GPU,
  which is what the simulated split-head's default `hold=True` does with each layer);
- the last stage (the loss stage: head and loss, on the GPU when compiled with `loss_fn=` or
  called with HF `labels=`) is dealt by micro-batch over the rotation of the pipeline's GPUs
  (`ir.gpus`, in their order of first use) starting at its own GPU h: micro-batch i's forward
  and backward run on GPU (h + i) mod N. Each GPU that runs it gets the stage's weights
  uploaded once (its own GPU as Mobius prefetches them; another while that GPU's last forward
  stage runs) and holds them from forward to backward, beside its own held stage: two stages'
  weights at once. Its inputs are pushed there from the stage before (or sent from the host),
  its outputs (the loss's sums and counts) go to the host, the gradients of its inputs go back
  to the stage before; after that GPU's last micro-batch its partial weight gradient is
  downloaded (the host sums the partials) and the copy evicted,
  before any backward upload on that GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

from mobius_fx.errors import MobiusError
from mobius_fx.kinds import HOST
from mobius_fx.planning.microbatch import check_count
from mobius_fx.planning.schedule_ir import OpKind, ScheduleIR, StageIO, ScheduleBuilder

__all__ = ["split_head", "build_split_head", "dealt"]


def dealt(rotation: Sequence[str], home: str, m: int) -> list[str]:
    """The GPU of each of `m` micro-batches of a stage on `home`, dealt over `rotation` from `home`."""
    rot = list(rotation)
    if home not in rot:
        raise MobiusError(f"split-head: the last stage runs on {home}, which is not among the rotation's GPUs "
                          f"{', '.join(rot)}; give a rotation that includes it")
    a = rot.index(home)
    return [rot[(a + i) % len(rot)] for i in range(m)]


def split_head(ir: ScheduleIR, gpus: Sequence[str] | None = None) -> ScheduleIR:
    """`ir` (a pipeline's Mobius IR, with its stages) with its last stage dealt by micro-batch
    (see the module docstring); `gpus`: the rotation (default: `ir.gpus`)."""
    if not ir.stages:
        raise MobiusError("split_head needs a pipeline's schedule IR (its stages as StageIO); got one without stages "
                          "(a simulator baseline's): build it with Pipeline.schedule_ir or build_schedule")
    rotation = list(gpus) if gpus is not None else list(ir.gpus)
    out = build_split_head(ir.stages, ir.microbatches, dealt(rotation, ir.stages[-1].gpu, ir.microbatches),
                           optimizer=any(o.kind == OpKind.STEP for o in ir.ops))
    return ScheduleIR(ops=out.ops, stages=out.stages, microbatches=out.microbatches, gpus=out.gpus,
                      next_on_gpu=out.next_on_gpu, prev_on_gpu=out.prev_on_gpu, by_place=out.by_place,
                      sharded=ir.sharded, host_optimizer=ir.host_optimizer, through_markers=ir.through_markers)


def build_split_head(stages: Sequence[StageIO], microbatches: int, heads: Sequence[str], *,
                     optimizer: bool = True) -> ScheduleIR:
    """`build_schedule(stages, microbatches)` with the last stage's micro-batch i on `heads[i]`
    (forward and backward); `heads[0]` is the stage's own GPU."""
    stages = tuple(stages)
    m = microbatches
    check_count(m)
    if not stages:
        raise MobiusError(f"a schedule needs at least one stage (got none, for {m} micro-batches)")
    if len(heads) != m or heads[0] != stages[-1].gpu:
        raise MobiusError(f"split-head deals the last stage's {m} micro-batches: give one GPU per micro-batch, the "
                          f"first its own ({stages[-1].gpu}); got {list(heads)}")
    b = _Dealt(stages, m, list(heads))
    b.walk()
    if optimizer:
        for k in sorted(set(b.downloads) | set(b.head_downloads)):
            b.op("step", HOST, k, "optimizer", b.head_downloads.get(k, [b.downloads.get(k)]))
    return ScheduleIR(ops=tuple(b.ops), stages=stages, microbatches=m, gpus=tuple(dict.fromkeys(b.gpu)),
                      next_on_gpu=tuple(b.nxt), prev_on_gpu=tuple(b.prev),
                      by_place={p: tuple(v) for p, v in b.places.items()})


class _Dealt(ScheduleBuilder):
    """`ScheduleBuilder` with the last stage's micro-batches on `heads` (forward and backward alike)."""

    def __init__(self, stages: tuple[StageIO, ...], m: int, heads: list[str]) -> None:
        super().__init__(stages, m)
        self.last = len(stages) - 1
        self.heads = heads
        self.head_gpus = list(dict.fromkeys(heads))  # the last stage's own GPU first
        self.head_evict: dict[str, int] = {}  # GPU -> the backward evict of its copy of the last stage
        self.head_downloads: dict[int, list[int]] = {}  # the last stage -> its partial gradients' downloads
        self.head_fetched: dict[str, int] = {}  # GPU -> the upload of its copy of the last stage

    def at(self, k: int, i: int, phase: str) -> str:
        return self.heads[i] if k == self.last else super().at(k, i, phase)

    def up(self, k: int, phase: str, deps: Sequence[int | None]) -> int:
        """A backward upload on a GPU that held a copy of the last stage waits for its eviction."""
        if phase == "backward":
            deps = [*deps, self.head_evict.get(self.bgpu[k])]
        return super().up(k, phase, deps)

    def forward(self, k: int) -> None:
        if k != self.last:
            super().forward(k)
            return
        st, m, op = self.stages[k], self.m, self.op
        fetched = self.head_fetched = {self.gpu[k]: self.fetched[k]}
        for g in self.head_gpus[1:]:  # uploaded while the last stage before it on that GPU runs
            waits = [o.index for o in self.ops if o.kind == OpKind.WAIT and o.place == g and o.phase == "forward"]
            fetched[g] = op("prefetch", g, k, "forward", [waits[-1] if waits else None, self.last_evict.get(g)],
                            src=HOST, dst=g, what="weight", bytes=st.weight_bytes)
        wait = {g: op("wait", g, k, "forward", [fetched[g]]) for g in self.head_gpus}
        for i in range(m):
            g = self.heads[i]
            deps: list[int | None] = [wait[g]]
            for j, inp in enumerate(st.inputs):
                if self.direct[k][j]:
                    deps.append(self.pushed.get((k, j, i), self.run_f[(k - 1, i)]))
                else:
                    src_op = self.hosted.get((inp.source, i)) if inp.source >= 0 else None
                    deps.append(op("send", g, k, "forward", [src_op], microbatch=i, src=HOST, dst=g,
                                   what="activation", bytes=inp.bytes, value=j))
            r = self.run_f[(k, i)] = op("run", g, k, "forward", deps, microbatch=i)
            for j, inp in enumerate(st.inputs):
                if self.direct[k][j] and self.has_bwd[k]:
                    self.saved[(k, j, i)] = op("offload", g, k, "forward", [r], microbatch=i, src=g, dst=HOST,
                                               what="input", bytes=inp.bytes, value=j)
            for p, nb in enumerate(st.host_outputs):
                self.hosted[(k, i)] = op("send", g, k, "forward", [r], microbatch=i, src=g, dst=HOST,
                                         what="activation", bytes=nb, value=p)
                self.hosted_all[(k, i)].append(self.hosted[(k, i)])
        for g in self.head_gpus:  # held for its backward there (the last stage on every GPU that runs it)
            last = max(self.run_f[(k, i)] for i in range(m) if self.heads[i] == g)
            if self.keeps[k]:
                op("hold", g, k, "forward", [last])
            else:
                self.last_evict[g] = op("evict", g, k, "forward", [last])

    def backward(self, k: int) -> None:
        if k != self.last:
            super().backward(k)
            return
        st, op, h = self.stages[k], self.op, self.gpu[k]
        wait = {g: op("wait", g, k, "backward", [self.head_fetched[g]]) for g in self.head_gpus}  # held since forward
        prev = self.bprev[k]
        if prev is not None and self.has_bwd[prev]:  # on its own GPU, as Mobius: the stage before it there
            self.fetched_b.add(prev)
            self.fetched[prev] = self.up(prev, "backward", [wait[h]])
        first = {g: min(i for i in range(self.m) if self.heads[i] == g) for g in self.head_gpus}
        for i in reversed(range(self.m)):
            g = self.heads[i]
            deps = [wait[g], *self.grads_back.pop((k, i), [])]
            for j, inp in enumerate(st.inputs):
                if self.direct[k][j]:
                    deps.append(op("restore", g, k, "backward", [self.saved[(k, j, i)], wait[g]], microbatch=i,
                                   src=HOST, dst=g, what="input", bytes=inp.bytes, value=j))
                else:
                    deps.append(op("send", g, k, "backward", [wait[g]], microbatch=i, src=HOST, dst=g, what="input",
                                   bytes=inp.bytes, value=j))
            for p, nb in enumerate(st.host_outputs):
                if st.host_grads and not st.host_grads[p]:
                    continue
                deps.append(op("send", g, k, "backward", self.hosted_all[(k, i)], microbatch=i, src=HOST, dst=g,
                               what="activation", bytes=nb))
            r = self.run_b[(k, i)] = op("run", g, k, "backward", deps, microbatch=i)
            self._grads_out(k, i, r)
            if i == first[g]:  # that GPU's last micro-batch: its partial gradient to the host, its copy evicted
                if st.grad_bytes:  # partials from several GPUs: as streamed (`StageIO.partial_grad_bytes`)
                    nbytes = st.partial_bytes() if len(self.head_gpus) > 1 else st.grad_bytes
                    self.head_downloads.setdefault(k, []).append(
                        op("download", g, k, "backward", [r], src=g, dst=HOST, what="gradient", bytes=nbytes))
                    self.grad_downloads[k].append(self.head_downloads[k][-1])
                self.head_evict[g] = op("evict", g, k, "backward", [r])
        self.evicted_b[k] = self.head_evict[h]
