"""The trace cache's store: a traced GraphModule written to disk without its weights, and read
back bound to the user's model.

`torch.export.save`/`load` would keep an ExportedProgram, but loading one re-parses every
symbolic shape with sympy and rebuilds a fake tensor per node: for Llama-70B (5,915 nodes) it
takes as long as exporting again. What the later passes read from a traced graph is less:

- the nodes: name, op, target, args, kwargs, and `meta["nn_module_stack"]` (layers follow
  module boundaries);
- each node's output dtype (the runtime's differentiable-output test): kept as
  `meta["tensor_meta"]` (shape, with symbolic sizes as text, and dtype), not as a fake tensor;
- the placeholders' `meta["val"]` (fake tensors whose symbolic sizes the call-shape check reads),
  `gm.range_constraints` (the symbols' ranges) and export's input guards (their compiled code);
- the pytree calling convention (`graph._codegen`), the bodies of higher-order ops (nested
  graph modules), the front end's own constants (export's lifted ones), and `TraceInfo`.

What a restored graph does not keep: torch.export's forward hooks on the graph module (a
direct `gm(...)` call does not check export's input constraints; the pipeline checks every call
with `input_guards` and the placeholders' shapes, mobius_fx/runtime/call_signatures.py), node
metadata nothing reads (`stack_trace`, `source_fn_stack`, `from_node`) and fake tensors beyond
the placeholders.

The parameters and buffers are never written: each is stored as its name in the model
(`TraceInfo.names`), and `load` binds the graph to the model's own tensors, as a fresh trace
does; it then checks the binding against the stored one. Anything the store cannot write
exactly (a call target it cannot name, an unknown codegen) raises `Unstorable`: the graph is
used as traced and not cached.

    save(gm, path, info)       # after trace (info: the TraceInfo fields)
    gm, info = load(path, model)   # raises on anything stale or corrupt; the caller retraces
"""

from __future__ import annotations

import importlib
import marshal
import math
import os
import pickle
import types
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import TensorMetadata

__all__ = ["save", "load", "Unstorable", "STORE_FORMAT"]

STORE_FORMAT = 1
# where a builtin call target without a `__module__` (torch.arange) is looked up by name
_BUILTIN_HOMES = ("torch", "torch.nn.functional", "torch._C._nn", "torch.functional", "operator", "math", "builtins")


class Unstorable(Exception):
    """The graph holds something the store cannot write exactly; it is not cached."""


class _Ref:
    """A reference to the node named `name` in a stored node's args."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self):
        return (_Ref, (self.name,))


class _Sym:
    """A symbolic size in a stored placeholder's shape: its expression (sympy, pickled) and hint."""

    __slots__ = ("expr", "hint")

    def __init__(self, expr: Any, hint: int | None) -> None:
        self.expr, self.hint = expr, hint

    def __reduce__(self):
        return (_Sym, (self.expr, self.hint))


# ----------------------------------------------------------------------------- save

def save(gm: fx.GraphModule, path: Path, info: dict) -> None:
    """Write `gm` (as `trace` returned it) and `info` (its TraceInfo's fields: `names`, gm name ->
    model name, `constants`, `front_end`) to `path`, atomically (a temporary file renamed)."""
    entry = {"format": STORE_FORMAT, "info": info, "graph": _encode_module(gm, info, root=True)}
    guards = gm.meta.get("mobius_guards")
    entry["guards"] = _encode_guards(guards) if guards is not None else None
    entry["ranges"] = dict(getattr(gm, "range_constraints", None) or {}) or None
    entry["fixed_mode"] = "train" in vars(gm)  # export's graph refuses train()/eval(): its modes are baked in
    try:
        blob = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # an arg or meta value pickle cannot write
        raise Unstorable(f"cannot pickle the graph ({type(e).__name__}: {e})") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(blob)
    tmp.replace(path)


