"""The face a `Pipeline` shows to code written for the model it wraps: HF `Trainer`,
`accelerate.Accelerator.prepare`, and what they read off a model (`mobius_fx/trainer.py` adds
the optimizer overlap and HF-format checkpoints; docs/trainer.md).

- `.to(device)` / `.cpu()` / `.cuda()` to a device the pipeline already lives on return the
  pipeline unchanged: the CPU, where its master weights are, and, for a pipeline compiled for
  CUDA, a CUDA device. A dtype, a memory format or any other device is refused (the pipeline
  copies the masters to its GPUs itself; cast or move the model before compiling).
- `forward`'s signature is the model's (`inspect.signature(pipe.forward)`), so Trainer's
  `remove_unused_columns` keeps the columns the model takes.
- `config`, `generation_config`, `main_input_name`, `name_or_path`, `_keys_to_ignore_on_save`,
  `model_tags` and `save_pretrained` are the wrapped model's, when it has them.
- `accepts_loss_kwargs = False`: Trainer then passes no `num_items_in_batch` (the pipeline
  combines its micro-batches' losses itself) and divides the loss by its gradient
  accumulation steps, as for any model whose forward takes no loss keywords.
- `activation_checkpointing_enable()` (Trainer's `activation_checkpointing=True`) is a no-op:
  every stage's forward is recomputed in its backward already.
- `state_dict()` holds a tied weight once (the first name `named_parameters()` gives it), so
  safetensors can save it; `load_state_dict` fills the other names from it.
"""

from __future__ import annotations

import inspect
import logging
import types
from typing import Any

import torch
from torch import nn

from mobius_fx.errors import MobiusError

__all__ = ["ModelFace", "PASSTHROUGH"]

log = logging.getLogger("mobius_fx")

# What code written for an HF model reads off it, read here off the wrapped model.
PASSTHROUGH = ("config", "generation_config", "main_input_name", "name_or_path", "_keys_to_ignore_on_save",
               "model_tags", "save_pretrained")


class ModelFace:
    """Mixed into `Pipeline` (an nn.Module with the user's model at `self.model`)."""

    accepts_loss_kwargs = False  # no `num_items_in_batch`: the pipeline combines micro-batch losses itself

    def _show_model(self, model: nn.Module) -> None:
        """Take on `model`'s forward signature and its state-dict names (called from __init__)."""
        try:
            sig = inspect.signature(model.forward)
        except (TypeError, ValueError):
            return
        self.__signature__ = sig
        run = type(self).forward
        forward = types.FunctionType(run.__code__, run.__globals__, run.__name__, run.__defaults__, run.__closure__)
        forward.__qualname__, forward.__doc__, forward.__kwdefaults__ = run.__qualname__, run.__doc__, run.__kwdefaults__
        this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        forward.__signature__ = sig.replace(parameters=[this, *sig.parameters.values()])
        # A bound method of a copy of forward, as accelerate's autocast wrapping and unwrapping expect
        # (model.forward.__func__); inspect.signature(pipe.forward) is the model's.
        self.__dict__["forward"] = types.MethodType(forward, self)
        self.register_state_dict_post_hook(_drop_aliases)
        self.register_load_state_dict_pre_hook(_fill_aliases)

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if name in PASSTHROUGH and model is not None and hasattr(model, name):
                return getattr(model, name)
            raise

    def activation_checkpointing_enable(self, *args: object, **kwargs: object) -> None:
        """A no-op (Trainer's `activation_checkpointing=True`): each stage's forward is already
        recomputed in its backward, from the stage's saved inputs."""
        log.info("activation checkpointing: a pipeline already recomputes each stage's forward in its backward; "
                 "nothing to enable")

    gradient_checkpointing_enable = activation_checkpointing_enable

    def _own_device(self, device: torch.device) -> bool:
        if device.type == "cpu":
            return True  # the master weights live there
        kinds = {d.torch_device.type for d in self._rt.devices.values()}
        return device.type == "cuda" and kinds == {"cuda"}

    def to(self, *args: object, **kwargs: object) -> Any:
        """A no-op to a device the pipeline lives on (see the module docstring); anything else is
        refused: the pipeline copies the master weights to its GPUs itself."""
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None and memory_format is None and (device is None or self._own_device(torch.device(device))):
            return self
        given = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        own = "the CPU" + (" or CUDA" if self._own_device(torch.device("cuda")) else "")
        raise MobiusError(f"pipe.to({given}): a Pipeline keeps the master weights on the CPU and copies them to its "
                          f"GPUs itself, so .to() takes only a device it lives on ({own}: a no-op) and no dtype or "
                          f"memory format; move or cast the model before compiling it, not the pipeline (for bf16 "
                          f"compute, compile with dtype=torch.bfloat16)")

    def cpu(self) -> Any:
        return self

    def cuda(self, device: int | str | torch.device | None = None) -> Any:
        return self.to(torch.device("cuda" if device is None else device if not isinstance(device, int)
                                    else f"cuda:{device}"))


def _aliases(pipe: nn.Module) -> dict[str, str]:
    """A tied tensor's other names -> the name `named_parameters()` (or buffers) keeps."""
    out: dict[str, str] = {}
    for named in (pipe.named_parameters, pipe.named_buffers):
        first: dict[int, str] = {}
        for name, t in named(remove_duplicate=False):
            if id(t) in first:
                out[name] = first[id(t)]
            else:
                first[id(t)] = name
    return out


def _drop_aliases(pipe: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    for alias in _aliases(pipe):
        state.pop(prefix + alias, None)


def _fill_aliases(pipe: nn.Module, state: dict, prefix: str, *rest: object) -> None:
    for alias, kept in _aliases(pipe).items():
        if prefix + alias not in state and prefix + kept in state:
            state[prefix + alias] = state[prefix + kept]
