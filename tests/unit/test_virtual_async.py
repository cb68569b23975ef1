"""The CPU stand-in of the CUDA path (`device="virtual-async"`, `VirtualAsyncDevice`).

It runs `StreamDevice`'s code -- four streams per GPU, events, the fixed slot pool, copies to
the host into buffers read later -- on worker threads with seeded random delays. What these
tests pin down:

- compile and build_pipeline accept it, and it trains bit-equal to the synchronous virtual GPUs;
- thread streams and events keep CUDA's semantics (in order, record/wait/query/synchronize,
  an event never recorded counts as done);
- the slot pool: the IR's resident count of slots per GPU, allocated when the pipeline is built,
  reused stage after stage and step after step; a refill before the last use completed is
  reported (the sanitizer);
- a stage's saved inputs are restored for all its micro-batches as its backward starts, each
  micro-batch's compute ordered after its own copies only;
- no blocking host copy in the steady state of the HF Llama, HF GPT-2 and nanoGPT zoo models
  (`steady_state_waits` says exactly what "steady state" means).
"""

import copy
import threading
import time

import pytest
import torch
import torch.fx as fx
from torch import nn

import mobius_fx
from mobius_fx import MobiusError, Topology, trace
from mobius_fx.runtime.device_virtual_async import VirtualAsyncDevice
from mobius_fx.runtime.devices import make_devices
from mobius_fx.errors import BudgetError
from mobius_fx.options import CompileOptions
from mobius_fx.build import build_pipeline
from mobius_fx.runtime.streams import PENDING, HostWaits, RaceError, ThreadEvent, ThreadStream
from mobius_fx.zoo import ResidualMLP, SkipNet, hf_gpt2, hf_inputs, hf_llama, nanogpt, nanogpt_inputs

_COMPUTE = ("call_function", "call_method", "call_module")

pytestmark = pytest.mark.usefixtures("one_thread")


