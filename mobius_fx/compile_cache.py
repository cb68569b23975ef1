"""What `plan` and `compile` keep on disk so that a second compile of the same model is quick:
the traced graph (mobius_fx/trace_key.py keys it, mobius_fx/trace_store.py stores it) and the
annotate pass's result (each node's `NodeCost` and the layers). The partition is cached by the
solver (passes/partition_solve.py, ``<dir>/*.json`` or ``~/.cache/mobius_fx/plans``).

Where: ``<cache_dir>/traces`` with `cache_dir=` given, else ``$MOBIUS_FX_CACHE/traces``, else
``~/.cache/mobius_fx/traces``. Off: `cache=False`, or ``MOBIUS_FX_TRACE_CACHE=0`` in the
environment (the tests' default, tests/conftest.py). A corrupt or stale entry is never trusted:
it is ignored with a log line and the work done again.

Layer costs are cached only when modelled (`costs="model"`, or "auto" on meta tensors): measured
times are the machine's of the moment, measured again each compile.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch.fx as fx

from mobius_fx.options import CompileContext, CompileOptions
from mobius_fx.trace_key import inputs_fingerprint
from mobius_fx.tracing import trace_info

__all__ = ["trace_dir", "cached_layers", "store_layers", "LAYERS_REVISION", "cache_enabled"]

log = logging.getLogger("mobius_fx")

# Bump with any change to what annotate computes for the same graph (the costs, the layer rules).
LAYERS_REVISION = "2026-12-05: NodeCost per node name and the LayerCost tuple"
_OFF = ("0", "off", "false", "no")


def cache_enabled(settings: CompileOptions) -> bool:
    """`settings.cache`, unless ``MOBIUS_FX_TRACE_CACHE`` says 0/off/false/no."""
    return settings.cache and os.environ.get("MOBIUS_FX_TRACE_CACHE", "").strip().lower() not in _OFF


def trace_dir(settings: CompileOptions) -> Path | None:
    """The directory of cached graphs and layer costs for these settings; None when the cache is off."""
    if not cache_enabled(settings):
        return None
    if settings.cache_dir is not None:
        root = Path(os.fsdecode(settings.cache_dir))
    else:
        env = os.environ.get("MOBIUS_FX_CACHE")
        root = Path(env) if env else Path.home() / ".cache" / "mobius_fx"
    return root / "traces"


def _layers_path(gm: fx.GraphModule, ctx: CompileContext) -> Path | None:
    """Where the annotate pass's result for `gm` under `ctx` is kept (None: the cache is off, or
    the graph was not cached: it has no key)."""
    folder = trace_dir(ctx.settings)
    key = trace_info(gm).key
    if folder is None or not key:
        return None
    s = ctx.settings
    spec = s.device_spec or ctx.topology.gpus[0].spec
    blob = {"revision": LAYERS_REVISION, "graph": key, "inputs": inputs_fingerprint(ctx.example_inputs, ctx.example_kwargs),
            "costs": s.costs, "spec": asdict(spec) if is_dataclass(spec) else repr(spec), "precision": repr(s.precision)}
    digest = hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()
    return folder / f"{digest}.layers"


def cached_layers(gm: fx.GraphModule, ctx: CompileContext) -> tuple | None:
    """The layers cached for `gm` under `ctx`, with each node's `meta["mobius"]` written back;
    None when there is none, or it does not fit this graph (a log line says why)."""
    path = _layers_path(gm, ctx)
    if path is None or not path.exists():
        return None
    try:
        entry = pickle.loads(path.read_bytes())
        costs, layers = entry["costs"], tuple(entry["layers"])
        nodes = list(gm.graph.nodes)
        if sorted(costs) != sorted(n.name for n in nodes):
            raise ValueError("its nodes are not this graph's")
    except Exception as e:  # anything: a corrupt or stale entry is never trusted
        log.warning("annotate: ignoring the cached layer costs %s (%s: %s); annotating again", path,
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    for n in nodes:
        if costs[n.name] is not None:
            n.meta["mobius"] = costs[n.name]
    log.info("annotate: cached (key %s): %d nodes -> %d layers", path.stem[:12], len(nodes), len(layers))
    return layers


def store_layers(gm: fx.GraphModule, ctx: CompileContext, layers: tuple) -> None:
    """Keep the annotate pass's result for `gm` (modelled costs only: see the module's docstring)."""
    path = _layers_path(gm, ctx)
    if path is None or any(getattr(layer, "measured", False) for layer in layers):
        return
    entry = {"costs": {n.name: n.meta.get("mobius") for n in gm.graph.nodes},
             "layers": list(layers)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL))
        tmp.replace(path)
    except OSError as e:  # a read-only cache is not an error
        log.info("annotate: layer costs not cached (cannot write %s: %s)", path, e.strerror or e)

