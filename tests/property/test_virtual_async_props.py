"""Properties of the CUDA path's logic on its CPU stand-in (`device="virtual-async"`).

`VirtualAsyncDevice` runs `StreamDevice`'s streams, events and slot pool on threads, every
queued copy, wait and event record delayed at random from a drawn seed. For random models
(MLPs, residual stacks, skips across stages, which go through host memory), cuts, GPU orders,
micro-batch counts and delay seeds:

- outputs and every gradient are bit-equal to eager PyTorch run micro-batch by micro-batch.
  The tolerance is zero on purpose: the stand-in runs the same CPU kernels on the same values
  as the synchronous `VirtualDevice` (tests/property/test_runtime_props.py proves that one
  bit-equal to eager by micro-batch; the full-batch comparison and its derived tolerance live
  there). Only the copies move to other threads and happen later, so any difference is a copy
  read before the event that says it is written -- a race, not rounding;
- the books never exceed a budget derived from the synchronous run (`VirtualDevice`, where every
  copy is done when issued): its measured peak P, plus
  - what the fixed slot pool holds beyond the weights the synchronous books hold at their peak:
    at most pool - w_min, w_min the smallest stage on that GPU, since a GPU peaks while a stage
    works and that stage's weights are resident;
  - the copies in flight: a tensor a stream still reads stays charged until the copy is done
    (on CUDA, `record_stream` keeps its memory as long). A stage's copies off its GPU in
    forward (inputs offloaded, values sent to the host, activations pushed to the next GPU) are
    all issued before it is evicted, and the refill of its slot waits for them (the event of
    its last use is recorded on the download stream too); pushes are awaited by the receiver
    before it runs. So at most two stages' forward copies per GPU are in flight: the one
    working and the one before it on that GPU -- at most the two largest stages' sums, read
    from the synchronous run's transfer log;
  the budget is the device's: one byte over raises BudgetError from the op that made it;
- each GPU's pool has exactly the schedule IR's resident count of slots, never held more stages
  at once (`max_in_use`, checked at every take), never grew beyond the plan (`overflows`), and
  the sanitizer saw no slot refilled before the events of its last use completed;
- nothing stays on a GPU afterwards (the pool is returned at the end of the step).
"""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from mobius_fx.runtime.device_virtual_async import VirtualAsyncDevice
from mobius_fx.build import build_pipeline

from tests.property.test_runtime_props import _eager_by_microbatch, _step, cases

pytestmark = pytest.mark.usefixtures("one_thread")


def _build(model, gm, nodes, stage_gpus, microbatches, x, device):
    return build_pipeline(model, gm, stage_nodes=nodes, stage_gpus=stage_gpus, gpu_budgets={},
                          microbatches=microbatches, example_inputs=(x,), device=device)


def _in_flight(pipe, forward):
    """Per GPU, the two largest per-stage sums of the bytes a stage's forward copies off its GPU
    (`forward`: transfer_stats(by_stage=True) after a forward): inputs offloaded and values sent
    to the host (logged by the sender), activations pushed to the next stage's GPU (logged by the
    receiver, under the receiving stage)."""
    stages = pipe.schedule.stages
    sent = {k: 0 for k in range(len(stages))}
    for gpu, kinds in forward.items():
        for kind, per in kinds.items():
            for k, c in per.items():
                if k is None:
                    continue
                if kind in ("input d2h", "activation d2h"):
                    sent[k] += c["bytes"]
                elif kind == "activation d2d" and k > 0 and stages[k - 1].gpu != gpu:
                    sent[k - 1] += c["bytes"]
    out = {}
    for gpu in {st.gpu for st in stages}:
        mine = sorted((sent[st.index] for st in stages if st.gpu == gpu), reverse=True)
        out[gpu] = sum(mine[:2])
    return out


@given(cases(), st.integers(0, 2**16))
def test_stand_in_equals_eager_within_the_pool_bound_and_the_ir_slots(case, delay_seed):
    model, gm, nodes, stage_gpus, x, microbatches = case
    note(f"stages={[len(n) for n in nodes]} gpus={stage_gpus} batch={x.size(0)} microbatches={microbatches} "
         f"delay seed={delay_seed}")
    out_mb, grads_mb = _eager_by_microbatch(model, x, microbatches)

    reference = _build(model, gm, nodes, stage_gpus, microbatches, x, "virtual")
    model.zero_grad(set_to_none=True)
    out = reference(x)
    in_flight = _in_flight(reference, reference.transfer_stats(last_step=True, by_stage=True))
    out.pow(2).sum().backward()
    peaks = {g: s["peak_bytes"] for g, s in reference.memory_stats().items()}

    gpus = sorted(set(stage_gpus))
    devices = {g: VirtualAsyncDevice(g, None, seed=delay_seed + i, delay=5e-4) for i, g in enumerate(gpus)}
    pipe = _build(model, gm, nodes, stage_gpus, microbatches, x, devices)
    rt = pipe._rt
    budgets = {}
    for g, dev in devices.items():
        pool = dev.slot_stats()["bytes"] or sum(dev._sizes)
        w_min = min(s.weight_bytes for s in rt.stages if s.device is dev)
        budgets[g] = dev.budget = peaks[g] + pool - w_min + in_flight[g]
    note(f"synchronous peaks {peaks}, budgets {budgets}")

    out_p, grads_p = _step(pipe, model, x)
    torch.testing.assert_close(out_p, out_mb, rtol=0, atol=0)
    for name in grads_mb:
        torch.testing.assert_close(grads_p[name], grads_mb[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")

    resident = pipe.schedule_ir().resident_at_most()
    for g, dev in devices.items():
        dev.synchronize()
        slots = dev.slot_stats()
        assert dev.peak_bytes <= budgets[g]
        assert slots["slots"] == resident[g], (g, slots, resident)
        assert slots["max_in_use"] <= resident[g], (g, slots, resident)
        assert slots["overflows"] == 0 and dev.races == []
        assert dev.current_bytes == dev.stats()["slot_pool_bytes"]
    assert all(slot.untyped_storage().nbytes() == 0 for st_ in rt.stages for slot in st_.slots)
