"""Scalar-prior marglik tuning on the closed-form gradient equals laplace-torch's loop."""

import math
import warnings

import pytest
import torch
from laplace import Laplace
from laplace.baselaplace import ParametricLaplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lowrank_laplace  # noqa: F401  (registers hessian_structure="lowrank_ggn")
from lowrank_laplace.laplace_torch import tuning


def _fit(likelihood, residual, dtype=torch.float64, rank=10, subset="all", **kw):
    torch.manual_seed(0)
    X = torch.randn(120, 5, dtype=dtype)
    out = 3 if likelihood == "classification" else 2
    y = torch.randint(0, 3, (120,)) if likelihood == "classification" \
        else torch.randn(120, 2, dtype=dtype)
    model = nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, out)).to(dtype)
    if likelihood == "regression":
        kw.setdefault("sigma_noise", 0.7)
    la = Laplace(model, likelihood, subset, "lowrank_ggn", rank=rank, residual=residual,
                 prior_mean=0.05, temperature=0.8, **kw)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=32))
    return la


def _loop(la, **kw):
    """laplace-torch's own Adam loop through autograd, on our log marginal likelihood."""
    ParametricLaplace.optimize_prior_precision(la, method="marglik", **kw)
    return la.prior_precision.clone()


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("residual", ["spectral", "isotropic", "none"])
def test_scalar_tuning_equals_laplace_torch_loop(likelihood, residual):
    la = _fit(likelihood, residual)
    tune = dict(n_steps=60, lr=0.2, init_prior_prec=0.5)
    assert tuning.scalar_marglik_call(la, (), dict(method="marglik", **tune)) is not None
    la.optimize_prior_precision(method="marglik", **tune)
    fast = la.prior_precision.clone()
    assert fast.shape == (1,) and fast.dtype == torch.float64
    torch.testing.assert_close(fast, _loop(la, **tune), rtol=1e-10, atol=0)


def test_scalar_tuning_of_last_layer_posterior_equals_laplace_torch_loop():
    la = _fit("classification", "spectral", rank=5, subset="last_layer")
    la.optimize_prior_precision(method="marglik")
    torch.testing.assert_close(la.prior_precision.clone(), _loop(la), rtol=1e-10, atol=0)


def test_scalar_tuning_keeps_a_stationary_point_of_the_marginal_likelihood():
    la = _fit("classification", "spectral")
    la.optimize_prior_precision(method="marglik", n_steps=500, lr=0.1)
    log_prior = la.prior_precision.log().clone().requires_grad_(True)
    la.log_marginal_likelihood(prior_precision=log_prior.exp()).backward()
    assert abs(float(log_prior.grad)) < 1e-3


def test_scalar_tuning_float32_is_laplace_torch_loop_within_rounding():
    la = _fit("classification", "spectral", dtype=torch.float32)
    la.optimize_prior_precision(method="marglik")
    fast = la.prior_precision.clone()
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast, _loop(la), rtol=1e-4, atol=0)


def test_scalar_tuning_keeps_laplace_torch_warnings_and_verbose_output(capsys):
    la = _fit("classification", "spectral")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        la.optimize_prior_precision(method="marglik", n_steps=5, verbose=True,
                                    val_loader=[])
    messages = " ".join(str(w.message) for w in caught)
    assert "link_approx" in messages and "val_loader" in messages
    assert "Optimized prior precision is" in capsys.readouterr().out


@pytest.mark.parametrize("call", [
    dict(method="marglik", prior_structure="layerwise"),
    dict(method="marglik", prior_structure="diag"),
    dict(method="marglik", init_prior_prec=torch.ones(4, dtype=torch.float64)),
    dict(method="gridsearch"),
])
def test_other_calls_keep_laplace_torch_method(call):
    la = _fit("classification", "spectral")
    assert tuning.scalar_marglik_call(la, (), call) is None


