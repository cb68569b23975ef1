"""How a GPU measures its stages' work (`memory_books`, mobius_fx/runtime/device_books.py): "ops" charges every
tensor per op through a dispatch mode (Python on every op); "allocator" runs no Python per op
and measures each stage's work window by a `MemorySource` -- CUDA's caching allocator on CUDA;
here, on the CPU stand-in of the CUDA path, the books themselves or an allocator the test drives
-- and raises `BudgetError` when a stage's measured peak passes the budget.

What these tests pin down on the CPU:

- "allocator" runs a training step without a single Python dispatch call (and with no dispatch
  mode on the stack while stages work), bit-equal to "ops";
- a stage whose measured peak passes the budget raises `BudgetError` naming the stage and the
  figures, in forward and in backward, and the pipeline recovers;
- the values are validated; compile and build_pipeline wire them to every device;
- `CudaAllocator`'s windows (resets of the device's peak, nested, shared by two pipeline GPUs)
  against a scripted torch.cuda allocator.
"""

import copy
import re

import pytest
import torch
import torch.fx as fx
from torch import nn

import mobius_fx
from mobius_fx import BudgetError, MobiusError, Topology
from mobius_fx.runtime.memory_sources import CudaAllocator, Mark, MemorySource
from mobius_fx.runtime.device_virtual import VirtualDevice
from mobius_fx.runtime.device_virtual_async import VirtualAsyncDevice
from mobius_fx.runtime.devices import make_devices
from mobius_fx.options import CompileOptions
from mobius_fx.build import build_pipeline

pytestmark = pytest.mark.usefixtures("one_thread", "trace_cache")

_COMPUTE = ("call_function", "call_method", "call_module")
_SEEN: list[int] = []  # the dispatch-mode stack's depth each time a stage's work ran `probe`
_SPIKE = {"bytes": 0, "when": None, "source": None}  # what `spike` reports to the test's allocator


@torch.fx.wrap
def probe(x):
    _SEEN.append(torch._C._len_torch_dispatch_stack())
    return x


@torch.fx.wrap
def spike(x):
    """A temporary the size the test sets, made and freed inside the stage's work ("forward":
    the forward's run, "backward": the recompute), reported to the test's allocator."""
    src, when = _SPIKE["source"], _SPIKE["when"]
    phase = "backward" if torch.is_grad_enabled() else "forward"
    if src is not None and when == phase:
        t = torch.empty(_SPIKE["bytes"], dtype=torch.uint8)
        src.note(t.numel())
        del t
    return x * 2


class Probed(nn.Module):
    def __init__(self, d=16, hidden=64):
        super().__init__()
        self.a, self.b = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.c, self.d = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        h = probe(torch.relu(self.a(x)))
        h = self.b(h)
        h = spike(probe(torch.tanh(self.c(h))))
        return self.d(h)


def pipeline(model, x, *, books, budget=None, devices=None):
    """Stages [a, relu, probe] [b] [c, tanh, probe, spike] [d] on gpu0 gpu1 gpu0 gpu1 (virtual-async)."""
    gm = fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    cuts = [names.index("b"), names.index("c"), names.index("d")]
    bounds = [0, *cuts, len(names)]
    return build_pipeline(model, gm, stage_nodes=[names[a:b] for a, b in zip(bounds, bounds[1:])],
                          stage_gpus=["gpu0", "gpu1"] * 2, gpu_budgets={"gpu0": budget, "gpu1": budget},
                          microbatches=2, example_inputs=(x,), device=devices or "virtual-async",
                          memory_books=books)


class ScriptedAllocator(MemorySource):
    """An allocator the test drives, shared by the GPUs as CUDA's is by pipeline GPUs on one
    device: `note(n)` is an allocation of n bytes made and freed while the open windows last."""

    what = "the test's allocator"

    def __init__(self):
        self.now = 0
        self.open: list[Mark] = []

    def allocated(self):
        return self.now

    def note(self, n):
        for m in self.open:
            m.peak = max(m.peak, self.now + n)

    def mark(self):
        m = Mark(self.now)
        self.open.append(m)
        return m

    def peak_since(self, mark):
        self.open.remove(mark)
        return mark.peak


def step(pipe, model, x, opt):
    opt.zero_grad(set_to_none=True)
    out = pipe(x)
    out.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return out.detach(), grads


def test_allocator_books_run_a_training_step_with_no_python_per_op_bit_equal_to_ops():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    runs = {}
    for books in ("ops", "allocator"):
        torch.manual_seed(0)
        model = Probed()
        pipe = pipeline(model, x, books=books)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        devs = list(pipe.devices.values())
        assert {d.memory_books for d in devs} == {books}
        step(pipe, model, x, opt)  # a first step: the streamed copies are made
        d0 = sum(d.dispatch_calls for d in devs)
        _SEEN.clear()
        runs[books] = [step(pipe, model, x, opt) for _ in range(2)], sum(d.dispatch_calls for d in devs) - d0, \
            list(_SEEN)
        assert all(s["current_bytes"] == s["slot_pool_bytes"] for s in pipe.memory_stats().values())
    (ops, ops_calls, ops_seen), (alloc, alloc_calls, alloc_seen) = runs["ops"], runs["allocator"]
    assert ops_calls > 100 and alloc_calls == 0, (ops_calls, alloc_calls)
    # probe ran in every stage call's forward and recompute: 2 probes x 2 micro-batches x 2 steps x 2
    assert len(ops_seen) == len(alloc_seen) == 16
    assert all(depth >= 1 for depth in ops_seen) and all(depth == 0 for depth in alloc_seen), (ops_seen, alloc_seen)
    for (out_o, g_o), (out_a, g_a) in zip(ops, alloc):
        assert torch.equal(out_o, out_a)
        assert g_o.keys() == g_a.keys() and all(torch.equal(g_o[n], g_a[n]) for n in g_o)


