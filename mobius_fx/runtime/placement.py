"""Placement: the device constants a trace fixed follow each stage to its GPU, and a check that
no op of a stage would see tensors of two devices, made on any machine.

A traced graph remembers the device its example inputs were on: `torch.export` writes it into
every factory op (`aten.arange(n, device=cpu)` for position ids, `ones`/`zeros`/`full` for
masks), every `.to`/`_to_copy` and every `_assert_tensor_metadata(device=cpu)`; a
`torch.fx` graph keeps literal devices (`torch.arange(n, device="cpu")`, `x.to("cpu")`) and
factory calls that give none (`torch.ones(t, t)`, made on the CPU). Run as is on a GPU, stage
0 of GPT-2 fails with "index is on cpu, different from other tensors on cuda:0".

- `place_stage` (called by `build_pipeline` as it binds each stage to its device) rewrites the
  stage's graph: every device constant equal to the traced device becomes the stage's device,
  factory calls without a device whose result meets a tensor of the stage get the stage's
  device, export's autocast regions name the stage's device type, the bodies of export's
  higher-order ops (`torch.no_grad()`, autocast regions) are rewritten alike (as copies: the
  traced graph's are shared), and tensor constants that are not weights (weights are uploaded
  by the runtime anyway) move to it. A device value one stage hands another (`x.device`)
  names the receiving stage's device (`sent_device`, used by the runtime's send). On virtual
  devices (the CPU) the rewrite maps cpu to cpu: numerics are unchanged.
- `check_placement` replays every stage graph, rewritten as `place_stage` would for the target
  device, under `torch._subclasses.FakeTensorMode` (which fakes CUDA tensors on a machine
  without CUDA), with the runtime's own transfers: each tensor input on the stage's device (the
  runtime copies every tensor a stage receives there, host inputs and skips included),
  non-tensor inputs as they are, weights and buffers on the stage's device. An op that would
  see two devices (a 0-dim CPU tensor excepted, as torch allows it) raises a MobiusError
  naming the stage, the node and both devices. `Pipeline.check_placement("cuda")` calls it;
  `build_pipeline` calls it before allocating anything when the devices are CUDA devices.

Why a replay and not a scan of device arguments: placement errors come from data flow (a CPU
tensor built three ops earlier meets a GPU weight in an `embedding`), which only running the
ops' device rules finds; fake tensors run them without memory or a GPU.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from mobius_fx.errors import MobiusError
from mobius_fx.runtime.device_rewrite import (
    COMPUTE_OPS, copy_graph, moved_device, moved_graph_module, named_tensors, rewrite_graph, rewritten_body,
    weight_places,
)
from mobius_fx.planning.microbatch import divides
from mobius_fx.planning.stage_contract import Schedule, StageSpec

__all__ = ["check_placement", "example_spec", "Placement", "target_devices", "sent_device"]

log = logging.getLogger("mobius_fx")

class Placement(NamedTuple):
    """What a pipeline keeps to check its placement later: the example inputs' shapes
    (`example_spec`, None when built without them), the traced device and the CUDA index of
    each GPU name (from the topology; absent: its position)."""

    example: list[Any] | None
    traced: torch.device
    indices: dict[str, int]


def sent_device(value: torch.device, to: torch.device | None) -> torch.device:
    """A device value one stage hands another (`x.device`, read where x was) as the runtime
    sends it to a stage on `to` (None: to the host, kept for a later stage): it named the
    sender's copy of a tensor, which the receiver holds on its own device, so it names that."""
    return value if to is None else to


def example_spec(flat: Sequence[object]) -> list[Any]:
    """The example inputs as `check_placement` needs them: shapes, strides and dtypes on the
    meta device (no memory held), non-tensors as they are."""
    def meta(x: object) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return x
    return [pytree.tree_map(meta, x) for x in flat]


