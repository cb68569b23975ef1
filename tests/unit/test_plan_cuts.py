"""Plans for given cuts (`plan(..., cuts=[...])`, `--cuts`) and the micro-batch rules of `plan`:
a count that does not divide the batch is refused, and the default is one per GPU or the
largest divisor of the batch below the GPU count, said in the plan's header."""

import functools
import sys
import types

import pytest
import torch

import mobius_fx
from mobius_fx.planning.host_step import HostPass
from mobius_fx import PlanError, Topology
from mobius_fx.__main__ import main
from mobius_fx.compiler import default_pipeline
from mobius_fx.planning.microbatch import default_microbatches
from mobius_fx.passes.partition import partition_pass
from mobius_fx.planning.step_model import evaluate, PartitionProblem
from mobius_fx.planning.plans import build_plan
from mobius_fx.zoo import GPT, GPTConfig

CFG = GPTConfig(vocab=100, seq=16, hidden=32, blocks=4, heads=2)  # 6 layers: embedding, 4 blocks, head


def _gpt(device="meta"):
    with torch.device(device):
        return GPT(CFG)


def _ids(batch, device="meta"):
    return torch.zeros(batch, CFG.seq, dtype=torch.long, device=device)


def _plan(tmp_path, batch=4, topo=None, **kw):
    kw.setdefault("microbatches", 2)
    return mobius_fx.plan(_gpt(), topo or Topology.virtual(gpus=2, memory="256MiB"), example_inputs=(_ids(batch),),
                          cache_dir=str(tmp_path), verbose=False, **kw)


def test_given_cuts_are_planned_as_build_plan_builds_and_the_step_model_times_them(tmp_path):
    topo = Topology.virtual(gpus=2, memory="256MiB")
    p = _plan(tmp_path, topo=topo, cuts=[1, 3])
    names = [l.name for l in p.layers]
    assert [s.layers for s in p.stages] == [tuple(names[:1]), tuple(names[1:3]), tuple(names[3:])]
    problem = PartitionProblem.from_topology(p.layers, topo, microbatches=2, order=p.order, memory_fraction=0.9,
                                             host=HostPass.of(topo, 4, "adamw", "sync"))  # the default host pass
    ev = evaluate(problem, (0, 1, 3))
    assert p.step_time == pytest.approx(ev.makespan, rel=1e-12)
    model = _gpt()
    ref = build_plan(p.layers, (0, 1, 3), order=p.order, topology=topo, microbatches=2, step_time=ev.makespan,
                     prefetch_fwd=ev.prefetch_fwd, solver=p.solver, input_bytes=_ids(4).numel() * 8,
                     param_sizes={n: t.numel() * t.element_size()
                                  for n, t in model.named_parameters(remove_duplicate=False)})
    assert p.stages == ref.stages and p.transfers == ref.transfers
    assert p.solver.name == "given cuts" and "[1, 3], no MIP run" in str(p.solver)


def test_the_mip_cuts_given_back_give_the_mip_plan(tmp_path):
    mip = _plan(tmp_path)
    sizes = [len(s.layers) for s in mip.stages]
    cuts = [sum(sizes[:k]) for k in range(1, len(sizes))]
    given = _plan(tmp_path, cuts=cuts)
    assert (given.stages, given.transfers, given.order) == (mip.stages, mip.transfers, mip.order)
    assert given.step_time == pytest.approx(mip.step_time, rel=1e-12)
    assert given.solver.name == "given cuts" != mip.solver.name


def test_no_cuts_is_one_stage(tmp_path):
    p = _plan(tmp_path, cuts=[])
    assert p.num_stages == 1 and p.stages[0].layers == tuple(l.name for l in p.layers)


