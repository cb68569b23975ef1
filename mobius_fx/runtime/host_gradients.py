"""Host gradients: a master's gradient on the host, summed from the downloads of every stage that
holds it, and the storage it is summed into.

The runtime (`engine.Runtime._gradients`), the optimizer overlap (`overlap.py`) and the
data-parallel reducer (`data_parallel.py`) all sum a master's downloads here, one way, so their
results are bit for bit the same; `finite_flag` tells on the GPU, before the download, whether
a stage's gradients are all finite. Every pass over host memory is counted
(`host_counters.COUNTERS`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from mobius_fx.runtime.device_books import nbytes
from mobius_fx.runtime.host_counters import COUNTERS

__all__ = ["GradHomes", "is_home", "host_gradient", "sum_downloads", "convert_span", "finite_flag"]

# Every gradient home (`GradHomes.take`), by id, held weakly: a download written into one (the
# runtime's widened downloads) is storage kept across steps, not fresh memory (`grad_alloc`).
_KEPT: dict[int, weakref.ref] = {}


def is_home(t: torch.Tensor) -> bool:
    """Whether `t` is a gradient home some `GradHomes` made (storage kept across steps)."""
    ref = _KEPT.get(id(t))
    return ref is not None and ref() is t


class GradHomes:
    """Per master, host storage its gradient is converted into, kept across steps: a step does not
    allocate (and fault in) a new fp32 gradient per master after `zero_grad(set_to_none=True)`
    freed the last. `.grad` is still None between `zero_grad` and the next backward, as torch
    users expect; the hand-over points it at the master's home again. A home someone else still
    holds (`g = p.grad` kept across steps, a view of it, async's update in flight) is left to
    them and another one used, so no gradient a user kept is overwritten. Two homes are kept per
    master: under mode="async" the update in flight reads step t's gradient while step t+1's is
    converted (a double buffer, no new memory per step)."""

    KEEP = 2

    def __init__(self) -> None:
        self._homes: dict[int, tuple[weakref.ref, list[torch.Tensor]]] = {}

    def take(self, master: torch.Tensor, pinned: bool = False) -> torch.Tensor:
        """A home for `master`'s gradient that nobody else holds (made when none is free).
        `pinned`: one in page-locked memory, which a GPU's download can be copied straight into
        (the runtime's widened downloads on CUDA, `Runtime._download`)."""
        entry = self._homes.get(id(master))
        if entry is None or entry[0]() is not master:
            entry = self._homes[id(master)] = (weakref.ref(master), [])
        homes = entry[1]
        for i in range(len(homes)):
            if (homes[i].shape == master.shape and homes[i].dtype == master.dtype and _alone(homes[i])
                    and (not pinned or homes[i].is_pinned())):
                return homes[i]
        if pinned:
            home = torch.empty(master.shape, dtype=master.dtype, pin_memory=True)
        else:
            home = torch.empty_like(master, memory_format=torch.contiguous_format)
        COUNTERS.add("grad_alloc", nbytes(home))
        _KEPT[id(home)] = weakref.ref(home, lambda _, key=id(home): _KEPT.pop(key, None))
        homes.insert(0, home)
        del homes[self.KEEP:]  # the oldest held elsewhere (a gradient the user kept) is theirs now
        return home


def _alone(t: torch.Tensor) -> bool:
    """Only GradHomes holds `t` (no Python reference, no view, no `.grad` slot elsewhere)."""
    import sys
    return sys.getrefcount(t) <= 3 and torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2


def host_gradient(master: torch.Tensor, thunks: Sequence[Callable[[], torch.Tensor | None]], homes: GradHomes | None = None) -> torch.Tensor | None:
    """A master's host gradient: the downloads of every stage that holds it (each thunk gives
    one, in the streamed dtype, or None), summed in order in the master's dtype on its device;
    None when there is none. The runtime (`_gradients`), the optimizer overlap and the
    data-parallel reducer all sum this one way, so their results are bit for bit the same.
    A download already in the master's dtype is the gradient itself (no pass); one to convert is
    converted into the master's home in `homes` when given (kept across steps), else into new
    memory. The passes are counted (`host_counters.COUNTERS`)."""
    return sum_downloads(master, [g for g in (thunk() for thunk in thunks) if g is not None], homes)


def sum_downloads(master: torch.Tensor, downloads: Sequence[torch.Tensor],
                  homes: GradHomes | None = None) -> torch.Tensor | None:
    """`host_gradient` of downloads already waited for (None entries dropped by the caller)."""
    total = None
    for g in downloads:
        if total is None:
            if g.dtype == master.dtype and g.device == master.device:
                total = g
                if not is_home(g):  # a download into a gradient home (widened on the GPU) is not new memory
                    COUNTERS.add("grad_alloc", nbytes(g))  # the download's own buffer, handed on
            else:
                if homes is not None:
                    total = homes.take(master)
                else:
                    total = torch.empty_like(master, memory_format=torch.contiguous_format)
                    COUNTERS.add("grad_alloc", nbytes(total))
                with torch.no_grad():
                    total.copy_(g)
                COUNTERS.add("grad_convert", nbytes(g) + nbytes(total))
        else:
            with torch.no_grad():  # in the master's dtype: the same bits as adding g.to(master.dtype), no temporary
                total.add_(g.to(device=master.device) if g.device != master.device else g)
            COUNTERS.add("grad_convert", nbytes(g) + 2 * nbytes(total))
    return total


def convert_span(home: torch.Tensor, downloads: Sequence[torch.Tensor], a: int, b: int) -> None:
    """Elements [a, b) of `sum_downloads` (the first download copied and converted, the others
    added in the master's dtype: the same operations, so the same bits) into `home`, a
    contiguous gradient home: the optimizer overlap converts a gradient span by span, each right
    before the optimizer steps it, while it is in cache."""
    span = home.view(-1)[a:b]
    span.copy_(downloads[0].reshape(-1)[a:b])
    for g in downloads[1:]:
        span.add_(g.reshape(-1)[a:b])


def finite_flag(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool on the gradients' device: False when any element of `grads` is non-finite.
    Sums in fp32 (a reduction, no temporary the size of a gradient): a NaN or an infinity
    always makes the sum non-finite; finite values so large that their sum overflows read as
    non-finite too, which only makes the optimizer overlap leave those stages to opt.step()."""
    return torch.stack([g.sum(dtype=torch.float32) for g in grads]).sum().isfinite()
