"""`Precision`: the one record of the dtypes a pipeline moves weights in, built once and carried.

A plan streams every floating weight (and its gradient, and the activations between stages) to
the GPUs in one dtype, `stream`, while the optimizer's masters stay in the host's DRAM in their
own dtype, `master` — read from the model's parameters, never assumed. `CompileOptions` builds
the record once per model (`CompileOptions.for_model`) and it travels typed from there: the
annotate pass, the step model's `PartitionProblem` and `MemoryModel`, `Plan.precision`, the
simulator and the runtime. Byte sizes are derived here (`scale`: streamed bytes per master
byte) and nowhere else.

`parse_dtype` is the one table of dtype spellings ("bf16", "torch.float16", ...); the command
line and the device specs' FLOP/s keys read it too.

    >>> p = Precision.of(torch.bfloat16, master=torch.float32)
    >>> p.stream_bytes, p.master_bytes, p.scale, str(p)
    (2, 4, 0.5, 'bfloat16 (masters float32)')
    >>> str(Precision.of(None, master=torch.float32))
    "float32 (the masters' dtype)"
    >>> Precision.from_dict(p.to_dict()) == p
    True
    >>> parse_dtype("bf16"), dtype_name(torch.float16)
    (torch.bfloat16, 'float16')
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from mobius_fx.errors import MobiusError

__all__ = ["Precision", "parse_dtype", "dtype_name", "master_dtype", "DTYPE_ALIASES", "STREAMED"]

# The spellings a dtype may be given in besides torch's own names ("float16", "torch.float16").
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                 "fp64": "float64", "double": "float64"}

# The dtypes a stage computes in: torch's float8/float4 types are storage formats its ops and
# autocast do not run in, so they pass `is_floating_point` and would fail at the first call.
STREAMED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def parse_dtype(value: Any, what: str = "dtype") -> torch.dtype:
    """`value` (a torch dtype, its name, "torch.<name>" or an alias of DTYPE_ALIASES) as a torch
    dtype; a MobiusError naming `what` for anything else."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        name = value.strip().removeprefix("torch.")
        found = getattr(torch, DTYPE_ALIASES.get(name, name), None)
        if isinstance(found, torch.dtype):
            return found
    raise MobiusError(f"{what}={value!r} is not a torch dtype; use torch.bfloat16, torch.float16, torch.float32 "
                      f"(or a name: {', '.join(sorted({*DTYPE_ALIASES, 'bfloat16', 'float16', 'float32'}))}) "
                      f"or None (the masters' dtype)")


def dtype_name(dtype: torch.dtype) -> str:
    """The printed (and JSON) form of a torch dtype: `torch.bfloat16` -> "bfloat16"; it parses back."""
    return str(parse_dtype(dtype)).removeprefix("torch.")


def master_dtype(parameters: Iterable[torch.Tensor]) -> torch.dtype:
    """The masters' dtype: that of most floating parameter elements (float32 when there is none).
    Meta parameters have their dtype too, so a model built on the meta device plans as it will run."""
    totals: dict[torch.dtype, int] = {}
    for p in parameters:
        if p.is_floating_point():
            totals[p.dtype] = totals.get(p.dtype, 0) + p.numel()
    return max(totals, key=totals.__getitem__) if totals else torch.float32


def _streamed(value: Any) -> torch.dtype:
    """The streamed dtype `value` asks for, checked: a floating dtype torch computes in."""
    dtype = parse_dtype(value)
    if not dtype.is_floating_point:
        raise MobiusError(f"dtype={value!r} is not a floating dtype; weights are trained in the streamed dtype, so it "
                          f"must be torch.bfloat16, torch.float16 or torch.float32 (quantised weights: keep them "
                          f"frozen in the model and stream in a floating dtype)")
    if dtype not in STREAMED:
        raise MobiusError(f"dtype={value!r} is a storage format ({dtype.itemsize * 8} bits) that torch cannot compute in "
                          f"(matmuls, activations and autocast are defined for float16, bfloat16, float32 and "
                          f"float64); stream in torch.bfloat16 or torch.float16 (keep float8 weights frozen in the "
                          f"model if you quantise)")
    return dtype


