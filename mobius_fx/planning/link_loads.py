"""The step's bytes over each link of the topology: `LinkLoad` / `link_loads` (which copies
cross which directed link), `copy_terms` / `slot_bytes` / `link_time` (their bytes and the least
step time they allow) and `forward_backlog` (when the forward's copies over a shared link have
crossed it, which the last stages' copies to the host wait for). Read by the step model's
timeline (step_timeline.py) and the MIP (passes/_partition_mip.py), which pass numbers or linear
forms alike.

    link_loads(Topology.virtual(gpus=2), ["gpu0", "gpu1"])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["LinkLoad", "link_loads", "copy_terms", "slot_bytes", "link_time", "forward_backlog",
           "grad_link_scale"]


@dataclass(frozen=True)
class LinkLoad:
    """A directed link of the topology and the copies of the step that cross it, by GPU slot:
    `up` / `down`, the slots whose host -> GPU / GPU -> host copies do; `hop` / `hop_back`,
    the slots i whose forward activation to slot (i+1) % N / whose backward gradient from
    slot (i+1) % N does. No schedule moves the bytes of all of them in less than their sum
    over `bandwidth` (bytes/s): `timeline`'s makespan is at least that (`link_time`), as
    `Plan.lower_bound` is. The timeline's own rows see each copy at its route's bottleneck
    alone, so without this row a link that several kinds of copies share (activations relayed
    through the host behind a switch uplink, with the weights) let the prediction fall below
    the plan's lower bound (issue 26: 342 ms predicted, 391 ms bound)."""

    name: str
    bandwidth: float
    up: tuple[int, ...] = ()
    down: tuple[int, ...] = ()
    hop: tuple[int, ...] = ()
    hop_back: tuple[int, ...] = ()


def link_loads(topology: Any, gpus: Sequence[str]) -> tuple[LinkLoad, ...]:
    """Every directed link of `topology` that a copy between the host and `gpus` (slot i =
    gpus[i]) or between consecutive slots crosses, with which ones (`LinkLoad`): the links of
    `Topology.route`, the routes `plans.build_plan` gives the plan's transfers.

    link_loads(Topology.virtual(gpus=2), ["gpu0", "gpu1"])
    """
    n = len(gpus)
    kinds: dict[tuple[str, str], dict[str, list[int]]] = {}

    def cross(route: Sequence[str], kind: str, slot: int) -> None:
        for edge in zip(route, route[1:]):
            kinds.setdefault(edge, {"up": [], "down": [], "hop": [], "hop_back": []})[kind].append(slot)

    for i, g in enumerate(gpus):
        cross(topology.route("host", g), "up", i)
        cross(topology.route(g, "host"), "down", i)
        if n > 1 and gpus[(i + 1) % n] != g:
            cross(topology.route(g, gpus[(i + 1) % n]), "hop", i)
            cross(topology.route(gpus[(i + 1) % n], g), "hop_back", i)
    return tuple(LinkLoad(f"{u}->{v}", float(topology.link_bandwidth(u, v)),
                          **{k: tuple(sorted(set(xs))) for k, xs in ks.items()})
                 for (u, v), ks in kinds.items())


def grad_link_scale(problem: Any) -> float:
    """The gradient downloads' bytes on the links per byte as streamed (`HostPass.down_scale`: 2
    where the runtime widens bf16 gradients to fp32 on the GPUs), 1 without a host model."""
    host = getattr(problem, "host", None)
    return 1.0 if host is None else float(getattr(host, "down_scale", 1.0))


def copy_terms(problem: Any, st: Any) -> dict[str, list[float]]:
    """The per-stage numbers `slot_bytes` reads, from a cut set's `StageTotals`: "w" / "wb"
    weights forward / fetched again for backward, "g" weight gradients, "saved" the saved
    input per micro-batch (stage 0: the model input), "grad_in" the gradient reaching stage k
    from k+1 (the last: the outputs' gradient from the host), "out" the boundary activation
    per micro-batch. A frozen stage runs no backward: its "wb", "saved", "grad_in" are 0."""
    s = len(st.f)
    live = [not x for x in st.frozen] if st.frozen else [True] * s
    zero = lambda xs: [x if on else 0.0 for x, on in zip(xs, live)]
    return {"w": list(st.w), "wb": zero(st.w), "g": list(st.g),
            "saved": zero([problem.input_bytes / problem.microbatches, *st.out[:s - 1]]),
            "grad_in": zero(st.out), "out": list(st.out)}


