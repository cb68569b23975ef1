"""Micro-batches' outputs: how a pipeline puts the outputs of its micro-batches together so that
it returns what eager returns for the whole batch, or why it refuses (README "Micro-batch
semantics"; the split itself and the count's rules are mobius_fx/planning/microbatch.py's).

- **Combine.** `compile` runs the graph on fake tensors at the whole batch and at one
  micro-batch (`analyse`): an output whose size along one dim scales with the batch is
  concatenated along it; one the batch inputs do not reach is taken from micro-batch 0; an
  output the batch reaches but whose shape does not scale was reduced over the batch and is
  combined by the op that made it (`combine_kind`): sum-like (`sum`, a loss with
  reduction="sum", `count_nonzero`) -> summed, mean-like (`mean`, a loss with the default
  reduction="mean" and no `weight`) -> averaged (exact: the micro-batches are equal slices),
  `max()`/`amax` -> max, `min()`/`amin` -> min, through `+`/`-` of the same kind, `*`/`/` by
  a value the batch does not reach, negation and dtype casts.
- **Refused** (MobiusError at compile, naming the node): any other value the batch reaches
  whose shape does not scale (`t - t.mean(0, keepdim=True)`, `x[0]`, `x.T @ x`), an output
  none of the rules combines, softmax/cumsum/sort-like ops along the batch dim, and a graph
  that does not run on one micro-batch (e.g. an unbatched matrix as the first input).
  BatchNorm in train mode keeps its warning (each micro-batch normalised by its own statistics).
"""

from __future__ import annotations

import inspect
import logging
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from mobius_fx.errors import MobiusError
from mobius_fx.planning.batch_sizes import fake_values
from mobius_fx.planning.loss_ratios import combine_ratio, is_index_mean_loss
from mobius_fx.planning.loss_ratios import op_name as _name
from mobius_fx.planning import sequence_first
from mobius_fx.planning.microbatch import ambiguous, batch_rows, is_split, split

__all__ = ["Semantics", "OutputKind", "analyse", "combine", "guess_kind", "prepare", "REMEDY"]

log = logging.getLogger("mobius_fx")

REMEDY = ("use microbatches=1 (the whole batch in one pass), or move the reduction out of forward (return the "
          "per-row values and reduce them after the pipeline)")

_SUM = {"sum", "nansum", "count_nonzero", "counted_targets"}
_MEAN = {"mean", "nanmean"}
_MAX = {"max", "amax"}
_MIN = {"min", "amin"}
_LOSSES = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "cross_entropy", "nll_loss", "binary_cross_entropy",
           "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss", "cross_entropy_loss", "chunked_cross_entropy",
           "nll_loss_nd", "nll_loss2d",
           "MSELoss", "L1Loss", "SmoothL1Loss", "HuberLoss", "CrossEntropyLoss", "NLLLoss", "BCELoss",
           "BCEWithLogitsLoss", "SoftMarginLoss"}
_CASTS = {"float", "double", "half", "bfloat16", "to", "type_as", "_to_copy", "clone", "contiguous", "detach",
          "alias", "_assert_tensor_metadata"}
_ADD = {"add", "sub", "iadd", "isub", "rsub"}
_MUL = {"mul", "truediv", "div", "imul", "itruediv"}
_META_ONLY = {"new_ones", "new_zeros", "new_full", "new_empty", "new_tensor", "zeros_like", "ones_like", "empty_like",
              "full_like", "size", "dim", "numel"}  # read a tensor's shape, dtype or device, not its values
_ALONG = {"softmax", "log_softmax", "_softmax", "_log_softmax", "cumsum", "cumprod", "cummax", "cummin",
          "logcumsumexp", "sort", "argsort", "topk", "normalize", "flip", "roll", "Softmax", "LogSoftmax"}

# How an output combines across micro-batches (`analyse`): "same", "sum", "min", "ratio", ..., or ("cat", dim).
OutputKind = str | tuple[str, int]


