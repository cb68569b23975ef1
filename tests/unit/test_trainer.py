"""HF Trainer and accelerate over a compiled pipeline (issue 40 part 1; docs/trainer.md).

The acceptance run: a tiny HF GPT-2 trained by `PipelineTrainer` (clipping on, gradient
accumulation 2, bf16 autocast where the CPU has bf16 instructions, else fp32) logs the losses
of the same Trainer on the eager model for 20 steps, and its step-10 checkpoint resumes to the
same step-11 loss.

Tolerance, derived: the pipeline computes a step as eager computes it with the batch cut into
its micro-batches (gradients summed over them), so its losses may differ from the eager
whole-batch run by what cutting the batch alone changes. That is measured in the same test:
the eager Trainer run again with half the batch and twice the accumulation (same rows, same
order, the same step). The pipeline must stay within 4x that spread (at least 4 fp32 ulps of
the loss). Measured here: fp32 spread 9.5e-7, pipeline 4.8e-7; bf16 (+GA 2) spread 1.1e-4,
pipeline 1.3e-4.
"""

from __future__ import annotations

import copy
import inspect
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from accelerate.utils import extract_model_from_parallel  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import mobius_fx  # noqa: E402
from mobius_fx import MobiusError, Topology  # noqa: E402
from mobius_fx.runtime.overlap import OverlapOptimizer  # noqa: E402
from mobius_fx.trainer import PipelineTrainer  # noqa: E402
from mobius_fx.zoo import hf_gpt2  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, SEQ, VOCAB, BATCH = 40, 16, 100, 4


def _bf16_cpu() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class Rows(Dataset):
    def __init__(self) -> None:
        self.x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= self.step:
            control.should_training_stop = True


def _model():
    torch.manual_seed(0)
    model = hf_gpt2(layers=2, hidden=32, vocab=VOCAB, positions=SEQ)
    # GPT2LMHeadModel's name has no "ForCausalLM", so HF leaves its loss_type None and the eager
    # Trainer counts num_items_in_batch over unshifted labels (64 tokens for 60 targets): say it.
    model.loss_type = "ForCausalLM"
    return model


@pytest.fixture(scope="module")
def compiled():
    model = _model()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(ids,),
                             example_kwargs={"labels": ids}, microbatches=2, device="virtual", verbose=False)
    return pipe, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def pipe(compiled):
    pipe, start = compiled
    pipe.overlap(torch.optim.SGD(pipe.parameters(), lr=0.0), "none")  # detach an earlier test's overlap
    extract_model_from_parallel(pipe, keep_fp32_wrapper=False)  # and the autocast its Trainer's accelerate put on forward
    assert "_original_forward" not in pipe.__dict__
    pipe.model.load_state_dict(start)
    pipe.model.zero_grad(set_to_none=True)
    return pipe


def _args(out, **kw) -> TrainingArguments:
    base = dict(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=20, learning_rate=3e-3,
                warmup_steps=3, lr_scheduler_type="linear", max_grad_norm=1.0, use_cpu=True, report_to=[],
                logging_steps=1, save_steps=10, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    return TrainingArguments(**{**base, **kw})


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_pipeline_trainer_matches_eager_trainer_and_resumes(pipe, tmp_path, caplog):
    kw = dict(bf16=_bf16_cpu(), gradient_accumulation_steps=2)
    eager = Trainer(model=_model(), args=_args(tmp_path / "eager", **kw), train_dataset=Rows())
    eager.train()
    cut = Trainer(model=_model(), args=_args(tmp_path / "cut", per_device_train_batch_size=BATCH // 2,
                                             **{**kw, "gradient_accumulation_steps": 4}), train_dataset=Rows())
    cut.train()
    with caplog.at_level(logging.INFO, logger="mobius_fx"):
        trainer = PipelineTrainer(model=pipe, args=_args(tmp_path / "pipe", **kw), train_dataset=Rows())
        trainer.train()
    assert isinstance(trainer.optimizer.optimizer, OverlapOptimizer)  # accelerate's wrapper around the overlap
    assert "serially" in caplog.text  # clipping and accumulation need every gradient: said, then serial
    e, c, p = _losses(eager), _losses(cut), _losses(pipe_run := trainer)
    assert len(e) == len(p) == 20
    spread = max(abs(a - b) for a, b in zip(e, c))
    tol = 4 * max(spread, torch.finfo(torch.float32).eps * max(e))
    worst = max(abs(a - b) for a, b in zip(e, p))
    assert worst <= tol, (worst, tol, e, p)
    lr = [h["learning_rate"] for h in pipe_run.state.log_history if "learning_rate" in h]
    assert lr == [h["learning_rate"] for h in eager.state.log_history if "learning_rate" in h]  # the scheduler steps

    ckpt = tmp_path / "pipe" / "checkpoint-10"
    assert (ckpt / "config.json").is_file() and (ckpt / "model.safetensors").is_file()  # save_pretrained's
    again = PipelineTrainer(model=pipe, args=_args(tmp_path / "pipe", **kw), train_dataset=Rows(),
                            callbacks=[StopAt(11)])
    again.train(resume_from_checkpoint=str(ckpt))  # the model now holds step 20's weights: they must be reloaded
    assert _losses(again)[-1] == p[10]


def test_sync_overlap_steps_stages_during_backward_without_clipping(pipe, tmp_path):
    trainer = PipelineTrainer(model=pipe, args=_args(tmp_path, max_steps=3, max_grad_norm=0.0, save_strategy="no"),
                              train_dataset=Rows())
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert opt.mode == "sync" and opt._serial is None and opt.stepped_in_backward == len(list(pipe.parameters()))
    metrics = trainer.evaluate(eval_dataset=torch.utils.data.Subset(Rows(), range(8)))
    assert "eval_loss" in metrics  # label_names read off the model's class, not Pipeline's


def test_plain_trainer_takes_the_pipeline_and_saves_tied_weights(pipe, tmp_path):
    trainer = Trainer(model=pipe, args=_args(tmp_path, max_steps=2, save_strategy="no"), train_dataset=Rows())
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))  # safetensors refuses shared tensors: the tied lm_head is kept once
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "model.transformer.wte.weight" in saved and "model.lm_head.weight" not in saved
    pipe.load_state_dict(saved)  # strict: the tied name is filled from the kept one


