"""Effective bandwidths of the links a server is built from: PCIe, UPI and NVLink.

Why a module of its own: the topology model (`mobius_fx.topology.server`, its presets and defaults)
and driver discovery (`mobius_fx.topology.detect`, which turns a PCIe generation and width into
bytes/s) need the same numbers; here both import them, and neither imports the other's insides.

All values are achievable bytes/s per direction, not the raw signalling rate:

>>> pcie_bandwidth(3, 8) / 1e9                 # PCIe 3.0 x8
6.4616
"""

from __future__ import annotations

__all__ = ["GB", "PCIE_EFFICIENCY", "PCIE_LANE_RAW", "pcie_bandwidth", "PCIE3_X8", "PCIE3_X16", "PCIE4_X16",
           "UPI_GOLD6130", "NVLINK2", "SWITCH_DUPLEX"]

GB = 1e9  # JSON topologies give bandwidths in GB/s

# PCIe raw rate per lane per direction by generation, bytes/s: 3.0 = 8 GT/s x 128b/130b =
# 0.985 GB/s, 4.0 = 1.969 GB/s. Pinned host<->device copies (CUDA bandwidthTest) reach ~82% of
# raw once TLP headers and flow control are paid.
PCIE_LANE_RAW = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
PCIE_EFFICIENCY = 0.82

# The rounded figures the presets use: PCIe 3.0 x8 = 7.88 GB/s raw -> ~6.5 GB/s;
# 3.0 x16 = 15.75 -> ~13 GB/s; 4.0 x16 = 31.5 -> ~25.
PCIE3_X8 = 6.5e9
PCIE3_X16 = 13e9
PCIE4_X16 = 25e9
# Xeon Gold 6130: 2 UPI links at 10.4 GT/s = 2 x 20.8 GB/s raw per direction; DMA to the
# remote socket's DRAM measures about half of that, so ~20 GB/s per direction.
UPI_GOLD6130 = 20e9
# NVLink 2.0 (V100): 25 GB/s raw per link per direction; p2pBandwidthLatencyTest measures
# ~24 GB/s over one link (NV1) and ~48 GB/s over a bonded pair (NV2).
NVLINK2 = 24e9
# Through PCIe switches the two directions of a link interfere: with host->device and
# device->host copies running at once, each direction keeps about 0.72 of its one-way rate
# (the pair carries ~1.44x one direction, not 2x). Measured with nvbandwidth on A100 servers
# whose GPUs sit behind PCIe switches: one-way ~25-26 GB/s each; both at once, D2H ~24-25 and
# H2D ~11-13 GB/s, together ~36-37 GB/s of 2 x 25.5 (github.com/NVIDIA/nvbandwidth issues #11,
# 2023, and #53, 2025, "PXB" topology). The simulator applies it (`Topology.link_duplex`) to
# PCIe links with a switch at one end, as a budget both directions share max-min fairly (we do
# not model the H2D/D2H asymmetry those runs show); a direct root-port link stays full duplex.
SWITCH_DUPLEX = 0.72


def pcie_bandwidth(gen: int, width: int) -> float:
    """Effective bytes/s per direction of a PCIe link of generation `gen` and `width` lanes
    (an unknown generation counts as 3.0)."""
    return PCIE_LANE_RAW.get(int(gen), PCIE_LANE_RAW[3]) * int(width) * PCIE_EFFICIENCY
