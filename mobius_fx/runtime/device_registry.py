"""The device kinds by name, and the contract each one keeps.

A kind is a `Device` subclass (mobius_fx/runtime/device_books.py, the abstract interface) in its
own module, registered by name: `register_device("virtual", VirtualDevice)` at the end of
`device_virtual.py`. `make_devices(device=name)` (`mobius_fx.runtime.devices`, whose import
registers the built-in kinds of `kinds.DEVICES`) builds any registered kind with its `create`.

`register_device` refuses a class that is no `Device`, or that leaves abstract methods
unimplemented; with `check=True` it also runs the contract below on two devices of the kind and
refuses one that breaks it, listing what broke. `tests/unit/test_device_conformance.py` runs the
same contract on every registered kind (one test per kind and check), plus a pipeline on the
kind against eager: a new kind passes it or is refused.

The contract (`CONTRACT`, each check a function of a factory `make(budgets) -> {name: Device}`):
weights booked by `fill` and freed by `vacate`; the budget refused with `BudgetError`, nothing
booked; compute after `ready` sees the upload; a slot refilled only after its last use (a
download of it still gives the old weights) and reused, not grown; activations moved, cast,
differentiable and logged as the IR books them; saved inputs offloaded and restored, a change in
place refused; gradients claimed, downloaded, freed (widened, and summed with partials); flags
fetched unlogged; `accept`; the RNG replayed and restored; a stage's work booked against its budget.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import torch

from mobius_fx.errors import BudgetError, MobiusError
from mobius_fx.kinds import DEVICES
from mobius_fx.runtime.device_books import Device, nbytes
from mobius_fx.runtime.streams import PENDING

__all__ = ["register_device", "unregister_device", "device_class", "device_kinds", "device_choices", "CONTRACT",
           "conformance_problems", "ContractError"]

_KINDS: dict[str, type[Device]] = {}
Make = Callable[[Mapping[str, "int | None"]], "dict[str, Device]"]


class ContractError(MobiusError):
    """A device kind broke the device contract (`CONTRACT`)."""


def register_device(kind: str, cls: type, *, check: bool = False) -> type:
    """Register `cls` as device kind `kind` (`make_devices(device=kind)`, `compile(device=kind)`);
    returns `cls`, whose `kind` becomes `kind`. Refused (MobiusError, nothing registered): a name
    that is not a non-empty string, "auto", a name taken by another class, a class registered
    under another name, a class that is not a `Device` subclass or leaves abstract methods
    unimplemented, and, with `check=True`, one that fails the contract (`conformance_problems`)."""
    if not isinstance(kind, str) or not kind or kind == "auto":
        raise MobiusError(f"register_device({kind!r}, ...): a device kind is named by a non-empty string other than "
                          f"'auto' (which picks 'cuda' or 'virtual'); pass the name compile(device=...) will take")
    if not (isinstance(cls, type) and issubclass(cls, Device)):
        raise MobiusError(f"register_device({kind!r}, {cls!r}): not a Device subclass; a device kind implements the "
                          f"abstract interface mobius_fx.runtime.device_books.Device (derive from it, or from "
                          f"StreamDevice for one with streams and a slot pool)")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise MobiusError(f"register_device({kind!r}, {cls.__name__}): it leaves abstract methods of Device "
                          f"unimplemented ({missing}); implement them (each one's docstring on "
                          f"mobius_fx.runtime.device_books.Device is its contract)")
    other = _KINDS.get(kind)
    if other is not None and other is not cls:
        raise MobiusError(f"register_device({kind!r}, {cls.__name__}): {kind!r} is {other.__name__} already; pick "
                          f"another name, or unregister_device({kind!r}) first")
    named = next((k for k, c in _KINDS.items() if c is cls and k != kind), None)
    if named is not None:
        raise MobiusError(f"register_device({kind!r}, {cls.__name__}): {cls.__name__} is kind {named!r} already (a "
                          f"class is one kind: its `kind` names it); register a subclass under the new name")
    if check:
        problems = conformance_problems(cls)
        if problems:
            raise ContractError(f"register_device({kind!r}, {cls.__name__}): the kind breaks the device contract:\n- "
                                + "\n- ".join(problems) + "\nfix these (each check is a function of "
                                "mobius_fx.runtime.device_registry.CONTRACT; tests/unit/test_device_conformance.py "
                                "runs them on every registered kind)")
    cls.kind = kind
    _KINDS[kind] = cls
    return cls


def unregister_device(kind: str) -> None:
    """Forget device kind `kind` (a kind a test or a plug-in registered); unknown names are ignored."""
    _KINDS.pop(kind, None)


def device_kinds() -> tuple[str, ...]:
    """The registered kinds, in the order they were registered."""
    return tuple(_KINDS)


def device_choices() -> tuple[str, ...]:
    """What `device=` takes by name: `kinds.DEVICES` ("auto" and the built-in kinds, registered
    when `mobius_fx.runtime.devices` is imported), then every other registered kind in the order
    it was registered."""
    return (*DEVICES, *(k for k in _KINDS if k not in DEVICES))


def device_class(kind: str) -> type[Device]:
    """The class of registered kind `kind`; refuses another name, listing the registered ones."""
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        names = ", ".join(repr(k) for k in device_choices())
        raise MobiusError(f"device={kind!r} is not a registered device kind; use one of {names} ('auto': cuda when "
                          f"available, else virtual), pass your own {{gpu name: Device}}, or register your kind "
                          f"(mobius_fx.runtime.device_registry.register_device)")
    return cls


def conformance_problems(cls: type[Device], make: Make | None = None) -> list[str]:
    """What `cls` breaks of the contract, one line per failed check (empty: it keeps it); `make`
    builds its devices (default: `cls.create(budgets, seed=0)`)."""
    reason = cls.unavailable()
    if reason is not None:
        return [f"its devices cannot be made here: {reason}"]
    make = make or (lambda budgets: cls.create(budgets, seed=0))
    problems = []
    for name, check in CONTRACT.items():
        try:
            check(make)
        except Exception as e:  # noqa: BLE001 -- any failure of the kind is a broken contract, reported by name
            problems.append(f"{name}: {type(e).__name__}: {e}")
    return problems


# ----------------------------------------------------------------------------- the contract

def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise ContractError(what)


def _masters(seed: int) -> list[torch.Tensor]:
    """A stage's host masters: a weight and a bias, seeded, far from zero (an empty slot reads 0)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 8, generator=g) + 3, torch.randn(8, generator=g) + 3]


