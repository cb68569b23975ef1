"""The device constants a trace fixed, rewritten to each stage's device (mobius_fx/runtime/placement.py
says why and how): `traced_device`, `rewrite_graph` on one graph, `place_stage` on a stage
(its graph, its higher-order ops' bodies, its tensor constants that are not weights),
`moved_module` for a copy of a placed stage on another device (a schedule that runs a stage on
another GPU: runtime/executor.py), and `random_nodes`: the ops of a graph that draw random
numbers (a recompute elsewhere must draw the same).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from mobius_fx.planning.stage_contract import StageSpec

__all__ = ["traced_device", "rewrite_graph", "rewritten_body", "place_stage", "moved_module", "moved_graph_module",
           "bind", "random_nodes", "weight_places", "named_tensors", "moved_device", "copy_graph", "COMPUTE_OPS"]

# torch-level factory functions (the fx front end records them as call_function nodes)
_TORCH_FACTORIES = frozenset(getattr(torch, n) for n in (
    "arange", "ones", "zeros", "full", "empty", "empty_strided", "eye", "linspace", "logspace", "rand",
    "randn", "randint", "randperm", "tensor", "as_tensor", "scalar_tensor", "tril_indices", "triu_indices",
) if hasattr(torch, n))
# nodes that read metadata (sizes, dims, the device): a device-ness does not flow through them
_META_METHODS = frozenset({"size", "dim", "numel", "stride", "element_size", "get_device"})
_META_FUNCTIONS = frozenset({len} | {getattr(torch.ops.aten, n).default for n in ("sym_numel", "sym_storage_offset")}
                            | {getattr(torch.ops.aten, n).int for n in ("sym_size", "sym_stride")})
_META_ATTRS = frozenset({"shape", "device", "dtype", "ndim", "layout", "is_cuda", "requires_grad"})  # not `x.T`
COMPUTE_OPS = ("call_function", "call_method", "call_module")


def traced_device(gm: fx.GraphModule) -> torch.device:
    """The device `gm` was traced on: where `mobius_fx.trace` found the example inputs (the
    model's parameters when no input is a tensor); for a GraphModule it did not make, where its
    first parameter or buffer is; the CPU when it has none."""
    from mobius_fx.tracing import trace_info

    info = trace_info(gm)
    if getattr(info, "device", None):
        return torch.device(info.device)
    for t in (*gm.parameters(), *gm.buffers()):
        return t.device
    return torch.device("cpu")


def _as_device(value: object) -> torch.device | None:
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError:
            return None
    return None


def _same(value: object, src: torch.device) -> bool:
    """Whether `value` (a device or its name) names `src`; a device without an index ("cuda")
    names any index of its type."""
    d = _as_device(value)
    return d is not None and d.type == src.type and (d.index is None or src.index is None or d.index == src.index)


def _is_to(node: fx.Node) -> bool:
    t = node.target
    if node.op == "call_method":
        return t == "to"
    return t is torch.Tensor.to or (isinstance(t, torch._ops.OpOverload) and t.overloadpacket is torch.ops.aten.to)


def _is_factory(node: fx.Node) -> bool:
    """A call that makes a new tensor from nothing but sizes and values: it lands on the default
    device (the CPU) unless given one. `*_like` calls follow their input and are not."""
    if node.op != "call_function":
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        args = t._schema.arguments
        return (any(a.name == "device" for a in args)
                and not any(isinstance(a.type, torch.TensorType) for a in args)
                and any(isinstance(r.type, torch.TensorType) for r in t._schema.returns))
    return t in _TORCH_FACTORIES


def _device_seeds(graph: fx.Graph, src: torch.device) -> set[fx.Node]:
    """Nodes whose value lives on the stage's device or is computed from one: the stage's inputs
    (the runtime copies each tensor input to the stage's device), its weights (get_attr), its
    modules' outputs, factory calls on the traced device (rewritten to the stage's) and
    everything computed from them, except through metadata reads
    (`x.size(0)` is a Python int wherever x lives)."""
    on: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr", "call_module"):
            on.add(n)
        elif n.op in ("call_function", "call_method"):
            if _is_factory(n):  # on the device when the rewrite puts it there; without a device: decided later
                if _has_device(n) and _same(n.kwargs["device"], src):
                    on.add(n)
                continue
            if any(a in on and not _reads_metadata(a) for a in n.all_input_nodes):
                on.add(n)
    return on


def _reads_metadata(n: fx.Node) -> bool:
    if n.op == "call_method":
        return n.target in _META_METHODS
    if n.op == "call_function" and n.target is getattr:
        return len(n.args) > 1 and n.args[1] in _META_ATTRS
    return n.op == "call_function" and n.target in _META_FUNCTIONS


def _has_device(n: fx.Node) -> bool:
    return n.kwargs.get("device") is not None


def _feeds(node: fx.Node, on: set[fx.Node]) -> bool:
    """Whether the value of `node` meets a value of the stage's device downstream."""
    seen: set[fx.Node] = set()
    todo = list(node.users)
    while todo:
        u = todo.pop()
        if u in seen or u.op == "output":
            continue
        seen.add(u)
        if u in on:
            return True
        if not _reads_metadata(u):
            todo.extend(u.users)
    return False


def rewrite_graph(graph: fx.Graph, src: torch.device, dst: torch.device) -> list[str]:
    """Rewrite `graph` in place so that what the trace fixed to `src` runs on `dst`:

    - a `device=` argument naming `src` (factories, `_to_copy`, `to.dtype_layout`,
      `_assert_tensor_metadata`, `*_like`, `new_*`) becomes `dst`;
    - a positional device naming `src` (`aten.to.device(x, cpu, ...)`, `x.to("cpu")`) becomes
      `dst` (positional strings only in `.to` calls, where they can only be a device);
    - a factory call without a device whose value meets a value of the stage gets `device=dst`.

    Returns the names of the nodes changed. The graph's `lint` still passes; the caller
    recompiles its GraphModule.
    """
    changed: list[str] = []
    on = _device_seeds(graph, src)
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        kwargs = dict(node.kwargs)
        args = list(node.args)
        touched = False
        if "device" in kwargs and kwargs["device"] is not None and _same(kwargs["device"], src):
            kwargs["device"] = dst
            touched = True
        for j, a in enumerate(args):
            if isinstance(a, torch.device) and _same(a, src) or (isinstance(a, str) and _is_to(node) and _same(a, src)):
                args[j] = dst
                touched = True
        if _is_factory(node) and kwargs.get("device") is None and _feeds(node, on):
            kwargs["device"] = dst
            touched = True
        if _is_autocast(node) and args and isinstance(args[0], str) and args[0] == src.type != dst.type:
            args[0] = dst.type  # `with torch.autocast("cpu", enabled=False)` guards the GPU's autocast there
            touched = True
        if touched:
            node.args, node.kwargs = tuple(args), kwargs
            changed.append(node.name)
    return changed


def _is_autocast(node: fx.Node) -> bool:
    """export's autocast region, as a higher-order op or as the enter call: (device_type, ...)."""
    return node.op == "call_function" and getattr(node.target, "__name__", "") in ("wrap_with_autocast",
                                                                                   "_enter_autocast")


def rewritten_body(body: fx.GraphModule, src: torch.device, dst: torch.device) -> tuple[fx.GraphModule, list[str]]:
    """A higher-order op's body (export's `torch.no_grad()` or autocast region) rewritten like
    its stage, as a new GraphModule over a copy of its graph (bodies nested in it too): the body
    is shared with the traced graph and the user's other pipelines, so it is never changed."""
    graph = copy_graph(body.graph)
    changed = [f"{body.__class__.__name__}.{c}" for c in rewrite_graph(graph, src, dst)]
    new = fx.GraphModule(body, graph, class_name=type(body).__name__)
    for node in graph.nodes:
        inner = _attr(new, str(node.target)) if node.op == "get_attr" else None
        if isinstance(inner, fx.GraphModule):
            sub, more = rewritten_body(inner, src, dst)
            _set_module(new, str(node.target), sub)
            changed += more
    if changed:
        new.recompile()
    return (new if changed else body), changed


def _attr(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _set_module(root: torch.nn.Module, target: str, module: torch.nn.Module) -> None:
    path, _, name = target.rpartition(".")
    owner = root.get_submodule(path) if path else root
    owner._modules[name] = module


def bind(module: torch.nn.Module, path: str, attr: str, value: torch.Tensor) -> None:
    """Make `value` the tensor at `path`.`attr` of `module` (a parameter, a buffer or a plain
    attribute, as it is there): a stage's weight slot, or a constant moved to its device."""
    owner = module.get_submodule(path) if path else module
    if attr in owner._parameters:
        owner._parameters[attr] = value
    elif attr in owner._buffers:
        owner._buffers[attr] = value
    else:
        object.__setattr__(owner, attr, value)


def weight_places(spec: StageSpec) -> set[str]:
    return {f"{path}.{attr}" if path else attr for w in spec.weights for path, attr in w.slots}


def named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def moved_device(name: str, t: torch.Tensor, weights: set[str], src: torch.device, dst: torch.device) -> torch.device:
    """Where a stage's tensor attribute is when the stage runs on `dst`: weights are uploaded
    there by the runtime; other tensor constants there too when they sit on the traced device."""
    if name in weights or _same(t.device, src):
        return dst
    return t.device


def place_stage(spec: StageSpec, src: torch.device, dst: torch.device) -> list[str]:
    """Bind stage `spec`'s graph to `dst`: `rewrite_graph` on its graph (recompiled when it
    changed) and its tensor constants that are not weights moved to `dst` when on `src`.
    Returns what changed (node names, then attribute names)."""
    module = spec.module
    changed = rewrite_graph(module.graph, src, dst)
    if changed:
        module.graph.lint()
        module.recompile()
    for node in module.graph.nodes:
        body = _attr(module, str(node.target)) if node.op == "get_attr" else None
        if isinstance(body, fx.GraphModule):
            new, more = rewritten_body(body, src, dst)
            if more:
                _set_module(module, str(node.target), new)
                changed += more
    weights = weight_places(spec)
    for name, t in named_tensors(module):
        if name not in weights and t.device != dst and _same(t.device, src):
            path, _, attr = name.rpartition(".")
            bind(module, path, attr, t.detach().to(dst))
            changed.append(name)
    return changed


def moved_module(spec: StageSpec, module: fx.GraphModule, src: torch.device, dst: torch.device
                 ) -> tuple[fx.GraphModule, list[tuple[str, str, torch.Tensor]]]:
    """Stage `spec`'s module as its copy on `dst` runs it, `module` being the stage bound to
    `src` (`place_stage`): a new GraphModule over a copy of its graph, rewritten from `src` to
    `dst` as `place_stage` rewrites (device constants, factories that meet the stage, autocast
    regions, the higher-order ops' bodies, as copies). The modules the graph calls are shared
    with `module` (fx copies the graph's attributes into a skeleton of its own): the stage's
    graph and its own attributes are never changed. Returns it and its tensor constants that
    are not weights, moved to `dst`, as (module path, attribute, tensor), bound into the new
    module: a constant of a module both call is one attribute for both, so the caller binds the
    copy's whenever it runs the copy (`StageState.bind_slots`) and the stage's own values when
    it runs the stage. (Compiled pipelines upload every tensor a stage reads as a weight; this
    is for one built otherwise.)"""
    new = moved_graph_module(module, src, dst)
    weights = weight_places(spec)
    consts = []
    for name, t in named_tensors(new):
        if name not in weights and t.device != dst and _same(t.device, src):
            path, _, attr = name.rpartition(".")
            consts.append((path, attr, t.detach().to(dst)))
    for path, attr, t in consts:
        bind(new, path, attr, t)
    return new, consts


def moved_graph_module(module: fx.GraphModule, src: torch.device, dst: torch.device,
                       bodies_from: torch.device | None = None) -> fx.GraphModule:
    """A new GraphModule over a copy of `module`'s graph rewritten from `src` to `dst`, its
    higher-order ops' bodies rewritten from `bodies_from` (default `src`) to `dst` (as copies),
    the modules and tensors it calls or reads shared with `module` (`moved_module`; the
    placement check's stage as bound to its device: runtime/placement.py)."""
    graph = copy_graph(module.graph)
    rewrite_graph(graph, src, dst)
    new = fx.GraphModule(module, graph, class_name=type(module).__name__)
    for node in graph.nodes:
        body = _attr(new, str(node.target)) if node.op == "get_attr" else None
        if isinstance(body, fx.GraphModule):
            _set_module(new, str(node.target), rewritten_body(body, bodies_from or src, dst)[0])
    return new


# Random ops of a torch.fx graph (not aten): torch functions, tensor methods, modules; aten ops say
# so with their `nondeterministic_seeded` tag
_RANDOM_FUNCTIONS = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "native_dropout",
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli", "multinomial",
    "normal", "poisson", "rrelu", "gumbel_softmax", "scaled_dot_product_attention"})
