"""RoundPipe on the step executor: `compile(schedule="roundpipe")` runs `ir_transforms.round_robin`
of the pipeline's Mobius IR, each stage's backward on GPU (2S - 2 - k) mod N of the rotation.

The step equals eager (loss, every `.grad`, two steps); the runtime moves exactly the transformed
IR's copies, copy by copy, and executes its order per GPU on `virtual-async` with seeded random
delays; the GPU that runs a stage's backward holds its weights in a slot of its pool planned from
the transformed IR (no slot added past the plan, the budget kept).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.errors import BudgetError
from mobius_fx.planning.ir_transforms import round_robin
from mobius_fx.planning.schedule_ir import StageInput, StageIO, build_schedule
from mobius_fx.runtime.devices import make_devices
from mobius_fx.zoo import GPT, GPTConfig
from mobius_fx.zoo.small import SkipNet
from tests.unit.test_executor import _check_conforms, _eager, _step_equals_eager, _step_ir
from tests.unit.test_train_step import Classifier, _assert_grads_equal, _grads

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET = 64 << 20


def _devices(n, seed, device="virtual-async"):
    return make_devices({f"gpu{g}": BUDGET for g in range(n)}, device=device, seed=seed)


def _chain(s, n, m=2):
    """A Mobius IR of `s` stages round-robin on `n` GPUs, the last stage's output to the host."""
    st = [StageIO(f"gpu{k % n}", 100 + k, 10 + k, (StageInput(k - 1, 7, needs_grad=k > 0),),
                  host_outputs=(5,) if k == s - 1 else ()) for k in range(s)]
    return build_schedule(st, m)


@pytest.mark.parametrize("s,n", [(3, 3), (4, 3), (5, 3), (5, 2), (6, 4)])
def test_round_robin_puts_each_backward_where_the_rotation_continues(s, n):
    ir = _chain(s, n)
    rp = round_robin(ir)
    gpus = [f"gpu{g}" for g in range(n)]
    back = lambda k: gpus[(2 * s - 2 - k) % n]  # noqa: E731
    for o in rp.ops:
        if o.phase != "backward":
            continue
        if o.kind == "send" and o.what == "activation" and "host" not in (o.src, o.dst):  # stage k's input gradient
            assert (o.place, o.src, o.dst) == (back(o.stage + 1), back(o.stage + 1), back(o.stage)), str(o)
        else:  # its upload, wait, restores, runs, download, evict: all on its backward GPU
            assert o.place == back(o.stage) and o.dst in ("", "host", back(o.stage)), str(o)
    # forward: Mobius's ops exactly, except a stage evicted instead of held where its backward runs elsewhere
    fwd = [o for o in ir.ops if o.phase == "forward"]
    assert [(o.kind, o.place, o.stage, o.microbatch) for o in rp.ops if o.phase == "forward"] == [
        ("evict" if o.kind == "hold" and gpus[(2 * s - 2 - o.stage) % n] != o.place else o.kind, o.place, o.stage,
         o.microbatch) for o in fwd]
    assert all(d < o.index for o in rp.ops for d in o.deps)
    # the same values and gradients cross, from and to other GPUs: as many sends, offloads and restores
    for kind in ("send", "offload", "restore", "download"):
        assert len(rp.select(kind=kind)) == len(ir.select(kind=kind)), kind
    assert max(rp.resident_at_most().values()) <= 2
    # an upload at its stage's own turn waits for the memory it takes: an evict on its GPU
    for o in rp.select(kind="prefetch", phase="backward"):
        if not any(rp.ops[d].kind == "wait" for d in o.deps):
            assert any(rp.ops[d].kind == "evict" and rp.ops[d].place == o.place for d in o.deps), str(o)


def test_on_two_gpus_the_rotation_is_mobius():
    """(2S - 2 - k) - k is even: on two GPUs every backward runs where its forward ran."""
    ir = _chain(5, 2)
    assert round_robin(ir).ops == ir.ops