def slot_bytes(problem: Any, terms: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Bytes per step of each kind of copy by GPU slot ("up", "down", "hop", "hop_back"),
    as the schedule moves them (schedule.py; `Plan.link_bytes` sums the same), from the
    per-stage `terms` (`copy_terms`; the MIP passes linear expressions): forward weights,
    backward weights (not the last N stages', which keep theirs), restores of the saved inputs
    (stage 0: the model input sent again), the model inputs and the outputs' gradients (up);
    weight gradients, offloads of the saved inputs and the outputs (down); activations forward
    and their gradients back (the hops)."""
    n, m, s = len(problem.gpus), problem.microbatches, len(terms["w"])
    widen = grad_link_scale(problem)
    out: dict[str, list[Any]] = {k: [0.0] * n for k in ("up", "down", "hop", "hop_back")}
    for k in range(s):
        i = k % n
        out["up"][i] += terms["w"][k] + m * terms["saved"][k]
        if k < s - n:
            out["up"][i] += terms["wb"][k]
        out["down"][i] += terms["g"][k] * widen  # the runtime's fp32 gradient downloads (`grad_link_scale`)
        if k:
            out["down"][i] += m * terms["saved"][k]
        if k < s - 1:
            out["hop"][i] += m * terms["out"][k]
            out["hop_back"][i] += m * terms["grad_in"][k]
    out["up"][0] += problem.input_bytes
    out["up"][(s - 1) % n] += m * terms["grad_in"][s - 1]
    out["down"][(s - 1) % n] += m * terms["out"][s - 1]
    return out


def link_time(load: LinkLoad, per_slot: dict[str, list[Any]]) -> Any:
    """The bytes of `slot_bytes` that cross `load`'s link over its bandwidth (s): a least step time."""
    total = sum(per_slot[k][i] for k in ("up", "down", "hop", "hop_back") for i in getattr(load, k))
    return total * (1 / load.bandwidth)


def forward_backlog(problem: Any, terms: dict[str, list[Any]], k: int, first: Any = 0.0) -> list[Any]:
    """Per shared link on stage k's host route (none for k <= N), when the forward's copies over
    that link, both directions, that come before k's first copy to the host have crossed it: the
    weight uploads of stages 0..k, the activation hops into stages 1..k and the offloads of
    stages 1..k-1 that cross it. k is a stage resident through the turn (k >= S-N): its copies to
    the host start no sooner (`_host_copy_starts`, the MIP's `host_copies`), because they queue on
    its GPU's download stream behind stage k-N's offloads (k-N >= 1), which the simulator serves
    last among those (it serves the copies needed first first, and k-N's backward comes after
    theirs). An
    estimate (a copy released early may end before others that it counts), not a bound. Before the first forward run ends
    (`first`, F[0][0] + f_0) only uploads cross (at most the bandwidth); after it the two
    directions together carry at most 2d x the bandwidth (d: `PartitionProblem.duplex`, a
    switch's 0.72). benchmarks/plan_quality.py's compute-bound case (8 stages, 4 GPUs behind one
    switch): stage 3's offloads ended 10 ms after its forward runs, the last stage's outputs
    behind them; without this term the turn came 5.5 ms before the simulator's and the step was
    predicted at 0.90 of it. `terms`: `copy_terms` (the MIP passes linear forms, and its F[0][0]
    + f_0 as `first`: one row each)."""
    n, m = len(problem.gpus), problem.microbatches
    if k - n < 1:  # no offloads of stage k-N before k's copies on its GPU (k-N = 0 saves none)
        return []
    pairs: dict[frozenset, list[Any]] = {}
    for x in getattr(problem, "links", ()):
        if len(set((*x.up, *x.down, *x.hop, *x.hop_back))) > 1:  # a link more than one GPU's copies cross
            pairs.setdefault(frozenset(x.name.split("->")), []).append(x)
    out: list[Any] = []
    d = (problem.duplex or (1.0,) * n)[k % n]
    for pair in pairs.values():
        if not any(k % n in x.down for x in pair):
            continue
        total: Any = 0.0
        for x in pair:
            total += sum(terms["w"][j] for j in range(k + 1) if j % n in x.up)
            total += sum(m * terms["out"][j] for j in range(k) if j % n in x.hop)
            total += sum(m * terms["saved"][j] for j in range(1, k) if j % n in x.down)
        out.append(total * (1 / (2 * d * min(x.bandwidth for x in pair))) + first * (1 - 1 / (2 * d)))
    return out
