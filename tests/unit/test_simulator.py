"""The step simulator (mobius_fx.sim.simulator): the Mobius schedule, the baselines, the physics."""

import dataclasses
import json
import math
import random
import time
from collections import Counter

import pytest

from mobius_fx.planning.costs import LayerCost
from mobius_fx.errors import MobiusError, PlanError
from mobius_fx.planning.plans import build_plan
from mobius_fx.planning.step_memory import MemoryModel, stage_memory
from mobius_fx import schedules
from mobius_fx.planning.host_step import HOST_COPY_BANDWIDTH, HOST_COPY_KINDS, TOUCHED_BYTES, host_copy_bytes
from mobius_fx.sim.simulator import simulate
from mobius_fx.planning.host_step import CPU_ADAM_BANDWIDTH
from mobius_fx.topology.server import Topology
from mobius_fx.topology.schema import HostFigures
from mobius_fx.precision import Precision

GB = 1e9
# The schedule model (docs/schedule.md) and the partitioner's have no host copies: tests of the
# network and the schedule against them simulate without (the copies are tested on their own).
NO_HOST_COPIES = dict.fromkeys(HOST_COPY_KINDS, 0)


# ------------------------------------------------------------------------------- helpers
def make_layers(n, *, f=0.01, b=0.03, w=100e6, out=1e6, rng=None):
    """n layers with whole-batch costs; random around the given numbers when `rng` is set."""
    def r(x):
        return x * rng.uniform(0.2, 2.0) if rng else x
    return [LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, r(f), r(b), int(r(w)), int(r(w)), int(r(out)), int(out))
            for i in range(n)]


def make_plan(topo, layers, cuts, m, *, order=None, dtype=None):
    order = order or [g.name for g in topo.gpus]
    return build_plan(layers, cuts, order=order, topology=topo, microbatches=m, step_time=0.0,
                      precision=Precision.of(dtype), input_bytes=1000, memory_fraction=0.99)


def unshared_topology(n, *, bw=10 * GB, nvlink=50 * GB):
    """Every GPU on its own host link, NVLink between every pair: no link is shared by two GPUs."""
    nodes = [{"name": "cpu0", "kind": "root_complex"}]
    nodes += [{"name": f"gpu{i}", "kind": "gpu", "memory": "24GiB", "spec": "rtx3090"} for i in range(n)]
    links = [{"a": "cpu0", "b": f"gpu{i}", "bandwidth_gbps": bw / GB} for i in range(n)]
    links += [{"a": f"gpu{i}", "b": f"gpu{j}", "kind": "nvlink", "bandwidth_gbps": nvlink / GB}
              for i in range(n) for j in range(i + 1, n)]
    return Topology.from_dict({"name": "unshared", "p2p": True, "nodes": nodes, "links": links})


def schedule_model(plan, topo, *, gradient_queue=True):
    """docs/schedule.md's recurrences (least start times). With `gradient_queue` the end of
    the step is when the last gradient download ends (each GPU's download link serves its
    stages' gradients in backward order); without it, the doc's `B[0][M-1] + b_0 + G_0/down_0`."""
    st, n, m = plan.stages, plan.num_gpus, plan.microbatches
    s = len(st)
    up = [topo.bandwidth("host", x.gpu) for x in st]

    def hop(a, b, nbytes):
        return 0.0 if st[a].gpu == st[b].gpu else nbytes / topo.bandwidth(st[a].gpu, st[b].gpu)

    F = []
    for k in range(s):
        if k < n:
            t = st[k].param_bytes / up[k]
        else:
            end = F[k - n][m - 1] + st[k - n].fwd_time
            p = min(st[k].param_bytes, up[k] * (end - F[k - n][0]))
            t = end + (st[k].param_bytes - p) / up[k]
        row = []
        for i in range(m):
            if k:
                t = max(t, F[k - 1][i] + st[k - 1].fwd_time + hop(k - 1, k, st[k - 1].output_bytes))
            row.append(t)
            t += st[k].fwd_time
        F.append(row)
    B = [None] * s
    for k in reversed(range(s)):
        if k == s - 1:
            t = F[k][m - 1] + st[k].fwd_time
        elif k >= s - n:
            t = 0.0
        else:
            end = B[k + n][m - 1] + st[k + n].bwd_time
            q = min(st[k].param_bytes, up[k] * (end - B[k + n][0]))
            t = end + (st[k].param_bytes - q) / up[k]
        row = []
        for i in range(m):
            if k < s - 1:
                t = max(t, B[k + 1][i] + st[k + 1].bwd_time + hop(k + 1, k, st[k].output_bytes))
            row.append(t)
            t += st[k].bwd_time
        B[k] = row
    down = [topo.bandwidth(x.gpu, "host") for x in st]
    if not gradient_queue:
        return B[0][m - 1] + st[0].bwd_time + st[0].grad_bytes / down[0]
    done = {}
    for k in reversed(range(s)):
        done[k] = max(B[k][m - 1] + st[k].bwd_time, done.get(k + n, 0.0)) + st[k].grad_bytes / down[k]
    return max(done.values())


@pytest.fixture(scope="module")
def testbed():
    return Topology.preset("mobius-testbed")


@pytest.fixture(scope="module")
def testbed_plan(testbed):
    return make_plan(testbed, make_layers(48, w=200e6, out=8e6), list(range(0, 48, 2)), 4, dtype="float16")


def events(result, kind, **where):
    return [e for e in result.events if e.kind == kind and all(getattr(e, k) == v for k, v in where.items())]


# ------------------------------------------------------------------------- the mobius plan
def test_mobius_moves_exactly_the_plans_transfers(testbed_plan):
    r = simulate(testbed_plan)
    assert r.link_bytes == testbed_plan.link_bytes()


def per_op(items):
    """(kind, phase, stage) -> (count, bytes) of (kind, phase, stage, bytes) items."""
    count, nbytes = Counter(), Counter()
    for kind, phase, stage, b in items:
        count[(kind, phase, stage)] += 1
        nbytes[(kind, phase, stage)] += b
    return count, nbytes


