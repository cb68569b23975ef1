"""A real English corpus with no download: the prose of the Python standard library.

Every Python installation ships its standard library's source; the docstrings in it are a few
megabytes of real, edited English about programming (PSF licence). `load_text()` collects them
deterministically (sorted files, the first `max_bytes`) so a run is repeatable on any machine.
Pass your own text file to the examples with `--data path.txt` instead.
"""

from __future__ import annotations

import ast
import os
import sysconfig

__all__ = ["load_text"]


def load_text(max_bytes: int = 400_000, data: str | None = None) -> str:
    if data is not None:
        with open(data, encoding="utf-8", errors="replace") as f:
            return f.read()
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[str] = []
    size = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in {"test", "tests", "idlelib", "site-packages", "lib2to3"})
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 200 and doc.isascii():
                        chunks.append(doc.strip() + "\n\n")
                        size += len(chunks[-1])
                        if size >= max_bytes:
                            return "".join(chunks)[:max_bytes]
    return "".join(chunks)
