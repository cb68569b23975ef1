"""The annotate pass's run of a traced graph, node by node, on meta tensors (modelled costs) or on
clones of the real ones (measured): `GraphRun` (the pass, `mobius_fx.passes.annotate`, says which
and why).

    run = GraphRun(gm, flat, names, measure=False, spec=DeviceSpec.preset("rtx3090"), dtype=torch.float32)
    costs = run.execute()        # node -> NodeCost
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mobius_fx.errors import MobiusError, first_line
from mobius_fx.passes.annotate_tools import (cuda_devices, holding, last_uses, meta_like, median_time, node_key,
                                             report, roofline, synchronizer, tensor_leaves, unique_tensors,
                                             value_bytes)
from mobius_fx.planning.costs import NodeCost
from mobius_fx.topology.device_specs import DeviceSpec

__all__ = ["GraphRun"]


class GraphRun:
    """Runs the graph node by node on meta (modelled) or real (measured) tensors.

    Identical nodes — same op, same module configuration, same input shapes/dtypes/strides and
    the same constant arguments — cost the same, so FLOP counting, backward and timing run once
    per distinct node and are reused (a 72-block model costs one block's work).
    """

    def __init__(self, gm: fx.GraphModule, flat_inputs: list[Any], names: dict[str, str], *, measure: bool,
                 spec: DeviceSpec, dtype: Any, warmup: int = 0, repeats: int = 1,
                 progress: Callable[[str], None] | None = None, cast: torch.dtype | None = None):
        self.gm = gm
        self.cast = cast  # meta copies of floating weights and inputs in this dtype (annotate's bytes as streamed)
        self.flat_inputs = flat_inputs
        self.measure = measure
        self.spec = spec
        self.dtype = dtype
        self.warmup = warmup
        self.repeats = repeats
        self.progress = progress
        self.counter = FlopCounterMode(display=False)
        self.cache: dict[Any, tuple[float, float, float, float, tuple[bool, ...] | None]] = {}
        # name -> (canonical model name, tensor) for every gm parameter/buffer (aliases included)
        self.attrs: dict[str, tuple[str, torch.Tensor]] = {}
        for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
            self.attrs[name] = (names.get(name, name), t)
        self.param_ids = {id(p) for p in gm.parameters()}
        self._copies: dict[int, torch.Tensor] = {}
        self.out_bytes: dict[fx.Node, int] = {}
        self.act_bytes: dict[fx.Node, int] = {}  # bytes of fresh (non-alias) outputs
        self.moved: dict[fx.Node, int] = {}
        # node -> (params it reads: canonical name -> (bytes, requires_grad))
        self.param_info: dict[fx.Node, dict[str, tuple[int, bool]]] = {}
        self.costs: dict[fx.Node, NodeCost] = {}
        self.values: dict[fx.Node, Any] = {}  # node -> its value, meta runs only

    # -- values
    def _value(self, t: torch.Tensor, *, is_buffer: bool) -> torch.Tensor:
        """What the graph sees for a model tensor: a meta copy (modelled) or a private clone
        (measured; parameters keep their requires_grad), one per tensor (tied weights stay
        tied). The model's own tensors are never run on: an in-place op in forward would change
        them once per timing run."""
        key = id(t)
        if key not in self._copies:
            if not self.measure:
                self._copies[key] = meta_like(t, self.cast)
            else:
                copy = t.detach().clone()
                if not is_buffer and isinstance(t, nn.Parameter):
                    copy.requires_grad_(t.requires_grad)
                self._copies[key] = copy
        return self._copies[key]

    def _attr(self, target: str) -> Any:
        if target in self.attrs:
            _, t = self.attrs[target]
            return self._value(t, is_buffer=id(t) not in self.param_ids)
        obj: Any = self.gm
        for part in target.split("."):
            obj = getattr(obj, part)
        return self._value(obj, is_buffer=True) if isinstance(obj, torch.Tensor) else obj

    def _input(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if not self.measure:
            return meta_like(x, self.cast)
        return x.detach().clone().requires_grad_(x.requires_grad)

    # -- main loop
    def execute(self) -> dict[fx.Node, NodeCost]:
        graph = self.gm.graph
        nodes = list(graph.nodes)
        frees = last_uses(nodes)

        env: dict[fx.Node, Any] = {}
        inputs = iter(self.flat_inputs)
        misses = 0
        with torch.random.fork_rng(devices=cuda_devices(self.flat_inputs)):
            for i, node in enumerate(nodes):
                try:
                    cost = self._node(node, env, inputs)
                except MobiusError:
                    raise
                except Exception as e:
                    mode = "measuring" if self.measure else "modelling costs on meta tensors"
                    hint = ("; this op may need real data (data-dependent shapes): try costs='measure' "
                            "with real example inputs" if not self.measure else "")
                    raise MobiusError(f"annotate failed while {mode} at node {node.format_node()}: "
                                      f"{first_line(e)}{hint}") from e
                self.costs[node] = cost
                if not self.measure:  # meta: free to keep, `layer_peaks` runs layers again from them
                    self.values[node] = env.get(node)
                for dead in frees.get(node, ()):
                    env.pop(dead, None)
                if self.measure and self.progress is not None and len(self.cache) > misses and len(self.cache) % 50 == 0:
                    misses = len(self.cache)
                    report(self.progress, f"annotate: measured {misses} distinct ops ({i + 1}/{len(nodes)} nodes)")
        return self.costs

    def _node(self, node: fx.Node, env: dict[fx.Node, Any], inputs) -> NodeCost:
        zero = NodeCost(0.0, 0.0, 0.0, 0.0, 0, 0, 0, self.measure)
        if node.op == "placeholder":
            value = self._input(next(inputs))
            env[node] = value
            nbytes = value_bytes(value)
            self.out_bytes[node] = self.act_bytes[node] = nbytes
            self.moved[node] = 0
            self.param_info[node] = {}
            return dataclasses.replace(zero, output_bytes=nbytes)
        if node.op == "get_attr":
            env[node] = self._attr(str(node.target))
            self.out_bytes[node] = self.act_bytes[node] = 0
            self.moved[node] = 0
            self.param_info[node] = {}
            return zero
        if node.op == "output":
            self.out_bytes[node] = self.act_bytes[node] = 0
            self.moved[node] = 0
            self.param_info[node] = {}
            return zero

        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if not self.measure:
            args, kwargs = pytree.tree_map_only(torch.device, lambda _: torch.device("meta"), (args, kwargs))
        fn, module_state = self.node_callable(node)
        params = self._params_read(node)
        self.param_info[node] = params

        in_tensors = unique_tensors((args, kwargs, list(module_state.values())))
        key = node_key(node, fn, args, kwargs, module_state)
        cached = self.cache.get(key) if key is not None else None
        if cached is None:
            out, entry = self._first_run(fn, args, kwargs, in_tensors)
            if key is not None:
                self.cache[key] = entry
        else:
            with torch.no_grad():
                out = fn(*args, **kwargs)
            entry = cached
        fwd_flops, bwd_flops, fwd_m, bwd_m, grad_flags = entry
        out_list = unique_tensors(out)
        in_ids = {id(t) for t in in_tensors}
        # fresh outputs: not an input handed back (getitem, in-place) nor a view of one
        fresh = [t for t in out_list if id(t) not in in_ids and not t._is_view()]
        env[node] = self._store(out, grad_flags, in_tensors)

        out_bytes = sum(value_bytes(t) for t in out_list)
        act = sum(value_bytes(t) for t in fresh)
        in_bytes = sum(value_bytes(t) for t in in_tensors)
        moved = in_bytes + act if fresh else 0
        self.out_bytes[node], self.act_bytes[node], self.moved[node] = out_bytes, act, moved
        if self.measure:
            fwd_time, bwd_time = fwd_m, fwd_m + bwd_m
        else:
            fwd_time = roofline(fwd_flops, moved, self.spec, self.dtype)
            needs_grad = grad_flags is not None and any(grad_flags)
            bwd_time = fwd_time + (roofline(bwd_flops, 2 * moved, self.spec, self.dtype) if needs_grad else 0.0)
        return NodeCost(fwd_flops=float(fwd_flops), bwd_flops=float(bwd_flops), fwd_time=fwd_time,
                        bwd_time=bwd_time, param_bytes=0, output_bytes=out_bytes, peak_bytes=in_bytes + act,
                        measured=self.measure)

    def node_callable(self, node: fx.Node) -> tuple[Callable[..., Any], dict[str, torch.Tensor]]:
        """What `node` calls, on this run's copies of the model's tensors, and the module state it
        computes with (its parameters and buffers by local name; empty for a function or method)."""
        if node.op == "call_function":
            return node.target, {}
        if node.op == "call_method":
            name = str(node.target)
            return (lambda self_, *a, **k: getattr(self_, name)(*a, **k)), {}
        module = self.gm.get_submodule(str(node.target))
        state: dict[str, torch.Tensor] = {}
        for local, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
            state[local] = self._value(t, is_buffer=id(t) not in self.param_ids)
        # measured: a shallow copy of the module holding the copies, called as it is (no
        # functional_call overhead in the timing)
        holder = holding(module, state) if self.measure else None

        def call(*a: Any, **k: Any) -> Any:
            if holder is not None:
                return holder(*a, **k)
            return torch.func.functional_call(module, state, a, k, strict=False, tie_weights=False)

        call.module = module  # type: ignore[attr-defined]
        return call, dict(state)  # what the module computes with (key, inputs of the backward)

    def _params_read(self, node: fx.Node) -> dict[str, tuple[int, bool]]:
        """Canonical names of the parameters this node reads directly, with bytes and grad flag."""
        out: dict[str, tuple[int, bool]] = {}
        targets: list[str] = []
        if node.op == "call_module":
            module = self.gm.get_submodule(str(node.target))
            targets += [f"{node.target}.{n}" for n, _ in module.named_parameters(remove_duplicate=False)]
        targets += [str(a.target) for a in node.all_input_nodes if a.op == "get_attr"]
        for target in targets:
            entry = self.attrs.get(target)
            if entry is None or id(entry[1]) not in self.param_ids:
                continue
            name, t = entry
            out.setdefault(name, (t.numel() * t.element_size(), bool(t.requires_grad)))
        return out

    def _first_run(self, fn: Callable[..., Any], args: Any, kwargs: Any,
                   in_tensors: list[torch.Tensor]) -> tuple[Any, tuple[float, float, float, float, tuple[bool, ...] | None]]:
        """Count FLOPs (forward, backward) and, when measuring, time the node."""
        counter = self.counter
        grad_ins = [t for t in in_tensors if t.requires_grad]
        bwd_flops = 0.0
        grad_flags: tuple[bool, ...] | None
        versions = [t._version for t in in_tensors]
        ran = False
        try:
            with counter:
                out = fn(*args, **kwargs)
            ran = True
            fwd_flops = float(counter.get_total_flops())
            outs = [t for t in unique_tensors(out) if t.requires_grad and t.grad_fn is not None]
            grad_flags = tuple(t.requires_grad for t in tensor_leaves(out))
            if outs and grad_ins:
                grads = [torch.ones_like(t) for t in outs]
                with counter:
                    torch.autograd.grad(outs, grad_ins, grads, allow_unused=True, retain_graph=self.measure)
                bwd_flops = float(counter.get_total_flops())
        except RuntimeError:
            # e.g. an in-place op on a leaf that requires grad: count the forward alone and use
            # the 2x rule for the backward. The forward runs again only if it did not run: an
            # in-place op must change its input once, as in eager.
            if not ran:
                with torch.no_grad(), counter:
                    out = fn(*args, **kwargs)
                fwd_flops = float(counter.get_total_flops())
            bwd_flops = 2.0 * fwd_flops
            outs, grads = [], []
            grad_flags = tuple((t.is_floating_point() and bool(grad_ins)) for t in tensor_leaves(out))
        fwd_m = bwd_m = 0.0
        if self.measure:
            sync = synchronizer(in_tensors)

            setup = None
            if any(t._version != v for t, v in zip(in_tensors, versions)):
                # an in-place op: each timing run gets fresh copies of the arguments, so the op is
                # not applied again to the values the graph goes on with (T5's bucket indices)
                def setup() -> tuple:
                    with torch.no_grad():
                        return pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))

            def forward(a: Any = args, k: Any = kwargs) -> None:
                with torch.no_grad():
                    fn(*a, **k)

            fwd_m = median_time(forward, self.warmup, self.repeats, sync, setup)
            if outs and grad_ins:
                def backward() -> None:
                    torch.autograd.grad(outs, grad_ins, grads, allow_unused=True, retain_graph=True)

                bwd_m = median_time(backward, self.warmup, self.repeats, sync)
        return out, (fwd_flops, bwd_flops, fwd_m, bwd_m, grad_flags)

    def _store(self, out: Any, grad_flags: tuple[bool, ...] | None, in_tensors: list[torch.Tensor]) -> Any:
        """Detach outputs into fresh leaves that keep their requires_grad flag (so the next
        node's backward stops at its own inputs)."""
        leaves, spec = pytree.tree_flatten(out)
        flags = iter(grad_flags or ())
        any_grad = any(t.requires_grad for t in in_tensors)
        new = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                flag = next(flags, any_grad and leaf.is_floating_point())
                d = leaf.detach()
                if flag and (d.is_floating_point() or d.is_complex()):
                    d.requires_grad_(True)
                new.append(d)
            else:
                new.append(leaf)
        return pytree.tree_unflatten(new, spec)
