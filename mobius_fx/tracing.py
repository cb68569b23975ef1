"""Front ends: capture a model as one flat `torch.fx.GraphModule`.

Two tracers, tried in order:

1. `torch.fx.symbolic_trace` — fast, keeps `call_module` nodes, works on plain PyTorch models.
   It cannot handle Python control flow on traced values, `torch.ones(t, t)` with a traced `t`,
   or HF transformers ≥ 5 (no HF fx tracer any more).
2. `torch.export.export(..., strict=False).module()` — aten-level graph; handles the above,
   including HF models built with `use_cache=False`, and meta-device models of any size.

A symbolic trace that succeeds but whose graph does not run on the example inputs (checked on
meta copies, and on the real inputs if that fails) also falls through to export.

`module_path(node)` is the one way the later passes ask "which user module did this node come
from" (it reads `node.meta["nn_module_stack"]`, which both tracers record).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .errors import TraceError

__all__ = ["trace", "TraceInfo", "module_path", "module_stack", "flatten_inputs", "trace_info"]

_log = logging.getLogger("mobius_fx")

_REMEDY = (
    "avoid Python control flow on tensor values (`if x.sum() > 0`, `.item()`, `.tolist()`; use "
    "torch.where or torch.cond), pass non-tensor options such as `use_cache=False` for HF models "
    "through `example_kwargs` or the model config, and keep input shapes static inside forward"
)


@dataclass(frozen=True)
class TraceInfo:
    """How a GraphModule was captured; stored as `gm.meta["mobius_trace"]`.

    `names` maps every parameter/buffer name of the GraphModule (tied aliases included) to the
    name under which the user's model lists the *same tensor object* in `named_parameters()` /
    `named_buffers()` (the first name, for tied weights). `constants` are tensor attributes the
    front end created (export's lifted constants); they have no counterpart in the model.
    """

    front_end: str  # "fx" or "export"
    names: dict[str, str] = field(default_factory=dict)
    constants: tuple[str, ...] = ()
    fx_error: str = ""  # why symbolic_trace was not used (first line), "" when it was
    dynamic_batch: bool = False  # export only: dim 0 of the tensor inputs is symbolic
    seconds: float = 0.0

    def model_name(self, gm_name: str) -> str:
        """The user model's name for a GraphModule parameter/buffer name."""
        return self.names.get(gm_name, gm_name)


def trace(model: nn.Module, *, example_inputs: tuple[Any, ...] | list[Any] = (),
          example_kwargs: dict[str, Any] | None = None, front_end: str = "auto", dynamic_batch: bool = True,
          progress: Callable[[str], None] | None = None) -> fx.GraphModule:
    """Capture `model` as a flat `GraphModule` that shares the model's tensors.

    Guarantees:

    - `gm(*example_inputs, **example_kwargs)` computes what the model computes, with the same
      output structure. Call it with the same argument structure as the example (export checks
      it; non-tensor arguments are fixed to the example's values).
    - Every parameter and buffer of `gm` is the very tensor object the model holds (nothing is
      copied). `gm.meta["mobius_trace"].names` maps each `gm` name (tied aliases included) to the
      model's name for that tensor, so `torch.func.functional_call(gm, {g: model_state[n]})`
      runs the graph on the model's masters.
    - The model is left as it was: parameter and buffer values, `training` flags, and the
      CPU/CUDA RNG state are restored.
    - Every node produced inside a submodule carries `node.meta["nn_module_stack"]`;
      `module_path(node)` gives that module's qualified name. `get_attr` nodes sit immediately
      before their first user (export hoists them all to the top; we move them back).
    - On the export path, dim 0 of each tensor input is traced symbolic (`Dim.AUTO`) when
      `dynamic_batch`, so stages also run on micro-batches; export falls back to static shapes
      where the model pins the batch size. Such a GraphModule cannot switch train/eval mode:
      the mode is baked in at trace time (trace a model in the mode you will run it in).

    `front_end`: "auto" (symbolic_trace, then export), "fx" or "export" (that one only).
    Raises `TraceError` quoting the front ends' failures when none captures the model.

    >>> gm = trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), example_inputs=(torch.randn(2, 4),))
    >>> gm.meta["mobius_trace"].front_end
    'fx'
    """
    if front_end not in ("auto", "fx", "export"):
        raise TraceError(f"front_end={front_end!r} is not a front end; use 'auto', 'fx' or 'export'")
    args = tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    t0 = time.perf_counter()
    with _preserve_model(model):
        gm, fx_error, dynamic = None, "not tried (front_end='export')", False
        if front_end in ("auto", "fx"):
            gm, fx_error = _try_fx(model, args, kwargs)
        used = "fx"
        if gm is None and front_end == "fx":
            raise TraceError(f"torch.fx.symbolic_trace could not trace {type(model).__name__}: {fx_error}. "
                             f"Try front_end='auto' (falls back to torch.export), or {_REMEDY}.")
        if gm is None:
            if front_end == "auto":
                _report(progress, f"symbolic_trace failed ({fx_error}); trying torch.export (strict=False)")
            gm, export_error, dynamic = _try_export(model, args, kwargs, dynamic_batch)
            used = "export"
            if gm is None:
                raise TraceError(
                    f"could not trace {type(model).__name__} with "
                    f"{'either front end' if front_end == 'auto' else 'torch.export'}:\n"
                    f"  torch.fx.symbolic_trace: {fx_error}\n"
                    f"  torch.export.export(strict=False): {export_error}\n"
                    f"To make it traceable, {_REMEDY}."
                )
    _place_get_attrs(gm)
    names, constants = _name_map(gm, model)
    gm.meta["mobius_trace"] = TraceInfo(front_end=used, names=names, constants=constants,
                                        fx_error=fx_error, dynamic_batch=dynamic,
                                        seconds=time.perf_counter() - t0)
    _report(progress, f"traced {type(model).__name__} with {used}: {len(gm.graph.nodes)} nodes "
                      f"in {time.perf_counter() - t0:.2f} s")
    return gm


def trace_info(gm: fx.GraphModule) -> TraceInfo:
    """The `TraceInfo` of `gm`, or an identity one for a GraphModule `trace` did not make."""
    info = getattr(gm, "meta", {}).get("mobius_trace")
    if isinstance(info, TraceInfo):
        return info
    names, constants = _name_map(gm, gm)
    return TraceInfo(front_end="fx", names=names, constants=constants)


# ----------------------------------------------------------------------------- module paths

def module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """(qualified path, class name) of every module around `node`, outermost first, root excluded.

    Reads `nn_module_stack` (fx keys it by path, export by `L__self__...`; both store
    (path, type) values) and drops the root entry (path "").
    """
    stack = node.meta.get("nn_module_stack") or {}
    out: list[tuple[str, str]] = []
    for value in stack.values():
        path, kind = value[0], value[1]
        if not path or path.startswith("_empty_nn_module_stack"):
            continue  # the root, or export's placeholder for "no module" (sym_size nodes)
        cls = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
        out.append((_strip_export_prefix(path), cls))
    return out


def module_path(node: fx.Node) -> str:
    """Qualified name of the innermost user module `node` was produced in ("" for the root).

    `call_module` nodes without a recorded stack give their target; `get_attr` nodes without
    one give the module of their first user (where the attribute is used).

    >>> gm = trace(nn.Sequential(nn.Linear(4, 4)), example_inputs=(torch.randn(1, 4),))
    >>> [module_path(n) for n in gm.graph.nodes]
    ['', '0', '']
    """
    stack = module_stack(node)
    if stack:
        return stack[-1][0]
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr" and node.users:
        first = min(node.users, key=_position(node.graph))
        if first.op != "output":
            return module_path(first)
    return ""


def _strip_export_prefix(path: str) -> str:
    # Older export versions record "L__self___transformer_h_0"-style keys as paths.
    return path[len("L__self__"):].lstrip("_.") if path.startswith("L__self__") else path


def _position(graph: fx.Graph) -> Callable[[fx.Node], int]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


# ----------------------------------------------------------------------------- inputs

def flatten_inputs(gm: fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> list[Any]:
    """The value each placeholder of `gm` receives for the call `gm(*args, **kwargs)`, in order.

    Works for both front ends: export GraphModules flatten (args, kwargs) with their pytree
    spec; symbolic-trace ones bind the forward signature (defaults filled in).
    """
    kwargs = dict(kwargs or {})
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        import torch.fx._pytree as fx_pytree

        flat = fx_pytree.tree_flatten_spec((tuple(args), kwargs), info.in_spec)
        return list(flat)
    sig = inspect.signature(gm.forward)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    values = []
    for ph in placeholders:
        name = str(ph.target).lstrip("*")
        if name in bound.arguments:
            values.append(bound.arguments[name])
        elif ph.args:
            values.append(ph.args[0])
        else:
            raise TraceError(f"placeholder {ph.name!r} of the graph gets no value from the call; "
                             f"pass example inputs matching the traced signature {sig}")
    return values


# ----------------------------------------------------------------------------- fx front end

def _try_fx(model: nn.Module, args: tuple, kwargs: dict) -> tuple[fx.GraphModule | None, str]:
    try:
        concrete = _concrete_args(model, args, kwargs)
        gm = fx.symbolic_trace(model, concrete_args=concrete or None)
        _restore_concrete_defaults(gm, concrete)
    except Exception as e:  # any failure of the tracer means "try the other front end"
        return None, _first_line(e)
    error = _check_runs(gm, args, kwargs)
    if error:
        return None, f"the traced graph does not run on the example inputs: {error}"
    return gm, ""


def _concrete_args(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Scalar non-tensor arguments (and defaults not given) are fixed; the rest are inputs."""
    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs)
    concrete: dict[str, Any] = {}
    for name, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        value = bound.arguments[name] if name in bound.arguments else p.default
        if value is not p.empty and _is_scalar(value):
            concrete[name] = value
    return concrete


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device))


def _restore_concrete_defaults(gm: fx.GraphModule, concrete: dict[str, Any]) -> None:
    """symbolic_trace renames a fixed argument `scale` to a placeholder `scale_1` that asserts
    its value; give it back its name and the fixed value as default, so the GraphModule
    accepts the model's own call with or without that argument."""
    changed = False
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        base = str(node.target)[: -len("_1")] if str(node.target).endswith("_1") else None
        if base in concrete:
            node.target = base
            node.args = (concrete[base],)
            changed = True
    if changed:
        gm.recompile()


def _check_runs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> str:
    """Run `gm` on meta copies of everything (cheap, no side effects); if that fails and the
    inputs are real, run it once on the real inputs (no_grad, buffers cloned). "" = it runs."""
    meta_state = {k: _meta_like(v) for k, v in _state(gm).items()}
    meta_args, meta_kwargs = pytree.tree_map_only(torch.Tensor, _meta_like, (args, kwargs))
    try:
        with torch.no_grad():
            torch.func.functional_call(gm, meta_state, meta_args, meta_kwargs, strict=False, tie_weights=False)
        return ""
    except Exception as e:
        meta_error = _first_line(e)
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(t.is_meta for t in leaves) or any(t.is_meta for t in _state(gm).values()):
        return meta_error
    state = {k: (v.detach().clone() if not isinstance(v, nn.Parameter) else v) for k, v in _state(gm).items()}
    try:
        with torch.no_grad():
            torch.func.functional_call(gm, state, args, kwargs, strict=False, tie_weights=False)
        return ""
    except Exception as e:
        return _first_line(e)


# ----------------------------------------------------------------------------- export front end

def _try_export(model: nn.Module, args: tuple, kwargs: dict,
                dynamic_batch: bool) -> tuple[fx.GraphModule | None, str, bool]:
    error = ""
    attempts = [True, False] if dynamic_batch else [False]
    for dynamic in attempts:
        try:
            shapes = _batch_dynamic_shapes(model, args, kwargs) if dynamic else None
            if dynamic and shapes is None:
                continue
            ep = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=shapes)
            gm = ep.module(check_guards=False)
            return gm, "", dynamic and _has_symbolic_batch(gm)
        except Exception as e:
            error = _first_line(e)
            if not dynamic or "DataDependent" in type(e).__name__:
                break  # static shapes would not help a data-dependent branch
    return None, error, False


def _batch_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Dim.AUTO on dim 0 of every tensor input (export keeps it static where it must)."""
    from torch.export import Dim

    def spec(x: Any) -> Any:
        return {0: Dim.AUTO} if isinstance(x, torch.Tensor) and x.dim() > 0 else None

    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not leaves:
        return None
    if kwargs:
        sig = inspect.signature(model.forward)
        bound = sig.bind(*args, **kwargs)
        return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}
    return tuple(pytree.tree_map(spec, a) for a in args)


def _has_symbolic_batch(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() > 0:
            if isinstance(val.shape[0], torch.SymInt):
                return True
    return False


# ----------------------------------------------------------------------------- shared helpers

def _place_get_attrs(gm: fx.GraphModule) -> None:
    """Move each get_attr node right before its first user; drop unused ones.

    torch.export hoists every parameter access to the top of the graph, which would glue all
    weights to the first layer; placed at their use, layers stay contiguous runs of nodes.
    """
    graph = gm.graph
    changed = False
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        if not node.users:
            graph.erase_node(node)
            changed = True
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        first = min(node.users, key=order.__getitem__)
        if first.op == "output" or node.next is first:
            continue
        first.prepend(node)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()


def _name_map(gm: nn.Module, model: nn.Module) -> tuple[dict[str, str], tuple[str, ...]]:
    """gm name -> model name of the same tensor object; names of gm tensors the model lacks."""
    canonical: dict[int, str] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(t), name)
    for name, t in model.named_buffers(remove_duplicate=False):
        canonical.setdefault(id(t), name)
    names: dict[str, str] = {}
    constants: list[str] = []
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        if id(t) in canonical:
            names[name] = canonical[id(t)]
        else:
            constants.append(name)
    if isinstance(gm, fx.GraphModule):
        for node in gm.graph.nodes:
            if node.op != "get_attr" or node.target in names:
                continue
            value = _get_attr(gm, str(node.target))
            if isinstance(value, torch.Tensor):
                if id(value) in canonical:
                    names[str(node.target)] = canonical[id(value)]
                elif str(node.target) not in constants:
                    constants.append(str(node.target))
    return names, tuple(constants)


def _get_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    out.update(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    return out


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else out


@contextlib.contextmanager
def _preserve_model(model: nn.Module):
    """Restore training flags, buffer values and RNG state after tracing."""
    modes = [(m, m.training) for m in model.modules()]
    buffers = {k: b.detach().clone() for k, b in model.named_buffers() if not b.is_meta}
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for m, mode in modes:
            m.training = mode
        current = dict(model.named_buffers())
        with torch.no_grad():
            for k, saved in buffers.items():
                b = current.get(k)
                if b is not None and b.shape == saved.shape and not torch.equal(b, saved):
                    b.copy_(saved)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), text)
    if len(line) > 300:
        line = line[:297] + "..."
    return f"{type(e).__name__}: {line}"


def _report(progress: Callable[[str], None] | None, message: str) -> None:
    _log.info(message)
    if progress is not None:
        progress(message)