@pytest.mark.parametrize("schedule", ["mobius", "mobius-noprefetch"])
@pytest.mark.parametrize("gpus", [8, 1])
def test_mobius_tasks_are_one_per_op_of_the_plans_schedule(testbed, schedule, gpus):
    # The simulator builds its Mobius tasks from plan.schedule(): a compute task per `run`, a
    # flow per copy that moves bytes (named after its op), nothing else that computes or moves.
    plan = make_plan(testbed, make_layers(24, w=200e6, out=8e6), list(range(0, 24, 2)), 3, dtype="float16",
                     order=[g.name for g in testbed.gpus][:gpus])
    ir = plan.schedule()
    r = simulate(plan, schedule=schedule)
    want = per_op((o.kind, o.phase, o.stage, o.bytes) for o in ir.ops if o.kind == "run" or (o.direction and o.bytes))
    got = per_op(("run" if e.kind == "compute" else e.name.split()[0], e.phase, e.stage, e.bytes)
                 for e in r.events if e.kind in ("compute", "prefetch", "activation", "gradient"))
    assert got == want
    busy = Counter()
    for e in events(r, "compute"):
        busy[(e.phase, e.stage)] += e.end - e.start
    for s in plan.stages:  # each run takes its stage's per-micro-batch time
        assert busy[("forward", s.index)] == pytest.approx(plan.microbatches * s.fwd_time)
        assert busy[("backward", s.index)] == pytest.approx(plan.microbatches * s.bwd_time)


def test_mobius_tasks_are_checked_against_the_plans_transfers(testbed_plan):
    # _check_transfers compares the tasks built from the IR with plan.transfers: a plan whose
    # table lost a row (or was built for other stages) is refused.
    rows = list(testbed_plan.transfers)
    rows.remove(next(t for t in rows if t.kind == "gradient"))
    short = dataclasses.replace(testbed_plan, transfers=tuple(rows))
    with pytest.raises(MobiusError, match="plan.transfers differ"):
        simulate(short)


def test_mobius_is_never_faster_than_the_plans_lower_bound(testbed_plan):
    assert simulate(testbed_plan).pipeline_time >= testbed_plan.lower_bound() * (1 - 1e-9)


def test_mobius_agrees_with_the_schedule_model_when_no_link_is_shared():
    rng = random.Random(7)
    for _ in range(20):
        n, nl, m = rng.randint(1, 4), rng.randint(2, 10), rng.randint(1, 6)
        topo = unshared_topology(n)
        cuts = [0] + sorted(rng.sample(range(1, nl), rng.randint(1, nl) - 1))
        plan = make_plan(topo, make_layers(nl, rng=rng), cuts, m)
        model = schedule_model(plan, topo)
        # Only the saved-input/output transfers the model ignores differ: measured <= 0.2%.
        assert simulate(plan, host_copies=NO_HOST_COPIES).pipeline_time == pytest.approx(model, rel=0.02)


def test_schedule_model_makespan_misses_a_later_gradient_download_of_another_stage():
    # Stage 1 has big gradients and finishes its backward just before stage 0: its download
    # ends after stage 0's, which the doc's makespan (stage 0 only) does not see.
    topo = unshared_topology(2)
    layers = make_layers(2, f=0.01, b=0.03, w=100e6)
    layers[1] = dataclasses.replace(layers[1], grad_bytes=int(2e9))
    plan = make_plan(topo, layers, [0, 1], 2)
    sim = simulate(plan, host_copies=NO_HOST_COPIES).pipeline_time
    assert sim > 1.5 * schedule_model(plan, topo, gradient_queue=False)
    assert sim == pytest.approx(schedule_model(plan, topo), rel=0.01)


def test_simulation_is_never_faster_than_the_partitioners_model():
    from mobius_fx.planning.step_model import evaluate, PartitionProblem

    rng = random.Random(3)
    for _ in range(10):
        n, nl, m = rng.randint(1, 3), rng.randint(2, 8), rng.randint(1, 4)
        topo = unshared_topology(n)
        cuts = [0] + sorted(rng.sample(range(1, nl), rng.randint(1, nl) - 1))
        layers = make_layers(nl, rng=rng)
        problem = PartitionProblem.from_topology(layers, topo, microbatches=m, memory_fraction=0.99)
        ev = evaluate(problem, cuts)
        if ev is not None:
            assert simulate(make_plan(topo, layers, cuts, m), host_copies=NO_HOST_COPIES).pipeline_time >= \
                ev.makespan * (1 - 1e-9)


def test_backward_waits_for_the_next_stage_even_when_no_gradient_bytes_cross():
    topo = unshared_topology(2)
    plan = make_plan(topo, make_layers(2, out=0), [0, 1], 1)
    r = simulate(plan)
    (b0,) = events(r, "compute", phase="backward", stage=0)
    (b1,) = events(r, "compute", phase="backward", stage=1)
    assert b0.start >= b1.end


def test_forward_prefetch_starts_when_the_stage_n_earlier_starts():
    topo = unshared_topology(2)
    plan = make_plan(topo, make_layers(6), [0, 1, 2, 3, 4, 5], 3)
    r = simulate(plan, host_copies=NO_HOST_COPIES)
    for k in range(2, 6):
        (pre,) = events(r, "prefetch", phase="forward", stage=k)
        (first,) = events(r, "compute", phase="forward", stage=k - 2, microbatch=0)
        assert pre.start == pytest.approx(first.start)


def test_at_most_two_stages_are_resident_on_a_gpu(testbed):
    plan = make_plan(testbed, make_layers(32, w=300e6), list(range(32)), 2)
    r = simulate(plan)
    for gpu in plan.order:
        changes = [(e.start, 1, e.stage) for e in events(r, "prefetch", gpu=gpu)]
        changes += [(e.start, 0, e.stage) for e in events(r, "evict", gpu=gpu)]
        resident = set()
        for _, up, stage in sorted(changes):
            resident = resident | {stage} if up else resident - {stage}
            assert len(resident) <= 2


