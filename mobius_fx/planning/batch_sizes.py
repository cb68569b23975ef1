"""Sizes read inside forward, as eager reads them: the whole batch's where they become values.

A forward that reads the batch size from a shape (`loss / x.shape[0]`, `x.size(0)`, `numel()`,
`mean() * len(x)`, `return y, y.shape[0]`) reads, on a micro-batch, the micro-batch's size: the
loss and its gradients would come out `microbatches` times too large, and a shape output one
micro-batch's. `rewrite` (run on the traced graph with the example call, before it is cut into
stages) finds every integer the graph reads from a shape that depends on the batch (by running
the graph on fake tensors at the whole batch and at a part of it) and classifies each of its uses:

- **shape** uses keep the micro-batch's size: `view`/`reshape`/`expand` sizes, `arange`,
  `zeros`/`ones`/`full` sizes, slicing and `narrow` bounds (nanoGPT's `b, t = idx.size()` then
  `.view(b, t, ...)`); an aten op's argument typed `SymInt`/`int`/`SymInt[]`.
- **value** uses read the whole batch's: arithmetic with a tensor, `torch.tensor(b)`, an aten
  argument typed `Scalar` or `Tensor`, and the graph's outputs. Such a use gets `whole_size(n)`
  (or `whole_shape(shape, dims)`), the size times the micro-batch count (the micro-batches are
  equal slices), through the integer arithmetic between the read and the use (`b * t`, `b + 1`).
- Any other use of such an integer (a call the rules do not know) is refused at compile, naming
  the node and the remedy.

In the traced graph the count is 1 (the graph computes what the model computes on the whole
batch); `insert_transfers` sets it (`set_microbatches`) in the stages' copies.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from mobius_fx.errors import MobiusError
from mobius_fx.planning.microbatch import batch_rows, divides, split

__all__ = ["rewrite", "whole_size", "whole_shape", "set_microbatches", "fake_values", "REMEDY"]

REMEDY = ("pass the whole batch's size in as an input, or move the arithmetic after the pipeline (return the "
          "unnormalised value and divide it by the batch size), or use microbatches=1")

# fx call_method / call_function names whose integer arguments are sizes or indices (per micro-batch)
_SHAPE_CALLS = {"view", "reshape", "expand", "repeat", "tile", "broadcast_to", "arange", "zeros", "ones", "empty",
                "rand", "randn", "randint", "new_zeros", "new_ones", "new_empty", "narrow", "split", "unflatten",
                "getitem", "eye", "tril", "triu", "tril_indices", "triu_indices", "roll", "chunk", "flatten",
                "select", "linspace", "_unsafe_view", "as_strided", "new_full", "full", "zeros_like", "ones_like",
                "unfold", "tensor_split", "logspace", "randperm", "slice"}
# the argument positions (after self/the size) that are values for calls mixing both roles
_VALUE_ARGS = {"full": (1, "fill_value"), "new_full": (2, "fill_value")}
_VALUE_CALLS = {"tensor", "as_tensor", "scalar_tensor", "new_tensor", "full_like", "fill_", "fill", "clamp", "clip", "where",
                "maximum", "minimum", "pow", "div", "mul", "add", "sub", "rsub", "true_divide", "floor_divide"}
_IGNORED = ("_assert", "sym_constrain_range", "_check", "sym_constrain")  # export's guards: not values


def whole_size(n: Any, microbatches: int = 1) -> Any:
    """The whole batch's size for the size `n` that each of `microbatches` same-sized micro-batches reads."""
    return n * microbatches


def whole_shape(shape: Any, dims: tuple[int, ...], microbatches: int = 1) -> torch.Size:
    """`shape` with its batch dims `dims` the whole batch's (see `whole_size`)."""
    return torch.Size(s * microbatches if i in dims else s for i, s in enumerate(shape))


whole_size.per_microbatch = whole_shape.per_microbatch = True  # type: ignore[attr-defined]


def set_microbatches(graph: fx.Graph, microbatches: int) -> None:
    """Give every node of `graph` (a stage's copy) calling a function marked `per_microbatch`
    (`whole_size`, `whole_shape`, loss_ratios' `mean_ratio`) the micro-batch count."""
    for node in graph.nodes:
        if node.op == "call_function" and getattr(node.target, "per_microbatch", False):
            node.kwargs = {**node.kwargs, "microbatches": microbatches}


