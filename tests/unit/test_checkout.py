"""The project runs from a plain checkout: torch and the other dependencies importable, mobius_fx
not installed (a GPU box with no package index). Each command runs in a copy of the checkout under
`python -S`, so no `.pth` file (an editable install's finder) can supply the installed copy; the
dependencies come from the site-packages folders on PYTHONPATH, which processes no `.pth`."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("checkout")
    for name in ("mobius_fx", "passes", "benchmarks", "examples"):
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", dst / "pyproject.toml")
    return dst


def _run(checkout: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = os.pathsep.join(site.getsitepackages())
    return subprocess.run([sys.executable, "-S", *args], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_checkouts_own_passes_are_imported_not_an_installed_copy(checkout):
    r = _run(checkout, "-c", "import mobius_fx.passes.partition as p, mobius_fx as m; "
                             "print(m.__file__); print(p.__file__)")
    assert r.returncode == 0, r.stderr
    package, passes = r.stdout.split()
    assert Path(package).parent == checkout / "mobius_fx"
    assert Path(passes).parent == checkout / "passes"


def test_the_cli_plans_from_the_checkout(checkout):
    r = _run(checkout, "-m", "mobius_fx", "plan", "--model", "gpt2", "--topology", "single-3090",
             "--batch", "2", "--seq", "128", "--time-limit", "2", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stage" in r.stdout.lower()


def test_gpu_check_dry_run_from_the_checkout(checkout):
    r = _run(checkout, "benchmarks/gpu_check.py", "--dry-run", "--params", "2e8", "--time-limit", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "simulated" in r.stdout


def test_an_example_runs_from_the_checkout(checkout):
    """examples/lora.py, from the checkout: its own asserts (frozen weights get no gradient, stay
    unchanged, and only the adapters' gradient bytes are sent back) pass, and it says so last."""
    r = _run(checkout, "examples/lora.py")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "never sent back" in r.stdout.splitlines()[-1]
