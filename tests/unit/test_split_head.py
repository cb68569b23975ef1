"""The "split-head" schedule (mobius_fx/schedules/split_head.py) and the planner's choice of
schedule (mobius_fx/schedules/choice.py)."""

from collections import Counter

import pytest

from mobius_fx import schedules
from mobius_fx.errors import MobiusError, PlanError
from mobius_fx.kinds import HOST
from mobius_fx.planning.costs import LayerCost
from mobius_fx.planning.plans import Plan, build_plan
from mobius_fx.planning.schedule_ir import Op
from mobius_fx.planning.ir_transforms import unchanged
from mobius_fx.precision import Precision
from mobius_fx.schedules import split_head
from mobius_fx.schedules.choice import choose
from mobius_fx.sim.simulator import simulate
from mobius_fx.sim.tasks import Context
from mobius_fx.topology.server import Topology


def layers(n, *, head_f=0.03, head_b=0.09, w=100e6, out=1e6, loss=4):
    """n - 1 equal layers and a loss stage three times as costly, as an LLM's head is."""
    ls = [LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, 0.01, 0.03, int(w), int(w), int(out), int(out))
          for i in range(n - 1)]
    return ls + [LayerCost("head", ("nh",), 1.0, 1.0, head_f, head_b, int(w), int(w), loss, loss)]


def plan_of(topo, n=12, m=8, step=2, **kw):
    return build_plan(layers(n, **kw), list(range(0, n, step)), order=[g.name for g in topo.gpus], topology=topo,
                      microbatches=m, step_time=0.0, precision=Precision.of("float16"), input_bytes=1000,
                      memory_fraction=0.99)


@pytest.fixture(scope="module")
def topo():
    return Topology.virtual(gpus=4, memory="24GiB", bandwidth=10e9, p2p=False)


def ir_of(plan, topo):
    return split_head.schedule_ir(Context(plan, topo, "adam", 1e11, use_plan_routes=True))


# ------------------------------------------------------------------------------ its IR
def test_every_micro_batch_runs_each_layer_once_forward_and_once_backward(topo):
    plan = plan_of(topo)
    ir, c = ir_of(plan, topo)
    runs = Counter((o.phase, o.stage, o.microbatch) for o in ir.ops if o.kind == "run")
    head = len(c.f) - 1
    want = Counter({("forward", k, i): 1 for k in range(head) for i in range(8)})
    want.update({("backward", k, i): 1 for k in range(head + 1) for i in range(8)})  # the head: fused, once
    assert runs == want
    assert c.names[0] == "h0" and c.names[-1] == "head" and len(c.f) == 12  # one slot per layer


def test_the_loss_stage_is_dealt_to_every_gpu_which_uploads_it_once(topo):
    plan = plan_of(topo)
    ir, c = ir_of(plan, topo)
    head = len(c.f) - 1
    by_gpu = {}
    for o in ir.ops:
        if o.kind == "run" and o.stage == head:
            by_gpu.setdefault(o.place, []).append(o.microbatch)
    assert sorted(by_gpu) == [g.name for g in topo.gpus]
    assert sorted(i for v in by_gpu.values() for i in v) == list(range(8))
    for g, mbs in by_gpu.items():
        assert mbs == sorted(mbs) and len(mbs) == 2  # micro-batches a, a + 4: in order
    uploads = Counter(o.place for o in ir.ops if o.kind == "prefetch" and o.stage == head)
    assert uploads == Counter({g.name: 1 for g in topo.gpus})
    # each downloads its own partial gradient; the host's step waits for every one
    grads = [o.index for o in ir.ops if o.kind == "download" and o.stage == head]
    (step,) = [o for o in ir.ops if o.kind == "step" and o.stage == head]
    assert len(grads) == 4 and set(step.deps) == set(grads)


def test_no_logits_leave_the_gpus_and_its_ops_print_and_parse_back(topo):
    plan = plan_of(topo)
    ir, c = ir_of(plan, topo)
    head = len(c.f) - 1
    assert not [o for o in ir.ops if o.stage == head and o.kind == "send" and o.dst == HOST]
    assert [Op.parse(str(o)) for o in ir.ops] == list(ir.ops)
    # every op waits only for ops before it: the list is an issue order
    assert all(d < o.index for o in ir.ops for d in (*o.deps, *o.starts))


