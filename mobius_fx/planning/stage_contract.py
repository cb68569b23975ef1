"""The op contract between the passes and the runtime: the stages, the schedule the runtime reads, the ops.

`passes.insert_transfers` cuts the traced graph into `StageSpec`s and writes the forward of the
schedule as a `Schedule`: a `torch.fx.Graph` of calls to the ops below, in schedule order;
`passes.emit` turns it into the program a `Pipeline` runs. The runtime (`runtime.engine.Runtime`)
reads the `Schedule` and implements the ops: it is a `StageRuntime`. Both sides import this
module and nothing of each other.

The ops (`OPS`, by the name the program prints them under):

- `prefetch(stage)`: start copying the stage's weights to its GPU;
- `wait(stage)`: order the stage's compute after its weight upload;
- `run_stage(stage, microbatch, *inputs)`: one micro-batch through one stage, its outputs a tuple;
- `send(value, gpu, stage)`: copy the tensors in `value` to GPU `gpu` (or to the host, "host");
- `evict(stage)`: free the stage's GPU copy of its weights;
- `hold_for_backward(stage)`: keep the stage (the last its GPU runs) resident for backward;
- `split_microbatches(inputs, m)` / `merge_microbatches(outputs)`: the batch into micro-batches
  and their outputs back into one (mobius_fx/planning/microbatch.py).

Each op acts on the `StageRuntime` of the Pipeline being called (`running(rt)`, a context
variable the Pipeline sets around its program), so the program itself holds no state. The
stateful ops are registered side-effectful, so `graph.eliminate_dead_code()` keeps them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from mobius_fx.errors import MobiusError
from mobius_fx.planning.schedule_ir import ScheduleIR, StageIO, build_schedule

__all__ = ["ValueRef", "WeightRef", "StageSpec", "Schedule", "stages_ir", "StageRuntime", "prefetch", "wait",
           "run_stage", "send", "evict", "hold_for_backward", "split_microbatches", "merge_microbatches", "OPS", "running"]


# ----------------------------------------------------------------------------- the stages and the schedule

@dataclass(frozen=True)
class ValueRef:
    """A value that crosses a stage boundary: output `index` of `stage` (stage -1: a model input).

    Not a tuple on purpose: fx's `map_aggregate` would walk into it.
    """

    stage: int
    index: int
    name: str


@dataclass(frozen=True, eq=False)
class WeightRef:
    """A tensor a stage reads (parameter, buffer or front-end constant), once per tensor object.

    `name` is its qualified name in the traced GraphModule; `slots` are the (owner module path,
    attribute) places in the stage module that hold it (tied weights: several places).
    """

    name: str
    tensor: torch.Tensor
    slots: tuple[tuple[str, str], ...]


@dataclass(frozen=True, eq=False)
class StageSpec:
    """One stage: its module (inputs -> tuple of outputs), what flows in and out, its weights."""

    index: int
    gpu: str
    module: fx.GraphModule
    nodes: tuple[str, ...]
    inputs: tuple[ValueRef, ...]
    outputs: tuple[str, ...]
    weights: tuple[WeightRef, ...]
    shells: tuple[tuple[nn.Module, nn.Module], ...] = ()  # (user module, its shell in this stage)


@dataclass(frozen=True, eq=False)
class Schedule:
    """The stages and the schedule graph; `emit` turns it into the pipeline's program."""

    stages: tuple[StageSpec, ...]
    graph: fx.Graph
    microbatches: int
    gpus: tuple[str, ...]  # distinct GPUs in order of first use (the cross-mapped order)
    next_on_gpu: tuple[int | None, ...]  # the stage the same GPU runs next (prefetched ahead)
    prev_on_gpu: tuple[int | None, ...]  # the stage the same GPU ran before (prefetched in backward)
    inputs: tuple[str, ...]  # placeholder names of the traced graph, in order
    out_spec: pytree.TreeSpec | None = None  # torch.export's output TreeSpec (None: the graph returns the structure)
    moved: tuple[str, ...] = field(default=())  # compute nodes not listed, placed with their predecessor
    to_host: tuple[tuple[int, ...], ...] = ()  # per stage: its outputs copied to the host (read later or returned)
    built_ir: ScheduleIR | None = field(default=None, repr=False)  # `stages_ir` of the above, built once (`ir()`)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def last_on_gpu(self, k: int) -> bool:
        return self.next_on_gpu[k] is None

    def ir(self) -> ScheduleIR:
        """The schedule IR of these stages (`stages_ir`), built once: `insert_transfers` builds it,
        lowers the forward program from it and gives it to the Schedule (`built_ir`). The runtime
        takes its backward prefetches and slot plan from it, `pipe.code` prints its backward part
        and the step executor compares its resident stages with it; the Pipeline's
        `schedule_ir(values)` gives the one with exact activation bytes."""
        if self.built_ir is None:  # a Schedule made without the pass: built at the first call, kept
            object.__setattr__(self, "built_ir", stages_ir(self.stages, self.to_host, self.microbatches))
        return self.built_ir