def _equal_on(dev: Device, stage: int, slots: list[torch.Tensor], masters: list[torch.Tensor]) -> bool:
    """Whether stage `stage`'s work on `dev` reads the masters' values in its slots."""
    with dev.working(stage):
        return all(bool(torch.equal(s, m.to(s.device, s.dtype))) for s, m in zip(slots, masters))


def _no_storage(slots: list[torch.Tensor]) -> bool:
    return all(s.untyped_storage().nbytes() == 0 for s in slots)


def _logged(dev: Device, kind: str) -> tuple[int, int]:
    c = dev.log.as_dict().get(kind, {"count": 0, "bytes": 0})
    return c["count"], c["bytes"]


def _stage(dev: Device, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    masters = _masters(seed)
    slots = [dev.new_slot(m, None, True) for m in masters]
    return masters, slots, sum(nbytes(s) for s in slots)


def check_weights_booked_and_freed(make: Make) -> None:
    dev = make({"gpu0": None})["gpu0"]
    masters, slots, n = _stage(dev, 0)
    _expect(_no_storage(slots), "new_slot gave the slot storage before any fill")
    dev.plan_slots([dev.slot_bytes(slots)])
    dev.open_pool()
    pool = dev.pool_bytes()
    _expect(dev.current_bytes == (pool or 0), f"open_pool booked {dev.current_bytes} bytes, pool_bytes() says {pool}")
    with dev.log.stage(0):
        token = dev.fill(0, slots, masters, n)
    want = pool if pool is not None else n
    _expect(dev.current_bytes == want, f"fill booked {dev.current_bytes} bytes in all, want {want} (the stage's "
                                       f"weights, or the pool)")
    _expect(_logged(dev, "weight h2d") == (len(slots), n),
            f"fill logged {_logged(dev, 'weight h2d')} weight h2d (copies, bytes), want {(len(slots), n)}")
    dev.ready(token, slots)
    _expect(_equal_on(dev, 0, slots, masters), "after ready, the stage's work does not read the masters' values")
    dev.vacate(0, slots, n)
    dev.synchronize()
    _expect(dev.current_bytes == (pool or 0), f"vacate left {dev.current_bytes} bytes booked, want {pool or 0}")
    _expect(_no_storage(slots), "vacate left the slots their storage (a use after eviction must fail)")
    dev.close_pool()
    _expect(dev.current_bytes == 0, f"close_pool left {dev.current_bytes} bytes booked")


def check_budget_refused(make: Make) -> None:
    budget = sum(nbytes(m) for m in _masters(1)) // 2
    dev = make({"gpu0": budget})["gpu0"]
    masters, slots, n = _stage(dev, 1)
    try:
        dev.plan_slots([dev.slot_bytes(slots)])
        dev.open_pool()
        dev.fill(0, slots, masters, n)
    except BudgetError as e:
        msg = str(e)
        _expect(dev.name in msg and "budget is" in msg and str(budget) in msg and "weight" in msg,
                f"the BudgetError does not name the GPU, its budget ({budget} bytes) and the weights: {msg!r}")
        _expect("more memory" in msg, f"the BudgetError gives no remedy: {msg!r}")
    else:
        raise ContractError(f"weights of {n} bytes were made resident under a budget of {budget} bytes")
    _expect(dev.current_bytes == 0 and _no_storage(slots),
            f"after the refusal {dev.current_bytes} bytes stay booked or a slot has storage")
    dev = make({"gpu0": 4096})["gpu0"]
    try:
        with dev.working(0):
            torch.ones(8192, dtype=torch.uint8, device=dev.torch_device).sum()
    except BudgetError as e:
        _expect(dev.name in str(e), f"the BudgetError of a stage's work does not name the GPU: {e}")
    else:
        raise ContractError("a stage's work of 8192 bytes passed a budget of 4096 bytes")


def check_compute_after_upload(make: Make) -> None:
    dev = make({"gpu0": None})["gpu0"]
    stages = [_stage(dev, 10 + k) for k in range(4)]
    dev.plan_slots([max(dev.slot_bytes(s) for _, s, _ in stages)])
    dev.open_pool()
    for k, (masters, slots, n) in enumerate(stages):
        dev.ready(dev.fill(k, slots, masters, n), slots)
        _expect(_equal_on(dev, k, slots, masters), f"stage {k}'s work ran before its upload (wrong weights read)")
        dev.vacate(k, slots, n)
    dev.synchronize()
    dev.close_pool()


def check_refill_after_last_use(make: Make) -> None:
    dev = make({"gpu0": None})["gpu0"]
    (a, sa, n), (b, sb, _) = _stage(dev, 20), _stage(dev, 21)
    dev.plan_slots([dev.slot_bytes(sa)])  # one slot: stage 1 reuses stage 0's
    dev.open_pool()
    dev.ready(dev.fill(0, sa, a, n), sa)
    with dev.working(0):
        where = sa[0].untyped_storage().data_ptr()
        scaled = sa[0] * 2  # a read of the slot on the compute stream
    pending = dev.download(sa[0], "buffer")  # and one on the download stream
    dev.vacate(0, sa, n)
    held, pool = dev.current_bytes, dev.pool_bytes()
    dev.ready(dev.fill(1, sb, b, n), sb)
    _expect(torch.equal(pending(), a[0]), "a refill of a slot overwrote a download issued before its eviction")
    with dev.working(1):
        _expect(bool(torch.equal(scaled, (a[0] * 2).to(scaled.device))), "a refill overwrote a read issued before "
                                                                          "its eviction")
        _expect(bool(torch.equal(sb[1], b[1].to(sb[1].device))), "the refilled slot does not hold the new weights")
    if pool is not None:
        _expect(dev.pool_bytes() == pool and dev.current_bytes == held, "the refill grew the pool instead of reusing "
                                                                        "the slot its last user gave back")
        _expect(sb[0].untyped_storage().data_ptr() == where, "stage 1 did not get the one slot stage 0 gave back")
    del scaled
    dev.vacate(1, sb, n)
    dev.synchronize()
    dev.close_pool()


def check_activations_move(make: Make) -> None:
    devs = make({"gpu0": None, "gpu1": None})
    a, b = devs["gpu0"], devs["gpu1"]
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(3), requires_grad=True)
    ya = a.receive(x, None)
    with a.compute():
        za = ya * 2
    yb = b.receive(za, a)
    with b.compute():
        zb = yb + 1
    h = b.to_host(zb)
    again = a.receive(h.detach(), None)  # the host buffer to_host writes, read by another GPU before the host reads it
    PENDING.settle(h, "the contract's host read")
    _expect(h.device.type == "cpu" and torch.equal(h.detach(), x.detach() * 2 + 1),
            "receive / compute / receive from a GPU / to_host does not give the host the value computed")
    h.sum().backward()
    _expect(x.grad is not None and torch.equal(x.grad, torch.full_like(x, 2.0)),
            "the gradient did not flow back through to_host, receive from a GPU and receive from the host")
    size = nbytes(x)
    for dev, kind, n in ((a, "activation h2d", 2), (b, "activation d2d", 1), (b, "activation d2h", 1)):
        _expect(_logged(dev, kind) == (n, n * size), f"{dev.name} logged {_logged(dev, kind)} {kind} (copies, bytes), "
                                                     f"want {(n, n * size)}")
    half = b.receive(h.detach(), None, torch.float16)
    _expect(half.dtype == torch.float16 and half.device == b.torch_device, "receive(dtype=float16) did not cast")
    with a.compute():
        _expect(bool(torch.equal(again, h.detach().to(again.device))), "a receive of a host value read it too early")
    for dev in devs.values():
        dev.synchronize()


