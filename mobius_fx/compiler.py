"""The declared pass pipeline: trace -> annotate -> partition -> cross_map -> plan
-> insert_transfers -> emit.

Each pass declares the facts it reads and writes (names such as "graph", "node.meta.mobius",
"layers", "partition", "order", "plan", "stages", "pipeline"). Before anything runs,
`PassPipeline.check()` walks the list and raises naming the pass and the missing fact when a
read is not written by an earlier pass (or given up front). Users replace or insert passes by
name, e.g. their own partitioner:

    pipeline = default_pipeline()
    pipeline.replace("partition", FunctionPass("my_partition", my_fn,
                                               reads=("layers", "topology"), writes=("partition",)))

Passes are `torch.fx.passes.infra.PassBase` subclasses, so each also runs on its own as
`pass_(graph_module)` once bound to a context.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from .errors import MobiusError
from .options import CompileOptions

__all__ = ["CompileContext", "MobiusPass", "FunctionPass", "PassPipeline", "default_pipeline", "PASS_ORDER"]

log = logging.getLogger("mobius_fx")

PASS_ORDER = ("trace", "annotate", "partition", "cross_map", "plan", "insert_transfers", "emit")


@dataclass
class CompileContext:
    """Everything a compile carries between passes: inputs, settings and the facts passes write.

    `facts` names what is available so far; passes read inputs from attributes here.
    """

    model: torch.nn.Module
    topology: Any
    example_inputs: tuple = ()
    example_kwargs: dict = field(default_factory=dict)
    settings: CompileOptions = field(default_factory=CompileOptions)
    gm: torch.fx.GraphModule | None = None
    layers: tuple = ()
    partition: Any = None
    order: tuple = ()
    plan: Any = None
    stages: Any = None
    pipeline: Any = None
    facts: set = field(default_factory=lambda: {"model", "topology", "example_inputs", "settings"})
    timings: dict = field(default_factory=dict)


class MobiusPass(PassBase):
    """A pass with a name and declared reads/writes. Subclasses implement `run(gm, ctx)`."""

    name: str = "pass"
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.ctx: CompileContext | None = None

    def run(self, gm: torch.fx.GraphModule | None, ctx: CompileContext) -> torch.fx.GraphModule | None:
        raise NotImplementedError

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        if self.ctx is None:
            raise MobiusError(f"pass {self.name!r} has no compile context; run it through PassPipeline.run")
        out = self.run(graph_module, self.ctx)
        return PassResult(out if out is not None else graph_module, out is not None)

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        missing = [f for f in self.reads if self.ctx is not None and f not in self.ctx.facts]
        if missing:
            raise MobiusError(f"pass {self.name!r} reads {missing} but no earlier pass wrote it")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} reads={list(self.reads)} writes={list(self.writes)}>"


class FunctionPass(MobiusPass):
    """Wrap `fn(gm, ctx) -> gm | None` as a named pass with declared reads and writes."""

    def __init__(self, name: str, fn: Callable[[Any, CompileContext], Any], *,
                 reads: Iterable[str] = (), writes: Iterable[str] = ()) -> None:
        super().__init__()
        self.name, self.fn = name, fn
        self.reads, self.writes = tuple(reads), tuple(writes)

    def run(self, gm, ctx):
        return self.fn(gm, ctx)


class PassPipeline:
    """An ordered list of passes whose declared reads/writes are checked before running."""

    def __init__(self, passes: Iterable[MobiusPass], *,
                 given: Iterable[str] = ("model", "topology", "example_inputs", "settings")) -> None:
        self.passes = list(passes)
        self.given = tuple(given)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def _index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise MobiusError(f"no pass named {name!r}; passes are {self.names}") from None

    def replace(self, name: str, new: MobiusPass) -> "PassPipeline":
        self.passes[self._index(name)] = new
        return self

    def insert_after(self, name: str, new: MobiusPass) -> "PassPipeline":
        self.passes.insert(self._index(name) + 1, new)
        return self

    def insert_before(self, name: str, new: MobiusPass) -> "PassPipeline":
        self.passes.insert(self._index(name), new)
        return self

    def remove(self, name: str) -> "PassPipeline":
        del self.passes[self._index(name)]
        return self

    def until(self, name: str) -> "PassPipeline":
        """The prefix of this pipeline that ends with pass `name` (e.g. planning only)."""
        return PassPipeline(self.passes[: self._index(name) + 1], given=self.given)

    def check(self) -> None:
        """Raise MobiusError naming the first pass that reads a fact no earlier pass wrote."""
        have = set(self.given)
        seen: set[str] = set()
        for p in self.passes:
            if p.name in seen:
                raise MobiusError(f"pass name {p.name!r} appears twice in {self.names}; names must be unique")
            seen.add(p.name)
            missing = [f for f in p.reads if f not in have]
            if missing:
                writers = [q.name for q in self.passes if set(q.writes) & set(missing)]
                hint = (f"it is written by {writers}, which must run before {p.name!r}" if writers
                        else "no pass in the pipeline writes it; insert one that does")
                raise MobiusError(f"pass {p.name!r} reads {missing}, which nothing before it writes "
                                  f"(pipeline {self.names}); {hint}")
            have.update(p.writes)

    def run(self, ctx: CompileContext) -> CompileContext:
        self.check()
        ctx.facts.update(self.given)
        for p in self.passes:
            p.ctx = ctx
            t0 = time.perf_counter()
            try:
                res = p(ctx.gm)
            finally:
                p.ctx = None
            if res is not None and res.graph_module is not None:
                ctx.gm = res.graph_module
            ctx.facts.update(p.writes)
            ctx.timings[p.name] = time.perf_counter() - t0
            log.info("pass %s done in %.2f s", p.name, ctx.timings[p.name])
        return ctx


def default_pipeline() -> PassPipeline:
    """The standard passes, in PASS_ORDER (imported lazily: solvers load only when used)."""
    from . import _stages

    return PassPipeline([
        FunctionPass("trace", _stages.trace_pass, reads=("model", "example_inputs"), writes=("graph",)),
        FunctionPass("annotate", _stages.annotate_pass, reads=("graph", "example_inputs", "settings"),
                     writes=("node.meta.mobius", "layers")),
        FunctionPass("partition", _stages.partition_pass, reads=("layers", "topology", "settings"), writes=("partition",)),
        FunctionPass("cross_map", _stages.cross_map_pass, reads=("partition", "topology", "settings"), writes=("order",)),
        FunctionPass("plan", _stages.plan_pass, reads=("layers", "partition", "order", "topology"), writes=("plan",)),
        FunctionPass("insert_transfers", _stages.insert_transfers_pass, reads=("graph", "plan", "node.meta.mobius"),
                     writes=("stages",)),
        FunctionPass("emit", _stages.emit_pass, reads=("stages", "plan"), writes=("pipeline",)),
    ])
