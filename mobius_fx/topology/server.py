"""The server a pipeline runs on: CPU sockets, PCIe switches, GPUs and the links between them.

Mobius's speed-up comes from the PCIe tree: GPUs under one switch or root complex share its
uplink, so where each transfer goes decides how fast it runs. A `Topology` is that tree as a
networkx `DiGraph`. Nodes have `kind` "root_complex" (one CPU socket: its DRAM and its PCIe
root complex), "switch" or "gpu". Each physical link is two directed edges (one per
direction, PCIe is full duplex) with `bandwidth` (bytes/s, effective), `kind` ("pcie", "upi"
or "nvlink") and `name`. Switches and root complexes form a tree over PCIe; the inter-socket
"upi" links and GPU-to-GPU "nvlink" links sit outside it.

Describe your own server in JSON (`Topology.from_json("server.json")`). Bandwidths are GB/s
(10**9 bytes/s) per direction: one number for both directions, or `[a_to_b, b_to_a]` when they
differ; a link's optional `duplex` (0.5 to 1) is the share of each direction left while both
are busy (default: `links.SWITCH_DUPLEX` at a PCIe switch, 1 elsewhere). Memory is bytes or a string with a unit; `spec` is a `DeviceSpec` preset name (or the
full spec as an object); `memory` defaults to the spec's. Memory, FLOP/s and bandwidths must be
positive and finite: 0, negatives, NaN, Infinity and quoted numbers are refused with their JSON
location. A link's `kind` defaults to "upi" between root complexes, "nvlink" between GPUs and
"pcie" otherwise; `name` to "a-b"; a GPU's `index` (its CUDA device number) to its position
among the GPU nodes::

    {"name": "my-server", "p2p": false,
     "nodes": [{"name": "cpu0", "kind": "root_complex"},
               {"name": "sw0", "kind": "switch"},
               {"name": "gpu0", "kind": "gpu", "memory": "24GiB", "spec": "rtx3090"},
               {"name": "gpu1", "kind": "gpu", "memory": "24GiB", "spec": "rtx3090"}],
     "links": [{"a": "cpu0", "b": "sw0", "bandwidth_gbps": 13.0},
               {"a": "sw0", "b": "gpu0", "bandwidth_gbps": 6.5},
               {"a": "sw0", "b": "gpu1", "bandwidth_gbps": [6.5, 6.2]}]}

`p2p` says whether GPUs may copy to each other directly over PCIe (consumer cards such as
the RTX 3090/4090 cannot; then GPU-to-GPU traffic is relayed through host memory).
Bandwidths are stored as whole bytes/s, so a topology survives `to_json`/`from_json` exactly.
An optional top-level "host" object holds the host's own measured figures (the CPU optimizer's
bytes/s, host copy bytes/s, cores: `HostFigures`, written by `benchmarks/cpu_optimizer.py
--topology-out` and `benchmarks/gpu_check.py`); `topo.host` is None without one. Its "memory"
("256GiB") is the host's DRAM, `topo.host_memory` (bytes; None: unknown), which the plan's host
budget is checked against (`mobius_fx.planning.host_memory`); `detect` and `virtual` read this machine's.

The rules a description must meet, and the reading of this schema, live in
`mobius_fx.topology.schema`; reading the server from the driver (`Topology.from_nvidia_smi`,
`Topology.detect`) in `mobius_fx.topology.detect`, which hands back a dict in this schema; the
link bandwidth figures the presets use in `mobius_fx.topology.links`; the preset servers
(`Topology.preset`, `PRESETS`), as schema dicts, in `mobius_fx.topology.presets`. Each imports
none of the others' private names, and none imports this module.
"""

from __future__ import annotations

import gc
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import networkx as nx

