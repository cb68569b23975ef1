"""The topology JSON's optional "host" section (`HostFigures`): the host's measured figures
round-trip through to_json / from_json, and a malformed one is refused naming the key."""

import pytest

from mobius_fx import Topology
from mobius_fx.errors import TopologyError
from mobius_fx.topology.schema import HostFigures

BASE = {"name": "t", "nodes": [{"name": "cpu0", "kind": "root_complex"},
                               {"name": "gpu0", "kind": "gpu", "memory": "8GiB", "spec": "h200"}],
        "links": [{"a": "cpu0", "b": "gpu0", "bandwidth_gbps": [35.4, 51.6]}]}
HOST = {"optimizer": "adamw", "implementation": "fused", "optimizer_bytes_per_s": 116_012_345_678.9,
        "host_copy_bytes_per_s": 4.25e10, "cores": 16}


def test_the_host_section_round_trips_and_is_part_of_equality(tmp_path):
    topo = Topology.from_dict({**BASE, "host": HOST})
    assert topo.host == HostFigures(**HOST)
    path = tmp_path / "t.json"
    path.write_text(topo.to_json())
    back = Topology.from_json(path)
    assert back == topo and back.host.to_dict() == HOST
    bare = Topology.from_dict(BASE)
    assert bare.host is None and "host" not in bare.to_dict() and bare != topo
    assert bare.with_host(HostFigures(**HOST)) == topo and topo.with_host(None) == bare
    partial = Topology.from_json(bare.with_host(HostFigures(cores=2)).to_json())
    assert partial.host == HostFigures(cores=2) and partial.host.to_dict() == {"cores": 2}


@pytest.mark.parametrize("host, says", [
    ({"optimizer_bytes_per_s": 1e11}, "without 'optimizer'"),
    ({**HOST, "optimizer": "lion"}, "optimizer is 'lion'"),
    ({**HOST, "optimizer_bytes_per_s": 0}, "optimizer_bytes_per_s is 0"),
    ({**HOST, "host_copy_bytes_per_s": "fast"}, "host_copy_bytes_per_s is 'fast'"),
    ({**HOST, "cores": 2.5}, "cores is 2.5"),
    ({**HOST, "cores": True}, "cores is True"),
    ({**HOST, "implementation": ""}, "implementation is ''"),
    ({**HOST, "threads": 4}, "unknown key(s) 'threads'"),
    ([1, 2], "expected an object"),
])
def test_a_malformed_host_section_is_refused_naming_the_key(host, says):
    with pytest.raises(TopologyError, match="host") as e:
        Topology.from_dict({**BASE, "host": host}, source="server.json")
    assert says in str(e.value) and str(e.value).startswith("server.json")
    if isinstance(host, dict) and "threads" not in host:  # the dataclass keeps the JSON's rules
        with pytest.raises(TopologyError, match=says.split(" is ")[0]):
            HostFigures(**host)
