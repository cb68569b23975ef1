"""The step model (mobius_fx.planning.step_model): `evaluate`, the timeline of fixed cuts, by hand and
against the simulator. The solvers that search it are tested in test_partition.py."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from mobius_fx import PlanError
from mobius_fx.planning.costs import LayerCost
from mobius_fx.planning.plans import build_plan
from mobius_fx.planning.host_step import NO_HOST_COPIES
from mobius_fx.sim.simulator import simulate
from mobius_fx.planning.step_model import PartitionProblem, PrefixSums, evaluate
from mobius_fx.planning.step_memory import MemoryModel, stage_memory, tied_weights, TiedWeight
from mobius_fx.planning.link_loads import LinkLoad
from mobius_fx.planning.step_timeline import shared_links, SharedLink
from mobius_fx.topology.server import Topology
from mobius_fx.precision import Precision


def layer(name: str, fwd: float = 1.0, bwd: float = 2.0, params: int = 10, out: int = 0, peak: int = 0,
          grad: int | None = None, sig: str = "") -> LayerCost:
    return LayerCost(name, (name,), 0.0, 0.0, fwd, bwd, params, params if grad is None else grad, out, peak,
                     signature=sig)


def problem(layers, *, gpus: int = 1, m: int = 1, cap: float = 1e9, up: float = 10.0, down: float = 10.0,
            hop: float = 10.0, hop_back: float | None = None, frac: float = 1.0, dtype=None,
            input_bytes: float = 0.0, tied: tuple[TiedWeight, ...] = ()) -> PartitionProblem:
    layers = tuple(layers)
    return PartitionProblem(layers, m, tuple(f"gpu{i}" for i in range(gpus)), (int(cap),) * gpus, (up,) * gpus,
                            (down,) * gpus, (hop,) * gpus, MemoryModel(m, Precision.of(dtype)), frac,
                            hop_back=None if hop_back is None else (hop_back,) * gpus, input_bytes=input_bytes,
                            tied=tied)


def unshared_topology(n: int, *, nvlink: float | list[float] = 50.0):
    """Every GPU on its own 10 GB/s host link, NVLink (GB/s, or [a_to_b, b_to_a]) between every
    pair: no link is shared, so the simulator replays exactly the partitioner's model."""
    nodes = [{"name": "cpu0", "kind": "root_complex"}]
    nodes += [{"name": f"gpu{i}", "kind": "gpu", "memory": "24GiB", "spec": "rtx3090"} for i in range(n)]
    links = [{"a": "cpu0", "b": f"gpu{i}", "bandwidth_gbps": 10.0} for i in range(n)]
    links += [{"a": f"gpu{i}", "b": f"gpu{j}", "kind": "nvlink", "bandwidth_gbps": nvlink}
              for i in range(n) for j in range(i + 1, n)]
    return Topology.from_dict({"name": "unshared", "p2p": True, "nodes": nodes, "links": links})


# ---------------------------------------------------------------------- weights and hops
def test_evaluate_hides_the_whole_upload_when_the_previous_span_is_long_enough():
    # One GPU, two stages of W=10 B at 10 B/s: stage 1's upload fits in stage 0's 1 s span.
    ev = evaluate(problem([layer("a"), layer("b")]), (0, 1))
    assert ev.fwd_start == ((1.0,), (2.0,))
    assert ev.prefetch_fwd == (0.0, 10.0)
    assert ev.bwd_start == ((5.0,), (3.0,))
    assert ev.makespan == pytest.approx(7.0 + 10 / 10)  # + stage 0's gradient download


def test_evaluate_prefetch_is_limited_by_bandwidth_times_the_previous_span():
    # At 5 B/s only 5 of stage 1's 10 B move during stage 0's 1 s forward; the rest waits 1 s.
    ev = evaluate(problem([layer("a"), layer("b")], up=5.0, down=5.0), (0, 1))
    assert ev.fwd_start == ((2.0,), (4.0,))
    assert ev.prefetch_fwd == (0.0, 5.0)
    assert ev.prefetch_bwd == (10.0, 0.0)  # stage 1's 2 s backward hides all of stage 0
    assert ev.makespan == pytest.approx(9.0 + 10 / 5)


def test_evaluate_prefetch_is_limited_by_free_memory():
    # Capacity 25 B: stage 1's backward (10 B weights, 10 B gradients) with stage 0's 10 B of
    # weights prefetched meanwhile (the double buffer, `memory_rows`: 30 > 25) fails; 30 B fit.
    p = problem([layer("a"), layer("b")], cap=25)
    assert evaluate(p, (0, 1)) is None
    assert evaluate(problem([layer("a"), layer("b")], cap=30), (0, 1)) is not None


def test_evaluate_waits_for_the_activation_hop():
    ls = [layer("a", out=20), layer("b")]
    ev = evaluate(problem(ls, gpus=2, hop=10.0), (0, 1))
    # stage 1 starts after stage 0 (1 s upload + 1 s compute) plus 20 B / 10 B/s
    assert ev.fwd_start[1][0] == pytest.approx(1.0 + 1.0 + 2.0)