from mobius_fx.topology.device_specs import DEVICE_SPECS, DeviceSpec
from mobius_fx.errors import TopologyError
from mobius_fx.topology.links import GB, NVLINK2, PCIE3_X16, SWITCH_DUPLEX, UPI_GOLD6130
from mobius_fx.kinds import HOST
from mobius_fx.topology.detect import NoGPUFound, detect_layout, host_memory_bytes, nvidia_smi_layout
from mobius_fx.topology.presets import PRESET_LAYOUTS, PRESETS
from mobius_fx.topology.schema import (HostFigures, check_graph, graph_from_dict, layout, natural_key, parse_bandwidths,
                                       parse_host_memory, parse_memory, parse_spec)
from mobius_fx.units import fmt_bytes

__all__ = ["GPU", "Topology"]



@dataclass(frozen=True)
class GPU:
    """One GPU of a topology: `memory` bytes usable, under root complex `root_complex`."""

    name: str
    index: int  # CUDA device number
    memory: int  # bytes
    root_complex: str
    spec: DeviceSpec


class Topology:
    """A multi-GPU server as a graph of sockets, switches, GPUs and directed links.

    Build one from a preset, a JSON file, `nvidia-smi topo -m`, NVML, or as virtual GPUs:

    >>> topo = Topology.preset("mobius-testbed")
    >>> topo.route("host", "gpu3")
    ('cpu0', 'sw0', 'gpu3')
    >>> topo.bandwidth("host", "gpu3") / 1e9      # the x8 GPU link is the bottleneck
    6.5

    Treat it as immutable: routes are cached and equal topologies hash equal.
    """

    PRESETS: tuple[str, ...]  # the preset names (`presets.PRESETS`), assigned below the class

    def __init__(self, graph: nx.DiGraph, *, name: str = "custom", p2p: bool = False,
                 virtual: bool = False, host: HostFigures | None = None, host_memory: int | None = None):
        if not isinstance(name, str) or not name:
            raise TopologyError(f"topology name {name!r} is not a non-empty string; name it, e.g. name='my-server'")
        for flag, value in (("p2p", p2p), ("virtual", virtual)):
            if not isinstance(value, bool):
                raise TopologyError(f"{flag}={value!r}; it must be True or False")
        self.name = name
        self.p2p = bool(p2p)
        if host is not None and not isinstance(host, HostFigures):
            raise TopologyError(f"host is {host!r}; give a mobius_fx.topology.server.HostFigures or None")
        self.host = host  # the host's measured figures (JSON "host"), None when not measured
        self.host_memory = None if host_memory is None else parse_host_memory(host_memory, "Topology: host")  # DRAM
        # An instance attribute: `topo.virtual` is this flag, `Topology.virtual(...)` the factory.
        self.virtual = bool(virtual)
        self.graph, self._parent, self._rc = check_graph(graph)
        kinds = nx.get_node_attributes(self.graph, "kind")
        self.root_complexes = tuple(n for n in self.graph if kinds[n] == "root_complex")
        by_index = sorted((d["index"], n) for n, d in self.graph.nodes(data=True) if d["kind"] == "gpu")
        self.gpus = tuple(GPU(n, i, self.graph.nodes[n]["memory"], self._rc[n], self.graph.nodes[n]["spec"])
                          for i, n in by_index)
        upi = nx.Graph()
        upi.add_nodes_from(self.root_complexes)
        upi.add_edges_from((u, v) for u, v, k in self.graph.edges(data="kind") if k == "upi")
        self._upi = upi
        self._routes: dict[tuple[str, str], tuple[str, ...]] = {}

    # ----------------------------------------------------------------- lookups
    def gpu(self, name: str | int) -> GPU:
        """The GPU called `name` ("gpu3"), or with CUDA index `name` (3)."""
        for g in self.gpus:
            if g.name == name or (isinstance(name, int) and g.index == name):
                return g
        raise TopologyError(f"no GPU {name!r} in topology {self.name!r}; its GPUs are "
                            f"{', '.join(g.name for g in self.gpus)}")

    def gpus_under(self, node: str) -> tuple[str, ...]:
        """Names of the GPUs in the PCIe subtree of `node` (a switch or root complex), by index."""
        self._need(node)
        out = []
        for g in self.gpus:
            n: str | None = g.name
            while n is not None and n != node:
                n = self._parent[n]
            if n == node:
                out.append(g.name)
        return tuple(out)

    def links(self) -> list[tuple[str, str, float]]:
        """Every directed link as (u, v, bytes/s)."""
        return [(u, v, bw) for u, v, bw in self.graph.edges(data="bandwidth")]

    def link_bandwidth(self, u: str, v: str) -> float:
        """Bytes/s of the directed link u -> v."""
        if not self.graph.has_edge(u, v):
            self._need(u)
            self._need(v)
            raise TopologyError(f"no link {u} -> {v} in topology {self.name!r}; {u} links to "
                                f"{', '.join(self.graph.successors(u)) or 'nothing'}")
        return self.graph.edges[u, v]["bandwidth"]

    def link_duplex(self, u: str, v: str) -> float:
        """The share of each direction's bandwidth of link u - v left while both directions are
        busy: the link's `duplex` if given, else `links.SWITCH_DUPLEX` for a PCIe link at a
        switch (measured interference) and 1.0 (full duplex) for the others."""
        self.link_bandwidth(u, v)  # the error for a missing link
        d = self.graph.edges[u, v]
        if d.get("duplex") is not None:
            return d["duplex"]
        at_switch = "switch" in (self.graph.nodes[u]["kind"], self.graph.nodes[v]["kind"])
        return SWITCH_DUPLEX if d["kind"] == "pcie" and at_switch else 1.0

    # ------------------------------------------------------------------ routes
    def route(self, a: str, b: str) -> tuple[str, ...]:
        """The nodes a transfer from `a` to `b` passes, both ends included.

        "host" stands for the host memory of the other end's own root complex. GPU to GPU:
        a direct NVLink if one joins them; else, with P2P, the shortest PCIe path (across the
        inter-socket link if needed); else relayed through host memory: up to a's root complex,
        across UPI when b sits on another socket, and down to b.

        >>> Topology.preset("mobius-testbed").route("gpu0", "gpu1")
        ('gpu0', 'sw0', 'cpu0', 'sw0', 'gpu1')
        """
        key = (a, b)
        if key not in self._routes:
            self._routes[key] = self._route(a, b)
        return self._routes[key]

    def bandwidth(self, a: str, b: str) -> float:
        """Bottleneck bytes/s along `route(a, b)` (inf when a and b are the same node)."""
        r = self.route(a, b)
        return min((self.graph.edges[u, v]["bandwidth"] for u, v in zip(r, r[1:])), default=math.inf)

    def _route(self, a: str, b: str) -> tuple[str, ...]:
        if a == HOST and b == HOST:
            raise TopologyError("route('host', 'host') has no GPU end; 'host' means the host memory "
                                "of the other end's root complex, so give a GPU, switch or root complex")
        if a == HOST:
            a = self._rc[self._need(b)]
        elif b == HOST:
            b = self._rc[self._need(a)]
        self._need(a)
        self._need(b)
        if a == b:
            return (a,)
        kinds = self.graph.nodes
        if kinds[a]["kind"] == "gpu" and kinds[b]["kind"] == "gpu":
            if self.graph.has_edge(a, b) and self.graph.edges[a, b]["kind"] == "nvlink":
                return (a, b)
            if not self.p2p:  # relayed through host memory
                return tuple(self._up(a) + self._upi_path(self._rc[a], self._rc[b])[1:] + self._up(b)[::-1][1:])
        up_a, up_b = self._up(a), self._up(b)
        if self._rc[a] != self._rc[b]:
            return tuple(up_a + self._upi_path(self._rc[a], self._rc[b])[1:] + up_b[::-1][1:])
        common = set(up_b)
        i = next(i for i, n in enumerate(up_a) if n in common)
        return tuple(up_a[: i + 1] + up_b[: up_b.index(up_a[i])][::-1])

    def _up(self, node: str) -> list[str]:
        path = [node]
        while (p := self._parent[path[-1]]) is not None:
            path.append(p)
        return path

    def _upi_path(self, a: str, b: str) -> list[str]:
        return nx.shortest_path(self._upi, a, b)

    def _need(self, node: str) -> str:
        if node not in self.graph:
            raise TopologyError(f"unknown node {node!r} in topology {self.name!r}; its nodes are "
                                f"{', '.join(self.graph)} (and 'host' for a GPU's host memory)")
        return node

    # ----------------------------------------------------------- equality, text
    def _key(self) -> tuple:
        nodes = tuple(sorted((n, d["kind"], d.get("memory"), d.get("index"), d.get("spec"))
                             for n, d in self.graph.nodes(data=True)))
        edges = tuple(sorted((u, v, d["bandwidth"], d["kind"], d["name"], d.get("duplex") or 0.0)
                             for u, v, d in self.graph.edges(data=True)))
        return (self.name, self.p2p, self.virtual, nodes, edges, self.host, self.host_memory)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"Topology({self.name!r}, {len(self.gpus)} GPUs, root complexes "
                f"{list(self.root_complexes)}, p2p={self.p2p}{', virtual' if self.virtual else ''}"
                f"{f', host memory {fmt_bytes(self.host_memory)}' if self.host_memory else ''})")

    def tree(self) -> str:
        """The server as a tree a person reads: root complexes > switches > GPUs.

        Each line shows the link to the parent (GB/s per direction) and, for GPUs, memory
        and device spec; links outside the PCIe tree (UPI, NVLink) follow.
        """
        children: dict[str, list[str]] = {n: [] for n in self.graph}
        for n, p in self._parent.items():
            if p is not None:
                children[p].append(n)
        for kids in children.values():
            kids.sort(key=natural_key)
        lines = [f"{self.name}: {len(self.gpus)} GPU(s) under {len(self.root_complexes)} root complex(es), "
                 f"P2P {'on' if self.p2p else 'off'}{', virtual GPUs' if self.virtual else ''}"
                 f"{f', host memory {fmt_bytes(self.host_memory)}' if self.host_memory else ''}"]

        def label(n: str) -> str:
            d = self.graph.nodes[n]
            bw = self._pair_gbps(self._parent[n], n)
            if d["kind"] == "gpu":
                return f"{n}  {bw}  {fmt_bytes(d['memory'])}  {d['spec'].name}"
            return f"{n} (switch)  {bw}"

        def walk(n: str, prefix: str) -> None:
            kids = children[n]
            for i, c in enumerate(kids):
                last = i == len(kids) - 1
                lines.append(f"{prefix}{'└── ' if last else '├── '}{label(c)}")
                walk(c, prefix + ("    " if last else "│   "))

        for rc in self.root_complexes:
            lines.append(f"{rc} (root complex)")
            walk(rc, "")
        extra = [(u, v, k) for u, v, k in self.graph.edges(data="kind") if k != "pcie" and natural_key(u) < natural_key(v)]
        if extra:
            lines.append("links outside the PCIe tree:")
            lines += [f"  {u} <-> {v}  {k}  {self._pair_gbps(u, v)}" for u, v, k in extra]
        return "\n".join(lines)

    def _pair_gbps(self, u: str, v: str) -> str:
        down, up = self.graph.edges[u, v]["bandwidth"] / GB, self.graph.edges[v, u]["bandwidth"] / GB
        return f"{down:.1f} GB/s" if down == up else f"{down:.1f} GB/s down / {up:.1f} GB/s up"

    # -------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """The JSON schema of the module docstring, as a dict (memory in bytes)."""
        nodes: list[dict[str, Any]] = []
        for n, d in self.graph.nodes(data=True):
            if d["kind"] != "gpu":
                nodes.append({"name": n, "kind": d["kind"]})
        for g in self.gpus:
            spec: Any = g.spec.name if DEVICE_SPECS.get(g.spec.name) == g.spec else {
                "name": g.spec.name, "flops": dict(g.spec.flops), "memory_bandwidth": g.spec.memory_bandwidth,
                "memory": g.spec.memory, "efficiency": g.spec.efficiency}
            nodes.append({"name": g.name, "kind": "gpu", "index": g.index, "memory": g.memory, "spec": spec})
        links = []
        for u, v, d in self.graph.edges(data=True):
            a, b = (v, u) if self._parent.get(u) == v else (u, v)  # parent first
            if (a, b) != (u, v) or (d["kind"] != "pcie" and natural_key(u) > natural_key(v)):
                continue  # write each physical link once
            ab, ba = d["bandwidth"] / GB, self.graph.edges[b, a]["bandwidth"] / GB
            link: dict[str, Any] = {"a": a, "b": b, "kind": d["kind"], "bandwidth_gbps": ab if ab == ba else [ab, ba]}
            if d["name"] != f"{a}-{b}":
                link["name"] = d["name"]
            if d.get("duplex") is not None:
                link["duplex"] = d["duplex"]
            links.append(link)
        out = {"name": self.name, "p2p": self.p2p, "virtual": self.virtual, "nodes": nodes, "links": links}
        if self.host is not None or self.host_memory is not None:
            out["host"] = {**(self.host.to_dict() if self.host is not None else {}),
                           **({"memory": self.host_memory} if self.host_memory is not None else {})}
        return out

    def with_host(self, host: HostFigures | None) -> "Topology":
        """This topology with the host's measured figures `host` (None: without any), its DRAM kept."""
        return Topology(self.graph, name=self.name, p2p=self.p2p, virtual=self.virtual, host=host,
                        host_memory=self.host_memory)

    def with_host_memory(self, memory: int | str | None) -> "Topology":
        """This topology with the host's DRAM `memory` (bytes or "256GiB"; None: unknown)."""
        return Topology(self.graph, name=self.name, p2p=self.p2p, virtual=self.virtual, host=self.host,
                        host_memory=memory)

    def to_json(self) -> str:
        """JSON text that `Topology.from_json` reads back into an equal topology."""
        d = self.to_dict()
        keys = ("name", "p2p", "virtual", "host") if "host" in d else ("name", "p2p", "virtual")
        head = ", ".join(f"{json.dumps(k)}: {json.dumps(d[k])}" for k in keys)
        lists = [f'"{k}": [\n  ' + ",\n  ".join(json.dumps(x) for x in d[k]) + "]" for k in ("nodes", "links")]
        return "{" + head + ",\n " + ",\n ".join(lists) + "}\n"  # one node / link a line

    @staticmethod
    def from_json(path_or_text: str | os.PathLike | Mapping[str, Any]) -> "Topology":
        """Read a topology from a JSON file path or from JSON text (schema: module docstring).

        Accepts a path (`str` or `os.PathLike`), JSON text (a `str` starting with `{`) or an
        already parsed dict.

        topo = Topology.from_json("server.json")
        """
        if isinstance(path_or_text, Mapping):
            return Topology.from_dict(path_or_text)
        if not isinstance(path_or_text, (str, os.PathLike)) or not str(path_or_text).strip():
            raise TopologyError(f"Topology.from_json got {path_or_text!r} (type {type(path_or_text).__name__}); give "
                                "the path of a JSON file (str or pathlib.Path), JSON text (a str) or a dict")
        if isinstance(path_or_text, os.PathLike) or not str(path_or_text).lstrip().startswith(("{", "[")):
            source = str(path_or_text)
            try:
                text: str | bytes = Path(path_or_text).read_bytes()
            except OSError as e:
                raise TopologyError(f"cannot read topology file {source!r} ({e.strerror or e}); give the path "
                                    f"of a JSON file, or the JSON text itself") from None
        else:
            source, text = "topology JSON", str(path_or_text)
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, too deep or long
            why = f"{e.msg} at line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else e
            raise TopologyError(f"{source}: not JSON ({why}); give a topology in JSON (schema: see "
                                "mobius_fx.topology.server)") from None
        return Topology.from_dict(data, source=source)

    @staticmethod
    def from_dict(data: Mapping[str, Any], *, source: str = "topology") -> "Topology":
        """Build a topology from the JSON schema of the module docstring, already parsed."""
        return _from_dict(data, source)

    # ----------------------------------------------------------------- presets
    @staticmethod
    def preset(name: str) -> "Topology":
        """A known server by name: one of `PRESETS`.

        >>> Topology.preset("rtx4090x8").gpus[5].root_complex
        'cpu1'
        """
        if name not in PRESET_LAYOUTS:
            raise TopologyError(f"unknown topology preset {name!r}; valid presets: {', '.join(PRESETS)}. "
                                f"Describe another server with Topology.from_json or Topology.virtual")
        return _from_dict(PRESET_LAYOUTS[name](), f"preset {name}")

    @staticmethod
    def virtual(*, gpus: int = 4, memory: int | str = "256MiB", root_complexes: int = 1,
                bandwidth: float | str = 16e9, uplink: float | str | None = None, upi: float | str = 20e9,
                p2p: bool = False, host_memory: int | str | None = "detect") -> "Topology":
        """CPU-backed "GPUs" with a byte budget each, for tests and CI.

        GPUs are spread over `root_complexes` in contiguous blocks (gpu0.. on cpu0), each
        block under one switch; `bandwidth` is each GPU's link (bytes/s per direction),
        `uplink` the switch's (default 2x, like x8 GPUs under an x16 uplink), `upi` the link
        between root complexes. Memory is bytes or a string with a unit ("256MiB"); bandwidths
        are bytes/s or a string in the same units, per second: "16GB/s" (or "16GB") is 16e9.
        `host_memory`: the host's DRAM (bytes, "64GiB"); "detect": this machine's; None: unknown.

        >>> Topology.virtual(gpus=4, memory="256MiB", root_complexes=2).gpu("gpu2").root_complex
        'cpu1'
        """
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise TopologyError(f"Topology.virtual got gpus={gpus!r}; gpus is a whole number (an int, not a bool), "
                                "at least 1; give e.g. gpus=4")
        if isinstance(root_complexes, bool) or not isinstance(root_complexes, int) or not 1 <= root_complexes <= gpus:
            raise TopologyError(f"Topology.virtual got root_complexes={root_complexes!r} for {gpus} GPU(s); give an "
                                f"int between 1 and {gpus}, so every root complex holds a GPU")
        mem = parse_memory(memory, f"Topology.virtual: gpu0..gpu{gpus - 1}")
        bw = parse_bandwidths("Topology.virtual", bandwidth=bandwidth, uplink=uplink, upi=upi)
        uplink = bw["uplink"] or 2 * bw["bandwidth"]
        base, extra = divmod(gpus, root_complexes)
        blocks, start = [], 0
        for r in range(root_complexes):
            size = base + (r < extra)
            blocks.append([list(range(start, start + size))])
            start += size
        dram = host_memory_bytes() if isinstance(host_memory, str) and host_memory == "detect" else host_memory
        return _from_dict(layout("virtual", blocks, spec="cpu", memory=mem, gpu_link=bw["bandwidth"], uplink=uplink,
                                  upi=bw["upi"], p2p=p2p, virtual=True, host_memory=dram), "Topology.virtual")

    # ------------------------------------------------------------ discovery
    @staticmethod
    def from_nvidia_smi(text: str, *, spec: str | DeviceSpec | Sequence[str | DeviceSpec],
                        memory: int | str | Sequence[int | str] | None = None, p2p: bool = False,
                        pcie: float | str = PCIE3_X16, uplink: float | str | None = None,
                        upi: float | str = UPI_GOLD6130, nvlink: float | str = NVLINK2,
                        name: str = "nvidia-smi") -> "Topology":
        """Build a topology from the matrix `nvidia-smi topo -m` prints.

        GPUs joined by PIX/PXB share a switch (PXB groups hold a switch per PIX group);
        NODE/PHB means the same socket, SYS different sockets; NV# adds an NVLink of # links
        (`nvlink` bytes/s each). The matrix hides the PCIe relation of NVLinked GPUs, so their
        socket comes from the CPU/NUMA affinity columns. `memory` defaults to the spec's;
        `pcie` is each GPU's link, `uplink` each switch's (default `pcie`); bandwidths are
        bytes/s or strings such as "13GB/s", as in `Topology.virtual`.

        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
        Topology.from_nvidia_smi(text, spec="rtx3090", memory="24GiB")
        """
        where = "Topology.from_nvidia_smi"
        bw = parse_bandwidths(where, pcie=pcie, uplink=uplink, upi=upi, nvlink=nvlink)
        specs = _each(spec, lambda v, at: parse_spec(v, f"{at}: spec"), where)
        mems = _each(memory, lambda v, at: None if v is None else parse_memory(v, at), where)
        return _from_dict(nvidia_smi_layout(text, spec=specs, memory=mems, p2p=p2p, name=name, **bw), name)

    @staticmethod
    def detect(*, spec: str | DeviceSpec | None = None, p2p: bool | None = None,
               upi: float | str = UPI_GOLD6130, nvlink: float | str = NVLINK2) -> "Topology":
        """The topology of this machine, from NVML (pynvml) or else `nvidia-smi`.

        The device spec is guessed from the GPU product name unless `spec` is given; P2P is
        read from the driver unless `p2p` is given; GPU link bandwidths from the PCIe
        generation and width (x 0.82 effective); the host's DRAM from psutil or /proc/meminfo.
        """
        bw = parse_bandwidths("Topology.detect", upi=upi, nvlink=nvlink)
        spec = None if spec is None else parse_spec(spec, "Topology.detect: spec")
        try:
            layout = detect_layout(spec=spec, p2p=p2p, **bw)
        except NoGPUFound as e:
            raise TopologyError(f"{e}. Describe the server instead: Topology.preset(name) with one of "
                                f"{', '.join(PRESETS)}, Topology.from_json('server.json') (schema in "
                                "mobius_fx.topology.server), or Topology.virtual(gpus=4, memory='256MiB') for CPU-backed "
                                "GPUs") from None
        return _from_dict(layout, "detected")


def _from_dict(data: Any, source: str) -> Topology:
    """The Topology a JSON-schema dict describes; errors located at `source`.

    Built with the cyclic garbage collector paused: a large file makes hundreds of thousands of
    small acyclic objects (graph dicts, f-strings), and the collections they trigger rescan the
    growing graph, which made loading superlinear (85k GPUs: minutes)."""
    paused = gc.isenabled()
    gc.disable()
    try:
        graph, attrs = graph_from_dict(data, source)
        return Topology(graph, **attrs)
    except TopologyError as e:
        raise TopologyError(f"{source}: {e}" if not str(e).startswith(source) else str(e)) from None
    finally:
        if paused:
            gc.enable()


def _each(value: Any, parse: Callable[[Any, str], Any], where: str) -> Any:
    """`parse(value, where)`: one value for every GPU, or a list or tuple of one per GPU, each
    located at its GPU ("Topology.from_nvidia_smi: GPU1")."""
    if isinstance(value, (list, tuple)):
        return [parse(v, f"{where}: GPU{i}") for i, v in enumerate(value)]
    return parse(value, where)


Topology.PRESETS = PRESETS  # also reachable from the class: Topology.PRESETS
