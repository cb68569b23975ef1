"""An op of the schedule IR prints as one line that parses back to the same op (hypothesis)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mobius_fx.errors import MobiusError
from mobius_fx.planning.schedule_ir import OP_KINDS, PHASES, Op, OpKind, StageInput, StageIO, build_schedule
from mobius_fx.kinds import HOST
from mobius_fx.planning.costs import LayerCost
from mobius_fx.planning.plans import build_plan
from mobius_fx.schedules import gpipe, roundpipe, split_head, zero3_offload
from mobius_fx.sim.tasks import Context
from mobius_fx.topology.server import Topology

places = st.sampled_from([HOST, "gpu0", "gpu1", "gpu13", "cuda:2"])
small = st.integers(0, 10**12)
maybe = st.one_of(st.none(), st.integers(0, 64))


# A copy's bytes: an int (the plan's), or a float (a baseline's share of a stage's bytes,
# `looped_ir`), printed as Python writes it ("1234.5", "1.5e+20") and read back exactly.
sizes = st.one_of(small, st.floats(0, 1e21, allow_nan=False, allow_infinity=False))
indices = st.lists(st.integers(0, 10**6), max_size=5).map(tuple)


@st.composite
def ops(draw):
    copy = draw(st.booleans())
    src, dst = (draw(places), draw(places)) if copy else ("", "")
    return Op(draw(st.integers(0, 10**6)), draw(st.sampled_from(OP_KINDS)), draw(places), draw(st.integers(0, 500)),
              draw(st.sampled_from(list(PHASES))), draw(maybe), src, dst,
              draw(st.sampled_from(["weight", "activation", "gradient", "input"])) if copy else "",
              draw(sizes) if copy else 0, draw(indices), draw(maybe), draw(maybe), draw(maybe), draw(indices))


@given(ops())
def test_an_op_parses_back_from_its_printed_form(op):
    text = str(op)
    assert "\n" not in text
    back = Op.parse(text)
    assert back == op and back.kind is op.kind and isinstance(back.kind, OpKind)


@given(st.sampled_from([gpipe, zero3_offload, roundpipe, split_head]), st.integers(1, 5), st.integers(1, 3),
       st.integers(1, 3), st.booleans())
def test_every_op_of_a_baselines_ir_round_trips(module, layers, gpus, m, p2p):
    """The baselines' IR (slots, turns, needs, float bytes, collectives, GPU steps) prints and parses back."""
    topo = Topology.virtual(gpus=gpus, memory="80GiB", bandwidth=10e9, p2p=p2p)
    ls = [LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, 0.01, 0.03, 3_000_001 + i, 3_000_001 + i, 70_001, 70_001)
          for i in range(layers)]
    plan = build_plan(ls, list(range(layers)), order=[g.name for g in topo.gpus], topology=topo, microbatches=m,
                      step_time=0.0, input_bytes=1000, memory_fraction=0.99)
    ir, _ = module.schedule_ir(Context(plan, topo, "adam", 1e11, use_plan_routes=True))
    assert ir.ops and [Op.parse(str(o)) for o in ir.ops] == list(ir.ops)


@given(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.integers(1, 4), st.booleans())
def test_every_op_of_a_built_schedule_round_trips(gpus_of, m, frozen_first):
    stages = [StageIO(f"gpu{k % g}", 1000 + k, 0 if (k == 0 and frozen_first) else 500 + k,
                      (StageInput(k - 1, 64 + k),), host_outputs=(12,) if k == len(gpus_of) - 1 else ())
              for k, g in enumerate(gpus_of)]
    ir = build_schedule(stages, m)
    assert [Op.parse(str(o)) for o in ir.ops] == list(ir.ops)
    assert {o.kind for o in ir.ops} <= set(OpKind)


def test_kinds_are_an_enum_equal_to_their_names():
    assert OpKind.RUN == "run" and OP_KINDS == tuple(OpKind) and len(set(OP_KINDS)) == 11
    assert Op(0, "evict", "gpu0", 1, "forward").kind is OpKind.EVICT


@pytest.mark.parametrize("text", ["", "7: jump F3.1 @gpu0", "7: run X3.1 @gpu0", "run F3.1 @gpu0",
                                  "7: run F3.1 @gpu0 <- ", "7: run F3.1 gpu0"])
def test_what_is_not_an_op_is_refused_with_the_form(text):
    with pytest.raises(MobiusError, match="INDEX: KIND PHASE-LETTER|is not one of"):
        Op.parse(text)