def test_the_gradient_hop_uses_the_backward_link():
    # Stage 0 on gpu0, stage 1 on gpu1; out_0 = 20 B. Forward hop 10 B/s (2 s), backward 4 B/s (5 s).
    ls = [layer("a", out=20), layer("b")]
    ev = evaluate(problem(ls, gpus=2, hop=10.0, hop_back=4.0), (0, 1))
    assert ev.fwd_start[1][0] == pytest.approx(1.0 + 1.0 + 20 / 10)
    assert ev.bwd_start[0][0] == pytest.approx(ev.bwd_start[1][0] + 2.0 + 20 / 4)


def test_hop_back_defaults_to_the_forward_hop():
    ls = [layer("a", out=20), layer("b")]
    same = evaluate(problem(ls, gpus=2, hop=4.0), (0, 1))
    explicit = evaluate(problem(ls, gpus=2, hop=4.0, hop_back=4.0), (0, 1))
    assert same == explicit


def test_micro_batches_pipeline_across_gpus():
    # Two GPUs, two micro-batches, resident stages: the second GPU starts micro-batch 0 while
    # the first runs micro-batch 1 (the classic GPipe fill), not after both.
    p = problem([layer("a"), layer("b")], gpus=2, m=2, up=1e12, down=1e12, hop=math.inf)
    ev = evaluate(p, (0, 1))
    assert ev.fwd_start[1] == pytest.approx((0.5, 1.0))


# --------------------------------------------------------------------- gradient downloads
def test_the_step_ends_at_a_later_stages_gradient_download():
    # Two GPUs; stage 1's 200 B of gradients take 20 s to download, long after stage 0's
    # backward (and its own 1 s download) is done: the step ends with stage 1's download.
    ls = [layer("a"), layer("b", grad=200)]
    ev = evaluate(problem(ls, gpus=2, hop=math.inf), (0, 1))
    b1_end = ev.bwd_start[1][0] + 2.0
    assert ev.grad_done == pytest.approx((ev.bwd_start[0][0] + 2.0 + 1.0, b1_end + 20.0))
    assert ev.makespan == pytest.approx(b1_end + 20.0)


def test_gradient_downloads_queue_on_one_gpu():
    # One GPU: stage 0's download waits for stage 1's (200 B at 10 B/s, 20 s) to finish.
    ls = [layer("a"), layer("b", grad=200)]
    ev = evaluate(problem(ls, cap=1e4), (0, 1))
    assert ev.grad_done[1] == pytest.approx(ev.bwd_start[1][0] + 2.0 + 20.0)
    assert ev.grad_done[1] > ev.bwd_start[0][0] + 2.0
    assert ev.makespan == ev.grad_done[0] == pytest.approx(ev.grad_done[1] + 1.0)


# --------------------------------------------------------------------------- saved inputs
# Times in the cases below: f = 1 s, b = 2 s per stage and micro-batch, W = G = 10 B at 10 B/s
# up (1 s); `down=1e9` makes offloads and gradient downloads take ~1e-8 s (hence abs=1e-6).
FAST = dict(down=1e9, hop=math.inf)


def test_a_restore_delays_the_backward_by_its_upload_time():
    # One GPU, stages a | b; b's saved input in_1 = 20 B. Forward: F0 = 1 (upload), F1 = 2
    # (prefetched during F0). Stage 1's offload leaves at 3 and is back after 20 B / 10 B/s:
    # B1 = 3 + 2 = 5 (without the restore: the turn, 3). Stage 0's backward follows stage 1's
    # (ends 7) and ends at 9: the whole step is 2 s, the restore, longer.
    ev = evaluate(problem([layer("a", out=20), layer("b")], **FAST), (0, 1))
    assert ev.fwd_start == ((1.0,), (2.0,))
    assert ev.host_copy_start[1] == (3.0,)  # the offload starts after F1's run
    assert (ev.bwd_start[0][0], ev.bwd_start[1][0]) == pytest.approx((7.0, 5.0), abs=1e-6)
    assert ev.makespan == pytest.approx(9.0, abs=1e-6)
    no_act = evaluate(problem([layer("a"), layer("b")], **FAST), (0, 1))
    assert ev.makespan - no_act.makespan == pytest.approx(20 / 10, abs=1e-6)


def test_a_restore_is_hidden_behind_the_next_stages_backward():
    # Two GPUs, stages a | b | c (gpu0, gpu1, gpu0); stage 1 keeps in_1 = out_a = 20 B. Its
    # offload (20 B at 10 B/s) leaves at F1 + f = 5 and its restore is back at 7 + 2 = 9,
    # before stage 2's 4 s backward (from 6) hands it the gradient at 10: nothing changes.
    ls = [layer("a", out=20), layer("b"), layer("c", bwd=4.0)]
    ev = evaluate(problem(ls, gpus=2), (0, 1, 2))
    assert ev.fwd_start == ((1.0,), (4.0,), (5.0,))
    assert ev.restores_done[1] == pytest.approx(9.0)
    assert ev.bwd_start == ((14.0,), (10.0,), (6.0,))
    assert ev.makespan == pytest.approx(17.0)
    sooner = evaluate(problem([layer("a", out=20), layer("b"), layer("c", bwd=2.0)], gpus=2), (0, 1, 2))
    assert sooner.bwd_start[1] == (9.0,)  # with stage 2 done at 8, the restore is what stage 1 waits for