def check_offload_and_restore(make: Make) -> None:
    dev = make({"gpu0": None})["gpu0"]
    with dev.working(0):
        t = torch.full((4, 6), 7.0, device=dev.torch_device)
        saved = dev.offload(t)
    _expect(_logged(dev, "input d2h") == (1, nbytes(t)), f"offload logged {_logged(dev, 'input d2h')}")
    with dev.deferred() as events:
        back = dev.restore(saved)
    dev.join(list(events))
    with dev.compute():
        _expect(bool(torch.equal(back, t)), "restore (deferred, then joined) did not give the offloaded values")
    _expect(_logged(dev, "input h2d") == (1, nbytes(t)), f"restore logged {_logged(dev, 'input h2d')}")
    with dev.working(0):
        u = torch.ones(4, device=dev.torch_device)
        saved = dev.offload(u)
        u.add_(1)
    try:
        dev.restore(saved)
    except MobiusError as e:
        _expect("modified in place" in str(e), f"the error of a changed input does not say so: {e}")
    else:
        raise ContractError("an input changed in place after offload was restored without an error")
    dev.synchronize()


def check_gradients_download_and_flags(make: Make) -> None:
    dev = make({"gpu0": None})["gpu0"]
    base = dev.current_bytes
    with dev.working(0):
        g = torch.full((32,), 0.5, device=dev.torch_device)
        dev.claim(g, "stage 0's weight gradients")
        flag = torch.isfinite(g).all()
    _expect(dev.current_bytes >= base + nbytes(g), f"claim booked {dev.current_bytes - base} bytes, want "
                                                    f"{nbytes(g)}")
    logged = dev.log.as_dict()
    read = dev.fetch(flag)
    _expect(dev.log.as_dict() == logged, "fetch logged a transfer (a flag is not one of the plan's)")
    pending = dev.download(g, "gradient")
    dev.free(nbytes(g))
    del g, flag
    host = pending()
    _expect(host.device.type == "cpu" and torch.equal(host, torch.full((32,), 0.5)), "download gave wrong values")
    _expect(read() is True, "fetch of a true flag did not read True")
    _expect(_logged(dev, "gradient d2h") == (1, nbytes(host)), f"download logged {_logged(dev, 'gradient d2h')}")
    # widened on the GPU into a host tensor of the caller's (the overlap's fp32 .grad home)
    with dev.working(0):
        h = torch.full((32,), 1 / 3, device=dev.torch_device).to(torch.bfloat16)
        dev.claim(h, "stage 0's weight gradients")
    into = torch.empty(32, dtype=torch.float32, pin_memory=dev.pins_host)
    pending = dev.download(h, "gradient", into=into)
    want = h.float().cpu()
    dev.free(nbytes(h))
    del h
    _expect(pending() is into and torch.equal(into, want), "a download into= a wider host tensor gave other values")
    _expect(_logged(dev, "gradient d2h") == (2, nbytes(host) + nbytes(into)),
            f"a widened download logged {_logged(dev, 'gradient d2h')}, want its fp32 bytes")
    dev.synchronize()
    _expect(dev.current_bytes == base, f"{dev.current_bytes - base} bytes stay booked after the download and free")


