"""ZeRO-3 offload on the step executor: `compile(schedule="zero3-offload")` runs
`ir_data_parallel.data_parallel` of the pipeline's Mobius IR, one replica per GPU.

The transform deals micro-batches round-robin (GPU g: g, g+N, ...), uploads every stage to every
GPU in forward and again in backward, moves no activation between GPUs, downloads each GPU's
gradients of each stage and steps a stage on the host after all of them; a stage is on one GPU
at a time. On `virtual-async` with seeded random delays the step equals eager (loss and every
`.grad`, within a bound derived from summation order), moves exactly the IR's copies and executes
its order per GPU; a tied-weight GPT sums four downloads of its tied weight. The checks fail when
one GPU's gradients are left out (mutations below).
"""

from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

import mobius_fx
from mobius_fx import MobiusError, Topology, schedules
from mobius_fx.planning.ir_data_parallel import data_parallel, dealt
from mobius_fx.planning.ir_transforms import with_fields
from mobius_fx.planning.schedule_ir import StageInput, StageIO, build_schedule
from mobius_fx.runtime.devices import make_devices
from mobius_fx.zoo import GPT, GPTConfig
from mobius_fx.zoo.small import SkipNet
from tests.unit.test_executor import _check_conforms, _mutated, _step_ir
from tests.unit.test_train_step import Classifier, _grads

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "zero3-offload"
BUDGET = 64 << 20
U = torch.finfo(torch.float32).eps / 2  # fp32 unit roundoff


def _devices(n, seed):
    return make_devices({f"gpu{g}": BUDGET for g in range(n)}, device="virtual-async", seed=seed)


def _chain(s, n, m, frozen=0):
    """A Mobius IR of `s` stages round-robin on `n` GPUs, the last one's output to the host;
    the first `frozen` stages without gradients."""
    st = [StageIO(f"gpu{k % n}", 100 + k, 0 if k < frozen else 10 + k, (StageInput(k - 1, 7, needs_grad=k > 0),),
                  host_outputs=(5,) if k == s - 1 else ()) for k in range(s)]
    return build_schedule(st, m)


# ---------------------------------------------------------------------------------- the transform
@pytest.mark.parametrize("s,n,m,frozen", [(3, 2, 4, 0), (4, 2, 3, 0), (5, 3, 4, 0), (3, 3, 2, 0), (4, 2, 4, 1),
                                          (2, 1, 2, 0)])
def test_data_parallel_deals_microbatches_and_uploads_every_stage_to_every_gpu(s, n, m, frozen):
    ir = _chain(s, n, m, frozen)
    dp = data_parallel(ir)
    gpus = [f"gpu{g}" for g in range(n)]
    share = dealt(m, n)
    assert share == [[i for i in range(m) if i % n == g] for g in range(n)]
    active = [g for g, mbs in zip(gpus, share) if mbs]
    assert dp.gpus == tuple(active) and dp.microbatches == m
    trains = [k for k in range(s) if k >= frozen]
    for g, mbs in zip(gpus, share):
        runs = [(o.phase, o.stage, o.microbatch) for o in dp.place(g) if o.kind == "run"]
        want = [("forward", k, i) for k in range(s) for i in mbs]
        want += [("backward", k, i) for k in reversed(trains) for i in reversed(mbs)]
        assert runs == want, g
        ups = [(o.phase, o.stage) for o in dp.place(g) if o.kind == "prefetch"]
        assert sorted(ups) == sorted([("forward", k) for k in range(s)] + [("backward", k) for k in trains]) if mbs \
            else ups == []
        assert [o.stage for o in dp.place(g) if o.kind == "download"] == list(reversed(trains)) if mbs else True
    assert not any(o.kind == "hold" for o in dp.ops)  # every GPU uploads its last stage again for backward
    assert not [o for o in dp.copies() if o.direction == "d2d"]  # no activation crosses GPUs
    for o in dp.select(kind="step"):  # the host steps a stage once every GPU's gradients of it arrived
        assert sorted(dp.ops[d].place for d in o.deps) == active and o.place == "host"
    assert sorted(o.stage for o in dp.select(kind="step")) == trains
    assert all(d < o.index for o in dp.ops for d in o.deps)
    assert max(dp.resident_at_most().values()) <= 2
    # the wavefront: in issue order a stage is on one GPU at a time, and each upload of it depends
    # on the evict that let it go before
    where: dict[int, str] = {}
    last_evict: dict[int, int] = {}
    for o in dp.ops:
        if o.kind == "prefetch":
            assert o.stage not in where, f"{o}: stage {o.stage} is still on {where.get(o.stage)}"
            assert o.stage not in last_evict or last_evict[o.stage] in o.deps, str(o)
            where[o.stage] = o.place
        elif o.kind == "evict":
            assert where.pop(o.stage) == o.place
            last_evict[o.stage] = o.index
    assert not where
    # bytes: each active GPU uploads every stage twice (once for a frozen one), downloads its gradients once
    moved = dp.bytes_moved()
    for g in active:
        assert sum(b for (gpu, what, d, _), (_, b) in moved.items() if gpu == g and what == "weight") == \
            sum(100 + k for k in range(s)) + sum(100 + k for k in trains)
        assert sum(b for (gpu, what, d, _), (_, b) in moved.items() if gpu == g and what == "gradient") == \
            sum(10 + k for k in trains)


