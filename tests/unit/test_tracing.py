"""trace(): fx first, export as the fallback; names, module paths and the user's model untouched."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.fx as fx
from torch import nn

from mobius_fx import TraceError
from mobius_fx.tracing import TraceInfo, flatten_inputs, trace
from mobius_fx.module_paths import module_path
from mobius_fx.zoo import ResidualMLP, hf_gpt2, hf_inputs, hf_llama, mlp, nanogpt, nanogpt_inputs

try:
    from tests.models import BranchOnValue
except ImportError:  # run as `pytest` (tests/ on sys.path) rather than `python -m pytest`
    from models import BranchOnValue


def _info(gm: fx.GraphModule) -> TraceInfo:
    return gm.meta["mobius_trace"]


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


class _BranchOnType(nn.Module):
    """fx passes a Proxy, not a Tensor, so it records the wrong branch; export does not."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if isinstance(x, torch.Tensor):
            return self.lin(x)
        return self.lin(x.view(-1, 3))  # only the symbolic tracer gets here


class _Options(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask=None, scale=1.0, flag=False):
        y = self.lin(x) * scale
        if mask is not None:
            y = y * mask
        return y + 1 if flag else y


class _BatchNormDropout(nn.Module):
    """Boolean-mask indexing has no meta kernel, so trace's check of the fx graph runs it for
    real: dropout draws random numbers and BatchNorm updates its statistics."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(self.drop(self.bn(x)))
        return h[h.sum(1) > -1e9]


def test_sequential_mlp_traces_with_fx():
    model = mlp((6, 8, 3))
    x = torch.randn(5, 6)
    gm = trace(model, example_inputs=(x,))
    assert _info(gm).front_end == "fx"
    torch.testing.assert_close(gm(x), model(x))


def test_gpt_with_mask_built_in_forward_falls_back_to_export():
    model = nanogpt(blocks=2).eval()
    (idx,) = nanogpt_inputs(model, batch=2)
    gm = trace(model, example_inputs=(idx,))
    info = _info(gm)
    assert info.front_end == "export"
    assert "ones" in info.fx_error
    torch.testing.assert_close(gm(idx), model(idx))


def test_hf_gpt2_traces_through_export():
    model = hf_gpt2().eval()
    (ids,) = hf_inputs(model)
    gm = trace(model, example_inputs=(ids,))
    assert _info(gm).front_end == "export"
    torch.testing.assert_close(_logits(gm(ids)), model(ids).logits)


def test_hf_llama_traces_through_export():
    model = hf_llama().eval()
    (ids,) = hf_inputs(model)
    gm = trace(model, example_inputs=(ids,))
    assert _info(gm).front_end == "export"
    torch.testing.assert_close(_logits(gm(ids)), model(ids).logits)


def test_meta_model_traces_without_allocating():
    with torch.device("meta"):
        model = nanogpt(hidden=64, blocks=3, vocab=500, seq=32, heads=4)
    inputs = nanogpt_inputs(model, batch=2, device="meta")
    gm = trace(model, example_inputs=inputs)
    assert all(t.is_meta for t in gm.parameters())
    assert gm(*inputs).shape == (2, 32, 500)


def test_export_graph_accepts_another_batch_size():
    model = nanogpt(blocks=1).eval()
    gm = trace(model, example_inputs=nanogpt_inputs(model, batch=4))
    assert _info(gm).dynamic_batch
    (small,) = nanogpt_inputs(model, batch=1, seed=3)
    torch.testing.assert_close(gm(small), model(small))


def test_fx_graph_that_does_not_run_falls_back_to_export():
    model = _BranchOnType()
    x = torch.randn(2, 4)
    gm = trace(model, example_inputs=(x,))
    assert _info(gm).front_end == "export"
    assert "does not run" in _info(gm).fx_error
    torch.testing.assert_close(gm(x), model(x))


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_graph_parameters_are_the_models_own_tensors(front_end):
    model = ResidualMLP(depth=2)
    gm = trace(model, example_inputs=(torch.randn(3, 8),), front_end=front_end)
    names = _info(gm).names
    own = dict(model.named_parameters())
    for name, p in gm.named_parameters(remove_duplicate=False):
        assert p is own[names[name]]


def test_tied_head_maps_to_the_embedding_name():
    model = nanogpt(blocks=1)
    gm = trace(model, example_inputs=nanogpt_inputs(model))
    names = _info(gm).names
    assert names["lm_head.weight"] == "transformer.wte.weight"
    state = dict(model.named_parameters())
    for gm_name in names:
        if gm_name in dict(gm.named_parameters(remove_duplicate=False)):
            assert gm_name in state or names[gm_name] in state


def test_functional_call_with_model_masters_matches_model():
    model = nanogpt(blocks=1).eval()
    (idx,) = nanogpt_inputs(model)
    gm = trace(model, example_inputs=(idx,))
    names = _info(gm).names
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # tied listed once
    masters = {n: t.detach().clone() + 0.01 for n, t in own.items()}
    out = torch.func.functional_call(gm, {g: masters[m] for g, m in names.items()}, (idx,))
    expected = torch.func.functional_call(model, masters, (idx,))
    torch.testing.assert_close(out, expected)


def test_fx_nodes_inside_submodules_have_module_paths():
    model = ResidualMLP(depth=2)
    gm = trace(model, example_inputs=(torch.randn(3, 8),))
    assert _info(gm).front_end == "fx"
    paths = {n.name: module_path(n) for n in gm.graph.nodes}
    assert paths["inp"] == "inp"
    assert {p for p in paths.values() if p.startswith("blocks.1")} >= {"blocks.1", "blocks.1.up", "blocks.1.down"}
    gelu = next(n for n in gm.graph.nodes if n.op == "call_function" and "gelu" in str(n.target))
    assert module_path(gelu) == "blocks.0"  # functional call inside a block's forward


def test_export_nodes_carry_their_module_paths():
    model = hf_gpt2(layers=2)
    gm = trace(model, example_inputs=hf_inputs(model))
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and "addmm" in str(n.target)]
    assert linears and all(module_path(n).startswith("transformer.h.") for n in linears)


def test_get_attr_nodes_sit_right_before_their_first_user():
    model = nanogpt(blocks=2)
    gm = trace(model, example_inputs=nanogpt_inputs(model))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.find_nodes(op="get_attr"):
        first = min(node.users, key=order.__getitem__)
        assert all(p.op == "get_attr" for p in list(gm.graph.nodes)[order[node] + 1:order[first]])


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_fixed_options_and_tensor_kwargs_are_accepted_the_models_way(front_end):
    model = _Options()
    x, mask = torch.randn(2, 4), torch.rand(4)
    gm = trace(model, example_inputs=(x,), example_kwargs={"mask": mask, "scale": 2.0, "flag": True},
               front_end=front_end)
    expected = model(x, mask=mask, scale=2.0, flag=True)
    torch.testing.assert_close(gm(x, mask=mask, scale=2.0, flag=True), expected)
    assert flatten_inputs(gm, (x,), {"mask": mask, "scale": 2.0, "flag": True})[:2] == [x, mask]


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_tracing_leaves_the_model_unchanged(front_end):
    model = _BatchNormDropout()
    model.bn.running_mean.fill_(0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.drop.eval()  # a mixed mode must survive too
    x = torch.randn(8, 4)
    rng = torch.get_rng_state()
    trace(model, example_inputs=(x,), front_end=front_end)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and model.bn.training and not model.drop.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_untraceable_model_raises_trace_error_quoting_both_front_ends():
    with pytest.raises(TraceError) as err:
        trace(BranchOnValue(), example_inputs=(torch.randn(2, 4),))
    message = str(err.value)
    assert "symbolic_trace: " in message and "control flow" in message
    assert "export" in message and "data-dependent" in message
    assert "torch.where" in message  # the remedy


def test_fx_only_front_end_reports_its_failure():
    model = nanogpt(blocks=1)
    with pytest.raises(TraceError, match="front_end='auto'"):
        trace(model, example_inputs=nanogpt_inputs(model), front_end="fx")


def test_unknown_front_end_is_rejected():
    with pytest.raises(TraceError, match="front_end='jit'"):
        trace(mlp(), example_inputs=(torch.randn(1, 16),), front_end="jit")


class _CacheConfig:
    """An HF-style config: `use_cache` on, as HF's defaults have it."""

    def __init__(self) -> None:
        self.use_cache = True


class _CachingModel(nn.Module):
    """Fails to trace, as an HF model does, while its config asks for a key/value cache."""

    def __init__(self) -> None:
        super().__init__()
        self.config = _CacheConfig()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, use_cache=None):
        if self.config.use_cache if use_cache is None else use_cache:
            raise RuntimeError("a key/value cache cannot be traced")
        return self.lin(x)


def test_hf_use_cache_is_off_while_tracing_and_put_back(caplog):
    model = _CachingModel()
    x = torch.randn(2, 4)
    with caplog.at_level(logging.INFO, logger="mobius_fx"):
        gm = trace(model, example_inputs=(x,))
    assert torch.equal(gm(x), model.lin(x))
    assert model.config.use_cache is True  # the user's value, back
    assert "config.use_cache=False while tracing" in caplog.text
    with pytest.raises(TraceError):  # a use_cache the example passes is the user's: left as given
        trace(model, example_inputs=(x,), example_kwargs={"use_cache": True})
    assert model.config.use_cache is True