def even_cut(gm, stages):
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    bounds = [round(i * len(names) / stages) for i in range(stages + 1)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def stand_in(model, inputs, kwargs=None, *, stages=4, gpus=2, microbatches=2, seed=0, gm=None, budget=None):
    gm = gm if gm is not None else trace(model, example_inputs=inputs, example_kwargs=kwargs)
    devices = {f"gpu{i}": VirtualAsyncDevice(f"gpu{i}", budget, seed=seed + i) for i in range(gpus)}
    return build_pipeline(model, gm, stage_nodes=even_cut(gm, stages),
                          stage_gpus=[f"gpu{k % gpus}" for k in range(stages)], gpu_budgets={},
                          microbatches=microbatches, example_inputs=inputs, example_kwargs=kwargs, device=devices)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def steady_state_waits(pipe, kind="copy"):
    """The host's blocking waits of `kind` in the steady state of the last step.

    Steady state, per phase, from the op log the runtime keeps (`executed`, stamped on the same
    clock as the devices' waits): from the phase's first stage run to its last executed op --
    in forward the eviction (or hold) after the last stage's last micro-batch, in backward the
    eviction after the last gradient download was issued. Outside it, and allowed to block:
    reading the model's outputs on the host (after the last forward op), buffer updates, and
    the gradients handed to the CPU optimizer at the end of backward."""
    rt = pipe._rt
    spans = []
    for phase in ("forward", "backward"):
        ops = [i for i, e in enumerate(rt.executed) if e[3] == phase]
        runs = [i for i in ops if rt.executed[i][0] == "run"]
        if runs:
            spans.append((rt.stamps[runs[0]], rt.stamps[ops[-1]]))
    return [(name, seq, what) for name, dev in pipe.devices.items() for seq, k, what in dev.waits.entries
            if k == kind and any(a <= seq <= b for a, b in spans)]


# ----------------------------------------------------------------------------- entry points

def test_compile_with_virtual_async_trains_like_the_synchronous_virtual_gpus(tmp_path):
    torch.manual_seed(0)
    model = ResidualMLP(d_in=8, width=16, depth=4, d_out=4)
    twin = copy.deepcopy(model)
    x = torch.randn(8, 8)
    topo = Topology.virtual(gpus=2, memory="64MiB")
    pipes = [mobius_fx.compile(m, topo, example_inputs=(x,), microbatches=2, device=d, cache_dir=str(tmp_path),
                               verbose=False) for m, d in ((model, "virtual-async"), (twin, "virtual"))]
    assert all(isinstance(d, VirtualAsyncDevice) for d in pipes[0].devices.values())
    outs = []
    for pipe, m in zip(pipes, (model, twin)):
        for _ in range(2):  # two steps: the pool is returned and taken again
            m.zero_grad(set_to_none=True)
            out = pipe(x)
            out.pow(2).sum().backward()
        outs.append((out.detach(), grads(m)))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    for name, g in outs[1][1].items():
        torch.testing.assert_close(outs[0][1][name], g, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert all(s["current_bytes"] == s["slot_pool_bytes"] for s in pipes[0].memory_stats().values())


def test_the_options_and_make_devices_know_virtual_async():
    assert CompileOptions(device="virtual-async").device == "virtual-async"
    with pytest.raises(MobiusError, match="not one of"):
        CompileOptions(device="virtual_async")
    devices = make_devices({"gpu0": None, "gpu1": 1024}, device="virtual-async", seed=7)
    assert [type(d) for d in devices.values()] == [VirtualAsyncDevice] * 2
    assert [d.seed for d in devices.values()] == [7, 8] and devices["gpu1"].budget == 1024
    with pytest.raises(MobiusError, match="virtual-async"):
        make_devices({"gpu0": None}, device="virtual-sync")


# ----------------------------------------------------------------------------- streams and events

def test_thread_streams_run_in_order_and_events_order_them():
    waits = HostWaits()
    a = ThreadStream("test-a", seed=0, delay=1e-3, chance=1.0, waits=waits)
    b = ThreadStream("test-b", seed=1, delay=0, chance=0, waits=waits)
    assert ThreadEvent().query()  # never recorded: done, as a CUDA event
    gate = threading.Event()
    seen = []
    a.submit(lambda: gate.wait())
    a.submit(lambda: seen.append("a1"))
    ev = ThreadEvent(waits)
    ev.record(a)
    assert not ev.query()
    b.wait_event(ev)  # b's later work waits for a's first two items
    b.submit(lambda: seen.append("b1"))
    time.sleep(0.01)
    assert seen == [] and not ev.query()
    gate.set()
    ev.synchronize("copy", "test")
    b.synchronize()
    assert seen == ["a1", "b1"] and ev.query()
    assert [k for _, k, _ in waits.entries] == ["copy", "sync"]  # both on this (the issuing) thread

    # The stand-in's compute stream runs work on the caller, after its waits; its events are
    # set later, in order, by a lag thread.
    c = ThreadStream("test-c", seed=2, delay=2e-3, chance=1.0, waits=waits, inline=True)
    late = ThreadEvent(waits)
    late.record(b)
    c.wait_event(late)  # blocks the caller: a "device" wait (a GPU stream's, played by the host)
    c.submit(lambda: seen.append("c1"))
    assert seen[-1] == "c1" and waits.entries[-1][1] == "device"
    first, second = ThreadEvent(), ThreadEvent()
    first.record(c)
    second.record(c)
    second.synchronize()
    assert first.query()


def test_the_sanitizer_reports_accesses_no_event_orders():
    dev = VirtualAsyncDevice("gpu0", None, seed=0, delay=0)
    gate = threading.Event()
    dev.download_stream.submit(lambda: gate.wait())  # hold the download stream
    # A refill whose last use (here: a download still running) neither completed nor was waited for.
    last_use = dev._event()
    last_use.record(dev.download_stream)
    with pytest.raises(RaceError, match="refill was issued without the upload stream waiting"):
        dev._copy_in([torch.empty(4)], [torch.ones(4)], [last_use])
    # A copy up from a host buffer the download stream has not written yet, without waiting for it.
    host, written = dev._to_host_raw(torch.ones(4))
    with pytest.raises(RaceError, match="reads a host buffer before the event"):
        dev._issue_copy(dev.copy_stream, host, dev.torch_device, None)
    # Waited for: ordered, whenever the download runs.
    dev.copy_stream.wait_event(written)
    late = dev._issue_copy(dev.copy_stream, host, dev.torch_device, None)
    dev.upload_stream.wait_event(last_use)
    dev._copy_in([torch.empty(4)], [torch.ones(4)], [last_use])
    gate.set()
    dev.synchronize()
    assert torch.equal(late, torch.ones(4)) and len(dev.races) == 2


# ----------------------------------------------------------------------------- the slot pool

def test_the_pool_has_the_irs_resident_count_of_slots_reused_stage_after_stage():
    torch.manual_seed(0)
    model = ResidualMLP(d_in=8, width=16, depth=6, d_out=4)
    x = torch.randn(8, 8)
    pipe = stand_in(model, (x,), gm=fx.symbolic_trace(model), stages=6, gpus=2, microbatches=2)
    dev0 = pipe.devices["gpu0"]
    regions = []
    fill = dev0.fill

    def spy(stage, slots, masters, nbytes, prefer=None):
        token = fill(stage, slots, masters, nbytes, prefer)
        regions.append((stage, dev0._pool.by_stage[stage].tensor.data_ptr()))
        return token

    dev0.fill = spy
    for _ in range(2):
        pipe(x).pow(2).sum().backward()
    resident = pipe.schedule_ir().resident_at_most()
    for name, dev in pipe.devices.items():
        stats = dev.slot_stats()
        assert stats["slots"] == stats["max_in_use"] == resident[name] == 2 and stats["overflows"] == 0
        assert dev.current_bytes == dev.stats()["slot_pool_bytes"] and dev.races == []
    # gpu0 runs stages 0, 2, 4: forward 0, 2, 4 (held), backward 2, 0: five fills into two slots,
    # the same two in both steps (allocated once, when the pipeline was built)
    first, step = regions[:len(regions) // 2], regions[len(regions) // 2:]
    assert [k for k, _ in step] == [0, 2, 4, 2, 0]
    assert len({p for _, p in step}) == 2 and {p for _, p in first} == {p for _, p in step}
    assert dev0.stats()["slot_pool_bytes"] == sum(r.bytes for r in dev0._pool.regions) > 0


def test_the_pool_is_allocated_when_the_pipeline_is_built_and_released_on_request():
    torch.manual_seed(0)
    model = ResidualMLP(d_in=8, width=16, depth=4, d_out=4)
    x = torch.randn(8, 8)
    with pytest.raises(BudgetError, match="weight slots"):  # at build time, not in the first step
        stand_in(model, (x,), gm=fx.symbolic_trace(model), budget=1024)
    pipe = stand_in(model, (x,), gm=fx.symbolic_trace(model))
    held = {name: s["slot_pool_bytes"] for name, s in pipe.memory_stats().items()}
    assert all(n > 0 for n in held.values())
    assert all(s["current_bytes"] == held[name] for name, s in pipe.memory_stats().items())
    out = pipe(x)
    with pytest.raises(MobiusError, match="resident"):  # the last stage is held for backward
        pipe.release_slots()
    out.pow(2).sum().backward()
    pipe.release_slots()
    assert all(s["current_bytes"] == s["slot_pool_bytes"] == 0 for s in pipe.memory_stats().values())
    pipe(x).pow(2).sum().backward()  # taken again by the next step
    assert {name: s["slot_pool_bytes"] for name, s in pipe.memory_stats().items()} == held


def test_saved_inputs_are_restored_as_the_stages_backward_starts_and_each_waited_for_by_its_call():
    """The IR's restores depend on the stage's wait alone: the runtime issues all of a stage's
    restores with its first backward call (in the order backward uses them), not one per call,
    and a call's compute waits for its own copies (`join`): skipping that wait computes on
    buffers the copy stream has not written yet, which the equality with eager catches."""
    from mobius_fx.runtime.streams import tick

    torch.manual_seed(0)
    model = ResidualMLP(d_in=8, width=16, depth=4, d_out=4)
    eager = copy.deepcopy(model)
    x = torch.randn(8, 8)
    m = 4
    pipe = stand_in(model, (x,), gm=fx.symbolic_trace(model), stages=4, gpus=2, microbatches=m, seed=5)
    restores = []  # (tick, stage)
    for dev in pipe.devices.values():
        def spy(saved, _dev=dev, _restore=dev.restore):
            restores.append((tick(), _dev.log._stage.k))
            return _restore(saved)
        dev.restore = spy
    out = pipe(x)
    out.pow(2).sum().backward()
    eager(x).pow(2).sum().backward()
    rt = pipe._rt
    runs = {}
    for e, stamp in zip(rt.executed, rt.stamps):
        if e[0] == "run" and e[3] == "backward":
            runs.setdefault(e[2], []).append(stamp)
    restored = {k for _, k in restores}
    assert restored == set(range(1, 4))  # stage 0's input is the model's, kept on the host
    for k in restored:
        ticks = [t for t, j in restores if j == k]
        assert len(ticks) == m and len(runs[k]) == m
        assert runs[k][0] < min(ticks) and max(ticks) < runs[k][1]  # all with its first backward call
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, dict(eager.named_parameters())[n].grad, rtol=1e-5, atol=1e-6)
    for dev in pipe.devices.values():
        dev.synchronize()
        assert dev.races == [] and dev.current_bytes == dev.stats()["slot_pool_bytes"]


def test_a_second_pipeline_on_the_same_devices_sizes_their_pool_for_its_stages_when_built():
    """compile's variants build another runtime on the pipeline's devices: larger stages get a
    pool sized for them when built (a budget error then, not in a step), not overflows mid-step."""
    torch.manual_seed(0)
    model = ResidualMLP(d_in=8, width=32, depth=6, d_out=4)
    x = torch.randn(8, 8)
    gm = fx.symbolic_trace(model)
    devices = {f"gpu{i}": VirtualAsyncDevice(f"gpu{i}", None, seed=i) for i in range(2)}

    def build(stages):
        return build_pipeline(model, gm, stage_nodes=even_cut(gm, stages),
                              stage_gpus=[f"gpu{k % 2}" for k in range(stages)], gpu_budgets={}, microbatches=2,
                              example_inputs=(x,), device=devices)

    a = build(8)
    a(x).pow(2).sum().backward()
    small = {n: d.stats()["slot_pool_bytes"] for n, d in devices.items()}
    b = build(2)
    built = {n: d.stats()["slot_pool_bytes"] for n, d in devices.items()}
    assert all(built[n] > small[n] for n in devices)
    for pipe in (b, a):
        pipe(x).pow(2).sum().backward()
    assert all(d.slot_stats()["overflows"] == 0 and d.stats()["slot_pool_bytes"] == built[n]
               for n, d in devices.items())


def test_release_slots_after_a_forward_whose_graph_was_dropped():
    torch.manual_seed(0)
    model = ResidualMLP(d_in=8, width=16, depth=4, d_out=4)
    x = torch.randn(8, 8)
    pipe = stand_in(model, (x,), gm=fx.symbolic_trace(model))
    loss = pipe(x).pow(2).sum()  # a validation loss computed with grad on, then dropped
    del loss
    pipe.release_slots()  # no backward can come: what was held for it is let go
    assert all(s["current_bytes"] == s["slot_pool_bytes"] == 0 for s in pipe.memory_stats().values())
    pipe(x).pow(2).sum().backward()


def test_values_skipping_stages_go_through_pending_host_buffers_without_a_host_wait():
    torch.manual_seed(0)
    model = SkipNet(d_in=8, width=16, depth=4, d_out=4)
    x = torch.randn(8, 8)
    eager = copy.deepcopy(model)
    pipe = stand_in(model, (x,), gm=fx.symbolic_trace(model), stages=5, gpus=2, microbatches=2, seed=3)
    assert any(pipe.schedule.to_host[k] for k in range(len(pipe.schedule.stages) - 1))
    sent = []
    add = PENDING.add
    try:
        PENDING.add = lambda t, ev, w: (sent.append(t.shape), add(t, ev, w))[1]
        out = pipe(x)
    finally:
        del PENDING.add
    assert sent and steady_state_waits(pipe) == []
    torch.testing.assert_close(out, eager(x))
    # Their gradients come back to the host, where autograd sums them: that waits (logged).
    out.pow(2).sum().backward()
    assert any("sent from the host" in what for _, _, what in steady_state_waits(pipe))


# ----------------------------------------------------------------------------- no host copy in the steady state

def _zoo(name):
    torch.manual_seed(0)
    if name == "gpt":
        model = nanogpt(hidden=32, blocks=2, vocab=64, seq=8, heads=2)
        (idx,) = nanogpt_inputs(model, batch=4)
        return model, (idx, torch.roll(idx, 1, dims=1)), None, lambda out: out[1]
    model = {"hf_llama": hf_llama, "hf_gpt2": hf_gpt2}[name]()
    (ids,) = hf_inputs(model, batch=4, seq=8)
    return model, (ids,), {"labels": ids}, lambda out: out.loss


@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2", "gpt"])
def test_no_blocking_host_copy_in_the_steady_state_of_the_zoo_models(name):
    model, inputs, kwargs, loss_of = _zoo(name)
    eager = copy.deepcopy(model)
    pipe = stand_in(model, inputs, kwargs, stages=4, gpus=2, microbatches=2, seed=11)
    if name == "hf_llama":  # its causal mask, made by stage 0, is read by every later stage
        assert pipe.schedule.to_host[0]
    for dev in pipe.devices.values():
        dev.waits.clear()
    out = pipe(*inputs, **(kwargs or {}))
    loss_of(out).backward()
    assert steady_state_waits(pipe, "copy") == []
    assert steady_state_waits(pipe, "sync") == []
    # The waits outside it are there, and counted: the outputs read, the gradients handed over.
    outside = [what for dev in pipe.devices.values() for _, k, what in dev.waits.entries if k == "copy"]
    assert "a model output" in outside and "gradient" in outside
    ref = eager(*inputs, **(kwargs or {}))
    loss_of(ref).backward()
    torch.testing.assert_close(loss_of(out), loss_of(ref))
    got, want = grads(model), grads(eager)
    assert got.keys() == want.keys()
    for n in want:  # micro-batches sum the batch in another order: fp32 rounding only
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    for dev in pipe.devices.values():
        dev.synchronize()
        assert dev.races == [] and dev.slot_stats()["overflows"] == 0 and dev.current_bytes == dev.stats()["slot_pool_bytes"]


def test_the_pool_takes_the_planned_slot_and_counts_what_it_adds_beyond_the_plan():
    from mobius_fx.runtime.streams import SlotPool

    charged = []
    pool = SlotPool([96, 64], lambda n: torch.empty(n, dtype=torch.uint8))
    assert pool.take(0, 64, 1, charged.append).index == 1  # the planned slot, free and large enough
    assert pool.take(1, 80, None, charged.append).index == 0  # the one that fits
    assert pool.in_use == pool.max_in_use == 2 and pool.overflows == 0 and charged == []
    # A third stage at once (a backward in an order the IR did not plan): one more slot, booked.
    assert pool.take(2, 32, None, charged.append).index == 2
    assert charged == [32] and pool.overflows == 1 and pool.max_in_use == 3
    used = ThreadEvent()
    pool.give_back(1, [used])
    assert pool.regions[0].stage is None and pool.regions[0].last_use == [used]

    def refuse(n):
        raise BudgetError(f"no room for {n} bytes")

    with pytest.raises(BudgetError, match="no room for 32"):  # grow slot 0 (96 bytes) to 128: refused
        pool.take(3, 128, None, refuse)
    assert pool.regions[0].bytes == 96 and pool.regions[0].stage is None and pool.in_use == 2


def test_batchnorm_buffers_downloaded_from_a_slot_are_waited_for_before_it_is_refilled():
    # Each stage's running statistics are downloaded from its slot after its last forward
    # micro-batch, on the download stream; the slot is refilled for the stage after next while
    # that copy may still run, so the slot's last use must include the download stream (the
    # sanitizer checks that every read of a slot is covered by an event the refill waits for).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16),
                          nn.Tanh(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    x = torch.randn(8, 8)
    gm = fx.symbolic_trace(model)
    pipe = stand_in(model, (x,), gm=gm, stages=6, gpus=2, microbatches=2, seed=5)
    ref = build_pipeline(twin, fx.symbolic_trace(twin), stage_nodes=even_cut(gm, 6), stage_gpus=["gpu0", "gpu1"] * 3,
                         gpu_budgets={}, microbatches=2, example_inputs=(x,), device="virtual")
    for _ in range(2):
        for p, m in ((pipe, model), (ref, twin)):
            m.zero_grad(set_to_none=True)
            p(x).pow(2).sum().backward()
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert all(dev.races == [] for dev in pipe.devices.values())


def test_a_stage_output_that_is_a_view_of_its_weights_is_read_before_the_slot_is_refilled():
    """A stage may hand the next one a slice of its own weights (`l.weight[0]`): the receiving
    copy reads the source's slot, so the slot's refill must wait for that read too (on CUDA the
    caching allocator's record_stream does not cover a pool slot). The sanitizer sees a refill
    not ordered after the read; the values must equal eager."""
    import copy as _copy

    from torch import nn

    from mobius_fx.runtime.device_virtual_async import VirtualAsyncDevice
    from mobius_fx.build import build_pipeline

    torch.manual_seed(0)
    n = 6

    class Rows(nn.Module):
        def __init__(self):
            super().__init__()
            self.ls = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

        def forward(self, x):
            row = torch.zeros(8)
            for layer in self.ls:
                x = torch.tanh(layer(x) + row)
                row = layer.weight[0]  # a view of this stage's weight, read by the next stage
            return x

    model = Rows()
    ref = _copy.deepcopy(model)
    x = torch.randn(8, 8)
    ref(x).sum().backward()
    gm = mobius_fx.trace(model, example_inputs=(x,))
    stages, k = [[] for _ in range(n)], 0
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            stages[k].append(node.name)
            if "getitem" in node.name:
                k = min(k + 1, n - 1)
    for seed in range(4):
        m = _copy.deepcopy(model)
        gm = mobius_fx.trace(m, example_inputs=(x,))
        devs = {f"gpu{i}": VirtualAsyncDevice(f"gpu{i}", None, seed=seed + i) for i in range(2)}
        pipe = build_pipeline(m, gm, stage_nodes=stages, stage_gpus=[f"gpu{j % 2}" for j in range(n)],
                              gpu_budgets={}, microbatches=2, example_inputs=(x,), device=devs)
        y = pipe(x)
        y.sum().backward()
        assert not [r for d in devs.values() for r in d.races]
        # micro-batches of 4 rows against eager's 8: another matmul blocking, so fp32 rounding of
        # 8-term dot products (a few ulps) apart, not bit-equal
        torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-6)
        for a, b in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
