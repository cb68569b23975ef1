"""What every device kind of `mobius_fx.runtime.devices` shares beyond the books
(`mobius_fx.runtime.device_books.Device`): the check that a saved stage input is unchanged, and the
RNG of a GPU played by the CPU."""

from __future__ import annotations

import contextlib
import weakref

import torch

from mobius_fx.errors import MobiusError


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

    @contextlib.contextmanager
    def rng(self, state):
        now = torch.get_rng_state()
        torch.set_rng_state(state)
        try:
            yield
        finally:
            torch.set_rng_state(now)
