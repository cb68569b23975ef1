"""The step program (mobius_fx/runtime/step_program.py): the whole training step as one torch.fx
GraphModule built from the schedule IR, one node per op, which `pipe.train_step` runs.

- the program holds one node per IR op, with the op's kind, stage, micro-batch and place, and
  each op's dependencies as the node's arguments (so its order is a topological order of the
  IR's), phase by phase around the step's own nodes; a program missing a node or an edge fails
  that check (`_check_program` is itself tested against those mutations);
- it is what runs: the ops execute in the program's order, a node erased from it is an op the
  step does not run (and the executor refuses the step), and the step equals eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.planning.ir_transforms import no_prefetch, round_robin, with_fields
from mobius_fx.planning.schedule_ir import ScheduleIR, StageInput, StageIO, build_schedule
from mobius_fx.runtime import step_program
from mobius_fx.runtime.step_program import STEP_OPS, build_program, op_function
from tests.unit.test_train_step import Classifier, _assert_grads_equal, _grads

pytestmark = pytest.mark.usefixtures("one_thread")

TOPO = Topology.virtual(gpus=2, memory="64MiB")
PHASES = ("forward", "backward", "optimizer")


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return seen


def _check_program(gm: fx.GraphModule, ir: ScheduleIR) -> None:
    """One node per op of `ir` saying its kind, stage, micro-batch and place; each op's deps
    (and starts) are its node's arguments, before it; forward ops before the loss, backward ops
    after the backward begins and before the gradients, optimizer steps after them."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    ops = [n for n in nodes if n.op == "call_function" and n.target in STEP_OPS.values()]
    assert sorted(n.kwargs["op"] for n in ops) == list(range(len(ir.ops))), "not one node per IR op"
    of = {n.kwargs["op"]: n for n in ops}
    for n in ops:
        o = ir.ops[n.kwargs["op"]]
        assert n.target is op_function(o) and n.meta["mobius_op"] == o
        assert (n.kwargs["stage"], n.kwargs.get("mb"), n.kwargs["at"]) == (o.stage, o.microbatch, o.place)
        for d in (*o.deps, *o.starts):
            assert of[d] in n.args and pos[of[d]] < pos[n], f"op {o} does not wait for op {d} in the program"
    own = {n.name: n for n in nodes if n.op == "call_function" and n.target not in STEP_OPS.values()}
    loss, begin, grads = own["loss"], own["backward"], own["gradients"]
    assert loss in _ancestors(begin) and begin in _ancestors(grads)
    for n in ops:
        phase = n.meta["mobius_op"].phase
        if phase == "forward":
            assert n in _ancestors(loss)
        elif phase == "backward":
            assert begin in _ancestors(n) and n in _ancestors(grads)
        else:
            assert grads in _ancestors(n)


def _irs() -> list[tuple[str, ScheduleIR]]:
    """Schedule IRs the executor runs: a chain, a skip through the host, a frozen first stage;
    Mobius's, without prefetch, RoundPipe's rotation; 1 to 3 micro-batches."""
    chain = [StageIO("gpu0", 100, 100, (StageInput(-1, 8, needs_grad=False),)),
             StageIO("gpu1", 100, 100, (StageInput(0, 8),)),
             StageIO("gpu2", 100, 100, (StageInput(1, 8),)),
             StageIO("gpu0", 100, 100, (StageInput(2, 8), StageInput(-1, 4, needs_grad=False)), host_outputs=(4,))]
    skip = [StageIO("gpu0", 100, 100, (StageInput(-1, 8, needs_grad=False),), host_outputs=(8,)),
            StageIO("gpu1", 100, 100, (StageInput(0, 8),)),
            StageIO("gpu0", 100, 100, (StageInput(1, 8), StageInput(0, 8)), host_outputs=(4,))]
    frozen = [StageIO("gpu0", 100, 0, (StageInput(-1, 8, needs_grad=False),)),
              StageIO("gpu1", 100, 100, (StageInput(0, 8),), host_outputs=(4,))]
    out = []
    for what, stages in (("chain", chain), ("skip", skip), ("frozen", frozen)):
        for m in (1, 2, 3):
            ir = build_schedule(stages, m)
            out += [(f"{what}-m{m}-mobius", ir), (f"{what}-m{m}-noprefetch", no_prefetch(ir))]
            if what == "chain":
                out.append((f"{what}-m{m}-roundpipe", round_robin(ir)))
    return out


@pytest.mark.parametrize("name, ir", _irs(), ids=[n for n, _ in _irs()])
def test_the_program_holds_one_node_per_op_in_the_irs_order(name, ir):
    gm = build_program(ir, ("x", "target"), name)
    _check_program(gm, ir)
    assert {o.phase for o in ir.ops} == set(PHASES)


def test_every_op_kind_has_its_function_in_the_program():
    from mobius_fx.planning.schedule_ir import OP_KINDS

    named = {k for k in STEP_OPS if not k.startswith("run_")} | {"run"}
    assert named == set(OP_KINDS), "a new OpKind needs its function in runtime/step_program.py (STEP_OPS)"


def _drop_arg(gm: fx.GraphModule, ir: ScheduleIR) -> None:
    n = next(n for n in gm.graph.nodes if n.target is STEP_OPS["run_backward"])
    n.args = n.args[:-1]


def _drop_node(gm: fx.GraphModule, ir: ScheduleIR) -> None:
    n = next(n for n in gm.graph.nodes if n.target is STEP_OPS["download"])
    for user in list(n.users):
        user.args = tuple(a for a in user.args if a is not n)
    gm.graph.erase_node(n)


