"""mobius_fx.plan end to end: trace -> annotate -> partition (cut + cross map) -> Plan."""

import json
import time

import pytest
import torch
import torch.nn as nn

import mobius_fx
from mobius_fx import PlanError, Topology
from mobius_fx.zoo import GPT, GPTConfig


def _mlp(width=64, depth=6):
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])


def test_plan_of_a_small_mlp_prints_stage_and_transfer_tables(tmp_path):
    topo = Topology.virtual(gpus=2, memory="256KiB")
    plan = mobius_fx.plan(_mlp(), topo, example_inputs=(torch.randn(8, 64),), microbatches=2,
                          cache_dir=str(tmp_path), verbose=False)
    assert plan.num_stages >= 2 and plan.microbatches == 2
    assert {s.gpu for s in plan.stages} == {"gpu0", "gpu1"}
    text = str(plan)
    for column in ("stage", "gpu", "root", "layers", "weights", "peak / capacity", "upload hidden",
                   "kind", "from -> to", "route"):
        assert column in text
    assert "predicted step" in text and plan.solver.status in text


def test_every_layer_lands_in_exactly_one_stage_in_order(tmp_path):
    plan = mobius_fx.plan(_mlp(depth=5), Topology.virtual(gpus=2, memory="256KiB"), example_inputs=(torch.randn(4, 64),),
                          cache_dir=str(tmp_path), verbose=False)
    assert [n for s in plan.stages for n in s.layers] == [l.name for l in plan.layers]


def test_a_layer_too_big_for_any_gpu_is_a_plan_error_naming_it(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4096), nn.Linear(4096, 8))
    with pytest.raises(PlanError, match=r"GiB|MiB|KiB") as e:
        mobius_fx.plan(model, Topology.virtual(gpus=2, memory="16KiB"), example_inputs=(torch.randn(2, 8),),
                       cache_dir=str(tmp_path), verbose=False)
    assert "gpu" in str(e.value) and "memory" in str(e.value)


