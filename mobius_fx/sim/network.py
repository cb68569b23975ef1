"""The event engine under `simulate`: tasks on serial streams, transfers as flows on links.

Two pieces, one idea (replaying a task graph on a machine's streams and links in time):

- `max_min_rates` / `FlowNetwork`: a flow-level model of the PCIe/NVLink fabric. Concurrent
  transfers share every directed link of their route max-min fairly (progressive filling:
  raise all rates together, freeze the flows of a link when it saturates, repeat), and are
  re-rated whenever a flow starts or finishes. Each direction of a link is its own resource
  (PCIe is full duplex), so H2D and D2H on one link do not interfere -- unless the link has a
  `duplex` factor d < 1 (PCIe switches show it, `mobius_fx.topology.links.SWITCH_DUPLEX`): then the two
  directions together carry at most d x (both bandwidths), one more resource shared max-min
  fairly by the flows of both directions (one direction alone still runs at full speed for
  d >= 0.5). Flows carry a `priority` (smaller first): a link serves its most urgent flows
  first, max-min fairly among equals, and lower classes get what is left (strict priority: the
  transfer needed first goes first, as Mobius's prototype intends with its stream priorities).
- `replay`: an event-driven run of `Task`s. A task waits for the end (or the start) of the
  tasks it depends on, then for its stream (one task at a time per stream; among ready tasks
  the smallest `priority` goes first, i.e. "the one needed first"). Compute tasks take
  `duration` seconds; transfer tasks take as long as their flow needs.

    >>> net = FlowNetwork({("a", "b"): 1e9})
    >>> net.add("x", (("a", "b"),), 1e9, now=0.0); net.add("y", (("a", "b"),), 1e9, now=0.0)
    >>> net.next_finish()[0]      # two flows on one link: each at half rate
    2.0
    >>> max_min_rates({"x": [("a", "b")], "y": [("a", "b")]}, {("a", "b"): 1.0}, priority={"x": (0,), "y": (1,)})
    {'x': 1.0, 'y': 0.0}

Per event the work is O(active flows x route length) times the number of distinct bottleneck
levels, so thousands of flows replay in well under a second.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence

from mobius_fx.errors import MobiusError

__all__ = ["Link", "max_min_rates", "FlowNetwork", "LinkSegment", "Task", "Replay", "replay", "run_flows"]

Link = tuple[str, str]

_REL = 1e-9  # relative tolerance for "this flow is done" and "these shares are equal"


def max_min_rates(flows: Mapping[Hashable, Sequence[Link]],
                  capacity: Mapping[Link, float], *, priority: Mapping[Hashable, tuple] | None = None,
                  duplex: Mapping[Link, float] | Callable[[Link], float] | None = None) -> dict[Hashable, float]:
    """Max-min fair rate (bytes/s) of each flow, given the directed links each one crosses.

    Progressive filling: every unfrozen flow gets the same rate until some link is full; the
    flows on that link are frozen at that rate, the others keep rising. A flow held back by
    one link so leaves its unused share of its other links to the flows there. With
    `priority` (flow -> tuple, smaller first) each class fills what the classes before it left;
    with `duplex` (link -> factor in [0.5, 1]) a link's two directions share d x their sum.

    >>> max_min_rates({"x": [("a", "b")], "y": [("a", "b"), ("b", "c")]},
    ...               {("a", "b"): 10.0, ("b", "c"): 2.0})
    {'y': 2.0, 'x': 8.0}
    """
    factor = _factor_of(duplex)
    cap = _capacity_of(capacity, factor)
    rates, _ = _fill({k: _resources(tuple(v), factor) for k, v in flows.items()}, cap, priority)
    return rates


def _factor_of(duplex: Mapping[Link, float] | Callable[[Link], float] | None) -> Callable[[Link], float]:
    if duplex is None:
        return lambda link: 1.0
    table = duplex if isinstance(duplex, Mapping) else None
    seen: dict[Link, float] = {}

    def factor(link: Link) -> float:
        if link not in seen:
            f = table.get(link, 1.0) if table is not None else duplex(link)  # type: ignore[operator]
            f = 1.0 if f is None else float(f)
            if not 0.5 <= f <= 1.0:
                raise MobiusError(f"link {link[0]} -> {link[1]} has duplex factor {f}; it is the share of each "
                                  f"direction's bandwidth left when both directions are busy, between 0.5 and 1 "
                                  f"(1 = full duplex); fix the topology")
            seen[link] = f
        return seen[link]

    return factor


def _resources(links: tuple[Link, ...], factor: Callable[[Link], float]) -> tuple:
    """A flow's links plus the duplex budget ("<->", a, b), a < b, of each link whose two
    directions interfere (one resource for both directions of the physical link)."""
    pairs = tuple(("<->", *sorted(link)) for link in links if factor(link) < 1.0)
    return links + pairs


def _capacity_of(capacity: Mapping[Link, float] | Callable[[Link], float],
                 factor: Callable[[Link], float]) -> Callable[[Hashable], float]:
    if isinstance(capacity, Mapping):
        def cap_of(link: Link) -> float:
            if link not in capacity:
                raise MobiusError(f"no bandwidth for link {link[0]} -> {link[1]}; give every link a flow crosses, "
                                  f"and both directions of a link with a duplex factor below 1")
            return capacity[link]
    else:
        cap_of = capacity

    def cap(resource: Hashable) -> float:
        if len(resource) == 3:  # a duplex budget: d x (a->b + b->a)
            _, a, b = resource
            return factor((a, b)) * (float(cap_of((a, b))) + float(cap_of((b, a))))
        return float(cap_of(resource))

    return cap


def _fill(flows: Mapping[Hashable, tuple[Hashable, ...]], cap_of: Callable[[Hashable], float],
          priority: Mapping[Hashable, tuple] | None = None
          ) -> tuple[dict[Hashable, float], dict[Hashable, Hashable | None]]:
    cap: dict[Hashable, float] = {}
    for links in flows.values():
        for link in links:
            if link not in cap:
                c = float(cap_of(link))
                if not c > 0:
                    raise MobiusError(f"link {link[0]} -> {link[1]} has bandwidth {c}; every link needs a "
                                      f"positive bandwidth in bytes/s (fix the topology)")
                cap[link] = c
    rates: dict[Hashable, float] = {}
    bottleneck: dict[Hashable, Hashable | None] = {}
    for key, links in flows.items():
        if not links:  # same node: no link to share, moves at once
            rates[key] = math.inf
            bottleneck[key] = None
    prio = priority or {}
    classes: dict[tuple, list[Hashable]] = {}
    for key in flows:
        if key not in rates:
            classes.setdefault(tuple(prio.get(key, ())), []).append(key)
    for cls in sorted(classes):
        users: dict[Hashable, list[Hashable]] = {}
        for key in classes[cls]:
            for link in flows[key]:
                users.setdefault(link, []).append(key)
        count = {link: len(u) for link, u in users.items()}
        while count:
            share = min(cap[l] / n for l, n in count.items())
            tight = [l for l, n in count.items() if cap[l] / n <= share * (1 + _REL)]
            for link in tight:
                for key in users[link]:
                    if key in rates:
                        continue
                    rates[key] = share
                    bottleneck[key] = link
                    for other in flows[key]:
                        cap[other] = max(0.0, cap[other] - share)
                        count[other] -= 1
            count = {l: n for l, n in count.items() if n > 0}
    return rates, bottleneck


@dataclass(frozen=True)
class LinkSegment:
    """A span of time in which the same flows shared a link (for link_busy and the trace)."""

    link: Link
    start: float
    end: float
    flows: tuple[Hashable, ...]


class _Flow:
    __slots__ = ("key", "links", "resources", "priority", "size", "remaining", "rate", "bottleneck", "by_link")

    def __init__(self, key: Hashable, links: tuple[Link, ...], resources: tuple, priority: tuple, size: float):
        self.key, self.links, self.size, self.remaining = key, links, float(size), float(size)
        self.resources, self.priority = resources, tuple(priority)
        self.rate, self.bottleneck = 0.0, None
        self.by_link: dict[Link, float] = {}  # seconds spent with each link as the bottleneck


class FlowNetwork:
    """Active flows on directed links, re-rated max-min fairly whenever the set changes.

    `capacity` maps a link to bytes/s (a mapping or a function); `duplex` a link to the share
    of each direction left when both are busy (default 1: full duplex; see `max_min_rates`).
    Times are absolute seconds; call `advance(t)` before `add`/`finished` at time t.
    """

    def __init__(self, capacity: Mapping[Link, float] | Callable[[Link], float],
                 duplex: Mapping[Link, float] | Callable[[Link], float] | None = None):
        self._factor = _factor_of(duplex)
        self._capacity = _capacity_of(capacity, self._factor)
        self._flows: dict[Hashable, _Flow] = {}
        self._on_link: dict[Link, list[Hashable]] = {}
        self._since: dict[Link, float] = {}
        self._dirty = False
        self.now = 0.0
        self.link_bytes: dict[Link, float] = {}
        self.segments: list[LinkSegment] = []

    def __len__(self) -> int:
        return len(self._flows)

    def add(self, key: Hashable, links: Sequence[Link], size: float, *, now: float | None = None,
            priority: tuple = ()) -> None:
        """Start flow `key` of `size` bytes over `links`; `priority`: smaller is served first."""
        if now is not None:
            self.advance(now)
        if key in self._flows:
            raise MobiusError(f"flow {key!r} is already active")
        flow = _Flow(key, tuple(links), _resources(tuple(links), self._factor), priority, size)
        self._flows[key] = flow
        for link in flow.links:
            self.link_bytes[link] = self.link_bytes.get(link, 0.0) + size
            self._change(link, key, add=True)
        self._dirty = True

    def _change(self, link: Link, key: Hashable, *, add: bool) -> None:
        users = self._on_link.setdefault(link, [])
        if users and self.now > self._since[link]:
            self.segments.append(LinkSegment(link, self._since[link], self.now, tuple(users)))
        if add:
            users.append(key)
        else:
            users.remove(key)
        self._since[link] = self.now

    def _rerate(self) -> None:
        if not self._dirty:
            return
        rates, bottleneck = _fill({k: f.resources for k, f in self._flows.items()}, self._capacity,
                                  {k: f.priority for k, f in self._flows.items()})
        for key, flow in self._flows.items():
            b = bottleneck[key]
            if b is not None and len(b) == 3:  # a duplex budget: blame this flow's own direction of it
                b = next(l for l in flow.links if tuple(sorted(l)) == b[1:])
            flow.rate, flow.bottleneck = rates[key], b
        self._dirty = False

    def rates(self) -> dict[Hashable, float]:
        self._rerate()
        return {k: f.rate for k, f in self._flows.items()}

    def next_finish(self) -> tuple[float, Hashable | None]:
        """(absolute time, key) of the next flow to finish at the current rates; (inf, None) if none."""
        self._rerate()
        best, best_key = math.inf, None
        for key, flow in self._flows.items():
            if flow.rate <= 0:  # waiting behind more urgent flows
                continue
            t = 0.0 if flow.rate == math.inf else flow.remaining / flow.rate
            if t < best:
                best, best_key = t, key
        return self.now + best, best_key

    def advance(self, t: float) -> None:
        """Move every active flow forward to time `t` at its current rate."""
        dt = t - self.now
        if dt < 0:
            raise MobiusError(f"time went backwards in the flow model ({self.now} -> {t}); this is a bug")
        if dt > 0 and self._flows:
            self._rerate()
            for flow in self._flows.values():
                if flow.rate == math.inf:
                    flow.remaining = 0.0
                    continue
                flow.remaining -= flow.rate * dt
                if flow.bottleneck is not None:
                    flow.by_link[flow.bottleneck] = flow.by_link.get(flow.bottleneck, 0.0) + dt
        self.now = t

    def finished(self, force: Hashable | None = None) -> list[tuple[Hashable, dict[Link, float]]]:
        """Remove and return the flows that are done (plus `force`, the one `next_finish` named),
        each with its seconds per bottleneck link."""
        done = [k for k, f in self._flows.items()
                if k == force or f.rate == math.inf or f.remaining <= _REL * f.size + 1e-6]
        out = []
        for key in done:
            flow = self._flows.pop(key)
            for link in flow.links:
                self._change(link, key, add=False)
            out.append((key, flow.by_link))
        if done:
            self._dirty = True
        return out

    def link_busy(self) -> dict[Link, float]:
        """Seconds each link carried at least one flow (so far)."""
        busy: dict[Link, float] = {}
        for seg in self.segments:
            busy[seg.link] = busy.get(seg.link, 0.0) + seg.end - seg.start
        return busy


def run_flows(capacity: Mapping[Link, float], flows: Sequence[tuple], *,
              duplex: Mapping[Link, float] | None = None) -> list[float]:
    """Finish time of each (start, links, bytes[, priority]) flow on an otherwise idle network.

    >>> run_flows({("a", "b"): 1.0}, [(0.0, [("a", "b")], 1.0), (0.0, [("a", "b")], 1.0)])
    [2.0, 2.0]
    >>> run_flows({("a", "b"): 1.0}, [(0.0, [("a", "b")], 1.0, (1,)), (0.0, [("a", "b")], 1.0, (0,))])
    [2.0, 1.0]
    """
    tasks = [Task(name=str(i), links=tuple(f[1]), size=f[2], not_before=f[0], link_priority=tuple(f[3]) if len(f) > 3 else ())
             for i, f in enumerate(flows)]
    result = replay(tasks, capacity, duplex=duplex)
    return [result.end[i] for i in range(len(tasks))]


# ------------------------------------------------------------------------------- task replay
@dataclass
class Task:
    """One unit of work: compute (`duration`), a transfer (`links`, `size` bytes) or a marker.

    `after` are tasks whose end it waits for, `after_start` tasks whose start it waits for.
    `stream` serialises tasks (one at a time; smallest `priority` of the ready ones first);
    None runs it as soon as it is ready. A transfer's `link_priority` orders it against the
    other flows on its links (smaller first, e.g. the step-order rank of the work that needs
    it; equal ones share max-min fairly). `meta` is carried through for the caller.
    """

    name: str
    stream: str | None = None
    priority: tuple = ()
    duration: float = 0.0
    links: tuple[Link, ...] = ()
    size: float = 0.0
    after: list[int] = field(default_factory=list)
    after_start: list[int] = field(default_factory=list)
    not_before: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    link_priority: tuple = ()

    @property
    def is_flow(self) -> bool:
        return bool(self.links) and self.size > 0


@dataclass(frozen=True)
class Replay:
    """What `replay` measured: start/end per task, the stream predecessor each task waited on,
    seconds per bottleneck link of each transfer, and the network's link statistics."""

    start: list[float]
    end: list[float]
    stream_prev: list[int | None]
    flow_links: dict[int, dict[Link, float]]
    link_bytes: dict[Link, float]
    link_busy: dict[Link, float]
    segments: list[LinkSegment]


