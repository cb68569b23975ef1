"""The runtime executes its schedule IR, over random models, cuts, GPU orders, micro-batch
counts and frozen prefixes: the bytes it moves per GPU, kind and stage equal the IR's
(`pipe.schedule_ir(values).bytes_moved()`), and its executed order keeps the IR's rules (the
same runs per GPU in the same order; every run after its wait, every wait after its prefetch;
never more stages resident on a GPU than the IR has). Stages of a frozen prefix take no
gradient and run forward only, in the IR and in the runtime.
"""

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from tests.property.test_runtime_props import _build, cases
from tests.unit.test_schedule_ir import _check_executed_order, _values

pytestmark = pytest.mark.usefixtures("one_thread")


def _moved(pipe, ir):
    """(what the runtime moved, what the IR says), as {gpu: {kind: {stage: (copies, bytes)}}};
    weights and gradients by bytes only (the runtime copies per tensor, the IR per stage)."""
    def per_copy(kind, count, nbytes):
        return nbytes if kind.split()[0] in ("weight", "gradient") else (count, nbytes)

    expected: dict = {}
    for (gpu, what, direction, stage), (count, nbytes) in ir.bytes_moved().items():
        kind = f"{what} {direction}"
        expected.setdefault(gpu, {}).setdefault(kind, {})[stage] = per_copy(kind, count, nbytes)
    got: dict = {}
    for gpu, kinds in pipe.transfer_stats(last_step=True, by_stage=True).items():
        for kind, per in kinds.items():
            if not kind.startswith("buffer"):
                for stage, c in per.items():
                    got.setdefault(gpu, {}).setdefault(kind, {})[stage] = per_copy(kind, c["count"], c["bytes"])
    return got, expected


@given(cases(), st.floats(0.0, 1.0))
def test_the_runtime_executes_its_schedule_ir(case, frozen_share):
    model, gm, nodes, stage_gpus, x, microbatches = case
    params = list(model.parameters())
    frozen = round(frozen_share * len(params))  # a frozen prefix, in registration (= data flow) order
    for j, p in enumerate(params):
        p.requires_grad_(j >= frozen)
    note(f"stages={[len(n) for n in nodes]} gpus={stage_gpus} microbatches={microbatches} frozen={frozen}")
    pipe = _build(model, gm, nodes, stage_gpus, microbatches, x, {})
    for _ in range(2):  # the second step starts from the state the first one left
        model.zero_grad(set_to_none=True)
        out = pipe(x)
        if out.requires_grad:
            out.pow(2).sum().backward()
    ir = pipe.schedule_ir(_values(gm, x[: x.size(0) // microbatches]))
    got, expected = _moved(pipe, ir)
    assert got == expected
    _check_executed_order(pipe, ir)