def stages_ir(stages: tuple[StageSpec, ...], to_host: tuple[tuple[int, ...], ...], microbatches: int) -> ScheduleIR:
    """The schedule IR of `stages` (`to_host[k]`: stage k's outputs copied to the host): order and
    dependencies, weight and gradient bytes in the masters' dtype, activations 0 bytes, no
    optimizer `step`s (a step's IR is the step executor's, `executor.step_ir`)."""
    def size(ts) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    return build_schedule(StageIO.from_graph(
        stages, to_host, weight_bytes=[size(w.tensor for w in st.weights) for st in stages],
        grad_bytes=[size(w.tensor for w in st.weights
                         if isinstance(w.tensor, nn.Parameter) and w.tensor.requires_grad) for st in stages]),
        microbatches, optimizer=False)


# ----------------------------------------------------------------------------- the ops

class StageRuntime(Protocol):
    """What runs the ops: one method per op (`runtime.engine.Runtime` is the one the package has).
    A value is a tensor or a pytree of tensors (`send` copies every tensor in it)."""

    def prefetch(self, k: int) -> None: ...
    def wait(self, k: int) -> None: ...
    def run(self, k: int, i: int, args: tuple) -> tuple: ...
    def send(self, value: Any, gpu: str, stage: int | None = None) -> Any: ...
    def evict(self, k: int) -> None: ...
    def hold(self, k: int) -> None: ...
    def split(self, inputs: tuple, m: int) -> tuple: ...
    def merge(self, outputs: list) -> Any: ...


# The runtime the ops of the Pipeline now running act on.
_ACTIVE: contextvars.ContextVar[StageRuntime | None] = contextvars.ContextVar("mobius_fx_runtime", default=None)


@contextlib.contextmanager
def running(rt: StageRuntime) -> Iterator[None]:
    """The ops called inside act on `rt` (a Pipeline's runtime, which calls its program here)."""
    token = _ACTIVE.set(rt)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _runtime() -> StageRuntime:
    rt = _ACTIVE.get()
    if rt is None:
        raise MobiusError("a schedule op ran outside a Pipeline call; call the Pipeline (pipe(x)), not its program")
    return rt


def prefetch(stage: int) -> None:
    """Start copying stage `stage`'s weights to its GPU (no-op when already there)."""
    _runtime().prefetch(stage)


def wait(stage: int) -> None:
    """Order the stage's compute after its weight upload."""
    _runtime().wait(stage)


def run_stage(stage: int, microbatch: int, *inputs: Any) -> tuple:
    """Run one micro-batch through one stage; returns the stage's outputs (a tuple)."""
    return _runtime().run(stage, microbatch, inputs)


def send(value: Any, gpu: str, stage: int | None = None) -> Any:
    """Copy the tensors in `value` to GPU `gpu` (or to host memory for "host") for `stage`
    (the stage the schedule IR books the copy under)."""
    return _runtime().send(value, gpu, stage)


def evict(stage: int) -> None:
    """Free the stage's GPU copy of its weights."""
    _runtime().evict(stage)


def hold_for_backward(stage: int) -> None:
    """Keep the stage (the last its GPU runs) resident for backward; evict it if none will come."""
    _runtime().hold(stage)


def split_microbatches(inputs: tuple, microbatches: int) -> tuple:
    """Split each input into micro-batches: (in0_mb0, in0_mb1, ..., in1_mb0, ...)."""
    return _runtime().split(inputs, microbatches)


def merge_microbatches(outputs: list) -> Any:
    """The micro-batches' outputs as one output, each combined as mobius_fx/planning/microbatch.py says."""
    return _runtime().merge(outputs)


for _fn in (prefetch, wait, run_stage, send, evict, hold_for_backward):
    fx.node._side_effectful_functions.add(_fn)

OPS = {f.__name__: f for f in (prefetch, wait, run_stage, send, evict, hold_for_backward, split_microbatches,
                               merge_microbatches)}