_RANDOM_METHODS = frozenset({"bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_",
                             "geometric_", "cauchy_", "log_normal_", "multinomial"})
# the arguments (name, position, default) of the torch-level functions that draw nothing when the
# probability is 0 or they are not training (aten ops: read from their schema)
_PROBABILITY = {"scaled_dot_product_attention": (("dropout_p", 4, 0.0), None)}
_PROBABILITY.update({n: (("p", 1, 0.5), ("training", 2, True)) for n in (
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")})


def _argument(node: fx.Node, name: str, pos: int, default: object) -> object:
    return node.kwargs.get(name, node.args[pos] if len(node.args) > pos else default)


def _draws_nothing(node: fx.Node) -> bool:
    """A dropout-like op whose probability is the literal 0, or whose `train` is False: it draws
    no random number. Anything else (a probability computed at run time) draws."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        p = train = None
        for pos, a in enumerate(t._schema.arguments):
            default = a.default_value if a.has_default_value() else None
            if a.name in ("p", "dropout_p"):
                p = _argument(node, a.name, pos, default)
            elif a.name in ("train", "training"):
                train = _argument(node, a.name, pos, default)
    else:
        known = _PROBABILITY.get(getattr(t, "__name__", ""))
        if known is None:
            return False
        p = _argument(node, *known[0])
        train = _argument(node, *known[1]) if known[1] is not None else None
    return (isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0) or train is False


def _may_draw(m: torch.nn.Module) -> bool:
    """A module a graph calls as a leaf: a dropout (p > 0) or RReLU layer draws; one of torch.nn's
    other layers does not; any other (the user's leaf module, whose forward the trace did not
    see) may."""
    if isinstance(m, torch.nn.modules.dropout._DropoutNd):
        return m.p != 0
    if isinstance(m, fx.GraphModule):
        return bool(random_nodes(m))
    return isinstance(m, torch.nn.RReLU) or not type(m).__module__.startswith("torch.")


def random_nodes(module: torch.nn.Module) -> list[str]:
    """The nodes of `module`'s graph (and of its higher-order ops' bodies) that draw random numbers
    or may: aten ops tagged `nondeterministic_seeded`, the torch functions and tensor methods
    that draw, and leaf modules holding a dropout or RReLU layer or a module of the user's
    (`_may_draw`); a dropout or attention whose probability is the literal 0 (or whose `train`
    is False) draws nothing. Conservative: a module's `training` is not consulted (it may change
    after this is asked)."""
    out: list[str] = []
    graph = getattr(module, "graph", None)
    if not isinstance(graph, fx.Graph):
        return out
    for node in graph.nodes:
        t = node.target
        if node.op == "call_function":
            if isinstance(t, torch._ops.OpOverload):
                if torch.Tag.nondeterministic_seeded in t.tags and not _draws_nothing(node):
                    out.append(node.name)
            elif getattr(t, "__name__", "") in _RANDOM_FUNCTIONS and not _draws_nothing(node):
                out.append(node.name)
        elif node.op == "call_method" and t in _RANDOM_METHODS:
            out.append(node.name)
        elif node.op == "call_module":
            sub = _attr(module, str(t))
            if isinstance(sub, torch.nn.Module) and any(_may_draw(m) for m in sub.modules()):
                out.append(node.name)
        elif node.op == "get_attr":
            body = _attr(module, str(t))
            if isinstance(body, fx.GraphModule):
                out += [f"{t}.{n}" for n in random_nodes(body)]
    return out


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph` (its nodes new, their targets shared) to rewrite."""
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new