@dataclass(frozen=True)
class Precision:
    """The dtype weights, gradients and activations cross the links and are computed in on the
    GPUs (`stream`), and the dtype of the masters in host memory (`master`, read from the model).

    `stream == master` (what `dtype=None` asks for) casts nothing: the stages run the masters'
    dtype under the caller's autocast, if any. A narrower `stream` is a mixed-precision pipeline:
    each upload is the master cast to `stream`, the stages run under autocast to it, and the
    gradients come back in it and are added into the masters (`cast`). A stream wider than the
    masters is refused: it would move more bytes for no precision the masters can keep.
    """

    stream: torch.dtype = torch.float32
    master: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for what in ("stream", "master"):
            value = getattr(self, what)
            if not isinstance(value, torch.dtype):
                raise MobiusError(f"Precision.{what}={value!r} is not a torch dtype; build it with Precision.of(dtype, "
                                  f"master=...) or Precision.of_model(model, dtype), which read names and aliases")
        if not self.master.is_floating_point:
            raise MobiusError(f"the masters' dtype {self.master} is not floating; the optimizer steps the masters, "
                              f"so they must be floating (keep integer or quantised tensors as buffers or frozen)")
        if self.stream != self.master:
            _streamed(self.stream)
            if self.stream.itemsize > self.master.itemsize:
                raise MobiusError(f"dtype={self.stream} is wider ({self.stream.itemsize} bytes) than the masters' "
                                  f"{self.master} ({self.master.itemsize} bytes); the masters could not keep the extra "
                                  f"precision and every copy would move more bytes; stream in {self.master} "
                                  f"(dtype=None) or narrower, or make the masters {self.stream} first "
                                  f"(model.to({self.stream}))")

    # ------------------------------------------------------------------ construction
    @classmethod
    def of(cls, dtype: Any, *, master: Any = torch.float32) -> "Precision":
        """The precision of streaming in `dtype` (a torch dtype, a name or an alias; None: the
        masters' own) masters of dtype `master`."""
        master = parse_dtype(master, "master")
        return cls(master if dtype is None else _streamed(dtype), master)

    @classmethod
    def of_model(cls, model: torch.nn.Module, dtype: Any = None) -> "Precision":
        """Streaming `model`'s masters in `dtype` (None: their own dtype, `master_dtype`)."""
        return cls.of(dtype, master=master_dtype(model.parameters()))

    @staticmethod
    def check_request(dtype: Any) -> torch.dtype | None:
        """The streamed dtype `dtype` asks for (None: the masters'), checked before the model is
        read: what `CompileOptions(dtype=...)` keeps."""
        return None if dtype is None else _streamed(dtype)

    # ------------------------------------------------------------------ derived
    @property
    def stream_bytes(self) -> int:
        return self.stream.itemsize

    @property
    def master_bytes(self) -> int:
        return self.master.itemsize

    @property
    def scale(self) -> float:
        """Streamed bytes per master byte: what the layer costs (traced in the masters' dtype)
        are multiplied by to get the bytes a GPU holds and a link carries."""
        return self.stream_bytes / self.master_bytes

    @property
    def cast(self) -> torch.dtype | None:
        """The dtype the runtime casts uploads and activations to and runs autocast in; None
        when the stream is the masters' dtype (nothing is cast)."""
        return None if self.stream == self.master else self.stream

    def __str__(self) -> str:
        if self.cast is None:
            return f"{dtype_name(self.stream)} (the masters' dtype)"
        return f"{dtype_name(self.stream)} (masters {dtype_name(self.master)})"

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, str]:
        return {"stream": dtype_name(self.stream), "master": dtype_name(self.master)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Precision":
        return cls(parse_dtype(d["stream"], "stream"), parse_dtype(d["master"], "master"))
