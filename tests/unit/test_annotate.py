"""annotate(): per-node costs, parameters counted once, layers along module boundaries."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mobius_fx import MobiusError
from mobius_fx.planning.costs import LayerCost, NodeCost
from mobius_fx.topology.device_specs import DEVICE_SPECS
from mobius_fx.passes.annotate import annotate
from mobius_fx.tracing import trace
from mobius_fx.precision import Precision
from mobius_fx.zoo import ResidualMLP, SkipNet, hf_gpt2, hf_inputs, hf_llama, mlp, nanogpt, nanogpt_inputs

try:
    from tests.models import unique_param_bytes
except ImportError:  # run as `pytest` (tests/ on sys.path) rather than `python -m pytest`
    from models import unique_param_bytes


def _annotated(model: nn.Module, inputs: tuple, **kw) -> tuple[torch.fx.GraphModule, list[LayerCost]]:
    gm = trace(model, example_inputs=inputs)
    return gm, annotate(gm, example_inputs=inputs, **kw)


@pytest.fixture(scope="module")
def tiny_gpt():
    model = nanogpt(hidden=32, blocks=3, vocab=64, seq=8, heads=2)
    inputs = nanogpt_inputs(model, batch=2)
    gm, layers = _annotated(model, inputs)
    return model, gm, layers


class _BNDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        return self.out(self.drop(self.bn(self.lin(x))))


class _SharedTwice(nn.Module):
    """`shared` is called before and after `middle`: two separate layers."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.middle = nn.Linear(8, 8)

    def forward(self, x):
        return self.shared(self.middle(self.shared(x)))


# ---------------------------------------------------------------------------- node costs

def test_every_node_gets_a_node_cost(tiny_gpt):
    _, gm, layers = tiny_gpt
    names = {name for layer in layers for name in layer.nodes}
    for node in gm.graph.nodes:
        cost = node.meta["mobius"]
        assert isinstance(cost, NodeCost)
        assert cost.layer in {layer.name for layer in layers}
        assert node.name in names


def test_linear_forward_flops_are_two_batch_in_out():
    batch, widths = 5, (12, 20, 7)
    gm, _ = _annotated(mlp(widths), (torch.randn(batch, widths[0]),))
    linears = [n for n in gm.graph.nodes if n.op == "call_module" and n.target in ("0", "2")]
    assert [n.meta["mobius"].fwd_flops for n in linears] == [2 * batch * 12 * 20, 2 * batch * 20 * 7]


def test_hidden_linear_backward_is_twice_forward():
    gm, _ = _annotated(mlp((12, 20, 7)), (torch.randn(5, 12),))
    last = next(n for n in gm.graph.nodes if n.target == "2").meta["mobius"]
    assert last.bwd_flops == 2 * last.fwd_flops  # input grad + weight grad


def test_first_linear_backward_skips_the_input_gradient():
    gm, _ = _annotated(mlp((12, 20, 7)), (torch.randn(5, 12),))
    first = next(n for n in gm.graph.nodes if n.target == "0").meta["mobius"]
    assert first.bwd_flops == first.fwd_flops  # the input needs no grad: weight grad only


def test_frozen_parameters_count_bytes_but_no_grad_bytes():
    model = mlp((8, 8, 8))
    model[0].requires_grad_(False)
    gm, layers = _annotated(model, (torch.randn(2, 8),))
    first = next(n for n in gm.graph.nodes if n.target == "0").meta["mobius"]
    assert first.param_bytes == (8 * 8 + 8) * 4 and first.grad_bytes == 0
    assert first.bwd_flops == 0  # nothing upstream needs a gradient
    assert layers[-1].grad_bytes == layers[-1].param_bytes


def test_modelled_time_is_the_roofline_of_the_device_spec():
    spec = DEVICE_SPECS["rtx3090"]
    gm, _ = _annotated(nn.Sequential(nn.Linear(1024, 1024, bias=False)), (torch.randn(512, 1024),), device_spec=spec)
    cost = next(n for n in gm.graph.nodes if n.op == "call_module").meta["mobius"]
    compute = cost.fwd_flops / (spec.peak_flops("float32") * spec.efficiency)
    memory = (512 * 1024 * 2 + 1024 * 1024) * 4 / spec.memory_bandwidth
    assert cost.fwd_time == pytest.approx(max(compute, memory))
    assert cost.bwd_time > cost.fwd_time  # includes the recompute


