"""`simulate`'s arguments, checked: the topology, where host memory lives, the data-parallel
network, and the host's measured figures (the optimizer's and the host copies' bytes/s, and
where each came from)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mobius_fx import schedules
from mobius_fx.errors import MobiusError
from mobius_fx.planning.plans import Plan
from mobius_fx.sim.tasks import NETWORK_LATENCY
from mobius_fx.planning.host_step import CPU_ADAM_BANDWIDTH, HOST_COPY_BANDWIDTH, HOST_COPY_KINDS
from mobius_fx.topology.schema import MIN_BANDWIDTH
from mobius_fx.topology.presets import PRESETS
from mobius_fx.topology.server import Topology
from mobius_fx.units import check_positive, parse_network

__all__ = ["topology_of", "masters_of", "network_of", "check_gpus", "host_rates", "host_copies_of", "keep_grads_of",
           "rate", "ideal", "MEASURED"]


def topology_of(plan: Plan, topology: Any) -> Topology:
    """`simulate(topology=)`: a Topology, a preset name or a JSON file (path or text), or None for the plan's."""
    if topology is not None and not isinstance(topology, Topology):
        if not isinstance(topology, str):
            raise MobiusError(f"topology={topology!r} is a {type(topology).__name__}; pass a Topology, a preset name "
                              f"({', '.join(PRESETS)}) or a JSON file path, or None for the plan's")
        text = topology.strip()
        topology = Topology.from_json(topology) if text.endswith(".json") or text.startswith("{") else \
            Topology.preset(topology)
    topo = topology if topology is not None else plan.topology
    if topo is None:
        raise MobiusError("the plan carries no topology; pass simulate(plan, topology=Topology.preset(...))")
    return topo


def masters_of(masters: str, topo: Topology) -> str:
    """`simulate(masters=)`, checked: "local" or one of the topology's root complexes."""
    if masters != "local" and masters not in topo.root_complexes:
        raise MobiusError(f"masters={masters!r}; host memory lives either 'local' (each stage on its GPU's socket) "
                          f"or on one root complex of topology {getattr(topo, 'name', '')!r}: "
                          f"{', '.join(topo.root_complexes)}; pass one of those")
    return masters


def network_of(spec: Any, servers: Any, network: Any, network_latency: Any) -> tuple[float, float]:
    """`simulate(servers=, network=, network_latency=)`, checked: the NIC's bytes/s (inf for one
    server or an ideal network) and the latency of one ring step."""
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise MobiusError(f"servers={servers!r}; give the number of data-parallel servers, an integer >= 1 "
                          f"(1: this server alone)")
    net = math.inf
    if servers > 1:
        if network is None:
            raise MobiusError(f"servers={servers} needs the network: pass network= each server's NIC bandwidth, "
                              f"bytes/s or a string such as '100Gbps' or '12.5GB/s'")
        if not spec.data_parallel:
            raise MobiusError(f"servers={servers} simulates data parallel over the schedules that step a CPU optimizer "
                              f"per stage ({', '.join(schedules.data_parallel_names())}), not {spec.name!r}; simulate "
                              f"{spec.name!r} with servers=1")
        net = math.inf if ideal(network) else rate(parse_network(network, "network"), "network", network)
    elif network is not None and not ideal(network):
        rate(parse_network(network, "network"), "network", network)  # checked; one server sends nothing
    alpha = NETWORK_LATENCY if network_latency is None else network_latency
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < math.inf:
        raise MobiusError(f"network_latency={network_latency!r}; give the seconds one ring step adds (>= 0, "
                          f"finite), e.g. 30e-6, or None for {NETWORK_LATENCY}")
    return net, alpha


def check_gpus(plan: Plan, topo: Topology) -> None:
    """The plan's GPUs are all in `topo`."""
    by_name = {g.name: g for g in topo.gpus}
    missing = [g for g in plan.order if g not in by_name]
    if missing:
        raise MobiusError(f"the plan runs on {', '.join(missing)}, which topology {getattr(topo, 'name', '')!r} "
                          f"lacks ({', '.join(by_name)}); simulate on the plan's topology or re-plan")


MEASURED = "measured on this host"  # a figure from the topology's "host" section (SimResult.host_sources)


