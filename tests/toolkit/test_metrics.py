"""Metrics against independent formulas on hand-made inputs."""

import math

import pytest
import torch

from lowrank_laplace.toolkit import metrics

PROBS = torch.tensor([[0.9, 0.05, 0.05], [0.2, 0.7, 0.1], [0.4, 0.35, 0.25], [0.1, 0.1, 0.8]])
TARGETS = torch.tensor([0, 2, 0, 2])


def test_accuracy_nll_brier_confidence():
    assert metrics.accuracy(PROBS, TARGETS) == pytest.approx(3 / 4)
    expected_nll = -(math.log(0.9) + math.log(0.1) + math.log(0.4) + math.log(0.8)) / 4
    assert metrics.nll(PROBS, TARGETS) == pytest.approx(expected_nll, rel=1e-6)
    brier = ((0.1**2 + 0.05**2 + 0.05**2) + (0.2**2 + 0.7**2 + 0.9**2)
             + (0.6**2 + 0.35**2 + 0.25**2) + (0.1**2 + 0.1**2 + 0.2**2)) / 4
    assert metrics.brier(PROBS, TARGETS) == pytest.approx(brier, rel=1e-6)
    assert metrics.confidence(PROBS) == pytest.approx((0.9 + 0.7 + 0.4 + 0.8) / 4)


def test_ece_and_mce_by_hand():
    # 2 bins: confidences 0.9, 0.7 (correct: no), 0.4, 0.8 -> bins [0, .5) and [.5, 1]
    # bin 1: {0.4 correct} -> |1 - 0.4| = 0.6, weight 1/4
    # bin 2: {0.9 correct, 0.7 wrong, 0.8 correct} -> |2/3 - 0.8| = 0.1333, weight 3/4
    ece = 0.25 * 0.6 + 0.75 * abs(2 / 3 - 0.8)
    assert metrics.ece(PROBS, TARGETS, n_bins=2) == pytest.approx(ece, rel=1e-5)
    assert metrics.mce(PROBS, TARGETS, n_bins=2) == pytest.approx(0.6, rel=1e-5)


def test_entropy_and_ood_auroc():
    uniform = torch.full((2, 3), 1 / 3)
    torch.testing.assert_close(metrics.entropy(uniform), torch.full((2,), math.log(3)))
    confident = torch.tensor([[0.98, 0.01, 0.01], [0.01, 0.98, 0.01]])
    assert metrics.ood_auroc(confident, uniform) == pytest.approx(1.0)
    assert metrics.ood_auroc(uniform, confident) == pytest.approx(0.0)
    assert metrics.ood_auroc(confident, uniform, score="max_prob") == pytest.approx(1.0)
    # one OOD score ties between the in-distribution ones: AUROC = 3/4 by pair counting
    p_in = torch.tensor([[0.9, 0.05, 0.05], [0.5, 0.3, 0.2]])
    p_out = torch.tensor([[0.6, 0.2, 0.2], [0.34, 0.33, 0.33]])
    s_in, s_out = 1 - p_in.max(1).values, 1 - p_out.max(1).values
    pairs = [(o > i).float() + 0.5 * (o == i).float() for o in s_out for i in s_in]
    assert metrics.ood_auroc(p_in, p_out, score="max_prob") == pytest.approx(
        float(sum(pairs) / len(pairs)))
    with pytest.raises(ValueError, match="score must be"):
        metrics.ood_auroc(p_in, p_out, score="margin")


def test_classification_metrics_keys():
    m = metrics.classification_metrics(PROBS, TARGETS)
    assert set(m) == {"accuracy", "nll", "ece", "mce", "brier", "confidence"}


def test_regression_metrics():
    mean = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    var = torch.tensor([[1.0], [4.0], [1.0], [0.25]])
    y = torch.tensor([[0.5], [1.0], [4.0], [3.0]])
    nll = sum(0.5 * math.log(2 * math.pi * v) + 0.5 * (t - m) ** 2 / v
              for m, v, t in zip(mean.flatten().tolist(), var.flatten().tolist(),
                                 y.flatten().tolist())) / 4
    assert metrics.gaussian_nll(mean, var, y) == pytest.approx(nll, rel=1e-6)
    assert metrics.rmse(mean, y) == pytest.approx(math.sqrt((0.25 + 0 + 4 + 0) / 4))
    # z-scores 0.5, 0, 2, 0: inside the 50% interval (|z| <= 0.674): 3 of 4
    cov = metrics.interval_coverage(mean, var, y, levels=(0.5, 0.99))
    assert cov[0.5] == pytest.approx(0.75) and cov[0.99] == pytest.approx(1.0)
    reg = metrics.regression_metrics(mean, var, y)
    assert set(reg) == {"nll", "rmse", "interval_calibration_error"}
