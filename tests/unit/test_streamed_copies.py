"""One streamed copy per master on the host (mobius_fx/runtime/streamed_copies.py), shared by every
GPU of a runtime that uploads it: ZeRO-3 offload's GPUs, roundpipe's forward and backward GPUs,
the two ends of a tied embedding.

- every schedule with a runtime form: after `train_step` the host holds the model once in the
  streamed dtype (tied weights once), each changed master is copied once per step whichever GPUs
  upload it, the store counts one epoch per step, and the step equals eager; under
  pipe.overlap(mode="sync") too, where the fused host pass (or a refresh) writes the one copy every
  GPU reads once a step, so nothing is copied again at upload in steady state (`pin` 0 bytes) and
  no copy is written twice (with a store per GPU, roundpipe refreshed the other GPU's stale copies:
  79 writes for 52 masters); the plan's host budget counts the same bytes;
- the store's rules, deterministic: one writer and no reader of a half-written copy (threads
  meeting on one master), a writer waits for every reader's upload event and for a reader that
  has not recorded its event yet;
- the same rules on virtual-async (random delays on every stream) with the copy slowed down: four
  GPUs filling a stage of the same masters at once copy each master once and upload whole copies.

Mutations run (each failed the tests named): a store per device again (`shared_copies` leaving
the devices' private ones) -> the byte, copy-count and writes-per-step tests of every schedule; no
lock in `take` -> the threads test (4 writes, not 1) and the virtual-async test (21 copies, not 6);
no lock and the copy marked used before it is written -> both again (a half-written slot); a
writer waiting only for the last reader's event, or not for a reader still issuing -> the events
test; every device bumping the shared epoch -> the schedule tests (5 epochs a step, not 1).
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import mobius_fx
from mobius_fx import Topology, schedules
from mobius_fx.runtime import streamed_copies
from mobius_fx.runtime.devices import make_devices
from mobius_fx.runtime.host_counters import COUNTERS, HostCounters
from mobius_fx.runtime.streamed_copies import StreamedCopies
from mobius_fx.zoo import GPT, GPTConfig
from tests.unit.test_train_step import _assert_grads_equal, _grads

pytestmark = pytest.mark.usefixtures("trace_cache", "one_thread")

VOCAB = 64
TOPO = Topology.virtual(gpus=4, memory="64MiB")  # four GPUs: ZeRO-3 offload uploads every layer on each
RUNNABLE = [n for n in schedules.names() if schedules.get(n).runnable]


def _lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=VOCAB, seq=8, hidden=16, blocks=4, heads=2))  # tied embedding and head


def _compile(model, name, ids, **kw):
    return mobius_fx.compile(model, TOPO, example_inputs=(ids,), microbatches=2, verbose=False, costs="model",
                             device="virtual-async", loss_fn=_lm_loss, example_target=ids, schedule=name, **kw)


def _stores(pipe):
    return list({id(d.streamed_copies): d.streamed_copies for d in pipe.devices.values()}.values())


def _model_bytes(model, dtype):
    """The model's tensors once each (a tied weight once), floating ones in `dtype`."""
    return sum(t.numel() * (torch.empty((), dtype=dtype).element_size() if t.is_floating_point()
                            else t.element_size()) for t in _tensors(model))


def _streamed_bytes(pipe):
    """The host bytes of the streamed copies every GPU of the pipeline reads (each store once)."""
    return sum(s.nbytes() for s in _stores(pipe))


