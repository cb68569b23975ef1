"""Properties of Topology over random valid servers: JSON round trip, routes, bottlenecks."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from mobius_fx.topology.server import Topology

GBPS = st.one_of(st.floats(0.001, 900, allow_nan=False), st.integers(1, 400))
BANDWIDTH = st.one_of(GBPS, st.lists(GBPS, min_size=2, max_size=2))


@st.composite
def servers(draw) -> dict:
    """A random valid topology dict: 1-3 sockets joined by UPI, a random switch forest,
    1-6 GPUs hanging anywhere in it, random NVLinks, shuffled CUDA indices."""
    n_rc = draw(st.integers(1, 3))
    nodes = [{"name": f"cpu{r}", "kind": "root_complex"} for r in range(n_rc)]
    links = [{"a": f"cpu{draw(st.integers(0, r - 1))}", "b": f"cpu{r}", "bandwidth_gbps": draw(BANDWIDTH)}
             for r in range(1, n_rc)]
    if n_rc == 3 and not any(ln["a"] == "cpu0" and ln["b"] == "cpu2" for ln in links) and draw(st.booleans()):
        links.append({"a": "cpu0", "b": "cpu2", "kind": "upi", "bandwidth_gbps": draw(BANDWIDTH)})
    parents = [f"cpu{r}" for r in range(n_rc)]
    for s in range(draw(st.integers(0, 4))):
        nodes.append({"name": f"sw{s}", "kind": "switch"})
        links.append({"a": draw(st.sampled_from(parents)), "b": f"sw{s}", "bandwidth_gbps": draw(BANDWIDTH)})
        parents.append(f"sw{s}")
    n_gpu = draw(st.integers(1, 6))
    index = draw(st.permutations(range(n_gpu)))
    for g in range(n_gpu):
        nodes.append({"name": f"gpu{g}", "kind": "gpu", "index": index[g],
                      "memory": draw(st.integers(1, 2**36)), "spec": draw(st.sampled_from(["rtx3090", "cpu", "h200"]))})
        links.append({"a": draw(st.sampled_from(parents)), "b": f"gpu{g}", "bandwidth_gbps": draw(BANDWIDTH)})
    pairs = [(i, j) for i in range(n_gpu) for j in range(i + 1, n_gpu)]
    for i, j in draw(st.lists(st.sampled_from(pairs), unique=True, max_size=4)) if pairs else []:
        links.append({"a": f"gpu{i}", "b": f"gpu{j}", "bandwidth_gbps": draw(BANDWIDTH)})
    return {"name": draw(st.sampled_from(["box", "lab-server"])), "p2p": draw(st.booleans()),
            "nodes": draw(st.permutations(nodes)), "links": draw(st.permutations(links))}


@given(servers())
def test_json_round_trip_gives_an_equal_topology(d):
    topo = Topology.from_dict(d)
    text = topo.to_json()
    back = Topology.from_json(text)
    assert back == topo and back.to_json() == text


@given(servers())
def test_routes_start_and_end_at_the_endpoints_and_follow_links(d):
    topo = Topology.from_dict(d)
    ends = [*topo.graph, "host"]
    for a in ends:
        for b in ends:
            if a == b == "host":
                continue
            r = topo.route(a, b)
            want_a = topo._rc[b] if a == "host" else a
            want_b = topo._rc[a] if b == "host" else b
            assert r[0] == want_a and r[-1] == want_b
            assert all(topo.graph.has_edge(u, v) for u, v in zip(r, r[1:]))


@given(servers())
def test_bandwidth_is_the_smallest_link_bandwidth_on_the_route(d):
    topo = Topology.from_dict(d)
    for a in ["host", *topo.graph]:
        for b in topo.graph:
            r = topo.route(a, b)
            if len(r) > 1:
                assert topo.bandwidth(a, b) == min(topo.link_bandwidth(u, v) for u, v in zip(r, r[1:]))


@given(servers())
def test_gpu_to_gpu_routes_follow_nvlink_p2p_or_host_memory(d):
    topo = Topology.from_dict(d)
    for ga in topo.gpus:
        for gb in topo.gpus:
            if ga == gb:
                continue
            r = topo.route(ga.name, gb.name)
            nvlink = topo.graph.has_edge(ga.name, gb.name)
            if nvlink:
                assert r == (ga.name, gb.name)
            elif topo.p2p:
                assert len(set(r)) == len(r)  # a simple path
            else:
                assert ga.root_complex in r and gb.root_complex in r  # relayed through DRAM


@given(servers())
def test_host_routes_walk_the_pcie_tree_from_the_gpus_own_root_complex(d):
    topo = Topology.from_dict(d)
    for g in topo.gpus:
        down = topo.route("host", g.name)
        assert down[0] == g.root_complex
        assert topo.route(g.name, "host") == down[::-1]
        assert all(topo.graph.edges[u, v]["kind"] == "pcie" for u, v in zip(down, down[1:]))


@st.composite
def pcie_layouts(draw) -> list[list[list[int]]]:
    """Sockets of switch groups of GPU numbers, e.g. [[[0, 1], [2]], [[3, 4]]]."""
    sizes = draw(st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=3), min_size=1, max_size=3))
    n, out = 0, []
    for socket in sizes:
        out.append([list(range(n + sum(socket[:k]), n + sum(socket[:k + 1]))) for k in range(len(socket))])
        n += sum(socket)
    return out


@given(pcie_layouts())
def test_nvidia_smi_matrices_give_back_the_sockets_and_switches_they_describe(layout):
    where = {g: (s, k) for s, groups in enumerate(layout) for k, grp in enumerate(groups) for g in grp}
    n = len(where)

    def rel(i: int, j: int) -> str:
        if i == j:
            return " X "
        (si, ki), (sj, kj) = where[i], where[j]
        return "SYS" if si != sj else "PIX" if ki == kj else "NODE"

    lines = ["\t" + "\t".join(f"GPU{j}" for j in range(n)) + "\tCPU Affinity\tNUMA Affinity"]
    lines += [f"GPU{i}\t" + "\t".join(rel(i, j) for j in range(n)) + f"\tN/A\t{where[i][0]}" for i in range(n)]
    topo = Topology.from_nvidia_smi("\n".join(lines), spec="rtx3090")
    sockets = {tuple(topo.gpus_under(rc)) for rc in topo.root_complexes}
    assert sockets == {tuple(f"gpu{g}" for grp in groups for g in grp) for groups in layout}
    switches = {topo.gpus_under(n) for n, k in topo.graph.nodes(data="kind") if k == "switch"}
    assert switches == {tuple(f"gpu{g}" for g in grp) for groups in layout for grp in groups if len(grp) > 1}
    assert json.loads(topo.to_json())["p2p"] is False
