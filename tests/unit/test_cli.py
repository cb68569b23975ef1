"""The command line: help at every level, useful errors for wrong names."""

import re
import subprocess
import sys
import types

import pytest
import torch

from mobius_fx.__main__ import _network, main
from mobius_fx.zoo import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("trace_cache")  # the tiny model, planned again and again, traced once


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


# ------------------------------------------------------------ plan --servers R --network BW
_TINY = GPTConfig(vocab=100, seq=16, hidden=32, blocks=4, heads=2)  # 6 layers: embedding, 4 blocks, head


@pytest.fixture
def tiny(monkeypatch):
    """`--model cli_dp_models:tiny`: a 6-layer GPT on the meta device (planned in well under a second with --cuts)."""
    def tiny(*, batch, seq, device):
        with torch.device(device):
            return GPT(_TINY), (torch.zeros(batch, _TINY.seq, dtype=torch.long),)
    mod = types.ModuleType("cli_dp_models")
    mod.tiny = tiny
    monkeypatch.setitem(sys.modules, "cli_dp_models", mod)
    return ["plan", "--model", "cli_dp_models:tiny", "--topology", "mobius-testbed", "--batch", "8", "--seq", "16",
            "--cuts", "1,3", "--quiet"]


def _cluster_rows(out):
    """The cluster table's rows: {servers: [cells]} (cells split on runs of 2+ spaces)."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("servers "))
    assert "global batch (tokens)" in lines[head] and "scaling efficiency" in lines[head]
    rows = {}
    for line in lines[head + 2:]:
        cells = re.split(r"\s{2,}", line.strip())
        if not cells[0].isdigit():
            break
        rows[int(cells[0])] = cells
    return rows


def _seconds(cell):
    value, unit = cell.split()
    return float(value) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]


@pytest.mark.parametrize("servers, counts", [(4, [1, 2, 4]), (6, [1, 2, 4, 6]), (1, [1])])
def test_plan_with_servers_prints_the_cluster_table(tiny, capsys, servers, counts):
    assert main([*tiny, "--servers", str(servers), "--network", "100Gbps"]) == 0
    out = capsys.readouterr().out
    assert "ring all-reduce per stage over a 100 Gbit/s = 12.5 GB/s full-duplex NIC" in out
    rows = _cluster_rows(out)
    assert sorted(rows) == counts
    step1 = _seconds(rows[1][2])
    assert rows[1][1] == f"{8 * 16:,}" and rows[1][4] == "100.0%" and rows[1][6] == "-"
    for r in counts[1:]:
        cells = rows[r]
        assert cells[1] == f"{r * 8 * 16:,}"  # global batch: R x batch x seq tokens
        eff = float(cells[4].rstrip("%")) / 100
        assert eff == pytest.approx(step1 / _seconds(cells[2]), abs=0.02)  # throughput_R / (R x throughput_1)
        assert float(cells[3].replace(",", "")) == pytest.approx(r * 8 * 16 / _seconds(cells[2]), rel=0.02)
        assert _seconds(cells[2]) == pytest.approx(sum(_seconds(c) for c in (cells[5], cells[7], cells[8])),
                                                  rel=0.02)


def test_a_slower_network_scales_worse(tiny, capsys):
    effs = []
    for net in ("400Gbps", "1Gbit/s", "10MB/s"):
        assert main([*tiny, "--servers", "2", "--network", net]) == 0
        effs.append(float(_cluster_rows(capsys.readouterr().out)[2][4].rstrip("%")))
    assert effs[0] >= effs[1] > effs[2]


@pytest.mark.parametrize("text, bytes_per_s", [("100Gbps", 12.5e9), ("100Gb/s", 12.5e9), ("25Gbit/s", 3.125e9),
                                               ("12.5GB/s", 12.5e9), ("12.5GBps", 12.5e9), ("400 Mbps", 50e6),
                                               ("1GiB/s", 2**30), ("10 gbits/s", 1.25e9)])
def test_network_takes_bits_or_bytes_per_second(text, bytes_per_s):
    assert _network(text) == pytest.approx(bytes_per_s, rel=1e-12)


@pytest.mark.parametrize("text, why", [("100G", "no bits or bytes"), ("12.5e9", "no unit"),
                                       ("100GBPS", "ambiguous"), ("0Gbps", "not a positive, finite bandwidth"),
                                       ("-1Gbps", "not a positive"), ("fast", "not a network bandwidth")])
def test_a_bad_network_is_refused_with_the_rule_and_examples(text, why, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "gpt2", "--topology", "mobius-testbed", "--servers", "2", f"--network={text}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --network" in err and repr(text) in err and why in err
    assert "lowercase b or 'bit' is bits" in err and "'100Gbps'" in err and "'12.5GB/s'" in err


@pytest.mark.parametrize("flags", [["--servers", "4"], ["--network", "100Gbps"]])
def test_servers_and_network_go_together(flags, capsys):
    assert main(["plan", "--model", "gpt2", "--topology", "mobius-testbed", *flags]) == 2
    assert "--servers R and --network go together" in capsys.readouterr().err


def test_servers_must_be_a_positive_integer(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "gpt2", "--topology", "mobius-testbed", "--servers", "0", "--network", "1Gbps"])
    assert e.value.code == 2 and "argument --servers" in capsys.readouterr().err


def _host_activation_rows(out, stage):
    return [line for line in out.splitlines() if re.match(rf"activation\s+forward\s+{stage}\s+gpu\d+ -> host", line)]


def test_plan_plans_the_training_step_so_no_logits_reach_the_host(tiny, capsys):
    """By default a language model's training step is planned, the loss on the last stage: the
    last stage sends the host only its loss; --forward-only plans the logits going there."""
    assert main([*tiny, "--transfers"]) == 0
    step = capsys.readouterr().out
    assert main([*tiny, "--forward-only", "--transfers"]) == 0
    forward = capsys.readouterr().out
    logits = f"{16 * _TINY.vocab * 2 / 1024:.2f} KiB x8"  # fp16, one micro-batch's (1 x 16 x vocab), 8 of them
    assert any(logits in row for row in _host_activation_rows(forward, 2))
    assert not any(logits in row for row in _host_activation_rows(step, 2))
    assert [line for line in step.splitlines() if "LossModel" in line] == []


# ------------------------------------------------------------ quiet defaults: the transfer summary, the overlap mode
def test_plan_prints_the_transfer_summary_and_the_full_table_on_request(tiny, capsys):
    assert main(tiny) == 0
    out = capsys.readouterr().out
    assert "stage  gpu" in out and "bytes per step" in out and "transfer rows summed" in out
    assert " > " not in out  # no route column: the full table is not printed
    assert main([*tiny, "--transfers"]) == 0
    full = capsys.readouterr().out
    assert "bytes per step" not in full and "cpu0 > " in full  # every transfer, with its route


def test_the_cli_overlap_default_is_the_library_s(tiny, capsys):
    import inspect

    from mobius_fx.runtime.pipeline import Pipeline

    assert main(tiny) == 0
    default = inspect.signature(Pipeline.overlap).parameters["mode"].default
    assert default == "sync" and f"CPU optimizer overlap: {default})" in capsys.readouterr().out
