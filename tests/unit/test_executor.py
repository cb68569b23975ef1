"""The step executor (mobius_fx/runtime/executor.py): `train_step` runs its schedule's IR op by op.

Per schedule with a runtime form: the step equals eager (loss and every `.grad`), the runtime
moves exactly what the schedule's IR says, copy by copy, and executes the IR's order on
`virtual-async` with random delays. A schedule without one is refused at compile with its
reason; a mutated IR (a download dropped, a restore skipped, two ops swapped) is refused by the
executor instead of silently computing something else.
"""

import copy
import re
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

import mobius_fx
from mobius_fx import MobiusError, Topology, schedules
from mobius_fx.planning.batch_sizes import set_microbatches
from mobius_fx.planning.ir_transforms import no_prefetch, with_fields
from mobius_fx.planning.schedule_ir import ScheduleIR
from mobius_fx.runtime.devices import make_devices
from mobius_fx.tracing import flatten_inputs
from mobius_fx.zoo import GPT, GPTConfig
from mobius_fx.zoo.small import SkipNet
from mobius_fx.zoo.tiny_hf import hf_gpt2
from tests.property.test_conformance_props import _moved
from tests.unit.test_schedule_ir import _check_executed_order, _values
from tests.unit.test_train_step import Classifier, _assert_grads_equal, _grads

pytestmark = pytest.mark.usefixtures("one_thread")

TOPO = Topology.virtual(gpus=2, memory="64MiB")
RUNNABLE = [n for n in schedules.names() if schedules.get(n).runtime is not None]


def _devices(seed):
    return make_devices({"gpu0": 64 << 20, "gpu1": 64 << 20}, device="virtual-async", seed=seed)


def _step_ir(pipe, name, args, kwargs):
    """The step pipeline's IR under schedule `name`, with the bytes of this call's micro-batch values."""
    sp = pipe.step_pipeline
    m = sp.schedule.microbatches
    flat = flatten_inputs(sp._gm, args, kwargs)
    mb = [t[: t.size(0) // m] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in flat]
    gm = copy.deepcopy(sp._gm)  # a mean loss is each micro-batch's sum and count in a stage
    set_microbatches(gm.graph, m)
    gm.recompile()
    return schedules.get(name).runtime(sp.schedule_ir(_values(gm, *mb)))


def _check_conforms(pipe, ir):
    """Transfers equal the IR copy by copy; per GPU, the prefetches, waits, runs and evictions
    that acted are the IR's, in the IR's order."""
    sp = pipe.step_pipeline
    got, expected = _moved(sp, ir)
    assert got == expected
    _check_executed_order(sp, ir)
    done, planned = defaultdict(list), defaultdict(list)
    for kind, gpu, k, phase, i in sp.executed_ops():
        done[gpu].append((kind, k, phase, i))
    for o in ir.ops:
        if o.kind in ("prefetch", "wait", "run", "evict"):
            planned[o.place].append((str(o.kind), o.stage, o.phase, o.microbatch))
    assert dict(done) == dict(planned)


def _eager(model, loss):
    model.zero_grad()
    ref = loss()
    ref.backward()
    return ref.detach(), _grads(model)


def _step_equals_eager(model, pipe, x, y, steps=1):
    """`steps` cross-entropy `train_step`s (the later ones start from what the first left: `.grad`
    accumulates, as eager's): the last loss and every `.grad` equal eager's."""
    for _ in range(steps):
        loss = pipe.train_step(x, target=y)
    got = _grads(model)
    ref, want = _eager(model, lambda: F.cross_entropy(model(x), y))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    _assert_grads_equal(got, {n: steps * g for n, g in want.items()})


@pytest.mark.parametrize("name", RUNNABLE)
def test_each_runnable_schedule_equals_eager_and_its_ir(name):
    torch.manual_seed(0)
    model = Classifier(blocks=3)
    x, y = torch.randn(8, 16), torch.randint(0, 50, (8,))
    pipe = mobius_fx.compile(model, TOPO, example_inputs=(x,), microbatches=2, cuts=[1, 2, 3], verbose=False,
                             device=_devices(seed=3), loss_fn=F.cross_entropy, schedule=name)
    _step_equals_eager(model, pipe, x, y, steps=2)
    ir = _step_ir(pipe, name, (x,), {"target": y})
    _check_conforms(pipe, ir)
    assert pipe.step_pipeline._rt._step_executor.name == name


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("name", ["mobius", "mobius-noprefetch"])
def test_a_skip_connection_routes_values_and_gradients_through_the_host(name, seed):
    """SkipNet's stem output is read four stages later: it goes to the host, comes back, and its
    gradient is summed on the host with the one of the running activation."""
    torch.manual_seed(seed)
    model = SkipNet(d_in=6, width=8, depth=4, d_out=5)
    x, y = torch.randn(4, 6), torch.randint(0, 5, (4,))
    pipe = mobius_fx.compile(model, TOPO, example_inputs=(x,), microbatches=2, cuts=[1, 2, 3, 4, 5], verbose=False,
                             device=_devices(seed), loss_fn=F.cross_entropy, schedule=name)
    loss = pipe.train_step(x, target=y)
    got = _grads(model)
    ref, want = _eager(model, lambda: F.cross_entropy(model(x), y))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    _assert_grads_equal(got, want)
    ir = _step_ir(pipe, name, (x,), {"target": y})
    assert any(o.kind == "send" and o.phase == "backward" and o.dst == "host" for o in ir.ops)  # a skip's gradient
    _check_conforms(pipe, ir)


def test_a_tied_gpt_with_the_identity_map_equals_eager():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq=8, hidden=16, blocks=3, heads=2))  # lm_head tied to wte
    ids = torch.randint(0, 64, (4, 8))

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB", root_complexes=2), example_inputs=(ids,),
                             microbatches=2, verbose=False, device=_devices(5), loss_fn=loss_fn,
                             schedule="mobius-identity-map")
    loss = pipe.train_step(ids, target=ids)
    got = _grads(model)
    ref, want = _eager(model, lambda: loss_fn(model(ids), ids))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    _assert_grads_equal(got, want)
    _check_conforms(pipe, _step_ir(pipe, "mobius-identity-map", (ids,), {"target": ids}))


