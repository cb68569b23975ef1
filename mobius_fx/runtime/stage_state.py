"""The state stage calls act on: `StageState` (a stage at run time: its module, its weight slots on
its GPU and their masters), `Step` (the book-keeping of one forward and its backward),
`StageCall` (one stage call of one micro-batch, as the autograd Function sees it) and `OnHost`
(a stage input kept on the host for backward). The calls themselves: `engine.Runtime` (its stage calls).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from mobius_fx.errors import MobiusError
from mobius_fx.planning.stage_contract import StageSpec
from mobius_fx.runtime.device_books import Device, nbytes
from mobius_fx.runtime.device_rewrite import bind, moved_module, named_tensors
from mobius_fx.runtime.host_counters import watch_masters

__all__ = ["StageState", "Step", "StageCall", "OnHost", "refuse_changed_masters"]


class StageState:
    """A stage at run time: its module, its weight slots on its device and their masters."""

    def __init__(self, spec: StageSpec, device: Device, masters: list[torch.Tensor], dtype: torch.dtype | None) -> None:
        if getattr(spec.module, "_mobius_bound", False):
            raise MobiusError(f"stage {spec.index}'s module already runs in another Pipeline; a schedule backs one "
                              f"pipeline: run insert_transfers again (or build_pipeline without schedule=)")
        spec.module._mobius_bound = True
        self.index = spec.index
        self.spec = spec
        self.device = device
        self.module = spec.module
        self.masters = masters
        self.is_param = [isinstance(m, nn.Parameter) for m in masters]
        self.kinds = [(m.shape, m.dtype, m.device) for m in masters]  # checked by Runtime.follow
        watch_masters(m for m, p in zip(masters, self.is_param) if p)  # their optimizer steps bump versions
        self.slots = [device.new_slot(m, dtype, p) for m, p in zip(masters, self.is_param)]
        for w, slot in zip(spec.weights, self.slots):
            for path, attr in w.slots:
                bind(self.module, path, attr, slot)
        self.buffer_idx = [j for j, p in enumerate(self.is_param) if not p]
        # Buffers grouped by the module holding them: native batch_norm updates running stats
        # without bumping their version counter, but num_batches_tracked beside them is bumped.
        groups: dict[str, list[int]] = {}
        for j in self.buffer_idx:
            groups.setdefault(spec.weights[j].slots[0][0], []).append(j)
        self.buffer_groups = list(groups.values())
        self.changing: set[int] = set()  # buffer slots a forward has changed: copied before each call
        self.weight_bytes = sum(nbytes(s) for s in self.slots)
        self.shells = spec.shells
        # tensor constants (not weights) bound into the module whenever it runs this state
        # ((path, attribute, tensor); set when a copy on another device moved them: `copy_on`)
        self.consts: list[tuple[str, str, torch.Tensor]] = []
        self.resident = False
        self.token: Any = None
        self.versions: list[int] = []
        self.train: list[int] = []  # slots that take gradients (set at each prefetch)

    def copy_on(self, device: Device, dtype: torch.dtype | None) -> "StageState":
        """This stage's copy on another GPU (a schedule that runs it on several: the step
        executor's split-head, ZeRO-3's replicas, RoundPipe's backward): the same spec and
        masters, slots of its own on `device`, bound into the module only while the executor
        runs the copy (`bind_slots`); not resident. On the same torch device (virtual GPUs, or
        pipeline GPUs sharing one CUDA device) the copy runs the stage's own module; on another
        (cuda:0 -> cuda:1) a module of its own (`device_rewrite.moved_module`): its graph with
        that device's constants, its tensor constants there."""
        new = object.__new__(StageState)
        new.__dict__.update(self.__dict__)
        new.device = device
        here, there = self.device.torch_device, device.torch_device
        if there != here:
            own = dict(named_tensors(self.module))  # before moved_module binds the copy's into shared modules
            new.module, new.consts = moved_module(self.spec, self.module, here, there)
            if new.consts and not self.consts:  # the stage's own values, bound back when it runs again (in
                self.consts[:] = [(path, attr, own[f"{path}.{attr}" if path else attr])  # place: its same-device
                                  for path, attr, _ in new.consts]  # copies share the list)
            for path, attr, t in self.consts:  # the stage's module left with its own, as it was (the
                bind(self.module, path, attr, t)  # executor binds nothing before a stage's first op at home)
        new.slots = [device.new_slot(m, dtype, p) for m, p in zip(self.masters, self.is_param)]
        new.weight_bytes = sum(nbytes(s) for s in new.slots)
        new.changing, new.resident, new.token, new.versions, new.train = set(), False, None, [], []
        return new

    def bind_slots(self) -> None:
        """Make the module compute with this state's slots (a copy's, or the stage's own again)
        and its tensor constants (a copy's on another device, or the stage's own again)."""
        for w, slot in zip(self.spec.weights, self.slots):
            for path, attr in w.slots:
                bind(self.module, path, attr, slot)
        for path, attr, t in self.consts:
            bind(self.module, path, attr, t)


