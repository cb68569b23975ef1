"""When each stage's gradients are all on the host, for the host's work that waits for them
(`host_step.HostPass`: sync's passes, async's hand-overs into the fp32 `.grad`): a fluid replay
of the step's gradient downloads and of the backward uploads that share links with them, as the
simulator (mobius_fx/sim/network.py) serves them.

The step model's D (`step_timeline._gradient_downloads`) queues the downloads in stage order
and charges the duplex per GPU (the MIP's rows). With a host model the timeline ends the
pipeline at the last landing of this replay instead (fp32 downloads made D 4.8 ms short on
benchmarks/plan_quality.py's compute-bound case), and the host's chain reads *each* stage's
landing, where the order matters: the simulator shares a switch uplink
max-min fairly among copies of equal need (every gradient download is needed by the
optimizer alone), serves a copy needed sooner first (a backward weight prefetch, a restore:
full speed, the downloads get what is left), and a link at a switch carries both directions
together at most its duplex share d x (both bandwidths). So while a GPU behind a switch takes
its backward weights at full speed, the downloads crossing the same links get 2d - 1 of their
speed (0.44 at d = 0.72), and the gradients land later than a replay of the downloads alone
says (benchmarks/plan_quality.py's link-bound case under async: stage 6's 227 MB landed at
192 ms planned, 223 ms simulated, and the hand-overs after it chained from there). Without
peer-to-peer the backward activation gradients are relayed through the host across the same
uplink, needed sooner than any download: they go first too (`Hop`).

    shared_landings(problem, grads, ready, D, uploads)
"""

from __future__ import annotations

import math
from typing import Any, Sequence

__all__ = ["Upload", "Hop", "shared_landings"]

# (slot, release time, bytes, rank): a backward upload on slot's host link (its weights fetched
# again and the saved inputs restored after them), released at that time; rank orders it against
# the other uploads on a shared link (smaller first: the simulator's `copy_need`, stage k's 2S-1-k).
Upload = tuple[int, float, float, float]
# (slot from, slot to, release time, bytes, rank): a backward activation gradient relayed through
# the host (no peer-to-peer), out of `from`'s host link and into `to`'s, released when the run
# that made it ends; ranked as an upload (the simulator's `copy_need`), ahead of every download.
Hop = tuple[int, int, float, float, float]


def _rates(flows: dict[Any, tuple[float, tuple]], caps: dict[Any, float]) -> dict[Any, float]:
    """Max-min fair rates by priority class: `flows` maps a flow to (its class, smaller first;
    the resources it uses), `caps` each resource's bytes/s; each class fills what the ones
    before it left (progressive filling, as sim/network.py's `_fill`)."""
    left, rate = dict(caps), {}
    classes: dict[float, dict] = {}
    for f, (c, r) in flows.items():
        classes.setdefault(c, {})[f] = r
    for cls in sorted(classes):
        todo = classes[cls]
        if len(todo) == 1:  # one flow (an upload of its own rank): what its resources have left
            (f, r), = todo.items()
            rate[f] = share = min(left[x] for x in r)
            for x in r:
                left[x] = max(0.0, left[x] - share)
            continue
        while todo:
            users: dict[Any, int] = {}
            for r in todo.values():
                for x in r:
                    users[x] = users.get(x, 0) + 1
            share = min(left[x] / u for x, u in users.items())
            tight = {x for x, u in users.items() if left[x] / u <= share * (1 + 1e-12)}
            for f in [f for f, r in todo.items() if tight.intersection(r)]:
                rate[f] = share
                for x in todo.pop(f):
                    left[x] = max(0.0, left[x] - share)
    return rate


def _resources(problem: Any) -> tuple[dict[Any, float], list[tuple], list[tuple]]:
    """(capacities, per slot the resources its uploads cross, per slot its downloads'): its own
    host link each way and, below duplex 1, both ways together; each shared uplink each way
    (`servers` x the fastest of its slots) and, below duplex 1, both ways together."""
    n = len(problem.gpus)
    dx = problem.duplex or (1.0,) * n
    caps: dict[Any, float] = {}
    ups: list[list] = [[] for _ in range(n)]
    downs: list[list] = [[] for _ in range(n)]
    for i in range(n):
        caps[("up", i)], caps[("down", i)] = problem.up[i], problem.down[i]
        ups[i].append(("up", i))
        downs[i].append(("down", i))
        if dx[i] < 1:
            caps[("both", i)] = dx[i] * (problem.up[i] + problem.down[i])
            ups[i].append(("both", i))
            downs[i].append(("both", i))
    links: dict[tuple[int, ...], dict[str, float]] = {}
    for way, shared, speed in (("up", problem.shared_up, problem.up), ("down", problem.shared_down, problem.down)):
        for x in shared:
            links.setdefault(tuple(sorted(x.slots)), {})[way] = x.servers * max(speed[i] for i in x.slots)
    for slots, cap in links.items():
        for way, users in (("up", ups), ("down", downs)):
            if way in cap:
                caps[(way, slots)] = cap[way]
                for i in slots:
                    users[i].append((way, slots))
        d = min(dx[i] for i in slots)
        if d < 1:
            caps[("both", slots)] = d * (cap.get("up", cap.get("down")) + cap.get("down", cap.get("up")))
            for i in slots:
                ups[i].append(("both", slots))
                downs[i].append(("both", slots))
    return caps, [tuple(r) for r in ups], [tuple(r) for r in downs]


