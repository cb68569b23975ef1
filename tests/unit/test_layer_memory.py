"""The memory terms of issue 26 part 5b: what annotate measures per layer on meta tensors
(`LayerCost.saved_bytes`, `peak_bytes`: `passes/annotate_layer_peaks.layer_peaks`), how the step model
sums them (`MemoryModel.footprint`), and what a stage's GPU holds for the stages around it
(`step_model.memory_rows`)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from mobius_fx.passes import annotate_layer_peaks as peaks
from mobius_fx.passes.annotate import annotate
from mobius_fx.passes.annotate_tools import LiveBytes
from mobius_fx.planning.step_memory import memory_rows, MemoryModel, stage_memory
from mobius_fx.tracing import trace
from tests.unit.test_step_model import layer

B, V = 8, 1000  # rows and classes of the loss below: an fp32 (B, V) tensor is 32 000 B
ROW = B * V * 4


class _Loss(nn.Module):
    """A head and its loss in one layer: cross_entropy keeps its log_softmax for backward,
    which no node's output shows."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, V, bias=False)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(x), t)


def test_live_bytes_counts_what_ops_make_while_it_lives_views_and_inputs_not():
    x = torch.empty(B, V, device="meta", requires_grad=True)
    t = torch.zeros(B, dtype=torch.long, device="meta")
    with LiveBytes() as books:
        y = F.cross_entropy(x.view(B, V).t().t(), t)  # views of the input: nothing new
        # the log_softmax autograd keeps, the scalar loss and nll_loss's total weight
        assert books.current == ROW + 4 + 4
        (g,) = torch.autograd.grad(y, [x])
        # log_softmax's output, its gradient from nll_loss and the input gradient at once
        assert books.peak == 3 * ROW + 8
        del y
    assert books.current == ROW  # g alone is left
    del g
    assert books.current == 0


def test_a_loss_layer_is_charged_the_log_softmax_inside_cross_entropy():
    x, t = torch.randn(B, 16), torch.zeros(B, dtype=torch.long)
    model = _Loss()
    gm = trace(model, example_inputs=(x, t))
    (loss,) = [l for l in annotate(gm, example_inputs=(x, t)) if "head" in l.name]
    # the recompute keeps the log_softmax (and the scalar loss, nll_loss's total weight), not
    # the logits: the nodes' outputs alone said the logits, half of it (issue 26)
    assert loss.saved_bytes == ROW + 8
    # the forward holds the logits and the log_softmax at once; the backward above the saved
    # bytes the log_softmax's gradient and the logits' (the weight gradient is the model's G)
    assert loss.peak_bytes == 2 * ROW + 8
    mm = MemoryModel(1)
    w = V * 16 * 4
    # backward: weights, their gradients, the saved log_softmax and the working memory above it
    assert stage_memory([loss], None, mm)[1] == w + w + loss.saved_bytes + loss.peak_bytes + 4  # + its output


def test_attention_is_charged_as_the_fused_kernel_keeps_it_not_the_math_path():
    b, h, s, d = 2, 4, 256, 16

    class Attn(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = torch.randn(b, h, s, d, requires_grad=True)
    gm = trace(Attn(), example_inputs=(q, q, q))
    (lay,) = annotate(gm, example_inputs=(q, q, q))
    scores = b * h * s * s * 4  # the attention matrix the math path keeps (several times)
    assert lay.saved_bytes < scores  # the output and its log-sum-exp
    assert lay.saved_bytes >= b * h * s * d * 4
    assert lay.peak_bytes < 2 * scores


def test_a_layer_meta_cannot_run_again_keeps_the_nodes_bound(monkeypatch):
    def refuse(run, members):
        raise RuntimeError("no meta kernel")

    monkeypatch.setattr(peaks, "_replay", refuse)
    x, t = torch.randn(B, 16), torch.zeros(B, dtype=torch.long)
    gm = trace(_Loss(), example_inputs=(x, t))
    (loss,) = [l for l in annotate(gm, example_inputs=(x, t)) if "head" in l.name]
    made = B * 16 * 4 + B * 8 + B * V * 4 + 4  # the nodes' outputs: the inputs, the logits and the loss
    assert loss.saved_bytes == made and loss.peak_bytes == 2 * made


def test_recompute_bytes_are_the_saved_bytes_where_known():
    known = dataclasses.replace(layer("a", peak=30), saved_bytes=10)
    mm = MemoryModel(2)
    assert mm.recompute_bytes(known) == 5 and mm.working(known) == 15
    assert mm.recompute_bytes(layer("b", peak=30)) == 15  # not measured (-1): the peak stands
    # backward = weights + 2 x gradients + saved + working (once) + boundary
    assert stage_memory([known], None, mm) == (10 + 15, 10 + 2 * 10 + 5 + 15)


def test_memory_rows_charge_a_neighbour_its_weights_and_boundary_not_its_work():
    fmem, bmem, held, gin = [1, 2, 3, 4], [10, 20, 30, 40], [100, 200, 300, 400], [0, 1000, 2000, 3000]
    rows = {(k, d): (row, w) for k, d, row, w in memory_rows(fmem, bmem, held, gin, 2)}
    assert rows[0, 0] == (1 + 300, (2,)) and rows[1, 0] == (2 + 400, (3,))  # stage k+2 prefetched
    assert rows[2, 0] == (3, ()) and rows[3, 0] == (4, ())
    assert rows[0, 1] == (10 + 2000, (2,))  # stage 2's input gradients not yet taken by stage 1
    assert rows[2, 1] == (30 + 100, (0,))  # stage 0 prefetched for its backward
    assert rows[3, 1] == (40 + 200, (1,))