def prepare(runtime: Any, gm: fx.GraphModule, flat: list, m: int, marks: Mapping[int, bool],
            model: torch.nn.Module | None = None) -> None:
    """Analyse the graph for `runtime` (its `output_kinds`) on the call `flat`, once: at compile
    with the example inputs, or at the first call of a pipeline built without them. Warns when
    the split guess is ambiguous, or when the graph cannot be analysed (outputs then guessed)."""
    rows = batch_rows(tuple(flat), m, marks)
    if m <= 1 or rows is None:
        runtime.analysed = True
        return
    for shape in ambiguous(flat, rows, marks)[:1]:
        log.warning("an input of shape %s is split into micro-batches because its dim 0 equals the batch (%d rows), "
                    "but the batch size also matches another of its dimensions: if it is not batched (a mask, a "
                    "table), say so with compile(..., batch_dims={'<its argument>': None}), or use microbatches=1 "
                    "(README \"Micro-batch semantics\")", shape, rows)
    sem = analyse(gm, flat, m, marks, model)  # a refusal leaves `analysed` False: every call refuses
    runtime.output_kinds, runtime.analysed = sem.outputs, True
    if sem.outputs is None:
        log.warning("the graph could not be run on fake tensors (%s), so how its outputs combine across the %d "
                    "micro-batches is guessed: dim 0 of a micro-batch's size concatenated, other floating outputs "
                    "averaged, others taken from micro-batch 0; use microbatches=1 for eager's results (README "
                    "\"Micro-batch semantics\")", sem.why, m)


def combine(kind: OutputKind, leaves: list) -> Any:
    """One output from its micro-batches' values, by its kind (`analyse`)."""
    if kind == "same" or not isinstance(leaves[0], torch.Tensor):
        return leaves[0]
    if isinstance(kind, tuple):  # ("cat", dim)
        return torch.cat(leaves, dim=kind[1])
    if kind == "ratio":  # loss_ratios.mean_ratio's (sum, count) pairs: Σ sum / Σ count
        return combine_ratio(leaves)
    stacked = torch.stack(leaves)
    if kind == "sum":
        return stacked.sum(0)
    if kind == "mean":
        return stacked.mean(0)
    if kind == "max":
        return stacked.amax(0)
    if kind == "min":
        return stacked.amin(0)
    raise MobiusError(f"internal: no rule combines outputs of kind {kind!r}")


def guess_kind(x: object, mb_rows: int) -> OutputKind:
    """The combination when the graph could not be analysed: concatenate dim 0 of the size of a
    micro-batch, else average floating values, else micro-batch 0 (README: warned once)."""
    if not isinstance(x, torch.Tensor):
        return "same"
    if x.dim() > 0 and x.size(0) == mb_rows:
        return ("cat", 0)
    return "mean" if (x.is_floating_point() or x.is_complex()) else "same"


@dataclass
class Semantics:
    """What `analyse` found: `outputs`, the combination of each output leaf (in pytree order):
    ("cat", dim), "sum", "mean", "max", "min" or "same"; None when the graph could not be run on
    fake tensors (then `guess_kind`, warned once)."""

    outputs: list | None
    why: str = ""


def _arg(node: fx.Node, gm: fx.GraphModule, name: str, default: object) -> Any:
    """Argument `name` of a call node, positional or keyword (None when it cannot be read)."""
    if name in node.kwargs:
        return node.kwargs[name]
    t = node.target
    if node.op == "call_module":
        return getattr(gm.get_submodule(str(t)), name, default)
    schema = getattr(t, "_schema", None)
    if schema is not None:
        names = [a.name for a in schema.arguments]
    else:
        try:
            names = list(inspect.signature(t).parameters) if callable(t) else []
        except (TypeError, ValueError):
            names = []
    if name in names and names.index(name) < len(node.args):
        return node.args[names.index(name)]
    return default


def _shape(v: object) -> tuple | None:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _scaled(a: object, b: object) -> list[int] | None:
    """Dims whose size differs between the whole-batch value `a` and the micro-batch value `b`."""
    sa, sb = _shape(a), _shape(b)
    if sa is None or sb is None:
        return None
    if len(sa) != len(sb):
        return [-1]
    return [d for d in range(len(sa)) if sa[d] != sb[d]]


def _run(gm: fx.GraphModule, flat: list) -> dict[fx.Node, Any]:
    """Every node's value for `gm(*flat)`, on fake tensors (nothing computed, nothing changed)."""
    return fake_values(gm, flat)