def test_held_weights_upload_once_and_saved_inputs_stay_on_the_gpu(topo):
    plan = plan_of(topo)
    ctx = Context(plan, topo, "adam", 1e11, use_plan_routes=True)
    ir, c = split_head.schedule_ir(ctx, hold=True)
    head = len(c.f) - 1
    ups = Counter(o.stage for o in ir.ops if o.kind == "prefetch")
    assert ups == Counter({**{k: 1 for k in range(head)}, head: 4})  # each layer once; the head once per GPU
    assert not [o for o in ir.ops if o.kind in ("offload", "restore")]
    for o in ir.ops:  # a layer's backward on the GPU that ran its forward
        if o.kind == "run" and o.stage < head:
            assert o.place == f"gpu{o.stage % 4}"
    assert split_head.schedule_ir(ctx, hold=None)[0] == ir  # it fits: held by default


def test_streamed_weights_keep_two_slots_at_most_and_go_to_the_next_gpu(topo):
    plan = plan_of(topo)
    ir, c = split_head.schedule_ir(Context(plan, topo, "adam", 1e11, use_plan_routes=True), hold=False)
    assert max(ir.resident_at_most().values()) <= 2  # a slot's weights and the next one's, per GPU
    ups = Counter(o.stage for o in ir.ops if o.kind == "prefetch")
    assert all(ups[k] == 2 for k in range(len(c.f) - 1))  # forward and backward: uploaded twice


def test_it_simulates_faster_than_roundpipe_where_the_head_paces_the_pipeline(topo):
    plan = plan_of(topo, n=16, m=8)
    ours = simulate(plan, schedule="split-head").pipeline_time
    assert ours < simulate(plan, schedule="roundpipe").pipeline_time
    assert ours < simulate(plan, schedule="mobius").pipeline_time
    assert ours >= plan.lower_bound() * (1 - 1e-9)


def test_a_slot_that_does_not_fit_its_gpu_is_refused_with_its_bytes():
    small = Topology.virtual(gpus=2, memory="256MiB", bandwidth=10e9, p2p=False)
    # 100 MB of fp16 weights per layer: a slot's, its gradients and the next slot's prefetch > 256 MiB
    plan = plan_of(small, n=4, m=2, step=1, w=200e6)
    with pytest.raises(PlanError, match=r"split-head slot 0 \(forward of h0\) needs .* on gpu0 \(its weights "
                                        r"95.37 MiB .* but the GPU has 253.44 MiB; use more GPUs"):
        simulate(plan, schedule="split-head")


def test_a_model_output_goes_to_the_host_and_its_gradient_comes_back(topo):
    plan = plan_of(topo, loss=8_000_000)  # logits, not a loss: the loss is the host's
    ir, c = ir_of(plan, topo)
    head = len(c.f) - 1
    out = [o for o in ir.ops if o.stage == head and o.kind == "send" and o.dst == HOST]
    back = [o for o in ir.ops if o.stage == head and o.kind == "send" and o.src == HOST and o.phase == "backward"]
    assert sorted(o.microbatch for o in out) == sorted(o.microbatch for o in back) == list(range(8))
    assert all(o.bytes == plan.stages[-1].output_bytes > 0 for o in out)
    for gpu in {o.place for o in out}:  # each GPU's part: its forwards, then its backwards, weights kept
        runs = [o.phase for o in ir.place(gpu) if o.kind == "run" and o.stage == head]
        assert runs == sorted(runs, key=lambda p: p != "forward") and len(runs) == 4
    assert Counter(o.stage for o in ir.ops if o.kind == "prefetch")[head] == 4
    loss_only = simulate(plan_of(topo), schedule="split-head").pipeline_time
    assert simulate(plan, schedule="split-head").pipeline_time > loss_only


def test_fewer_micro_batches_than_gpus_deal_the_head_to_as_many_gpus(topo):
    ir, c = ir_of(plan_of(topo, m=2), topo)
    heads = Counter(o.place for o in ir.ops if o.kind == "run" and o.stage == len(c.f) - 1)
    # the rotation goes on after the last forward slot (11 of them on 4 GPUs: gpu3, then gpu0)
    assert heads == Counter({"gpu3": 1, "gpu0": 1})


# ------------------------------------------------------------------------------ the choice
@pytest.fixture
def toy():
    """A registered toy schedule: Mobius's tasks with every compute 20x shorter (so, the fastest)."""
    def build(ctx):
        schedules.get("mobius").build(ctx)
        for t in ctx.tasks:
            if t.meta.get("kind") == "compute":
                t.duration *= 0.05
    schedules.register("toy", build, summary="mobius at 20x the speed")
    yield "toy"
    schedules.unregister("toy")