def shared_landings(problem: Any, grads: Sequence[float], ready: Sequence[float], D: Sequence[float],
                    uploads: Sequence[Upload] = (), hops: Sequence[Hop] = ()) -> list[float]:
    """When each stage's gradients are all on the host (the module docstring): a fluid replay of
    each GPU's gradient downloads, in stage order k, k-N, ... (stage k's `grads[k]` bytes from
    its last backward run's end, `ready[k]`), and of its backward `uploads` (in the order given
    per slot, serial on its upload stream, each from its release), uploads first on every link
    they share with the downloads (by rank among themselves), the downloads max-min fairly
    among themselves, each at most its own link's speed, a shared uplink's `servers` x the
    fastest of its slots each way and, below duplex 1, a link's two directions together at
    most its duplex share of both. `hops` (`Hop`) cross the links of their sender's downloads
    and of their receiver's uploads, each from its release, ahead of the downloads (a relayed
    activation gradient takes a switch uplink's both ways, and its duplex budget, from them).
    D (`step_timeline._gradient_downloads`) where nothing is
    shared and every link is full duplex: there the replay is D. `problem`: a
    `step_model.PartitionProblem` (its `up`, `down`, `shared_up`, `shared_down`, `duplex`)."""
    n, s = len(problem.gpus), len(grads)
    if not problem.shared_down and all(d >= 1 for d in (problem.duplex or ())):
        return list(D)
    caps, up_res, down_res = _resources(problem)
    downs = {i: [k for k in range(s - 1, -1, -1) if k % n == i] for i in range(n)}
    ups: dict[int, list[Upload]] = {i: [u for u in uploads if u[0] == i and u[2] > 0] for i in range(n)}
    active: dict[tuple, list] = {}  # (way, slot): [bytes left, class, resources, stage k or the upload's bytes]
    land, t, left = list(D), 0.0, s
    pending = sorted((h for h in hops if h[3] > 0), key=lambda h: h[2])
    for _ in range(8 * (s + len(uploads) + len(pending)) + 8):
        releases = []
        while pending and pending[0][2] <= t + 1e-15:
            h = pending.pop(0)
            active[("h", len(pending), h[0])] = [h[3], h[4], tuple(dict.fromkeys(down_res[h[0]] + up_res[h[1]])), h[3]]
        if pending:
            releases.append(pending[0][2])
        for i in range(n):  # each GPU's next copy each way once the one before it ended
            while downs[i] and ("d", i) not in active and ready[downs[i][0]] <= t + 1e-15:
                k = downs[i].pop(0)
                if grads[k] > 0:
                    active[("d", i)] = [grads[k], math.inf, down_res[i], k]
                else:
                    land[k], left = max(t, ready[k]), left - 1
            if downs[i] and ("d", i) not in active:
                releases.append(ready[downs[i][0]])
            if ups[i] and ("u", i) not in active:
                if ups[i][0][1] <= t + 1e-15:
                    u = ups[i].pop(0)
                    active[("u", i)] = [u[2], u[3], up_res[i], u[2]]
                else:
                    releases.append(ups[i][0][1])
        if not left:
            break
        if not active:
            t = max(t, min(releases))
            continue
        rate = _rates({f: (a[1], a[2]) for f, a in active.items()}, caps)
        dt = min([active[f][0] / rate[f] for f in active if rate[f] > 0] + [r - t for r in releases if r > t])
        t += dt
        for f in list(active):
            a = active[f]
            a[0] -= rate[f] * dt
            if a[0] <= 1e-9 * (grads[a[3]] if f[0] == "d" else a[3]):
                del active[f]
                if f[0] == "d":
                    land[a[3]], left = t, left - 1
    return land
