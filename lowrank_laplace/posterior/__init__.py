"""The Laplace posterior on a low-rank GGN: precision, residual models, GLM predictive.

No laplace-torch inside: :mod:`~lowrank_laplace.posterior.precision` (Woodbury, log
det, samples), :mod:`~lowrank_laplace.posterior.residual` (the curvature the rank
drops) and :mod:`~lowrank_laplace.posterior.predictive` (GLM moments from the engine).
"""

from lowrank_laplace.posterior.precision import GramCache, LowRankPrecision
from lowrank_laplace.posterior.residual import (
    DEFAULT_RESIDUAL,
    RESIDUALS,
    DroppedCurvature,
    Residual,
    residual_class,
)

__all__ = [
    "DEFAULT_RESIDUAL",
    "DroppedCurvature",
    "GramCache",
    "LowRankPrecision",
    "RESIDUALS",
    "Residual",
    "residual_class",
]
