"""The one precision record (mobius_fx/precision.py): the alias parser, masters read from the
model, `dtype=None` as the masters' dtype everywhere, the refusals, and plans of bf16-master
models counted at 2 bytes a weight (issue 29 part 2)."""

import json

import pytest
import torch
from torch import nn

import mobius_fx
from mobius_fx import Topology
from mobius_fx.errors import MobiusError
from mobius_fx.options import CompileOptions
from mobius_fx.planning.plans import Plan
from mobius_fx.precision import DTYPE_ALIASES, STREAMED, Precision, dtype_name, master_dtype, parse_dtype

_EXPECTED_ALIASES = {"fp32": torch.float32, "float": torch.float32, "fp16": torch.float16, "half": torch.float16,
                     "bf16": torch.bfloat16, "fp64": torch.float64, "double": torch.float64}


# ----------------------------------------------------------------------------- the parser


@pytest.mark.parametrize("dtype", [*STREAMED, torch.float8_e4m3fn, torch.int8, torch.bool])
def test_a_dtype_name_parses_back_to_the_dtype(dtype):
    name = dtype_name(dtype)
    assert parse_dtype(name) is dtype
    assert parse_dtype(f"torch.{name}") is dtype
    assert parse_dtype(dtype) is dtype


def test_every_alias_names_the_dtype_it_says():
    assert {a: parse_dtype(a) for a in DTYPE_ALIASES} == _EXPECTED_ALIASES


@pytest.mark.parametrize("stream, master", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                            (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float64)])
def test_a_precision_round_trips_through_its_dict_and_json(stream, master):
    p = Precision(stream, master)
    assert Precision.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_byte_sizes_and_the_printed_form():
    p = Precision.of("bf16", master=torch.float32)
    assert (p.stream, p.master, p.stream_bytes, p.master_bytes, p.scale, p.cast) == (
        torch.bfloat16, torch.float32, 2, 4, 0.5, torch.bfloat16)
    assert str(p) == "bfloat16 (masters float32)"
    same = Precision.of(None, master=torch.bfloat16)
    assert (same.stream, same.scale, same.cast, str(same)) == (torch.bfloat16, 1.0, None,
                                                               "bfloat16 (the masters' dtype)")


def test_the_command_line_reads_dtypes_with_the_one_parser():
    from mobius_fx.__main__ import _parser

    for text, want in [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32),
                       ("torch.bfloat16", torch.bfloat16)]:
        args = _parser().parse_args(["plan", "--model", "gpt2", "--topology", "single-3090", "--dtype", text])
        assert args.dtype is want


@pytest.mark.parametrize("bad, phrase", [("int8", "is not a floating dtype"), ("float8", "is not a torch dtype"),
                                         ("float8_e4m3fn", "storage format")])
def test_the_command_line_refuses_a_bad_dtype_before_planning(bad, phrase, capsys):
    from mobius_fx.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "gpt2", "--topology", "single-3090", "--dtype", bad])
    assert e.value.code == 2 and phrase in capsys.readouterr().err


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("stream, master, phrase", [
    (torch.float32, torch.bfloat16, r"dtype=torch.float32 is wider \(4 bytes\) than the masters' torch.bfloat16 "
                                    r"\(2 bytes\).*stream in torch.bfloat16 \(dtype=None\) or narrower"),
    (torch.float64, torch.float32, r"wider \(8 bytes\)"),
    (torch.int8, torch.float32, r"dtype=torch.int8 is not a floating dtype"),
    (torch.float8_e5m2, torch.float32, r"storage format \(8 bits\)"),
    (torch.bfloat16, torch.int64, r"the masters' dtype torch.int64 is not floating"),
    ("bf16", torch.float32, r"Precision.stream='bf16' is not a torch dtype; build it with Precision.of"),
])
def test_a_bad_precision_is_refused_with_the_rule_and_the_remedy(stream, master, phrase):
    with pytest.raises(MobiusError, match=phrase):
        Precision(stream, master)


def test_plan_refuses_a_stream_wider_than_the_masters_before_tracing(monkeypatch):
    from mobius_fx import pass_adapters

    monkeypatch.setattr(pass_adapters, "trace_pass", lambda *a, **k: pytest.fail("planning started"))
    model = nn.Linear(8, 8).to(torch.bfloat16)
    with pytest.raises(MobiusError, match=r"wider \(4 bytes\) than the masters' torch.bfloat16"):
        mobius_fx.plan(model, Topology.virtual(gpus=2), example_inputs=(torch.randn(4, 8, dtype=torch.bfloat16),),
                       dtype=torch.float32, verbose=False)


# ----------------------------------------------------------------------------- masters read from the model


def _mlp(dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                             nn.Linear(256, 64)).to(dtype)


