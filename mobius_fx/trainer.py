"""HF `Trainer` over a compiled pipeline (docs/trainer.md).

A plain `transformers.Trainer(model=pipe, ...)` already trains a pipeline
(`runtime/model_face.py`: `.to()` its own device, the model's forward signature and config),
with its optimizer stepped serially after backward and checkpoints holding `pipe.state_dict()`.
`PipelineTrainer` is that Trainer with what the plain route cannot give:

- the optimizer Trainer builds (or the one passed in `optimizers=`) is stepped through
  `pipe.overlap(opt, mode)` (`optimizer_overlap`, default "sync"); the LR scheduler is built
  on the overlapped optimizer, whose `param_groups` are the wrapped optimizer's (one set of
  groups, stepped by both). Under "sync" the first step runs serially and watches the loop:
  gradient clipping (`max_grad_norm > 0`) and gradient accumulation (`gradient_accumulation_steps
  > 1`) each need every gradient before any update, so from the second step the optimizer steps
  serially after backward (said once in the `mobius_fx` log); with neither, stages are stepped
  during backward. "async" (staleness 1) overlaps with both; "none" steps serially.
- checkpoints (`save_steps`, `save_model`) are the wrapped model's `save_pretrained` (an HF
  model or PEFT directory that `from_pretrained` reads), and `resume_from_checkpoint` /
  `load_best_model_at_end` load them back into the model whose masters the pipeline streams.
- each training step is the pipeline's (`pipe.train_step`): the loss on the last stage, only the
  loss leaving the GPUs (Trainer's own route where a loss scaler or a custom loss needs it).
- `label_names` and `can_return_loss` read off the wrapped model's class (Trainer reads them off
  the class of `model`, which is `Pipeline`), so evaluation computes the loss.

bf16: `args.bf16=True` puts Trainer's CPU autocast around the call; a pipeline compiled
without `dtype=` runs each stage under the caller's autocast for the stage's device type
(virtual GPUs: "cpu", the same numerics as the eager Trainer), and one compiled with
`dtype=torch.bfloat16` runs its own autocast on its GPUs whatever Trainer does (use this on
CUDA: bf16 weight copies are streamed, and Trainer's CPU autocast does not reach CUDA stages).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from transformers import Trainer
from transformers.utils.generic import can_return_loss, find_labels

from mobius_fx.errors import MobiusError
from mobius_fx.kinds import OVERLAP_MODES
from mobius_fx.runtime.overlap import OverlapOptimizer
from mobius_fx.runtime.pipeline import Pipeline

__all__ = ["PipelineTrainer", "PipelineTrainerMixin"]


class PipelineTrainerMixin:
    """What `PipelineTrainer` adds to a Trainer, for any Trainer subclass (TRL's, say):
    `class PipelineSFTTrainer(PipelineTrainerMixin, SFTTrainer): pass`."""

    def __init__(self, model: Any = None, *args: Any, optimizer_overlap: str = "sync", **kwargs: Any) -> None:
        if not isinstance(model, Pipeline):
            raise MobiusError(f"PipelineTrainer(model=...) takes a compiled pipeline, got {type(model).__name__}; "
                              f"pass mobius_fx.compile(model, topology, example_inputs=...), or use "
                              f"transformers.Trainer for an eager model")
        if optimizer_overlap not in OVERLAP_MODES:
            raise MobiusError(f"PipelineTrainer(optimizer_overlap={optimizer_overlap!r}); use one of "
                              f"{', '.join(OVERLAP_MODES)}")
        self.optimizer_overlap = optimizer_overlap
        super().__init__(model, *args, **kwargs)
        inner = type(model.model)
        if self.args.label_names is None:
            self.label_names = find_labels(inner)
        self.can_return_loss = can_return_loss(inner)

    @property
    def pipeline(self) -> Pipeline:
        return self.model

    def create_optimizer(self, model: Any = None) -> Any:
        opt = super().create_optimizer(model)
        if self.optimizer_overlap != "none" and not isinstance(opt, OverlapOptimizer):
            opt = self.optimizer = self.pipeline.overlap(opt, self.optimizer_overlap)
        return opt

    def training_step(self, model: Any, inputs: dict, num_items_in_batch: Any = None) -> Any:
        """Trainer's step as the pipeline's training step (`pipe.train_step`): the model's loss on
        its last stage, so the logits never leave the GPUs; backward from the loss over the
        accumulation steps, as Trainer's own. Trainer's route (`compute_loss`, then
        `accelerator.backward`) where that cannot be: a loss scaler (fp16), a `compute_loss_func`,
        several devices, or a subclass that overrides `compute_loss`."""
        own = type(self).compute_loss is Trainer.compute_loss
        if (model is not self.pipeline or not own or self.compute_loss_func is not None or self.args.n_gpu > 1
                or getattr(self.accelerator, "scaler", None) is not None
                or self.pipeline.__dict__.get("_step") is None):
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        inputs = self._prepare_inputs(inputs)
        accumulate = self.current_gradient_accumulation_steps
        with self.compute_loss_context_manager():
            loss = self.pipeline._train_step((), dict(inputs), None, scale=1.0 / accumulate)
        return loss / accumulate

    @contextlib.contextmanager
    def _as_model(self) -> Iterator[Any]:
        """Trainer's save and load code run on the wrapped model (the pipeline streams its masters)."""
        pipe, wrapped = self.model, self.model_wrapped
        self.model = pipe.model
        if wrapped is pipe:
            self.model_wrapped = pipe.model
        try:
            yield pipe.model
        finally:
            self.model, self.model_wrapped = pipe, wrapped

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is not None:  # pipe.state_dict() names: the model's under "model."
            state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
        with self._as_model():
            super()._save(output_dir, state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if model is not None and model is not self.model:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        with self._as_model() as inner:
            super()._load_from_checkpoint(resume_from_checkpoint, inner)

    def _load_best_model(self) -> None:
        with self._as_model():
            super()._load_best_model()


class PipelineTrainer(PipelineTrainerMixin, Trainer):
    """`transformers.Trainer` over a `Pipeline` (see the module docstring).

        pipe = mobius_fx.compile(model, topology, example_inputs=(ids,), example_kwargs={"labels": ids})
        trainer = PipelineTrainer(model=pipe, args=TrainingArguments(...), train_dataset=ds)
        trainer.train()
    """