def host_rates(topo: Any, cpu_adam_bandwidth: Any, deepspeed_adam_bandwidth: Any,
                host_copy_bandwidth: Any) -> tuple[float, float | None, float, dict[str, str]]:
    """The optimizer's, DeepSpeed's (None: the optimizer's) and the host copies' bytes/s, each
    from its argument, else the topology's host section, else the default; and where each came
    from (SimResult.host_sources)."""
    host = getattr(topo, "host", None)
    measured = host.optimizer_bytes_per_s if host is not None else None
    deepspeed = host is not None and host.implementation == "deepspeed"
    kernel = f"{host.optimizer}, {host.implementation or 'kernel not named'}" if host is not None else ""
    sources: dict[str, str] = {}
    if cpu_adam_bandwidth is not None:
        bw, sources["optimizer"] = rate(check_positive(
            cpu_adam_bandwidth, "cpu_adam_bandwidth",
            f"give the optimizer's bytes/s, e.g. {CPU_ADAM_BANDWIDTH:.3g}, or None for the topology's or the default"),
            "cpu_adam_bandwidth", cpu_adam_bandwidth), "given"
    elif measured is not None and not deepspeed:
        bw, sources["optimizer"] = measured, f"{MEASURED}: {kernel}"
    else:
        bw, sources["optimizer"] = CPU_ADAM_BANDWIDTH, "default: fused AdamW measured on the H200 run's 16-core host"
    if deepspeed_adam_bandwidth is not None:
        ds, sources["deepspeed"] = rate(check_positive(
            deepspeed_adam_bandwidth, "deepspeed_adam_bandwidth",
            "give DeepSpeedCPUAdam's bytes/s, e.g. 1.1e11, or None for the topology's or the optimizer's"),
            "deepspeed_adam_bandwidth", deepspeed_adam_bandwidth), "given"
    elif measured is not None and deepspeed:
        ds, sources["deepspeed"] = measured, f"{MEASURED}: {kernel}"
    else:
        ds, sources["deepspeed"] = None, f"DeepSpeed's not measured: the optimizer's speed, {sources['optimizer']}"
    if host_copy_bandwidth is not None:
        copy, sources["host copies"] = rate(check_positive(
            host_copy_bandwidth, "host_copy_bandwidth",
            f"give the host copies' bytes/s, e.g. {HOST_COPY_BANDWIDTH:.3g}, or None for the topology's or the default"),
            "host_copy_bandwidth", host_copy_bandwidth), "given"
    elif host is not None and host.host_copy_bytes_per_s is not None:
        copy, sources["host copies"] = host.host_copy_bytes_per_s, MEASURED
    else:
        copy, sources["host copies"] = HOST_COPY_BANDWIDTH, "default: the gradient hand-over measured on the H200 run's host"
    return bw, ds, copy, sources


def keep_grads_of(given: Any) -> bool:
    """`simulate(keep_grads=)`, checked: the overlap's `OverlapOptimizer.keep_grads`."""
    if not isinstance(given, bool):
        raise MobiusError(f"keep_grads={given!r}; it must be True (the overlap writes the fp32 .grad, the "
                          f"runtime's default) or False (a loop with opt.keep_grads = False)")
    return given


def host_copies_of(given: Any) -> dict[str, float]:
    """`simulate(host_copies=)`: kind -> bytes per parameter (per 4 master bytes), checked."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise MobiusError(f"host_copies={given!r}; give a dict of host copy kind -> bytes per parameter, "
                          f"e.g. {{'handover': 0}}; kinds: {', '.join(HOST_COPY_KINDS)}")
    out = {}
    for kind, nbytes in given.items():
        if kind not in HOST_COPY_KINDS:
            renamed = "; 'staging' is now called 'pin'" if kind == "staging" else ""
            raise MobiusError(f"host_copies has {kind!r}, not a host copy the simulator models; use one of "
                              f"{', '.join(HOST_COPY_KINDS)}{renamed}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not 0 <= nbytes < math.inf:
            raise MobiusError(f"host_copies[{kind!r}] is {nbytes!r}; give the bytes read + written per "
                              f"parameter, a finite number >= 0 (0: the runtime makes no such pass)")
        out[kind] = float(nbytes)
    return out


def rate(x: float, name: str, given: Any) -> float:
    """A bandwidth in bytes/s of at least 1 MB/s (topology.schema.MIN_BANDWIDTH): slower is a unit
    mistake (GB/s given as bytes/s) that would simulate hour-long steps."""
    if x < MIN_BANDWIDTH:
        raise MobiusError(f"{name}={given!r} is {x:.3g} bytes/s; a rate must be at least 1 MB/s (1e6 bytes/s), "
                          f"slower is a unit mistake: give bytes/s, e.g. 2e10")
    return x


def ideal(network: Any) -> bool:
    """`network=math.inf`: an infinitely fast network (the all-reduces take no time)."""
    return isinstance(network, (int, float)) and not isinstance(network, bool) and network == math.inf
