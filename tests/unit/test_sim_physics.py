"""The simulator's physics beyond max-min sharing, each on a case small enough to time by hand:
transfer priorities on a shared link, interference between the two directions of a PCIe
switch link, host memory on one socket (NUMA), and ZeRO-3 as DeepSpeed runs it (host-routed
collectives without peer-to-peer, DeepSpeed's own CPU Adam)."""

import pytest

from mobius_fx.planning.costs import LayerCost
from mobius_fx.errors import MobiusError
from mobius_fx.planning.plans import build_plan
from mobius_fx.planning.host_step import HOST_COPY_BANDWIDTH, HOST_COPY_KINDS, host_copy_bytes
from mobius_fx.sim.simulator import simulate
from mobius_fx.planning.host_step import CPU_ADAM_BANDWIDTH
from mobius_fx.topology.server import Topology
from mobius_fx.topology.schema import HostFigures

GB = 1e9
W = 100e6  # bytes of one layer's weights (fp32, as traced)
NO_HOST_COPIES = dict.fromkeys(HOST_COPY_KINDS, 0)  # the network's physics alone (the pinning delays uploads)


def layers(n):
    return [LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, 0.01, 0.03, int(W), int(W), int(1e6), int(1e6))
            for i in range(n)]


def plan_on(topo, cuts, n_layers, m=1):
    return build_plan(layers(n_layers), cuts, order=[g.name for g in topo.gpus], topology=topo, microbatches=m,
                      step_time=0.0, input_bytes=1000, memory_fraction=0.99)


def first(result, kind, **where):
    return next(e for e in result.events if e.kind == kind and all(getattr(e, k) == v for k, v in where.items()))


def switch_box(*, gpus=2, uplink=10.0, gpu_link=10.0, gpu_duplex=None, uplink_duplex=None, p2p=False):
    """One socket, one switch, `gpus` GPUs (GB/s per direction; duplex None: the default)."""
    nodes = [{"name": "cpu0", "kind": "root_complex"}, {"name": "sw0", "kind": "switch"}]
    nodes += [{"name": f"gpu{i}", "kind": "gpu", "memory": "24GiB", "spec": "rtx3090"} for i in range(gpus)]
    up = {"a": "cpu0", "b": "sw0", "bandwidth_gbps": uplink}
    links = [up if uplink_duplex is None else {**up, "duplex": uplink_duplex}]
    for i in range(gpus):
        link = {"a": "sw0", "b": f"gpu{i}", "bandwidth_gbps": gpu_link}
        links.append(link if gpu_duplex is None else {**link, "duplex": gpu_duplex})
    return Topology.from_dict({"name": "box", "p2p": p2p, "nodes": nodes, "links": links})


# ----------------------------------------------------------------------------- priorities
def test_the_stage_needed_first_gets_the_shared_uplink_first():
    # Stages 0 and 1 (gpu0, gpu1) upload at t=0 through one 10 GB/s uplink. Stage 0 runs first,
    # so it takes the uplink (with stage 0's 1000-byte model input, as urgent) before stage 1:
    # it ends at (W + 1000) / B, stage 1 at (2W + 1000) / B. Shared fairly, stage 0 would end
    # at about 2W / B too.
    topo = switch_box()
    r = simulate(plan_on(topo, [0, 1, 2, 3], 4), host_copies=NO_HOST_COPIES)
    s0 = first(r, "prefetch", stage=0, phase="forward")
    s1 = first(r, "prefetch", stage=1, phase="forward")
    assert (s0.start, s1.start) == (0.0, 0.0)
    assert s0.end == pytest.approx((W + 1000) / (10 * GB), rel=1e-9)
    assert s1.end == pytest.approx((2 * W + 1000) / (10 * GB), rel=1e-9)


