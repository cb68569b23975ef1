"""The schedule IR (mobius_fx/planning/schedule_ir.py): the order and the bytes of a step, and the plan's
transfer table as a sum over it."""

import functools
from collections import defaultdict

import pytest
import torch

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.planning.schedule_ir import Op, StageInput, StageIO, build_schedule
from mobius_fx.kinds import HOST
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


@pytest.mark.parametrize("fields", [
    dict(src="gpu0"), dict(dst=HOST), dict(what="weight"), dict(bytes=8),  # one copy field alone
    dict(src="gpu0", dst=HOST, bytes=8), dict(src=HOST, dst="gpu0", what="weight", bytes=-1),
    dict(src=HOST, dst="gpu0", what="weight", bytes=float("inf"))])
def test_an_op_is_a_copy_with_all_four_fields_or_none(fields):
    """src, dst, what and bytes: a copy names all of them (0 bytes: a copy of unknown size, as the
    traced graph's IR has), any other op none; a half-made copy is refused with the rule."""
    with pytest.raises(MobiusError, match="give all four or none"):
        Op(3, "send", "gpu0", 1, "forward", **fields)
    assert Op(3, "send", "gpu0", 1, "forward", src=HOST, dst="gpu0", what="input", bytes=0).direction == "h2d"
    assert Op(3, "run", "gpu0", 1, "forward").bytes == 0


def test_the_timeline_prints_each_gpu_and_phase():
    text = str(build_schedule(_chain(["a", "b"]), 1))
    assert "a:\n  forward   prefetch(0); wait(0); send activation 0.0 host->a; F0.0" in text
    assert "host:\n  optimizer step(0); step(1)" in text


# ----------------------------------------------------------------------------- the plan reads it

def test_a_plans_ir_is_built_once_per_plan_and_gpu_map():
    from mobius_fx.planning.costs import LayerCost
    from mobius_fx.planning.plans import Plan, build_plan

    topo = Topology.virtual(gpus=2, memory="24GiB")
    layers = [LayerCost(f"h{i}", (f"n{i}",), 1.0, 1.0, 0.01, 0.03, 1000, 1000, 64, 64) for i in range(3)]
    plan = build_plan(layers, [0, 1, 2], order=["gpu1", "gpu0"], topology=topo, microbatches=2, step_time=0.0)
    ir = plan.schedule()
    assert plan.schedule() is ir  # the one build_plan made its transfers from
    assert ir == build_schedule(StageIO.from_plan(plan.stages), 2)
    ident = plan.schedule(("gpu0", "gpu1"))
    assert plan.schedule(["gpu0", "gpu1"]) is ident and ident is not ir
    assert [s.gpu for s in ident.stages] == ["gpu0", "gpu1", "gpu0"] and [s.gpu for s in ir.stages] == ["gpu1", "gpu0", "gpu1"]
    again = Plan.from_json(plan.to_json())  # a plan read back builds its own, the same
    assert again.schedule() == ir and again.schedule() is again.schedule()
    for bad in ((), "gpu0"):  # no GPUs; a name, not a list of names (it would map stages to "g", "p", ...)
        with pytest.raises(MobiusError, match=r"gpus must be a non-empty sequence of GPU names"):
            plan.schedule(bad)


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
        ops = [o for o in ir.copies() if o.stage == t.stage and o.phase == t.phase and o.src == t.src
               and o.dst == t.dst and o.bytes == t.bytes]  # one name for host memory: "host"
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


def test_the_planned_step_counts_the_tied_copy_and_the_model_input(tmp_path):
    # The partitioner's problem is the plan's: the step time compile() reports is the step
    # model's for the plan's stages with the tied head's copy (and its gradient) and the model
    # input in it — without either, the model gives another time.
    from dataclasses import replace

    from mobius_fx.planning.host_step import HostPass
    from mobius_fx.planning.step_model import PartitionProblem, evaluate
    from mobius_fx.planning.step_memory import tied_weights

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, seq=32, hidden=64, blocks=4, heads=2))
    x = torch.randint(0, 256, (4, 32))
    size = sum(p.numel() * 4 for p in model.parameters())
    topo = Topology.virtual(gpus=2, memory=8 * size, bandwidth=4 * size)  # slow links (above the 1 MB/s floor): every byte counts
    plan = mobius_fx.plan(model, topo, example_inputs=(x,), microbatches=2, cache_dir=str(tmp_path), time_limit=2.0)
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters(remove_duplicate=False)}
    tied = tied_weights(plan.layers, sizes)
    assert [(t.name, t.owner, t.readers) for t in tied] == [("wte.weight", 0, (len(plan.layers) - 1,))]
    full = PartitionProblem.from_topology(plan.layers, topo, microbatches=plan.microbatches,
                                          order=plan.order, input_bytes=4 * 32 * 8, tied=tied,
                                          host=HostPass.of(topo, 4, "adamw", "sync"))  # the default host pass
    cuts = [plan.layers.index(next(l for l in plan.layers if l.name == s.layers[0])) for s in plan.stages]
    ev = evaluate(full, cuts)
    assert plan.step_time == pytest.approx(ev.makespan, rel=1e-12)
    # and each is in it: the head's stage downloads the copy's gradient, stage 0 uploads the input
    assert evaluate(replace(full, tied=()), cuts).grad_done[-1] < ev.grad_done[-1]
    assert evaluate(replace(full, input_bytes=0.0), cuts).fwd_start[0][0] < ev.fwd_start[0][0]


