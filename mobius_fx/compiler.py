"""The declared pass pipeline: trace -> annotate -> partition (cut + cross map) -> plan
-> insert_transfers -> emit.

Each pass declares the facts it reads and writes (names such as "graph", "node.meta.mobius",
"layers", "partition", "order", "plan", "stages", "pipeline"). Before anything runs,
`PassPipeline.check()` walks the list and raises naming the pass and the missing fact when a
read is not written by an earlier pass (or given up front). While it runs, `PassPipeline.run`
records what each pass really touches and raises naming the pass and the fact when it reads or
writes one it did not declare, so the declarations cannot drift from the code (see `Touched`
for what is recorded and what is not). Users replace or insert passes by name, e.g. their own
partitioner:

    pipeline = default_pipeline()
    pipeline.replace("partition", FunctionPass("my_partition", my_fn,
                                               reads=("layers", "topology"), writes=("partition",)))

Passes are `torch.fx.passes.infra.PassBase` subclasses, so each also runs on its own as
`pass_(graph_module)` once bound to a context.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from mobius_fx.errors import MobiusError
from mobius_fx.options import CompileContext

__all__ = ["MobiusPass", "FunctionPass", "PassPipeline", "Touched", "default_pipeline", "heartbeat",
           "PASS_ORDER"]

log = logging.getLogger("mobius_fx")

PASS_ORDER = ("trace", "annotate", "partition", "plan", "insert_transfers", "emit")


@dataclass(frozen=True)
class Touched:
    """The facts one pass really read and wrote in a run, as `PassPipeline.run` recorded them.

    Recorded: every CompileContext field the pass gets or sets (its fact, see CompileContext),
    the graph module it is handed (a pass that declares the read "graph" gets it and counts as
    reading it; any other pass gets a stand-in that raises on use), the graph module it returns
    ("graph" written), and `node.meta["mobius"]` entries it adds, replaces or removes on the
    graph's nodes ("node.meta.mobius" written). Not recorded (they would need every object
    wrapped, so declare them by hand): reads of `node.meta["mobius"]`, changes made inside a
    fact's value (an item of `ctx.layers` edited in place), and a graph module changed in place
    by a pass that then returns None.
    """

    reads: frozenset = frozenset()
    writes: frozenset = frozenset()


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
        """Check the declarations, then run each pass on `ctx`, recording what it touches in
        `ctx.touched` and raising MobiusError when that is more than it declares."""
        self.check()
        ctx.facts.update(self.given)
        for p in self.passes:
            t0 = time.perf_counter()
            with heartbeat(f"pass {p.name}"):
                ctx.touched[p.name] = _run_recorded(p, ctx)
            ctx.facts.update(p.writes)
            ctx.timings[p.name] = time.perf_counter() - t0
            log.info("pass %s done in %.2f s", p.name, ctx.timings[p.name])
        return ctx


PROGRESS_EVERY = 10.0  # seconds between two "still running" lines of a long pass (`heartbeat`)


@contextlib.contextmanager
def heartbeat(what: str, every: float | None = None):
    """While the block runs, log "`what`: still running (N s)" at INFO every `every` seconds
    (default `PROGRESS_EVERY`): a long trace or MIP says it is alive in a log file or pipe too,
    where no progress bar shows. Nothing when the "mobius_fx" logger does not log INFO."""
    every = PROGRESS_EVERY if every is None else every
    if not log.isEnabledFor(logging.INFO) or every <= 0:
        yield
        return
    done = threading.Event()
    t0 = time.perf_counter()

    def beat() -> None:
        while not done.wait(every):
            log.info("%s: still running (%.0f s)", what, time.perf_counter() - t0)

    thread = threading.Thread(target=beat, name="mobius-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


# ---------------------------------------------------------------- recording what a pass touches
_BOOKKEEPING = frozenset({"facts", "timings", "touched"})
_FACT_OF_FIELD = {"gm": "graph", "example_kwargs": "example_inputs", "wiring": "settings"}


def _fact(attr: str) -> str:
    return _FACT_OF_FIELD.get(attr, attr)


class _Recorder:
    """The CompileContext as one pass sees it: each field it gets or sets is noted as a fact
    read or written (a read of a fact the pass already wrote is its own, not an input)."""

    __slots__ = ("_ctx", "_reads", "_writes")

    def __init__(self, ctx: CompileContext) -> None:
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "_reads", {})  # fact -> how it was touched, for the error
        object.__setattr__(self, "_writes", {})

    @property  # type: ignore[misc]
    def __class__(self):  # isinstance(ctx, CompileContext) holds inside a pass
        return CompileContext

    def _note(self, kind: str, fact: str, how: str) -> None:
        book = self._writes if kind == "write" else self._reads
        if kind == "write" or fact not in self._writes:
            book.setdefault(fact, how)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._ctx, name)
        if name not in _BOOKKEEPING and not name.startswith("__"):
            self._note("read", _fact(name), f"ctx.{name}")
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, _Undeclared):
            value.refuse()
        if name not in _BOOKKEEPING:
            self._note("write", _fact(name), f"ctx.{name} = ...")
        setattr(self._ctx, name, value)

    def __delattr__(self, name: str) -> None:
        self._note("write", _fact(name), f"del ctx.{name}")
        delattr(self._ctx, name)


class _Undeclared:
    """What a pass that does not declare the read "graph" is handed instead of the graph module."""

    def __init__(self, name: str, reads: tuple[str, ...]) -> None:
        self._name, self._reads = name, reads

    def refuse(self, *_: Any, **__: Any) -> Any:
        raise MobiusError(f"pass {self._name!r} uses the graph module it is handed, but 'graph' is not among its "
                          f"declared reads {list(self._reads)}; a pass may touch only the facts it declares (so "
                          f"PassPipeline.check can order the passes); add 'graph' to the pass's reads")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        self.refuse()

    __call__ = __getitem__ = __iter__ = __len__ = __contains__ = __bool__ = refuse

    def __repr__(self) -> str:
        return f"<graph module hidden from pass {self._name!r}: not among its reads>"


def _mobius_meta(gm: Any) -> dict[Any, Any]:
    """node -> node.meta["mobius"] on `gm`'s graph ({} when there is no graph module)."""
    if not isinstance(gm, torch.fx.GraphModule):
        return {}
    return {n: n.meta["mobius"] for n in gm.graph.nodes if "mobius" in n.meta}


