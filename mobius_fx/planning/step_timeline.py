"""The timeline of the step model (`mobius_fx.planning.step_model`; import these from here):
the least start times of docs/schedule.md for fixed stages, the records they come in, and the
shared links whose copies queue (`SharedLink`, `shared_links`, `queue_before`).

Kept apart only for size: import these names from `mobius_fx.planning.step_model`. This module reads
its `problem` (a `step_model.PartitionProblem`) and stage numbers (`step_model.StageTotals`)
by attribute and imports nothing from it.

    timeline(problem, PrefixSums(problem).stages((0, 4, 8)))   # seconds per step
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from mobius_fx.planning.landings import shared_landings
from mobius_fx.planning.link_loads import copy_terms, forward_backlog, grad_link_scale, link_time, slot_bytes

__all__ = ["Evaluation", "Timeline", "timeline", "SharedLink", "shared_links", "queue_before", "queue_window",
           "freed", "UPLOADS_PER_DOWNLOAD"]


@dataclass(frozen=True)
class Evaluation:
    """The schedule of fixed cuts: start times F[k][i] / B[k][i], prefetches, memory,
    `grad_done[k]` = D_k, when stage k's gradients are on the host (makespan = max of them), and
    the helper times of the saved-input rows (`Timeline`): `host_copy_start[k][i]` = V_k,i for
    the stages resident through the turn (() for the others), `host_copies_done[k]` = E_k,
    `weights_back[k]` = A_k, `restores_done[k]` = R_k and `upload_done[k]` = U_k, the end of
    stage k's forward upload (after the ones before it on a shared link)."""

    boundaries: tuple[int, ...]
    makespan: float
    prefetch_fwd: tuple[float, ...]
    prefetch_bwd: tuple[float, ...]
    fwd_start: tuple[tuple[float, ...], ...]
    bwd_start: tuple[tuple[float, ...], ...]
    fwd_mem: tuple[float, ...]
    bwd_mem: tuple[float, ...]
    grad_done: tuple[float, ...]
    host_copy_start: tuple[tuple[float, ...], ...] = ()
    host_copies_done: tuple[float, ...] = ()
    weights_back: tuple[float, ...] = ()
    restores_done: tuple[float, ...] = ()
    upload_done: tuple[float, ...] = ()
    host_done: tuple[float, ...] = ()  # H_k: sync's pass (async's hand-over) of stage k ends (`HostPass.ends`)
    pipeline: float = float("nan")  # the makespan without the host's work (fwd + bwd + downloads, links)


@dataclass(frozen=True)
class Timeline:
    """`timeline(..., full=True)`: the least times of docs/schedule.md for fixed stages.

    p / q: bytes prefetched forward / backward; F / B: forward / backward start of the i-th
    micro-batch run of each stage (backward in run order); D: end of each stage's gradient
    download; V: start of micro-batch i's copies to the host (offload, model output) of each
    stage resident through the turn (k >= S-N; no key for the others); E: end of the copies of
    stage k and those before it on its GPU (read for k < S-N); A: stage k's weights back for
    backward (k < S-N); R: the least end of the uploads up to and including stage k's restores
    (its backward prefetch and the restores of the stages after it on its GPU included).
    """

    makespan: float
    p: list[float]
    q: list[float]
    F: list[list[float]]
    B: list[list[float]]
    D: list[float]
    V: dict[int, list[float]]
    E: list[float]
    A: list[float]
    R: list[float]
    U: list[float] = field(default_factory=list)
    H: list[float] = field(default_factory=list)  # sync's host pass (async's hand-over) ends (`HostPass.ends`)
    pipeline: float = float("nan")  # makespan before the host's work


@dataclass(frozen=True)
class SharedLink:
    """A link that the host copies of several GPU slots cross the same way (a PCIe switch's
    uplink): it carries `servers` of them at a time, each at its own link's speed, and the
    schedule's priorities serve them in the order the pipeline needs them (the simulator's
    priorities, `network.py`). `slots` are the GPU slots behind it; `name` says which link."""

    name: str
    slots: tuple[int, ...]
    servers: int


