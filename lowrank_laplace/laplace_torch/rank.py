"""``rank="auto"``: the rank chosen from the data.

The fit starts at :data:`AUTO_RANK_START` eigenpairs and is redone with twice the rank while
the spectral residual's rank check (:func:`~lowrank_laplace.posterior.probe.variance_change`
on the Lanczos quadrature's Jacobian starts) says the rank still matters; the fit report
lists every rank tried with its change.
"""

from __future__ import annotations

from typing import Optional

import torch

from lowrank_laplace.fitting.budget import resolve_memory_budget

#: The ``rank`` option's value that chooses the rank from the data.
AUTO = "auto"
#: The first rank ``rank="auto"`` fits (the default rank).
AUTO_RANK_START = 100
#: ``rank="auto"`` stops where the Jacobian starts' median predictive variance moves by
#: less than this from the leading half of the kept eigenpairs to all of them.
AUTO_RANK_TOLERANCE = 0.05
#: ``rank="auto"`` doubles the rank only while a float64 ``D x 2r`` basis takes at most
#: this share of the memory budget.
AUTO_RANK_MEMORY_SHARE = 0.25


def next_rank(rank: int, change: Optional[float], bounds: tuple) -> Optional[int]:
    """Twice the fitted ``rank`` (at most the rank bound), or ``None`` to stop.

    ``change`` is its rank check's variance change (``None``: not measured, so nothing tells
    that more rank would help); ``bounds`` is ``(GGN rank bound, D, memory budget as given,
    device)``.
    """
    rank_bound, dim, budget, device = bounds
    if change is None or change <= AUTO_RANK_TOLERANCE or rank >= min(rank_bound, dim):
        return None
    grown = min(2 * rank, rank_bound, dim)
    budget = resolve_memory_budget(budget, torch.device(device))
    if dim * 2 * grown * 8 > AUTO_RANK_MEMORY_SHARE * budget:
        return None
    return grown
