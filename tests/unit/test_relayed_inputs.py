"""A stage fed from another GPU gets its inputs over its own link from the host (relayed through
the host, or through the switch), the link its weights upload on: the step model charges both
there (`PartitionProblem.inlink`, step_timeline's forward, the MIP's `inlink_f` rows), as the
simulator's flows share it. Without it the step model's forward ran ahead of the simulator's on
switched servers (benchmarks/plan_quality.py "two switches": pipeline predicted 0.934 of the
simulated, the step 0.932 under async)."""

from __future__ import annotations

import math

import pytest

from mobius_fx.planning.costs import LayerCost
from mobius_fx.planning.step_model import MemoryModel, PartitionProblem, evaluate
from mobius_fx import Topology
from tests.unit.test_landings import one_switch

W, OUT = int(60e6), int(8e6)  # bytes of one layer's weights (fp32) and of its output (the batch's)


def _problem(topo: Topology, m: int = 4) -> PartitionProblem:
    layers = [LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, 1e-4, 3e-4, W, W, OUT, 2 * OUT) for i in range(4)]
    return PartitionProblem.from_topology(layers, topo, microbatches=m)


def test_a_stage_waits_for_its_weights_and_relayed_inputs_on_its_own_link():
    problem = _problem(one_switch(2))
    assert problem.inlink == (6.5e9, 6.5e9) and all(h < math.inf for h in problem.hop)
    ev = evaluate(problem, (0, 1, 2, 3))
    m = problem.microbatches
    for i in range(m):  # stage 1 (gpu1): its weights, then micro-batches 0..i's inputs, on 6.5 GB/s
        assert ev.fwd_start[1][i] >= (W + (i + 1) * OUT / m) / 6.5e9 - 1e-12
    # the same problem without the shared link charges the weights alone: its micro-batch 3 starts sooner
    alone = evaluate(PartitionProblem(**{**problem.__dict__, "inlink": None}), (0, 1, 2, 3))
    assert alone.fwd_start[1][3] < ev.fwd_start[1][3]


def test_a_direct_link_between_gpus_is_not_the_host_link():
    # two GPUs joined by their own link (NVLink-like): the activations do not cross the host's
    nodes = [{"name": "cpu0", "kind": "root_complex"}]
    nodes += [{"name": f"gpu{i}", "kind": "gpu", "memory": "24GiB", "spec": "rtx3090"} for i in range(2)]
    links = [{"a": "cpu0", "b": f"gpu{i}", "bandwidth_gbps": 6.5} for i in range(2)]
    links.append({"a": "gpu0", "b": "gpu1", "bandwidth_gbps": 50.0})
    topo = Topology.from_dict({"name": "direct", "p2p": True, "nodes": nodes, "links": links})
    assert _problem(topo).inlink == (math.inf, math.inf)


def test_inputs_relayed_while_the_weights_upload_delay_them():
    # stage 0 holds a tenth of the weights: its four outputs are relayed to gpu1 while stage 1's
    # weights still upload there. The simulator shares the link between the flows, so the weights
    # are all there only after the four inputs' bytes too: every run of stage 1 waits for that
    # (charging only the first input, micro-batch 0 started 0.92 ms early: 9.54 ms, not 10.46).
    ws = [W // 10, W, W, W]
    layers = [LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, 1e-4, 3e-4, ws[i], ws[i], OUT, 2 * OUT) for i in range(4)]
    problem = PartitionProblem.from_topology(layers, one_switch(2), microbatches=4)
    ev = evaluate(problem, (0, 1, 2, 3))
    assert max(t + 1e-4 for t in ev.fwd_start[0]) < W / 6.5e9  # the inputs all leave during the upload
    assert ev.fwd_start[1][0] == pytest.approx((W + OUT) / 6.5e9, rel=1e-9)  # the weights and all 4 quarters
    assert ev.upload_done[1] == pytest.approx(ev.fwd_start[1][0], rel=1e-9)