def check_download_sums_partials(make: Make) -> None:
    """A widened download with `addends` (host tensors: a tied weight's partials the other stages
    downloaded, runtime/tied_sums.py) writes their sum and the value's, in fp32 in order (the
    host's `sum_downloads` bits), and logs the fp32 bytes once; nothing stays booked."""
    dev = make({"gpu0": None})["gpu0"]
    base = dev.current_bytes
    vals = [(torch.randn(37, generator=torch.Generator().manual_seed(s)) * 10 ** s).to(torch.bfloat16)
            for s in range(3)]
    for v, x in zip(vals, (1.0, 1.0, 2.0 ** 24)):  # fp32 addition's order shows: (1 + 1) + 2^24 != (2^24 + 1) + 1
        v[:4] = x
    with dev.working(0):
        own = vals[2].to(dev.torch_device)
        dev.claim(own, "stage 0's weight gradients")
    into = torch.empty(37, dtype=torch.float32, pin_memory=dev.pins_host)
    pending = dev.download(own, "gradient", into=into,
                           addends=[v.pin_memory() if dev.pins_host else v for v in vals[:2]])
    dev.free(nbytes(own))
    del own
    want = (vals[0].float() + vals[1].float()) + vals[2].float()
    _expect(pending() is into and torch.equal(into, want), "a download with addends did not write their fp32 sum, "
                                                           "in order, with the value last")
    _expect(_logged(dev, "gradient d2h") == (1, nbytes(into)), f"a summed download logged "
                                                               f"{_logged(dev, 'gradient d2h')}, want its fp32 bytes")
    dev.synchronize()
    _expect(dev.current_bytes == base, f"{dev.current_bytes - base} bytes stay booked after a summed download")


