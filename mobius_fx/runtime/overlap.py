"""The optimizer off the critical path: `Pipeline.overlap(opt, mode=...)`.

The optimizer is the user's `torch.optim` optimizer over the CPU master weights. Stepped after
backward, it is a serial term of every step (the single biggest one for multi-billion-parameter
models, `benchmarks/cpu_optimizer.py`). `pipe.overlap(opt, mode)` returns an `OverlapOptimizer`
that the training loop keeps using in its place (`step`, `zero_grad`, `state_dict`,
`load_state_dict`, `param_groups`, LR schedulers, `GradScaler`):

- `mode="sync"` — exact. During `loss.backward()`, as soon as a stage's gradients are complete
  in host memory (its last micro-batch's backward downloaded; a tied parameter once every stage
  holding a copy has been), a CPU worker adds them into `.grad` and steps that stage's
  parameters while the GPUs go on with earlier stages; `opt.step()` waits for the rest and steps
  whatever backward left (parameters outside the pipeline, ones with gradient hooks). Every
  parameter gets the same update as a serial `opt.step()` after backward, bit for bit: the
  optimizers of torch update each parameter from its own gradient and state
  (`PER_PARAMETER`; any other optimizer -- LBFGS, one whose step reads every
  gradient -- is stepped serially, whole, at opt.step(), said once in the log). Step pre- and
  post-hooks (the optimizer's and torch's global ones) run once per opt.step().

  What needs every gradient before any update cannot be stepped during backward for good:
  `clip_grad_norm_` over all parameters, fp16 `GradScaler.unscale_`'s inf check, several backward
  passes per step (gradient accumulation), a step pre-hook. The first step after `overlap()`
  therefore runs serially and watches the loop. If gradients change between the end of backward
  and `opt.step()` (a clip), a GradScaler steps the optimizer, or a step pre-hook is registered, in
  a bf16/fp16 pipeline whose optimizer the fused host pass steps, the stages are stepped
  SPECULATIVELY from then on (`_speculate`, said once in the log): during backward, out of place
  (new master, moments and streamed copy into spare buffers; the model and `opt.state` keep the old
  ones; a GradScaler's loss: the download times the fp32 inverse of the scale the loss was
  multiplied by, as its unscale_ computes it, `_scale_now`), and opt.step() -- after the pre-hooks
  -- commits each parameter by pointer swaps where its final `.grad` is bit for bit what the pass
  read (a clip factor of 1.0), else drops the new buffers and steps it with torch's own step from
  the final gradient -- serial's bits either way (`opt.speculate = False`: the deferral below
  instead). A step the scaler skips (inf found) drops the speculation at the next backward. If two
  backward passes come before one step, or speculation cannot run,
  the update waits for opt.step() from then on (with a pre-hook, from the first step), said once in the log
  (`logging.getLogger("mobius_fx")`): gradients are still handed over into `.grad` during
  backward, the loop's code runs on the final ones, and opt.step() steps what it leaves --
  serial's bits (docs/overlap_semantics.md). A loop that changes its shape later (clipping switched
  on after a warm-up) is caught at `opt.step()` with a `MobiusError`: in sync mode those stages
  were already stepped with the gradients backward produced. `torch.autograd.grad` and
  `backward(inputs=...)` only overlap for the tensors they accumulate into `.grad`.
  While backward runs, `.grad` and weights are in flux; once `loss.backward()` returns, every
  `.grad` is final (read or log them freely), weights are final after `opt.step()`.
  On CUDA (and its stand-in, `device="virtual-async"`) the stage's step also writes the new
  weights into the streamed (pinned, half-precision when `dtype=` says so) copy the next step
  uploads from (`refresh_copies=True`, the default), on the optimizer's worker, so the next step
  makes no copy-and-cast pass over them. Weights it does not step (frozen ones: a LoRA model's
  base) are copied at their first upload and again only when their storage or version changes
  (`StreamDevice._pinned_copy`); after a write in place through `.data` (`p.data.clamp_()`), which
  neither changes, call `pipe.refresh_weights()`.
  A forward between `loss.backward()` and `opt.step()` is refused once stages were stepped
  (it would see some stages' new weights and others' old ones).
  The hand-over makes no host pass of its own: whether a stage's gradients are all finite is
  computed on its GPU before they are downloaded (`host_gradients.finite_flag`; a loop may skip the
  step on a non-finite loss, so no stage is stepped from a non-finite gradient: from the first,
  the rest is left to `opt.step()`), and a gradient to convert (bf16 download, fp32 master) is
  converted into `.grad` -- storage kept across steps -- inside the stage's step, span by span,
  each span right before the optimizer's own step runs over views of that span of the
  parameter, gradient and state (`_step_fused`: Adam, AdamW and SGD, whose updates are
  elementwise; other optimizers convert whole gradients first). `loss.backward()` returns when
  the stages it stepped are done: every `.grad` is final then.

- `mode="async"` — RoundPipe's staleness-1 update. `opt.step()` hands step t's gradients to a
  CPU worker and returns at once; step t+1's forward and backward run on the weights of step t
  (one update old) while the worker computes w(t+1) = update(w(t), g(t)) into a shadow copy, which
  becomes the model's weights at the next `opt.step()` (a pointer swap). So
  w(t+1) = update(w(t), grad at w(t-1)). Not the serial trajectory: a trade-off the user opts
  into for the optimizer's time. Costs one more fp32 copy of the trainable weights (the shadow)
  and holds one step's gradients while the next accumulates (double buffer). After `opt.step()`
  `.grad` shows the gradients that step uses, as in eager; a loop without `zero_grad` accumulates
  onto them, as eager does. `opt.synchronize()` (also called by `state_dict`, `load_state_dict`,
  `add_param_group`, `Pipeline.overlap` of another optimizer, and -- through hooks on the model
  -- by `model.state_dict()` of any of its modules and an eager call `model(x)`) waits for the
  update in flight and puts it in the model: so `{"model": model.state_dict(), "opt":
  opt.state_dict()}` is one consistent checkpoint. Reading a parameter directly (`p.detach()`)
  sees the weights the pipeline runs on; call `opt.synchronize()` first for the newest. Clipping and `GradScaler` work as in a serial loop (they act before
  `opt.step()`, on the gradients the update then uses).

- `mode="none"` returns `opt` itself: stepped serially after backward.

`OverlapOptimizer` is one class, in this module, in sections: the wrapped optimizer's face and the
loop's side (`step`, `zero_grad`, `state_dict`, ...); what the runtime calls during forward and
backward (the hand-over: `before_forward`, `backward_started`, `ready`, `backward_done`, ...);
sync's fused step of a stage (`_step_fused`, `_chunks`, `_host_pass`); mode="async"'s update
(`take`, `_step_async`, `_finish_flight`). Above it, what it watches the loop and autograd with
(`WeakHook`, `accumulator`, `fingerprint`, `per_parameter`, `pre_hooks`, ...) and the host pass's
switches (`HOST_PASS`, `SPAN`, `UNIT`).

The fused step (sync). A stage's parameters whose optimizer the host pass knows (torch's Adam,
AdamW, SGD: `host_optimizer.kind_of`) are stepped by it, one parameter per call, in ONE pass over
host memory: it reads the downloaded half-precision gradient, updates the fp32 master and torch's
own state, and writes the fp32 `.grad` (its home, kept across steps) and the streamed copy the
next upload reads (the one copy every GPU uploads from: `streamed_copies.StreamedCopies`), so no refresh pass follows for them (`_host_pass`;
`HOST_PASS = False` or `MOBIUS_FX_HOST_PASS=0` turns it off; where it cannot be built, the log
says so once and the path below runs). The others: the downloaded gradients converted into
`.grad` span by span, each span right before the wrapped optimizer's own step runs over views of
that span of the parameter, gradient and state (Adam, AdamW and SGD, whose updates are
elementwise).

The async update: RoundPipe's staleness-1 update computed into shadow copies of the weights on
the optimizer's worker while the next step runs on the old ones, by the same host pass where it
knows the optimizer (docs/host_optimizer.md), swapped in at the next `opt.step()` or when the
model is read (hooks on the model).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import weakref
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch import nn

from mobius_fx.errors import MobiusError
from mobius_fx.kinds import OVERLAP_MODES
from mobius_fx.runtime import host_optimizer, host_threads
from mobius_fx.runtime.device_books import nbytes
from mobius_fx.runtime.host_counters import COUNTERS
from mobius_fx.runtime.host_gradients import GradHomes, convert_span, is_home, sum_downloads
from mobius_fx.runtime.streamed_copies import Entry, StreamedCopies

__all__ = ["OverlapOptimizer", "HOST_PASS", "ALIGN", "UNIT", "SPAN_UNITS", "SPAN", "WeakHook", "accumulator",
           "WIDEN_DOWNLOADS", "engine_accumulates", "has_grad_hooks", "fingerprint", "partition_owners",
           "hyper_params", "same_hyper", "called_by_grad_scaler", "grad_scaler_calling", "PER_PARAMETER",
           "per_parameter", "raw_step", "pre_hooks", "post_hooks",
           "stepped_masters"]

log = logging.getLogger("mobius_fx")

# ------------------------------------------------------------------ the host pass's switches
# Whether sync's stage step uses the fused host pass (`host_optimizer`) where it can.
HOST_PASS = os.environ.get("MOBIUS_FX_HOST_PASS", "1") != "0"
# The default of `OverlapOptimizer.widen_downloads`: the gradients handed over into the fp32 `.grad`
# are widened on the GPUs and downloaded straight into it (`Runtime.widens_gradients`).
WIDEN_DOWNLOADS = os.environ.get("MOBIUS_FX_WIDEN_DOWNLOADS", "1") != "0"
ALIGN = 64  # bytes: every tensor the compiled pass reads or writes starts at this alignment


# The optimizers whose step `_step_fused` runs span by span: each element is updated from its own
# gradient and state, and from per-parameter scalars (Adam's `step`) the same for every span.
# Exact classes (a subclass may change the update); the kind says when a parameter's state is made.
_CHUNKED = {torch.optim.Adam: "adam", torch.optim.AdamW: "adam", torch.optim.SGD: "sgd"}

# Spans of `_step_fused`. torch's fused CPU optimizers (`fused=True`) step a tensor in units of
# UNIT elements, one thread per unit, vectorised with a scalar tail only at the tensor's end (whose
# bits differ from the vector path's): spans of whole units split it the same way. Its other
# implementations are TensorIterator loops whose elements get the same bits wherever they fall.
# A span gives each of the worker's threads SPAN_UNITS units: for each thread the fp32 parameter,
# gradient and moments of its share (1 MiB) and the half-precision download stay in its core's
# cache between the conversion and the step, and every thread works, as on a whole tensor.
UNIT = 32768
SPAN_UNITS = 2
SPAN: int | None = None  # elements per span; None: UNIT * SPAN_UNITS * the worker's threads


def _summed(master: torch.Tensor, downloads: list[torch.Tensor], homes: GradHomes | None) -> torch.Tensor | None:
    """`sum_downloads(master, downloads, homes)` into a fresh `.grad`, a tied master's two 16-bit
    downloads in ONE pass (`host_optimizer.sum_two`: read both, write the fp32 home; the same bits):
    8 B per bf16 parameter instead of `sum_downloads`' 16 (its copy, then its addition)."""
    if (len(downloads) == 2 and homes is not None and master.dtype == torch.float32 and master.is_contiguous()
            and downloads[0].dtype != master.dtype and all(g.shape == master.shape and g.device == master.device
                                                            and not g.is_sparse for g in downloads)):
        home = homes.take(master)
        if host_optimizer.sum_two(home, downloads[0], downloads[1]):
            COUNTERS.add("grad_convert", sum(nbytes(g) for g in downloads) + nbytes(home))
            return home
        del home  # not taken: sum_downloads takes it again (a home held here would look kept)
    return sum_downloads(master, downloads, homes)


