"""The planner's choice of the micro-batch count (`plan()` without `microbatches=`): the counts
it times (planning/microbatch.py `candidate_counts`), how it picks among them
(schedules/choice.py `choose_count`) and what `plan()` does with it (api.py): the same trace,
the default's MIP, the chosen count's own MIP kept when it simulates faster, the caller's count
binding, the reason and the cuts on the plan's first line."""

from dataclasses import dataclass

import pytest
import torch

import mobius_fx
from mobius_fx import schedules
from mobius_fx.errors import MobiusError, PlanError
from mobius_fx.planning.microbatch import candidate_counts, divides
from mobius_fx.schedules import choice
from mobius_fx.schedules.choice import NO_BUBBLE, Choice, _fmt, choose_count
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
    assert c.line.endswith("; 32 not timed: 16 was slower than 8); cuts: those planned at 4 (its own MIP not run)")
    assert plan.microbatches_rule == "chosen: the fastest simulated fwd+bwd of 4, 8, 16"


def test_raising_stops_once_the_best_is_at_the_lower_bound(monkeypatch):
    plan_at, asked = _stub(monkeypatch, {4: 1.0, 8: 0.1 * NO_BUBBLE, 16: 0.05}, bound=0.1)
    plan, c = choose_count(plan_at, (4, 8, 16))
    assert plan.microbatches == 8 and asked == [4, 8]
    assert f"16 not timed: 8 is within {NO_BUBBLE:.2f}x the lower bound); cuts: " in c.line


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


# ------------------------------------------------------------------ the chosen count's own cuts (replan)
@dataclass(frozen=True)
class _Own(_Plan):
    """A stub plan of a count on its own cuts (the MIP solved at that count)."""


def _stub_replan(monkeypatch, kept, own, bound=0.1):
    """choose_count over stub plans: `kept[m]` the fwd+bwd at m on the default's cuts, `own[m]`
    on m's own cuts (an Exception: raised); the counts replanned are recorded."""
    plan_at, _ = _stub(monkeypatch, kept, bound)
    replanned = []

    def replan(m):
        replanned.append(m)
        if isinstance(own[m], Exception):
            raise own[m]
        return _Own(m, bound, "chosen by the planner")

    monkeypatch.setattr(choice, "choose", lambda p, schedule=None, **kw: Choice(
        "mobius", f"schedule: mobius ({p.microbatches}{', own' if isinstance(p, _Own) else ''})",
        {"mobius": (own if isinstance(p, _Own) else kept)[p.microbatches]}))
    return plan_at, replan, replanned


def test_the_chosen_count_keeps_its_own_cuts_when_they_simulate_faster(monkeypatch):
    plan_at, replan, replanned = _stub_replan(monkeypatch, {4: 1.0, 8: 0.8, 16: 0.7}, {16: 0.6})
    plan, c = choose_count(plan_at, (4, 8, 16), replan=replan)
    assert replanned == [16] and isinstance(plan, _Own) and plan.microbatches == 16
    assert c.line.startswith("schedule: mobius (16, own); 16 micro-batches (simulated fwd+bwd 0.6 s vs 1 s at 4, "
                             "0.8 s at 8; fwd+bwd / lower bound 10.00 at 4, 6.00 at 16")
    assert c.line.endswith("; cuts: its own MIP's (0.6 s vs 0.7 s on the cuts planned at 4)")


@pytest.mark.parametrize("own", [0.75, 0.7, MobiusError("no schedule fits")])  # slower, a tie, no plan
def test_the_chosen_count_keeps_the_defaults_cuts_when_its_own_are_no_faster(monkeypatch, own):
    plan_at, replan, replanned = _stub_replan(monkeypatch, {4: 1.0, 8: 0.8, 16: 0.7}, {16: own})
    plan, c = choose_count(plan_at, (4, 8, 16), replan=replan)
    assert replanned == [16] and not isinstance(plan, _Own) and plan.microbatches == 16
    assert c.line.startswith("schedule: mobius (16); 16 micro-batches (simulated fwd+bwd 0.7 s vs 1 s at 4, 0.8 s at 8")
    why = " does not fit: no schedule fits" if isinstance(own, Exception) else f": {own:g} s, no faster"
    assert c.line.endswith(f"; cuts: those planned at 4 (its own MIP's{why})")


