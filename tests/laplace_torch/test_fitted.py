"""``fit_lowrank_ggn``: the same posterior as ``Laplace(...).fit``, without its classes."""

import pytest
import torch
from laplace import Laplace

import lowrank_laplace
from lowrank_laplace.laplace_torch.options import LowRankOptions
from tests.posterior.test_quadrature import _problem


@pytest.mark.parametrize("likelihood, sigma", [("classification", 1.0), ("regression", 0.7)])
@pytest.mark.parametrize("low_memory", [False, True])
def test_fit_lowrank_ggn_is_the_laplace_fit(likelihood, sigma, low_memory):
    """Eigenpairs, measured dropped curvature and so the precision: the fit ``la`` holds
    (a low-memory fit keeps no factors and measures nothing)."""
    model, X, _, loader = _problem(likelihood)
    before = [p.detach().clone() for p in model.parameters()]
    kwargs = {"rank": 6, "low_memory": low_memory, "residual": "spectral"}
    fitted = lowrank_laplace.fit_lowrank_ggn(model, likelihood, loader,
                                             LowRankOptions(**kwargs), prior_precision=2.0,
                                             sigma_noise=sigma)
    la = Laplace(model, likelihood, subset_of_weights="all", hessian_structure="lowrank_ggn",
                 prior_precision=2.0, sigma_noise=sigma, **kwargs)
    la.fit(loader)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # (the same numbers to the rounding of the thread count each call takes)
    assert str(fitted.report) == str(la.fit_report)
    assert (fitted.quadrature is None) == (la._quadrature is None)
    torch.testing.assert_close(fitted.result.eigenvalues, la.H[1])
    ours, theirs = fitted.precision(2.0, sigma), la._precision()
    torch.testing.assert_close(ours.logdet(), theirs.logdet())
    J = torch.randn(5, la.n_params, dtype=torch.float64)
    torch.testing.assert_close(ours.jacobian_variance(J[:, None]),
                               theirs.jacobian_variance(J[:, None]))


def test_the_defaults_and_a_layerwise_prior():
    model, X, _, loader = _problem("classification")
    fitted = lowrank_laplace.fit_lowrank_ggn(model, "classification", loader)
    assert fitted.options == LowRankOptions()  # rank 100: every nonzero eigenvalue kept
    assert fitted.report.kept_fraction == pytest.approx(1.0) and fitted.report.rank <= 83
    layers = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    assert fitted.precision(layers.repeat_interleave(
        torch.tensor(fitted.layer_sizes))).dim == fitted.result.mean.numel()