def fake_values(gm: fx.GraphModule, flat: list) -> dict[fx.Node, Any]:
    """Every node's value for `gm(*flat)`, on fake tensors (nothing computed, nothing changed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    values: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            values[n] = out
            return out

    class Whole(torch.nn.Module):  # runs gm's graph node by node; functional_call swaps in fake copies
        def __init__(self) -> None:
            super().__init__()
            self.g = gm

        def forward(self, *args: Any) -> Any:
            return Recorder(self.g).run(*args)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    was, quiet.disabled = quiet.disabled, True
    try:
        with mode, torch.no_grad():
            state = {f"g.{k}": mode.from_tensor(v) for k, v in (*gm.named_parameters(remove_duplicate=False),
                                                                 *gm.named_buffers(remove_duplicate=False))}
            fake = [pytree.tree_map_only(torch.Tensor, mode.from_tensor, x) for x in flat]
            torch.func.functional_call(Whole(), state, tuple(fake), strict=False, tie_weights=False)
    finally:
        quiet.disabled = was
    return values


def _is_int(v: Any) -> bool:
    if isinstance(v, (torch.Size, tuple, list)):
        return bool(v) and all(_is_int(x) for x in v)
    return isinstance(v, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(v, bool)


def _name(node: fx.Node) -> str:
    t = node.target
    if node.op in ("call_method", "call_module"):
        return str(t)
    packet = getattr(t, "overloadpacket", None)
    if packet is not None:
        return str(getattr(packet, "__name__", t)).split(".")[-1]
    return str(getattr(t, "__name__", t))


def _positions(node: fx.Node, n: fx.Node) -> list[tuple[int | str, Any]]:
    """Where `n` appears among `node`'s arguments: (position or keyword, the argument holding it)."""
    out: list[tuple[int | str, Any]] = []
    for i, a in enumerate(node.args):
        if n in pytree.tree_leaves(a):
            out.append((i, a))
    for k, a in node.kwargs.items():
        if n in pytree.tree_leaves(a):
            out.append((k, a))
    return out


def _role(node: fx.Node, n: fx.Node, values: Mapping[fx.Node, Any]) -> Any:
    """How `node` (a use of the batch-dependent integer `n`) reads it: "shape", "value", "int"
    (integer arithmetic: followed further), "ignore" (a guard), "unknown", or, for a call whose
    arguments have roles of their own (`full(size, fill_value)`, an aten op's typed arguments),
    {argument position or keyword: "shape" or "value"}."""
    if node.op == "output":
        return "value"
    name = _name(node)
    if name.startswith(_IGNORED):
        return "ignore"
    v = values.get(node)
    if not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(v)) and (_is_int(v) or isinstance(v, bool)):
        return "int"
    if name in _VALUE_ARGS:
        return {p: "value" if p in _VALUE_ARGS[name] else "shape" for p, _ in _positions(node, n)}
    if name in _SHAPE_CALLS:  # before the schema: arange's end is typed Scalar, but is a size
        return "shape"
    schema = getattr(node.target, "_schema", None)
    if schema is not None:  # an aten op: its argument types say
        names = [a.name for a in schema.arguments]
        roles = {}
        for pos, _ in _positions(node, n):
            i = pos if isinstance(pos, int) else names.index(pos) if pos in names else None
            typ = str(schema.arguments[i].type) if i is not None and i < len(schema.arguments) else ""
            roles[pos] = "value" if any(k in typ.lower() for k in ("scalar", "number", "tensor", "float")) else "shape"
        return roles
    if node.op == "call_function" and node.target in (operator.add, operator.sub, operator.mul, operator.truediv,
                                                       operator.floordiv, operator.pow, operator.mod):
        return "value"  # arithmetic with a tensor (the result is a tensor)
    if name in _VALUE_CALLS:
        return "value"
    return "unknown"


def _replace_at(node: fx.Node, n: fx.Node, new: fx.Node, where: set) -> None:
    """Replace `n` by `new` in the arguments of `node` at the positions/keywords `where`."""
    swap = lambda a: pytree.tree_map_only(fx.Node, lambda x: new if x is n else x, a)  # noqa: E731
    node.args = tuple(swap(a) if i in where else a for i, a in enumerate(node.args))
    node.kwargs = {k: swap(a) if k in where else a for k, a in node.kwargs.items()}