def test_the_model_input_is_sent_to_stage_0_again_for_backward():
    # One GPU, a | b, a 20 B model input. Forward: the input and stage 0's weights share its
    # host link, F0 = (10 + 20) B / 10 B/s = 3. Backward: stage 0's weights come back after
    # stage 1's backward starts (B1 + 1 s) and the input after them (+ 2 s): B0 = B1 + 3, after
    # the end of stage 1's backward (B1 + 2).
    ev = evaluate(problem([layer("a"), layer("b")], input_bytes=20, **FAST), (0, 1))
    assert ev.fwd_start == ((3.0,), (4.0,))
    b1 = ev.bwd_start[1][0]
    assert b1 == pytest.approx(5.0)
    assert ev.bwd_start[0][0] == pytest.approx(b1 + 1.0 + 2.0)
    without = evaluate(problem([layer("a"), layer("b")], **FAST), (0, 1))
    assert without.bwd_start[0][0] == pytest.approx(without.bwd_start[1][0] + 2.0)  # the GPU was the limit


def test_the_output_goes_to_the_host_and_its_gradient_comes_back():
    # One stage, two micro-batches (f = 0.5, b = 1 s each), a 20 B output (10 B per micro-batch,
    # 1 s each way). Outputs leave at 1.5 and 2.5; the gradient of micro-batch 1 (run first in
    # backward) is back at 2.5 + 1 + 1 = 4.5; the step ends after 2 s of backward + 1 s download.
    ev = evaluate(problem([layer("a", out=20)], m=2), (0,))
    assert ev.fwd_start == ((1.0, 1.5),)
    assert ev.host_copy_start[0] == (1.5, 2.5)
    assert ev.bwd_start == ((4.5, 5.5),)
    assert ev.makespan == pytest.approx(7.5)


def test_the_last_stages_outputs_leave_at_the_duplex_share_while_their_gradients_come_back():
    # As above on a route that keeps half of each direction while both are busy: the second
    # output (10 B) leaves while the first one's gradient comes back, so it takes 2 s (the
    # simulator's switch links do this; plan_quality's compute-bound case predicted 0.845 of the
    # simulated step without it). The first leaves before any gradient comes back: 1 s, at full
    # speed (the simulator's too: issue 38's case was predicted 0.2% over it at the share).
    # One micro-batch: nothing comes back meanwhile.
    p = replace(problem([layer("a", out=20)], m=2), duplex=(0.5,))
    ev = evaluate(p, (0,))
    assert ev.host_copy_start[0] == (1.5, 2.5)
    assert ev.bwd_start == ((5.5, 6.5),)  # the last output back at 4.5, its gradient at 5.5
    one = replace(problem([layer("a", out=20)], m=1), duplex=(0.5,))
    assert evaluate(one, (0,)).bwd_start == ((1.0 + 1.0 + 2.0 + 2.0,),)  # 20 B out and back at 10 B/s


def switch_links(slots=(0, 1), bandwidth: float = 10.0):
    """A switch uplink both GPU slots' host copies and their hops through the host cross (`LinkLoad`)."""
    return (LinkLoad("cpu->sw", bandwidth, up=slots, hop=slots), LinkLoad("sw->cpu", bandwidth, down=slots, hop=slots))


def test_the_last_stages_copies_wait_for_the_forwards_backlog_on_a_shared_link():
    # Two GPUs behind one 10 B/s uplink at duplex 0.5 (10 B/s for both directions together),
    # a | b | c | d, W = 10 B, out = 10 B, one micro-batch. Stage 3's copies queue on its GPU
    # behind stage 1's offload, which the simulator serves after the forward's other copies on
    # the link: weights 0..3 (40 B), hops into 1..3, each over the uplink twice (60 B), stage
    # 1..2's offloads (20 B): 120 B at 10 B/s, so they start at 12 s, not 8 (plan_quality's
    # compute-bound case: the turn came 5.5 ms before the simulator's without it). Full duplex
    # (20 B/s after the first run ends at 2 s): 2 + (120 - 20) / 20 = 7 < 8, no change.
    ls = [layer(c, out=10) for c in "abcd"]
    p = problem(ls, gpus=2)
    for d, want in ((0.5, 12.0), (1.0, 8.0)):
        ev = evaluate(replace(p, links=switch_links(), duplex=(d, d)), (0, 1, 2, 3))
        assert evaluate(replace(p, duplex=(d, d)), (0, 1, 2, 3)).host_copy_start[3] == (8.0,)
        assert ev.host_copy_start[3] == (pytest.approx(want),)
        assert ev.host_copy_start[2] == (6.0,)  # stage 0 (= 2 - N) offloads nothing: no queue


