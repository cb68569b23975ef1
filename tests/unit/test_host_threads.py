"""The host thread plan (mobius_fx/runtime/host_threads.py): never more busy threads than cores, workers
with the team size the plan gives them, and pipe.overlap equal to its reference whether the plan
steps the optimizer on a worker or inline."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F

import mobius_fx
from mobius_fx import MobiusError, Topology
from mobius_fx.runtime import host_threads
from mobius_fx.zoo import nanogpt, nanogpt_inputs


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch):
    monkeypatch.delenv("MOBIUS_HOST_THREADS", raising=False)
    host_threads.configure()
    yield
    host_threads.configure()


@pytest.mark.parametrize("host_compute", [True, False])
def test_the_plan_never_runs_more_busy_threads_than_cores(host_compute):
    for cores in range(1, 65):
        for gpus in range(0, 17):
            for main in (1, 2, cores, 2 * cores):  # the pipeline thread's torch threads, as the user set them
                p = host_threads.plan(gpus, host_compute, main=main, n_cores=cores)
                # one upload worker must copy even with no core beside the pipeline's thread
                extra = 1 if gpus and p.main == cores else 0
                assert p.busy <= cores + extra, (cores, gpus, main, p)
                assert p.main >= 1 and p.optimizer >= 0 and p.grads in (0, 1) and p.uploads == gpus
                assert (gpus == 0) == (p.upload_busy == 0)
                if p.grads:
                    assert p.optimizer >= 1  # the hand-over has its own worker only beside an optimizer worker
    # the hosts this project measures on
    assert host_threads.plan(0, True, main=2, n_cores=2).inline  # 2 cores, virtual GPUs: no spare core
    h200 = host_threads.plan(1, False, n_cores=16)
    assert (h200.main, h200.upload_busy, h200.grads, h200.optimizer) == (1, 1, 0, 14)
    with_grads = host_threads.plan(1, False, n_cores=16, grads=1)
    assert (with_grads.grads, with_grads.optimizer) == (1, 13)


def test_overrides_from_configure_and_the_environment(monkeypatch):
    monkeypatch.setenv("MOBIUS_HOST_THREADS", "optimizer=3,grads=0")
    p = host_threads.plan(0, True, main=2, n_cores=2)
    assert (p.optimizer, p.grads) == (3, 0)
    host_threads.configure(optimizer=1)  # over the environment
    assert host_threads.plan(0, True, main=2, n_cores=2).optimizer == 1
    with pytest.raises(MobiusError, match="unknown host thread role 'optimiser'"):
        host_threads.configure(optimiser=1)
    monkeypatch.setenv("MOBIUS_HOST_THREADS", "grads=two")
    with pytest.raises(MobiusError, match="grads=-1"):
        host_threads.plan()


def test_a_worker_gets_its_team_and_leaves_the_callers_and_new_threads_alone():
    before = torch.get_num_threads()
    ex = host_threads.worker("mobius-test", 1)
    try:
        assert ex.submit(torch.get_num_threads).result() == 1
    finally:
        ex.shutdown()
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert torch.get_num_threads() == before
    assert seen == [before]  # torch.set_num_threads in the worker also set the default for new threads: put back


@pytest.fixture(scope="module")
def pair():
    """Two pipelines over copies of one GPT (compiled once for the module), its first weights and data."""
    torch.manual_seed(0)
    model = nanogpt(hidden=32, blocks=3, vocab=64, seq=8)
    twin = copy.deepcopy(model)
    data = [nanogpt_inputs(model, batch=4, seed=s)[0] for s in range(3)]
    topo = Topology.virtual(gpus=2, memory=8 * sum(p.numel() * 4 for p in model.parameters()))
    pipes = [mobius_fx.compile(m, topo, example_inputs=(data[0],), microbatches=2, cuts=[1, 2, 3], verbose=False)
             for m in (model, twin)]
    return model, twin, pipes, copy.deepcopy(model.state_dict()), data


def _run(pair, mode: str, where: dict):
    """`mode` under the plan overridden by `where` against AdamW stepped after backward."""
    model, twin, pipes, start, data = pair
    model.load_state_dict(start)
    twin.load_state_dict(start)
    host_threads.configure(**where)
    before = set(threading.enumerate())
    opt = pipes[0].overlap(torch.optim.AdamW(model.parameters(), lr=1e-2), mode=mode)
    workers = sorted(t.name.split("_")[0] for t in set(threading.enumerate()) - before)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for x in data:
        for pipe, o in ((pipes[0], opt), (pipes[1], ref)):
            F.cross_entropy(pipe(x).flatten(0, 1), x.flatten()).backward()
            o.step()
            o.zero_grad()
    if mode == "async":
        opt.synchronize()
    out = [p.detach().clone() for p in model.parameters()], [q.detach().clone() for q in twin.parameters()]
    opt.close()
    return opt, workers, out


@pytest.mark.parametrize("where", [{"optimizer": 0}, {"optimizer": 1, "grads": 0}, {"optimizer": 1, "grads": 1}],
                         ids=["inline", "one-worker", "two-workers"])
def test_sync_is_bit_identical_to_serial_inline_or_on_workers(pair, where):
    opt, workers, (mine, ref) = _run(pair, "sync", where)
    assert opt.threads.inline == (where["optimizer"] == 0)
    expected = [] if where["optimizer"] == 0 else ["mobius-grads"] * where["grads"] + ["mobius-optimizer"]
    assert workers == expected
    assert opt.stepped_in_backward > 0  # it overlapped: the stages were stepped during backward
    for a, b in zip(mine, ref):
        assert torch.equal(a, b)


def test_async_is_the_same_update_inline_or_on_a_worker(pair):
    _, _, (inline_w, ref) = _run(pair, "async", {"optimizer": 0})
    _, workers, (worker_w, _) = _run(pair, "async", {"optimizer": 1})
    assert workers == ["mobius-optimizer"]
    for a, b in zip(inline_w, worker_w):
        assert torch.equal(a, b)  # the same update, wherever it runs
    assert any(not torch.equal(a, b) for a, b in zip(inline_w, ref))  # staleness 1: not the serial trajectory
