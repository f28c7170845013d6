"""``rank="auto"``: the rank chosen from the data.

The fit starts at :data:`AUTO_RANK_START` eigenpairs. After each fit the spectral
residual's probe says how much the probe inputs' predictive variance moves from the
leading half of the kept eigenpairs to all of them
(:func:`~lowrank_laplace.posterior.probe.variance_change`): where it moves by more than
:data:`AUTO_RANK_TOLERANCE`, the rank still matters and the fit is redone with twice the
rank, until the change is below the tolerance, the GGN's rank bound is reached, or the
``D x 2r`` basis would exceed :data:`AUTO_RANK_MEMORY_SHARE` of the memory budget. The
fit report lists every rank tried with its change.
"""

from __future__ import annotations

from typing import Optional

import torch

from lowrank_laplace.fitting.budget import resolve_memory_budget

#: The ``rank`` option's value that chooses the rank from the data.
AUTO = "auto"
#: The first rank ``rank="auto"`` fits (the default rank).
AUTO_RANK_START = 100
#: ``rank="auto"`` stops where the probe inputs' median predictive variance moves by
#: less than this from the leading half of the kept eigenpairs to all of them.
AUTO_RANK_TOLERANCE = 0.05
#: ``rank="auto"`` doubles the rank only while a float64 ``D x 2r`` basis takes at most
#: this share of the memory budget.
AUTO_RANK_MEMORY_SHARE = 0.25


def next_rank(rank: int, change: Optional[float], bounds: tuple) -> Optional[int]:
    """The rank of the next fit of ``rank="auto"``, or ``None`` to stop.

    Args:
        rank: The rank just fitted.
        change: Its probe's variance change (``None``: not measured, so nothing tells
            that more rank would help).
        bounds: ``(rank bound of the GGN, parameters D, memory budget as given, device)``.

    Returns:
        Twice the rank (at most the rank bound), or ``None``.
    """
    rank_bound, dim, budget, device = bounds
    if change is None or change <= AUTO_RANK_TOLERANCE or rank >= min(rank_bound, dim):
        return None
    grown = min(2 * rank, rank_bound, dim)
    budget = resolve_memory_budget(budget, torch.device(device))
    if dim * 2 * grown * 8 > AUTO_RANK_MEMORY_SHARE * budget:
        return None
    return grown
