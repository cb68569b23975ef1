"""What a valid server description is: the rules of the topology graph and its JSON schema.

Why a module of its own: `mobius_fx.topology.server` is the model a planner asks (routes,
bandwidths, presets, printing); this is the gate every description passes first, whatever its
source (JSON, a preset, `nvidia-smi`): the PCIe links form one tree per root complex, sockets
join by UPI, GPUs by NVLink, every number is positive and finite, and an error names its JSON
location. The schema itself is documented in `mobius_fx.topology.server`, where users look for it.

>>> check_graph(graph_from_dict({"nodes": [{"name": "cpu0", "kind": "root_complex"}], "links": []}, "x")[0])
Traceback (most recent call last):
    ...
mobius_fx.errors.TopologyError: topology has no GPUs (nodes: cpu0); add nodes of kind 'gpu'
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import networkx as nx

from mobius_fx.topology.device_specs import DEVICE_SPECS, DeviceSpec
from mobius_fx.errors import MobiusError, TopologyError
from mobius_fx.topology.links import GB
from mobius_fx.units import check_positive, parse_bandwidth, parse_bytes

__all__ = ["NODE_KINDS", "LINK_KINDS", "HostFigures", "check_graph", "graph_from_dict", "layout", "parse_spec",
           "parse_memory", "parse_bandwidths", "parse_host", "parse_host_memory", "natural_key"]

NODE_KINDS = ("root_complex", "switch", "gpu")
LINK_KINDS = ("pcie", "upi", "nvlink")


# ------------------------------------------------------------------ graph rules
def check_graph(graph: Any) -> tuple[nx.DiGraph, dict[str, str | None], dict[str, str]]:
    """Check a topology graph; return a canonical copy, PCIe parents and each node's root complex."""
    if not isinstance(graph, nx.DiGraph):
        raise TopologyError(f"a Topology is built on a networkx.DiGraph, got {type(graph).__name__}; "
                            "or use Topology.from_json / preset / virtual")
    for n, d in graph.nodes(data=True):
        if not isinstance(n, str) or not n or n == "host":
            raise TopologyError(f"node name {n!r} is not allowed; give a non-empty string other than 'host' "
                                "(the name routes use for a GPU's host memory)")
        if d.get("kind") not in NODE_KINDS:
            raise TopologyError(f"node {n!r} has kind {d.get('kind')!r}; give one of {', '.join(NODE_KINDS)}")
        if d["kind"] == "gpu":
            mem = d.get("memory")
            if isinstance(mem, bool) or not isinstance(mem, int) or mem <= 0:
                raise TopologyError(f"GPU {n!r} has memory {mem!r}; a GPU needs a positive number of bytes, "
                                    "e.g. 24 * 2**30 or '24GiB' in JSON")
            if not isinstance(d.get("spec"), DeviceSpec):
                raise TopologyError(f"GPU {n!r} has spec {d.get('spec')!r}; give a DeviceSpec, e.g. "
                                    "DeviceSpec.preset('rtx3090')")
    gpus = [n for n, k in graph.nodes(data="kind") if k == "gpu"]
    if not gpus:
        raise TopologyError(f"topology has no GPUs (nodes: {', '.join(graph) or 'none'}); add nodes of kind 'gpu'")
    index = _check_indices(graph, gpus)
    for u, v, d in graph.edges(data=True):
        _check_edge(graph, u, v, d)
    # The PCIe tree: switches and GPUs hang below exactly one root complex, without cycles.
    pcie = nx.Graph()
    pcie.add_nodes_from(sorted(graph))
    pcie.add_edges_from((u, v) for u, v, k in graph.edges(data="kind") if k == "pcie")
    try:
        cycle = nx.find_cycle(pcie)
    except nx.NetworkXNoCycle:
        pass
    else:
        raise TopologyError(f"the PCIe links form a cycle through {', '.join(u for u, _ in cycle)}; switches and "
                            "root complexes must form a tree (join sockets with 'upi' links, GPUs with 'nvlink')")
    parent: dict[str, str | None] = {}
    rc_of: dict[str, str] = {}
    for comp in nx.connected_components(pcie):
        rcs = sorted(n for n in comp if graph.nodes[n]["kind"] == "root_complex")
        if len(rcs) > 1:
            path = nx.shortest_path(pcie, rcs[0], rcs[1])
            raise TopologyError(f"root complexes {rcs[0]} and {rcs[1]} are joined over PCIe ({' - '.join(path)}); "
                                "each switch and GPU belongs to one root complex, sockets join by a 'upi' link")
        if not rcs:
            orphans = sorted(comp, key=lambda n: (graph.nodes[n]["kind"] != "gpu", n))
            what = "GPU" if graph.nodes[orphans[0]]["kind"] == "gpu" else "switch"
            raise TopologyError(f"{what} {orphans[0]} has no path to DRAM: no PCIe links lead from it to a root "
                                f"complex; link it (or its switch) to one, e.g. "
                                f'{{"a": "cpu0", "b": "{orphans[0]}", "bandwidth_gbps": 13}}')
        parent[rcs[0]] = None
        for child, par in nx.bfs_predecessors(pcie, rcs[0]):
            parent[child] = par
        for n in comp:
            rc_of[n] = rcs[0]
    for g in gpus:
        if pcie.degree(g) != 1:
            raise TopologyError(f"GPU {g} has {pcie.degree(g)} PCIe links ({', '.join(sorted(pcie[g]))}); a GPU "
                                "hangs off exactly one switch or root complex")
    rcs = sorted(n for n in graph if graph.nodes[n]["kind"] == "root_complex")
    upi = nx.Graph()
    upi.add_nodes_from(rcs)
    upi.add_edges_from((u, v) for u, v, k in graph.edges(data="kind") if k == "upi")
    if not nx.is_connected(upi):
        reach = nx.node_connected_component(upi, rcs[0])
        raise TopologyError(f"root complexes {', '.join(n for n in rcs if n not in reach)} have no 'upi' path to "
                            f"{rcs[0]}; add an inter-socket link between them")
    return _canonical(graph, parent, index), parent, rc_of


