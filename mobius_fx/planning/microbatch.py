"""Micro-batches: the count's rules, what a pipeline splits, and how it combines the outputs.

The one home of the micro-batch rules: the count is a positive int (`check_count`), it divides
the batch (`divides`, `check_divides`: the one message, however the caller spells the count),
the default when none is given (`default_microbatches`), the rows of the batch (`batch_rows`)
and the split (`split`). `CompileOptions`, `plan`/`compile`, the command line, the schedule IR,
the planning problem, the transfer pass and the runtime call these; none repeats them.

The single rule behind README "Micro-batch semantics"; the runtime's `split`/`merge` and
`compile` read it from here. With `microbatches=m > 1`, a call runs the model m times on equal
slices of the batch; the pipeline returns what eager returns for the whole batch, or refuses:

- **Split.** The batch is dim 0 of the first tensor input with a dimension; every input whose
  dim 0 has that size is split along dim 0, the others go whole to every micro-batch.
  `batch_dims={"mask": None}` (a forward argument's name -> 0 or None) says it instead; when
  the guess is ambiguous (the batch size equals another dimension of a split input or of the
  first one), a one-time warning names the input and the remedy.
- **Combine** and **refused**: how a pipeline's outputs are put together from its
  micro-batches' (or why they cannot be) is mobius_fx/runtime/microbatch_outputs.py's.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from mobius_fx.errors import MobiusError

__all__ = ["ambiguous", "batch_rows", "candidate_counts", "check_batch_dims", "check_count", "check_divides",
           "declared", "default_microbatches", "divides", "divisors_near", "is_split", "split"]


COUNT_RULE = "it must be a positive int (micro-batches per step; Mobius uses one per GPU)"
DIVIDES_RULE = "micro-batches must divide the batch"


def check_count(microbatches: Any, *, error: type[MobiusError] = MobiusError) -> int:
    """`microbatches` when it is a positive int (micro-batches per step), else `error` naming the
    value and the rule:

    >>> check_count(0)
    Traceback (most recent call last):
    ...
    mobius_fx.errors.MobiusError: microbatches=0; it must be a positive int (micro-batches per step; Mobius uses one per GPU)
    """
    m = microbatches
    if isinstance(m, bool) or not isinstance(m, int):
        kind = "a bool" if isinstance(m, bool) else f"a {type(m).__name__}"
        raise error(f"microbatches={m!r} is {kind}; {COUNT_RULE}")
    if m < 1:
        raise error(f"microbatches={m!r}; {COUNT_RULE}")
    return m


def divides(rows: int | None, microbatches: int) -> bool:
    """Whether `microbatches` equal micro-batches split a batch of `rows` rows (True when there
    is no batch dimension, `rows` None: nothing is split)."""
    return rows is None or rows % microbatches == 0


def check_divides(rows: int | None, microbatches: int, *, batch: str | None = None, count: str | None = None,
                  remedy: str | Callable[[], str] | None = None, error: type[MobiusError] = MobiusError) -> None:
    """Refuse a batch of `rows` rows that `microbatches` do not split into equal parts, with the
    one message: `batch` (the value: by default "the batch has R rows (dim 0 of the first batched
    input) and"), `count` (how the caller spells the count: "4", "microbatches=4"), the rule, and
    `remedy` (a str, or a function of nothing called only when the batch does not split).

    >>> check_divides(6, 4)
    Traceback (most recent call last):
    ...
    mobius_fx.errors.MobiusError: the batch has 6 rows (dim 0 of the first batched input) and does not split into 4 equal micro-batches; micro-batches must divide the batch: use a batch size that is a multiple of 4, or microbatches that divide 6
    """
    m = microbatches
    if divides(rows, m):
        return
    if batch is None:
        batch = f"the batch has {rows} rows (dim 0 of the first batched input) and"
    if remedy is None:
        remedy = f"use a batch size that is a multiple of {m}, or microbatches that divide {rows}"
    elif callable(remedy):
        remedy = remedy()
    raise error(f"{batch} does not split into {count or m} equal micro-batches; {DIVIDES_RULE}: {remedy}")


def divisors_near(rows: int, m: int) -> tuple[int, ...]:
    """The divisors of `rows` nearest to `m`: the largest below it and the smallest above it."""
    divs = [d for d in range(1, rows + 1) if divides(rows, d)]
    below = [d for d in divs if d < m]
    above = [d for d in divs if d > m]
    return tuple(x for x in (below[-1] if below else None, above[0] if above else None) if x is not None)


def default_microbatches(rows: int | None, gpus: int) -> tuple[int, str]:
    """The micro-batch count when none is given, and why: one per GPU (as the paper runs) when
    the batch of `rows` divides into that many, else the largest divisor of the batch <= the
    GPU count; 1 when the inputs have no batch dimension (`rows` None).

    >>> default_microbatches(rows=6, gpus=4)
    (3, 'default: the largest divisor of batch 6 <= 4 GPUs')
    """
    if rows is None:
        return 1, "default: 1, the inputs have no batch dimension to split"
    if divides(rows, gpus):
        return gpus, "default: one per GPU"
    best = max(d for d in range(1, min(rows, gpus) + 1) if divides(rows, d))
    return best, f"default: the largest divisor of batch {rows} <= {gpus} GPUs"


COUNT_CANDIDATES = 4  # counts the planner times when it chooses (`candidate_counts`), the default's included


def candidate_counts(rows: int | None, default: int, limit: int = COUNT_CANDIDATES) -> tuple[int, ...]:
    """The micro-batch counts the planner times when the caller gives none: `default` (one per
    GPU, `default_microbatches`) and, for each k = 1, 2, ..., the smallest divisor of the batch's
    `rows` at least 2**k x `default`, at most `limit` counts in all. Only divisors: every count
    splits the batch into equal micro-batches, as compile's split needs. Just `default` when it is
    1 (one GPU, or no batch to split: no fill/drain bubble to shrink, and the traced graph differs).

    >>> candidate_counts(64, 8)
    (8, 16, 32, 64)
    >>> candidate_counts(48, 8)
    (8, 16, 48)
    >>> candidate_counts(8, 8)
    (8,)
    """
    if rows is None or default <= 1:
        return (default,)
    out = [default]
    target = 2 * default
    while len(out) < limit and target <= rows:
        m = next(d for d in range(target, rows + 1) if divides(rows, d))
        if m not in out:
            out.append(m)
        target = 2 * m
    return tuple(out)


def check_batch_dims(value: Any) -> dict[str, int | None] | None:
    """`batch_dims=`: None (guess) or {forward argument name: 0 (split along dim 0) or None (not
    batched: passed whole to every micro-batch)}."""
    if value is None:
        return None
    rule = ("batch_dims maps forward argument names to 0 (the argument is batched along dim 0 and split) or None "
            "(it is not batched: every micro-batch gets it whole), e.g. batch_dims={'mask': None}")
    if not isinstance(value, Mapping):
        raise MobiusError(f"batch_dims={value!r} is a {type(value).__name__}, not a dict; {rule}")
    out: dict[str, int | None] = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise MobiusError(f"batch_dims key {k!r} is not an argument name (a str); {rule}")
        if v is not None and (isinstance(v, bool) or v != 0 or not isinstance(v, int)):
            raise MobiusError(f"batch_dims[{k!r}]={v!r}; {rule} (the batch must be dim 0: move it there with "
                              f".movedim(d, 0) before calling)")
        out[k] = v
    return out


def declared(model: torch.nn.Module | None, args: tuple, kwargs: dict, batch_dims: Mapping | None) -> dict[int, bool]:
    """id(tensor) -> whether it is batched, for the tensors of the arguments `batch_dims` names
    (an unknown name is refused, listing forward's arguments)."""
    if not batch_dims or model is None:
        return {}
    try:
        sig = inspect.signature(model.forward)
        bound = sig.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):  # a call forward does not take is refused by call_signatures.bind_call
        sig, bound = None, {f"args[{i}]": a for i, a in enumerate(args)} | dict(kwargs)
    values: dict[str, Any] = {}
    for name, value in bound.items():
        kind = sig.parameters[name].kind if sig is not None else None
        if kind is inspect.Parameter.VAR_KEYWORD:
            values.update(value)
        else:
            values[name] = value
    names = [n for n, p in sig.parameters.items() if p.kind is not p.VAR_KEYWORD] if sig is not None else []
    names += [n for n in values if n not in names]
    unknown = [k for k in batch_dims if k not in names and k not in values]
    if unknown:
        raise MobiusError(f"batch_dims names {', '.join(map(repr, unknown))}, which {type(model).__name__}.forward "
                          f"does not take; its arguments are {', '.join(names)}")
    out: dict[int, bool] = {}
    for name, dim in batch_dims.items():
        for t in pytree.tree_leaves(values.get(name)):
            if isinstance(t, torch.Tensor):
                out[id(t)] = dim is not None
    return out


