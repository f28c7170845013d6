"""Calibration and uncertainty metrics, on torchmetrics where it has them.

Classification metrics take predictive probabilities ``probs`` ``(N, C)`` and class
indices ``targets`` ``(N,)``; regression metrics take a predictive mean and variance
``(N, 1)`` (or ``(N,)``) and targets of the same shape. Logarithms are natural.
"""

from __future__ import annotations

import math
from typing import Dict, Sequence

import torch
from torch import Tensor
from torchmetrics.functional import mean_squared_error
from torchmetrics.functional.classification import (
    binary_auroc,
    multiclass_accuracy,
    multiclass_calibration_error,
)

_EPS = 1e-12


def accuracy(probs: Tensor, targets: Tensor) -> float:
    """Return the fraction of correct top-1 predictions.

    Args:
        probs: Predictive probabilities.
        targets: Class indices.
    """
    return float(multiclass_accuracy(probs, targets, num_classes=probs.shape[1], average="micro"))


def nll(probs: Tensor, targets: Tensor) -> float:
    """Return the mean negative log predictive probability of the true class.

    Args:
        probs: Predictive probabilities.
        targets: Class indices.
    """
    picked = probs.gather(1, targets[:, None]).squeeze(1)
    return float(-torch.log(picked.clamp_min(_EPS)).mean())


def ece(probs: Tensor, targets: Tensor, n_bins: int = 15) -> float:
    """Return the ECE: the confidence-accuracy gaps of equal-width bins, weighted by size.

    Args:
        probs: Predictive probabilities.
        targets: Class indices.
        n_bins: Number of bins.
    """
    return float(multiclass_calibration_error(probs, targets, num_classes=probs.shape[1],
                                              n_bins=n_bins, norm="l1"))


def mce(probs: Tensor, targets: Tensor, n_bins: int = 15) -> float:
    """Return the MCE: the largest gap of the bins of :func:`ece`.

    Args:
        probs: Predictive probabilities.
        targets: Class indices.
        n_bins: Number of bins.
    """
    return float(multiclass_calibration_error(probs, targets, num_classes=probs.shape[1],
                                              n_bins=n_bins, norm="max"))


def brier(probs: Tensor, targets: Tensor) -> float:
    """Return the Brier score ``sum_c (p_c - 1[c = y])^2``, in ``[0, 2]``, averaged over samples.

    Args:
        probs: Predictive probabilities.
        targets: Class indices.
    """
    onehot = torch.nn.functional.one_hot(targets, probs.shape[1]).to(probs.dtype)
    return float(((probs - onehot) ** 2).sum(1).mean())


def confidence(probs: Tensor) -> float:
    """Return the mean top-1 predictive probability.

    Args:
        probs: Predictive probabilities.
    """
    return float(probs.max(1).values.mean())


def entropy(probs: Tensor) -> Tensor:
    """Return the predictive entropy of every sample, ``(N,)``.

    Args:
        probs: Predictive probabilities.
    """
    return -(probs * torch.log(probs.clamp_min(_EPS))).sum(1)


def ood_auroc(probs_in: Tensor, probs_out: Tensor, score: str = "entropy") -> float:
    """Return the AUROC (0.5 is chance) of telling OOD inputs from in-distribution ones.

    Args:
        probs_in: Predictive probabilities on in-distribution data, ``(N, C)``.
        probs_out: Predictive probabilities on OOD data, ``(M, C)``.
        score: ``'entropy'`` or ``'max_prob'`` (one minus the top-1 probability); higher
            means "more likely OOD".

    Raises:
        ValueError: For an unknown score.
    """
    scores = {"entropy": entropy, "max_prob": lambda p: 1 - p.max(1).values}
    if score not in scores:
        raise ValueError(f"score must be 'entropy' or 'max_prob', got {score!r}.")
    s_in, s_out = scores[score](probs_in), scores[score](probs_out)
    labels = torch.cat([torch.zeros_like(s_in), torch.ones_like(s_out)]).long()
    return float(binary_auroc(torch.cat([s_in, s_out]), labels))


def classification_metrics(probs: Tensor, targets: Tensor) -> Dict[str, float]:
    """Return ``{"accuracy", "nll", "ece", "mce", "brier", "confidence"}`` of the reports.

    Args:
        probs: Predictive probabilities.
        targets: Class indices.
    """
    probs, targets = probs.detach().float().cpu(), targets.cpu()
    return {"accuracy": accuracy(probs, targets), "nll": nll(probs, targets),
            "ece": ece(probs, targets), "mce": mce(probs, targets),
            "brier": brier(probs, targets), "confidence": confidence(probs)}


def gaussian_nll(mean: Tensor, var: Tensor, targets: Tensor) -> float:
    """Return the mean Gaussian NLL of the targets under ``N(mean, var)``, constant included.

    Args:
        mean: Predictive means.
        var: Predictive variances (observation noise included).
        targets: Targets.
    """
    return float(torch.nn.functional.gaussian_nll_loss(mean, targets, var, full=True))


def rmse(mean: Tensor, targets: Tensor) -> float:
    """Return the root mean squared error.

    Args:
        mean: Predictive means.
        targets: Targets.
    """
    return float(mean_squared_error(mean, targets, squared=False))


def interval_coverage(mean: Tensor, var: Tensor, targets: Tensor,
                      levels: Sequence[float] = (0.5, 0.8, 0.9, 0.95)) -> Dict[float, float]:
    """Return ``{level: share of targets in the central interval of that mass}`` (ideal: level).

    Args:
        mean: Predictive means.
        var: Predictive variances.
        targets: Targets.
        levels: Interval probability masses in ``(0, 1)``.
    """
    z = ((targets - mean).abs() / var.sqrt()).flatten()
    return {level: float((z <= math.sqrt(2) * float(torch.special.erfinv(torch.tensor(level))))
                         .float().mean()) for level in levels}


def regression_metrics(mean: Tensor, var: Tensor, targets: Tensor) -> Dict[str, float]:
    """Return ``{"nll", "rmse", "interval_calibration_error"}`` of a Gaussian predictive.

    The last is the mean absolute gap between coverage and level over the levels of
    :func:`interval_coverage`.

    Args:
        mean: Predictive means.
        var: Predictive variances (observation noise included).
        targets: Targets.
    """
    coverage = interval_coverage(mean, var, targets)
    gap = sum(abs(c - level) for level, c in coverage.items()) / len(coverage)
    return {"nll": gaussian_nll(mean, var, targets), "rmse": rmse(mean, targets),
            "interval_calibration_error": gap}