def _check_indices(graph: nx.DiGraph, gpus: list[str]) -> dict[str, int]:
    """Each GPU's CUDA index: as given, or (none given) by natural name order."""
    have = [n for n in gpus if "index" in graph.nodes[n]]
    if have and len(have) != len(gpus):
        missing = sorted(set(gpus) - set(have))
        raise TopologyError(f"GPU {missing[0]} has no index but other GPUs do; give every GPU an index or none")
    if not have:
        return {n: i for i, n in enumerate(sorted(gpus, key=natural_key))}
    seen: dict[int, str] = {}
    for n in sorted(gpus, key=natural_key):
        i = graph.nodes[n]["index"]
        ok = not isinstance(i, bool) and isinstance(i, int) and 0 <= i < len(gpus)
        if not ok or i in seen:
            clash = f" (also {seen[i]}'s)" if ok else ""
            raise TopologyError(f"GPU {n} has index {i!r}{clash}; GPU indices must be 0..{len(gpus) - 1}, "
                                "each used once (the CUDA device numbers)")
        seen[i] = n
    return {n: i for i, n in seen.items()}


MIN_BANDWIDTH = 1e6  # bytes/s: below 1 MB/s a link is a typo (GB/s given as bytes/s), not a machine


def check_bandwidth(value: Any, what: str, remedy: str, *, scale: float = 1.0) -> float:
    """`value` * `scale` as bytes/s when it is a positive finite number of at least 1 MB/s
    (`MIN_BANDWIDTH`); TopologyError otherwise (a link of 1e-300 GB/s would plan hour-long steps)."""
    x = check_positive(value, what, remedy, TopologyError) * scale
    if x < MIN_BANDWIDTH:
        raise TopologyError(f"{what} is {value!r} = {x:.3g} bytes/s; a link must carry at least 1 MB/s "
                            f"({MIN_BANDWIDTH / GB:g} GB/s), slower is a unit mistake; {remedy}")
    return x