def test_pipeline_face(pipe):
    model = pipe.model
    assert pipe.to("cpu") is pipe and pipe.to(torch.device("cpu")) is pipe and pipe.cpu() is pipe and pipe.to() is pipe
    for bad, text in ((lambda: pipe.to(torch.float16), "pipe.to(torch.float16)"), (lambda: pipe.to("cuda"), "'cuda'"),
                      (lambda: pipe.cuda(), "device(type='cuda')"), (lambda: pipe.to("cpu", torch.bfloat16), "'cpu'"),
                      (lambda: pipe.half(), "")):
        with pytest.raises(MobiusError, match="copies them to its GPUs itself") as e:
            bad()
        assert text in str(e.value)
    assert inspect.signature(pipe.forward) == inspect.signature(model.forward)
    assert pipe.config is model.config and pipe.main_input_name == "input_ids"
    assert pipe.generation_config is model.generation_config and pipe.accepts_loss_kwargs is False
    with pytest.raises(AttributeError):
        pipe.no_such_attribute
    state = pipe.state_dict()
    assert "model.lm_head.weight" not in state and "model.transformer.wte.weight" in state
    assert set(model.state_dict()) == {k.removeprefix("model.") for k in state} | {"lm_head.weight"}
    with pytest.raises(MobiusError, match="compiled pipeline"):
        PipelineTrainer(model=model, args=_args("unused"))


def test_accelerate_prepares_the_pipeline_with_device_placement(pipe):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    losses = {}
    for name, model in (("eager", _model()), ("cut", _model()), ("pipe", pipe)):
        AcceleratorState._reset_state(reset_partial_state=True)  # a Trainer test may have left bf16 in it
        acc = Accelerator(cpu=True)
        assert acc.mixed_precision == "no" and acc.device_placement
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if model is pipe:
            opt = pipe.overlap(opt, "sync")  # exact: stages stepped during backward from the second step
        m, o, dl = acc.prepare(model, opt, DataLoader(Rows(), batch_size=BATCH))
        assert m is model
        seen = []
        for step, batch in zip(range(3), dl):
            parts = 2 if name == "cut" else 1  # eager on the pipeline's micro-batches: the spread to allow
            total = 0.0
            for j in range(parts):
                loss = m(**{k: v.chunk(parts)[j] for k, v in batch.items()}).loss / parts
                acc.backward(loss)
                total += loss.item()
            o.step()
            o.zero_grad()
            seen.append(total)
        losses[name] = seen
    assert o.optimizer.stepped_in_backward == len(list(pipe.parameters()))
    e, c, p = losses["eager"], losses["cut"], losses["pipe"]
    tol = 4 * max(max(abs(a - b) for a, b in zip(e, c)), torch.finfo(torch.float32).eps * max(e))
    assert max(abs(a - b) for a, b in zip(e, p)) <= tol, (e, c, p)


def test_pipeline_trainer_steps_with_the_loss_on_the_last_stage(pipe, tmp_path):
    """Each Trainer step is the pipeline's training step: the last stage sends the host its loss
    (its fp32 sum and count per micro-batch), never the logits (2 x 16 x 100 fp32 per micro-batch)."""
    trainer = PipelineTrainer(model=pipe, args=_args(tmp_path, max_steps=2, save_strategy="no"), train_dataset=Rows())
    trainer.train()
    step = pipe.step_pipeline
    assert step is not None
    last = step.plan.num_stages - 1
    sent = {g: kinds.get("activation d2h", {}).get(last, {}).get("bytes", 0)
            for g, kinds in pipe.transfer_stats(last_step=True, by_stage=True).items()}
    assert sum(sent.values()) == 2 * 2 * 4  # per micro-batch the loss's fp32 sum and count (planning/loss_ratios.py)


def test_report_to_tensorboard_writes_the_losses(pipe, tmp_path):
    """`report_to="tensorboard"`: Trainer's TensorBoard callback logs the pipeline's training losses."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = tmp_path  # Trainer's TensorBoard callback writes under the output directory
    trainer = PipelineTrainer(model=pipe, args=_args(tmp_path, max_steps=3, save_strategy="no", report_to=["tensorboard"]),
                              train_dataset=Rows())
    trainer.train()
    runs = [p.parent for p in logs.rglob("events.out.tfevents.*")]
    assert runs, f"no event file under {logs}"
    acc = EventAccumulator(str(runs[0]))
    acc.Reload()
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert len(losses) == 3 and losses == pytest.approx(_losses(trainer), rel=1e-6)
