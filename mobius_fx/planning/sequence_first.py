"""Sequence-first modules: refuse a micro-batch split that would cut their time dimension.

`nn.LSTM`, `nn.GRU`, `nn.RNN`, `nn.MultiheadAttention` and the `nn.Transformer*` layers built
with the default `batch_first=False` take `(T, B, F)`: dim 0 is time, the batch is dim 1. The
pipeline splits dim 0 of the batched inputs into micro-batches, so such a module would see the
sequence cut in time (each micro-batch a few time steps of every sequence) and compute something
else than eager, with no error from torch. `check` finds these modules in the traced graph (a
`call_module`, or export's `nn_module_stack`) and refuses when an input they read from outside
has its dim 0 split, naming the module and the remedy (docs/microbatch_layouts.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from mobius_fx.errors import MobiusError
from mobius_fx.module_paths import module_stack

__all__ = ["check", "SEQUENCE_FIRST", "batch_first"]

RNNS = {"LSTM", "GRU", "RNN"}
SEQUENCE_FIRST = RNNS | {"MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer",
                         "TransformerEncoder", "TransformerDecoder", "Transformer"}


def batch_first(module: nn.Module) -> bool | None:
    """The module's `batch_first` (a Transformer layer's: its attention's); None when it has none."""
    value = getattr(module, "batch_first", None)
    if value is None:
        for sub in module.modules():
            if isinstance(sub, nn.MultiheadAttention):
                return bool(sub.batch_first)
    return None if value is None else bool(value)


def _get(root: nn.Module | None, path: str) -> nn.Module | None:
    if root is None:
        return None
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _regions(gm: fx.GraphModule, model: nn.Module | None) -> dict[str, tuple[nn.Module, list[fx.Node]]]:
    """path -> (the sequence-first module, its nodes), for each such module with batch_first=False."""
    out: dict[str, tuple[nn.Module, list[fx.Node]]] = {}
    for node in gm.graph.nodes:
        entries = list(module_stack(node))
        if node.op == "call_module":
            entries.append((str(node.target), type(gm.get_submodule(str(node.target))).__name__))
        for path, cls in entries:
            if cls not in SEQUENCE_FIRST:
                continue
            module = _get(gm, path) if node.op == "call_module" and path == str(node.target) else None
            if module is None:
                module = _get(model, path)
            if module is None:
                module = _get(gm, path)
            if module is None or batch_first(module) is not False:
                continue
            out.setdefault(path, (module, []))[1].append(node)
            break  # the outermost sequence-first module is the one its inputs enter
    return out


def check(gm: fx.GraphModule, whole: Mapping[fx.Node, Any], part: Mapping[fx.Node, Any], m: int,
          model: nn.Module | None = None) -> None:
    """Refuse (MobiusError) a batch_first=False module whose input's dim 0 scales with the batch
    (`whole`/`part`: every node's value for the whole batch and for one of `m` micro-batches)."""
    for path, (module, nodes) in _regions(gm, model).items():
        inside = set(nodes)
        kind = type(module).__name__
        least = 2 if kind in RNNS else 3  # attention's 2-D inputs are masks, batch first
        for node in nodes:
            args = node.args[:1] if node.op == "call_module" else node.args
            for a in _nodes(args):
                if a in inside:
                    continue
                w, p = whole.get(a), part.get(a)
                if not (isinstance(w, torch.Tensor) and isinstance(p, torch.Tensor)) or w.dim() < least:
                    continue
                if w.shape[0] != p.shape[0] and w.shape[1:] == p.shape[1:]:
                    raise MobiusError(
                        f"{kind} `{path}` has batch_first=False: it takes (T, B, ...) inputs, time first, and "
                        f"microbatches={m} splits dim 0 of its input `{a.name}` (shape {tuple(w.shape)} for the "
                        f"whole batch, {tuple(p.shape)} for one micro-batch): each micro-batch would see the "
                        f"sequence cut in time, not a part of the batch. Build it with batch_first=True and give "
                        f"the pipeline (B, T, ...) inputs (it splits dim 0; batch_dims= can only say an input is "
                        f"batched along dim 0 or not batched), or use microbatches=1 (docs/microbatch_layouts.md)")


def _nodes(args: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(args, out.append)
    return out
