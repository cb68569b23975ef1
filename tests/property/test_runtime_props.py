"""Properties of the runtime over random models, cuts, GPU orders, micro-batch counts and budgets.

For any valid cut (contiguous stages in graph order) of a random MLP or residual stack, any
cross-mapped GPU order and any micro-batch count dividing the batch:

- outputs and every gradient equal eager PyTorch's;
- the books are exact: with each GPU's budget at the peak the pipeline measured, the step runs;
  one byte less on any GPU and it raises MobiusError;
- nothing stays on a GPU afterwards and every weight slot is freed (any use would raise).
"""

import pytest
import torch
import torch.fx as fx
from hypothesis import given, note
from hypothesis import strategies as st
from torch import nn

from mobius_fx import MobiusError
from mobius_fx.runtime import build_pipeline

from tests.models import ResidualMLP, SkipNet

_COMPUTE = ("call_function", "call_method", "call_module")


pytestmark = pytest.mark.usefixtures("one_thread")


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["mlp", "residual", "skip"]))
    d_in = draw(st.integers(2, 6))
    if kind == "mlp":
        widths = [d_in] + draw(st.lists(st.integers(1, 12), min_size=2, max_size=6))
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), draw(st.sampled_from([nn.ReLU, nn.Tanh, nn.GELU]))()]
        model = nn.Sequential(*layers)
    elif kind == "residual":
        model = ResidualMLP(d_in=d_in, width=draw(st.integers(2, 8)), depth=draw(st.integers(1, 4)), d_out=3)
    else:
        model = SkipNet(d_in=d_in, width=draw(st.integers(2, 8)), depth=draw(st.integers(1, 4)), d_out=3)
    gm = fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    gpus = draw(st.integers(1, 3))
    stages = draw(st.integers(1, min(6, len(names))))
    gpus = min(gpus, stages)
    cuts = sorted(draw(st.sets(st.integers(1, len(names) - 1), min_size=stages - 1, max_size=stages - 1))) \
        if stages > 1 else []
    bounds = [0, *cuts, len(names)]
    order = draw(st.permutations([f"gpu{i}" for i in range(gpus)]))
    batch = draw(st.sampled_from([2, 4, 6, 8]))
    microbatches = draw(st.sampled_from([m for m in (1, 2, 3, 4) if batch % m == 0]))
    seed = draw(st.integers(0, 2**16))
    return model, gm, [names[a:b] for a, b in zip(bounds, bounds[1:])], \
        [order[k % gpus] for k in range(len(bounds) - 1)], batch, d_in, microbatches, seed


def _build(model, gm, nodes, stage_gpus, microbatches, x, budgets):
    return build_pipeline(model, gm, stage_nodes=nodes, stage_gpus=stage_gpus, gpu_budgets=budgets,
                          microbatches=microbatches, example_inputs=(x,), device="virtual")


def _step(fn, model, x):
    model.zero_grad(set_to_none=True)
    out = fn(x)
    out.pow(2).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@given(cases())
def test_pipeline_equals_eager_within_exact_budgets(case):
    model, gm, nodes, stage_gpus, batch, d_in, microbatches, seed = case
    note(f"stages={[len(n) for n in nodes]} gpus={stage_gpus} batch={batch} microbatches={microbatches}")
    torch.manual_seed(seed)
    x = torch.randn(batch, d_in)
    out_e, grads_e = _step(model, model, x)

    measured = _build(model, gm, nodes, stage_gpus, microbatches, x, {})
    _step(measured, model, x)
    peaks = {g: s["peak_bytes"] for g, s in measured.memory_stats().items()}

    pipe = _build(model, gm, nodes, stage_gpus, microbatches, x, peaks)
    out_p, grads_p = _step(pipe, model, x)
    torch.testing.assert_close(out_p, out_e)
    for name in grads_e:
        torch.testing.assert_close(grads_p[name], grads_e[name], msg=lambda m: f"{name}: {m}")
    stats = pipe.memory_stats()
    assert all(stats[g]["peak_bytes"] <= peaks[g] for g in peaks)
    assert all(s["current_bytes"] == 0 for s in stats.values())
    assert all(slot.untyped_storage().nbytes() == 0 for st_ in pipe._rt.stages for slot in st_.slots)

    tight = max(peaks, key=peaks.get)
    short = _build(model, gm, nodes, stage_gpus, microbatches, x, {**peaks, tight: peaks[tight] - 1})
    with pytest.raises(MobiusError, match=f"{tight} would hold"):
        _step(short, model, x)
    assert all(s["current_bytes"] == 0 for s in short.memory_stats().values())