def _microbatch(flat: Sequence[object], m: int) -> list[Any]:
    """Micro-batch 0 of the inputs, split as the runtime splits them (`Runtime.split`: dim 0 of
    the first tensor input with a dimension is the batch; build_pipeline refused a batch that
    does not split)."""
    rows = next((x.size(0) for x in pytree.tree_leaves(list(flat)) if isinstance(x, torch.Tensor) and x.dim() > 0),
                None) if m > 1 else None
    if not rows or not divides(rows, m):
        return list(flat)
    mb = rows // m

    def part(x: object) -> Any:
        return x[:mb] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.size(0) == rows else x
    return [pytree.tree_map(part, x) for x in flat]


_DEVICE_ERROR = re.compile(r"same device|device mismatch|different from other tensors|on the same device|"
                           r"found at least two devices|Expected all tensors", re.I)


_TWO_DEVICES = re.compile(r"two devices, (\S+) and (\S+?)!")


def _is_device_error(e: BaseException) -> bool:
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    return isinstance(e, FakeTensorDeviceMismatchError) or bool(_DEVICE_ERROR.search(str(e)))


def _devices_of(values: Iterable[object]) -> list[str]:
    out: list[str] = []
    for x in pytree.tree_leaves(list(values)):
        d = None
        if isinstance(x, torch.Tensor) and not (x.dim() == 0 and x.device.type == "cpu"):
            d = x.device
        elif isinstance(x, torch.device):
            d = x
        if d is not None and str(d) not in out:
            out.append(str(d))
    return out


class _Unreplayable(Exception):
    pass


class _Replay(fx.Interpreter):
    """One stage's graph under fake tensors; names the node of a device clash."""

    def __init__(self, module: fx.GraphModule, graph: fx.Graph, k: int, device: torch.device,
                 traced: torch.device | None) -> None:
        super().__init__(module, garbage_collect_values=False, graph=graph)  # values kept: a clash names their origin
        self.k, self.device, self.traced, self.count = k, device, traced, 0  # traced None: bodies already rewritten
        self.bodies: dict[str, fx.GraphModule] = {}
        self.copy = ""  # ", its copy on GPU x," for a stage's copy on another GPU
        self.clash: str | None = None  # the message of a clash (fx's Interpreter appends to the error's own)
        self.stuck = ""  # the op fake tensors could not run, if any

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if isinstance(value, fx.GraphModule) and self.traced is not None:  # a body, rewritten as binding does
            if target not in self.bodies:
                self.bodies[target] = rewritten_body(value, self.traced, self.device)[0]
            return self.bodies[target]
        return value

    def run_node(self, n: fx.Node) -> Any:
        try:
            out = super().run_node(n)
        except MobiusError:
            raise
        except Exception as e:
            if n.op not in COMPUTE_OPS:
                raise
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            if _is_device_error(e):
                self.clash = self._clash(n, args, kwargs, e)
                raise MobiusError(self.clash) from e
            out = self._on_meta(n, args, kwargs, e)
        if n.op in COMPUTE_OPS:
            self.count += 1
        return out

    def _foreign(self, v: object) -> bool:
        return isinstance(v, torch.Tensor) and v.device != self.device and not (v.dim() == 0 and v.device.type == "cpu")

    def _origin(self, a: fx.Node) -> fx.Node:
        """The first node, walking back from `a` through values on the same foreign device, that
        made such a value from none (the factory or constant the rewrite did not place)."""
        while True:
            back = [b for b in a.all_input_nodes if self._foreign(self.env.get(b))]
            if not back:
                return a
            a = back[0]

    def _clash(self, n: fx.Node, args: tuple, kwargs: dict, e: BaseException) -> str:
        devices = _devices_of([args, kwargs])
        if n.op == "call_module" and str(self.device) not in devices:
            devices.insert(0, str(self.device))
        where = []
        for a in n.all_input_nodes:
            v = self.env.get(a)
            if self._foreign(v):
                o = self._origin(a)
                where.append(f"%{a.name} on {v.device}" + (f", made by `{o.format_node()}`" if o is not a else ""))
        first = str(e).strip().splitlines()[0]
        named = _TWO_DEVICES.search(str(e))
        if len(devices) < 2 and named:
            devices = [named.group(1), named.group(2)]
        pair = " and ".join(devices[:2]) if len(devices) >= 2 else first
        return (f"stage {self.k}{self.copy} would run on {self.device} but its node `{n.format_node()}` sees tensors "
                f"of two devices, {pair}{' (' + '; '.join(where) + ')' if where else ''}: torch refuses that on a GPU "
                f"({first}). A device fixed by the trace that the stage's device does not replace (a tensor made "
                f"on the traced device outside a factory op, a plain tensor attribute of a module that is neither "
                f"a parameter nor a buffer, an explicit `.cpu()`) is the usual cause: make it follow an input "
                f"(`device=x.device`), register the tensor as a buffer, or report the op")

    def _on_meta(self, n: fx.Node, args: tuple, kwargs: dict, e: BaseException) -> Any:
        """An op fake tensors cannot run on the fake device (a kernel that needs the real
        backend, a data-dependent size): its result's shapes from the meta device, placed on
        the stage's device (where every input it got already was: no clash was raised)."""
        def meta(x: object) -> Any:
            if isinstance(x, torch.Tensor) and not (x.dim() == 0 and x.device.type == "cpu"):
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            return x

        try:
            margs, mkwargs = pytree.tree_map(meta, (args, kwargs))
            out = getattr(self, n.op)(n.target, margs, mkwargs)
        except Exception as again:
            self.stuck = f"node `{n.format_node()}` ({type(e).__name__}: {str(e).strip().splitlines()[0]})"
            raise _Unreplayable(self.stuck) from again

        def back(x: object) -> Any:
            if isinstance(x, torch.Tensor) and x.device.type == "meta":
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=self.device)
            return x
        return pytree.tree_map(back, out)


