"""The host's threads: one plan for how many threads each role of a pipeline runs on the CPU.

A training step of a Pipeline keeps several host threads busy at once:

- `main`: the thread that runs the pipeline (the training loop, autograd's backward, and on the
  CPU stand-ins -- `device="virtual"` and `"virtual-async"` -- the stages' compute itself), with
  its torch intra-op (OpenMP) team. On CUDA it issues kernels and copies: one core.
- `uploads`: one upload worker per streamed GPU (`StreamDevice`: CUDA and its stand-in); it waits
  for a slot's last use, then casts masters into the streamed copies and issues the copies. Each
  worker runs ops with 1 intra-op thread, and at most `upload_busy` of them copy at once
  (`copying()`, a host-wide semaphore); the rest of their time they wait on events.
- `optimizer`: the worker of `pipe.overlap(opt, mode)` that steps stages during backward ("sync")
  or the update one step late ("async"), with `optimizer` intra-op threads. 0: no worker -- the
  step runs inline on the pipeline's thread, at the same point of the step ("sync": right after
  the stage's last backward; "async": in `opt.step()`), with the same result.
- `grads`: 1 when the gradient hand-over of "sync" (adding each stage's downloaded gradients into
  `.grad`) has a worker of its own; 0 (the default): it runs on the optimizer's worker (or
  inline) -- by default inside the stage's step, span by span (`overlap.OverlapOptimizer._step_fused`), so
  a worker of its own would idle; `configure(grads=1)` gives one to the unfused hand-over
  (`opt.fuse = False`).

Every thread torch creates in a worker is an OpenMP team of its own: a worker left at torch's
default (every core) beside the pipeline's thread runs teams of `cores` threads each, and on a
host where those cores are already busy the teams' spin-waits take the cores from the thread on
the critical path. The plan therefore gives out cores, never more busy threads than there are
(`HostThreadPlan.busy <= cores`, `tests/unit/test_host_threads.py`):

    free        = max(1, round(cores - busy elsewhere))              (busy elsewhere: HostLoad; 0 unknown)
    main        = min(torch.get_num_threads(), free) when the stages compute on the host, else 1
    upload_busy = min(GPUs streamed, max(1, (free - main) // 2))    (0 without streamed GPUs)
    spare       = free - main - upload_busy
    grads       = 0                                                 (configure(grads=1): 1)
    optimizer   = spare - grads                                     (0: inline)

so on a 2-core machine running virtual GPUs (their compute is the same cores) the optimizer
steps inline and an overlap costs nothing over stepping after backward; on the 16-core H200 host
with one GPU: main 1, upload 1, grads 0, optimizer 14. The one exception to `busy <= cores` is a
streamed GPU with no core beside `main` (one core; or the CUDA stand-in with torch's threads on
every core): one upload worker must still copy, and shares a core with `main` (busy = cores + 1).

Torch's own thread counts belong to the plan too, while a pipeline runs (`steer`, called as each
step begins, on the pipeline's thread):

- intra-op: the pipeline thread's team is `main`, sized on the cores *free*: every `STEER_EVERY`
  seconds the plan reads how many cores other processes keep busy (`HostLoad`: /proc/stat for the
  CPUs of the affinity mask, less this process's own CPU time) and plans on
  `round(cores - busy elsewhere)` of them (at least one). An OpenMP team larger than the free cores
  waits at every parallel region's barrier for a member the kernel has descheduled (and spins
  while it waits): on 2 cores beside one busy process the main example took 2.7x as long; with a
  team that fits, about as long as alone (`benchmarks/contention.py`). Alone, the team is the
  intra-op count the user gave (`torch.set_num_threads`, read at the first step and whenever the
  user changes it between steps): no slower than before. `release()` puts the user's count back.
  The team's size decides how reductions split, so their last bits follow the host's load from
  step to step: for bit-for-bit repeatable runs pin it (`MOBIUS_HOST_THREADS="main=2"`, or
  `steer=0` with `torch.set_num_threads`); the test suite runs with `steer=0`.
- inter-op: `interop` (1): the pipeline's parallelism is its own threads; torch's inter-op pool
  (`torch.jit.fork`) is set to it once per process, when torch still allows it (before any
  inter-op work), else left as it is.

Override any field (for instance to give the optimizer a worker on a host that the plan would
step inline, or fewer cores than the affinity mask when other processes share the machine) with
`configure(optimizer=2, grads=0, cores=8, ...)` (`configure()` clears) or the environment:
`MOBIUS_HOST_THREADS="optimizer=2,grads=0"`. `steer=0` leaves torch's thread counts as they are
(the behaviour before the plan owned them: the pipeline's thread keeps the user's intra-op
count whatever else runs on the host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from mobius_fx.errors import MobiusError
from mobius_fx.runtime.device_books import Device

__all__ = ["HostThreadPlan", "plan", "plan_for", "configure", "cores", "worker", "start_thread", "copying",
           "size_uploads", "FIELDS", "HostLoad", "steer", "release", "STEER_EVERY"]

FIELDS = ("cores", "main", "upload_busy", "grads", "optimizer", "interop", "steer")
_LOW = {"cores": 1, "main": 1, "interop": 1}  # the least each field may be (the others: 0)
_log = logging.getLogger("mobius_fx")
_ENV = "MOBIUS_HOST_THREADS"
_overrides: dict[str, int] = {}


@dataclasses.dataclass(frozen=True)
class HostThreadPlan:
    """How many host threads each role runs (see the module docstring)."""

    cores: int  # the cores this process may run on
    main: int  # intra-op threads of the pipeline's thread counted busy
    uploads: int  # upload workers (one per streamed GPU), 1 intra-op thread each
    upload_busy: int  # of them, at most this many copy at once
    grads: int  # 1: the gradient hand-over has a worker of its own; 0: before each step, on its thread
    optimizer: int  # intra-op threads of the optimizer's worker; 0: no worker, stepped inline
    interop: int = 1  # torch's inter-op threads (set once per process, when torch allows)
    steer: int = 1  # 1: `steer` sets torch's counts to the plan's as steps begin; 0: leaves them as they are
    free: int = 0  # cores not kept busy by other processes when planned (0: not measured, all)

    @property
    def busy(self) -> int:
        """Threads the plan lets compute at once."""
        return self.main + self.upload_busy + self.grads + self.optimizer

    @property
    def inline(self) -> bool:
        """Whether pipe.overlap steps the optimizer on the pipeline's thread (no spare core)."""
        return self.optimizer == 0

    def describe(self) -> str:
        opt = "inline on the pipeline's thread" if self.inline else f"a worker with {self.optimizer} intra-op threads"
        free = f" ({self.free} free of other processes' work)" if self.free and self.free < self.cores else ""
        return (f"{self.cores} cores{free}: pipeline thread {self.main}, {self.uploads} upload workers ({self.upload_busy} "
                f"copying at once), optimizer {opt}, gradient hand-over "
                f"{'on a worker of its own' if self.grads else 'before each step, on the same thread'}")


