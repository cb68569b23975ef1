"""Bad input to plan, compile and a Pipeline: a clear MobiusError (value, rule, remedy), never a
crash, a raw error or a silently wrong result — and the model and the pipeline stay usable."""

import copy
import io
import logging
import pickle
import re

import pytest
import torch
from torch import nn

import mobius_fx
from mobius_fx import BudgetError, MobiusError, CompileOptions, Topology


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _topo(gpus=2, memory="1MiB"):
    return Topology.virtual(gpus=gpus, memory=memory)


def _compile(model=None, x=None, **kw):
    model = model if model is not None else _mlp()
    x = x if x is not None else torch.randn(4, 8)
    kw = {"microbatches": 2, "verbose": False, **kw}
    return mobius_fx.compile(model, kw.pop("topology", _topo()), example_inputs=(x,), **kw)


@pytest.fixture
def no_tracing(monkeypatch):
    """Fail the test if planning starts: the refusal must come before any work."""
    from mobius_fx import pass_adapters

    def refuse(*a, **k):
        raise AssertionError("planning started; the bad input should have been refused first")

    monkeypatch.setattr(pass_adapters, "trace_pass", refuse)


# ----------------------------------------------------------------------------- copies

def test_deepcopy_of_a_pipeline_raises_and_says_to_copy_the_model():
    pipe = _compile()
    with pytest.raises(MobiusError, match=r"cannot be copied.*copy\.deepcopy\(model\)"):
        copy.deepcopy(pipe)
    pipe(torch.randn(4, 8)).sum().backward()  # still usable


@pytest.mark.parametrize("save", [pickle.dumps, lambda p: torch.save(p, io.BytesIO()), copy.copy],
                         ids=["pickle", "torch.save", "copy.copy"])
def test_pickling_or_saving_a_pipeline_raises_and_says_to_save_the_state_dict(save):
    with pytest.raises(MobiusError, match=r"cannot be pickled or saved.*state_dict"):
        save(_compile())


# ----------------------------------------------------------------------------- meta models

def test_compile_of_a_meta_model_is_refused_at_compile_time_naming_plan(no_tracing):
    with torch.device("meta"):
        model = _mlp()
    with pytest.raises(MobiusError, match=r"meta device.*mobius_fx\.plan"):
        _compile(model)


def test_compile_with_meta_example_inputs_is_refused(no_tracing):
    with pytest.raises(MobiusError, match=r"an example input is on the meta device"):
        _compile(x=torch.empty(4, 8, device="meta"))


# ----------------------------------------------------------------------------- batches

def test_a_call_with_an_empty_batch_is_refused_and_the_pipeline_stays_usable():
    pipe = _compile()
    with pytest.raises(MobiusError, match=r"the batch is empty .*\(0, 8\)"):
        pipe(torch.randn(0, 8))
    assert all(s["current_bytes"] == 0 for s in pipe.memory_stats().values())
    pipe(torch.randn(4, 8)).sum().backward()


def test_an_empty_batch_is_refused_with_one_microbatch_too():
    with pytest.raises(MobiusError, match=r"the batch is empty"):
        _compile(microbatches=1)(torch.randn(0, 8))


def test_a_1d_unbatched_example_with_several_microbatches_is_refused(no_tracing):
    with pytest.raises(MobiusError, match=r"every tensor input is 1-D.*unsqueeze\(0\)"):
        _compile(x=torch.randn(8))


def test_a_1d_call_to_a_pipeline_with_several_microbatches_is_refused():
    pipe = _compile()
    with pytest.raises(MobiusError, match=r"every tensor input is 1-D \(shape \(8,\)\)"):
        pipe(torch.randn(8))


def test_a_1d_input_with_one_microbatch_runs_like_eager():
    model = _mlp()
    x = torch.randn(8)
    torch.testing.assert_close(_compile(model, x, microbatches=1)(x), model(x))


def test_an_example_batch_that_microbatches_do_not_divide_is_refused_before_planning(no_tracing):
    with pytest.raises(MobiusError, match=r"6 rows .*microbatches=4"):
        mobius_fx.plan(_mlp(), _topo(), example_inputs=(torch.randn(6, 8),), microbatches=4, verbose=False)


