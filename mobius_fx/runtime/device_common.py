"""What the device kinds of `mobius_fx.runtime.devices` share beyond the books
(`mobius_fx.runtime.device_books.Device`): an empty weight slot (`empty_slot`), a saved stage
input (`SavedInput`) and the check that it is unchanged, and the RNG of a GPU played by the CPU."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from mobius_fx.errors import MobiusError


def empty_slot(like: torch.Tensor, dtype: torch.dtype | None, parameter: bool, device: torch.device) -> torch.Tensor:
    """A tensor shaped like `like` on `device` with no storage (`Device.new_slot`)."""
    dt = dtype if (dtype is not None and like.is_floating_point()) else like.dtype
    t = torch.empty(like.shape, dtype=dt, device=device)
    t.untyped_storage().resize_(0)
    if parameter:
        return nn.Parameter(t, requires_grad=False)
    return t


class SavedInput:
    """A stage input kept for backward (`Device.offload`): its host copy and what orders reading
    it (a CUDA event and the input's version; on virtual devices the version the input had)."""

    __slots__ = ("host", "event")

    def __init__(self, host: torch.Tensor, event: object) -> None:
        self.host = host
        self.event = event


def check_unchanged(gpu: str, ref: "weakref.ref[torch.Tensor]", version: int) -> None:
    """A stage input saved for backward must be as the forward used it when it is restored."""
    t = ref()
    if t is not None and t._version != version:
        raise MobiusError(
            f"an input saved for backward on {gpu} was modified in place after the forward used it "
            f"(version {version} -> {t._version}); a stage must not change its inputs in place "
            f"(use the out-of-place op, e.g. relu instead of relu_)")


class CpuRng:
    """The RNG of a GPU played by the CPU: the CPU generator (saved per stage call, replayed by
    the backward's recompute)."""

    def rng_state(self):
        return torch.get_rng_state()

    def rng_differs(self, other):
        """The CPU generator is one per process: every GPU the CPU plays draws from it."""
        return None if isinstance(other, CpuRng) else super().rng_differs(other)

    @contextlib.contextmanager
    def rng(self, state):
        now = torch.get_rng_state()
        torch.set_rng_state(state)
        try:
            yield
        finally:
            torch.set_rng_state(now)
