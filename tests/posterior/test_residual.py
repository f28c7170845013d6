"""Residual models of the truncated curvature against dense float64 references."""

import copy
import functools
import math

import numpy as np
import pytest
import torch
from laplace import FullLaplace
from scipy.optimize import brentq
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowrank_laplace import LowRankGGNLaplace
from lowrank_laplace.posterior import probe
from lowrank_laplace.posterior.layer_tail import power_law_tail
from lowrank_laplace.posterior.probe import jacobian_exponent
from lowrank_laplace.posterior.residual import DiagonalResidual, DroppedCurvature
from tests.conftest import set_tuning
from tests.laplace_torch.test_laplace import fit_reference, make_problem

TOL = dict(rtol=1e-6, atol=1e-9)


def reference_tail(anchor, mass, start, count, stride=1.0):
    """The power-law tail by a scalar root finder (independent of the bisection)."""
    i = (start + stride * torch.arange(1, count + 1, dtype=torch.float64)) / start
    alpha = brentq(lambda a: float((anchor * i ** (-a)).sum()) - mass, 0.0, 200.0, xtol=1e-14)
    return anchor * i ** (-alpha)


def test_power_law_tail():
    tail = power_law_tail(2.0, 5.0, 10, 300)
    torch.testing.assert_close(tail, reference_tail(2.0, 5.0, 10, 300), rtol=1e-8, atol=0)
    assert float(tail.sum()) == pytest.approx(5.0, rel=1e-10)
    assert (tail[1:] <= tail[:-1]).all() and tail[0] < 2.0
    # a mass the flat continuation cannot reach is spread evenly; nothing to spread: zeros
    torch.testing.assert_close(power_law_tail(1.0, 50.0, 3, 10), torch.full((10,), 5.0,
                                                                             dtype=torch.float64))
    assert power_law_tail(1.0, 0.0, 3, 4).abs().max() == 0
    assert power_law_tail(1.0, 1.0, 3, 0).numel() == 0


def _fit(residual, prior_kind="scalar", name="mlp-classification", rank=6, n=40, **tuning):
    """A fitted posterior (oversampled merges: near-exact eigenpairs) and FullLaplace.

    ``tuning``: the probe's constants for this fit (``probe_size``, ...).
    """
    model, likelihood, X, y, loader = make_problem(name, n=n, batch_size=16)
    full = fit_reference(FullLaplace(model, likelihood), loader)
    with pytest.MonkeyPatch.context() as patch:
        set_tuning(patch, oversampling=30 / rank, **tuning)
        la = LowRankGGNLaplace(model, likelihood, rank=rank, residual=residual)
        la.fit(loader)
    if prior_kind == "scalar":
        prior = torch.tensor(0.7, dtype=torch.float64)
    elif prior_kind == "layer":
        prior = torch.rand(len(list(model.parameters())), dtype=torch.float64) + 0.3
    else:
        prior = torch.rand(la.n_params, dtype=torch.float64) + 0.3
    la.prior_precision = prior
    full.prior_precision = prior
    return la, full, X


def reference_exponent(la, full, X):
    """``beta``: slope of log Jacobian energy on log eigenvalue over the kept pairs."""
    U, lam = la.H
    Js, _ = full.backend.jacobians(X[: la.options.probe_inputs])
    energy = ((Js @ U) ** 2).sum((0, 1))
    x, y = lam.log().numpy(), energy.log().numpy()
    return min(max(float(np.polyfit(x, y, 1)[0]), 0.0), 1.0)


def reference_null_basis(la, full):
    """The logit-shift directions of the final linear layer, ``(D, H + 1)`` (``None``:
    the posterior does not know them: regression, or no measured complement)."""
    if la.likelihood != "classification" or la.measured_complement is None:
        assert la.fit_report.null_directions == 0
        return None
    params = list(full.model.parameters())
    head = [m for m in full.model.modules() if isinstance(m, nn.Linear)][-1]
    offsets = dict(zip(map(id, params), np.cumsum([0] + [p.numel() for p in params])))
    C, H = head.weight.shape
    columns = []
    for k in range(H + 1):
        v = torch.zeros(la.n_params, dtype=torch.float64)
        if k < H:
            block = torch.zeros(C, H, dtype=torch.float64)
            block[:, k] = C**-0.5
            start = offsets[id(head.weight)]
            v[start:start + C * H] = block.flatten()
        else:
            start = offsets[id(head.bias)]
            v[start:start + C] = C**-0.5
        columns.append(v)
    assert la.fit_report.null_directions == H + 1
    return torch.stack(columns, 1)


def with_null_prior(P, null, d):
    """The covariance ``P^{-1}`` with the prior's variance on the null directions, where
    the precision's diagonal is constant on each (their eigenvectors)."""
    cov = torch.linalg.inv(P)
    if null is None:
        return cov
    prior_j = (null**2 * d[:, None]).sum(0)
    rows = null != 0
    if any(d[rows[:, j]].unique().numel() > 1 for j in range(null.shape[1])):
        return cov  # a prior per parameter: the posterior keeps P
    held_j = (null * (P @ null)).sum(0)  # P n_j = held_j n_j
    return cov + null @ torch.diag(1 / prior_j - 1 / held_j) @ null.T


