"""When the gradients land on the host (mobius_fx/planning/landings.py): the step model's replay of
the gradient downloads beside the backward uploads, which the host's work after them (sync's
passes, async's hand-overs into the fp32 `.grad`) starts from, against the simulator."""

from __future__ import annotations

import pytest
import torch

from mobius_fx.planning.costs import LayerCost
from mobius_fx.planning.host_step import HostPass
from mobius_fx.planning.landings import shared_landings
from mobius_fx.planning.plans import build_plan
from mobius_fx.planning.step_model import PartitionProblem, evaluate
from mobius_fx.planning.step_timeline import SharedLink
from mobius_fx.precision import Precision
from mobius_fx.sim.simulator import simulate
from mobius_fx.topology.server import Topology

FP16 = Precision(stream=torch.float16, master=torch.float32)


def one_switch(gpus: int) -> Topology:
    """`gpus` RTX 3090s on x8 links (6.5 GB/s) behind one PCIe switch with an x16 uplink (13 GB/s):
    the uplink carries two GPUs' copies at a time each way, and every link at the switch carries
    both ways together at most links.SWITCH_DUPLEX (0.72) of both (benchmarks/plan_quality.py)."""
    nodes = [{"name": "cpu0", "kind": "root_complex"}, {"name": "sw0", "kind": "switch"}]
    nodes += [{"name": f"gpu{i}", "kind": "gpu", "memory": "24GiB", "spec": "rtx3090"} for i in range(gpus)]
    links = [{"a": "cpu0", "b": "sw0", "bandwidth_gbps": 13.0}]
    links += [{"a": "sw0", "b": f"gpu{i}", "bandwidth_gbps": 6.5} for i in range(gpus)]
    return Topology.from_dict({"name": "one switch", "p2p": False, "nodes": nodes, "links": links})


def test_the_async_hand_overs_start_when_the_simulated_gradients_land():
    # benchmarks/plan_quality.py's link-bound case as 8 equal layers of 450 MB (fp32 masters,
    # 225 MB streamed in fp16), one per stage on 4 GPUs behind a switch, 4 micro-batches, under
    # "async" with the fp32 .grad kept and bf16 downloads (`widen_downloads=False`; widened
    # downloads leave the host nothing to convert): one thread converts each stage's downloads into it as they
    # land (27.5 GB/s), so the step ends with that chain, which starts at the landings. The
    # downloads share the uplink with the backward weight uploads, which the simulator serves
    # first, so the downloads get what the duplex budget leaves (0.44 of their speed). Measured:
    # the plan predicts 0.989 of the simulated step; a replay of the downloads alone (no uploads
    # passed to `shared_landings`: the mutation) lands them early and predicts 0.912.
    topo = one_switch(4)
    layers = [LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, 6e-3, 18e-3, int(450e6), int(450e6), int(8e6), int(50e6))
              for i in range(8)]
    cuts, m = tuple(range(8)), 4
    host = HostPass.of(topo, 2, "adamw", "async", widen=False)
    prob = PartitionProblem.from_topology(layers, topo, microbatches=m, host=host, precision=FP16, input_bytes=1000)
    ev = evaluate(prob, cuts)
    plan = build_plan(layers, cuts, order=[g.name for g in topo.gpus], topology=topo, microbatches=m,
                      step_time=ev.makespan, input_bytes=1000, precision=FP16)
    r = simulate(plan, optimizer_overlap="async", keep_grads=True, widen_downloads=False, host_copies={"pin": 0})
    assert r.step_time > r.pipeline_time * 1.1  # the hand-overs end the step
    assert 0.94 <= ev.makespan / r.step_time <= 1.00, (ev.makespan, r.step_time)


def test_a_download_behind_an_upload_gets_what_the_duplex_budget_leaves():
    # Two slots behind one 10 B/s uplink (1 server each way), each on its own 10 B/s link, every
    # link at duplex 0.75 (both ways together 15 B/s). Slot 0 uploads 10 B from t = 0 (first: a
    # smaller rank), slot 1 from t = 0 too but behind it on the uplink; slot 1's 10 B of
    # gradients leave from t = 0. The uplink carries slot 0's upload at 10 B/s, so the download
    # gets 15 - 10 = 5 B/s until t = 1, then slot 1's upload takes the uplink up again: 5 B/s
    # more until t = 2 (its own link: 15 - 10 = 5 too), then all 10 B/s: lands at 2.
    # Slot 0's download (10 B, from t = 0.5) shares what is left fairly with slot 1's.
    prob = PartitionProblem(layers=(LayerCost("a", ("a",), 0, 0, 0, 0, 1, 1, 1, 1),), microbatches=1,
                            gpus=("g0", "g1"), capacity=(10**9, 10**9), up=(10.0, 10.0), down=(10.0, 10.0),
                            hop=(10.0, 10.0), memory=None, duplex=(0.75, 0.75),
                            shared_up=(SharedLink("up", (0, 1), 1),), shared_down=(SharedLink("down", (0, 1), 1),))
    uploads = [(0, 0.0, 10.0, 0), (1, 0.0, 10.0, 1)]
    # slot 1's download alone: 5 B/s for 2 s (uplink duplex: 15 - 10 each second)
    assert shared_landings(prob, [0.0, 10.0], [0.0, 0.0], [0.0, 0.0], uploads) == pytest.approx([0.0, 2.0])
    # without the uploads, 1 s at full speed
    assert shared_landings(prob, [0.0, 10.0], [0.0, 0.0], [0.0, 0.0]) == pytest.approx([0.0, 1.0])
    # both downloads: slot 1's from 0 at 5 B/s; slot 0's joins at 0.5 and they split the 5 B/s until the
    # uploads end at 2 (slot 1 then has 10 - 2.5 - 3.75 = 3.75 B left, slot 0 6.25), then 5 B/s each:
    # slot 1 lands at 2.75, slot 0 has 2.5 B left at 10 B/s: 3.0
    assert shared_landings(prob, [10.0, 10.0], [0.5, 0.0], [0.0, 0.0], uploads) == pytest.approx([3.0, 2.75])


