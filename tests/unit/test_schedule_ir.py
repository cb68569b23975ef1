"""The schedule IR (mobius_fx/schedule.py): the order and the bytes of a step, and the plan's
transfer table as a sum over it."""

import pytest
import torch

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.schedule import HOST, StageInput, StageIO, build_schedule
from mobius_fx.zoo import GPT, GPTConfig


def _chain(gpus, w=1000, act=64, out=12):
    return [StageIO(g, w, w, (StageInput(k - 1, act, needs_grad=k > 0),), host_outputs=(out,) if k == len(gpus) - 1
                    else ()) for k, g in enumerate(gpus)]


def _order(ir, place, kind):
    return [o.stage for o in ir.place(place) if o.kind == kind]


def test_each_gpu_prefetches_the_stage_n_ahead_and_evicts_all_but_its_last():
    ir = build_schedule(_chain(["a", "b"] * 3), 2)
    assert _order(ir, "a", "prefetch") == [0, 2, 4, 2, 0]  # forward 0, 2, 4; backward 2, 0
    assert _order(ir, "b", "prefetch") == [1, 3, 5, 3, 1]
    fwd_evicts = [o.stage for o in ir.select(kind="evict", phase="forward")]
    assert fwd_evicts == [0, 1, 2, 3]  # 4 and 5 stay resident for backward
    assert [o.stage for o in ir.select(kind="hold")] == [4, 5]
    assert ir.resident_at_most() == {"a": 2, "b": 2}


def test_forward_runs_every_microbatch_of_a_stage_before_the_next_and_backward_reverses_both():
    ir = build_schedule(_chain(["a", "b", "a"]), 3)
    runs = [(o.phase[0], o.stage, o.microbatch) for o in ir.place("a") if o.kind == "run"]
    assert runs == [("f", 0, 0), ("f", 0, 1), ("f", 0, 2), ("f", 2, 0), ("f", 2, 1), ("f", 2, 2),
                    ("b", 2, 2), ("b", 2, 1), ("b", 2, 0), ("b", 0, 2), ("b", 0, 1), ("b", 0, 0)]


def test_every_dependency_points_back_and_runs_come_after_their_wait():
    ir = build_schedule(_chain(["a", "b"] * 2), 2)
    for o in ir.ops:
        assert all(d < o.index for d in o.deps)
    for o in ir.select(kind="run"):
        waits = [ir.ops[d] for d in o.deps if ir.ops[d].kind == "wait"]
        assert waits and waits[0].stage == o.stage and waits[0].phase == o.phase


def test_bytes_moved_per_gpu_kind_and_stage():
    ir = build_schedule(_chain(["a", "b"]), 2, optimizer=False)
    moved = ir.bytes_moved()
    assert moved[("a", "weight", "h2d", 0)] == (1, 1000)  # stays resident: no backward prefetch
    assert moved[("b", "activation", "d2d", 1)] == (2, 128)  # the forward push from a
    assert moved[("a", "activation", "d2d", 0)] == (2, 128)  # the gradient pushed back from b
    assert moved[("b", "input", "d2h", 1)] == (2, 128) and moved[("b", "input", "h2d", 1)] == (2, 128)
    assert moved[("a", "input", "h2d", 0)] == (2, 128)  # the model input, sent again for recompute
    assert ("a", "input", "d2h", 0) not in moved  # ... but never offloaded: the host has it
    assert moved[("b", "activation", "d2h", 1)] == (2, 24) and moved[("b", "activation", "h2d", 1)] == (2, 24)
    assert moved[("a", "gradient", "d2h", 0)] == (1, 1000)


def test_a_value_read_two_stages_later_goes_through_the_host_both_ways():
    stages = [StageIO("a", 10, 10, (StageInput(-1, 8, needs_grad=False),), host_outputs=(32,)),
              StageIO("b", 10, 10, (StageInput(0, 8),)),
              StageIO("a", 10, 10, (StageInput(1, 8), StageInput(0, 32)), host_outputs=(4,))]
    ir = build_schedule(stages, 1, optimizer=False)
    skip = [(o.phase, o.what, o.src, o.dst) for o in ir.select(kind="send", stage=2) if o.bytes == 32]
    assert skip == [("forward", "activation", HOST, "a"),  # read from the host copy
                    ("backward", "input", HOST, "a"),  # again, for the recomputation
                    ("backward", "activation", "a", HOST)]  # its gradient goes back to the host ...
    back = [(o.phase, o.src, o.dst) for o in ir.select(kind="send", stage=0) if o.bytes == 32]
    assert back == [("forward", "a", HOST), ("backward", HOST, "a")]  # ... and from there to its producer


def test_the_host_steps_each_stage_after_its_gradients_are_downloaded():
    ir = build_schedule(_chain(["a", "b"]), 2)
    steps = ir.place(HOST)
    assert [o.stage for o in steps] == [0, 1]
    for o in steps:
        assert [ir.ops[d].kind for d in o.deps] == ["download"]


def test_a_stage_reading_a_later_stage_is_refused():
    with pytest.raises(MobiusError, match="stage 0 reads an input of stage 1"):
        build_schedule([StageIO("a", 1, 1, (StageInput(1, 4),)), StageIO("a", 1, 1)], 1)


def test_the_timeline_prints_each_gpu_and_phase():
    text = str(build_schedule(_chain(["a", "b"]), 1))
    assert "a:\n  forward   prefetch(0); wait(0); send activation 0.0 host->a; F0.0" in text
    assert "host:\n  optimizer step(0); step(1)" in text


# ----------------------------------------------------------------------------- the plan reads it

def _tied_gpt_pipe(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, seq=32, hidden=64, blocks=4, heads=2))
    x = torch.randint(0, 256, (4, 32))
    topo = Topology.virtual(gpus=2, memory=8 * sum(p.numel() * 4 for p in model.parameters()))
    pipe = mobius_fx.compile(model, topo, example_inputs=(x,), microbatches=2, cache_dir=str(tmp_path), verbose=False)
    pipe(x).float().sum().backward()
    return pipe


def test_plan_transfers_are_the_sum_over_its_schedule(tmp_path):
    plan = _tied_gpt_pipe(tmp_path).plan
    ir = plan.schedule()
    for t in plan.transfers:
        if t.kind == "evict":
            continue
        src = HOST if t.src == "dram" else t.src
        dst = HOST if t.dst == "dram" else t.dst
        ops = [o for o in ir.copies() if o.stage == t.stage and o.phase == t.phase and o.src == src
               and o.dst == dst and o.bytes == t.bytes]
        assert len(ops) == t.count, t
    assert sum(t.bytes * t.count for t in plan.transfers) == sum(o.bytes for o in ir.copies())


def test_the_plan_counts_the_tied_heads_gradient_the_runtime_sends_back(tmp_path):
    pipe = _tied_gpt_pipe(tmp_path)
    stats = pipe.transfer_stats(last_step=True)
    for gpu in pipe.plan.order:
        planned_grads = sum(t.bytes * t.count for t in pipe.plan.transfers if t.kind == "gradient" and t.src == gpu)
        planned_weights = sum(t.bytes * t.count for t in pipe.plan.transfers if t.kind == "prefetch" and t.dst == gpu)
        assert stats[gpu]["gradient d2h"]["bytes"] == planned_grads, gpu
        assert stats[gpu]["weight h2d"]["bytes"] == planned_weights, gpu
