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
  optimizers of torch update each parameter from its own gradient and state (LBFGS, which needs
  a closure over all parameters, is refused).

  What needs every gradient before any update cannot overlap: `clip_grad_norm_` over all
  parameters, fp16 `GradScaler.unscale_`'s inf check, several backward passes per step (gradient
  accumulation), a closure. The first step after `overlap()` therefore runs serially and watches
  the loop; if gradients change between the end of backward and `opt.step()`, or two backward
  passes come before one step, the optimizer steps serially from then on and says why once in the
  log (`logging.getLogger("mobius_fx")`). A loop that changes its shape later (clipping switched
  on after a warm-up) is caught at `opt.step()` with a `MobiusError`: in sync mode those stages
  were already stepped with the gradients backward produced. `torch.autograd.grad` and
  `backward(inputs=...)` only overlap for the tensors they accumulate into `.grad`.
  While backward runs, `.grad` and weights are in flux; once `loss.backward()` returns, every
  `.grad` is final (read or log them freely), weights are final after `opt.step()`.

- `mode="async"` — RoundPipe's staleness-1 update. `opt.step()` hands step t's gradients to a
  CPU worker and returns at once; step t+1's forward and backward run on the weights of step t
  (one update old) while the worker computes w(t+1) = update(w(t), g(t)) into a shadow copy, which
  becomes the model's weights at the next `opt.step()` (a pointer swap). So
  w(t+1) = update(w(t), grad at w(t-1)). Not the serial trajectory: a trade-off the user opts
  into for the optimizer's time. Costs one more fp32 copy of the trainable weights (the shadow)
  and holds one step's gradients while the next accumulates (double buffer). `opt.synchronize()`
  (also called by `state_dict`, `load_state_dict`, `add_param_group` and `Pipeline.overlap` of
  another optimizer) waits for the update in flight and puts it in the model: call it before
  evaluating or saving. Clipping and `GradScaler` work as in a serial loop (they act before
  `opt.step()`, on the gradients the update then uses).

- `mode="none"` returns `opt` itself: stepped serially after backward.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch import nn

from .errors import MobiusError

__all__ = ["OverlapOptimizer", "MODES"]

log = logging.getLogger("mobius_fx")

MODES = ("sync", "async", "none")


def _accumulator(p: torch.Tensor) -> Any:
    """The AccumulateGrad node autograd runs for leaf `p` (kept alive by the caller)."""
    with torch.enable_grad():  # called inside backward, where grad mode is off
        return p.view_as(p).grad_fn.next_functions[0][0]


