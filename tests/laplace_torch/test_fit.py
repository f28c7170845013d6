"""fit_lowrank_ggn on its own (no laplace-torch object) against the dense GGN."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowrank_laplace.laplace_torch.fit import FitResult, fit_lowrank_ggn
from lowrank_laplace.laplace_torch.options import LowRankOptions
from tests import reference as ref

TOL = dict(rtol=1e-7, atol=1e-9)


def _problem(likelihood, n=20, out=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, out)).double()
    X = torch.randn(n, 4, dtype=torch.float64)
    y = torch.randint(0, out, (n,)) if likelihood == "classification" else \
        torch.randn(n, out, dtype=torch.float64)
    return model, X, y, DataLoader(TensorDataset(X, y), batch_size=6)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("dense_max_dim, path", [(0, "streaming"), (2048, "dense")])
def test_full_rank_fit_is_laplace_torchs_ggn(likelihood, dense_max_dim, path):
    model, X, y, loader = _problem(likelihood)
    before = [p.detach().clone() for p in model.parameters()]
    options = LowRankOptions(rank=1000, dense_max_dim=dense_max_dim, residual="diagonal")
    result = fit_lowrank_ggn(model, likelihood, loader, options)
    assert isinstance(result, FitResult) and result.fit_path == path
    # laplace-torch's GGN: cross-entropy summed, or 1/2 the summed squared error's
    loss_func, factor = (nn.CrossEntropyLoss(reduction="sum"), 1.0) \
        if likelihood == "classification" else (nn.MSELoss(reduction="sum"), 0.5)
    G = factor * ref.ggn(model, loss_func, X, y)
    U, lam = result.eigenvectors, result.eigenvalues
    torch.testing.assert_close(U @ torch.diag(lam) @ U.T, G, **TOL)
    torch.testing.assert_close(result.trace, G.trace(), **TOL)
    torch.testing.assert_close(result.residual_diagonal, torch.zeros_like(G.diagonal()),
                               rtol=0, atol=1e-9)
    with torch.no_grad():
        torch.testing.assert_close(result.loss, factor * loss_func(model(X), y), **TOL)
    assert result.n_data == len(X) and result.n_outputs == 3
    assert result.factor_backend == "backpack" and 0 <= result.jacobian_exponent <= 1
    torch.testing.assert_close(result.mean, torch.cat([p.flatten() for p in before]))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_previous_fit_is_merged_like_another_batch():
    model, X, y, loader = _problem("classification")
    half = len(X) // 2
    first, second = (DataLoader(TensorDataset(X[s], y[s]), batch_size=6)
                     for s in (slice(0, half), slice(half, None)))
    options = LowRankOptions(rank=1000, dense_max_dim=0)
    both = fit_lowrank_ggn(model, "classification", second, options,
                           previous=fit_lowrank_ggn(model, "classification", first, options))
    whole = fit_lowrank_ggn(model, "classification", loader, options)
    torch.testing.assert_close(both.eigenvectors @ torch.diag(both.eigenvalues)
                               @ both.eigenvectors.T,
                               whole.eigenvectors @ torch.diag(whole.eigenvalues)
                               @ whole.eigenvectors.T, **TOL)
    assert both.n_data == whole.n_data and torch.allclose(both.loss, whole.loss)


def test_bad_loaders_and_targets_fail_before_any_pass():
    model, X, y, loader = _problem("classification")
    options = LowRankOptions()
    with pytest.raises(ValueError, match="needs a .dataset"):
        fit_lowrank_ggn(model, "classification", [(X, y)], options)
    with pytest.raises(ValueError, match="train_loader is empty"):
        fit_lowrank_ggn(model, "classification", DataLoader(TensorDataset(X[:0], y[:0])),
                        options)
    with pytest.raises(ValueError, match="integer class targets"):
        fit_lowrank_ggn(model, "classification",
                        DataLoader(TensorDataset(X, y.double()), batch_size=5), options)
