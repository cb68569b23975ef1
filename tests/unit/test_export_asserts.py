"""Export's `_assert_tensor_metadata` nodes record the trace-time dtype and device of a value
before each `.to`; the pipeline changes both on purpose (bf16 streaming, autocast, a stage's
GPU), so they are erased from the graph (export_front._drop_metadata_asserts). Found on the
CPU too: HF Llama in bf16 failed its first call with "Tensor dtype mismatch! Expected: Float"."""

from __future__ import annotations

import torch

from mobius_fx.zoo import TINY_HF
from tests.gpu.test_cuda_hf_models import BF16_UNIT_ROUNDOFF, MICROBATCHES, bf16_roundings, compare


def test_llama_in_bf16_runs_and_is_close_to_eager_fp32_on_virtual_gpus():
    errs = compare("llama", device="virtual", dtype=torch.bfloat16)
    bound = bf16_roundings(TINY_HF["llama"](), MICROBATCHES) * BF16_UNIT_ROUNDOFF
    over = {k: v for k, v in errs.items() if not v <= bound}
    assert not over, (bound, over)


def test_no_metadata_assert_is_left_in_an_exported_graph():
    from mobius_fx.tracing import trace

    model = TINY_HF["llama"]()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    gm = trace(model, example_inputs=(ids,))
    target = torch.ops.aten._assert_tensor_metadata.default
    left = [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes if n.target is target]
    assert not left
