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
  (`overlap_watch.PER_PARAMETER`; any other optimizer -- LBFGS, one whose step reads every
  gradient -- is stepped serially, whole, at opt.step(), said once in the log). Step pre- and
  post-hooks (the optimizer's and torch's global ones) run once per opt.step().

  What needs every gradient before any update cannot be stepped during backward: `clip_grad_norm_`
  over all parameters, fp16 `GradScaler.unscale_`'s inf check, several backward passes per step
  (gradient accumulation), a step pre-hook. The first step after `overlap()` therefore runs
  serially and watches the loop; if gradients change between the end of backward and `opt.step()`,
  a GradScaler steps, or two backward passes come before one step, the update waits for
  opt.step() from then on (with a pre-hook, from the first step), said once in the log
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

`OverlapOptimizer` is assembled here from its parts: `overlap_handover.GradHandover` (what the
runtime calls during backward, sync), `overlap_fused.FusedStep` (a stage's span-by-span step),
`overlap_async.AsyncUpdate` (mode="async") and the helpers of `overlap_watch`.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch import nn

from mobius_fx.errors import MobiusError
from mobius_fx.kinds import OVERLAP_MODES
from mobius_fx.runtime import host_threads, overlap_watch
from mobius_fx.runtime.overlap_async import AsyncUpdate
from mobius_fx.runtime.overlap_fused import FusedStep
from mobius_fx.runtime.overlap_handover import GradHandover
from mobius_fx.runtime.overlap_watch import (
    called_by_grad_scaler, fingerprint, hyper_params, partition_owners, per_parameter, post_hooks, pre_hooks, raw_step,
    same_hyper, stepped_masters,
)

__all__ = ["OverlapOptimizer"]

log = logging.getLogger("mobius_fx")


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
                          f"{', '.join(c.__name__ for c in overlap_watch.PER_PARAMETER)}); use shard=False")
    return reducer


class OverlapOptimizer(GradHandover, FusedStep, AsyncUpdate, torch.optim.Optimizer):
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
        # False: no fp32 `.grad` from the host pass (4 B per parameter less), only for loops that
        # do not read or edit `.grad` between backward and step (docs/host_optimizer.md)
        self.keep_grads = True
        if mode == "async":
            self._hook_model()
        if mode == "sync" and not per_parameter(optimizer):
            self._serial = (f"{type(optimizer).__name__} is not one of the optimizers whose update is per parameter "
                            f"({', '.join(c.__name__ for c in overlap_watch.PER_PARAMETER)}, exact classes or "
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
        self.inner.load_state_dict(state_dict)
        self._dirty, self._stepped, self._backwards, self._hp = None, set(), 0, None

    def add_param_group(self, param_group: dict) -> None:
        self.synchronize()
        self.inner.add_param_group(param_group)

    # ------------------------------------------------------------------ workers
    def _submit(self, executor: ThreadPoolExecutor | None, fn: Callable[[], Any]) -> Future:
        """Run `fn` on `executor`'s worker, or now on this thread when the plan has none (an
        error is kept for step() either way)."""
        if executor is not None:
            return executor.submit(self._guarded, fn)
        done: Future = Future()
        self._guarded(fn)
        done.set_result(None)
        return done

    def _guarded(self, fn: Callable[[], Any]) -> None:
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

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
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
        changed = [i for i, (g, v, f) in self._after_backward.items()
                   if i not in now or now[i].grad is not g or g._version != v or (f is not None and fingerprint(g) != f)]
        stepped, self._stepped = self._stepped, set()
        self.stepped_in_backward = len(stepped)
        handed, self._handed = self._handed, set()
        self.handed_in_backward = len(handed)
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
        if called_by_grad_scaler():
            self._deferring("a GradScaler steps this optimizer: its inf check needs every gradient before any update",
                            refuse=bool(stepped))
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
        if changed:
            self._deferring(f"{len(changed)} gradients changed between the end of backward and opt.step() "
                            f"(clip_grad_norm_, GradScaler.unscale_, or code that edits .grad): every gradient "
                            f"is needed before any update", refuse=bool(stepped))
        if self._probing and backwards:
            self._probing = False
            if self._serial is None:
                log.info("pipe.overlap(mode='sync'): the first step ran serially; from the next one, stages are "
                         "stepped during backward as their gradients complete")
        self._pre_hooks()
        rest = [p for p in self._params() if id(p) not in stepped and p.grad is not None]
        if rest:
            self._step_only(rest)
        if self.shard:
            self._gather()
        self._post_hooks()
        return None

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
