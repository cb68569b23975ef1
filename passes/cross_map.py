"""Cross mapping: choose the GPU order so that transfers running at the same time do not
share PCIe links.

Stage k runs on `order[k % N]`. Neighbouring stages run at nearly the same time, so their
weight uploads (DRAM -> GPU) and activation hops (GPU -> GPU) overlap; when their routes
share a switch uplink or a root complex they slow each other down.

Two costs, both minimised over orders (exactly up to 8 GPUs, by local search above):

* `paper_cost` — Mobius (Feng et al., ASPLOS 2023):
  Σ_{i<j} shared(o_i, o_j) / (j - i), where shared(a, b) is the number of GPUs under the
  root complex of a and b when they share one, else 0. (The public prototype,
  torchmobius `get_device_order`, used 1 instead of 0 for different root complexes; that
  only adds a constant-free bias, we follow the paper.)
* `contention_cost` — ours, read off the topology graph instead of root-complex labels.
  Each stage k has transfers: its weight upload along route(host, g_k) with `stage_bytes[k]`
  bytes (1 each when not given), and (k < S-1) its activation hop along route(g_k, g_{k+1})
  with `act_bytes[k]` bytes (all M micro-batches; left out when not given, since their size
  relative to the weights is then unknown). Two transfers of stages k and k+d (1 <= d <= N-1) overlap in
  time with weight 1/d (stage k+d starts about d stage-steps later, as in the paper), and
  for every directed link they both cross they delay each other by about
  min(bytes) / link bandwidth (while both flow, each gets half the link). The cost is the
  sum of those delays (seconds when bytes are real):

      Σ_{k, d} (1/d) Σ_{τ ∈ T_k, τ' ∈ T_{k+d}} Σ_{ℓ ∈ route(τ) ∩ route(τ')} min(x_τ, x_τ') / bw_ℓ

  Links are directed, so an upload and a gradient download never collide, and a link that
  no two routes share costs nothing: a switch's GPU ports, a second socket's uplink, an
  NVLink. With S > N the pair (slot N-1, slot 0) is a neighbour too (stage N-1 -> N).

The cost is a sum over pairs of slots of a table indexed by the GPUs placed there, so one
numpy gather prices all 8! = 40,320 orders at once.

>>> cross_map(Topology.preset("mobius-testbed"))
('gpu0', 'gpu4', 'gpu1', 'gpu5', 'gpu2', 'gpu6', 'gpu3', 'gpu7')
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping, Sequence

import numpy as np

from mobius_fx.errors import MobiusError

__all__ = ["paper_cost", "best_order_paper", "contention_cost", "best_order_contention", "cross_map"]

_EXACT = 8  # enumerate every order up to this many GPUs
_GB = 1e9  # costs are kept in GB-scaled units so ties compare cleanly


# ------------------------------------------------------------------------ the cost engine
class _PairCost:
    """cost(order) = Σ_{a,b} w2[a,b]·c2[o_a,o_b] + Σ_{a,b} w3[a,b]·c3[o_a,o_{a+1},o_b]
    + Σ_{a,b} w4[a,b]·c4[o_a,o_{a+1},o_b,o_{b+1}] over slots a, b (indices mod N); GPU ids are
    0..N-1. The weights hold the time decay and bytes, the tables the shared links."""

    def __init__(self, n: int, w2: np.ndarray, c2: np.ndarray, w3: np.ndarray | None = None,
                 c3: np.ndarray | None = None, w4: np.ndarray | None = None, c4: np.ndarray | None = None):
        self.n = n
        self.terms = [(w, c) for w, c in ((w2, c2), (w3, c3), (w4, c4)) if w is not None and np.any(w)]

    def __call__(self, orders: np.ndarray) -> np.ndarray:
        """Costs of a batch of orders (shape [B, N] of GPU ids)."""
        nxt = np.roll(orders, -1, axis=1)
        out = np.zeros(len(orders))
        for w, c in self.terms:
            for a, b in zip(*np.nonzero(w)):
                if c.ndim == 2:
                    v = c[orders[:, a], orders[:, b]]
                elif c.ndim == 3:
                    v = c[orders[:, a], nxt[:, a], orders[:, b]]
                else:
                    v = c[orders[:, a], nxt[:, a], orders[:, b], nxt[:, b]]
                out += w[a, b] * v
        return out


def _best(cost: _PairCost) -> np.ndarray:
    """The cheapest order (identity first among equals): all of them up to 8 GPUs, else the
    best of local searches from the identity and from an alternating seed."""
    n = cost.n
    ident = np.arange(n)
    if n <= _EXACT:
        perms = np.array(list(itertools.permutations(range(n))), dtype=np.intp)  # identity first
        vals = np.concatenate([cost(perms[i:i + 8192]) for i in range(0, len(perms), 8192)])
        return perms[int(np.flatnonzero(vals <= vals.min() + 1e-12 * max(1.0, abs(vals.min())))[0])]
    seeds = [ident, _alternating(cost)]
    results = [_local_search(cost, s) for s in seeds]
    base = cost(ident[None])[0]
    order, val = min(results, key=lambda r: r[1])
    return order if val < base else ident


def _alternating(cost: _PairCost) -> np.ndarray:
    """GPUs dealt round-robin over groups of mutually expensive GPUs (root complexes)."""
    n, c2 = cost.n, next((c for w, c in cost.terms if c.ndim == 2), None)
    if c2 is None:
        return np.arange(n)
    groups: list[list[int]] = []
    for g in range(n):
        for grp in groups:
            if c2[g, grp[0]] > 0:
                grp.append(g)
                break
        else:
            groups.append([g])
    out = [g for tier in itertools.zip_longest(*groups) for g in tier if g is not None]
    return np.array(out, dtype=np.intp)


def _local_search(cost: _PairCost, order: np.ndarray) -> tuple[np.ndarray, float]:
    """Best-improvement over all 2-swaps and insertions (each batch priced at once)."""
    n = cost.n
    cur = order.copy()
    val = cost(cur[None])[0]
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    while True:
        cands = []
        for i, j in pairs:
            if i < j:
                s = cur.copy()
                s[i], s[j] = s[j], s[i]
                cands.append(s)
            moved = list(np.delete(cur, i))
            moved.insert(j, cur[i])
            cands.append(np.array(moved, dtype=np.intp))
        batch = np.array(cands)
        vals = cost(batch)
        k = int(np.argmin(vals))
        if vals[k] >= val - 1e-12 * max(1.0, abs(val)):
            return cur, float(val)
        cur, val = batch[k], vals[k]


# ------------------------------------------------------------------------------ the paper
def _paper_engine(gpus: Sequence[str], root_complex: Mapping[str, str]) -> _PairCost:
    n = len(gpus)
    missing = [g for g in gpus if g not in root_complex]
    if missing:
        raise MobiusError(f"no root complex given for GPU(s) {', '.join(missing)}; pass a mapping "
                          f"GPU name -> root complex for every GPU in the order")
    rc = [root_complex[g] for g in gpus]
    size = {r: rc.count(r) for r in rc}
    c2 = np.array([[size[rc[a]] if rc[a] == rc[b] else 0 for b in range(n)] for a in range(n)], dtype=float)
    w2 = np.array([[1.0 / (b - a) if b > a else 0.0 for b in range(n)] for a in range(n)])
    return _PairCost(n, w2, c2)


def paper_cost(order: Sequence[str], root_complex: Mapping[str, str]) -> float:
    """Mobius's contention degree of an order: Σ_{i<j} shared(o_i, o_j)/(j−i).

    shared = the number of GPUs (of `order`) under the common root complex, 0 if different.

    >>> paper_cost(["gpu0", "gpu1"], {"gpu0": "cpu0", "gpu1": "cpu0"})
    2.0
    """
    order = list(order)
    return float(_paper_engine(order, root_complex)(np.arange(len(order))[None])[0])


def best_order_paper(gpus: Sequence[str], root_complex: Mapping[str, str]) -> tuple[str, ...]:
    """The order minimising `paper_cost` (exact up to 8 GPUs, local search above).

    >>> best_order_paper([f"gpu{i}" for i in range(4)], {"gpu0": "a", "gpu1": "a", "gpu2": "b", "gpu3": "b"})
    ('gpu0', 'gpu2', 'gpu1', 'gpu3')
    """
    gpus = list(gpus)
    return tuple(gpus[i] for i in _best(_paper_engine(gpus, root_complex)))


# ------------------------------------------------------------------------ our contention
def _links(topology: Any, a: str, b: str) -> dict[tuple[str, str], float]:
    r = topology.route(a, b)
    return {(u, v): _GB / topology.link_bandwidth(u, v) for u, v in zip(r, r[1:])}


def _contention_engine(gpus: Sequence[str], topology: Any, num_stages: int | None,
                       stage_bytes: Sequence[float] | None, act_bytes: Sequence[float] | None) -> _PairCost:
    n = len(gpus)
    s = num_stages if num_stages is not None else (len(stage_bytes) if stage_bytes is not None else 2 * n)
    if s < 1:
        raise MobiusError(f"num_stages={s}; a pipeline has at least one stage")
    x = list(stage_bytes) if stage_bytes is not None else [1.0] * s
    y = list(act_bytes) if act_bytes is not None else [0.0] * s
    if len(x) != s or len(y) < s - 1:
        raise MobiusError(f"stage_bytes has {len(x)} and act_bytes {len(y)} entries for {s} stages; "
                          f"give one per stage")
    up = [_links(topology, "host", g) for g in gpus]
    hop = [[_links(topology, g, h) for h in gpus] for g in gpus]
    shared = lambda p, q: sum(c for l, c in p.items() if l in q)
    c2 = np.array([[shared(up[a], up[b]) for b in range(n)] for a in range(n)])
    c3 = np.array([[[shared(hop[a][a2], up[b]) for b in range(n)] for a2 in range(n)] for a in range(n)])
    c4 = np.array([[[[shared(hop[a][a2], hop[b][b2]) for b2 in range(n)] for b in range(n)]
                    for a2 in range(n)] for a in range(n)])
    w2, w3, w4 = (np.zeros((n, n)) for _ in range(3))
    for k in range(s):
        for d in range(1, n):
            j = k + d
            if j >= s:
                break
            a, b, om = k % n, j % n, 1.0 / d
            w2[a, b] += om * min(x[k], x[j])
            if k < s - 1:
                w3[a, b] += om * min(y[k], x[j])  # hop out of k vs upload of j
            if j < s - 1:
                w3[b, a] += om * min(y[j], x[k])  # hop out of j vs upload of k
                if k < s - 1:
                    w4[a, b] += om * min(y[k], y[j])
    return _PairCost(n, w2, c2, w3, c3, w4, c4)


def _gpu_names(topology: Any) -> list[str]:
    return [g.name for g in topology.gpus]


def contention_cost(order: Sequence[str], topology: Any, *, stage_bytes: Sequence[float] | None = None,
                    act_bytes: Sequence[float] | None = None, num_stages: int | None = None) -> float:
    """Our contention estimate of `order` on `topology` (see the module docstring).

    Upload bytes default to 1 per stage (then the cost counts shared links weighted by
    1/(bandwidth in GB/s) and by 1/d); activation hops count only when `act_bytes` is
    given; `num_stages` defaults to len(stage_bytes) or 2N.
    The value is in seconds when bytes are real bytes, times 1e9 (GB-scaled units).

    >>> contention_cost(["gpu0", "gpu4", "gpu1", "gpu5"], Topology.virtual(gpus=8, root_complexes=2))
    0.09375
    """
    order = list(order)
    _check_order(order, topology)
    eng = _contention_engine(order, topology, num_stages, stage_bytes, act_bytes)
    return float(eng(np.arange(len(order))[None])[0])


def best_order_contention(topology: Any, *, gpus: Sequence[str] | None = None, num_stages: int | None = None,
                          stage_bytes: Sequence[float] | None = None,
                          act_bytes: Sequence[float] | None = None) -> tuple[str, ...]:
    """The order of `gpus` (default: all) minimising `contention_cost`."""
    names = list(gpus) if gpus is not None else _gpu_names(topology)
    _check_order(names, topology)
    eng = _contention_engine(names, topology, num_stages, stage_bytes, act_bytes)
    return tuple(names[i] for i in _best(eng))


def _check_order(order: Sequence[str], topology: Any) -> None:
    known = set(_gpu_names(topology))
    if len(set(order)) != len(order) or not set(order) <= known or not order:
        raise MobiusError(f"order {tuple(order)} must list distinct GPUs of the topology "
                          f"({', '.join(sorted(known))})")


def cross_map(topology: Any, *, num_stages: int | None = None, stage_bytes: Sequence[float] | None = None,
              act_bytes: Sequence[float] | None = None, method: str = "contention",
              gpus: Sequence[str] | None = None) -> tuple[str, ...]:
    """The GPU order for the pipeline: stage k runs on the result's [k % N].

    method: "contention" (ours, from the topology's links), "paper" (Mobius's root-complex
    count) or "identity" (the topology's order).

    >>> cross_map(Topology.virtual(gpus=4, root_complexes=2), method="paper")
    ('gpu0', 'gpu2', 'gpu1', 'gpu3')
    """
    names = list(gpus) if gpus is not None else _gpu_names(topology)
    if method == "identity":
        _check_order(names, topology)
        return tuple(names)
    if method == "paper":
        _check_order(names, topology)
        rc = {g.name: g.root_complex for g in topology.gpus}
        return best_order_paper(names, rc)
    if method == "contention":
        return best_order_contention(topology, gpus=names, num_stages=num_stages, stage_bytes=stage_bytes,
                                     act_bytes=act_bytes)
    raise MobiusError(f"cross_map method {method!r}; use 'contention', 'paper' or 'identity'")
