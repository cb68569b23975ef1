"""The training step with its loss on the last stage: `compile(..., loss_fn=fn)` and
`pipe.train_step(*args, target=y, **kwargs)`.

The vocabulary logits of an LLM are its largest activation (fp32, as large as the weights at
batch 16 for Llama-8B); an output nobody asked for must not cross PCIe. So the step is compiled
as its own pipeline over `LossModel(model, loss_fn)`: the model's forward followed by the loss,
traced as one graph, so the loss is computed by the stage that computes the logits and only the
scalar leaves the GPUs. torch.distributed.pipelining (`schedule.step(x, target=y)`), DeepSpeed
(`PipelineModule(loss_fn=...)`) and RoundPipe (`forward_backward(..., loss_fn=...)`) do the same.

- `loss_fn(outputs, target)` returns a scalar; without one, the loss is the model's own: an
  output's `.loss` / `["loss"]` (HF models called with `labels=`) or the output itself when it is
  0-dim.
- The micro-batch losses combine as compile's analysis of the step's graph says
  (runtime/microbatch_outputs.py): a mean loss is averaged over the micro-batches, a sum summed.
- The step pipeline shares the model pipeline's devices (one set of GPU budgets), its optimizer
  overlap, its data-parallel reducer and its host gradient storage: `pipe.overlap(opt)` steps the
  optimizer during `train_step` too, and `transfer_stats()` / `memory_stats()` see its traffic.

    pipe = mobius_fx.compile(model, topo, example_inputs=(x,), loss_fn=F.cross_entropy)
    loss = pipe.train_step(x, target=y)   # forward, loss, backward: .grad as loss.backward() leaves it
    opt.step()
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx
from torch import nn

from mobius_fx.errors import MobiusError

__all__ = ["LossModel", "TARGET", "StepCompiler", "model_loss"]

log = logging.getLogger("mobius_fx")

TARGET = "target"  # the keyword `train_step` passes the target as


def model_loss(out: Any) -> torch.Tensor:
    """The loss a model returns itself: `out.loss` / `out["loss"]` (HF models called with
    `labels=`), or `out` when it is a 0-dim tensor."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = None
    if isinstance(out, Mapping) and "loss" in out:
        loss = out["loss"]
    elif not isinstance(out, (torch.Tensor, torch.fx.Proxy)) and hasattr(out, "loss"):
        loss = out.loss
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 or isinstance(loss, torch.fx.Proxy):
        return loss
    what = (f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
            else f"a {type(out).__name__} without a 0-dim `loss`")
    raise MobiusError(f"train_step without loss_fn needs a model that returns its loss (an output with a 0-dim "
                      f"`.loss`, as HF models called with labels= do, or a 0-dim tensor), but the model returned "
                      f"{what}; compile with loss_fn=fn, where fn(outputs, target) returns a scalar, and call "
                      f"train_step(..., target=y), or pass the model's labels (train_step(ids, labels=ids))")


