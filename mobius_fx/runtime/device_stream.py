"""`StreamDevice`: the CUDA path's logic -- per pipeline GPU a compute, upload, download and copy
stream ordered by events, weights in a fixed pool of stage slots -- over a stream backend given
by a subclass (`CudaDevice`, `VirtualAsyncDevice`; see `mobius_fx.runtime.devices`)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mobius_fx.runtime import host_threads
from mobius_fx.runtime.device_books import Device, nbytes
from mobius_fx.runtime.device_common import SavedInput, check_unchanged
from mobius_fx.runtime.host_counters import COUNTERS, watch_optimizer_steps
from mobius_fx.runtime.streamed_copies import Entry, Event, StreamedCopies
from mobius_fx.runtime.streams import PENDING, HostWaits, SlotPool, layout, views


class StreamDevice(Device):
    """The CUDA path's logic -- streams, events, the slot pool, asynchronous copies -- over a
    stream backend (see the module docstring). Subclasses give the streams and events
    (`_event`), where slot regions live (`_region`), how one copy is issued on a stream
    (`_issue_copy`, `_copy_in`) and how a copy is differentiated (`_differentiable`).

    `waits` logs the issuing thread's blocking waits (streams.HostWaits); `slot_stats()` says
    how many slots the pool has and held at most at once."""

    align = 256  # a stage's tensors are packed into its slot at this alignment

    def __init__(self, name: str, budget: int | None, torch_device: torch.device) -> None:
        super().__init__(name, budget, torch_device)
        self.waits = HostWaits()
        self.races: list[str] = []  # what the stand-in's sanitizer saw (always empty on CUDA)
        self._sizes: list[int] = []
        self._pool: SlotPool | None = None
        self._defer: list | None = None  # the events of copies whose compute wait is deferred (`deferred`)
        self._empty: dict[int, torch.Tensor] = {}  # id(slot) -> its storage-less tensor (bound when not resident)
        self._slot_stats = {"slots": 0, "max_in_use": 0, "overflows": 0, "bytes": 0}
        # the upload worker: one intra-op thread; its copies share the plan's upload cores (host_threads)
        self._worker = host_threads.worker(f"mobius-upload-{name}", 1)
        self.compute_stream: Any = None
        self.upload_stream: Any = None
        self.download_stream: Any = None
        self.copy_stream: Any = None
        # The streamed copies of the masters the slots upload from (`_pinned_copy`), kept across
        # steps: the Runtime's store, shared by all its devices (one copy per master on the host;
        # mobius_fx/runtime/streamed_copies.py), or this device's own when it is used standalone.
        # `refresh` (the optimizer overlap) writes a stepped stage's new values right after its
        # step, so the next step's upload copies nothing; mode="async" keeps a second copy per
        # master there (`next_copy`, `swap_copy`).
        self._copies = StreamedCopies(private=True)
        # An unchanged (storage pointer, version) needs no new copy (`_pinned_copy`); False copies
        # every master at its first upload of every step (the behaviour before issue 27)
        self.trust_versions = True
        watch_optimizer_steps()
        self.pinned_copies = {"copies": 0, "bytes": 0, "refreshed_copies": 0, "refreshed_bytes": 0}

    # ------------------------------------------------------------------ backend
    def _event(self) -> Any:
        raise NotImplementedError

    def _region(self, n: int) -> torch.Tensor:
        """A new slot region of `n` bytes (uint8) on this GPU."""
        raise NotImplementedError

    def _issue_copy(self, stream: Any, value: torch.Tensor, device: torch.device, dtype: torch.dtype | None,
                    src_stream: Any = None) -> torch.Tensor:
        """A copy of `value` on `device` (cast to `dtype`), issued on `stream` (`src_stream`: the
        source GPU's stream, for a copy between two CUDA devices); the result is allocated now
        and written when the stream gets to it. A copy to the host lands in pinned memory."""
        raise NotImplementedError

    def _issue_widen(self, stream: Any, value: torch.Tensor, into: torch.Tensor,
                     addends: Sequence[torch.Tensor] = (), chunk: int = 0) -> None:
        """`value` (on this GPU) copied into the host tensor `into` (contiguous, `value`'s
        shape, a wider dtype, pinned on CUDA), converted on this GPU `chunk` elements at a time
        (with `addends`, host tensors: each chunk of theirs brought here and summed first,
        `widened_chunks`), issued on `stream`; written when the stream gets to it."""
        raise NotImplementedError

    def _copy_in(self, targets: list[torch.Tensor], sources: list[torch.Tensor], last: list[Any]) -> None:
        """Copy `sources` into the slot views `targets` on the upload stream (upload worker)."""
        raise NotImplementedError

    def _differentiable(self, value: torch.Tensor, there: Any, back: Any) -> torch.Tensor:
        """`there(value)`, differentiable: its gradient goes back by `back` (CUDA: torch's own)."""
        raise NotImplementedError

    def _used_by(self, t: torch.Tensor, stream: Any) -> None:
        """`t`'s memory is read or written on `stream`: not reused before that stream is done."""

    def _streams(self) -> tuple[Any, ...]:
        return tuple(s for s in (self.compute_stream, self.upload_stream, self.download_stream, self.copy_stream)
                     if s is not None)

    def check(self) -> None:
        """Raise the first error a stream's worker met (the stand-in's sanitizer, a failed copy)."""
        for s in self._streams():
            errors = getattr(s, "errors", None)
            if errors:
                raise errors[0]

    def new_step(self) -> None:
        self.waits.clear()  # the log covers the step now running (it would grow without end)
        if self._copies.private:  # a shared store counts the step once (the Runtime's begin_step)
            self._copies.new_step()

    # ------------------------------------------------------------------ the streamed copies of the masters
    @property
    def streamed_copies(self) -> StreamedCopies:
        """The store of the streamed copies this device uploads from (shared with the other
        devices of its Runtime)."""
        return self._copies

    def use_streamed_copies(self, copies: StreamedCopies) -> None:
        """Upload from `copies` from now on (the Runtime's, shared by its devices)."""
        self._copies = copies

    def _host_buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor the upload stream copies from (CUDA: pinned)."""
        return torch.empty(shape, dtype=dtype)

    def _pinned_copy(self, master: torch.Tensor, dtype: torch.dtype) -> tuple[Entry, torch.Tensor]:
        """The streamed copy of `master` in `dtype` (upload worker only; the caller uploads from
        it, then `StreamedCopies.release`s it), kept across steps and written again only when
        the master changed since it was last written: another storage (`p.data = ...`, a
        replaced parameter, async's swap) or another version (every in-place write through the
        tensor: optimizer steps -- the fused ones through `host_counters.watch_optimizer_steps`
        --, `load_state_dict`, `torch.no_grad()` edits). A write in place through `.data`
        (`p.data.mul_()`) is seen by neither: call `Pipeline.refresh_weights()` after one.
        Buffers are copied every step: modules update theirs in place unseen (BatchNorm's
        running statistics bump no version counter). Of the devices sharing the store, the one
        that writes a copy counts it (`pinned_copies`, the `pin` counter)."""
        entry, host, wrote = self._copies.take(master, dtype, self._host_buffer, self.trust_versions)
        if wrote:
            self.pinned_copies["copies"] += 1
            self.pinned_copies["bytes"] += nbytes(host)
            COUNTERS.add("pin", nbytes(master) + nbytes(host))
        return entry, host

    def forget_pinned_copies(self) -> None:
        """Every streamed copy is made again at its next upload (`Pipeline.refresh_weights`)."""
        self._copies.forget()

    def refresh(self, masters: Sequence[torch.Tensor]) -> None:
        """The optimizer stepped `masters` (pipe.overlap, on its worker, after a stage's last
        backward): write their new values into the streamed copies now (once every upload that
        read them is done), so the next step's uploads need no copy of their own. A copy already
        current -- written by the fused host pass in the step itself
        (`overlap.OverlapOptimizer._host_pass`), or by another device sharing the store -- is
        left as it is."""
        for m in masters:
            n = self._copies.refresh(m)
            if n:
                self.pinned_copies["refreshed_copies"] += 1
                self.pinned_copies["refreshed_bytes"] += n
                COUNTERS.add("refresh", nbytes(m) + n)

    def next_copy(self, master: torch.Tensor) -> torch.Tensor | None:
        """mode="async": the second streamed copy of `master` (None when it has no first one),
        once every upload that read it is done; the update in flight writes the new weights
        there while the running step uploads the old ones from the first (optimizer's worker)."""
        return self._copies.next_copy(master)

    def swap_copy(self, master: torch.Tensor, copy: torch.Tensor) -> None:
        """mode="async": the update that wrote `copy` (`next_copy`) landed -- `master` holds the
        new weights --: `copy` becomes the streamed copy the next uploads read, current for the
        master's (storage pointer, version) now, and the old one the spare."""
        self._copies.swap_copy(master, copy, self.trust_versions)

    def _sources(self, targets: list[torch.Tensor], masters: list[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], Callable[[Event | None], None]]:
        """The streamed copies to upload `masters` into `targets` from, and what to call with the
        upload's event once it is issued (None: it was not): every copy is released then."""
        taken: list[tuple[Entry, torch.Tensor]] = []

        def uploaded(event: Event | None) -> None:
            for entry, host in taken:
                self._copies.release(entry, host, self, event)

        try:
            for t, m in zip(targets, masters):
                taken.append(self._pinned_copy(m, t.dtype))
        except BaseException:
            uploaded(None)
            raise
        return [host for _, host in taken], uploaded

    # ------------------------------------------------------------------ slots
    def plan_slots(self, sizes: Sequence[int], *, exact: bool = False) -> list[int]:
        before = list(self._sizes)
        if exact:
            self._sizes = [int(b) for b in sizes]
            return before
        n = max(len(sizes), len(self._sizes))
        old = self._sizes + [0] * (n - len(self._sizes))
        new = list(sizes) + [0] * (n - len(sizes))
        self._sizes = [max(a, int(b)) for a, b in zip(old, new)]
        return before

    def slot_bytes(self, slots: Sequence[torch.Tensor]) -> int:
        return layout(slots, self.align)[1]

    def stats(self):
        out = super().stats()
        out["slot_pool_bytes"] = self.pool_bytes() or 0
        return out

    def slot_stats(self) -> dict[str, int]:
        """slots: the pool's slots; max_in_use: the most stages resident at once; overflows:
        slots added or grown beyond the plan; bytes: the pool's bytes (the largest it was)."""
        pool = self._pool
        out = dict(self._slot_stats)
        if pool is not None:
            out = {"slots": max(out["slots"], len(pool.regions)), "max_in_use": max(out["max_in_use"], pool.max_in_use),
                   "overflows": out["overflows"] + pool.overflows, "bytes": max(out["bytes"], pool.bytes)}
        return out

    def _open(self) -> SlotPool:
        if self._pool is None:
            sizes = list(self._sizes)
            self.alloc(sum(sizes), "the weight slots of its stages")
            try:
                self._pool = SlotPool(sizes, self._region)
            except BaseException:
                self.free(sum(sizes))
                raise
        return self._pool

    def open_pool(self):
        pool = self._pool
        if pool is not None and not pool.in_use and (len(pool.regions) < len(self._sizes) or any(
                r.bytes < n for r, n in zip(pool.regions, self._sizes))):
            self.close_pool()  # another pipeline on these devices planned larger slots: sized again, now
        self._open()

    def pool_bytes(self):
        return self._pool.bytes if self._pool is not None else None

    def close_pool(self):
        pool = self._pool
        if pool is None or pool.in_use:
            return False
        self._pool = None
        self._slot_stats = {"slots": max(self._slot_stats["slots"], len(pool.regions)),
                            "max_in_use": max(self._slot_stats["max_in_use"], pool.max_in_use),
                            "overflows": self._slot_stats["overflows"] + pool.overflows,
                            "bytes": max(self._slot_stats["bytes"], pool.bytes)}
        self.free(pool.bytes)
        return True

    def fill(self, stage, slots, masters, nbytes_, prefer=None):
        """Give stage `stage` a slot of the pool and upload its masters into it (see `SlotPool`):
        the upload worker waits for the slot's last use to end, then issues the copies on the
        upload stream after the same events; returns the token `ready` waits for."""
        slots, masters = list(slots), list(masters)
        pool = self._open()
        offsets, need = layout(slots, self.align)
        region = pool.take(stage, need, prefer, lambda n: self.alloc(n, f"stage {stage}'s weights (beyond the "
                                                                        f"slots the schedule planned)"))
        targets = views(region.tensor, slots, offsets)
        for s, v in zip(slots, targets):
            self._empty.setdefault(id(s), s.data)
            s.data = v
        last = list(region.last_use)

        def work() -> Any:
            for ev in last:  # the host may not refill a slot before its last use has ended
                ev.synchronize()
            with host_threads.copying():  # at most the plan's upload_busy workers copy at once
                sources, uploaded = self._sources(targets, masters)
            done = None
            try:
                for ev in last:
                    self.upload_stream.wait_event(ev)
                self._copy_in(targets, sources, last)
                done = self._event()
                done.record(self.upload_stream)
                region.filled = done
            finally:
                uploaded(done)  # the copies may be written again once `done` is (never before this)
            return done

        self.log.add("weight", "h2d", sum(nbytes(s) for s in slots), len(slots))
        return self._worker.submit(work)

    def ready(self, token, slots):
        if token is None:
            return
        if not token.done():
            self.waits.add("flow", "a stage's upload to be issued (after its slot's last use)")
        done = token.result()
        self.compute_stream.wait_event(done)
        self.check()

    def cancel(self, token):
        if token is not None:
            try:
                token.result()
            except BaseException:  # the upload's own error was reported where it was awaited
                pass

    def vacate(self, stage, slots, nbytes_):
        """Unbind the stage's slot views and give its slot back; its last use is what the
        compute and download streams have been given so far (a refill waits for both)."""
        for s in slots:
            empty = self._empty.get(id(s))
            if empty is not None:
                s.data = empty
        pool = self._pool
        if pool is None or stage not in pool.by_stage:
            return
        used = self._event()
        used.record(self.compute_stream)
        read = self._event()
        read.record(self.download_stream)
        pool.give_back(stage, [used, read])

    def _region_of(self, t: torch.Tensor) -> Any:
        """The pool slot `t` lives in (a view of a stage's weights), or None."""
        if self._pool is None:
            return None
        ptr = t.untyped_storage().data_ptr()
        if not ptr:  # no bytes: nothing to order
            return None
        return next((r for r in self._pool.regions if r.tensor.untyped_storage().data_ptr() == ptr), None)

    def _read_on(self, region: Any, stream: Any) -> None:
        """`region` (one of this GPU's slots) is read on `stream`: its refill waits for that too."""
        ev = self._event()
        ev.record(stream)
        region.reads.append(ev)

    # ------------------------------------------------------------------ activations
    def _receive_raw(self, value: torch.Tensor, src: "StreamDevice | None", dtype: torch.dtype | None) -> torch.Tensor:
        """`value` from `src` (None: the host) onto this GPU, on its copy stream: after the
        source's compute (another GPU) or the host buffer's event (a pending host copy); this
        GPU's compute waits for the copy on its stream, not on the host."""
        if src is None:
            pending = PENDING.event(value)
            if pending is not None:
                self.copy_stream.wait_event(pending)
            out = self._issue_copy(self.copy_stream, value, self.torch_device, dtype)
        else:
            made = src._event()
            made.record(src.compute_stream)
            self.copy_stream.wait_event(made)
            cross = src.torch_device != self.torch_device
            if cross:
                src.copy_stream.wait_event(made)
            reader = src.copy_stream if cross else self.copy_stream
            out = self._issue_copy(self.copy_stream, value, self.torch_device, dtype,
                                   src.copy_stream if cross else None)
            self._used_by(value, reader)
            region = src._region_of(value)
            if region is not None:  # a view of the source's weights (a stage output that is a slice of one)
                src._read_on(region, reader)
        done = self._event()
        done.record(self.copy_stream)
        if self._defer is not None:  # deferred(): compute waits when the result is used (join)
            self._defer.append(done)
        else:
            self.compute_stream.wait_event(done)
        self._used_by(out, self.compute_stream)
        return out

    @contextlib.contextmanager
    def deferred(self):
        outer, self._defer = self._defer, []
        try:
            yield self._defer
        finally:
            self._defer = outer

    def join(self, events):
        for ev in events:
            self.compute_stream.wait_event(ev)

    def _to_host_raw(self, value: torch.Tensor, into: torch.Tensor | None = None,
                     addends: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, Any]:
        """`value` into a pinned host buffer on the download stream, after the compute that made
        it (`into`: into that host tensor, widened on this GPU, summed with the host tensors
        `addends` first); the buffer is pending (streams.PENDING) until the returned event."""
        made = self._event()
        made.record(self.compute_stream)
        self.download_stream.wait_event(made)
        if into is not None:
            per = self.widen_bytes(into, value, addends)
            chunk = self.widen_chunk(value.numel(), per) if per else 0
            n = chunk * per
            self.alloc(n, "a downloaded gradient widened on the GPU")  # booked while issued (stream-ordered after)
            try:
                self._issue_widen(self.download_stream, value, into, tuple(addends), chunk)
            finally:
                self.free(n)
            host = into
        else:
            host = self._issue_copy(self.download_stream, value, torch.device("cpu"), None)
        self._used_by(value, self.download_stream)
        done = self._event()
        done.record(self.download_stream)
        PENDING.add(host, done, self.waits)
        return host, done

    def grad_onto(self, grad: torch.Tensor, frm: "Device | None", dtype: torch.dtype) -> torch.Tensor:
        return self._grad_back(grad, frm, dtype)

    def grad_to_host(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._grad_to_host(grad, dtype)

    def _grad_back(self, grad: torch.Tensor, frm: "StreamDevice | None", dtype: torch.dtype) -> torch.Tensor:
        """The gradient of a copy onto `frm` (None: the host), back onto this GPU."""
        out = self._receive_raw(grad, frm, dtype if dtype != grad.dtype else None)
        self.track(out, "gradient")
        return out

    def _grad_to_host(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The gradient of a copy from the host, back to the host: autograd sums it there, so
        the host waits for it (a blocking copy, logged)."""
        host, _ = self._to_host_raw(grad)
        PENDING.settle(host, "the gradient of a value sent from the host")
        return host if host.dtype == dtype else host.to(dtype)

    def receive(self, value, src, dtype=None, kind="activation"):
        assert src is None or isinstance(src, StreamDevice)
        orig = value.dtype

        def there(v: torch.Tensor) -> torch.Tensor:
            return self._receive_raw(v, src, dtype)

        def back(g: torch.Tensor) -> torch.Tensor:
            return src._grad_back(g, self, orig) if src is not None else self._grad_to_host(g, orig)

        out = self._differentiable(value, there, back)
        self.log.add(kind, "h2d" if src is None else "d2d", nbytes(out))
        return out

    def to_host(self, value):
        orig = value.dtype
        out = self._differentiable(value, lambda v: self._to_host_raw(v)[0], lambda g: self._grad_back(g, None, orig))
        self.log.add("activation", "d2h", nbytes(out))
        return out

    def offload(self, t):
        # The input, while it lives, tells whether it was changed in place before backward: an
        # error, as in eager checkpointing.
        with self.untracked():
            host, done = self._to_host_raw(t.detach())
        self.log.add("input", "d2h", nbytes(t))
        return SavedInput(host, (done, weakref.ref(t), t._version))

    def restore(self, saved):
        check_unchanged(self.name, *saved.event[1:])
        out = self._receive_raw(saved.host, None, None)  # waits for the offload's event on the copy stream
        self.log.add("input", "h2d", nbytes(out))
        return out

    def download(self, t, kind, into=None, addends=()):
        host, _ = self._to_host_raw(t.detach(), into, [a.detach() for a in addends])
        self.log.add(kind, "d2h", nbytes(host))

        def wait() -> torch.Tensor:
            PENDING.settle(host, kind)
            self.check()
            return host

        return wait

    def fetch(self, t):
        """A small value the runtime reads on the host (a stage's gradient finiteness flag), on
        the download stream after the compute that made it; not a transfer of the plan, so not
        logged. The thunk waits for it."""
        with self.untracked():
            host, _ = self._to_host_raw(t.detach())

        def wait() -> bool:
            PENDING.settle(host, "flag")
            self.check()
            return bool(host)

        return wait

    def synchronize(self):
        for s in self._streams():
            s.synchronize()
        self.check()