def test_gpu_busy_is_the_plans_compute(testbed_plan):
    r = simulate(testbed_plan)
    m = testbed_plan.microbatches
    want = sum(m * (s.fwd_time + s.bwd_time) for s in testbed_plan.stages)
    assert sum(r.gpu_busy.values()) == pytest.approx(want)


def test_simulating_on_a_slower_topology_takes_longer():
    topo = Topology.virtual(gpus=2, bandwidth=16 * GB)
    plan = make_plan(topo, make_layers(8, w=400e6), list(range(0, 8, 2)), 2)
    slow = Topology.virtual(gpus=2, bandwidth=4 * GB)
    assert simulate(plan, topology=slow).pipeline_time > simulate(plan).pipeline_time


# ------------------------------------------------------------------------------ baselines
def test_noprefetch_uploads_wait_for_the_gpu_to_finish_its_previous_stage():
    topo = unshared_topology(2)
    plan = make_plan(topo, make_layers(6), list(range(6)), 3)
    r = simulate(plan, schedule="mobius-noprefetch")
    for k in range(2, 6):
        (pre,) = events(r, "prefetch", phase="forward", stage=k)
        (last,) = events(r, "compute", phase="forward", stage=k - 2, microbatch=2)
        assert pre.start >= last.end - 1e-12
    assert r.pipeline_time > simulate(plan).pipeline_time


def test_noprefetch_moves_the_same_bytes_as_mobius(testbed_plan):
    assert simulate(testbed_plan, schedule="mobius-noprefetch").link_bytes == testbed_plan.link_bytes()


def test_identity_map_runs_stage_k_on_the_kth_gpu(testbed):
    order = ["gpu0", "gpu4", "gpu1", "gpu5", "gpu2", "gpu6", "gpu3", "gpu7"]
    plan = make_plan(testbed, make_layers(16), list(range(16)), 2, order=order)
    r = simulate(plan, schedule="mobius-identity-map")
    for e in events(r, "compute"):
        assert e.gpu == f"gpu{e.stage % 8}"


def test_roundpipe_continues_the_rotation_into_backward(testbed):
    plan = make_plan(testbed, make_layers(12), list(range(12)), 2)
    r = simulate(plan, schedule="roundpipe")
    s = 12
    for e in events(r, "compute"):
        slot = e.stage if e.phase == "forward" or e.stage == s - 1 else 2 * s - 2 - e.stage
        assert e.gpu == f"gpu{slot % 8}"


def test_roundpipe_fuses_the_last_stage_forward_into_its_backward(testbed):
    plan = make_plan(testbed, make_layers(12), list(range(12)), 2)
    r = simulate(plan, schedule="roundpipe")
    assert not events(r, "compute", phase="forward", stage=11)
    assert len(events(r, "prefetch", stage=11)) == 1
    assert len(events(r, "prefetch", stage=0)) == 2  # every other stage uploads for each slot


def test_zero3_every_gpu_fetches_every_layer_and_sends_its_gradients(testbed):
    layers = make_layers(8, w=100e6)
    plan = make_plan(testbed, layers, [0, 4], 2)
    r = simulate(plan, schedule="zero3-offload")
    w = sum(s.param_bytes for s in plan.stages)
    g = sum(s.grad_bytes for s in plan.stages)
    last = layers[-1].param_bytes
    for gpu in testbed.gpus:
        into = sum(e.bytes for e in events(r, "prefetch", gpu=gpu.name))
        assert into == pytest.approx(2 * w - last, rel=1e-6)  # the last layer stays for backward
        assert sum(e.bytes for e in events(r, "gradient", gpu=gpu.name)) == pytest.approx(g, rel=1e-6)


def test_zero3_loads_the_shared_uplink_n_times_more_than_mobius(testbed_plan):
    mobius = simulate(testbed_plan).link_bytes[("cpu0", "sw0")]
    zero3 = simulate(testbed_plan, schedule="zero3-offload").link_bytes[("cpu0", "sw0")]
    assert zero3 > 3 * mobius


def test_gpipe_moves_no_weights(testbed_plan):
    r = simulate(testbed_plan, schedule="gpipe")
    assert not events(r, "prefetch") and not events(r, "gradient")
    assert sum(r.link_bytes.values()) < 0.01 * sum(simulate(testbed_plan).link_bytes.values())


def test_gpipe_cuts_the_layers_into_one_balanced_stage_per_gpu(testbed_plan):
    r = simulate(testbed_plan, schedule="gpipe")
    busy = list(r.gpu_busy.values())
    assert len(busy) == 8 and max(busy) == pytest.approx(min(busy))


def test_gpipe_uses_the_stages_when_the_plan_has_no_layer_table(testbed_plan):
    plan = dataclasses.replace(testbed_plan, layers=())
    r = simulate(plan, schedule="gpipe")
    assert sum(r.gpu_busy.values()) == pytest.approx(sum(simulate(testbed_plan).gpu_busy.values()))


def test_gpipe_that_does_not_fit_names_the_stage_and_the_gpu():
    topo = Topology.virtual(gpus=2, memory="1GiB")
    plan = make_plan(topo, make_layers(4, w=300e6), [0, 1, 2, 3], 1)
    with pytest.raises(PlanError, match=r"gpipe stage 0 .*on gpu0 needs .* but gpu0 has"):
        simulate(plan, schedule="gpipe")


@pytest.mark.parametrize("microbatches", [1, 4])
def test_gpipe_checks_memory_with_the_plans_own_footprint(microbatches):
    """A GPipe stage needs what `plans.stage_memory` says for its layers (one formula for
    every schedule) plus its optimizer state: just under that it is refused, at it it runs."""
    topo = Topology.virtual(gpus=2, memory="8GiB")
    layers = [dataclasses.replace(l, peak_bytes=int(5e6 * (i + 1))) for i, l in enumerate(make_layers(4, w=10e6))]
    plan = make_plan(topo, layers, [0, 1, 2, 3], microbatches)
    mm = MemoryModel(microbatches)
    need = max(stage_memory(layers[a:z], layers[a - 1] if a else None, mm)[1]
               + sum(l.grad_bytes for l in layers[a:z]) / 4 * 8 for a, z in ((0, 2), (2, 4)))

    def with_capacity(cap):
        return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, capacity=cap) for s in plan.stages))

    simulate(with_capacity(need * (1 + 1e-9)), schedule="gpipe", optimizer="adam")
    with pytest.raises(PlanError, match="gpipe stage 1"):
        simulate(with_capacity(need * (1 - 1e-9)), schedule="gpipe", optimizer="adam")


