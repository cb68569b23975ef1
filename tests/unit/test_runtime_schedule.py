"""The emitted schedule: readable code in Mobius order, explicit side-effect nodes, checked cuts."""

import pytest
import torch
import torch.fx as fx
from torch import nn

from mobius_fx import MobiusError
from mobius_fx.planning import stage_contract as rt
from mobius_fx.passes.emit import emit
from mobius_fx.passes.insert_transfers import insert_transfers
from mobius_fx.build import build_pipeline

_COMPUTE = ("call_function", "call_method", "call_module")

@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread avoids stalls when other work shares the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



def mlp(depth: int = 8) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(8, 8), nn.Tanh())])


def cut(gm, stages):
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    per = len(names) // stages
    return [names[k * per:(k + 1) * per] if k < stages - 1 else names[k * per:] for k in range(stages)]


def schedule(stages=4, gpus=2, microbatches=2, model=None):
    gm = fx.symbolic_trace(model if model is not None else mlp())
    names = [f"gpu{i}" for i in range(gpus)]
    return insert_transfers(gm, stage_nodes=cut(gm, stages), stage_gpus=[names[k % gpus] for k in range(stages)],
                            microbatches=microbatches)


def events_of(graph: fx.Graph) -> list[tuple]:
    """The schedule ops of a program graph in execution order, read from each node's
    `meta["mobius"]`: (op, stage) for prefetch / wait / evict / hold_for_backward, (op, stage,
    micro-batch) for run_stage and send, with the GPU the op acts on as the last element."""
    out = []
    for node in graph.nodes:
        meta = node.meta.get("mobius")
        if meta is None or meta["op"] in ("split_microbatches", "merge_microbatches"):
            continue
        assert node.op == "call_function" and node.target.__name__ == meta["op"], node.format_node()
        if meta["op"] in ("run_stage", "send"):
            out.append((meta["op"], meta["stage"], meta["microbatch"], meta["gpu"]))
        else:
            out.append((meta["op"], meta["stage"], meta["gpu"]))
    return out


def at(events: list[tuple], *key) -> list[int]:
    """Positions of the events that start with `key`."""
    return [i for i, e in enumerate(events) if e[:len(key)] == key]


def test_the_runtime_implements_every_op_of_the_contract():
    """planning/stage_contract.py's StageRuntime is what the ops call; the Runtime has each of its
    methods, with the same parameters (a renamed or dropped one fails here, not in a program)."""
    import inspect

    from mobius_fx.runtime.engine import Runtime

    methods = [n for n, f in vars(rt.StageRuntime).items() if inspect.isfunction(f) and not n.startswith("_")]
    assert sorted(methods) == ["evict", "hold", "merge", "prefetch", "run", "send", "split", "wait"]
    for name in methods:
        want = list(inspect.signature(getattr(rt.StageRuntime, name)).parameters)
        got = list(inspect.signature(getattr(Runtime, name)).parameters)
        assert got[:len(want)] == want, (name, got, want)
    assert sorted(rt.OPS) == ["evict", "hold_for_backward", "merge_microbatches", "prefetch", "run_stage", "send",
                              "split_microbatches", "wait"]


def test_program_prefetches_stage_k_plus_n_before_stage_k_runs_and_evicts_after_its_last_microbatch():
    model = mlp()
    x = torch.randn(4, 8)
    gm = fx.symbolic_trace(model)
    s, n = 6, 2  # three stages per GPU, so a prefetch of k+2N would have a stage to fetch
    gpu_of = {k: f"gpu{k % n}" for k in range(s)}
    pipe = build_pipeline(model, gm, stage_nodes=cut(gm, s), stage_gpus=list(gpu_of.values()), gpu_budgets={},
                          microbatches=2, example_inputs=(x,), device="virtual")
    events = events_of(pipe.program.graph)
    for e in events:  # every op names its stage's GPU (a send: the GPU it delivers to)
        assert e[-1] == gpu_of[e[1]] or e[0] == "send", e
    # Each stage is prefetched exactly once, waited for once, and then run once per micro-batch.
    for k in range(s):
        assert len(at(events, "prefetch", k)) == len(at(events, "wait", k)) == 1
        assert at(events, "prefetch", k)[0] < at(events, "wait", k)[0] < min(at(events, "run_stage", k))
        assert sorted(e[2] for e in events if e[:2] == ("run_stage", k)) == [0, 1]
    # The first stage of each GPU is uploaded before anything runs.
    assert max(i for k in range(n) for i in at(events, "prefetch", k)) < min(at(events, "run_stage"))
    for k in range(s - n):
        (wait,), (prefetch_next,) = at(events, "wait", k), at(events, "prefetch", k + n)
        runs = at(events, "run_stage", k)
        # stage k+N goes up after stage k's wait and before stage k's first micro-batch,
        assert wait < prefetch_next < min(runs)
        # and it is the only prefetch of this GPU while stage k runs (no k+2N: two stages resident).
        assert [e for e in events[wait:max(runs) + 1] if e[0] == "prefetch"] == [("prefetch", k + n, gpu_of[k])]
        # Stage k is evicted after its last micro-batch and before stage k+1 starts.
        (evicted,) = at(events, "evict", k)
        assert max(runs) < evicted < min(at(events, "run_stage", k + 1))
        assert not at(events, "hold_for_backward", k)
    for k in range(s - n, s):  # the last stage of each GPU stays for backward
        assert not at(events, "evict", k)
        (held,) = at(events, "hold_for_backward", k)
        assert max(at(events, "run_stage", k)) < held
    assert "# ---- stage 2 on gpu0" in pipe.code and "# backward" in pipe.code  # the readable code


