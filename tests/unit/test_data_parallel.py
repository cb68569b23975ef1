"""Data parallel across processes (gloo on the CPU, virtual GPUs in each): equal to one process
on the concatenated batch.

Each rank trains the same plan on GLOBAL_BATCH / world rows; compile broadcasts rank 0's weights
(the other ranks start from other seeds on purpose) and backward averages every complete stage's
gradients across the ranks. One process on all rows computes the same mean gradient with
another summation order, so the weights differ by rounding only: per step the gradients agree to
a few fp32 ulps of their magnitude (|g| < 1 here), and SGD with momentum 0.9 and lr 0.1 carries a
gradient difference into the weights at most lr * (1 + 0.9 + ... ) <= 1 times per step, so after
5 steps the weights agree to well under 1e-5 (measured: about 1e-7).
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


@pytest.mark.parametrize("world,overlap", [(2, "none"), (3, "sync")])
def test_ranks_equal_one_process_on_the_whole_batch(tmp_path, single_process, world, overlap):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")])}
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, WORKER, "--rank", str(r), "--world", str(world), "--store", str(store),
                               "--out", str(tmp_path / f"rank{r}.pt"), "--overlap", overlap],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{out[-3000:]}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for name, ref in single_process.items():
        for r, w in enumerate(ranks):
            torch.testing.assert_close(w[name], ref, rtol=0, atol=1e-5, msg=f"rank {r}: {name}")
        assert all(torch.equal(w[name], ranks[0][name]) for w in ranks)  # the ranks agree exactly
    start = dp_worker.build_model(0).state_dict()
    assert any(not torch.equal(single_process[n], start[n]) for n in single_process)  # training moved the weights
