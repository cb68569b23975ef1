"""The row groups of the partition MIP (passes/_partition_mip.py) that each model one rule of
`step_model`: a stage's working memory (`stage_working`), the tied weights' extra copies
(`tied_copies`), the frozen prefix that runs no backward (`frozen_prefix`) and the memory rules
(`add_memory_rows`); with `var`, a variable of any PuLP version.
"""

from __future__ import annotations

from typing import Any

import pulp

from mobius_fx.planning.step_model import PartitionProblem
from mobius_fx.planning.step_memory import memory_rows

__all__ = ["var", "stage_working", "tied_copies", "frozen_prefix", "add_memory_rows"]


def var(lp: pulp.LpProblem, name: str, lo: float | None = None, hi: float | None = None,
         cat: str = pulp.LpContinuous) -> pulp.LpVariable:
    if hasattr(lp, "add_variable"):  # PuLP >= 3.3 (the 4.0 API)
        return lp.add_variable(name, lo, hi, cat=cat)
    return pulp.LpVariable(name, lo, hi, cat=cat)  # pragma: no cover - older PuLP


def stage_working(lp: pulp.LpProblem, problem: PartitionProblem, runs: list[tuple[int, int]], z: dict, t: dict,
                   s: int) -> tuple[list, dict]:
    """Each stage's working memory (`MemoryModel.stage_working`: the largest of its own
    layers'), as a variable W_k >= the working memory of every run the stage touches; exact
    at the optimum, since the memory rows only grow with W_k.

    A stage touches run r when it holds r's first layer, or r holds its own first layer.
    With z[k, r] ("cut k falls after a layer of run r"), C(k, r) = sum over runs r' < r of
    z[k, r'] says cut k is at or before r's start, so stage k holds that start when
    C(k, r) = 1 and C(k + 1, r) = 0: W_k >= w_r (C(k, r) - C(k + 1, r)) (cut 0 is before
    everything, cut S after everything). The first layer of stage k > 0 is in run r when
    z[k, r] = 1 and the cut leaves some of r (t[k, r] < len_r), else it is the next run's
    start, held already. So W_k >= w_r z[k, r] is exact when that next run's working memory
    is at least w_r or the cut cannot end run r; otherwise a binary e ("cut k ends run r",
    t[k, r] >= len_r e) takes it off: W_k >= w_r (z[k, r] - e). Returns (W, {name: e})."""
    mm = problem.memory
    wr = [mm.working(problem.layers[a]) for a, _ in runs]
    ends: dict = {}
    if not any(wr):
        return [0.0] * s, ends
    W = [var(lp, f"work_{k}", 0) for k in range(s)]

    def before(k: int, r: int) -> Any:  # C(k, r): cut k at or before run r's start
        if k == 0:
            return 1
        if k == s:
            return 0
        return pulp.lpSum(z[k, rr] for rr in range(r) if (k, rr) in z)

    for k in range(s):
        for r, (start, length) in enumerate(runs):
            if not wr[r]:
                continue
            row = before(k, r) - before(k + 1, r)
            if not isinstance(row, int) or row > 0:
                lp += W[k] >= wr[r] * row, f"work_{k}_{r}"
            if k == 0 or (k, r) not in z:
                continue
            tv = t[k, r]
            if isinstance(tv, int):  # the cut's place in run r is fixed
                if tv < length:
                    lp += W[k] >= wr[r] * z[k, r], f"work_first_{k}_{r}"
                continue
            nxt = wr[r + 1] if r + 1 < len(runs) else 0.0
            if nxt >= wr[r] or tv.upBound < length:
                lp += W[k] >= wr[r] * z[k, r], f"work_first_{k}_{r}"
            else:
                e = ends[f"ends_{k}_{r}"] = var(lp, f"ends_{k}_{r}", 0, 1, pulp.LpBinary)
                lp += tv >= length * e, f"ends_{k}_{r}"
                lp += W[k] >= wr[r] * (z[k, r] - e), f"work_first_{k}_{r}"
    return W, ends