def analyse(gm: fx.GraphModule, flat: list, m: int, marks: Mapping[int, bool],
            model: torch.nn.Module | None = None) -> Semantics:
    """Classify each output of `gm` and refuse row-mixing values, for `m` micro-batches of the
    example call `flat` (the placeholders' values), and a split that cuts the time dim of a
    sequence-first module of `model` (planning/sequence_first.py). See the module docstring."""
    if m <= 1:
        return Semantics([])
    rows = batch_rows(tuple(flat), m, marks)
    if rows is None:
        return Semantics([])
    parts, mb = split(tuple(flat), m, marks)
    first = [parts[i * m] for i in range(len(flat))]
    try:
        whole = _run(gm, flat)
    except Exception as e:  # noqa: BLE001 (any failure of the fake run: fall back to the guess)
        return Semantics(None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    try:
        part = _run(gm, first)
    except Exception as e:  # noqa: BLE001
        shapes = ", ".join(str(tuple(x.shape)) for x in pytree.tree_leaves(flat) if isinstance(x, torch.Tensor))
        raise MobiusError(f"the model does not run on one micro-batch: microbatches={m} splits dim 0 of the inputs "
                          f"(shapes {shapes}) into {mb}-row parts, and the graph then fails "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); dim 0 of an input is "
                          f"not a batch? Give a batched input first (rows along dim 0), say which inputs are not "
                          f"batched with batch_dims={{'name': None}}, or use microbatches=1") from None
    sequence_first.check(gm, whole, part, m, model)
    # Which nodes the batch reaches through tensor data (a size read is not data).
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    dep: set[fx.Node] = set()
    for ph, x in zip(placeholders, flat):
        if any(is_split(t, rows, marks) for t in pytree.tree_leaves(x)):
            dep.add(ph)
    kinds, exempt = _classify(gm, whole, part, dep, m)
    return Semantics(_outputs(gm, whole, part, dep, kinds, m))


def _classify(gm: fx.GraphModule, whole: dict, part: dict, dep: set, m: int) -> tuple[dict, set]:
    """Walk the graph: every node the batch reaches joins `dep`; refuse ops along the batch dim
    and values pairing rows; a reduced value (its shape does not scale) gets its combination
    kind, or is exempt (BatchNorm's statistics, a buffer's update), or is refused when it feeds
    anything but the output or another combinable one. Returns (kinds, exempt)."""
    kinds: dict[fx.Node, str] = {}
    exempt = _state_updates(gm)
    free: set[fx.Node] = set()  # values the batch reaches whose shape does not scale
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        v = whole.get(n)
        if not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(v)):
            continue
        name = _name(n, gm)
        if not any(a in dep for a in n.all_input_nodes):
            continue
        if name in _META_ONLY:  # values from none; but a shape from the batch (zeros_like(h)) makes rows,
            if _scaled(v, part.get(n)):  # whose sum over the batch is no constant
                dep.add(n)
            continue
        dep.add(n)
        scaled = _scaled(v, part.get(n))
        if name in _ALONG and n.all_input_nodes:
            _refuse_along_batch(n, name, gm, whole, part, m)
        if "batch_norm" in name.lower() or any(a in exempt for a in n.all_input_nodes) and scaled == []:
            exempt.add(n)  # BatchNorm's statistics (warned about by build_pipeline), a buffer's update
            continue
        if scaled is not None and len(scaled) > 1:  # (B, B): pairs of rows, e.g. h @ h.T
            raise MobiusError(f"`{n.format_node()}` has {len(scaled)} dims that grow with the batch (shape "
                              f"{_shape(v)} for the whole batch, {_shape(part.get(n))} for one of microbatches={m}): it pairs "
                              f"rows of the batch, which micro-batches cannot see together; {REMEDY}")
        if scaled is None or scaled:
            continue
        free.add(n)
        kind = _kind(n, gm, kinds, dep, free, whole)
        if kind is not None:
            kinds[n] = kind
        if kind == "mean" and is_index_mean_loss(n, gm, name, whole):
            _warn_mean_of_means(n, name, m)
    for n in reversed(list(gm.graph.nodes)):  # values that only feed buffer updates: state, as BatchNorm's
        if n in dep and n.users and all(u in exempt for u in n.users) and _scaled(whole.get(n), part.get(n)) == []:
            exempt.add(n)
            kinds.pop(n, None)
    for n in kinds:  # a combinable reduction feeding anything but the output or another combinable one
        for u in n.users:
            if u.op != "output" and u not in kinds and u not in exempt:
                _refuse(u, n, gm, m)
    for n in dep:
        if n in kinds or n in exempt or n.op == "placeholder":
            continue
        if _scaled(whole.get(n), part.get(n)) == []:
            _refuse(n, n, gm, m)
    return kinds, exempt


