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
import dataclasses
import inspect
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from mobius_fx import grad_modes
from mobius_fx.errors import TraceError, first_line
from mobius_fx.export_front import try_export
from mobius_fx.trace_key import Unkeyable, trace_key
from mobius_fx import trace_store
from mobius_fx.trace_semantics import (autograd_functions, describe, forward_effects, graph_checks, refuse_effects,
                                       refuse_input_writes, refuse_parameter_writes, refuse_traced_functions)

__all__ = ["trace", "TraceInfo", "flatten_inputs", "trace_info"]

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
    # `training` of each of the model's modules (model.modules() order) when traced: an export
    # graph computes in these modes whatever train()/eval() says later
    modes: tuple[bool, ...] = ()
    # the device the example inputs were on (the model's when no input is a tensor): what the
    # trace baked into factory ops and `.to` calls (mobius_fx/runtime/placement.py rewrites it per stage)
    device: str | None = None
    # the trace cache's key for this graph ("" when not cached: mobius_fx/trace_key.py), and
    # whether this graph was read from the cache instead of traced (mobius_fx/trace_store.py)
    key: str = ""
    cached: bool = False
    # the model's buffers forward changes in place (a counter, an EMA): with several micro-batches
    # the update runs once per micro-batch (build_pipeline warns)
    buffer_writes: tuple[str, ...] = ()

    def model_name(self, gm_name: str) -> str:
        """The user model's name for a GraphModule parameter/buffer name."""
        return self.names.get(gm_name, gm_name)