def test_half_precision_dtype_uses_the_tensor_core_peak():
    model, x = nn.Sequential(nn.Linear(1024, 1024, bias=False)), torch.randn(512, 1024)
    gm = trace(model, example_inputs=(x,))
    fp32 = annotate(gm, example_inputs=(x,), device_spec="rtx3090")[0].fwd_time
    bf16 = annotate(gm, example_inputs=(x,), device_spec="rtx3090", precision=Precision.of(torch.bfloat16))[0].fwd_time
    assert bf16 < fp32


def test_output_bytes_are_the_nodes_output_tensors():
    gm, _ = _annotated(mlp((12, 20, 7)), (torch.randn(5, 12),))
    first = next(n for n in gm.graph.nodes if n.target == "0").meta["mobius"]
    assert first.output_bytes == 5 * 20 * 4
    assert first.peak_bytes == first.output_bytes + (5 * 12 + 12 * 20 + 20) * 4


# ---------------------------------------------------------------------------- parameters once

@pytest.mark.parametrize("build,inputs", [
    (lambda: nanogpt(blocks=2), lambda m: nanogpt_inputs(m)),
    (lambda: hf_gpt2(layers=2), lambda m: hf_inputs(m)),
    (lambda: hf_llama(layers=2), lambda m: hf_inputs(m)),
    (lambda: ResidualMLP(depth=3), lambda m: (torch.randn(4, 8),)),
], ids=["nanogpt-tied", "hf-gpt2-tied", "hf-llama", "residual-mlp"])
def test_total_parameter_bytes_equal_the_models_unique_parameter_bytes(build, inputs):
    model = build()
    gm, layers = _annotated(model, inputs(model))
    assert sum(layer.param_bytes for layer in layers) == unique_param_bytes(model)
    assert sum(n.meta["mobius"].param_bytes for n in gm.graph.nodes) == unique_param_bytes(model)


def test_tied_weight_is_owned_by_the_embedding_and_used_by_the_head(tiny_gpt):
    _, _, layers = tiny_gpt
    owners = [layer.name for layer in layers if "transformer.wte.weight" in layer.params]
    users = [layer.name for layer in layers if "transformer.wte.weight" in layer.uses]
    assert owners == [layers[0].name]
    assert users == [layers[0].name, layers[-1].name]
    assert "lm_head.weight" not in {p for layer in layers for p in layer.uses}  # canonical names only


def test_each_parameter_has_exactly_one_owner(tiny_gpt):
    model, _, layers = tiny_gpt
    owned = [p for layer in layers for p in layer.params]
    assert sorted(owned) == sorted(dict(model.named_parameters()))


# ---------------------------------------------------------------------------- layers

def test_gpt_layers_are_the_blocks_plus_embedding_and_head(tiny_gpt):
    _, _, layers = tiny_gpt
    assert [layer.name for layer in layers] == [
        "transformer.wte+wpe+drop", "transformer.h.0", "transformer.h.1", "transformer.h.2",
        "transformer.ln_f+lm_head"]


def test_hf_llama_layers_are_the_decoder_layers_plus_two():
    model = hf_llama(layers=3)
    _, layers = _annotated(model, hf_inputs(model))
    names = [layer.name for layer in layers]
    assert names[1:4] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert len(names) == 5 and names[0].startswith("model.embed_tokens") and names[-1].endswith("lm_head")


def test_small_embedding_and_head_each_merge_into_one_layer():
    with torch.device("meta"):
        model = hf_gpt2(layers=3, hidden=128, heads=4)  # vocab 100: every non-block layer is tiny
    inputs = hf_inputs(model, device="meta")
    _, layers = _annotated(model, inputs)
    assert [layer.name for layer in layers] == [
        "transformer.wte+wpe+drop", "transformer.h.0", "transformer.h.1", "transformer.h.2",
        "transformer.ln_f+lm_head"]


def test_repeated_blocks_share_a_signature(tiny_gpt):
    _, _, layers = tiny_gpt
    blocks = [layer for layer in layers if ".h." in layer.name]
    assert len({b.signature for b in blocks}) == 1
    assert blocks[0] == blocks[1].__class__(**{**blocks[1].__dict__, "name": blocks[0].name,
                                               "nodes": blocks[0].nodes, "params": blocks[0].params,
                                               "uses": blocks[0].uses})
    assert layers[0].signature != blocks[0].signature