def _warn_mean_of_means(n: fx.Node, name: str, m: int) -> None:
    log.warning("`%s`: a mean %s over class-index targets feeds more than the output, so with microbatches=%d "
                "it is the mean of the micro-batches' means, which differs from eager's when the targets equal "
                "to ignore_index (-100 by default) are spread unevenly over the micro-batches; for eager's value "
                "return the loss itself as an output (it is then combined exactly, as a sum and a count), or "
                "compute it with reduction='sum' and divide by the count of targets after the pipeline, or use "
                "microbatches=1 (README \"Micro-batch semantics\")", n.format_node(), name, m)


def _refuse_along_batch(n: fx.Node, name: str, gm: fx.GraphModule, whole: dict, part: dict, m: int) -> None:
    """Refuse a softmax/cumsum/sort-like op `n` along a dim that carries the batch."""
    src = n.all_input_nodes[0]
    dims = _scaled(whole.get(src), part.get(src)) or []
    d = _arg(n, gm, "dim", _arg(n, gm, "dims", None))
    if d is None and n.op != "call_module" and len(n.args) > 1:  # a builtin without a signature
        d = n.args[1]
    rank = len(_shape(whole.get(src)) or ())
    ds = [d] if isinstance(d, int) else list(d) if isinstance(d, (list, tuple)) else []
    if rank and any(isinstance(i, int) and i % rank in dims for i in ds):
        raise MobiusError(f"{n.format_node()}: `{name}` along dim {d}, the batch, mixes the rows of the "
                          f"batch; with microbatches={m} each micro-batch would see only its own rows; "
                          f"{REMEDY}")


def _outputs(gm: fx.GraphModule, whole: dict, part: dict, dep: set, kinds: dict, m: int) -> list:
    """The combination of each output leaf (pytree order); MobiusError for one no rule combines."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = []
    for leaf in pytree.tree_leaves(out_node.args[0]):
        scaled = _scaled(whole.get(leaf), part.get(leaf)) if isinstance(leaf, fx.Node) else None
        if scaled is None or (not scaled and leaf not in dep):  # not a tensor, or not reached by the batch
            outputs.append("same")
        elif len(scaled) == 1 and scaled[0] >= 0 and whole[leaf].shape[scaled[0]] == part[leaf].shape[scaled[0]] * m:
            outputs.append(("cat", scaled[0]))
        elif scaled:
            raise MobiusError(f"output {leaf.name} has shape {tuple(whole[leaf].shape)} for the whole batch and "
                              f"{tuple(part[leaf].shape)} for one micro-batch: no one dim carries the batch, so the "
                              f"micro-batches' outputs cannot be put together; {REMEDY}")
        elif leaf in kinds:
            outputs.append(kinds[leaf])
        else:
            _refuse(leaf, leaf, gm, m)
    return outputs


def _state_updates(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes that update a buffer in place (`self.ema.mul_(0.9).add_(...)`, export's wrapped
    no-grad blocks writing one) and their results: model state, which micro-batches update one
    after the other, as eager gradient accumulation would (README "Micro-batch semantics")."""
    buffers = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            try:
                obj = gm.get_buffer(str(n.target))
            except (AttributeError, TypeError):
                obj = None
            if isinstance(obj, torch.Tensor):
                buffers.add(n)
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        name = _name(n, gm)
        first = n.args[0] if n.args else None
        inplace = name.endswith("_") and not name.startswith("_") and (first in buffers or first in out)
        wrapped = isinstance(n.target, torch._ops.HigherOrderOperator) and any(a in buffers for a in n.all_input_nodes)
        if inplace or wrapped or (n.target is operator.getitem and first in out):
            out.add(n)
    return out


