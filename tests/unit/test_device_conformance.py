"""The device contract, run on every registered device kind (issue 37 part 5).

`Device` (mobius_fx/runtime/device_books.py) is an abstract class: its abstract methods are what
the runtime calls on a device and differs per kind, each docstring a contract. Every kind of the
registry (`mobius_fx.runtime.device_registry.device_choices()`: virtual, virtual-async, cuda -- skipped
here without CUDA, run on a GPU machine -- and any kind registered before collection) runs:

- each check of the contract (`device_registry.CONTRACT`, one test per kind and check): weights
  booked by `fill` and freed by `vacate`; the budget refused with `BudgetError` naming the GPU, the
  budget and a remedy, nothing booked; compute after `ready` reads the upload; a slot refilled
  only after its last use (a download issued before the eviction still reads the old weights)
  and reused, not grown; activations moved, cast, differentiable, logged as the IR books them; a
  saved input restored (deferred, joined), one changed in place refused; gradients claimed,
  downloaded, freed; flags fetched unlogged; `accept`; the RNG replayed and restored;
- on the stream stand-in, the same checks with every queued item delayed (an ordering fault
  shows as wrong values, not only in the sanitizer);
- a small pipeline on the kind: outputs and gradients equal eager (bit-equal to the reference
  kind "virtual" on the CPU), transfers equal the schedule IR copy by copy, everything freed.

A new kind passes these or is refused: `register_device(kind, cls, check=True)` runs the same
contract and refuses a broken kind with the checks it fails (the broken toy kinds below, each
with one fault; a fault of a built-in kind fails these tests the same way).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import inspect
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import ShapeProp

from mobius_fx import MobiusError
from mobius_fx.build import build_pipeline
from mobius_fx.kinds import DEVICES
from mobius_fx.options import CompileOptions
from mobius_fx.runtime import device_registry
from mobius_fx.runtime.device_books import Device
from mobius_fx.runtime.device_common import CpuRng
from mobius_fx.runtime.device_registry import CONTRACT, ContractError, conformance_problems, device_class
from mobius_fx.runtime.devices import make_devices
from mobius_fx.runtime.device_virtual_async import VirtualAsyncDevice
from mobius_fx.runtime.device_virtual import VirtualDevice
from mobius_fx.runtime.device_registry import device_choices, register_device, unregister_device
from mobius_fx.zoo import ResidualMLP

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = [k for k in device_choices() if k != "auto"]  # every registered kind, built-in or not
_COMPUTE = ("call_function", "call_method", "call_module")


def _make(kind):
    cls = device_class(kind)
    reason = cls.unavailable()
    if reason is not None:
        pytest.skip(f"device kind {kind!r} cannot run here: {reason}")
    return lambda budgets: cls.create(budgets, seed=0)


# ----------------------------------------------------------------------------- the interface

# The abstract methods: what differs per kind. Everything else the runtime calls has a shared
# implementation (the books) or a default for a kind without a pool or streams.
ABSTRACT = {"compute", "fill", "ready", "vacate", "accept", "receive", "to_host", "offload", "restore", "download",
            "fetch", "rng_state", "rng"}
ROOT = Path(__file__).resolve().parents[2]
# The modules that drive devices, and how they name one: `dev`, `src`, `dst`, `device`, `<x>.device`,
# `<x>.devices[...]`, `devices[...]`; calls through getattr(<device>, "name", ...) included.
DRIVERS = ["mobius_fx/runtime/engine.py", "mobius_fx/runtime/stage_state.py",
           "mobius_fx/runtime/stage_autograd.py", "mobius_fx/runtime/pipeline.py", "mobius_fx/runtime/overlap.py",
           "mobius_fx/runtime/executor.py", "mobius_fx/build.py"]


def _is_device(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in {"dev", "src", "dst", "device"}
    if isinstance(node, ast.Attribute):
        return node.attr == "device"
    if isinstance(node, ast.Subscript):
        v = node.value
        return (isinstance(v, ast.Name) and v.id == "devices") or (isinstance(v, ast.Attribute) and v.attr == "devices")
    return False


def runtime_uses() -> dict[str, set[str]]:
    """What the driving modules read on a device: name -> the modules that do."""
    out: dict[str, set[str]] = {}
    for rel in DRIVERS:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            name = None
            if isinstance(node, ast.Attribute) and _is_device(node.value):
                name = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                  and len(node.args) >= 2 and _is_device(node.args[0]) and isinstance(node.args[1], ast.Constant)):
                name = node.args[1].value
            if name is not None:
                out.setdefault(name, set()).add(rel)
    return out


# Device with every abstract method stubbed: what the base class itself gives.
_Probe = type("_Probe", (Device,), {m: (lambda self, *a, **k: None) for m in ABSTRACT})


def test_device_is_abstract_and_its_abstract_methods_are_the_per_kind_ones():
    assert inspect.isabstract(Device) and set(Device.__abstractmethods__) == ABSTRACT
    with pytest.raises(TypeError, match="abstract"):
        Device("gpu0", None, torch.device("cpu"))
    for name in ABSTRACT:
        assert (getattr(Device, name).__doc__ or "").strip(), f"Device.{name} has no contract"


def test_what_the_runtime_calls_on_a_device_is_the_interface():
    """Every name the runtime reads on a device is Device's (a method with its contract, or an
    attribute Device.__init__ sets), private ones excepted; every abstract method is called, by
    the runtime or by the shared code it calls."""
    uses = runtime_uses()
    probe = _Probe("gpu0", None, torch.device("cpu"))
    public = {n: where for n, where in uses.items() if not n.startswith("_")}
    missing = {n: sorted(w) for n, w in public.items() if not hasattr(probe, n)}
    assert not missing, f"the runtime reads these on a device but Device has none: {missing}"
    for n in public:
        member = getattr(Device, n, None)
        if callable(member):
            assert (member.__doc__ or "").strip(), f"Device.{n} (called by the runtime) has no contract"
    shared = {n.func.attr for n in ast.walk(ast.parse(inspect.getsource(Device)))  # self.x() in Device's own
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)  # code: `working` enters `compute`
              and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"}
    unused = ABSTRACT - set(uses) - shared
    assert not unused, f"abstract but called neither by the runtime nor by Device's shared code: {sorted(unused)}"


def test_the_runtime_use_scan_sees_a_new_call():
    tree = ast.parse("def f(st, dev):\n    st.device.teleport(1)\n    getattr(dev, 'warp', None)\n")
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _is_device(n.value)}
    assert names == {"teleport"} and _is_device(ast.parse("dev", mode="eval").body)
    assert not _is_device(ast.parse("x.devices", mode="eval").body)


# ----------------------------------------------------------------------------- the registry

def test_the_built_in_kinds_are_registered_and_kinds_devices_lists_them():
    built_in = [k for k in DEVICES if k != "auto"]
    assert set(built_in) <= set(device_registry.device_kinds())
    assert device_choices()[:len(DEVICES)] == DEVICES and KINDS[:len(built_in)] == built_in  # the suite runs them all
    for kind in built_in:
        assert device_class(kind).kind == kind
    assert type(make_devices({"gpu0": None}, device="virtual")["gpu0"]) is VirtualDevice


def test_register_device_refuses_what_is_no_kind():
    class NotADevice:
        pass

    class HalfDone(CpuRng):  # the CPU's RNG, nothing else
        pass

    class Incomplete(Device):
        def compute(self):
            return self.books()

    with pytest.raises(MobiusError, match="not a Device subclass"):
        register_device("nope", NotADevice)
    with pytest.raises(MobiusError, match="not a Device subclass"):
        register_device("nope", HalfDone)
    with pytest.raises(MobiusError, match=r"leaves abstract methods of Device unimplemented \(accept, download, "):
        register_device("nope", Incomplete)
    with pytest.raises(MobiusError, match="other than 'auto'"):
        register_device("auto", VirtualDevice)
    with pytest.raises(MobiusError, match="'virtual' is VirtualDevice already"):
        register_device("virtual", VirtualAsyncDevice)
    with pytest.raises(MobiusError, match="VirtualDevice is kind 'virtual' already"):
        register_device("virtual-2", VirtualDevice)
    assert VirtualDevice.kind == "virtual"
    register_device("virtual", VirtualDevice)  # the same again: nothing changes
    assert "nope" not in device_registry.device_kinds() and "virtual-2" not in device_registry.device_kinds()
    with pytest.raises(MobiusError, match=r"device='tpu' is not a registered device kind; use one of 'auto', "
                                          r"'virtual', 'virtual-async', 'cuda'"):
        make_devices({"gpu0": None}, device="tpu")


class CountingDevice(VirtualDevice):
    """A toy kind that keeps the contract: a virtual GPU counting its fills."""

    fills = 0

    def fill(self, stage, slots, masters, nbytes_, prefer=None):
        type(self).fills += 1
        return super().fill(stage, slots, masters, nbytes_, prefer)


def test_a_kind_that_keeps_the_contract_registers_and_runs_wherever_a_name_is_taken():
    register_device("counting", CountingDevice, check=True)
    try:
        assert CountingDevice.kind == "counting" and "counting" in device_choices()
        assert CompileOptions(device="counting").device == "counting"
        devs = make_devices({"gpu0": None, "gpu1": 1 << 20}, device="counting")
        assert [type(d) for d in devs.values()] == [CountingDevice] * 2 and devs["gpu1"].budget == 1 << 20
        before = CountingDevice.fills
        _run_pipeline("counting")
        assert CountingDevice.fills > before
    finally:
        unregister_device("counting")
    assert "counting" not in device_choices()
    with pytest.raises(MobiusError, match="not one of"):
        CompileOptions(device="counting")


# ----------------------------------------------------------------------------- broken toy kinds: refused

class LeakyDevice(VirtualDevice):
    """Evicting frees the storage but not the books."""

    def vacate(self, stage, slots, nbytes_):
        self._release(slots)


class UnbudgetedDevice(VirtualDevice):
    """Fills without booking: no budget can refuse it."""

    def fill(self, stage, slots, masters, nbytes_, prefer=None):
        with torch.no_grad():
            for s, m in zip(slots, masters):
                s.untyped_storage().resize_(s.numel() * s.element_size())
                s.copy_(m)
        self.log.add("weight", "h2d", sum(s.numel() * s.element_size() for s in slots), len(slots))


class SilentDevice(VirtualDevice):
    """Moves activations without logging them (the transfers would not equal the IR)."""

    def receive(self, value, src, dtype=None, kind="activation"):
        return value.to(dtype) if dtype is not None and dtype != value.dtype else value.clone()


class ForgetfulRngDevice(VirtualDevice):
    """Replays the state but does not put the generator back."""

    @contextlib.contextmanager
    def rng(self, state):
        torch.set_rng_state(state)
        yield


class EagerComputeDevice(VirtualAsyncDevice):
    """The stand-in whose compute does not wait for the upload (`ready` waits only for the issue)."""

    def ready(self, token, slots):
        if token is not None:
            token.result()


class EarlyRefillDevice(VirtualAsyncDevice):
    """The stand-in whose eviction gives the slot back with no last use: a refill may overwrite
    reads still queued."""

    def vacate(self, stage, slots, nbytes_):
        for s in slots:
            empty = self._empty.get(id(s))
            if empty is not None:
                s.data = empty
        if self._pool is not None and stage in self._pool.by_stage:
            self._pool.give_back(stage, [])


BROKEN = [(LeakyDevice, "weights booked and freed"), (UnbudgetedDevice, "budget refused"),
          (SilentDevice, "activations move"), (ForgetfulRngDevice, "rng"),
          (EagerComputeDevice, "compute after upload"), (EarlyRefillDevice, "refill after last use")]


@pytest.mark.parametrize("cls, check", BROKEN, ids=[c.__name__ for c, _ in BROKEN])
def test_a_broken_kind_is_refused_naming_the_check_it_fails(cls, check):
    problems = conformance_problems(cls)
    assert any(p.startswith(f"{check}: ") for p in problems), problems
    with pytest.raises(ContractError, match=f"breaks the device contract:\n(.|\n)*- {check}: "):
        register_device("broken", cls, check=True)
    assert "broken" not in device_registry.device_kinds()


# ----------------------------------------------------------------------------- the contract on every kind

@pytest.mark.parametrize("check", list(CONTRACT))
@pytest.mark.parametrize("kind", KINDS)
def test_every_registered_kind_keeps_the_contract(kind, check):
    CONTRACT[check](_make(kind))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_stand_in_keeps_the_contract_with_every_queued_item_delayed(seed):
    """Every queued item delayed: a copy read before its event, or a slot refilled before its
    last use, reads wrong values (and the sanitizer says so)."""
    def make(budgets):
        return {name: VirtualAsyncDevice(name, b, seed=seed + i, delay=1e-3, chance=1.0)
                for i, (name, b) in enumerate(budgets.items())}

    problems = conformance_problems(VirtualAsyncDevice, make)
    assert problems == []


# ----------------------------------------------------------------------------- a pipeline on every kind

def _values(gm, *mb_inputs):
    """Each graph value's tensor for one micro-batch (meta), for the IR's activation bytes."""
    ShapeProp(gm).propagate(*mb_inputs)
    return {n.name: torch.empty(n.meta["tensor_meta"].shape, dtype=n.meta["tensor_meta"].dtype, device="meta")
            for n in gm.graph.nodes if hasattr(n.meta.get("tensor_meta"), "shape")}


def _run_pipeline(kind, steps=2, m=2):
    """A 4-stage ResidualMLP on 2 GPUs of `kind`, `steps` training steps; (pipeline, model, eager
    twin, input, the steps' (output, grads) per side)."""
    torch.manual_seed(0)
    model = ResidualMLP(d_in=8, width=16, depth=4, d_out=4)
    eager = copy.deepcopy(model)
    x = torch.randn(8, 8)
    gm = fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    bounds = [round(i * len(names) / 4) for i in range(5)]
    pipe = build_pipeline(model, gm, stage_nodes=[names[a:b] for a, b in zip(bounds, bounds[1:])],
                          stage_gpus=["gpu0", "gpu1"] * 2, gpu_budgets={"gpu0": 1 << 20, "gpu1": 1 << 20},
                          microbatches=m, example_inputs=(x,), device=kind)
    runs = {"pipe": [], "eager": []}
    for _ in range(steps):
        for side, fn, mod in (("pipe", pipe, model), ("eager", eager, eager)):
            mod.zero_grad(set_to_none=True)
            out = fn(x)
            out.pow(2).sum().backward()
            runs[side].append((out.detach().cpu(), {n: p.grad.clone() for n, p in mod.named_parameters()}))
        with torch.no_grad():  # a step of plain SGD on both, so the second step uploads changed masters
            for p, q in zip(model.parameters(), eager.parameters()):
                p.sub_(0.1 * p.grad)
                q.sub_(0.1 * q.grad)
    return pipe, gm, x, m, runs


@pytest.mark.parametrize("kind", KINDS)
def test_a_pipeline_on_every_kind_equals_eager_and_moves_what_the_ir_says(kind, monkeypatch):
    _make(kind)  # skips a kind that cannot run here
    if kind == "cuda":  # true fp32 matmuls, as tests/gpu runs them: the fp32 tolerances assume it
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    pipe, gm, x, m, runs = _run_pipeline(kind)
    # The existing tolerances (tests/unit/test_runtime.py: assert_close's fp32 defaults): the
    # pipeline sums a weight's gradient over micro-batches, eager over the batch at once.
    for (out, grads), (ref, ref_grads) in zip(runs["pipe"], runs["eager"]):
        torch.testing.assert_close(out, ref)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], msg=lambda s: f"{kind} {name}: {s}")
    if kind != "virtual" and all(d.torch_device.type == "cpu" for d in pipe.devices.values()):
        _, _, _, _, ref = _run_pipeline("virtual")  # the reference kind: the same ops on the CPU, bit-equal
        for (out, grads), (rout, rgrads) in zip(runs["pipe"], ref["pipe"]):
            torch.testing.assert_close(out, rout, rtol=0, atol=0)
            for name, g in grads.items():
                torch.testing.assert_close(g, rgrads[name], rtol=0, atol=0, msg=lambda s: f"{kind} {name}: {s}")
    ir = pipe.schedule_ir(_values(gm, x[: x.shape[0] // m]))
    want = {}
    for (gpu, what, direction, stage), (count, nbytes) in ir.bytes_moved().items():
        kind_ = f"{what} {direction}"
        per = nbytes if what in ("weight", "gradient") else (count, nbytes)  # weights: one IR op per stage
        want.setdefault(gpu, {}).setdefault(kind_, {})[stage] = per
    got = {}
    for gpu, kinds in pipe.transfer_stats(last_step=True, by_stage=True).items():
        for kind_, per in kinds.items():
            what = kind_.split()[0]
            if what == "buffer":  # buffer updates are not ops of the IR (ResidualMLP has none anyway)
                continue
            for stage, c in per.items():
                got.setdefault(gpu, {}).setdefault(kind_, {})[stage] = \
                    c["bytes"] if what in ("weight", "gradient") else (c["count"], c["bytes"])
    assert got == want
    stats = pipe.memory_stats()
    assert all(s["current_bytes"] == s.get("slot_pool_bytes", 0) for s in stats.values()), stats
    assert all(s["peak_bytes"] <= 1 << 20 for s in stats.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_kind_that_cannot_run_here_says_why_and_is_not_checked_here():
    from mobius_fx.runtime.device_cuda import CudaDevice

    assert conformance_problems(CudaDevice) == [
        "its devices cannot be made here: torch.cuda.is_available() is False; use device='virtual' to run the "
        "pipeline on the CPU with virtual GPUs"]
    with pytest.raises(MobiusError, match=r"device='cuda' but torch.cuda.is_available\(\) is False"):
        make_devices({"gpu0": None}, device="cuda")