def test_offloads_queue_on_the_gpus_download_stream():
    # One GPU, a | b | c, two micro-batches, saved inputs of 20 B per micro-batch at 10 B/s down
    # (2 s each), uploads ~free. Stage 1 offloads at 1.5 and 3.5; stage 2's offloads queue
    # behind them (5.5, 7.5) though its runs end at 2.5 and 3: its first restore is back at 9.5.
    ls = [layer("a", out=40), layer("b", out=40), layer("c")]
    ev = evaluate(problem(ls, m=2, up=1e9, hop=math.inf), (0, 1, 2))
    assert ev.host_copies_done[1] == pytest.approx(3.5 + 2.0, abs=1e-6)
    assert ev.host_copy_start[2] == pytest.approx((5.5, 7.5), abs=1e-6)
    assert ev.bwd_start[2] == pytest.approx((9.5, 10.5), abs=1e-6)


def test_the_backward_prefetch_queues_after_the_restores_of_the_stage_before_it():
    # One GPU, a | b | c, two micro-batches; stage 2 restores in_2 = 20 B per micro-batch (2 s
    # each) and its backward is short (0.1 s per micro-batch). Its restores are back at 6 and
    # 7.5 (released at its offloads, 3.5 and 4); stage 1's prefetch, triggered at B2 = 6, queues
    # behind the second one: stage 1's weights are there at 7.5 + 1 = 8.5, not 6 + 1 = 7.
    ls = [layer("a"), layer("b", out=40), layer("c", bwd=0.2)]
    ev = evaluate(problem(ls, m=2, **FAST), (0, 1, 2))
    assert ev.bwd_start[2] == pytest.approx((6.0, 7.5), abs=1e-6)
    assert ev.restores_done[2] == pytest.approx(7.5, abs=1e-6)
    assert ev.bwd_start[1][0] == pytest.approx(8.5, abs=1e-6)


def test_a_frozen_stage_saves_and_restores_nothing():
    # Stages a | b | c on one GPU; a and b take no gradient, so stages 0 and 1 run no backward
    # and stage 1 keeps no copy of its input: out_a's size changes nothing. When they train,
    # stage 1's weights are back at B2 + 1 = 5 and its 20 B input at 7, a second after stage
    # 2's backward ends (6): the step takes 1 s longer.
    def makespan(out_a, grad):
        ls = [layer("a", out=out_a, grad=grad), layer("b", grad=grad), layer("c")]
        return evaluate(problem(ls, **FAST), (0, 1, 2)).makespan
    assert makespan(20, 0) == makespan(0, 0)
    assert makespan(20, 10) == pytest.approx(makespan(0, 10) + 1.0, abs=1e-6)


# ------------------------------------------------------------------------ the simulator
@pytest.mark.parametrize("nvlink", [50.0, [50.0, 0.2]], ids=["symmetric", "slow-backward-link"])
def test_evaluate_agrees_with_the_simulator_when_no_link_is_shared(nvlink):
    # The simulator moves every transfer of the plan; with no shared link and small activations
    # the model agrees closely (measured: <= 0.015%; 0.3% before it counted saved inputs, 5%
    # when it ended at stage 0's download or timed gradient hops on the forward link).
    rng = random.Random(5)
    checked = 0
    for _ in range(12):
        n, nl, m = rng.randint(1, 3), rng.randint(2, 7), rng.randint(1, 4)
        topo = unshared_topology(n, nvlink=nvlink)
        layers = [LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, 0.01 * rng.uniform(0.2, 2), 0.03 * rng.uniform(0.2, 2),
                            int(100e6 * rng.uniform(0.2, 2)), int(100e6 * rng.uniform(0.2, 2)),
                            int(1e6 * rng.uniform(0.2, 2)), int(1e6)) for i in range(nl)]
        cuts = [0] + sorted(rng.sample(range(1, nl), rng.randint(1, nl) - 1))
        ev = evaluate(PartitionProblem.from_topology(layers, topo, microbatches=m, memory_fraction=0.99,
                                                     input_bytes=1000), cuts)
        if ev is None:
            continue
        plan = build_plan(layers, cuts, order=[g.name for g in topo.gpus], topology=topo, microbatches=m,
                          step_time=0.0, input_bytes=1000, memory_fraction=0.99)
        assert simulate(plan, host_copies=NO_HOST_COPIES).pipeline_time == pytest.approx(ev.makespan, rel=1e-3)
        checked += 1
    assert checked >= 8


def tied_layers(nl: int, rng: random.Random, *, reader: int, emb: int) -> list[LayerCost]:
    """`nl` layers of ~100 MB; layer 0 owns "emb.weight" (`emb` bytes, in its own) and layer
    `reader` reads it too (a tied head, or a middle one as T5's decoder embedding)."""
    layers = []
    for i in range(nl):
        w = int(100e6 * rng.uniform(0.2, 2)) + (emb if i == 0 else 0)
        layers.append(LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, 0.01 * rng.uniform(0.2, 2), 0.03 * rng.uniform(0.2, 2),
                                w, w, int(1e6 * rng.uniform(0.2, 2)), int(1e6),
                                params=(f"p{i}",) + (("emb.weight",) if i == 0 else ()),
                                uses=(f"p{i}",) + (("emb.weight",) if i in (0, reader) else ())))
    return layers