def trace(model: nn.Module, *, example_inputs: tuple[Any, ...] | list[Any] = (),
          example_kwargs: dict[str, Any] | None = None, front_end: str = "auto", dynamic_batch: bool = True,
          progress: Callable[[str], None] | None = None,
          cache_dir: str | os.PathLike | None = None) -> fx.GraphModule:
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
    - Autograd and state semantics are kept or refused (TraceError): symbolic_trace records each
      custom `torch.autograd.Function.apply` as one call, so its backward is kept; an export
      graph that traced through one is refused (export drops the backward). An in-place buffer
      update symbolic_trace cannot record (`self.count.add_(1)`) sends "auto" to export, which
      records it; a forward that changes a parameter in place is refused. A forward with a
      grad-mode region (`torch.no_grad()`, `set_grad_enabled`, `inference_mode`, a decorated
      method) also goes to export, which records it (mobius_fx/grad_modes.py); the caller's
      grad mode is the same after tracing as before.
    - Every node produced inside a submodule carries `node.meta["nn_module_stack"]`;
      `module_path(node)` gives that module's qualified name. `get_attr` nodes sit immediately
      before their first user (export hoists them all to the top; we move them back).
    - On the export path, every dim of each tensor input is traced `Dim.AUTO` when
      `dynamic_batch` (stages run on micro-batches; sequence lengths may vary between calls);
      export keeps a dim static where the model pins it, and falls back to a symbolic dim 0
      only, then to static shapes. Its guards are kept off the graph (`input_guards(gm)`), for
      the pipeline to check each call. Such a GraphModule cannot switch train/eval mode:
      the mode is baked in at trace time (trace a model in the mode you will run it in).
      A forward whose example passes values through `*args`/`**kwargs` (PEFT's `PeftModel`)
      is exported under an explicit signature, its base model's or the example's argument
      names (`export_signature`), so that its shapes can be dynamic; the graph's names and
      tensors stay the model's own.

    `front_end`: "auto" (symbolic_trace, then export), "fx" or "export" (that one only).
    Raises `TraceError` quoting the front ends' failures when none captures the model.

    `cache_dir`: a directory of traced graphs (None: no cache), kept without weights under a key
    of the model, its code, the inputs and these settings (mobius_fx/trace_key.py, trace_store.py);
    a trace with the same key reads the graph back bound to the model's own tensors ("trace:
    cached (key ...)"); an entry that does not read back or bind as stored is ignored (logged).

    >>> gm = trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), example_inputs=(torch.randn(2, 4),))
    >>> gm.meta["mobius_trace"].front_end
    'fx'
    """
    if front_end not in ("auto", "fx", "export"):
        raise TraceError(f"front_end={front_end!r} is not a front end; use 'auto', 'fx' or 'export'")
    args = tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    path = None
    if cache_dir is not None:
        try:
            path = Path(cache_dir) / f"{trace_key(model, args, kwargs, front_end=front_end, dynamic_batch=dynamic_batch)}.graph"
        except Unkeyable as e:
            _report(progress, f"trace: not cached ({e})")
    gm = _cached(path, model, progress) if path is not None and path.exists() else None
    if gm is not None:
        return gm
    gm = _traced(model, args, kwargs, front_end, dynamic_batch, progress, key=path.stem if path is not None else "")
    if path is not None:
        try:
            trace_store.save(gm, path, asdict(gm.meta["mobius_trace"]))
        except trace_store.Unstorable as e:
            gm.meta["mobius_trace"] = dataclasses.replace(gm.meta["mobius_trace"], key="")
            _report(progress, f"trace: not cached ({e})")
        except OSError as e:  # a read-only or full cache directory is not an error: the graph is good
            _report(progress, f"trace: not cached (cannot write {path}: {e.strerror or e})")
    return gm


def _traced(model: nn.Module, args: tuple, kwargs: dict, front_end: str, dynamic_batch: bool,
            progress: Callable[[str], None] | None, key: str) -> fx.GraphModule:
    """`trace`'s work when the cache does not answer: the front ends, the checks, the TraceInfo."""
    t0 = time.perf_counter()
    modes = tuple(m.training for m in model.modules())
    with _preserve_model(model), _no_kv_cache(model, kwargs, progress):
        with forward_effects(model) as effects:
            gm, fx_error, dynamic, applied = None, "not tried (front_end='export')", False, []
            if front_end in ("auto", "fx"):
                gm, fx_error = _try_fx(model, args, kwargs)
            used = "fx"
            if gm is None and front_end == "fx":
                raise TraceError(f"torch.fx.symbolic_trace could not trace {type(model).__name__}: {fx_error}. "
                                 f"Try front_end='auto' (falls back to torch.export), or {_REMEDY}.")
            if gm is None:
                gm, dynamic, applied = _export(model, args, kwargs, front_end, dynamic_batch, fx_error, progress)
                used = "export"
        refuse_effects(model, effects, used)
        refuse_traced_functions(model, applied, fx_error)
        _, written, inputs_written = _run_on_copies(gm, args, kwargs)
        refuse_parameter_writes(model, gm, written or [], _name_map(gm, model)[0])
        refuse_input_writes(model, args, kwargs, inputs_written or [])
    _place_get_attrs(gm)
    names, constants = _name_map(gm, model)
    buffers = {n for n, _ in gm.named_buffers(remove_duplicate=False)}
    buffer_writes = tuple(dict.fromkeys(names.get(n, n) for n in written or [] if n in buffers))
    gm.meta["mobius_trace"] = TraceInfo(front_end=used, names=names, constants=constants,
                                        fx_error=fx_error, dynamic_batch=dynamic,
                                        seconds=time.perf_counter() - t0, modes=modes,
                                        device=_input_device(model, args, kwargs), key=key,
                                        buffer_writes=buffer_writes)
    _report(progress, f"traced {type(model).__name__} with {used}: {len(gm.graph.nodes)} nodes "
                      f"in {time.perf_counter() - t0:.2f} s")
    return gm