def reference_measured_variance(la, full, X, h, delta, tail, beta, null=None):
    """The complement variance measured on the probe, from dense Jacobians.

    A probe of all ``N`` inputs: the exact complement GGN and the probe's Jacobian
    energy on its eigenvectors. A smaller one: each half's energy on the complement GGN
    of the other half (scaled by ``N / n``), and the same with the halves' first halves,
    extrapolated to ``n = N``. Resolved eigenvectors have eigenvalues from ``1e-6`` of
    the probe's GGN trace (the floor). Energy outside them is curved by the floor on
    the whole data; on a sub-sample, where the halves resolve ``k`` directions each (on
    average), it lies in the ``D - r - k`` unresolved ones: the share the modelled
    ``tail`` (GGN scale) has beyond its first ``k`` with variances weighted by
    ``tail^beta``, the rest curved by the floor. The result clamped. Known ``null``
    directions lie outside the complement measured.
    """
    U, lam = la.H
    D = U.shape[0]
    known = 0 if null is None else null.shape[1]
    N, m = len(X), min(la.options.probe_inputs, len(X))
    Js, f = full.backend.jacobians(X[:m])  # (m, C, D)
    if la.likelihood == "classification":
        p = f.softmax(-1)
        hess = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    else:
        hess = torch.eye(f.shape[-1], dtype=f.dtype).expand(m, -1, -1)
    P = torch.eye(D, dtype=torch.float64) - U @ U.T
    if null is not None:
        P = P - null @ null.T
    rows = Js.reshape(-1, D) @ P
    energy = (rows ** 2).sum()
    ggn = [J.T @ H @ J for J, H in zip(Js, hess)]
    floor = 1e-6 * N / m * float(sum(G.trace() for G in ggn))

    def spectrum(inputs):
        mu, Q = torch.linalg.eigh(N / len(inputs) * P @ sum(ggn[i] for i in inputs) @ P)
        return mu[mu >= floor], Q[:, mu >= floor]

    def unresolved(k):
        flat = 1 / (h * floor + delta)
        beyond = tail[k:]
        if m >= N or len(beyond) == 0:
            return flat
        weights = (beyond / beyond.max()) ** beta
        curved = (weights / (h * beyond + delta)).sum() / weights.sum()
        share = len(beyond) / (D - len(lam) - known - k)
        return share * curved + (1 - share) * flat

    def variance(pairs, total):
        terms, seen, resolved = 0.0, 0.0, 0
        for ggn_inputs, energy_inputs in pairs:
            mu, Q = spectrum(ggn_inputs)
            q = ((rows.reshape(m, -1, D)[energy_inputs].reshape(-1, D) @ Q) ** 2).sum(0)
            terms, seen = terms + (q / (h * mu + delta)).sum(), seen + q.sum()
            resolved += len(mu)
        return (terms + (total - seen) * unresolved(resolved // len(pairs))) / total

    if m >= N:
        v = variance([(list(range(N)), list(range(N)))], energy)
    else:
        n = m // 2
        a, b = list(range(n)), list(range(n, 2 * n))
        total = (rows.reshape(m, -1, D)[: 2 * n] ** 2).sum()
        v = variance([(a, b), (b, a)], total)
        if n // 2 >= 16:
            half = variance([(a[: n // 2], b), (b[: n // 2], a)], total)
            v = v - (half - v) * (1 - n / N)
    return v.clamp(min=1 / (h * lam[-1] + delta), max=1 / delta)


def reference_posterior(la, full, X):
    """Dense ``(covariance, log det P)`` of the residual model, built from the definitions."""
    U, lam = la.H
    D, r = U.shape
    h = 1 / la.sigma_noise**2 / la.temperature
    d = full.prior_precision_diag
    mass = float(full.H.trace() - lam.sum())
    kept = h * U @ torch.diag(lam) @ U.T
    eye = torch.eye(D, dtype=torch.float64)
    if la.residual == "none":
        P = kept + torch.diag(d)
        return torch.linalg.inv(P), torch.logdet(P)
    if la.residual == "isotropic":
        P = kept + h * mass / (D - r) * (eye - U @ U.T) + torch.diag(d)
        return torch.linalg.inv(P), torch.logdet(P)
    # spectral: power-law tail over the rank bound, random directions in the complement,
    # their variances weighted by tail^beta (Jacobian energies against eigenvalues); the
    # logit-shift directions apart, at the prior
    null = reference_null_basis(la, full)
    count = min(la.rank_bound, D - (0 if null is None else null.shape[1])) - r
    rho, tail_logdet = reference_whole(la, full, X, (count, mass, null), d.mean())
    if d.unique().numel() > 1:  # a prior per layer or parameter: each layer's tail moves it
        P, logdet = reference_layer_posterior(la, full, (count, mass, kept), rho, tail_logdet)
        return with_null_prior(P, null, d), logdet
    P = kept - rho * U @ U.T + torch.diag(d + rho)  # = U(hl+d)U^T + (rho+d)(I-UU^T) if scalar
    logdet = torch.logdet(P) + tail_logdet - (D - r) * torch.log(rho + d.mean())
    return with_null_prior(P, null, d), logdet


def reference_whole(la, full, X, dropped, delta):
    """The network-wide shift ``rho`` and dropped log det at the scalar prior ``delta``."""
    (U, lam), (count, mass, null) = la.H, dropped
    D, r = U.shape
    h = 1 / la.sigma_noise**2 / la.temperature
    raw = reference_tail(float(lam[-1]), mass, r, count)
    tail = h * raw
    zeros = D - r - count
    beta = reference_exponent(la, full, X)
    # exact on these small probes; random output projections (larger ones) estimate it
    assert la.jacobian_exponent == pytest.approx(beta, abs=0.05)
    beta = la.jacobian_exponent
    if la.measured_complement is not None:
        v = reference_measured_variance(la, full, X, h, delta, raw, beta, null)
    elif beta > 0:
        v = (tail**beta / (tail + delta)).sum() / (tail**beta).sum()
    else:
        v = ((1 / (tail + delta)).sum() + zeros / delta) / (D - r)
    return 1 / v - delta, torch.log(tail + delta).sum() + zeros * torch.log(delta)


def reference_layer_posterior(la, full, dropped, rho, tail_logdet):
    """The spectral model under a prior that differs between layers.

    Each layer's shift is the network-wide ``rho`` at the prior's mean plus the change of
    its own tail's shift from that mean to its prior (clamped at zero), and the log det
    the network's plus each tail's change. Layer ``l``'s tail holds the exact share
    ``T_l`` of the dropped mass (its part of ``diag(H - U diag(lambda) U^T)``) and
    ``c_l = D_l - ||U_l||_F^2`` of the dropped directions; ``n_l = round(count c_l /
    (D - r))`` of them carry a power law anchored at ``lambda_r`` with stride
    ``count / n_l``, the rest none.
    """
    (U, lam), (count, mass, kept) = la.H, dropped
    D, r = U.shape
    h = 1 / la.sigma_noise**2 / la.temperature
    d = full.prior_precision_diag
    sizes = [p.numel() for p in full.model.parameters()]
    residual = (full.H - U @ torch.diag(lam) @ U.T).diagonal()
    shares = torch.stack([part.sum() for part in residual.split(sizes)])
    masses = shares / shares.sum() * mass
    norms = torch.stack([(part**2).sum(0) for part in U.split(sizes)])  # (L, r)
    complement = torch.tensor(sizes, dtype=torch.float64) - norms.sum(1)
    beta = la.jacobian_exponent
    top = h * float(lam[-1])  # weights are relative: any common scale cancels per layer

    def layer_tail(c, m, delta):
        n = max(1, round(count * float(c) / (D - r)))
        k = min(1.0, float(c) / n)  # directions per tail eigenvalue: n k + zeros = c_l
        tail = h * reference_tail(float(lam[-1]), float(m) / k, r, n, max(count / n, 1.0))
        zeros = max(float(c) - n, 0.0)
        if beta > 0:
            w = (tail / top) ** beta
            shift = (w * tail / (tail + delta)).sum() / (w / (tail + delta)).sum()
        else:
            shift = (k * tail / (tail + delta)).sum() / (
                (k / (tail + delta)).sum() + zeros / delta)
        return shift, k * torch.log(tail + delta).sum() + zeros * torch.log(delta)

    rhos = []
    for c, m, delta in zip(complement, masses, [part.mean() for part in d.split(sizes)]):
        (own, own_logdet), (mean, mean_logdet) = layer_tail(c, m, delta), \
            layer_tail(c, m, d.mean())
        rhos.append((rho + own - mean).clamp(min=0))
        tail_logdet = tail_logdet + own_logdet - mean_logdet
    rho = torch.stack(rhos)
    rho_diag = torch.cat([r_l.expand(n) for r_l, n in zip(rho, sizes)])
    P = kept - U @ torch.diag(norms.T @ rho) @ U.T + torch.diag(d + rho_diag)
    # the offset trades each layer's complement, c_l log(delta + rho_l), for its tail
    log_d = torch.stack([part.mean() for part in (d + rho_diag).split(sizes)]).log()
    logdet = torch.logdet(P) + tail_logdet - (complement * log_d).sum()
    return P, logdet


CASES = [("isotropic", "scalar"), ("isotropic", "param"), ("spectral", "scalar"),
         ("spectral", "layer"), ("spectral", "param"), ("none", "scalar")]


@pytest.mark.parametrize("residual,prior_kind", CASES)
def test_residual_models_against_dense_reference(residual, prior_kind):
    la, full, X = _fit(residual, prior_kind)
    assert 0 < la.rank_bound <= la.n_params
    for sigma in (1.0, 0.6):
        la.sigma_noise = full.sigma_noise = sigma
        cov, logdet = reference_posterior(la, full, X)
        torch.testing.assert_close(la.log_det_posterior_precision, logdet, **TOL)
        expected = (full.log_likelihood
                    - 0.5 * (logdet - full.log_det_prior_precision + full.scatter))
        torch.testing.assert_close(la.log_marginal_likelihood(), expected, **TOL)
        torch.testing.assert_close(la.posterior_covariance, cov, rtol=1e-6,
                                   atol=1e-9 * cov.abs().max())
        torch.testing.assert_close(la.posterior_variance, cov.diagonal(), **TOL)
        eye = torch.eye(la.n_params, dtype=torch.float64)
        S = (la.sample_from_noise(eye) - la.mean).T
        torch.testing.assert_close(S @ S.T, cov, rtol=1e-6, atol=1e-9 * cov.abs().max())
        Js, f_mu = full.backend.jacobians(X[:5])
        f_mu_ours, f_var = la._glm_predictive_distribution(X[:5])
        torch.testing.assert_close(f_mu_ours, f_mu, **TOL)
        torch.testing.assert_close(f_var, Js @ cov @ Js.transpose(1, 2), **TOL)
        torch.testing.assert_close(la.functional_variance(Js), Js @ cov @ Js.transpose(1, 2),
                                   **TOL)
        _, joint = la._glm_predictive_distribution(X[:3], joint=True)
        J3 = Js[:3].reshape(-1, la.n_params)
        torch.testing.assert_close(joint, J3 @ cov @ J3.T, **TOL)


@pytest.mark.parametrize("prior_kind", ["scalar", "layer"])
@pytest.mark.parametrize("residual", ["isotropic", "spectral"])
def test_marglik_gradients_against_dense_reference(residual, prior_kind, tune):
    """Gradients in the prior precision and in sigma_noise (regression).

    A small posterior's gradient runs on one thread through its own backward
    (``utils.threads.scoped_backward``); the objects still hold the caller's tensors.
    """
    model, likelihood, X, y, loader = make_problem("mlp-regression", n=40, batch_size=16)
    full = fit_reference(FullLaplace(model, likelihood), loader)
    tune(oversampling=6.0)
    la = LowRankGGNLaplace(model, likelihood, rank=5, residual=residual)
    la.fit(loader)
    for la_ in (la, full):
        la_.prior_precision = 0.9
    layers = len(list(model.parameters())) if prior_kind == "layer" else 1
    start = torch.linspace(0.7, 1.1, layers, dtype=torch.float64).log().reshape(
        () if layers == 1 else (layers,))
    log_prior = start.clone().requires_grad_(True)
    log_sigma = torch.tensor(math.log(0.8), dtype=torch.float64, requires_grad=True)
    ours = la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())
    grads = torch.autograd.grad(ours, (log_prior, log_sigma), retain_graph=True)
    assert la.prior_precision.grad_fn is not None and la.sigma_noise.grad_fn is not None
    again = la.log_marginal_likelihood()  # at the caller's tensors, still differentiable
    torch.testing.assert_close(again.detach(), ours.detach(), **TOL)
    for g, e in zip(torch.autograd.grad(again, (log_prior, log_sigma)), grads):
        torch.testing.assert_close(g, e, **TOL)

    def reference(lp, ls):
        full.prior_precision, full.sigma_noise = lp.exp(), ls.exp()
        la.prior_precision, la.sigma_noise = lp.exp(), ls.exp()
        _, logdet = reference_posterior(la, full, X)
        return full.log_likelihood - 0.5 * (logdet - full.log_det_prior_precision
                                            + full.scatter)

    lp = log_prior.detach().clone().requires_grad_()
    ls = log_sigma.detach().clone().requires_grad_()
    value = reference(lp, ls)
    torch.testing.assert_close(ours.detach(), value.detach(), **TOL)
    for g, e in zip(grads, torch.autograd.grad(value, (lp, ls))):
        torch.testing.assert_close(g, e, **TOL)


@pytest.mark.parametrize("residual", ["spectral", "isotropic", "diagonal", "none"])
def test_full_rank_equals_full_laplace_for_every_residual(residual):
    model, likelihood, X, y, loader = make_problem("cnn-classification")
    full = fit_reference(FullLaplace(model, likelihood), loader)
    la = LowRankGGNLaplace(model, likelihood, rank=1000, residual=residual)
    la.fit(loader)
    torch.testing.assert_close(la.log_marginal_likelihood(), full.log_marginal_likelihood(),
                               rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(la(X[:4]), full(X[:4]), rtol=1e-6, atol=1e-8)


def test_residual_switch_after_fit_and_state_dict():
    la, full, X = _fit("spectral")
    spectral = la.log_marginal_likelihood()
    la.residual = "isotropic"
    _, logdet = reference_posterior(la, full, X)
    torch.testing.assert_close(la.log_det_posterior_precision, logdet, **TOL)
    la.residual = "spectral"
    torch.testing.assert_close(la.log_marginal_likelihood(), spectral, **TOL)
    # the spectral fit keeps the residual diagonal (it splits its tail over layers)
    la.residual = "diagonal"
    diagonal, *_ = _fit("diagonal")
    diagonal.prior_precision = la.prior_precision
    torch.testing.assert_close(la.log_marginal_likelihood(), diagonal.log_marginal_likelihood(),
                               **TOL)
    iso, *_ = _fit("isotropic")
    with pytest.raises(ValueError, match="refit with residual='diagonal'"):
        iso.residual = "diagonal"
    la.residual = "spectral"
    # state_dict round trip keeps the rank bound and the model
    model, likelihood, *_ = make_problem("mlp-classification", n=40, batch_size=16)
    other = LowRankGGNLaplace(model, likelihood, rank=6, residual="spectral")
    other.load_state_dict(la.state_dict())
    other.prior_precision = la.prior_precision
    torch.testing.assert_close(other.log_marginal_likelihood(), spectral, **TOL)
    torch.testing.assert_close(other(X[:3]), la(X[:3]), **TOL)
    wrong = LowRankGGNLaplace(model, likelihood, rank=6, residual="none")
    with pytest.raises(ValueError, match="residual='spectral'"):
        wrong.load_state_dict(la.state_dict())


def test_bad_residual_options():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="residual must be one of"):
        LowRankGGNLaplace(model, "classification", residual="tail")
    with pytest.warns(FutureWarning, match="residual='diagonal'"):
        la = LowRankGGNLaplace(model, "classification", diagonal_correction=True)
    assert la.residual == "diagonal" and la.diagonal_correction
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="contradicts"):
        LowRankGGNLaplace(model, "classification", residual="isotropic",
                          diagonal_correction=True)
    with pytest.raises(ValueError, match="needs the residual diagonal"):
        DiagonalResidual.from_fit(DroppedCurvature(torch.eye(5, 2), torch.ones(2),
                                                   torch.tensor(3.0), 5))


def test_online_update_keeps_the_rank_bound_growing():
    model, likelihood, X, y, _ = make_problem("mlp-classification", n=40)
    la = LowRankGGNLaplace(model, likelihood, rank=4)
    la.fit(DataLoader(TensorDataset(X[:3], y[:3]), batch_size=3))
    assert la.rank_bound == 3 * 2  # 3 samples, C - 1 = 2 columns each
    la.fit(DataLoader(TensorDataset(X[3:8], y[3:8]), batch_size=5), override=False)
    assert la.n_data == 8 and la.rank_bound == 16


@functools.lru_cache(maxsize=1)
def _digits_problem():
    """sklearn digits' MLP 64-16-10 at its MAP and its 500 training images (as the
    refinement's gate study of ``benchmarks/bench_quadrature.py`` trains it)."""
    from benchmarks.bench_quadrature import digits_problem

    model, loader, _, _ = digits_problem()
    return model, loader


def heldout_nll(la):
    """Test NLL of a posterior's probit GLM predictive on 400 held-out digits."""
    from sklearn.datasets import load_digits

    data = load_digits()
    X_test = torch.tensor(data.data[500:900] / 16.0, dtype=torch.float64)
    y_test = torch.tensor(data.target[500:900])
    probs = la(X_test, link_approx="probit")
    return float(nn.functional.nll_loss(probs.log(), y_test))


@pytest.mark.slow
def test_default_posterior_tracks_the_full_ggn_on_real_data():
    """Real data (sklearn digits), default residual, rank 5% of D: the marglik prior
    within 25% of the full GGN's and the held-out NLL within 10% of its NLL."""
    model, loader = _digits_problem()
    nll = heldout_nll

    full = fit_reference(FullLaplace(model, "classification"), loader)
    full.optimize_prior_precision(method="marglik", n_steps=300, lr=0.1)
    prior, quality = {}, {}
    for residual in ("spectral", "none"):
        la = LowRankGGNLaplace(model, "classification", rank=60, residual=residual)
        la.fit(loader)
        la.optimize_prior_precision(method="marglik", n_steps=300, lr=0.1)
        prior[residual] = float(la.prior_precision / full.prior_precision)
        quality[residual] = nll(la) / nll(full)
        if residual == "spectral":
            exponent = la.jacobian_exponent
    assert 0 < exponent < 1  # measured by the spectral fit (only it runs the probe)
    assert abs(prior["spectral"] - 1) < 0.25, prior
    assert abs(prior["none"] - 1) > abs(prior["spectral"] - 1), prior
    assert abs(quality["spectral"] - 1) < 0.10, quality
    assert abs(quality["none"] - 1) > abs(quality["spectral"] - 1), quality


@pytest.mark.slow
def test_layerwise_priors_track_the_full_ggn_on_real_data():
    """Real data, rank 5% of D: each layer's marglik prior within 25% of the full GGN's.

    One network-wide tail at the mean prior (the spectral model without the layer split)
    misplaces the dropped curvature between layers and is further off.
    """
    model, loader = _digits_problem()
    tune = dict(method="marglik", prior_structure="layerwise", n_steps=80, lr=0.2)
    full = fit_reference(FullLaplace(model, "classification"), loader)
    full.optimize_prior_precision(**tune)
    la = LowRankGGNLaplace(model, "classification", rank=60)
    la.fit(loader)
    assert la.residual_model.layers is not None and la.residual_model.layers.num_layers == 4
    errors = {}
    for split in (True, False):
        if not split:
            la.residual_model.layers = None
        la.optimize_prior_precision(**tune)
        errors[split] = (la.prior_precision / full.prior_precision - 1).abs().max().item()
    assert errors[True] < 0.25, errors
    assert errors[False] > errors[True], errors


def test_jacobian_exponent_fit():
    lam = torch.logspace(2, -1, 30, dtype=torch.float64)
    assert jacobian_exponent(lam, 3 * lam**0.6) == pytest.approx(0.6, rel=1e-10)
    assert jacobian_exponent(lam, lam**1.7) == 1.0  # clamped
    assert jacobian_exponent(lam, lam**-0.5) == 0.0
    assert jacobian_exponent(torch.ones(5), torch.rand(5)) == 0.0  # no spread
    assert jacobian_exponent(lam[:1], lam[:1]) == 0.0
    assert jacobian_exponent(torch.zeros(0), torch.zeros(0)) == 0.0
    energy = lam**0.5
    energy[3] = 0.0  # a direction no probe input reaches is left out of the fit
    assert jacobian_exponent(lam, energy) == pytest.approx(0.5)


def test_jacobian_exponent_is_state_and_settable():
    la, full, X = _fit("spectral", measure_complement=False)
    assert la.measured_complement is None
    beta = la.jacobian_exponent
    assert 0 < beta < 1
    before, logdet = la.posterior_variance, la.log_det_posterior_precision
    la.jacobian_exponent = 0.0  # the plain random-direction mean: wider everywhere
    assert (la.posterior_variance >= before - 1e-12).all()
    assert float(la.posterior_variance.sum()) > float(before.sum())
    # the weighting changes the covariance only; the log det stays the spectral one
    torch.testing.assert_close(la.log_det_posterior_precision, logdet, **TOL)
    with pytest.raises(ValueError, match="jacobian_exponent"):
        la.jacobian_exponent = -1
    la.jacobian_exponent = beta
    model, likelihood, *_ = make_problem("mlp-classification", n=40, batch_size=16)
    other = LowRankGGNLaplace(model, likelihood, rank=6)
    other.load_state_dict(la.state_dict())
    assert other.jacobian_exponent == beta
    torch.testing.assert_close(other.posterior_variance, before, **TOL)


@pytest.mark.parametrize("name", ["mlp-classification", "mlp-regression"])
@pytest.mark.parametrize("probe_size", [80, 64, 40])
def test_measured_complement_against_dense_reference(name, probe_size):
    """The measured complement variance: on all 80 inputs (the exact complement GGN),
    on 64 (each half against the other's GGN, extrapolated with quarters) and on 40
    (halves of 20, no extrapolation), against dense Jacobians, at several priors and
    noise levels; it survives ``state_dict`` and stays out of the log det."""
    la, full, X = _fit("spectral", name=name, probe_size=probe_size, n=80)
    measured = la.measured_complement
    assert measured is not None
    assert measured.fraction == (1.0 if probe_size == 80 else probe_size // 2 / 80)
    assert (measured.mu_half is None) == (probe_size != 64)
    logdet = la.log_det_posterior_precision
    for prior, sigma in [(0.7, 1.0), (3.0, 0.6), (1e-3, 1.0)]:
        la.prior_precision = full.prior_precision = prior
        la.sigma_noise = full.sigma_noise = sigma
        cov, ref_logdet = reference_posterior(la, full, X)
        torch.testing.assert_close(la.posterior_covariance, cov, rtol=1e-6,
                                   atol=1e-9 * cov.abs().max())
        torch.testing.assert_close(la.log_det_posterior_precision, ref_logdet, **TOL)
    la.prior_precision, la.sigma_noise = 0.7, 1.0
    before = la.posterior_variance
    model, likelihood, *_ = make_problem(name, n=80, batch_size=16)
    other = LowRankGGNLaplace(model, likelihood, rank=6)
    other.load_state_dict(la.state_dict())
    other.prior_precision = 0.7
    torch.testing.assert_close(other.posterior_variance, before, **TOL)
    # the model instead: another complement variance, the same log det
    modelled, *_ = _fit("spectral", name=name, probe_size=probe_size, n=80,
                        measure_complement=False)
    assert modelled.measured_complement is None
    torch.testing.assert_close(modelled.log_det_posterior_precision, logdet, **TOL)
    assert not torch.allclose(modelled.posterior_variance, before)


def _float32_copy(la64, model64, X, y, likelihood):
    """The same fitted posterior in float32 (a float32 model and float32 factors)."""
    model32 = copy.deepcopy(model64).float()
    la32 = LowRankGGNLaplace(model32, likelihood, sigma_noise=la64.sigma_noise,
                             residual=la64.residual)
    la32.fit(DataLoader(TensorDataset(X.float(), y.float() if y.is_floating_point() else y),
                        batch_size=50))
    U, lam = la64.H
    la32.H = (U.float(), lam.float())
    la32.trace, la32.rank_bound = la64.trace.float(), la64.rank_bound
    la32.residual = la64.residual  # drops the cached residual model
    return la32


@pytest.mark.slow
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_float32_glm_predictive_matches_float64(likelihood):
    """The GLM variance cancels when J lies in the kept subspace; float32 keeps 1e-3."""
    torch.manual_seed(0)
    X = torch.rand(150, 1, dtype=torch.float64) * 8 - 4
    out = 1 if likelihood == "regression" else 3
    model = nn.Sequential(nn.Linear(1, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(),
                          nn.Linear(50, out)).double()
    if likelihood == "regression":
        y = torch.sin(X) + 0.3 * torch.randn_like(X)
        loss = lambda: ((model(X) - y) ** 2).mean()  # noqa: E731
    else:
        y = (X[:, 0] > -1).long() + (X[:, 0] > 1.5).long()
        loss = lambda: nn.functional.cross_entropy(model(X), y)  # noqa: E731
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(1000):
        opt.zero_grad()
        loss().backward()
        opt.step()
    la64 = LowRankGGNLaplace(model, likelihood, sigma_noise=0.3 if out == 1 else 1.0)
    la64.fit(DataLoader(TensorDataset(X, y), batch_size=50))
    la32 = _float32_copy(la64, model, X, y, likelihood)
    Xt = torch.linspace(-6, 6, 40, dtype=torch.float64)[:, None]
    for prior in (1e-3, 1e-2, 1e-1, 1.0, 10.0, 1e2, 1e3):
        la64.prior_precision = la32.prior_precision = prior
        _, v64 = la64._glm_predictive_distribution(Xt)
        _, v32 = la32._glm_predictive_distribution(Xt.float())
        assert v32.dtype == torch.float32
        torch.testing.assert_close(v32.double(), v64, rtol=1e-3, atol=1e-3 * v64.abs().max())
        if likelihood == "classification":
            # (laplace-torch's own bridge_norm formula overflows in float32 for confident
            # logits whatever the variance, so it is left out here)
            for link in ("probit", "bridge"):
                p64 = la64(Xt, link_approx=link)
                p32 = la32(Xt.float(), link_approx=link)
                torch.testing.assert_close(p32.double(), p64, rtol=1e-3, atol=1e-5)


def test_gram_cache_recomputes_for_a_new_or_changed_basis():
    from lowrank_laplace.posterior import GramCache
    from lowrank_laplace.utils.linalg import wide_inner

    torch.manual_seed(0)
    U = torch.linalg.qr(torch.randn(300, 7))[0]  # float32
    cache = GramCache()
    first = cache.get(U)
    assert first.dtype == torch.float64
    torch.testing.assert_close(first, U.double().T @ U.double(), rtol=1e-12, atol=1e-12)
    assert cache.get(U) is first  # one pass over U for every later predictive
    U.mul_(2)  # in place: a new version
    torch.testing.assert_close(cache.get(U), 4 * first, rtol=1e-12, atol=1e-12)
    V = torch.randn(300, 7)
    torch.testing.assert_close(cache.get(V), wide_inner(V), rtol=1e-12, atol=1e-12)



@pytest.mark.parametrize("measure", [True, False])
def test_exact_probe_gives_the_reference_exponent(monkeypatch, tune, measure):
    """With ``probe_columns=None`` the energies are exact (all output directions), from
    the complement's measurement where it covers the whole probe, else from their pass."""
    model, likelihood, X, y, loader = make_problem("mlp-classification", n=40, batch_size=16)
    tune(probe_columns=None, measure_complement=measure)
    la = LowRankGGNLaplace(model, likelihood, rank=6)
    la.fit(loader)
    full = fit_reference(FullLaplace(model, likelihood), loader)
    assert la.jacobian_exponent == pytest.approx(reference_exponent(la, full, X), rel=1e-6,
                                                 abs=1e-9)


@pytest.mark.montecarlo
def test_projected_energies_are_unbiased():
    from lowrank_laplace.engine import FactorEngine
    from lowrank_laplace.posterior.predictive import jacobian_energies

    model, _, X, _, _ = make_problem("mlp-classification", n=30, batch_size=16)
    U = torch.linalg.qr(torch.randn(sum(p.numel() for p in model.parameters()), 5,
                                    dtype=torch.float64))[0]
    with FactorEngine(model, nn.MSELoss(reduction="sum"), eval_mode=True) as engine:
        exact = jacobian_energies(engine, [X], U, 30)
        torch.manual_seed(0)
        draws = torch.stack([jacobian_energies(engine, [X], U, 30, projections=4)
                             for _ in range(400)])
    # 1600 projections per input: the mean is within a few percent of the exact energies
    torch.testing.assert_close(draws.mean(0), exact, rtol=0.05, atol=0)
    assert (draws.std(0) > 0.01 * exact).all()  # random, not the exact pass


def test_probe_draws_are_private_and_reproducible(monkeypatch, tune):
    """256 probe inputs of a 10-class model carry 2 random output combinations each:
    drawn in the fit's private stream (same exponent twice, the caller's generator
    untouched) and close to the exact energies' exponent."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 10)).double()
    X, y = torch.randn(300, 8, dtype=torch.float64), torch.randint(0, 10, (300,))
    loader = DataLoader(TensorDataset(X, y), batch_size=50)
    torch.manual_seed(5)
    list(loader)  # iterating a loader draws its base seed from the caller's generator
    expected = torch.random.get_rng_state()
    torch.manual_seed(5)
    first = LowRankGGNLaplace(model, "classification", rank=20)
    first.fit(loader)
    assert torch.equal(torch.random.get_rng_state(), expected)  # nothing more drawn
    second = LowRankGGNLaplace(model, "classification", rank=20)
    second.fit(loader)
    # same draws (numerically: BLAS may round the same sums differently by the 1e-15)
    assert second.jacobian_exponent == pytest.approx(first.jacobian_exponent, rel=1e-9)
    tune(probe_columns=None)
    exact = LowRankGGNLaplace(model, "classification", rank=20)
    exact.fit(loader)
    assert 0 < exact.jacobian_exponent < 1
    assert first.jacobian_exponent != exact.jacobian_exponent  # the random path ran
    assert first.jacobian_exponent == pytest.approx(exact.jacobian_exponent, abs=0.05)


def test_fitted_posterior_pickles_after_a_predictive():
    """The Gram cache holds a weak reference; it pickles empty and refills."""
    import pickle

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3))
    X, y = torch.randn(40, 3), torch.randint(0, 3, (40,))
    la = LowRankGGNLaplace(model, "classification", rank=5)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=10))
    before = la(X[:4], pred_type="glm", link_approx="probit")
    again = pickle.loads(pickle.dumps(la))
    torch.testing.assert_close(again(X[:4], pred_type="glm", link_approx="probit"), before)


def test_a_fit_under_a_layerwise_prior_measures_the_complement_as_a_scalar_one():
    """The measurement does not depend on the prior's shape: a fit under a layerwise
    prior (``marglik_training``'s refits) measures the same complement."""
    model, likelihood, X, y, loader = make_problem("mlp-classification", n=80, batch_size=16)
    layers = len(list(model.parameters()))
    la = LowRankGGNLaplace(model, likelihood, rank=6, prior_precision=torch.ones(layers))
    la.fit(loader)
    assert la.measured_complement is not None and probe.MEASURE_COMPLEMENT
    scalar = LowRankGGNLaplace(model, likelihood, rank=6, prior_precision=1.0)
    scalar.fit(loader)
    torch.testing.assert_close(la.measured_complement.mu, scalar.measured_complement.mu)
    torch.testing.assert_close(la.log_marginal_likelihood(), scalar.log_marginal_likelihood())


def test_probe_predictive_variance_is_the_dense_posteriors():
    """The rank check's variance: the trace of ``J P^{-1} J^T`` for the precision with
    ``h lambda + delta`` on the kept directions and ``1 / v`` outside them; at half the
    rank, the dropped half pools with the complement into one energy-weighted variance."""
    from lowrank_laplace.posterior.probe import ProbeColumns, predictive_variance, variance_change

    torch.manual_seed(0)
    D, r, m, C, h, delta, v = 30, 4, 5, 3, 0.7, 0.4, 0.9
    U = torch.linalg.qr(torch.randn(D, r, dtype=torch.float64))[0]
    lam = torch.tensor([9.0, 5.0, 2.0, 1.0], dtype=torch.float64)
    J = torch.randn(C * m, D, dtype=torch.float64)  # rows (c, n)
    eye = torch.eye(D, dtype=torch.float64)

    def dense(k, variance):
        Uk = U[:, :k]
        P = Uk @ torch.diag(h * lam[:k] + delta) @ Uk.T + (eye - Uk @ Uk.T) / variance
        return (J @ torch.linalg.inv(P) * J).sum(1).reshape(C, m).sum(0)

    probe = ProbeColumns((J**2).sum(1), J @ U, C)
    variance = torch.tensor(v, dtype=torch.float64)
    full = predictive_variance(probe, lam, variance, (h, delta))
    torch.testing.assert_close(full, dense(r, v), rtol=1e-10, atol=1e-12)
    energies = ((J @ U[:, 2:]) ** 2).sum(0)
    outside = ((J**2).sum() - ((J @ U) ** 2).sum())
    pooled = float(((energies / (h * lam[2:] + delta)).sum() + v * outside)
                   / (energies.sum() + outside))
    half = predictive_variance(probe, lam, variance, (h, delta), lumped=2)
    torch.testing.assert_close(half, dense(2, pooled), rtol=1e-10, atol=1e-12)
    change = ((dense(2, pooled) - dense(r, v)).abs() / dense(r, v)).median()
    assert variance_change(probe, lam, variance, (h, delta)) == pytest.approx(float(change))


def test_fit_report_says_what_ran_and_survives_the_state_dict(tune):
    tune(dense_max_dim=0)
    model, likelihood, X, y, loader = make_problem("mlp-classification", n=80, batch_size=16)
    la = LowRankGGNLaplace(model, likelihood, rank=6, solver="streaming")
    assert la.fit_report is None and repr(la).startswith("LowRankGGNLaplace(rank=6")
    la.fit(loader)
    report = la.fit_report
    assert (report.rank, report.fit_path, report.residual) == (6, "streaming", "spectral")
    assert report.kept_fraction == pytest.approx(float(la.kept_fraction))
    assert report.check is None and 0 <= report.variance_change < 10
    assert "kept share of the GGN trace" in repr(la) and "from rank 3 to 6" in str(report)
    other = LowRankGGNLaplace(model, likelihood, rank=6, solver="streaming")
    other.load_state_dict(la.state_dict())
    assert other.fit_report == report
    assert report.fit_passes == 1 and report.quadrature_steps == 0
    assert "dropped curvature: variance measured on the probe inputs" in str(report)
    assert report.as_dict()["estimator"] == report.estimator
    iso = LowRankGGNLaplace(model, likelihood, rank=6, residual="isotropic")
    iso.fit(loader)
    assert iso.fit_report.variance_change is None  # no probe pass
    assert iso.fit_report.estimator.startswith("the mean dropped eigenvalue")
    switched = type(report)(**{**report.__dict__, "residual": "none"})  # calibrate's rows
    assert switched.estimator == "nothing: the prior alone"
    refined = LowRankGGNLaplace(model, likelihood, rank=6, solver="sketch", refine_below=1)
    refined.fit(loader)
    report = refined.fit_report
    assert report.fit_passes >= 1 and report.quadrature_steps > 1
    # the steps multiply by the fit's own kept factors: no pass over the data
    assert report.quadrature_passes == 0
    assert f"passes over the training data: {report.fit_passes} " \
        f"(fit {report.fit_passes}, refinement 0)" in str(report)
    again = LowRankGGNLaplace(model, likelihood, rank=6, solver="sketch")
    again.load_state_dict(refined.state_dict())
    again.refine_complement(loader)  # a pass, then the steps after it reuse its factors
    assert again.fit_report.quadrature_passes == 1
    torch.testing.assert_close(again.log_marginal_likelihood(),
                               refined.log_marginal_likelihood())
    assert "Lanczos quadrature" in report.estimator


@pytest.mark.parametrize("n_train, hidden", [(1200, 8), (1500, 16)])
def test_measured_complement_far_below_n_meets_the_modelled_tail(n_train, hidden):
    """Real digits, a probe of 40 of 1,200-1,500 training inputs: the energy its halves
    cannot resolve meets the modelled tail, not only the floor, which brings the
    complement variance closer to the exact full-GGN one (dense, float64) on test
    inputs; it stays within 1.6x of it (the floor alone: 1.75-2x)."""
    from sklearn.datasets import load_digits

    torch.manual_seed(0)
    data = load_digits()
    X = torch.tensor(data.data, dtype=torch.float64) / 16.0
    y = torch.tensor(data.target)
    X, Xt, y = X[:n_train], X[n_train:], y[:n_train]
    model = nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10)).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(20):
        for idx in torch.randperm(n_train).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(model(X[idx]), y[idx]).backward()
            opt.step()
    loader = DataLoader(TensorDataset(X, y), batch_size=100)
    full = fit_reference(FullLaplace(model, "classification"), loader)
    with pytest.MonkeyPatch.context() as patch:
        set_tuning(patch, probe_size=40)
        la = LowRankGGNLaplace(model, "classification", rank=20, solver="streaming",
                               refine_below=0)  # the probe's measurement, unrefined
        la.fit(loader)
    one, delta = torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    U, lam = la.H
    J = full.backend.jacobians(Xt)[0].reshape(-1, la.n_params)
    P = full.H + delta * torch.eye(la.n_params, dtype=torch.float64)
    JU = J @ U
    outside = (J @ torch.linalg.solve(P, J.T)).trace() - ((JU**2) / (lam + delta)).sum()
    exact = float(outside / ((J**2).sum() - (JU**2).sum()))
    measured = la.measured_complement
    assert 0 < measured.resolved_share < 0.9
    with_tail = float(la.residual_model.complement_variance(one, delta))
    floor_only = float(measured.variance(one, delta, float(lam[-1])))
    assert abs(math.log(with_tail / exact)) < abs(math.log(floor_only / exact))
    assert with_tail / exact < 1.6
    assert f"resolves {measured.resolved_share:.0%}" in str(la.fit_report)
