"""Paired statistics over seeds: a mode's delta against ZeRO-3 beside a perturbation control's.

[Note: paired verdict]
Per seed, a mode's delta against ZeRO-3 is its cost plus the drift of a perturbed run; the
control's delta on the same seed (``CONTROL``, zeropp.tools.modes [Note: perturbation controls]) is
drift alone, of the same size by construction. Their difference per seed estimates the cost;
over seeds, its mean with a 95% Student-t interval (n - 1 degrees of freedom) says whether the
cost is distinguishable from drift at this size: an interval that holds 0 is "indistinguishable
from noise", one above 0 "costs X% ± Y", one below 0 does better than the control. The interval
also bounds the cost: an upper end of 0.3 means at most 0.3% at 95% confidence, whatever the mean.
Beside it, Wilcoxon's signed-rank test on the same differences: a run that stalls on the early
plateau puts one difference of several percent among small ones, which widens the t interval
while the ranks still see that most seeds went one way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

CONTROL = "zero3_init"
"""The control every mode is paired with: a perturbation of qwZ's size."""
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045)
"""Student's t 97.5% quantiles for 1 to 29 degrees of freedom (from 30 on, 2.04 down to 1.96)."""


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def std(values: Sequence[float]) -> float:
    """Sample standard deviation (0 for one value)."""
    if len(values) < 2:
        return 0.0
    center = mean(values)
    return math.sqrt(sum((v - center) ** 2 for v in values) / (len(values) - 1))


def t975(dof: int) -> float:
    """Student's t 97.5% quantile for ``dof`` degrees of freedom (within 0.3% from 30 on)."""
    return _T975[dof - 1] if dof <= len(_T975) else 1.96 + 2.4 / dof


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Mean and standard error of paired deltas (None where there are too few)."""
    n = len(values)
    return {"n": n, "mean_percent": mean(values) if n else None,
            "standard_error_percent": std(values) / math.sqrt(n) if n > 1 else None}


def signed_rank_p(differences: Sequence[float]) -> float:
    """Two-sided exact p-value of Wilcoxon's signed-rank test that the differences centre on 0.

    Zeros are dropped; equal magnitudes share their mean rank. The null distribution of the sum
    of positive ranks is counted exactly over all 2^n sign patterns (ranks doubled to integers).
    """
    nonzero = sorted((d for d in differences if d != 0), key=abs)
    if not nonzero:
        return 1.0
    doubled_ranks, start = [], 0
    while start < len(nonzero):
        end = start
        while end + 1 < len(nonzero) and abs(nonzero[end + 1]) == abs(nonzero[start]):
            end += 1
        doubled_ranks += [start + end + 2] * (end - start + 1)  # 2 x the mean of ranks start+1 .. end+1
        start = end + 1
    counts = [1] + [0] * sum(doubled_ranks)  # counts[s]: sign patterns whose positive ranks sum to s
    for rank in doubled_ranks:
        counts = [count + (counts[s - rank] if s >= rank else 0) for s, count in enumerate(counts)]
    observed = sum(rank for rank, d in zip(doubled_ranks, nonzero) if d > 0)
    below, above = sum(counts[:observed + 1]), sum(counts[observed:])
    return min(1.0, 2 * min(below, above) / 2 ** len(nonzero))


def verdict(differences: Sequence[float], *, against: str = "the control") -> dict[str, Any]:
    """The verdict on a mode's per-seed deltas minus the control's ([Note: paired verdict]), or
    minus another mode's (``against`` names it in the text)."""
    n = len(differences)
    if n < 2:
        return {"n": n, "differences_percent": list(differences), "mean_percent": mean(differences) if n else None,
                "interval_percent": None, "text": "too few seeds"}
    center, half = mean(differences), t975(n - 1) * std(differences) / math.sqrt(n)
    low, high = center - half, center + half
    if low <= 0 <= high:
        text = f"indistinguishable from noise ({center:+.2f}%, 95% interval [{low:+.2f}, {high:+.2f}])"
    elif low > 0:
        text = f"costs {center:.2f}% ± {half:.2f}"
    else:
        text = f"better than {against} by {-center:.2f}% ± {half:.2f}"
    return {"n": n, "differences_percent": list(differences), "mean_percent": center,
            "standard_error_percent": std(differences) / math.sqrt(n), "interval_percent": [low, high],
            "wins_over_control": sum(d < 0 for d in differences),
            "signed_rank_p": signed_rank_p(differences), "text": text}