def _mobius_meta_changed(before: dict[Any, Any], gms: Iterable[Any]) -> bool:
    """Whether a node of `gms` has a "mobius" entry that none had before, or lost its own."""
    old = {id(v) for v in before.values()}
    for gm in gms:
        now = _mobius_meta(gm)
        if any(id(v) not in old for v in now.values()):
            return True
        if isinstance(gm, torch.fx.GraphModule) and any(n in before and n not in now for n in gm.graph.nodes):
            return True
    return False


def _run_recorded(p: MobiusPass, ctx: CompileContext) -> Touched:
    """Run pass `p` on `ctx` through a _Recorder; raise MobiusError for undeclared facts."""
    rec = _Recorder(ctx)
    gm = ctx.gm
    handed: Any = gm if "graph" in p.reads else _Undeclared(p.name, p.reads)
    if handed is gm and gm is not None:
        rec._note("read", "graph", "the graph module argument")
    meta_before = _mobius_meta(gm)
    p.ctx = rec  # type: ignore[assignment]
    try:
        res = p(handed)
    finally:
        p.ctx = None
    new = res.graph_module if res is not None else None
    if new is not None and not isinstance(new, _Undeclared):
        if new is not gm:
            ctx.gm = new
            rec._note("write", "graph", "a returned graph module")
        elif res.modified:
            rec._note("write", "graph", "the graph module, changed and returned")
    if _mobius_meta_changed(meta_before, (gm, ctx.gm)):
        rec._note("write", "node.meta.mobius", 'node.meta["mobius"] on the graph\'s nodes')
    for kind, book, declared in (("reads", rec._reads, p.reads), ("writes", rec._writes, p.writes)):
        extra = [f for f in book if f not in declared]
        if extra:
            how = ", ".join(f"{f!r} ({book[f]})" for f in extra)
            raise MobiusError(f"pass {p.name!r} {kind} {how} but declares {kind}={tuple(declared)}; a pass may touch "
                              f"only the facts it declares, so PassPipeline.check can order the passes and a "
                              f"replacement knows what to provide; add {extra} to the pass's {kind}")
    return Touched(reads=frozenset(rec._reads), writes=frozenset(rec._writes))


def default_pipeline() -> PassPipeline:
    """The standard passes, in PASS_ORDER (imported lazily: solvers load only when used)."""
    from mobius_fx import pass_adapters as std
    from mobius_fx.passes.partition import partition_pass

    return PassPipeline([
        FunctionPass("trace", std.trace_pass, reads=("model", "example_inputs", "settings"), writes=("graph",)),
        FunctionPass("annotate", std.annotate_pass, reads=("graph", "example_inputs", "settings", "topology"),
                     writes=("node.meta.mobius", "layers")),
        FunctionPass("partition", partition_pass, reads=("layers", "topology", "settings", "model", "example_inputs"),
                     writes=("partition", "order")),
        FunctionPass("plan", std.plan_pass, reads=("layers", "partition", "order", "topology", "settings", "model",
                                                   "example_inputs"), writes=("plan",)),
        FunctionPass("insert_transfers", std.insert_transfers_pass, reads=("graph", "plan"), writes=("stages",)),
        FunctionPass("emit", std.emit_pass, reads=("graph", "stages", "plan", "settings", "model", "example_inputs"),
                     writes=("pipeline",)),
    ])