@pytest.mark.parametrize("schedule", schedules.names())
def test_every_schedule_is_bounded_by_its_own_work(testbed_plan, schedule):
    r = simulate(testbed_plan, schedule=schedule)
    assert r.pipeline_time >= r.bound * (1 - 1e-9)
    assert r.pipeline_time >= max(r.gpu_busy.values()) * (1 - 1e-9)


# ---------------------------------------------------------------------- optimizer, results
def test_optimizer_time_is_the_hand_over_then_master_bytes_times_adam_traffic_over_bandwidth(testbed_plan):

    masters = sum(l.grad_bytes for l in testbed_plan.layers)  # fp32, traced
    handover = host_copy_bytes("handover", testbed_plan.precision.stream_bytes)  # the .grad made fp32
    assert handover == (0 if testbed_plan.precision.stream_bytes == 4 else 6)
    for bw in (10 * GB, CPU_ADAM_BANDWIDTH):
        r = simulate(testbed_plan, cpu_adam_bandwidth=bw) if bw != CPU_ADAM_BANDWIDTH else simulate(testbed_plan)
        assert r.optimizer_time == pytest.approx(masters / 4 * (handover / HOST_COPY_BANDWIDTH + 28 / bw))
    assert simulate(testbed_plan, optimizer="none").optimizer_time == 0


def test_the_default_optimizer_speed_is_the_measured_fused_adamw():
    # 3,000,238,080 fp32 masters x 28 B in 0.756 s (the H200 host, fused AdamW): 111 GB/s, not
    # the 20 GB/s assumed before; the host copies at the measured hand-over, 18 GB in 0.6537 s.
    assert CPU_ADAM_BANDWIDTH == pytest.approx(3_000_238_080 * 28 / 0.756) and 110e9 < CPU_ADAM_BANDWIDTH < 112e9
    assert HOST_COPY_BANDWIDTH == pytest.approx(3_000_238_080 * 6 / 0.6537)


def test_step_time_is_pipeline_then_hand_over_then_optimizer(testbed_plan):
    r = simulate(testbed_plan)
    assert r.step_time == pytest.approx(r.pipeline_time + r.optimizer_time)
    (opt,) = events(r, "optimizer")
    handed = [e for e in r.events if e.kind == "host-copy" and e.name == "hand-over"]
    start = handed[0].end if handed else r.pipeline_time
    assert opt.start == pytest.approx(start) and (not handed or handed[0].start == pytest.approx(r.pipeline_time))


def write_topology(tmp_path, topo, host):
    path = tmp_path / "server.json"
    path.write_text(topo.with_host(host).to_json())
    return str(path)


def test_simulate_reads_the_host_section_and_says_so(testbed, testbed_plan, tmp_path):
    """A topology JSON with measured host figures changes the optimizer's time by the ratio of
    the speeds and the host copies' by theirs; explicit arguments win; the result names the
    source of each figure."""
    # "none": torch's step and the host copies around it (the hand-over, the pinning)
    default = simulate(testbed_plan, topology=testbed, optimizer_overlap="none")
    host = HostFigures(optimizer="adamw", implementation="fused", optimizer_bytes_per_s=CPU_ADAM_BANDWIDTH / 4,
                       host_copy_bytes_per_s=HOST_COPY_BANDWIDTH / 3, cores=16)
    measured = simulate(testbed_plan, topology=write_topology(tmp_path, testbed, host), optimizer_overlap="none")

    def busy(r, kind, copy=None):
        return sum(e.end - e.start for e in r.events if e.kind == kind and (copy is None or copy in e.name))

    assert busy(default, "optimizer") > 0 and busy(default, "host-copy", "hand-over") > 0
    assert busy(measured, "optimizer") == pytest.approx(4 * busy(default, "optimizer"), rel=1e-9)
    assert busy(measured, "host-copy", "hand-over") == pytest.approx(3 * busy(default, "host-copy", "hand-over"),
                                                                     rel=1e-9)
    assert measured.step_time > default.step_time
    assert (measured.optimizer_bandwidth, measured.host_copy_bandwidth) == (CPU_ADAM_BANDWIDTH / 4,
                                                                            HOST_COPY_BANDWIDTH / 3)
    assert measured.host_sources == {"optimizer": "measured on this host: adamw, fused",
                                     "host copies": "measured on this host"}
    assert default.host_sources["optimizer"].startswith("default") and default.host_sources["host copies"].startswith(
        "default")
    assert "measured on this host" in measured.summary() and "default" in default.summary()
    given = simulate(testbed_plan, topology=write_topology(tmp_path, testbed, host), optimizer_overlap="none",
                     cpu_adam_bandwidth=CPU_ADAM_BANDWIDTH, host_copy_bandwidth=HOST_COPY_BANDWIDTH)
    assert given.step_time == pytest.approx(default.step_time, rel=1e-12)
    assert given.host_sources == {"optimizer": "given", "host copies": "given"}
    # a host section with only the cores (or none of the rates) keeps the defaults
    cores_only = simulate(testbed_plan, topology=testbed.with_host(HostFigures(cores=2)), optimizer_overlap="none")
    assert cores_only.step_time == pytest.approx(default.step_time, rel=1e-12)


