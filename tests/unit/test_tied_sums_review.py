"""Corner cases of a tied weight's gradient summed on a GPU (runtime/tied_sums.py): the runtime
sums what the step's IR sends, whatever the stage's own gradients."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mobius_fx
from mobius_fx import Topology
from tests.unit.test_executor import _devices

pytestmark = pytest.mark.usefixtures("one_thread")


class DetachedEmbedding(nn.Module):
    """A tied weight whose first holder (stage 0: the embedding) gets no gradient of its own: its
    output is detached by stage 1, so stage 0's backward downloads nothing of its own."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.h = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids).detach()
        for block in self.h:
            x = block(x)
        return self.head(x)


def _lm_loss(logits, target):
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def test_a_first_holder_without_its_own_gradient_still_gets_the_partials():
    # the IR sends the head's partials up to stage 0's GPU (its download sums them); stage 0's own
    # backward gives no gradient at all (its output is detached), so its download had nothing of
    # its own: it dropped the partials it had fetched, and the tied weight had no .grad
    torch.manual_seed(0)
    model = DetachedEmbedding()
    twin = copy.deepcopy(model)
    ids = [torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    topo = Topology.virtual(gpus=2, memory="64MiB")
    pipes, opts = [], []
    for m, widen in ((model, True), (twin, False)):
        p = mobius_fx.compile(m, topo, example_inputs=(ids[0],), microbatches=2, cuts=[1, 3], verbose=False,
                              device=_devices(seed=5), loss_fn=_lm_loss, dtype=torch.bfloat16)
        o = p.overlap(torch.optim.SGD(m.parameters(), lr=1e-2), mode="sync")
        o.widen_downloads = widen
        pipes.append(p)
        opts.append(o)
    for x in ids:
        for p, o in zip(pipes, opts):
            o.zero_grad()
            p.train_step(x, target=x)
            o.step()
        assert twin.emb.weight.grad is not None, "the host's sum"
        assert model.emb.weight.grad is not None, "the GPU's sum: the partials were fetched, then dropped"
        assert torch.equal(model.emb.weight.grad, twin.emb.weight.grad)
    for o in opts:
        o.close()


class DetachedHead(nn.Module):
    """A tied weight whose other holder (the head) gives it no gradient: the head reads it detached."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.h = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(16, 64)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.h:
            x = block(x)
        return F.linear(x, self.head.weight.detach(), self.head.bias)


def test_a_holder_without_a_partial_sends_nothing_to_sum():
    torch.manual_seed(0)
    model = DetachedHead()
    twin = copy.deepcopy(model)
    ids = [torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    topo = Topology.virtual(gpus=2, memory="64MiB")
    pipes, opts = [], []
    for m, widen in ((model, True), (twin, False)):
        p = mobius_fx.compile(m, topo, example_inputs=(ids[0],), microbatches=2, cuts=[1, 2], verbose=False,
                              device=_devices(seed=5), loss_fn=_lm_loss, dtype=torch.bfloat16)
        o = p.overlap(torch.optim.SGD(m.parameters(), lr=1e-2), mode="sync")
        o.widen_downloads = widen
        pipes.append(p)
        opts.append(o)
    for x in ids:
        for p, o in zip(pipes, opts):
            o.zero_grad()
            p.train_step(x, target=x)
            o.step()
        assert torch.equal(model.emb.weight.grad, twin.emb.weight.grad)
    for o in opts:
        o.close()


def test_a_plan_that_fits_keeps_fitting_when_the_first_holder_sums_the_tied_weight():
    # a GPT whose embedding (its head) is most of stage 0: 4096 x 64 parameters, 0.5 MiB in bf16.
    # At 2.25 MB per GPU the plan fits and the step with bf16 downloads peaks at 1.68 MB on gpu0.
    # The memory model charges no widening: the sum brings the head's partial up chunk by chunk
    # (never the whole 0.5 MiB) and sizes its chunks to what is free (`Device.widen_chunk`); with
    # the whole partial on the GPU and a 1 MiB fp32 chunk it raised BudgetError (the review's find)
    from mobius_fx.zoo import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=4096, seq=8, hidden=64, blocks=2, heads=2))
    ids = torch.randint(0, 4096, (2, 8), generator=torch.Generator().manual_seed(0))
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory=2_250_000), example_inputs=(ids,),
                             microbatches=2, cuts=[1, 2, 3], verbose=False, device="virtual-async",
                             loss_fn=_lm_loss, dtype=torch.bfloat16)
    opt = pipe.overlap(torch.optim.AdamW(model.parameters(), lr=1e-3), mode="sync")
    opt.widen_downloads = True  # whatever the plan chose for this virtual server (off: the step passes)
    try:
        for _ in range(2):  # the first step is the probe (serial: nothing widened)
            opt.zero_grad()
            pipe.train_step(ids, target=ids)
            opt.step()
        assert opt.widens() and pipe._rt.widens_gradients()
    finally:
        opt.close()