def test_hf_labels_under_noprefetch_equals_eager():
    torch.manual_seed(0)
    model = hf_gpt2(layers=2, vocab=64, positions=8)
    ids = torch.randint(0, 64, (4, 8))
    pipe = mobius_fx.compile(model, TOPO, example_inputs=(ids,), microbatches=2, device=_devices(4), verbose=False,
                             schedule="mobius-noprefetch")
    loss = pipe.train_step(ids, labels=ids)
    got = _grads(model)
    ref, want = _eager(model, lambda: model(ids, labels=ids).loss)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    _assert_grads_equal(got, want)
    _check_conforms(pipe, _step_ir(pipe, "mobius-noprefetch", (ids,), {"labels": ids}))


def test_noprefetch_moves_the_same_copies_and_holds_fewer_stages():
    torch.manual_seed(0)
    model = Classifier(blocks=3)
    x = torch.randn(8, 16)
    pipe = mobius_fx.compile(model, TOPO, example_inputs=(x,), microbatches=2, cuts=[1, 2, 3], verbose=False)
    ir = pipe.schedule_ir()
    flat = no_prefetch(ir)
    assert flat.bytes_moved() == ir.bytes_moved()
    assert sorted(map(str, (o.kind for o in flat.ops))) == sorted(map(str, (o.kind for o in ir.ops)))
    assert all(d < o.index for o in flat.ops for d in o.deps)
    assert max(flat.resident_at_most().values()) == 1 < max(ir.resident_at_most().values())


def test_schedules_without_a_runtime_form_are_refused_with_the_reason():
    torch.manual_seed(0)
    model = Classifier(blocks=3)
    x = torch.randn(8, 16)
    kw = dict(example_inputs=(x,), microbatches=2, cuts=[1, 2, 3], verbose=False, loss_fn=F.cross_entropy)
    from mobius_fx.schedules import mobius as mobius_schedule

    schedules.register("sim-only-toy", mobius_schedule.build, refusal="a toy that only the simulator times")
    try:
        with pytest.raises(MobiusError, match=r"schedule='sim-only-toy' cannot run on the pipeline runtime.*"
                                              r"only the simulator times.*" + re.escape(", ".join(RUNNABLE))):
            mobius_fx.compile(model, TOPO, schedule="sim-only-toy", **kw)
    finally:
        schedules.unregister("sim-only-toy")
    with pytest.raises(MobiusError, match=r"unknown schedule 'pipedream'; valid schedules: mobius"):
        mobius_fx.compile(model, TOPO, schedule="pipedream", **kw)
    assert all(p.grad is None for p in model.parameters())