def tied_sizes(layers: list[LayerCost], emb: int) -> dict[str, int]:
    """param_sizes for `tied_layers`: layer 0's own bytes are its "p0" and the embedding."""
    sizes = {f"p{i}": l.param_bytes for i, l in enumerate(layers)}
    sizes["p0"] -= emb
    sizes["emb.weight"] = emb
    return sizes


@pytest.mark.parametrize("trainable", [True, False], ids=["trained", "frozen-embedding"])
def test_tied_copies_are_the_plans_stage_bytes(trainable):
    # Every cut set of six layers whose embedding (owned by layer 0) is read again by layer 2
    # (the middle: a stage holds it or not depending on the cuts) and layer 5 (the head): the
    # step model's weights, gradients and footprints are the plan's, copy by copy.
    import itertools

    rng = random.Random(3)
    emb = int(40e6)
    layers = tied_layers(6, rng, reader=5, emb=emb)
    layers[2] = replace(layers[2], uses=("p2", "emb.weight"))
    sizes = tied_sizes(layers, emb)
    train = [n for n in sizes if trainable or n != "emb.weight"]
    tied = tied_weights(layers, sizes, train)
    assert tied == (TiedWeight("emb.weight", 0, (2, 5), float(emb), trainable),)
    topo = Topology.virtual(gpus=2, memory="24GiB", bandwidth=10e9)
    p = PartitionProblem.from_topology(layers, topo, microbatches=2, tied=tied, precision=Precision.of("float16"))
    for k in range(6):
        for rest in itertools.combinations(range(1, 6), k):
            cuts = (0, *rest)
            plan = build_plan(layers, cuts, order=["gpu0", "gpu1"], topology=topo, microbatches=2, step_time=0.0,
                              precision=Precision.of("float16"), param_sizes=sizes, trainable=train)
            st = PrefixSums(p).stages(cuts)
            assert [int(x) for x in st.w] == [s.param_bytes for s in plan.stages]
            assert [int(x) for x in st.g] == [s.grad_bytes for s in plan.stages]
            assert [int(max(a, b)) for a, b in zip(st.fmem, st.bmem)] == [s.peak_bytes for s in plan.stages]
    # the copies are there: one stage for layers 0-1, one for 2-5 holds 2 and 5, one copy
    st = PrefixSums(p).stages((0, 2))
    own = PrefixSums(PartitionProblem.from_topology(layers, topo, microbatches=2, precision=Precision.of("float16"))).stages((0, 2))
    assert st.w[1] - own.w[1] == emb / 2 and st.g[1] - own.g[1] == (emb / 2 if trainable else 0)
    assert st.w[0] == own.w[0]


@pytest.mark.parametrize("reader", [1, 3, 5])
def test_evaluate_with_tied_weights_agrees_with_the_simulator(reader):
    # The simulator moves the plan's transfers, tied copies and their gradients included; the
    # step model counts them the same way (no link shared, so they agree as without tied weights).
    rng = random.Random(reader)
    topo = unshared_topology(2)
    checked = 0
    for _ in range(8):
        layers = tied_layers(6, rng, reader=reader, emb=int(150e6))
        sizes = tied_sizes(layers, int(150e6))
        cuts = [0] + sorted(rng.sample(range(1, 6), rng.randint(1, 5)))
        m = rng.randint(1, 3)
        prob = PartitionProblem.from_topology(layers, topo, microbatches=m, memory_fraction=0.99,
                                              tied=tied_weights(layers, sizes))
        ev = evaluate(prob, cuts)
        plan = build_plan(layers, cuts, order=["gpu0", "gpu1"], topology=topo, microbatches=m, step_time=0.0,
                          memory_fraction=0.99, param_sizes=sizes)
        assert simulate(plan, host_copies=NO_HOST_COPIES).pipeline_time == pytest.approx(ev.makespan, rel=1e-3)
        untied = evaluate(PartitionProblem.from_topology(layers, topo, microbatches=m, memory_fraction=0.99), cuts)
        copies = any(a <= reader < b for a, b in zip(cuts[1:], [*cuts[2:], 6]))
        assert ev.makespan >= untied.makespan and (ev.grad_done != untied.grad_done) == copies
        checked += ev.makespan > untied.makespan * 1.001  # the copies were on the critical path
    assert checked >= 2


