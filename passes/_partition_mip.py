"""The partition MIP of passes/partition.py: building it, warm-starting it, running the solver.

The model is `mobius_fx.planning.step_model` (docs/schedule.md); partition_solve.py owns the search over
stage counts. This module turns one stage count S into a PuLP program over run-length-encoded
layers (`step_model.layer_runs`) whose sums are `step_model.PrefixSums`; `run_solver`
(passes/mip_solver.py) drives HiGHS (through highspy) or CBC on it. The formulation is explained in partition.py's docstring;
every row here is a row of `step_model.evaluate`, so a solver point is re-checked there
exactly.

    mip = build_mip(problem, PrefixSums(problem), layer_runs(problem), 16, mem_tol=1e-6)
    run_solver(mip, "highs", 5.0, 1e-4, False, None)    # (status, objective, bound)

HiGHS gets no MIP start (see mip_solver.py), only the incumbent's makespan as a cutoff; CBC
gets the warm start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pulp

from mobius_fx.planning.step_model import PartitionProblem, PrefixSums
from mobius_fx.planning.link_loads import forward_backlog, grad_link_scale, link_time, slot_bytes
from mobius_fx.planning.step_timeline import UPLOADS_PER_DOWNLOAD, Evaluation, queue_before, queue_window

from ._partition_mip_rows import add_memory_rows, frozen_prefix, stage_working, tied_copies, var

__all__ = ["Mip", "build_mip", "warm_start", "cuts_of"]


@dataclass
class Mip:
    """One stage count's program and the variables the driver reads back (times in `scale` s)."""

    lp: pulp.LpProblem
    s: int
    scale: float  # seconds per objective unit
    z: dict  # (k, r) -> var; cut k falls after a layer of run r
    t: dict  # (k, r) -> var or int multiplier (layers of run r before cut k)
    F: list  # [k][i] forward start of micro-batch i of stage k (a dict by i)
    B: list  # [k][i] backward start (a dict by i)
    D: list  # [k] end of stage k's gradient download (the per-GPU download queue)
    T: pulp.LpVariable  # the makespan: max_k D[k]
    infeasible: bool = False  # a constant memory row already fails (e.g. S = 1 too big)
    frozen: dict = field(default_factory=dict)  # k -> (y_k, [(var, its expression when live)]): `frozen_prefix`
    prefix: int = 0  # P: layers before the first with a weight gradient
    layers: int = 0
    V: dict = field(default_factory=dict)  # k -> [i] start of micro-batch i's copies to the host (k >= S-N)
    E: dict = field(default_factory=dict)  # k -> end of the copies to the host up to stage k (k < S-N)
    A: dict = field(default_factory=dict)  # k -> stage k's weights back for backward (k < S-N)
    R: dict = field(default_factory=dict)  # k -> its restores and the uploads before them done (k >= S-N, N)
    tied: dict = field(default_factory=dict)  # "holds_{i}_{k}" / "tied_{j}_{k}" -> var: `tied_copies`
    tied_weights: tuple = ()  # the problem's TiedWeights (j indexes them)
    U: dict = field(default_factory=dict)  # k -> end of stage k's forward upload (shared uplinks only)
    skips: list = field(default_factory=list)  # (k, c, {j: binary}): U_k's row after U_j off (`queue_window`)
    work: dict = field(default_factory=dict)  # k -> stage k's working memory (var), "ends_{k}_{r}" -> binary: `stage_working`
    working: list = field(default_factory=list)  # each layer's working memory (`MemoryModel.working`), for the warm start
    H: dict = field(default_factory=dict)  # k -> end of sync's host pass of stage k (`HostPass`)


def build_mip(problem: PartitionProblem, fast: PrefixSums, runs: list[tuple[int, int]], s: int, *,
               mem_tol: float, bound_only: bool = False) -> Mip:
    """The program for S = s stages: cut k picks a run (binary) and a count in it (integer).

    `mem_tol` is the relative slack on capacity the exact check also allows. `bound_only`: a
    relaxation for a lower bound only (`partition_bounds.lp_bound` solves its LP): the start
    times of the first and the last micro-batch alone (F, B, V keyed by those two), the rows
    between them summed along their chains (`F[k][M-1] >= F[k][0] + (M-1) f_k`, ...), the rows
    of the middle micro-batches dropped. Every row left is a row of the program or a sum of
    them, so its optimum is at most the program's. Its variables are not a schedule.

    The rows are added in `_Program`'s steps, in this order: the cuts, the stages' sums and
    memory, forward, the shared uplinks' queues, the copies to the host, backward, the
    gradient downloads and the makespan, the host's pass (`HostPass`).
    """
    p = _Program(problem, fast, runs, s, bound_only)
    p.cuts()
    p.stage_sums(mem_tol)
    p.forward()
    p.upload_queues()
    p.host_copies()
    p.backward()
    p.downloads()
    p.host_pass()
    return p.mip()


