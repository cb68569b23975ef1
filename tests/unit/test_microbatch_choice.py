"""The planner's choice of the micro-batch count (`plan()` without `microbatches=`): the counts
it times (planning/microbatch.py `candidate_counts`), how it picks among them
(schedules/choice.py `choose_count`) and what `plan()` does with it (api.py): the same trace,
one MIP, the caller's count binding, the reason on the plan's first line."""

from dataclasses import dataclass

import pytest
import torch

import mobius_fx
from mobius_fx import schedules
from mobius_fx.errors import MobiusError, PlanError
from mobius_fx.planning.microbatch import candidate_counts, divides
from mobius_fx.schedules import choice
from mobius_fx.schedules.choice import NO_BUBBLE, Choice, choose_count
from mobius_fx.sim.simulator import simulate
from mobius_fx.topology.server import Topology
from mobius_fx.zoo import GPT, GPTConfig

CFG = GPTConfig(vocab=100, seq=16, hidden=32, blocks=4, heads=2)  # 6 layers: embedding, 4 blocks, head


# ------------------------------------------------------------------ the counts timed
@pytest.mark.parametrize("rows, default, expected", [
    (64, 8, (8, 16, 32, 64)),
    (1024, 8, (8, 16, 32, 64)),  # at most 4 counts
    (48, 8, (8, 16, 48)),        # the smallest divisor at least 2x the last
    (8, 8, (8,)),                # one row each already
    (8, 1, (1,)),                # one GPU: nothing timed
    (None, 4, (4,)),             # no batch to split
])
def test_the_counts_timed_are_the_default_then_divisors_near_2x_4x_8x(rows, default, expected):
    got = candidate_counts(rows, default)
    assert got == expected
    assert got[0] == default and list(got) == sorted(got) and len(got) <= 4
    assert all(divides(rows, m) for m in got)  # compile's split needs equal micro-batches


# ------------------------------------------------------------------ choose_count's rule, on stub plans
@dataclass(frozen=True)
class _Plan:
    microbatches: int
    bound: float
    microbatches_rule: str = ""

    def lower_bound(self) -> float:
        return self.bound


def _stub(monkeypatch, times, bound=0.1):
    """choose_count over stub plans whose chosen schedule takes `times[m]` (an Exception: raised)."""
    asked = []

    def plan_at(m):
        asked.append(m)
        if isinstance(times[m], Exception):
            raise times[m]
        return _Plan(m, bound, "default: one per GPU" if m == min(times) else "chosen by the planner")

    monkeypatch.setattr(choice, "choose", lambda p, schedule=None, **kw: Choice(
        "mobius", f"schedule: mobius ({p.microbatches})", {"mobius": times[p.microbatches]}))
    return plan_at, asked


def test_the_fastest_count_wins_and_raising_stops_when_a_count_is_no_faster(monkeypatch):
    plan_at, asked = _stub(monkeypatch, {4: 1.0, 8: 0.8, 16: 0.9, 32: 0.5})
    plan, c = choose_count(plan_at, (4, 8, 16, 32))
    assert plan.microbatches == 8 and asked == [4, 8, 16]  # 16 slower than 8: 32 not planned
    assert c.line.startswith("schedule: mobius (8); 8 micro-batches (simulated fwd+bwd 0.8 s vs 1 s at 4, 0.9 s "
                             "at 16; fwd+bwd / lower bound 10.00 at 4, 8.00 at 8: the fill/drain bubble shrinks")
    assert c.line.endswith("; 32 not timed: 16 was slower than 8)")
    assert plan.microbatches_rule == "chosen: the fastest simulated fwd+bwd of 4, 8, 16"


def test_raising_stops_once_the_best_is_at_the_lower_bound(monkeypatch):
    plan_at, asked = _stub(monkeypatch, {4: 1.0, 8: 0.1 * NO_BUBBLE, 16: 0.05}, bound=0.1)
    plan, c = choose_count(plan_at, (4, 8, 16))
    assert plan.microbatches == 8 and asked == [4, 8]
    assert c.line.endswith(f"16 not timed: 8 is within {NO_BUBBLE:.2f}x the lower bound)")


def test_a_tie_keeps_fewer_micro_batches_and_the_default_says_it_is_the_fastest(monkeypatch):
    plan_at, _ = _stub(monkeypatch, {4: 0.5, 8: 0.5})
    plan, c = choose_count(plan_at, (4, 8))
    assert plan.microbatches == 4
    assert "the default (default: one per GPU) is the fastest" in c.line
    assert plan.microbatches_rule == "default: one per GPU, the fastest simulated fwd+bwd of 4, 8"