# ------------------------------------------------------------------ direction interference
@pytest.mark.parametrize("duplex, upload_end", [(1.0, 1.0), (0.5, 1.5)])
def test_a_gpus_upload_and_download_through_a_switch_share_its_duplex_budget(duplex, upload_end):
    # ZeRO-3 on 2 GPUs without P2P: layer 0's upload (W, H2D) and its all-gather send (W/2,
    # D2H) start together on gpu0's 10 GB/s switch port (uplink wide, full duplex). Full duplex:
    # the upload ends at W/B. Duplex 0.5: both directions share B, so each runs at B/2 until
    # the send is done (at W/B, half the upload moved), then the upload alone: 1.5 W/B.
    topo = switch_box(uplink=100.0, uplink_duplex=1.0, gpu_duplex=duplex)
    r = simulate(plan_on(topo, [0, 2], 4), schedule="zero3-offload")
    up = first(r, "prefetch", gpu="gpu0", stage=0, phase="forward")
    assert up.end == pytest.approx(upload_end * W / (10 * GB))


# ---------------------------------------------------------------------------- NUMA
def two_sockets():
    return Topology.virtual(gpus=2, memory="24GiB", root_complexes=2, bandwidth="10GB/s", uplink="20GB/s",
                            upi="5GB/s")


def test_masters_on_one_socket_reach_the_other_sockets_gpu_over_the_inter_socket_link():
    # Stage 1 runs on gpu1 (socket cpu1). With every master in cpu0's DRAM its upload crosses
    # the 5 GB/s UPI link: W / 5 GB/s; local (in cpu1's DRAM) it takes W / 10 GB/s.
    topo = two_sockets()
    plan = plan_on(topo, [0, 1], 2)
    remote = first(simulate(plan, masters="cpu0", host_copies=NO_HOST_COPIES), "prefetch", stage=1)
    local = first(simulate(plan, host_copies=NO_HOST_COPIES), "prefetch", stage=1)
    assert remote.route == ("cpu0", "cpu1", "sw1", "gpu1") and remote.end == pytest.approx(W / (5 * GB))
    assert local.route == ("cpu1", "sw1", "gpu1") and local.end == pytest.approx(W / (10 * GB))
    grads = first(simulate(plan, masters="cpu0"), "gradient", stage=1)
    assert grads.route == ("gpu1", "sw1", "cpu1", "cpu0")


def test_local_masters_live_on_the_socket_of_the_gpu_each_stage_is_mapped_to():
    topo = Topology.preset("mobius-testbed")
    plan = build_plan(layers(16), list(range(16)), order=["gpu0", "gpu4", "gpu1", "gpu5", "gpu2", "gpu6", "gpu3",
                                                           "gpu7"], topology=topo, microbatches=2, step_time=0.0,
                      input_bytes=1000, memory_fraction=0.99)
    for schedule in ("mobius", "mobius-identity-map"):
        r = simulate(plan, schedule=schedule)
        moved = [e for e in r.events if e.kind in ("prefetch", "gradient")]
        assert moved and not any({"cpu0", "cpu1"} <= set(e.route) for e in moved)
        r = simulate(plan, schedule=schedule, masters="cpu0")
        # Half of the 24 uploads (16 forward, 8 in backward: each GPU holds its last stage) cross.
        assert sum({"cpu0", "cpu1"} <= set(e.route) for e in r.events if e.kind == "prefetch") == 12


def test_masters_on_an_unknown_socket_are_refused():
    plan = plan_on(two_sockets(), [0, 1], 2)
    with pytest.raises(MobiusError, match=r"masters='cpu7'.*'local'.*cpu0, cpu1"):
        simulate(plan, masters="cpu7")


# --------------------------------------------------------------------- ZeRO-3 as run
def test_zero3_without_p2p_routes_half_of_its_collectives_through_the_host():
    # Per GPU and ring of N: the all-gather sends (N-1)/N of every uploaded layer to the host,
    # the reduce-scatter receives (N-1)/N of every gradient from it.
    testbed = Topology.preset("mobius-testbed")
    plan = plan_on(testbed, [0, 4], 8)
    r = simulate(plan, schedule="zero3-offload")
    n, uploaded, grads = 8, 2 * 8 * W - W, 8 * W  # the last layer stays across the turn
    for gpu in testbed.gpus:
        mine = [e for e in r.events if e.kind == "collective" and e.gpu == gpu.name]
        assert sum(e.bytes for e in mine if e.route[0] == gpu.name) == pytest.approx((n - 1) / n * uploaded, rel=1e-6)
        assert sum(e.bytes for e in mine if e.route[-1] == gpu.name) == pytest.approx((n - 1) / n * grads, rel=1e-6)
    with_p2p = Topology.from_dict({**testbed.to_dict(), "p2p": True})
    assert not [e for e in simulate(plan, schedule="zero3-offload", topology=with_p2p).events
                if e.kind == "collective"]


