"""The zoo's training cases are the same models and inputs on every call (the books test and
`benchmarks/memory_margins.py` measure the same thing), and each is named once."""

from __future__ import annotations

import torch

from mobius_fx.zoo import training_cases


def _tensors(case) -> list[torch.Tensor]:
    return [*case.model.state_dict().values(), *(a for a in case.args if isinstance(a, torch.Tensor)),
            *(v for v in case.kwargs.values() if isinstance(v, torch.Tensor))]


def test_training_cases_are_the_same_on_every_call_whatever_the_global_seed():
    torch.manual_seed(1)
    first = training_cases()
    torch.manual_seed(2)
    torch.rand(7)
    state = torch.get_rng_state()
    second = training_cases()
    assert torch.equal(torch.get_rng_state(), state), "training_cases() moved the caller's random state"
    assert [c.name for c in first] == [c.name for c in second]
    assert len({c.name for c in first}) == len(first)
    for a, b in zip(first, second):
        assert a.microbatches == b.microbatches >= 1
        for x, y in zip(_tensors(a), _tensors(b), strict=True):
            assert torch.equal(x, y), a.name
