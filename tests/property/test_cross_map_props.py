"""Properties of cross mapping over random root-complex layouts and random topologies: the
result is a permutation, never worse than the identity, optimal (brute force) up to the
exact-search size, and above it at least as good as a typical random order."""

from __future__ import annotations

import itertools
import random
import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from mobius_fx.passes.cross_map import (
    best_order_contention, best_order_paper, contention_cost, paper_cost,
)
from mobius_fx.topology.server import Topology


def layouts(min_gpus: int, max_gpus: int):
    """GPU names with a root complex each (1-4 root complexes, any sizes)."""
    return st.integers(min_gpus, max_gpus).flatmap(
        lambda n: st.lists(st.sampled_from(["cpu0", "cpu1", "cpu2", "cpu3"]), min_size=n, max_size=n)
    ).map(lambda rcs: ([f"gpu{i}" for i in range(len(rcs))], {f"gpu{i}": r for i, r in enumerate(rcs)}))


@st.composite
def topologies(draw, min_gpus: int, max_gpus: int) -> Topology:
    n = draw(st.integers(min_gpus, max_gpus))
    return Topology.virtual(gpus=n, root_complexes=draw(st.integers(1, n)),
                            bandwidth=draw(st.sampled_from([6.5e9, 13e9, 25e9])),
                            uplink=draw(st.sampled_from([None, 6.5e9, 13e9, 40e9])),
                            p2p=draw(st.booleans()))


def _random_costs(cost, names, k: int = 30, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    out = []
    for _ in range(k):
        order = list(names)
        rng.shuffle(order)
        out.append(cost(order))
    return out


# ------------------------------------------------------------------------------ paper
@given(layouts(1, 6))
def test_paper_order_is_an_optimal_permutation(layout):
    names, rc = layout
    order = best_order_paper(names, rc)
    assert sorted(order) == sorted(names)
    brute = min(paper_cost(p, rc) for p in itertools.permutations(names))
    assert abs(paper_cost(order, rc) - brute) <= 1e-9 * max(1.0, brute)


@given(layouts(1, 8))
def test_paper_order_is_never_worse_than_identity(layout):
    names, rc = layout
    assert paper_cost(best_order_paper(names, rc), rc) <= paper_cost(names, rc) + 1e-9


@settings(max_examples=10)
@given(layouts(9, 12))
def test_paper_search_above_8_gpus_beats_identity_and_the_median_random_order(layout):
    names, rc = layout
    got = paper_cost(best_order_paper(names, rc), rc)
    assert got <= paper_cost(names, rc) + 1e-9
    assert got <= statistics.median(_random_costs(lambda o: paper_cost(o, rc), names)) + 1e-9


# -------------------------------------------------------------------------- contention
@settings(max_examples=15)
@given(topologies(1, 5), st.integers(1, 12), st.randoms(use_true_random=False))
def test_contention_order_is_an_optimal_permutation(topo, stages, rnd):
    names = [g.name for g in topo.gpus]
    bytes_ = [rnd.uniform(0.1, 10) for _ in range(stages)]
    acts = [rnd.uniform(0.0, 2) for _ in range(stages)]
    cost = lambda o: contention_cost(o, topo, stage_bytes=bytes_, act_bytes=acts)
    order = best_order_contention(topo, stage_bytes=bytes_, act_bytes=acts)
    assert sorted(order) == sorted(names)
    brute = min(cost(p) for p in itertools.permutations(names))
    assert abs(cost(order) - brute) <= 1e-9 * max(1.0, brute)
    assert cost(order) <= cost(names) + 1e-9


@settings(max_examples=6)
@given(topologies(9, 10))
def test_contention_search_above_8_gpus_beats_identity_and_the_median_random_order(topo):
    names = [g.name for g in topo.gpus]
    cost = lambda o: contention_cost(o, topo)
    got = cost(best_order_contention(topo))
    assert got <= cost(names) + 1e-9
    assert got <= statistics.median(_random_costs(cost, names)) + 1e-9
