r"""Models of the curvature a rank-``r`` truncation drops.

The fit keeps the leading eigenpairs :math:`U \mathrm{diag}(\lambda) U^\top` of the GGN
sum :math:`H` and knows the dropped curvature's total exactly: the *residual mass*
:math:`T = \mathrm{tr}(H) - \sum_i \lambda_i`. Leaving the residual
:math:`R = H - U \mathrm{diag}(\lambda) U^\top` out (``"none"``) gives the
``D - r`` dropped directions the prior variance only, and its log-determinant, in
which only ``r`` eigenvalues depend on the prior precision, drives the marginal
likelihood towards weak priors. The models, each one consistent posterior:

``"spectral"`` (default)
    The dropped eigenvalues follow a power law that continues the kept spectrum,
    :math:`\tilde\lambda_i = \lambda_r (i / r)^{-\alpha}` for
    :math:`i = r+1 \dots n`, with :math:`\alpha` fixed by the exact mass
    :math:`\sum_i \tilde\lambda_i = T` and :math:`n` the GGN's rank bound
    (``min(D, N x columns per sample)``); their eigenvectors are unknown, so they
    are taken uniformly at random in the complement of ``U``. Every member of that
    family has the same :math:`\log\det P` (used by the marginal likelihood), and
    the family's covariance is the kept part plus the complement with the mean
    variance :math:`v = \mathrm{mean}_i\, 1 / (h \tilde\lambda_i + \delta)` (used by
    the predictive, samples and weight variances). For a scalar prior this is
    exact; per-layer / per-parameter priors evaluate the tail at their mean.
``"isotropic"``
    :math:`R \approx \rho (I - U U^\top)` with :math:`\rho = T / (D - r)`, the mean
    dropped eigenvalue (probabilistic PCA's noise term).
``"diagonal"``
    :math:`R \approx \mathrm{diag}(H) - \mathrm{diag}(U \mathrm{diag}(\lambda) U^\top)`,
    the exact diagonal of the residual (the fit tracks the GGN diagonal).
``"none"``
    :math:`R = 0` (laplace-torch's plain low-rank semantics).

The isotropic and spectral models enter the algebra of
:class:`~lowrank_laplace.posterior.LowRankPrecision` as a shift,
:math:`P = U \mathrm{diag}(h\lambda - \rho) U^\top + (P_0 + \rho I)`, plus (spectral)
a log-determinant offset; nothing costs more than the model without residual.
Why the spectral model is the default: a flat residual overstates
:math:`\log\det(R + \delta I)` of a decaying tail (by Jensen's inequality), so the
marginal likelihood of the isotropic and diagonal models overshoots the prior
precision (sklearn digits MLP, rank 100: +36% and +30% against the full GGN's,
spectral +11%); their predictive, though, is the closer one at ranks of a few percent
of ``D``. See the posterior-quality page of the docs.

Shape glossary:
    D: parameters; r: kept rank; n: rank bound of the GGN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lowrank_laplace.posterior import LowRankPrecision

RESIDUALS = ("spectral", "isotropic", "diagonal", "none")
DEFAULT_RESIDUAL = "spectral"


def check_residual(residual: str) -> str:
    """Validate a residual model's name.

    Args:
        residual: One of :data:`RESIDUALS`.

    Returns:
        The name.

    Raises:
        ValueError: For anything else.
    """
    if residual not in RESIDUALS:
        raise ValueError(
            f"residual must be one of {', '.join(map(repr, RESIDUALS))}, got {residual!r}."
        )
    return residual


def power_law_tail(anchor: float, mass: float, start: int, count: int) -> Tensor:
    r"""Eigenvalues :math:`a (i / s)^{-\alpha}`, :math:`i = s+1 \dots s+n`, summing to ``mass``.

    The exponent is found by bisection (the sum falls monotonically in
    :math:`\alpha`). A mass the flat continuation (:math:`\alpha = 0`) cannot reach
    is spread evenly instead.

    Args:
        anchor: The last kept eigenvalue ``a`` (``lambda_r``), ``>= 0``.
        mass: The total the tail must hold, ``>= 0``.
        start: The last kept index ``s = r >= 1``.
        count: Number of tail eigenvalues ``n >= 0``.

    Returns:
        Float64 tensor of shape ``(count,)``, non-increasing.
    """
    if count <= 0:
        return torch.zeros(0, dtype=torch.float64)
    if mass <= 0 or anchor <= 0:
        return torch.full((count,), max(mass, 0.0) / count, dtype=torch.float64)
    log_ratio = torch.log(torch.arange(start + 1, start + count + 1, dtype=torch.float64) / start)
    if anchor * count <= mass:
        return torch.full((count,), mass / count, dtype=torch.float64)
    lo, hi = 0.0, 1.0
    while float((anchor * torch.exp(-hi * log_ratio)).sum()) > mass:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if float((anchor * torch.exp(-mid * log_ratio)).sum()) > mass:
            lo = mid
        else:
            hi = mid
    return anchor * torch.exp(-hi * log_ratio)


@dataclass
class Residual:
    """What a residual model needs of a fit, on the GGN's own scale (before ``1/sigma^2/T``).

    Attributes:
        model: One of :data:`RESIDUALS`.
        dim: Number of parameters ``D``.
        mass: The exact dropped curvature ``tr(H) - sum(lambda)`` (``>= 0``).
        diagonal: Residual diagonal, shape ``(D,)`` (``"diagonal"`` only).
        tail: Modelled dropped eigenvalues, shape ``(n - r,)`` (``"spectral"`` only).
    """

    model: str
    dim: int
    mass: float
    diagonal: Optional[Tensor] = None
    tail: Optional[Tensor] = None

    @classmethod
    def from_fit(cls, model: str, eigenvalues: Tensor, trace: Tensor, dim: int,
                 rank_bound: int, diagonal: Optional[Tensor] = None) -> "Residual":
        """Build the model's quantities from a fit.

        Args:
            model: One of :data:`RESIDUALS`.
            eigenvalues: Kept eigenvalues ``lambda`` (descending), shape ``(r,)``.
            trace: Exact trace of ``H``.
            dim: Number of parameters ``D``.
            rank_bound: Upper bound on the rank of ``H`` (e.g. ``N (C - 1)``).
            diagonal: The residual diagonal (needed by ``"diagonal"``).

        Returns:
            The residual.

        Raises:
            ValueError: For ``"diagonal"`` without the residual diagonal.
        """
        check_residual(model)
        rank = eigenvalues.numel()
        mass = max(float(trace) - float(eigenvalues.sum()), 0.0)
        if model == "diagonal" and diagonal is None:
            raise ValueError(
                "residual='diagonal' needs the residual diagonal, which this fit did not "
                "keep: refit with residual='diagonal'."
            )
        tail = None
        if model == "spectral":
            count = min(max(int(rank_bound), rank), dim) - rank
            if count == 0 and mass > 0:  # a bound that cannot hold the mass: spread it
                count = dim - rank
            anchor = float(eigenvalues[-1]) if rank else 0.0
            tail = power_law_tail(anchor, mass, max(rank, 1), count)
        return cls(model, dim, mass, diagonal if model == "diagonal" else None, tail)

    def precision(self, eigenvectors: Tensor, eigenvalues: Tensor, scale: Tensor,
                  prior: Tensor) -> LowRankPrecision:
        r"""The posterior precision with this residual.

        Args:
            eigenvectors: Kept ``U``, shape ``(D, r)``.
            eigenvalues: Kept ``lambda``, shape ``(r,)``.
            scale: ``h = 1 / sigma^2 / T`` (laplace-torch's ``_H_factor``); may carry
                gradients.
            prior: Prior precision ``d``: a scalar tensor or shape ``(D,)``; may carry
                gradients.

        Returns:
            The :class:`~lowrank_laplace.posterior.LowRankPrecision`.
        """
        ell = scale * eigenvalues
        dim, rank = self.dim, eigenvalues.numel()
        if self.model == "none" or dim == rank:
            return LowRankPrecision(eigenvectors, ell, prior)
        if self.model == "diagonal":
            diag = self.diagonal.to(ell.dtype)
            return LowRankPrecision(eigenvectors, ell, prior + scale * diag)
        num = dim - rank
        if self.model == "isotropic":
            rho = scale * self.mass / num
            offset = None
        else:
            delta = prior if prior.numel() == 1 else prior.mean()
            tail = scale * self.tail.to(device=ell.device, dtype=ell.dtype)
            zeros = num - tail.numel()
            # 1 / mean(1 / (t + delta)) - delta = delta m / (1 - m), m = mean(t / (t + delta))
            frac = (tail / (tail + delta)).sum() / num
            rho = delta * frac / (1 - frac)
            tail_logdet = torch.log(tail + delta).sum() + zeros * torch.log(delta)
            offset = tail_logdet - num * torch.log(rho + delta)
        return LowRankPrecision(eigenvectors, (ell - rho).clamp(min=0), prior + rho,
                                logdet_offset=offset)
