"""The training step as one generated program: a torch.fx GraphModule built from the schedule IR.

`pipe.train_step` runs this program. It holds the whole step, one `call_function` node per IR op
(`prefetch`, `wait`, `run_forward`, `send`, `offload`, `hold`, `evict`, `restore`,
`run_backward`, `download`, `step`, ...), phase by phase (forward, backward, optimizer), each in
the IR's issue order, each node taking the nodes of the ops it waits for (the op's `deps` and
`starts`) as its arguments: the program's order is a topological order of the IR's
dependencies by construction (fx refuses a node that reads a later one; an IR whose op waits
for a later one is refused here). Around the ops, four nodes of the step itself: `split` (the
inputs into micro-batches), `loss` (the end of the forward: the last stage's host copies
combined into the step's output, differentiated on the host to seed the backward), `backward`
(the backward begins) and `gradients` (each master's host gradient). Each op node calls its
handler in runtime/executor.py (`StepExecutor`, one per op kind and phase): the program is the
order, the handlers are what an op does. Printed (`pipe.step_pipeline.code`):

    def forward(self, inputs, scale):
        # the training step, schedule 'mobius': 4 stages on gpu0, gpu1; 2 micro-batches; the loss on the last stage
        microbatches = split(inputs, names=('x', 'target'))
        # ---- forward
        op0 = prefetch(op=0, stage=0, at='gpu0', move='weight host->gpu0 1088B')
        op1 = prefetch(op=1, stage=1, at='gpu1', move='weight host->gpu1 1088B')
        op2 = wait(op0, op=2, stage=0, at='gpu0')
        op3 = prefetch(op2, op=3, stage=2, at='gpu0', move='weight host->gpu0 1088B')
        op4 = send(microbatches, op=4, stage=0, mb=0, at='gpu0', move='activation host->gpu0', value=0)
        op5 = run_forward(op2, op4, op=5, stage=0, mb=0, at='gpu0')
        ...
        loss = loss_on_host(op10, op14, ..., op37, scale=scale)
        # ---- backward
        backward = begin_backward(loss)
        ...
        op43 = run_backward(op38, op40, op41, op42, op=43, stage=3, mb=1, at='gpu1')
        ...
        gradients = gradients_to_masters(op50, op51, ..., op77)
        # ---- optimizer
        op78 = step(gradients, op76, op=78, stage=0, at='host')
        ...
        return loss

The program runs as the backward of one autograd node over the trainable masters (`_Step`):
the optimizer overlap steps a master during the backward only while autograd's engine runs a
backward that will accumulate into its `.grad`, and autograd accumulates the host gradients
into `.grad` when the program returns, as `loss.backward()` does (hooks run). The forward-only
call (`pipe(x)`, eval, no_grad) runs the forward program the emit pass generates
(passes/emit.py), not this one.
"""

from __future__ import annotations

import contextvars
import re
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.function import once_differentiable
from torch.fx.graph import CodeGen

from mobius_fx.errors import MobiusError
from mobius_fx.kinds import HOST
from mobius_fx.planning.schedule_ir import Op, OpKind, ScheduleIR
from mobius_fx.runtime.step_output import step_output

__all__ = ["STEP_OPS", "build_program", "run_program"]


class _Run:
    """One execution of a step program: its executor and where the step stands."""

    __slots__ = ("ex", "trainable", "backward_on", "in_backward", "locked", "out", "grads")

    def __init__(self, ex: Any, trainable: dict[int, torch.Tensor]) -> None:
        self.ex = ex
        self.trainable = trainable  # the trainable masters, by id
        self.backward_on = False  # the backward runs (a stage ran a forward that saved inputs, masters train)
        self.in_backward = False  # between begin_backward and the gradients: a failure is the backward's
        self.locked = False  # the runtime's lock is held (the backward ops, as the eager backward holds it)
        self.out: Any = None  # the step's output (the `loss` node's value)
        self.grads: dict[int, torch.Tensor] = {}  # the host gradient of each master, by id

    def op(self, index: int) -> None:
        """Op `index` of the executor's IR, by its handler in its phase; the backward's and the
        optimizer's only when the backward runs."""
        ex = self.ex
        o = ex.ir.ops[index]
        if o.phase == "forward":
            ex._handler(ex._forward_handlers, o)(o)
        elif self.backward_on:
            ex._handler(ex._backward_handlers if o.phase == "backward" else ex._optimizer_handlers, o)(o)


# The step program now running (set by `run_program` around the GraphModule's call).
_RUNNING: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("mobius_fx_step", default=None)


def _run() -> _Run:
    run = _RUNNING.get()
    if run is None:
        raise MobiusError("a step op ran outside pipe.train_step: the step program's ops act on the step in progress; "
                          "call pipe.train_step(x, target=y), not the program")
    return run