# ---------------------------------------------------------------------- shared links
def test_uploads_behind_a_switch_queue_two_at_a_time_in_stage_order():
    # Four GPUs behind one uplink that carries two 10 B/s uploads at a time: stages 0 and 1
    # upload in [0, 1] s, stages 2 and 3 wait for them and upload in [1, 2] s. Forward runs
    # take 0.01 s, so without the queue every stage starts right after the one before.
    ls = [layer(c, fwd=0.01, bwd=0.02) for c in "abcd"]
    free = problem(ls, gpus=4, hop=math.inf)
    shared = replace(free, shared_up=(SharedLink("sw", (0, 1, 2, 3), 2),))
    assert evaluate(free, (0, 1, 2, 3)).upload_done == pytest.approx((1, 1, 1, 1))
    ev = evaluate(shared, (0, 1, 2, 3))
    assert ev.upload_done == pytest.approx((1, 1, 2, 2))
    assert [row[0] for row in ev.fwd_start] == pytest.approx([1, 1.01, 2, 2.01])
    one = replace(free, shared_up=(SharedLink("sw", (0, 1, 2, 3), 1),))  # one at a time
    assert evaluate(one, (0, 1, 2, 3)).upload_done == pytest.approx((1, 2, 3, 4))


def test_uploads_behind_a_switch_take_the_first_server_that_frees():
    # Two servers, stages of 50, 40, 10 and 20 B at 10 B/s: stages 0 and 1 upload first; stage
    # 2 takes the server stage 1 frees at 4 s (ends 5 s), stage 3 the one stage 2 frees at 5 s
    # (ends 7 s), not the one stage 1 freed (positionally two places before it: 6 s).
    ls = [layer(c, fwd=0.01, bwd=0.02, params=p) for c, p in zip("abcd", (50, 40, 10, 20))]
    shared = replace(problem(ls, gpus=4, hop=math.inf, cap=1e4), shared_up=(SharedLink("sw", (0, 1, 2, 3), 2),))
    assert evaluate(shared, (0, 1, 2, 3)).upload_done == pytest.approx((5, 4, 5, 7))


def test_gradient_downloads_behind_a_switch_queue_in_backward_order():
    # Gradients leave in reverse stage order; one 10 B/s download at a time through the
    # uplink: stage 3's first, then 2, 1, 0, each 1 s after the one before it at the latest.
    ls = [layer(c, fwd=0.01, bwd=0.02) for c in "abcd"]
    free = problem(ls, gpus=4, hop=math.inf)
    ev = evaluate(replace(free, shared_down=(SharedLink("sw", (0, 1, 2, 3), 1),)), (0, 1, 2, 3))
    ends = ev.grad_done
    assert [ends[k] - ends[k + 1] for k in range(3)] == pytest.approx([1, 1, 1])
    assert ev.makespan == ends[0] > evaluate(free, (0, 1, 2, 3)).makespan + 2.9


def test_a_gradient_download_gets_what_the_uploads_it_overlaps_leave_of_the_duplex_budget():
    # One GPU, two stages of 10 B at 10 B/s each way. Stage 0's weights come back for backward
    # from stage 1's backward start (B1) to B1 + 1 s, at full speed: the simulator serves the
    # copy needed first first. Stage 1's backward takes 0.5 s, so its gradients start leaving
    # 0.5 s before the upload ends and get 2d - 1 of the link meanwhile (the duplex budget
    # 2d x 10 B/s less the upload's 10 B/s), all of it after: at d = 0.75, 2.5 B in the first
    # 0.5 s, 7.5 B in 0.75 s more. At d = 0.5 nothing moves until the upload is done.
    ls = [layer("a"), layer("b", bwd=0.5)]
    full = problem(ls, cap=1e4)
    for d, took in ((1.0, 1.0), (0.75, 1.25), (0.5, 1.5)):
        ev = evaluate(replace(full, duplex=(d,)), (0, 1))
        b1 = ev.bwd_start[1][0]
        assert ev.weights_back[0] == pytest.approx(b1 + 1.0)  # the upload at full speed
        assert ev.grad_done[1] == pytest.approx(b1 + 0.5 + took)
        assert ev.grad_done[0] - ev.grad_done[1] >= 10 / 10 - 1e-12  # stage 0's own download: nothing to overlap
    # A download that outlasts the upload of stage k-N overlaps stage k-2N's too: one GPU, three
    # stages, stage 2's gradients (100 B) leave from its backward's end; stage 1's weights and
    # then stage 0's come back meanwhile (1 s each, from B2 and from B1), each costing
    # 2(1 - 0.75) = 0.5 s of the download's time.
    ls = [layer("a", bwd=0.1), layer("b", bwd=0.1), layer("c", bwd=0.1, params=100)]
    ev = evaluate(replace(problem(ls, cap=1e4), duplex=(0.75,)), (0, 1, 2))
    b2_end = ev.bwd_start[2][0] + 0.1
    up1 = ev.weights_back[1] - b2_end  # what is left of stage 1's upload when the download starts
    assert ev.grad_done[2] == pytest.approx(b2_end + 100 / 10 + 0.5 * (up1 + 1.0))
    with pytest.raises(PlanError, match=r"duplex=\(0.4,\); give one share in \[0.5, 1\]"):
        replace(full, duplex=(0.4,))


