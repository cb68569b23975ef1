"""Compiled variants: which compiled variant of a pipeline serves a call, and which calls it refuses.

A traced graph serves the call it was traced for (its arguments, dtypes, ranks, non-tensor
values and shapes: `call_signatures.py`, which also reads a call the way the model's `forward`
reads it). Nothing a call passes is ever dropped:

- A call the compiled graph serves runs on it (rearranged into the traced form).
- A call with other arguments (`attention_mask`, `labels=` ... given now but not at compile
  time, or the reverse, or another value of a flag), or with shapes the graph does not hold
  for, gets a *variant*: `mobius_fx.compile` traces and plans the model again for this call
  (cached per signature, at most `max_variants`; the plan's cuts are reused when they fit)
  and logs a warning saying so. A pipeline without a compile behind it (`build_pipeline`), or
  with `max_variants` variants already, raises `MobiusError` naming the argument or the
  dimension and the remedy.
- A call larger than the variant was planned for (a longer sequence, a bigger batch: more
  elements in an input than its example had) is re-costed on the same graph: the plan is kept
  when its stages still fit their GPUs, re-planned (and logged) when not.
- `labels` that ignore (-100) more tokens in one micro-batch than in another are warned about
  once when the loss is averaged over micro-batches (not eager's mean over tokens); a loss the
  graph returns as is, combined as one sum over one count (planning/loss_ratios.py), is exact.

`VariantPipeline` is the `Pipeline` that `build_pipeline` returns; between calls it shows the
variant of its last call (`plan`, `code`, `program`, `schedule`, `executed_ops()`); every
variant shares the pipeline's devices, so `memory_stats()` and `transfer_stats()` see them all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from mobius_fx.errors import MobiusError, PlanError, TraceError
from mobius_fx.planning.microbatch import batch_rows, check_divides, declared, divides
from mobius_fx.planning.plans import Plan
from mobius_fx.planning.stage_contract import Schedule
from mobius_fx.runtime.call_signatures import Call, CallForm, bind_call, check_shapes
from mobius_fx.runtime.engine import Runtime
from mobius_fx.runtime.pipeline import Pipeline
from mobius_fx.tracing import flatten_inputs, trace_info

__all__ = ["Variant", "VariantPipeline", "Recompiler", "StepSource"]

log = logging.getLogger("mobius_fx")


# ----------------------------------------------------------------------------- variants

@dataclass
class Variant:
    """A compiled pipeline for one call signature: the state a `Pipeline` runs, the form its
    example was traced in, and what it was planned for (`sizes`: elements per argument)."""

    gm: fx.GraphModule
    schedule: Schedule
    program: fx.GraphModule
    runtime: Runtime
    plan: Plan | None
    code: str
    form: CallForm | None
    key: tuple
    generic_key: tuple
    values: dict  # the example's arguments by name (for messages)
    sizes: dict
    layers: tuple = ()  # the plan's layer names and cuts, to reuse when they fit another call
    boundaries: tuple = ()

    @property
    def export(self) -> bool:
        return trace_info(self.gm).front_end == "export"

    def matches(self, call: Call) -> bool:
        return (self.key if self.export else self.generic_key) == (call.key if self.export else call.generic_key)

    def flat(self, call: Call) -> tuple[tuple, dict, list, list[str]]:
        args, kwargs = self.form.arrange(call) if self.form is not None else (call.args, call.kwargs)
        flat = flatten_inputs(self.gm, args, kwargs)
        labels = [f"input {i}" for i in range(len(flat))]
        if self.form is not None:
            paths = [p for p, _ in pytree.tree_flatten_with_path((args, kwargs))[0]]
            if len(paths) == len(flat):
                labels = [self.form.label(p) for p in paths]
        return args, kwargs, flat, labels

    def covers(self, call: Call) -> bool:
        return all(n <= self.sizes.get(name, 0) for name, n in call.sizes.items())


class Recompiler(Protocol):
    """What compiles a pipeline's variants (`mobius_fx.compile` gives one; without it, a call the
    compiled variants do not serve is refused): `variant` traces and plans the model for `call`
    and adds it; `replan` costs a larger call again on variant `like`'s graph (returning `like`
    when its plan still fits, else a new variant when `allow_new`)."""

    def variant(self, pipe: VariantPipeline, call: Call) -> Variant: ...

    def replan(self, pipe: VariantPipeline, like: Variant, call: Call, *, allow_new: bool = True) -> Variant: ...


class StepSource(Protocol):
    """What gives a pipeline its training step (`Pipeline.train_step`; mobius_fx/train_step.py's
    `StepCompiler`): `arguments` turns a `train_step` call into the step pipeline's call, `get`
    returns that pipeline (compiled at its first use), `pipeline` the one compiled so far."""

    pipeline: Pipeline | None

    def arguments(self, args: tuple, kwargs: dict, target: object) -> tuple[tuple, dict]: ...

    def get(self, args: tuple, kwargs: dict) -> Pipeline: ...


class VariantPipeline(Pipeline):
    """A `Pipeline` that serves each call with the compiled variant for its signature (see the
    module docstring); its attributes are those of the variant its last call ran. Built complete
    by `build_pipeline`: `recompiler` compiles the variants of other calls (none: refused), at
    most `max_variants` in all; `step` gives `train_step` its step pipeline (none: refused)."""

    def __init__(self, *args: object, recompiler: Recompiler | None = None, max_variants: int = 1,
                 step: StepSource | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "_variants", [])
        object.__setattr__(self, "_recompiler", recompiler)
        object.__setattr__(self, "max_variants", max_variants)
        if step is not None:  # read by Pipeline.train_step
            object.__setattr__(self, "_step", step)

    # -- set up by build_pipeline, and by the Recompiler as it adds a variant
    def _add_variant(self, example_args: tuple, example_kwargs: dict | None, layers: tuple = (),
                     boundaries: tuple = (), state: Pipeline | None = None) -> Variant:
        src = state if state is not None else self
        call = bind_call(self.model, tuple(example_args), dict(example_kwargs or {}))
        v = Variant(src._gm, src.schedule, src.program, src._rt, src.plan, src.code,
                    CallForm.of(self.model, tuple(example_args), dict(example_kwargs or {})),
                    call.key, call.generic_key, call.values, dict(call.sizes), tuple(layers), tuple(boundaries))
        self._variants.append(v)
        return v

    def _use(self, v: Variant) -> None:
        old = self._rt
        if v.runtime is not old:  # the optimizer overlap, the data-parallel reducer and the kept host
            # gradient storage (one fp32 buffer per master, not one per variant) follow the call
            v.runtime.overlap, v.runtime.reducer, v.runtime.grad_homes = old.overlap, old.reducer, old.grad_homes
        for attr, value in (("_gm", v.gm), ("schedule", v.schedule), ("program", v.program), ("_rt", v.runtime)):
            object.__setattr__(self, attr, value)
        self.plan, self.code = v.plan, v.code

    @property
    def variants(self) -> list[Variant]:
        """The compiled variants, the one traced at compile time first."""
        return list(self._variants)

    # -- a call
    def forward(self, *args: object, **kwargs: object) -> Any:
        if not self._variants:  # built without an example: the call as given
            return super().forward(*args, **kwargs)
        with self._one_call():  # a second call is refused before it selects (and switches to) a variant
            call = bind_call(self.model, args, kwargs)
            v = self._select(call)
            self._use(v)
            self._check_labels(call, v)
            a, k, _, _ = v.flat(call)
            return self._forward(a, k)

    def _check_labels(self, call: Call, v: Variant) -> None:
        """Warn (once) when `labels` ignores (-100, HF's ignore_index) more tokens in one
        micro-batch than in another and the variant `v` averages the micro-batches' losses, which
        then differs from eager's mean over all the batch's tokens; not when its loss is combined
        as one sum over one count (planning/loss_ratios.py: output kind "ratio")."""
        m, labels = self.schedule.microbatches, call.values.get("labels")
        if "ratio" in (getattr(v.runtime, "output_kinds", None) or []):
            return
        if m <= 1 or getattr(self, "_warned_labels", False) or not isinstance(labels, torch.Tensor):
            return
        if labels.is_floating_point() or labels.dim() == 0 or not divides(labels.size(0), m):
            return
        parts = labels.split(labels.size(0) // m)
        counts = [int((part == -100).sum()) for part in parts]
        # a causal LM's loss shifts the labels (each row's first label predicts nothing): count
        # those it uses too, so left padding ignored unevenly after the shift is warned about
        shifted = [int((part[..., 1:] == -100).sum()) for part in parts] if labels.dim() > 1 else counts
        if len(set(counts)) > 1 or len(set(shifted)) > 1:
            object.__setattr__(self, "_warned_labels", True)
            told = " / ".join(map(str, counts)) + ("" if len(set(counts)) > 1 else
                                                   f" (after each row's first label: {' / '.join(map(str, shifted))})")
            log.warning("mobius_fx: labels ignore (-100) %s tokens in the %d micro-batches: the pipeline's loss is the "
                        "mean of the micro-batch losses, which differs from eager's mean over the whole batch's tokens "
                        "(and so do the gradients); ignore as many tokens in each micro-batch, or compile with "
                        "microbatches=1 for eager's loss", told, m)

    def _select(self, call: Call) -> Variant:
        m = self.schedule.microbatches
        rows = batch_rows((call.args, call.kwargs), m, declared(self.model, call.args, call.kwargs, self._rt.batch_dims))
        rule = getattr(self.plan, "microbatches_rule", "")
        chosen = (f"; microbatches={m} was not given but chosen ({rule}): compile with a microbatches= that "
                  f"divides every batch you call with (1 always does), or drop a partial last batch "
                  f"(DataLoader(..., drop_last=True))") if rule else ""
        check_divides(rows, m, remedy=lambda: f"use a batch size that is a multiple of {m}{chosen}")
        shape_error, holds = None, []
        for v in sorted((v for v in self._variants if v.matches(call)), key=lambda v: sum(v.sizes.values())):
            _, _, flat, labels = v.flat(call)
            error = check_shapes(v.gm, flat, labels)
            if error is not None:
                shape_error = shape_error or error
            elif v.covers(call):
                return v
            else:
                holds.append(v)
        if holds:  # larger than planned: costed again (without a compile behind, the runtime's books decide)
            return holds[-1] if self._recompiler is None else self._replan(holds[-1], call)
        if shape_error is not None:
            reason = shape_error
            remedy = "call with shapes the traced graph holds for (pad sequences to a length it was compiled for)"
        else:
            reason, remedy = self._difference(call)
        if self._recompiler is None:
            raise MobiusError(f"{reason}. This pipeline serves the call it was traced for (built by build_pipeline "
                              f"from one trace): {remedy}, or trace it with this call's arguments (example_inputs / "
                              f"example_kwargs); mobius_fx.compile traces a variant per call signature")
        if len(self._variants) >= self.max_variants:
            have = "; ".join(_signature_text(v.values) for v in self._variants)
            raise MobiusError(f"{reason}. The pipeline has its {len(self._variants)} compiled variant(s) "
                              f"(max_variants={self.max_variants}: {have}): {remedy}, or compile with a larger "
                              f"max_variants (a variant per call signature)")
        log.warning("mobius_fx: %s; compiling a variant of the pipeline for this call (%s), variant %d of at most "
                    "%d", reason, _signature_text(call.values), len(self._variants) + 1, self.max_variants)
        try:
            return self._recompiler.variant(self, call)
        except TraceError as e:
            raise MobiusError(f"{reason}; tracing the model for this call failed too, so the call is refused: "
                              f"{e}") from None

    def _replan(self, v: Variant, call: Call) -> Variant:
        grown = ", ".join(f"{n} {call.sizes[n]} elements (planned {v.sizes.get(n, 0)})"
                          for n in call.sizes if call.sizes[n] > v.sizes.get(n, 0))
        try:
            new = self._recompiler.replan(self, v, call, allow_new=len(self._variants) < self.max_variants)
        except PlanError as e:  # nothing fits (or no new variant allowed): the books say what overflows
            log.warning("mobius_fx: this call is larger than planned (%s) and runs on the plan as it is (the GPUs' "
                        "budgets are enforced: BudgetError if it does not fit): %s", grown, e)
            return v
        if new is v:
            log.info("mobius_fx: this call is larger than planned (%s); the plan's stages still fit their GPUs, "
                     "kept", grown)
        else:
            log.warning("mobius_fx: this call is larger than planned (%s) and the plan's stages do not fit their GPUs "
                        "with it; re-planned: %d stages (were %d), variant %d", grown, new.plan.num_stages,
                        len(v.boundaries) or v.plan.num_stages, len(self._variants))
        return new

    def _difference(self, call: Call) -> tuple[str, str]:
        """What this call gives that the first variant's example did not (or the reverse), and
        the remedy."""
        base = self._variants[0]
        ref = dict(base.key if base.export else base.generic_key)
        now = dict(call.key if base.export else call.generic_key)
        parts, remedies = [], []
        added = [n for n in now if n not in ref]
        missing = [n for n in ref if n not in now]
        changed = [n for n in now if n in ref and now[n] != ref[n]]
        if added:
            parts.append(f"{_names(added)} {'is' if len(added) == 1 else 'are'} given in this call but "
                         f"{'was' if len(added) == 1 else 'were'} not when the pipeline was traced (its example "
                         f"gave {_names(list(ref)) or 'no arguments'})")
            remedies.append(f"give {_names(added)} at compile time too (example_kwargs={{{added[0]!r}: ...}})")
        if missing:
            parts.append(f"{_names(missing)} {'was' if len(missing) == 1 else 'were'} given when the pipeline was "
                         f"traced but not in this call")
            remedies.append(f"pass {_names(missing)} as the example did")
        for n in changed:
            parts.append(f"{n} is {_what(now[n])} here; the pipeline was traced with {_what(ref[n])}")
        if changed:
            remedies.append(f"pass {_names(changed)} as the example did")
        reason = "; ".join(parts) or "this call's arguments differ from the traced example's"
        return reason, " and ".join(remedies) or "call it with the example's arguments"


def _names(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _signature_text(values: dict) -> str:
    parts = []
    for n, v in values.items():
        if isinstance(v, torch.Tensor):
            parts.append(f"{n}={tuple(v.shape)}")
        elif any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(v)):
            parts.append(f"{n}=...")
        else:
            parts.append(f"{n}={v!r}")
    return ", ".join(parts) or "no arguments"


def _what(desc: object) -> str:
    """One argument's entry of a `Call.key` in words (a 2-D int64 tensor, a value, a structure)."""
    leaves = desc[1]
    if len(leaves) == 1 and leaves[0][0] == "tensor":
        return f"a {leaves[0][2]}-D {leaves[0][1]} tensor" if len(leaves[0]) > 1 else "a tensor"
    if len(leaves) == 1:
        return repr(leaves[0][1])
    return f"a structure of {len(leaves)} values"