def _check_edge(graph: nx.DiGraph, u: str, v: str, d: Mapping[str, Any]) -> None:
    link = d.get("name") or f"{u}-{v}"
    check_bandwidth(d.get("bandwidth"), f"link {link} ({u} -> {v}): bandwidth", "give bytes/s (GB/s in JSON)")
    kind = d.get("kind")
    if kind not in LINK_KINDS:
        raise TopologyError(f"link {link} ({u} -> {v}) has kind {kind!r}; give one of {', '.join(LINK_KINDS)}")
    if u == v:
        raise TopologyError(f"link {link} joins {u} to itself; a link joins two different nodes")
    if not graph.has_edge(v, u) or graph.edges[v, u].get("kind") != kind:
        raise TopologyError(f"link {link} ({u} -> {v}, {kind}) has no reverse {v} -> {u} of the same kind; "
                            "each physical link is two directed edges")
    duplex = d.get("duplex")
    if duplex is not None and (isinstance(duplex, bool) or not isinstance(duplex, (int, float))
                               or not 0.5 <= duplex <= 1 or graph.edges[v, u].get("duplex") != duplex):
        raise TopologyError(f"link {link} ({u} -> {v}) has duplex {duplex!r} (reverse: "
                            f"{graph.edges[v, u].get('duplex')!r}); duplex is the share of each direction's "
                            "bandwidth left while both directions are busy, one number from 0.5 to 1 for both "
                            "directions (1 = full duplex); give e.g. 0.72, or leave it out for the default")
    ku, kv = graph.nodes[u]["kind"], graph.nodes[v]["kind"]
    rule = {"nvlink": ku == kv == "gpu", "upi": ku == kv == "root_complex",
            "pcie": {ku, kv} not in ({"gpu"}, {"root_complex"})}[kind]
    if not rule:
        raise TopologyError(f"link {link} joins {ku} {u} and {kv} {v} by {kind}; nvlink joins two GPUs, upi two "
                            "root complexes, pcie a root complex or switch to a switch or GPU")


def _canonical(graph: nx.DiGraph, parent: dict[str, str | None], index: dict[str, int]) -> nx.DiGraph:
    """A copy in a fixed order (so equal topologies route alike), bandwidths in whole bytes/s."""
    out = nx.DiGraph()
    order = {"root_complex": 0, "switch": 1, "gpu": 2}
    for n in sorted(graph, key=lambda n: (order[graph.nodes[n]["kind"]], natural_key(n))):
        d = graph.nodes[n]
        attrs = {"kind": d["kind"]}
        if d["kind"] == "gpu":
            attrs.update(memory=d["memory"], spec=d["spec"], index=index[n])
        out.add_node(n, **attrs)
    rank = {n: i for i, n in enumerate(out)}
    # edges by (rank[u], rank[v]): each node's successors sorted on their own (a sort of degree
    # size per node, not one of every edge: loading stays linear in the GPUs)
    for u, v in ((u, v) for u in out for v in sorted(graph.successors(u), key=rank.__getitem__)):
        d = graph.edges[u, v]
        a, b = (v, u) if parent.get(u) == v or (d["kind"] != "pcie" and rank[v] < rank[u]) else (u, v)
        out.add_edge(u, v, bandwidth=float(max(1, round(d["bandwidth"]))), kind=d["kind"],
                     name=str(d.get("name") or f"{a}-{b}"))
        if d.get("duplex") is not None:
            out.edges[u, v]["duplex"] = float(d["duplex"])
    return out


