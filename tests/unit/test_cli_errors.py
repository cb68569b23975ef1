"""The command line refuses bad input with a clear message (value, rule, remedy), before any planning.

Each test runs `main([...])` in-process with the planner and the model builder replaced by tripwires,
so a check that comes too late fails loudly instead of planning for half a minute.
"""

import os
import sys
import types

import pytest
import torch
import torch.nn as nn

from mobius_fx import api, zoo
from mobius_fx.__main__ import main

_REAL_BUILD = zoo.build
PLAN = ["plan", "--model", "gpt2", "--topology", "single-3090", "--quiet"]


class _Reached(Exception):
    pass


@pytest.fixture(autouse=True)
def no_planning(monkeypatch):
    """api.plan and zoo.build record their call and stop there; the fixture is the list of calls reached."""
    calls = []

    def tripwire(name):
        def f(*args, **kwargs):
            calls.append((name, kwargs))
            raise _Reached(name)
        return f
    monkeypatch.setattr(api, "plan", tripwire("plan"))
    monkeypatch.setattr(zoo, "build", tripwire("build"))
    return calls


def _usage_error(argv, capsys) -> str:
    """argparse's usage error: SystemExit(2) and the message on stderr."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("flag, value, rule", [
    ("--microbatches", "0", "positive integer"),
    ("--microbatches", "-2", "positive integer"),
    ("--adam-gbps", "0", "positive number of GB/s"),
    ("--adam-gbps", "-5", "positive number of GB/s"),
    ("--adam-gbps", "inf", "positive number of GB/s"),
    ("--batch", "0", "positive integer"),
    ("--seq", "-1", "positive integer"),
    ("--time-limit", "0", "positive number of seconds"),
    ("--time-limit", "nan", "positive number of seconds"),
    ("--memory-fraction", "0", "in (0, 1]"),
    ("--memory-fraction", "1.5", "in (0, 1]"),
    ("--memory-fraction", "nan", "in (0, 1]"),
])
def test_plan_refuses_a_bad_number_before_planning(flag, value, rule, no_planning, capsys):
    err = _usage_error([*PLAN, f"{flag}={value}"], capsys)
    assert f"argument {flag}: invalid value {value!r}" in err and rule in err
    assert no_planning == []


def test_plan_refuses_json_in_a_missing_directory_before_planning(tmp_path, no_planning, capsys):
    out = tmp_path / "missing" / "plan.json"
    err = _usage_error([*PLAN, "--json", str(out)], capsys)
    assert f"cannot write '{out}'" in err and "does not exist" in err
    assert no_planning == []


def test_plan_refuses_trace_that_is_a_directory_before_planning(tmp_path, no_planning, capsys):
    err = _usage_error([*PLAN, "--trace", str(tmp_path)], capsys)
    assert f"'{tmp_path}' is a directory" in err and "give a file path" in err
    assert no_planning == []


def test_plan_refuses_json_in_an_unwritable_directory_before_planning(tmp_path, monkeypatch, no_planning, capsys):
    access = os.access  # root can write anywhere, so the test makes tmp_path read-only through os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(tmp_path) else access(p, mode, **kw))
    err = _usage_error([*PLAN, "--json", str(tmp_path / "plan.json")], capsys)
    assert "is not writable" in err and str(tmp_path) in err
    assert no_planning == []


def test_topology_refuses_json_in_a_missing_directory_before_printing(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["topology", "rtx4090x8", "--json", str(tmp_path / "missing" / "t.json")])
    assert e.value.code == 2
    out = capsys.readouterr()
    assert "does not exist" in out.err and out.out == ""


def test_plan_refuses_a_batch_the_microbatches_do_not_divide_before_planning(no_planning, capsys):
    assert main([*PLAN, "--batch", "6", "--microbatches", "4"]) == 2
    err = capsys.readouterr().err
    assert "mobius-fx: error: --batch 6 does not split into 4 equal micro-batches" in err
    assert "--microbatches 3 or --microbatches 6" in err  # the nearest divisors, as the remedy
    assert no_planning == []


def test_plan_default_microbatches_take_a_divisor_of_a_batch_smaller_than_the_gpu_count(no_planning):
    # One micro-batch per GPU would not divide a batch of 4 on 8 GPUs; the default is then the
    # largest divisor of the batch (4), so the command goes on to plan instead of refusing.
    with pytest.raises(_Reached, match="build"):
        main(["plan", "--model", "gpt2", "--topology", "mobius-testbed", "--batch", "4"])


def test_valid_flags_reach_the_planner_unchanged(tmp_path, monkeypatch, no_planning):
    monkeypatch.setattr(zoo, "build", lambda *a, **kw: (nn.Linear(2, 2), (torch.zeros(4, 2),)))
    with pytest.raises(_Reached):
        main([*PLAN, "--batch", "4", "--microbatches", "2", "--memory-fraction", "1", "--time-limit", "0.5",
              "--adam-gbps", "50", "--json", str(tmp_path / "p.json"), "--trace", str(tmp_path / "t.json")])
    (name, kwargs), = no_planning
    assert name == "plan" and kwargs["microbatches"] == 2 and kwargs["memory_fraction"] == 1.0
    assert kwargs["time_limit"] == 0.5


@pytest.fixture
def factories(monkeypatch):
    """A module `cli_factories` of model factories, good and bad, importable by `--model cli_factories:...`."""
    m = types.ModuleType("cli_factories")
    m.no_kwargs = lambda: nn.Linear(2, 2)
    m.returns_str = lambda **kw: "a model"
    m.returns_triple = lambda **kw: (nn.Linear(2, 2), (torch.zeros(2, 2),), "extra")
    monkeypatch.setitem(sys.modules, "cli_factories", m)
    return m


def _model_error(spec, monkeypatch, capsys) -> str:
    """The one-line error `plan --model spec` ends with, the real zoo.build loading the factory."""
    monkeypatch.setattr(zoo, "build", _REAL_BUILD)
    assert main(["plan", "--model", spec, "--topology", "single-3090", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mobius-fx: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert "a model factory is a function `factory(*, batch, seq, device)`" in err
    return err


def test_model_spec_naming_something_not_callable_is_a_clear_error(monkeypatch, capsys, no_planning):
    err = _model_error("os:path", monkeypatch, capsys)
    assert "'os:path' is a module, not callable" in err
    assert no_planning == []


def test_model_spec_naming_a_missing_module_is_a_clear_error(monkeypatch, capsys):
    err = _model_error("no_such_module_xyz:make", monkeypatch, capsys)
    assert "cannot load the model factory 'no_such_module_xyz:make'" in err and "No module named" in err


def test_model_spec_with_an_empty_module_name_is_a_clear_error(monkeypatch, capsys):
    assert "cannot load the model factory ':make'" in _model_error(":make", monkeypatch, capsys)


def test_model_factory_that_takes_no_batch_seq_device_is_a_clear_error(factories, monkeypatch, capsys):
    err = _model_error("cli_factories:no_kwargs", monkeypatch, capsys)
    assert "'cli_factories:no_kwargs' cannot be called as factory(batch=, seq=, device=)" in err


def test_model_factory_returning_a_non_model_is_a_clear_error(factories, monkeypatch, capsys):
    err = _model_error("cli_factories:returns_str", monkeypatch, capsys)
    assert "'cli_factories:returns_str' returned a str" in err


def test_model_factory_returning_a_triple_is_a_clear_error(factories, monkeypatch, capsys):
    err = _model_error("cli_factories:returns_triple", monkeypatch, capsys)
    assert "returned a tuple of 3 (Linear, tuple, str)" in err


def test_topology_file_that_is_not_a_preset_name_is_read_as_json(tmp_path, capsys):
    path = tmp_path / "server.txt"
    path.write_text("not json at all")
    assert main(["topology", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mobius-fx: error: ") and str(path) in err and "JSON" in err and "preset" not in err


def test_topology_that_is_neither_a_preset_nor_a_file_says_both(capsys):
    assert main(["topology", "nope.txt"]) == 2
    err = capsys.readouterr().err
    assert "'nope.txt' is neither a topology preset nor an existing file" in err and "mobius-testbed" in err


def test_topology_without_a_source_is_a_one_line_error(capsys):
    assert main(["topology"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mobius-fx: error: no topology given") and "--detect" in err


def test_topology_refuses_a_source_and_detect_together(capsys):
    assert main(["topology", "rtx4090x8", "--detect"]) == 2
    assert "give one of them, not both" in capsys.readouterr().err


# ----------------------------------------------------------------------------- issue 28

_REAL_PLAN = api.plan


def test_plan_refuses_a_batch_beyond_int64_as_a_usage_error(no_planning, capsys):
    """`--batch 99999999999999999999` once reached torch and died with a raw TypeError."""
    err = _usage_error([*PLAN, "--batch", "99999999999999999999"], capsys)
    assert "argument --batch: invalid value '99999999999999999999'" in err and "below 2**31" in err
    assert no_planning == []


@pytest.mark.skipif(not os.path.exists("/proc/self"), reason="needs /proc")
@pytest.mark.parametrize("flag", ["--json", "--trace"])
def test_plan_refuses_an_output_path_that_cannot_be_opened_before_planning(flag, no_planning, capsys):
    """/proc/x passes the directory checks (it exists, access() says writable) but cannot be created."""
    err = _usage_error([*PLAN, flag, "/proc/mobius-x"], capsys)
    assert f"argument {flag}: cannot write '/proc/mobius-x'" in err
    assert no_planning == []


def test_the_output_path_check_leaves_no_file_behind(tmp_path, no_planning):
    out = tmp_path / "plan.json"
    with pytest.raises(_Reached):
        main([*PLAN, "--json", str(out)])
    assert not out.exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("flag", ["--json", "--trace"])
def test_a_write_that_fails_after_planning_is_a_one_line_error(flag, monkeypatch, capsys):
    """/dev/full opens fine and fails on write: a MobiusError line, exit 2, no traceback."""
    monkeypatch.setattr(api, "plan", _REAL_PLAN)
    monkeypatch.setattr(zoo, "build", lambda *a, **kw: (nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
                                                         (torch.zeros(4, 8, device="meta"),)))
    assert main([*PLAN, "--batch", "4", "--time-limit", "2", flag, "/dev/full"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mobius-fx: error: could not write the ") and "'/dev/full' (No space left on device)" in err
    assert "Traceback" not in err
