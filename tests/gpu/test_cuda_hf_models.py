"""HF models through `mobius_fx.compile(..., device="cuda")` against the same model run eagerly on
CUDA (skipped without CUDA; `compare` also runs on virtual GPUs, which is how its bounds were
checked on a machine without one).

Why: the first real GPU run failed in stage 0 of HF GPT-2 on a device constant fixed at trace
time ("index is on cpu"); the CPU stand-ins cannot see that, these tests can. Each model of the
HF zoo (mobius_fx/zoo/tiny_hf.TINY_HF: GPT-2, Llama, Mistral, Qwen2, OPT, BERT, T5), tiny and built from
its config class, is compiled onto min(2, CUDA devices) pipeline GPUs with four stages (fixed
`cuts`, so every model streams weights through its GPUs whatever the partitioner would pick),
two micro-batches, and compared with CUDA eager on the same inputs:

- fp32 (TF32 off): logits, loss and every weight gradient within `fp32_bound` in norm;
- bf16 streaming: within `bf16_roundings * 2**-8` of fp32 eager in norm, no gradient lost.

The bounds are first-order error bounds, not fitted: see `fp32_bound` and
tests.models.bf16_roundings. Both are far below what a real fault gives (a micro-batch's share
of a gradient missing is ~0.5 relative, an all-zero gradient 1).
"""

from __future__ import annotations

import copy

import pytest
import torch

import mobius_fx
from mobius_fx import Topology
from mobius_fx.zoo import TINY_HF

try:
    from tests.models import BF16_UNIT_ROUNDOFF, bf16_roundings
except ImportError:  # pragma: no cover
    from models import BF16_UNIT_ROUNDOFF, bf16_roundings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BATCH, SEQ, MICROBATCHES, STAGES = 4, 16, 2, 4
FP32_UNIT_ROUNDOFF = torch.finfo(torch.float32).eps / 2  # 2**-24


def hf_call(name: str, vocab: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded keyword inputs with labels, so every model returns a loss: token ids (T5: the
    decoder's labels, half as long; BERT: the ids as masked-LM labels)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (BATCH, SEQ), generator=g)
    if name == "t5":
        return {"input_ids": ids, "labels": torch.randint(1, vocab, (BATCH, SEQ // 2), generator=g)}
    return {"input_ids": ids, "labels": ids}


def fp32_bound(model: torch.nn.Module, microbatches: int) -> float:
    """Relative error in norm allowed between two fp32 runs of `model` that may sum in other
    orders (the pipeline's micro-batches, the exported graph's kernels against the modules').
    A sum of K terms is within K u of exact (Higham's gamma_K, u = 2**-24), so two orders within
    2 K u of each other, per rounding step on the longest path (`bf16_roundings` counts those
    steps). K is the longest reduction here: the tokens of a batch (weight gradients), the
    vocabulary (softmax, the head) or the widest weight dimension."""
    k = max([BATCH * SEQ, model.config.vocab_size] + [max(p.shape) for p in model.parameters()])
    return 2 * bf16_roundings(model, microbatches) * k * FP32_UNIT_ROUNDOFF


def _cuts(model, topo, call) -> list[int]:
    """Four even stages over the plan's layers (`plan(..., cuts=[])` lists them)."""
    layers = len(mobius_fx.plan(model, topo, example_inputs=(), example_kwargs=call, cuts=[],
                                microbatches=MICROBATCHES, verbose=False).layers)
    return sorted({round(i * layers / STAGES) for i in range(1, STAGES)} - {0})


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}


def rel_err(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """||got - want|| / max(||want||, floor) (the bare error when both are 0)."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    scale = max(float(torch.linalg.vector_norm(want)), floor)
    err = float(torch.linalg.vector_norm(got - want))
    return err / scale if scale > 0 else err


def gradient_floor(grads: dict[str, torch.Tensor]) -> float:
    """The RMS of the gradients' norms: the scale a gradient that is zero in exact arithmetic is
    judged at. BERT's key bias is one (softmax ignores a shift shared by every key, so its
    gradient cancels to rounding noise, ~1e-9 in fp32): relative to its own norm any two runs
    differ by ~1, while their errors are those of the terms that cancelled."""
    norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads.values()])
    return float(norms.pow(2).mean().sqrt())


def compare(name: str, *, device: str = "cuda", dtype: torch.dtype | None = None) -> dict[str, float]:
    """Compile HF zoo model `name` onto `device` ("cuda"; "virtual" on the CPU), run one
    forward and backward, and return each figure's relative error in norm against eager fp32 on
    the same device type (eager on cuda:0 for "cuda"): "logits", "loss" and "grad <name>" (each
    gradient against at least `gradient_floor`).
    Raises AssertionError when a gradient is missing or all-zero where eager's is not."""
    torch.manual_seed(0)
    model = TINY_HF[name]()
    model.train()
    call = hf_call(name, model.config.vocab_size)
    eager_dev = "cuda" if device == "cuda" else "cpu"
    reference = copy.deepcopy(model).to(eager_dev)
    want = reference(**{k: v.to(eager_dev) for k, v in call.items()})
    want.loss.backward()
    want_grads = _grads(reference)
    gpus = min(2, torch.cuda.device_count()) if device == "cuda" else 2
    topo = Topology.virtual(gpus=gpus, memory="1GiB")
    pipe = mobius_fx.compile(model, topo, example_inputs=(), example_kwargs=call, microbatches=MICROBATCHES,
                             cuts=_cuts(model, topo, call), dtype=dtype, device=device, verbose=False)
    assert pipe.plan.num_stages >= 3, pipe.plan.summary()  # weights stream through the GPUs
    got = pipe(**call)
    got.loss.float().backward()
    got_grads = _grads(model)
    assert got_grads.keys() == want_grads.keys()
    errs = {"logits": rel_err(got.logits, want.logits), "loss": rel_err(got.loss, want.loss)}
    floor = gradient_floor(want_grads)
    for n, g in got_grads.items():
        assert g.count_nonzero() > 0 or want_grads[n].count_nonzero() == 0, f"{name}: {n}: all-zero gradient"
        errs[f"grad {n}"] = rel_err(g, want_grads[n], floor)
    return errs


def _within(errs: dict[str, float], bound: float, what: str) -> None:
    over = {k: f"{v:.3g}" for k, v in errs.items() if not v <= bound}
    assert not over, f"{what}: relative error in norm above {bound:.3g}: {over}"


@pytest.mark.parametrize("name", list(TINY_HF))
def test_hf_model_on_the_cuda_pipeline_equals_cuda_eager_in_fp32(name):
    errs = compare(name)
    _within(errs, fp32_bound(TINY_HF[name](), MICROBATCHES), f"{name} fp32")


@pytest.mark.parametrize("name", list(TINY_HF))
def test_hf_model_on_the_cuda_pipeline_in_bf16_is_close_to_cuda_eager_fp32(name):
    errs = compare(name, dtype=torch.bfloat16)
    _within(errs, bf16_roundings(TINY_HF[name](), MICROBATCHES) * BF16_UNIT_ROUNDOFF, f"{name} bf16")
