"""`build_pipeline`: a traced graph and its stages -> the runnable `Pipeline`.

It cuts the graph into stages (`passes.insert_transfers`), emits the program (`passes.emit`),
makes the devices and binds the user's master weights; `compile` calls it through the emit pass,
with the `Wiring` of the compile (what compiles the variants, the data-parallel reducer, the
training step), so the Pipeline it returns is complete: nothing sets its internals afterwards.
It lives apart from the runtime so that the runtime imports nothing from the passes.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from mobius_fx.runtime.devices import make_devices
from mobius_fx.runtime.device_books import Device
from mobius_fx.errors import MobiusError
from mobius_fx.runtime.pipeline import Pipeline
from mobius_fx.planning import microbatch
from mobius_fx.planning.ir_transforms import ScheduleForm
from mobius_fx.runtime import microbatch_outputs
from mobius_fx.precision import Precision
from mobius_fx.runtime.engine import Runtime
from mobius_fx.runtime.data_parallel import GradientReducer
from mobius_fx.runtime.variants import Recompiler, StepSource, VariantPipeline

__all__ = ["build_pipeline", "Wiring"]

log = logging.getLogger("mobius_fx")


@dataclass(frozen=True)
class Wiring:
    """What `mobius_fx.compile` wires into the Pipeline `build_pipeline` builds, beside its stages.

    `recompiler` compiles a variant for a call the compiled ones do not serve, at most
    `max_variants` in all (none: such calls are refused); `reducer` averages the gradients across
    data-parallel ranks; `step(devices)` gives `train_step` its step compiler, on the pipeline's
    devices (none: `train_step` is refused), which compiles the step pipeline for the call
    `step_example` (args, kwargs, target) as the pipeline is built, else at the first `train_step`.
    `schedule_form`: the schedule `train_step`'s executor runs (`compile(schedule=)`: its name and
    its runtime form, mobius_fx/planning/ir_transforms.py; none: Mobius's); `step_code`: the
    pipeline is a training step's, so its `code` is the step the executor runs (runtime/step_code.py)."""

    recompiler: Recompiler | None = None
    max_variants: int = 1
    reducer: GradientReducer | None = None
    step: Callable[[Mapping[str, Device]], StepSource] | None = None
    step_example: tuple[tuple, dict, object] | None = None
    schedule_form: ScheduleForm | None = None
    step_code: bool = False


def _masters(model: nn.Module, gm: fx.GraphModule, spec: Any) -> list[torch.Tensor]:
    """The user's tensor behind each weight a stage reads (by identity, else by name)."""
    from mobius_fx.tracing import trace_info

    own = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    info = trace_info(gm)
    out = []
    for w in spec.weights:
        if id(w.tensor) in own:
            out.append(w.tensor)
            continue
        name = info.model_name(w.name)
        found = None
        for getter in (model.get_parameter, model.get_buffer):
            try:
                found = getter(name)
                break
            except (AttributeError, TypeError):
                continue
        out.append(found if found is not None and found.shape == w.tensor.shape else w.tensor)
    return out


def _place(gm: fx.GraphModule, schedule: Any, devices: Mapping[str, Device], flat: list | None,
           gpu_indices: Mapping[str, int] | None) -> Any:
    """Bind each stage's graph to its device (`placement.place_stage`: the device constants the
    trace fixed follow the stage); on CUDA devices, first replay the stages under fake tensors
    (`placement.check_placement`), so a placement error is named before anything is allocated."""
    from mobius_fx.runtime.placement import Placement, check_placement, example_spec
    from mobius_fx.runtime.device_rewrite import place_stage, traced_device

    placement = Placement(example_spec(flat) if flat is not None else None, traced_device(gm),
                          {g: int(i) for g, i in (gpu_indices or {}).items() if i is not None})
    targets = {spec.gpu: devices[spec.gpu].torch_device for spec in schedule.stages}
    if placement.example is not None and any(d.type == "cuda" for d in targets.values()):
        ops = check_placement(schedule, placement.example, targets, placement.traced)
        log.debug("placement checked: %d ops of %d stages replayed on %s", ops, len(schedule.stages),
                  sorted({str(d) for d in targets.values()}))
    for spec in schedule.stages:
        if not getattr(spec.module, "_mobius_bound", False):  # bound: the Runtime refuses it below
            changed = place_stage(spec, placement.traced, targets[spec.gpu])
            if changed and placement.traced != targets[spec.gpu]:
                log.debug("stage %d: device constants moved from %s to %s: %s", spec.index, placement.traced,
                          targets[spec.gpu], ", ".join(changed))
    return placement