def _span() -> int:
    return SPAN if SPAN is not None else UNIT * SPAN_UNITS * max(1, torch.get_num_threads())


def _raw_step(cls: type) -> Callable[[Any], Any] | None:
    """`cls.step` without torch's wrappers (the step hooks, the grad-mode switch): `_step_fused`
    runs no step hook (opt.step() runs them once) and calls this once per span, under no_grad."""
    step = getattr(cls, "step", None) if cls in _CHUNKED else None
    if step is None or not getattr(step, "hooked", False):
        return None
    raw = inspect.unwrap(step)
    return raw if raw is not step else None


# ------------------------------------------------------------------ what the overlap watches
# The optimizers the sync overlap steps stage by stage, during backward: torch's own, whose step
# updates each parameter from its own gradient, its own state and the group's hyper-parameters
# (scalars the same for every parameter), so stepping the parameters in several calls gives the
# bits of one call. Matched by the step function the optimizer's class runs (a subclass that
# keeps its parent's step is one of them; one that overrides step is not). Every other optimizer
# -- LBFGS, which re-evaluates the loss over all parameters, or one whose step reads all
# gradients (a global norm, a trust ratio over the model) -- is stepped whole at opt.step(),
# serially, said once in the log (`OverlapOptimizer.__init__`): never silently differently.
PER_PARAMETER: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in ("Adam", "AdamW", "SGD", "Adagrad", "Adamax", "NAdam", "RAdam",
                                            "RMSprop", "Adadelta", "ASGD", "Rprop", "Adafactor")
    if hasattr(torch.optim, name))


class WeakHook:
    """A hook that calls `method` of an overlap held weakly, and nothing once it is gone. Copying
    or pickling the model it hangs on (`copy.deepcopy(model)` for a best-model copy,
    `torch.save(model)`) gives an inert hook: the copy is not the overlap's."""

    def __init__(self, owner: object, method: str, *args: object) -> None:
        self._ref = weakref.ref(owner) if owner is not None else None
        self._method, self._args = method, args

    def __call__(self, *a: object) -> Any:
        owner = self._ref() if self._ref is not None else None
        if owner is not None:
            return getattr(owner, self._method)(*self._args, *a)
        return None

    def __deepcopy__(self, memo: dict) -> "WeakHook":
        return WeakHook(None, self._method)

    def __reduce__(self) -> tuple:
        return (WeakHook, (None, self._method))


def accumulator(p: torch.Tensor) -> Any:
    """The AccumulateGrad node autograd runs for leaf `p` (kept alive by the caller)."""
    with torch.enable_grad():  # called inside backward, where grad mode is off
        return p.view_as(p).grad_fn.next_functions[0][0]