@pytest.mark.parametrize("cuts, match", [
    ([0, 2], r"cuts=\[0, 2\] starts at 0.*first cut must be >= 1"),
    ([3, 2], r"cuts=\[3, 2\] is not strictly increasing \(3 then 2\).*sort them"),
    ([2, 2], r"not strictly increasing \(2 then 2\).*drop repeats"),
    ([1.5], r"holds 1.5, which is not an int"),
    ([True], r"holds True, which is not an int"),
    ("1,5", r"cuts='1,5' is not a list of layer indices"),
    ([6], r"cuts=\[6\]: 6 is not a layer index in 1..5 \(this model has 6 layers.*give cuts below 6"),
])
def test_bad_cuts_are_a_plan_error_with_the_value_the_rule_and_the_remedy(tmp_path, cuts, match):
    with pytest.raises(PlanError, match=match) as e:
        _plan(tmp_path, cuts=cuts)
    assert "stages [0,1), [1,5), [5,L)" in str(e.value) or "give cuts below" in str(e.value)


@pytest.mark.parametrize("memory, cuts, match", [
    ("400KiB", [5], r"cuts=\[5\] do not fit the GPUs: stage 0 \(wte\+wpe\+drop..h.3\) needs .* on gpu0, which has "
                    r"360.00 KiB usable"),
    ("200KiB", [1, 2, 3, 4, 5], r"do not fit the GPUs: stage 4 \(h.3\) needs [^;]* 180.00 KiB usable \(memory_frac"),
    ("330KiB", [1, 2, 3, 4, 5], r"do not fit the GPUs: stage (\d) \(.*\) needs .* in backward with what stages? "
                                r"[\d and]+ on its GPU holds? meanwhile \(the double buffer"),
])
def test_cuts_that_do_not_fit_the_gpus_are_a_plan_error_naming_the_rule(tmp_path, memory, cuts, match):
    # A stage too big alone is named before a pair on one GPU (the double buffer) that is too big.
    with pytest.raises(PlanError, match=match) as e:
        _plan(tmp_path, topo=Topology.virtual(gpus=2, memory=memory), cuts=cuts)
    assert "move the cuts (more, smaller stages)" in str(e.value)
    assert ("double buffer" in str(e.value)) == ("double buffer" in match)


def test_cuts_that_fit_only_in_the_topology_order_are_refused_not_cut_again(tmp_path):
    nodes = [{"name": "cpu0", "kind": "root_complex"}, {"name": "gpu0", "kind": "gpu", "memory": "2MiB", "spec": "cpu"},
             {"name": "gpu1", "kind": "gpu", "memory": "400KiB", "spec": "cpu"}]
    links = [{"a": "cpu0", "b": g, "bandwidth_gbps": 16.0} for g in ("gpu0", "gpu1")]
    topo = Topology.from_dict({"name": "uneven", "nodes": nodes, "links": links})
    assert _plan(tmp_path, topo=topo, cuts=[5]).order == ("gpu0", "gpu1")  # fits: the big stage on gpu0

    pipeline = default_pipeline()
    pipeline.passes[pipeline.names.index("partition")].fn = functools.partial(
        partition_pass, order=lambda ctx, part: ("gpu1", "gpu0"))  # a cross map that swaps the GPUs
    with pytest.raises(PlanError, match=r"cuts=\[5\] fit the GPUs in the topology's order, but cross_map=.* chose "
                                        r"GPU order \('gpu1', 'gpu0'\).*stage 0 .* on gpu1.*cross_map='identity'"):
        _plan(tmp_path, topo=topo, cuts=[5], pipeline=pipeline)


# ---------------------------------------------------------------------------------- micro-batches
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_plan_refuses_microbatches_that_do_not_divide_the_batch(tmp_path, device):
    with pytest.raises(PlanError, match=r"batch has 6 rows .* microbatches=4 .*must divide the batch.*use "
                                        r"microbatches=3 or microbatches=6 \(the divisors of 6 nearest 4\)"):
        mobius_fx.plan(_gpt(device), Topology.virtual(gpus=2), example_inputs=(_ids(6, device),), microbatches=4,
                       cache_dir=str(tmp_path), verbose=False)