def test_layers_are_contiguous_runs_that_cover_the_graph_in_order(tiny_gpt):
    _, gm, layers = tiny_gpt
    assert [name for layer in layers for name in layer.nodes] == [n.name for n in gm.graph.nodes]


def test_layer_costs_are_sums_of_their_nodes(tiny_gpt):
    _, gm, layers = tiny_gpt
    by_name = {n.name: n.meta["mobius"] for n in gm.graph.nodes}
    for layer in layers:
        assert layer.fwd_flops == sum(by_name[n].fwd_flops for n in layer.nodes)
        assert layer.bwd_time == pytest.approx(sum(by_name[n].bwd_time for n in layer.nodes))
        assert layer.param_bytes == sum(by_name[n].param_bytes for n in layer.nodes)


def test_block_output_bytes_are_the_hidden_state(tiny_gpt):
    _, _, layers = tiny_gpt
    assert layers[1].output_bytes == 2 * 8 * 32 * 4  # (batch, seq, hidden) fp32
    assert layers[-1].output_bytes == 2 * 8 * 64 * 4  # the logits leave the model


def test_output_bytes_include_a_skip_connection_that_crosses_the_cut():
    batch, width = 3, 16
    _, layers = _annotated(SkipNet(width=width, depth=4), (torch.randn(batch, 8),))
    by_name = {layer.name: layer for layer in layers}
    hidden = batch * width * 4
    assert by_name["stem"].output_bytes == hidden  # s (h is s itself)
    assert [by_name[f"blocks.{i}"].output_bytes for i in range(3)] == [2 * hidden] * 3  # h and s
    assert by_name["blocks.3"].output_bytes == hidden  # h + s is summed inside blocks.3's run


def test_shared_module_called_again_later_starts_a_new_layer():
    _, layers = _annotated(_SharedTwice(), (torch.randn(2, 8),))
    assert [layer.name for layer in layers] == ["shared", "middle", "shared@1"]
    assert layers[0].params and not layers[2].params and layers[2].uses == layers[0].uses


def test_blocks_plus_two_layers_for_a_deeper_gpt():
    with torch.device("meta"):
        model = nanogpt(hidden=64, blocks=12, vocab=256, seq=16, heads=4)
    inputs = nanogpt_inputs(model, batch=2, device="meta")
    _, layers = _annotated(model, inputs)
    assert len(layers) == 12 + 2


def test_meta_model_is_modelled_without_allocating():
    with torch.device("meta"):
        model = nanogpt(hidden=64, blocks=2, vocab=256, seq=16, heads=4)
    inputs = nanogpt_inputs(model, batch=2, device="meta")
    gm, layers = _annotated(model, inputs, costs="auto")
    assert not any(layer.measured for layer in layers)
    assert sum(layer.param_bytes for layer in layers) == unique_param_bytes(model)
    assert all(layer.fwd_time > 0 for layer in layers)


# ---------------------------------------------------------------------------- measured

def test_measure_times_nodes_on_the_host():
    model = _BNDrop()
    x = torch.randn(4, 6)
    gm, layers = _annotated(model, (x,), costs="measure", warmup=1, repeats=2)
    assert all(layer.measured for layer in layers)
    lin = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "lin").meta["mobius"]
    assert lin.measured and lin.fwd_time > 0 and lin.bwd_time > lin.fwd_time
    assert lin.fwd_flops == 2 * 4 * 6 * 6  # FLOPs are counted in either mode


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_measure_leaves_no_grad_on_the_model(front_end):
    model = _BNDrop()
    x = torch.randn(4, 6)
    gm = trace(model, example_inputs=(x,), front_end=front_end)
    annotate(gm, example_inputs=(x,), costs="measure", warmup=1, repeats=2)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_measure_leaves_batchnorm_statistics_unchanged(front_end):
    model = _BNDrop()
    x = torch.randn(4, 6) * 3 + 1
    gm = trace(model, example_inputs=(x,), front_end=front_end)
    before = {k: v.clone() for k, v in model.named_buffers()}
    annotate(gm, example_inputs=(x,), costs="measure", warmup=1, repeats=2)
    for k, v in model.named_buffers():
        assert torch.equal(v, before[k]), k


