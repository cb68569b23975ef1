"""The flow-level network model and the task replay engine (mobius_fx.sim.network)."""

import math

import pytest

from mobius_fx.errors import MobiusError
from mobius_fx.sim.network import FlowNetwork, Task, max_min_rates, replay, run_flows

GB = 1e9
AB, BC, BA = ("a", "b"), ("b", "c"), ("b", "a")


def test_two_flows_on_one_link_take_twice_as_long():
    assert run_flows({AB: GB}, [(0.0, [AB], GB), (0.0, [AB], GB)]) == pytest.approx([2.0, 2.0])


def test_flows_on_disjoint_links_do_not_interfere():
    assert run_flows({AB: GB, BC: 2 * GB}, [(0.0, [AB], GB), (0.0, [BC], GB)]) == pytest.approx([1.0, 0.5])


def test_opposite_directions_of_a_link_do_not_interfere():
    # PCIe is full duplex: H2D and D2H are separate resources.
    assert run_flows({AB: GB, BA: GB}, [(0.0, [AB], GB), (0.0, [BA], GB)]) == pytest.approx([1.0, 1.0])


def test_three_flows_through_a_shared_uplink_get_a_third_each():
    up = ("cpu", "sw")
    caps = {up: 3 * GB, ("sw", "g0"): 10 * GB, ("sw", "g1"): 10 * GB, ("sw", "g2"): 10 * GB}
    rates = max_min_rates({i: [up, ("sw", f"g{i}")] for i in range(3)}, caps)
    assert rates == pytest.approx({0: GB, 1: GB, 2: GB})


def test_flow_bottlenecked_elsewhere_leaves_its_share_to_others():
    # y is held to 2 by b->c, so x gets the remaining 8 of a->b (max-min, not 5/5).
    rates = max_min_rates({"x": [AB], "y": [AB, BC]}, {AB: 10.0, BC: 2.0})
    assert rates == pytest.approx({"x": 8.0, "y": 2.0})


def test_flow_is_re_rated_when_another_finishes():
    # Both at 0.5 until the short one ends at t=1 (0.5 moved each); the long one then runs at 1.
    assert run_flows({AB: 1.0}, [(0.0, [AB], 0.5), (0.0, [AB], 2.0)]) == pytest.approx([1.0, 2.5])


def test_flow_is_re_rated_when_another_starts():
    assert run_flows({AB: 1.0}, [(0.0, [AB], 1.0), (0.5, [AB], 1.0)]) == pytest.approx([1.5, 2.0])


def test_flow_with_no_links_is_instant():
    assert run_flows({AB: 1.0}, [(0.0, [], 5.0)]) == [0.0]


def test_zero_bandwidth_link_is_an_error():
    with pytest.raises(MobiusError, match="positive bandwidth"):
        max_min_rates({"x": [AB]}, {AB: 0.0})


def test_network_reports_bytes_and_busy_time_per_link():
    net = FlowNetwork({AB: 1.0, BC: 1.0})
    net.add("x", [AB, BC], 2.0, now=0.0)
    t, key = net.next_finish()
    net.advance(t)
    net.finished(force=key)
    assert (t, key) == (2.0, "x")
    assert net.link_bytes == {AB: 2.0, BC: 2.0}
    assert net.link_busy() == pytest.approx({AB: 2.0, BC: 2.0})


def test_replay_runs_one_task_per_stream_at_a_time():
    tasks = [Task("a", stream="s", duration=1.0), Task("b", stream="s", duration=1.0)]
    r = replay(tasks, {})
    assert sorted((r.start[i], r.end[i]) for i in range(2)) == [(0.0, 1.0), (1.0, 2.0)]


def test_replay_stream_runs_the_task_needed_first_first():
    tasks = [Task("later", stream="up", priority=(2,), links=(AB,), size=1.0),
             Task("sooner", stream="up", priority=(1,), links=(AB,), size=1.0)]
    r = replay(tasks, {AB: 1.0})
    assert (r.start[1], r.start[0]) == (0.0, 1.0)


