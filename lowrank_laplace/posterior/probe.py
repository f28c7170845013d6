r"""The spectral residual's probe: the checks a fit runs on its first training inputs.

The logit-shift directions are checked to move every output alike on the first inputs
(:func:`checked_null`), and the rank check (:func:`variance_change`) reads the Lanczos
quadrature's Jacobian starts (:mod:`~lowrank_laplace.posterior.quadrature`): how much
their predictive variance changes from half the kept eigenpairs to all.

Shape glossary:
    D: Laplace parameters; r: kept rank; m: columns (starts); C: outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.posterior.null import NullDirections, moves_outputs_alike
from lowrank_laplace.utils.batches import take
from lowrank_laplace.utils.checks import check_batch

#: Training inputs (the first) a fit with the spectral residual keeps: the Lanczos
#: quadrature's Jacobian starts and the null directions' check.
PROBE_SIZE = 256
#: Inputs the logit-shift directions are checked on.
NULL_CHECK_INPUTS = 32


def checked_null(engine: FactorEngine, inputs: Any, null: Optional[NullDirections]
                 ) -> Optional[NullDirections]:
    """The candidate directions if they move every output alike on the first inputs, or ``None``.

    Args:
        engine: The fit's Jacobian engine.
        inputs: The first batch of training inputs.
        null: The candidates (``posterior.null.head_directions``), or ``None``.
    """
    if null is None:
        return None
    n = check_batch(inputs, None)
    factor = engine.compute(take(inputs, slice(0, min(n, NULL_CHECK_INPUTS)), n), None,
                            gradient=False)
    alike = moves_outputs_alike(null.factor_product(factor), engine.num_outputs)
    return null if alike else None


@dataclass(frozen=True)
class ProbeColumns:
    """Jacobian columns (the quadrature's starts), as the rank check reads them.

    Attributes:
        norms: ``||j_i||^2``, ``(m,)``.
        projections: ``j_i^T U``, ``(m, r)``, float64.
        null: ``||N^T j_i||^2`` on the logit-shift directions (``None``: none known).
    """

    norms: Tensor
    projections: Tensor
    null: Optional[Tensor] = None


def predictive_variance(probe: ProbeColumns, eigenvalues: Tensor, variance: Tensor,
                        prior: Tuple[float, float], lumped: Optional[int] = None) -> Tensor:
    r"""Each column's GLM variance under the spectral residual, ``(m,)`` float64.

    ``sum_k z_ik^2 / (h lambda_k + delta) + v (||j_i||^2 - sum_k z_ik^2)``, the
    logit-shift directions' energy apart at ``1 / delta``. With ``lumped = k``, the kept
    directions from ``k`` on join the complement: their exact eigenvalues and the columns'
    energies on them pool with ``v`` into one variance, as a rank-``k`` fit's residual
    would hold them.

    Args:
        probe: The columns.
        eigenvalues: The kept ``lambda``, ``(r,)``.
        variance: The complement variance ``v`` outside all ``r``.
        prior: ``(h, delta)``.
        lumped: Kept directions treated as kept (``None``: all).
    """
    (scale, delta), lam = prior, eigenvalues.to(probe.projections)
    z2 = probe.projections[:, : lam.numel()] ** 2
    inverse = 1 / (scale * lam + delta)
    null = 0 if probe.null is None else probe.null
    outside = (probe.norms - z2.sum(1) - null).clamp(min=0)
    v, k = variance.to(z2.dtype), lam.numel() if lumped is None else lumped
    if k < lam.numel():  # pooled: energy-weighted mean of the lumped and outside variances
        pooled = z2[:, k:].sum(0)
        total = pooled.sum() + outside.sum()
        v = ((pooled * inverse[k:]).sum() + v * outside.sum()) / total.clamp(
            min=torch.finfo(z2.dtype).tiny)
        outside = outside + z2[:, k:].sum(1)
    return z2[:, :k] @ inverse[:k] + v * outside + null / delta


def variance_change(probe: ProbeColumns, eigenvalues: Tensor, variance: Tensor,
                    prior: Tuple[float, float]) -> float:
    """``median |var_half - var| / var`` of the columns' predictive variance.

    The leading half of the kept eigenpairs ``(r,)``, ``r >= 2``, against all of them: the
    directions the half drops join its complement (:func:`predictive_variance` with
    ``lumped``); ``variance`` is ``v`` outside all of them, ``prior`` ``(h, delta)``.
    """
    var = predictive_variance(probe, eigenvalues, variance, prior)
    var_half = predictive_variance(probe, eigenvalues, variance, prior,
                                   eigenvalues.numel() // 2)
    return float(((var_half - var).abs() / var.clamp(min=1e-300)).median())
