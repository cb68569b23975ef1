"""The two entry points: `plan` (trace, annotate, partition, cross-map) and `compile` (plan,
then rewrite and emit the pipeline you train with)."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

import torch

from .compiler import CompileContext, PassPipeline, default_pipeline
from .errors import MobiusError
from .plans import Plan

__all__ = ["plan", "compile"]

log = logging.getLogger("mobius_fx")


def _topology(topology: Any):
    from .topology import Topology

    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, str):
        if topology.endswith(".json") or topology.lstrip().startswith("{"):
            return Topology.from_json(topology)
        return Topology.preset(topology)
    raise MobiusError(f"topology {topology!r} is neither a Topology, a preset name nor a JSON file; "
                      f"use Topology.preset(...), Topology.virtual(...) or Topology.from_json(path)")


@contextlib.contextmanager
def _verbosity(verbose: bool):
    """With verbose=True, show INFO progress on stderr while a compile runs.

    To route mobius_fx's progress through your own logging setup instead, pass verbose=False
    and configure the "mobius_fx" logger (or attach a handler to it: then it is used as is).
    """
    if not verbose or log.handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[mobius_fx] %(message)s"))
    old_level, old_propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
        log.propagate = old_propagate


def _run(passes: PassPipeline, *, model, topology, example_inputs, example_kwargs, microbatches: int,
         verbose: bool, **settings) -> CompileContext:
    """Normalise the user's arguments into a CompileContext and run `passes` on it."""
    if not isinstance(microbatches, int) or microbatches < 1:
        raise MobiusError(f"microbatches={microbatches!r}; it must be a positive int (Mobius uses one per GPU)")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    ctx = CompileContext(model=model, topology=_topology(topology), example_inputs=tuple(example_inputs),
                         example_kwargs=dict(example_kwargs or {}),
                         settings={"microbatches": microbatches, **settings})
    with _verbosity(verbose):
        passes.run(ctx)
    return ctx


def plan(model: torch.nn.Module, topology: Any, *, example_inputs: Any, example_kwargs: dict | None = None,
         microbatches: int = 1, costs: str = "auto", dtype: torch.dtype | None = None,
         memory_fraction: float = 0.9, solver: str = "auto", time_limit: float = 20.0,
         cross_map: str = "contention", cache_dir: str | None = None, verbose: bool = True,
         pipeline: PassPipeline | None = None) -> Plan:
    """Plan a Mobius pipeline for `model` on `topology`; nothing is run on a GPU.

    Works on the meta device, so a 15B model plans on a laptop:

        with torch.device("meta"):
            model = GPT(GPTConfig(hidden=3072, blocks=72))
        p = mobius_fx.plan(model, "mobius-testbed", example_inputs=(ids,), microbatches=8)
        print(p)

    `dtype` is the dtype weights are streamed and computed in on the GPUs (fp32 masters stay
    in DRAM); `memory_fraction` the share of each GPU's memory the plan may use; `solver`
    "auto" | "highs" | "cbc"; `time_limit` the MIP's whole budget in seconds (shared by the
    candidate stage counts; the gap reached is reported in `plan.solver`).
    """
    return _run((pipeline or default_pipeline()).until("plan"), model=model, topology=topology,
                example_inputs=example_inputs, example_kwargs=example_kwargs, microbatches=microbatches,
                verbose=verbose, costs=costs, dtype=dtype, memory_fraction=memory_fraction, solver=solver,
                time_limit=time_limit, cross_map=cross_map, cache_dir=cache_dir).plan


def compile(model: torch.nn.Module, topology: Any, *, example_inputs: Any, example_kwargs: dict | None = None,
            microbatches: int = 1, dtype: torch.dtype | None = None, costs: str = "auto",
            memory_fraction: float = 0.9, solver: str = "auto", time_limit: float = 20.0,
            cross_map: str = "contention", cache_dir: str | None = None, device: str = "auto",
            verbose: bool = True, pipeline: PassPipeline | None = None):
    """Compile `model` into a Mobius pipeline you train with your usual loop.

        pipe = mobius_fx.compile(model, Topology.virtual(gpus=4, memory="256MiB"),
                                 example_inputs=(x,), microbatches=4)
        loss = loss_fn(pipe(x), y); loss.backward(); opt.step()   # opt over model.parameters()

    The master weights stay in `model` on the CPU; gradients land in `param.grad`.
    `device`: "auto" (CUDA when the topology is real and CUDA is present, else virtual GPUs on
    the CPU), "virtual" or "cuda".
    """
    return _run(pipeline or default_pipeline(), model=model, topology=topology, example_inputs=example_inputs,
                example_kwargs=example_kwargs, microbatches=microbatches, verbose=verbose, costs=costs, dtype=dtype,
                memory_fraction=memory_fraction, solver=solver, time_limit=time_limit, cross_map=cross_map,
                cache_dir=cache_dir, device=device).pipeline