def _tensors(model):
    """The model's masters, each once (a tied weight once)."""
    return list({id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


def _copies(pipe):
    return sum(d.pinned_copies["copies"] for d in pipe.devices.values())


@pytest.mark.parametrize("name", RUNNABLE)
def test_one_streamed_copy_per_master_each_written_once_a_step_and_the_step_is_eagers(name):
    model = _model()
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    pipe = _compile(model, name, ids)
    store = pipe.devices["gpu0"].streamed_copies
    for step in range(2):
        before, epoch = _copies(pipe), store.epoch
        loss = pipe.train_step(ids, target=ids)
        got = _grads(model)
        model.zero_grad()
        ref = _lm_loss(model(ids), ids)
        ref.backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
        _assert_grads_equal(got, _grads(model))
        # every master changed (the SGD step below): each copied once, whichever GPUs upload it
        assert _copies(pipe) - before == len(_tensors(model))
        assert _streamed_bytes(pipe) == _model_bytes(model, torch.float32)
        assert store.epoch == epoch + 1  # one step, once, however many GPUs share it
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
        model.zero_grad()
    assert _stores(pipe) == [store]  # every GPU reads the one store


@pytest.mark.parametrize("name", RUNNABLE)
def test_under_sync_overlap_the_host_pass_writes_the_one_copy_and_nothing_is_pinned_again(name):
    model = _model()
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    pipe = _compile(model, name, ids, dtype=torch.bfloat16)
    opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=1e-3), mode="sync")
    counts, writes = [], []
    for _ in range(3):
        before, wrote = COUNTERS.snapshot(), sum(s.writes() for s in _stores(pipe))
        pipe.train_step(ids, target=ids)
        opt.step()
        opt.zero_grad()
        counts.append(HostCounters.since(before, COUNTERS.snapshot()))
        writes.append(sum(s.writes() for s in _stores(pipe)) - wrote)
    # steady state: the optimizer wrote the copy the GPUs read next (the fused pass or a refresh)
    # of every master it stepped (all), once; none was copied again at upload
    assert not list(model.buffers())  # (a buffer would be: copied at its first upload of each step)
    assert counts[-1]["pin"] == 0
    assert writes[-1] == len(_tensors(model))
    assert _streamed_bytes(pipe) == _model_bytes(model, torch.bfloat16)
    assert pipe.plan.host_budget().streamed_copy == _model_bytes(model, torch.bfloat16)
    for store in _stores(pipe):  # what the next uploads read: the weights now
        for e in store.entries():
            assert torch.equal(e.host, e.master.detach().to(torch.bfloat16))


# ---------------------------------------------------------------------- the store's rules, deterministic


class _Event:
    """A stand-in upload event: done when `done` is set."""

    def __init__(self, done=True):
        self.done = threading.Event()
        if done:
            self.done.set()

    def synchronize(self):
        self.done.wait()


def _alloc(shape, dtype):
    return torch.empty(shape, dtype=dtype)


def _in_thread(fn):
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_threads_meeting_on_one_master_copy_it_once_and_never_read_it_half_written(monkeypatch):
    writes = []
    write = streamed_copies.write_copy

    def slow(host, master):  # half, a pause, the rest: a reader that does not wait sees zeros
        writes.append(1)
        host.zero_()
        time.sleep(0.05)
        write(host, master)

    monkeypatch.setattr(streamed_copies, "write_copy", slow)
    store = StreamedCopies()
    master = torch.nn.Parameter(torch.arange(1.0, 4097.0))
    start, seen = threading.Barrier(4), []

    def reader(k):
        start.wait()
        entry, host, _ = store.take(master, torch.bfloat16, _alloc, True)
        seen.append(host.clone())
        store.release(entry, host, k, _Event())

    for t in [_in_thread(lambda k=k: reader(k)) for k in range(4)]:
        t.join()
    assert len(writes) == 1  # one worker copied; the others waited for its copy
    assert all(torch.equal(s, master.detach().to(torch.bfloat16)) for s in seen)