class Step:
    """Book-keeping of one forward (and its backward): calls per stage, gradients in flight."""

    def __init__(self, num_stages: int) -> None:
        self.fwd_calls = [0] * num_stages
        self.bwd_calls = [0] * num_stages
        self.acc: dict[int, dict[int, torch.Tensor]] = {}  # stage -> slot -> gradient on its GPU
        self.calls: dict[int, list[weakref.ref]] = {}  # stage -> its calls that saved inputs (weak: autograd owns them)
        self.pending: list[tuple[torch.Tensor, Any]] = []  # (master, thunk giving the host gradient)
        self.buffers: list[tuple[torch.Tensor, Any]] = []  # (master buffer, thunk giving its new value)
        self.state = "forward"  # forward | backward | done | aborted
        self.mb_rows = 0
        self.marks: dict[int, bool] = {}  # id(input tensor) -> batched, from batch_dims (mobius_fx/planning/microbatch.py)
        self.hub: torch.Tensor | None = None  # Masters' output: every stage call hangs off it
        # pipe.overlap(mode="sync"): whether this backward hands complete gradients to the
        # optimizer (decided at its first flush), the stages flushed, the masters handed over
        # and, per master, the stages holding it that ran
        self.overlap: bool | None = None
        self.flushed: set[int] = set()
        self.handed: set[int] = set()
        self.holders: dict[int, set[int]] = {}
        # per stage flushed with gradients while overlapping: a thunk giving whether all of them
        # are finite, computed on its GPU before the download (None: the device cannot; the
        # optimizer then reads the gradients on the host)
        self.finite: dict[int, Any] = {}
        # whether this backward downloads the optimizer overlap's gradients widened to the masters'
        # dtype on the GPUs, straight into their `.grad` homes (decided at its first flush:
        # `Runtime._widens`)
        self.widen: bool | None = None
        # the stages whose download completes a tied weight's gradient on their GPU, as the
        # schedule IR the executor runs says (its `send ... gradient host->gpu`; None: the model
        # pipeline's backward, every first holder), and the partials fetched for it: (stage, slot)
        # -> host tensors its download brings up chunk by chunk (runtime/tied_sums.py)
        self.gpu_sums: set[int] | None = None
        self.split_downloads: set[int] = set()  # stages the IR downloads from several GPUs: never widened
        self.partials: dict[tuple[int, int], list[torch.Tensor]] = {}
        # per stage, the version counter of each of its parameters when its first forward call
        # ran: its backward recomputes from the masters, so one changed since is refused
        self.param_versions: dict[int, list[tuple[int, int]]] = {}


class StageCall:
    """One stage call of one micro-batch, as the autograd Function sees it."""

    __slots__ = ("rt", "step", "stage", "mb", "in_leaves", "in_spec", "in_pos", "out_leaves", "out_spec",
                 "out_pos", "saved", "restored", "rng", "amp", "state", "__weakref__")

    def __init__(self, rt: Any, step: Step, stage: int, mb: int, leaves: list, spec: pytree.TreeSpec, pos: list[int]):
        self.rt, self.step, self.stage, self.mb = rt, step, stage, mb
        self.in_leaves = [None if j in pos else x for j, x in enumerate(leaves)]
        self.in_spec, self.in_pos = spec, pos
        self.out_leaves: list = []
        self.out_spec: Any = None
        self.out_pos: list[int] = []
        self.saved: list = []
        self.restored: tuple[list, list] | None = None  # (inputs back on the GPU, their copies' events)
        self.rng: Any = None
        self.amp: tuple[str, bool, torch.dtype] = rt.amp_state(rt.stages[stage].device)
        self.state: list[tuple[int, torch.Tensor]] = []  # (buffer slot, its value before the forward changed it)


class OnHost:
    """A stage input that came from the host: kept there for backward (no offload copy)."""

    __slots__ = ("host", "version")

    def __init__(self, host: torch.Tensor, version: int) -> None:
        self.host, self.version = host, version


def refuse_changed_masters(st: StageState, recorded: list[tuple[int, int]], names: list[tuple[nn.Module, str, str] | None]) -> None:
    """Refuse the backward of stage `st` when one of its parameters changed in place since the
    forward that used it (`recorded`: (slot, version) at that forward; `names[j]`: where the model
    holds slot j, `(module, attr, name)` or None). Eager raises too when the weight was saved for
    backward ("modified by an inplace operation"); the pipeline recomputes the stage from the
    masters, so it would silently differentiate the new weights."""
    for j, version in recorded:
        now = st.masters[j]._version
        if now != version:
            place = names[j] if j < len(names) else None
            name = place[2] if place is not None else st.spec.weights[j].name
            raise MobiusError(
                f"parameter `{name}` was modified in place after the forward that used it and before its backward "
                f"(version {version} -> {now}: an optimizer.step(), or an edit under torch.no_grad(), between the "
                f"forward and loss.backward()); eager PyTorch raises too (\"one of the variables needed for gradient "
                f"computation has been modified by an inplace operation\"), and stage {st.index}'s backward recomputes "
                f"the stage from the changed weight. Call loss.backward() before changing the weights (forward, "
                f"backward, then optimizer.step()), or run the forward again after the change")