def rewrite(gm: fx.GraphModule, flat: list, marks: Mapping[int, bool] | None = None,
            whole: Mapping[fx.Node, Any] | None = None) -> int:
    """Make every value use of a batch size in `gm` read the whole batch's (module docstring),
    for the example call `flat` (the placeholders' values; `marks`: microbatch.declared's;
    `whole`: `fake_values(gm, flat)` if already run). Returns how many uses were rewritten;
    MobiusError for a use no rule classifies."""
    if gm.meta.get("mobius_batch_sizes") is not None:
        return 0
    marks = marks or {}
    try:
        rows = batch_rows(tuple(flat), 1, marks)
    except MobiusError:
        rows = None
    if not rows or rows < 2:
        return 0
    d = next(k for k in range(2, rows + 1) if divides(rows, k))
    try:
        parts, mb = split(tuple(flat), d, marks)
        whole = fake_values(gm, flat) if whole is None else whole
        part = fake_values(gm, [parts[i * d] for i in range(len(flat))])
    except Exception:  # noqa: BLE001 (a graph that does not run on a part: micro-batches refuse it later)
        return 0
    ratio = d
    batchy = {n for n in gm.graph.nodes if n in whole and n in part and _is_int(whole[n])
              and _differs(whole[n], part[n])}
    count = 0
    for n in list(gm.graph.nodes):
        if n not in batchy:
            continue
        for user in list(n.users):
            role = _role(user, n, whole)
            where = None
            if isinstance(role, dict):  # per argument: rewrite only the values
                where = {p for p, r in role.items() if r == "value"}
                role = "value" if where else "shape"
            if role in ("shape", "ignore"):
                continue
            if role == "int":
                continue  # b * t: followed from `user` itself if it depends on the batch; b // b, b > 0 do not
            if role == "unknown":
                raise MobiusError(
                    f"`{user.format_node()}` reads the batch size `{n.name}` (it is {whole[n]} for the whole batch and "
                    f"{part[n]} for one micro-batch) in a way the pipeline cannot classify as a shape (kept per "
                    f"micro-batch, as in `.view(b, ...)`) or a value (read as the whole batch's, as in "
                    f"`loss / b`); {REMEDY}")
            with gm.graph.inserting_before(user):
                replacement = _whole(gm, n, whole, part, ratio, batchy, {})
            if where is None:
                user.replace_input_with(n, replacement)
            else:
                _replace_at(user, n, replacement, where)
            count += 1
    gm.meta["mobius_batch_sizes"] = count
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list, torch.Size)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    return a != b


def _whole(gm: fx.GraphModule, n: fx.Node, whole: Mapping, part: Mapping, ratio: int, batchy: set,
           made: dict) -> fx.Node:
    """A node computing the whole batch's value of the batch-dependent integer `n` (inserted at
    the graph's insertion point): `whole_size` at a shape read, `n`'s own op on whole inputs after."""
    if n in made:
        return made[n]
    w, p = whole[n], part[n]
    reads_tensor = any(isinstance(a, fx.Node) and isinstance(whole.get(a), torch.Tensor) for a in n.all_input_nodes)
    if reads_tensor or not any(a in batchy for a in n.all_input_nodes):
        if isinstance(w, (tuple, list, torch.Size)):
            dims = tuple(i for i, (a, b) in enumerate(zip(w, p)) if a != b)
            if any(w[i] != p[i] * ratio for i in dims):
                _refuse_nonlinear(n, w, p)
            out = gm.graph.call_function(whole_shape, (n, dims))
        else:
            if w != p * ratio:
                _refuse_nonlinear(n, w, p)
            out = gm.graph.call_function(whole_size, (n,))
    else:
        args = pytree.tree_map_only(fx.Node, lambda a: _whole(gm, a, whole, part, ratio, batchy, made)
                                    if a in batchy else a, (n.args, n.kwargs))
        out = gm.graph.create_node(n.op, n.target, args[0], args[1])
    out.meta.update({k: v for k, v in n.meta.items() if k in ("nn_module_stack", "stack_trace")})
    made[n] = out
    return out


def _refuse_nonlinear(n: fx.Node, w: Any, p: Any) -> None:
    raise MobiusError(f"`{n.format_node()}` reads a size that depends on the batch but not in proportion to it "
                      f"({w} for the whole batch, {p} for a part of it), and forward uses it as a value: micro-batches "
                      f"cannot give eager's; {REMEDY}")
