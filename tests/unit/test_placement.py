"""Placement (mobius_fx/runtime/placement.py): the device constants a trace fixed follow each stage to
its device, and `Pipeline.check_placement("cuda")` finds, on a machine without a GPU, every op
that would see tensors of two devices on one.

The first real GPU run (issue 26) failed in stage 0 of GPT-2 and the test GPT with "index is on
cpu, different from other tensors on cuda:0": the export graph's `arange(..., device=cpu)`.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

import mobius_fx.runtime.device_rewrite as device_rewrite
import mobius_fx.runtime.placement as placement
from mobius_fx import MobiusError, trace, zoo
from mobius_fx.runtime.device_virtual import VirtualDevice
from mobius_fx.build import build_pipeline
from mobius_fx.zoo import ResidualMLP, SkipNet, TINY_HF, hf_inputs, mlp, nanogpt, nanogpt_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

_COMPUTE = ("call_function", "call_method", "call_module")


class Constants(nn.Module):
    """Every kind of device constant a torch.fx graph keeps: a literal `device="cpu"`, a factory
    without a device (made on the CPU), `.to("cpu")` with a positional device, and a factory
    without a device that meets no tensor of the stage (it stays where it is)."""

    def __init__(self, vocab: int = 50, seq: int = 8, width: int = 16) -> None:
        super().__init__()
        self.seq, self.width = seq, width
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.fc = nn.Linear(width, width)

    def forward(self, idx: torch.Tensor):
        t = idx.shape[1]
        pos = torch.arange(t, device="cpu")  # a literal device
        x = self.wte(idx) + self.wpe(pos)
        mask = torch.ones((t, t)).tril()  # no device: the default one
        att = (x @ x.transpose(1, 2)).masked_fill(mask == 0, float("-inf")).softmax(-1)
        y = self.fc(att @ x) + torch.zeros((t, 1)).to("cpu")  # .to with a positional device
        return y, torch.full((t,), 3.0)  # no device, meets nothing of the stage


class Regions(nn.Module):
    """`torch.no_grad()` and `torch.autocast("cpu", enabled=False)` regions: torch.export makes
    them higher-order ops whose bodies (separate GraphModules) hold device constants too."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            s = h * 2 + torch.arange(x.shape[1], device=x.device).float()
        with torch.autocast("cpu", enabled=False):
            s = s + torch.ones(x.shape[1], device=x.device)
        return self.b(h + s)


class Handoff(Regions):
    """Regions without the grad-mode block (the fx front end refuses those, issue 28): the
    device of `x`, read in one stage, builds tensors in later ones."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.device  # read in the first stage, used in the last
        h = self.b(torch.relu(self.a(x)))
        with torch.autocast("cpu", enabled=False):
            return h + torch.ones(x.shape[1], device=d) + torch.arange(x.shape[1], device=d).float()


def _ids(vocab: int, batch: int = 4, seq: int = 8) -> tuple[torch.Tensor]:
    return (torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)),)


def _tiny_zoo_gpt() -> nn.Module:
    return zoo.GPT(zoo.GPTConfig(vocab=64, hidden=16, blocks=2, heads=2, seq=16))


# name -> (builder, inputs, kwargs, front ends it supports)
MODELS = {
    "mlp": (lambda: mlp((8, 16, 16, 4)), lambda m: (torch.randn(4, 8),), {}, ("fx", "export")),
    "residual_mlp": (lambda: ResidualMLP(depth=3), lambda m: (torch.randn(4, 8),), {}, ("fx", "export")),
    "skipnet": (lambda: SkipNet(depth=3), lambda m: (torch.randn(4, 8),), {}, ("fx", "export")),
    "constants": (Constants, lambda m: _ids(50), {}, ("fx", "export")),
    "regions": (Regions, lambda m: (torch.randn(4, 8),), {}, ("export",)),
    "handoff": (Handoff, lambda m: (torch.randn(4, 8),), {}, ("fx", "export")),
    "zoo_gpt": (_tiny_zoo_gpt, lambda m: _ids(64), {}, ("fx", "export")),
    "gpt": (lambda: nanogpt(hidden=16, blocks=2, vocab=64, seq=8), lambda m: nanogpt_inputs(m, batch=4), {}, ("export",)),
    **{name: (TINY_HF[name], lambda m: hf_inputs(m, batch=4), {}, ("export",))
       for name in ("gpt2", "llama", "opt", "bert")},
    "t5": (TINY_HF["t5"], lambda m: hf_inputs(m, batch=4), "decoder", ("export",)),
}
CASES = [(name, fe) for name, spec in MODELS.items() for fe in spec[3]]


@functools.lru_cache(maxsize=None)
def _traced(name: str, front_end: str):
    torch.manual_seed(0)
    build, inputs, kwargs, _ = MODELS[name]
    model = build()
    x = inputs(model)
    kw = {"decoder_input_ids": x[0]} if kwargs == "decoder" else {}
    return model, x, kw, trace(model, example_inputs=x, example_kwargs=kw, front_end=front_end)


def _cut(gm: fx.GraphModule, stages: int) -> list[list[str]]:
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    bounds = [round(i * len(names) / stages) for i in range(stages + 1)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def _pipe(name: str, front_end: str, *, stages: int = 3, device="virtual"):
    model, x, kw, gm = _traced(name, front_end)
    return build_pipeline(model, gm, stage_nodes=_cut(gm, stages), stage_gpus=[f"gpu{k % 2}" for k in range(stages)],
                          gpu_budgets={}, microbatches=2, example_inputs=x, example_kwargs=kw, device=device)


def _ops(pipe) -> int:
    return sum(1 for st in pipe.schedule.stages for n in st.module.graph.nodes if n.op in _COMPUTE)


@pytest.mark.parametrize("name,front_end", CASES, ids=[f"{n}-{fe}" for n, fe in CASES])
def test_every_stage_of_the_zoo_replays_on_cuda_without_a_device_clash(name, front_end):
    pipe = _pipe(name, front_end)
    assert pipe._gm.meta["mobius_trace"].front_end == front_end
    assert pipe.check_placement("cuda") == _ops(pipe)  # every op of every stage replayed


def test_without_the_rewrite_gpt2_fails_the_check_naming_stage_node_and_devices(monkeypatch):
    """The mutation the check exists for: the issue's GPU failure, found on the CPU."""
    pipe = _pipe("gpt2", "export")
    monkeypatch.setattr(placement, "rewrite_graph", lambda graph, src, dst: [])
    with pytest.raises(MobiusError, match=r"stage 0 would run on cuda:0 but its node `%embedding\S* .*aten\."
                                          r"embedding.*` sees tensors of two devices, cuda:0 and cpu \(%\w+ on cpu, "
                                          r"made by `%arange\w* .*aten\.arange.*device: cpu.*`\)"):
        pipe.check_placement("cuda")