def test_the_duplex_share_comes_from_the_route():
    testbed = Topology.preset("mobius-testbed")
    p = PartitionProblem.from_topology([layer("a")], testbed, microbatches=1)
    assert p.duplex == (0.72,) * 8  # every GPU sits under a PCIe switch (links.SWITCH_DUPLEX)
    rtx = Topology.preset("rtx4090x8")  # root ports: full duplex
    assert PartitionProblem.from_topology([layer("a")], rtx, microbatches=1).duplex == (1.0,) * 8


def test_shared_links_of_the_presets():
    # The paper's server: each 13 GB/s switch uplink carries two of its four 6.5 GB/s GPU
    # links' copies at a time, both ways; with cross mapping a switch's GPUs are slots 0, 2, 4, 6.
    testbed = Topology.preset("mobius-testbed")
    cross = ["gpu0", "gpu4", "gpu1", "gpu5", "gpu2", "gpu6", "gpu3", "gpu7"]
    for direction, name in (("up", "cpu0->sw0"), ("down", "sw0->cpu0")):
        links = shared_links(testbed, cross, direction)
        assert links[0] == SharedLink(name, (0, 2, 4, 6), 2) and links[1].slots == (1, 3, 5, 7)
    rtx = Topology.preset("rtx4090x8")  # every GPU on its own root port: nothing shared
    assert shared_links(rtx, [g.name for g in rtx.gpus], "up") == ()
    box = Topology.virtual(gpus=4, bandwidth=10e9, uplink=10e9)  # an uplink no faster than one GPU's
    assert shared_links(box, [g.name for g in box.gpus], "down") == (SharedLink("sw0->cpu0", (0, 1, 2, 3), 1),)
    assert shared_links(Topology.virtual(gpus=2), ["gpu0", "gpu1"], "up") == ()  # 2x uplink: room for both


def test_stacked_switches_queue_once_on_the_link_with_the_fewest_servers():
    # cpu0 - swA - swB - four GPUs: both uplinks carry the same GPUs' copies; the model keeps
    # one queue (the slower link's) and the planner plans it (two queues gave the MIP the same
    # row twice, which PuLP refuses).
    import torch

    import mobius_fx
    from mobius_fx.zoo import mlp

    gpus = [{"name": f"gpu{i}", "kind": "gpu", "memory": "64MiB", "spec": "cpu"} for i in range(4)]
    links = [{"a": "cpu0", "b": "swA", "bandwidth_gbps": 13.0}, {"a": "swA", "b": "swB", "bandwidth_gbps": 6.5}]
    links += [{"a": "swB", "b": f"gpu{i}", "bandwidth_gbps": 6.5} for i in range(4)]
    topo = Topology.from_dict({"name": "stacked", "p2p": False, "links": links, "nodes": [
        {"name": "cpu0", "kind": "root_complex"}, {"name": "swA", "kind": "switch"},
        {"name": "swB", "kind": "switch"}, *gpus]})
    names = [g.name for g in topo.gpus]
    assert shared_links(topo, names, "up") == (SharedLink("swA->swB", (0, 1, 2, 3), 1),)
    torch.manual_seed(0)
    plan = mobius_fx.plan(mlp((64, 256, 256, 256, 256, 8)), topo, example_inputs=(torch.randn(8, 64),),
                          time_limit=2.0, verbose=False)
    assert plan.step_time > 0 and plan.solver.status != "not solved"


def test_where_gpus_share_an_uplink_the_model_is_within_10_percent_of_the_simulator():
    # Random plans on 2-4 virtual GPUs under one switch (an uplink as fast as one GPU's link or
    # twice it): the simulator shares links max-min fairly with priorities and loses bandwidth
    # when both directions are busy; the model queues the weight and gradient copies on the
    # uplink and slows backward copies by the duplex share. Measured: 0.97-1.07 of the simulated step.
    rng = random.Random(5)
    checked = 0
    for _ in range(16):
        n, nl, m = rng.choice([2, 3, 4]), rng.randint(3, 9), rng.randint(1, 4)
        topo = Topology.virtual(gpus=n, memory="24GiB", bandwidth=10e9, uplink=rng.choice([10e9, 20e9]))
        layers = [LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, 0.01 * rng.uniform(0.2, 2), 0.03 * rng.uniform(0.2, 2),
                            int(100e6 * rng.uniform(0.2, 2)), int(100e6 * rng.uniform(0.2, 2)),
                            int(1e6 * rng.uniform(0.2, 2)), int(1e6)) for i in range(nl)]
        cuts = [0] + sorted(rng.sample(range(1, nl), rng.randint(1, nl) - 1))
        p = PartitionProblem.from_topology(layers, topo, microbatches=m, memory_fraction=0.99, input_bytes=1000)
        ev = evaluate(p, cuts)
        if ev is None:
            continue
        plan = build_plan(layers, cuts, order=[g.name for g in topo.gpus], topology=topo, microbatches=m,
                          step_time=0.0, input_bytes=1000, memory_fraction=0.99)
        assert ev.makespan == pytest.approx(simulate(plan, host_copies=NO_HOST_COPIES).pipeline_time, rel=0.10)
        checked += bool(p.shared_up) and len(cuts) > 2
    assert checked >= 6