def _encode_module(gm: fx.GraphModule, info: dict, *, root: bool) -> dict:
    codegen = gm.graph._codegen
    if type(codegen) is fx.graph.CodeGen:
        pytree_info = None
    elif type(codegen).__name__ == "_PyTreeCodeGen":
        pytree_info = codegen.pytree_info
    else:
        raise Unstorable(f"the graph's codegen is a {type(codegen).__name__}")
    nodes, subs, constants = [], {}, {}
    state = set(info["names"]) if root else set()
    for node in gm.graph.nodes:
        nodes.append((node.name, node.op, _encode_target(node), _encode_arg(node.args), _encode_arg(node.kwargs),
                      _encode_meta(node), _encode_type(node.type)))
        if node.op in ("get_attr", "call_module") and str(node.target) not in state:
            value = _attr(gm, str(node.target))
            if isinstance(value, fx.GraphModule):
                subs[str(node.target)] = _encode_module(value, info, root=False)
            elif isinstance(value, torch.Tensor) and root and str(node.target) in info["constants"]:
                constants[str(node.target)] = value.detach()
            elif node.op == "call_module" and info["front_end"] == "fx":
                pass  # the model's own submodule: bound by its path
            else:
                raise Unstorable(f"node {node.name} reads {node.target!r}, a {type(value).__name__} the store "
                                 f"cannot bind")
    non_persistent = sorted(f"{p}.{b}" if p else b for p, m in gm.named_modules()
                            for b in getattr(m, "_non_persistent_buffers_set", ()))
    return {"class_name": type(gm).__name__ if root else "GraphModule", "nodes": nodes, "pytree_info": pytree_info,
            "subs": subs, "constants": constants, "non_persistent": non_persistent}


def _encode_target(node: fx.Node) -> Any:
    target = node.target
    if node.op != "call_function":
        return target
    if isinstance(target, torch._ops.OpOverload):
        return ("op", target.namespace, target._schema.name.split("::")[-1], target._overloadname)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return ("packet", target._qualified_op_name.split("::")[0], target._qualified_op_name.split("::")[-1])
    if isinstance(target, torch._ops.HigherOrderOperator):
        return ("hop", target.name())
    names = {getattr(target, "__qualname__", None), getattr(target, "__name__", None)} - {None}
    for module in (getattr(target, "__module__", None), *_BUILTIN_HOMES):
        for qualname in sorted(names):
            if module and "<" not in qualname:
                try:
                    if _resolve_python(module, qualname) is target:
                        return ("py", module, qualname)
                except (ImportError, AttributeError):
                    pass
    raise Unstorable(f"node {node.name} calls {target!r}, which cannot be named by module and qualified name")


def _encode_arg(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return _Ref(a.name)
    if isinstance(a, (tuple, list)):
        items = [_encode_arg(x) for x in a]
        return tuple(items) if isinstance(a, tuple) else items
    if isinstance(a, dict):
        return {k: _encode_arg(v) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_encode_arg(a.start), _encode_arg(a.stop), _encode_arg(a.step))
    if isinstance(a, torch.Tensor):
        raise Unstorable("a tensor held in a node's arguments")
    return a


def _encode_type(annotation: Any) -> Any:
    """A node's type annotation (`x: torch.Tensor`, shown in the generated code) when it pickles, else None."""
    if annotation is None:
        return None
    try:
        pickle.dumps(annotation)
    except Exception:
        return None
    return annotation


def _encode_meta(node: fx.Node) -> dict:
    meta: dict[str, Any] = {}
    stack = node.meta.get("nn_module_stack")
    if stack is not None:
        meta["nn_module_stack"] = {k: (v[0], v[1] if isinstance(v[1], str) else f"{v[1].__module__}.{v[1].__qualname__}")
                                   for k, v in stack.items()}
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    if node.op == "placeholder" and isinstance(val, torch.Tensor):
        meta["placeholder"] = ([_size(s) for s in val.shape], val.dtype, str(val.device), val.requires_grad)
    elif val is not None:
        described = _describe(val)
        if described is not None:
            meta["tensor_meta"] = described
    return meta


def _size(s: Any) -> Any:
    if isinstance(s, torch.SymInt):
        return _Sym(s.node.expr, s.node.hint)
    return int(s)


def _describe(val: Any) -> Any:
    """A node's output as TensorMetadata (symbolic sizes as text), tuples of them, None for others."""
    if isinstance(val, (tuple, list)):
        items = [_describe(v) for v in val]
        return tuple(items) if any(i is not None for i in items) else None
    if isinstance(val, TensorMetadata):
        val_shape, dtype, grad = val.shape, val.dtype, val.requires_grad
    elif isinstance(val, torch.Tensor):
        val_shape, dtype, grad = val.shape, val.dtype, val.requires_grad
    else:
        return None
    shape = tuple(str(s) if isinstance(s, torch.SymInt) else int(s) for s in val_shape)
    return TensorMetadata(shape, dtype, grad, None, None, False, {})


def _encode_guards(guards: nn.Module) -> bytes:
    """The code of export's guard function (`torch.export._unlift`: generated source, exec'd in
    sympy's namespace), out of the wrappers torch puts around it (`dont_skip_tracing`)."""
    fn = guards.forward
    for _ in range(8):
        if getattr(fn, "__closure__", None) is None:
            break
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__))
        if "func" not in cells:
            break
        fn = cells["func"].cell_contents
    code = getattr(fn, "__code__", None)
    if code is None or code.co_freevars:
        raise Unstorable("export's guards are not one plain function")
    return marshal.dumps(code)


