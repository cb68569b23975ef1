"""The declared pass pipeline checks reads against earlier writes before running anything."""

import pytest

from mobius_fx import MobiusError
from mobius_fx.compiler import CompileContext, FunctionPass, PassPipeline, default_pipeline, PASS_ORDER


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
