"""Partial gradient downloads are never widened: where a schedule downloads a stage's gradients from
several GPUs -- split-head's dealt last stage, ZeRO-3 offload's replicas -- the host sums the
partials, so widening each to fp32 would double their link bytes and the host's reads and still
leave the sum to the host. The IR books them as streamed (`StageIO.partial_grad_bytes`), the
runtime downloads them so (`Step.split_downloads`), the simulator charges them so; a stage's one
download is widened as before.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from mobius_fx import Topology
from mobius_fx.planning.ir_data_parallel import data_parallel
from mobius_fx.planning.ir_split_head import split_head
from mobius_fx.planning.schedule_ir import StageInput, StageIO, build_schedule
from mobius_fx.sim.simulator import simulate
from tests.property.test_conformance_props import _moved
from tests.unit.test_executor_split_head import _compile
from tests.unit.test_simulator import make_layers, make_plan
from tests.unit.test_train_step import Classifier

pytestmark = pytest.mark.usefixtures("one_thread")


def _stages():
    """Two stages, 40 B of gradients as one download moves them (widened), 20 B as streamed."""
    return [StageIO("gpu0", 100, 40, (StageInput(-1, 8, needs_grad=False),), partial_grad_bytes=20),
            StageIO("gpu1", 100, 40, (StageInput(0, 8),), host_outputs=(8,), partial_grad_bytes=20)]


def _downloads(ir, stage):
    return [o.bytes for o in ir.ops if o.kind == "download" and o.stage == stage]


def test_partials_are_booked_as_streamed_and_one_download_as_it_is():
    ir = build_schedule(_stages(), 2)
    assert _downloads(ir, 0) == [40] and _downloads(ir, 1) == [40]
    dealt = split_head(ir, ["gpu0", "gpu1"])
    assert _downloads(dealt, 1) == [20, 20] and _downloads(dealt, 0) == [40]  # the dealt stage's two partials
    assert _downloads(data_parallel(ir), 0) == [20, 20]  # a replica per GPU: partials of every stage
    assert _downloads(data_parallel(build_schedule(_stages(), 1)), 0) == [40]  # one micro-batch: one replica


def test_the_simulator_charges_a_dealt_stages_partials_as_streamed():
    plan = make_plan(Topology.preset("mobius-testbed"), make_layers(16, w=200e6, out=8e6), list(range(0, 16, 2)), 8, dtype="float16")
    by = {w: simulate(plan, schedule="split-head", optimizer_overlap="sync", widen_downloads=w) for w in (True, False)}
    grads = {w: [e for e in r.events if e.kind == "gradient"] for w, r in by.items()}
    last = max(e.stage for e in grads[True])
    heads = {w: sorted(e.bytes for e in g if e.stage == last) for w, g in grads.items()}
    rest = {w: sum(e.bytes for e in g if e.stage != last) for w, g in grads.items()}
    assert len(heads[True]) > 1 and heads[True] == heads[False]  # partials: streamed either way
    assert rest[True] == pytest.approx(2 * rest[False], rel=1e-6)  # one download per stage: widened (fp16 -> fp32)


def test_split_heads_partials_go_down_as_streamed_and_the_update_is_the_same_bits():
    torch.manual_seed(0)
    model = Classifier(blocks=3)
    twin = copy.deepcopy(model)
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    ys = [torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(9 + s)) for s in range(3)]
    pipes, opts = [], []
    for m, widen in ((model, True), (twin, False)):
        p = _compile(m, xs[0], 2, 4, 3, cuts=[1, 2, 3], loss_fn=F.cross_entropy, dtype=torch.bfloat16)
        o = p.overlap(torch.optim.AdamW(m.parameters(), lr=1e-2), mode="sync")
        o.widen_downloads = widen
        pipes.append(p)
        opts.append(o)
    for x, y in zip(xs, ys):  # the probe (serial), then overlapped steps
        for p, o in zip(pipes, opts):
            o.zero_grad()
            p.train_step(x, target=y)
            o.step()
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad) and torch.equal(a, b), n
    sp = pipes[0].step_pipeline
    assert sp._rt.widens_gradients()
    last = sp.plan.num_stages - 1
    got, want = _moved(sp, sp._rt._step_executor.ir)
    grads = {g: kinds.get("gradient d2h", {}) for g, kinds in got.items()}
    assert grads == {g: kinds.get("gradient d2h", {}) for g, kinds in want.items()}
    head = sum(p.numel() for k, st in enumerate(sp._rt.stages) if k == last for p in st.masters)
    assert sum(per[last] for per in grads.values() if last in per) == 2 * 2 * head  # two partials, bf16
    assert any(per.get(0) == 4 * sum(p.numel() for p in sp._rt.stages[0].masters) for per in grads.values())  # widened
    for o in opts:
        o.close()