def test_zero3_steps_at_mobius_speed_unless_deepspeeds_is_measured_or_given():
    """No assumed speed-up for DeepSpeed's CPU Adam: ZeRO-3 steps at the optimizer speed Mobius
    gets (default, given or measured) unless DeepSpeed's own was measured on the machine (host
    section, implementation "deepspeed") or given. Its kernel writes the fp16 copy as it steps
    (the streamed bytes count in the step); the gradients are handed over first, at the host
    copy speed."""
    testbed = Topology.preset("mobius-testbed")
    plan = plan_on(testbed, [0, 4], 8)
    masters = 8 * W
    s = plan.precision.stream_bytes

    def zero3_time(bw, copy=HOST_COPY_BANDWIDTH):
        return masters / 4 * (host_copy_bytes("handover", s) / copy + (28 + s) / bw)

    def mobius_time(bw, copy=HOST_COPY_BANDWIDTH):
        return masters / 4 * (host_copy_bytes("handover", s) / copy + 28 / bw)

    zero3 = simulate(plan, schedule="zero3-offload")
    assert zero3.optimizer_time == pytest.approx(zero3_time(CPU_ADAM_BANDWIDTH))
    assert zero3.optimizer_bandwidth == CPU_ADAM_BANDWIDTH and "the optimizer's speed" in zero3.host_sources["optimizer"]
    zero3 = simulate(plan, schedule="zero3-offload", cpu_adam_bandwidth=10 * GB)  # the same speed as Mobius's
    assert zero3.optimizer_time == pytest.approx(zero3_time(10 * GB))
    zero3 = simulate(plan, schedule="zero3-offload", deepspeed_adam_bandwidth=7 * GB, cpu_adam_bandwidth=10 * GB)
    assert zero3.optimizer_time == pytest.approx(zero3_time(7 * GB)) and zero3.host_sources["optimizer"] == "given"
    mobius = simulate(plan, deepspeed_adam_bandwidth=7 * GB)
    assert mobius.optimizer_time == pytest.approx(mobius_time(CPU_ADAM_BANDWIDTH))
    # measured on the machine: DeepSpeed's figure for ZeRO-3 only; a torch kernel's for both
    for impl, ds_bw, mobius_bw in (("deepspeed", 50 * GB, CPU_ADAM_BANDWIDTH), ("fused", 50 * GB, 50 * GB)):
        host = HostFigures(optimizer="adamw", implementation=impl, optimizer_bytes_per_s=50 * GB,
                           host_copy_bytes_per_s=5 * GB)
        topo = testbed.with_host(host)
        zero3 = simulate(plan, schedule="zero3-offload", topology=topo)
        assert zero3.optimizer_time == pytest.approx(zero3_time(ds_bw, 5 * GB))
        assert zero3.host_sources["optimizer"].startswith("measured on this host" if impl == "deepspeed" else "Deep")
        mobius = simulate(plan, topology=topo)
        assert mobius.optimizer_time == pytest.approx(mobius_time(mobius_bw, 5 * GB))
        assert mobius.host_sources["optimizer"].startswith("default" if impl == "deepspeed" else "measured on this host")


def test_each_zero3_rank_keeps_its_partition_in_its_own_sockets_dram():
    testbed = Topology.preset("mobius-testbed")
    r = simulate(plan_on(testbed, [0, 4], 8), schedule="zero3-offload")
    moved = [e for e in r.events if e.kind in ("prefetch", "gradient", "collective")]
    assert moved and not any({"cpu0", "cpu1"} <= set(e.route) for e in moved)