def shared_links(topology: Any, gpus: Sequence[str], direction: str) -> tuple[SharedLink, ...]:
    """The links that the host copies of two or more of `gpus` (slot i = gpus[i]) cross in
    `direction` ("up": host -> GPU, "down": GPU -> host) and that carry fewer of them at a
    time at full speed than there are: servers = the link's bandwidth over the fastest of their
    own routes' bandwidth (at least 1). mobius-testbed: each 13 GB/s switch uplink carries two of
    the four 6.5 GB/s GPU links' copies at a time.

    shared_links(Topology.preset("mobius-testbed"), [f"gpu{i}" for i in range(8)], "up")
    """
    routes = [topology.route("host", g) if direction == "up" else topology.route(g, "host") for g in gpus]
    users: dict[tuple[str, str], list[int]] = {}
    for i, r in enumerate(routes):
        for edge in zip(r, r[1:]):
            users.setdefault(edge, []).append(i)
    out: dict[tuple[int, ...], SharedLink] = {}  # one per set of slots: the link that carries fewest
    for (u, v), slots in users.items():
        if len(slots) < 2:
            continue
        own = max(topology.bandwidth("host", gpus[i]) if direction == "up" else topology.bandwidth(gpus[i], "host")
                  for i in slots)
        servers = max(1, int(topology.link_bandwidth(u, v) / own + 1e-9))
        key = tuple(slots)
        if servers < len(slots) and (key not in out or servers < out[key].servers):
            out[key] = SharedLink(f"{u}->{v}", key, servers)
    return tuple(out.values())


def queue_before(links: Sequence[Any], slot_of: Sequence[int], order: Sequence[int]) -> list[list[int]]:
    """For each stage k, the stages whose copy on a shared link (`step_model.SharedLink`) must
    end before k's starts: on each link k's slot is behind, the one `servers` places before k
    among the stages of `order` (the order the pipeline needs their copies in) behind that
    link — a queue with `servers` servers, served in need order. Indexed by stage."""
    before: list[list[int]] = [[] for _ in slot_of]
    for link in links:
        queue = [k for k in order if slot_of[k] in link.slots]
        for j, k in enumerate(queue):
            if j >= link.servers and queue[j - link.servers] not in before[k]:
                before[k].append(queue[j - link.servers])
    return before


# UPLOADS_PER_DOWNLOAD: how many of a GPU's backward uploads (stages k-N, k-2N, ...) a gradient
# download's rows count overlapping it (`timeline`'s D): in the benchmarks a download outlasts at most two; more
# rows only grow the MIP (O(S^2 / N) of them).
UPLOADS_PER_DOWNLOAD = 2


def queue_window(links: Sequence[Any], slot_of: Sequence[int], order: Sequence[int]) -> list[list[tuple[int, list[int]]]]:
    """For each stage k, per shared link k's slot is behind: (servers c, the last
    max(c + 1, slots - 1) stages before k in `order` behind that link), when c or more come
    before it. The simulator serves a link's flows in need order, each at its own link's speed,
    c at a time: stage k's copy starts when one of the c running frees, at the c-th latest end
    of the copies before it (`freed`), not at the end of the one c places before it
    (`queue_before`) -- with uneven stages the next copy takes whichever server frees first.
    The model reads the c-th latest among that window only (fewer when fewer precede it): a
    lower bound of the full queue's, equal to it unless an older copy still runs, and one
    binary per end in the MIP. The window holds the latest copy of every other GPU behind the
    link (stages take the GPUs in turn): with only the last c + 1 on a link of more slots,
    more than c copies could run at once and `stage_count_bound`, which counts c, was not a
    bound (5 GPUs behind a 2-server uplink)."""
    out: list[list[tuple[int, list[int]]]] = [[] for _ in slot_of]
    for link in links:
        queue = [k for k in order if slot_of[k] in link.slots]
        width = max(link.servers + 1, len(link.slots) - 1)
        for j, k in enumerate(queue):
            if j >= link.servers:
                out[k].append((link.servers, queue[max(0, j - width):j]))
    return out


