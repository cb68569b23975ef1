"""Schedules that run a stage on a GPU other than its own (RoundPipe's backward, split-head's dealt
last stage, ZeRO-3's replicas) over GPUs that are different torch devices (cuda:0, cuda:1, ...).

The executor runs such a stage on its copy there (`StageState.copy_on`); on another torch device
the copy has a module of its own (`device_rewrite.moved_module`): its graph with that device's
constants, its tensor constants there. A recompute on another device than its forward draws the
forward's random numbers only where the two generators are interchangeable (`Device.rng_differs`:
CUDA GPUs of one model); a stage that draws is refused elsewhere.

Without a GPU: the copies are checked on fake CUDA tensors (`Pipeline.check_placement("cuda")`
of the step pipeline replays each copy on its GPU's device, as the executor does before it
allocates them on CUDA); the runtime's own copy is run on a fake CUDA device; and the whole step
runs on virtual GPUs that are different torch devices of the CPU (cpu:0, cpu:1, cpu:2: the index
names a device the rewrite must follow, the tensors stay on the CPU) and equals eager.
"""

import functools

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.runtime import device_cuda
from mobius_fx.runtime.device_common import CpuRng
from mobius_fx.runtime.device_cuda import CudaDevice
from mobius_fx.runtime.device_rewrite import random_nodes
from mobius_fx.runtime.device_virtual import VirtualDevice
from mobius_fx.runtime.devices import make_devices
from mobius_fx.zoo import GPT, GPTConfig
from tests.unit.test_executor import _check_conforms, _eager, _step_ir
from tests.unit.test_train_step import _assert_grads_equal, _grads

pytestmark = pytest.mark.usefixtures("one_thread")

MOVING = ["roundpipe", "split-head", "zero3-offload"]
_COMPUTE = ("call_function", "call_method", "call_module")


