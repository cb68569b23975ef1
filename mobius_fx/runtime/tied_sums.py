"""A tied weight's gradient completed on a GPU: the runtime side of `schedule_ir.TiedSum`.

A tied weight (GPT-2's token embedding read again as its LM head) is held by two stages (or more),
so its gradient comes in partials, one per stage's download. When the backward widens the
gradient downloads to the masters' dtype (`Runtime.widens_gradients`: the optimizer overlap's
fp32 `.grad`, downloaded straight into it), the host summing the partials would read them and
write the fp32 `.grad` -- 6 bytes per parameter of that weight more than any other (sync; 8 under
async), the only bytes above 30 per parameter left on the host (benchmarks/host_path.py). Here the
stage that holds it first (its backward runs last) completes it on its GPU instead:

- each earlier holder downloads its partial as streamed, as before (`Runtime._download`);
- before the first holder's own download, each of those partials goes back up to its GPU
  (`fetch_partial`: the schedule IR's `send ... gradient host->gpu`, one per partial, logged as
  a "gradient" h2d copy of that stage);
- its download brings them up chunk by chunk, sums them in fp32 in the order the downloads
  came, its own partial last, and writes the sum into the master's `.grad` home as it widens
  (`Device.download(addends=)`): the same bits as the host's sum (`host_gradients.sum_downloads`:
  the first widened, each next added in fp32), one download of the master's bytes, and the host
  converts and sums nothing.

The links carry the partial once more (up); the GPU holds chunks of it and of the sum (at most
`WIDEN_CHUNK` elements, fewer where less memory is free: `Device.widen_chunk`), never a whole
partial. Where a schedule downloads the first holder's gradients on several GPUs (ZeRO-3
offload's replicas) its IR has no such sends and the host sums the partials as before: the step
follows its IR (`Step.gpu_sums`). A first holder that gets no gradient of its own this step (its
output read detached) leaves the sum to the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from mobius_fx.errors import MobiusError
from mobius_fx.runtime.device_books import nbytes
from mobius_fx.runtime.stage_state import StageState, Step

# id(master) -> the stages holding it (`Runtime.holders`)
Holders = Mapping[int, tuple[int, ...]]

__all__ = ["widenable", "tied_sums", "fetch_partial", "partials", "sums_at"]


def widenable(master: torch.Tensor, streamed: torch.dtype) -> bool:
    """A trainable fp32 parameter on the host whose GPU copy is `streamed`, narrower: its gradient
    may be downloaded widened (`Runtime.widened`: when one stage holds it; else summed here)."""
    return (isinstance(master, torch.nn.Parameter) and master.requires_grad and master.dtype == torch.float32
            and streamed.is_floating_point and streamed.itemsize < master.dtype.itemsize and master.is_cpu)


def tied_sums(stages: Sequence[StageState], holders: Holders, k: int) -> dict[int, tuple[int, ...]]:
    """{slot j of stage k: the other stages holding its master, in the order their downloads
    come (the last stage first)} for each tied master whose gradient stage k completes on its
    GPU when the backward widens: stage k holds it first, and it is `widenable`."""
    st = stages[k]
    out: dict[int, tuple[int, ...]] = {}
    for j, (m, is_param) in enumerate(zip(st.masters, st.is_param)):
        held = holders.get(id(m), ())
        if (is_param and len(held) > 1 and min(held) == k and id(m) not in {id(x) for x in st.masters[:j]}
                and widenable(m, st.slots[j].dtype)):
            out[j] = tuple(sorted((h for h in held if h != k), reverse=True))
    return out


def sums_at(stages: Sequence[StageState], holders: Holders, k: int, step: Step) -> dict[int, tuple[int, ...]]:
    """`tied_sums` for this backward: none unless it widens its downloads (`step.widen`, decided
    at its first flush), or when the schedule IR it runs sums nothing on stage k's GPU
    (`step.gpu_sums`, the executor's; None, the model pipeline's own backward: every first
    holder sums)."""
    if not step.widen or (step.gpu_sums is not None and k not in step.gpu_sums):
        return {}
    return tied_sums(stages, holders, k)


def fetch_partial(stages: Sequence[StageState], holders: Holders, k: int, step: Step) -> None:
    """The next partial stage k sums (in the order `tied_sums` lists its slots, each slot's
    partials in the order they were downloaded), for stage k's GPU: the schedule IR's `send ...
    gradient host->gpu` of stage k, logged as that copy. The host tensor, landed, is handed to
    stage k's download, which brings it up chunk by chunk as it sums (`Device.download(addends=)`:
    the GPU holds no whole partial). It leaves the step's pending downloads, so the optimizer
    overlap is handed the sum alone. None pending: a holder's backward gave the weight no gradient
    this step (it reads it detached), so there is nothing to send."""
    st = stages[k]
    sums = sums_at(stages, holders, k, step)
    for j in sums:
        m = st.masters[j]
        at = next((n for n, (master, _) in enumerate(step.pending) if master is m), None)
        if at is None:
            continue
        _, thunk = step.pending.pop(at)
        host = thunk()  # landed long before: its stage flushed before this stage's backward ended
        with st.device.log.stage(k):
            st.device.log.add("gradient", "h2d", nbytes(host))
        step.partials.setdefault((k, j), []).append(host)
        return
    if not sums:
        raise MobiusError(f"the schedule IR sends a tied weight's gradient partial to stage {k}'s GPU "
                          f"({st.device.name}), but this backward sums none there (widened downloads: "
                          f"{bool(step.widen)}; the stages summing on their GPU: {step.gpu_sums}): the IR is not "
                          f"this step's; build it with the pipeline's widening (`Pipeline.schedule_ir`)")


def partials(stages: Sequence[StageState], holders: Holders, k: int, j: int, step: Step) -> list[torch.Tensor]:
    """Slot j's partials for stage k's GPU (host tensors), in download order: those the IR's
    sends fetched and any still pending (the model pipeline's backward fetches them here, at the
    download)."""
    m = stages[k].masters[j]
    while any(master is m for master, _ in step.pending):  # each call takes one (another slot's first, in slot order)
        fetch_partial(stages, holders, k, step)
    return step.partials.pop((k, j), [])
