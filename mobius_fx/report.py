"""The schedule comparison table printed by the CLI, the examples and benchmarks/paper.py."""

from __future__ import annotations

from dataclasses import dataclass

from tabulate import tabulate

from .errors import PlanError
from .plans import Plan
from .units import fmt_bytes, fmt_time

__all__ = ["SCHEDULES", "Comparison", "compare"]

SCHEDULES = ("mobius", "mobius-noprefetch", "mobius-identity-map", "gpipe", "zero3-offload", "roundpipe")


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
        for name in SCHEDULES:
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
        return tabulate(rows, headers=["schedule", "fwd+bwd", "step (+CPU Adam)", "step vs mobius",
                                       "fwd+bwd / lower bound", "bytes on links", "note"])


def compare(plan: Plan, schedules=SCHEDULES, *, cpu_adam_bandwidth: float | None = None,
            deepspeed_adam_bandwidth: float | None = None, masters: str | None = None,
            optimizer_overlap: str = "none") -> Comparison:
    """Simulate `plan` under every schedule (same costs, same topology, same simulator).

    `cpu_adam_bandwidth` (bytes/s) sets the CPU optimizer's speed; None takes the simulator's
    default for a plain torch.optim.Adam (see mobius_fx.simulator.CPU_ADAM_BANDWIDTH);
    `deepspeed_adam_bandwidth` that of ZeRO-3's DeepSpeedCPUAdam, `masters` where host memory
    lives, `optimizer_overlap` when the CPU optimizer steps (all: see `mobius_fx.simulate`).
    """
    from .simulator import simulate

    results: dict = {}
    for name in schedules:
        try:
            results[name] = simulate(plan, schedule=name, cpu_adam_bandwidth=cpu_adam_bandwidth,
                                     deepspeed_adam_bandwidth=deepspeed_adam_bandwidth, masters=masters,
                                     optimizer_overlap=optimizer_overlap)
        except PlanError as e:
            results[name] = str(e)
    return Comparison(plan, results)
