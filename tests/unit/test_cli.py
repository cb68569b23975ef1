"""The command line: help at every level, useful errors for wrong names."""

import subprocess
import sys

import pytest

from mobius_fx.__main__ import main


def _run(*args):
    return subprocess.run([sys.executable, "-m", "mobius_fx", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("level", [[], ["plan"], ["topology"]])
def test_help_at_every_level_describes_the_command(level):
    out = _run(*level, "--help")
    assert out.returncode == 0
    assert "usage: mobius-fx" in out.stdout
    if level == ["plan"]:
        assert "--model" in out.stdout and "gpt3-8b" in out.stdout and "mobius-testbed" in out.stdout


def test_wrong_model_name_lists_the_valid_ones(capsys):
    assert main(["plan", "--model", "gpt5", "--topology", "single-3090", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'gpt5'" in err and "gpt3-8b" in err and "llama-8b" in err and "module:factory" in err


def test_wrong_topology_name_lists_the_presets(capsys):
    assert main(["topology", "dgx-a100"]) == 2
    err = capsys.readouterr().err
    assert "dgx-a100" in err and "mobius-testbed" in err


def test_topology_prints_a_tree_and_writes_json(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["topology", "mobius-testbed", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cpu0" in text and "gpu7" in text and "GB/s" in text
    from mobius_fx import Topology
    assert Topology.from_json(str(out)) == Topology.preset("mobius-testbed")


def test_detect_without_gpus_is_a_clear_error(capsys):
    assert main(["topology", "--detect"]) == 2
    assert "mobius-fx: error:" in capsys.readouterr().err