def test_data_parallel_refuses_an_ir_without_stages_and_repeated_gpus():
    ir = _chain(3, 2, 2)
    with pytest.raises(MobiusError, match=r"distinct GPU names, got \['gpu0', 'gpu0'\]"):
        data_parallel(ir, ["gpu0", "gpu0"])
    from mobius_fx.planning.schedule_ir import ScheduleIR
    with pytest.raises(MobiusError, match="needs a pipeline's schedule IR"):
        data_parallel(ScheduleIR(ops=(), stages=(), microbatches=2, gpus=(), next_on_gpu=(), prev_on_gpu=()))


# ---------------------------------------------------------------------------------- the runtime
def _row_grads(model, row_loss, rows):
    """Per parameter, the sum over the batch's rows of |d row_loss(r) / d param|: the magnitude
    the order of the gradient's summation rounds against."""
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for r in range(rows):
        model.zero_grad()
        row_loss(r).backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                total[n] += p.grad.abs()
    model.zero_grad()
    return total


def _assert_sum_order_close(got, want, mags, terms, depth):
    """`got` and `want` are one gradient summed over `terms` per-row (or per-token) contributions in
    two orders: the runtime's (per micro-batch on each GPU, then GPU by GPU on the host) and
    eager's (one backward over the batch). To first order in the unit roundoff u, two orders of
    the same n terms differ by at most 2(n - 1) u sum|terms|, and each term, computed through
    reductions at most `depth` long (the widest dot product, which a kernel may block differently
    for another batch size), by 2 depth u |term|. Reductions inside a row mix a tensor's entries
    (attention, normalisation), so the bound is per tensor, against its largest entry of
    sum_r |g_r| (`mags`, `_row_grads`): max |got - want| <= 2 (n - 1 + depth) u max sum_r |g_r|."""
    assert got.keys() == want.keys()
    for n in want:
        bound = 2 * (terms - 1 + depth) * U * mags[n].max().item()
        err = (got[n] - want[n]).abs().max().item()
        assert err <= bound, f"{n}: |got - eager| up to {err:.3g}, over the summation-order bound {bound:.3g}"


def _classifier_case(m, blocks, seed):
    torch.manual_seed(seed)
    model = Classifier(blocks=blocks)
    rows = 4 * m
    x, y = torch.randn(rows, 16), torch.randint(0, 50, (rows,))
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=m,
                             cuts=list(range(1, blocks + 1)), verbose=False, device=_devices(2, seed),
                             loss_fn=F.cross_entropy, schedule=NAME)
    return model, pipe, x, y


def _eager_classifier(model, x, y):
    rows = x.size(0)
    mags = _row_grads(model, lambda r: F.cross_entropy(model(x[r:r + 1]), y[r:r + 1], reduction="sum") / rows, rows)
    model.zero_grad()
    ref = F.cross_entropy(model(x), y)
    ref.backward()
    return ref.detach(), _grads(model), mags


@pytest.mark.parametrize("m,blocks,seed", [(2, 3, 1), (3, 3, 2), (4, 4, 3)])
def test_zero3_train_step_equals_eager_and_its_ir(m, blocks, seed):
    model, pipe, x, y = _classifier_case(m, blocks, seed)
    for _ in range(2):  # the second step starts from what the first left (.grad accumulates, as eager's)
        loss = pipe.train_step(x, target=y)
    got = _grads(model)
    ref, want, mags = _eager_classifier(model, x, y)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    _assert_sum_order_close(got, {n: 2 * g for n, g in want.items()}, {n: 2 * a for n, a in mags.items()},
                            2 * x.size(0), depth=50)
    ir = _step_ir(pipe, NAME, (x,), {"target": y})
    _check_conforms(pipe, ir)
    sp = pipe.step_pipeline
    assert sp._rt._step_executor.name == NAME
    # each GPU ran its dealt micro-batches through every stage, and downloaded every stage's gradients
    ran = defaultdict(set)
    for kind, gpu, k, phase, i in sp.executed_ops():
        if kind == "run":
            ran[gpu].add(i)
    assert dict(ran) == {f"gpu{g}": set(mbs) for g, mbs in enumerate(dealt(m, 2))}
    stats = sp.transfer_stats(last_step=True, by_stage=True)
    for g in ("gpu0", "gpu1"):
        assert set(stats[g]["gradient d2h"]) == set(range(len(sp.schedule.stages)))
        assert "activation d2d" not in stats[g]
    rt = sp._rt
    assert all(st.device.name == spec.gpu for st, spec in zip(rt.stages, rt.schedule.stages))  # back home