def test_gpipe_that_does_not_fit_resident_is_refused_naming_the_stage_gpu_and_bytes():
    """GPipe keeps every stage's weights on its GPU for the whole step: where Mobius streams
    them through two slots, a GPU too small to hold them all is refused at compile."""
    torch.manual_seed(0)
    wide = Classifier(width=256, classes=256, blocks=6)
    xw = torch.randn(8, 256)
    kw = dict(example_inputs=(xw,), microbatches=2, cuts=[1, 2, 3, 4, 5, 6], verbose=False, loss_fn=F.cross_entropy)
    topo = Topology.virtual(gpus=2, memory="1.5MiB")  # 4 stages of 257 KiB weights each on gpu0
    mobius_fx.compile(wide, topo, **kw)  # Mobius streams them through two slots: it fits
    with pytest.raises(MobiusError, match=r"schedule='gpipe' does not fit this model: gpipe stage \d \(.*\) on gpu\d "
                                          r"needs [\d.]+ [KMG]iB .* but gpu\d has [\d.]+ [KMG]iB; GPipe keeps the weights "
                                          r"of all \d stages on gpu\d"):
        mobius_fx.compile(wide, topo, schedule="gpipe", **kw)
    assert all(p.grad is None for p in wide.parameters())
    # 2 MiB holds the 4 stages resident; the simulator's GPipe (2 re-cut stages, Adam's state on
    # the GPUs) would not fit: the runtime form runs, and the plan's line says so
    pipe = mobius_fx.compile(wide, Topology.virtual(gpus=2, memory="2MiB"), schedule="gpipe",
                             device=_devices(seed=6), **kw)
    assert "schedule: gpipe (the caller's; its simulated form does not fit: gpipe stage" in pipe.plan.schedule_choice
    yw = torch.randint(0, 256, (8,))
    loss = pipe.train_step(xw, target=yw)
    got = _grads(wide)
    ref, want = _eager(wide, lambda: F.cross_entropy(wide(xw), yw))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    _assert_grads_equal(got, want)
    _check_conforms(pipe, _step_ir(pipe, "gpipe", (xw,), {"target": yw}))


def _mutated(ir: ScheduleIR, keep) -> ScheduleIR:
    """`ir` with ops rewritten by `keep(op) -> op | list of ops | None` (None: dropped), renumbered."""
    ops = []
    for o in ir.ops:
        new = keep(o)
        ops += [] if new is None else new if isinstance(new, list) else [new]
    index = {o.index: n for n, o in enumerate(ops)}
    ops = [with_fields(o, index=n, deps=tuple(index[d] for d in o.deps if d in index), starts=()) for n, o in enumerate(ops)]
    by_place = defaultdict(list)
    for o in ops:
        by_place[o.place].append(o.index)
    return ScheduleIR(tuple(ops), ir.stages, ir.microbatches, ir.gpus, ir.next_on_gpu, ir.prev_on_gpu,
                      {p: tuple(v) for p, v in by_place.items()})


def _swap_first_run_and_its_send(ir):
    """The first forward run of the last stage before the send that brings it its input."""
    run = next(o for o in ir.ops if o.kind == "run" and o.phase == "forward" and o.stage == len(ir.stages) - 1)
    send = next(o for o in ir.ops if o.index in run.deps and o.kind == "send")
    return lambda o: run if o is send else send if o is run else o


def _drop_first_send_into_the_last_stage(ir):
    """The send bringing the last stage's first forward run its input, dropped."""
    run = next(o for o in ir.ops if o.kind == "run" and o.phase == "forward" and o.stage == len(ir.stages) - 1)
    send = next(o for o in ir.ops if o.index in run.deps and o.kind == "send")
    return lambda o: None if o is send else o


