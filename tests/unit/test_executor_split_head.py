"""Split-head on the step executor: `compile(schedule="split-head")` runs `ir_split_head.split_head`
of the pipeline's Mobius IR: every stage but the last as Mobius runs it, the last stage (the loss
stage) dealt by micro-batch, micro-batch i's forward and backward on GPU (h + i) mod N.

The IR: each micro-batch of the last stage with all its ops on its GPU, the stage uploaded once to
each GPU that runs it and its partial gradient downloaded from each, the rest Mobius's. The step
equals eager (loss, every `.grad`, two steps; a classifier, a tied GPT, HF GPT-2 with labels, the
sync optimizer overlap); the runtime moves exactly the IR's copies, copy by copy, and executes
its order per GPU on `virtual-async` with seeded random delays; a GPU too small for the head's
copy beside its own stage is refused naming the stage, the GPU and the bytes.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.errors import BudgetError
from mobius_fx.planning.ir_split_head import dealt, split_head
from mobius_fx.planning.schedule_ir import StageInput, StageIO, build_schedule
from mobius_fx.runtime.devices import make_devices
from mobius_fx.zoo import GPT, GPTConfig
from mobius_fx.zoo.tiny_hf import hf_gpt2
from tests.unit.test_executor import _check_conforms, _eager, _mutated, _step_equals_eager, _step_ir
from tests.unit.test_train_step import Classifier, _assert_grads_equal, _grads

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET = 64 << 20


def _devices(n, seed, device="virtual-async"):
    return make_devices({f"gpu{g}": BUDGET for g in range(n)}, device=device, seed=seed)


def _chain(s, n, m):
    """A Mobius IR of `s` stages round-robin on `n` GPUs; the last stage reads the model input
    too (a target) and sends its output (a loss) to the host."""
    st = [StageIO(f"gpu{k % n}", 100 + k, 10 + k,
                  (StageInput(k - 1, 7, needs_grad=k > 0),) + ((StageInput(-1, 3, needs_grad=False),) if k == s - 1 else ()),
                  host_outputs=(5,) if k == s - 1 else ()) for k in range(s)]
    return build_schedule(st, m)


def _key(o):
    return (str(o.kind), o.place, o.stage, o.phase, o.microbatch, o.src, o.dst, o.what, o.bytes, o.value)


@pytest.mark.parametrize("s,n,m", [(4, 3, 4), (5, 3, 3), (3, 2, 2), (6, 4, 2), (5, 2, 4), (4, 3, 5)])
def test_split_head_deals_the_last_stage_and_keeps_the_rest_mobius(s, n, m):
    ir = _chain(s, n, m)
    sh = split_head(ir)
    last, gpus = s - 1, list(ir.gpus)
    h = ir.stages[last].gpu
    deal = [gpus[(gpus.index(h) + i) % n] for i in range(m)]
    assert dealt(gpus, h, m) == deal
    heads = sorted(set(deal))
    assert len(heads) == min(n, m)
    for o in sh.ops:
        if o.stage == last and o.microbatch is not None:  # every op of micro-batch i of the last stage on its GPU
            if o.kind == "send" and o.phase == "forward" and o.src not in ("host", deal[o.microbatch]):
                assert (o.place, o.dst) == (ir.stages[last - 1].gpu, deal[o.microbatch]), str(o)  # pushed to it
            else:
                assert o.place == deal[o.microbatch] and deal[o.microbatch] in (o.src or deal[o.microbatch],
                                                                                o.dst or deal[o.microbatch]), str(o)
        if o.stage == last - 1 and o.kind == "send" and o.phase == "backward" and o.microbatch is not None:
            assert (o.place, o.src, o.dst) == (deal[o.microbatch],) * 2 + (ir.stages[last - 1].gpu,), str(o)
    # the stage uploaded once to each GPU that runs it, held to its backward; a partial gradient from each
    for kind in ("prefetch", "download"):
        assert sorted(o.place for o in sh.select(kind=kind, stage=last)) == heads, kind
    assert all(o.bytes == ir.stages[last].grad_bytes for o in sh.select(kind="download", stage=last))
    step = next(o for o in sh.select(kind="step") if o.stage == last)
    assert sorted(step.deps) == sorted(o.index for o in sh.select(kind="download", stage=last))
    # every other stage's ops are Mobius's, but for where the pushes to the last stage go and where
    # the gradients back from it come from
    body = lambda ir_: [_key(o)[:5] for o in ir_.ops if o.stage < last and o.kind != "step"  # noqa: E731
                        and not (o.kind == "send" and o.stage == last - 1 and o.phase == "backward"
                                 and o.src != "host")]
    assert body(sh) == body(ir)
    assert all(d < o.index for o in sh.ops for d in o.deps)
    assert max(sh.resident_at_most().values()) <= 2
    # a backward upload on a GPU waits for its copy of the last stage to leave it
    evict = {o.place: o.index for o in sh.select(kind="evict", stage=last) if o.phase == "backward"}
    for o in sh.select(kind="prefetch", phase="backward"):
        if o.index > evict.get(o.place, len(sh.ops)):
            assert evict[o.place] in o.deps, str(o)
    assert sh.bytes_moved() != ir.bytes_moved() or m == 1


def test_with_one_microbatch_split_head_is_mobius():
    ir = _chain(5, 3, 1)
    assert [_key(o) for o in split_head(ir).ops] == [_key(o) for o in ir.ops]


def test_split_head_needs_a_pipelines_ir():
    with pytest.raises(MobiusError, match=r"the last stage runs on gpu3, which is not among the rotation"):
        dealt(["gpu0", "gpu1"], "gpu3", 2)


def _dealt_backward(ir):
    last = len(ir.stages) - 1
    return {o.place for o in ir.ops if o.kind == "run" and o.phase == "backward" and o.stage == last}


def _compile(model, x, gpus, m, seed, device="virtual-async", **kw):
    return mobius_fx.compile(model, Topology.virtual(gpus=gpus, memory="64MiB"), example_inputs=(x,), microbatches=m,
                             verbose=False, device=_devices(gpus, seed, device), schedule="split-head", **kw)


@pytest.mark.parametrize("gpus,m,blocks,seed,device", [(2, 2, 3, 1, "virtual-async"), (3, 4, 3, 2, "virtual-async"),
                                                       (3, 3, 4, 3, "virtual-async"), (2, 4, 5, 4, "virtual-async"),
                                                       (3, 4, 3, 0, "virtual")])
def test_split_head_train_step_equals_eager_and_its_ir(gpus, m, blocks, seed, device):
    torch.manual_seed(seed)
    model = Classifier(blocks=blocks)
    x, y = torch.randn(4 * m, 16), torch.randint(0, 50, (4 * m,))
    pipe = _compile(model, x, gpus, m, seed, device, cuts=list(range(1, blocks + 1)), loss_fn=F.cross_entropy)
    _step_equals_eager(model, pipe, x, y, steps=2)
    ir = _step_ir(pipe, "split-head", (x,), {"target": y})
    assert len(_dealt_backward(ir)) == min(gpus, m)  # the last stage's backward runs on as many GPUs
    _check_conforms(pipe, ir)
    rt = pipe.step_pipeline._rt
    assert all(st.device.name == spec.gpu for st, spec in zip(rt.stages, rt.schedule.stages))  # back home
    with torch.no_grad():  # the stage modules compute with their own slots again
        torch.testing.assert_close(pipe.step_pipeline(x, target=y), F.cross_entropy(model(x), y))


def test_split_head_tied_gpt_equals_eager_and_the_eager_loop_still_runs_mobius():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq=8, hidden=16, blocks=3, heads=2))  # lm_head tied to wte
    ids = torch.randint(0, 64, (6, 8))

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    pipe = _compile(model, ids, 3, 3, 5, loss_fn=loss_fn)
    for _ in range(2):
        loss = pipe.train_step(ids, target=ids)
    got = _grads(model)
    ref, want = _eager(model, lambda: loss_fn(model(ids), ids))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    _assert_grads_equal(got, {n: 2 * g for n, g in want.items()})
    ir = _step_ir(pipe, "split-head", (ids,), {"target": ids})
    assert len(_dealt_backward(ir)) == 3
    _check_conforms(pipe, ir)
    model.zero_grad()
    loss_fn(pipe(ids), ids).backward()
    _assert_grads_equal(_grads(model), want)


def test_split_head_hf_labels_and_the_sync_overlap_equal_eager():
    """HF GPT-2 with labels= (the loss on the last stage), the optimizer overlap stepping during
    the backward: a master of the dealt stage is handed over once all its partials are on the host."""
    torch.manual_seed(0)
    model = hf_gpt2(layers=2, hidden=16, vocab=64, positions=8)
    ref_model = hf_gpt2(layers=2, hidden=16, vocab=64, positions=8)
    ref_model.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (4, 8))
    pipe = _compile(model, ids, 2, 2, 6)
    opt = pipe.overlap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), mode="sync")
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    for i in range(2):  # the first round runs serially (the overlap watches the loop), then overlapped
        opt.zero_grad()
        loss = pipe.train_step(ids, labels=ids)
        opt.step()
        if i:
            assert opt.stepped_in_backward == len(list(model.parameters()))
        ref_opt.zero_grad()
        ref = ref_model(ids, labels=ids).loss
        ref.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    ir = _step_ir(pipe, "split-head", (ids,), {"labels": ids})
    assert len(_dealt_backward(ir)) == 2
    _check_conforms(pipe, ir)


def _last_on(ir, kind, gpu):
    last = len(ir.stages) - 1
    return lambda o: None if o.kind == kind and o.stage == last and o.place == gpu else o


@pytest.mark.parametrize("kind, message", [
    ("download", "stage 3's weight gradients are still on gpu1 after the step: the schedule IR 'split-head' has no "
                 "download"),
    ("evict", "stage 3 is still on gpu1 after the step: the schedule IR 'split-head' never evicts it"),
])
def test_a_mutated_split_head_ir_is_refused_and_the_pipeline_stays_usable(kind, message):
    torch.manual_seed(0)
    model = Classifier(blocks=3)
    x, y = torch.randn(12, 16), torch.randint(0, 50, (12,))
    pipe = _compile(model, x, 3, 3, 7, cuts=[1, 2, 3], loss_fn=F.cross_entropy, example_target=y)
    pipe.train_step(x, target=y)
    ex = pipe.step_pipeline._rt._step_executor
    good = ex.ir
    assert "gpu1" in _dealt_backward(good) and good.stages[3].gpu != "gpu1"
    ex.ir = _mutated(good, _last_on(good, kind, "gpu1"))
    model.zero_grad()
    with pytest.raises(MobiusError, match=message):
        pipe.train_step(x, target=y)
    assert all(p.grad is None for p in model.parameters())
    ex.ir = good
    loss = pipe.train_step(x, target=y)  # every GPU copy of the failed step was freed
    got = _grads(model)
    ref, want = _eager(model, lambda: F.cross_entropy(model(x), y))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    _assert_grads_equal(got, want)
    for dev in pipe.step_pipeline._rt.devices.values():
        assert not dev.slot_stats()["overflows"]


class WideHead(nn.Module):
    """Two narrow stages and a wide head: dealt to gpu1, the head needs more than gpu1's budget
    beside gpu1's own stage."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(16, 512)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_a_gpu_too_small_for_the_heads_copy_is_refused_and_mobius_still_runs():
    torch.manual_seed(0)
    model = WideHead()
    x, y = torch.randn(8, 16), torch.randint(0, 512, (8,))
    budgets = {"gpu0": BUDGET, "gpu1": 24 << 10}

    def run(schedule):
        devs = make_devices(budgets, device="virtual-async", seed=3)
        pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,),
                                 microbatches=2, cuts=[1, 2], verbose=False, device=devs, loss_fn=F.cross_entropy,
                                 example_target=y, schedule=schedule)
        return pipe, devs

    pipe, devs = run("mobius")
    pipe.train_step(x, target=y)
    assert devs["gpu1"].peak_bytes <= budgets["gpu1"]
    assert pipe.step_pipeline.schedule.stages[2].gpu == "gpu0"  # the head's own GPU; split-head deals mb 1 to gpu1
    model.zero_grad()
    pipe, devs = run("split-head")
    head = pipe.step_pipeline._rt.stages[2].weight_bytes
    with pytest.raises(BudgetError, match=r"gpu1 would hold .* the weight slots") as e:
        pipe.train_step(x, target=y)
    note = "\n".join(getattr(e.value, "__notes__", []))
    assert "schedule 'split-head' uploads stage(s) [2] on gpu1 for their forward and backward (" in note
    from mobius_fx.units import fmt_bytes

    assert f"{fmt_bytes(head)} of weights" in note
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():  # the refused pool left the pipeline's own pools as they were: its forward still runs
        torch.testing.assert_close(pipe.step_pipeline(x, target=y), F.cross_entropy(model(x), y), rtol=1e-5, atol=1e-6)