def _engine_accumulates(node: Any) -> bool:
    """True when the backward pass running now will accumulate into this leaf's `.grad`:
    `loss.backward()` and `backward(inputs=[... p ...])` do; `torch.autograd.grad` does not (torch
    refuses to answer for leaves there, which means no)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


def _fingerprint(g: torch.Tensor) -> int:
    """A checksum of `g`'s bits, for the first step's watch: some in-place kernels
    (GradScaler's unscale) do not bump the version counter."""
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(g.element_size())
    if bits is None or g.is_sparse:
        return g._version
    return int(g.detach().contiguous().view(bits).sum(dtype=torch.int64))


def _partition(params: list[torch.Tensor], world: int) -> dict[int, int]:
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


def _hooked(p: torch.Tensor) -> bool:
    return bool(getattr(p, "_backward_hooks", None)) or bool(getattr(p, "_post_accumulate_grad_hooks", None))


class OverlapOptimizer(torch.optim.Optimizer):
    """`opt` stepped off the critical path of a `Pipeline` (see the module docstring).

    It shares `param_groups`, `state` and `defaults` with the optimizer it wraps, so LR
    schedulers and checkpoints see one optimizer; use it, not the wrapped one, in the loop.
    """

    def __init__(self, pipeline: Any, optimizer: torch.optim.Optimizer, mode: str,  # noqa: D107
                 shard: bool = False) -> None:
        # Optimizer.__init__ is not called: this object owns no parameters of its own.
        if mode not in ("sync", "async"):
            raise MobiusError(f"overlap mode={mode!r}; use 'sync' (exact: stages stepped during backward), 'async' "
                              f"(staleness 1, as RoundPipe) or 'none' (serial, after backward)")
        if isinstance(optimizer, OverlapOptimizer):
            raise MobiusError("this optimizer is already overlapped with a pipeline; pass the torch optimizer itself")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise MobiusError(f"pipe.overlap needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise MobiusError("LBFGS re-evaluates the loss over all parameters in its step (a closure), so it cannot "
                              "step stage by stage or one step late; use it without pipe.overlap")
        reducer = pipeline._rt.reducer if shard else None
        if shard and reducer is None:
            raise MobiusError("shard=True divides the optimizer over the ranks of a data-parallel run, but this "
                              "pipeline has none: compile with process_group=... (or under an initialised "
                              "torch.distributed with several ranks), or use shard=False")
        if shard and mode != "sync":
            raise MobiusError(f"shard=True steps each rank's share of the parameters and then gathers them, which "
                              f"mode={mode!r} does not do; use mode='sync' with shard=True")
        self.inner = optimizer
        self.mode = mode
        self.shard = shard
        self._reducer = reducer
        self.owned = 0  # parameters this rank steps (shard=True; else all)
        self.defaults = optimizer.defaults
        self.state = optimizer.state
        self.param_groups = optimizer.param_groups
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self._optimizer_state_dict_pre_hooks: dict = {}
        self._optimizer_state_dict_post_hooks: dict = {}
        self._optimizer_load_state_dict_pre_hooks: dict = {}
        self._optimizer_load_state_dict_post_hooks: dict = {}
        self._pipeline = pipeline
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        # sync: a worker adds downloaded gradients into .grad, another steps the parameters.
        self._adder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mobius-grads")
        self._stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mobius-optimizer")
        self._adds: list[Future] = []
        self._steps: list[Future] = []
        self._stepped: set[int] = set()  # ids of parameters stepped during this round's backward
        self._nodes: dict[int, Any] = {}  # id(param) -> its AccumulateGrad node
        self._serial: str | None = None  # why sync mode steps serially (None: it overlaps)
        self._probing = mode == "sync"  # the first round runs serially and watches the loop
        self._backwards = 0  # backward passes since the last step()
        self.stepped_in_backward = 0  # parameters the last step() found already stepped during backward
        self._after_backward: dict[int, tuple[Any, int]] = {}  # id(p) -> (its .grad, version) when backward ended
        # async: per parameter a shadow the update is written into while the model runs on the old weights
        self._shadows: dict[int, nn.Parameter] = {}
        self._flight: Future | None = None
        self._flight_params: list[torch.Tensor] = []
        if shard:
            self._owners = _partition(self._params(), reducer.world)
            reducer.owners = self._owners
            self.owned = sum(1 for r in self._owners.values() if r == reducer.rank)
        else:
            self.owned = len(self._params())

    # ------------------------------------------------------------------ the wrapped optimizer's face
    def __repr__(self) -> str:
        return f"OverlapOptimizer(mode={self.mode!r}, {self.inner!r})"

    def __getstate__(self) -> dict:
        raise MobiusError("an OverlapOptimizer holds worker threads; save opt.state_dict() instead of pickling it")

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._wait_adds()
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        self.synchronize()
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.synchronize()
        self.inner.load_state_dict(state_dict)
        self.state = self.inner.state

    def add_param_group(self, param_group: dict) -> None:
        self.synchronize()
        self.inner.add_param_group(param_group)

    # ------------------------------------------------------------------ the pipeline's side (sync)
    def backward_started(self) -> None:
        """A backward pass of the pipeline begins (first stage backward of a step)."""
        self._backwards += 1
        if self._backwards > 1 and self.mode == "sync":
            self._serialize("two backward passes came before one opt.step() (gradient accumulation): a stage cannot "
                            "be stepped before its gradients are summed over them",
                            refuse=bool(self._stepped))

    def overlapping(self) -> bool:
        """Whether this backward steps stages as their gradients complete."""
        return self.mode == "sync" and self._serial is None and not self._probing and self._error is None

    def wants(self, p: torch.Tensor) -> bool:
        """Whether `p` can be stepped now, during the backward that runs: it is one of this
        optimizer's parameters, this backward accumulates into its `.grad`, and no hook on it
        expects autograd to do so."""
        if torch.is_grad_enabled():  # backward(create_graph=True): autograd builds on the gradients it accumulates
            return False
        node = self._nodes.get(id(p))
        if node is None:
            if not any(q is p for q in self._params()):
                return False
            node = self._nodes[id(p)] = _accumulator(p)
        return not _hooked(p) and _engine_accumulates(node)

    def ready(self, groups: list[tuple[torch.Tensor, list[Callable[[], torch.Tensor]]]]) -> None:
        """Gradients of these masters are complete (each: the thunks giving its host gradient
        from every stage that holds it, in the order the runtime summed them): add them into
        `.grad` and step them, on the workers."""
        params = [p for p, _ in groups]
        self._stepped.update(id(p) for p in params)

        def add() -> None:
            with torch.no_grad():
                for p, thunks in groups:
                    total = None
                    for thunk in thunks:
                        g = thunk()
                        if g is None:  # data parallel: no rank had a gradient for it
                            continue
                        if total is None:
                            total = g.to(device=p.device, dtype=p.dtype)
                        else:
                            total.add_(g.to(p.dtype))
                    if total is None:
                        continue
                    if p.grad is None:
                        p.grad = total
                    else:
                        p.grad.add_(total)

        added = self._adder.submit(self._guarded, add)
        self._adds.append(added)
        self._steps.append(self._stepper.submit(self._guarded, lambda: (added.result(), self._step_only(params))))

    def backward_done(self) -> None:
        """End of a backward pass: every `.grad` is final when it returns."""
        self._wait_adds()
        self._after_backward = {id(p): (p.grad, p.grad._version, _fingerprint(p.grad) if self._probing else None)
                                for p in self._params() if p.grad is not None}

    def aborted(self, e: BaseException) -> None:
        self._backwards = max(0, self._backwards - 1)  # a backward that failed does not count
        if self._stepped and hasattr(e, "add_note"):
            e.add_note(f"[mobius_fx] pipe.overlap(mode='sync') had already stepped {len(self._stepped)} parameters of "
                       f"stages whose backward finished before the error; their new weights stay")

    # ------------------------------------------------------------------ workers
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

    def _step_only(self, params: list[torch.Tensor], groups: list[dict] | None = None) -> None:
        """Step the wrapped optimizer over `params` only (optionally with the hyper-parameters
        of `groups`, a snapshot of param_groups taken when the step was launched)."""
        want = {id(p) for p in params}
        inner = self.inner
        public = inner.param_groups
        source = groups if groups is not None else public
        inner.param_groups = [{**g, "params": [p for p in g["params"] if id(p) in want]} for g in source]
        try:
            inner.step()
        finally:
            inner.param_groups = public

    # ------------------------------------------------------------------ the loop's side
    def _serialize(self, why: str, refuse: bool = False) -> None:
        if refuse:
            raise MobiusError(f"pipe.overlap(mode='sync'): {why}. This step's stages were already stepped during "
                              f"backward with the gradients it produced. Use mode='async' (which steps after your "
                              f"changes) or mode='none', or keep the loop as it was in its first step")
        if self._serial is None:
            self._serial = why
            log.warning("pipe.overlap(mode='sync') steps the optimizer serially after backward from now on: %s", why)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Finish this step's update (sync) or launch it (async); see the module docstring."""
        if closure is not None:
            raise MobiusError("pipe.overlap's optimizer takes no closure: the pipeline's backward already computed the "
                              "gradients; call loss.backward() and then opt.step()")
        if self.mode == "async":
            return self._step_async()
        steps, self._steps = self._steps, []
        for f in steps:
            f.result()
        self._wait_adds()
        now = {id(p): p for p in self._params()}
        changed = [i for i, (g, v, f) in self._after_backward.items()
                   if i not in now or now[i].grad is not g or g._version != v or (f is not None and _fingerprint(g) != f)]
        stepped, self._stepped = self._stepped, set()
        self.stepped_in_backward = len(stepped)
        backwards, self._backwards = self._backwards, 0
        self._after_backward = {}
        if changed:
            self._serialize(f"{len(changed)} gradients changed between the end of backward and opt.step() "
                            f"(clip_grad_norm_, GradScaler.unscale_, or code that edits .grad): every gradient "
                            f"is needed before any update", refuse=bool(stepped))
        if self._probing and backwards:
            self._probing = False
            if self._serial is None:
                log.info("pipe.overlap(mode='sync'): the first step ran serially; from the next one, stages are "
                         "stepped during backward as their gradients complete")
        rest = [p for p in self._params() if id(p) not in stepped and p.grad is not None]
        if rest:
            self._step_only(rest)
        if self.shard:
            self._gather()
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

    def _step_async(self) -> None:
        self._finish_flight()
        params = [p for p in self._params() if p.grad is not None]
        if not params:
            return
        shadows = []
        for p in params:
            q = self._shadows.get(id(p))
            if q is None or q.shape != p.shape or q.dtype != p.dtype:
                q = self._shadows[id(p)] = nn.Parameter(torch.empty_like(p, memory_format=torch.preserve_format),
                                                        requires_grad=p.requires_grad)
            q.grad, p.grad = p.grad, None  # the next backward accumulates into a fresh .grad (double buffer)
            shadows.append(q)
        ids = {id(p) for p in params}
        groups = [{**g, "params": [self._shadows[id(p)] for p in g["params"] if id(p) in ids]}
                  for g in self.param_groups]
        state = self.inner.state
        for p, q in zip(params, shadows):
            if p in state:
                state[q] = state.pop(p)

        def update() -> None:
            with torch.no_grad():
                for p, q in zip(params, shadows):
                    q.copy_(p)  # w(t); the model keeps running on p meanwhile
            self._step_only(shadows, groups)

        self._flight_params = params
        self._flight = self._stepper.submit(self._guarded, update)

    def _finish_flight(self) -> None:
        """Wait for the async update in flight and make it the model's weights."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        flight.result()
        params, self._flight_params = self._flight_params, []
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

    def synchronize(self) -> None:
        """Wait for the optimizer work in flight and leave the model with the newest weights
        (async: the update launched by the last `step()`)."""
        for f in self._steps:
            f.result()
        self._wait_adds()
        self._finish_flight()

    def close(self) -> None:
        self.synchronize()
        self._adder.shutdown()
        self._stepper.shutdown()

