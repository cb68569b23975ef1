"""Cross mapping: the paper's cost, our link-contention cost, and the orders they choose."""

from __future__ import annotations

import time

import pytest

from mobius_fx import MobiusError
from mobius_fx.passes.cross_map import (
    best_order_contention, best_order_paper, contention_cost, cross_map, paper_cost,
)
from mobius_fx.topology.server import Topology

TESTBED_ALTERNATING = ("gpu0", "gpu4", "gpu1", "gpu5", "gpu2", "gpu6", "gpu3", "gpu7")


def root_complexes(topo: Topology) -> dict[str, str]:
    return {g.name: g.root_complex for g in topo.gpus}


def neighbours_share_a_root_complex(order, topo: Topology) -> list[tuple[str, str]]:
    """Neighbouring slots (with the wrap from the last slot to the first) on one root complex."""
    rc = root_complexes(topo)
    pairs = zip(order, order[1:] + order[:1])
    return [(a, b) for a, b in pairs if rc[a] == rc[b]]


# ---------------------------------------------------------------------------- paper cost
def test_paper_cost_counts_the_gpus_of_a_shared_root_complex():
    assert paper_cost(["gpu0", "gpu1"], {"gpu0": "cpu0", "gpu1": "cpu0"}) == 2.0


def test_paper_cost_is_zero_across_root_complexes():
    assert paper_cost(["gpu0", "gpu1"], {"gpu0": "cpu0", "gpu1": "cpu1"}) == 0.0


def test_paper_cost_divides_by_the_slot_distance():
    rc = {"a0": "A", "a1": "A", "b0": "B", "b1": "B"}
    # only (a0, a1) and (b0, b1) share, both 2 slots apart: 2/2 + 2/2
    assert paper_cost(["a0", "b0", "a1", "b1"], rc) == 2.0
    assert paper_cost(["a0", "a1", "b0", "b1"], rc) == 4.0 + 0.0


def test_paper_cost_needs_every_gpus_root_complex():
    with pytest.raises(MobiusError, match="no root complex given for GPU"):
        paper_cost(["gpu0", "gpu1"], {"gpu0": "cpu0"})


def test_best_paper_order_on_the_testbed_alternates_like_the_prototype():
    topo = Topology.preset("mobius-testbed")
    assert best_order_paper([g.name for g in topo.gpus], root_complexes(topo)) == TESTBED_ALTERNATING


def test_exact_paper_search_over_8_gpus_is_fast():
    topo = Topology.preset("mobius-testbed")
    t0 = time.perf_counter()
    best_order_paper([g.name for g in topo.gpus], root_complexes(topo))
    assert time.perf_counter() - t0 < 2.0


# ------------------------------------------------------------------------ contention cost
def test_contention_counts_a_shared_switch_uplink_by_its_bandwidth():
    topo = Topology.preset("mobius-testbed")
    # stages 0 and 1 upload through cpu0 -> sw0 (13 GB/s): 1 shared link, distance 1
    assert contention_cost(["gpu0", "gpu1"], topo, num_stages=2) == pytest.approx(1e9 / 13e9)
    assert contention_cost(["gpu0", "gpu4"], topo, num_stages=2) == 0.0


def test_contention_weights_by_the_smaller_transfer():
    topo = Topology.preset("mobius-testbed")
    cost = contention_cost(["gpu0", "gpu1"], topo, stage_bytes=[3.0, 5.0])
    assert cost == pytest.approx(3.0 * 1e9 / 13e9)


def test_contention_is_zero_when_no_two_routes_share_a_link():
    topo = Topology.preset("rtx4090x8")  # every GPU on its own x16 link to its socket
    order = [g.name for g in topo.gpus]
    assert contention_cost(order, topo) == 0.0
    assert cross_map(topo) == tuple(order)  # nothing to gain: keep the identity


def test_activation_hops_add_their_shared_links():
    topo = Topology.preset("mobius-testbed")
    order = ["gpu0", "gpu1", "gpu2"]
    plain = contention_cost(order, topo, num_stages=3)
    with_hops = contention_cost(order, topo, num_stages=3, act_bytes=[1.0, 1.0, 1.0])
    assert with_hops > plain


# ------------------------------------------------------------------------------ cross_map
@pytest.mark.parametrize("method", ["contention", "paper"])
@pytest.mark.parametrize("topo", [Topology.preset("mobius-testbed"), Topology.virtual(gpus=8, root_complexes=2)],
                         ids=["mobius-testbed", "virtual-8x2"])
def test_every_neighbouring_stage_pair_is_on_different_root_complexes(topo, method):
    order = cross_map(topo, method=method)
    assert sorted(order) == sorted(g.name for g in topo.gpus)
    assert neighbours_share_a_root_complex(order, topo) == []


def test_contention_mapping_keeps_alternating_with_realistic_plan_bytes():
    # 16 stages of ~2 GPT-8B blocks (452 MB) and their 8 micro-batches of activations (50 MB)
    topo = Topology.preset("mobius-testbed")
    order = cross_map(topo, num_stages=16, stage_bytes=[452e6] * 16, act_bytes=[50e6] * 16)
    assert neighbours_share_a_root_complex(order, topo) == []


def test_more_than_8_gpus_are_searched_locally_and_still_alternate():
    topo = Topology.virtual(gpus=12, root_complexes=3)
    for method in ("contention", "paper"):
        order = cross_map(topo, method=method)
        assert sorted(order) == sorted(g.name for g in topo.gpus)
        assert neighbours_share_a_root_complex(order, topo) == []


def test_identity_keeps_the_topology_order():
    topo = Topology.virtual(gpus=4, root_complexes=2)
    assert cross_map(topo, method="identity") == ("gpu0", "gpu1", "gpu2", "gpu3")


def test_a_subset_of_gpus_can_be_mapped():
    topo = Topology.preset("mobius-testbed")
    order = cross_map(topo, gpus=["gpu0", "gpu1", "gpu4", "gpu5"])
    assert sorted(order) == ["gpu0", "gpu1", "gpu4", "gpu5"]
    assert neighbours_share_a_root_complex(order, topo) == []


def test_unknown_method_and_gpu_are_rejected():
    topo = Topology.virtual(gpus=2)
    with pytest.raises(MobiusError, match="'contention', 'paper' or 'identity'"):
        cross_map(topo, method="random")
    with pytest.raises(MobiusError, match="distinct GPUs of the topology"):
        cross_map(topo, gpus=["gpu0", "gpu7"])


def test_best_order_contention_matches_cross_map():
    topo = Topology.virtual(gpus=4, root_complexes=2)
    assert best_order_contention(topo) == cross_map(topo)