def test_measure_restores_the_callers_rng_state():
    model = _BNDrop()
    x = torch.randn(4, 6)
    gm = trace(model, example_inputs=(x,))
    state = torch.get_rng_state()
    annotate(gm, example_inputs=(x,), costs="measure", warmup=1, repeats=2)
    assert torch.equal(torch.get_rng_state(), state)


def test_measure_does_not_modify_the_example_inputs():
    class InPlace(nn.Module):
        def forward(self, x):
            return x.add_(1.0)

    x = torch.zeros(3)
    gm = torch.fx.symbolic_trace(InPlace())  # mobius_fx.trace refuses the input edit (issue 39); annotate alone
    annotate(gm, example_inputs=(x,), costs="measure", warmup=1, repeats=2)  # must still leave inputs alone
    assert torch.equal(x, torch.zeros(3))


def test_measure_on_meta_tensors_is_refused():
    with torch.device("meta"):
        model = mlp((4, 4))
    x = torch.empty(2, 4, device="meta")
    gm = trace(model, example_inputs=(x,))
    with pytest.raises(MobiusError, match="costs='model'"):
        annotate(gm, example_inputs=(x,), costs="measure")


def test_auto_measures_a_small_real_model():
    _, layers = _annotated(mlp((8, 8)), (torch.randn(2, 8),), costs="auto", warmup=1, repeats=2)
    assert all(layer.measured for layer in layers)


def test_unknown_cost_source_is_rejected():
    with pytest.raises(MobiusError, match="costs='guess'"):
        _annotated(mlp(), (torch.randn(2, 16),), costs="guess")


def test_progress_callback_hears_the_phases():
    messages: list[str] = []
    _annotated(mlp(), (torch.randn(2, 16),), progress=messages.append)
    assert any("layers" in m for m in messages)


class _MaskSelect(nn.Module):
    """Boolean-mask indexing: its output shape depends on the data, so meta tensors cannot run it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h[h.sum(1) > -1e9]


def test_model_costs_name_the_node_that_needs_real_data():
    x = torch.randn(3, 4)
    gm = trace(_MaskSelect(), example_inputs=(x,))
    with pytest.raises(MobiusError, match="costs='measure'"):
        annotate(gm, example_inputs=(x,), costs="model")


def test_auto_measures_when_meta_tensors_cannot_run_the_graph():
    x = torch.randn(3, 4)
    gm = trace(_MaskSelect(), example_inputs=(x,))
    layers = annotate(gm, example_inputs=(x,), costs="auto", warmup=0, repeats=1)
    assert all(layer.measured for layer in layers)
    assert sum(layer.param_bytes for layer in layers) == (16 + 4) * 4


def test_view_nodes_move_no_bytes_and_take_no_time():
    class Transpose(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x).t()

    gm, _ = _annotated(Transpose(), (torch.randn(4, 8),))
    view = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "t").meta["mobius"]
    assert view.output_bytes == 4 * 8 * 4  # it still is an output tensor
    assert view.fwd_time == 0 and view.peak_bytes == 4 * 8 * 4  # but nothing new is written


@pytest.mark.slow
def test_gpt3_8b_on_meta_is_annotated_at_planner_scale():
    """GPT-3 8B's shapes (hidden 3072, vocab 50257, 8 x 1024 tokens) on 12 of its 72 blocks: ~6 GB of
    weights, past 32-bit byte counts; the 72 blocks are traced, annotated and planned by
    tests/unit/test_plan_api.py::test_gpt3_8b_on_the_paper_server_plans_in_under_a_minute."""
    blocks = 12
    with torch.device("meta"):
        model = nanogpt(hidden=3072, blocks=blocks, vocab=50257, seq=1024, heads=24)
    inputs = nanogpt_inputs(model, batch=8, device="meta")
    gm = trace(model, example_inputs=inputs, dynamic_batch=False)  # static shapes export faster
    layers = annotate(gm, example_inputs=inputs)
    assert len(layers) == blocks + 2
    assert unique_param_bytes(model) > 2**32
    assert sum(layer.param_bytes for layer in layers) == unique_param_bytes(model)  # ~6 GB, tied once
    assert len({layer.signature for layer in layers[1:-1]}) == 1
    block = layers[1]
    assert block.fwd_flops == pytest.approx(24 * 8 * 1024 * 3072**2 + 4 * 8 * 1024**2 * 3072, rel=0.01)
    assert all(n.meta["mobius"].layer for n in gm.graph.nodes)
