"""The error types of mobius_fx.

Every message says the value, the rule it broke, and what to do about it, e.g.
"Stage 3 needs 9.2 GiB (weights 7.1 + activations 2.1) but gpu5 has 8.0 GiB; raise
`memory_fraction` or allow more stages".
"""

from __future__ import annotations

__all__ = ["MobiusError", "TraceError", "PlanError", "TopologyError", "BudgetError", "first_line"]


class MobiusError(Exception):
    """Base class of every error mobius_fx raises on purpose."""


class TraceError(MobiusError):
    """The model could not be captured as a graph by any front end."""


class PlanError(MobiusError):
    """No pipeline plan satisfies the constraints (memory, double buffer, settings)."""


class TopologyError(MobiusError):
    """A topology description is malformed or cannot be used."""


class BudgetError(MobiusError):
    """At run time a GPU would hold more bytes than its budget (nothing was counted or copied)."""


def first_line(e: BaseException) -> str:
    """The first line of an error, with its type, at most ~300 characters (for messages)."""
    text = str(e).strip() or type(e).__name__
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), text)
    if len(line) > 300:
        line = line[:297] + "..."
    return f"{type(e).__name__}: {line}"