def freed(ends: Sequence[float], windows: Sequence[tuple[int, list[int]]]) -> float:
    """When a server of every shared link in `windows` (`queue_window`) is free: the c-th
    latest of the `ends` of its window; -inf with none."""
    return max((sorted((ends[j] for j in w), reverse=True)[c - 1] for c, w in windows), default=-math.inf)


def timeline(problem: Any, st: Any, full: bool = False):
    """Least start times of docs/schedule.md for fixed stages (exact: see the module docstring).

    Returns the makespan, or with `full` a `Timeline` (prefetched bytes, start times, download
    ends and the saved-input helpers V, E, A and R). Memory is not checked here
    (`memory_violation`); the prefetches use the free memory. The steps, in the order each
    reads the one before: `_CopyTimes`, `_forward_starts`, `_host_copy_starts`,
    `_backward_starts`, `_gradient_downloads`.
    """
    c = _CopyTimes(problem, st)
    F, p, U = _forward_starts(problem, st, c)
    terms = copy_terms(problem, st)
    V, E = _host_copy_starts(st, c, F, [max(forward_backlog(problem, terms, k, F[0][0] + st.f[0]), default=0.0) for k in range(c.s)])
    B, q, A, R = _backward_starts(problem, st, c, F, V)
    D = _gradient_downloads(problem, st, c, B, R)
    landed, host = D, getattr(problem, "host", None)
    if host is not None and (problem.shared_down or any(d < 1 for d in (problem.duplex or ()))):
        # The gradients are all on the host when the last lands. The simulator shares a switch
        # uplink max-min fairly among the downloads (all of equal need), where D queues them in
        # stage order `servers` at a time: a GPU's second download crawls beside the others'
        # (compute-bound in benchmarks/plan_quality.py, fp32 downloads: its last landed 4.8 ms
        # after D's), and the downloads end together, not one alone at the end (link-bound, tiny
        # batch: D 0.3% over). So the fluid replay of `shared_landings` times the end, with the
        # activation gradients relayed through the host ahead of the downloads (`_relayed_hops`).
        # The MIP keeps D's rows (its host pass reads D too): with a host model it is not exact.
        landed = shared_landings(problem, [g * grad_link_scale(problem) for g in st.g],
                                 [B[k][c.m - 1] + c.b[k] for k in range(c.s)], D, _uploads(problem, c, B),
                                 _relayed_hops(problem, st, c, B))
    makespan = max(landed)
    if getattr(problem, "links", ()):  # no link carries more than its bandwidth (`LinkLoad`)
        per_slot = slot_bytes(problem, copy_terms(problem, st))
        makespan = max(makespan, max(link_time(x, per_slot) for x in problem.links))
    pipeline, H = makespan, []
    if host is not None and host.per_byte > 0:  # the host's work the step waits for (`host_step.HostPass`)
        H = host.ends(st.g, landed)
        makespan = host.end(pipeline, st.g, landed)
    return Timeline(makespan, p, q, F, B, D, V, E, A, R, U, H, pipeline) if full else makespan


def _uploads(problem: Any, c: "_CopyTimes", B: list[list[float]]) -> list[tuple[int, float, float, float]]:
    """The backward uploads the gradient downloads share links with (`landings.Upload`): stage
    k's weights fetched again (k < S-N) and its M saved inputs restored after them, on its GPU's
    upload stream from stage k+N's backward start (the IR's prefetch, after that stage's
    weights are there), ranked 2S-1-k as the simulator's `copy_need` ranks them."""
    n, m, s = c.n, c.m, c.s
    return [(k % n, B[k + n][0], c.wb[k] + m * c.r[k] * problem.up[k % n], 2 * s - 1 - k)
            for k in range(s - n - 1, -1, -1) if c.wb[k] > 0]