@pytest.mark.parametrize("mutation, message", [
    (lambda ir: (lambda o: None if o.kind == "download" and o.stage == 1 else o),
     "stage 1's weight gradients are still on gpu1 after the step: the schedule IR 'mobius' has no download"),
    (lambda ir: (lambda o: None if o.kind == "restore" and o.stage == 2 and o.microbatch == 0 else o),
     "the backward of stage 2, micro-batch 0 on gpu0 needs its saved input"),
    # the step program is built in the IR's order: a run issued before the send it waits for is refused there
    (_swap_first_run_and_its_send, r"op \d+: run F3.0 @gpu1 .* waits for \d+: \w+ F3\b.* which the step runs after "
                                   r"it .* the IR of schedule 'mobius' is not in an order the step can run"),
    (_drop_first_send_into_the_last_stage, "stage 3, micro-batch 0 on gpu1: its input 0 .* never arrived"),
    (lambda ir: (lambda o: None if o.kind == "run" and o.phase == "backward" and o.stage == 0 else o),
     "never runs the backward of stage 0, micro-batch 0"),
    (lambda ir: (lambda o: with_fields(o, phase="backward") if o.kind == "hold" else o),
     "has a hold op in backward, which the step executor does not run in that phase"),
])
def test_a_mutated_ir_is_refused_and_the_pipeline_stays_usable(mutation, message):
    torch.manual_seed(0)
    model = Classifier(blocks=3)
    x, y = torch.randn(8, 16), torch.randint(0, 50, (8,))
    pipe = mobius_fx.compile(model, TOPO, example_inputs=(x,), microbatches=2, cuts=[1, 2, 3], verbose=False,
                             device="virtual-async", loss_fn=F.cross_entropy, example_target=y)
    pipe.train_step(x, target=y)
    ex = pipe.step_pipeline._rt._step_executor
    good = ex.ir
    ex.ir = _mutated(good, mutation(good))
    model.zero_grad()
    with pytest.raises(MobiusError, match=message):
        pipe.train_step(x, target=y)
    ex.ir = good
    model.zero_grad()
    loss = pipe.train_step(x, target=y)  # every GPU copy of the failed step was freed
    got = _grads(model)
    ref, want = _eager(model, lambda: F.cross_entropy(model(x), y))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    _assert_grads_equal(got, want)


def test_the_step_code_is_the_program_the_executor_runs():
    torch.manual_seed(0)
    model = Classifier(blocks=3)
    x, y = torch.randn(8, 16), torch.randint(0, 50, (8,))
    pipe = mobius_fx.compile(model, TOPO, example_inputs=(x,), microbatches=2, cuts=[1, 2, 3], verbose=False,
                             loss_fn=F.cross_entropy, example_target=y, schedule="mobius-noprefetch")
    pipe.train_step(x, target=y)
    sp = pipe.step_pipeline
    ex = sp._rt._step_executor
    assert sp.code == ex.step_gm.code.strip("\n") + "\n"  # printed is what ran
    calls = [line.split(" = ", 1)[1] for line in sp.code.splitlines() if re.match(r"\s+op\d+ = ", line)]
    ops = [o for phase in ("forward", "backward", "optimizer") for o in ex.ir.ops if o.phase == phase]
    assert len(calls) == len(ops) and "'mobius-noprefetch'" in sp.code.splitlines()[1]
    assert [c.split("(")[0] for c in calls] == [{"run": f"run_{o.phase}"}.get(str(o.kind), str(o.kind)) for o in ops]
    assert any(c.startswith("run_backward(") and "stage=0, mb=0, at='gpu0'" in c for c in calls)
    assert any(c.startswith("download(") and "stage=3" in c for c in calls)
    assert [c for c in calls if c.startswith("step(")] and "loss = loss_on_host(" in sp.code


def test_a_layer_unfrozen_between_steps_gets_its_gradients():
    torch.manual_seed(0)
    model = Classifier(blocks=3)
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    x, y = torch.randn(8, 16), torch.randint(0, 50, (8,))
    pipe = mobius_fx.compile(model, TOPO, example_inputs=(x,), microbatches=2, cuts=[1, 2, 3], verbose=False,
                             device="virtual-async", loss_fn=F.cross_entropy, example_target=y)
    pipe.train_step(x, target=y)
    assert all(p.grad is None for p in model.blocks[0].parameters())
    for p in model.blocks[0].parameters():
        p.requires_grad_(True)
    model.zero_grad()
    pipe.train_step(x, target=y)
    got = _grads(model)
    _, want = _eager(model, lambda: F.cross_entropy(model(x), y))
    _assert_grads_equal(got, want)
    _check_conforms(pipe, _step_ir(pipe, "mobius", (x,), {"target": y}))
