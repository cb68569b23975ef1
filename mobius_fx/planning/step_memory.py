"""The memory side of the step model (`mobius_fx.planning.step_model`; import these from here): the bytes a stage holds on its GPU and the rules they must meet (docs/schedule.md).

* `MemoryModel.footprint` and `stage_memory`, the (forward, backward) bytes of a stage: "a stage
  fits" for the plan tables, the partitioner, the rows of its MIP and the simulator's GPipe check;
* tied weights: `TiedWeight` / `tied_weights`, the extra copy (and gradient) a stage keeps of a
  parameter another stage's layer owns, `tied_copy_bytes` its bytes;
* the memory rules: `memory_rows` (each stage in forward and backward with what its GPU holds
  for the stages around it) and `memory_violation`, within `MEMORY_TOLERANCE` of capacity.

Kept apart for size: import these names from `mobius_fx.planning.step_model`. `memory_violation`
reads its `problem` (a `step_model.PartitionProblem`) and stage numbers (`step_model.StageTotals`)
by attribute and this module imports nothing from step_model.

    stage_memory(layers[0:4], None, problem.memory)   # (forward, backward) bytes of layers 0-3
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from mobius_fx.planning.costs import LayerCost
from mobius_fx.precision import Precision

__all__ = ["MEMORY_TOLERANCE", "MemoryModel", "stage_memory", "TiedWeight", "tied_weights", "tied_copy_bytes",
           "memory_rows", "memory_violation"]

MEMORY_TOLERANCE = 1e-6  # relative slack on capacity, the solvers' feasibility tolerance


@dataclass(frozen=True)
class MemoryModel:
    """Bytes scale factors of a plan and the stage footprint formula (`footprint`) that
    `stage_memory`, the partitioner and its MIP share.

    Layer costs are traced in the masters' dtype (`precision.master`, read from the model);
    weights, gradients and activations on the GPU are `precision.scale` times that
    (`weight_scale`, `act_scale`: streamed bytes per master byte, 1 when the stream is the
    masters' dtype). Built once per problem (`PartitionProblem.from_topology`) and per plan
    (`Plan.memory`).
    """

    microbatches: int
    precision: Precision = field(default_factory=Precision)

    @property
    def weight_scale(self) -> float:
        return self.precision.scale

    @property
    def act_scale(self) -> float:
        return self.precision.scale

    @property
    def grad_copies(self) -> int:
        """Copies of a stage's weight gradients on its GPU in backward: the sum so far and,
        with several micro-batches, the fresh gradients of the micro-batch being added to it
        (autograd hands a stage call's weight gradients back all at once)."""
        return 2 if self.microbatches > 1 else 1

    def recompute_bytes(self, layer: LayerCost) -> float:
        """What recomputing `layer` with grad keeps until its backward, for one micro-batch as
        streamed: its `saved_bytes` (its outputs and what autograd saved, annotate's meta
        run), or where that is not known (-1) its `peak_bytes`."""
        saved = layer.saved_bytes if layer.saved_bytes >= 0 else layer.peak_bytes
        return saved * self.act_scale / self.microbatches

    def working(self, layer: LayerCost) -> float:
        """`layer`'s working memory for one micro-batch as streamed (its `peak_bytes`): the
        most running it holds beyond the stage's weights, boundary activations and, in
        backward, the saved bytes of the stage's layers (its forward, and its backward's
        gradients and temporaries). A stage's is the largest of its own layers'
        (`stage_working`): a stage without the loss does not pay for the loss's fp32 logits
        (issue 26: charging every stage the whole model's largest refused a 3B GPT that ran
        within 3.7 of 6 GiB)."""
        return layer.peak_bytes * self.act_scale / self.microbatches

    def stage_working(self, layers: Sequence[LayerCost]) -> float:
        """The working memory of a stage made of `layers`: the largest of theirs (0 for none)."""
        return max((self.working(l) for l in layers), default=0.0)

    @staticmethod
    def held(weights: Any, boundary: Any) -> Any:
        """What a stage holds on its GPU while another stage there works: its weights (a prefetch,
        or not yet evicted) and its boundary activations (inputs arrived or restored, output
        gradients): held_k = W_k + M·(in_k + out_k). Linear, for the MIP."""
        return weights + boundary

    def footprint(self, weights: Any, grads: Any, recompute: Any, boundary: Any, work: Any) -> tuple[Any, Any]:
        """(forward, backward) bytes of a stage from its sums over its layers: weights, weight
        gradients, `recompute_bytes`, M x (boundary input + output) activations, and its
        working memory (`stage_working`, the largest of its layers'). Linear in them, so the
        MIP can call it with PuLP expressions.

        forward  = weights + work + boundary
        backward = weights + grad_copies x gradients + recompute + work + boundary

        recompute is what the stage's recompute keeps for backward, summed over its layers
        (`recompute_bytes`); work (the stage's largest layer's, one micro-batch, `working`)
        bounds the forward's live tensors and, in backward, what the layer being
        differentiated holds above its saved bytes: the gradients in flight and its backward
        ops' temporaries (annotate measures both on meta tensors, the ops inside a node
        included: the log_softmax inside cross_entropy, issue 26). boundary covers the
        stage's inputs (forward) and the input and output gradients of its M calls (backward).
        """
        return weights + work + boundary, weights + self.grad_copies * grads + recompute + work + boundary


def stage_memory(layers: Sequence[LayerCost], before: LayerCost | None, mm: MemoryModel,
                 tied: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """(forward, backward) GPU footprint of a stage made of `layers`, in bytes (`MemoryModel.footprint`).

    `before` is the layer just before the stage (its output is the stage input), None for
    stage 0. `tied` = (weight, gradient) bytes as streamed of the tied weights the stage keeps
    a copy of (`TiedWeight.copies`). Linear in the layers, so the MIP can use the same formula.
    What the runtime's books measure per stage (`Pipeline.stage_peaks()`) stays at or below
    the larger of the two.
    """
    m = mm.microbatches
    w = sum(l.param_bytes for l in layers) * mm.weight_scale + tied[0]
    g = sum(l.grad_bytes for l in layers) * mm.weight_scale + tied[1]
    r = sum(mm.recompute_bytes(l) for l in layers)
    act_in = (before.output_bytes if before is not None else 0) * mm.act_scale / m
    act_out = layers[-1].output_bytes * mm.act_scale / m if layers else 0.0
    return mm.footprint(w, g, r, m * (act_in + act_out), mm.stage_working(layers))


@dataclass(frozen=True)
class TiedWeight:
    """A parameter that several layers read (tied embedding and head, a shared module), in the
    numbers of the step model. Layer `owner` owns it (`LayerCost.params`; -1: no layer does)
    and `readers` read it too (`LayerCost.uses`). A stage that holds a reader but not the
    owner keeps a copy of its own on its GPU: `nbytes` more weights uploaded (forward and
    backward) and, when `trainable`, `nbytes` more gradient sent to the host and summed there —
    as `plans.build_plan` counts it. `nbytes` is in the master dtype (scaled like the layers').
    """

    name: str
    owner: int
    readers: tuple[int, ...]
    nbytes: float
    trainable: bool = True

    def copies(self, start: int, end: int) -> bool:
        """Whether the stage of layers [start, end) keeps a copy of its own."""
        return not start <= self.owner < end and any(start <= r < end for r in self.readers)


def tied_weights(layers: Sequence[LayerCost], param_sizes: dict[str, int],
                 trainable: Any = None) -> tuple[TiedWeight, ...]:
    """The parameters of `layers` that a layer reads without owning them, with their bytes
    (`param_sizes`: qualified name -> master bytes) and whether they take a gradient
    (`trainable`: names; default all of `param_sizes`). Parameters missing from `param_sizes`
    count 0 bytes, as in `plans.build_plan`.

    tied_weights(layers, {"wte.weight": 154_389_504})   # (TiedWeight("wte.weight", 0, (14,), ...),)
    """
    trainable = set(param_sizes) if trainable is None else set(trainable)
    owner = {p: i for i, l in enumerate(layers) for p in l.params}
    readers: dict[str, list[int]] = {}
    for i, l in enumerate(layers):
        for p in dict.fromkeys(l.uses or l.params):
            if owner.get(p, -1) != i:
                readers.setdefault(p, []).append(i)
    return tuple(TiedWeight(p, owner.get(p, -1), tuple(rs), float(param_sizes.get(p, 0)), p in trainable)
                 for p, rs in readers.items() if param_sizes.get(p, 0) > 0)


def tied_copy_bytes(tied: Sequence[TiedWeight], start: int, end: int, weight_scale: float) -> tuple[float, float]:
    """(weight, gradient) bytes as streamed of the tied copies the stage of layers [start, end)
    keeps (`TiedWeight.copies`): what it uploads and holds beyond its layers' own weights, and
    the gradient of those copies it sends to the host."""
    w = g = 0.0
    for t in tied:
        if t.copies(start, end):
            w += t.nbytes * weight_scale
            g += t.nbytes * weight_scale if t.trainable else 0.0
    return w, g


def memory_rows(fmem: Sequence[Any], bmem: Sequence[Any], held: Sequence[Any], grad_in: Sequence[Any],
                n: int) -> list[tuple[int, int, Any, tuple[int, ...]]]:
    """The memory rules of docs/schedule.md, as (stage k, 0 forward | 1 backward, bytes its GPU
    holds while stage k works, the other stages in them): floats or PuLP expressions.

    forward:  fwd_mem_k + held_{k+N}                       (stage k+N prefetched)
    backward: bwd_mem_k + held_{k-N} + grad_in_{k+N}       (stage k-N prefetched; stage
              k+N's input gradients until stage k+N-1, on the GPU before, takes them)

    A prefetched stage holds its weights and boundary activations (`MemoryModel.held`), not
    its working memory: it works once stage k is done and gone (issue 26: charging the next
    stage's whole footprint refused a 3B GPT that ran within its budget)."""
    s, rows = len(fmem), []
    for k in range(s):
        ahead, behind = k + n < s, k >= n
        rows.append((k, 0, fmem[k] + held[k + n] if ahead else fmem[k], (k + n,) if ahead else ()))
        row, with_ = bmem[k], ()
        if behind:
            row, with_ = row + held[k - n], (k - n,)
        if ahead:
            row, with_ = row + grad_in[k + n], (*with_, k + n)
        rows.append((k, 1, row, with_))
    return rows


def memory_violation(problem: Any, st: Any) -> float:
    """Sum of relative overshoots of every memory rule of docs/schedule.md (`memory_rows`: each
    stage in forward and in backward with what its GPU holds for the stages around it), within
    `MEMORY_TOLERANCE` of capacity (0 = fits)."""
    n, cap = len(problem.gpus), problem.capacity
    v = 0.0
    for k, _, row, _ in memory_rows(st.fmem, st.bmem, st.held, st.grad_in, n):
        v += max(0.0, row - cap[k % n] * (1 + MEMORY_TOLERANCE)) / max(cap[k % n], 1)
    return v