@pytest.mark.parametrize("own_mobius, kept", [(0.8, False), (0.9, True), (1.0, True)])
def test_on_a_tie_of_the_chosen_schedule_the_cuts_compiles_schedule_runs_faster_on_are_kept(monkeypatch, own_mobius,
                                                                                           kept):
    """split-head re-cuts the plan into one-layer slots: its time is the same on any cuts, and
    then the fastest schedule compile runs by itself (mobius) decides."""
    plan_at, replan, _ = _stub_replan(monkeypatch, {4: 1.0, 8: 0.7}, {8: 0.7})
    runs = {False: 0.9, True: own_mobius}  # mobius's fwd+bwd on the default's cuts, on 8's own
    monkeypatch.setattr(choice, "choose", lambda p, schedule=None, **kw: Choice(
        "split-head", f"schedule: split-head ({p.microbatches})",
        {"split-head": {4: 1.0, 8: 0.7}[p.microbatches], "mobius": runs[isinstance(p, _Own)] + (p.microbatches == 4)}))
    plan, c = choose_count(plan_at, (4, 8), replan=replan)
    assert plan.microbatches == 8 and isinstance(plan, _Own) is not kept
    either = f"0.7 s on either; mobius {own_mobius:g} s vs mobius 0.9 s"
    assert c.line.endswith(f"; cuts: its own MIP's ({either} on the cuts planned at 4)" if not kept else
                           "; cuts: those planned at 4 (its own MIP's: 0.7 s, no faster)" if own_mobius == 0.9 else
                           f"; cuts: those planned at 4 (its own MIP's: {either} on these)")


def test_only_the_fastest_counts_are_replanned_and_never_the_default(monkeypatch):
    plan_at, replan, replanned = _stub_replan(monkeypatch, {4: 0.5, 8: 0.8}, {})
    plan, c = choose_count(plan_at, (4, 8), replan=replan)
    assert replanned == [] and plan.microbatches == 4 and c.line.endswith("; cuts: its own MIP's")
    # two replanned: the second fastest on the default's cuts can win on its own
    plan_at, replan, replanned = _stub_replan(monkeypatch, {4: 1.0, 8: 0.8, 16: 0.7}, {16: 0.75, 8: 0.6})
    plan, c = choose_count(plan_at, (4, 8, 16), replan=replan, replanned=2)
    assert replanned == [16, 8] and isinstance(plan, _Own) and plan.microbatches == 8
    assert "8 micro-batches (simulated fwd+bwd 0.6 s vs 1 s at 4, 0.7 s at 16" in c.line


def test_without_replan_the_defaults_cuts_stay_and_the_line_says_why(monkeypatch):
    plan_at, _ = _stub(monkeypatch, {4: 1.0, 8: 0.8})
    plan, c = choose_count(plan_at, (4, 8))
    assert plan.microbatches == 8 and c.line.endswith("; cuts: those planned at 4 (its own MIP not run)")
    plan, c = choose_count(plan_at, (4, 8), kept_why="the caller's (cuts=)")
    assert c.line.endswith("; cuts: the caller's (cuts=)")
    plan_at, _ = _stub(monkeypatch, {4: 0.8, 8: 1.0})  # the default the fastest: still the caller's cuts
    plan, c = choose_count(plan_at, (4, 8), kept_why="the caller's (cuts=)")
    assert plan.microbatches == 4 and c.line.endswith("; cuts: the caller's (cuts=)")


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
    solved = []  # each MIP's (micro-batches, hint, boundaries)

    def counted(name, fn):
        def call(*a, **k):
            calls[name] += 1
            out = fn(*a, **k)
            if name == "mip":
                solved.append((a[0].microbatches, k.get("hint"), tuple(out.boundaries)))
            return out
        return call

    mp = pytest.MonkeyPatch()
    mp.setattr(tracing, "trace", counted("trace", trace))
    mp.setattr(partition, "solve", counted("mip", solve))
    try:
        plan = _plan(tmp_path_factory.mktemp("chosen"), cache=False)
    finally:
        mp.undo()
    return plan, calls, solved