def _relayed_hops(problem: Any, st: Any, c: "_CopyTimes", B: list[list[float]]) -> list[tuple[int, int, float, float, float]]:
    """The backward activation gradients that cross a shared download link (relayed through the
    host: `LinkLoad.hop_back` on it), as `landings.Hop`s: stage k's M of them to stage k-1, each
    released when its run ends, ranked 2S-k as the simulator's `copy_need` ranks stage k-1's."""
    n, m, s = c.n, c.m, c.s
    names = {x.name for x in problem.shared_down}
    relayed = {i for x in getattr(problem, "links", ()) if x.name in names for i in x.hop_back}
    return [(k % n, (k - 1) % n, B[k][i] + c.b[k], st.out[k - 1], 2 * s - k)
            for k in range(1, s) if (k - 1) % n in relayed and c.hop_back_t[k - 1] > 0 for i in range(m)]


class _CopyTimes:
    """The per-stage seconds and queues `timeline`'s steps read, from the problem and the stage
    numbers `st`: hops, the saved inputs' offloads (d) and restores (r), the last stage's output
    copies, the duplex shares, the backward's (b) and its weights (wb), and the shared-link queues."""

    def __init__(self, problem: Any, st: Any):
        n, m, s = len(problem.gpus), problem.microbatches, len(st.f)
        up, down = problem.up, problem.down
        self.n, self.m, self.s = n, m, s
        # out_k over the link stage k -> k+1 (forward) and k+1 -> k (backward); 0 on the same GPU
        self.hop_t = [st.out[k] / problem.hop[k % n] for k in range(s)]
        # A frozen stage (no weight gradient in it or before it) runs no backward: no gradient
        # reaches it, its weights are not fetched again, it recomputes nothing, and its input is
        # neither saved nor restored.
        live = [not x for x in st.frozen] if st.frozen else [True] * s
        self.hop_back_t = [st.out[k] / problem.backward_hop[k % n] if live[k] else 0.0 for k in range(s)]
        self.b = [x if on else 0.0 for x, on in zip(st.b, live)]
        self.wb = [x if on else 0.0 for x, on in zip(st.w, live)]  # weights fetched again for backward
        # Saved inputs (schedule.py): in_k per micro-batch (k = 0: the model input as sent). Stage
        # k > 0 offloads it to the host after each forward run (d_k) and restores it before each
        # backward run (r_k); stage 0's model input is sent again (r_0). The last stage copies its
        # output to the host (h) and gets its gradient back (e).
        self.in0 = in0 = problem.input_bytes / m
        inp = [in0, *st.out[:s - 1]]
        # A GPU behind a switch link that loses bandwidth with both directions busy (duplex d < 1)
        # fetches stage k-N's weights again for backward, and restores its inputs, while stage k's
        # gradients leave. The simulator serves the copy needed first first: the uploads keep their
        # full speed, the gradient download gets what the link's duplex budget leaves, 2d - 1 of
        # its speed (0.44 at a switch), and all of it once the uploads are done. So each second the
        # GPU's upload stream is busy while a download waits costs that download 2(1-d) seconds:
        # see `_gradient_downloads`. (Both at the duplex share d, as before, put the backward
        # weights late and the gradients early: memory-tight in benchmarks/plan_quality.py picked a
        # partition 5% slower than the best.)
        self.dx = problem.duplex or (1.0,) * n
        self.r = [inp[k] / up[k % n] if live[k] else 0.0 for k in range(s)]
        # The last stage's copies to the host (its offloads, its outputs) leave while the outputs'
        # gradients come back (with several micro-batches, the gradient of one while the next goes):
        # at the duplex share too.
        last_dx = self.dx[(s - 1) % n] if m > 1 and live[s - 1] else 1.0
        self.d = [inp[k] / (down[k % n] * (last_dx if k == s - 1 else 1.0)) if live[k] and k else 0.0
                  for k in range(s)]
        self.out_up = st.out[s - 1] / up[(s - 1) % n] if live[s - 1] else 0.0
        self.copy = self.d[:]  # what stage k copies to the host per micro-batch: its offload (and output)
        self.copy[s - 1] += st.out[s - 1] / (down[(s - 1) % n] * last_dx)
        # Micro-batch 0's copies leave before any output gradient comes back: at full speed (the
        # simulator's, benchmarks/plan_quality.py's issue-38 case: its 12.9 MB output in 2.1 ms, the
        # next ones in 2.8; at the duplex share the turn came 0.5 ms late and the step 0.2% over).
        self.copy0 = self.copy[:]
        if live[s - 1] and s > 1:
            self.copy0[s - 1] = (inp[s - 1] + st.out[s - 1]) / down[(s - 1) % n]
        elif live[s - 1]:
            self.copy0[s - 1] = st.out[s - 1] / down[(s - 1) % n]
        # Weight uploads (forward in stage order, backward in reverse) and gradient downloads
        # (reverse) of the slots behind a shared link queue on it: one starts when its release time
        # has come and a server is free -- forward, the first that frees (`queue_window`); backward
        # and down, the one `servers` places before it (`queue_before`).
        slot = [k % n for k in range(s)]
        self.up_fwd = queue_window(problem.shared_up, slot, range(s))
        self.up_bwd = queue_before(problem.shared_up, slot, range(s - n - 1, -1, -1))
        self.down_q = queue_before(problem.shared_down, slot, range(s - 1, -1, -1))


