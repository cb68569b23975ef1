"""The pipeline's side of the sync overlap (`GradHandover`, a part of `OverlapOptimizer`): the
runtime says when a backward starts and ends and hands over each stage's gradients as they
complete (`ready`); they go into `.grad` and the stage is stepped on the workers, unless the loop
or autograd shows the step must wait for every gradient. See mobius_fx/runtime/overlap.py."""

from __future__ import annotations

from typing import Any, Callable

import torch

from mobius_fx.errors import MobiusError
from mobius_fx.runtime.device_books import nbytes
from mobius_fx.runtime.host_counters import COUNTERS
from mobius_fx.runtime.overlap_watch import (
    WeakHook, accumulator, engine_accumulates, fingerprint, has_grad_hooks, hyper_params, pre_hooks,
)
from mobius_fx.runtime.host_gradients import sum_downloads

__all__ = ["GradHandover"]


class GradHandover:
    """`OverlapOptimizer`'s methods the pipeline's runtime calls during forward and backward."""

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
            self._deferring("opt.step() was not called between two backward passes (gradient accumulation, or a loop "
                            "that skips steps, e.g. on a non-finite loss): a stage cannot be stepped before it is known "
                            "that the step will be taken with these gradients", refuse=bool(self._stepped))

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
            node = self._nodes[id(p)] = accumulator(p)
        return id(p) not in self._outside and not has_grad_hooks(p) and engine_accumulates(node)

    def ready(self, groups: list[tuple[torch.Tensor, list[Callable[[], torch.Tensor]]]],
              finite: list[Callable[[], bool]] | None = None) -> None:
        """Gradients of these masters are complete (each: the thunks giving its host gradient
        from every stage that holds it, in the order the runtime summed them): put them in
        `.grad` and step them, on the workers. `finite`: thunks telling whether the gradients of
        the stages they came from are all finite, computed on the GPUs (None: read them here)."""
        params = [p for p, _ in groups]
        homes = self._pipeline._rt.grad_homes
        if self._defer is not None or pre_hooks(self.inner):
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

    def _hand(self, downloads: list[tuple[torch.Tensor, list[torch.Tensor]]], homes: Any) -> None:
        """The downloaded gradients into `.grad`: summed into the master's home (`GradHomes`)
        when `.grad` is None, else added into the `.grad` the loop kept (it accumulates)."""
        with torch.no_grad():
            for p, gs in downloads:
                fresh = p.grad is None
                total = sum_downloads(p, gs, homes if fresh else None)
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
        """End of a backward pass: every `.grad` is final when it returns."""
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
        if self._stepped and self._dirty is None:
            self._dirty = (f"a backward failed after {len(self._stepped)} parameters of the stages it had finished "
                           f"were stepped")
            if hasattr(e, "add_note"):
                e.add_note(f"[mobius_fx] pipe.overlap(mode='sync') had already stepped {len(self._stepped)} parameters "
                           f"of stages whose backward finished before the error; their new weights stay, and the "
                           f"next backward or opt.step() refuses until the state is reloaded")
