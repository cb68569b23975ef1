"""insert_transfers: cut the traced graph into stages and write the Mobius schedule as a graph.

Input: the traced `GraphModule`, which compute nodes form each stage and which GPU runs it.
Output: a `Schedule` with

- one private `GraphModule` per stage, made by `torch.fx.passes.split_module` (it routes values
  that cross several stages, skip connections included, and lifts `get_attr` weights to the
  stage that reads them). Leaf modules are replaced by *shells* — shallow copies that share
  code and configuration with the user's modules but own their parameter slots — so the runtime
  binds GPU copies of the weights into a stage without ever touching the user's model;
- the top-level `torch.fx.Graph` of the schedule: the forward ops of the schedule IR
  (mobius_fx/planning/schedule_ir.py), lowered in their order to explicit calls of the runtime ops
  (mobius_fx/planning/stage_contract.py) `prefetch`, `wait`, `run_stage`, `send`, `evict` and `hold_for_backward`,
  in Mobius order. Per GPU all M
  micro-batches of stage k run before stage k+N (GPipe order); the first stage of every GPU is
  uploaded at the start, stage k+N is prefetched before stage k runs, stage k is evicted after
  its last micro-batch, and the last stage of each GPU stays resident for backward
  (docs/schedule.md). Activations are pushed to the next stage's GPU as soon as they are
  produced; values needed further on (long skips, model outputs) go to host memory;
- the schedule IR itself (`Schedule.ir()`), built here once: the forward program is lowered from
  it, and the runtime, `emit` and the step executor read it instead of building their own.

The op nodes are registered side-effectful (`torch.fx.node._side_effectful_functions`, as
`torch.distributed.pipelining` does for its split marker), so `graph.eliminate_dead_code()`
keeps them and `graph.lint()` stays clean.

    sched = insert_transfers(gm, stage_nodes=[["fc1", "relu"], ["fc2"]],
                             stage_gpus=["gpu0", "gpu1"], microbatches=2)
    len(sched.stages), [n.name for n in sched.graph.nodes][:4]
    # 2, ['x', 'microbatches', 'x_0', 'x_1']
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module

from mobius_fx.kinds import HOST
from mobius_fx.errors import MobiusError
from mobius_fx.planning.batch_sizes import set_microbatches
from mobius_fx.planning.microbatch import check_count
from mobius_fx.planning.schedule_ir import ScheduleIR, neighbours
from mobius_fx.planning import stage_contract as _ops
from mobius_fx.planning.stage_contract import Schedule, StageSpec, ValueRef, WeightRef, stages_ir

__all__ = ["insert_transfers"]

_COMPUTE = ("call_function", "call_method", "call_module")


def insert_transfers(gm: fx.GraphModule, *, stage_nodes: Sequence[Sequence[str]], stage_gpus: Sequence[str],
                     microbatches: int) -> Schedule:
    """Split `gm` into stages and build the Mobius schedule graph (see the module docstring).

    `stage_nodes[k]` names the compute nodes of stage k (placeholders, get_attr and output are
    placed automatically; a compute node left out joins the stage of the compute node before it).
    Every node may only use values of its own or earlier stages. `stage_gpus[k]` is the GPU name
    that runs stage k.

    >>> gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    >>> s = insert_transfers(gm, stage_nodes=[["_0", "_1"], ["_2"]], stage_gpus=["a", "b"], microbatches=2)
    >>> [st.gpu for st in s.stages], s.next_on_gpu
    (['a', 'b'], (None, None))
    """
    check_count(microbatches)
    if len(stage_nodes) != len(stage_gpus) or not stage_nodes:
        raise MobiusError(f"{len(stage_nodes)} stage node lists but {len(stage_gpus)} stage GPUs; give one GPU name "
                          f"per stage (and at least one stage)")
    _refuse_attribute_outputs(gm)
    work = _working_copy(gm)
    set_microbatches(work.graph, microbatches)  # a size read as a value: the whole batch's (planning/batch_sizes.py)
    work.recompile()
    stage_of, moved = _assign_stages(work, stage_nodes)
    _check_dependencies(work, stage_of)

    qualname_map: dict[str, str] = {}
    kwargs: dict[str, Any] = {"qualname_map": qualname_map, "keep_original_node_name": True}
    if "tuple_return" in inspect.signature(split_module).parameters:
        kwargs["tuple_return"] = True
    split = split_module(work, work, lambda n: stage_of[n.name], **kwargs)

    # by target: an export graph's HOP body attribute (`submod_1` of a `torch.no_grad()` block)
    # may take a partition's node name, but never its call_module target
    parent = {str(n.target): n for n in split.graph.nodes if n.op == "call_module"}
    stages = tuple(_build_stage(k, stage_gpus[k], split, parent[f"submod_{k}"], work, qualname_map)
                   for k in range(len(stage_nodes)))

    gpus = tuple(dict.fromkeys(stage_gpus))
    next_on, prev_on = neighbours(stage_gpus)

    placeholders = [n for n in split.graph.nodes if n.op == "placeholder"]
    output = next(n for n in split.graph.nodes if n.op == "output")
    out_arg = _resolve_output(output.args[0])
    info = getattr(gm.graph._codegen, "pytree_info", None)
    graph, host_ids, ir = _schedule_graph(stages, [p.name for p in placeholders], out_arg, microbatches)
    return Schedule(stages=stages, graph=graph, microbatches=microbatches, gpus=gpus, next_on_gpu=tuple(next_on),
                    prev_on_gpu=tuple(prev_on), inputs=tuple(p.name for p in placeholders),
                    out_spec=info.out_spec if info is not None else None, moved=tuple(moved),
                    to_host=host_ids, built_ir=ir)


# ----------------------------------------------------------------------------- stage assignment

def _working_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule sharing gm's attributes over a copy of its graph, without export's guard
    call (it checks the example's batch size, which micro-batches do not have)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target) == "_guards_fn" and not node.users:
            graph.erase_node(node)
    return fx.GraphModule(gm, graph)


def _assign_stages(gm: fx.GraphModule, stage_nodes: Sequence[Sequence[str]]) -> tuple[dict[str, int], list[str]]:
    nodes = {n.name: n for n in gm.graph.nodes}
    stage_of: dict[str, int] = {}
    for k, names in enumerate(stage_nodes):
        for name in names:
            node = nodes.get(name)
            if node is None:
                raise MobiusError(f"stage {k} lists node {name!r}, which the graph does not have; stage node names "
                                  f"must come from the traced GraphModule that is being split")
            if node.op not in _COMPUTE:
                continue
            if name in stage_of and stage_of[name] != k:
                raise MobiusError(f"node {name!r} is listed in stages {stage_of[name]} and {k}; each compute node "
                                  f"belongs to exactly one stage")
            stage_of[name] = k
    moved: list[str] = []
    current = 0
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE:
            continue
        if node.name in stage_of:
            current = stage_of[node.name]
        else:
            stage_of[node.name] = current
            moved.append(node.name)
    used = set(stage_of.values())
    empty = [k for k in range(len(stage_nodes)) if k not in used]
    if empty:
        raise MobiusError(f"stage(s) {empty} have no compute node; every stage needs at least one (merge empty "
                          f"stages into their neighbours or plan fewer stages)")
    return stage_of, moved


def _check_dependencies(gm: fx.GraphModule, stage_of: dict[str, int]) -> None:
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE:
            continue
        for inp in node.all_input_nodes:
            if inp.op in _COMPUTE and stage_of[inp.name] > stage_of[node.name]:
                raise MobiusError(
                    f"node {node.format_node()} is in stage {stage_of[node.name]} but uses {inp.name!r} from the "
                    f"later stage {stage_of[inp.name]}; stages must follow the data flow (cut the graph in "
                    f"topological order)")


# ----------------------------------------------------------------------------- stage modules

def _get_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _shell(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    """A shallow copy of `module` (and its children) with its own parameter, buffer and child
    dicts: same code and configuration, separate slots. Shared children stay shared."""
    if id(module) in memo:
        return memo[id(module)]
    new = object.__new__(type(module))
    new.__dict__.update(module.__dict__)
    memo[id(module)] = new
    new.__dict__["_parameters"] = dict(module._parameters)
    new.__dict__["_buffers"] = dict(module._buffers)
    new.__dict__["_modules"] = {k: (_shell(v, memo) if v is not None else None) for k, v in module._modules.items()}
    return new


def _build_stage(k: int, gpu: str, split: fx.GraphModule, call: fx.Node, gm: fx.GraphModule,
                 qualname_map: dict[str, str]) -> StageSpec:
    sub: fx.GraphModule = getattr(split, str(call.target))
    graph = sub.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(call.args):
        raise MobiusError(f"internal: stage {k} has {len(placeholders)} inputs but is called with {len(call.args)}")
    last_ph = placeholders[-1] if placeholders else None
    root: dict[str, Any] = {}
    refs: dict[int, tuple[str, torch.Tensor, list[tuple[str, str]]]] = {}

    def add_slot(gm_name: str, tensor: torch.Tensor, path: str, attr: str) -> None:
        entry = refs.setdefault(id(tensor), (gm_name, tensor, []))
        if (path, attr) not in entry[2]:
            entry[2].append((path, attr))

    inputs: list[ValueRef] = []
    for ph, arg in zip(placeholders, call.args):
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            value = _get_attr(gm, str(arg.target))
            anchor = last_ph.next if last_ph is not None else next(iter(graph.nodes))
            with graph.inserting_before(anchor):
                node = graph.create_node("get_attr", str(arg.target))
            node.meta = dict(ph.meta)
            ph.replace_all_uses_with(node)
            graph.erase_node(ph)
            root[str(arg.target)] = value
            if isinstance(value, torch.Tensor):
                path, _, attr = str(arg.target).rpartition(".")
                add_slot(str(arg.target), value, path, attr)
        else:
            inputs.append(_value_ref(arg))

    shells: list[tuple[nn.Module, nn.Module]] = []
    memo: dict[int, nn.Module] = {}
    for node in graph.nodes:
        if node.op not in ("call_module", "get_attr") or str(node.target) in root:
            continue
        target = str(node.target)
        obj = _get_attr(sub, target)
        if not isinstance(obj, nn.Module):
            root[target] = obj
            continue
        shell = _shell(obj, memo)
        root[target] = shell
        original = qualname_map.get(f"{call.target}.{target}", target)
        for user_mod, shell_mod in _pairs(obj, shell):
            shells.append((user_mod, shell_mod))
        tensors = [*obj.named_parameters(remove_duplicate=False), *obj.named_buffers(remove_duplicate=False)]
        for name, t in tensors:
            owner, _, attr = name.rpartition(".")
            add_slot(f"{original}.{name}", t, f"{target}.{owner}" if owner else target, attr)

    out = next(n for n in graph.nodes if n.op == "output")
    if not isinstance(out.args[0], tuple):  # torch without split_module(tuple_return=True)
        out.args = ((out.args[0],),)
    outputs = tuple(a.name if isinstance(a, fx.Node) else f"out{j}" for j, a in enumerate(out.args[0]))
    module = fx.GraphModule(root, graph, class_name=f"Stage{k}")
    module.graph.lint()
    nodes = tuple(n.name for n in graph.nodes if n.op in _COMPUTE)
    weights = tuple(WeightRef(name, t, tuple(slots)) for name, t, slots in refs.values())
    return StageSpec(index=k, gpu=gpu, module=module, nodes=nodes, inputs=tuple(inputs), outputs=outputs,
                     weights=weights, shells=tuple(shells))


def _pairs(user: nn.Module, shell: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    out = [(user, shell)]
    for name, child in user._modules.items():
        if child is not None:
            out.extend(_pairs(child, shell._modules[name]))
    return out


def _value_ref(arg: Any) -> ValueRef:
    if not isinstance(arg, fx.Node):
        raise MobiusError(f"internal: unexpected stage argument {arg!r}")
    if arg.op == "placeholder":
        return ValueRef(-1, 0, arg.name)
    if arg.op == "call_function" and arg.target is operator.getitem and str(arg.args[0].target).startswith("submod_"):
        src = arg.args[0]
        return ValueRef(int(str(src.target).split("_")[1]), int(arg.args[1]), arg.name)
    if arg.op == "call_module" and str(arg.target).startswith("submod_"):
        return ValueRef(int(str(arg.target).split("_")[1]), 0, arg.name)
    raise MobiusError(f"internal: cannot route value {arg.format_node()} between stages")


def _refuse_attribute_outputs(gm: fx.GraphModule) -> None:
    """Refuse a graph that returns one of its parameters, buffers or constant tensors itself
    (`return y, self.fc.weight`): no stage computes it, so no stage can send it on."""
    output = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if output is None:
        return
    leaves: list[fx.Node] = []
    fx.node.map_arg(output.args, leaves.append)
    for node in leaves:
        if node.op != "get_attr":
            continue
        target = str(node.target)
        names = getattr(gm.meta.get("mobius_trace"), "names", {}) or {}
        value = _get_attr(gm, target)
        if target in names:
            kind = "parameter" if isinstance(value, nn.Parameter) else "buffer"
            what, read = f"its {kind} `{names[target]}`", f"read it from the model after the call (model.{names[target]})"
        else:
            what = f"a constant tensor `{target}` (built in forward from no input, e.g. torch.tensor(...))"
            read = "build it outside the model, after the call"
        raise MobiusError(f"the model's forward returns {what} as an output itself; a pipeline returns what its "
                          f"stages compute, and no stage computes this value. Do not return it from forward: {read}")


def _resolve_output(arg: Any) -> Any:
    """The parent graph's output structure with each Node replaced by its ValueRef."""
    return fx.node.map_aggregate(arg, lambda a: _value_ref(a) if isinstance(a, fx.Node) else a)


