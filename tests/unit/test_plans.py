"""Plan types: build_plan follows docs/schedule.md, tables read well, JSON round-trips."""

import json
import math

import pytest

from mobius_fx import MobiusError, Topology
from mobius_fx.planning.costs import LayerCost
from mobius_fx.planning.plans import Plan, build_plan
from mobius_fx.planning.step_memory import MemoryModel, stage_memory
from mobius_fx.planning.step_model import SolverInfo
from mobius_fx.precision import Precision

MiB = 2**20


def _layers(n=6, w=4 * MiB, act=1 * MiB):
    return tuple(LayerCost(name=f"h.{i}", nodes=(f"n{i}",), fwd_flops=1e9, bwd_flops=2e9, fwd_time=0.01,
                           bwd_time=0.03, param_bytes=w, grad_bytes=w, output_bytes=act, peak_bytes=2 * act,
                           params=(f"h.{i}.weight",)) for i in range(n))


def _plan(n_layers=6, cuts=(0, 2, 3, 5), gpus=2, m=2, dtype=None):
    topo = Topology.virtual(gpus=gpus, memory="1GiB", root_complexes=min(2, gpus))
    order = tuple(g.name for g in topo.gpus)
    return build_plan(_layers(n_layers), cuts, order=order, topology=topo, microbatches=m, step_time=0.5,
                      precision=Precision.of(dtype), solver=SolverInfo("cbc", "Optimal", 0.5, 0.0, 1.2, 10, 20, (4,)))


def test_stages_take_their_layers_and_gpus_round_robin():
    plan = _plan()
    assert [s.layers for s in plan.stages] == [("h.0", "h.1"), ("h.2",), ("h.3", "h.4"), ("h.5",)]
    assert [s.gpu for s in plan.stages] == ["gpu0", "gpu1", "gpu0", "gpu1"]
    assert plan.stages[0].param_bytes == 8 * MiB
    assert math.isclose(plan.stages[0].fwd_time, 0.02 / 2)  # per micro-batch


def test_transfers_follow_the_schedule_table():
    plan = _plan()
    kinds = [(t.kind, t.phase, t.stage) for t in plan.transfers]
    # every stage prefetched in forward; only stages before the last N refetched in backward
    assert [k for k in kinds if k[:2] == ("prefetch", "forward")] == [("prefetch", "forward", k) for k in range(4)]
    assert [k for k in kinds if k[:2] == ("prefetch", "backward")] == [("prefetch", "backward", 1),
                                                                       ("prefetch", "backward", 0)]
    # the last stage on each GPU stays resident: evicted only after backward
    assert [k for k in kinds if k[:2] == ("evict", "forward")] == [("evict", "forward", 0), ("evict", "forward", 1)]
    assert sum(t.bytes for t in plan.transfers if t.kind == "gradient") == 6 * 4 * MiB
    hop = next(t for t in plan.transfers if t.kind == "activation" and t.src == "gpu0" and t.dst == "gpu1")
    assert hop.count == 2 and hop.route[0] == "gpu0" and hop.route[-1] == "gpu1"


def test_half_precision_streams_half_the_weight_bytes():
    fp32, bf16 = _plan(), _plan(dtype="bfloat16")
    w32 = sum(t.bytes for t in fp32.transfers if t.kind == "prefetch")
    w16 = sum(t.bytes for t in bf16.transfers if t.kind == "prefetch")
    assert w16 * 2 == w32


def test_stage_memory_counts_weights_working_and_boundaries():
    layers = _layers(3)
    mm = MemoryModel(2)
    fwd, bwd = stage_memory(layers[1:], layers[0], mm)
    assert fwd == 8 * MiB + 1 * MiB + 2 * (0.5 * MiB + 0.5 * MiB)
    # backward: the gradients twice (their sum and a micro-batch's fresh ones) and all the
    # recompute keeps of both layers (2 x 2 MiB for the batch, per micro-batch)
    # (the working memory, in forward its live tensors, is in backward what the layer being
    # differentiated holds above its saved bytes: once in each)
    assert bwd == fwd + 2 * 8 * MiB + 2 * MiB
    fwd1, bwd1 = stage_memory(layers[1:], layers[0], MemoryModel(1))
    assert bwd1 == fwd1 + 8 * MiB + 4 * MiB  # one micro-batch: no fresh gradients to add in


def test_lower_bound_is_compute_or_busiest_link():
    plan = _plan()
    compute = sum(2 * (s.fwd_time + s.bwd_time) for s in plan.stages) / 2
    link = max(b / plan.topology.link_bandwidth(u, v) for (u, v), b in plan.link_bytes().items())
    assert plan.lower_bound() == pytest.approx(max(compute, link))


def test_str_shows_summary_stage_and_transfer_tables():
    text = str(_plan())
    assert "4 stages on 2 GPUs" in text and "predicted step 500.0 ms" in text
    assert "h.0 .. h.1" in text and "MiB" in text and "prefetch" in text and "gpu0 > " in text


def test_json_round_trip_is_exact():
    plan = _plan(dtype="float16")
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.topology == plan.topology
    assert json.loads(plan.to_json())["stages"][0]["gpu"] == "gpu0"


def test_bad_plan_json_says_what_it_expected():
    with pytest.raises(MobiusError, match="not a mobius_fx plan JSON"):
        Plan.from_json('{"stages": []}')


def test_boundaries_must_start_at_zero_and_increase():
    topo = Topology.virtual(gpus=2)
    with pytest.raises(MobiusError, match=r"\(1, 3\)"):
        build_plan(_layers(), (1, 3), order=("gpu0", "gpu1"), topology=topo, microbatches=1, step_time=0.0)


def test_the_transfer_summary_sums_every_transfer_by_kind_phase_and_link():
    plan = _plan()
    text = plan.transfer_summary()
    rows = {}
    for line in text.splitlines()[2:]:
        cells = [c for c in line.split("  ") if c.strip()]
        rows[tuple(c.strip() for c in cells[:3]) if cells[0] != "total" else ("total",)] = int(cells[-3].strip() if cells[0] != "total" else cells[1].strip())
    assert rows[("total",)] == sum(t.count for t in plan.transfers)
    grads = sum(t.count for t in plan.transfers if t.kind == "gradient")
    assert rows[("gradient", "backward", "GPU -> host")] == grads
    assert str(plan) == plan.describe("full") and plan.transfer_table() in str(plan)  # print(plan): both full tables
    brief = plan.describe("summary")
    assert plan.stage_table() in brief and text in brief and plan.transfer_table() not in brief
    with pytest.raises(MobiusError, match="transfers='all'"):
        plan.describe("all")