# ----------------------------------------------------------------------------- the runtime moves what it says

from torch.fx.passes.shape_prop import ShapeProp  # noqa: E402

from mobius_fx.build import build_pipeline  # noqa: E402
from mobius_fx.zoo import ResidualMLP, SkipNet  # noqa: E402

_COMPUTE = ("call_function", "call_method", "call_module")


def _values(gm, *mb_inputs):
    """Each graph value's tensor for one micro-batch (shapes from ShapeProp on meta copies)."""
    ShapeProp(gm).propagate(*mb_inputs)
    out = {}
    for n in gm.graph.nodes:
        tm = n.meta.get("tensor_meta")
        if tm is not None and hasattr(tm, "shape"):
            out[n.name] = torch.empty(tm.shape, dtype=tm.dtype, device="meta")
    return out


def _lora_example():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("lora_example", Path(__file__).parents[2] / "examples" / "lora.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check_executed_order(pipe, ir):
    """The order the runtime executed (`executed_ops`) against the IR: per GPU the same runs in
    the same order; every run after a wait for its stage on that GPU, every wait after its
    prefetch there (a stage may be on several GPUs at once: split-head's dealt last stage);
    never more stages resident on a GPU than the IR has."""
    on, waited, peak, runs = defaultdict(set), set(), defaultdict(int), defaultdict(list)
    for kind, gpu, k, phase, i in pipe.executed_ops():
        if kind == "prefetch":
            on[gpu].add(k)
            waited.discard((gpu, k))
        elif kind == "wait":
            assert k in on[gpu], f"wait for stage {k} on {gpu} before its prefetch"
            waited.add((gpu, k))
        elif kind == "run":
            assert k in on[gpu] and (gpu, k) in waited, f"stage {k} ran on {gpu} ({phase}, mb {i}) before its wait"
            runs[gpu].append((k, phase, i))
        elif kind == "evict":
            on[gpu].discard(k)
            waited.discard((gpu, k))
        peak[gpu] = max(peak[gpu], len(on[gpu]))
    planned = {g: [(o.stage, o.phase, o.microbatch) for o in ir.place(g) if o.kind == "run"] for g in ir.gpus}
    assert dict(runs) == {g: r for g, r in planned.items() if r}
    most = ir.resident_at_most()
    assert all(n <= most[g] for g, n in peak.items()), (dict(peak), most)


def _cases():
    torch.manual_seed(0)
    res = ResidualMLP(d_in=8, width=16, depth=6, d_out=4)
    gm = torch.fx.symbolic_trace(res)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    adds = [j + 1 for j, n in enumerate(names) if n.startswith("add")]
    for gpus in (["gpu0", "gpu1"] * 2, ["gpu1", "gpu0", "gpu2"] * 2 + ["gpu1"], ["gpu0"] * 3):
        cuts = [0, *adds[:len(gpus) - 1], len(names)]
        yield f"residual-{len(gpus)}on{len(set(gpus))}", res, gm, [names[a:b] for a, b in zip(cuts, cuts[1:])], \
            gpus, (torch.randn(4, 8),)
    skip = SkipNet(d_in=6, width=8, depth=4, d_out=3)
    gm = torch.fx.symbolic_trace(skip)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    q = len(names) // 4
    yield "skip-4on2", skip, gm, [names[:q], names[q:2 * q], names[2 * q:3 * q], names[3 * q:]], \
        ["gpu0", "gpu1"] * 2, (torch.randn(4, 6),)
    tied = GPT(GPTConfig(vocab=64, seq=8, hidden=16, blocks=3, heads=2))  # lm_head tied to wte
    ids = torch.randint(0, 64, (4, 8))
    gm = mobius_fx.trace(tied, example_inputs=(ids,))
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    h = len(names) // 3
    yield "tied-gpt-3on2", tied, gm, [names[:h], names[h:2 * h], names[2 * h:]], ["gpu0", "gpu1", "gpu0"], (ids,)


    frozen = ResidualMLP(d_in=8, width=16, depth=4, d_out=4)
    for name, p in frozen.named_parameters():  # a frozen prefix: those stages run forward only
        p.requires_grad_(not name.startswith(("inp", "blocks.0", "blocks.1")))
    gm = torch.fx.symbolic_trace(frozen)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    h, q = len(names) // 2, len(names) // 4
    yield "frozen-2on2", frozen, gm, [names[:h], names[h:]], ["gpu0", "gpu1"], (torch.randn(4, 8),)
    yield "frozen-4on2", frozen, gm, [names[:q], names[q:h], names[h:3 * q], names[3 * q:]], \
        ["gpu0", "gpu1"] * 2, (torch.randn(4, 8),)
    lora = GPT(GPTConfig(vocab=64, seq=8, hidden=16, blocks=3, heads=2))
    _lora_example().add_lora(lora, rank=2)  # frozen base, adapters in every block; embeddings frozen
    ids = torch.randint(0, 64, (4, 8))
    gm = mobius_fx.trace(lora, example_inputs=(ids,))
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    h = len(names) // 3
    yield "lora-gpt-3on2", lora, gm, [names[:h], names[h:2 * h], names[2 * h:]], ["gpu0", "gpu1", "gpu0"], (ids,)

    from mobius_fx.zoo import hf_inputs, hf_llama

    llama = hf_llama(layers=3)
    ids = hf_inputs(llama, batch=4, seq=8)
    gm = mobius_fx.trace(llama, example_inputs=ids)
    names = [n.name for n in gm.graph.nodes if n.op in _COMPUTE]
    h = len(names) // 3
    yield "hf-llama-3on2", llama, gm, [names[:h], names[h:2 * h], names[2 * h:]], ["gpu0", "gpu1", "gpu0"], ids


# The cases are built when a test first runs, not at import: test_executor, test_train_step and
# test_conformance_props import this module's helpers (as tests.unit.test_schedule_ir, a second copy of
# the module), and building them there traced the hf-llama and GPTs again at every collection.
CASES = ("residual-4on2", "residual-7on3", "residual-3on1", "skip-4on2", "tied-gpt-3on2", "frozen-2on2",
         "frozen-4on2", "lora-gpt-3on2", "hf-llama-3on2")


@functools.lru_cache(maxsize=None)
def _built() -> dict:
    cases = {c[0]: c for c in _cases()}
    assert tuple(cases) == CASES, tuple(cases)
    return cases


@pytest.mark.parametrize("case", CASES)
def test_the_runtime_moves_exactly_what_its_schedule_ir_says(case):
    _, model, gm, nodes, gpus, inputs = _built()[case]
    m = 2
    pipe = build_pipeline(model, gm, stage_nodes=nodes, stage_gpus=gpus, gpu_budgets={}, microbatches=m,
                          example_inputs=inputs, device="virtual")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        out = pipe(*inputs)
        getattr(out, "logits", out).float().pow(2).sum().backward()
    ir = pipe.schedule_ir(_values(gm, *[t[: t.shape[0] // m] for t in inputs]))
    # Weights and gradients move one copy per tensor, the IR one op per stage: compare their
    # bytes; activations and saved inputs move one copy per value and micro-batch: both.
    def per_copy(kind, c):
        return c["bytes"] if kind.split()[0] in ("weight", "gradient") else (c["count"], c["bytes"])

    expected = {}
    for (gpu, what, direction, stage), (count, nbytes) in ir.bytes_moved().items():
        kind = f"{what} {direction}"
        expected.setdefault(gpu, {}).setdefault(kind, {})[stage] = per_copy(kind, {"count": count, "bytes": nbytes})
    got = {}
    for gpu, kinds in pipe.transfer_stats(last_step=True, by_stage=True).items():
        for kind, per in kinds.items():
            if kind.startswith("buffer"):
                continue
            for stage, c in per.items():
                got.setdefault(gpu, {}).setdefault(kind, {})[stage] = per_copy(kind, c)
    assert got == expected
    assert all(n <= 2 for n in ir.resident_at_most().values())
    _check_executed_order(pipe, ir)