@pytest.mark.parametrize("rows, gpus, expected", [
    (8, 4, (4, "default: one per GPU")),
    (4, 8, (4, "default: the largest divisor of batch 4 <= 8 GPUs")),
    (6, 4, (3, "default: the largest divisor of batch 6 <= 4 GPUs")),
    (7, 4, (1, "default: the largest divisor of batch 7 <= 4 GPUs")),
    (None, 4, (1, "default: 1, the inputs have no batch dimension to split")),
])
def test_default_microbatches_rule(rows, gpus, expected):
    assert default_microbatches(rows, gpus) == expected


@pytest.mark.parametrize("batch, given, expected, header", [
    (4, None, 4, "4 micro-batches (default: one per GPU)"),  # one row each: no other count to time
    # plan() times the default and the divisors of the batch near 2x, 4x, 8x it (test_microbatch_choice.py)
    (8, None, 8, "8 micro-batches (chosen: the fastest simulated fwd+bwd of 4, 8)"),
    (6, None, 6, "6 micro-batches (chosen: the fastest simulated fwd+bwd of 3, 6)"),
    (8, 2, 2, "2 micro-batches, "),
])
def test_plan_default_microbatches_and_the_header_says_why(tmp_path, batch, given, expected, header):
    p = _plan(tmp_path, batch=batch, topo=Topology.virtual(gpus=4), microbatches=given, cuts=[1, 3])
    assert p.microbatches == expected and header in p.summary()
    assert mobius_fx.Plan.from_json(p.to_json()).summary() == p.summary()
    if given is None and expected > 4:  # a count chosen on the caller's cuts: no MIP of its own
        assert p.schedule_choice.endswith("; cuts: the caller's (cuts=)") and p.solver.name == "given cuts"


def test_compile_takes_cuts_and_defaults_to_one_microbatch_per_gpu(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(4, 8)
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="1MiB"), example_inputs=(x,), cuts=[],
                             cache_dir=str(tmp_path), verbose=False)
    assert pipe.plan.microbatches == 2 and pipe.plan.num_stages == 1 and pipe.plan.solver.name == "given cuts"
    torch.testing.assert_close(pipe(x), model(x))


def test_a_call_whose_batch_the_default_micro_batches_do_not_split_says_they_were_chosen(tmp_path):
    # 2 GPUs: the example batch of 4 gets 2 micro-batches by default; a last batch of 3 rows
    # cannot split, and the error says the count was chosen and how to choose another.
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="1MiB"), example_inputs=(torch.randn(4, 8),),
                             cuts=[], cache_dir=str(tmp_path), verbose=False)
    with pytest.raises(mobius_fx.MobiusError, match=r"3 rows.*microbatches=2 was not given but chosen \(default: "
                                                    r"one per GPU\).*drop_last=True"):
        pipe(torch.randn(3, 8))
    given = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="1MiB"), example_inputs=(torch.randn(4, 8),),
                              cuts=[], microbatches=2, cache_dir=str(tmp_path), verbose=False)
    with pytest.raises(mobius_fx.MobiusError, match=r"multiple of 2$"):  # the user's own count: no such remark
        given(torch.randn(3, 8))