def _elements(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _plan(model, x, dtype, tmp_path):
    return mobius_fx.plan(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=2,
                          dtype=dtype, costs="model", cache_dir=str(tmp_path), verbose=False)


def test_the_masters_dtype_is_read_from_meta_parameters_too():
    assert master_dtype(_mlp(torch.bfloat16, "meta").parameters()) is torch.bfloat16
    assert CompileOptions().for_model(_mlp(torch.bfloat16, "meta")).precision == Precision(torch.bfloat16,
                                                                                            torch.bfloat16)
    assert master_dtype([]) is torch.float32


def test_options_whose_dtype_no_longer_matches_their_precision_are_refused():
    # dataclasses.replace(opts, dtype=...) after for_model would leave a stale record beside dtype.
    from dataclasses import replace

    opts = CompileOptions(dtype="fp16").for_model(_mlp(torch.float32, "meta"))
    assert opts.precision == Precision(torch.float16, torch.float32)
    with pytest.raises(MobiusError, match=r"precision streams torch.float16 but dtype=torch.bfloat16.*precision=None"):
        replace(opts, dtype=torch.bfloat16)
    with pytest.raises(MobiusError, match="precision streams torch.float16 but dtype=None"):
        replace(opts, dtype=None)
    again = replace(opts, dtype=torch.bfloat16, precision=None).for_model(_mlp(torch.float32, "meta"))
    assert again.precision == Precision(torch.bfloat16, torch.float32)
    same = CompileOptions().for_model(_mlp(torch.bfloat16, "meta"))  # None: the masters' own
    assert replace(same, verbose=False).precision == Precision(torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_a_bf16_master_model_plans_its_weights_at_two_bytes_each(dtype, device, tmp_path):
    # Masters already bf16: streaming in None, bf16 or fp16 moves 2 bytes a weight, not 1
    # (an fp32 master assumed would halve them again).
    model = _mlp(torch.bfloat16, device)
    x = torch.randn(8, 64, dtype=torch.bfloat16, device=device)
    plan = _plan(model, x, dtype, tmp_path)
    assert plan.precision.master is torch.bfloat16 and plan.precision.master_bytes == 2
    assert plan.memory.weight_scale == plan.memory.act_scale == 1.0
    assert sum(s.param_bytes for s in plan.stages) == 2 * _elements(model)
    assert sum(t.bytes * t.count for t in plan.transfers if t.kind == "prefetch") >= 2 * _elements(model)


def test_an_fp32_master_model_streamed_in_bf16_still_halves_its_weights(tmp_path):
    model = _mlp(torch.float32)
    plan = _plan(model, torch.randn(8, 64), torch.bfloat16, tmp_path)
    assert plan.precision == Precision(torch.bfloat16, torch.float32) and plan.memory.weight_scale == 0.5
    assert sum(s.param_bytes for s in plan.stages) == 2 * _elements(model)


def test_the_bf16_master_plan_is_what_the_runtime_uploads(tmp_path):
    model = _mlp(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    pipe = mobius_fx.compile(model, Topology.virtual(gpus=2, memory="64MiB"), example_inputs=(x,), microbatches=2,
                             cache_dir=str(tmp_path), verbose=False, device="virtual")
    assert pipe._rt.precision == pipe.plan.precision == Precision(torch.bfloat16, torch.bfloat16)
    assert pipe._rt.dtype is None  # streamed in the masters' dtype: nothing is cast
    pipe(x).float().pow(2).mean().backward()
    stats = pipe.transfer_stats(last_step=True)
    uploaded = sum(s.get("weight h2d", {}).get("bytes", 0) for s in stats.values())
    planned = sum(t.bytes * t.count for t in pipe.plan.transfers if t.kind == "prefetch")
    assert uploaded == planned
    assert all(p.grad is not None and p.grad.dtype is torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16])
def test_dtype_none_means_the_masters_dtype_everywhere(master, tmp_path):
    model = _mlp(master)
    x = torch.randn(8, 64, dtype=master)
    none = CompileOptions().for_model(model).precision
    assert none == Precision(master, master) == Precision.of(None, master=master)
    plan = _plan(model, x, None, tmp_path)
    assert plan.precision == none and plan.dtype is master and plan.precision.cast is None
    assert f"{dtype_name(master)} (the masters' dtype) on the GPUs" in str(plan)
    # Streaming in the masters' own dtype, given by name, is the same record and the same plan.
    given = _plan(model, x, dtype_name(master), tmp_path)
    assert given.precision == none and [s.param_bytes for s in given.stages] == [s.param_bytes for s in plan.stages]


# ----------------------------------------------------------------------------- saved plans


def test_a_plan_saved_before_the_precision_record_loads_with_fp32_masters(tmp_path):
    plan = _plan(_mlp(torch.float32), torch.randn(8, 64), torch.float16, tmp_path)
    assert Plan.from_json(plan.to_json()).precision == plan.precision  # today's files round-trip
    old = plan.to_dict()
    del old["precision"]
    old["dtype"] = "float16"  # what plans wrote before: the streamed dtype's name
    loaded = Plan.from_json(json.dumps(old))
    assert loaded.precision == Precision(torch.float16, torch.float32) and loaded.memory.weight_scale == 0.5
    old["dtype"] = "float32"  # dtype=None was saved as "float32"
    assert Plan.from_json(json.dumps(old)).precision == Precision(torch.float32, torch.float32)


@pytest.mark.parametrize("master, dtype, handover", [(torch.bfloat16, None, 0), (torch.float32, None, 0),
                                                     (torch.float32, torch.bfloat16, 6)])
def test_the_simulator_hands_gradients_over_only_when_the_stream_is_cast(master, dtype, handover, tmp_path):
    # A gradient downloaded in the masters' own dtype is the master's .grad (no conversion pass).
    from mobius_fx.sim.tasks import Context

    plan = _plan(_mlp(master), torch.randn(8, 64, dtype=master), dtype, tmp_path)
    ctx = Context(plan, plan.topology, "adam", 1e9, True)
    assert ctx.scale == plan.precision.scale and ctx.copies["handover"] == handover
