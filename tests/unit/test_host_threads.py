"""The host thread plan (mobius_fx/runtime/host_threads.py): never more busy threads than cores, workers
with the team size the plan gives them, and pipe.overlap equal to its reference whether the plan
steps the optimizer on a worker or inline."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
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
    host_threads.configure(steer=0, **where)  # bits compared: the team must not follow the host's load between runs
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


# ----------------------------------------------------------------------------- torch's counts, steered by the plan

@pytest.fixture
def steering(monkeypatch):
    """A fresh steering state; the caller's torch intra-op count put back afterwards."""
    before = torch.get_num_threads()
    monkeypatch.setattr(host_threads, "_steering", host_threads._Steering())
    yield host_threads._steering
    torch.set_num_threads(before)


def test_steer_sizes_the_team_on_the_free_cores_and_follows_the_user(steering):
    host_threads.configure(cores=4)
    torch.set_num_threads(4)  # the user's count
    assert host_threads.steer([], busy_elsewhere=0.0, now=0.0).main == 4
    assert torch.get_num_threads() == 4  # alone: the user's count, as before
    p = host_threads.steer([], busy_elsewhere=1.0, now=1.0)  # one core busy elsewhere
    assert (p.free, p.main, torch.get_num_threads()) == (3, 3, 3)
    host_threads.steer([], busy_elsewhere=2.6, now=2.0)
    assert torch.get_num_threads() == 1  # round(4 - 2.6) = 1
    host_threads.steer([], busy_elsewhere=9.0, now=3.0)
    assert torch.get_num_threads() == 1  # never fewer than one
    host_threads.steer([], busy_elsewhere=0.2, now=4.0)
    assert torch.get_num_threads() == 4  # the load went: back to the user's count
    torch.set_num_threads(2)  # the user changes it between steps: the new ceiling
    host_threads.steer([], busy_elsewhere=0.0, now=5.0)
    assert torch.get_num_threads() == 2
    host_threads.steer([], busy_elsewhere=1.0, now=6.0)
    assert torch.get_num_threads() == 2  # 3 free, the user asked for 2
    host_threads.steer([], busy_elsewhere=3.0, now=7.0)
    assert torch.get_num_threads() == 1
    host_threads.release()
    assert torch.get_num_threads() == 2  # the user's count back


def test_steer_looks_at_the_load_at_most_every_interval_and_can_be_switched_off(steering, monkeypatch):
    host_threads.configure(cores=2)
    torch.set_num_threads(2)
    seen = iter([1.0, 0.0])
    monkeypatch.setattr(steering.load, "sample", lambda: next(seen))
    host_threads.steer([], now=100.0)
    assert torch.get_num_threads() == 1
    host_threads.steer([], now=100.0 + host_threads.STEER_EVERY / 2)  # too soon: no new look
    assert torch.get_num_threads() == 1
    host_threads.steer([], now=100.0 + host_threads.STEER_EVERY)
    assert torch.get_num_threads() == 2
    host_threads.configure(cores=2, steer=0)  # today's behaviour: torch's counts left alone
    torch.set_num_threads(2)
    assert host_threads.steer([], busy_elsewhere=1.0, now=200.0).steer == 0
    assert torch.get_num_threads() == 2
    with pytest.raises(MobiusError, match="steer=2"):
        host_threads.configure(steer=2)


def test_a_cuda_pipeline_thread_keeps_the_users_team(steering):
    class Cuda:
        kind = "cuda"
        upload_stream = None

    host_threads.configure(cores=4)
    torch.set_num_threads(3)
    host_threads.steer([Cuda()], busy_elsewhere=2.0, now=0.0)
    assert torch.get_num_threads() == 3  # the loss and host ops of the loop run there


def test_host_load_is_the_cpus_busy_time_less_this_process(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    cpus = sorted(os.sched_getaffinity(0))
    hz = os.sysconf("SC_CLK_TCK")

    def write(busy_each: int) -> None:  # every allowed CPU: user=busy_each, idle=1000; a CPU not ours: busy
        lines = ["cpu 1 2 3 4 5 6 7 8 0 0"]
        lines += [f"cpu{c} {busy_each} 0 0 1000 0 0 0 0 0 0" for c in cpus]
        lines.append(f"cpu{max(cpus) + 1} 99999 0 0 0 0 0 0 0 0 0")
        stat.write_text("\n".join(lines) + "\n")

    clock = {"wall": 10.0, "cpu": 5.0}
    monkeypatch.setattr(host_threads.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(host_threads.time, "process_time", lambda: clock["cpu"])
    load = host_threads.HostLoad(str(stat))
    write(0)
    assert load.sample() is None  # nothing to compare yet
    write(2 * hz)  # each CPU 2 s busier over 2 s of wall time ...
    clock["wall"] += 2.0
    clock["cpu"] += 1.0  # ... 1 s of it ours
    assert load.sample() == pytest.approx((2.0 * len(cpus) - 1.0) / 2.0)
    assert host_threads.HostLoad(str(tmp_path / "missing")).sample() is None


def test_interop_threads_are_set_once_in_a_fresh_process():
    code = ("import torch\nfrom mobius_fx.runtime import host_threads as h\n"
            "torch.set_num_threads(2)\nh.steer([], busy_elsewhere=0.0)\nprint(torch.get_num_interop_threads())\n"
            "h.steer([], busy_elsewhere=0.0)\n")  # a second step: torch allows one set; no error
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("MOBIUS_HOST_THREADS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1"]


def test_a_pipeline_step_sets_the_plan_s_team(pair, steering, monkeypatch):
    _, _, pipes, _, data = pair
    host_threads.configure(cores=2)
    torch.set_num_threads(2)
    monkeypatch.setattr(steering.load, "sample", lambda: 1.0)  # one core busy elsewhere
    pipes[0](data[0])
    assert torch.get_num_threads() == 1
    monkeypatch.setattr(steering.load, "sample", lambda: 0.0)
    steering.looked = -float("inf")
    pipes[0](data[0])
    assert torch.get_num_threads() == 2