# ----------------------------------------------------------------------------- the ops, one function per kind

def prefetch(*after: object, op: int, **where: object) -> None:
    """Upload a stage's weights to the op's GPU (executor: `_prefetch`)."""
    _run().op(op)


def wait(*after: object, op: int, **where: object) -> None:
    """Order the stage's compute after its weight upload."""
    _run().op(op)


def run_forward(*after: object, op: int, **where: object) -> None:
    """One micro-batch through one stage, without an autograd graph; its inputs saved for backward."""
    _run().op(op)


def run_backward(*after: object, op: int, **where: object) -> None:
    """One micro-batch's backward of one stage: recompute from the restored inputs, autograd inside it."""
    _run().op(op)


def send(*after: object, op: int, **where: object) -> None:
    """A value or a gradient between GPUs, or to or from the host."""
    _run().op(op)


def offload(*after: object, op: int, **where: object) -> None:
    """A saved input to the host (issued by the run; the op checks it was)."""
    _run().op(op)


def restore(*after: object, op: int, **where: object) -> None:
    """A saved input back on the GPU for the backward."""
    _run().op(op)


def download(*after: object, op: int, **where: object) -> None:
    """A stage's gradient sums to the host, handed over to the optimizer overlap when complete."""
    _run().op(op)


def evict(*after: object, op: int, **where: object) -> None:
    """Free the stage's GPU copy of its weights."""
    _run().op(op)


def hold(*after: object, op: int, **where: object) -> None:
    """Keep the stage (the last its GPU runs in forward) for its backward."""
    _run().op(op)


def step(*after: object, op: int, **where: object) -> None:
    """A stage's optimizer step: where the overlap takes its gradients (or the user's opt.step())."""
    _run().op(op)


def collective(*after: object, op: int, **where: object) -> None:
    """A GPU's share of a host-routed collective (refused by the executor)."""
    _run().op(op)


# ----------------------------------------------------------------------------- the step's own nodes

def split(inputs: list, names: tuple = ()) -> None:
    """The step's inputs into micro-batches (`StepExecutor._split`)."""
    _run().ex._split(list(inputs))


def loss_on_host(*after: object, scale: float) -> Any:
    """The end of the forward: the buffers updated once, then the micro-batches' host copies
    combined into the step's output and differentiated on the host from `scale` (step_output.py)."""
    ex = _run().ex
    ex.rt.executing = None
    ex.rt.end_forward()
    return step_output(ex, scale)


def begin_backward(*after: object) -> None:
    """The backward begins when the forward ran a stage that saved inputs and a master trains;
    under the runtime's lock (as the eager backward's stage calls hold it), the overlap told."""
    run = _run()
    rt = run.ex.rt
    step_ = rt.step
    run.backward_on = step_.state == "forward" and any(step_.fwd_calls) and bool(run.trainable)
    if not run.backward_on:
        return
    rt._lock.acquire()
    run.locked = True
    step_.state = "backward"
    step_.bwd_calls = [0] * len(rt.stages)
    if rt.overlap is not None:
        rt.overlap.backward_started()
    run.in_backward = True


def gradients_to_masters(*after: object) -> None:
    """The end of the backward: everything the step started ended (`StepExecutor._check_done`),
    the host gradient of each master, which autograd accumulates into `.grad` when the program
    returns (`_Step`), as `loss.backward()` does (hooks run)."""
    run = _run()
    if not run.backward_on:
        return
    rt = run.ex.rt
    run.ex._check_done()
    run.grads = rt._gradients(rt.step)
    run.in_backward = False
    run.locked = False
    rt._lock.release()


class _Step(torch.autograd.Function):
    """The masters' place in autograd for one step: its backward runs the step program, so
    autograd's engine is running, and will accumulate into the masters' `.grad`, while the
    program's backward ops hand gradients to the optimizer overlap (which steps a master only
    then: `overlap.engine_accumulates`); it returns the host gradients the program made, which
    autograd accumulates into `.grad` (hooks run)."""

    @staticmethod
    def forward(ctx, run: _Run, program: fx.GraphModule, flat: list, scale: float, anchor: torch.Tensor,
                *masters: torch.Tensor):
        ctx.run, ctx.program, ctx.flat, ctx.scale = run, program, flat, scale
        return anchor.detach().clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, _):
        run, program, flat, scale = ctx.run, ctx.program, ctx.flat, ctx.scale
        ctx.run = ctx.program = ctx.flat = None
        rt = run.ex.rt
        token = _RUNNING.set(run)  # on the thread autograd runs this backward on
        try:
            with torch.no_grad():
                run.out = program(flat, scale)
        except BaseException as e:
            if run.in_backward:
                rt.backward_failed(rt.step, e, explain=False)  # Pipeline._forward explains it
            raise
        finally:
            _RUNNING.reset(token)
            if run.locked:
                run.locked = False
                rt._lock.release()
        return (None, None, None, None, None, *(run.grads.get(i) for i in run.trainable))


