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
  inline) -- by default inside the stage's step, span by span (`overlap_fused.FusedStep._step_fused`), so
  a worker of its own would idle; `configure(grads=1)` gives one to the unfused hand-over
  (`opt.fuse = False`).

Every thread torch creates in a worker is an OpenMP team of its own: a worker left at torch's
default (every core) beside the pipeline's thread runs teams of `cores` threads each, and on a
host where those cores are already busy the teams' spin-waits take the cores from the thread on
the critical path. The plan therefore gives out cores, never more busy threads than there are
(`HostThreadPlan.busy <= cores`, `tests/unit/test_host_threads.py`):

    main        = min(torch.get_num_threads(), cores) when the stages compute on the host, else 1
    upload_busy = min(GPUs streamed, max(1, (cores - main) // 2))   (0 without streamed GPUs)
    spare       = cores - main - upload_busy
    grads       = 0                                                 (configure(grads=1): 1)
    optimizer   = spare - grads                                     (0: inline)

so on a 2-core machine running virtual GPUs (their compute is the same cores) the optimizer
steps inline and an overlap costs nothing over stepping after backward; on the 16-core H200 host
with one GPU: main 1, upload 1, grads 0, optimizer 14. The one exception to `busy <= cores` is a
streamed GPU with no core beside `main` (one core; or the CUDA stand-in with torch's threads on
every core): one upload worker must still copy, and shares a core with `main` (busy = cores + 1).

Override any field (for instance to give the optimizer a worker on a host that the plan would
step inline, or fewer cores than the affinity mask when other processes share the machine) with
`configure(optimizer=2, grads=0, cores=8, ...)` (`configure()` clears) or the environment:
`MOBIUS_HOST_THREADS="optimizer=2,grads=0"`. The pipeline's own thread keeps the intra-op
threads the user gave it (`torch.set_num_threads`); the plan reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from mobius_fx.errors import MobiusError

__all__ = ["HostThreadPlan", "plan", "plan_for", "configure", "cores", "worker", "start_thread", "copying",
           "size_uploads", "FIELDS"]

FIELDS = ("cores", "main", "upload_busy", "grads", "optimizer")
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
        return (f"{self.cores} cores: pipeline thread {self.main}, {self.uploads} upload workers ({self.upload_busy} "
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


def _check(key: str, value: Any, where: str) -> None:
    if key not in FIELDS:
        raise MobiusError(f"{where}: unknown host thread role {key!r}; the plan has {', '.join(FIELDS)} "
                          f"(e.g. {_ENV}=\"optimizer=2,grads=0\")")
    low = 1 if key in ("cores", "main") else 0
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise MobiusError(f"{where}: {key}={value!r}; it must be an integer >= {low}")


def configure(**overrides: int) -> None:
    """Override fields of every plan made from now on (`configure()` clears the overrides);
    the environment's `MOBIUS_HOST_THREADS` applies under these."""
    for k, v in overrides.items():
        _check(k, v, "host_threads.configure")
    _overrides.clear()
    _overrides.update(overrides)


def plan(gpus: int = 0, host_compute: bool = True, *, main: int | None = None, n_cores: int | None = None,
         **override: int) -> HostThreadPlan:
    """The plan for a pipeline with `gpus` streamed GPUs (upload workers), whose stages compute on
    the host (`host_compute`: the CPU stand-ins) or not (CUDA). `main`: the pipeline thread's
    intra-op threads (default `torch.get_num_threads()`); `n_cores`: default `cores()`;
    `override`: fields given outright (after `configure()` and the environment)."""
    for k, v in override.items():
        _check(k, v, "host_threads.plan")
    given = {**_parse_env(), **_overrides, **override}
    c = given.get("cores", n_cores if n_cores is not None else cores())
    m = given.get("main", min(main if main is not None else torch.get_num_threads(), c) if host_compute else 1)
    up = given.get("upload_busy", min(gpus, max(1, (c - m) // 2)) if gpus else 0)
    spare = c - m - up
    g = given.get("grads", 0)  # the default hand-over runs inside the step (see the module docstring)
    opt = given.get("optimizer", max(0, spare - g))
    return HostThreadPlan(cores=c, main=m, uploads=gpus, upload_busy=up, grads=g, optimizer=opt)


def plan_for(devices: Iterable[Any]) -> HostThreadPlan:
    """The plan for a pipeline running on these devices (`mobius_fx.runtime.devices`)."""
    devices = list(devices)
    streamed = sum(1 for d in devices if hasattr(d, "upload_stream"))
    host_compute = any(getattr(d, "kind", "") != "cuda" for d in devices) or not devices
    return plan(streamed, host_compute)


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


def start_thread(target: Callable[..., Any], args: tuple, name: str, threads: int = 1) -> threading.Thread:
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