def check_placement(schedule: Schedule, example: Sequence[object] | None, devices: Mapping[str, torch.device],
                    traced: torch.device, copies: Mapping[int, Iterable[str]] | None = None) -> int:
    """Replay every stage of `schedule` on `devices[stage.gpu]` under fake tensors (see the
    module docstring), `example` being the flat example inputs (`example_spec`) and `traced`
    the device they were traced on. Returns the number of ops replayed; raises MobiusError at
    the first op that would see two devices. A stage whose replay hits an op fake tensors
    cannot run (a data-dependent branch) is left unchecked from there, with a warning, and so
    are the stages that need its outputs.

    `copies` ({stage: GPU names}): the other GPUs a schedule runs each stage on (RoundPipe's
    backward, split-head's dealt last stage, ZeRO-3's replicas: runtime/executor.py); where
    one is another device, the stage's copy there is replayed too, its graph rewritten from
    the stage's device to that one as the runtime's copy is (`device_rewrite.moved_module`),
    its inputs, weights and constants there."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if example is None:
        raise MobiusError("check_placement needs the example inputs' shapes, but this pipeline was built without "
                          "example inputs; build it with example_inputs= (mobius_fx.compile always passes them)")
    flat = _microbatch(example, schedule.microbatches)
    by_name = dict(zip(schedule.inputs, flat))
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    outputs: dict[int, tuple | None] = {}
    count = 0
    with mode:
        for spec in schedule.stages:
            dev = torch.device(devices[spec.gpu])

            def to_stage(x: object) -> Any:  # the runtime's send: every tensor a stage gets is copied to its device
                if isinstance(x, torch.Tensor):
                    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=dev)
                return sent_device(x, dev) if isinstance(x, torch.device) else x
            args, missing = [], None
            for ref in spec.inputs:
                if ref.stage < 0:
                    args.append(pytree.tree_map(to_stage, by_name[ref.name]))
                elif outputs.get(ref.stage) is None:
                    missing = ref.stage
                    break
                else:
                    args.append(pytree.tree_map(to_stage, outputs[ref.stage][ref.index]))
            if missing is not None:
                log.warning("check_placement: stage %d was not replayed: it needs outputs of stage %d, which could "
                            "not be replayed", spec.index, missing)
                outputs[spec.index] = None
                continue
            graph = copy_graph(spec.module.graph)
            rewrite_graph(graph, traced, dev)
            weights = weight_places(spec)
            fakes = {name: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                               device=moved_device(name, t, weights, traced, dev))
                     for name, t in named_tensors(spec.module)}
            replay = _Replay(spec.module, graph, spec.index, dev, traced)
            out = _replayed(replay, spec.module, fakes, args, f"stage {spec.index} on {dev}")
            count += replay.count
            outputs[spec.index] = tuple(out) if out is not None else None
            others: dict[torch.device, str] = {}  # each other device a copy runs on, and its first GPU there
            for g in sorted((copies or {}).get(spec.index, ())):
                others.setdefault(torch.device(devices[g]), g)
            for there, gpu in others.items():
                if there != dev:
                    count += _replay_copy(spec, args, traced, dev, there, gpu)
    return count


def _replay_copy(spec: StageSpec, args: list, traced: torch.device, dev: torch.device, there: torch.device,
                 gpu: str) -> int:
    """Stage `spec`'s copy on `there` (GPU `gpu`) under fake tensors (`check_placement`): the
    stage as binding it to `dev` leaves it, moved to `there` as the runtime moves its copy
    (`moved_graph_module` of `moved_module`), its inputs sent there, its weights uploaded there,
    its other tensor constants there when binding and moving put them there."""
    placed = moved_graph_module(spec.module, traced, dev)  # what place_stage leaves (bodies too)
    module = moved_graph_module(placed, dev, there)  # what the copy runs (moved_module)

    def sent(x: object) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=there)
        return sent_device(x, there) if isinstance(x, torch.device) else x
    weights = weight_places(spec)
    fakes = {}
    for name, t in named_tensors(module):
        at = moved_device(name, t, weights, traced, dev)
        fakes[name] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                          device=there if name in weights or at == dev else at)
    replay = _Replay(module, module.graph, spec.index, there, None)
    replay.copy = f", its copy on {gpu},"
    _replayed(replay, module, fakes, pytree.tree_map(sent, args), f"stage {spec.index}'s copy on {gpu} ({there})")
    return replay.count


def _replayed(replay: "_Replay", module: torch.nn.Module, fakes: dict[str, torch.Tensor], args: Sequence[object],
              what: str) -> Any:
    """`replay` run on `args` with `module`'s tensors the `fakes`: its output, or None (logged)
    where fake tensors cannot run it; a device clash it met raised as its MobiusError."""
    from torch.nn.utils.stateless import _reparametrize_module

    try:
        with _reparametrize_module(module, fakes):
            return replay.run(*args)
    except MobiusError as e:
        if replay.clash is None:
            raise
        raise MobiusError(replay.clash) from e.__cause__
    except _Unreplayable:
        log.warning("check_placement: %s is unchecked from %s on: fake tensors cannot run it, even on the meta device",
                    what, replay.stuck)
        return None


def target_devices(gpus: Iterable[str], given: Mapping[str, torch.device], indices: Mapping[str, int] | None,
                   device: str | torch.device) -> dict[str, torch.device]:
    """The device each GPU name's stages would run on with `device` ("cuda", "cuda:1", ...):
    the pipeline's own device where it already is of that type, else its topology index (or
    its position) on that device type; a device with an index puts every stage there."""
    try:
        want = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise MobiusError(f"check_placement(device={device!r}): not a torch device ({e}); use 'cuda', 'cuda:1' or "
                          f"another device type name") from None
    out: dict[str, torch.device] = {}
    for i, gpu in enumerate(gpus):
        have = given.get(gpu)
        if want.index is not None:
            out[gpu] = want
        elif have is not None and have.type == want.type:
            out[gpu] = have
        else:
            out[gpu] = torch.device(want.type, (indices or {}).get(gpu, i))
    return out