def _forward_starts(problem: Any, st: Any, c: _CopyTimes) -> tuple[list[list[float]], list[float], list[float]]:
    """(F, p, U): each stage's forward run starts, the bytes prefetched for it and the end of its
    forward upload, in stage order; stage 0 waits for the model inputs on its host link too, and
    a stage fed from another GPU for its inputs on its own link (`PartitionProblem.inlink`: its
    weights and its first i+1 relayed inputs cross it after the upload began; and as the
    simulator shares the link between flows, every input relayed before the weights are all
    there delays them by its own bytes: benchmarks/plan_quality.py "two switches", async, the
    pipeline predicted 0.938 of the simulated without this, 0.956 with it). The MIP keeps the
    first bound only (`inlink_f`: which inputs come during the upload is not linear in the
    starts), so it stays a lower bound of this timeline, which times its candidates."""
    n, m, s, f, w = c.n, c.m, c.s, st.f, st.w
    up, cap, hop_t, in0 = problem.up, problem.capacity, c.hop_t, c.in0
    inlink = getattr(problem, "inlink", None)
    F: list[list[float]] = []
    p = [0.0] * s
    U = [0.0] * s  # end of stage k's forward upload
    for k in range(s):
        sl = k % n
        start = 0.0 if k < n else F[k - n][0]  # the prefetch starts with stage k-N
        start = max(start, freed(U, c.up_fwd[k]))
        U[k] = start + w[k] / up[sl]
        if k < n:
            t0 = U[k]
        else:
            end = F[k - n][m - 1] + f[k - n]
            p[k] = max(0.0, min(w[k], up[sl] * (end - start), cap[sl] - st.fmem[k - n]))
            t0 = max(end, start) + (w[k] - p[k]) / up[sl]
        row = [0.0] * m
        t, fk = t0, f[k]
        if k:
            before, gap = F[k - 1], f[k - 1] + hop_t[k - 1]
            shared = (inlink is not None and problem.hop[(k - 1) % n] < math.inf  # inputs from another GPU,
                      and inlink[sl] < math.inf)  # on this GPU's link from the host
            base, rate, ink = (0.0 if k < n else F[k - n][0]), (inlink[sl] if shared else math.inf), st.out[k - 1]
            if shared:  # the inputs relayed while the weights upload share the link with them (the
                # simulator's flows, max-min fair): each delays the weights by its bytes
                for i in range(m):
                    if before[i] + f[k - 1] < t:
                        t += ink / rate
                if k < n:
                    U[k] = t
            for i in range(m):
                if before[i] + gap > t:
                    t = before[i] + gap
                if shared and base + (w[k] + (i + 1) * ink) / rate > t:
                    t = base + (w[k] + (i + 1) * ink) / rate
                row[i] = t
                t += fk
        else:  # the model inputs of micro-batches 0..i and the weights share stage 0's host link
            for i in range(m):
                if (w[0] + (i + 1) * in0) / up[0] > t:
                    t = (w[0] + (i + 1) * in0) / up[0]
                row[i] = t
                t += fk
        F.append(row)
    return F, p, U