def test_the_checks_fail_when_one_gpus_gradients_are_not_summed():
    """Mutation: the host keeps only gpu0's downloads (gpu1's reduce-scatter share lost); the
    gradients then differ from eager's far beyond the summation-order bound."""
    model, pipe, x, y = _classifier_case(2, 3, 1)
    pipe.train_step(x, target=y)  # builds the executor
    rt = pipe.step_pipeline._rt
    download = rt._download

    def only_gpu0(k, step):
        n = len(step.pending)
        on = rt.stages[k].device.name
        download(k, step)
        if on == "gpu1":
            del step.pending[n:]

    rt._download = only_gpu0
    model.zero_grad()
    pipe.train_step(x, target=y)
    got = _grads(model)
    _, want, mags = _eager_classifier(model, x, y)
    with pytest.raises(AssertionError, match="over the summation-order bound"):
        _assert_sum_order_close(got, want, mags, x.size(0), depth=50)


def test_a_dropped_replica_download_is_refused_and_the_pipeline_stays_usable():
    """Mutation: gpu1's download of stage 1 removed from the IR: the executor refuses the step (its
    gradients would stay on gpu1) instead of summing gpu0's alone, and the next step runs."""
    model, pipe, x, y = _classifier_case(2, 3, 1)
    pipe.train_step(x, target=y)
    ex = pipe.step_pipeline._rt._step_executor
    good = ex.ir
    ex.ir = _mutated(good, lambda o: None if o.kind == "download" and o.stage == 1 and o.place == "gpu1" else o)
    model.zero_grad()
    with pytest.raises(MobiusError, match="stage 1's weight gradients are still on gpu1 after the step: the schedule "
                                          "IR 'zero3-offload' has no download"):
        pipe.train_step(x, target=y)
    assert all(p.grad is None for p in model.parameters())
    ex.ir = good
    loss = pipe.train_step(x, target=y)
    got = _grads(model)
    ref, want, mags = _eager_classifier(model, x, y)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    _assert_sum_order_close(got, want, mags, x.size(0), depth=50)


def test_a_microbatch_dealt_to_the_wrong_gpu_breaks_conformance():
    """Mutation: gpu1's runs of micro-batch 1 moved to gpu0's list (as if it were dealt there): the
    executed order no longer matches the IR the schedule defines."""
    model, pipe, x, y = _classifier_case(2, 3, 1)
    pipe.train_step(x, target=y)
    ir = _step_ir(pipe, NAME, (x,), {"target": y})
    _check_conforms(pipe, ir)
    wrong = _mutated(ir, lambda o: with_fields(o, microbatch=1 - o.microbatch) if o.kind == "run" else o)
    with pytest.raises(AssertionError):
        _check_conforms(pipe, wrong)


@pytest.mark.parametrize("m", [4])
def test_a_tied_gpt_sums_every_gpus_downloads_of_the_tied_weight(m):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=8, hidden=16, blocks=3, heads=2)
    model = GPT(cfg)  # lm_head tied to wte: held by the first and the last stage
    rows = 3 * m  # not the sequence length: the batch dimension is unambiguous
    ids = torch.randint(0, 64, (rows, 8))

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(ids,), microbatches=m,
                             verbose=False, device=_devices(2, 5 + m), loss_fn=loss_fn, schedule=NAME)
    loss = pipe.train_step(ids, target=ids)
    got = _grads(model)
    tokens = ids.numel()
    mags = _row_grads(model, lambda r: F.cross_entropy(model(ids[r:r + 1]).flatten(0, 1), ids[r].flatten(),
                                                       reduction="sum") / tokens, rows)
    ref = loss_fn(model(ids), ids)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    # a row is a sequence: its gradient sums seq positions too; the widest reduction is the MLP's 4 x hidden
    _assert_sum_order_close(got, _grads(model), mags, tokens, depth=4 * cfg.hidden)
    ir = _step_ir(pipe, NAME, (ids,), {"target": ids})
    _check_conforms(pipe, ir)
    sp = pipe.step_pipeline
    tied = [k for k, st in enumerate(sp._rt.stages) if any(m_ is model.wte.weight for m_ in st.masters)]
    assert len(tied) == 2  # the tied weight's stages: 2 stages x 2 GPUs = 4 downloads summed on the host
    assert sorted((o.stage, o.place) for o in ir.select(kind="download") if o.stage in tied) == \
        sorted((k, g) for k in tied for g in ("gpu0", "gpu1"))