def build_pipeline(model: nn.Module, gm: fx.GraphModule, *, stage_nodes: Sequence[Sequence[str]] | None = None,
                   stage_gpus: Sequence[str] | None = None, gpu_budgets: Mapping[str, int | None] | None = None,
                   microbatches: int | None = None, example_inputs: tuple = (), example_kwargs: dict | None = None,
                   plan: Any = None, device: str | Mapping[str, Device] = "auto", dtype: Any = None,
                   gpu_indices: Mapping[str, int] | None = None, schedule: Any = None,
                   batch_dims: Mapping[str, int | None] | None = None, memory_books: str = "auto",
                   wiring: Wiring | None = None) -> Pipeline:
    """Build the runnable Mobius pipeline of `model` from its traced graph `gm`.

    Give the stages explicitly (`stage_nodes[k]`: gm's compute nodes of stage k, in graph order;
    `stage_gpus[k]`: the GPU name running it; `gpu_budgets`: bytes per GPU name, None or absent =
    unlimited), or a `plan` (its stages' `nodes` and `gpu`, its `microbatches` and `precision`, and
    its topology's GPU memory and CUDA indices fill whatever is not given), or a `schedule`
    already made by `passes.insert_transfers`. `dtype` (e.g. torch.bfloat16; default: the plan's
    `precision.stream`, else the masters' dtype) is what weights and activations are copied to the
    GPUs in, and the stages run under autocast to it when it is narrower than the masters, which
    stay on the host with their gradients (for fp16, scale the loss with
    `torch.amp.GradScaler("cpu")`); streaming in the masters' own dtype casts nothing.
    `device`: "virtual" (GPUs played by the CPU), "virtual-async" (the CPU stand-in of the CUDA
    path's streams, events and slot pool: runtime/device_virtual_async.py), "cuda", "auto"
    (virtual for a virtual topology or without CUDA, else CUDA) or a `{gpu name: Device}` of your own; `gpu_indices`
    maps GPU names to CUDA indices. The model is left as it was. Given example inputs, the
    pipeline (a `variants.VariantPipeline`) serves calls like them: a call with other keyword
    arguments, or shapes the traced graph does not hold for, is refused with a MobiusError
    naming the argument or dimension (`mobius_fx.compile` traces a variant for it instead).
    `batch_dims` ({forward argument: 0 or None}) says which inputs carry the batch; with several
    micro-batches the example call's graph is analysed (mobius_fx/planning/microbatch.py: how each output
    combines; row-mixing values refused) — README "Micro-batch semantics". `memory_books`: how
    each GPU measures its stages' work, "ops" | "allocator" | "auto" (compile's `memory_books=`;
    mobius_fx/runtime/device_books.py). `wiring`: what `mobius_fx.compile` wires in (`Wiring`;
    default: none of it).

    gm = torch.fx.symbolic_trace(model)
    pipe = build_pipeline(model, gm, stage_nodes=[["fc1", "relu"], ["fc2"]], stage_gpus=["gpu0", "gpu1"],
                          gpu_budgets={"gpu0": 2**20, "gpu1": 2**20}, microbatches=2,
                          example_inputs=(x,), device="virtual")
    """
    from mobius_fx.passes.emit import backward_summary, emit
    from mobius_fx.passes.insert_transfers import insert_transfers

    _refuse_sparse_gradients(model, gm)

    topology = getattr(plan, "topology", None)
    if plan is not None:
        stage_nodes, stage_gpus, microbatches, gpu_budgets, gpu_indices, device = _plan_defaults(
            plan, stage_nodes, stage_gpus, microbatches, gpu_budgets, gpu_indices, device)
    # The plan's Precision, or one of `dtype` (None: the masters' own) for the model's masters.
    precision = plan.precision if plan is not None and dtype is None else Precision.of_model(model, dtype)
    if schedule is None:
        if stage_nodes is None or stage_gpus is None:
            raise MobiusError("build_pipeline needs the stages: pass stage_nodes and stage_gpus, a plan or a schedule")
        schedule = insert_transfers(gm, stage_nodes=stage_nodes, stage_gpus=list(stage_gpus),
                                    microbatches=1 if microbatches is None else microbatches)
    if schedule.moved:
        log.debug("compute nodes not listed in any stage, placed with the node before them: %s", schedule.moved)
    program = emit(schedule)
    devices = _pipeline_devices(topology, schedule, gpu_budgets, device, gpu_indices, memory_books)
    batch_dims = microbatch.check_batch_dims(batch_dims)
    m = schedule.microbatches
    flat, marks = _example_batch(model, gm, example_inputs, example_kwargs, batch_dims, m)
    placement = _place(gm, schedule, devices, flat, gpu_indices)  # checked on CUDA before the Runtime allocates
    masters = [_masters(model, gm, spec) for spec in schedule.stages]
    wiring = wiring if wiring is not None else Wiring()
    runtime = Runtime(schedule, devices, masters, precision)
    runtime.placement = placement
    runtime.batch_dims = batch_dims
    if wiring.reducer is not None:
        runtime.reducer = wiring.reducer
    if flat is not None:
        runtime.planned_rows = microbatch.batch_rows(flat, m, marks) or 0
        if m > 1 and flat:
            microbatch_outputs.prepare(runtime, gm, flat, m, marks, model)
    _warn_batch_norms(model, schedule.microbatches)
    _warn_buffer_updates(model, gm, schedule.microbatches)
    code = program.code.strip("\n") + "\n\n" + backward_summary(schedule) + "\n"
    step = wiring.step(devices) if wiring.step is not None else None
    pipe = VariantPipeline(model, gm, schedule, program, runtime, plan, code, recompiler=wiring.recompiler,
                           max_variants=wiring.max_variants, step=step)
    if wiring.schedule_form is not None:
        pipe.schedule_form = wiring.schedule_form
    if example_inputs or example_kwargs:  # the call it serves (call_signatures.py); the recompiler adds variants
        pipe._add_variant(tuple(example_inputs), dict(example_kwargs or {}), *_plan_cuts(plan))
    if wiring.step_code:  # its `code` is the step program it runs (each variant its own)
        for p in [pipe, *(getattr(pipe, "_variants", None) or [])]:
            object.__setattr__(p, "_step_code", True)
    if step is not None and wiring.step_example is not None:
        step.get(*step.arguments(*wiring.step_example))
    return pipe


