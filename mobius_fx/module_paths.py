"""Where a traced node comes from: the module path of the user's model that produced it, read
from the node's `nn_module_stack` (fx and torch.export alike), so nodes group into layers and
stage tables name them as the model does.

    module_path(node)      # "transformer.h.3.attn"
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

__all__ = ["module_path", "module_stack"]


def module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """(qualified path, class name) of every module around `node`, outermost first, root excluded.

    Reads `nn_module_stack` (fx keys it by path, export by `L__self__...`; both store
    (path, type) values) and drops the root entry (path "").
    """
    stack = node.meta.get("nn_module_stack") or {}
    out: list[tuple[str, str]] = []
    for value in stack.values():
        path, kind = value[0], value[1]
        if not path or path.startswith("_empty_nn_module_stack"):
            continue  # the root, or export's placeholder for "no module" (sym_size nodes)
        cls = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
        out.append((_strip_export_prefix(path), cls))
    return out


def module_path(node: fx.Node) -> str:
    """Qualified name of the innermost user module `node` was produced in ("" for the root).

    `call_module` nodes without a recorded stack give their target; `get_attr` nodes without
    one give the module of their first user (where the attribute is used).

    >>> gm = trace(nn.Sequential(nn.Linear(4, 4)), example_inputs=(torch.randn(1, 4),))
    >>> [module_path(n) for n in gm.graph.nodes]
    ['', '0', '']
    """
    stack = module_stack(node)
    if stack:
        return stack[-1][0]
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr" and node.users:
        first = min(node.users, key=_position(node.graph))
        if first.op != "output":
            return module_path(first)
    return ""


def _strip_export_prefix(path: str) -> str:
    # Older export versions record "L__self___transformer_h_0"-style keys as paths.
    return path[len("L__self__"):].lstrip("_.") if path.startswith("L__self__") else path


def _position(graph: fx.Graph) -> Callable[[fx.Node], int]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__