def test_replay_start_dependency_overlaps_with_the_task_it_follows():
    # A prefetch that may start when a compute task starts runs alongside it.
    tasks = [Task("compute", stream="c", duration=2.0), Task("prefetch", links=(AB,), size=1.0, after_start=[0])]
    r = replay(tasks, {AB: 1.0})
    assert (r.start[1], r.end[1]) == (0.0, 1.0)


def test_replay_end_dependency_waits():
    tasks = [Task("x", duration=2.0), Task("y", duration=1.0, after=[0])]
    r = replay(tasks, {})
    assert r.end[1] == 3.0


def test_replay_reports_a_cycle():
    with pytest.raises(MobiusError, match="cycle"):
        replay([Task("x", after=[1]), Task("y", after=[0])], {})


def test_replay_records_time_per_bottleneck_link():
    tasks = [Task("x", links=(AB, BC), size=4.0)]
    r = replay(tasks, {AB: 1.0, BC: 4.0})
    assert r.flow_links[0] == pytest.approx({AB: 4.0})
    assert not math.isnan(r.end[0])


# ------------------------------------------------------------------ priorities on a link
def test_the_flow_needed_first_takes_a_shared_link_first():
    # Same link, same bytes: the urgent one (priority 0) runs alone at full rate, then the other.
    assert run_flows({AB: 1.0}, [(0.0, [AB], 1.0, (1,)), (0.0, [AB], 1.0, (0,))]) == pytest.approx([2.0, 1.0])


def test_a_less_urgent_flow_gets_what_the_urgent_ones_leave():
    # x (urgent) is held to 2 by b->c, so y (later) gets the other 8 of a->b, not nothing.
    rates = max_min_rates({"x": [AB, BC], "y": [AB]}, {AB: 10.0, BC: 2.0}, priority={"x": (0,), "y": (1,)})
    assert rates == pytest.approx({"x": 2.0, "y": 8.0})


def test_flows_of_one_priority_share_max_min_fairly():
    rates = max_min_rates({"x": [AB], "y": [AB], "z": [AB]}, {AB: 9.0}, priority={"x": (0,), "y": (1,), "z": (1,)})
    assert rates == pytest.approx({"x": 9.0, "y": 0.0, "z": 0.0})
    assert max_min_rates({"y": [AB], "z": [AB]}, {AB: 9.0}, priority={"y": (1,), "z": (1,)}) == \
        pytest.approx({"y": 4.5, "z": 4.5})


# ------------------------------------------------------------- two directions of a link
def test_both_directions_of_an_interfering_link_keep_the_duplex_share():
    # d = 0.72: the pair carries 0.72 x (1 + 1); each direction gets 0.72, so 1 byte takes 1/0.72 s.
    assert run_flows({AB: 1.0, BA: 1.0}, [(0.0, [AB], 1.0), (0.0, [BA], 1.0)], duplex={AB: 0.72, BA: 0.72}) == \
        pytest.approx([1 / 0.72, 1 / 0.72])


def test_one_direction_alone_runs_at_full_speed_on_an_interfering_link():
    assert run_flows({AB: 1.0, BA: 1.0}, [(0.0, [AB], 1.0)], duplex={AB: 0.72, BA: 0.72}) == pytest.approx([1.0])


def test_the_duplex_budget_a_slow_reverse_flow_leaves_goes_to_the_other_direction():
    # d = 0.5: both directions share 1.0. y (b->a) also crosses a->c, which holds it to 0.2, so
    # x (a->b) gets the rest of the shared 1.0: 0.8, not a flat 0.5.
    caps = {AB: 1.0, BA: 1.0, ("a", "c"): 0.2}
    rates = max_min_rates({"x": [AB], "y": [BA, ("a", "c")]}, caps, duplex={AB: 0.5, BA: 0.5})
    assert rates == pytest.approx({"x": 0.8, "y": 0.2})


def test_a_duplex_factor_outside_half_to_one_is_refused():
    with pytest.raises(MobiusError, match=r"duplex factor 0.3.*between 0.5 and 1"):
        max_min_rates({"x": [AB]}, {AB: 1.0, BA: 1.0}, duplex={AB: 0.3})