# ----------------------------------------------------------------------------- options

@pytest.mark.parametrize("bad, phrase", [
    ({"microbatches": True}, r"microbatches=True is a bool"),
    ({"microbatches": 0}, r"microbatches=0; it must be a positive int"),
    ({"microbatches": 2.0}, r"microbatches=2\.0 is a float"),
    ({"memory_fraction": True}, r"memory_fraction=True is not a number"),
    ({"memory_fraction": 1.5}, r"memory_fraction=1\.5; it must be in \(0, 1\]"),
    ({"memory_fraction": float("nan")}, r"memory_fraction=nan"),
    ({"time_limit": 0}, r"time_limit=0; it must be positive and finite"),
    ({"time_limit": float("inf")}, r"time_limit=inf"),
    ({"solver": "gurobi"}, r"solver='gurobi' is not one of 'auto', 'highs', 'cbc'"),
    ({"costs": "guess"}, r"costs='guess' is not one of"),
    ({"cross_map": "random"}, r"cross_map='random' is not one of"),
    ({"verbose": "yes"}, r"verbose='yes'; it must be True or False"),
    ({"dtype": "float8"}, r"dtype='float8' is not a torch dtype"),
])
def test_bad_settings_are_refused_before_planning(no_tracing, bad, phrase):
    with pytest.raises(MobiusError, match=phrase):
        mobius_fx.plan(_mlp(), _topo(), example_inputs=(torch.randn(4, 8),), **{"verbose": False, **bad})


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool, "int8"])
def test_a_non_floating_dtype_is_refused_at_plan_time(no_tracing, dtype):
    with pytest.raises(MobiusError, match=r"is not a floating dtype"):
        mobius_fx.plan(_mlp(), _topo(), example_inputs=(torch.randn(4, 8),), dtype=dtype, verbose=False)


def test_compile_refuses_an_unknown_device(no_tracing):
    with pytest.raises(MobiusError, match=r"device='tpu' is not one of 'auto', 'virtual', 'virtual-async', 'cuda'"):
        _compile(device="tpu")


def test_options_normalise_dtype_names_and_are_frozen():
    o = CompileOptions(dtype="bf16", microbatches=4)
    assert o.dtype is torch.bfloat16
    with pytest.raises(AttributeError):
        o.microbatches = 8


def test_model_and_inputs_of_the_wrong_kind_are_refused(no_tracing):
    with pytest.raises(MobiusError, match=r"model is a function, not a torch\.nn\.Module"):
        mobius_fx.plan(lambda x: x, _topo(), example_inputs=(torch.randn(4, 8),), verbose=False)
    with pytest.raises(MobiusError, match=r"example_inputs is a dict; pass a tensor or a tuple"):
        mobius_fx.plan(_mlp(), _topo(), example_inputs={"x": torch.randn(4, 8)}, verbose=False)


# ----------------------------------------------------------------------------- budgets at run time

def test_a_batch_too_large_for_the_budget_names_the_batch_remedies_and_the_planned_batch():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 3))
    pipe = _compile(model, torch.randn(4, 64), topology=_topo(memory="2MiB"))
    with pytest.raises(BudgetError, match=r"activation.*smaller batch.*more micro-batches") as err:
        pipe(torch.randn(4096, 64)).sum().backward()
    assert "fewer micro-batches" not in str(err.value)
    assert any("batch has 4096 rows" in n and "made for 4" in n for n in err.value.__notes__)
    assert all(s["current_bytes"] == 0 for s in pipe.memory_stats().values())
    pipe(torch.randn(4, 64)).sum().backward()


def test_weights_over_the_budget_name_the_stage_remedies():
    from mobius_fx.build import build_pipeline

    model = _mlp()
    gm = torch.fx.symbolic_trace(model)
    pipe = build_pipeline(model, gm, stage_nodes=[["_0", "_1", "_2", "_3", "_4"]], stage_gpus=["gpu0"],
                          gpu_budgets={"gpu0": 100}, microbatches=1, device="virtual")
    with pytest.raises(BudgetError, match=r"stage 0's weights.*more, smaller stages"):
        pipe(torch.randn(4, 8))