def test_the_host_copies_are_where_the_runtime_makes_them(testbed_plan):

    s = testbed_plan.precision.stream_bytes
    master = {st.index: st.grad_bytes / (s / 4) for st in testbed_plan.stages}
    secs = lambda kind, k: master[k] / 4 * host_copy_bytes(kind, s) / HOST_COPY_BANDWIDTH
    copies = lambda r, kind: [e for e in r.events if e.kind == "host-copy" and e.name.startswith(kind)]
    # "none": each stage's streamed copy pinned by its GPU's upload worker before its first upload
    r = simulate(testbed_plan)
    pinned = copies(r, "pin")
    assert sorted(e.stage for e in pinned) == sorted(k for k in master if master[k] > 0)
    for e in pinned:
        assert e.end - e.start == pytest.approx(secs("pin", e.stage))
        for up in events(r, "prefetch", stage=e.stage):
            assert up.start >= e.end - 1e-12
    assert r.host_copy_time == pytest.approx(sum(e.end - e.start for e in r.events if e.kind == "host-copy"))
    bare = simulate(testbed_plan, host_copies={"pin": 0})
    assert not copies(bare, "pin") and bare.pipeline_time < r.pipeline_time
    # "none": the hand-over on the main thread after the pipeline (read s, write 4), then torch's
    # step (28 B) -- the optimizer's time is exactly their bytes over their speeds
    assert s < 4
    (h,), (o,) = copies(r, "hand-over"), events(r, "optimizer")
    total = sum(master.values())
    assert h.end - h.start == pytest.approx(total / 4 * (s + 4) / HOST_COPY_BANDWIDTH)
    assert o.end - o.start == pytest.approx(total / 4 * 28 / CPU_ADAM_BANDWIDTH) and o.start >= h.end - 1e-12
    # "sync" with half-precision gradients: per stage ONE fused pass (runtime/host_optimizer.py):
    # reads the fp32 .grad the GPUs widened and downloaded into it (4 B), p, m, v (12), writes p, m,
    # v and the s-byte streamed copy (12 + s): 28 + 4 - s B (30 in bf16/fp16), at the optimizer's
    # speed; no host copy. The gradient downloads carry 4 B per parameter
    sync = simulate(testbed_plan, optimizer_overlap="sync", widen_downloads=True)
    assert sync.host_copy_time == 0 and not [e for e in sync.events if e.kind == "host-copy"]
    for k in (k for k in master if master[k] > 0):
        (o,) = [e for e in events(sync, "optimizer") if e.stage == k]
        assert o.stream == "host/optimizer"
        assert o.end - o.start == pytest.approx(master[k] / 4 * (12 + 4 + 12 + s) / CPU_ADAM_BANDWIDTH)
        assert sum(e.bytes for e in events(sync, "gradient", stage=k)) == pytest.approx(master[k], abs=8)
    assert sync.host_busy == pytest.approx(total / 4 * (28 + 4 - s) / CPU_ADAM_BANDWIDTH)
    # widen_downloads=False (opt.widen_downloads = False): s-byte downloads, the pass reads them and
    # writes the fp32 .grad (12 + s + 12 + s + 4: 28 + 4 B)
    narrow = simulate(testbed_plan, optimizer_overlap="sync", widen_downloads=False)
    assert narrow.host_busy == pytest.approx(total / 4 * 32 / CPU_ADAM_BANDWIDTH)
    assert sum(e.bytes for e in events(narrow, "gradient")) == pytest.approx(total * s / 4, abs=64)
    # keep_grads=False: no .grad written, 28 B (and so host_copies={"grad": 0})
    nograd = simulate(testbed_plan, optimizer_overlap="sync", keep_grads=False)
    assert nograd.host_busy == pytest.approx(total / 4 * 28 / CPU_ADAM_BANDWIDTH)
    assert simulate(testbed_plan, optimizer_overlap="sync", host_copies={"grad": 0}).host_busy == \
        pytest.approx(nograd.host_busy, rel=1e-12)
    # "async", keep_grads=False: the same fused pass out of place (28 B) reading the held
    # downloads, from the start, beside the pipeline; no shadow copy, hand-over or pin: the step
    # is max(pipeline, pass)
    r = simulate(testbed_plan, optimizer_overlap="async", keep_grads=False)
    (opt,) = events(r, "optimizer")
    assert not [e for e in r.events if e.kind == "host-copy"] and opt.start == 0.0
    assert opt.end - opt.start == pytest.approx(total / 4 * 28 / CPU_ADAM_BANDWIDTH)
    assert r.step_time == pytest.approx(max(r.pipeline_time, opt.end))
    # "async" by default (keep_grads, widened downloads): the .grad comes from the GPUs in fp32, no
    # hand-over; the pass reads it (4 - s bytes more than the download)
    wide = simulate(testbed_plan, optimizer_overlap="async", widen_downloads=True)
    (opt,) = events(wide, "optimizer")
    assert not [e for e in wide.events if e.kind == "host-copy"]
    assert opt.start == 0.0 and opt.end - opt.start == pytest.approx(total / 4 * (28 + 4 - s) / CPU_ADAM_BANDWIDTH)
    # "async" with widen_downloads=False: each stage's downloads converted into the fp32 .grad once
    # they landed (read s, write 4), on one thread in landing order, while the GPUs go on; the
    # pass reads that .grad (4 - s bytes more)
    kept = simulate(testbed_plan, optimizer_overlap="async", widen_downloads=False)
    (opt,), handed = events(kept, "optimizer"), copies(kept, "hand-over")
    assert opt.start == 0.0 and opt.end - opt.start == pytest.approx(total / 4 * (28 + 4 - s) / CPU_ADAM_BANDWIDTH)
    assert sorted(h.stage for h in handed) == sorted(k for k in master if master[k] > 0)
    for h in handed:
        landed = max(e.end for e in kept.events if e.kind == "gradient" and e.stage == h.stage)
        assert h.stream == "host/handover" and h.start >= landed - 1e-12
        assert h.end - h.start == pytest.approx(master[h.stage] / 4 * (s + 4) / HOST_COPY_BANDWIDTH)
    assert min(h.start for h in handed) < kept.pipeline_time  # beside the GPUs, not after them
    assert kept.step_time == pytest.approx(max(kept.pipeline_time, opt.end, *(h.end for h in handed)))
    assert r.pipeline_time == pytest.approx(simulate(testbed_plan, host_copies={"pin": 0}).pipeline_time)
    with pytest.raises(MobiusError, match="host_copies has 'grads'"):
        simulate(testbed_plan, host_copies={"grads": 0})
    with pytest.raises(MobiusError, match=r"host_copies\['pin'\] is -1"):
        simulate(testbed_plan, host_copies={"pin": -1})
    with pytest.raises(MobiusError, match="'staging' is now called 'pin'"):  # the old name of the kind
        simulate(testbed_plan, host_copies={"staging": 0})