def engine_accumulates(node: torch.autograd.graph.Node) -> bool:
    """True when the backward pass running now will accumulate into this leaf's `.grad`:
    `loss.backward()` and `backward(inputs=[... p ...])` do; `torch.autograd.grad` does not (torch
    refuses to answer for leaves there, which means no)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


def has_grad_hooks(p: torch.Tensor) -> bool:
    return bool(getattr(p, "_backward_hooks", None)) or bool(getattr(p, "_post_accumulate_grad_hooks", None))


def fingerprint(g: torch.Tensor) -> int:
    """A checksum of `g`'s bits, for the first step's watch: some in-place kernels
    (GradScaler's unscale) do not bump the version counter."""
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(g.element_size())
    if bits is None or g.is_sparse:
        return g._version
    return int(g.detach().contiguous().view(bits).sum(dtype=torch.int64))


def partition_owners(params: list[torch.Tensor], world: int) -> dict[int, int]:
    """shard=True: which rank steps each parameter (trainable ones), balancing bytes greedily in
    the optimizer's order, the same on every rank."""
    load = [0] * world
    owners: dict[int, int] = {}
    for p in params:
        if p.requires_grad and id(p) not in owners:
            r = min(range(world), key=lambda i: (load[i], i))
            owners[id(p)] = r
            load[r] += p.numel() * p.element_size()
    return owners


def hyper_params(groups: list[dict]) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def same_hyper(a: list[dict], b: list[dict]) -> bool:
    def same(x: object, y: object) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        return x == y
    return len(a) == len(b) and all(g.keys() == h.keys() and all(same(g[k], h[k]) for k in g) for g, h in zip(a, b))


def called_by_grad_scaler() -> bool:
    """Whether opt.step() was called by torch.amp.GradScaler.step (directly or through an LR
    scheduler's wrapper of step)."""
    return grad_scaler_calling(3) is not None


def grad_scaler_calling(depth: int = 2) -> torch.amp.GradScaler | None:
    """The torch.amp.GradScaler whose `step` called opt.step() (directly or through an LR scheduler's
    wrapper of step), or None: the `self` of the nearest grad_scaler.py frame above the caller of the
    function that calls this (`depth` frames up). The sync overlap reads the scale a speculative
    step unscales by from it (`OverlapOptimizer._round_scale`)."""
    frame = sys._getframe(depth)
    for _ in range(4):
        if frame is None:
            return None
        if frame.f_code.co_filename.endswith("grad_scaler.py"):
            scaler = frame.f_locals.get("self")
            return scaler if isinstance(scaler, torch.amp.GradScaler) else None
        frame = frame.f_back
    return None


def per_parameter(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt`'s step is one of `PER_PARAMETER`'s (the sync overlap may split it by stage)."""
    step = raw_step(type(opt))
    return any(step is raw_step(cls) for cls in PER_PARAMETER)


def raw_step(cls: type) -> Any:
    """`cls.step` without torch's hook wrapper (`Optimizer.profile_hook_step`): the overlap runs
    the step hooks itself, once per `opt.step()`, however many calls the update takes."""
    step = cls.step
    return step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else step


def stepped_masters(sub: torch.optim.Optimizer) -> None:
    """What `host_counters.watch_optimizer_steps`' global post-hook does after a step, done by the
    overlap after each of its own calls of the step (`raw_step`, which runs no hook): the pipeline
    masters it stepped get a new version, before their streamed copies are refreshed."""
    from mobius_fx.runtime.host_counters import masters_stepped
    masters_stepped(sub, (), {})


def pre_hooks(opt: torch.optim.Optimizer) -> list:
    """The step pre-hooks torch would run before `opt.step()`: the global ones, then opt's."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks
    return [*_global_optimizer_pre_hooks.values(), *opt._optimizer_step_pre_hooks.values()]


def post_hooks(opt: torch.optim.Optimizer) -> list:
    """The step post-hooks torch would run after `opt.step()`: opt's, then the global ones (but
    the pipeline's own, which the overlap runs after each of its calls: `stepped_masters`)."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    from mobius_fx.runtime.host_counters import masters_stepped
    return [*opt._optimizer_step_post_hooks.values(), *(h for h in _global_optimizer_post_hooks.values()
                                                        if h is not masters_stepped)]


def _user_grad_hooks(p: torch.Tensor) -> bool:
    """Whether `p` has a gradient hook other than async's own (`_arriving`): autograd must run it."""
    hooks = getattr(p, "_backward_hooks", None) or {}
    if any(not (isinstance(h, WeakHook) and h._method == "_arriving") for h in hooks.values()):
        return True
    return bool(getattr(p, "_post_accumulate_grad_hooks", None))


def _inner(name: str) -> property:
    """An attribute of the OverlapOptimizer that is its wrapped optimizer's."""
    return property(lambda self: getattr(self.inner, name), lambda self, v: setattr(self.inner, name, v))


def _checked(pipeline: Any, optimizer: torch.optim.Optimizer, mode: str, shard: bool) -> Any:
    """The overlap's arguments refused with the reason and the remedy; the data-parallel reducer
    that shard=True divides the optimizer over (None without shard)."""
    if mode == "none" or mode not in OVERLAP_MODES:
        raise MobiusError(f"overlap mode={mode!r}; use 'sync' (exact: stages stepped during backward), 'async' "
                          f"(staleness 1, as RoundPipe) or 'none' (serial, after backward)")
    if isinstance(optimizer, OverlapOptimizer):
        raise MobiusError("this optimizer is already overlapped with a pipeline; pass the torch optimizer itself")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise MobiusError(f"pipe.overlap needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS) and mode == "async":
        raise MobiusError("LBFGS re-evaluates the loss over all parameters in its step (a closure), so it cannot "
                          "step one update late; use it with mode='sync' (which steps it serially) or without "
                          "pipe.overlap")
    reducer = pipeline._rt.reducer if shard else None
    if shard and reducer is None:
        raise MobiusError("shard=True divides the optimizer over the ranks of a data-parallel run, but this "
                          "pipeline has none: compile with process_group=... (or under an initialised "
                          "torch.distributed with several ranks), or use shard=False")
    if shard and mode != "sync":
        raise MobiusError(f"shard=True steps each rank's share of the parameters and then gathers them, which "
                          f"mode={mode!r} does not do; use mode='sync' with shard=True")
    if shard and not per_parameter(optimizer):
        raise MobiusError(f"shard=True steps each rank's share of the parameters, but {type(optimizer).__name__}'s "
                          f"update is not per parameter (it may read every gradient: not one of "
                          f"{', '.join(c.__name__ for c in PER_PARAMETER)}); use shard=False")
    return reducer


class OverlapOptimizer(torch.optim.Optimizer):
    """`opt` stepped off the critical path of a `Pipeline` (see the module docstring).

    It shares `param_groups`, `state` and `defaults` with the optimizer it wraps, so LR
    schedulers and checkpoints see one optimizer; use it, not the wrapped one, in the loop.
    """

    def __init__(self, pipeline: Any, optimizer: torch.optim.Optimizer, mode: str,  # noqa: D107
                 shard: bool = False, refresh_copies: bool = True) -> None:
        # Optimizer.__init__ is not called: this object owns no parameters of its own.
        reducer = _checked(pipeline, optimizer, mode, shard)
        self.inner = optimizer
        self.mode = mode
        self.shard = shard
        self.refresh_copies = refresh_copies and mode == "sync"
        # sync: hand each stage's gradients over and step it span by span, its finiteness read on
        # the GPUs (`_step_fused`); False: convert whole gradients on one worker, read them for a
        # non-finite value and step on the other (the path before, for comparisons: host_path.py)
        self.fuse = True
        self._reducer = reducer
        self.owned = 0  # parameters this rank steps (shard=True; else all)
        self._pipeline = pipeline
        self._error: BaseException | None = None
        # Where the work runs: the host thread plan (host_threads.py). sync: gradients are added
        # into .grad (the hand-over) and the parameters stepped on the optimizer's worker (the
        # hand-over on a worker of its own when the plan has a core for it); with no spare core,
        # both inline on the pipeline's thread, at the same point of the step.
        self.threads = host_threads.plan_for(pipeline._rt.devices.values())
        self._stepper: ThreadPoolExecutor | None = None
        self._adder: ThreadPoolExecutor | None = None
        if not self.threads.inline:
            self._stepper = host_threads.worker("mobius-optimizer", self.threads.optimizer)
            self._adder = host_threads.worker("mobius-grads", 1) if self.threads.grads else self._stepper
        self._adds: list[Future] = []
        self._steps: list[Future] = []
        self._stepped: set[int] = set()  # ids of parameters stepped during this round's backward
        self._nodes: dict[int, Any] = {}  # id(param) -> its AccumulateGrad node
        # sync: why the optimizer is stepped serially, whole, by its own step (None: the pipeline
        # may step it stage by stage): one whose update is not per parameter (`per_parameter`)
        self._serial: str | None = None
        # sync: why the update waits for opt.step() (None: stages are stepped during backward).
        # Gradients are still handed over into .grad during backward, as their stages complete;
        # the loop's code between backward and step (clip_grad_norm_, GradScaler) and the step's
        # pre-hooks then run on the final gradients, and the update after them: serial's bits.
        self._defer: str | None = None
        self._handed: set[int] = set()  # ids of parameters handed over (not stepped) during this round's backward
        self.handed_in_backward = 0  # parameters the last step() found handed over, unstepped, during backward
        self._probing = mode == "sync"  # the first round runs serially and watches the loop
        self._backwards = 0  # backward passes since the last step()
        self.stepped_in_backward = 0  # parameters the last step() found already stepped during backward
        self._after_backward: dict[int, tuple[Any, int]] = {}  # id(p) -> (its .grad, version) when backward ended
        self._hp: list[dict] | None = None  # the hyper-parameters this round's stages were stepped with
        self._watched: set[int] = set()  # parameters whose AccumulateGrad node has our pre-hook
        self._handles: list[Any] = []  # every hook this overlap put on autograd or the model: removed by close()
        self._handed_fp: dict[int, tuple] = {}  # probe: the gradients Masters handed autograd (tensor, version)
        self._outside: set[int] = set()  # parameters that also get gradients from outside the pipeline
        self._late: set[int] = set()  # ... seen after their stage was stepped (an overlapping round)
        self._nonfinite = False  # this round met a non-finite gradient: no more stepping during backward
        self._dirty: str | None = None  # a backward failed after stepping some parameters
        # async: per parameter a shadow the update is written into while the model runs on the old weights
        self._shadows: dict[int, nn.Parameter] = {}
        self._flight: Future | None = None
        self._flight_params: list[torch.Tensor] = []
        self._flight_copies: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # (device, param, copy) it writes
        self._write_copies = refresh_copies  # async: the update writes the streamed copy the next uploads read
        self._held: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # async: downloads the update reads
        self._stream_size: dict[int, int] = {}  # async: id(param) -> its downloads' element size
        self._mine: dict[int, torch.Tensor] | None = None  # async: this optimizer's parameters by id (per backward)
        # keep_grads False: no fp32 `.grad` (2 B per parameter less), only for loops that do not read or
        # edit `.grad` between backward and step; widen_downloads (`widens`): `.grad` widened on the GPUs
        self.keep_grads, self.widen_downloads = True, WIDEN_DOWNLOADS  # (docs/host_optimizer.md)
        self._init_speculation(shard)
        if mode == "async":
            self._hook_model()
        if mode == "sync" and not per_parameter(optimizer):
            self._serial = (f"{type(optimizer).__name__} is not one of the optimizers whose update is per parameter "
                            f"({', '.join(c.__name__ for c in PER_PARAMETER)}, exact classes or "
                            f"subclasses that keep their step): its step may read every parameter (a closure, a "
                            f"global norm), so it is stepped whole at opt.step(), after backward")
            self._probing = False
            log.warning("pipe.overlap(mode='sync') steps the optimizer serially: %s", self._serial)
        if shard:
            self._owners = partition_owners(self._params(), reducer.world)
            reducer.owners = self._owners
            self.owned = sum(1 for r in self._owners.values() if r == reducer.rank)
        else:
            self.owned = len(self._params())

    def _init_speculation(self, shard: bool) -> None:
        # sync, a loop that edits the gradients between backward and opt.step() (clip_grad_norm_):
        # True (the default) steps the stages during backward speculatively, out of place, and
        # commits or rolls back at opt.step() (`_speculate`, docs/overlap_semantics.md); so do a
        # GradScaler's loop and a step pre-hook (which may clip); False: the update waits for
        # opt.step() (`_defer`)
        self.speculate = not shard
        self._speculating: str | None = None  # why stages are stepped speculatively (None: they are not)
        self._spec: dict[int, list] = {}  # id(p) -> this round's speculative step of p (`_speculate_one`)
        self._spare_bufs: dict[int, dict[str, torch.Tensor]] = {}  # id(p) -> its spare master and moments
        self.speculated_in_backward = 0  # parameters the last step() found stepped speculatively during backward
        self.committed = 0  # ... of which it committed (their gradients were what the pass read)
        self._scaler: Any = None  # a weak reference to the GradScaler whose step called the last opt.step()
        self._round_scale: torch.Tensor | None = None  # its scale when this round's backward began (the loss's)
        self._silent_edits = False  # the probe saw a gradient edited without a version bump
        self.rolled_back = 0  # ... and rolled back (then stepped from the final gradients, as serial)

    # ------------------------------------------------------------------ the wrapped optimizer's face
    # Read through to the wrapped optimizer (its load_state_dict replaces param_groups and state):
    # schedulers and user edits reach the groups its step reads. Workers step a shallow copy of it
    # with groups of their own (`_step_only`), so these are never rebound while work is in flight.
    param_groups = _inner("param_groups")
    state = _inner("state")
    defaults = _inner("defaults")
    # Hooks registered here are the wrapped optimizer's. Its step hooks (and torch's global ones)
    # run once per opt.step(), by `step` (`_pre_hooks`, `_post_hooks`), however many calls of the
    # optimizer's step the update takes: those calls run its step without torch's hook wrapper
    # (`raw_step`). Its state_dict and load_state_dict hooks are theirs.
    _optimizer_step_pre_hooks = _inner("_optimizer_step_pre_hooks")
    _optimizer_step_post_hooks = _inner("_optimizer_step_post_hooks")
    _optimizer_state_dict_pre_hooks = _inner("_optimizer_state_dict_pre_hooks")
    _optimizer_state_dict_post_hooks = _inner("_optimizer_state_dict_post_hooks")
    _optimizer_load_state_dict_pre_hooks = _inner("_optimizer_load_state_dict_pre_hooks")
    _optimizer_load_state_dict_post_hooks = _inner("_optimizer_load_state_dict_post_hooks")

    def __repr__(self) -> str:
        return f"OverlapOptimizer(mode={self.mode!r}, {self.inner!r})"

    def __getstate__(self) -> dict:
        raise MobiusError("an OverlapOptimizer holds worker threads; save opt.state_dict() instead of pickling it")

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._wait_adds()
        if self._held:  # async, between backward and step: the gradients it holds are the .grad zeroed
            if set_to_none:
                self.drop_held()
            else:
                self._materialize()
        if not set_to_none:
            self.unshare_grads(zero=True)
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        self.synchronize()
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.synchronize()
        self._spec = {}  # a speculative step of the state replaced: dropped
        self.inner.load_state_dict(state_dict)
        self._dirty, self._stepped, self._backwards, self._hp = None, set(), 0, None

    def add_param_group(self, param_group: dict) -> None:
        self.synchronize()
        self.inner.add_param_group(param_group)

    # ------------------------------------------------------------------ workers
    def _submit(self, executor: ThreadPoolExecutor | None, fn: Callable[[], object]) -> Future:
        """Run `fn` on `executor`'s worker, or now on this thread when the plan has none (an
        error is kept for step() either way)."""
        if executor is not None:
            return executor.submit(self._guarded, fn)
        done: Future = Future()
        self._guarded(fn)
        done.set_result(None)
        return done

    def _guarded(self, fn: Callable[[], object]) -> None:
        if self._error is not None:
            return
        try:
            fn()
        except BaseException as e:  # reported by step()
            self._error = e

    def _wait_adds(self) -> None:
        adds, self._adds = self._adds, []
        for f in adds:
            f.result()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise MobiusError(f"the optimizer step running beside the pipeline failed: {e!r}") from e

    def _sub(self, groups: list[dict]) -> torch.optim.Optimizer:
        """A shallow copy of the wrapped optimizer sharing every attribute -- state, hooks,
        whatever the optimizer keeps -- with `groups` of its own (copy.copy would go through
        Optimizer.__getstate__, which keeps only defaults, state and param_groups: the hooks and
        other attributes would be lost). With no groups, a state of its own too (`_chunks`)."""
        sub = object.__new__(type(self.inner))
        sub.__dict__.update(self.inner.__dict__)
        sub.__dict__.pop("step", None)  # an LR scheduler's wrapper of the optimizer's bound step
        sub.param_groups = groups
        if not groups:
            sub.state = defaultdict(dict)
        return sub

    def _step_only(self, params: list[torch.Tensor], groups: list[dict] | None = None) -> None:
        """Step the wrapped optimizer over `params` only (optionally with the hyper-parameters
        of `groups`, a snapshot of param_groups taken when the step was launched)."""
        want = {id(p) for p in params}
        source = groups if groups is not None else self.inner.param_groups
        sub = self._sub([{**g, "params": [p for p in g["params"] if id(p) in want]} for g in source])
        raw_step(type(self.inner))(sub)
        stepped_masters(sub)

    def _pre_hooks(self) -> None:
        """torch's and the optimizer's step pre-hooks, once for this opt.step(), before any of
        its update (as `Optimizer.profile_hook_step` runs them, with this object as the optimizer)."""
        for hook in pre_hooks(self.inner):
            result = hook(self, (self,), {})
            if result is not None and not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"{hook} must return None or a tuple of (new_args, new_kwargs), but got {result}.")

    def _post_hooks(self) -> None:
        """The step post-hooks, once for this opt.step(), after its update (async: launched)."""
        self.inner._optimizer_step_code()
        for hook in post_hooks(self.inner):
            hook(self, (self,), {})

    # ------------------------------------------------------------------ the loop's side
    def _deferring(self, why: str, refuse: bool = False) -> None:
        """The loop needs every gradient before any update: from now on stages are handed over,
        not stepped, during backward, and the update runs at opt.step() (`_defer`); said once.
        `refuse`: this round's stages were already stepped, which nothing can undo exactly."""
        if refuse:
            raise MobiusError(f"pipe.overlap(mode='sync'): {why}. This step's stages were already stepped during "
                              f"backward with the gradients it produced. Use mode='async' (which steps after your "
                              f"changes) or mode='none', or keep the loop as it was in its first step")
        if self._defer is None and self._serial is None:
            self._defer = why
            log.warning("pipe.overlap(mode='sync'): from now on the update waits for opt.step() (gradients are still "
                        "handed over during backward, as their stages complete; the update then runs after your "
                        "code, on the gradients it leaves, exactly as a serial step): %s", why)

    def _speculable(self) -> bool:
        """Whether a loop that edits gradients can be speculated on: the pipeline streams a
        narrower dtype than fp32 (bf16, fp16: the gradients arrive converted by the pass), the
        fused host pass is on and built and steps every group of this optimizer (it writes the new
        state out of place), `.grad` is kept (the loop edits it), no shard."""
        cast = getattr(self._pipeline._rt, "dtype", None)  # the streamed dtype (None: the masters'): the pass
        narrow = cast is not None and cast.itemsize < 4    # steps where the download is narrower (`_fusable`)
        return (self.speculate and narrow and not self.shard and self.fuse and self.keep_grads and HOST_PASS
                and getattr(self, "host_pass", True) and host_optimizer.compiled()
                and all(host_optimizer.kind_of(self.inner, g) is not None for g in self.param_groups))

    def _speculating_from_now(self, why: str) -> None:
        """From the next round on, stages are stepped during backward speculatively (`_speculate`);
        said once."""
        self._speculating = why
        log.warning("pipe.overlap(mode='sync'): %s. From now on each stage is stepped speculatively during "
                    "backward, out of place (the new weights, moments and streamed copy into spare buffers: 16 B "
                    "per parameter more host memory for AdamW in bf16; a GradScaler's unscale applied in the pass), "
                    "and opt.step() commits it where your code and the step pre-hooks left the gradients the step "
                    "read (a clip factor of 1.0) or rolls it back and steps from the gradients you left, exactly as a "
                    "serial step", why)

    def _watch_scaler(self, scaler: torch.amp.GradScaler | None, stepped: bool) -> None:
        """opt.step() called by `scaler.step` (or not: None). The scaler that steps the optimizer is
        the one that scaled the loss: the next rounds' speculative steps unscale by its scale
        (`_scale_now`); after a step it did not make, by none. Its first step starts the
        speculation (or, where that cannot run, the deferral)."""
        self._scaler = weakref.ref(scaler) if scaler is not None else None
        if scaler is not None and self._speculating is None:
            why = ("a GradScaler steps this optimizer: its unscale_ and inf check need every gradient before any "
                   "update")
            if not stepped and self._defer is None and self._serial is None and self._speculable():
                self._speculating_from_now(why)
            else:
                self._deferring(why, refuse=stepped)

    def step(self, closure: Callable[[], object] | None = None) -> Any:  # type: ignore[override]
        """Finish this step's update (sync) or launch it (async); see the module docstring."""
        serial = self.mode == "sync" and self._serial is not None
        if closure is not None and not serial:
            raise MobiusError("pipe.overlap's optimizer takes no closure: the pipeline's backward already computed the "
                              "gradients; call loss.backward() and then opt.step()")
        self.inner._opt_called = True  # for an LR scheduler built on the wrapped optimizer
        if self.mode == "async":
            self._finish_flight()
            self._pre_hooks()
            self._step_async()
            self._post_hooks()
            return None
        self._check_dirty()
        steps, self._steps = self._steps, []
        for f in steps:
            f.result()
        self._wait_adds()
        now = {id(p): p for p in self._params()}
        changed = self._changed(now)
        stepped, self._stepped = self._stepped, set()
        self.stepped_in_backward = len(stepped)
        handed, self._handed = self._handed, set()
        spec, self._spec = self._spec, {}
        self.speculated_in_backward = len(spec)
        self.handed_in_backward = len(handed) - sum(1 for i in spec if i in handed)
        backwards, self._backwards = self._backwards, 0
        self._after_backward = {}
        hp, self._hp = self._hp, None
        late, self._late = self._late, set()
        self._nonfinite = False
        self._handed_fp = {}
        if serial:  # the optimizer's own step over its own groups, torch's hooks and all: a serial step
            self._backwards = 0
            return self.inner.step(closure) if closure is not None else self.inner.step()
        if stepped and pre_hooks(self.inner):
            raise MobiusError(f"pipe.overlap(mode='sync'): an optimizer step pre-hook was registered after this step's "
                              f"backward began, when {len(stepped)} parameters were already stepped; a pre-hook runs "
                              f"before any update (with one, the update waits for opt.step()). Register it before "
                              f"loss.backward(), or use mode='none'")
        self._watch_scaler(grad_scaler_calling(), bool(stepped))
        if hp is not None and not same_hyper(hp, hyper_params(self.param_groups)):
            self._deferring("hyper-parameters (lr, momentum, weight decay ...) changed between the end of backward and "
                            "opt.step(): the stages are stepped during backward", refuse=bool(stepped))
        if late:
            self._deferring(f"{len(late)} parameters got gradients from outside the pipeline (a regulariser or an "
                            f"auxiliary loss on the model's parameters) after their stage was stepped",
                            refuse=bool(stepped))
        if self._outside and self._probing and backwards:
            log.info("pipe.overlap(mode='sync'): %d parameters also get gradients from outside the pipeline; they are "
                     "stepped at opt.step(), the others during backward", len(self._outside))
        if changed and self._speculating is None:  # speculating: what opt.step() checks below
            why = (f"{len(changed)} gradients changed between the end of backward and opt.step() "
                   f"(clip_grad_norm_, GradScaler.unscale_, or code that edits .grad): every gradient "
                   f"is needed before any update")
            if not stepped and self._defer is None and self._serial is None and self._speculable():
                self._speculating_from_now(why)
            else:
                self._deferring(why, refuse=bool(stepped))
        if self._probing and backwards:
            self._probing = False
            if self._serial is None:
                log.info("pipe.overlap(mode='sync'): the first step ran serially; from the next one, stages are "
                         "stepped during backward as their gradients complete")
        self._pre_hooks()
        stepped |= self._settle(spec, hp)  # after the pre-hooks: one may clip
        rest = [p for p in self._params() if id(p) not in stepped and p.grad is not None]
        if rest:
            self._step_only(rest)
        if self.shard:
            self._gather()
        self._post_hooks()
        return None

    def _changed(self, now: dict[int, torch.Tensor]) -> list[int]:
        """The parameters whose gradient changed since backward ended (another tensor, a new
        version, or -- while probing -- other bits). The probe also notes a gradient edited in
        place without a version bump (GradScaler.unscale_'s kernel): a speculation's check then
        compares the bits every step (`_unchanged`)."""
        changed = []
        for i, (g, v, f) in self._after_backward.items():
            if i not in now or now[i].grad is not g or g._version != v:
                changed.append(i)
            elif f is not None and fingerprint(g) != f:
                changed.append(i)
                self._silent_edits = True
        return changed

    def _gather(self) -> None:
        """shard=True: every rank stepped its own parameters; each owner's new values to all."""
        by_owner: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        for p in self._params():
            if id(p) in self._owners:
                by_owner.setdefault((self._owners[id(p)], p.dtype), []).append(p)
        red = self._reducer
        with torch.no_grad():
            for (owner, _), params in sorted(by_owner.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
                flat = torch.cat([p.detach().reshape(-1) for p in params])
                red.broadcast_flat(flat, owner)
                if owner != red.rank:
                    offset = 0
                    for p in params:
                        p.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()


    def synchronize(self) -> None:
        """Wait for the optimizer work in flight and leave the model with the newest weights
        (async: the update launched by the last `step()`)."""
        for f in self._steps:
            f.result()
        self._wait_adds()
        self._finish_flight()

    def close(self) -> None:
        """Finish the work in flight, end the worker threads and remove every hook this overlap
        put on autograd's nodes, so nothing keeps it (or its optimizer's state) alive."""
        self.synchronize()
        for ex in {id(e): e for e in (self._adder, self._stepper) if e is not None}.values():
            ex.shutdown()
        self._held = {}
        self._spec, self._spare_bufs = {}, {}
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        self._watched.clear()
        self._nodes.clear()
        self._handed_fp, self._after_backward = {}, {}
        pipe = self._pipeline
        if pipe.__dict__.get("_overlap") is self:  # closed while current: the pipeline steps nothing more through it
            object.__setattr__(pipe, "_overlap", None)
        runtimes = [pipe._rt] + [v.runtime for v in getattr(pipe, "_variants", ())]  # every compiled variant's
        for rt in runtimes:
            if rt.overlap is self:
                rt.overlap = None

    # ------------------------------------------------------------------ the runtime's side: the hand-over
    def before_forward(self) -> None:
        """A forward of the pipeline begins: refused between a backward that stepped stages and
        the opt.step() that completes the update."""
        self._check_dirty()
        if self._stepped:
            raise MobiusError(f"a forward ran between loss.backward() and opt.step() under pipe.overlap(mode='sync'), "
                              f"after {len(self._stepped)} parameters were already stepped: it would run on some "
                              f"stages' new weights and others' old ones. Call opt.step() before the next forward "
                              f"(evaluate after it), or use mode='none'")

    def backward_started(self) -> None:
        """A backward pass of the pipeline begins (first stage backward of a step)."""
        self._check_dirty()
        self._backwards += 1
        if self.mode == "async":
            self._materialize()  # a second backward before opt.step() accumulates onto the first's gradients
            self._mine = {id(p): p for p in self._params()}
        if self.mode != "sync":
            return
        for p in self._params():
            self._watch(p)
        if self._backwards > 1:
            # a backward with no opt.step() since the last. Speculating: that round's speculative
            # steps are dropped (the state is the old one: nothing to undo). A loop that skipped the
            # step (a non-finite loss or norm, a GradScaler's inf: often fp16's first steps) and
            # zeroed the gradients starts a new round where nothing was stepped in place (the probe
            # too: it probes again), speculating or not.
            if self._speculating is not None:
                self._spec = {}
            if not self._stepped and all(p.grad is None for p in self._params()):
                self._backwards, self._handed, self._nonfinite, self._hp = 1, set(), False, None
                self._after_backward = {}
        if self._backwards == 1:
            self._round_scale = self._scale_now()
            if (pre_hooks(self.inner) and self._speculating is None and self._defer is None and self._serial is None
                    and not self._probing and not self._stepped and self._speculable()):
                self._speculating_from_now("a step pre-hook is registered: it runs at opt.step() before any update "
                                           "and may edit the gradients (clip_grad_norm_ in a hook)")
        if self._backwards > 1:
            self._deferring("opt.step() was not called between two backward passes (gradient accumulation, or a loop "
                            "that skips steps, e.g. on a non-finite loss): a stage cannot be stepped before it is known "
                            "that the step will be taken with these gradients", refuse=bool(self._stepped))

    def _scale_now(self) -> torch.Tensor | None:
        """The scale of the GradScaler that stepped the last opt.step() (`grad_scaler_calling`) as
        this backward begins: the loss it runs from was multiplied by it (`scaler.scale(loss)`;
        `scaler.update()` changes it only after the step). A copy of the tensor (read on the worker:
        no device sync here), or None: no scaler, a disabled one, or one not yet used."""
        scaler = self._scaler() if self._scaler is not None else None
        if scaler is None or not getattr(scaler, "_enabled", False):
            return None
        scale = getattr(scaler, "_scale", None)
        return scale.detach().clone() if isinstance(scale, torch.Tensor) else None

    def _check_dirty(self) -> None:
        if self._dirty is not None:
            raise MobiusError(f"pipe.overlap(mode='sync'): {self._dirty}; the model's weights and the optimizer state "
                              f"are those of a partial step. Reload both from a checkpoint (opt.load_state_dict clears "
                              f"this), or use mode='none' to retry failed steps")

    def _watch(self, p: torch.Tensor) -> None:
        """Pre-hook p's AccumulateGrad node: it sees every gradient autograd accumulates into
        `.grad`, so a gradient from outside the pipeline (a regulariser, an auxiliary loss on
        model.parameters()) shows up there."""
        if id(p) in self._watched or not p.requires_grad:
            return
        node = self._nodes.get(id(p))
        if node is None:
            node = self._nodes[id(p)] = accumulator(p)
        # The node outlives this optimizer (autograd keeps it while `p` lives): the hook holds it
        # weakly and close() removes it, so a replaced or closed overlap and its state are freed.
        self._handles.append(node.register_prehook(WeakHook(self, "_arrives", id(p))))
        self._watched.add(id(p))

    def _arrives(self, pid: int, grad_outputs: tuple) -> None:
        """What autograd accumulates into parameter `pid`'s `.grad` (its AccumulateGrad pre-hook)."""
        g = grad_outputs[0] if grad_outputs else None
        if g is None:
            return
        if pid in self._stepped:
            self._late.add(pid)
        elif self._probing and pid in self._handed_fp:
            mine, version = self._handed_fp[pid]
            if g is not mine or g._version != version:  # summed with another gradient (even a zero one)
                self._outside.add(pid)

    def handed_by_autograd(self, grads: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The runtime's `Masters` hands these (id -> (master, gradient)) to autograd; while
        probing, remember them, to tell gradients from outside the pipeline (`_watch`)."""
        if self._probing:
            self._handed_fp = {i: (g, g._version) for i, (_, g) in grads.items()}

    def widens(self) -> bool:
        """Whether the runtime may download the gradients this backward hands over widened to
        the masters' dtype, straight into their `.grad` homes (`Runtime.widens_gradients`): a
        loop that keeps the fp32 `.grad` (`keep_grads`), stepped by the fused hand-over, sync not
        speculating (its commit check compares `.grad` with the bf16 download) or async."""
        return (self.widen_downloads and self.keep_grads and self.fuse and self._error is None
                and (self.mode == "async" or (self.mode == "sync" and self._speculating is None)))

    def _streamed_size(self, g: torch.Tensor) -> int:
        """Bytes per element of a download as the pipeline streamed it: a widened download
        (`widens`) is fp32 on the host but was summed and streamed in the pipeline's dtype."""
        cast = self._pipeline._rt.dtype
        if cast is not None and g.is_floating_point() and cast.itemsize < g.element_size() and is_home(g):
            return cast.itemsize
        return g.element_size()

    def _widened(self, p: torch.Tensor, gs: list[torch.Tensor]) -> bool:
        """Whether `p`'s gradient came as one download widened on the GPU into a `.grad` home:
        the fp32 gradient itself, the pass reads it (`_host_pass`) and nothing converts it."""
        return len(gs) == 1 and gs[0].dtype == p.dtype and self._streamed_size(gs[0]) < p.element_size()

    def overlapping(self) -> bool:
        """Whether this backward steps stages as their gradients complete (sync), or hands their
        gradients over into the fp32 `.grad` as they complete (async with `keep_grads`: `ready`)."""
        if self.mode == "async":
            return self.keep_grads and self.fuse and self._error is None
        return self.mode == "sync" and self._serial is None and not self._probing and self._error is None

    def wants(self, p: torch.Tensor) -> bool:
        """Whether `p` can be stepped now, during the backward that runs: it is one of this
        optimizer's parameters, this backward accumulates into its `.grad`, and no hook on it
        expects autograd to do so."""
        if torch.is_grad_enabled():  # backward(create_graph=True): autograd builds on the gradients it accumulates
            return False
        if self.mode == "async":  # where `take` would convert the downloads into an empty .grad
            mine, homes = self._mine, self._pipeline._rt.grad_homes
            if (homes is None or mine is None or mine.get(id(p)) is not p or p.grad is not None
                    or id(p) in self._outside or _user_grad_hooks(p) or p.is_sparse):
                return False
        node = self._nodes.get(id(p))
        if node is None:
            if not any(q is p for q in self._params()):
                return False
            node = self._nodes[id(p)] = accumulator(p)
        hooked = _user_grad_hooks(p) if self.mode == "async" else has_grad_hooks(p)
        return id(p) not in self._outside and not hooked and engine_accumulates(node)

    def ready(self, groups: list[tuple[torch.Tensor, list[Callable[[], torch.Tensor]]]],
              finite: list[Callable[[], bool]] | None = None) -> None:
        """Gradients of these masters are complete (each: the thunks giving its host gradient
        from every stage that holds it, in the order the runtime summed them): put them in
        `.grad` and step them, on the workers. `finite`: thunks telling whether the gradients of
        the stages they came from are all finite, computed on the GPUs (None: read them here)."""
        params = [p for p, _ in groups]
        homes = self._pipeline._rt.grad_homes
        if self.mode == "async":
            # keep_grads: each stage's downloads converted into the fp32 .grad (`take`'s
            # conversion) on the adder thread as the stage's gradients complete, while the GPUs go
            # on with earlier stages, not on the main thread after the pipeline; backward's end
            # (`backward_done`) waits for them, so `.grad` is final when backward returns
            def hand_async() -> None:
                downloads = [(p, [g for g in (t() for t in thunks) if g is not None]) for p, thunks in groups]
                for p, gs in downloads:
                    if gs:
                        self._stream_size[id(p)] = self._streamed_size(gs[0])
                self._hand(downloads, homes)

            self._adds.append(self._submit(self._adder, hand_async))
            return
        if (self._speculating is not None and finite is not None and self.fuse and self.keep_grads
                and self._defer is None):
            self._ready_speculative(groups, finite, homes)
            return
        if self._defer is not None or pre_hooks(self.inner) or self._speculating is not None:
            # the update waits for opt.step() (`_defer`; a step pre-hook runs before any update):
            # only the hand-over now, while the GPUs go on; `.grad` is final when backward returns
            self._handed.update(id(p) for p in params)

            def hand() -> None:
                self._hand([(p, [g for g in (t() for t in thunks) if g is not None]) for p, thunks in groups], homes)

            self._adds.append(self._submit(self._adder, hand))
            return
        self._stepped.update(id(p) for p in params)
        if self._hp is None:  # the hyper-parameters of this round: every stage is stepped with them
            self._hp = hyper_params(self.param_groups)
        hp = [{**h, "params": g["params"]} for h, g in zip(self._hp, self.param_groups)]

        if finite is not None and self.fuse:
            # the hand-over and the step in one job: each gradient converted span by span right
            # before the optimizer steps that span (`_step_fused`); `.grad` is final when it ends,
            # so backward's end (`backward_done`) waits for it as for an addition
            def fused() -> None:
                ok = not self._nonfinite and all(f() for f in finite)
                downloads = [(p, [g for g in (t() for t in thunks) if g is not None]) for p, thunks in groups]
                if not ok:
                    self._hand(downloads, homes)
                    self._skip(params)
                    return
                self._step_fused(downloads, hp, homes)
                self._refresh(params)

            job = self._submit(self._stepper, fused)
            self._adds.append(job)
            self._steps.append(job)
            return

        def add() -> None:
            self._hand([(p, [g for g in (t() for t in thunks) if g is not None]) for p, thunks in groups], homes)

        added = self._submit(self._adder, add)
        self._adds.append(added)

        def step() -> None:
            added.result()
            COUNTERS.add("finite_check", sum(nbytes(p.grad) for p in params if p.grad is not None))
            if not self._nonfinite and all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params):
                self._step_only(params, hp)
                self._refresh(params)
                return
            self._skip(params)

        self._steps.append(self._submit(self._stepper, step))

    def _ready_speculative(self, groups: list, finite: list[Callable[[], bool]], homes: GradHomes | None) -> None:
        """`ready` while the loop edits gradients before opt.step(): the stage stepped
        speculatively, out of place, on the optimizer's worker (`_speculate`; committed or rolled
        back at opt.step()); what is not speculated is handed over."""
        self._handed.update(id(p) for p, _ in groups)
        if self._hp is None:
            self._hp = hyper_params(self.param_groups)
        hp = [{**h, "params": g["params"]} for h, g in zip(self._hp, self.param_groups)]
        scale = self._round_scale

        def speculative() -> None:
            ok = not self._nonfinite and all(f() for f in finite)
            downloads = [(p, [g for g in (t() for t in thunks) if g is not None]) for p, thunks in groups]
            if not ok:  # a non-finite gradient: no speculation from it (opt.step() steps what the loop leaves)
                self._nonfinite = True
                self._hand(downloads, homes)
                return
            # a GradScaler's loss: the step reads the gradient unscaled as its unscale_ will leave it
            # (fp32 inverse scale computed as unscale_ does); None: read as it came
            inv = None if scale is None else float(scale.double().reciprocal().float())
            self._speculate(downloads, hp, homes, inv)

        job = self._submit(self._stepper, speculative)
        self._adds.append(job)
        self._steps.append(job)

    def _hand(self, downloads: list[tuple[torch.Tensor, list[torch.Tensor]]], homes: GradHomes | None) -> None:
        """The downloaded gradients into `.grad`: summed into the master's home (`GradHomes`)
        when `.grad` is None, else added into the `.grad` the loop kept (it accumulates)."""
        with torch.no_grad():
            for p, gs in downloads:
                fresh = p.grad is None
                total = _summed(p, gs, homes) if fresh else sum_downloads(p, gs, None)
                if total is None:
                    continue
                if fresh:
                    p.grad = total
                else:
                    p.grad.add_(total)
                    COUNTERS.add("grad_add", 3 * nbytes(total))

    def _skip(self, params: list[torch.Tensor]) -> None:
        """A non-finite gradient: step nothing more during this backward; opt.step() steps the
        rest serially if the loop takes the step (a loop that skips it then changed nothing)."""
        self._nonfinite = True
        self._stepped.difference_update(id(p) for p in params)

    def _refresh(self, params: list[torch.Tensor]) -> None:
        if self.refresh_copies:  # the streamed copies the next step uploads (see refresh_copies)
            for dev in self._pipeline._rt.devices.values():
                refresh = getattr(dev, "refresh", None)
                if refresh is not None:
                    refresh(params)

    def backward_done(self) -> None:
        """End of a backward pass: every `.grad` is final when it returns (async: the hand-overs
        `ready` queued have ended)."""
        self._wait_adds()
        if self.mode != "sync":
            return
        if self._hp is None:
            self._hp = hyper_params(self.param_groups)
        self._after_backward = {id(p): (p.grad, p.grad._version, fingerprint(p.grad) if self._probing else None)
                                for p in self._params() if p.grad is not None}

    def aborted(self, e: BaseException) -> None:
        for f in self._steps:  # let the work already handed over finish, then account for it
            f.result()
        self._backwards = max(0, self._backwards - 1)  # a backward that failed does not count
        self._spec = {}  # speculative steps of the stages it had finished: rolled back (nothing to undo)
        if self._stepped and self._dirty is None:
            self._dirty = (f"a backward failed after {len(self._stepped)} parameters of the stages it had finished "
                           f"were stepped")
            if hasattr(e, "add_note"):
                e.add_note(f"[mobius_fx] pipe.overlap(mode='sync') had already stepped {len(self._stepped)} parameters "
                           f"of stages whose backward finished before the error; their new weights stay, and the "
                           f"next backward or opt.step() refuses until the state is reloaded")

    # ------------------------------------------------------------------ sync: a stage's fused step
    def _fusable(self, p: torch.Tensor, gs: list[torch.Tensor], group: dict, homes: GradHomes | None,
                 widened: bool = False) -> bool:
        """Whether `p` can be handed over and stepped span by span (`_step_fused`): its downloads
        need a conversion into a fresh `.grad` (a gradient home), the optimizer is one whose
        update is elementwise and whose state for `p` is made (`_CHUNKED`), and every tensor is
        contiguous, so a span of each is the same elements. `widened`: the download is already
        the fp32 `.grad` (`_widened`), only the host pass may step it (`_step_fused`)."""
        if homes is None or p.grad is not None or not gs or (gs[0].dtype == p.dtype and not widened) or p.is_sparse:
            return False
        if not p.is_contiguous() or any(not g.is_contiguous() or g.shape != p.shape or g.device != p.device
                                        for g in gs):
            return False
        kind = _CHUNKED.get(type(self.inner))
        if kind is None or group.get("differentiable") or group.get("capturable"):
            return False
        if group.get("fused") and _span() % UNIT:
            return False  # spans of part units would split the fused kernel's work differently
        state = self.inner.state.get(p)
        if kind == "adam" and not state:
            return False  # made by its first step: whole
        if kind == "sgd" and group.get("momentum", 0) != 0 and (state or {}).get("momentum_buffer") is None:
            return False
        for v in (state or {}).values():
            if not isinstance(v, torch.Tensor):
                return False
            if not (v.dim() == 0 or (v.shape == p.shape and v.is_contiguous() and v.device == p.device)):
                return False
        return True

    def _step_fused(self, downloads: list[tuple[torch.Tensor, list[torch.Tensor]]], hp: list[dict],
                    homes: GradHomes | None) -> None:
        """Hand over and step a stage's parameters in one pass (`ready`, finiteness known from the
        GPUs): for the parameters `_fusable` allows, span by span (`_span()` elements), the
        downloaded gradient is converted into the span of `.grad` (its home, kept across steps)
        and the wrapped optimizer's own step (`_raw_step`) runs at once over views of that span
        of the parameter, its gradient and its state, while the span is in cache. The optimizers
        in `_CHUNKED` update every element from its own gradient and state and the per-parameter
        scalars (`step`), so the spans give the bits of one whole step (tests/unit/test_host_path.py
        checks it against serial stepping). Each span steps its own copy of the scalar state,
        written back once. The others (first step, a `.grad` the loop kept, another optimizer)
        are handed over and stepped whole, as `_step_only` does. No step hook runs here:
        opt.step() runs them once for the whole update."""
        where = {id(q): i for i, g in enumerate(hp) for q in g["params"]}
        fused, whole, passed = [], [], []
        for p, gs in downloads:
            widened = self._widened(p, gs)
            if id(p) in where and self._fusable(p, gs, hp[where[id(p)]], homes, widened):
                kind = self._passable(p, gs, hp[where[id(p)]], homes)
                if kind is not None:
                    passed.append((p, gs, kind))
                elif widened:  # the fp32 .grad already: torch's step reads it (the spans' bits, converting nothing)
                    whole.append((p, gs))
                else:
                    fused.append((p, gs))
            else:
                whole.append((p, gs))
        if passed and _raw_step(type(self.inner)) is None:
            fused += [(p, gs) for p, gs, _ in passed if not self._widened(p, gs)]
            whole += [(p, gs) for p, gs, _ in passed if self._widened(p, gs)]
            passed = []
        self._hand(whole, homes)
        params = [p for p, _ in downloads]
        want = {id(p) for p in params}
        sub = self._sub([{**g, "params": [p for p in g["params"] if id(p) in want]} for g in hp])
        raw = _raw_step(type(self.inner))
        if not (fused or passed) or raw is None:
            self._hand(fused, homes)
            raw_step(type(self.inner))(sub)  # no step hooks: opt.step() runs them once (`_pre_hooks`)
            stepped_masters(sub)
            return
        rest = {id(p) for p, _ in whole}
        written: list[tuple[torch.Tensor, Entry]] = []

        def body(opt: torch.optim.Optimizer, *_: object, **__: object) -> None:
            with torch.no_grad():
                if rest:
                    raw(self._sub([{**g, "params": [p for p in g["params"] if id(p) in rest]} for g in hp]))
                if fused:
                    self._chunks(fused, hp, where, homes, raw)
                if passed:
                    written.extend(self._host_pass(passed, hp, where, homes))

        body(sub)  # no step hooks: opt.step() runs them once (`_pre_hooks`)
        stepped_masters(sub)  # the version bump the global post-hook would give
        for p, entry in written:  # after that bump: the copy the pass wrote is current
            StreamedCopies.mark_current(entry, p)

    def _chunks(self, fused: list[tuple[torch.Tensor, list[torch.Tensor]]], hp: list[dict], where: dict[int, int],
                homes: GradHomes | None, raw: Callable[[torch.optim.Optimizer], object]) -> None:
        """`_step_fused`'s spans: batches of at most `_span()` elements (one span of a large
        parameter, or several small parameters), each converted then stepped."""
        state = self.inner.state
        chunk = _span()
        spans: list[tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, int, int]] = []
        for p, gs in fused:
            home = homes.take(p)
            p.grad = home
            n = p.numel()
            spans += [(p, gs, home, a, min(n, a + chunk)) for a in range(0, n, chunk)]
            COUNTERS.add("grad_fused", sum(nbytes(g) for g in gs) + nbytes(home) * (2 * len(gs) - 1))
        scalars: dict[int, dict] = {}
        i = 0
        while i < len(spans):
            j, size = i, 0
            while j < len(spans) and (j == i or size + spans[j][4] - spans[j][3] <= chunk):
                size += spans[j][4] - spans[j][3]
                j += 1
            sub = self._sub([])
            groups: dict[int, list[torch.Tensor]] = {}
            for p, gs, home, a, b in spans[i:j]:
                convert_span(home, gs, a, b)
                q = p.detach().view(-1)[a:b]
                q.grad = home.view(-1)[a:b]
                own = {k: (v.view(-1)[a:b] if v.dim() else v.clone()) for k, v in state.get(p, {}).items()}
                sub.state[q] = own
                scalars[id(p)] = (p, own)
                groups.setdefault(where[id(p)], []).append(q)
            sub.param_groups = [{**hp[g], "params": qs} for g, qs in sorted(groups.items())]
            raw(sub)
            sub.state.clear()  # no view of a gradient home outlives its span (a home held is not reused)
            sub.param_groups = []
            del sub, groups
            i = j
        for p, own in scalars.values():  # every span stepped the same scalars: the last one's are theirs
            for k, v in own.items():
                if v.dim() == 0:
                    state[p][k].copy_(v)

    # ------------------------------------------------------------------ the fused host pass
    def _passable(self, p: torch.Tensor, gs: list[torch.Tensor], group: dict, homes: GradHomes | None) -> str | None:
        """The host pass's kind for `p` (`_fusable` already holds), or None: the pass is on and
        built, the optimizer and group are ones it steps as torch does (`host_optimizer.kind_of`),
        one download, or two of one dtype (a tied master held by two stages: the pass reads both and
        sums them as `sum_downloads` does; three or more keep the span path, `_chunks`), an fp32
        master with its state made, every tensor aligned."""
        if not (HOST_PASS and getattr(self, "host_pass", True) and host_optimizer.compiled()):
            return None
        kind = host_optimizer.kind_of(self.inner, group)
        if kind is None or len(gs) not in (1, 2) or p.dtype != torch.float32 or not gs[0].is_floating_point():
            return None
        if len(gs) == 2 and (gs[1].dtype != gs[0].dtype or gs[1].data_ptr() % ALIGN):
            return None
        state = self.inner.state.get(p) or {}
        names = (("exp_avg", "exp_avg_sq") if kind != "sgd"
                 else (("momentum_buffer",) if float(group.get("momentum", 0)) != 0 else ()))
        tensors = [p, gs[0]] + [state.get(k) for k in names]
        if kind != "sgd" and not isinstance(state.get("step"), torch.Tensor):
            return None
        if any(t is None or t.dtype not in (torch.float32, gs[0].dtype) or t.data_ptr() % ALIGN for t in tensors):
            return None
        return kind

    def _streamed(self, p: torch.Tensor) -> tuple[StreamedCopies, Entry] | None:
        """The streamed copy of `p` the devices upload from (one, shared by them: `StreamedCopies`)
        with its store, if there is one the pass can write."""
        for dev in self._pipeline._rt.devices.values():
            store = getattr(dev, "streamed_copies", None)
            entry = store.get(p) if store is not None else None
            if entry is not None:
                host = entry.host
                if host.shape == p.shape and host.is_contiguous() and host.data_ptr() % ALIGN == 0:
                    return store, entry
                return None
        return None

    def _host_pass(self, passed: list[tuple[torch.Tensor, list[torch.Tensor], str]], hp: list[dict],
                   where: dict[int, int], homes: GradHomes | None) -> list[tuple[torch.Tensor, Entry]]:
        """Step each parameter in one pass (`host_optimizer.step_span`): the download in (a tied
        master's two: summed in the pass), the master, torch's state, `.grad` (its home: the sum)
        and the streamed copy out. Returns the (parameter, streamed-copy entry) pairs it wrote,
        for `_step_fused` to mark current."""
        state = self.inner.state
        written = []
        keep = self.keep_grads
        for p, gs, kind in passed:
            widened = self._widened(p, gs)  # the download is the fp32 .grad (widened on the GPU): read, not written
            home = gs[0] if widened else homes.take(p) if keep else None
            p.grad = home
            st = state[p]
            step = None
            if kind != "sgd":
                st["step"] += 1  # once per parameter, as torch's step
                step = float(st["step"])
            streamed = self._streamed(p) if self.refresh_copies else None
            flat = {k: (v.view(-1) if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in st.items()}
            second = gs[1].reshape(-1) if len(gs) == 2 else None  # a tied master's other stage's download
            # the copy every GPU uploads from, written once every upload that read it is done
            with streamed[0].writing(streamed[1]) if streamed is not None else contextlib.nullcontext() as copy:
                ok = host_optimizer.step_span(kind, hp[where[id(p)]], p.detach().view(-1), gs[0].reshape(-1), flat,
                                              step=step, grad_out=None if home is None or widened else home.view(-1),
                                              copy_out=None if copy is None else copy.view(-1), grad2=second)
            if not bool(ok) and self._dirty is None:  # the GPUs said finite: a download went wrong
                self._dirty = (f"the host pass met a non-finite gradient of a {tuple(p.shape)} parameter that the GPUs "
                               f"had reported finite (a corrupted download) and stepped it")
            if second is not None:  # beside the optimizer's 28 B/param: the second download read
                COUNTERS.add("grad_fused", nbytes(second))
            if home is None:  # no .grad: the step hooks' version bump (host_counters) skips it
                torch.autograd.graph.increment_version(p)
            elif widened:  # beside the optimizer's 28 B/param: the fp32 .grad read where it would read the download
                COUNTERS.add("grad_read", (p.element_size() - self._streamed_size(gs[0])) * p.numel())
            else:
                # beside the optimizer's own 28 B/param: the fp32 .grad written (the download read
                # replaces the fp32 gradient's read, the copy written within the same bytes)
                COUNTERS.add("grad_fused", nbytes(home))
            if streamed is not None:
                written.append((p, streamed[1]))
        return written

    # ------------------------------------------------------------------ sync: speculation (a clipped loop)
    @staticmethod
    def _moments(kind: str, group: dict) -> tuple[str, ...]:
        if kind != "sgd":
            return ("exp_avg", "exp_avg_sq")
        return ("momentum_buffer",) if float(group.get("momentum", 0)) != 0 else ()

    def _speculate(self, downloads: list[tuple[torch.Tensor, list[torch.Tensor]]], hp: list[dict],
                   homes: GradHomes | None, inv: float | None = None) -> None:
        """A stage's step while the loop may still edit its gradients (clip_grad_norm_ between
        backward and opt.step()), on the optimizer's worker: each parameter the host pass steps
        (`_passable`) is stepped OUT OF PLACE (`_speculate_one`): the model, torch's state and the
        streamed copy the uploads read keep the old values until opt.step() commits (pointer
        swaps, `_commit`) or drops the new ones (the rollback: nothing to undo). The others are
        handed over into `.grad` and stepped at opt.step() from what the loop leaves."""
        where = {id(q): i for i, g in enumerate(hp) for q in g["params"]}
        rest = []
        for p, gs in downloads:
            kind = sp = None
            if id(p) in where and self._fusable(p, gs, hp[where[id(p)]], homes):
                kind = self._passable(p, gs, hp[where[id(p)]], homes)
            if kind is not None:
                sp = self._spare(p, kind, hp[where[id(p)]])
            if sp is None:
                rest.append((p, gs))
            else:
                self._speculate_one(p, gs, kind, hp[where[id(p)]], homes, sp, inv)
        self._hand(rest, homes)

    def _spare(self, p: torch.Tensor, kind: str, group: dict) -> dict[str, torch.Tensor] | None:
        """The spare master and moments `p`'s speculative step writes (kept across steps: a commit
        makes the old ones the spares), or None where one is not aligned for the pass."""
        st = self.inner.state[p]
        names = self._moments(kind, group)
        sp = self._spare_bufs.get(id(p))
        if sp is None or sp["p"].shape != p.shape or set(sp) != {"p", *names} \
                or any(sp[k].shape != st[k].shape or sp[k].dtype != st[k].dtype for k in names):
            sp = {"p": torch.empty_like(p, memory_format=torch.contiguous_format),
                  **{k: torch.empty_like(st[k], memory_format=torch.contiguous_format) for k in names}}
            self._spare_bufs[id(p)] = sp
        if any(t.data_ptr() % ALIGN for t in sp.values()):
            return None
        return sp

    def _speculate_one(self, p: torch.Tensor, gs: list[torch.Tensor], kind: str, group: dict,
                       homes: GradHomes | None, sp: dict[str, torch.Tensor], inv: float | None = None) -> None:
        """`p` stepped by the host pass from its download `gs[0]` (a tied master's two: summed in
        the pass, `step_span`'s `grad2`), out of place: the new master into
        `sp["p"]` (`p_out`), the new moments into `sp`'s (`state_out`; the C++ kernel reads the old
        and writes the new in the same loop: the pass's own 28 B per parameter for AdamW), the
        streamed copy into the device's second copy (`next_copy`), Adam's `step` counted only at
        the commit; `.grad` (its home) written as always. Recorded in `_spec` with what
        opt.step() checks: the `.grad` tensor and its version, the download, `inv` (a GradScaler's
        inverse scale the step multiplied the widened download by: `step_span`'s `grad_scale`, as
        its unscale_ does) and the versions of the parameter and its state (the check's too)."""
        st = self.inner.state[p]
        names = self._moments(kind, group)
        home = homes.take(p)
        p.grad = home
        if host_optimizer.backend() != "c++":  # the others copy the state into `state_out` first
            COUNTERS.add("spec_copy", 2 * sum(nbytes(st[k]) for k in names))
        step = float(st["step"] + 1) if kind != "sgd" else None  # as torch's step_t += 1, in fp32
        copy = None
        if self.refresh_copies:
            for dev in self._pipeline._rt.devices.values():
                buf = dev.next_copy(p) if hasattr(dev, "next_copy") else None
                if buf is not None and buf.is_contiguous() and buf.data_ptr() % ALIGN == 0:
                    copy = (dev, buf)
                    break
        g = tuple(d.reshape(-1) for d in gs)
        ok = host_optimizer.step_span(kind, group, p.detach().view(-1), g[0],
                                      {k: st[k].view(-1) for k in names}, step=step, grad_out=home.view(-1),
                                      copy_out=None if copy is None else copy[1].view(-1), p_out=sp["p"].view(-1),
                                      state_out={k: sp[k].view(-1) for k in names}, grad_scale=inv,
                                      grad2=g[1] if len(g) == 2 else None)
        COUNTERS.add("grad_fused", nbytes(home) + sum(nbytes(d) for d in g[1:]))  # .grad written, a 2nd download read
        versions = (p.data_ptr(), p._version, *((st[k].data_ptr(), st[k]._version) for k in names))
        self._spec[id(p)] = [p, g, home, home._version, sp, names, copy, bool(ok), kind, inv, versions]

    def _settle(self, spec: dict[int, list], hp: list[dict] | None) -> set[int]:
        """opt.step() of a speculative round: commit each parameter whose final gradient is the one
        its step read, with the hyper-parameters it was stepped with; roll back the others (the
        old state was never touched: dropping the new one is the rollback). Returns the committed."""
        same = hp is not None and same_hyper(hp, hyper_params(self.param_groups))
        done = set()
        for pid, rec in spec.items():
            if same and self._unchanged(rec):
                self._commit(rec)
                done.add(pid)
        self.committed, self.rolled_back = len(done), len(spec) - len(done)
        return done

    def _unchanged(self, rec: list) -> bool:
        """Whether the gradient `p` has now is, bit for bit, the one its speculative step read, and
        `p` and its moments the tensors, at the versions, it read. Free when `.grad` is the tensor
        the pass wrote at the version it left (and no scale was applied; no silent edit seen);
        else (clip_grad_norm_ multiplies every gradient, by exactly 1.0 when the norm is within
        max_norm; a GradScaler's unscale_ multiplies by its inverse scale without a version bump)
        its bits are compared with the download's, widened (exact; a tied master's two: their sum in
        fp32, as the pass made it) and times the inverse scale the step applied (rounded as unscale_
        rounds), span by span: 4 + 2 B read per parameter (+ 2 for a second download)."""
        p, g, home, version, ok, inv, names = rec[0], rec[1], rec[2], rec[3], rec[7], rec[9], rec[5]
        if not ok:  # the pass met a non-finite value the GPUs had not reported: serial's step then
            return False
        st = self.inner.state[p]
        if rec[10] != (p.data_ptr(), p._version, *((st[k].data_ptr(), st[k]._version) for k in names)):
            return False  # the parameter or its state changed since the step read them (a pre-hook's edit)
        scaled = inv is not None and inv != 1.0
        now = p.grad
        # free where .grad is the tensor the pass wrote, at its version, and the step read it as it is;
        # not after a GradScaler's unscale_ (expected to change it) or another edit that does not bump
        # the version (seen by the probe: `_silent_edits`)
        if now is home and now._version == version and not scaled and not self._silent_edits:
            return True
        if now is None or now.dtype != torch.float32 or now.shape != p.shape or now.is_sparse \
                or not now.is_contiguous():
            return False
        a, b = now.view(-1).view(torch.int32), g[0]
        COUNTERS.add("spec_check", nbytes(now) + sum(nbytes(d) for d in g))
        n, chunk = a.numel(), _span()
        factor = torch.tensor(inv, dtype=torch.float32) if scaled else None
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            # the gradient the step read: the download widened (+ a second one in fp32), times unscale_'s
            # factor, rounded once
            read = b[i:j].float()
            if len(g) == 2:
                read.add_(g[1][i:j])
            if factor is not None:
                read = read * factor
            if not torch.equal(a[i:j], read.view(torch.int32)):
                return False
        return True

    def _commit(self, rec: list) -> None:
        """A speculative step made the model's: the new master, moments and streamed copy swapped
        in by pointer, Adam's `step` counted (as torch's, in place)."""
        p, sp, names, copy, kind = rec[0], rec[4], rec[5], rec[6], rec[8]
        st = self.inner.state[p]
        with torch.no_grad():
            new = sp["p"]
            sp["p"] = p.data
            p.data = new
            for k in names:
                st[k], sp[k] = sp[k], st[k]
            if kind != "sgd":
                st["step"] += 1
        torch.autograd.graph.increment_version(p)  # stepped: copies elsewhere are made again
        if copy is not None:  # ... and the one the pass wrote is current
            copy[0].swap_copy(p, copy[1])

    # ------------------------------------------------------------------ async: the staleness-1 update
    def _hook_model(self) -> None:
        """async: the model's state_dict() and load_state_dict() (of any of its modules) and an eager call
        of the model first finish the update in flight, so `{"model": m.state_dict(), "opt":
        opt.state_dict()}` is one step, and a loaded checkpoint is not overwritten by it."""
        model = self._pipeline.model
        reading = WeakHook(self, "_reading")
        self._handles += [m.register_state_dict_pre_hook(reading) for m in model.modules()]
        self._handles += [m.register_load_state_dict_pre_hook(reading) for m in model.modules()]
        self._handles.append(model.register_forward_pre_hook(reading))
        # a gradient arriving for a parameter whose .grad the update in flight reads: unshare it first
        self._handles += [p.register_hook(WeakHook(self, "_arriving", p)) for p in self._params()
                          if p.requires_grad]

    def _reading(self, *_: object) -> None:
        """A (load_)state_dict and forward pre-hook on the model (async): its weights are read or
        replaced, so the update in flight lands first. Not while torch.export traces the model (a
        variant compiled for a new call): it runs on fake tensors then, and a weight swap there
        would change the trajectory the user chose (staleness 1) for no read of theirs."""
        if not torch.compiler.is_compiling():
            self.synchronize()

    def _arriving(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """A tensor hook on each parameter (async): runs as its gradient arrives, before autograd
        accumulates it into `.grad`; a loop that zeroed `.grad` (set_to_none) pays nothing."""
        q = self._shadows.get(id(p))
        if q is not None and p.grad is not None and p.grad is q.grad:
            p.grad = p.grad.clone()

    def unshare_grads(self, zero: bool = False) -> None:
        """async: after `step()` a parameter's `.grad` is the gradient that step uses, as in eager
        (the update in flight reads the very tensor). Before anything writes into it -- the next
        backward accumulating (a loop without zero_grad, as eager accumulates), zero_grad(
        set_to_none=False) -- the parameter gets a copy (zeros, for `zero`) of its own
        (`_arriving` does it for backward, only when a gradient arrives)."""
        for p in self._flight_params:
            q = self._shadows.get(id(p))
            if q is not None and p.grad is not None and p.grad is q.grad:
                p.grad = torch.zeros_like(p.grad) if zero else p.grad.clone()

    # ------------------------------------------------------------------ the gradients the update reads
    def take(self, master: torch.Tensor, thunks: list) -> bool:
        """The runtime's end of backward (`Runtime._gradients`), per master, before it would
        hand autograd the master's gradient: async takes it instead where autograd would only put
        it in an empty `.grad` -- a parameter of this optimizer whose `.grad` is None, that this
        backward accumulates into, with no gradient hook of the user's. With `keep_grads` (the
        default) it is converted into `.grad` as autograd would, into storage kept across steps
        (`GradHomes`, two per master: the update in flight reads the other); without, the
        downloads (the streamed dtype, bf16) are held as they are and the update reads them
        (`_step_async`): no `.grad` then, no conversion pass. Returns whether it took it."""
        if self.mode != "async" or not self.fuse or self._error is not None or torch.is_grad_enabled():
            return False
        homes = self._pipeline._rt.grad_homes
        mine = self._mine
        if homes is None or mine is None or mine.get(id(master)) is not master or master.grad is not None \
                or id(master) in self._outside or _user_grad_hooks(master) or master.is_sparse:
            return False
        node = self._nodes.get(id(master))
        if node is None:
            node = self._nodes[id(master)] = accumulator(master)
        if not engine_accumulates(node):
            return False
        downloads = [g for g in (t() for t in thunks) if g is not None]
        if not downloads or any(g.shape != master.shape or g.is_sparse for g in downloads):
            return False
        self._stream_size[id(master)] = self._streamed_size(downloads[0])
        if self.keep_grads or downloads[0].dtype == master.dtype:
            grad = _summed(master, downloads, homes)  # a tied master's two downloads: one pass
            if grad is None:
                return False
            master.grad = grad
            return True
        self._held[id(master)] = (master, downloads)
        return True

    def _materialize(self, zero: bool = False) -> None:
        """The held downloads (`take`) into `.grad`, where autograd would have put them: before
        a second backward accumulates onto them, or zero_grad(set_to_none=False) zeroes them."""
        held, self._held = self._held, {}
        homes = self._pipeline._rt.grad_homes
        with torch.no_grad():
            for p, downloads in held.values():
                total = sum_downloads(p, downloads, homes)
                if total is not None:
                    p.grad = total if p.grad is None else p.grad + total

    def drop_held(self) -> None:
        """zero_grad(set_to_none=True) between backward and step: the held gradients go, as `.grad` would."""
        self._held = {}

    # ------------------------------------------------------------------ the update
    def _async_passable(self, p: torch.Tensor, grad: torch.Tensor, group: dict,
                        second: torch.Tensor | None = None) -> str | None:
        """The host pass's kind for stepping `p` into its shadow from `grad` (the held download,
        or `.grad`; `second`: a tied master's other held download, of `grad`'s dtype, summed in the
        pass), or None (torch's own step, with the shadow copied first)."""
        if not (HOST_PASS and getattr(self, "host_pass", True) and host_optimizer.compiled()):
            return None
        kind = host_optimizer.kind_of(self.inner, group)
        if kind is None or p.dtype != torch.float32 or not p.is_contiguous() or p.is_sparse:
            return None
        if grad.is_sparse or not grad.is_contiguous() or grad.shape != p.shape or not grad.is_floating_point() \
                or grad.device != p.device:
            return None
        state = self.inner.state.get(p) or {}
        names = (("exp_avg", "exp_avg_sq") if kind != "sgd"
                 else (("momentum_buffer",) if float(group.get("momentum", 0)) != 0 else ()))
        if kind != "sgd" and not isinstance(state.get("step"), torch.Tensor):
            return None  # the first step makes the state: torch's
        if second is not None and (second.dtype != grad.dtype or second.is_sparse or second.device != p.device):
            return None
        tensors = [p, grad] + [state.get(k) for k in names] + ([] if second is None else [second])
        if any(t is None or t.dtype not in (torch.float32, grad.dtype) or t.shape != p.shape
               or not t.is_contiguous() or t.data_ptr() % ALIGN for t in tensors):
            return None
        return kind

    def _step_async(self) -> None:
        """Launch the staleness-1 update of the gradients this step leaves: w(t+1) into each
        parameter's shadow, on the optimizer's worker, while the next step runs on w(t). Where
        the host pass steps a parameter (`_async_passable`: torch's Adam, AdamW, SGD, their state
        made) it does so in ONE pass: it reads w(t), the gradient (the held bf16 download, or the
        fp32 `.grad` with `keep_grads`) and the state, writes w(t+1) into the shadow (out of
        place: the model keeps w(t) until the swap), the state in place and the second streamed
        copy (`StreamDevice.next_copy`) that the uploads after the swap read. The others: w(t)
        copied into the shadow, then the optimizer's own step over it."""
        self._finish_flight()
        held, self._held = self._held, {}
        homes = self._pipeline._rt.grad_homes
        for pid, (p, downloads) in list(held.items()):
            if p.grad is not None:  # a gradient from outside the pipeline came after `take`: summed, as autograd would
                self._outside.add(pid)
                with torch.no_grad():
                    p.grad = p.grad + sum_downloads(p, downloads, None)
                del held[pid]
        params = [p for p in self._params() if p.grad is not None or id(p) in held]
        if not params:
            return
        where = {id(q): i for i, g in enumerate(self.param_groups) for q in g["params"]}
        hp = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]  # this step's hyper-parameters
        passed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, str, dict]] = []
        copied: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in params:
            q = self._shadows.get(id(p))
            if q is None or q.shape != p.shape or q.dtype != p.dtype:
                q = self._shadows[id(p)] = nn.Parameter(torch.empty_like(p, memory_format=torch.preserve_format),
                                                        requires_grad=p.requires_grad)
            grad, second = p.grad, None
            if id(p) in held:
                downloads = held[id(p)][1]
                if len(downloads) <= 2:  # a tied master's two: the pass reads both (three or more: summed first)
                    grad, second = downloads[0], (downloads[1] if len(downloads) == 2 else None)
                else:
                    grad = sum_downloads(p, downloads, homes)
            group = hp[where[id(p)]]
            # the pass where the gradient came in a narrower dtype than the master's (bf16 streamed), as
            # sync's: it saves the conversion there; an fp32 pipeline keeps torch's step, its bits and all
            narrow = self._stream_size.get(id(p), p.element_size()) < p.element_size()
            kind = (self._async_passable(p, grad, group, second)
                    if narrow and q.is_contiguous() and q.data_ptr() % ALIGN == 0 else None)
            if kind is None and p.grad is None:  # torch's step reads .grad: the held download converted into it
                p.grad = grad if grad.dtype == p.dtype and second is None else _summed(p, held[id(p)][1], homes)
            q.grad = p.grad  # p.grad shows it too, as eager's does after step (unshare_grads before a write)
            if kind is not None:
                passed.append((p, q, grad, kind, group, second))
            else:
                copied.append((p, q))
        state = self.inner.state
        for p in params:
            q = self._shadows[id(p)]
            if p in state:
                state[q] = state.pop(p)
        ids = {id(p) for p in params}
        groups = [{**g, "params": [self._shadows[id(p)] for p in g["params"] if id(p) in ids]}
                  for g in self.param_groups]
        devices = list(self._pipeline._rt.devices.values()) if self._write_copies else []
        written: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        sizes = dict(self._stream_size)

        def update() -> None:
            self._update_shadows(passed, copied, groups, devices, written, sizes)

        self._flight_params = params
        self._flight_copies = written
        self._flight = self._submit(self._stepper, update)

    def _update_shadows(self, passed: list, copied: list, groups: list[dict], devices: list, written: list,
                        sizes: dict[int, int]) -> None:
        """The update `_step_async` launched, on the optimizer's worker: the host pass over each
        parameter of `passed` (w(t) read, w(t+1) into its shadow, the streamed copy into the
        first device's second copy, noted in `written`), then w(t) copied into the shadows of
        `copied` and the optimizer's own step over them with the hyper-parameters of `groups`."""
        state = self.inner.state
        with torch.no_grad():
            for p, q, grad, kind, group, second in passed:
                st = state[q] if q in state else {}
                step = None
                if kind != "sgd":
                    st["step"] += 1  # once per parameter, as torch's step
                    step = float(st["step"])
                copy = None
                for dev in devices:
                    buf = dev.next_copy(p)
                    if buf is not None and buf.is_contiguous() and buf.data_ptr() % ALIGN == 0:
                        copy = buf
                        written.append((dev, p, buf))
                        break
                flat = {k: (v.view(-1) if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in st.items()}
                host_optimizer.step_span(kind, group, p.detach().view(-1), grad.reshape(-1), flat, step=step,
                                         copy_out=None if copy is None else copy.view(-1), p_out=q.detach().view(-1),
                                         grad2=None if second is None else second.reshape(-1))
                if second is not None:  # beside the optimizer's 28 B/param: a tied master's 2nd download read
                    COUNTERS.add("grad_fused", nbytes(second))
                wide = grad.element_size() - sizes.get(id(p), grad.element_size())
                if wide > 0:  # the fp32 .grad read instead of the streamed-dtype download
                    COUNTERS.add("grad_read", wide * grad.numel())
            for p, q in copied:
                q.copy_(p)  # w(t); the model keeps running on p meanwhile
                COUNTERS.add("shadow", 2 * nbytes(q))
        if copied:
            self._step_only([q for _, q in copied], groups)

    def _finish_flight(self) -> None:
        """Wait for the async update in flight and make it the model's weights."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        flight.result()
        params, self._flight_params = self._flight_params, []
        copies, self._flight_copies = self._flight_copies, []
        state = self.inner.state
        for p in params:
            q = self._shadows[id(p)]
            if q in state:
                state[p] = state.pop(q)
            q.grad = None
        self._raise()
        with torch.no_grad():
            for p in params:
                q = self._shadows[id(p)]
                p.data, q.data = q.data, p.data  # a pointer swap: the model now holds w(t+1)
        for dev, p, buf in copies:  # ... and the streamed copy the pass wrote is the one uploads read
            dev.swap_copy(p, buf)