def test_a_count_that_does_not_fit_is_passed_over_and_none_fitting_raises_the_first_error(monkeypatch):
    plan_at, _ = _stub(monkeypatch, {4: PlanError("stage 3 needs 30 GiB"), 8: 0.7})
    plan, c = choose_count(plan_at, (4, 8))
    assert plan.microbatches == 8 and "vs 4 does not fit" in c.line
    plan_at, _ = _stub(monkeypatch, {4: PlanError("stage 3 needs 30 GiB"), 8: MobiusError("no schedule fits")})
    with pytest.raises(PlanError, match="stage 3 needs 30 GiB"):
        choose_count(plan_at, (4, 8))


def test_one_count_says_why_no_other_was_timed(monkeypatch):
    plan_at, asked = _stub(monkeypatch, {8: 0.7})
    plan, c = choose_count(plan_at, (8,), alone="one row each: a batch of 8 rows splits into no more")
    assert asked == [8] and plan.microbatches_rule == "default: one per GPU"  # the rule kept as it was
    assert c.line == ("schedule: mobius (8); 8 micro-batches (default: one per GPU; one row each: a batch of 8 rows "
                      "splits into no more)")


# ------------------------------------------------------------------ plan(): meta model, planned, not allocated
def _plan(tmp_path, batch=8, **kw):
    with torch.device("meta"):
        model = GPT(CFG)
    ids = torch.zeros(batch, CFG.seq, dtype=torch.long, device="meta")
    return mobius_fx.plan(model, Topology.virtual(gpus=4), example_inputs=(ids,), cache_dir=str(tmp_path),
                          verbose=False, **kw)


def _fastest(plan):
    """The least simulated fwd+bwd of the plan's candidate schedules (what `choose` ranks by)."""
    out = []
    for n in schedules.candidates():
        try:
            out.append(simulate(plan, schedule=n).pipeline_time)
        except MobiusError:
            pass
    return min(out)


@pytest.fixture(scope="module")
def chosen(tmp_path_factory):
    """plan() of an 8-row batch on 4 GPUs without microbatches=, counting traces and MIPs."""
    import mobius_fx.passes.partition as partition
    import mobius_fx.tracing as tracing

    calls = {"trace": 0, "mip": 0}
    trace, solve = tracing.trace, partition.solve

    def counted(name, fn):
        def call(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return call

    mp = pytest.MonkeyPatch()
    mp.setattr(tracing, "trace", counted("trace", trace))
    mp.setattr(partition, "solve", counted("mip", solve))
    try:
        plan = _plan(tmp_path_factory.mktemp("chosen"), cache=False)
    finally:
        mp.undo()
    return plan, calls


def test_plan_chooses_a_count_the_simulator_says_is_faster_than_the_default(chosen, tmp_path):
    plan, _ = chosen
    default = _plan(tmp_path, microbatches=4)  # one per GPU
    assert candidate_counts(8, 4) == (4, 8) and plan.microbatches == 8
    assert _fastest(plan) < _fastest(default)


def test_the_first_line_says_the_count_and_why(chosen):
    plan, _ = chosen
    first = str(plan).splitlines()[0]
    assert first == plan.schedule_choice and first.startswith("schedule: ")
    m = plan.microbatches
    assert f"; {m} micro-batches (simulated fwd+bwd " in first and " at 4" in first
    assert "fwd+bwd / lower bound" in first and "the fill/drain bubble shrinks" in first
    assert f"{m} micro-batches (chosen: the fastest simulated fwd+bwd of 4, 8)" in plan.summary()
    assert mobius_fx.Plan.from_json(plan.to_json()).schedule_choice == first


def test_choosing_traces_once_and_runs_one_mip(chosen):
    _, calls = chosen
    assert calls == {"trace": 1, "mip": 1}  # the other counts: the same trace, costs and cuts


def test_the_callers_count_is_binding(tmp_path):
    plan = _plan(tmp_path, microbatches=2)
    assert plan.microbatches == 2
    assert plan.schedule_choice.endswith("; 2 micro-batches (the caller's)")


def test_the_benchmarks_floor_is_under_every_schedule_the_simulator_runs(chosen):
    """benchmarks/schedules.py's floor (every weight uploaded once, then the backward's compute on
    every GPU) is what it claims: no registered schedule's simulated fwd+bwd is below it."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "schedules.py"
    spec = importlib.util.spec_from_file_location("bench_schedules", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    plan, _ = chosen
    with torch.device("meta"):
        model = GPT(CFG)
    floor = bench.floor(plan, model)
    times = {}
    for n in schedules.names():
        try:
            times[n] = simulate(plan, schedule=n).pipeline_time
        except MobiusError:
            pass
    assert len(times) >= 3 and floor > 0
    assert all(floor <= t for t in times.values()), (floor, times)
