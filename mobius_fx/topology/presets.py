"""The servers `Topology.preset` knows by name (`PRESETS`), each as the schema dict
(`mobius_fx.topology.schema.layout`) that `mobius_fx.topology.server` builds its `Topology` from,
with where its figures come from. Each preset also says its host's DRAM ("host": {"memory": ...},
`Topology.host_memory`), which the plan's host memory budget is checked against; where a source
does not give it, the comment says what is assumed and why.

    Topology.preset("mobius-testbed")     # built from PRESET_LAYOUTS["mobius-testbed"]()
"""

from __future__ import annotations

from typing import Any, Callable

from mobius_fx.topology.links import NVLINK2, PCIE3_X8, PCIE3_X16, PCIE4_X16, UPI_GOLD6130
from mobius_fx.topology.schema import layout

__all__ = ["PRESET_LAYOUTS", "PRESETS"]


def mobius_testbed() -> dict[str, Any]:
    # Feng et al., "Mobius", ASPLOS 2023, evaluation setup: 2x Xeon Gold 6130, 8 GPUs
    # ("8x3090-Ti", 24 GB); "every 4 GPUs are connected to a CPU root complex via PCIe 3.0x8
    # and a PCIe switch". The switch uplink is PCIe 3.0 x16 (~13 GB/s); GPU links x8
    # (~6.5 GB/s); UPI ~20 GB/s per direction. GeForce cards have no PCIe P2P.
    # DRAM: not among the figures we have of the paper; assumed 384 GiB, one 32 GiB DDR4 DIMM in
    # each of the 12 channels of two Gold 6130s: what full fine-tuning of the paper's largest model
    # (15B, fp32 masters + AdamW, ~300 GB of host state) needs, and a usual fill of such a server.
    return layout("mobius-testbed", [[[0, 1, 2, 3]], [[4, 5, 6, 7]]], spec="rtx3090ti",
                  memory="24GiB", gpu_link=PCIE3_X8, uplink=PCIE3_X16, upi=UPI_GOLD6130,
                  p2p=False, host_memory="384GiB")


def rtx4090x8() -> dict[str, Any]:
    # RoundPipe (2026) evaluation server: 8x RTX 4090 24 GB, PCIe 4.0, 800 GB DDR4, two sockets
    # of four GPUs. Its switch layout is not published; we assume each GPU has its own x16
    # CPU link (~25 GB/s effective of 31.5 raw). The CPU is not named either; we assume three
    # UPI links at 11.2 GT/s (67 GB/s raw per direction) and ~60% of it, 40 GB/s, for DMA.
    # DRAM: the paper's 800 GB, taken as 800 * 10**9 bytes.
    return layout("rtx4090x8", [[[0], [1], [2], [3]], [[4], [5], [6], [7]]], spec="rtx4090",
                  memory="24GiB", gpu_link=PCIE4_X16, uplink=None, upi=40e9, p2p=False, host_memory="800GB")


def v100x4_nvlink() -> dict[str, Any]:
    # AWS EC2 p3.8xlarge (the Mobius paper's second setup): 4x V100-SXM2 16 GB, one socket,
    # each GPU on PCIe 3.0 x16 (~13 GB/s) to the host, NVLink 2.0 hybrid cube mesh, as
    # `nvidia-smi topo -m` shows on p3 instances: 0-1 NV1, 0-2 NV1, 0-3 NV2, 1-2 NV2,
    # 1-3 NV1, 2-3 NV2 (six links per GPU, ~24 GB/s each per direction). P2P is on.
    # DRAM: 244 GiB, the instance's memory in AWS's instance type table.
    nv = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (1, 2): 2, (1, 3): 1, (2, 3): 2}
    return layout("v100x4-nvlink", [[[0], [1], [2], [3]]], spec="v100-16gb", memory="16GiB",
                  gpu_link=PCIE3_X16, uplink=None, upi=UPI_GOLD6130, p2p=True,
                  nvlinks={k: c * NVLINK2 for k, c in nv.items()}, host_memory="244GiB")


def single_3090() -> dict[str, Any]:
    # One RTX 3090 24 GB in a desktop, on its native PCIe 4.0 x16 link (~25 GB/s effective).
    # DRAM: assumed 128 GiB, four 32 GiB DIMMs, the most a usual desktop board takes in DDR4.
    return layout("single-3090", [[[0]]], spec="rtx3090", memory="24GiB", gpu_link=PCIE4_X16,
                  uplink=None, upi=UPI_GOLD6130, p2p=False, host_memory="128GiB")


PRESET_LAYOUTS: dict[str, Callable[[], dict[str, Any]]] = {  # preset name -> its schema dict
    "mobius-testbed": mobius_testbed, "rtx4090x8": rtx4090x8,
    "v100x4-nvlink": v100x4_nvlink, "single-3090": single_3090,
}
PRESETS = tuple(PRESET_LAYOUTS)