class LossModel(nn.Module):
    """`model`'s forward followed by its loss, traced as one graph.

    Its `forward` takes the model's arguments (the same signature, so the tracers and the call
    binding read it as they read the model's) plus the keyword `target` when `loss_fn` is given,
    and returns the 0-dim loss. Its parameters and buffers are the model's own tensors (under
    `model.`): the pipeline streams and steps the user's masters, nothing is copied. The runtime's
    errors name them as the user does, without that prefix (`user_root`).
    """

    user_root = "model"

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        forward = self._make_forward()
        if forward is not None:  # a class of its own: torch.fx traces `type(root).forward`
            self.__class__ = type(f"LossModel[{type(model).__name__}]", (LossModel,), {"forward": forward})

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """For a model whose forward has no signature to copy: `target` is taken by keyword."""
        target = kwargs.pop(TARGET, None) if self.loss_fn is not None else None
        return self._loss(self.model(*args, **kwargs), target)

    def _make_forward(self) -> Callable[..., torch.Tensor] | None:
        try:
            sig = inspect.signature(self.model.forward)
        except (TypeError, ValueError):
            sig = None
        if sig is None or TARGET in sig.parameters:
            if self.loss_fn is not None and sig is not None:
                raise MobiusError(f"the model's forward has an argument named {TARGET!r}, which train_step uses for "
                                  f"the loss's target; rename it, or fold the loss into the model and call "
                                  f"train_step without loss_fn")
            return None
        params = list(sig.parameters.values())
        if self.loss_fn is not None:
            target = inspect.Parameter(TARGET, inspect.Parameter.KEYWORD_ONLY, default=None)
            at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
            params.insert(at, target)
        # A function with the model's own parameter list (the tracers read a signature's names,
        # kinds and defaults from the code object), calling the model as it was called.
        names, pass_args, defaults = ["self"], [], {}
        star = False
        for p in params:
            if p.kind is p.VAR_POSITIONAL:
                names.append(f"*{p.name}")
                pass_args.append(f"*{p.name}")
                star = True
                continue
            if p.kind is p.VAR_KEYWORD:
                names.append(f"**{p.name}")
                pass_args.append(f"**{p.name}")
                continue
            if p.kind is p.KEYWORD_ONLY and not star:
                names.append("*")
                star = True
            text = p.name if p.default is p.empty else f"{p.name}=__defaults[{p.name!r}]"
            if p.default is not p.empty:
                defaults[p.name] = p.default
            if p.kind is p.POSITIONAL_ONLY:
                names.append(text)
                pass_args.append(p.name)
                if not any(q.kind is q.POSITIONAL_ONLY for q in params[params.index(p) + 1:]):
                    names.append("/")
            elif p.name != TARGET or self.loss_fn is None:
                names.append(text)
                pass_args.append(f"{p.name}={p.name}" if p.kind is p.KEYWORD_ONLY else p.name)
            else:
                names.append(text)
        target_arg = TARGET if self.loss_fn is not None else "None"
        src = (f"def forward({', '.join(names)}):\n"
               f"    return self._loss(self.model({', '.join(pass_args)}), {target_arg})\n")
        scope: dict[str, Any] = {"__defaults": defaults}
        exec(compile(src, f"<mobius_fx train_step of {type(self.model).__name__}>", "exec"), scope)  # noqa: S102
        return scope["forward"]

    def _loss(self, out: Any, target: Any) -> torch.Tensor:
        if self.loss_fn is None:
            return model_loss(out)
        loss = self.loss_fn(out, target)
        if isinstance(loss, torch.fx.Proxy):  # torch.fx.symbolic_trace: no shape yet; the step checks
            return loss  # the loss it combines is one 0-dim tensor (runtime/step_output.py)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            what = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise MobiusError(f"loss_fn returned {what}; it must return a 0-dim tensor (the batch's loss, e.g. "
                              f"F.cross_entropy(out, target) with its default reduction='mean')")
        return loss


class StepCompiler:
    """Compiles and keeps the training-step pipeline of a compiled model: `LossModel(model,
    loss_fn)` compiled with the pipeline's own settings, on its devices, the first time a call
    needs it (or at compile, when the example can serve it). `compile_fn(wrapper, args, kwargs)`
    returns the step's `Pipeline`."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None,
                 compile_fn: Callable[[nn.Module, tuple, dict], Any]) -> None:
        if loss_fn is not None and not callable(loss_fn):
            raise MobiusError(f"loss_fn is a {type(loss_fn).__name__}, not callable; pass fn(outputs, target) "
                              f"returning a scalar (e.g. torch.nn.functional.cross_entropy)")
        self.wrapper = LossModel(model, loss_fn)
        self.loss_fn = loss_fn
        self._compile = compile_fn
        self.pipeline: Any = None

    def arguments(self, args: tuple, kwargs: dict, target: Any) -> tuple[tuple, dict]:
        """The step pipeline's call for `train_step(*args, target=target, **kwargs)`."""
        kwargs = dict(kwargs)
        if self.loss_fn is None:
            if target is not None:
                raise MobiusError("train_step got target= but the pipeline was compiled without loss_fn, so nothing "
                                  "would read it; compile with loss_fn=fn (fn(outputs, target) returns the loss), or "
                                  "pass the model's own labels (train_step(ids, labels=ids))")
        else:
            if target is None:
                raise MobiusError("train_step needs target= for the loss_fn the pipeline was compiled with: "
                                  "pipe.train_step(x, target=y)")
            kwargs[TARGET] = target
        return tuple(args), kwargs

    def get(self, args: tuple, kwargs: dict) -> Any:
        """The step pipeline, compiled on first use with this call as its example."""
        if self.pipeline is None:
            log.info("compiling the training step (%s on the last stage; only the loss leaves the GPUs)",
                     "loss_fn" if self.loss_fn is not None else "the model's own loss")
            self.pipeline = self._compile(self.wrapper, args, kwargs)
        return self.pipeline
