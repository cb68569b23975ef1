"""The host's passes outside the optimizer (issue 27), counted by mobius_fx.host_counters.

Under pipe.overlap(mode="sync") on the CUDA stand-in, once the first (serial, probing) step is
behind: no master is staged again at upload (the optimizer's worker refreshed the streamed
copies), gradients are converted into storage kept across steps (no new fp32 `.grad` per step),
`.grad` is None after zero_grad(set_to_none=True) as torch users expect, and a gradient a user
kept from an earlier step is never overwritten. The weights stay those of serial stepping.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import mobius_fx
from mobius_fx import Topology
from mobius_fx.host_counters import COUNTERS, HostCounters

try:
    from tests.models import gpt, gpt_inputs
except ImportError:  # pragma: no cover
    from models import gpt, gpt_inputs


def _loss(out, x):
    return F.cross_entropy(out.flatten(0, 1).float(), x.flatten())


def test_steady_sync_steps_stage_nothing_and_reuse_gradient_storage(tmp_path):
    torch.manual_seed(0)
    model = gpt(hidden=32, blocks=3, vocab=64, seq=8)
    twin = copy.deepcopy(model)
    data = [gpt_inputs(model, batch=4, seed=s) for s in range(5)]
    topo = Topology.virtual(gpus=2, memory=8 * sum(p.numel() * 4 for p in model.parameters()))
    kw = dict(example_inputs=data[0], microbatches=2, cuts=[1, 2, 3], cache_dir=str(tmp_path), verbose=False,
              dtype=torch.bfloat16)
    pipe = mobius_fx.compile(model, topo, device="virtual-async", **kw)
    ref_pipe = mobius_fx.compile(twin, topo, device="virtual", **kw)
    opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=1e-2), mode="sync")
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    kept, homes = None, []
    for j, (x,) in enumerate(data):
        for p_, o in ((pipe, opt), (ref_pipe, ref)):
            before = COUNTERS.snapshot()
            _loss(p_(x), x).backward()
            if o is opt:
                homes.append([p.grad.data_ptr() for p in params])
                if j == 3:
                    kept = params[0].grad  # a user keeps this step's gradient
                    kept_value = kept.clone()
            o.step()
            o.zero_grad()
            if o is opt:  # the counters are the process's: the reference pipeline's are left out
                counts = HostCounters.since(before, COUNTERS.snapshot())
        assert all(p.grad is None for p in params)
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q), j
        if j >= 2:  # the probe (0) and the first overlapping step (1) are behind
            assert counts["staging"] == 0 and counts["grad_add"] == 0
            assert counts["grad_alloc"] == (params[0].numel() * 4 if j == 4 else 0)  # only the kept one anew
            assert counts["refresh"] >= n * 6  # read fp32, write bf16, beside the optimizer
    assert homes[2] == homes[3]  # the same storage, step after step
    assert homes[4][0] != homes[3][0] and homes[4][1:] == homes[3][1:]
    assert torch.equal(kept, kept_value)  # step 4 did not write into the gradient the user kept