# The function of each op kind (a run: per phase), by the name the program prints.
STEP_OPS = {f.__name__: f for f in (prefetch, wait, run_forward, run_backward, send, offload, restore, download,
                                    evict, hold, step, collective)}
_OWN = {f.__name__: f for f in (split, loss_on_host, begin_backward, gradients_to_masters)}
for _fn in (*STEP_OPS.values(), *_OWN.values()):
    fx.node._side_effectful_functions.add(_fn)


def op_function(o: Op) -> Any:
    """The program's function for op `o`."""
    kind = str(o.kind)
    if o.kind == OpKind.RUN:
        kind = "run_forward" if o.phase == "forward" else "run_backward"
    return STEP_OPS[kind]


# ----------------------------------------------------------------------------- building and running

_PHASES = ("forward", "backward", "optimizer")


def build_program(ir: ScheduleIR, inputs: tuple[str, ...], name: str = "mobius") -> fx.GraphModule:
    """The step program of `ir` (module docstring); `inputs`: the step's input names, `name`:
    its schedule's. The nodes go phase by phase (forward, backward, optimizer), each in the IR's
    issue order; an op that waits for one after it there is refused."""
    graph = fx.Graph()
    flat = graph.placeholder("inputs")
    scale = graph.placeholder("scale")
    off = next((i for i, o in enumerate(ir.ops) if o.index != i), None)
    if off is not None:
        raise MobiusError(f"op {ir.ops[off]} is at position {off} of the IR of schedule {name!r}: an op's index is its "
                          f"position (its deps name positions); renumber the ops (fix the schedule's runtime form, "
                          f"mobius_fx/planning/ir_transforms.py)")
    where: dict[int, int] = {}  # op index -> its position in the program
    nodes: dict[int, fx.Node] = {}
    order = [o for phase in _PHASES for o in ir.ops if o.phase == phase]
    for pos, o in enumerate(order):
        where[o.index] = pos
    for o in order:
        late = [d for d in (*o.deps, *o.starts) if where.get(d, len(order)) >= where[o.index]]
        if late:
            d = late[0]
            other = str(ir.ops[d]) if 0 <= d < len(ir.ops) else f"op {d} (not in the IR)"
            raise MobiusError(f"op {o} waits for {other}, which the step runs after it (forward, then backward, then "
                              f"the optimizer, each in the IR's issue order): the IR of schedule {name!r} is not in "
                              f"an order the step can run; issue each op after the ops it depends on (fix the "
                              f"schedule's runtime form, mobius_fx/planning/ir_transforms.py) or compile with "
                              f"schedule='mobius'")
    m, s = ir.microbatches, len(ir.stages)
    header = (f"the training step, schedule {name!r}: {s} stage{'s' if s != 1 else ''} on {', '.join(ir.gpus)}; "
              f"{m} micro-batch{'es' if m != 1 else ''}; the loss on the last stage")
    heads: dict[str, str] = {}  # the node each phase begins at -> the phase
    mbs = graph.create_node("call_function", split, (flat,), {"names": tuple(inputs)}, name="microbatches")
    loss = begin = grads = None
    for o in order:
        if o.phase != "forward" and loss is None:
            loss, begin = _end_forward(graph, nodes, order, scale)
        if o.phase == "optimizer" and grads is None:
            grads = _end_backward(graph, nodes, order)
        after = [nodes[d] for d in sorted({*o.deps, *o.starts})]
        if o.phase == "forward" and o.kind == OpKind.SEND and o.src == HOST and o.value is not None \
                and o.value < len(ir.stages[o.stage].inputs) and ir.stages[o.stage].inputs[o.value].source < 0:
            after.insert(0, mbs)  # a model input: its micro-batches
        elif o.phase == "backward" and not any(ir.ops[d].phase == "backward" for d in o.deps):
            after.insert(0, begin)
        elif o.phase == "optimizer":
            after.insert(0, grads)
        node = graph.create_node("call_function", op_function(o), tuple(after), _where(o), name=f"op{o.index}")
        node.meta["mobius_op"] = o
        nodes[o.index] = node
        if o.phase != "backward" and o.phase not in heads.values():
            heads[node.name] = o.phase
    if loss is None:
        loss, begin = _end_forward(graph, nodes, order, scale)
    if grads is None:
        grads = _end_backward(graph, nodes, order)
    graph.output(loss)
    heads[begin.name] = "backward"
    graph.set_codegen(_StepCodeGen(header, heads))
    program = fx.GraphModule(nn.Module(), graph, class_name="MobiusStep")
    program.graph.lint()
    program.ir = ir  # the IR it was built from (the executor rebuilds it for another)
    return program


