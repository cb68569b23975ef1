"""Data parallel across servers: one Mobius pipeline per rank, gradients averaged as stages complete.

`mobius_fx.compile(..., process_group=pg)` (default: the world group when `torch.distributed` is
initialised) runs the same plan on every rank, each on its own slice of the global batch (feed
each rank its own data, as with DDP and a `DistributedSampler`). At compile, rank 0's weights and
buffers are broadcast to the others, so every rank starts from the same model. During
`loss.backward()`, as soon as a stage's gradients are complete in host memory (its last
micro-batch downloaded; a tied parameter once every stage holding it is), they are summed into
one flat bucket per stage and dtype and averaged across ranks (`all_reduce` over the process
group: gloo for the CPU masters) on a communication thread, while the GPUs go on with earlier
stages; `.grad` receives the average. With a mean-reduced loss that is the gradient of the mean
over the global batch, so every rank then takes the same optimizer step: the weights stay equal
across ranks without any further communication. `pipe.overlap(opt, mode="sync")` steps a stage
as soon as its averaged gradients are back.

Every rank must run the same sequence of forward and backward calls (the buckets are reduced in
the order stages complete, which the schedule fixes); a parameter that gets no gradient on any
rank keeps `.grad` None, one that gets a gradient on some ranks only is averaged with zeros from
the others (as DDP with `find_unused_parameters=True`). Buffers (BatchNorm statistics) are not
synchronised after compile: each rank updates its own, as DDP with `broadcast_buffers=False`.
A rank that fails or hangs makes the others' collective fail after the process group's timeout
(`init_process_group(timeout=...)`, torch's default 30 minutes for gloo): that surfaces as a
`MobiusError` from `loss.backward()`, the weights and optimizer state still those of the step before.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.distributed as dist

from mobius_fx.errors import MobiusError
from mobius_fx.runtime.host_gradients import host_gradient

__all__ = ["GradientReducer", "default_group"]


def default_group(process_group: dist.ProcessGroup | bool | None) -> dist.ProcessGroup | None:
    """The process group `compile(process_group=...)` means: the one given; the world group
    when None and torch.distributed is initialised with more than one rank; else no data
    parallelism (returns None). `False` turns it off."""
    if process_group is False:
        return None
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return dist.group.WORLD
    if not (dist.is_available() and dist.is_initialized()):
        raise MobiusError("compile(process_group=...) needs torch.distributed initialised (dist.init_process_group("
                          "'gloo', ...) under torchrun); pass process_group=None for one process")
    return process_group


class GradientReducer:
    """Averages complete stage gradients across the ranks of `group` (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mobius-allreduce")
        self.buckets = 0  # collectives made (per stage, dtype and, sharded, owner)
        self.bytes = 0  # bytes reduced
        # pipe.overlap(opt, shard=True): id(param) -> the rank that steps it; its gradient is
        # reduced to that rank only (ZeRO-1: the others never hold it or its optimizer state)
        self.owners: dict[int, int] | None = None

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def broadcast_flat(self, flat: torch.Tensor, owner: int) -> None:
        """`owner`'s `flat` into every rank's (shard=True: the stepped parameters, gathered)."""
        dist.broadcast(flat, src=self._global(owner), group=self.group)
        self.bytes += flat.numel() * flat.element_size()

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values into every rank's `tensors` (the masters and buffers, at compile)."""
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t.data, src=self._global(0), group=self.group)

    def reduce(self, groups: list[tuple[torch.Tensor, list[Callable[[], torch.Tensor]]]]
               ) -> list[tuple[torch.Tensor, list[Callable[[], torch.Tensor | None]]]]:
        """Start averaging these masters' gradients (each: the thunks of its host gradient from
        every stage holding it); returns, per master, one thunk giving the average (None when no
        rank had a gradient for it)."""
        fut = self._comm.submit(self._reduce, groups)

        def take(i: int) -> Callable[[], torch.Tensor | None]:
            def thunk() -> torch.Tensor | None:
                try:
                    return fut.result()[i]
                except MobiusError:
                    raise
                except Exception as e:  # gloo timeouts, a peer that died
                    raise MobiusError(f"averaging gradients across the {self.world} ranks failed on rank {self.rank}: "
                                      f"{e}; another rank probably failed or left (its own error says why). The "
                                      f"weights and optimizer state are those of the step before") from e
            return thunk

        return [(m, [take(i)]) for i, (m, _) in enumerate(groups)]

    def _reduce(self, groups: list[tuple[torch.Tensor, list[Callable[[], torch.Tensor]]]]) -> list[torch.Tensor | None]:
        totals = [host_gradient(m, thunks) for m, thunks in groups]
        out: list[torch.Tensor | None] = [None] * len(groups)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (m, _) in enumerate(groups):
            by_dtype.setdefault(m.dtype, []).append(i)
        buckets: list[tuple[int | None, list[int]]] = []  # (owner rank or None: every rank, members)
        for dtype, idx in by_dtype.items():
            owners: dict[int | None, list[int]] = {}
            for i in idx:
                owners.setdefault(None if self.owners is None else self.owners.get(id(groups[i][0])), []).append(i)
            buckets += sorted(owners.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
        for owner, idx in buckets:
            dtype = groups[idx[0]][0].dtype
            parts = [totals[i].reshape(-1) if totals[i] is not None else torch.zeros(groups[i][0].numel(), dtype=dtype)
                     for i in idx]
            has = torch.tensor([float(totals[i] is not None) for i in idx], dtype=dtype)
            flat = torch.cat([*parts, has])
            if owner is None:
                dist.all_reduce(flat, group=self.group)
            else:
                dist.reduce(flat, dst=self._global(owner), group=self.group)
            self.buckets += 1
            self.bytes += flat.numel() * flat.element_size()
            if owner is not None and owner != self.rank:
                continue  # only the owner steps these parameters: the others get no gradient
            flat.div_(self.world)
            offset = 0
            for i in idx:
                n = groups[i][0].numel()
                out[i] = flat[offset:offset + n].view_as(groups[i][0])
                offset += n
            seen = flat[offset:]
            for j, i in enumerate(idx):
                if not seen[j] > 0:
                    out[i] = None
        return out

    def close(self) -> None:
        self._comm.shutdown()