class _Program:
    """`build_mip`'s program while it is built: each step adds its variables and rows to `lp`
    and keeps what later steps read as attributes (the names of step_model.timeline)."""

    def __init__(self, problem: PartitionProblem, fast: PrefixSums, runs: list[tuple[int, int]], s: int,
                 bound_only: bool) -> None:
        self.problem, self.fast, self.runs, self.s, self.bound_only = problem, fast, runs, s, bound_only
        self.n, self.m, self.L = len(problem.gpus), problem.microbatches, len(problem.layers)
        m = self.m
        self.mbs = sorted({0, m - 1}) if bound_only else list(range(m))  # symmetric: i in it iff m-1-i is
        self.prev = {i: self.mbs[j - 1] for j, i in enumerate(self.mbs) if j}  # the micro-batch before i in mbs
        # Normalise: times in units of `scale` seconds, memory rows in units of capacity.
        L = self.L
        self.scale = max(fast.f[L] + fast.b[L] + fast.w[L] / min(problem.up) + fast.g[L] / min(problem.down), 1e-30)
        self.lp = pulp.LpProblem(f"mobius_partition_S{s}", pulp.LpMinimize)

    def cuts(self) -> None:
        """z, t and `at`: a linear form of the prefix sums at each cut ({"f": expr, "b":...,
        "w":..., "g":..., "r": recompute bytes, "a": boundary activation, "pos": the cut's layer}),
        with the rows that keep the cuts and their runs in order."""
        lp, fast, runs, s, L = self.lp, self.fast, self.runs, self.s, self.L
        z, t = {}, {}
        sums = {"f": fast.f, "b": fast.b, "w": fast.w, "g": fast.g, "r": fast.r}
        at: list[dict[str, Any]] = [{q: 0.0 for q in "fbwgra"}]
        for k in range(1, s):
            lo_layer, hi_layer = k - 1, L - s + k - 1  # the layer just before cut k
            forms = {q: pulp.LpAffineExpression() for q in "fbwgra"}
            pos = pulp.LpAffineExpression()
            for r, (start, length) in enumerate(runs):
                t_lo, t_hi = max(1, lo_layer - start + 1), min(length, hi_layer - start + 1)
                if t_lo > t_hi:
                    continue
                zv = var(lp, f"z_{k}_{r}", 0, 1, pulp.LpBinary)
                z[k, r] = zv
                if t_lo == t_hi:
                    tv: Any = t_lo * zv
                    t[k, r] = t_lo
                else:
                    tv = var(lp, f"t_{k}_{r}", 0, t_hi, pulp.LpInteger)
                    t[k, r] = tv
                    lp += tv >= t_lo * zv
                    lp += tv <= t_hi * zv
                pos += start * zv + tv
                for q, prefix in sums.items():  # prefix[start] + (layers of run r before the cut) x per layer
                    forms[q] += prefix[start] * zv + (prefix[start + 1] - prefix[start]) * tv
                forms["a"] += fast.out[start] * zv
            lp += pulp.lpSum(zv for (kk, _), zv in z.items() if kk == k) == 1, f"one_run_{k}"
            forms["pos"] = pos
            at.append(forms)
        at.append({**{q: prefix[L] for q, prefix in sums.items()}, "a": fast.out[L - 1], "pos": L})
        at[0]["pos"] = 0
        for k in range(1, s):  # cuts in order, runs in order
            lp += at[k + 1]["pos"] - at[k]["pos"] >= 1, f"order_{k}"
            if k + 1 < s:
                for r in range(len(runs)):
                    a = [z[k, rr] for rr in range(r + 1) if (k, rr) in z]
                    b = [z[k + 1, rr] for rr in range(r + 1) if (k + 1, rr) in z]
                    if b:
                        lp += pulp.lpSum(a) >= pulp.lpSum(b), f"run_order_{k}_{r}"
        self.z, self.t, self.at = z, t, at

    def part(self, q: str, k: int) -> Any:
        """Stage k's sum of quantity q (a linear form)."""
        return self.at[k + 1][q] - self.at[k][q]

    def stage_sums(self, mem_tol: float) -> None:
        """Each stage's times and bytes (tied copies and the frozen prefix included), the memory
        rows, and the seconds per byte of each copy (in units of `scale`)."""
        lp, problem, fast, s, n, m, L, at = self.lp, self.problem, self.fast, self.s, self.n, self.m, self.L, self.at
        part, scale = self.part, self.scale
        self.aux = aux = {}
        tied_w, tied_g = tied_copies(lp, problem, at, s, aux)
        self.f = f = [part("f", k) * (1 / scale) for k in range(s)]
        self.b = b = [part("b", k) * (1 / scale) for k in range(s)]
        self.w = w = [part("w", k) + tied_w[k] for k in range(s)]
        self.g = g = [part("g", k) + tied_g[k] for k in range(s)]
        self.wb = wb = list(w)  # weights fetched again for backward
        self.grad_in = grad_in = [at[k + 1]["a"] for k in range(s)]  # bytes of the gradient that reaches stage k (from k + 1)
        self.in0 = in0 = problem.input_bytes / m
        self.saved = saved = [in0] + [at[k]["a"] for k in range(1, s)]  # in_k: offloaded and restored (k = 0: sent again)
        self.frozen = frozen_prefix(lp, problem, at, s, {"b": b, "w": wb, "a": grad_in, "in": saved},
                                     {"b": fast.b[L] / scale, "w": fast.w[L] + sum(t.nbytes for t in problem.tied) * fast.mm.weight_scale,
                                      "a": max(fast.out), "in": max(*fast.out, in0)})
        # Memory: step_model.stage_memory's formula (MemoryModel.footprint, linear) on the stage sums.
        self.work, self.ends = work, _ = stage_working(lp, problem, self.runs, self.z, self.t, s)
        mem = [fast.mm.footprint(w[k], g[k], part("r", k), m * (at[k]["a"] + at[k + 1]["a"]), work[k])
               for k in range(s)]
        held = [fast.mm.held(w[k], m * (at[k]["a"] + at[k + 1]["a"])) for k in range(s)]
        self.infeasible = add_memory_rows(lp, problem, mem, held, [m * at[k]["a"] for k in range(s)], mem_tol)
        inv = lambda bw: 0.0 if bw == math.inf else 1 / (bw * scale)  # seconds per byte, in units
        self.hop = [inv(problem.hop[k % n]) for k in range(s)]  # activation k -> k+1
        self.hop_back = [inv(problem.backward_hop[k % n]) for k in range(s)]  # gradient k+1 -> k
        self.up = [1 / (problem.up[k % n] * scale) for k in range(s)]  # seconds per byte, in units
        inlink = problem.inlink or (math.inf,) * n  # each GPU's own link: its uploads and the inputs relayed to it
        self.inlink = [inv(inlink[k % n]) if k and problem.hop[(k - 1) % n] < math.inf else 0.0 for k in range(s)]
        self.dx = problem.duplex or (1.0,) * n  # step_model.timeline: gradients slowed by the uploads they overlap
        self.down = [1 / (problem.down[k % n] * scale) for k in range(s)]

    def forward(self) -> None:
        """F and B (the forward and backward starts) and the forward rows."""
        lp, s, n, m, mbs, prev = self.lp, self.s, self.n, self.m, self.mbs, self.prev
        f, w, up, hop, at, in0 = self.f, self.w, self.up, self.hop, self.at, self.in0
        self.F = F = [{i: var(lp, f"F_{k}_{i}", 0) for i in mbs} for k in range(s)]
        self.B = [{i: var(lp, f"B_{k}_{i}", 0) for i in mbs} for k in range(s)]
        for k in range(s):
            if k < n:
                lp += F[k][0] >= w[k] * up[k], f"upload_{k}"
            else:
                lp += F[k][0] >= F[k - n][m - 1] + f[k - n], f"gpu_free_f{k}"
                lp += F[k][0] >= F[k - n][0] + w[k] * up[k], f"prefetch_f{k}"
            for i in mbs:
                if i:
                    lp += F[k][i] >= F[k][prev[i]] + (i - prev[i]) * f[k], f"mb_f{k}_{i}"
                if k:
                    lp += F[k][i] >= F[k - 1][i] + f[k - 1] + at[k]["a"] * hop[k - 1], f"act_f{k}_{i}"
                    # its weights and the inputs relayed from k-1 share the GPU's own link (the
                    # timeline also delays the weights by the inputs relayed during their upload:
                    # not linear, left out here, so the row is a lower bound of it)
                    if self.inlink[k]:
                        base = 0 if k < n else F[k - n][0]
                        lp += F[k][i] >= base + (w[k] + (i + 1) * at[k]["a"]) * self.inlink[k], f"inlink_f{k}_{i}"
                elif in0 > 0:  # the model inputs of micro-batches 0..i and the weights share the host link
                    lp += F[0][i] >= (w[0] + (i + 1) * in0) * up[0], f"input_f{i}"

    def upload_queues(self) -> None:
        """Uploads and downloads of the slots behind a shared link queue on it (step_model's
        `queue_before`): U_k, the end of stage k's forward upload, after the one `servers`
        places before it; the backward uploads (A) and the downloads (D) likewise, in their steps."""
        lp, problem, fast, s, n, m = self.lp, self.problem, self.fast, self.s, self.n, self.m
        F, w, up, L = self.F, self.w, self.up, self.L
        slot = [k % n for k in range(s)]
        up_fwd = queue_window(problem.shared_up, slot, range(s))
        self.up_bwd = queue_before(problem.shared_up, slot, range(s - n - 1, -1, -1))
        self.down_q = queue_before(problem.shared_down, slot, range(s - 1, -1, -1))
        self.U, self.skips = U, skips = {}, []
        # An upper bound of every forward upload's end in the least schedule (all the forward's
        # work one after another), the big-M of the rows a queue's binary switches off.
        acts = sum(fast.out) * max(self.hop) + (self.in0 * max(up) if self.in0 > 0 else 0.0)
        horizon = 2 * ((fast.w[L] + sum(t.nbytes for t in problem.tied) * fast.mm.weight_scale) * max(up)
                       + m * (fast.f[L] / self.scale + acts))
        if not problem.shared_up:
            return
        for k in range(s):
            U[k] = var(lp, f"U_{k}", 0)
            lp += U[k] >= (F[k - n][0] if k >= n else 0) + w[k] * up[k], f"upload_end_{k}"
            for c, window in up_fwd[k]:  # after the c-th latest end of its window: all but c-1 of them
                if c == 1:
                    for j in window:
                        lp += U[k] >= U[j] + w[k] * up[k], f"upload_queue_{k}_{j}"
                    continue
                # continuous in the bound's LP (solve_relaxation relaxes only the cut columns)
                skip = {j: var(lp, f"upload_skip_{k}_{j}", 0, 1,
                                pulp.LpContinuous if self.bound_only else pulp.LpBinary) for j in window}
                skips.append((k, c, skip))
                lp += pulp.lpSum(skip.values()) <= c - 1, f"upload_servers_{k}_{window[-1]}"
                for j, e in skip.items():
                    lp += U[k] >= U[j] + w[k] * up[k] - horizon * e, f"upload_queue_{k}_{j}"
            lp += F[k][0] >= U[k], f"uploaded_{k}"

    def host_copies(self) -> None:
        """Copies to the host (step_model.timeline's V and E): micro-batch i's offload, then (last
        stage) its output, after its forward run, in stage and micro-batch order per GPU. V per
        micro-batch for the stages resident through the turn, only the end E for the others."""
        lp, problem, s, n, m, L, mbs, prev = self.lp, self.problem, self.s, self.n, self.m, self.L, self.mbs, self.prev
        F, f, saved, down, dx = self.F, self.f, self.saved, self.down, self.dx
        out_last = self.fast.out[L - 1]
        # step_model.timeline's last_dx: the last stage's copies to the host at the duplex share
        # while its outputs' gradients come back (several micro-batches; it is live unless all are frozen)
        self.down_c = down_c = [down[k] / (dx[k % n] if k == s - 1 and m > 1 and problem.frozen_prefix < L else 1.0)
                                for k in range(s)]
        self.copy = copy = [(saved[k] * down_c[k] if k else 0.0) + (out_last * down_c[k] if k == s - 1 else 0.0)
                            for k in range(s)]
        # step_model.timeline's copy0: micro-batch 0's copies leave before any output gradient comes back: full speed
        self.copy0 = copy0 = [(saved[k] * down[k] if k else 0.0) + out_last * down[k] if k == s - 1 else copy[k]
                              for k in range(s)]
        self.V, self.E = V, E = {}, {}
        for k in range(1 if s > 1 else 0, s):
            if k >= s - n:
                V[k] = {i: var(lp, f"V_{k}_{i}", 0) for i in mbs}
                for i in mbs:
                    lp += V[k][i] >= F[k][i] + f[k], f"host_copy_{k}_{i}"
                    if i:
                        first = copy0[k] - copy[k] if prev[i] == 0 else 0.0
                        lp += V[k][i] >= V[k][prev[i]] + (i - prev[i]) * copy[k] + first, f"host_copies_{k}_{i}"
                if k - n in E:
                    lp += V[k][0] >= E[k - n], f"host_copies_{k}"
                terms = {"w": self.w, "out": [self.at[j + 1]["a"] for j in range(s)], "saved": saved}
                for j, x in enumerate(forward_backlog(problem, terms, k, F[0][0] * self.scale + f[0] * self.scale)):  # the shared link's forward copies
                    lp += V[k][0] >= x * (1 / self.scale), f"host_copies_backlog_{k}_{j}"
            else:
                E[k] = var(lp, f"E_{k}", 0)
                lp += E[k] >= F[k][0] + f[k] + m * copy[k], f"host_copies_{k}_first"
                lp += E[k] >= F[k][m - 1] + f[k] + copy[k], f"host_copies_{k}_last"
                if k - n in E:
                    lp += E[k] >= E[k - n] + m * copy[k], f"host_copies_{k}"

    def backward(self) -> None:
        """The backward rows: the turn, each GPU free in turn, the restores and the gradients in
        (resident stages), the prefetch of weights back (A) for the others."""
        lp, s, n, m, mbs, prev = self.lp, self.s, self.n, self.m, self.mbs, self.prev
        F, B, V, f, b, w, wb, up = self.F, self.B, self.V, self.f, self.b, self.w, self.wb, self.up
        saved, grad_in, copy, in0 = self.saved, self.grad_in, self.copy, self.in0
        self.A, self.R, self.uploads_end = A, R, uploads_end = {}, {}, {}  # uploads_end: k < S-N, timeline's R[k]
        for k in range(s - 1, -1, -1):
            rk = saved[k] * up[k]  # one restore (k = 0: one model input sent again)
            if k == s - 1:
                lp += B[k][0] >= F[k][m - 1] + f[k], "turn"
            elif k < s - n:
                lp += B[k][0] >= B[k + n][m - 1] + b[k + n], f"gpu_free_b{k}"
            if k >= s - n:  # step_model.timeline's ready[j] and R_k of a resident stage
                dk = saved[k] * self.down_c[k] if k else 0.0
                for j in mbs:
                    if k:  # restore j after offload M-1-j
                        lp += B[k][j] >= V[k][m - 1 - j] + dk + (j + 1) * rk, f"restore_b{k}_{j}"
                    elif in0 > 0:
                        lp += B[0][j] >= w[0] * up[0] + (j + 1) * rk, f"input_b{j}"
                    if k == s - 1:
                        gone = self.copy0[k] if j == m - 1 else copy[k]  # micro-batch m-1-j's copies to the host
                        lp += B[k][j] >= V[k][m - 1 - j] + gone + (j + 1) * grad_in[k] * up[k], f"output_grad_b{j}"
                if k >= n:
                    R[k] = var(lp, f"R_{k}", 0)
                    for i in mbs:
                        lp += R[k] >= V[k][i] + dk + (m - i) * rk, f"restores_{k}_{i}"
            else:  # the prefetch starts with stage k+N's backward and queues after its restores
                A[k] = var(lp, f"A_{k}", 0)
                lp += A[k] >= B[k + n][0] + wb[k] * up[k], f"prefetch_b{k}"
                lp += A[k] >= R[k + n] + wb[k] * up[k], f"upload_queue_b{k}"
                for j in self.up_bwd[k]:
                    lp += A[k] >= A[j] + wb[k] * up[k], f"shared_upload_b{k}_{j}"
                lp += B[k][0] >= A[k] + rk, f"restore_b{k}_first"
                lp += B[k][m - 1] >= A[k] + m * rk, f"restore_b{k}_last"
                uploads_end[k] = A[k] + m * rk
                if k >= n:
                    R[k] = uploads_end[k]
            for i in mbs:
                if i:
                    lp += B[k][i] >= B[k][prev[i]] + (i - prev[i]) * b[k], f"mb_b{k}_{i}"
                if k < s - 1:
                    lp += B[k][i] >= B[k + 1][i] + b[k + 1] + grad_in[k] * self.hop_back[k], f"grad_b{k}_{i}"

    def downloads(self) -> None:
        """Gradient downloads queue per GPU: D_k = max(end of B[k], D_{k+N}) + G_k/down_k. The
        makespan is max_k D_k; D_k >= D_{k+N} (G >= 0), so T >= D_k for the first N stages
        covers it. Stage k's download (k >= N) also loses 2(1-d) of each second the GPU's
        uploads for stages k-N, k-2N, ... run after it starts (timeline's rows): D_k >= X +
        grads + 2(1-d) x (R_{k-N} - X + the later uploads' busy times) for each X the start is
        the max of. Then no link carries more than its bandwidth, and T is the objective."""
        lp, problem, s, n, m, B, b, g = self.lp, self.problem, self.s, self.n, self.m, self.B, self.b, self.g
        wb, up, saved, dx, down = self.wb, self.up, self.saved, self.dx, self.down
        self.D = D = [var(lp, f"D_{k}", 0) for k in range(s)]
        self.T = T = var(lp, "makespan", 0)
        busy = [wb[j] * up[j] + m * saved[j] * up[j] for j in range(s)]
        widen = grad_link_scale(problem)
        for k in range(s - 1, -1, -1):
            grads = g[k] * (down[k] * widen)  # widen: the runtime's fp32 downloads (`HostPass.down_scale`)
            starts = [(B[k][m - 1] + b[k], f"download_{k}")]
            if k + n < s:
                starts.append((D[k + n], f"download_queue_{k}"))
            starts += [(D[j], f"shared_download_{k}_{j}") for j in self.down_q[k]]
            for x, name in starts:
                lp += D[k] >= x + grads, name
                if k >= n and dx[k % n] < 1:
                    lost, overlap = 2 * (1 - dx[k % n]), self.uploads_end[k - n]
                    for j in range(k - n, max(-1, k - (UPLOADS_PER_DOWNLOAD + 1) * n), -n):
                        overlap = overlap + (busy[j] if j < k - n else 0.0)
                        lp += D[k] >= (1 - lost) * x + lost * overlap + grads, f"{name}_overlap_{j}"
            if k < n:
                lp += T >= D[k] + self.tail(), f"end_{k}"
        if problem.links:  # step_model.timeline: no link carries more than its bandwidth (LinkLoad)
            per_slot = slot_bytes(problem, {"w": self.w, "wb": wb, "g": g, "saved": saved, "grad_in": self.grad_in,
                                            "out": [self.at[k + 1]["a"] for k in range(s)]})
            for j, x in enumerate(problem.links):
                lp += T >= link_time(x, per_slot) * (1 / self.scale) + self.tail(), f"link_{j}"
        lp += T

    def tail(self) -> Any:
        """"none"'s host work after the pipeline (`HostPass`: per_byte x all gradient bytes), in units; 0 otherwise."""
        host = self.problem.host
        if host is None or host.per_byte <= 0:
            return 0.0
        per = host.per_byte if host.mode == "none" else 0.0
        return pulp.lpSum(self.g) * (per / self.scale) if per > 0 else 0.0

    def host_pass(self) -> None:
        """The host's pass (step_model.timeline's `HostPass.end`): "sync", one worker steps the stages
        in landing order, H_k >= max(D_k, H_{k+1}) + pass_k, T >= H_0; "async", T >= the pass over
        all stages, and the same rows for its hand-overs into `.grad` (`HostPass.after`) ("none":
        `tail`, in the end rows)."""
        host, lp, s, T, D, g = self.problem.host, self.lp, self.s, self.T, self.D, self.g
        self.H = {}
        if host is None or host.per_byte <= 0:
            return
        unit = host.per_byte / self.scale
        if host.mode == "async":
            lp += T >= pulp.lpSum(g) * unit, "host_async"
            unit = host.after / self.scale  # its hand-overs: a chain as sync's passes
        if host.mode != "none" and unit > 0:
            for k in range(s - 1, -1, -1):
                self.H[k] = var(lp, f"H_{k}", 0)
                lp += self.H[k] >= D[k] + g[k] * unit, f"host_pass_{k}"
                if k + 1 < s:
                    lp += self.H[k] >= self.H[k + 1] + g[k] * unit, f"host_queue_{k}"
            lp += T >= self.H[0], "host_end"

    def mip(self) -> Mip:
        problem = self.problem
        return Mip(self.lp, self.s, self.scale, self.z, self.t, self.F, self.B, self.D, self.T, self.infeasible,
                   self.frozen, problem.frozen_prefix, self.L, self.V, self.E, self.A,
                   {k: v for k, v in self.R.items() if isinstance(v, pulp.LpVariable)}, self.aux, problem.tied,
                   self.U, self.skips,
                   {**{k: v for k, v in enumerate(self.work) if isinstance(v, pulp.LpVariable)}, **self.ends},
                   [problem.memory.working(l) for l in problem.layers], self.H)