# ----------------------------------------------------------------------------- batch statistics

def test_batchnorm_with_several_microbatches_is_logged_once(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        _compile(model, torch.randn(4, 8), microbatches=2)
    warned = [r for r in caplog.records if "normalise" in r.getMessage()]
    assert len(warned) == 1 and "own statistics" in warned[0].getMessage() and "1" in warned[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mobius_fx"):
        _compile(model, torch.randn(4, 8), microbatches=1)
    assert not [r for r in caplog.records if "normalise" in r.getMessage()]


# ----------------------------------------------------------------------------- issue 28

def _plan():
    return mobius_fx.plan(_mlp(), _topo(), example_inputs=(torch.randn(4, 8),), microbatches=2, verbose=False)


@pytest.mark.parametrize("kw, phrase", [
    ({"cpu_adam_bandwidth": True}, "cpu_adam_bandwidth is True (type bool)"),
    ({"deepspeed_adam_bandwidth": False}, "deepspeed_adam_bandwidth is False (type bool)"),
    ({"cpu_adam_bandwidth": 0}, "cpu_adam_bandwidth is 0"),
    ({"cpu_adam_bandwidth": 1e-300}, "cpu_adam_bandwidth=1e-300 is 1e-300 bytes/s; a rate must be at least 1 MB/s"),
    ({"network": 1e-300}, "network=1e-300 is 1e-300 bytes/s; a rate must be at least 1 MB/s"),
    ({"topology": 5}, "topology=5 is a int; pass a Topology, a preset name"),
    ({"topology": "no-such-server"}, "unknown topology preset 'no-such-server'"),
])
def test_simulate_refuses_bad_arguments(kw, phrase):
    """`cpu_adam_bandwidth=True` was read as 1 B/s; a bool is not a number anywhere."""
    with pytest.raises(MobiusError, match=re.escape(phrase)):
        mobius_fx.simulate(_plan(), **kw)


def test_simulate_refuses_something_that_is_not_a_plan():
    with pytest.raises(MobiusError, match=r"simulate needs a Plan, got None"):
        mobius_fx.simulate(None)


def test_simulate_reads_a_preset_name_as_the_topology():
    plan = _plan()
    assert mobius_fx.simulate(plan, topology="rtx4090x8").step_time > 0


@pytest.mark.parametrize("values, phrase", [(5, "values is a int; pass a dict"),
                                            ({"x": 3}, "values['x'] is a int, not a tensor")])
def test_schedule_ir_refuses_values_that_are_not_tensors_by_name(values, phrase):
    with pytest.raises(MobiusError, match=re.escape(phrase)):
        _compile().schedule_ir(values=values)


@pytest.mark.parametrize("name", [[1, 2], "", None])
def test_a_topology_name_must_be_a_string(name):
    graph = _topo().graph
    with pytest.raises(MobiusError, match=r"topology name .* is not a non-empty string"):
        Topology(graph, name=name)


def test_example_inputs_the_pipeline_cannot_split_are_refused_at_compile():
    """An unbatched matrix first: (8, 3) read as 8 rows; each micro-batch's (4, 3) cannot
    multiply the (8, 8) weight, so the call would fail with a raw shape error."""

    class Mix(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return self.w @ x

    with pytest.raises(MobiusError, match=r"does not run on one micro-batch.*shapes \(8, 3\).*microbatches=1"):
        _compile(Mix(), torch.randn(8, 3))
    assert _compile(Mix(), torch.randn(8, 3), microbatches=1)(torch.randn(8, 3)).shape == (8, 3)


def test_a_wrongly_shaped_example_input_says_so_without_torchs_fake_tensor_log():
    """It printed ~60 lines of fake-tensor tracebacks (torch's logger), then a remedy about
    control flow."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    logger.addHandler(handler)
    try:
        with pytest.raises(mobius_fx.TraceError) as e:
            _compile(x=torch.randn(4, 5))
    finally:
        logger.removeHandler(handler)
    text = str(e.value)
    assert "does not run on these example inputs" in text and "args[0] (4, 5) float32" in text
    assert "control flow" not in text
    assert records == []