def _leaves(inputs: Any, marks: Mapping[int, bool]) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.dim() > 0
            and marks.get(id(x), True)]


def batch_rows(inputs: Any, microbatches: int, marks: Mapping[int, bool] | None = None) -> int | None:
    """The rows of the batch that micro-batches split: dim 0 of the first input `batch_dims`
    marks as batched, else of the first tensor input with a dimension not marked unbatched
    (None when there is none).

    Refused with a MobiusError: an empty batch (dim 0 of size 0), and, with several
    micro-batches, inputs that are all 1-D — an unbatched example whose dim 0 is its features,
    which splitting would cut apart.
    """
    marks = marks or {}
    leaves = _leaves(inputs, marks)
    if not leaves:
        return None
    first = next((x for x in leaves if marks.get(id(x))), leaves[0])
    rows = first.size(0)
    if rows == 0:
        raise MobiusError(f"the batch is empty (an input of shape {tuple(first.shape)}: dim 0, the batch, is 0); "
                          f"call the pipeline with at least one row per micro-batch")
    if microbatches > 1 and all(x.dim() == 1 for x in leaves) and not marks.get(id(first)):
        raise MobiusError(f"microbatches={microbatches} splits dim 0 of the inputs, but every tensor input is 1-D "
                          f"(shape {tuple(first.shape)}), so dim 0 is not a batch: add a batch dimension "
                          f"(x.unsqueeze(0)) and use a batch of at least {microbatches} rows, or use microbatches=1; "
                          f"if dim 0 is a batch of scalars, give them a feature dimension (x.unsqueeze(-1))")
    return rows