def _is_zero(a: object) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and a == 0


def _refuse(n: fx.Node, src: fx.Node, gm: fx.GraphModule, m: int) -> None:
    raise MobiusError(f"`{n.format_node()}` mixes the rows of the batch (it reduces over, selects from or contracts "
                      f"the batch dimension, or reads a value that does: `{src.name}`), so with microbatches={m} each micro-batch would get "
                      f"its own value, not eager's; only outputs that are sums, means, max or min over the batch "
                      f"are combined across micro-batches (README \"Micro-batch semantics\"); {REMEDY}")


def _kind(n: fx.Node, gm: fx.GraphModule, kinds: Mapping[fx.Node, str], dep: set, free: set,
          whole: Mapping) -> str | None:
    """How micro-batch values of `n` (a value the batch reaches, whose shape does not scale)
    combine into the whole batch's, or None when no rule says."""
    name = _name(n, gm)
    tensors = [a for a in n.all_input_nodes]
    if name == "mean_ratio":  # loss_ratios: (sum, count) per micro-batch, divided once for the whole batch
        return "ratio"
    if tensors and tensors[0] in free and name in _SUM | _MEAN | _MAX | _MIN | _LOSSES:
        # reducing a value already reduced over the batch (h.mean(0).sum()): linear reductions keep
        # its kind, max of a max stays a max; anything else has no rule
        inner = kinds.get(tensors[0])
        src = whole.get(tensors[0])
        if (len(tensors) == 1 and name not in _LOSSES and name != "count_nonzero" and isinstance(src, torch.Tensor)
                and src.dim() == 0):
            return inner  # a reduction of a 0-dim value (a loss's `.sum()`) is the value itself
        if name in _SUM | _MEAN and name != "count_nonzero" and inner in ("sum", "mean"):
            return inner
        if (name in _MAX and inner == "max") or (name in _MIN and inner == "min"):
            return inner
        return None
    if name in _SUM:
        return "sum"
    if name in _MEAN:
        return "mean"
    if name in _MAX | _MIN and len(tensors) == 1 and (name in ("amax", "amin") or
                                                       len(n.args) + len(n.kwargs) == 1):
        return "max" if name in _MAX else "min"
    if name in _LOSSES:
        reduction = _arg(n, gm, "reduction", "mean")
        reduction = {0: "none", 1: "mean", 2: "sum"}.get(reduction, reduction)
        weight = _arg(n, gm, "weight", None)
        if reduction == "sum":
            return "sum"
        if reduction == "mean" and weight is None and name not in ("kl_div",):
            return "mean"
        return None
    if name in _CASTS and tensors:
        return kinds.get(tensors[0])
    inner = [kinds.get(a) for a in tensors if a in dep]
    if len(inner) != len([a for a in tensors if a in dep]) or not inner:
        return None
    if name in ("neg",) and inner[0] in ("mean", "sum"):
        return inner[0]
    if len(inner) == 1 and len(n.args) == 2 and (
            (name in ("add", "iadd") and any(_is_zero(a) for a in n.args)) or
            (name in ("sub", "isub") and _is_zero(n.args[1]))):
        return inner[0]  # x + 0 (Python's sum() starts at 0) is x
    if name in _MUL and len(inner) == 1 and inner[0] in ("max", "min") and len(n.args) == 2 and n.args[0] in dep:
        c = n.args[1]  # max(a, b) * c is max(a * c, b * c) for c > 0, their min for c < 0
        if isinstance(c, (int, float)) and not isinstance(c, bool) and c != 0:
            return inner[0] if c > 0 else {"max": "min", "min": "max"}[inner[0]]
    if name in _ADD and inner[0] in ("mean", "sum") and len(set(inner)) == 1:
        if len(inner) == 2 or inner[0] == "mean":  # sum + a constant is not a sum of the micro-batches' values
            return inner[0]
    if name in _MUL and len(inner) == 1 and inner[0] in ("mean", "sum"):
        first = n.args[0] if n.args else None
        if name in ("truediv", "div", "itruediv") and first not in dep:
            return None  # c / sum is not linear in the sum
        return inner[0]
    return None