def test_planning_leaves_the_model_untouched(tmp_path):
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mobius_fx.plan(model, Topology.virtual(gpus=2, memory="256KiB"), example_inputs=(torch.randn(8, 64),),
                   cache_dir=str(tmp_path), verbose=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_gpt3_8b_on_the_paper_server_plans_in_under_a_minute(tmp_path):
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(GPTConfig(hidden=3072, blocks=72, heads=24))
        ids = torch.zeros(8, 1024, dtype=torch.long)
    # The MIP's budget is wall-clock time it spends whole when the search is not closed (here): 5 s
    # instead of the default 20 s (both runs' best: a 3.59 s step, found before the budget runs out),
    # so a plan with the default budget takes 15 s more than this one.
    budget = 5.0
    plan = mobius_fx.plan(model, "mobius-testbed", example_inputs=(ids,), microbatches=8, dtype=torch.float16,
                          time_limit=budget, cache_dir=str(tmp_path), verbose=False)
    elapsed = time.perf_counter() - t0
    assert elapsed + (mobius_fx.CompileOptions().time_limit - budget) < 60
    assert plan.num_stages > 8
    roots = [s.root_complex for s in plan.stages]
    assert all(a != b for a, b in zip(roots, roots[1:])), roots
    assert all(s.peak_bytes <= s.capacity for s in plan.stages)

    # The plan's simulated step exports as a valid Chrome trace: a process per GPU and a
    # thread per directed link that carried bytes.
    from mobius_fx import simulate

    result = simulate(plan)
    path = tmp_path / "trace.json"
    result.save_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    processes = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {f"gpu{i}" for i in range(8)} <= processes and "links" in processes
    link_threads = [t for t in threads if "->" in t or ">" in t]
    assert len(link_threads) >= len([k for k, b in result.link_bytes.items() if b > 0])


def test_progress_is_reported_unless_silenced(tmp_path, capfd):
    kw = dict(example_inputs=(torch.randn(8, 64),), cache_dir=str(tmp_path))
    mobius_fx.plan(_mlp(), Topology.virtual(gpus=2, memory="256KiB"), verbose=True, **kw)
    err = capfd.readouterr().err
    assert "[mobius_fx] traced" in err and "partition:" in err and "pass plan done" in err
    mobius_fx.plan(_mlp(), Topology.virtual(gpus=2, memory="256KiB"), verbose=False, **kw)
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""


# ------------------------------------------------ a GPU order the identity order's cuts do not fit
def _big_gpu0_small_gpu1(small: int) -> Topology:
    return Topology.from_dict({"name": "uneven", "nodes": [
        {"name": "cpu0", "kind": "root_complex"},
        {"name": "gpu0", "kind": "gpu", "memory": "512KiB", "spec": "cpu"},
        {"name": "gpu1", "kind": "gpu", "memory": small, "spec": "cpu"}],
        "links": [{"a": "cpu0", "b": "gpu0", "bandwidth_gbps": 16}, {"a": "cpu0", "b": "gpu1", "bandwidth_gbps": 16}]})


def _reversed_order_pipeline():
    """The standard passes with a partition pass whose cross map puts the small gpu1 first."""
    import functools

    from mobius_fx.compiler import default_pipeline
    from mobius_fx.passes.partition import partition_pass

    pipeline = default_pipeline()
    pipeline.passes[pipeline.names.index("partition")].fn = functools.partial(
        partition_pass, order=lambda ctx, part: ("gpu1", "gpu0"))
    return pipeline


def test_a_gpu_order_the_partition_does_not_fit_is_partitioned_again_for_that_order(tmp_path):
    from mobius_fx.options import CompileContext, CompileOptions
    from mobius_fx.planning.step_model import evaluate, PartitionProblem
    from mobius_fx.passes.partition_solve import solve
    from mobius_fx.planning.host_step import HostPass

    # gpu1 holds 78 KiB: the partition for (gpu0, gpu1) gives gpu0 a first stage that does
    # not fit gpu1 once gpu1 runs stage 0.
    topo = _big_gpu0_small_gpu1(80_000)
    ctx = CompileContext(model=_mlp(), topology=topo, example_inputs=(torch.randn(8, 64),),
                         settings=CompileOptions(microbatches=2, cache_dir=str(tmp_path), verbose=False))
    _reversed_order_pipeline().until("plan").run(ctx)
    host = HostPass.of(topo, 4, "adamw", "sync")  # compile's default: fp32 streamed, sync's pass
    identity = PartitionProblem.from_topology(ctx.layers, topo, microbatches=2, input_bytes=8 * 64 * 4, host=host)
    mapped = PartitionProblem.from_topology(ctx.layers, topo, microbatches=2, order=ctx.order,
                                            input_bytes=8 * 64 * 4, host=host)  # the example input, as compile gives it
    first = solve(identity, cache_dir=str(tmp_path)).boundaries  # the cuts for the topology's order
    assert evaluate(mapped, first) is None  # ... no longer fit
    plan = ctx.plan
    assert ctx.order == ("gpu1", "gpu0") and [s.gpu for s in plan.stages][:2] == ["gpu1", "gpu0"]
    assert all(s.peak_bytes <= s.capacity for s in plan.stages), [(s.peak_bytes, s.capacity) for s in plan.stages]
    names = [layer.name for layer in plan.layers]
    cuts = tuple(names.index(s.layers[0]) for s in plan.stages)
    assert cuts != first and cuts == tuple(ctx.partition.boundaries)  # cut again, in the one pass
    assert plan.step_time == pytest.approx(evaluate(mapped, cuts).makespan) == ctx.partition.makespan


def test_a_gpu_order_no_partition_fits_is_a_plan_error_naming_the_order_and_the_gpu(tmp_path):
    # gpu1 (59 KiB) holds no stage that includes a layer, and under ("gpu1", "gpu0") stage 0 is
    # always gpu1's; the topology's order fits (one stage on gpu0), but that is not this order.
    with pytest.raises(PlanError, match=r"cross_map chose GPU order \('gpu1', 'gpu0'\).*on gpu1.*"
                                        r"cross_map='identity'"):
        mobius_fx.plan(_mlp(), _big_gpu0_small_gpu1(60_000), example_inputs=(torch.randn(8, 64),), microbatches=2,
                       cache_dir=str(tmp_path), verbose=False, pipeline=_reversed_order_pipeline())