# ----------------------------------------------------------------------------- schedule graph

def _schedule_graph(stages: tuple[StageSpec, ...], inputs: list[str], out_arg: Any,
                    m: int) -> tuple[fx.Graph, tuple[tuple[int, ...], ...], ScheduleIR]:
    """The forward program: the schedule IR's forward ops, lowered in their order to calls of
    the ops of the contract (mobius_fx.planning.stage_contract); also, per stage, its outputs that
    go to the host, and the IR itself: the Schedule's, built here once (`Schedule.ir()`)."""
    program = _ForwardProgram(stages, inputs, m)
    to_host = _outputs_to_host(stages, out_arg)
    program.host_ids = tuple(tuple(sorted(j for (st, j) in to_host if st == k)) for k in range(len(stages)))
    ir = stages_ir(stages, program.host_ids, m)
    for o in ir.select(phase="forward"):
        program.lower(o)
    program.output(out_arg, m)
    return program.graph, program.host_ids, ir


def _outputs_to_host(stages: tuple[StageSpec, ...], out_arg: Any) -> set[tuple[int, int]]:
    """(stage, output index) of the stage outputs that go to the host: who consumes each stage
    output decides it: the next stage gets a direct push, anyone later (or the model output)
    reads a host copy."""
    consumers: dict[tuple[int, int], set[int]] = {}
    for st in stages:
        for ref in st.inputs:
            if ref.stage >= 0:
                consumers.setdefault((ref.stage, ref.index), set()).add(st.index)
    to_output: set[tuple[int, int]] = set()
    fx.node.map_aggregate(out_arg, lambda a: to_output.add((a.stage, a.index))
                          if isinstance(a, ValueRef) and a.stage >= 0 else None)
    return {(k, j) for (k, j), users in consumers.items() if any(u > k + 1 for u in users)} | to_output