def test_the_check_names_a_later_stage_and_the_device_of_a_clash_on_another_gpu(monkeypatch):
    pipe = _pipe("gpt", "export", stages=3)
    assert pipe.check_placement("cuda:1") == _ops(pipe)
    rewrite = device_rewrite.rewrite_graph
    # the rewrite left out after stage 0 (the one with the position ids' arange): a later
    # stage's causal-mask `ones` stays on the CPU
    monkeypatch.setattr(placement, "rewrite_graph", lambda graph, src, dst: rewrite(graph, src, dst)
                        if any(n.name.startswith("arange") for n in graph.nodes) else [])
    with pytest.raises(MobiusError, match=r"stage [12] would run on cuda:1 but its node `%\w+ .*` sees tensors of "
                                          r"two devices, cuda:1 and cpu \(%\w+ on cpu, made by `%ones\w* .*aten\."
                                          r"ones.*`\): torch refuses that on a GPU \([^)]*\)\. A device fixed by the "
                                          r"trace [^\n]*$"):
        pipe.check_placement("cuda:1")


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_binding_a_stage_to_a_gpu_rewrites_every_device_constant_of_the_trace(front_end):
    pipe = _pipe("constants", front_end, stages=1)
    (spec,) = pipe.schedule.stages
    graph = device_rewrite.copy_graph(spec.module.graph)
    cuda = torch.device("cuda", 0)
    changed = device_rewrite.rewrite_graph(graph, torch.device("cpu"), cuda)
    constants = [a for n in graph.nodes for a in (*n.args, *n.kwargs.values())
                 if isinstance(a, torch.device) or (isinstance(a, str) and device_rewrite._is_to(n))]
    assert changed and constants and all(torch.device(d) == cuda for d in constants), constants
    if front_end == "fx":  # the factory without a device that feeds the stage got one; the other did not
        made = {n.target: n.kwargs.get("device") for n in graph.nodes if n.op == "call_function"}
        assert made[torch.arange] == made[torch.ones] == made[torch.zeros] == cuda
        assert made[torch.full] is None
        assert any(n.op == "call_method" and n.target == "to" and n.args[1] == cuda for n in graph.nodes)


def test_binding_rewrites_the_bodies_of_higher_order_ops_and_leaves_the_traced_graph_alone():
    model, x, kw, gm = _traced("regions", "export")
    pipe = _pipe("regions", "export", stages=1)
    (spec,) = pipe.schedule.stages
    cuda = torch.device("cuda", 0)

    def bodies(module):
        return [getattr(module, str(n.target)) for n in module.graph.nodes if n.op == "get_attr"
                and isinstance(getattr(module, str(n.target), None), fx.GraphModule)]

    def constants(module):
        return [a for n in module.graph.nodes for a in (*n.args, *n.kwargs.values()) if isinstance(a, torch.device)]

    before = [constants(b) for b in bodies(gm)]
    assert any(before) and all(d == torch.device("cpu") for c in before for d in c)
    device_rewrite.place_stage(spec, torch.device("cpu"), cuda)
    placed = [constants(b) for b in bodies(spec.module)]
    assert sum(map(len, placed)) == sum(map(len, before)) and all(d == cuda for c in placed for d in c)
    autocast = [n for n in spec.module.graph.nodes if "autocast" in str(n.target)]
    assert autocast and all(n.args[0] == "cuda" for n in autocast)
    assert [constants(b) for b in bodies(gm)] == before  # the user's traced graph (and other pipelines) unchanged