def test_plan_chooses_a_count_the_simulator_says_is_faster_than_the_default(chosen, tmp_path):
    plan, *_ = chosen
    default = _plan(tmp_path, microbatches=4)  # one per GPU
    assert candidate_counts(8, 4) == (4, 8) and plan.microbatches == 8
    assert _fastest(plan) < _fastest(default)


def test_the_first_line_says_the_count_and_why(chosen):
    plan, *_ = chosen
    first = str(plan).splitlines()[0]
    assert first == plan.schedule_choice and first.startswith("schedule: ")
    m = plan.microbatches
    assert f"; {m} micro-batches (simulated fwd+bwd " in first and " at 4" in first
    assert "fwd+bwd / lower bound" in first and "the fill/drain bubble shrinks" in first
    assert f"{m} micro-batches (chosen: the fastest simulated fwd+bwd of 4, 8)" in plan.summary()
    assert mobius_fx.Plan.from_json(plan.to_json()).schedule_choice == first


def test_choosing_traces_once_and_runs_a_mip_for_the_default_and_the_chosen_count(chosen):
    plan, calls, solved = chosen
    assert calls == {"trace": 1, "mip": 2}  # the other counts: the same trace, costs and the default's cuts
    (m0, hint0, cuts0), (m1, hint1, _) = solved
    assert (m0, hint0, m1, hint1) == (4, None, 8, cuts0)  # the chosen count's MIP starts from the default's cuts
    # 8 on its own cuts is no faster here (the MIP cuts 8 where it cut 4): the default's are kept
    assert plan.schedule_choice.endswith(", no faster)") and "; cuts: those planned at 4 (its own MIP's: " in \
        plan.schedule_choice


def _cuts(plan):
    names = [layer.name for layer in plan.layers]
    return [names.index(st.layers[0]) for st in plan.stages[1:]]


def test_the_chosen_count_keeps_its_own_mips_cuts_when_they_simulate_faster(tmp_path):
    """2 GPUs, 16 rows of 128 tokens, a 2000-word vocabulary: the MIP at the default 2
    micro-batches balances the uploads; at 16 the compute weighs more and its own cuts differ."""
    cfg = GPTConfig(vocab=2000, seq=128, hidden=32, blocks=4, heads=2)
    with torch.device("meta"):
        model = GPT(cfg)
    ids = torch.zeros(16, cfg.seq, dtype=torch.long, device="meta")
    kw = dict(example_inputs=(ids,), cache_dir=str(tmp_path), verbose=False, cache=False)
    plan = mobius_fx.plan(model, Topology.virtual(gpus=2), **kw)
    default = mobius_fx.plan(model, Topology.virtual(gpus=2), microbatches=2, **kw)
    # the same count on the default's cuts: what the planner ranked the counts by
    kept = mobius_fx.plan(model, Topology.virtual(gpus=2), cuts=_cuts(default), **kw)
    assert plan.microbatches == kept.microbatches == 16 and _cuts(plan) != _cuts(default)
    assert _fastest(plan) < _fastest(kept)
    line = plan.schedule_choice
    assert f"; cuts: its own MIP's ({_fmt(_fastest(plan))} vs {_fmt(_fastest(kept))} on the cuts planned at 2)" in line
    assert kept.schedule_choice.endswith("; cuts: the caller's (cuts=)")


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
    plan, *_ = chosen
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
