"""`TransferLog`: the bytes and copies a device moved, per kind, direction and stage, as the
schedule IR books them (a `Device` keeps one; mobius_fx/runtime/device_books.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["TransferLog"]


class TransferLog:
    """Bytes and copies moved, per (kind, direction, stage); kind is weight | gradient |
    activation | input (a stage input saved for backward) | buffer, direction h2d | d2h | d2d.

    The runtime says which stage a copy belongs to (`with log.stage(k):`), so the log can be
    compared with the schedule IR per GPU, kind and stage; copies made outside are stage None.
    """

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, int | None], list[int]] = {}
        self._mark: dict[tuple[str, str, int | None], list[int]] = {}
        self._stage = threading.local()

    @contextlib.contextmanager
    def stage(self, k: int | None) -> Iterator[None]:
        old = getattr(self._stage, "k", None)
        self._stage.k = k
        try:
            yield
        finally:
            self._stage.k = old

    def add(self, kind: str, direction: str, nbytes: int, count: int = 1) -> None:
        c = self._counts.setdefault((kind, direction, getattr(self._stage, "k", None)), [0, 0])
        c[0] += count
        c[1] += nbytes

    def bytes(self, kind: str | None = None, direction: str | None = None) -> int:
        return sum(b for (k, d, _), (_, b) in self._counts.items()
                   if (kind is None or k == kind) and (direction is None or d == direction))

    def count(self, kind: str | None = None, direction: str | None = None) -> int:
        return sum(n for (k, d, _), (n, _) in self._counts.items()
                   if (kind is None or k == kind) and (direction is None or d == direction))

    def as_dict(self, *, since_mark: bool = False, by_stage: bool = False) -> dict:
        """{"kind direction": {"count", "bytes"}}, in total or since the last `mark()`; with
        `by_stage`, {"kind direction": {stage: {"count", "bytes"}}}."""
        out: dict = {}
        for (k, d, st), (n, b) in sorted(self._counts.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or -1)):
            n0, b0 = self._mark.get((k, d, st), (0, 0)) if since_mark else (0, 0)
            if not (n - n0 or b - b0):
                continue
            if by_stage:
                out.setdefault(f"{k} {d}", {})[st] = {"count": n - n0, "bytes": b - b0}
            else:
                c = out.setdefault(f"{k} {d}", {"count": 0, "bytes": 0})
                c["count"] += n - n0
                c["bytes"] += b - b0
        return out

    def mark(self) -> None:
        self._mark = {key: list(v) for key, v in self._counts.items()}

    def clear(self) -> None:
        self._counts.clear()
        self._mark.clear()