def test_the_fastest_candidate_is_chosen_and_the_line_says_why(topo, toy):
    plan = plan_of(topo)
    c = choose(plan)
    assert c.name == "toy" and set(c.times) == set(schedules.candidates())
    assert c.line.startswith("schedule: toy (simulated fwd+bwd ") and "vs mobius" in c.line
    assert "not executable by the runtime yet: compile runs mobius" in c.line
    assert all(isinstance(t, float) for t in c.times.values())
    assert c.times["toy"] == min(c.times.values())


def test_compile_chooses_only_what_the_runtime_executes(topo, toy):
    plan = plan_of(topo)
    assert choose(plan, runnable=True).name == "mobius"
    assert "the only candidate compile picks by itself" in choose(plan, runnable=True).line
    with pytest.raises(MobiusError, match="'toy' is simulated but the runtime does not execute it yet"):
        choose(plan, "toy", runnable=True)


def test_a_runnable_faster_schedule_is_chosen_for_compile_too(topo):
    schedules.register("toy-run", lambda ctx: TOY_FAST(ctx), runtime=unchanged)
    try:
        c = choose(plan_of(topo), runnable=True)
        assert c.name == "toy-run" and "not executable" not in c.line
    finally:
        schedules.unregister("toy-run")


def TOY_FAST(ctx):
    schedules.get("mobius").build(ctx)
    for t in ctx.tasks:
        if t.meta.get("kind") == "compute":
            t.duration *= 0.05


def test_baselines_are_never_chosen_and_the_callers_schedule_is_taken(topo):
    plan = plan_of(topo)
    assert not {"gpipe", "zero3-offload", "mobius-noprefetch", "mobius-identity-map"} & set(schedules.candidates())
    c = choose(plan, "zero3-offload")
    assert c.name == "zero3-offload" and c.line.startswith("schedule: zero3-offload (the caller's")
    with pytest.raises(MobiusError, match="unknown schedule 'nope'; valid schedules: mobius"):
        choose(plan, "nope")


def test_a_candidate_that_does_not_fit_is_named_and_passed_over(topo):
    def build(ctx):
        raise PlanError("toy-big needs 1 TiB")

    schedules.register("toy-big", build)
    try:
        c = choose(plan_of(topo))
        assert c.name != "toy-big" and c.times["toy-big"].startswith("does not fit: toy-big needs 1 TiB")
        assert "toy-big does not fit" in c.line
    finally:
        schedules.unregister("toy-big")


def test_the_plans_first_line_is_its_schedule_choice_and_survives_json(topo):
    import dataclasses

    plan = dataclasses.replace(plan_of(topo), schedule_choice=choose(plan_of(topo)).line)
    assert str(plan).splitlines()[0] == plan.schedule_choice
    assert Plan.from_json(plan.to_json()).schedule_choice == plan.schedule_choice
    assert str(plan_of(topo)).startswith("Mobius plan:")  # none chosen: the summary first, as before


def test_plan_and_compile_say_their_schedule_on_the_first_line(tmp_path):
    import torch

    import mobius_fx

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(8, 64)
    kw = dict(example_inputs=(x,), microbatches=2, cache_dir=str(tmp_path), verbose=False)
    plan = mobius_fx.plan(model, Topology.virtual(gpus=2, memory="256KiB"), **kw)
    first = str(plan).splitlines()[0]
    assert first == plan.schedule_choice and first.startswith("schedule: ")
    assert "simulated fwd+bwd" in first and "mobius" in first  # every candidate simulated, mobius among them
    mine = mobius_fx.plan(model, Topology.virtual(gpus=2, memory="256KiB"), schedule="roundpipe", **kw)
    assert mine.schedule_choice.startswith("schedule: roundpipe (the caller's; simulated fwd+bwd ")
    with pytest.raises(MobiusError, match="unknown schedule 'pipedream'"):
        mobius_fx.plan(model, Topology.virtual(gpus=2, memory="256KiB"), schedule="pipedream", **kw)
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="256KiB"), device="virtual", **kw)
    assert pipe.plan.schedule_choice == ("schedule: mobius (the only candidate compile picks by itself; compile(schedule=) "
                                         "runs the others the runtime executes)")