def test_cuts_that_do_not_fit_name_the_stage_with_its_tied_copy(tmp_path):
    # A tied GPT's head reads the embedding: cut into one layer per stage, the head's stage
    # holds a copy of it and needs the most. With room for a byte less, the message names that
    # stage with the bytes evaluate counted, copy included (it used to leave the copy out).
    from mobius_fx.passes.partition_infeasible import misfit
    from mobius_fx.planning.step_memory import tied_weights
    from mobius_fx.units import fmt_bytes

    cfg = GPTConfig(vocab=2000, seq=16, hidden=32, blocks=2, heads=2)  # the embedding outweighs a block
    with torch.device("meta"):
        model = GPT(cfg)
    p = mobius_fx.plan(model, Topology.virtual(gpus=2, memory="64MiB"), cuts=[1], cache_dir=str(tmp_path),
                       example_inputs=(torch.zeros(2, cfg.seq, dtype=torch.long, device="meta"),), verbose=False)
    sizes = {n: t.numel() * t.element_size() for n, t in model.named_parameters(remove_duplicate=False)}
    tied = tied_weights(p.layers, sizes)
    last = len(p.layers) - 1
    assert [t.readers for t in tied] == [(last,)]
    cuts = tuple(range(last + 1))
    prob = PartitionProblem.from_topology(p.layers, p.topology, microbatches=2, tied=tied, memory_fraction=1.0)
    ev = evaluate(prob, cuts)
    needs = [max(f, b) for f, b in zip(ev.fwd_mem, ev.bwd_mem)]
    assert needs.index(max(needs)) == last
    room = p.topology.gpus[0].memory
    small = PartitionProblem.from_topology(p.layers, p.topology, microbatches=2, tied=tied,
                                           memory_fraction=(needs[last] - 1) / room)
    assert evaluate(small, cuts) is None
    assert f"stage {last} ({p.layers[last].name}) needs {fmt_bytes(needs[last])}" in misfit(small, cuts)


# --------------------------------------------------------------------------------------- CLI
@pytest.fixture
def tiny_factory(monkeypatch):
    mod = types.ModuleType("plan_cuts_models")
    mod.tiny = lambda *, batch, seq, device: (_gpt(device), (_ids(batch, device),))
    monkeypatch.setitem(sys.modules, "plan_cuts_models", mod)


def test_cli_plans_given_cuts(tiny_factory, capsys):
    argv = ["plan", "--model", "plan_cuts_models:tiny", "--topology", "single-3090", "--batch", "2", "--quiet"]
    assert main([*argv, "--cuts", "1,3"]) == 0
    out = capsys.readouterr().out
    assert "3 stages on 1 GPUs, 1 micro-batches (default: one per GPU)" in out and "given cuts [1, 3]" in out
    assert main([*argv, "--cuts", "none"]) == 0
    assert "1 stages on 1 GPUs" in capsys.readouterr().out


def test_cli_compares_with_the_optimizer_overlap_asked_for(tiny_factory, capsys):
    # The comparison's step column follows --optimizer-overlap: "async" hides an optimizer
    # faster than the pipeline behind it (its one fused pass runs beside the pipeline): the step is
    # the pipeline, by default (on 8 RTX 4090s, each GPU on its own link, the fp32 .grad is widened
    # on the GPUs: no hand-over, the downloads 4 B per parameter) and with --no-keep-grads (no fp32 .grad, bf16 downloads: never a longer one);
    # "none" adds the hand-over and the optimizer after it.
    argv = ["plan", "--model", "plan_cuts_models:tiny", "--topology", "rtx4090x8", "--batch", "8", "--quiet",
            "--cuts", "1,3", "--adam-gbps", "1000"]
    def parse_time(text):  # fmt_time's "36 us", "1.2 ms", "3 s"
        value, unit = text.split()
        return float(value) * {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}[unit]

    steps = {}
    for mode in ("none", "async", "async-bare"):
        assert main([*argv, "--optimizer-overlap", mode.split("-")[0], *(["--no-keep-grads"] if "-" in mode else [])]) == 0
        out = capsys.readouterr().out
        assert f"CPU optimizer overlap: {mode.split('-')[0]}" in out
        fwd_bwd, step = (" ".join(x) for x in (lambda f: (f[1:3], f[3:5]))(
            next(line for line in out.splitlines() if line.startswith("mobius ")).split()))
        steps[mode] = parse_time(step)
        assert (parse_time(step) > parse_time(fwd_bwd)) if mode == "none" else (step == fwd_bwd), \
            (mode, fwd_bwd, step)
    assert steps["async-bare"] <= steps["async"] < steps["none"], steps


@pytest.mark.parametrize("value, rule", [("1,x", "comma-separated layer indices"),
                                         ("3,2", "not strictly increasing")])
def test_cli_refuses_bad_cuts_before_planning(value, rule, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "gpt2", "--topology", "single-3090", "--cuts", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --cuts" in err and rule in err
