"""The README stays short and true (issue 40 part 6): its setup commands are CI's, the files and
scripts it and docs/ name exist, and the sections the code cites by name are there."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

# docs/ pages linked from the README before the branch that writes them is merged (none now).
PENDING_DOCS: set[str] = set()


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 250, "the README is read in five minutes: move details into docs/"


def test_the_setup_commands_are_the_ones_ci_runs():
    block = re.search(r"## Setup\n\n```bash\n(.*?)```", README, re.S)
    assert block, "the README's Setup section starts with a bash block of the two commands"
    readme_cmds = block.group(1).strip().splitlines()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert readme_cmds == ["pip install -e \".[dev]\"", "python -m pytest"]
    assert ci[-2:] == readme_cmds, "CI runs exactly the README's install and test commands, last"


def _texts():
    yield "README.md", README, ROOT
    for page in sorted((ROOT / "docs").glob("*.md")):
        yield f"docs/{page.name}", page.read_text(), page.parent


def test_every_linked_page_and_named_script_exists():
    missing = []
    for name, text, base in _texts():
        for link in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", text):  # markdown links, relative to the page
            if not (base / link).is_file() and Path(link).name not in PENDING_DOCS:
                missing.append((name, link))
        for path in re.findall(r"\b((?:examples|benchmarks)/\w+\.py)", text):  # scripts, from the root
            if not (ROOT / path).is_file():
                missing.append((name, path))
    assert not missing, f"named but not in the repository: {missing}"


def test_each_headline_figure_has_its_script():
    table = README.split("## Figures", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| figure")]
    assert 3 <= len(rows) <= 5, "the README keeps 3-5 headline figures; the rest are in docs/benchmarks.md"
    for row in rows:
        script = re.search(r"`python ((?:benchmarks|examples)/\w+\.py)[^`]*`", row)
        assert script and (ROOT / script.group(1)).is_file(), f"a figure without the command that makes it: {row}"
    assert "docs/benchmarks.md" in table


def test_sections_the_sources_cite_are_in_the_readme():
    headings = set(re.findall(r"^#+ (.+)$", README, re.M))
    cited = set()
    for folder in ("mobius_fx", "passes", "benchmarks", "examples", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            text = re.sub(r"\s+", " ", path.read_text())
            cited |= {(m, path.name) for m in re.findall(r'README\W{0,4}"([^"\\]{3,60})', text)}
    assert cited, "the sources cite README sections by name (e.g. \"Micro-batch semantics\")"
    assert not [c for c in cited if c[0] not in headings], "cited README sections that are gone"
