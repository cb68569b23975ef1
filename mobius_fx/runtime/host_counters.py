"""The host's work outside the optimizer, counted: what `benchmarks/host_path.py` reports.

On a host-bound pipeline every pass the CPU makes over the weights or gradients besides the
optimizer's own is on the critical path (issue 27: 40 bytes per parameter per step where the fused
optimizer needs 28). The runtime counts those passes here, in bytes read plus written:

- `pin`          — a master copied (and cast) into the streamed copy an upload reads, by the upload
                   worker (`StreamDevice._pinned_copy`; once per master, whichever GPUs upload it);
- `refresh`      — the same copy written by the optimizer overlap right after a stage's step
                   (`StreamDevice.refresh`): beside the optimizer, off the critical path in sync mode;
- `grad_convert` — a downloaded gradient converted into the master's dtype, or summed with another
                   stage's (a tied weight), on its way to `.grad` (`host_gradient`), a pass of its own
                   (a tied weight's two downloads summed in one: `overlap._summed`, read 2 + 2, write 4);
- `grad_fused`   — the same conversion done inside the optimizer overlap's step of a stage, span by
                   span (`overlap.OverlapOptimizer._step_fused`): each span of `.grad` is written and at
                   once read by the optimizer from cache. Beside the optimizer, like `refresh`: the
                   bytes are those of writing the fp32 `.grad` torch users read after backward; and
                   the fused host pass's own beside its 28 B: the `.grad` it writes, a tied weight's
                   second download it reads (`host_optimizer.step_span`'s `grad2`);
- `grad_alloc`   — fresh host memory allocated for a gradient (faulted in by its first write);
- `grad_add`     — a gradient added into an existing `.grad` (accumulation the loop asked for);
- `shadow`       — mode="async": a parameter copied into the shadow its update is written into,
                   before the optimizer's own step (where the fused host pass does not step it:
                   that pass writes the shadow out of place, no copy);
- `grad_read`    — mode="async": the fused host pass reading the fp32 `.grad` (`keep_grads`, the
                   default) where it would read the streamed-dtype download: the difference (2 B
                   per parameter in bf16), beside the optimizer;
- `spec_copy`    — pipe.overlap(mode="sync") speculating (a clipped loop) where the C++ kernel does
                   not step: the optimizer's moments copied into spare buffers before the pass steps
                   them there, so the old ones stay for a rollback (the C++ kernel writes them out of
                   place in its own pass: 0 here; `overlap.OverlapOptimizer._speculate`);
- `spec_check`   — the same, at opt.step(): the final `.grad` of a speculated parameter read and
                   compared bit for bit with the download the pass read (only where its version
                   changed: `clip_grad_norm_` multiplies even by 1.0);
- `finite_check` — pipe.overlap(mode="sync") reading a stage's gradients on the host for a
                   non-finite value before stepping it during backward (a loop may skip a step on
                   one); only where the GPU could not tell (a device without `fetch`, data
                   parallel): otherwise the GPU sums them before the download (`finite_flag`).

A step with nothing but the optimizer has 0 in all but `refresh`, `grad_fused` and `grad_read`
(`BESIDE`). The counters are process-wide (several pipelines add into them) and cheap: one
locked addition per tensor, never per element.

`watch_optimizer_steps()` (installed by every stream-device pipeline) bumps the version counter of
the parameters a `torch.optim` step changed: the fused optimizers write without bumping it, and
the streamed copies are made again only for masters whose storage or version changed. Only
parameters that are some pipeline's masters (`watch_masters`, held weakly) are bumped: an
optimizer of the same process unrelated to any pipeline is left alone.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["COUNTERS", "HostCounters", "watch_optimizer_steps", "watch_masters", "masters_stepped", "BESIDE"]

KINDS = ("pin", "refresh", "grad_convert", "grad_fused", "grad_alloc", "grad_add", "finite_check", "shadow",
         "grad_read", "spec_copy", "spec_check")
BESIDE = ("refresh", "grad_fused", "grad_read")  # written inside or right after the optimizer's step


class HostCounters:
    """Bytes the host read and wrote per kind of pass (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = dict.fromkeys(KINDS, 0)

    def add(self, kind: str, n: int) -> None:
        with self._lock:
            self._bytes[kind] += int(n)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._bytes)

    @staticmethod
    def since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        return {k: after[k] - before.get(k, 0) for k in after}

    @staticmethod
    def outside_optimizer(counts: dict[str, int]) -> int:
        """The bytes of passes that are neither the optimizer's step nor written beside it."""
        return sum(v for k, v in counts.items() if k not in BESIDE)

    @staticmethod
    def beside_optimizer(counts: dict[str, int]) -> int:
        """The bytes written inside or right after the optimizer's step (`BESIDE`)."""
        return sum(v for k, v in counts.items() if k in BESIDE)


COUNTERS = HostCounters()

_installed = False
_install_lock = threading.Lock()
_MASTERS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def watch_masters(masters: Iterable[torch.Tensor]) -> None:
    """These parameters are a pipeline's masters: `watch_optimizer_steps` bumps their version
    when an optimizer steps them. Held weakly (a dead model's leave the registry)."""
    for m in masters:
        _MASTERS[id(m)] = m


def masters_stepped(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """The global step post-hook `watch_optimizer_steps` installs: the pipeline masters `optimizer`
    stepped (those with a gradient) get a new version (the optimizer overlap calls it after each
    of its own, hook-less, calls of the step)."""
    params = [p for g in optimizer.param_groups for p in g["params"]
              if p.grad is not None and _MASTERS.get(id(p)) is p]
    if params:
        torch.autograd.graph.increment_version(params)


def watch_optimizer_steps() -> None:
    """Install, once per process, a global `torch.optim` step post-hook that bumps the version of
    every pipeline master (`watch_masters`) the step had a gradient for (`fused=True`
    AdamW/Adam/SGD write theirs without bumping it; the foreach and for-loop ones already do)."""
    global _installed
    with _install_lock:
        if not _installed:
            register_optimizer_step_post_hook(masters_stepped)
            _installed = True