def cores() -> int:
    """The cores this process may run on (its CPU affinity; the CPU count where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _parse_env() -> dict[str, int]:
    text = os.environ.get(_ENV, "").strip()
    out: dict[str, int] = {}
    if not text:
        return out
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        try:
            out[key] = int(value)
        except ValueError:
            out[key] = -1
        _check(key, out[key], f"{_ENV}={text!r}")
    return out


def _check(key: str, value: object, where: str) -> None:
    if key not in FIELDS:
        raise MobiusError(f"{where}: unknown host thread role {key!r}; the plan has {', '.join(FIELDS)} "
                          f"(e.g. {_ENV}=\"optimizer=2,grads=0\")")
    low = _LOW.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (key == "steer" and value > 1):
        raise MobiusError(f"{where}: {key}={value!r}; it must be an integer >= {low}"
                          + (" and <= 1 (0: leave torch's thread counts alone, 1: set them)" if key == "steer" else ""))


def configure(**overrides: int) -> None:
    """Override fields of every plan made from now on (`configure()` clears the overrides);
    the environment's `MOBIUS_HOST_THREADS` applies under these."""
    for k, v in overrides.items():
        _check(k, v, "host_threads.configure")
    _overrides.clear()
    _overrides.update(overrides)


def plan(gpus: int = 0, host_compute: bool = True, *, main: int | None = None, n_cores: int | None = None,
         busy_elsewhere: float = 0.0, **override: int) -> HostThreadPlan:
    """The plan for a pipeline with `gpus` streamed GPUs (upload workers), whose stages compute on
    the host (`host_compute`: the CPU stand-ins) or not (CUDA). `main`: the pipeline thread's
    intra-op threads (default `torch.get_num_threads()`); `n_cores`: default `cores()`;
    `busy_elsewhere`: cores other processes keep busy (`HostLoad.sample()`; the plan sizes the
    teams on the rest); `override`: fields given outright (after `configure()` and the environment)."""
    for k, v in override.items():
        _check(k, v, "host_threads.plan")
    given = {**_parse_env(), **_overrides, **override}
    c = given.get("cores", n_cores if n_cores is not None else cores())
    free = max(1, min(c, round(c - max(0.0, busy_elsewhere))))
    m = given.get("main", min(main if main is not None else torch.get_num_threads(), free) if host_compute else 1)
    up = given.get("upload_busy", min(gpus, max(1, (free - m) // 2)) if gpus else 0)
    spare = free - m - up
    g = given.get("grads", 0)  # the default hand-over runs inside the step (see the module docstring)
    opt = given.get("optimizer", max(0, spare - g))
    return HostThreadPlan(cores=c, main=m, uploads=gpus, upload_busy=up, grads=g, optimizer=opt,
                          interop=given.get("interop", 1), steer=given.get("steer", 1), free=free)


def _shape(devices: Iterable[Device]) -> tuple[int, bool]:
    devices = list(devices)
    streamed = sum(1 for d in devices if hasattr(d, "upload_stream"))
    host_compute = any(getattr(d, "kind", "") != "cuda" for d in devices) or not devices
    return streamed, host_compute


def plan_for(devices: Iterable[Device]) -> HostThreadPlan:
    """The plan for a pipeline running on these devices (`mobius_fx.runtime.devices`), on the
    cores other processes leave free (as the last `steer` measured them; all before any step)."""
    streamed, host_compute = _shape(devices)
    return plan(streamed, host_compute, main=_steering.ceiling, busy_elsewhere=_steering.elsewhere)


# ----------------------------------------------------------------------------- torch's counts, steered

STEER_EVERY = 1.0  # seconds between two looks at the host's load (`steer`)
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat cpuN: user nice system [idle iowait] irq softirq steal


class HostLoad:
    """How many cores other processes keep busy: the busy time of the CPUs this process may run on
    (/proc/stat) less this process's own CPU time, over the wall time since the last `sample()`.
    None where that cannot be read (not Linux) or on the first sample (nothing to compare)."""

    def __init__(self, stat: str = "/proc/stat") -> None:
        self.stat = stat
        self._last: tuple[float, float, float] | None = None
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _busy_seconds(self) -> float | None:
        try:
            allowed = {f"cpu{i}" for i in os.sched_getaffinity(0)}
            with open(self.stat) as f:
                busy = 0
                for line in f:
                    parts = line.split()
                    if parts and parts[0] in allowed:
                        busy += sum(int(parts[1 + i]) for i in _BUSY_FIELDS if 1 + i < len(parts))
            return busy / self._hz
        except (OSError, AttributeError, ValueError):
            return None

    def sample(self) -> float | None:
        busy = self._busy_seconds()
        if busy is None:
            return None
        now, mine = time.monotonic(), time.process_time()
        last, self._last = self._last, (now, busy, mine)
        if last is None or now - last[0] <= 0:
            return None
        return max(0.0, ((busy - last[1]) - (mine - last[2])) / (now - last[0]))


@dataclasses.dataclass
class _Steering:
    """The pipeline thread's torch counts as `steer` left them (one per process: torch's are)."""

    ceiling: int | None = None  # the user's intra-op count: read at the first step, and when the user changes it
    set_to: int | None = None  # what steer last set (torch.get_num_threads() differs: the user set another)
    elsewhere: float = 0.0  # cores busy elsewhere at the last look
    looked: float = -math.inf  # time.monotonic() of the last look
    interop_tried: bool = False
    load: HostLoad = dataclasses.field(default_factory=HostLoad)


_steering = _Steering()


def steer(devices: Iterable[Device], *, busy_elsewhere: float | None = None, now: float | None = None) -> HostThreadPlan:
    """Set the calling (pipeline) thread's torch intra-op count to the plan's `main` for the
    cores other processes leave free, looking at the host's load at most every `STEER_EVERY`
    seconds (`busy_elsewhere`: given instead of measured, for tests), and torch's inter-op count to
    `interop` once (when torch still allows it). The pipeline calls it as each step begins. With
    `steer=0` (configure, or MOBIUS_HOST_THREADS) it changes nothing."""
    st = _steering
    current = torch.get_num_threads()
    if st.set_to is None or current != st.set_to:
        st.ceiling = current  # the user's count (first step, or changed by the user since)
    streamed, host_compute = _shape(devices)
    if not plan(streamed, host_compute, main=st.ceiling).steer:  # torch's counts left alone, the load unread
        st.set_to, st.elsewhere = None, 0.0
        return plan(streamed, host_compute, main=st.ceiling)
    now = time.monotonic() if now is None else now
    if busy_elsewhere is not None:
        st.elsewhere, st.looked = busy_elsewhere, now
    elif now - st.looked >= STEER_EVERY:
        seen = st.load.sample()
        st.elsewhere, st.looked = (st.elsewhere if seen is None else seen), now
    p = plan(streamed, host_compute, main=st.ceiling, busy_elsewhere=st.elsewhere)
    if not st.interop_tried:
        st.interop_tried = True
        if torch.get_num_interop_threads() != p.interop:
            try:
                torch.set_num_interop_threads(p.interop)
            except RuntimeError as e:  # inter-op work has started (or it was set before): torch allows it once
                _log.debug("host threads: torch's inter-op threads left at %d (%s)", torch.get_num_interop_threads(), e)
    want = p.main if host_compute else current  # on CUDA the thread's host ops (the loss) keep the user's team
    if want != current:
        torch.set_num_threads(want)
    st.set_to = want
    return p


def release() -> None:
    """Put the calling thread's torch intra-op count back to the user's (what `steer` found at
    the first step); the next step steers it again. Inter-op threads cannot be set back."""
    st = _steering
    if st.set_to is not None and st.ceiling is not None and torch.get_num_threads() == st.set_to:
        torch.set_num_threads(st.ceiling)
    st.set_to = None


# ----------------------------------------------------------------------------- threads with a set team

def _team(threads: int) -> int:
    """In a new thread: set its intra-op (OpenMP team) threads."""
    torch.get_num_threads()  # ATen sizes a thread's team at its first parallel op: do it now
    torch.set_num_threads(threads)
    return threads


def _restore(default: int) -> None:
    # torch.set_num_threads in a thread sets that thread's OpenMP team size (a per-thread ICV)
    # and also the default each new thread starts with: put the default back, from the caller
    # (which keeps its own team size)
    torch.set_num_threads(default)


_start_lock = threading.Lock()


def worker(name: str, threads: int) -> ThreadPoolExecutor:
    """A one-thread executor named `name` whose thread runs torch ops with `threads` intra-op
    threads; the caller's, and those of threads started later, are left as they were."""
    with _start_lock:
        default = torch.get_num_threads()
        ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=_team, initargs=(threads,))
        try:
            ex.submit(int).result()  # start the thread now, and its initializer with it
        finally:
            _restore(default)
    return ex


def start_thread(target: Callable[..., object], args: tuple, name: str, threads: int = 1) -> threading.Thread:
    """Start a daemon thread running `target(*args)` with `threads` intra-op threads (as `worker`)."""
    started = threading.Event()

    def run() -> None:
        _team(threads)
        started.set()
        target(*args)

    with _start_lock:
        default = torch.get_num_threads()
        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        started.wait()
        _restore(default)
    return thread


# ----------------------------------------------------------------------------- the upload workers' copies

_copying = threading.BoundedSemaphore(1)


def size_uploads(gpus: int, host_compute: bool) -> HostThreadPlan:
    """Size the upload workers' semaphore (`copying`) for `gpus` streamed GPUs (make_devices)."""
    global _copying
    p = plan(gpus, host_compute)
    _copying = threading.BoundedSemaphore(max(1, p.upload_busy))
    return p


@contextlib.contextmanager
def copying() -> Iterator[None]:
    """An upload worker's host copies (the streamed copies of the masters): at most
    `upload_busy` workers at once."""
    sem = _copying
    with sem:
        yield
