"""Describing a server from what the driver reports: `nvidia-smi topo -m` text, NVML, or `nvidia-smi`.

Why a module of its own: `mobius_fx.topology.server` is the topology *model* (the PCIe tree, routes,
bandwidths, JSON and presets) and needs no GPU. Discovery is a different idea: it parses a
vendor text format, shells out to `nvidia-smi`, talks to NVML and guesses device specs from
product names. Keeping it here keeps the model small and lets the parser be tested alone.

This module knows nothing of `Topology`: it returns the server as a dict in the JSON schema of
`mobius_fx.topology.server` (a GPU's spec may be a `DeviceSpec` object there), and the public entry points there, `Topology.from_nvidia_smi` and
`Topology.detect`, check their arguments and build the `Topology` from it (so the import runs
one way, topology.server -> topology.detect)::

    text = open("topo.txt").read()          # saved `nvidia-smi topo -m` output
    d = nvidia_smi_layout(text, spec=DeviceSpec.preset("rtx3090"), memory=None, p2p=False,
                          pcie=13e9, uplink=None, upi=20e9, nvlink=24e9, name="nvidia-smi")
    Topology.from_dict(d, source="nvidia-smi")
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any, Callable, Mapping, Sequence

import networkx as nx

from mobius_fx.topology.device_specs import DEVICE_SPECS
from mobius_fx.errors import TopologyError
from mobius_fx.topology.links import GB, PCIE3_X16, pcie_bandwidth

__all__ = ["nvidia_smi_layout", "detect_layout", "NoGPUFound", "host_memory_bytes"]


class NoGPUFound(TopologyError):
    """No detection route found a GPU on this machine; the message says what each route tried."""


def host_memory_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """This machine's DRAM in bytes: psutil's `virtual_memory().total` when psutil is importable,
    else MemTotal of `meminfo` (Linux); None when neither tells (the host budget is then printed
    without a limit and nothing is refused for it)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return int(psutil.virtual_memory().total)
        except (OSError, AttributeError):  # pragma: no cover (a sandbox without /proc)
            pass
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    value, unit = line.split()[1:3]
                    return int(value) * {"kb": 1024, "mb": 2**20, "gb": 2**30}.get(unit.lower(), 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def nvidia_smi_layout(text: str, *, spec: Any, memory: Any, p2p: bool, pcie: float, uplink: float | None,
                      upi: float, nvlink: float, name: str) -> dict[str, Any]:
    """The server an `nvidia-smi topo -m` matrix describes, as a JSON-schema dict.

    Arguments as `Topology.from_nvidia_smi` (which gives the defaults and what the matrix
    entries mean), already checked: bandwidths in bytes/s; `spec` and `memory` one value or
    one per GPU (a memory of None means the spec's).
    """
    gpus, rel, nvl, affinity = _parse_topo_matrix(text)
    n = len(gpus)
    return _from_relations(name, n, rel, nvl, affinity, specs=_per_gpu(spec, n, "spec"),
                           memory=_per_gpu(memory, n, "memory"), gpu_link=[pcie] * n, uplink=uplink, upi=upi,
                           nvlink=nvlink, p2p=p2p)


def detect_layout(*, spec: Any, p2p: bool | None, upi: float, nvlink: float) -> dict[str, Any]:
    """This machine's server, from NVML or else `nvidia-smi`, as a JSON-schema dict named "detected".

    Raises NoGPUFound naming every route tried (`Topology.detect` adds the ways to describe
    the server instead).

    detect_layout(spec=None, p2p=None, upi=20e9, nvlink=24e9)["nodes"]   # on a GPU machine
    """
    tried = []
    for probe in (_detect_nvml, _detect_smi):
        try:
            out = probe(spec=spec, p2p=p2p, upi=upi, nvlink=nvlink)
            dram = host_memory_bytes()
            return out if dram is None else {**out, "host": {"memory": dram}}
        except _NotHere as e:
            tried.append(str(e))
    raise NoGPUFound("found no GPUs to build a topology from: " + "; ".join(tried))


def _per_gpu(value: Any, n: int, what: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise TopologyError(f"{what} lists {len(value)} values for {n} GPUs; give one value or one per GPU")
        return list(value)
    return [value] * n


# ------------------------------------------------------------ nvidia-smi topo -m
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RELATION = re.compile(r"X|PIX|PXB|PHB|NODE|SYS|SOC|NV(\d+)")
_TRAILING = re.compile(r"CPU Affinity|NUMA Affinity|GPU NUMA ID")
_SAME_SOCKET = {"PIX", "PXB", "PHB", "NODE"}


def _parse_topo_matrix(text: str) -> tuple[list[str], dict, dict, list[str | None]]:
    """GPU names, PCIe relation per GPU pair (None where NV# hides it), NVLink counts, affinity."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    head = next((i for i, ln in enumerate(lines) if ln.split()[:1] and re.fullmatch(r"GPU\d+", ln.split()[0])
                 and (len(ln.split()) == 1 or not _RELATION.fullmatch(ln.split()[1]))), None)
    if head is None:
        raise TopologyError("no GPU columns found in the nvidia-smi text; give the output of `nvidia-smi topo -m` "
                            "(a header line 'GPU0 GPU1 ... CPU Affinity' and one row per GPU)")
    columns: list[str] = []
    for tok in lines[head].split():
        if tok in ("CPU", "NUMA", "GPU"):
            break
        columns.append(tok)
    trailing = _TRAILING.findall(lines[head])
    rows: dict[str, list[str]] = {}
    extras: dict[str, dict[str, str]] = {}
    for ln in lines[head + 1:]:
        toks = ln.split()
        if not toks:
            continue
        if toks[0].startswith("Legend"):
            break
        if toks[0] not in columns:
            raise TopologyError(f"nvidia-smi row {toks[0]!r} matches no column ({', '.join(columns)}); give the "
                                "matrix exactly as `nvidia-smi topo -m` prints it")
        if len(toks) < 1 + len(columns):
            raise TopologyError(f"nvidia-smi row {toks[0]} has {len(toks) - 1} entries for {len(columns)} columns")
        rows[toks[0]] = toks[1:1 + len(columns)]
        extras[toks[0]] = dict(zip(trailing, toks[1 + len(columns):]))
    gpus = [c for c in columns if re.fullmatch(r"GPU\d+", c)]
    for g in gpus:
        if g not in rows:
            raise TopologyError(f"nvidia-smi matrix has a column {g} but no row for it")
    col = {c: k for k, c in enumerate(columns)}
    rel: dict[tuple[int, int], str | None] = {}
    nvl: dict[tuple[int, int], int] = {}
    for i, gi in enumerate(gpus):
        for j, gj in enumerate(gpus):
            cell, back = rows[gi][col[gj]], rows[gj][col[gi]]
            m = _RELATION.fullmatch(cell)
            if m is None:
                raise TopologyError(f"nvidia-smi entry {cell!r} at row {gi}, column {gj} is not in the legend "
                                    "(X, PIX, PXB, PHB, NODE, SYS, NV#)")
            if (cell == "X") != (i == j) or cell != back:
                raise TopologyError(f"nvidia-smi entries for {gi}/{gj} disagree: {cell!r} at row {gi} but {back!r} "
                                    f"at row {gj} (and only the diagonal is X); give the unedited matrix")
            if i < j:
                rel[i, j] = None if m.group(1) else ("SYS" if cell == "SOC" else cell)
                if m.group(1):
                    nvl[i, j] = int(m.group(1))
    affinity = []
    for g in gpus:
        ex = extras[g]
        key = ex.get("NUMA Affinity", "N/A")
        affinity.append(key if key != "N/A" else (ex.get("CPU Affinity") if ex.get("CPU Affinity") != "N/A" else None))
    return gpus, rel, nvl, affinity


def _from_relations(name: str, n: int, rel: Mapping, nvl: Mapping, affinity: Sequence[str | None], *,
                    specs: Sequence[Any], memory: Sequence[Any], gpu_link: Sequence[float], uplink: float | None,
                    upi: float, nvlink: float, p2p: bool) -> dict[str, Any]:
    """Sockets from SYS/NODE (affinity where NVLink hides the PCIe relation), switches from PIX/PXB."""
    def groups(pairs: Callable[[int, int], bool], members: Sequence[int]) -> list[list[int]]:
        g = nx.Graph()
        g.add_nodes_from(members)
        g.add_edges_from((i, j) for i in members for j in members if i < j and pairs(i, j))
        return sorted((sorted(c) for c in nx.connected_components(g)), key=lambda c: c[0])

    sockets: list[list[int]] = []
    for block in groups(lambda i, j: rel[i, j] in _SAME_SOCKET, range(n)):
        for i in block:
            for j in block:
                if i < j and rel[i, j] == "SYS":
                    raise TopologyError(f"GPU{i} and GPU{j} are SYS (different sockets) but linked to one socket "
                                        "through other GPUs; give the unedited `nvidia-smi topo -m` matrix")
        keys = {affinity[i] for i in block} - {None}
        for s in sockets:
            s_keys = {affinity[i] for i in s} - {None}
            apart = any(rel[min(i, j), max(i, j)] == "SYS" for i in block for j in s)
            if not apart and not (keys and s_keys and keys != s_keys):
                s.extend(block)
                break
        else:
            sockets.append(list(block))
    d: dict[str, Any] = {"name": name, "p2p": p2p, "nodes": [], "links": []}
    gbps = lambda bw: bw / GB  # noqa: E731
    up = max(gpu_link) if uplink is None else uplink
    sw = 0
    for r, members in enumerate(sockets):
        d["nodes"].append({"name": f"cpu{r}", "kind": "root_complex"})
        d["links"] += [{"a": f"cpu{s}", "b": f"cpu{r}", "kind": "upi", "bandwidth_gbps": gbps(upi)} for s in range(r)]
        for top in groups(lambda i, j: rel[i, j] in ("PIX", "PXB"), sorted(members)):
            parent = f"cpu{r}"
            if len(top) > 1:
                parent, sw = f"sw{sw}", sw + 1
                d["nodes"].append({"name": parent, "kind": "switch"})
                d["links"].append({"a": f"cpu{r}", "b": parent, "bandwidth_gbps": gbps(up)})
            subs = groups(lambda i, j: rel[i, j] == "PIX", top)
            for sub in subs:
                below = parent
                if len(sub) > 1 and len(subs) > 1:  # a PIX pair inside a PXB group: a switch below a switch
                    below, sw = f"sw{sw}", sw + 1
                    d["nodes"].append({"name": below, "kind": "switch"})
                    d["links"].append({"a": parent, "b": below, "bandwidth_gbps": gbps(up)})
                for g in sub:
                    d["links"].append({"a": below, "b": f"gpu{g}", "bandwidth_gbps": gbps(gpu_link[g])})
    for g in range(n):  # no memory: the spec's
        gpu = {"name": f"gpu{g}", "kind": "gpu", "index": g, "spec": specs[g]}
        d["nodes"].append(gpu if memory[g] is None else {**gpu, "memory": memory[g]})
    d["links"] += [{"a": f"gpu{i}", "b": f"gpu{j}", "kind": "nvlink", "bandwidth_gbps": gbps(c * nvlink)}
                   for (i, j), c in sorted(nvl.items())]
    return d


# ----------------------------------------------------------------- detection
class _NotHere(Exception):
    """A detection route that does not apply on this machine (says why)."""


_SPEC_BY_PRODUCT = (("3090 ti", "rtx3090ti"), ("3090", "rtx3090"), ("4090", "rtx4090"), ("v100", "v100-16gb"),
                    ("a100", "a100-40gb-pcie"), ("h200", "h200"))


def _guess_spec(product: str, spec: Any) -> Any:
    if spec is not None:
        return spec
    for key, preset in _SPEC_BY_PRODUCT:
        if key in product.lower():
            return preset
    raise TopologyError(f"no DeviceSpec preset for GPU {product!r}; call Topology.detect(spec=...) with one of "
                        f"{', '.join(sorted(DEVICE_SPECS))} or a DeviceSpec of your own")


def _nvidia_smi(*args: str) -> str:
    """stdout of `nvidia-smi args`; _NotHere when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise _NotHere("`nvidia-smi` is not on PATH")
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise _NotHere(f"`nvidia-smi {' '.join(args)}` failed ({e})") from None
    if out.returncode != 0:
        raise _NotHere(f"`nvidia-smi {' '.join(args)}` exited {out.returncode}: {out.stderr.strip()[:200]}")
    return out.stdout


def _detect_smi(*, spec: Any, p2p: bool | None, upi: float, nvlink: float) -> dict[str, Any]:
    query = _nvidia_smi("--query-gpu=index,name,memory.total,pcie.link.gen.max,pcie.link.width.max",
                        "--format=csv,noheader,nounits")
    rows = [[c.strip() for c in ln.split(",")] for ln in query.splitlines() if ln.strip()]
    if not rows:
        raise _NotHere("`nvidia-smi` lists no GPUs")
    rows.sort(key=lambda r: int(r[0]))
    gpus, rel, nvl, affinity = _parse_topo_matrix(_nvidia_smi("topo", "-m"))
    if len(gpus) != len(rows):
        raise TopologyError(f"`nvidia-smi topo -m` shows {len(gpus)} GPUs but the query lists {len(rows)}")
    if p2p is None:
        p2p = len(rows) > 1 and _p2p_ok(_nvidia_smi("topo", "-p2p", "r"))
    links = [pcie_bandwidth(int(r[3]), int(r[4])) if r[3].isdigit() and r[4].isdigit() else PCIE3_X16
             for r in rows]
    return _from_relations("detected", len(rows), rel, nvl, affinity, specs=[_guess_spec(r[1], spec) for r in rows],
                           memory=[int(float(r[2])) * 2**20 for r in rows], gpu_link=links, uplink=max(links),
                           upi=upi, nvlink=nvlink, p2p=p2p)


def _p2p_ok(text: str) -> bool:
    """True when every GPU pair of `nvidia-smi topo -p2p r` reads OK."""
    cells = [c for ln in text.splitlines() if re.match(r"\s*GPU\d+\s", _ANSI.sub("", ln))
             for c in _ANSI.sub("", ln).split()[1:] if c in ("OK", "NS", "CNS", "GNS", "TNS", "NA", "U")]
    return bool(cells) and all(c == "OK" for c in cells)


def _detect_nvml(*, spec: Any, p2p: bool | None, upi: float, nvlink: float) -> dict[str, Any]:  # pragma: no cover
    try:
        import pynvml as nv
    except ImportError:
        raise _NotHere("pynvml is not installed (pip install nvidia-ml-py)") from None
    try:
        nv.nvmlInit()
    except Exception as e:  # NVMLError: no driver, no device
        raise _NotHere(f"NVML did not start ({e})") from None
    try:
        n = nv.nvmlDeviceGetCount()
        if n == 0:
            raise _NotHere("NVML sees no GPUs")
        hs = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        level = {nv.NVML_TOPOLOGY_INTERNAL: "X", nv.NVML_TOPOLOGY_SINGLE: "PIX", nv.NVML_TOPOLOGY_MULTIPLE: "PXB",
                 nv.NVML_TOPOLOGY_HOSTBRIDGE: "PHB", nv.NVML_TOPOLOGY_NODE: "NODE", nv.NVML_TOPOLOGY_SYSTEM: "SYS"}
        rel = {(i, j): level.get(nv.nvmlDeviceGetTopologyCommonAncestor(hs[i], hs[j]), "SYS")
               for i in range(n) for j in range(i + 1, n)}
        bus = {_text(nv.nvmlDeviceGetPciInfo(h).busId).lower(): i for i, h in enumerate(hs)}
        nvl: dict[tuple[int, int], int] = {}
        to_switch = [0] * n
        for i, h in enumerate(hs):
            for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if nv.nvmlDeviceGetNvLinkState(h, link) != nv.NVML_FEATURE_ENABLED:
                        continue
                    j = bus.get(_text(nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId).lower())
                except nv.NVMLError:
                    continue
                if j is None:
                    to_switch[i] += 1  # NVSwitch: every GPU with switch links reaches every other
                elif i < j:
                    nvl[i, j] = nvl.get((i, j), 0) + 1
        for i in range(n):
            for j in range(i + 1, n):
                if to_switch[i] and to_switch[j]:
                    nvl[i, j] = nvl.get((i, j), 0) + min(to_switch[i], to_switch[j])
        affinity = []
        for h in hs:
            try:
                affinity.append(str(nv.nvmlDeviceGetNumaNodeId(h)))
            except (AttributeError, nv.NVMLError):
                affinity.append(str(tuple(nv.nvmlDeviceGetCpuAffinity(h, 16))))
        links = [pcie_bandwidth(nv.nvmlDeviceGetMaxPcieLinkGeneration(h), nv.nvmlDeviceGetMaxPcieLinkWidth(h))
                 for h in hs]
        if p2p is None:
            p2p = n > 1 and all(nv.nvmlDeviceGetP2PStatus(hs[i], hs[j], nv.NVML_P2P_CAPS_INDEX_READ)
                                == nv.NVML_P2P_STATUS_OK for i in range(n) for j in range(n) if i != j)
        specs = [_guess_spec(_text(nv.nvmlDeviceGetName(h)), spec) for h in hs]
        memory = [int(nv.nvmlDeviceGetMemoryInfo(h).total) for h in hs]
    finally:
        nv.nvmlShutdown()
    return _from_relations("detected", n, rel, nvl, affinity, specs=specs, memory=memory, gpu_link=links,
                           uplink=max(links), upi=upi, nvlink=nvlink, p2p=p2p)


def _text(x: str | bytes) -> str:
    return x.decode() if isinstance(x, bytes) else x