# ----------------------------------------------------------------------------- load

def load(path: Path, model: nn.Module) -> tuple[fx.GraphModule, dict]:
    """(the GraphModule stored at `path` bound to `model`'s parameters and buffers, the info stored
    with it). Raises (anything: the caller treats every failure as a stale or corrupt entry) when
    the file does not read back; the caller checks the binding against `info["names"]`."""
    with warnings.catch_warnings():  # torch's TreeSpec warns of its own deprecated LeafSpec as it unpickles
        warnings.simplefilter("ignore", FutureWarning)
        entry = pickle.loads(Path(path).read_bytes())
    if not isinstance(entry, dict) or entry.get("format") != STORE_FORMAT:
        raise ValueError(f"not a stored graph of format {STORE_FORMAT}")
    info = entry["info"]
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    state = {gm_name: tensors[model_name] for gm_name, model_name in info["names"].items()}
    shapes = _ShapeBuilder(entry.get("ranges"))
    gm = _decode_module(entry["graph"], model if info["front_end"] == "fx" else None, state, shapes)
    if shapes.ranges is not None:
        gm.range_constraints = shapes.ranges
    if entry.get("guards") is not None:
        gm.meta["mobius_guards"] = _decode_guards(entry["guards"])
    if entry.get("fixed_mode"):
        gm.train = types.MethodType(_refuse_train, gm)  # type: ignore[method-assign]
        gm.eval = types.MethodType(_refuse_eval, gm)  # type: ignore[method-assign]
    return gm, info


def _refuse_train(self: nn.Module, mode: bool = True) -> nn.Module:
    raise NotImplementedError("Calling train() is not supported yet.")  # as torch.export's graph module says


def _refuse_eval(self: nn.Module) -> nn.Module:
    raise NotImplementedError("Calling eval() is not supported yet.")