def test_round_robin_refuses_a_placement_off_the_rotation():
    st = [StageIO(g, 10, 10, (StageInput(k - 1, 1, needs_grad=k > 0),)) for k, g in enumerate(["gpu0", "gpu1", "gpu1"])]
    with pytest.raises(MobiusError, match=r"stage 2 runs on gpu1, but RoundPipe's rotation over gpu0, gpu1 puts it "
                                          r"on gpu0"):
        round_robin(build_schedule(st, 2))


def _moved_backward(ir):
    return {o.stage for o in ir.ops if o.kind == "run" and o.phase == "backward"
            and o.place != ir.stages[o.stage].gpu}


@pytest.mark.parametrize("gpus,m,blocks,seed,device", [(3, 2, 4, 1, "virtual-async"), (3, 4, 3, 2, "virtual-async"),
                                                       (3, 3, 5, 3, "virtual-async"), (3, 2, 4, 0, "virtual")])
def test_roundpipe_train_step_equals_eager_and_its_ir(gpus, m, blocks, seed, device):
    torch.manual_seed(seed)
    model = Classifier(blocks=blocks)
    x, y = torch.randn(4 * m, 16), torch.randint(0, 50, (4 * m,))
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=gpus, memory="64MiB"), example_inputs=(x,), microbatches=m,
                             cuts=list(range(1, blocks + 1)), verbose=False, device=_devices(gpus, seed, device),
                             loss_fn=F.cross_entropy, schedule="roundpipe")
    _step_equals_eager(model, pipe, x, y, steps=2)
    ir = _step_ir(pipe, "roundpipe", (x,), {"target": y})
    assert _moved_backward(ir)  # some stage's backward runs on another GPU than its forward
    _check_conforms(pipe, ir)
    rt = pipe.step_pipeline._rt
    assert all(st.device.name == spec.gpu for st, spec in zip(rt.stages, rt.schedule.stages))  # back home


class Uneven(nn.Module):
    """A wide first stage and a narrow second: on three GPUs RoundPipe runs stage 0's backward on
    gpu1, whose Mobius pool is sized for stage 1 only."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 256), nn.Tanh()),
                                     nn.Sequential(nn.Linear(256, 2), nn.Tanh())])
        self.head = nn.Linear(2, 50)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _uneven(budgets, schedule, seed=7):
    torch.manual_seed(0)
    model = Uneven()
    x, y = torch.randn(8, 16), torch.randint(0, 50, (8,))
    devs = make_devices(budgets, device="virtual-async", seed=seed)
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=3, memory="64MiB"), example_inputs=(x,), microbatches=2,
                             cuts=[1, 2], verbose=False, device=devs, loss_fn=F.cross_entropy, schedule=schedule)
    return model, pipe, devs, x, y


def test_roundpipe_plans_the_second_slot_and_keeps_the_budgets():
    """The GPU running a stage's backward holds it in a slot of its pool sized from the RoundPipe
    IR: no slot added or grown past the plan, at most the IR's resident stages, budgets kept."""
    model, pipe, devs, x, y = _uneven({f"gpu{g}": BUDGET for g in range(3)}, "roundpipe")
    _step_equals_eager(model, pipe, x, y)
    ir = _step_ir(pipe, "roundpipe", (x,), {"target": y})
    _check_conforms(pipe, ir)
    rt = pipe.step_pipeline._rt
    assert rt.stages[0].weight_bytes > 4 * rt.stages[1].weight_bytes
    assert next(o.place for o in ir.ops if o.kind == "run" and o.phase == "backward" and o.stage == 0) == "gpu1"
    most = ir.resident_at_most()
    for name, dev in devs.items():
        stats = dev.slot_stats()
        assert stats["overflows"] == 0, (name, stats)
        assert stats["max_in_use"] <= most[name], (name, stats, most)
        assert dev.peak_bytes <= BUDGET
    assert devs["gpu1"].pool_bytes() >= devs["gpu1"].slot_bytes(rt.stages[0].slots)


