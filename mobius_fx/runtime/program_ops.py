"""The schedule ops: the functions the pipeline's fx program calls, in the order the schedule says.

`passes.insert_transfers` writes the schedule as calls to these; `passes.emit` turns it into the
program a `Pipeline` runs. Each acts on the runtime of the Pipeline being called (a context
variable the Pipeline sets around its program), so the program itself holds no state. They are
registered side-effectful, so `graph.eliminate_dead_code()` keeps them. This module imports
nothing from the runtime or the passes: both import it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch.fx as fx

from mobius_fx.errors import MobiusError

__all__ = ["prefetch", "wait", "run_stage", "send", "evict", "hold_for_backward", "split_microbatches",
           "merge_microbatches", "OPS", "running"]

# The runtime (mobius_fx.runtime.engine.Runtime) the ops of the Pipeline call now running act on.
_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("mobius_fx_runtime", default=None)


@contextlib.contextmanager
def running(rt: Any) -> Iterator[None]:
    """The ops called inside act on `rt` (a Pipeline's runtime, which calls its program here)."""
    token = _ACTIVE.set(rt)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _runtime() -> Any:
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