def _cached(path: Path, model: nn.Module, progress: Callable[[str], None] | None) -> fx.GraphModule | None:
    """The graph cached at `path` bound to `model`, or None (with a log line) when it does not
    read back, or binds to the model's tensors otherwise than when it was traced."""
    t0 = time.perf_counter()
    try:
        gm, fields = trace_store.load(path, model)
        info = TraceInfo(**{**fields, "modes": tuple(fields["modes"]), "constants": tuple(fields["constants"]),
                            "buffer_writes": tuple(fields.get("buffer_writes", ()))})
        names, constants = _name_map(gm, model)
        if names != info.names or constants != info.constants:
            raise ValueError("its parameters and buffers bind to the model otherwise than when it was traced")
        gm.graph.lint()
    except Exception as e:  # anything: a corrupt, truncated or stale entry is never trusted
        _log.warning("trace: ignoring the cached graph %s (%s: %s); tracing again", path, type(e).__name__,
                     first_line(e))
        return None
    gm.meta["mobius_trace"] = dataclasses.replace(info, cached=True, seconds=time.perf_counter() - t0)
    _report(progress, f"trace: cached (key {path.stem[:12]}): {type(model).__name__}, {len(gm.graph.nodes)} nodes "
                      f"({info.front_end}) in {time.perf_counter() - t0:.2f} s")
    return gm


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module, kwargs: dict, progress: Callable[[str], None] | None):
    """Trace an HF model without its key/value cache: `config.use_cache` (True in HF's default
    configs) makes forward build and return a cache, which no tracer captures (the trace failed
    after minutes, naming `use_cache=False` as the fix). Every module config that has it on is set
    to False for the trace, said in the log, and put back afterwards (`generate()` reads it); a
    `use_cache` the example passes is the user's choice and left alone."""
    if "use_cache" in kwargs:
        yield
        return
    configs: dict[int, Any] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "use_cache", None) is True:
            configs.setdefault(id(cfg), cfg)
    if not configs:
        yield
        return
    for cfg in configs.values():
        cfg.use_cache = False
    _report(progress, f"{type(model).__name__}: config.use_cache=False while tracing (a training graph keeps no "
                      f"key/value cache); put back to True afterwards")
    try:
        yield
    finally:
        for cfg in configs.values():
            cfg.use_cache = True


def _export(model: nn.Module, args: tuple, kwargs: dict, front_end: str, dynamic_batch: bool, fx_error: str,
            progress: Callable[[str], None] | None) -> tuple[fx.GraphModule, bool, list[type]]:
    """`trace`'s second front end, torch.export (strict=False): (graph module, whether its dims
    are dynamic, the autograd.Function classes it traced through); TraceError quoting both
    front ends' failures (and the eager one, if the model itself fails on the inputs)."""
    if front_end == "auto":
        _report(progress, f"symbolic_trace failed ({fx_error}); trying torch.export (strict=False)")
    with autograd_functions(as_calls=False) as applied, _quiet_fake_tensors(), grad_modes.recording(set_grad=False):
        gm, export_error, dynamic = try_export(model, args, kwargs, dynamic_batch)
    if gm is None:
        with _quiet_fake_tensors():
            eager_error = _run_on_copies(model, args, kwargs)[0]
        raise TraceError(
            f"could not trace {type(model).__name__} with "
            f"{'either front end' if front_end == 'auto' else 'torch.export'}:\n"
            f"  torch.fx.symbolic_trace: {fx_error}\n"
            f"  torch.export.export(strict=False): {export_error}\n"
            + (f"The model itself does not run on these example inputs ({eager_error}): check their shapes "
               f"and dtypes against what forward expects (given: {_shapes(args, kwargs)}); "
               f"model(*example_inputs) shows the same error eagerly."
               if eager_error else f"To make it traceable, {_REMEDY}.")
        )
    return gm, dynamic, applied


def _input_device(model: nn.Module, args: tuple, kwargs: dict) -> str:
    for x in pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            return str(x.device)
    for t in (*model.parameters(), *model.buffers()):
        return str(t.device)
    return "cpu"