def test_schedule_runs_every_microbatch_of_a_stage_before_the_next_stage():
    events = events_of(emit(schedule(stages=4, gpus=2, microbatches=3)).graph)
    calls = [e[1:3] for e in events if e[0] == "run_stage"]
    assert calls == [(k, i) for k in range(4) for i in range(3)]


def test_side_effect_ops_survive_dead_code_elimination_and_the_graph_lints_clean():
    sched = schedule()
    graph = sched.graph
    before = [n.name for n in graph.nodes]
    graph.eliminate_dead_code()
    graph.lint()
    assert [n.name for n in graph.nodes] == before
    ops = [n.target.__name__ for n in graph.nodes if n.op == "call_function" and hasattr(n.target, "__name__")]
    assert {"prefetch", "wait", "evict", "hold_for_backward", "run_stage", "send"} <= set(ops)
    for fn in (rt.prefetch, rt.wait, rt.evict, rt.hold_for_backward, rt.run_stage, rt.send):
        assert fn in fx.node._side_effectful_functions


def test_schedule_nodes_carry_their_op_stage_and_gpu_in_meta():
    sched = schedule(stages=4, gpus=2)
    prefetches = [(n.meta["mobius"]["stage"], n.meta["mobius"]["gpu"]) for n in sched.graph.nodes
                  if n.meta.get("mobius", {}).get("op") == "prefetch"]
    assert prefetches == [(0, "gpu0"), (1, "gpu1"), (2, "gpu0"), (3, "gpu1")]


def test_each_stage_module_reads_only_its_own_weights():
    sched = schedule(stages=4, gpus=2)
    names = [sorted(w.name for w in st.weights) for st in sched.stages]
    assert names[0] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(not set(a) & set(b) for i, a in enumerate(names) for b in names[i + 1:])


def test_unlisted_compute_nodes_join_the_stage_before_them():
    gm = fx.symbolic_trace(mlp(2))
    sched = insert_transfers(gm, stage_nodes=[["_0"], ["_2"]], stage_gpus=["a", "b"], microbatches=1)
    assert sched.moved == ("_1", "_3")
    assert sched.stages[0].nodes == ("_0", "_1") and sched.stages[1].nodes == ("_2", "_3")


@pytest.mark.parametrize("nodes, message", [
    ([["_0", "_1"], ["_1", "_2", "_3"]], r"'_1' is listed in stages 0 and 1"),
    ([["_0", "nope"], ["_2"]], r"node 'nope', which the graph does not have"),
    ([["_2", "_3"], ["_0", "_1"]], r"in stage 0 but uses '_1' from the later stage 1"),
    ([["_0", "_1", "_2", "_3"], []], r"stage\(s\) \[1\] have no compute node"),
])
def test_invalid_stage_assignments_are_rejected_with_the_rule(nodes, message):
    gm = fx.symbolic_trace(mlp(2))
    with pytest.raises(MobiusError, match=message):
        insert_transfers(gm, stage_nodes=nodes, stage_gpus=["a", "b"], microbatches=1)


def test_the_program_runs_only_inside_its_pipeline():
    program = emit(schedule())
    with pytest.raises(MobiusError, match="outside a Pipeline call"):
        program(torch.randn(4, 8))


def test_stage_modules_never_touch_the_users_modules():
    model = mlp(4)
    gm = fx.symbolic_trace(model)
    sched = insert_transfers(gm, stage_nodes=cut(gm, 2), stage_gpus=["a", "b"], microbatches=1)
    user_modules = {id(m) for m in model.modules()}
    for st in sched.stages:
        assert not any(id(m) in user_modules for m in st.module.modules())
        assert all(user is not shell and type(user) is type(shell) for user, shell in st.shells)


def test_a_plan_supplies_stages_gpus_microbatches_and_whole_gpu_budgets():
    from mobius_fx import Topology
    from mobius_fx.planning.plans import Plan, Stage

    model = mlp(4)
    x = torch.randn(4, 8)
    gm = fx.symbolic_trace(model)
    topo = Topology.virtual(gpus=2, memory="1MiB")
    order = ("gpu1", "gpu0")  # cross-mapped: stage 0 on gpu1
    stages = tuple(Stage(index=k, gpu=order[k % 2], root_complex="cpu0", layers=(f"l{k}",), nodes=tuple(nodes),
                         param_bytes=0, grad_bytes=0, fwd_time=0.0, bwd_time=0.0, input_bytes=0, output_bytes=0,
                         peak_bytes=0, capacity=1000)
                   for k, nodes in enumerate(cut(gm, 4)))
    plan = Plan(stages=stages, transfers=(), order=order, microbatches=2, step_time=0.0, topology=topo)
    pipe = build_pipeline(model, gm, plan=plan, example_inputs=(x,))
    assert pipe.plan is plan and pipe.schedule.microbatches == 2
    assert [st.gpu for st in pipe.schedule.stages] == ["gpu1", "gpu0", "gpu1", "gpu0"]
    assert {name: dev.budget for name, dev in pipe.devices.items()} == {"gpu1": 2**20, "gpu0": 2**20}
    assert all(dev.kind == "virtual" for dev in pipe.devices.values())  # the topology is virtual
    torch.testing.assert_close(pipe(x), model(x))


def test_a_schedule_backs_one_pipeline():
    model = mlp(2)
    gm = fx.symbolic_trace(model)
    sched = insert_transfers(gm, stage_nodes=cut(gm, 2), stage_gpus=["a", "b"], microbatches=1)
    build_pipeline(model, gm, schedule=sched, device="virtual")
    with pytest.raises(MobiusError, match="already runs in another Pipeline"):
        build_pipeline(model, gm, schedule=sched, device="virtual")