def test_a_dealt_stage_runs_on_another_torch_device():
    """gpu1 another torch device (as cuda:1 would be): the dealt stage's copy there runs a module
    of its own (tests/unit/test_executor_devices.py), and the step still equals eager."""
    torch.manual_seed(0)
    model = Classifier(blocks=3)
    x, y = torch.randn(8, 16), torch.randint(0, 50, (8,))
    pipe = _compile(model, x, 2, 2, 1, cuts=[1, 2, 3], loss_fn=F.cross_entropy, example_target=y)
    pipe.step_pipeline._rt.devices["gpu1"].torch_device = torch.device("cpu", 1)
    _step_equals_eager(model, pipe, x, y)
    ex = pipe.step_pipeline._rt._step_executor
    (g,) = [g for (k, g), st in ex.copies.items() if k == 3 and st is not ex.home[3]]
    assert ex.copies[(3, g)].module is not ex.home[3].module  # its home and its copy: cpu and cpu:1


class Counter(nn.Module):
    """Counts its calls in a buffer (a step counter, as an EMA's or a scheduler's)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen.add_(1)
        return x


class CountingHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)])
        self.head = nn.Sequential(nn.Linear(16, 10), Counter())

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_a_dealt_stage_whose_forward_changes_buffers_is_refused():
    """A buffer the forward changes chains micro-batch to micro-batch on one GPU; copies on
    several GPUs would each update their own."""
    torch.manual_seed(0)
    model = CountingHead()
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    pipe = _compile(model, x, 2, 2, 1, cuts=[1, 2], loss_fn=F.cross_entropy, example_target=y)
    with pytest.raises(MobiusError, match=r"schedule 'split-head' deals stage 2's micro-batches to several GPUs, but "
                                          r"its forward changes buffer\(s\) .*seen.*schedule='mobius'"):
        pipe.train_step(x, target=y)
    assert all(p.grad is None for p in model.parameters())
    assert model.head[1].seen.item() == 0


def test_the_plan_line_says_when_the_fastest_runs_in_another_form():
    """A runnable schedule whose runtime form is not what the simulator timed (split-head's,
    RoundPipe's) is named with the form compile runs by itself."""
    from mobius_fx import schedules
    from mobius_fx.planning.ir_transforms import unchanged
    from mobius_fx.schedules.choice import choose
    from tests.unit.test_split_head import TOY_FAST, plan_of

    schedules.register("toy-other", lambda ctx: TOY_FAST(ctx), runtime=unchanged, runs_as_simulated=False)
    try:
        c = choose(plan_of(Topology.virtual(gpus=4, memory="24GiB", bandwidth=10e9, p2p=False)))
        assert c.name == "toy-other"
        assert ("; the runtime runs it in another form (compile(schedule='toy-other')): compile by itself runs "
                "mobius (") in c.line
    finally:
        schedules.unregister("toy-other")
