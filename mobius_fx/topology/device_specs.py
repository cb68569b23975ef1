"""What a GPU can do: `DeviceSpec`, the roofline modelled costs use (FLOP/s per dtype, memory
bandwidth, memory size), and `DEVICE_SPECS`, the presets the topology's GPUs name.

It lives with the topology (a GPU of the server is described by one) and below the planner,
which reads a topology's specs when it models costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from mobius_fx.errors import MobiusError, TopologyError
from mobius_fx.precision import dtype_name, parse_dtype
from mobius_fx.units import check_positive, parse_bytes

__all__ = ["DeviceSpec", "DEVICE_SPECS"]


def _flops_key(key: object) -> str | None:
    """A `flops` key (a torch dtype, its name or an alias: precision.parse_dtype) as a dtype name; None if not one."""
    try:
        return dtype_name(parse_dtype(key))
    except MobiusError:
        return None


@dataclass(frozen=True)
class DeviceSpec:
    """Peak capabilities of one accelerator, for the roofline cost model.

    `flops` maps dtype names ("float32", "float16", "bfloat16") to dense peak FLOP/s (tensor
    cores where the dtype uses them, fp32 accumulate). `efficiency` is the share of peak a
    well-shaped matmul reaches in practice; modelled time is
    max(flops / (peak * efficiency), bytes / memory_bandwidth).

    Checked when built (a `TopologyError` names the field): `flops` must hold "float32" (the
    rate of dtypes it does not list), keys are dtype names or torch dtypes ("bf16" is read as
    "bfloat16"); FLOP/s, `memory_bandwidth` and `memory` (bytes, or a string like "24GiB") are
    positive and finite; `efficiency` is in (0, 1].
    """

    name: str
    flops: dict[str, float]
    memory_bandwidth: float  # bytes/s
    memory: int  # bytes
    efficiency: float = 0.6

    def __post_init__(self) -> None:
        # Refused here, where the spec is written, not later as a ZeroDivisionError or a 1 us plan.
        if not isinstance(self.name, str) or not self.name:
            raise TopologyError(f"DeviceSpec name is {self.name!r}; give a non-empty string such as 'rtx3090'")
        me = f"DeviceSpec {self.name!r}"

        def positive(value: object, what: str, remedy: str) -> float:
            return check_positive(value, f"{me}: {what}", remedy, TopologyError)

        given = self.flops if isinstance(self.flops, Mapping) else {}
        keys = {k: _flops_key(k) for k in given}
        if None in keys.values() or "float32" not in keys.values():
            raise TopologyError(f"{me}: flops is {self.flops!r}; it must map dtype names (float32, bfloat16, ...) to "
                                "peak FLOP/s and hold 'float32' (the rate of unlisted dtypes); give e.g. "
                                "{'float32': 35.6e12, 'bfloat16': 71e12}")
        flops = {keys[k]: positive(v, f"flops[{k!r}]", "give the peak FLOP/s, e.g. 35.6e12") for k, v in given.items()}
        bandwidth = positive(self.memory_bandwidth, "memory_bandwidth", "give bytes/s, e.g. 936e9 for 936 GB/s")
        try:
            memory = parse_bytes(self.memory, f"{me}: memory")
        except MobiusError as e:
            raise TopologyError(str(e)) from None
        positive(memory, "memory", "give bytes, e.g. 24 * 2**30 or '24GiB'")
        efficiency = positive(self.efficiency, "efficiency", "give the share of peak a matmul reaches, e.g. 0.6")
        if efficiency > 1:
            raise TopologyError(f"{me}: efficiency is {self.efficiency!r}; it is a share of peak FLOP/s, at most 1; "
                                "give e.g. 0.6")
        for key, value in (("flops", flops), ("memory_bandwidth", bandwidth), ("memory", memory),
                           ("efficiency", efficiency)):
            object.__setattr__(self, key, value)

    def peak_flops(self, dtype: torch.dtype | str | None = None) -> float:
        key = "float32" if dtype is None else dtype_name(parse_dtype(dtype))
        return self.flops.get(key, self.flops["float32"])

    @staticmethod
    def preset(name: str) -> "DeviceSpec":
        try:
            return DEVICE_SPECS[name]
        except KeyError:
            raise MobiusError(
                f"unknown device spec {name!r}; known: {', '.join(sorted(DEVICE_SPECS))}"
            ) from None

    def __hash__(self) -> int:  # dict field: hash by the immutable view
        return hash((self.name, tuple(sorted(self.flops.items())), self.memory_bandwidth, self.memory))


_T = 1e12
_G = 1e9
DEVICE_SPECS: dict[str, DeviceSpec] = {
    # NVIDIA Ampere GA102 whitepaper (v2.1), Table "GeForce RTX 3090": 35.6 TFLOPS FP32,
    # 71 TFLOPS FP16/BF16 tensor (FP32 accumulate, dense), 936 GB/s GDDR6X, 24 GB.
    "rtx3090": DeviceSpec("rtx3090", {"float32": 35.6 * _T, "float16": 71 * _T, "bfloat16": 71 * _T}, 936 * _G, 24 * 2**30),
    # NVIDIA GeForce RTX 3090 Ti product specifications (2022): 40 TFLOPS FP32, 80 TFLOPS
    # FP16 tensor (FP32 accumulate, dense), 1008 GB/s, 24 GB.
    "rtx3090ti": DeviceSpec("rtx3090ti", {"float32": 40 * _T, "float16": 80 * _T, "bfloat16": 80 * _T}, 1008 * _G, 24 * 2**30),
    # NVIDIA Ada Lovelace architecture whitepaper (v1.0), Appendix Table "GeForce RTX 4090":
    # 82.6 TFLOPS FP32, 165.2 TFLOPS FP16/BF16 tensor (FP32 accumulate, dense), 1008 GB/s, 24 GB.
    "rtx4090": DeviceSpec("rtx4090", {"float32": 82.6 * _T, "float16": 165.2 * _T, "bfloat16": 165.2 * _T}, 1008 * _G, 24 * 2**30),
    # NVIDIA Tesla V100 datasheet (SXM2, 16 GB): 15.7 TFLOPS FP32, 125 TFLOPS FP16 tensor,
    # 900 GB/s HBM2. No bf16 units: bf16 falls back to the fp32 rate.
    "v100-16gb": DeviceSpec("v100-16gb", {"float32": 15.7 * _T, "float16": 125 * _T}, 900 * _G, 16 * 2**30),
    # NVIDIA A100 datasheet (PCIe 40 GB): 19.5 TFLOPS FP32, 312 TFLOPS FP16/BF16 tensor
    # (dense), 1555 GB/s HBM2.
    "a100-40gb-pcie": DeviceSpec("a100-40gb-pcie", {"float32": 19.5 * _T, "float16": 312 * _T, "bfloat16": 312 * _T}, 1555 * _G, 40 * 2**30),
    # NVIDIA H200 datasheet (SXM): 67 TFLOPS FP32, 989 TFLOPS FP16/BF16 tensor (dense, half
    # the quoted sparse 1979), 4.8 TB/s HBM3e, 141 GB.
    "h200": DeviceSpec("h200", {"float32": 67 * _T, "float16": 989 * _T, "bfloat16": 989 * _T}, 4800 * _G, 141 * 10**9),
    # Virtual GPUs run on the host CPU (tests, CI). A two-core desktop CPU: ~100 GFLOP/s fp32
    # with AVX2 FMA, ~20 GB/s DRAM. Only used when costs are modelled for a virtual topology.
    "cpu": DeviceSpec("cpu", {"float32": 100 * _G}, 20 * _G, 16 * 2**30, efficiency=0.5),
}