def _decode_module(enc: dict, model: nn.Module | None, state: dict[str, torch.Tensor],
                   shapes: "_ShapeBuilder") -> fx.GraphModule:
    graph = fx.Graph()
    if enc["pytree_info"] is not None:
        graph._codegen = fx.graph._PyTreeCodeGen(enc["pytree_info"])
    env: dict[str, fx.Node] = {}

    def arg(a: Any) -> Any:
        if isinstance(a, _Ref):
            return env[a.name]
        if isinstance(a, tuple):
            return tuple(arg(x) for x in a)
        if isinstance(a, list):
            return [arg(x) for x in a]
        if isinstance(a, dict):
            return {k: arg(v) for k, v in a.items()}
        if isinstance(a, slice):
            return slice(arg(a.start), arg(a.stop), arg(a.step))
        return a

    attrs: dict[str, Any] = {}
    for name, op, target, args, kwargs, meta, type_ in enc["nodes"]:
        node = graph.create_node(op, _decode_target(op, target), arg(args), arg(kwargs), name=name, type_expr=type_)
        if node.name != name:
            raise ValueError(f"node {name!r} came back as {node.name!r}")
        env[name] = node
        if "nn_module_stack" in meta:
            node.meta["nn_module_stack"] = dict(meta["nn_module_stack"])
        if "tensor_meta" in meta:
            node.meta["tensor_meta"] = meta["tensor_meta"]
        if "placeholder" in meta:
            node.meta["val"] = shapes.tensor(*meta["placeholder"])
        if op in ("get_attr", "call_module") and target not in attrs:
            if target in enc["subs"]:
                attrs[target] = _decode_module(enc["subs"][target], None, {}, shapes)
            elif target in enc["constants"]:
                attrs[target] = enc["constants"][target]
            elif target in state:
                attrs[target] = state[target]
            elif model is not None:
                attrs[target] = _attr(model, target)  # fx: the model's own submodule
            else:
                raise ValueError(f"node {name!r} reads {target!r}, which the entry does not hold")
    gm = fx.GraphModule(attrs, graph, class_name=enc["class_name"])
    for target, value in state.items():  # the model's tensors the graph never reads are the graph's too
        if _get(gm, target) is None:
            _assign(gm, target, value)
    for target in enc["non_persistent"]:
        owner, _, leaf = target.rpartition(".")
        gm.get_submodule(owner)._non_persistent_buffers_set.add(leaf)
    return gm


def _decode_target(op: str, target: Any) -> Any:
    if op != "call_function":
        return target
    kind = target[0]
    if kind == "op":
        return getattr(getattr(getattr(torch.ops, target[1]), target[2]), target[3])
    if kind == "packet":
        return getattr(getattr(torch.ops, target[1]), target[2])
    if kind == "hop":
        return getattr(torch.ops.higher_order, target[1])
    return _resolve_python(target[1], target[2])


def _resolve_python(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _ShapeBuilder:
    """Fake tensors for the placeholders, their symbolic sizes in one fresh ShapeEnv; the stored
    ranges keyed by the same symbols."""

    def __init__(self, ranges: dict | None) -> None:
        self._mode = None
        self.ranges = dict(ranges) if ranges else None

    def _env(self):
        if self._mode is None:
            from torch._subclasses.fake_tensor import FakeTensorMode
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            self._mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
        return self._mode

    def tensor(self, shape: list, dtype: torch.dtype, device: str, requires_grad: bool) -> torch.Tensor:
        import sympy

        mode = self._env()
        env = mode.shape_env
        sizes: list[Any] = []
        for s in shape:
            if not isinstance(s, _Sym):
                sizes.append(s)
                continue
            values = getattr(env, "backed_var_to_val", None)
            values = env.var_to_val if values is None else values
            for sym in s.expr.free_symbols:
                if sym not in values:
                    if s.hint is None or not s.expr.is_Symbol:
                        raise ValueError(f"symbolic size {s.expr} has no hint to rebuild it with")
                    values[sym] = sympy.Integer(s.hint)
            sizes.append(env.create_symintnode(s.expr, hint=s.hint))
        with mode:
            t = torch.empty(sizes, dtype=dtype, device=device)
        return t.requires_grad_(requires_grad) if requires_grad else t


def _decode_guards(code: bytes) -> nn.Module:
    from torch.export._unlift import GuardsFn
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    namespace = {**SYMPY_INTERP, "math": math, "inf": float("inf")}
    guards = GuardsFn()
    guards.forward = types.FunctionType(marshal.loads(code), namespace, "_")  # type: ignore[method-assign]
    return guards


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _get(root: nn.Module, target: str) -> Any:
    try:
        return _attr(root, target)
    except AttributeError:
        return None


def _assign(root: nn.Module, target: str, value: Any) -> None:
    """Set `target` (a dotted path) on `root`, making plain modules for missing parents; a tensor
    that is not a Parameter becomes a buffer."""
    *parents, leaf = target.split(".")
    mod = root
    for p in parents:
        nxt = getattr(mod, p, None)
        if nxt is None:
            nxt = nn.Module()
            setattr(mod, p, nxt)
        mod = nxt
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        mod.register_buffer(leaf, value)
    else:
        setattr(mod, leaf, value)