class _ForwardProgram:
    """The forward program's graph while the IR's forward ops are lowered into it (`lower`, in the
    IR's order), and where each value is: the model inputs per micro-batch, each stage output on
    its stage's GPU, the values pushed onto a GPU or sent from the host, the host copies.
    `host_ids[k]`: the output indices of stage k that go to the host (IR send `value` j is
    output host_ids[k][j])."""

    def __init__(self, stages: tuple[StageSpec, ...], inputs: list[str], m: int):
        self.graph, self.stages, self.host_ids = fx.Graph(), stages, [()] * len(stages)
        ph = {name: self.graph.placeholder(name) for name in inputs}
        self.per_mb: dict[str, list[fx.Node]] = {name: [node] * m for name, node in ph.items()}
        if m > 1 and inputs:
            split = self.call(_ops.split_microbatches, (tuple(ph.values()), m), "microbatches")
            for j, name in enumerate(inputs):
                self.per_mb[name] = [self.graph.create_node("call_function", operator.getitem, (split, j * m + i),
                                                            name=f"{name}_{i}") for i in range(m)]
        self.outputs: dict[tuple[int, int, int], fx.Node] = {}  # (stage, output index, mb) -> value on its stage's GPU
        self.pushed: dict[tuple[int, int, int], fx.Node] = {}  # (stage, input j, mb) -> value pushed onto its GPU
        self.fetched: dict[tuple[int, int, int], fx.Node] = {}  # (stage, input j, mb) -> value sent from the host
        self.hosted: dict[tuple[int, int, int], fx.Node] = {}  # (stage, output index, mb) -> host copy

    def call(self, fn: Callable, args: tuple, name: str | None = None, **meta: Any) -> fx.Node:
        node = self.graph.create_node("call_function", fn, args, name=name)
        node.meta["mobius"] = {"op": fn.__name__, **meta}
        return node

    def source(self, ref: ValueRef, i: int) -> fx.Node:
        """Micro-batch i of `ref` where a later stage or the output reads it: a model input, or a host copy."""
        return self.per_mb[ref.name][i] if ref.stage < 0 else self.hosted[(ref.stage, ref.index, i)]

    def lower(self, o: Any) -> None:
        """Lower one forward op of the IR to a call of its runtime op (offload: done by run_stage
        itself, which saves the inputs it needs again in backward)."""
        k, i, st = o.stage, o.microbatch, self.stages[o.stage]
        if o.kind == "prefetch":
            self.call(_ops.prefetch, (k,), stage=k, gpu=st.gpu)
        elif o.kind == "wait":
            self.call(_ops.wait, (k,), stage=k, gpu=st.gpu)
        elif o.kind == "evict":
            self.call(_ops.evict, (k,), stage=k, gpu=st.gpu)
        elif o.kind == "hold":
            self.call(_ops.hold_for_backward, (k,), stage=k, gpu=st.gpu)
        elif o.kind == "send":
            self._send(o, k, i, st)
        elif o.kind == "run":
            self._run(k, i, st)

    def _send(self, o: Any, k: int, i: int, st: StageSpec) -> None:
        if o.dst == HOST:  # a host copy of output `value` of stage k
            j = self.host_ids[k][o.value]
            name = st.outputs[j]
            self.hosted[(k, j, i)] = self.call(_ops.send, (self.outputs[(k, j, i)], HOST, k), f"{name}_{i}_{HOST}",
                                               stage=k, microbatch=i, gpu=HOST)
        elif o.src == HOST:  # input `value` of stage k from the host
            ref = st.inputs[o.value]
            name = ref.name if ref.stage < 0 else self.stages[ref.stage].outputs[ref.index]
            self.fetched[(k, o.value, i)] = self.call(_ops.send, (self.source(ref, i), st.gpu, k),
                                                      f"{name}_{i}_{st.gpu}", stage=k, microbatch=i, gpu=st.gpu)
        else:  # a push of input `value` of stage k from the stage before
            ref = st.inputs[o.value]
            name = self.stages[ref.stage].outputs[ref.index]
            self.pushed[(k, o.value, i)] = self.call(_ops.send, (self.outputs[(ref.stage, ref.index, i)], st.gpu, k),
                                                     f"{name}_{i}_{st.gpu}", stage=k, microbatch=i, gpu=st.gpu)

    def _run(self, k: int, i: int, st: StageSpec) -> None:
        args = []
        for j, ref in enumerate(st.inputs):
            if (k, j, i) in self.fetched:
                args.append(self.fetched[(k, j, i)])
            elif (k, j, i) in self.pushed:
                args.append(self.pushed[(k, j, i)])
            else:  # made by the stage before on this GPU: no copy
                args.append(self.outputs[(ref.stage, ref.index, i)])
        out = self.call(_ops.run_stage, (k, i, *args), f"stage{k}_{i}", stage=k, microbatch=i, gpu=st.gpu)
        for j, name in enumerate(st.outputs):
            self.outputs[(k, j, i)] = self.graph.create_node("call_function", operator.getitem, (out, j),
                                                             name=f"{name}_{i}")

    def output(self, out_arg: Any, m: int) -> None:
        """The graph's output: the model output of every micro-batch, merged."""
        def resolve(i: int) -> Callable[[Any], Any]:
            return lambda a: self.source(a, i) if isinstance(a, ValueRef) else a

        outs = [fx.node.map_aggregate(out_arg, resolve(i)) for i in range(m)]
        merged = self.call(_ops.merge_microbatches, (outs,), "output_value", stages=len(self.stages))
        self.graph.output(merged)