def test_layerwise_and_diagonal_residual_tune_through_laplace_torch_loop():
    la = _fit("classification", "spectral")
    la.optimize_prior_precision(method="marglik", n_steps=10, prior_structure="layerwise")
    assert la.prior_precision.shape == (4,)
    la = _fit("classification", "diagonal")
    assert tuning.scalar_marglik_call(la, (), dict(method="marglik")) is None
    la.optimize_prior_precision(method="marglik", n_steps=10)
    assert la.prior_precision.shape == (1,)


def test_unfitted_posterior_raises_laplace_torch_error():
    model = nn.Linear(3, 2)
    la = Laplace(model, "classification", "all", "lowrank_ggn")
    with pytest.raises(AttributeError, match="fit"):
        la.optimize_prior_precision(method="marglik", n_steps=2)


@pytest.mark.parametrize("residual", ["spectral", "isotropic", "none"])
@pytest.mark.parametrize("rank", [10, 1000])
def test_curvature_spectrum_gives_the_posterior_log_determinant(residual, rank):
    """``sum_j c_j log(a_j + delta) + (D - sum_j c_j) log delta`` is ``log det P``."""
    la = _fit("regression", residual, rank=rank)
    values, counts = la.residual_model.curvature_spectrum(la.H[1], float(la._H_factor))
    for delta in (1e-3, 0.5, 30.0):
        la.prior_precision = delta
        expected = float(la.log_det_posterior_precision)
        got = float((counts * torch.log(values + delta)).sum()
                    + (la.n_params - counts.sum()) * math.log(delta))
        assert got == pytest.approx(expected, rel=1e-10, abs=1e-8)
    assert la.residual_model.curvature_spectrum(la.H[1], 1.0) is not None


def test_the_layer_split_is_built_only_for_a_layerwise_prior():
    """A scalar prior's tuning and queries never need the dropped curvature's split over
    layers."""
    la = _fit("classification", "spectral")
    la.optimize_prior_precision(method="marglik", n_steps=5)
    float(la.log_det_posterior_precision)
    residual = la.residual_model
    assert residual._split is not None and residual._layers is None
    la.prior_precision = torch.ones(4, dtype=torch.float64)
    float(la.log_det_posterior_precision)
    assert residual._split is None and residual.layers is not None
    assert len(residual.layers.sizes) == 4


@pytest.mark.parametrize("rank", [2, 30])
def test_a_constant_layerwise_or_diagonal_prior_is_the_scalar_posterior(rank):
    """The dropped curvature's estimate depends on the prior's value, not its shape, where
    the rank keeps little (2) or most (30) of the GGN."""
    la = _fit("classification", "spectral", rank=rank)
    assert la.fit_report.quadrature_steps > 0, la.fit_report
    X = torch.randn(16, 5, dtype=torch.float64)
    results = []
    for prior in (torch.tensor(0.7), torch.full((4,), 0.7), torch.full((la.n_params,), 0.7)):
        la.prior_precision = prior.double()
        _, f_var = la._glm_predictive_distribution(X)
        results.append((la.log_marginal_likelihood().detach(), f_var))
    for logml, f_var in results[1:]:
        torch.testing.assert_close(logml, results[0][0], rtol=1e-8, atol=0)
        torch.testing.assert_close(f_var, results[0][1], rtol=1e-6, atol=1e-12)


def test_a_layerwise_prior_moves_each_layer_by_its_own_tail():
    """Layers whose prior differs from the mean see their own share's change."""
    la = _fit("classification", "spectral", rank=10)
    la.prior_precision = torch.tensor([0.7, 0.7, 0.7, 0.7], dtype=torch.float64)
    constant = la._precision().d.clone()
    la.prior_precision = torch.tensor([0.2, 0.7, 3.0, 0.7], dtype=torch.float64)
    moved = la._precision().d
    assert not torch.allclose(moved - la.prior_precision_diag, constant - 0.7)
    assert bool((moved >= la.prior_precision_diag).all())