def trace_info(gm: fx.GraphModule) -> TraceInfo:
    """The `TraceInfo` of `gm`, or an identity one for a GraphModule `trace` did not make."""
    info = getattr(gm, "meta", {}).get("mobius_trace")
    if isinstance(info, TraceInfo):
        return info
    names, constants = _name_map(gm, gm)
    return TraceInfo(front_end="fx", names=names, constants=constants)


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
        versions = {k: t._version for k, t in _state(model).items()}
        with autograd_functions(as_calls=True), grad_modes.recording() as grad_changes:
            gm = fx.symbolic_trace(model, concrete_args=concrete or None)  # each Function one node: backward kept
        _restore_concrete_defaults(gm, concrete)
    except Exception as e:  # any failure of the tracer means "try the other front end"
        return None, first_line(e)
    changed = [k for k, t in _state(model).items() if k in versions and t._version != versions[k]]
    if changed:  # e.g. `self.count.add_(1)`: a buffer is a real tensor, not a traced value, to symbolic_trace
        return None, (f"forward changes {describe(model, changed[0])} in place on the real tensor, which "
                      f"symbolic_trace does not record (the update ran once, at trace time, and the graph would "
                      f"never repeat it); torch.export records such updates")
    if grad_changes:  # see mobius_fx/grad_modes.py
        return None, (f"forward changes the grad mode ({', '.join(grad_changes)}), which symbolic_trace does not "
                      f"record: its graph would compute gradients inside the region that eager computes without "
                      f"them; torch.export records grad-mode regions")
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


@contextlib.contextmanager
def _quiet_fake_tensors():
    """Silence torch's fake-tensor logger while a front end tries the model: a failing export
    logs each failed meta kernel with its traceback (~60 lines) before the error we report."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    was, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = was


def _shapes(args: tuple, kwargs: dict) -> str:
    """The example inputs' tensors as `name: shape dtype`, for error messages."""
    parts = [f"args[{i}]" for i in range(len(args))] + list(kwargs)
    out = []
    for name, v in zip(parts, (*args, *kwargs.values())):
        for t in pytree.tree_leaves(v):
            if isinstance(t, torch.Tensor):
                out.append(f"{name} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}")
    return ", ".join(out) or "no tensors"


def _check_runs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> str:
    """"" when `gm` runs on the example inputs, else why not (see `_run_on_copies`)."""
    return _run_on_copies(gm, args, kwargs)[0]


def _run_on_copies(gm: fx.GraphModule, args: tuple, kwargs: dict) -> tuple[str, list[str] | None, list[int] | None]:
    """Run `gm` once under no_grad on meta copies of everything (cheap, no side effects); if
    that fails and everything is real, on clones of the real inputs, parameters and buffers.
    Returns ("" or why it runs on neither, the names of gm's parameters and buffers the run
    changed in place, the indices of the input tensors -- `pytree.tree_leaves((args, kwargs))`
    order -- it changed in place; both None when it did not run). The model and the inputs are
    never touched."""
    state = _state(gm)
    copies = {k: _meta_like(v) for k, v in state.items()}
    inputs = pytree.tree_map_only(torch.Tensor, _meta_like, (args, kwargs))
    error = ""
    for real in (False, True):
        if real:
            leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if any(t.is_meta for t in leaves) or any(t.is_meta for t in state.values()):
                return error, None, None
            copies = {k: v.detach().clone() for k, v in state.items()}
            inputs = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
        versions = {k: t._version for k, t in copies.items()}
        given = [(i, t, t._version) for i, t in enumerate(pytree.tree_leaves(inputs)) if isinstance(t, torch.Tensor)]
        try:
            with torch.no_grad(), graph_checks():
                torch.func.functional_call(gm, copies, inputs[0], inputs[1], strict=False, tie_weights=False)
        except Exception as e:
            error = first_line(e)
            continue
        return ("", [k for k, t in copies.items() if t._version != versions[k]],
                [i for i, t, v in given if t._version != v])
    return error, None, None


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


def _report(progress: Callable[[str], None] | None, message: str) -> None:
    _log.info(message)
    if progress is not None:
        progress(message)