def tied_copies(lp: pulp.LpProblem, problem: PartitionProblem, at: list, s: int, aux: dict) -> tuple[list, list]:
    """(weight, gradient) bytes of the tied copies each stage keeps (`TiedWeight.copies`), as
    linear forms. Stage k holds layer i when cut k <= i < cut k+1; that is fixed for layer 0
    (stage 0), the last layer (stage S-1) and layers no stage but one can reach, else a binary
    per feasible stage with exactly one set (big-M rows on the cut positions). Stage k keeps a
    copy when it holds a reader but not the owner: x >= holds(reader) - holds(owner), x >= 0,
    exact because every row grows with x. The variables go into `aux` by name (the warm start)."""
    L = len(problem.layers)
    ws = problem.memory.weight_scale
    holds: dict[int, list] = {}

    def held(i: int) -> list:
        if i not in holds:
            if i < 0:
                row: list = [0] * s
            elif i == 0:
                row = [1] + [0] * (s - 1)
            elif i == L - 1:
                row = [0] * (s - 1) + [1]
            else:
                row = [1 if k <= i <= L - s + k else 0 for k in range(s)]  # stage k starts at layer >= k
                if sum(row) > 1:
                    us = {k: var(lp, f"holds_{i}_{k}", 0, 1, pulp.LpBinary) for k in range(s) if row[k]}
                    aux.update((f"holds_{i}_{k}", u) for k, u in us.items())
                    lp.addConstraint(pulp.lpSum(us.values()) == 1, f"holds_one_{i}")
                    for k, u in us.items():
                        lp.addConstraint(at[k]["pos"] <= i + L * (1 - u), f"holds_from_{i}_{k}")
                        lp.addConstraint(at[k + 1]["pos"] >= i + 1 - L * (1 - u), f"holds_to_{i}_{k}")
                    row = [us.get(k, 0) for k in range(s)]
            holds[i] = row
        return holds[i]

    tw: list = [0.0] * s
    tg: list = [0.0] * s
    for j, t in enumerate(problem.tied):
        owner = held(t.owner)
        for k in range(s):
            diffs = [held(r)[k] - owner[k] for r in t.readers]
            if all(isinstance(d, int) for d in diffs):
                x: Any = max(0, *diffs)
            else:
                x = aux[f"tied_{j}_{k}"] = var(lp, f"tied_{j}_{k}", 0)
                for i, d in enumerate(diffs):
                    lp += x >= d, f"tied_{j}_{k}_{i}"
            tw[k] = tw[k] + t.nbytes * ws * x
            if t.trainable:
                tg[k] = tg[k] + t.nbytes * ws * x
    return tw, tg


def frozen_prefix(lp: pulp.LpProblem, problem: PartitionProblem, at: list, s: int, live: dict[str, list],
                   most: dict[str, float]) -> dict:
    """The rule of `step_model.timeline` for stages of a frozen prefix: a stage whose layers and
    all before them have no weight gradient runs no backward (no time, no refetch, no gradient
    in). Nothing to add when the first layer has a gradient. Else y_k = 1 exactly when stage k
    ends within the first P layers (the frozen prefix), and each backward term x of stage k
    (`live[q][k]`, replaced in place; at most `most[q]`) becomes a variable >= x - most * y_k,
    >= 0: every row reads "start >= ... + x", so the optimum takes the least, x (1 - y_k)."""
    L = len(problem.layers)
    P = problem.frozen_prefix
    if P == 0:
        return {}
    frozen = {}
    for k in range(min(s, P)):  # stage k ends after layer k at least: only the first P can be frozen
        y = var(lp, f"frozen_{k}", 0, 1, pulp.LpBinary)
        end = at[k + 1]["pos"]
        lp += end <= P + (L - P) * (1 - y), f"frozen_ends_in_prefix_{k}"
        lp += end >= (P + 1) * (1 - y), f"live_ends_after_prefix_{k}"
        if k:
            lp += y <= frozen[k - 1][0], f"frozen_is_a_prefix_{k}"
        terms = []
        for q, xs in live.items():
            v = var(lp, f"live_{q}_{k}", 0)
            lp += v >= xs[k] - most[q] * y, f"live_{q}_{k}"
            terms.append((v, xs[k]))
            xs[k] = v
        frozen[k] = (y, terms)
    return frozen


def add_memory_rows(lp: pulp.LpProblem, problem: PartitionProblem, mem: list, held: list, grad_in: list,
                 mem_tol: float) -> bool:
    """Add the memory rules of `step_model.memory_rows` (each stage in forward and in backward,
    with what its GPU holds for the stages around it) and return whether a constant one
    already fails.

    `mem[k]` is MemoryModel.footprint of stage k's sums, `held[k]` MemoryModel.held, `grad_in[k]`
    stage k's M input gradients, all >= 0 (bytes). The prefetch's free-memory term, which the
    MIP leaves out (partition.py's docstring), needs W_k <= both footprints: checked here.
    """
    mm, n = problem.memory, len(problem.gpus)
    base = mm.footprint(0.0, 0.0, 0.0, 0.0, 0.0)
    units = [mm.footprint(*(1.0 if j == i else 0.0 for j in range(5))) for i in range(5)]
    cf, cb = ([u[d] - base[d] for u in units] for d in (0, 1))  # per weights, grads, recompute, boundary, work
    nonneg = lambda const, coefs: const >= -1e-9 * max(1.0, abs(const)) and all(c >= -1e-9 for c in coefs)
    assert nonneg(base[0], [cf[0] - 1, *cf[1:]]) and nonneg(base[1], [cb[0] - 1, *cb[1:]]), \
        "the MIP assumes a stage's memory footprint holds at least its weights"
    infeasible = False
    rows = memory_rows([f for f, _ in mem], [b for _, b in mem], held, grad_in, n)
    for k, d, row, with_ in rows:
        row = row * (1 / (problem.capacity[k % n] * (1 + mem_tol)))
        if not isinstance(row, pulp.LpAffineExpression) or not row.keys():  # no variable in it
            infeasible |= float(row.constant if isinstance(row, pulp.LpAffineExpression) else row) > 1
        else:
            lp += row <= 1, f"memory_{'fb'[d]}_{'_'.join(map(str, (k, *with_)))}"
    return infeasible