def _end_forward(graph: fx.Graph, nodes: dict[int, fx.Node], order: list[Op], scale: fx.Node) -> tuple:
    """The `loss` node after every forward op that no later forward op waits for, and the
    `backward` node after it."""
    loss = graph.create_node("call_function", loss_on_host, tuple(_sinks(nodes, order, "forward")), {"scale": scale},
                             name="loss")
    return loss, graph.create_node("call_function", begin_backward, (loss,), name="backward")


def _end_backward(graph: fx.Graph, nodes: dict[int, fx.Node], order: list[Op]) -> fx.Node:
    return graph.create_node("call_function", gradients_to_masters, tuple(_sinks(nodes, order, "backward")),
                             name="gradients")


def _sinks(nodes: dict[int, fx.Node], order: list[Op], phase: str) -> list[fx.Node]:
    """The nodes of `phase`'s ops that no later op of that phase waits for."""
    ops = [o for o in order if o.phase == phase]
    waited = {d for o in ops for d in (*o.deps, *o.starts)}
    return [nodes[o.index] for o in ops if o.index not in waited]


def _where(o: Op) -> dict[str, object]:
    """The node's keyword arguments: the op's index (what the function runs) and, to read, where."""
    kw: dict[str, object] = {"op": o.index, "stage": o.stage}
    if o.microbatch is not None:
        kw["mb"] = o.microbatch
    kw["at"] = o.place
    if o.src:
        kw["move"] = f"{o.what} {o.src}->{o.dst}" + (f" {o.bytes}B" if o.bytes else "")
    if o.value is not None:
        kw["value"] = o.value
    return kw


_KW = re.compile(r"(\w+) = ")
_FREE = re.compile(r";  (?:\w+ = )+None$")
_ASSIGN = re.compile(r"^\s*(\w+) = ")


class _StepCodeGen(CodeGen):
    """Prints the ops by their short names, `k=v` keywords, no `x = None` lines (the ops' values
    are tokens), a header and a comment where each phase begins."""

    def __init__(self, header: str, heads: dict[str, str]) -> None:
        super().__init__()
        self._header, self._heads = header, heads
        self._body_transformer = self._tidy

    def _gen_python_code(self, nodes: list[fx.Node], root_module: str, namespace: fx.graph._Namespace,
                         *args: object, **kwargs: object) -> fx.graph.PythonCode:
        for name, fn in (*STEP_OPS.items(), *_OWN.items()):  # claim the short names before any node takes them
            namespace.create_name(name, fn)
        return super()._gen_python_code(nodes, root_module, namespace, *args, **kwargs)

    def _tidy(self, body: list[str]) -> list[str]:
        out = [f"# {self._header}"]
        for line in "".join(body).split("\n"):
            line = _FREE.sub("", line)
            a = _ASSIGN.match(line)
            if a and a.group(1) in self._heads:
                out.append(f"# ---- {self._heads[a.group(1)]}")
            if "(" in line:
                head, rest = line.split("(", 1)
                line = head + "(" + _KW.sub(r"\1=", rest)
            out.append(line)
        return ["\n".join(out)]


def run_program(ex: Any, flat: list, scale: float) -> Any:
    """Run one training step of executor `ex` (runtime/executor.py) on its inputs `flat`, the
    backward seeded with `scale` x the loss: its step program (built for `ex.ir`, rebuilt when
    that changes), every op by its handler, run as the backward of one autograd node over the
    trainable masters (`_Step`). Returns the (detached) output. A failed step is dropped: the
    backward's failure handled as the eager backward's (`backward_failed`), the stages back
    home, nothing the step saved kept."""
    program = ex.__dict__.get("step_gm")
    if program is None or program.ir is not ex.ir:
        program = ex.step_gm = build_program(ex.ir, tuple(ex.schedule.inputs), ex.name)
    rt = ex.rt
    ex._reset()
    homes = rt._slot_home
    if ex.slot_home is not None:
        rt._slot_home = ex.slot_home
    run = _Run(ex, {id(m): m for st in rt.stages for m, p in zip(st.masters, st.is_param) if p and m.requires_grad})
    try:
        rt.executing = ex
        with torch.enable_grad():
            hub = _Step.apply(run, program, flat, scale, rt._anchor, *run.trainable.values())
        hub.backward()
        if run.backward_on and rt.overlap is not None:
            rt.overlap.backward_done()
    finally:
        rt.executing = None
        rt._slot_home = homes
        ex._home()
        ex._reset()  # a failed step keeps none of its saved inputs, outputs or gradients
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), run.out)