def warm_start(mip: Mip, runs: list[tuple[int, int]], ev: Evaluation) -> None:
    """Set initial values of every variable from a feasible cut set and its exact schedule
    (CBC's warm start; HiGHS is not given one, see mip_solver.py)."""
    cuts = ev.boundaries
    for v in mip.lp.variables():
        v.setInitialValue(0)
    for k in range(1, mip.s):
        layer = cuts[k] - 1
        r = next(i for i, (a, n) in enumerate(runs) if a <= layer < a + n)
        mip.z[k, r].setInitialValue(1)
        if isinstance(mip.t[k, r], pulp.LpVariable):
            mip.t[k, r].setInitialValue(layer - runs[r][0] + 1)
    edges = [*cuts, mip.layers]
    for name, v in mip.tied.items():  # holds_{i}_{k}: stage k holds layer i; tied_{j}_{k}: it keeps a copy
        what, a, k = name.split("_")
        a, k = int(a), int(k)
        if what == "holds":
            v.setInitialValue(int(edges[k] <= a < edges[k + 1]))
        else:
            v.setInitialValue(int(mip.tied_weights[a].copies(edges[k], edges[k + 1])))
    for k, (y, terms) in mip.frozen.items():  # after z and t are set, the live expressions evaluate
        off = edges[k + 1] <= mip.prefix
        y.setInitialValue(int(off))
        for v, x in terms:
            v.setInitialValue(0.0 if off else max(0.0, pulp.value(x)))
    for k in range(mip.s):
        for i in mip.F[k]:
            mip.F[k][i].setInitialValue(ev.fwd_start[k][i] / mip.scale)
            mip.B[k][i].setInitialValue(ev.bwd_start[k][i] / mip.scale)
        mip.D[k].setInitialValue(ev.grad_done[k] / mip.scale)
    for k, row in mip.V.items():
        for i, v in row.items():
            v.setInitialValue(ev.host_copy_start[k][i] / mip.scale)
    for times, variables in ((ev.host_copies_done, mip.E), (ev.weights_back, mip.A), (ev.restores_done, mip.R),
                             (ev.upload_done, mip.U)):
        for k, v in variables.items():
            v.setInitialValue(times[k] / mip.scale)
    for key, v in mip.work.items():  # W_k: the stage's working memory; ends_{k}_{r}: cut k ends run r
        if isinstance(key, int):
            v.setInitialValue(max(mip.working[edges[key]:edges[key + 1]], default=0.0))
        else:
            _, k, r = key.split("_")
            v.setInitialValue(int(edges[int(k)] == runs[int(r)][0] + runs[int(r)][1]))
    for k, c, skip in mip.skips:  # the c-1 latest ends of U_k's window switched off
        for j in sorted(skip, key=lambda j: -ev.upload_done[j])[:c - 1]:
            skip[j].setInitialValue(1)
    for k, v in mip.H.items():
        v.setInitialValue(ev.host_done[k] / mip.scale)
    mip.T.setInitialValue(ev.makespan / mip.scale)


def cuts_of(mip: Mip, runs: list[tuple[int, int]]) -> tuple[int, ...]:
    """The boundaries a solved program's (z, t) encode."""
    cuts = [0]
    for k in range(1, mip.s):
        r = max((key[1] for key in mip.z if key[0] == k), key=lambda r: mip.z[k, r].value() or 0)
        tv = mip.t[k, r]
        cuts.append(runs[r][0] + (round(tv.value()) if isinstance(tv, pulp.LpVariable) else tv))
    return tuple(cuts)