def test_critical_path_adds_up_to_the_step_time(testbed_plan):
    for schedule in ("mobius", "zero3-offload", "gpipe"):
        r = simulate(testbed_plan, schedule=schedule)
        assert sum(r.critical_path.values()) == pytest.approx(r.step_time)


def test_critical_path_of_zero3_runs_through_the_shared_uplink(testbed_plan):
    r = simulate(testbed_plan, schedule="zero3-offload", optimizer="none")
    # Its uploads go down the uplink, its host-routed all-gather sends (no P2P) come back up it.
    assert max(r.critical_path, key=r.critical_path.get) in ("cpu0->sw0", "cpu1->sw1", "sw0->cpu0", "sw1->cpu1")


def test_chrome_trace_has_a_track_per_gpu_stream_and_per_link(testbed_plan, tmp_path):
    r = simulate(testbed_plan)
    path = tmp_path / "trace.json"
    r.save_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    threads = {(procs[e["pid"]], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    for gpu in testbed_plan.order:
        for stream in ("compute", "upload", "download", "activation"):
            assert (gpu, stream) in threads
    for u, v in r.link_bytes:
        assert ("links", f"{u} -> {v}") in threads
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 and (e["pid"], e["tid"]) for e in spans)
    assert len(threads) == len({(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["name"] == "thread_name"})


def test_summary_names_the_schedule_and_the_busiest_link(testbed_plan):
    text = simulate(testbed_plan).summary()
    assert text.startswith("mobius: step") and "busiest link" in text


def test_unknown_schedule_lists_the_valid_ones(testbed_plan):
    with pytest.raises(MobiusError, match="valid schedules: mobius"):
        simulate(testbed_plan, schedule="pipedream")


def test_unknown_optimizer_is_an_error(testbed_plan):
    with pytest.raises(MobiusError, match="unknown optimizer 'lion'"):
        simulate(testbed_plan, optimizer="lion")


def test_a_large_plan_simulates_in_seconds(testbed):
    plan = make_plan(testbed, make_layers(130, w=436e6, out=32e6), list(range(0, 128, 2)), 8, dtype="float16")
    t0 = time.perf_counter()
    for schedule in ("mobius", "zero3-offload", "roundpipe"):
        simulate(plan, schedule=schedule)
    assert time.perf_counter() - t0 < 5.0
    assert math.isfinite(simulate(plan).step_time)


# ------------------------------------------------------------------ the optimizer's overlap
@pytest.mark.parametrize("schedule", ["mobius", "roundpipe", "split-head"])
def test_a_synchronous_overlap_steps_each_stage_once_its_gradients_have_landed(testbed_plan, schedule):
    # Per-stage steps on the one host optimizer, each after its stage's gradient downloads:
    # the step ends sooner than stepping everything after the pipeline, never before it, and
    # the optimizer does the same work.
    serial = simulate(testbed_plan, schedule=schedule, optimizer_overlap="none")
    sync = simulate(testbed_plan, schedule=schedule, optimizer_overlap="sync", widen_downloads=True)
    grads_done: dict[int, float] = {}
    for e in sync.events:
        if e.kind == "gradient":
            grads_done[e.stage] = max(grads_done.get(e.stage, 0.0), e.end)
    steps = [e for e in sync.events if e.kind == "optimizer"]
    assert sorted(e.stage for e in steps) == sorted(grads_done)  # one per stage with gradients
    for e in steps:
        assert e.start >= grads_done[e.stage] - 1e-12
    work = lambda r: sum(e.end - e.start for e in r.events if e.kind == "optimizer")
    # the same step, as one fused pass: the fp32 .grad the GPUs widened read (4 B, as torch's), the
    # s-byte streamed copy written (28 + s against torch's 28)
    s = testbed_plan.precision.stream_bytes
    fused = TOUCHED_BYTES["adam"] + s
    assert work(sync) == pytest.approx(work(serial) * fused / TOUCHED_BYTES["adam"], rel=1e-9)
    # sync's step refreshes the streamed copies, so its uploads stage nothing: never a slower pipeline
    # with the same downloads (widen_downloads=False: s-byte ones), the same one when nothing is
    # pinned in either; the widened downloads (4 B) never make it faster
    narrow = simulate(testbed_plan, schedule=schedule, optimizer_overlap="sync", widen_downloads=False)
    assert narrow.pipeline_time <= serial.pipeline_time and narrow.pipeline_time <= sync.pipeline_time + 1e-12
    bare = {"pin": 0}
    assert simulate(testbed_plan, schedule=schedule, optimizer_overlap="sync", host_copies=bare,
                    widen_downloads=False).pipeline_time == \
        pytest.approx(simulate(testbed_plan, schedule=schedule, host_copies=bare).pipeline_time, rel=1e-12)
    # the per-stage passes end sooner than one step after the pipeline, with the host copies
    # serial mode makes and without them
    none = {k: 0 for k in HOST_COPY_KINDS}
    assert sync.pipeline_time <= sync.step_time < serial.step_time
    assert simulate(testbed_plan, schedule=schedule, optimizer_overlap="sync", host_copies=none).step_time < \
        simulate(testbed_plan, schedule=schedule, host_copies=none).step_time


def test_an_asynchronous_optimizer_takes_the_longer_of_the_pipeline_and_the_update(testbed_plan):
    # Staleness 1: step t's update (one fused pass out of place into the shadow) runs while step t+1
    # computes, so a step is the longer of the two; with a slow CPU
    # optimizer the update is the longer one.
    for bw in (CPU_ADAM_BANDWIDTH, CPU_ADAM_BANDWIDTH / 100):
        r = simulate(testbed_plan, optimizer_overlap="async", cpu_adam_bandwidth=bw)
        (opt,) = events(r, "optimizer")
        handed = [e for e in r.events if e.kind == "host-copy" and e.name.startswith("hand-over")]
        main = max([r.pipeline_time, *(e.end for e in handed)])  # keep_grads' hand-overs as stages land
        assert r.step_time == pytest.approx(max(main, opt.end), rel=1e-9)
    assert opt.end > main  # the slow optimizer case is the one it bounds


def test_zero3_keeps_deepspeeds_step_after_the_pipeline_whatever_the_overlap(testbed_plan):
    a, b, c = (simulate(testbed_plan, schedule="zero3-offload", optimizer_overlap=m) for m in ("none", "async", "sync"))
    assert a.step_time == pytest.approx(b.step_time, rel=1e-12) == pytest.approx(c.step_time, rel=1e-12)
    # as its authors run it: the hand-over after the pipeline (s + 4 B at the copies' speed), then
    # DeepSpeedCPUAdam's pass, Adam's 28 B and the s-byte fp16 copy it writes, at its speed
    s = testbed_plan.precision.stream_bytes
    params = sum(st.grad_bytes for st in testbed_plan.stages) / (s / 4) / 4
    (opt,) = events(a, "optimizer")
    assert opt.end - opt.start == pytest.approx(params * (28 + s) / CPU_ADAM_BANDWIDTH, rel=1e-9)
    assert a.optimizer_time == pytest.approx(params * ((s + 4) / HOST_COPY_BANDWIDTH + (28 + s) / CPU_ADAM_BANDWIDTH),
                                             rel=1e-9)


def test_an_unknown_optimizer_overlap_is_refused():
    plan = make_plan(unshared_topology(1), make_layers(2), [0], 1)
    with pytest.raises(MobiusError, match=r"optimizer_overlap='later'; use one of 'none', 'sync', 'async'"):
        simulate(plan, optimizer_overlap="later")


# ------------------------------------------------------- data parallel across servers (ring)
def _dp_plan(stages=4, *, dtype=None):
    """Compute and PCIe made negligible (1 ns per layer, 1 PB/s links): the step is the NIC's."""
    topo = unshared_topology(2, bw=1e15, nvlink=1e15)
    return make_plan(topo, make_layers(2 * stages, f=1e-9, b=1e-9, w=100e6, out=1e3), list(range(0, 2 * stages, 2)),
                     2, dtype=dtype)


def _ring(nbytes, servers, bandwidth, alpha=0.0):
    """The closed form of a ring all-reduce (reduce-scatter + all-gather) on full-duplex NICs."""
    return 2 * (servers - 1) * alpha + 2 * (servers - 1) / servers * nbytes / bandwidth


@pytest.mark.parametrize("schedule", ["mobius", "roundpipe", "split-head"])
@pytest.mark.parametrize("mode", ["none", "sync", "async"])
def test_one_server_is_exactly_the_single_server_step(testbed_plan, schedule, mode):
    one = simulate(testbed_plan, schedule=schedule, optimizer_overlap=mode)
    assert simulate(testbed_plan, schedule=schedule, optimizer_overlap=mode, servers=1, network="100Gbps") == one
    assert one.servers == 1 and one.allreduce_time == 0 and one.nic_bytes == 0
    assert not events(one, "allreduce")


@pytest.mark.parametrize("servers", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [None, "float16"])
def test_the_nic_time_is_the_ring_all_reduce_closed_form(servers, dtype):
    # No optimizer, negligible compute and PCIe: the step is the NIC carrying every stage's
    # fp32 master gradients, 2(R-1)/R x bytes each way at the network bandwidth, one stage
    # after the other.
    plan = _dp_plan(dtype=dtype)
    masters = sum(l.grad_bytes for l in plan.layers)  # fp32, traced (fp16 streams half of it)
    bw = 12.5e9  # 100 Gbit/s
    r = simulate(plan, optimizer="none", servers=servers, network="100Gbps")
    assert r.allreduce_time == pytest.approx(_ring(masters, servers, bw), rel=1e-12)
    assert r.step_time == pytest.approx(_ring(masters, servers, bw), rel=1e-5)
    assert r.nic_bytes == pytest.approx(2 * (servers - 1) / servers * masters, abs=len(plan.stages))
    assert r.step_time == pytest.approx(r.pipeline_time + r.allreduce_exposed + r.optimizer_time, rel=1e-12)
    per_stage = events(r, "allreduce")
    assert len(per_stage) == plan.num_stages and {e.stream for e in per_stage} == {"host/nic"}
    for e in per_stage:
        assert e.end - e.start == pytest.approx(_ring(plan.stages[e.stage].grad_bytes * (2 if dtype else 1),
                                                      servers, bw), rel=1e-12)
    assert sum(r.critical_path.values()) == pytest.approx(r.step_time)
    assert r.critical_path["network"] == pytest.approx(r.allreduce_time, rel=1e-5)


def test_one_stage_all_reduce_starts_when_its_gradients_land_and_pays_the_latency_per_ring_step():
    plan = _dp_plan(stages=1)
    r = simulate(plan, optimizer="none", servers=4, network=1e9, network_latency=1e-3)
    (ar,) = events(r, "allreduce")
    (grad,) = events(r, "gradient")
    assert ar.start == pytest.approx(grad.end, abs=1e-12)
    assert ar.end - ar.start == pytest.approx(6 * 1e-3 + 1.5 * plan.stages[0].grad_bytes / 1e9, rel=1e-12)


def test_all_reduces_run_one_at_a_time_in_the_order_stages_complete(testbed_plan):
    r = simulate(testbed_plan, servers=4, network="25Gbit/s")
    ars = sorted(events(r, "allreduce"), key=lambda e: e.start)
    assert [e.stage for e in ars] == sorted((e.stage for e in ars), reverse=True)  # backward order
    for a, b in zip(ars, ars[1:]):
        assert b.start >= a.end - 1e-12
    landed = {}
    for e in events(r, "gradient"):
        landed[e.stage] = max(landed.get(e.stage, 0.0), e.end)
    assert all(e.start >= landed[e.stage] - 1e-12 for e in ars)
    assert any(e.start < r.pipeline_time for e in ars)  # overlapped with the backward of earlier stages


@pytest.mark.parametrize("mode", ["none", "sync", "async"])
def test_an_infinitely_fast_network_scales_perfectly(testbed_plan, mode):
    from mobius_fx.sim.report import cluster

    # data parallel downloads the gradients as streamed (the reducer sums them on the host: no
    # widened downloads), so one server is compared without them
    one = simulate(testbed_plan, optimizer_overlap=mode, widen_downloads=False)
    if mode == "sync":  # data-parallel sync takes the runtime's unfused host path (gradients reduced on
        # the host: no finite flag from the GPUs), so compare with 2 servers
        one = simulate(testbed_plan, optimizer_overlap=mode, servers=2, network=math.inf)
    for servers in (2, 4, 16):
        r = simulate(testbed_plan, optimizer_overlap=mode, servers=servers, network=math.inf)
        assert r.step_time == one.step_time and r.allreduce_exposed == 0
        assert simulate(testbed_plan, optimizer_overlap=mode, servers=servers, network=1e18).step_time == \
            pytest.approx(one.step_time, rel=1e-6)
    c = cluster(testbed_plan, 8, math.inf, tokens=1000, optimizer_overlap=mode)
    base = c.efficiency(2)  # 1 but for sync's unfused data-parallel host path and one server's widened downloads
    assert sorted(c.results) == [1, 2, 4, 8] and all(c.efficiency(r) == pytest.approx(base) for r in c.results
                                                     if r > 1) and (mode != "none" or base == pytest.approx(1.0))
    slow = cluster(testbed_plan, 4, "10Gbps", tokens=1000, optimizer_overlap=mode)
    assert slow.efficiency(4) < slow.efficiency(2) < 1.0
    assert slow.throughput(4) == pytest.approx(4 * 1000 / slow.results[4].step_time)


def test_the_all_reduce_delays_its_stages_optimizer_step_in_sync_mode(testbed_plan):
    # Each stage steps once its averaged gradients are back, not when they land from the GPUs;
    # a slower network delays the steps and the step, never the pipeline (one server's downloads as
    # streamed: data parallel does not widen them).
    one = simulate(testbed_plan, optimizer_overlap="sync", widen_downloads=False)
    r = simulate(testbed_plan, optimizer_overlap="sync", servers=4, network="10Gbps")
    reduced = {e.stage: e for e in events(r, "allreduce")}
    steps = events(r, "optimizer")
    assert sorted(e.stage for e in steps) == sorted(reduced)
    for e in steps:
        assert e.start >= reduced[e.stage].end - 1e-12
    assert any(e.start > min(x.start for x in events(one, "optimizer", stage=e.stage)) + 1e-6 for e in steps)
    assert r.pipeline_time == pytest.approx(one.pipeline_time, rel=1e-12)
    assert r.step_time > one.step_time
    assert r.step_time >= max(e.end for e in reduced.values()) + steps[-1].end - steps[-1].start - 1e-9


def test_without_overlap_the_optimizer_steps_after_the_last_all_reduce(testbed_plan):
    r = simulate(testbed_plan, servers=2, network="10Gbps", host_copies={"handover": 0})
    (opt,) = events(r, "optimizer")
    last = max(e.end for e in events(r, "allreduce"))
    assert opt.start == pytest.approx(last) and last > r.pipeline_time
    assert r.allreduce_exposed == pytest.approx(last - r.pipeline_time)
    assert r.optimizer_time == pytest.approx(opt.end - opt.start)
    handed = simulate(testbed_plan, servers=2, network="10Gbps")  # the hand-over after the last all-reduce
    (opt,) = events(handed, "optimizer")
    (h,) = [e for e in handed.events if e.name == "hand-over"]
    assert h.start == pytest.approx(last) and opt.start == pytest.approx(h.end)
    assert "one of 2 data-parallel servers" in r.summary() and "ring all-reduce" in r.summary()


def test_an_asynchronous_optimizer_overlaps_the_all_reduces_too(testbed_plan):
    r = simulate(testbed_plan, servers=4, network="10Gbps", optimizer_overlap="async", keep_grads=False)
    (opt,) = events(r, "optimizer")
    comm_end = max(e.end for e in events(r, "allreduce"))
    assert opt.start == 0.0 and not [e for e in r.events if e.kind == "host-copy"]
    assert r.step_time == pytest.approx(max(comm_end, opt.end))
    # keep_grads (the default): each stage's averaged gradients converted into .grad after its all-reduce
    kept = simulate(testbed_plan, servers=4, network="10Gbps", optimizer_overlap="async")
    handed = [e for e in kept.events if e.kind == "host-copy"]
    reduced = {e.stage: e.end for e in events(kept, "allreduce")}
    assert handed and all(h.name.startswith("hand-over") and h.start >= reduced[h.stage] - 1e-12 for h in handed)
    assert kept.step_time == pytest.approx(max(max(h.end for h in handed), comm_end,
                                               max(e.end for e in events(kept, "optimizer"))))


@pytest.mark.parametrize("kwargs, message", [
    ({"servers": 2}, r"servers=2 needs the network: pass network="),
    ({"servers": 0, "network": 1e9}, r"servers=0; give the number of data-parallel servers, an integer >= 1"),
    ({"servers": 2.0, "network": 1e9}, r"servers=2.0; give the number"),
    ({"servers": 2, "network": "100G"}, r"network '100G' is not a network bandwidth .*'100Gbps'"),
    ({"servers": 2, "network": -1.0}, r"network -1.0 is not a positive, finite bandwidth"),
    ({"servers": 2, "network": 1e9, "schedule": "zero3-offload"}, r"not 'zero3-offload'; simulate 'zero3-offload' "
                                                                  r"with servers=1"),
    ({"servers": 2, "network": 1e9, "network_latency": -1}, r"network_latency=-1; give the seconds one ring step"),
])
def test_bad_data_parallel_arguments_are_refused(kwargs, message):
    plan = make_plan(unshared_topology(1), make_layers(2), [0], 1)
    with pytest.raises(MobiusError, match=message):
        simulate(plan, **kwargs)
