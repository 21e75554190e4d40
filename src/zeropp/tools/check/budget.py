"""How ``zeropp check`` shares its time budget among its sections.

Each section has a share of the budget. A section may use its own share and whatever the
sections before it left unused, but never the shares of the sections after it: so a fast
section hands its time on, and a slow one cannot starve the rest. The runner stops a section
when its allotment is spent; a section whose allotment is below what it needs to finish its
first part is skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence


def allotment(shares: Sequence[float], budget_s: float, elapsed_s: float) -> float:
    """Seconds for the first of the sections still to run, whose shares are ``shares`` in order,
    ``elapsed_s`` into a budget of ``budget_s``."""
    remaining = max(0.0, budget_s - elapsed_s)
    reserved = sum(shares[1:]) * budget_s
    return min(remaining, max(shares[0] * budget_s, remaining - reserved))


def too_little(allotted_s: float, needed_s: float) -> str | None:
    """The reason to skip a section allotted ``allotted_s`` that needs ``needed_s``, or None."""
    if allotted_s >= needed_s:
        return None
    return f"the budget is spent: {allotted_s:.0f} s left for it, it needs at least {needed_s:.0f} s"