def is_split(x: Any, rows: int, marks: Mapping[int, bool]) -> bool:
    if not isinstance(x, torch.Tensor):
        return False
    mark = marks.get(id(x))
    if mark is not None:
        return mark
    return x.dim() > 0 and x.size(0) == rows


def split(inputs: tuple, m: int, marks: Mapping[int, bool] | None = None) -> tuple[tuple, int]:
    """(in0_mb0, in0_mb1, ..., in1_mb0, ...) and the rows per micro-batch."""
    marks = marks or {}
    rows = batch_rows(inputs, m, marks)
    if rows is None:
        raise MobiusError(f"microbatches={m} but no input is a tensor with a batch dimension to split; pass "
                          f"batched tensors or use microbatches=1")
    check_divides(rows, m)
    mb = rows // m
    for x in pytree.tree_leaves(inputs):
        if is_split(x, rows, marks) and (x.dim() == 0 or x.size(0) != rows):
            raise MobiusError(f"batch_dims marks an input of shape {tuple(x.shape)} as batched along dim 0, but the "
                              f"batch has {rows} rows; give every batched input the same dim 0")

    def parts(x: Any) -> list:
        return list(x.split(mb)) if is_split(x, rows, marks) else [x] * m

    out: list = []
    for x in inputs:
        flat, spec = pytree.tree_flatten(x)
        chunks = [parts(leaf) for leaf in flat]
        out.extend(pytree.tree_unflatten([c[i] for c in chunks], spec) for i in range(m))
    return tuple(out), mb


def ambiguous(inputs: Any, rows: int, marks: Mapping[int, bool]) -> list[tuple[int, ...]]:
    """The shapes of split inputs the guess split without `batch_dims` saying so, where the batch
    size also equals another dimension of that input or of the first batched one (a (T, T) mask
    with T == batch): dim 0 may not be a batch there."""
    leaves = _leaves(inputs, marks)
    if not leaves:
        return []
    first = leaves[0]
    clash = rows in tuple(first.shape[1:])
    return [tuple(x.shape) for x in leaves[1:] if id(x) not in marks and x.size(0) == rows
            and (clash or rows in tuple(x.shape[1:]))]
