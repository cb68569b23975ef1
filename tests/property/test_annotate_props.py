"""Properties of annotate on random MLPs: parameter bytes exact, every Linear's FLOPs exact."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mobius_fx.passes.annotate import annotate
from mobius_fx.tracing import trace
from mobius_fx.zoo import mlp

try:
    from tests.models import unique_param_bytes
except ImportError:  # run as `pytest` (tests/ on sys.path) rather than `python -m pytest`
    from models import unique_param_bytes

widths = st.lists(st.integers(1, 48), min_size=2, max_size=6)


def _check(widths: list[int], batch: int, bias: bool, front_end: str) -> None:
    model = mlp(widths, bias=bias)
    x = torch.randn(batch, widths[0])
    gm = trace(model, example_inputs=(x,), front_end=front_end)
    layers = annotate(gm, example_inputs=(x,), costs="model")
    assert sum(layer.param_bytes for layer in layers) == unique_param_bytes(model)
    # Sequential children are the layers: "0" Linear, "1" ReLU, "2" Linear, ...
    by_name = {layer.name: layer for layer in layers}
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        linear = by_name[str(2 * i)]
        assert linear.fwd_flops == 2 * batch * a * b
        assert linear.param_bytes == (a * b + (b if bias else 0)) * 4
        assert linear.bwd_flops == (1 if i == 0 else 2) * 2 * batch * a * b  # no input grad for the first
    assert [n for layer in layers for n in layer.nodes] == [n.name for n in gm.graph.nodes]


@given(widths=widths, batch=st.integers(1, 9), bias=st.booleans())
def test_random_mlp_costs_are_exact_through_fx(widths, batch, bias):
    _check(widths, batch, bias, "fx")


@settings(max_examples=8)
@given(widths=widths, batch=st.integers(2, 9), bias=st.booleans())
def test_random_mlp_costs_are_exact_through_export(widths, batch, bias):
    _check(widths, batch, bias, "export")
