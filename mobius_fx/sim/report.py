"""The schedule comparison table printed by the CLI, the examples and benchmarks/paper.py, and
the data-parallel cluster table (`plan --servers R --network ...`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tabulate import tabulate

from mobius_fx.errors import PlanError
from mobius_fx import schedules
from mobius_fx.planning.plans import Plan
from mobius_fx.units import fmt_bytes, fmt_time

__all__ = ["Comparison", "compare", "Cluster", "cluster", "server_counts"]



@dataclass(frozen=True)
class Comparison:
    """Simulated step times of every schedule on one plan's costs and topology."""

    plan: Plan
    results: dict  # schedule -> SimResult, or the PlanError text when it cannot run

    def step_time(self, schedule: str) -> float | None:
        r = self.results.get(schedule)
        return None if r is None or isinstance(r, str) else r.step_time

    def speedup(self, over: str, schedule: str = "mobius") -> float | None:
        a, b = self.step_time(schedule), self.step_time(over)
        return None if a is None or b is None else b / a

    def table(self) -> str:
        lb = self.plan.lower_bound()
        base = self.step_time("mobius")
        rows = []
        for name in schedules.names():  # the registry's order
            r = self.results.get(name)
            if r is None:
                continue
            if isinstance(r, str):
                rows.append([name, "does not fit", "", "", "", "", r[:70]])
                continue
            pcie = sum(r.link_bytes.values())
            rows.append([name, fmt_time(r.pipeline_time), fmt_time(r.step_time),
                         f"{r.step_time / base:.2f}x" if base else "",
                         f"{r.pipeline_time / lb:.2f}" if lb else "", fmt_bytes(pcie), ""])
        table = tabulate(rows, headers=["schedule", "fwd+bwd", "step (+CPU Adam)", "step vs mobius",
                                        "fwd+bwd / lower bound", "bytes on links", "note"])
        mobius = self.results.get("mobius")
        if mobius is None or isinstance(mobius, str):
            return table
        ds = "".join(f"\n{name}'s DeepSpeedCPUAdam: {r.optimizer_bandwidth / 1e9:.1f} GB/s "
                     f"({r.host_sources.get('optimizer', '')})" for name in schedules.names()
                     if schedules.get(name).optimizer == "deepspeed"
                     and (r := self.results.get(name)) is not None and not isinstance(r, str))
        return f"{table}\n{mobius.host_line()}{ds}"


def compare(plan: Plan, names=None, *, cpu_adam_bandwidth: float | None = None,
            deepspeed_adam_bandwidth: float | None = None, masters: str | None = None,
            optimizer_overlap: str = "none", keep_grads: bool = True) -> Comparison:
    """Simulate `plan` under each schedule of `names` (default: every registered one,
    `mobius_fx.schedules.names()`, in its order), with the same costs, topology and simulator.

    `cpu_adam_bandwidth` (bytes/s) sets the CPU optimizer's speed; None takes the topology's
    measured host section, else the simulator's default (a fused AdamW measured on the H200
    run's host, mobius_fx.planning.host_step.CPU_ADAM_BANDWIDTH); `deepspeed_adam_bandwidth` that of
    ZeRO-3's DeepSpeedCPUAdam (None: measured, else the same speed), `masters` where host memory
    lives, `optimizer_overlap` when the CPU optimizer steps and `keep_grads` whether the overlap
    writes the fp32 `.grad` (all: see `mobius_fx.simulate`).
    """
    from mobius_fx.sim.simulator import simulate

    results: dict = {}
    for name in schedules.names() if names is None else names:
        try:
            results[name] = simulate(plan, schedule=name, cpu_adam_bandwidth=cpu_adam_bandwidth,
                                     deepspeed_adam_bandwidth=deepspeed_adam_bandwidth, masters=masters,
                                     optimizer_overlap=optimizer_overlap, keep_grads=keep_grads)
        except PlanError as e:
            results[name] = str(e)
    return Comparison(plan, results)


def server_counts(servers: int) -> list[int]:
    """The cluster sizes the table shows: 1, the powers of two below `servers`, and `servers`.

    >>> server_counts(4), server_counts(6), server_counts(1)
    ([1, 2, 4], [1, 2, 4, 6], [1])
    """
    out, r = [], 1
    while r < servers:
        out.append(r)
        r *= 2
    return out + [servers]


@dataclass(frozen=True)
class Cluster:
    """Simulated data-parallel steps of one plan on 1..R servers (`cluster`): `results[R]` is one
    server's SimResult among R, `tokens` the tokens one server runs per step."""

    plan: Plan
    tokens: int
    network: float  # bytes/s per direction of each server's NIC
    results: dict  # servers -> SimResult

    def throughput(self, servers: int) -> float:
        """Tokens per second of the whole cluster: R x tokens per server / step time."""
        return servers * self.tokens / self.results[servers].step_time

    def efficiency(self, servers: int) -> float:
        """Scaling efficiency vs one server: throughput_R / (R x throughput_1)."""
        return self.throughput(servers) / (servers * self.throughput(1))

    def table(self) -> str:
        rows = []
        for r, res in sorted(self.results.items()):
            rows.append([r, f"{r * self.tokens:,}", fmt_time(res.step_time), f"{self.throughput(r):,.0f}",
                         f"{self.efficiency(r):.1%}", fmt_time(res.pipeline_time),
                         fmt_time(res.allreduce_time) if r > 1 else "-",
                         fmt_time(res.allreduce_exposed) if r > 1 else "-", fmt_time(res.optimizer_time),
                         fmt_bytes(res.nic_bytes) if r > 1 else "-"])
        return tabulate(rows, headers=["servers", "global batch (tokens)", "step", "throughput (tokens/s)",
                                       "scaling efficiency", "pipeline", "all-reduce (NIC busy)",
                                       "all-reduce exposed", "optimizer", "NIC bytes each way"],
                        disable_numparse=True)


def cluster(plan: Plan, servers: int, network: float | str, *, tokens: int, schedule: str = "mobius",
            counts: list[int] | None = None, cpu_adam_bandwidth: float | None = None,
            optimizer_overlap: str = "none", network_latency: float | None = None,
            keep_grads: bool = True) -> Cluster:
    """Simulate `plan` data parallel on each of `counts` servers (default `server_counts(servers)`,
    always with 1) over NICs of `network` (bytes/s, "100Gbps", or math.inf): one server's step
    among R, the ring all-reduce of every stage's gradients on its NIC (see `mobius_fx.simulate`).
    `tokens` is what one server runs per step (batch x sequence length), for the throughput."""
    from mobius_fx.sim.simulator import simulate
    from mobius_fx.units import parse_network

    bw = math.inf if isinstance(network, float) and network == math.inf else parse_network(network)
    counts = sorted(set([1, *(counts if counts is not None else server_counts(servers))]))
    results = {r: simulate(plan, schedule=schedule, cpu_adam_bandwidth=cpu_adam_bandwidth,
                           optimizer_overlap=optimizer_overlap, servers=r, network=bw, network_latency=network_latency,
                           keep_grads=keep_grads)
               for r in counts}
    return Cluster(plan, tokens, bw, results)
