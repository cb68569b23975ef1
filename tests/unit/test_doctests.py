"""Every `>>>` example in the package runs and prints what it shows.

Examples that need a model or a plan from context are written as plain indented code, not as
doctests; what is written with `>>>` is executed here (modules imported under their installed
names, so `passes/` runs as `mobius_fx.passes`).
"""

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest
import torch
from torch import nn

import mobius_fx
import mobius_fx.passes


def _modules() -> list[str]:
    """Every module of the package, subpackages (`mobius_fx.runtime`, ...) included."""
    names = set()
    for pkg in (mobius_fx, mobius_fx.passes):
        names.add(pkg.__name__)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{pkg.__name__}."):
            if not info.name.endswith(".__main__"):
                names.add(info.name)
    return sorted(names)


def _files() -> set[str]:
    """The same, read off the source files: `pkg/sub/mod.py` -> `pkg.sub.mod`."""
    names = set()
    for pkg in (mobius_fx, mobius_fx.passes):
        root = Path(pkg.__path__[0])
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts and parts[-1] == "__main__":
                continue
            names.add(".".join((pkg.__name__, *parts)))
    return names


def _tests(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    globs = {"torch": torch, "nn": nn, "mobius_fx": mobius_fx, "Topology": mobius_fx.Topology,
             "trace": mobius_fx.trace}
    return [t for t in doctest.DocTestFinder().find(module, extraglobs=globs) if t.examples]


_WITH_EXAMPLES = [name for name in _modules() if _tests(name)]


def test_every_module_of_the_package_is_searched_for_examples():
    missed = sorted(_files() - set(_modules()))
    assert not missed, f"modules the doctest search does not reach: {missed}"


def test_the_package_has_runnable_examples():
    assert len(_WITH_EXAMPLES) >= 6, _WITH_EXAMPLES


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", _WITH_EXAMPLES)
def test_docstring_examples_run(name):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for t in _tests(name):
        runner.run(t, out=report.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(report)
    assert result.attempted > 0