def test_a_relayed_activation_gradient_goes_before_the_downloads_on_the_links_it_crosses():
    # Two slots behind one 10 B/s uplink (1 server), each on its own 10 B/s link, full duplex.
    # Slot 1's 10 B of gradients leave from t = 0: 1 s alone. A 5 B activation gradient relayed
    # through the host (`Hop`, ranked before every download) from slot 1 to slot 0 takes slot 1's
    # own link for 0.5 s; one from slot 0 to slot 1 takes the uplink's way down for 0.5 s: either
    # way the download gets nothing meanwhile and lands at 1.5.
    prob = PartitionProblem(layers=(LayerCost("a", ("a",), 0, 0, 0, 0, 1, 1, 1, 1),), microbatches=1,
                            gpus=("g0", "g1"), capacity=(10**9, 10**9), up=(10.0, 10.0), down=(10.0, 10.0),
                            hop=(10.0, 10.0), memory=None,
                            shared_up=(SharedLink("up", (0, 1), 1),), shared_down=(SharedLink("down", (0, 1), 1),))
    grads, ready, D = [0.0, 10.0], [0.0, 0.0], [0.0, 0.0]
    assert shared_landings(prob, grads, ready, D) == pytest.approx([0.0, 1.0])
    assert shared_landings(prob, grads, ready, D, hops=[(1, 0, 0.0, 5.0, 0)]) == pytest.approx([0.0, 1.5])
    assert shared_landings(prob, grads, ready, D, hops=[(0, 1, 0.0, 5.0, 0)]) == pytest.approx([0.0, 1.5])
    # released at 2, after the download landed: no effect
    assert shared_landings(prob, grads, ready, D, hops=[(0, 1, 2.0, 5.0, 0)]) == pytest.approx([0.0, 1.0])


@pytest.mark.parametrize("cuts", [(0, 1, 3, 4, 5, 6, 7), (0, 2, 3, 4, 5, 6, 7)])
def test_the_pipeline_ends_when_the_fairly_shared_fp32_downloads_land(cuts):
    # benchmarks/plan_quality.py's compute-bound case (a GPT of 5 blocks, 4 x 1024 tokens, its layers'
    # costs rounded; no tied head) on 4 GPUs behind one switch, 7 stages, "async" with the fp32 .grad
    # kept: the GPUs widen the gradients to fp32 and download 4 B/param. The simulator shares the
    # uplink max-min fairly among the downloads (equal need) and serves the activation gradients
    # relayed through the host first, so GPU 1's second download (stage 1, 54 MB) crawls beside
    # the others' and lands last. Measured, pipeline predicted over simulated: D alone (the stage-order
    # queue, `servers` at a time: the mutation `makespan = max(D)`) 0.928 / 0.960; the fluid replay
    # without the relayed hops (`_relayed_hops(...)[:0]`) 0.936 / 0.957; with them 0.959 / 0.982.
    MB = 2**20
    lc = lambda name, f, b, p, out, peak, saved: LayerCost(name, (name,), 0.0, 0.0, f, b, p, p, out, peak,
                                                           saved_bytes=saved)
    layers = [lc("wte", 5.4e-5, 1.6e-4, 32 * MB, 16 * MB, 16 * MB, 16 * MB),
              lc("wpe", 4.9e-5, 1.5e-4, 4 * MB, 16 * MB, 36 * MB, 16 * MB)]
    layers += [lc(f"h{i}", 3.18e-3, 9.54e-3, 48 * MB, 16 * MB, 160 * MB, 256 * MB) for i in range(5)]
    layers += [lc("head", 1.65e-3, 4.95e-3, 8192, 128 * MB, 160 * MB, 144 * MB)]
    topo, m = one_switch(4), 4
    prob = PartitionProblem.from_topology(layers, topo, microbatches=m, host=HostPass.of(topo, 2, "adamw", "async"),
                                          precision=FP16, input_bytes=32768)
    ev = evaluate(prob, cuts)
    plan = build_plan(layers, cuts, order=[g.name for g in topo.gpus], topology=topo, microbatches=m,
                      step_time=ev.makespan, input_bytes=32768, precision=FP16)
    r = simulate(plan, optimizer_overlap="async", keep_grads=True)
    assert 0.94 <= ev.pipeline / r.pipeline_time <= 1.00, (ev.pipeline, r.pipeline_time)