def test_a_skip_connection_goes_through_the_host_on_each_replica():
    torch.manual_seed(4)
    model = SkipNet(d_in=6, width=8, depth=4, d_out=5)
    x, y = torch.randn(8, 6), torch.randint(0, 5, (8,))
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=4,
                             cuts=[1, 2, 3, 4, 5], verbose=False, device=_devices(2, 4), loss_fn=F.cross_entropy,
                             schedule=NAME)
    loss = pipe.train_step(x, target=y)
    got = _grads(model)
    ref, want, mags = _eager_classifier(model, x, y)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    _assert_sum_order_close(got, want, mags, x.size(0), depth=8)
    ir = _step_ir(pipe, NAME, (x,), {"target": y})
    assert {o.place for o in ir.ops if o.kind == "send" and o.phase == "backward" and o.dst == "host"} == \
        {"gpu0", "gpu1"}  # a skip's gradient, from each replica
    _check_conforms(pipe, ir)


def test_the_sync_overlap_steps_each_stage_after_every_gpus_gradients():
    """pipe.overlap(mode="sync") takes a stage's gradients at its last GPU's download: the weights
    after three steps equal eager's (mutation: handing over at each download steps on gpu0's
    gradients alone and fails this)."""
    torch.manual_seed(0)
    model = Classifier(blocks=3)
    ref_model = Classifier(blocks=3)
    ref_model.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 16), torch.randint(0, 50, (8,))
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=2,
                             cuts=[1, 2, 3], verbose=False, device=_devices(2, 6), loss_fn=F.cross_entropy,
                             schedule=NAME)
    opt = pipe.overlap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), mode="sync")
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    for i in range(3):
        opt.zero_grad()
        loss = pipe.train_step(x, target=y)
        opt.step()
        if i:
            assert opt.stepped_in_backward == len(list(model.parameters()))
        ref_opt.zero_grad()
        ref = F.cross_entropy(ref_model(x), y)
        ref.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_zero3_is_registered_to_run_but_not_chosen_by_simulated_time():
    entry = schedules.get(NAME)
    assert entry.runnable and entry.runtime is data_parallel and not entry.runs_as_simulated and entry.baseline
    assert NAME not in schedules.candidates(runnable=True)


@pytest.mark.parametrize("name", ["mobius", NAME])
def test_a_stage_without_weights_runs_backward_and_downloads_nothing(name):
    """A cut at an activation leaves a stage with no weights: its backward sends its input's
    gradient on and accumulates none (mutation: the executor's end-of-step check counting the
    stage's empty accumulator as gradients left on the GPU refuses the step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 50))
    x, y = torch.randn(12, 16), torch.randint(0, 50, (12,))
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=2,
                             cuts=[2, 3, 4], verbose=False, device=_devices(2, 8), loss_fn=F.cross_entropy,
                             schedule=name)
    loss = pipe.train_step(x, target=y)
    assert any(not st.masters for st in pipe.step_pipeline._rt.stages)
    got = _grads(model)
    ref, want, mags = _eager_classifier(model, x, y)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    _assert_sum_order_close(got, want, mags, x.size(0), depth=16)
    _check_conforms(pipe, _step_ir(pipe, name, (x,), {"target": y}))


def test_a_buffer_the_forward_updates_is_refused_as_each_replica_would_keep_its_own():
    """BatchNorm's running statistics: each GPU's replica would update its own copy, not micro-batch
    after micro-batch as eager does; the executor refuses it (as for split-head's dealt stage)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 50))
    x, y = torch.randn(12, 16), torch.randint(0, 50, (12,))
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=4,
                             cuts=[3, 5], verbose=False, device=_devices(2, 9), loss_fn=F.cross_entropy, schedule=NAME)
    with pytest.raises(MobiusError, match=r"deals stage 0's micro-batches to several GPUs, but its forward changes "
                                          r"buffer\(s\).*running_mean"):
        pipe.train_step(x, target=y)


def test_a_frozen_stage_whose_forward_updates_a_buffer_is_refused_too():
    """A stage without backward runs without the recompute's books: its buffer change is seen by
    its version since the upload (before: not refused, each replica kept its own statistics)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 50))
    for p in list(model[0].parameters()) + list(model[1].parameters()):
        p.requires_grad_(False)
    before = [b.clone() for b in model[1].buffers()]
    x, y = torch.randn(12, 16), torch.randint(0, 50, (12,))
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=4,
                             cuts=[3, 5], verbose=False, device=_devices(2, 9), loss_fn=F.cross_entropy, schedule=NAME)
    with pytest.raises(MobiusError, match=r"deals stage 0's micro-batches to several GPUs, but its forward changes"):
        pipe.train_step(x, target=y)
    assert all(torch.equal(a, b) for a, b in zip(model[1].buffers(), before))  # the failed step changed nothing
