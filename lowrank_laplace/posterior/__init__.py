"""The Laplace posterior on a low-rank GGN (no laplace-torch inside).

The precision (Woodbury, log det, samples), residual models of the dropped curvature and
the GLM predictive.
"""

from lowrank_laplace.posterior.precision import GramCache, LowRankPrecision
from lowrank_laplace.posterior.residual import (
    DEFAULT_RESIDUAL,
    RESIDUALS,
    DroppedCurvature,
    Residual,
    residual_class,
)

__all__ = ["DEFAULT_RESIDUAL", "DroppedCurvature", "GramCache", "LowRankPrecision", "RESIDUALS",
           "Residual", "residual_class"]
