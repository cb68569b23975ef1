"""The plan's numbers hold together (issue 26, part 5): no plan predicts a step below its own
lower bound. `Plan.lower_bound` counts every byte the plan moves on each link over that link's
bandwidth; the step model (`step_model.timeline`, the MIP) must count them too
(`step_model.LinkLoad`), or a link that activations relayed through the host share with the
weights (a switch uplink, P2P off) lets the prediction fall below the bound."""

from __future__ import annotations

import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from mobius_fx import PlanError
from mobius_fx.planning.costs import LayerCost
from mobius_fx.planning.step_model import PartitionProblem, evaluate
from mobius_fx.passes.partition_solve import solve
from mobius_fx.planning.plans import build_plan
from mobius_fx.topology.server import Topology
from mobius_fx.precision import Precision

GB = 1e9


@st.composite
def cases(draw):
    """A topology of 1-5 virtual GPUs (1-2 root complexes, a switch uplink half to twice
    a GPU link's speed, P2P on or off, 8-256 MiB each), 1-12 layers of random costs (the first
    few frozen, sometimes), 1-4 micro-batches, fp32 or fp16 on the GPUs, a model input."""
    n = draw(st.integers(1, 5))
    bw = draw(st.floats(2 * GB, 32 * GB))
    uplink = draw(st.sampled_from([None, 0.5, 1.0, 1.0, 2.0]))
    topo = Topology.virtual(gpus=n, root_complexes=draw(st.integers(1, min(2, n))), bandwidth=bw,
                            uplink=None if uplink is None else uplink * bw, p2p=draw(st.booleans()),
                            memory=draw(st.integers(8, 256)) * 2**20)
    nl = draw(st.integers(1, 12))
    frozen = draw(st.integers(0, nl))
    # compute and copies of the same order (a link can be the bottleneck)
    costs = st.tuples(st.floats(1e-6, 1e-3), st.floats(1e-6, 2e-3), st.integers(1, 32_000_000),
                      st.integers(0, 32_000_000), st.integers(0, 8_000_000))
    layers = tuple(LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, f, b, w, 0 if i < frozen else w, out, peak)
                   for i, (f, b, w, out, peak) in enumerate(draw(st.lists(costs, min_size=nl, max_size=nl))))
    order = tuple(draw(st.permutations([g.name for g in topo.gpus])))
    return dict(layers=layers, topology=topo, order=order, microbatches=draw(st.integers(1, 4)),
                dtype=draw(st.sampled_from([None, "float16"])), input_bytes=draw(st.integers(0, 2_000_000)))


def _problem(c) -> PartitionProblem:
    return PartitionProblem.from_topology(c["layers"], c["topology"], microbatches=c["microbatches"],
                                          order=c["order"], precision=Precision.of(c["dtype"]), input_bytes=c["input_bytes"])


def _plan(c, cuts, step_time):
    return build_plan(c["layers"], cuts, order=c["order"], topology=c["topology"], microbatches=c["microbatches"],
                      step_time=step_time, precision=Precision.of(c["dtype"]), input_bytes=c["input_bytes"])


def _assert_bound_holds(plan) -> None:
    lb = plan.lower_bound()
    assert lb <= plan.step_time * (1 + 1e-9), (
        f"predicted {plan.step_time} s below the lower bound {lb} s: {plan.summary()}\n{plan.link_bytes()}")


@settings(max_examples=200)  # evaluate only: fast; a link tips the balance in a few % of them
@given(cases(), st.data())
def test_every_fitting_cut_set_predicts_at_least_its_plans_lower_bound(c, data):
    nl = len(c["layers"])
    # many stages: the links carry the more activations
    cuts = (0, *(i for i in range(1, nl) if data.draw(st.integers(0, 7), label=f"cut {i}")))
    ev = evaluate(_problem(c), cuts)
    if ev is not None:
        _assert_bound_holds(_plan(c, cuts, ev.makespan))


@settings(max_examples=25)
@given(cases())
def test_the_partitioners_plan_predicts_at_least_its_lower_bound(c):
    try:
        with tempfile.TemporaryDirectory() as d:
            part = solve(_problem(c), time_limit=10.0, cache_dir=d)
    except PlanError:
        return  # nothing fits
    _assert_bound_holds(_plan(c, part.boundaries, part.makespan))


def test_the_h200_case_of_issue_26_two_gpus_behind_one_uplink_without_p2p():
    """gpu_check's 2 pipeline GPUs on one H200: one switch whose uplink is the device's link,
    P2P off, so each activation hop goes up the uplink and down again, beside the weights."""
    from mobius_fx.topology.server import Topology as T

    link = {"kind": "pcie", "bandwidth_gbps": [35.4, 51.6], "duplex": 0.92}
    topo = T.from_dict({"name": "gpu-check", "p2p": False, "nodes": [
        {"name": "cpu0", "kind": "root_complex"}, {"name": "sw0", "kind": "switch"},
        *({"name": f"gpu{i}", "kind": "gpu", "index": i, "memory": 3 * 2**30, "spec": "h200"} for i in range(2))],
        "links": [{"a": "cpu0", "b": "sw0", **link}, *({"a": "sw0", "b": f"gpu{i}", **link} for i in range(2))]})
    # 33 stages of a 3B GPT in the proportions of issue 26: 330 MB of weights and 21 MB of
    # activations per block, so that the activations the uplink carries tip its volume.
    layers = tuple(LayerCost(f"b{i}", (f"n{i}",), 1.0, 1.0, 1.5e-3, 3e-3, 330_000_000, 330_000_000,
                             21_000_000, 40_000_000) for i in range(33))
    c = dict(layers=layers, topology=topo, order=("gpu0", "gpu1"), microbatches=2, dtype="bfloat16",
             input_bytes=32768)
    cuts = tuple(range(33))
    ev = evaluate(_problem(c), cuts)
    assert ev is not None
    _assert_bound_holds(_plan(c, cuts, ev.makespan))