def _host_copy_starts(st: Any, c: _CopyTimes, F: list[list[float]], backlog: Sequence[float] = ()
                      ) -> tuple[dict[int, list[float]], list[float]]:
    """(V, E) of `Timeline`. Copies to the host leave on each GPU's download stream in stage and
    micro-batch order (a stage's are released before the next stage's on the GPU, and served
    first): stage k's offload (d_k), then, for the last stage, its output (h), each after its
    forward run. V[k][i] is when micro-batch i's copies start, for a stage resident through the
    turn (k >= S-N), whose restores wait for them. The other stages' copies only delay the
    resident one's: E[k] bounds when those of stage k (and the stages before it on its GPU) are
    done, by the first and the last micro-batch's (both exact when forward runs follow each other
    without a gap; the MIP keeps two rows instead of M)."""
    n, m, s, f = c.n, c.m, c.s, st.f
    V: dict[int, list[float]] = {}
    E = [-math.inf] * s
    for k in range(1 if s > 1 else 0, s):
        before, ck, row = E[k - n] if k >= n else -math.inf, c.copy[k], F[k]
        if k < s - n:
            E[k] = max(before + m * ck, row[0] + f[k] + m * ck, row[m - 1] + f[k] + ck)
            continue
        v, t = [], max(before, backlog[k]) if backlog else before
        for i in range(m):
            if row[i] + f[k] > t:
                t = row[i] + f[k]
            v.append(t)
            t += c.copy0[k] if i == 0 else ck
        V[k] = v
    return V, E


def _backward_ready(c: _CopyTimes, st: Any, k: int, F: list[list[float]], V: dict[int, list[float]],
                    up0: float) -> tuple[float, list[float], float]:
    """(t0, ready, R_k) of a stage resident through the turn (k >= S-N): ready[j] is the least
    start of its j-th backward run (micro-batch M-1-j) from the uploads it waits for: the restores
    of micro-batches M-1..M-1-j, serial on the upload stream, restore j after offload M-1-j."""
    m, s, f = c.m, c.s, st.f
    t0, rk_done = (F[k][m - 1] + f[k] if k == s - 1 else 0.0), 0.0
    if k:
        v, dk, rk = V[k], c.d[k], c.r[k]
        ready = [v[m - 1 - j] + dk + (j + 1) * rk for j in range(m)]
        rk_done = max(v[i] + dk + (m - i) * rk for i in range(m))
    else:  # a resident stage 0: the model input is sent again after the first upload
        ready = [st.w[0] / up0 + (j + 1) * c.r[0] for j in range(m)]
    if k == s - 1:  # the output's gradient comes back from the host after the output went
        v = V[k]
        ready = [max(x, v[m - 1 - j] + (c.copy0[k] if j == m - 1 else c.copy[k]) + (j + 1) * c.out_up)
                 for j, x in enumerate(ready)]
    return t0, ready, rk_done