def natural_key(name: str) -> tuple:
    """Sort key that orders "gpu2" before "gpu10"."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


# ------------------------------------------------------------------------ JSON
_TOP_KEYS = {"name", "p2p", "virtual", "nodes", "links", "comment", "host"}
_HOST_KEYS = {"optimizer", "implementation", "optimizer_bytes_per_s", "host_copy_bytes_per_s", "cores", "memory"}
# The host's DRAM ("host": {"memory": "256GiB"}) is not a measured speed: it is kept on the Topology
# (`Topology.host_memory`), not in `HostFigures`, so a host section of only "memory" leaves `topo.host` None.
MIN_HOST_MEMORY = 2**20  # bytes: a host of less than 1 MiB is a unit mistake (GiB given as bytes)
# The optimizers whose bytes touched per parameter the simulator knows (planning.host_step.TOUCHED_BYTES;
# not imported: this module imports no simulator code).
HOST_OPTIMIZERS = ("adam", "adamw", "sgd")


@dataclass(frozen=True)
class HostFigures:
    """The host's own figures, measured on the machine (`benchmarks/cpu_optimizer.py`,
    `benchmarks/gpu_check.py`), for the simulator to charge the host as it is instead of assumed.

    Why in the topology: the host is part of the server the plan runs on, and the scripts that
    measure the links measure it in the same run. JSON: an optional top-level "host" object::

        "host": {"optimizer": "adamw", "implementation": "fused", "optimizer_bytes_per_s": 1.2e11,
                 "host_copy_bytes_per_s": 4.5e10, "cores": 16}

    `optimizer_bytes_per_s` counts `planning.host_step.TOUCHED_BYTES[optimizer]` bytes per fp32 master
    parameter per step (28 for Adam/AdamW), so it needs `optimizer`; `implementation` says which
    kernel ran ("fused", "foreach", "for-loop", "deepspeed"); `host_copy_bytes_per_s` is the
    slowest host-side copy around a step (the streamed copy's refresh, the gradient hand-over),
    bytes read + written per second, as `planning.host_step.host_copy_bytes` counts them; `cores` the CPU
    cores the process may use. Every key is optional."""

    optimizer: str | None = None
    implementation: str | None = None
    optimizer_bytes_per_s: float | None = None
    host_copy_bytes_per_s: float | None = None
    cores: int | None = None

    def __post_init__(self) -> None:
        _check_host(self.to_dict(), "HostFigures")  # the same rules as the JSON

    def to_dict(self) -> dict[str, Any]:
        """The JSON object, keys that are None left out."""
        return {k: v for k, v in (("optimizer", self.optimizer), ("implementation", self.implementation),
                                  ("optimizer_bytes_per_s", self.optimizer_bytes_per_s),
                                  ("host_copy_bytes_per_s", self.host_copy_bytes_per_s), ("cores", self.cores))
                if v is not None}


def parse_host(data: Any, source: str) -> HostFigures:
    """The "host" object of a topology JSON as `HostFigures`; TopologyError naming the key.

    >>> parse_host({"optimizer": "adamw", "optimizer_bytes_per_s": 1.2e11, "cores": 16}, "x").cores
    16
    >>> parse_host({"optimizer_bytes_per_s": 1.2e11}, "x")
    Traceback (most recent call last):
        ...
    mobius_fx.errors.TopologyError: x: host: optimizer_bytes_per_s is given without 'optimizer'; say which optimizer it was measured for (one of adam, adamw, sgd), e.g. "optimizer": "adamw"
    """
    return HostFigures(**_check_host(data, source))


def parse_host_memory(value: Any, where: str) -> int:
    """The host's DRAM (bytes, or a string with a unit: "256GiB") as int bytes; TopologyError at
    `where` when it is not a positive size of at least 1 MiB.

    >>> parse_host_memory("256GiB", "x") == 256 * 2**30
    True
    >>> parse_host_memory(256, "server.json: host")
    Traceback (most recent call last):
        ...
    mobius_fx.errors.TopologyError: server.json: host: memory is 256 bytes; the host's DRAM is at least 1 MiB, smaller is a unit mistake; give bytes or a string with a unit, e.g. "256GiB"
    """
    n = _parse(parse_bytes, value, f"{where}: memory")
    if n < MIN_HOST_MEMORY:
        raise TopologyError(f"{where}: memory is {value!r}{'' if n == value else f' = {n}'} bytes; the host's DRAM is "
                            f"at least 1 MiB, smaller is a unit mistake; give bytes or a string with a unit, "
                            f"e.g. \"256GiB\"")
    return n


def _check_host(data: Any, source: str) -> dict[str, Any]:
    """The host object's figures, checked (rates as float bytes/s); TopologyError naming the key.
    "memory" is checked by `parse_host_memory` and not returned (it is not a HostFigures field)."""
    where = f"{source}: host"
    if not isinstance(data, Mapping):
        raise TopologyError(f"{where}: expected an object with the host's DRAM and measured figures (keys "
                            f"{', '.join(sorted(_HOST_KEYS))}), got {data!r}")
    _no_unknown_keys(data, _HOST_KEYS, "host", lambda w, msg: TopologyError(f"{source}: {w}: {msg}"))
    if "memory" in data:
        parse_host_memory(data["memory"], where)
    opt, impl = data.get("optimizer"), data.get("implementation")
    if opt is not None and opt not in HOST_OPTIMIZERS:
        raise TopologyError(f"{where}: optimizer is {opt!r}; give the optimizer the speed was measured for, one of "
                            f"{', '.join(HOST_OPTIMIZERS)} (its kernel goes in 'implementation')")
    if impl is not None and (not isinstance(impl, str) or not impl):
        raise TopologyError(f"{where}: implementation is {impl!r}; give a non-empty string such as 'fused', "
                            "'foreach', 'for-loop' or 'deepspeed'")
    rates = {}
    for key in ("optimizer_bytes_per_s", "host_copy_bytes_per_s"):
        if data.get(key) is not None:
            rates[key] = check_positive(data[key], f"{where}: {key}", "give bytes/s, e.g. 1.2e11", TopologyError)
    if "optimizer_bytes_per_s" in rates and opt is None:
        raise TopologyError(f"{where}: optimizer_bytes_per_s is given without 'optimizer'; say which optimizer it "
                            f"was measured for (one of {', '.join(HOST_OPTIMIZERS)}), e.g. \"optimizer\": \"adamw\"")
    cores = data.get("cores")
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
        raise TopologyError(f"{where}: cores is {cores!r}; give the number of CPU cores, a positive integer")
    return {"optimizer": opt, "implementation": impl, **rates, "cores": cores}

_NODE_KEYS = {"name", "kind", "memory", "spec", "index"}
_LINK_KEYS = {"a", "b", "kind", "bandwidth_gbps", "name", "duplex"}


def graph_from_dict(data: Any, source: str) -> tuple[nx.DiGraph, dict[str, Any]]:
    """The graph of a topology JSON dict (schema: `mobius_fx.topology.server`) and its `name`, `p2p` and
    `virtual`, for `Topology(graph, **attrs)`; TopologyError located at `source` and the key.

    >>> graph, attrs = graph_from_dict({"nodes": [{"name": "cpu0", "kind": "root_complex"}], "links": []}, "x")
    >>> list(graph), attrs
    (['cpu0'], {'name': 'custom', 'p2p': False, 'virtual': False})
    """
    def fail(where: str, msg: str) -> TopologyError:
        return TopologyError(f"{source}: {where}: {msg}")

    if not isinstance(data, Mapping):
        raise fail("top level", f"expected an object with 'nodes' and 'links', got {type(data).__name__}")
    _no_unknown_keys(data, _TOP_KEYS, "top level", fail)
    for key in ("nodes", "links"):
        if not isinstance(data.get(key), list):
            raise fail(key, f"expected a list, got {type(data.get(key)).__name__}")
    graph = nx.DiGraph()
    _add_nodes(graph, data["nodes"], source, fail)
    _add_links(graph, data["links"], source, fail)
    for key in ("p2p", "virtual"):
        if not isinstance(data.get(key, False), bool):
            raise fail(key, f"expected true or false, got {data[key]!r}")
    if not isinstance(data.get("name", "custom"), str) or not data.get("name", "custom"):
        raise fail("name", f"expected a non-empty string naming the topology, got {data['name']!r}")
    attrs = {"name": data.get("name", "custom"), "p2p": data.get("p2p", False),
             "virtual": data.get("virtual", False)}
    host = data.get("host")
    if host is not None:
        figures = _check_host(host, source)  # every key checked, "memory" too, each located
        if "memory" in host:
            attrs["host_memory"] = parse_host_memory(host["memory"], f"{source}: host")
        if set(host) - {"memory"} or "memory" not in host:  # measured figures (or an empty section, as before)
            attrs["host"] = HostFigures(**figures)
    return graph, attrs


def _add_nodes(graph: nx.DiGraph, nodes: list, source: str, fail: Callable[[str, str], TopologyError]) -> None:
    """The topology JSON's `nodes` into `graph` (GPUs with memory, spec and index)."""
    where_of: dict[str, str] = {}
    gpus = 0  # GPU nodes so far: the default index of the next (counted as they come: linear in the file)
    for i, nd in enumerate(nodes):
        where = f"nodes[{i}]"
        if not isinstance(nd, Mapping):
            raise fail(where, f"expected an object, got {nd!r}")
        _no_unknown_keys(nd, _NODE_KEYS, where, fail)
        name, kind = nd.get("name"), nd.get("kind")
        if not isinstance(name, str) or not name:
            raise fail(where, f"'name' must be a non-empty string, got {name!r}")
        where = f"nodes[{i}] ({name})"
        if name in where_of:
            raise fail(where, f"duplicate node name {name!r} (first at {where_of[name]}); names must be unique")
        where_of[name] = f"nodes[{i}]"
        if kind not in NODE_KINDS:
            raise fail(where, f"'kind' is {kind!r}; give one of {', '.join(NODE_KINDS)}")
        if kind != "gpu":
            extra = sorted(set(nd) & {"memory", "spec", "index"})
            if extra:
                raise fail(where, f"{', '.join(extra)} belong on GPU nodes only")
            graph.add_node(name, kind=kind)
            continue
        spec = parse_spec(nd.get("spec"), f"{source}: {where}")
        mem = parse_memory(nd["memory"], f"{source}: {where}") if "memory" in nd else spec.memory
        attrs = {"kind": "gpu", "memory": mem, "spec": spec}
        attrs["index"] = nd["index"] if "index" in nd else gpus
        gpus += 1
        graph.add_node(name, **attrs)


def _add_links(graph: nx.DiGraph, links: list, source: str, fail: Callable[[str, str], TopologyError]) -> None:
    """The topology JSON's `links` into `graph`, an edge each way (bandwidth per direction,
    kind, name, duplex)."""
    seen: dict[frozenset, str] = {}
    for i, ln in enumerate(links):
        where = f"links[{i}]"
        if not isinstance(ln, Mapping):
            raise fail(where, f"expected an object, got {ln!r}")
        _no_unknown_keys(ln, _LINK_KEYS, where, fail)
        a, b = ln.get("a"), ln.get("b")
        unknown = [repr(x) for x in (a, b) if x not in graph]
        if unknown:
            raise fail(where, f"unknown node {' and '.join(unknown)} in link {a}-{b}; nodes are {', '.join(graph)}")
        name = ln.get("name", f"{a}-{b}")
        where = f"links[{i}] ({name})"
        if a == b:
            raise fail(where, f"links {a} to itself; a link joins two different nodes")
        pair = frozenset((a, b))
        if pair in seen:
            raise fail(where, f"{a} and {b} are already linked by {seen[pair]}; give one link per pair")
        seen[pair] = where
        ka, kb = graph.nodes[a]["kind"], graph.nodes[b]["kind"]
        kind = ln.get("kind", "upi" if ka == kb == "root_complex" else "nvlink" if ka == kb == "gpu" else "pcie")
        gbps = ln.get("bandwidth_gbps")
        both = isinstance(gbps, list) and len(gbps) == 2
        ab, ba = (check_bandwidth(x, f"{source}: {where}: bandwidth_gbps{f'[{k}]' if both else ''}",
                                  "give GB/s per direction: one number, or [a_to_b, b_to_a]", scale=GB)
                  for k, x in enumerate(gbps if both else (gbps, gbps)))
        duplex = ln.get("duplex")
        if duplex is not None and (isinstance(duplex, bool) or not isinstance(duplex, (int, float))
                                   or not 0.5 <= duplex <= 1):
            raise fail(where, f"duplex is {duplex!r}; it is the share of each direction's bandwidth left while both "
                              "directions are busy, a number from 0.5 to 1 (1 = full duplex); give e.g. 0.72, or "
                              "leave it out (PCIe links at a switch default to mobius_fx.topology.links.SWITCH_DUPLEX)")
        extra = {} if duplex is None else {"duplex": float(duplex)}
        graph.add_edge(a, b, bandwidth=ab, kind=kind, name=name, **extra)  # rounded to whole bytes/s by Topology
        graph.add_edge(b, a, bandwidth=ba, kind=kind, name=name, **extra)


def layout(name: str, sockets: list[list[list[int]]], *, spec: Any, memory: Any, gpu_link: float,
            uplink: float | None, upi: float, p2p: bool, virtual: bool = False,
            nvlinks: Mapping[tuple[int, int], float] | None = None, host_memory: Any = None) -> dict[str, Any]:
    """A JSON-schema dict: socket r holds groups of GPU indices; each group sits under one
    switch with `uplink`, or with `uplink=None` every GPU links straight to the socket.
    `host_memory`: the host's DRAM ("host": {"memory": ...}), None for none."""
    nodes: list[dict] = [{"name": f"cpu{r}", "kind": "root_complex"} for r in range(len(sockets))]
    links: list[dict] = [{"a": f"cpu{r}", "b": f"cpu{s}", "kind": "upi", "bandwidth_gbps": upi / GB}
                         for r in range(len(sockets)) for s in range(r + 1, len(sockets))]
    gpus: list[dict] = []
    sw = 0
    for r, groups in enumerate(sockets):
        for group in groups:
            top = f"cpu{r}"
            if uplink is not None:
                top, sw = f"sw{sw}", sw + 1
                nodes.append({"name": top, "kind": "switch"})
                links.append({"a": f"cpu{r}", "b": top, "bandwidth_gbps": uplink / GB})
            for g in group:
                gpus.append({"name": f"gpu{g}", "kind": "gpu", "index": g, "memory": memory, "spec": spec})
                links.append({"a": top, "b": f"gpu{g}", "bandwidth_gbps": gpu_link / GB})
    links += [{"a": f"gpu{i}", "b": f"gpu{j}", "kind": "nvlink", "bandwidth_gbps": bw / GB}
              for (i, j), bw in (nvlinks or {}).items()]
    out = {"name": name, "p2p": p2p, "virtual": virtual, "nodes": nodes + sorted(gpus, key=lambda g: g["index"]),
           "links": links}
    if host_memory is not None:
        out["host"] = {"memory": host_memory}
    return out


def _no_unknown_keys(d: Mapping, allowed: set[str], where: str, fail: Callable[[str, str], Exception]) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        raise fail(where, f"unknown key(s) {', '.join(map(repr, extra))}; allowed: {', '.join(sorted(allowed))}")


def parse_spec(spec: Any, where: str) -> DeviceSpec:
    """A GPU's DeviceSpec from a spec, a preset name or a spec object (dict); TopologyError at `where`."""
    if isinstance(spec, DeviceSpec):
        return spec
    if isinstance(spec, str):
        try:
            return DeviceSpec.preset(spec)
        except MobiusError as e:
            raise TopologyError(f"{where}: {e}") from None
    if isinstance(spec, Mapping):
        try:
            return DeviceSpec(**spec)
        except TypeError as e:
            raise TopologyError(f"{where}: spec object {spec!r} is not a DeviceSpec ({e}); give name, flops, "
                                "memory_bandwidth, memory and optionally efficiency") from None
        except TopologyError as e:
            raise TopologyError(f"{where}: spec: {e}") from None
    raise TopologyError(f"{where}: GPU spec is {spec!r}; give a DeviceSpec preset name "
                        f"({', '.join(sorted(DEVICE_SPECS))}) or a spec object")


def parse_memory(value: Any, where: str) -> int:
    """A GPU's memory (bytes or a string with a unit) as positive int bytes; TopologyError at `where`."""
    n = _parse(parse_bytes, value, f"{where}: memory")
    if n <= 0:
        raise TopologyError(f"{where}: memory is {value!r}{'' if n == value else f' = {n} bytes'}; a GPU needs a "
                            "positive number of bytes, e.g. '24GiB'")
    return n


def parse_bandwidths(where: str, **values: Any) -> dict[str, Any]:
    """Bandwidth arguments (bytes/s, or strings like '16GB/s') as bytes/s, None kept; TopologyError names the one."""
    return {k: None if v is None else _parse(parse_bandwidth, v, f"{where}: {k}") for k, v in values.items()}


def _parse(parse: Callable[[Any, str], Any], value: Any, what: str) -> Any:
    try:
        return parse(value, what)
    except MobiusError as e:
        raise TopologyError(str(e)) from None
