"""The device layer: where a pipeline's weights, gradients and activations live, and how they move.

Everything above the devices (the engine, `engine.py`) is one code path; only the copies differ.
`Device` (`device_books.py`) is the abstract interface the runtime drives, each method's docstring
its contract. One module per kind, each registering its class by name (`register_device`,
`device_registry.py`), built here by `make_devices` from the registry (importing this module
registers the built-in kinds of `kinds.DEVICES`; each class is imported from its own module). A new kind is
registered the same way and then runs wherever a name is taken (`compile(device=...)`); the
contract (`device_registry.CONTRACT`, `tests/unit/test_device_conformance.py`) is how it is
validated (`register_device(..., check=True)` refuses one that breaks it). docs/devices.md says how.

- `VirtualDevice` (`device_virtual.py`) — a GPU of the topology played by the CPU with a byte budget (tests, CI, laptops).
  Uploads make real copies into slots whose storage is freed again on eviction
  (`untyped_storage().resize_(0)`), so a schedule that touches an evicted weight fails loudly.
- `StreamDevice` (`device_stream.py`) — the CUDA path's logic, shared by the two below: per pipeline GPU a compute
  stream, an upload stream (weights), a download stream (gradients, offloaded inputs, values sent
  to the host) and a copy stream (activations from other GPUs and from the host), ordered by
  events (mobius_fx/runtime/streams.py). Weights live in a fixed pool of stage slots (`SlotPool`: as many
  as the schedule IR has stages resident on the GPU, each a region sized from the plan, allocated
  when the pipeline is compiled and kept until `Pipeline.release_slots()`); a slot is
  refilled only after the events of its last use completed, and the upload worker waits for them
  before it issues the refill, so the host cannot run further ahead of a GPU than the IR allows
  (its `wait` for the stage waits for the worker). No copy blocks the host in the steady state:
  a value sent to the host lands in a pinned buffer on the download stream with an event
  (`streams.PENDING`); the copy up to the GPU that reads it waits for that event on its copy
  stream, and only a host read (the model's outputs, the gradients handed to the optimizer, buffer
  updates) waits on the host.
- `CudaDevice` (`device_cuda.py`) — a real GPU (`torch.cuda.Stream`/`Event`; compute and copy streams at the highest
  priority, upload next, download last; `record_stream` keeps freed memory from being reused while
  another stream still reads it; weights upload from pinned copies of the masters -- the
  user's tensors are never moved, pinned or replaced).
- `VirtualAsyncDevice` (`device_virtual_async.py`) — the CPU stand-in (`device="virtual-async"`): the same stream, event and
  slot-pool code on thread-backed streams with seeded random delays, an access sanitizer (a copy
  into a slot whose last use has not completed raises `RaceError`) and a log of the host's
  blocking waits (`waits`), so races, over-allocation and host syncs show up in CI.

All keep the same books (`mobius_fx.runtime.device_books.Device`): bytes held now and at peak, a budget that
raises `BudgetError` when exceeded, and a log of the bytes moved per kind and direction. What a
stage's work creates is charged per op on virtual devices (memory_books="ops") and measured by
CUDA's caching allocator per stage's work on `CudaDevice` ("allocator": no Python per op); either
device takes either setting (`Device.set_memory_books`, compile's `memory_books=`).

    dev = VirtualDevice("gpu0", budget=parse_bytes("64MiB"))
    slot = dev.new_slot(master, dtype=None, parameter=True)   # no storage yet
    dev.ready(dev.fill(0, [slot], [master], nbytes(slot)), [slot])
    dev.vacate(0, [slot], nbytes(slot))
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mobius_fx.errors import MobiusError
from mobius_fx.runtime import device_cuda, device_virtual, device_virtual_async  # noqa: F401 (importing registers the built-in kinds)
from mobius_fx.runtime.device_books import Device, check_memory_books
from mobius_fx.runtime.device_registry import device_class

__all__ = ["make_devices"]


def make_devices(budgets: Mapping[str, int | None], *, device: "str | Mapping[str, Device]" = "auto",
                 indices: Mapping[str, int] | None = None, seed: int = 0,
                 memory_books: str = "auto") -> dict[str, Device]:
    """One `Device` per GPU name. device: a registered kind -- "virtual", "virtual-async" (the CPU
    stand-in of the CUDA path: streams on threads with random delays, seeded by `seed` plus the
    GPU's position), "cuda", or one you registered (`register_device`) --, "auto" (CUDA when
    available), or your own `{gpu name: Device}` (it must name every GPU of `budgets`).

    `indices` maps a GPU name to its CUDA index (default: the order of `budgets`, modulo the
    number of CUDA devices, so a 4-GPU topology also runs on one real GPU). `memory_books`:
    how stage work is measured (`Device.set_memory_books`); "auto" leaves each device's default
    ("ops" on virtual devices, "allocator" on CUDA; your own Devices as they are).
    """
    check_memory_books(memory_books)
    if isinstance(device, Mapping):
        missing = sorted(set(budgets) - set(device))
        if missing:
            raise MobiusError(f"no Device given for GPU(s) {missing}; pass one Device per GPU name the stages use")
        out = {name: device[name] for name in budgets}
    else:
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "virtual"
        cls = device_class(device)
        reason = cls.unavailable()
        if reason is not None:  # a kind that cannot run here (CUDA without a GPU, a user's kind)
            raise MobiusError(f"device={device!r} but {reason}")
        out = cls.create(budgets, indices=indices, seed=seed)
    if memory_books != "auto":
        for dev in out.values():
            dev.set_memory_books(memory_books)
    return out