def _backward_starts(problem: Any, st: Any, c: _CopyTimes, F: list[list[float]], V: dict[int, list[float]],
                     ) -> tuple[list[list[float]], list[float], list[float], list[float]]:
    """(B, q, A, R) of `Timeline`: each stage's backward run starts (in run order), the bytes
    prefetched for it, its weights back (k < S-N) and its restores done, in reverse stage order."""
    n, m, s, b, wb, r = c.n, c.m, c.s, c.b, c.wb, c.r
    up, cap, hop_back_t = problem.up, problem.capacity, c.hop_back_t
    B: list[list[float]] = [[0.0] * m for _ in range(s)]
    q = [0.0] * s
    A = [0.0] * s  # stage k's weights back for backward (k < S-N), at the least
    R = [0.0] * s  # the restores of stage k (and the uploads before them on its GPU) done, at the least
    for k in range(s - 1, -1, -1):
        sl = k % n
        ready, last = None, -math.inf
        if k >= s - n:
            t0, ready, R[k] = _backward_ready(c, st, k, F, V, up[0])
        else:  # the prefetch starts with stage k+N's backward and queues after its restores (its
            # offloads are older than the resident stage's, so they are implied); the first
            # run waits for one restore, the last for all M (the MIP keeps these two rows)
            nxt = B[k + n]
            end = nxt[m - 1] + b[k + n]
            start = max([nxt[0], *(A[j] for j in c.up_bwd[k])])
            q[k] = max(0.0, min(wb[k], up[sl] * (end - start), cap[sl] - st.bmem[k + n]))
            t0 = max(end, start) + (wb[k] - q[k]) / up[sl]
            A[k] = max(R[k + n], start) + wb[k] / up[sl]
            R[k] = last = A[k] + m * r[k]
            if A[k] + r[k] > t0:
                t0 = A[k] + r[k]
        row, t, bk = B[k], t0, b[k]
        if k < s - 1:
            after, gap = B[k + 1], b[k + 1] + hop_back_t[k]
            if ready is None:
                for i in range(m):
                    if after[i] + gap > t:
                        t = after[i] + gap
                    row[i] = t
                    t += bk
            else:
                for i in range(m):
                    if after[i] + gap > t:
                        t = after[i] + gap
                    if ready[i] > t:
                        t = ready[i]
                    row[i] = t
                    t += bk
        else:
            for i in range(m):
                if ready[i] > t:
                    t = ready[i]
                row[i] = t
                t += bk
        if last > row[m - 1]:  # the last run waits for all M restores
            row[m - 1] = last
    return B, q, A, R


def _gradient_downloads(problem: Any, st: Any, c: _CopyTimes, B: list[list[float]], R: list[float]) -> list[float]:
    """D of `Timeline`. Gradient downloads queue per GPU: stage k's after stage k+N's. From its
    start, stage k's (k >= N) overlaps the GPU's uploads for stage k-N (busy until R[k-N]) and, if
    it lasts, those of k-2N (its weights and M restores back to back; UPLOADS_PER_DOWNLOAD of them
    at most): one row per how many of them it outlasts, each charging 2(1-d) x the upload time. A
    row that assumes more overlap than there is overshoots, but never past that upload's end (a
    download that ends before it is charged at most 2(1-d) of the time left to it)."""
    n, m, s, b, dx = c.n, c.m, c.s, c.b, c.dx
    up, down = problem.up, problem.down
    widen = grad_link_scale(problem)
    busy = [c.wb[j] / up[j % n] + m * c.r[j] for j in range(s)]  # stage j's backward uploads
    D = [0.0] * s
    for k in range(s - 1, -1, -1):
        done = B[k][m - 1] + b[k]
        if k + n < s and D[k + n] > done:
            done = D[k + n]
        for j in c.down_q[k]:
            done = max(done, D[j])
        D[k] = done + st.g[k] * widen / down[k % n]
        if k >= n and dx[k % n] < 1:
            overlap = R[k - n] - done
            for j in range(k - n, max(-1, k - (UPLOADS_PER_DOWNLOAD + 1) * n), -n):
                overlap += busy[j] if j < k - n else 0.0
                D[k] = max(D[k], done + st.g[k] * widen / down[k % n] + 2 * (1 - dx[k % n]) * overlap)
    return D
