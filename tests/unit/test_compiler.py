"""The declared pass pipeline checks reads against earlier writes before running anything, and
each pass against what it really touches while it runs."""

import pytest
import torch
from torch import nn

from mobius_fx import MobiusError, Topology
from mobius_fx.compiler import FunctionPass, PassPipeline, Touched, default_pipeline, PASS_ORDER
from mobius_fx.options import CompileContext, CompileOptions
from mobius_fx.zoo import GPT, GPTConfig


def _noop(gm, ctx):
    return None


def test_default_pipeline_declares_a_consistent_order():
    pipe = default_pipeline()
    assert pipe.names == list(PASS_ORDER)
    pipe.check()


def test_a_read_nobody_wrote_is_reported_with_the_pass_and_fact():
    pipe = PassPipeline([FunctionPass("cut", _noop, reads=("layers",), writes=("partition",))])
    with pytest.raises(MobiusError, match=r"'cut' reads \['layers'\]"):
        pipe.check()


def test_a_pass_moved_before_its_writer_names_the_writer():
    pipe = default_pipeline()
    annotate = pipe.passes[pipe.names.index("annotate")]
    pipe.remove("annotate").insert_after("partition", annotate)
    with pytest.raises(MobiusError, match=r"'partition' reads \['layers'\].*written by \['annotate'\]"):
        pipe.check()


def test_check_runs_before_any_pass():
    ran = []
    pipe = PassPipeline([
        FunctionPass("first", lambda gm, ctx: ran.append("first"), writes=("a",)),
        FunctionPass("second", _noop, reads=("b",)),
    ])
    with pytest.raises(MobiusError):
        pipe.run(CompileContext(model=None, topology=None))
    assert ran == []


def test_replace_by_name_runs_the_users_pass():
    seen = []
    pipe = PassPipeline([
        FunctionPass("make", lambda gm, ctx: seen.append("make"), writes=("x",)),
        FunctionPass("use", lambda gm, ctx: seen.append("use"), reads=("x",)),
    ])
    pipe.replace("use", FunctionPass("use", lambda gm, ctx: seen.append("mine"), reads=("x",)))
    ctx = pipe.run(CompileContext(model=None, topology=None))
    assert seen == ["make", "mine"]
    assert {"x"} <= ctx.facts and set(ctx.timings) == {"make", "use"}


def test_unknown_pass_name_lists_the_known_ones():
    with pytest.raises(MobiusError, match="passes are"):
        default_pipeline().replace("partitioner", FunctionPass("p", _noop))


def test_duplicate_pass_names_are_rejected():
    pipe = PassPipeline([FunctionPass("a", _noop), FunctionPass("a", _noop)])
    with pytest.raises(MobiusError, match="appears twice"):
        pipe.check()


# ------------------------------------------------------------- declarations against what runs
def _graph_module():
    return torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def _run_one(fn, *, reads=(), writes=(), gm=None):
    """Run one FunctionPass on a bare context whose given facts include 'graph' and 'layers'."""
    given = ("model", "topology", "example_inputs", "settings", "graph", "layers")
    pipe = PassPipeline([FunctionPass("p", fn, reads=reads, writes=writes)], given=given)
    return pipe.run(CompileContext(model=None, topology=None, gm=gm, layers=("l0",)))


def test_a_pass_that_reads_an_undeclared_fact_is_named_with_the_fact_and_the_fix():
    def peek(gm, ctx):
        _ = ctx.topology, ctx.layers

    with pytest.raises(MobiusError, match=r"pass 'p' reads 'layers' \(ctx\.layers\) but declares "
                                          r"reads=\('topology',\).*add \['layers'\] to the pass's reads"):
        _run_one(peek, reads=("topology",))


def test_a_pass_that_writes_an_undeclared_fact_is_named_with_the_fact_and_the_fix():
    def cut(gm, ctx):
        ctx.partition = "cuts"

    with pytest.raises(MobiusError, match=r"pass 'p' writes 'partition' \(ctx\.partition = \.\.\.\) but declares "
                                          r"writes=\(\).*add \['partition'\] to the pass's writes"):
        _run_one(cut, reads=("layers",))


def test_example_kwargs_are_the_fact_example_inputs():
    with pytest.raises(MobiusError, match=r"reads 'example_inputs' \(ctx\.example_kwargs\)"):
        _run_one(lambda gm, ctx: print(ctx.example_kwargs))


def test_a_pass_that_uses_the_graph_module_without_declaring_graph_is_refused():
    with pytest.raises(MobiusError, match=r"pass 'p' uses the graph module.*add 'graph' to the pass's reads"):
        _run_one(lambda gm, ctx: gm.graph, gm=_graph_module())


def test_a_pass_that_returns_a_new_graph_module_writes_graph():
    with pytest.raises(MobiusError, match=r"writes 'graph' \(a returned graph module\)"):
        _run_one(lambda gm, ctx: _graph_module())


def test_a_pass_that_sets_node_meta_mobius_writes_that_fact():
    def annotate(gm, ctx):
        for node in gm.graph.nodes:
            node.meta["mobius"] = "cost"

    with pytest.raises(MobiusError, match=r"writes 'node\.meta\.mobius'"):
        _run_one(annotate, reads=("graph",), gm=_graph_module())
    ctx = _run_one(annotate, reads=("graph",), writes=("node.meta.mobius",), gm=_graph_module())
    assert ctx.touched["p"].writes == {"node.meta.mobius"}


def test_reading_back_a_fact_the_pass_wrote_is_not_an_input():
    def order(gm, ctx):
        ctx.order = (1, 0)
        assert isinstance(ctx, CompileContext) and ctx.order == (1, 0)

    ctx = _run_one(order, writes=("order",))
    assert ctx.touched["p"].reads == frozenset() and ctx.order == (1, 0)


def test_the_standard_passes_declare_exactly_what_they_touch(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq=16, hidden=32, blocks=4, heads=2))
    topo = Topology.virtual(gpus=2, memory=4 * sum(p.numel() * 4 for p in model.parameters()))
    ctx = CompileContext(model=model, topology=topo, example_inputs=(torch.randint(0, 64, (4, 16)),),
                         settings=CompileOptions(microbatches=2, cache_dir=str(tmp_path), verbose=False))
    pipe = default_pipeline()
    pipe.run(ctx)
    assert ctx.pipeline is not None
    for p in pipe.passes:
        assert ctx.touched[p.name] == Touched(reads=frozenset(p.reads), writes=frozenset(p.writes)), p.name