def check_accept(make: Make) -> None:
    dev = make({"gpu0": None})["gpu0"]
    with dev.compute():
        mine = torch.ones(3, device=dev.torch_device)
    dev.track(mine)
    _expect(dev.accept(mine) is mine, "accept copied a tensor the GPU holds")
    _expect(dev.accept(3) == 3, "accept changed a non-tensor")
    host = torch.arange(5.0)
    with dev.compute():
        got = dev.accept(host)
        _expect(got is not host and got.device == dev.torch_device and bool(torch.equal(got, host.to(got.device))),
                "accept of a host tensor did not give a copy on the GPU")
    dev.synchronize()


def check_rng(make: Make) -> None:
    dev = make({"gpu0": None})["gpu0"]
    state = dev.rng_state()
    draws = []
    for _ in range(2):
        with dev.rng(state):
            draws.append(torch.rand(8, device=dev.torch_device))
    _expect(torch.equal(draws[0], draws[1]), "two runs under rng(state) drew different numbers")
    torch.rand(3, device=dev.torch_device)  # the generator moves on outside rng()
    before = dev.rng_state()
    with dev.rng(state):
        torch.rand(8, device=dev.torch_device)
    _expect(torch.equal(dev.rng_state(), before), "rng(state) did not restore the generator's state")


def check_stage_work_measured(make: Make) -> None:
    dev = make({"gpu0": None})["gpu0"]
    with dev.working(3, others=0):
        t = torch.ones(1024, device=dev.torch_device)
        t.add_(1)
    _expect(dev.stage_peaks.get(3, 0) >= nbytes(t), f"stage 3's measured peak {dev.stage_peaks.get(3)} misses the "
                                                    f"{nbytes(t)} bytes its work made")
    del t
    dev.synchronize()


CONTRACT: dict[str, Callable[[Make], None]] = {
    "weights booked and freed": check_weights_booked_and_freed,
    "budget refused": check_budget_refused,
    "compute after upload": check_compute_after_upload,
    "refill after last use": check_refill_after_last_use,
    "activations move": check_activations_move,
    "offload and restore": check_offload_and_restore,
    "gradients, downloads, flags": check_gradients_download_and_flags,
    "downloads sum partials": check_download_sums_partials,
    "accept": check_accept,
    "rng": check_rng,
    "stage work measured": check_stage_work_measured,
}