class ConstBlock(nn.Module):
    """A block whose trace keeps device constants: a literal `device="cpu"`, a factory without a
    device (made on the default one) and `.to("cpu")` with a positional device."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.ones(t, t, device="cpu").tril()
        pos = torch.arange(t).float()
        h = (mask / mask.sum(-1, keepdim=True)) @ self.fc(self.ln(x))  # a causal mean
        return x + torch.tanh(h) + pos[:, None].to("cpu") * 0.01


class ConstGPT(nn.Module):
    def __init__(self, vocab: int = 32, seq: int = 8, width: int = 16, blocks: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList([ConstBlock(width) for _ in range(blocks)])
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device="cpu"))
        for b in self.blocks:
            x = b(x)
        return self.head(x) * torch.ones(1, device="cpu")  # a constant in the last stage too


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _devices(n, seed, indexed):
    devs = make_devices({f"gpu{g}": 64 << 20 for g in range(n)}, device="virtual-async", seed=seed)
    if indexed:  # each GPU its own torch device, as cuda:0, cuda:1, ... are
        for g, d in enumerate(devs.values()):
            d.torch_device = torch.device("cpu", g)
    return devs


def _compile(model, ids, schedule, devs, n=3):
    cuts = list(range(1, len(model.blocks) + 2)) if isinstance(model, ConstGPT) else None
    return mobius_fx.compile(model, Topology.virtual(gpus=n, memory="64MiB"), example_inputs=(ids,), microbatches=2,
                             verbose=False, device=devs, loss_fn=_loss, example_target=ids, schedule=schedule,
                             cuts=cuts)


@functools.lru_cache(maxsize=None)
def _const_gpt(schedule):
    """ConstGPT compiled with `schedule` on three virtual GPUs that are torch devices cpu:0..2."""
    torch.manual_seed(0)
    model = ConstGPT()
    ids = torch.randint(0, 32, (4, 8))
    return model, ids, _compile(model, ids, schedule, _devices(3, 1, indexed=True))


def _constants(gm: fx.GraphModule) -> set[torch.device]:
    """The devices a graph names (device= arguments, positional devices of `.to`)."""
    out = set()
    for n in gm.graph.nodes:
        for a in [*n.args, *n.kwargs.values()]:
            named = isinstance(a, str) and (n.target == "to" or a == n.kwargs.get("device"))
            if isinstance(a, torch.device) or named:
                out.add(torch.device(a))
    return out


def _moved(ex):
    """The executor's copies on another torch device than their stage's own GPU."""
    return {(k, g): st for (k, g), st in ex.copies.items() if st.device.torch_device != ex.home[k].device.torch_device}


@pytest.mark.parametrize("schedule", MOVING)
def test_copies_on_other_torch_devices_carry_their_devices_constants_and_equal_eager(schedule):
    model, ids, pipe = _const_gpt(schedule)
    model.zero_grad(set_to_none=True)
    loss = pipe.train_step(ids, target=ids)
    ref, want = _eager(model, lambda: _loss(model(ids), ids))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    _assert_grads_equal(_grads(model), want)
    _check_conforms(pipe, _step_ir(pipe, schedule, (ids,), {"target": ids}))
    ex = pipe.step_pipeline._rt._step_executor
    moved = _moved(ex)
    assert moved, "the schedule runs no stage on another torch device"
    named = 0
    for (k, g), st in moved.items():
        home = ex.home[k]
        assert st.module is not home.module
        consts = _constants(st.module)
        assert consts <= {st.device.torch_device}, (k, g, consts)  # the copy's device only
        assert _constants(home.module) <= {home.device.torch_device}  # the stage's own: untouched
        named += bool(consts)
    assert named, "no moved copy holds a device constant: the test checks nothing"
    rt = pipe.step_pipeline._rt
    assert all(st.device.name == spec.gpu for st, spec in zip(rt.stages, rt.schedule.stages))  # back home


@pytest.mark.parametrize("schedule,model_name", [(s, "const_gpt") for s in MOVING] + [("roundpipe", "zoo_gpt")])
def test_every_copy_replays_on_its_fake_cuda_device(schedule, model_name):
    """`check_placement("cuda")` of the step pipeline replays every stage on its GPU and every
    copy the schedule runs on another GPU on that GPU's device, on fake CUDA tensors."""
    if model_name == "const_gpt":
        pipe = _const_gpt(schedule)[2]
    else:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab=32, seq=8, hidden=16, blocks=3, heads=2))
        ids = torch.randint(0, 32, (4, 8))
        pipe = _compile(model, ids, schedule, _devices(3, 1, indexed=False))
    sp = pipe.step_pipeline
    copies = sp._copies()
    assert copies
    ops = [sum(n.op in _COMPUTE for n in spec.module.graph.nodes) for spec in sp.schedule.stages]
    # GPU i is cuda:i: a copy on another GPU is on another device
    assert sp.check_placement("cuda") == sum(ops) + sum(ops[k] * len(gs) for k, gs in copies.items())


