"""Topology: presets, routes, JSON, nvidia-smi parsing, detection and every error path."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import networkx as nx
import pytest

from mobius_fx import TopologyError
from mobius_fx.topology.device_specs import DeviceSpec
from mobius_fx.topology.presets import PRESETS
from mobius_fx.topology.server import Topology

DATA = Path(__file__).parent.parent / "data"
GB = 1e9


def smi(name: str) -> str:
    return (DATA / f"nvidia_smi_{name}.txt").read_text()


def server(**over) -> dict:
    """A small hand-written server: cpu0 > sw0 > gpu0, gpu1 (asymmetric gpu1 link)."""
    d = {
        "name": "two", "p2p": False,
        "nodes": [{"name": "cpu0", "kind": "root_complex"}, {"name": "sw0", "kind": "switch"},
                  {"name": "gpu0", "kind": "gpu", "memory": "24GiB", "spec": "rtx3090"},
                  {"name": "gpu1", "kind": "gpu", "memory": "24GiB", "spec": "rtx3090"}],
        "links": [{"a": "cpu0", "b": "sw0", "bandwidth_gbps": 13.0},
                  {"a": "sw0", "b": "gpu0", "bandwidth_gbps": 6.5},
                  {"a": "sw0", "b": "gpu1", "bandwidth_gbps": [6.5, 6.0]}],
    }
    d.update(over)
    return d


def two_sockets(p2p: bool) -> Topology:
    """cpu0 > sw0 > gpu0, gpu1 and cpu1 > gpu2, joined by UPI."""
    d = server(p2p=p2p)
    d["nodes"] += [{"name": "cpu1", "kind": "root_complex"},
                   {"name": "gpu2", "kind": "gpu", "memory": "24GiB", "spec": "rtx3090"}]
    d["links"] += [{"a": "cpu1", "b": "gpu2", "bandwidth_gbps": 25}, {"a": "cpu0", "b": "cpu1", "bandwidth_gbps": 20}]
    return Topology.from_json(json.dumps(d))


def error(fn, *args, **kw) -> str:
    with pytest.raises(TopologyError) as e:
        fn(*args, **kw)
    return str(e.value)


# --------------------------------------------------------------------- presets
def test_presets_are_the_four_documented_servers():
    assert set(PRESETS) == {"mobius-testbed", "rtx4090x8", "v100x4-nvlink", "single-3090"}
    assert Topology.PRESETS == PRESETS


def test_mobius_testbed_has_two_sockets_of_four_3090ti_behind_a_switch():
    topo = Topology.preset("mobius-testbed")
    assert [g.name for g in topo.gpus] == [f"gpu{i}" for i in range(8)]
    assert [g.root_complex for g in topo.gpus] == ["cpu0"] * 4 + ["cpu1"] * 4
    assert {g.memory for g in topo.gpus} == {24 * 2**30}
    assert {g.spec.name for g in topo.gpus} == {"rtx3090ti"}
    assert topo.gpus_under("sw1") == ("gpu4", "gpu5", "gpu6", "gpu7")
    assert topo.p2p is False


def test_mobius_testbed_bandwidths_are_x8_gpu_links_under_an_x16_uplink():
    topo = Topology.preset("mobius-testbed")
    assert topo.link_bandwidth("sw0", "gpu3") == 6.5 * GB
    assert topo.link_bandwidth("cpu0", "sw0") == 13 * GB
    assert topo.link_bandwidth("cpu0", "cpu1") == 20 * GB
    assert topo.bandwidth("host", "gpu3") == 6.5 * GB


def test_rtx4090x8_puts_four_gpus_on_each_socket_over_pcie4_x16():
    topo = Topology.preset("rtx4090x8")
    assert [g.root_complex for g in topo.gpus] == ["cpu0"] * 4 + ["cpu1"] * 4
    assert topo.bandwidth("host", "gpu6") == 25 * GB
    assert topo.p2p is False and topo.gpus[0].spec.name == "rtx4090"


def test_v100_preset_routes_gpu_to_gpu_over_nvlink():
    topo = Topology.preset("v100x4-nvlink")
    assert topo.p2p is True
    assert topo.route("gpu0", "gpu3") == ("gpu0", "gpu3")
    assert topo.bandwidth("gpu0", "gpu3") == 48 * GB  # NV2
    assert topo.bandwidth("gpu0", "gpu1") == 24 * GB  # NV1
    assert topo.gpu("gpu2").memory == 16 * 2**30


def test_single_3090_has_one_gpu():
    topo = Topology.preset("single-3090")
    assert [(g.name, g.root_complex) for g in topo.gpus] == [("gpu0", "cpu0")]


def test_unknown_preset_lists_the_valid_ones():
    msg = error(Topology.preset, "dgx-h100")
    assert "'dgx-h100'" in msg and all(p in msg for p in PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_survives_a_json_round_trip(name):
    topo = Topology.preset(name)
    back = Topology.from_json(topo.to_json())
    assert back == topo and hash(back) == hash(topo)


# ---------------------------------------------------------------------- routes
def test_host_means_the_gpus_own_root_complex():
    topo = Topology.preset("mobius-testbed")
    assert topo.route("host", "gpu3") == ("cpu0", "sw0", "gpu3")
    assert topo.route("gpu5", "host") == ("gpu5", "sw1", "cpu1")


def test_a_root_complex_can_be_named_explicitly_as_the_host_end():
    topo = Topology.preset("mobius-testbed")
    assert topo.route("cpu1", "gpu0") == ("cpu1", "cpu0", "sw0", "gpu0")


def test_without_p2p_gpus_under_one_switch_copy_through_host_memory():
    topo = Topology.preset("mobius-testbed")
    assert topo.route("gpu0", "gpu1") == ("gpu0", "sw0", "cpu0", "sw0", "gpu1")


def test_without_p2p_gpus_on_different_sockets_copy_across_upi():
    topo = Topology.preset("mobius-testbed")
    assert topo.route("gpu1", "gpu6") == ("gpu1", "sw0", "cpu0", "cpu1", "sw1", "gpu6")


def test_with_p2p_gpus_under_one_switch_copy_through_the_switch():
    assert two_sockets(p2p=True).route("gpu0", "gpu1") == ("gpu0", "sw0", "gpu1")


def test_with_p2p_gpus_on_different_sockets_cross_the_inter_socket_link():
    assert two_sockets(p2p=True).route("gpu1", "gpu2") == ("gpu1", "sw0", "cpu0", "cpu1", "gpu2")


def test_bandwidth_is_the_bottleneck_link_of_the_route():
    topo = two_sockets(p2p=False)
    assert topo.bandwidth("gpu2", "gpu1") == 6.5 * GB  # 25 up, 20 upi, 13 down, 6.5 into gpu1
    assert topo.bandwidth("gpu1", "gpu2") == 6.0 * GB  # gpu1's uplink is the slower direction


def test_each_direction_of_a_link_has_its_own_bandwidth():
    topo = two_sockets(p2p=False)
    assert topo.link_bandwidth("sw0", "gpu1") == 6.5 * GB
    assert topo.link_bandwidth("gpu1", "sw0") == 6.0 * GB


def test_a_route_to_itself_is_one_node_with_unbounded_bandwidth():
    topo = Topology.preset("single-3090")
    assert topo.route("gpu0", "gpu0") == ("gpu0",)
    assert topo.bandwidth("host", "cpu0") == math.inf


def test_route_to_an_unknown_node_names_it():
    msg = error(Topology.preset("single-3090").route, "host", "gpu7")
    assert "'gpu7'" in msg and "gpu0" in msg


def test_route_from_host_to_host_is_refused():
    assert "'host'" in error(Topology.preset("single-3090").route, "host", "host")


def test_link_bandwidth_of_a_missing_link_names_both_ends():
    msg = error(Topology.preset("mobius-testbed").link_bandwidth, "gpu0", "gpu1")
    assert "gpu0 -> gpu1" in msg


def test_links_lists_both_directions_of_every_link():
    links = Topology.preset("mobius-testbed").links()
    assert ("cpu0", "sw0", 13 * GB) in links and ("sw0", "cpu0", 13 * GB) in links
    assert len(links) == 2 * (8 + 2 + 1)


def test_gpu_lookup_by_name_or_index_and_unknown_names_listed():
    topo = Topology.preset("mobius-testbed")
    assert topo.gpu("gpu5") is topo.gpus[5] and topo.gpu(5) is topo.gpus[5]
    msg = error(topo.gpu, "gpu9")
    assert "'gpu9'" in msg and "gpu7" in msg


def test_graph_edges_carry_bandwidth_kind_and_name():
    topo = Topology.preset("mobius-testbed")
    assert topo.graph.edges["cpu0", "cpu1"] == {"bandwidth": 20 * GB, "kind": "upi", "name": "cpu0-cpu1"}
    assert topo.graph.nodes["sw0"]["kind"] == "switch"


# --------------------------------------------------------------------- virtual
def test_virtual_spreads_gpus_in_contiguous_blocks_over_root_complexes():
    topo = Topology.virtual(gpus=5, memory="256MiB", root_complexes=2)
    assert [g.root_complex for g in topo.gpus] == ["cpu0", "cpu0", "cpu0", "cpu1", "cpu1"]
    assert topo.gpus_under("sw1") == ("gpu3", "gpu4")


def test_virtual_gpus_have_the_memory_budget_and_the_cpu_spec():
    topo = Topology.virtual(gpus=2, memory="256MiB")
    assert [g.memory for g in topo.gpus] == [256 * 2**20] * 2
    assert topo.gpus[0].spec == DeviceSpec.preset("cpu")
    assert topo.virtual is True and topo.root_complexes == ("cpu0",)


def test_virtual_memory_may_be_given_in_bytes():
    assert Topology.virtual(gpus=1, memory=1000).gpus[0].memory == 1000


def test_virtual_links_are_pcie_like_under_one_switch_per_root_complex():
    topo = Topology.virtual(gpus=2, bandwidth=16e9)
    assert topo.route("host", "gpu1") == ("cpu0", "sw0", "gpu1")
    assert topo.bandwidth("host", "gpu1") == 16e9


def test_virtual_rejects_more_root_complexes_than_gpus():
    assert "root_complexes=3" in error(Topology.virtual, gpus=2, root_complexes=3)


def test_virtual_rejects_zero_gpus():
    assert "gpus=0" in error(Topology.virtual, gpus=0)


def test_virtual_rejects_zero_memory_naming_a_gpu():
    assert "gpu0" in error(Topology.virtual, gpus=2, memory=0)


# ------------------------------------------------------------------------ JSON
def test_hand_written_json_reads_memory_units_and_asymmetric_bandwidth():
    topo = Topology.from_json(json.dumps(server()))
    assert topo.gpu("gpu1").memory == 24 * 2**30
    assert topo.link_bandwidth("sw0", "gpu1") == 6.5e9 and topo.link_bandwidth("gpu1", "sw0") == 6.0e9
    assert topo.graph.edges["sw0", "gpu1"]["kind"] == "pcie"


def test_json_link_kind_defaults_by_the_nodes_it_joins():
    topo = two_sockets(p2p=False)
    assert topo.graph.edges["cpu0", "cpu1"]["kind"] == "upi"
    assert topo.graph.edges["sw0", "gpu0"]["kind"] == "pcie"


def test_json_gpu_memory_defaults_to_the_spec():
    d = server()
    del d["nodes"][2]["memory"]
    assert Topology.from_json(json.dumps(d)).gpu("gpu0").memory == DeviceSpec.preset("rtx3090").memory


def test_a_custom_device_spec_survives_the_round_trip():
    d = server()
    d["nodes"][2]["spec"] = {"name": "mygpu", "flops": {"float32": 1e13}, "memory_bandwidth": 5e11,
                             "memory": 2**33}
    topo = Topology.from_json(json.dumps(d))
    assert topo.gpu("gpu0").spec.name == "mygpu"
    assert Topology.from_json(topo.to_json()) == topo


def test_from_json_reads_a_file(tmp_path):
    path = tmp_path / "server.json"
    path.write_text(json.dumps(server()))
    assert Topology.from_json(path) == Topology.from_json(str(path)) == Topology.from_json(json.dumps(server()))


def test_to_json_writes_the_documented_schema():
    d = json.loads(Topology.preset("mobius-testbed").to_json())
    assert set(d) == {"name", "p2p", "virtual", "nodes", "links", "host"}
    assert d["host"] == {"memory": 384 * 2**30}  # the preset's DRAM (presets.py says why)
    assert {"a": "cpu0", "b": "sw0", "kind": "pcie", "bandwidth_gbps": 13.0} in d["links"]


def test_topologies_differing_in_one_bandwidth_are_not_equal():
    d = server()
    d["links"][0]["bandwidth_gbps"] = 12.0
    assert Topology.from_json(json.dumps(d)) != Topology.from_json(json.dumps(server()))


def test_topologies_differing_in_one_gpu_spec_are_not_equal():
    d = server()
    d["nodes"][3]["spec"] = "rtx4090"
    assert Topology.from_json(json.dumps(d)) != Topology.from_json(json.dumps(server()))


def test_a_topology_can_be_built_from_a_networkx_graph():
    g = nx.DiGraph()
    g.add_node("cpu0", kind="root_complex")
    g.add_node("gpu0", kind="gpu", memory=2**30, spec=DeviceSpec.preset("cpu"))
    g.add_edge("cpu0", "gpu0", bandwidth=1e9, kind="pcie")
    g.add_edge("gpu0", "cpu0", bandwidth=1e9, kind="pcie")
    topo = Topology(g, name="tiny")
    assert topo.gpus[0].index == 0 and topo.graph.edges["gpu0", "cpu0"]["name"] == "cpu0-gpu0"
    assert "index" not in g.nodes["gpu0"]  # the caller's graph is left alone


# -------------------------------------------------------------- JSON: errors
def test_malformed_json_says_line_and_column():
    msg = error(Topology.from_json, '{"name": "x",\n "nodes": [}')
    assert "line 2" in msg and "column" in msg


def test_missing_file_names_the_path(tmp_path):
    assert "nope.json" in error(Topology.from_json, tmp_path / "nope.json")


def test_negative_bandwidth_names_the_link():
    d = server()
    d["links"][1]["bandwidth_gbps"] = -1
    msg = error(Topology.from_json, json.dumps(d))
    assert "sw0-gpu0" in msg and "-1" in msg


def test_zero_bandwidth_in_one_direction_names_the_link():
    d = server()
    d["links"][2]["bandwidth_gbps"] = [6.5, 0]
    assert "sw0-gpu1" in error(Topology.from_json, json.dumps(d))


def test_zero_bandwidth_in_a_networkx_graph_names_the_link():
    g = Topology.preset("single-3090").graph.copy()
    g.edges["gpu0", "cpu0"]["bandwidth"] = 0.0
    assert "gpu0 -> cpu0" in error(Topology, g)


def test_unknown_node_names_in_a_link_are_named():
    d = server()
    d["links"].append({"a": "sw9", "b": "gpu7", "bandwidth_gbps": 1})
    msg = error(Topology.from_json, json.dumps(d))
    assert "'sw9'" in msg and "'gpu7'" in msg and "links[3]" in msg


def test_duplicate_gpu_name_is_named():
    d = server()
    d["nodes"].append({"name": "gpu1", "kind": "gpu", "memory": "8GiB", "spec": "rtx3090"})
    msg = error(Topology.from_json, json.dumps(d))
    assert "duplicate" in msg and "'gpu1'" in msg and "nodes[4]" in msg


def test_zero_gpu_memory_names_the_gpu():
    d = server()
    d["nodes"][3]["memory"] = "0GiB"
    msg = error(Topology.from_json, json.dumps(d))
    assert "gpu1" in msg and "memory" in msg


def test_a_gpu_with_no_path_to_host_memory_is_named():
    d = server()
    d["nodes"].append({"name": "gpu2", "kind": "gpu", "memory": "8GiB", "spec": "rtx3090"})
    d["links"].append({"a": "gpu1", "b": "gpu2", "kind": "nvlink", "bandwidth_gbps": 50})
    msg = error(Topology.from_json, json.dumps(d))
    assert "gpu2" in msg and "no path to DRAM" in msg


def test_a_pcie_cycle_names_the_nodes_on_it():
    d = server()
    d["nodes"].append({"name": "sw1", "kind": "switch"})
    d["links"] += [{"a": "cpu0", "b": "sw1", "bandwidth_gbps": 13}, {"a": "sw1", "b": "sw0", "bandwidth_gbps": 13}]
    msg = error(Topology.from_json, json.dumps(d))
    assert "cycle" in msg and all(n in msg for n in ("cpu0", "sw0", "sw1"))


def test_root_complexes_without_an_inter_socket_link_are_named():
    d = server()
    d["nodes"] += [{"name": "cpu1", "kind": "root_complex"},
                   {"name": "gpu2", "kind": "gpu", "memory": "8GiB", "spec": "rtx3090"}]
    d["links"].append({"a": "cpu1", "b": "gpu2", "bandwidth_gbps": 13})
    msg = error(Topology.from_json, json.dumps(d))
    assert "cpu1" in msg and "upi" in msg


def test_root_complexes_joined_over_pcie_are_named():
    d = server()
    d["nodes"].append({"name": "cpu1", "kind": "root_complex"})
    d["links"].append({"a": "cpu1", "b": "sw0", "bandwidth_gbps": 13})
    msg = error(Topology.from_json, json.dumps(d))
    assert "cpu0" in msg and "cpu1" in msg and "sw0" in msg


def test_a_gpu_between_two_pcie_nodes_is_named():
    d = server()
    d["links"] = [{"a": "cpu0", "b": "gpu0", "bandwidth_gbps": 13}, {"a": "gpu0", "b": "sw0", "bandwidth_gbps": 13},
                  {"a": "sw0", "b": "gpu1", "bandwidth_gbps": 13}]
    assert "GPU gpu0 has 2 PCIe links" in error(Topology.from_json, json.dumps(d))


def test_nvlink_between_a_switch_and_a_gpu_is_refused():
    d = server()
    d["links"][1]["kind"] = "nvlink"
    msg = error(Topology.from_json, json.dumps(d))
    assert "sw0-gpu0" in msg and "nvlink" in msg


def test_unknown_json_keys_are_named():
    d = server()
    d["links"][0]["bandwith_gbps"] = 13
    msg = error(Topology.from_json, json.dumps(d))
    assert "'bandwith_gbps'" in msg and "links[0]" in msg


def test_unknown_device_spec_names_the_gpu():
    d = server()
    d["nodes"][2]["spec"] = "rtx9090"
    msg = error(Topology.from_json, json.dumps(d))
    assert "gpu0" in msg and "'rtx9090'" in msg


def test_a_topology_without_gpus_is_refused():
    d = server(nodes=[{"name": "cpu0", "kind": "root_complex"}], links=[])
    assert "no GPUs" in error(Topology.from_json, json.dumps(d))


def test_duplicate_gpu_index_names_the_gpu():
    d = server()
    d["nodes"][2]["index"] = d["nodes"][3]["index"] = 1
    assert "gpu1 has index 1" in error(Topology.from_json, json.dumps(d))


def test_two_links_between_the_same_pair_are_refused():
    d = server()
    d["links"].append({"a": "gpu0", "b": "sw0", "bandwidth_gbps": 6.5})
    assert "gpu0 and sw0 are already linked" in error(Topology.from_json, json.dumps(d))


# ------------------------------------------------------------------ nvidia-smi
def test_nvidia_smi_pix_pairs_become_switches_on_two_sockets():
    topo = Topology.from_nvidia_smi(smi("8gpu_2socket_pix"), spec="rtx3090", memory="24GiB")
    assert [g.root_complex for g in topo.gpus] == ["cpu0"] * 4 + ["cpu1"] * 4
    assert [topo.gpus_under(s) for s in ("sw0", "sw1", "sw2", "sw3")] == [
        ("gpu0", "gpu1"), ("gpu2", "gpu3"), ("gpu4", "gpu5"), ("gpu6", "gpu7")]
    assert topo.graph.edges["cpu0", "cpu1"]["kind"] == "upi"
    assert not any(n.startswith("nic") for n in topo.graph)


def test_nvidia_smi_pxb_group_holds_a_switch_per_pix_pair():
    topo = Topology.from_nvidia_smi(smi("8gpu_pxb_nested"), spec="rtx3090ti", memory="24GiB")
    assert topo.route("host", "gpu3") == ("cpu0", "sw0", "sw2", "gpu3")
    assert topo.gpus_under("sw0") == ("gpu0", "gpu1", "gpu2", "gpu3")
    assert topo.gpus_under("sw4") == ("gpu4", "gpu5")


def test_nvidia_smi_nv_entries_become_nvlinks_of_that_many_links():
    topo = Topology.from_nvidia_smi(smi("v100x4_nvlink"), spec="v100-16gb", p2p=True, nvlink=24e9)
    assert topo.root_complexes == ("cpu0",)
    assert topo.route("gpu1", "gpu2") == ("gpu1", "gpu2")
    assert topo.bandwidth("gpu1", "gpu2") == 48e9 and topo.bandwidth("gpu1", "gpu3") == 24e9
    assert topo.gpus[0].memory == DeviceSpec.preset("v100-16gb").memory


def test_nvidia_smi_phb_pair_hangs_both_gpus_on_one_root_complex():
    topo = Topology.from_nvidia_smi(smi("2gpu_phb"), spec="rtx3090", memory="24GiB", pcie=25e9)
    assert topo.route("gpu0", "gpu1") == ("gpu0", "cpu0", "gpu1")
    assert topo.bandwidth("host", "gpu0") == 25e9


def test_nvidia_smi_sockets_of_nvlinked_gpus_come_from_sys_and_affinity():
    topo = Topology.from_nvidia_smi(smi("v100x8_dgx1"), spec="v100-16gb")
    assert [g.root_complex for g in topo.gpus] == ["cpu0"] * 4 + ["cpu1"] * 4
    assert topo.route("gpu0", "gpu4") == ("gpu0", "gpu4")  # NV2 across the sockets


def test_nvidia_smi_nvlinked_gpus_with_different_numa_nodes_sit_on_different_sockets():
    text = ("\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n"
            "GPU0\t X \tNV4\t0-15\t0\n"
            "GPU1\tNV4\t X \t16-31\t1\n")
    topo = Topology.from_nvidia_smi(text, spec="rtx3090")
    assert [g.root_complex for g in topo.gpus] == ["cpu0", "cpu1"]


def test_nvidia_smi_memory_may_differ_per_gpu():
    topo = Topology.from_nvidia_smi(smi("2gpu_phb"), spec="rtx3090", memory=["24GiB", "12GiB"])
    assert [g.memory for g in topo.gpus] == [24 * 2**30, 12 * 2**30]


def test_nvidia_smi_text_without_a_matrix_is_refused():
    assert "nvidia-smi topo -m" in error(Topology.from_nvidia_smi, "No devices were found", spec="rtx3090")


def test_nvidia_smi_unknown_entry_names_row_and_column():
    text = smi("2gpu_phb").replace("PHB\t X", "FOO\t X")
    msg = error(Topology.from_nvidia_smi, text, spec="rtx3090")
    assert "'FOO'" in msg and "GPU1" in msg and "GPU0" in msg


def test_nvidia_smi_asymmetric_matrix_names_the_pair():
    text = smi("2gpu_phb").replace("PHB\t X", "SYS\t X")
    msg = error(Topology.from_nvidia_smi, text, spec="rtx3090")
    assert "GPU0/GPU1" in msg


def test_nvidia_smi_memory_list_of_the_wrong_length_is_refused():
    assert "2 GPUs" in error(Topology.from_nvidia_smi, smi("2gpu_phb"), spec="rtx3090", memory=["24GiB"])


# ------------------------------------------------------------------- detection
def test_detect_without_gpus_says_what_it_tried_and_what_to_do(monkeypatch):
    import mobius_fx.topology.detect as t
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as on a machine without it
    monkeypatch.setattr(t.shutil, "which", lambda exe: None)
    msg = error(Topology.detect)
    assert "pynvml" in msg and "nvidia-smi" in msg
    assert "Topology.preset" in msg and "from_json" in msg and "mobius-testbed" in msg


def test_detect_falls_back_to_nvidia_smi(monkeypatch):
    import mobius_fx.topology.detect as t
    outputs = {
        "--query-gpu=index,name,memory.total,pcie.link.gen.max,pcie.link.width.max":
            "0, NVIDIA GeForce RTX 3090, 24576, 4, 16\n1, NVIDIA GeForce RTX 3090, 24576, 3, 8\n",
        "topo": smi("2gpu_phb"),
    }
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(t, "_nvidia_smi", lambda *args: "\tGPU0\tGPU1\nGPU0\tX\tCNS\nGPU1\tCNS\tX\n"
                        if args[:2] == ("topo", "-p2p") else outputs[args[0]])
    topo = Topology.detect()
    assert [g.spec.name for g in topo.gpus] == ["rtx3090", "rtx3090"]
    assert topo.gpus[1].memory == 24 * 2**30 and topo.p2p is False
    assert topo.link_bandwidth("cpu0", "gpu0") == round(16 * 1.969e9 * 0.82)
    assert topo.link_bandwidth("cpu0", "gpu1") == round(8 * 0.985e9 * 0.82)


# ------------------------------------------------------------------------ tree
def test_tree_shows_sockets_switches_gpus_bandwidths_and_memory():
    text = Topology.preset("mobius-testbed").tree()
    lines = text.splitlines()
    assert lines.index("cpu0 (root complex)") < lines.index("└── sw0 (switch)  13.0 GB/s")
    assert "    ├── gpu0  6.5 GB/s  24.00 GiB  rtx3090ti" in lines
    assert "  cpu0 <-> cpu1  upi  20.0 GB/s" in lines


def test_tree_shows_both_directions_of_an_asymmetric_link():
    assert "6.5 GB/s down / 6.0 GB/s up" in Topology.from_json(json.dumps(server())).tree()
