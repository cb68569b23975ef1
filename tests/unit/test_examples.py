"""The examples a new user starts from run as documented."""

import runpy
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("trace_cache")  # tests/conftest.py: each model traced once per module

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(name, argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", [name, *argv])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")


def test_hf_models_match_eager_gradients(monkeypatch, capsys):
    _run("hf_models.py", [], monkeypatch)
    out = capsys.readouterr().out
    for name in ("gpt2", "llama", "opt", "bert"):
        assert f"{name} " in out
    assert out.count("match eager") == 4


# examples/lora.py (frozen base weights: only the adapters' gradients are sent back; the script
# asserts it) runs in tests/unit/test_checkout.py::test_an_example_runs_from_the_checkout.


def test_finetune_hf_example_falls_back_without_a_cache_and_lowers_the_loss(monkeypatch, capsys, tmp_path):
    # an empty cache: GPT-2 is not there, nothing is downloaded, a config-built GPT-2 is fine-tuned
    _run("finetune_hf.py", ["--model", "gpt2", "--cache-dir", str(tmp_path), "--steps", "30", "--log-every", "15"],
         monkeypatch)
    out = capsys.readouterr().out
    assert "gpt2 is not in the local Hugging Face cache" in out and "nothing is downloaded" in out
    assert "stage" in out and "step 30: train loss" in out
    sent = next(l for l in out.splitlines() if "sent back" in l)
    assert "ran on 1 compiled variant" in sent  # every padded length on one graph
    assert sent.split("sent back ")[1].split(" KB")[0] == sent.split("adapters': ")[1].split(" KB")[0]
    line = next(l for l in out.splitlines() if l.startswith("validation loss"))
    first, last = (float(v) for v in line.split()[2:5:2])
    assert last < 0.85 * first


@pytest.mark.slow
@pytest.mark.parametrize("overlap", ["sync", "async"])
def test_finetune_example_lowers_the_loss_in_a_short_run(monkeypatch, capsys, overlap):
    # the default model and 4 virtual GPUs, on fewer and smaller batches than the default run (the loss
    # falls about 35% in these 20 steps, both modes; the bound asks for 20%)
    _run("finetune_gpt.py", ["--steps", "20", "--log-every", "10", "--batch", "8", "--seq", "32", "--microbatches", "4",
                             "--optimizer-overlap", overlap], monkeypatch)
    out = capsys.readouterr().out
    assert f"overlap mode '{overlap}'" in out
    line = next(l for l in out.splitlines() if l.startswith("validation loss"))
    first, last = (float(v) for v in line.split()[2:5:2])
    assert last < 0.8 * first
    assert "sample:" in out and "stage" in out


@pytest.mark.slow
def test_finetune_example_runs_data_parallel_under_torchrun(tmp_path):
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(EXAMPLES / "finetune_gpt.py"), "--steps", "4", "--log-every", "2", "--batch", "8",
                          "--microbatches", "4", "--shard"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "data parallel: 2 processes, 8 rows each (16 per step)" in run.stdout
    assert run.stdout.count("step 4: train loss") == 1  # rank 0 prints, the other does not