def test_a_backward_gpu_too_small_for_the_second_copy_is_refused_and_mobius_still_runs():
    budgets = {"gpu0": BUDGET, "gpu1": 12 << 10, "gpu2": BUDGET}  # stage 1's weights and work, not stage 0's 17 KiB
    model, pipe, devs, x, y = _uneven(budgets, "mobius")
    pipe.train_step(x, target=y)
    assert devs["gpu1"].peak_bytes <= budgets["gpu1"]
    model, pipe, devs, x, y = _uneven(budgets, "roundpipe")
    with pytest.raises(BudgetError, match=r"gpu1 would hold 17.00 KiB .*the weight slots") as e:
        pipe.train_step(x, target=y)
    assert "uploads stage(s) [0] on gpu1 for their backward" in "\n".join(getattr(e.value, "__notes__", []))
    assert all(p.grad is None for p in model.parameters())


def test_roundpipe_skip_connections_go_through_the_host():
    """SkipNet's stem output is read four stages later: its gradient leaves from the GPU that runs
    the reader's backward, into host memory, and comes back to the stem's backward GPU."""
    torch.manual_seed(4)
    model = SkipNet(d_in=6, width=8, depth=4, d_out=5)
    x, y = torch.randn(4, 6), torch.randint(0, 5, (4,))
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=3, memory="64MiB"), example_inputs=(x,), microbatches=2,
                             cuts=[1, 2, 3, 4, 5], verbose=False, device=_devices(3, 4), loss_fn=F.cross_entropy,
                             schedule="roundpipe")
    _step_equals_eager(model, pipe, x, y)
    ir = _step_ir(pipe, "roundpipe", (x,), {"target": y})
    assert any(o.kind == "send" and o.phase == "backward" and o.dst == "host" for o in ir.ops)
    assert _moved_backward(ir)
    _check_conforms(pipe, ir)


def test_roundpipe_gpt_equals_eager_and_the_eager_loop_still_runs_mobius():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq=8, hidden=16, blocks=3, heads=2))
    ids = torch.randint(0, 64, (4, 8))

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    pipe = mobius_fx.compile(model, Topology.virtual(gpus=3, memory="64MiB"), example_inputs=(ids,), microbatches=2,
                             verbose=False, device=_devices(3, 5), loss_fn=loss_fn, schedule="roundpipe")
    for _ in range(2):
        loss = pipe.train_step(ids, target=ids)
    got = _grads(model)
    ref, want = _eager(model, lambda: loss_fn(model(ids), ids))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    _assert_grads_equal(got, {n: 2 * g for n, g in want.items()})
    ir = _step_ir(pipe, "roundpipe", (ids,), {"target": ids})
    assert _moved_backward(ir)
    _check_conforms(pipe, ir)
    # the eager-style loop keeps Mobius's autograd path, every stage on its own GPU
    model.zero_grad()
    loss_fn(pipe(ids), ids).backward()
    _assert_grads_equal(_grads(model), want)


@pytest.mark.parametrize("s", [5, 12])
def test_the_simulators_roundpipe_and_the_runtime_form_agree_but_for_the_fused_last_stage(s):
    """Per stage and micro-batch, every run the simulator's RoundPipe IR has is on the same GPU
    in `round_robin` of the plan's IR over the simulator's GPUs; the runtime's only extra runs
    are the last stage's forward (the simulator's fused slot doubles as it), on that slot's GPU.
    On the stages' own GPUs (the runtime's default) the two agree when every GPU runs a stage."""
    from mobius_fx.schedules import roundpipe
    from mobius_fx.sim.tasks import Context
    from tests.unit.test_simulator import make_layers, make_plan

    topo = Topology.preset("mobius-testbed")
    plan = make_plan(topo, make_layers(s), list(range(s)), 2)
    ctx = Context(plan, topo, "adamw", 1e10, True)
    sim = roundpipe.schedule_ir(ctx)[0]
    rt = round_robin(plan.schedule(ctx.gpus), ctx.gpus)
    assert (round_robin(plan.schedule(ctx.gpus)).ops == rt.ops) == (s >= len(ctx.gpus))
    runs = lambda ir: {(o.phase, o.stage, o.microbatch): o.place for o in ir.ops if o.kind == "run"}  # noqa: E731
    got, want = runs(rt), runs(sim)
    assert {key: got[key] for key in want} == want
    n = len(ctx.gpus)
    assert {key: g for key, g in got.items() if key not in want} == {("forward", s - 1, i): ctx.gpus[(s - 1) % n]
                                                                     for i in range(plan.microbatches)}