def test_the_runtimes_copy_on_a_fake_cuda_device_computes_there():
    """`StageState.copy_on` onto cuda:1 (fake): the copy's module computes on cuda:1 only, with
    cuda:1 in its graph; the stage's own module is unchanged and still runs on the CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    model = ConstGPT(blocks=2)
    ids = torch.randint(0, 32, (4, 8))
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(ids,),
                             microbatches=1, cuts=[1, 2], verbose=False, device="virtual")
    st = pipe._rt.stages[0]
    before = st.module.code
    with FakeTensorMode(allow_non_fake_inputs=True):
        dev = VirtualDevice("gpu9", None)
        dev.torch_device = torch.device("cuda", 1)
        copy = st.copy_on(dev, None)
        assert _constants(copy.module) == {torch.device("cuda", 1)}
        copy.bind_slots()
        try:
            out = copy.module(torch.randint(0, 32, (4, 8), device="cuda:1"))
        finally:
            st.bind_slots()
        assert {t.device for t in out if isinstance(t, torch.Tensor)} == {torch.device("cuda", 1)}
    assert st.module.code == before and _constants(st.module) <= {torch.device("cpu")}
    torch.testing.assert_close(pipe(ids), model(ids))  # the stage's own state runs as before


def test_a_gpu_of_another_device_type_is_refused():
    torch.manual_seed(0)
    model = ConstGPT()
    ids = torch.randint(0, 32, (4, 8))
    devs = _devices(3, 1, indexed=False)
    pipe = _compile(model, ids, "roundpipe", devs)
    assert any(g == "gpu1" for gs in pipe.step_pipeline._copies().values() for g in gs)
    devs["gpu1"].torch_device = torch.device("meta")
    with pytest.raises(MobiusError, match=r"schedule 'roundpipe' runs stage \d's backward on gpu\d \((meta|cpu)\), a "
                                          r"device of another type than its own GPU gpu\d \((cpu|meta)\).*"
                                          r"schedule='mobius'"):
        pipe.train_step(ids, target=ids)
    assert all(p.grad is None for p in model.parameters())


def test_a_stage_that_draws_is_refused_where_the_generators_differ_and_runs_where_they_agree(monkeypatch):
    """RoundPipe recomputes a stage with dropout on another GPU: refused where the GPUs say a
    state of one draws otherwise on the other (CUDA GPUs of different models), run where not."""
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (4, 8))
    model = GPT(GPTConfig(vocab=32, seq=8, hidden=16, blocks=2, heads=2, dropout=0.1))
    pipe = _compile(model, ids, "roundpipe", _devices(3, 1, indexed=True))
    with monkeypatch.context() as m:
        m.setattr(CpuRng, "rng_differs", lambda self, other: f"{self.name} and {other.name} differ")
        with pytest.raises(MobiusError, match=r"schedule 'roundpipe' recomputes stage \d's micro-batch \d on gpu\d for "
                                              r"its backward after its forward on gpu\d, and the stage draws random "
                                              r"numbers \(scaled_dot_product_attention.*\).*gpu\d and gpu\d differ.*"
                                              r"schedule='mobius'.*one model"):
            pipe.train_step(ids, target=ids)
    assert all(p.grad is None for p in model.parameters())
    pipe.train_step(ids, target=ids)  # virtual GPUs share the CPU generator: runs
    assert all(p.grad is not None for p in model.parameters())


def test_cuda_generators_are_interchangeable_between_gpus_of_one_model(monkeypatch):
    models = {0: ("H100", (9, 0), 132, 2048), 1: ("H100", (9, 0), 132, 2048), 2: ("L4", (8, 9), 58, 1536)}
    monkeypatch.setattr(device_cuda, "cuda_model", lambda d: models[d.index])

    def dev(i):
        d = object.__new__(CudaDevice)
        d.name, d.torch_device = f"gpu{i}", torch.device("cuda", i)
        return d
    assert dev(0).rng_differs(dev(1)) is None
    assert dev(0).rng_differs(dev(0)) is None
    why = dev(0).rng_differs(dev(2))
    assert "gpu0 (cuda:0: ('H100'" in why and "gpu2 (cuda:2: ('L4'" in why and "SM count" in why
    assert VirtualDevice("v", None).rng_differs(dev(0)) is not None  # another kind: not known to agree


class Leaf(nn.Module):
    def forward(self, x):
        return x


class LeafTracer(fx.Tracer):
    def is_leaf_module(self, m, name):
        return isinstance(m, Leaf) or super().is_leaf_module(m, name)


@pytest.mark.parametrize("build,draws", [
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)), True),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)), False),
    (lambda: GPT(GPTConfig(vocab=32, seq=8, hidden=16, blocks=1, heads=2)), False),  # dropout 0: p literal 0
    (lambda: GPT(GPTConfig(vocab=32, seq=8, hidden=16, blocks=1, heads=2, dropout=0.1)), True),
])
def test_random_nodes_finds_the_ops_that_draw(build, draws):
    torch.manual_seed(0)
    model = build()
    x = torch.randint(0, 32, (2, 8)) if isinstance(model, GPT) else torch.randn(2, 4)
    for front_end in ("fx", "export"):
        gm = mobius_fx.trace(model, example_inputs=(x,), front_end=front_end)
        assert bool(random_nodes(gm)) == draws, (front_end, random_nodes(gm))


def test_a_leaf_module_of_the_users_may_draw():
    """Its forward was not traced: counted as drawing (refused only where generators differ)."""
    model = nn.Sequential(nn.Linear(4, 4), Leaf())
    assert random_nodes(fx.GraphModule(model, LeafTracer().trace(model))) == ["_1"]
    assert random_nodes(fx.symbolic_trace(model)) == []  # traced through: nothing draws


class WithConstants(nn.Module):
    """Buffers of its own and inside a leaf module the graph calls (shared with a copy)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(4).eval()
        self.register_buffer("c", torch.ones(4))

    def forward(self, x):
        # a constant the trace computes (`_tensor_constant0`) and a factory with a literal device
        return self.norm(x) * self.c + torch.zeros(4) + torch.zeros(x.shape[1], device="cpu")