def _plan_cuts(plan: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(the plan's layer names, the index of each stage's first layer): the cuts a variant for
    another call reuses when its layers are the same (`passes.partition.reuse_partition_pass`);
    ((), ()) without a plan made of layers."""
    if plan is None or not getattr(plan, "layers", ()):
        return (), ()
    starts = itertools.accumulate((len(s.layers) for s in plan.stages[:-1]), initial=0)
    return tuple(layer.name for layer in plan.layers), tuple(starts)


def _plan_defaults(plan: Any, stage_nodes: Any, stage_gpus: Any, microbatches: int | None,
                   gpu_budgets: Mapping[str, int | None] | None, gpu_indices: Mapping[str, int] | None,
                   device: Any) -> tuple[Any, Any, int | None, Any, Any, Any]:
    """(stage_nodes, stage_gpus, microbatches, gpu_budgets, gpu_indices, device), each as given or,
    where not given, from `plan`: its stages' nodes and GPUs, its micro-batches, its topology's
    GPU memory (the whole GPU: the plan's capacity is the planner's target, not a limit) and CUDA
    indices, and the virtual devices of a virtual topology for "auto"."""
    topology = getattr(plan, "topology", None)
    stage_nodes = stage_nodes if stage_nodes is not None else [list(s.nodes) for s in plan.stages]
    stage_gpus = stage_gpus if stage_gpus is not None else [s.gpu for s in plan.stages]
    microbatches = microbatches if microbatches is not None else plan.microbatches
    if gpu_budgets is None:
        gpus = {g.name: g for g in topology.gpus} if topology is not None else {}
        gpu_budgets = {s.gpu: (gpus[s.gpu].memory if s.gpu in gpus else int(s.capacity)) for s in plan.stages}
        gpu_budgets.update({name: g.memory for name, g in gpus.items() if name not in gpu_budgets})
    if gpu_indices is None and topology is not None:
        gpu_indices = {g.name: g.index for g in topology.gpus}
    if device == "auto" and getattr(topology, "virtual", False):
        device = "virtual"
    return stage_nodes, stage_gpus, microbatches, gpu_budgets, gpu_indices, device


def _pipeline_devices(topology: Any, schedule: Any, gpu_budgets: Mapping[str, int | None] | None, device: Any,
                      gpu_indices: Mapping[str, int] | None, memory_books: str) -> dict[str, Device]:
    """A Device for every GPU of the topology (and of gpu_budgets), used by a stage or not, so
    memory_stats() lists them all; the topology's order first. With your own Devices (a mapping):
    those you gave, and every GPU a stage uses."""
    budgets = dict(gpu_budgets or {})
    names = [g.name for g in topology.gpus] if topology is not None else []
    names += [g for g in (*schedule.gpus, *budgets) if g not in names]
    if isinstance(device, Mapping):
        names = [g for g in names if g in device or g in schedule.gpus]
    return make_devices({g: budgets.get(g) for g in names}, device=device, indices=gpu_indices,
                        memory_books=memory_books)


def _example_batch(model: nn.Module, gm: fx.GraphModule, example_inputs: tuple, example_kwargs: dict | None,
                   batch_dims: Any, m: int) -> tuple[list | None, Any]:
    """(the example call's flat graph inputs, the batch marks of its arguments), (None, None)
    without an example call; with several micro-batches, refuses (before any allocation) a batch
    that does not split into `m`."""
    if not (example_inputs or example_kwargs):
        return None, None
    from mobius_fx.tracing import flatten_inputs

    marks = microbatch.declared(model, tuple(example_inputs), dict(example_kwargs or {}), batch_dims)
    flat = flatten_inputs(gm, tuple(example_inputs), dict(example_kwargs or {}))
    if m > 1 and flat:
        microbatch.split(tuple(flat), m, marks)
    return flat, marks


def _warn_batch_norms(model: nn.Module, microbatches: int) -> None:
    """Warn, with several micro-batches, that `model`'s batch norms normalise each micro-batch by
    its own statistics (as eager run micro-batch by micro-batch), not by the whole batch's."""
    if microbatches <= 1:
        return
    norms = [n for n, mod in model.named_modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm)]
    if norms:
        log.warning("%s normalise%s over the batch: with %d micro-batches each micro-batch is normalised by its "
                    "own statistics (as eager run micro-batch by micro-batch), not by the whole batch's",
                    ", ".join(norms[:3]) + (" ..." if len(norms) > 3 else ""), "" if len(norms) > 1 else "s",
                    microbatches)


def _refuse_sparse_gradients(model: nn.Module, gm: fx.GraphModule) -> None:
    """Refuse an embedding with `sparse=True` over a trainable weight: its gradient is a sparse
    tensor, which a stage's gradient sum and download (dense buffers on the GPU) cannot hold."""
    sparse = [(n, m) for n, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    if not sparse:
        _refuse_sparse_calls(gm)
        return
    name, mod = sparse[0]
    raise MobiusError(f"module `{name}` ({type(mod).__name__}) has sparse=True: its weight's gradient is a sparse "
                      f"tensor, which the pipeline's gradient sums on the GPUs (dense buffers) cannot hold. Set "
                      f"`{name}.sparse = False` before compiling (a dense gradient; SparseAdam then needs another "
                      f"optimizer, e.g. Adam), or freeze its weight (requires_grad_(False)) to run it for inference")


def _refuse_sparse_calls(gm: fx.GraphModule) -> None:
    """`_refuse_sparse_gradients` for a functional embedding (`F.embedding(x, w, sparse=True)`,
    export's `aten.embedding(w, x, ..., True)`) over a trainable weight of the graph."""
    info = gm.meta.get("mobius_trace")
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.embedding.default:
            weight, sparse = node.args[0], (node.args[4] if len(node.args) > 4 else node.kwargs.get("sparse"))
        elif node.target is torch.nn.functional.embedding:
            weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            sparse = node.args[6] if len(node.args) > 6 else node.kwargs.get("sparse")
        else:
            continue
        if sparse is not True or not isinstance(weight, fx.Node) or weight.op != "get_attr":
            continue
        tensor = gm.get_parameter(str(weight.target)) if str(weight.target) in dict(gm.named_parameters()) else None
        if tensor is not None and tensor.requires_grad:
            name = info.model_name(str(weight.target)) if info is not None else str(weight.target)
            raise MobiusError(f"the model computes an embedding with sparse=True over parameter `{name}`: its "
                              f"gradient is a sparse tensor, which the pipeline's gradient sums on the GPUs (dense "
                              f"buffers) cannot hold; pass sparse=False (a dense gradient)")


def _warn_buffer_updates(model: nn.Module, gm: fx.GraphModule, microbatches: int) -> None:
    """Warn, with several micro-batches, that a buffer forward changes in place (a counter, an
    EMA) is updated once per micro-batch, as eager run micro-batch by micro-batch updates it;
    BatchNorm's statistics have their own warning (`_warn_batch_norms`)."""
    info = gm.meta.get("mobius_trace")
    if microbatches <= 1 or info is None:
        return
    norms = {n for n, mod in model.named_modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm)}
    names = [b for b in getattr(info, "buffer_writes", ()) if b.rpartition(".")[0] not in norms]
    if names:
        shown = ", ".join(f"`{b}`" for b in names[:3]) + (" ..." if len(names) > 3 else "")
        warnings.warn(f"forward changes the buffer{'s' if len(names) > 1 else ''} {shown} in place: with "
                      f"{microbatches} micro-batches the update runs once per micro-batch ({microbatches} times per "
                      f"call, in micro-batch order, as eager run micro-batch by micro-batch), not once per call. "
                      f"Compile with microbatches=1 for eager's once-per-call update, or make the update independent "
                      f"of how the batch is split", stacklevel=3)