def replay(tasks: Sequence[Task], capacity: Mapping[Link, float] | Callable[[Link], float], *,
           duplex: Mapping[Link, float] | Callable[[Link], float] | None = None) -> Replay:
    """Run `tasks` to completion on links of `capacity` (and `duplex`, see `FlowNetwork`);
    raise MobiusError if some can never start (a cycle)."""
    run = _Replayer(tasks, FlowNetwork(capacity, duplex))
    run.events()
    run.check_all_ran()
    net = run.net
    return Replay(run.start, run.end, run.stream_prev, run.flow_links, dict(net.link_bytes), net.link_busy(),
                  net.segments)


class _Replayer:
    """`replay`'s event loop: tasks wait for their dependencies (`waiting`), then for their
    stream (one task at a time per stream, by priority) or their `not_before`; a flow runs on
    the network until its bytes are through, a timed task for its duration."""

    def __init__(self, tasks: Sequence[Task], net: FlowNetwork) -> None:
        n = len(tasks)
        self.tasks, self.net, self.now = tasks, net, 0.0
        self.waiting = [len(t.after) + len(t.after_start) for t in tasks]
        self.on_end: list[list[int]] = [[] for _ in range(n)]
        self.on_start: list[list[int]] = [[] for _ in range(n)]
        for i, t in enumerate(tasks):
            for d in t.after:
                self.on_end[d].append(i)
            for d in t.after_start:
                self.on_start[d].append(i)
        self.start = [math.nan] * n
        self.end = [math.nan] * n
        self.stream_prev: list[int | None] = [None] * n
        self.flow_links: dict[int, dict[Link, float]] = {}
        self.queues: dict[str, list] = {}
        self.busy: dict[str, int | None] = {}
        self.last_on: dict[str, int | None] = {}
        self.timers: list[tuple[float, int, int]] = []  # (time, kind 0=end 1=release, task)
        self.ready: list[int] = []
        self.touched: set[str] = set()
        self.finish_now: list[int] = []

    def make_ready(self, i: int) -> None:
        t = self.tasks[i]
        if t.not_before > self.now:
            heapq.heappush(self.timers, (t.not_before, 1, i))
        else:
            self.release(i)

    def release(self, i: int) -> None:
        """Task i may start: at once without a stream, else queued on its stream."""
        t = self.tasks[i]
        if t.stream is None:
            self.ready.append(i)
        else:
            heapq.heappush(self.queues.setdefault(t.stream, []), (t.priority, i))
            self.touched.add(t.stream)

    def begin(self, i: int) -> None:
        t, now = self.tasks[i], self.now
        self.start[i] = now
        for j in self.on_start[i]:
            self.waiting[j] -= 1
            if self.waiting[j] == 0:
                self.make_ready(j)
        if t.is_flow:
            self.net.add(i, t.links, t.size, priority=t.link_priority)
        elif t.duration > 0:
            heapq.heappush(self.timers, (now + t.duration, 0, i))
        else:
            self.finish_now.append(i)

    def complete(self, i: int) -> None:
        self.end[i] = self.now
        s = self.tasks[i].stream
        if s is not None:
            self.busy[s] = None
            self.touched.add(s)
        for j in self.on_end[i]:
            self.waiting[j] -= 1
            if self.waiting[j] == 0:
                self.make_ready(j)

    def settle(self) -> None:
        """Start and finish what can at this instant: ready tasks, free streams' next tasks,
        zero-length tasks."""
        ready, touched, finish_now, busy, queues = self.ready, self.touched, self.finish_now, self.busy, self.queues
        while ready or touched or finish_now:
            while ready:
                self.begin(ready.pop())
            while touched:
                s = touched.pop()
                if busy.get(s) is None and queues.get(s):
                    _, i = heapq.heappop(queues[s])
                    busy[s] = i
                    self.stream_prev[i] = self.last_on.get(s)
                    self.last_on[s] = i
                    self.begin(i)
            while finish_now:
                self.complete(finish_now.pop())

    def events(self) -> None:
        """Advance from event to event (a flow's or a timer's end) until nothing is left."""
        net, timers = self.net, self.timers
        for i in range(len(self.tasks)):
            if self.waiting[i] == 0:
                self.make_ready(i)
        while True:
            self.settle()
            t_flow, key = net.next_finish()
            t_timer = timers[0][0] if timers else math.inf
            t_next = min(t_flow, t_timer)
            if t_next == math.inf:
                break
            self.now = t_next
            net.advance(t_next)
            if t_flow <= t_next:
                for i, by_link in net.finished(force=key):
                    self.flow_links[i] = by_link
                    self.complete(i)
            while timers and timers[0][0] <= t_next:
                _, kind, i = heapq.heappop(timers)
                if kind == 0:
                    self.complete(i)
                else:
                    self.release(i)

    def check_all_ran(self) -> None:
        tasks, start, end = self.tasks, self.start, self.end
        stuck = [i for i in range(len(tasks)) if end[i] != end[i]]
        if stuck:
            i = stuck[0]
            missing = [tasks[d].name for d in tasks[i].after if end[d] != end[d]]
            missing += [tasks[d].name for d in tasks[i].after_start if start[d] != start[d]]
            raise MobiusError(f"{len(stuck)} simulated tasks never ran, e.g. {tasks[i].name!r} waiting for "
                              f"{missing[:3] or 'its stream'}; the task graph has a cycle (a simulator bug)")