@pytest.mark.parametrize("when", ["forward", "backward"])
def test_a_stage_whose_measured_peak_passes_the_budget_raises_naming_it_and_the_pipeline_recovers(when):
    torch.manual_seed(0)
    model = Probed()
    eager = copy.deepcopy(model)
    x = torch.randn(8, 16)
    budget = 2**20  # the slots, gradient sums and activations: a few KiB
    source = ScriptedAllocator()
    devices = {f"gpu{i}": VirtualAsyncDevice(f"gpu{i}", None, seed=i) for i in range(2)}
    for d in devices.values():
        d.memory_source = source  # both pipeline GPUs on one "device", as on cuda:0
    pipe = pipeline(model, x, books="allocator", devices=devices)
    _SPIKE.update(bytes=budget, when=when, source=source)
    try:
        pipe(x).pow(2).mean().backward()  # nothing the books see comes near the budget
        measured = pipe.stage_peaks()
        assert measured[2] >= budget > max(measured[:2] + measured[3:]), measured
        model.zero_grad(set_to_none=True)
        for dev in devices.values():
            dev.budget = budget
        with pytest.raises(BudgetError) as err:
            pipe(x).pow(2).mean().backward()
        msg = str(err.value)
        peak = int(re.search(r"\((\d+) bytes: ", msg).group(1))
        assert msg.startswith(f"gpu0: stage 2's work peaked at") and "measured by the test's allocator" in msg, msg
        assert peak > budget and f"budget is 1.00 MiB ({budget} bytes)" in msg, msg
        assert "memory_books='ops'" in msg
        assert all(p.grad is None for p in model.parameters())
        assert all(s["current_bytes"] == s["slot_pool_bytes"] for s in pipe.memory_stats().values())
        assert not source.open  # every window closed, the failed one too
    finally:
        _SPIKE.update(bytes=0, when=None, source=None)
    pipe(x).pow(2).mean().backward()  # no spike: the pipeline is usable again
    eager(x).pow(2).mean().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_compile_wires_memory_books_to_every_device_and_refuses_unknown_values(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(4, 8)
    topo = Topology.virtual(gpus=2, memory="64MiB")
    kw = dict(example_inputs=(x,), microbatches=2, costs="model", cache_dir=str(tmp_path), verbose=False)
    for device in ("virtual", "virtual-async"):
        pipes = {books: mobius_fx.compile(copy.deepcopy(model), topo, device=device, memory_books=books, **kw)
                 for books in ("auto", "ops", "allocator")}
        assert {b: {d.memory_books for d in p.devices.values()} for b, p in pipes.items()} == \
            {"auto": {"ops"}, "ops": {"ops"}, "allocator": {"allocator"}}
        for books, pipe in pipes.items():
            pipe(x).sum().backward()
            calls = sum(d.dispatch_calls for d in pipe.devices.values())
            assert (calls == 0) == (books == "allocator"), (device, books, calls)
    for bad in ("alloc", None, "OPS", 1):
        with pytest.raises(MobiusError, match=r"memory_books=.* is not one of 'auto', 'ops', 'allocator'"):
            mobius_fx.compile(model, topo, memory_books=bad, **kw)
        with pytest.raises(MobiusError, match=r"memory_books=.* is not one of"):
            CompileOptions(memory_books=bad)
        with pytest.raises(MobiusError, match=r"memory_books=.* is not one of"):
            VirtualDevice("gpu0", None).set_memory_books(bad)
    assert {d.memory_books for d in make_devices({"a": None}, device="virtual").values()} == {"ops"}
    given = VirtualDevice("gpu0", None)
    given.set_memory_books("allocator")
    make_devices({"gpu0": None}, device={"gpu0": given})  # "auto" leaves your own devices as they are
    assert given.memory_books == "allocator"
    make_devices({"gpu0": None}, device={"gpu0": given}, memory_books="ops")
    assert given.memory_books == "ops"


class _FakeCuda:
    """torch.cuda's allocator statistics, scripted: `alloc(n)` / `free(n)` move the bytes
    allocated; the peak is the most since the last `reset_peak_memory_stats`."""

    def __init__(self):
        self.current = self.peak = 0
        self.resets = 0

    def alloc(self, n):
        self.current += n
        self.peak = max(self.peak, self.current)

    def free(self, n):
        self.current -= n

    def stats(self, index):
        assert index == 0
        return {"allocated_bytes": {"all": {"current": self.current, "peak": self.peak}}}

    def reset(self, index):
        self.resets += 1
        self.peak = self.current


def test_cuda_allocator_windows_nest_across_the_pipeline_gpus_sharing_a_device(monkeypatch):
    fake = _FakeCuda()
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", fake.stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset)
    monkeypatch.setattr(CudaAllocator, "_by_index", {})
    src = CudaAllocator.of(0)
    assert CudaAllocator.of(0) is src  # one per CUDA device, whichever pipeline GPU asks
    fake.alloc(1000)
    fake.free(600)  # a peak before any window: in max_allocated, in no window
    outer = src.mark()  # gpu0's stage
    assert (outer.start, fake.peak) == (400, 400)
    fake.alloc(500)
    fake.free(500)  # outer's peak: 900
    inner = src.mark()  # gpu1's stage, inside (a reset: outer keeps what it saw)
    fake.alloc(200)
    fake.free(200)
    assert src.peak_since(inner) == 600
    fake.alloc(50)
    assert src.peak_since(outer) == 900
    assert src.max_allocated() == 1000  # as torch would have said it, across the resets
    src.reset_max()
    assert src.max_allocated() == 450 and not src._open
    fake.alloc(100)
    assert src.allocated() == 550 and src.max_allocated() == 550
