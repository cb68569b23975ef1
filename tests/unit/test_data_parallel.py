"""Data parallel across processes (gloo on the CPU, virtual GPUs in each): equal to one process
on the concatenated batch.

Each rank trains the same plan on GLOBAL_BATCH / world rows; compile broadcasts rank 0's weights
(the other ranks start from other seeds on purpose) and backward averages every complete stage's
gradients across the ranks. One process on all rows computes the same mean gradient with
another summation order, so the weights differ by rounding only: per step the gradients agree to
a few fp32 ulps of their magnitude (|g| < 1 here), and SGD with momentum 0.9 and lr 0.1 carries a
gradient difference into the weights at most lr * (1 + 0.9 + ... ) <= 1 times per step, so after
5 steps the weights agree to well under 1e-5 (measured: about 1e-7).

The launches share one trace cache (a folder of this module's): the first traces the model, the
rest load its graph; tracing is not what these tests check (tests/unit/test_trace_cache.py
does). The 2-rank runs save a checkpoint after 3 of their 5 steps and train on, so one run is
both the checkpoint a resumed run starts from and the uninterrupted run it must equal.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(os.path.dirname(HERE), "distributed", "dp_worker.py")
sys.path.insert(0, os.path.dirname(WORKER))
import dp_worker  # noqa: E402


@pytest.fixture(scope="module")
def single_process():
    return dp_worker.train(dp_worker.build_model(0), 0, 1, "none", process_group=False)


@pytest.fixture(scope="module", autouse=True)
def _trace_cache(tmp_path_factory):
    global CACHE
    CACHE = str(tmp_path_factory.mktemp("dp_cache"))


CACHE = None


def _launch(tmp_path, world, *extra, tag="run"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")]),
        "MOBIUS_FX_TRACE_CACHE": "1", "MOBIUS_FX_CACHE": CACHE}
    store = tmp_path / f"{tag}.store"
    procs = [subprocess.Popen([sys.executable, WORKER, "--rank", str(r), "--world", str(world), "--store", str(store),
                               "--out", str(tmp_path / f"{tag}{r}.pt"), *extra],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    return [p.returncode for p in procs], outs, [tmp_path / f"{tag}{r}.pt" for r in range(world)]


def _results(tmp_path, world, *extra, tag="run"):
    codes, outs, files = _launch(tmp_path, world, *extra, tag=tag)
    for r, (c, out) in enumerate(zip(codes, outs)):
        assert c == 0, f"rank {r} failed:\n{out[-3000:]}"
    return [torch.load(f) for f in files]


SHARD = ("--overlap", "sync", "--shard")


def _saving(tmp_path_factory, *extra):
    """Two ranks' 5 steps, saving a checkpoint (`ckpt.pt`) after step 3: the results and the checkpoint."""
    folder = tmp_path_factory.mktemp("dp")
    ckpt = folder / "ckpt.pt"
    return _results(folder, 2, *extra, "--save", str(ckpt), "--save-after", "3"), ckpt


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _saving(tmp_path_factory)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return _saving(tmp_path_factory, *SHARD)


@pytest.mark.parametrize("world,extra", [(2, ()), (3, ("--overlap", "sync")), (2, SHARD)])
def test_ranks_equal_one_process_on_the_whole_batch(tmp_path, request, single_process, world, extra):
    if world == 2:  # the module's runs (the resume tests start from their checkpoints)
        ranks = request.getfixturevalue("sharded" if extra else "two_ranks")[0]
    else:
        ranks = _results(tmp_path, world, *extra)
    for name, ref in single_process.items():
        for r, res in enumerate(ranks):
            torch.testing.assert_close(res["weights"][name], ref, rtol=0, atol=1e-5, msg=f"rank {r}: {name}")
        assert all(torch.equal(res["weights"][name], ranks[0]["weights"][name]) for res in ranks)  # ranks agree
    start = dp_worker.build_model(0).state_dict()
    assert any(not torch.equal(single_process[n], start[n]) for n in single_process)  # training moved the weights
    trainable = sum(1 for p in dp_worker.build_model(0).parameters() if p.requires_grad)
    if "--shard" in extra:  # each rank holds optimizer state for its share only
        assert sum(res["owned"] for res in ranks) == trainable
        assert all(0 < res["state_entries"] < trainable for res in ranks)
        assert sum(res["state_entries"] for res in ranks) == trainable
    else:
        assert all(res["state_entries"] == trainable for res in ranks)


def test_a_rank_that_dies_fails_the_others_loudly_with_weights_intact(tmp_path):
    codes, outs, files = _launch(tmp_path, 2, "--fail-at", "2", "--timeout", "20")
    assert codes[1] != 0 and "failing on purpose" in outs[1]
    assert codes[0] == 0, outs[0][-3000:]
    res = torch.load(files[0])
    assert "averaging gradients across the 2 ranks failed" in res["error"]
    assert res["intact"] and res["grads_untouched"]


def test_a_saved_run_resumes_on_the_same_loss_curve(tmp_path, two_ranks):
    whole, ckpt = two_ranks  # saved after step 3, then trained on to step 5
    resumed = _results(tmp_path, 2, "--steps", "3", str(dp_worker.STEPS), "--resume", str(ckpt), tag="second")
    for name, w in whole[0]["weights"].items():
        assert torch.equal(resumed[0]["weights"][name], w), name


def test_a_sharded_run_resumes_with_one_optimizer_file_per_rank(tmp_path, sharded):
    """pipe.overlap(shard=True): the weights are the same on every rank after step(), the optimizer
    state is each rank's own share; a checkpoint is the model once plus one optimizer file per rank
    (docs/checkpointing.md), and resuming on as many ranks gives the same next losses and weights."""
    whole, ckpt = sharded  # saved after step 3, then trained on to step 5
    assert sorted(p.name for p in ckpt.parent.glob("ckpt.pt*")) == ["ckpt.pt", "ckpt.pt.rank0", "ckpt.pt.rank1"]
    resumed = _results(tmp_path, 2, *SHARD, "--steps", "3", str(dp_worker.STEPS), "--resume", str(ckpt), tag="second")
    for r in range(2):
        assert resumed[r]["losses"] == {t: whole[r]["losses"][t] for t in range(3, dp_worker.STEPS)}  # bit for bit
        for name, w in whole[r]["weights"].items():
            assert torch.equal(resumed[r]["weights"][name], w), name
