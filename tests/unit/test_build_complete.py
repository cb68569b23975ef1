"""`build_pipeline` returns the Pipeline complete (issue 37 part 5): what `compile` wires in (the
variants' recompiler, `max_variants`, the training step, the cuts a variant reuses) is given to the
build (`build.Wiring`), not set on the Pipeline afterwards. tests/unit/test_architecture.py checks
that no module outside the runtime and build.py reaches into a Pipeline's internals."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.api import _run
from mobius_fx.build import Wiring, _plan_cuts
from mobius_fx.compiler import default_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")

TOPO = Topology.virtual(gpus=2, memory="64MiB")


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8, 8), nn.Tanh())], nn.Linear(8, 3))


def test_a_compiled_pipeline_comes_out_of_the_build_with_its_step_and_variants():
    model, x, y = _mlp(), torch.randn(4, 8), torch.randint(0, 3, (4,))
    pipe = mobius_fx.compile(model, TOPO, example_inputs=(x,), device="virtual", max_variants=3,
                             loss_fn=F.cross_entropy, example_target=y)
    assert pipe.max_variants == 3
    assert pipe.step_pipeline is not None  # compiled for example_target as the pipeline was built
    (v,) = pipe.variants
    assert v.layers == tuple(layer.name for layer in pipe.plan.layers) and v.boundaries[0] == 0
    loss = pipe.train_step(x, target=y)
    torch.testing.assert_close(loss, F.cross_entropy(model(x), y).detach(), rtol=1e-5, atol=1e-6)


def test_the_cuts_a_variant_reuses_are_the_partitions():
    model, x = _mlp(1), torch.randn(4, 8)
    ctx = _run(default_pipeline().until("plan"), model=model, topology=TOPO, example_inputs=(x,), example_kwargs=None)
    layers, boundaries = _plan_cuts(ctx.plan)
    assert layers == tuple(layer.name for layer in ctx.layers)
    assert boundaries == tuple(ctx.partition.boundaries)
    assert _plan_cuts(None) == ((), ())


def test_a_pipeline_built_without_a_compile_has_no_step():
    from mobius_fx.build import build_pipeline

    model, x = _mlp(2), torch.randn(4, 8)
    gm = torch.fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op == "call_module"]
    pipe = build_pipeline(model, gm, stage_nodes=[names[:5], names[5:]], stage_gpus=["gpu0", "gpu1"], gpu_budgets={},
                          microbatches=2, example_inputs=(x,), device="virtual", wiring=Wiring())
    assert pipe.max_variants == 1 and pipe.step_pipeline is None
    with pytest.raises(MobiusError, match="built by build_pipeline"):
        pipe.train_step(x)
    torch.testing.assert_close(pipe(x), model(x), rtol=1e-5, atol=1e-6)


def test_example_target_without_loss_fn_is_refused_before_compiling():
    with pytest.raises(MobiusError, match="example_target was given without loss_fn"):
        mobius_fx.compile(_mlp(), TOPO, example_inputs=(torch.randn(4, 8),), device="virtual",
                          example_target=torch.zeros(4, dtype=torch.long))