def test_a_factory_meeting_an_input_through_an_attribute_gets_the_stage_device_and_one_of_a_size_does_not():
    class Transposed(nn.Module):
        def forward(self, x):  # x.T is a tensor of the stage; x.shape only sizes
            return torch.ones(x.shape[::-1]) + x.T, torch.zeros(x.shape)

    gm = fx.symbolic_trace(Transposed())
    cuda = torch.device("cuda", 0)
    device_rewrite.rewrite_graph(gm.graph, torch.device("cpu"), cuda)
    made = {n.target: n.kwargs.get("device") for n in gm.graph.nodes if n.op == "call_function"}
    assert made[torch.ones] == cuda and made[torch.zeros] is None


@pytest.mark.parametrize("name", ["constants", "regions", "handoff"])
def test_virtual_stages_compute_what_eager_computes_after_the_rewrite(name):
    for front_end in MODELS[name][3]:
        model, x, kw, _ = _traced(name, front_end)
        pipe = _pipe(name, front_end)
        for got, want in zip(pytree.tree_leaves(pipe(*x)), pytree.tree_leaves(model(*x))):
            torch.testing.assert_close(got, want)


class DataDependent(nn.Module):
    """`nonzero`, whose output size depends on the values (fake tensors on a CUDA-less build run
    it on the meta device), and a custom autograd Function that branches on a value (no fake
    tensor can run it)."""

    class Clip(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clamp(0) if x.sum().item() > 0 else x

        @staticmethod
        def backward(ctx, g):
            return g

    def __init__(self, branch: bool) -> None:
        super().__init__()
        self.branch = branch
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.branch:
            h = self.Clip.apply(h)
        return self.b(h * (h > 0).nonzero().shape[0])


def test_an_op_with_a_value_dependent_size_is_replayed_on_the_meta_device():
    model, x = DataDependent(branch=False), (torch.randn(4, 8),)
    gm = trace(model, example_inputs=x, front_end="fx")
    pipe = build_pipeline(model, gm, stage_nodes=_cut(gm, 2), stage_gpus=["gpu0", "gpu1"], gpu_budgets={},
                          microbatches=2, example_inputs=x, device="virtual")
    assert pipe.check_placement("cuda") == _ops(pipe)


def test_an_op_fake_tensors_cannot_run_leaves_its_stage_and_the_stages_after_unchecked_with_a_warning(caplog):
    model, x = DataDependent(branch=True), (torch.randn(4, 8),)
    gm = trace(model, example_inputs=x, front_end="fx")
    pipe = build_pipeline(model, gm, stage_nodes=_cut(gm, 2), stage_gpus=["gpu0", "gpu1"], gpu_budgets={},
                          microbatches=2, example_inputs=x, device="virtual")
    with caplog.at_level("WARNING", logger="mobius_fx"):
        assert pipe.check_placement("cuda") == 1  # the Linear before the Function
    text = caplog.text
    assert "stage 0 on cuda:0 is unchecked from node `%clip_apply" in text and "data-dependent" in text
    assert "While executing" not in text and "stage 1 was not replayed: it needs outputs of stage 0" in text


class _CudaLike(VirtualDevice):
    """A virtual GPU that says it is cuda:0 and records any allocation."""

    allocated: list[str] = []

    def __init__(self, name: str) -> None:
        super().__init__(name, None)
        self.torch_device = torch.device("cuda", 0)

    def new_slot(self, like, dtype, parameter):
        self.allocated.append(self.name)
        return super().new_slot(like, dtype, parameter)


def test_building_a_cuda_pipeline_checks_placement_before_allocating(monkeypatch):
    model, x, kw, gm = _traced("gpt2", "export")
    from mobius_fx.passes.insert_transfers import insert_transfers

    schedule = insert_transfers(gm, stage_nodes=_cut(gm, 2), stage_gpus=["gpu0", "gpu1"], microbatches=1)
    monkeypatch.setattr(placement, "rewrite_graph", lambda graph, src, dst: [])
    _CudaLike.allocated = []
    with pytest.raises(MobiusError, match=r"stage 0 would run on cuda:0 .*embedding"):
        build_pipeline(model, gm, schedule=schedule, example_inputs=x,
                       device={"gpu0": _CudaLike("gpu0"), "gpu1": _CudaLike("gpu1")})
    assert _CudaLike.allocated == []


def test_check_placement_refuses_a_name_that_is_no_device():
    pipe = _pipe("mlp", "fx", stages=2)
    with pytest.raises(MobiusError, match="not a torch device"):
        pipe.check_placement("gpu")


def test_check_placement_needs_the_example_a_pipeline_was_built_with():
    model, x, kw, gm = _traced("mlp", "fx")
    pipe = build_pipeline(model, gm, stage_nodes=_cut(gm, 2), stage_gpus=["gpu0", "gpu1"], gpu_budgets={},
                          microbatches=1, device="virtual")
    with pytest.raises(MobiusError, match="built without example inputs; build it with example_inputs="):
        pipe.check_placement("cuda")