def test_a_writer_waits_for_every_readers_upload_and_for_a_reader_still_issuing():
    store = StreamedCopies()
    master = torch.nn.Parameter(torch.ones(64))
    store.new_step()
    slow, fast = _Event(done=False), _Event(done=True)
    for reader, ev in (("gpu0", slow), ("gpu1", fast)):  # gpu0's upload is issued first and still runs
        entry, host, _ = store.take(master, torch.bfloat16, _alloc, True)
        store.release(entry, host, reader, ev)
    with torch.no_grad():
        master.mul_(2)
    done = threading.Event()
    t = _in_thread(lambda: (store.refresh(master), done.set()))
    assert not done.wait(0.2)  # gpu1's upload is done, gpu0's is not: the copy is still being read
    assert torch.equal(entry.host, torch.ones(64, dtype=torch.bfloat16))
    slow.done.set()
    t.join(5)
    assert done.is_set() and torch.equal(entry.host, master.detach().to(torch.bfloat16))

    # a reader between take and release (its event not recorded yet) holds the writer back too
    store.new_step()
    entry, host, _ = store.take(master, torch.bfloat16, _alloc, True)
    with torch.no_grad():
        master.mul_(2)
    done.clear()
    t = _in_thread(lambda: (store.refresh(master), done.set()))
    assert not done.wait(0.2)
    store.release(entry, host, "gpu0", _Event())
    t.join(5)
    assert done.is_set() and torch.equal(entry.host, master.detach().to(torch.bfloat16))


def test_devices_built_alone_keep_a_private_store_and_a_runtime_shares_one():
    devs = make_devices({"a": None, "b": None}, device="virtual-async")
    a, b = devs["a"].streamed_copies, devs["b"].streamed_copies
    assert a is not b and a.private and b.private
    devs["a"].new_step()
    assert a.epoch == 1 and b.epoch == 0  # a private store: its device counts the steps
    shared = streamed_copies.shared_copies(list(devs.values()))
    assert not shared.private and devs["a"].streamed_copies is shared is devs["b"].streamed_copies
    assert streamed_copies.shared_copies(list(devs.values())) is shared  # another runtime on them: the same


# ---------------------------------------------------------------------- on virtual-async, the copy slowed


def test_four_virtual_async_gpus_uploading_the_same_masters_at_once_copy_each_once_and_upload_it_whole(monkeypatch):
    """Four GPUs of the CPU stand-in (random delays on every stream) fill a stage of the same
    masters at once, three steps, the masters changed between; every copy is slowed down
    (zeroed, a seeded pause, written): each master is copied once a step, and every GPU's slot
    holds the master's values, not a half-written copy."""
    monkeypatch.setenv("MOBIUS_HOST_THREADS", "steer=0,upload_busy=4")  # four upload workers copy at once
    rng = random.Random(0)
    write = streamed_copies.write_copy

    def slow(host, master):
        host.zero_()
        time.sleep(rng.uniform(0.002, 0.01))
        write(host, master)

    monkeypatch.setattr(streamed_copies, "write_copy", slow)
    devs = make_devices({f"gpu{i}": None for i in range(4)}, device="virtual-async", seed=0)
    store = streamed_copies.shared_copies(list(devs.values()))
    g = torch.Generator().manual_seed(0)
    masters = [torch.nn.Parameter(torch.randn(256, generator=g)) for _ in range(6)]
    slots = {n: [torch.empty(256, dtype=torch.bfloat16) for _ in masters] for n in devs}
    for n, d in devs.items():
        d.plan_slots([d.slot_bytes(slots[n])])
    for step in range(3):
        streamed_copies.new_step(list(devs.values()))
        before = sum(d.pinned_copies["copies"] for d in devs.values())
        tokens = {n: d.fill(0, slots[n], masters, 0) for n, d in devs.items()}
        for n, d in devs.items():
            d.ready(tokens[n], slots[n])
            d.synchronize()
            for s, m in zip(slots[n], masters):
                assert torch.equal(s, m.detach().to(torch.bfloat16)), (step, n)
            d.vacate(0, slots[n], 0)
        assert sum(d.pinned_copies["copies"] for d in devs.values()) - before == len(masters)
        assert store.epoch == step + 1
        with torch.no_grad():
            for m in masters:
                m.add_(1.0)