def test_a_tied_weight_with_a_bad_layer_index_is_refused():
    with pytest.raises(PlanError, match="tied weight 'w'.*layer indices below 2"):
        problem([layer("a"), layer("b")], tied=(TiedWeight("w", 0, (2,), 8.0),))
    with pytest.raises(PlanError, match="readers other than the owner"):
        problem([layer("a"), layer("b")], tied=(TiedWeight("w", 1, (1,), 8.0),))


@pytest.mark.parametrize("cuts", [[0], [0, 3], [0, 2, 4], [0, 1, 2, 3, 4, 5]])
def test_with_large_activations_the_model_is_the_simulated_step_on_one_gpu(cuts):
    # Six layers with 400 MB outputs (100 MB per micro-batch: 10 ms each way at 10 GB/s, as
    # long as a stage's weight upload) on one virtual GPU. The saved inputs' offloads queue on
    # the download stream, their restores on the upload stream ahead of the next prefetch, the
    # model output goes to the host and its gradient comes back; the model counts all of it and
    # equals the simulated step. Without them it was 50-82% of it. (The GPU's own 10 GB/s link
    # to the root complex, no switch: a switch's PCIe links lose bandwidth when both directions
    # are busy, which the simulator models and the step model does not, issue 14.)
    topo = unshared_topology(1)
    layers = [LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, 0.01, 0.03, int(100e6), int(100e6), int(400e6), int(1e6))
              for i in range(6)]
    plan = build_plan(layers, cuts, order=["gpu0"], topology=topo, microbatches=4, step_time=0.0,
                      memory_fraction=0.99)
    ev = evaluate(PartitionProblem.from_topology(layers, topo, microbatches=4, memory_fraction=0.99), cuts)
    assert ev.makespan == pytest.approx(simulate(plan, host_copies=NO_HOST_COPIES).pipeline_time, rel=1e-9)


def test_with_large_activations_the_model_stays_below_the_simulated_step_on_two_gpus():
    # Two virtual GPUs under one switch: hops go GPU to GPU through the host and share links
    # with the offloads, and the switch's links lose bandwidth when both directions are busy
    # (links.SWITCH_DUPLEX); the model leaves both out (issue 14), so it is a bound (0.82 of the
    # simulated step on these cuts; 0.89 before the simulator modelled the duplex share, 0.66
    # without saved inputs).
    topo = Topology.virtual(gpus=2, memory="24GiB", bandwidth=10e9)
    layers = [LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, 0.01, 0.03, int(100e6), int(100e6), int(400e6), int(1e6))
              for i in range(6)]
    plan = build_plan(layers, [0, 2, 4], order=["gpu0", "gpu1"], topology=topo, microbatches=4, step_time=0.0,
                      memory_fraction=0.99)
    ev = evaluate(PartitionProblem.from_topology(layers, topo, microbatches=4, memory_fraction=0.99), [0, 2, 4])
    sim = simulate(plan, host_copies=NO_HOST_COPIES).pipeline_time
    assert 0.8 * sim <= ev.makespan <= sim * (1 + 1e-9)


# ----------------------------------------------------------------------------- memory
def test_evaluate_memory_equals_plans_stage_memory():
    ls = [layer("a", params=7, out=3, peak=5), layer("b", params=4, out=9, peak=8), layer("c", params=6, out=2)]
    p = problem(ls, gpus=2, m=2)
    ev = evaluate(p, (0, 1))
    assert (ev.fwd_mem[0], ev.bwd_mem[0]) == pytest.approx(stage_memory(ls[:1], None, p.memory))
    assert (ev.fwd_mem[1], ev.bwd_mem[1]) == pytest.approx(stage_memory(ls[1:], ls[0], p.memory))


def test_the_boundary_term_holds_every_restored_input():
    # Backward may restore all M saved inputs before its first run: the footprint's boundary
    # term, M x (in + out), holds them. Growing in_1 by 1 B per micro-batch grows stage 1's
    # backward footprint by M bytes.
    ls = [layer("a", out=8), layer("b", out=4)]
    big = [layer("a", out=8 + 4), layer("b", out=4)]  # whole batch: +1 B per micro-batch at M = 4
    one, two = (evaluate(problem(x, m=4), (0, 1)) for x in (ls, big))
    assert two.bwd_mem[1] - one.bwd_mem[1] == pytest.approx(4 * 1)


# ------------------------------------------------------------------------------ errors
def test_evaluate_rejects_malformed_boundaries():
    with pytest.raises(PlanError, match="must start at 0"):
        evaluate(problem([layer("a"), layer("b")]), (1,))
    with pytest.raises(PlanError, match="increase strictly"):
        evaluate(problem([layer("a"), layer("b")]), (0, 0))


def test_a_negative_input_size_is_refused():
    with pytest.raises(PlanError, match="input_bytes=-1"):
        problem([layer("a")], input_bytes=-1)
