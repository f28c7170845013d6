"""The softmax head's logit-shift directions: found, checked, and exact null directions."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowrank_laplace import LowRankGGNLaplace
from lowrank_laplace.posterior.null import NullDirections, head_directions
from tests.reference import ggn


def _data(n=48, d=5, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=g)
    return X, y, DataLoader(TensorDataset(X, y), batch_size=16)


def _mlp(head_bias=True, tail=()):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4, bias=head_bias),
                         *tail).double()


def _dense(null: NullDirections, dim: int) -> torch.Tensor:
    return null.expand(torch.eye(null.count, dtype=torch.float64), dim).T


@pytest.mark.parametrize("head_bias", [True, False])
def test_directions_are_orthonormal_null_directions_of_the_ggn(head_bias):
    model = _mlp(head_bias)
    X, y, _ = _data()
    params = list(model.parameters())
    null = head_directions(model, params, "classification", 4)
    assert null.count == 6 + head_bias
    D = sum(p.numel() for p in params)
    N = _dense(null, D)
    torch.testing.assert_close(N.T @ N, torch.eye(null.count, dtype=torch.float64))
    G = ggn(model, nn.CrossEntropyLoss(reduction="sum"), X, y)
    assert float((G @ N).abs().max()) < 1e-10 * float(G.abs().max())
    x = torch.randn(3, D, dtype=torch.float64)
    torch.testing.assert_close(null.project(x), x @ N)
    torch.testing.assert_close(null.column_means(torch.full((D,), 0.3, dtype=torch.float64)),
                               torch.full((null.count,), 0.3, dtype=torch.float64))
    assert null.column_means(torch.rand(D, dtype=torch.float64) + 1) is None


def test_no_candidate_for_regression_or_a_frozen_head():
    model = _mlp()
    params = list(model.parameters())
    assert head_directions(model, params, "regression", 4) is None
    assert head_directions(model, params[:2], "classification", 4) is None


@pytest.mark.parametrize("tail,found", [((), True), ((nn.Tanh(),), False)])
def test_the_probe_keeps_only_directions_that_move_every_output_alike(tail, found):
    """A linear layer with C outputs followed by a nonlinearity is not the head."""
    model = _mlp(tail=tail)
    X, _, loader = _data()
    la = LowRankGGNLaplace(model, "classification", rank=5)
    la.fit(loader)
    assert la.fit_report.null_directions == (7 if found else 0)
    assert ("logit-shift" in str(la.fit_report)) == found
    # a found direction keeps the prior's variance in the posterior
    D = la.n_params
    N = _dense(head_directions(model, list(model.parameters()), "classification", 4), D)
    variance = (N * la._precision().solve(N)).sum(0)
    prior = 1 / float(la.prior_precision)
    if found:
        torch.testing.assert_close(variance, torch.full_like(variance, prior))
    else:
        assert float(variance.max()) < prior


def test_posterior_precision_is_the_inverse_of_the_covariance_with_the_directions():
    model = _mlp()
    _, _, loader = _data()
    la = LowRankGGNLaplace(model, "classification", rank=5)
    la.fit(loader)
    (U, ell), d = la.posterior_precision
    assert U.shape[1] == 5 + 7 and (ell[5:] < 0).all()
    P = U @ torch.diag(ell) @ U.T + torch.diag(d)
    torch.testing.assert_close(torch.linalg.inv(P), la.posterior_covariance, rtol=1e-6,
                               atol=1e-9)