def test_moved_module_moves_the_constants_that_are_not_weights_and_leaves_the_stage_alone():
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from mobius_fx.runtime.device_rewrite import moved_module

    gm = fx.symbolic_trace(WithConstants())
    code, c = gm.code, gm.c
    cuda1 = torch.device("cuda", 1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        new, consts = moved_module(SimpleNamespace(weights=()), gm, torch.device("cpu"), cuda1)
        assert {f"{p}.{a}" if p else a for p, a, _ in consts} == {"c", "_tensor_constant0", "norm.weight", "norm.bias",
                                                                    "norm.running_mean", "norm.running_var",
                                                                    "norm.num_batches_tracked"}
        assert all(t.device == cuda1 for _, _, t in consts)
        assert new.c.device == cuda1 and _constants(new) == {cuda1}
    assert gm.code == code and gm.c is c and _constants(gm) == {torch.device("cpu")}  # the stage's own: unchanged
    # shared: its constants are those bound last, so StageState binds each state's (`bind_slots`)
    assert new.norm is gm.norm and gm.norm.running_mean.device == cuda1


def test_copies_on_two_other_devices_keep_the_stages_own_constants_and_move_their_own():
    """`StageState.copy_on` onto cuda:1, then cuda:2 (fake): the stage's own constants
    (`consts`, bound back when it runs) are its CPU ones, not those the first copy bound into
    the leaf module both share; the second copy's are all on cuda:2; the stage's module is left
    with its own (the executor's first op on a stage's own GPU binds nothing: `_use`)."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from mobius_fx.runtime.device_rewrite import named_tensors
    from mobius_fx.runtime.stage_state import StageState

    gm = fx.symbolic_trace(WithConstants())
    spec = SimpleNamespace(index=0, module=gm, weights=(), shells=None)
    st = StageState(spec, VirtualDevice("gpu0", None), [], None)
    cpu = torch.device("cpu")
    with FakeTensorMode(allow_non_fake_inputs=True):
        copies = []
        for i in (1, 2):
            dev = VirtualDevice(f"gpu{i}", None)
            dev.torch_device = torch.device("cuda", i)
            copies.append(st.copy_on(dev, None))
        assert st.consts and {t.device for _, _, t in st.consts} == {cpu}
        for i, copy in enumerate(copies, 1):
            assert {t.device for _, _, t in copy.consts} == {torch.device("cuda", i)}, i
            assert len(copy.consts) == len(st.consts)
    assert {t.device for _, t in named_tensors(gm)} == {cpu}  # copy_on leaves the stage as it found it
    st.bind_slots()
    assert {t.device for _, t in named_tensors(gm)} == {cpu}
    torch.testing.assert_close(gm(torch.ones(2, 4)), WithConstants().eval()(torch.ones(2, 4)))


def test_on_cuda_the_executor_replays_the_copies_before_allocating_them(monkeypatch):
    """GPUs that are CUDA devices (faked: set after compile): the executor's first step calls the
    placement check with the copies on other devices, before any copy has a slot."""
    import mobius_fx.runtime.placement as placement

    torch.manual_seed(0)
    model = ConstGPT()
    ids = torch.randint(0, 32, (4, 8))
    devs = _devices(3, 1, indexed=False)
    pipe = _compile(model, ids, "roundpipe", devs)
    want = pipe.step_pipeline._copies()
    for g, d in enumerate(devs.values()):
        d.torch_device = torch.device("cuda", g)
    seen = []

    def check(schedule, example, devices, traced, copies=None):
        seen.append({k: set(gs) for k, gs in copies.items()})
        raise MobiusError("checked")
    monkeypatch.setattr(placement, "check_placement", check)
    with pytest.raises(MobiusError, match="checked"):
        pipe.train_step(ids, target=ids)
    assert seen == [want]


def test_hf_gpt2_with_labels_under_zero3_on_other_torch_devices_equals_eager_and_replays_on_fake_cuda():
    """An export graph (literal devices: stage 0's `arange`, ...): ZeRO-3 copies every stage
    to other torch devices; they run and equal eager, and replay on fake CUDA."""
    from mobius_fx.zoo.tiny_hf import hf_gpt2

    torch.manual_seed(0)
    model = hf_gpt2(layers=2, vocab=64, positions=8)
    ids = torch.randint(0, 64, (4, 8))
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=3, memory="64MiB"), example_inputs=(ids,),
                             example_kwargs={"labels": ids}, microbatches=2, verbose=False, costs="model",
                             device=_devices(3, 1, indexed=True), schedule="zero3-offload")
    loss = pipe.train_step(ids, labels=ids)
    got = _grads(model)
    model.zero_grad()
    ref = model(ids, labels=ids).loss
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    _assert_grads_equal(got, _grads(model))
    ex = pipe.step_pipeline._rt._step_executor
    moved = _moved(ex)
    assert moved and any(_constants(st.module) for st in moved.values())
    for (k, g), st in moved.items():
        assert _constants(st.module) <= {st.device.torch_device}, (k, g)
    sp = pipe.step_pipeline
    ops = [sum(n.op in _COMPUTE for n in spec.module.graph.nodes) for spec in sp.schedule.stages]
    assert sp.check_placement("cuda") == sum(ops) + sum(ops[k] * len(gs) for k, gs in sp._copies().items())


def test_a_copy_rewrites_the_bodies_of_higher_order_ops_as_copies():
    """export's `torch.no_grad()` and autocast regions are GraphModules of their own, shared with
    the stage: the copy gets them rewritten to its device, the stage keeps its own."""
    from mobius_fx.runtime.device_rewrite import moved_graph_module
    from tests.unit.test_placement import Regions

    gm = mobius_fx.trace(Regions(), example_inputs=(torch.randn(4, 8),), front_end="export")
    cuda1 = torch.device("cuda", 1)
    targets = [n.target for n in gm.graph.nodes
               if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), fx.GraphModule)]
    assert targets
    before = {t: getattr(gm, t).code for t in targets}
    new = moved_graph_module(gm, torch.device("cpu"), cuda1)
    moved = [getattr(new, t) for t in targets]
    assert all(_constants(b) <= {cuda1} for b in moved) and any(_constants(b) for b in moved)
    assert {t: getattr(gm, t).code for t in targets} == before
    assert all(_constants(getattr(gm, t)) <= {torch.device("cpu")} for t in targets)