def _wrong_place(gm: fx.GraphModule, ir: ScheduleIR) -> None:
    n = next(n for n in gm.graph.nodes if n.target is STEP_OPS["run_forward"])
    n.kwargs = {**n.kwargs, "at": "gpu9"}


def _backward_before_loss(gm: fx.GraphModule, ir: ScheduleIR) -> None:
    n = next(n for n in gm.graph.nodes if n.target is STEP_OPS["run_backward"])
    n.args = tuple(a for a in n.args if a.meta.get("mobius_op") is None or a.meta["mobius_op"].phase == "forward")


@pytest.mark.parametrize("mutation", [_drop_arg, _drop_node, _wrong_place, _backward_before_loss])
def test_the_program_check_fails_on_a_mutated_program(mutation):
    name, ir = _irs()[4]  # chain, 2 micro-batches, Mobius's
    gm = build_program(ir, ("x",), name)
    _check_program(gm, ir)
    mutation(gm, ir)
    with pytest.raises(AssertionError):
        _check_program(gm, ir)


def test_an_ir_out_of_its_own_order_is_refused():
    ir = build_schedule([StageIO("gpu0", 1, 1, (StageInput(-1, 1, needs_grad=False),), host_outputs=(1,))], 1)
    wait = next(o for o in ir.ops if o.kind == "wait")
    ops = tuple(with_fields(o, deps=(*o.deps, wait.index + 1)) if o is wait else o for o in ir.ops)
    bad = ScheduleIR(ops, ir.stages, ir.microbatches, ir.gpus, ir.next_on_gpu, ir.prev_on_gpu, ir.by_place)
    with pytest.raises(MobiusError, match=rf"op {wait.index}: wait F0 @gpu0 .* waits for {wait.index + 1}: .* which "
                                          r"the step runs after it .* issue each op after the ops it depends on"):
        build_program(bad, ("x",), "mine")


def test_an_ir_whose_indices_are_not_positions_is_refused():
    ir = build_schedule([StageIO("gpu0", 1, 1, (StageInput(-1, 1, needs_grad=False),), host_outputs=(1,))], 1)
    ops = (with_fields(ir.ops[0], index=7), *ir.ops[1:])
    bad = ScheduleIR(ops, ir.stages, ir.microbatches, ir.gpus, ir.next_on_gpu, ir.prev_on_gpu, ir.by_place)
    with pytest.raises(MobiusError, match=r"op 7: prefetch F0 @gpu0 .* is at position 0 of the IR of schedule 'mine': "
                                          r"an op's index is its position"):
        build_program(bad, ("x",), "mine")


def _compiled(seed=0):
    torch.manual_seed(seed)
    model = Classifier(blocks=3)
    x, y = torch.randn(8, 16), torch.randint(0, 50, (8,))
    pipe = mobius_fx.compile(model, TOPO, example_inputs=(x,), microbatches=2, cuts=[1, 2, 3], verbose=False,
                             device="virtual-async", loss_fn=F.cross_entropy, example_target=y)
    return model, pipe, x, y


def _eager(model, x, y):
    model.zero_grad()
    ref = F.cross_entropy(model(x), y)
    ref.backward()
    return ref.detach(), _grads(model)


def test_train_step_runs_the_program_op_by_op_in_its_order(monkeypatch):
    model, pipe, x, y = _compiled()
    ran = []
    op = step_program._Run.op
    monkeypatch.setattr(step_program._Run, "op", lambda self, index: (ran.append(index), op(self, index))[1])
    loss = pipe.train_step(x, target=y)
    got = _grads(model)
    ex = pipe.step_pipeline._rt._step_executor
    _check_program(ex.step_gm, ex.ir)
    assert ran == [n.kwargs["op"] for n in ex.step_gm.graph.nodes if n.target in STEP_OPS.values()]
    ref, want = _eager(model, x, y)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    _assert_grads_equal(got, want)
    ran.clear()
    pipe.eval()
    with torch.no_grad():  # the forward-only call runs the forward program, not the step
        torch.testing.assert_close(pipe(x), model(x), rtol=1e-6, atol=1e-6)
    assert ran == []


def test_a_node_erased_from_the_program_is_an_op_the_step_does_not_run():
    model, pipe, x, y = _compiled()
    pipe.train_step(x, target=y)
    ex = pipe.step_pipeline._rt._step_executor
    download = next(n for n in ex.step_gm.graph.nodes
                    if n.target is STEP_OPS["download"] and n.kwargs["stage"] == 1)
    for user in list(download.users):
        user.args = tuple(a for a in user.args if a is not download)
    ex.step_gm.graph.erase_node(download)
    ex.step_gm.recompile()
    model.zero_grad()
    with pytest.raises(MobiusError, match="stage 1's weight gradients are still on gpu1 after the step: the "
                                          "schedule IR 'mobius' has no download"):
        pipe.train_step(x, target=y)
    assert all(p.grad is None for p in model.parameters())
    del ex.step_gm  # built again from the IR at the next step
    loss = pipe.train_step(x, target=y)
    got = _grads(model)
    ref, want = _eager(model, x, y)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    _assert_grads_equal(got, want)


def test_the_program_runs_only_inside_train_step():
    model, pipe, x, y = _compiled()
    pipe.train_step(x, target=y)
    gm = pipe.step_pipeline._rt._step_executor.step_gm
    with pytest.raises(MobiusError, match="a step op ran outside pipe.train_step"):
        gm([x, y], 1.0)
