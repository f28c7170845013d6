"""laplace-torch integration: with full rank, equal to FullLaplace's exact GGN."""

import math

import pytest
import torch
from laplace import FullLaplace, Laplace
from laplace.baselaplace import ParametricLaplace
from laplace.lllaplace import FullLLLaplace
from laplace.marglik_training import marglik_training
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lowrank_laplace as ll
from lowrank_laplace import LowRankGGNLaplace, LowRankGGNLLLaplace
from tests.conftest import set_tuning

TOL = dict(rtol=1e-5, atol=1e-8)


@pytest.fixture(autouse=True)
def streaming(request, monkeypatch):
    """The toy models here are small enough for the dense path; test streaming unless
    a test is marked ``dense``."""
    if "dense" not in request.keywords:
        set_tuning(monkeypatch, dense_max_dim=0)


def _mlp(out):
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, out))


def _cnn(out):
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 3 * 3, out))


PROBLEMS = {
    "mlp-classification": (_mlp, lambda n: torch.randn(n, 3), "classification"),
    "mlp-regression": (_mlp, lambda n: torch.randn(n, 3), "regression"),
    "cnn-classification": (_cnn, lambda n: torch.randn(n, 1, 5, 5), "classification"),
    "cnn-regression": (_cnn, lambda n: torch.randn(n, 1, 5, 5), "regression"),
}


def make_problem(name, n=24, out=3, seed=0, batch_size=7, shuffle=False):
    torch.manual_seed(seed)
    model_fn, x_fn, likelihood = PROBLEMS[name]
    model = model_fn(out).double()
    X = x_fn(n).double()
    if likelihood == "classification":
        y = torch.randint(0, out, (n,))
    else:
        y = torch.randn(n, out, dtype=torch.float64)
    loader = DataLoader(TensorDataset(X, y), batch_size=batch_size, shuffle=shuffle)
    return model, likelihood, X, y, loader


def fit_reference(la, loader):
    """Fit a laplace-torch reference; its curvlinops backend builds torch.eye in the
    default dtype, so float64 is made the default for exact float64 references."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        la.fit(loader)
    finally:
        torch.set_default_dtype(old)
    return la


def dense_H(la):
    U, lam = la.H
    return U @ torch.diag(lam) @ U.T


def fit_pair(name, **kwargs):
    model, likelihood, X, y, loader = make_problem(name)
    ours = Laplace(model, likelihood, subset_of_weights="all", hessian_structure="lowrank_ggn",
                   rank=1000, **kwargs)
    full = FullLaplace(model, likelihood, **kwargs)
    ours.fit(loader)
    fit_reference(full, loader)
    return ours, full, X


@pytest.fixture(params=list(PROBLEMS), scope="module")
def pair(request):
    return fit_pair(request.param)


def test_factory_returns_our_classes():
    model, likelihood, *_ = make_problem("mlp-classification")
    la = Laplace(model, likelihood, hessian_structure="lowrank_ggn")
    assert isinstance(la, LowRankGGNLaplace)
    la = Laplace(model, likelihood, subset_of_weights="last_layer", hessian_structure="lowrank_ggn")
    assert isinstance(la, LowRankGGNLLLaplace)


def test_hessian_equals_full_laplace(pair):
    ours, full, _ = pair
    scale = full.H.abs().max()
    torch.testing.assert_close(dense_H(ours), full.H, rtol=1e-5, atol=1e-8 * scale)
    torch.testing.assert_close(ours.loss, torch.as_tensor(full.loss, dtype=torch.float64), **TOL)
    torch.testing.assert_close(ours.kept_fraction, torch.ones((), dtype=torch.float64), **TOL)


def _set_prior(ours, full, prior):
    torch.manual_seed(3)
    if prior == "scalar":
        p = torch.tensor(0.7, dtype=torch.float64)
    elif prior == "layer":
        p = torch.rand(ours.n_layers, dtype=torch.float64) + 0.2
    else:
        p = torch.rand(ours.n_params, dtype=torch.float64) + 0.2
    sigma = torch.tensor(0.8 if ours.likelihood == "regression" else 1.0, dtype=torch.float64)
    for la in (ours, full):
        la.prior_precision = p
        if la.likelihood == "regression":
            la.sigma_noise = sigma


@pytest.mark.parametrize("prior", ["scalar", "layer", "diag"])
def test_marglik_logdet_equal_full_laplace(pair, prior):
    ours, full, _ = pair
    _set_prior(ours, full, prior)
    torch.testing.assert_close(ours.log_det_posterior_precision,
                               full.log_det_posterior_precision, **TOL)
    torch.testing.assert_close(ours.log_marginal_likelihood(), full.log_marginal_likelihood(),
                               **TOL)
    delta = torch.randn(ours.n_params, dtype=torch.float64)
    torch.testing.assert_close(ours.square_norm(ours.mean + delta),
                               full.square_norm(full.mean + delta), **TOL)



@pytest.mark.parametrize("prior", ["scalar", "layer", "diag"])
def test_posterior_covariance_variance_scale_equal_full_laplace(pair, prior):
    ours, full, _ = pair
    _set_prior(ours, full, prior)
    cov = full.posterior_covariance
    tol = dict(rtol=1e-5, atol=1e-8 * cov.abs().max())
    torch.testing.assert_close(ours.posterior_covariance, cov, **tol)
    torch.testing.assert_close(ours.posterior_variance, cov.diagonal(), **tol)
    scale = ours.posterior_scale
    torch.testing.assert_close(scale @ scale.T, cov, **tol)
    eye = torch.eye(ours.n_params, dtype=torch.float64)
    torch.testing.assert_close(scale, ours.sample_from_noise(eye).T - ours.mean[:, None])


def test_dense_posterior_matrices_respect_the_memory_budget():
    model, likelihood, X, y, loader = make_problem("mlp-classification")
    la = LowRankGGNLaplace(model, likelihood, rank=5, memory_budget=50_000)
    la.fit(loader)
    assert la.posterior_variance.shape == (la.n_params,)  # O(D r): always available
    for name in ("posterior_covariance", "posterior_scale"):
        with pytest.raises(ValueError, match=f"{name} is a dense 77 x 77 matrix.*posterior_var"):
            getattr(la, name)

def test_marglik_gradients_equal_full_laplace():
    ours, full, _ = fit_pair("mlp-regression")
    grads = []
    for la in (ours, full):
        log_prior = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
        log_sigma = torch.tensor(-0.2, dtype=torch.float64, requires_grad=True)
        la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp()).backward()
        grads.append(torch.stack([log_prior.grad, log_sigma.grad]))
    torch.testing.assert_close(grads[0], grads[1], **TOL)


@pytest.mark.parametrize("link", ["probit", "bridge", "bridge_norm", "mc"])
def test_glm_predictive_equals_full_laplace(pair, link):
    ours, full, X = pair
    for la in (ours, full):
        la.prior_precision = 0.9
    if ours.likelihood == "regression":
        for joint in (False, True):
            mu_o, var_o = ours(X[:5], pred_type="glm", joint=joint)
            mu_f, var_f = full(X[:5], pred_type="glm", joint=joint)
            torch.testing.assert_close(mu_o, mu_f, **TOL)
            torch.testing.assert_close(var_o, var_f, **TOL)
        return
    torch.manual_seed(0)
    p_o = ours(X[:5], pred_type="glm", link_approx=link, n_samples=50)
    torch.manual_seed(0)
    p_f = full(X[:5], pred_type="glm", link_approx=link, n_samples=50)
    torch.testing.assert_close(p_o, p_f, **TOL)


def test_functional_variance_from_jacobians(pair):
    ours, full, X = pair
    Js, _ = full.backend.jacobians(X[:4])
    torch.testing.assert_close(ours.functional_variance(Js), full.functional_variance(Js), **TOL)
    torch.testing.assert_close(ours.functional_covariance(Js), full.functional_covariance(Js),
                               **TOL)


@pytest.mark.parametrize("method", ["marglik", "gridsearch"])
def test_optimize_prior_precision_equals_full_laplace(method):
    ours, full, X = fit_pair("mlp-classification")
    y = torch.randint(0, 3, (X.shape[0],))
    val = DataLoader(TensorDataset(X, y), batch_size=8)
    found = []
    for la in (ours, full):
        kw = dict(val_loader=val, grid_size=12) if method == "gridsearch" else dict(n_steps=30)
        la.optimize_prior_precision(method=method, **kw)
        found.append(la.prior_precision)
    torch.testing.assert_close(found[0], found[1], rtol=1e-5, atol=1e-8)


def test_sampling_is_a_square_root_of_the_covariance():
    ours, full, _ = fit_pair("cnn-regression")
    for prior in (torch.tensor(0.5, dtype=torch.float64),
                  torch.rand(ours.n_params, dtype=torch.float64) + 0.3):
        ours.prior_precision = prior
        full.prior_precision = prior
        eye = torch.eye(ours.n_params, dtype=torch.float64)
        S = (ours.sample_from_noise(eye) - ours.mean).T
        ref = full.posterior_covariance
        torch.testing.assert_close(S @ S.T, ref, rtol=1e-5, atol=1e-8 * ref.abs().max())


def test_sample_covariance_statistical():
    ours, full, _ = fit_pair("mlp-classification")
    ours.prior_precision = full.prior_precision = 2.0
    gen = torch.Generator().manual_seed(0)
    n = 40_000
    samples = ours.sample(n, generator=gen)
    cov = torch.cov(samples.T)
    ref = full.posterior_covariance
    # Monte-Carlo error of a sample covariance ~ sqrt(2/n) relative to the variances
    assert ((cov - ref).abs().max() / ref.diagonal().max()) < 0.03
    assert ((samples.mean(0) - ours.mean).abs().max() / ref.diagonal().max().sqrt()) < 0.03


def test_shuffled_orders_and_micro_batches_agree():
    model, likelihood, X, y, _ = make_problem("cnn-classification", n=30)
    results = []
    for seed, bs, budget, micro in [(0, 30, None, None), (1, 4, None, None), (2, 11, 2000, None),
                                    (3, 30, None, 7)]:
        gen = torch.Generator().manual_seed(seed)
        loader = DataLoader(TensorDataset(X, y), batch_size=bs, shuffle=True, generator=gen)
        la = LowRankGGNLaplace(model, likelihood, rank=1000, memory_budget=budget,
                               micro_batch_size=micro)
        la.fit(loader)
        results.append(dense_H(la))
    scale = results[0].abs().max()
    for H in results[1:]:
        torch.testing.assert_close(H, results[0], rtol=1e-6, atol=1e-9 * scale)


def overlap(U, W):
    """Overlap of two k-dim subspaces (ViViT eq. overlap_eigenspaces): ||U^T W||_F^2 / k."""
    return (U.T @ W).pow(2).sum() / U.shape[1]


def test_truncated_rank_against_dense_top_r(tune):
    model, likelihood, X, y, loader = make_problem("mlp-classification", n=60, batch_size=16)
    full = fit_reference(FullLaplace(model, likelihood), loader)
    evals, evecs = torch.linalg.eigh(full.H)
    evals, evecs = evals.flip(0), evecs.flip(1)
    r = 6
    tune(oversampling=10 / 6)
    la = LowRankGGNLaplace(model, likelihood, rank=r, residual="none")
    la.fit(loader)
    U, lam = la.H
    assert lam.shape == (r,)
    torch.testing.assert_close(lam, evals[:r], rtol=1e-3, atol=0)
    assert overlap(U, evecs[:, :r]) > 0.999
    # the trace is exact, so the kept fraction is exact too
    torch.testing.assert_close(la.trace, torch.trace(full.H), **TOL)
    torch.testing.assert_close(la.kept_fraction, lam.sum() / torch.trace(full.H), **TOL)
    # posterior of the truncated curvature (scalar prior): covariance and its diagonal
    la.prior_precision = 0.4
    cov = torch.linalg.inv(U @ torch.diag(lam) @ U.T + 0.4 * torch.eye(la.n_params).double())
    torch.testing.assert_close(la.posterior_covariance, cov, **TOL)
    torch.testing.assert_close(la.posterior_variance, cov.diagonal(), **TOL)



@pytest.mark.parametrize("name", ["cnn-classification", "cnn-regression", "mlp-classification"])
def test_low_memory_fit_equals_full_laplace(name):
    """Two passes per micro-batch (Gram and products, then V C) and no kept V: exact."""
    model, likelihood, X, y, loader = make_problem(name)
    full = fit_reference(FullLaplace(model, likelihood), loader)
    for kwargs in (dict(), dict(micro_batch_size=3, residual="diagonal")):
        la = LowRankGGNLaplace(model, likelihood, rank=1000, low_memory=True, **kwargs)
        la.fit(loader)
        scale = full.H.abs().max()
        torch.testing.assert_close(dense_H(la), full.H, rtol=1e-5, atol=1e-8 * scale)
        torch.testing.assert_close(la.log_marginal_likelihood(), full.log_marginal_likelihood(),
                                   **TOL)
        torch.testing.assert_close(la(X[:3]), full(X[:3]), **TOL)


def test_low_memory_fit_replays_mc_and_subsampling_draws():
    model, likelihood, X, y, loader = make_problem("cnn-classification")
    kwargs = dict(rank=1000, micro_batch_size=4, mc_samples=2, subsample_fraction=0.5)
    low = LowRankGGNLaplace(model, likelihood, low_memory=True, **kwargs)
    low.fit(loader)
    std = LowRankGGNLaplace(model, likelihood, **kwargs)
    std.fit(loader)
    torch.testing.assert_close(dense_H(low), dense_H(std), rtol=1e-6,
                               atol=1e-10 * dense_H(std).abs().max())


def test_low_memory_fit_truncated_against_dense_top_r(tune):
    model, likelihood, X, y, loader = make_problem("mlp-classification", n=60, batch_size=16)
    full = fit_reference(FullLaplace(model, likelihood), loader)
    evals, evecs = torch.linalg.eigh(full.H)
    evals, evecs = evals.flip(0), evecs.flip(1)
    tune(oversampling=10 / 6)
    la = LowRankGGNLaplace(model, likelihood, rank=6, low_memory=True,
                           residual="diagonal")
    la.fit(loader)
    U, lam = la.H
    torch.testing.assert_close(lam, evals[:6], rtol=1e-3, atol=0)
    assert overlap(U, evecs[:, :6]) > 0.999
    torch.testing.assert_close(la.trace, torch.trace(full.H), **TOL)
    residual = (full.H.diagonal() - (U**2) @ lam).clamp(min=0)
    torch.testing.assert_close(la.residual_diagonal, residual, rtol=1e-6, atol=1e-9 * evals[0])


def test_recomputed_factor_only_projects_its_targets():
    from lowrank_laplace.engine import FactorEngine
    from lowrank_laplace.fitting.recompute import RecomputedFactor

    model, likelihood, X, y, _ = make_problem("mlp-classification")
    basis = torch.randn(sum(p.numel() for p in model.parameters()), 4, dtype=torch.float64)
    with FactorEngine(model, nn.CrossEntropyLoss(reduction="sum")) as engine:
        factor = RecomputedFactor(engine, X[:5], y[:5], 0, None, [basis], diagonal=True)
        kept = engine.compute(X[:5], y[:5])
        torch.testing.assert_close(factor.t_matmul(basis), kept.t_matmul(basis), **TOL)
        torch.testing.assert_close(factor.diag(), kept.diag(), **TOL)
        coeff = torch.randn(factor.num_columns, 2, dtype=torch.float64)
        torch.testing.assert_close(factor.matmul(coeff), kept.matmul(coeff), **TOL)
        with pytest.raises(RuntimeError, match="only available for the merge's projection"):
            factor.t_matmul(basis.clone())

@pytest.mark.montecarlo
def test_mc_and_subsampling_are_unbiased_on_average():
    model, likelihood, X, y, loader = make_problem("mlp-classification", n=20, batch_size=20)
    full = fit_reference(FullLaplace(model, likelihood), loader)
    acc = {"mc": 0, "sub": 0}
    reps = 200
    for seed in range(reps):
        la = LowRankGGNLaplace(model, likelihood, rank=1000, mc_samples=1, seed=seed)
        la.fit(loader)
        acc["mc"] = acc["mc"] + dense_H(la) / reps
        la = LowRankGGNLaplace(model, likelihood, rank=1000, subsample_fraction=0.5, seed=seed)
        la.fit(loader)
        acc["sub"] = acc["sub"] + dense_H(la) / reps
    scale = full.H.abs().max()
    for H in acc.values():  # Monte-Carlo error ~ 1/sqrt(reps)
        assert (H - full.H).abs().max() / scale < 0.15


def test_mc_draws_follow_the_seed_option_not_the_global_rng():
    model, likelihood, X, y, loader = make_problem("cnn-classification", shuffle=True)
    fits = {}
    for name, seed in [("a", 3), ("b", 3), ("c", 4)]:
        torch.manual_seed(100)  # same global state before every fit
        la = LowRankGGNLaplace(model, likelihood, rank=1000, mc_samples=2, seed=seed)
        before = torch.get_rng_state()
        la.fit(loader)
        after_fit = torch.get_rng_state()
        torch.set_rng_state(before)
        list(loader)  # only the loader's shuffling may consume the global RNG
        assert torch.equal(after_fit, torch.get_rng_state())
        fits[name] = dense_H(la)
    torch.testing.assert_close(fits["a"], fits["b"], rtol=1e-12, atol=1e-12)
    assert (fits["a"] - fits["c"]).abs().max() > 1e-3 * fits["a"].abs().max()


@pytest.mark.parametrize("mode", ["streaming", pytest.param("dense", marks=pytest.mark.dense)])
def test_last_layer_equals_full_ll_laplace(mode):
    model, likelihood, X, y, loader = make_problem("cnn-classification")
    ours = Laplace(model, likelihood, subset_of_weights="last_layer",
                   hessian_structure="lowrank_ggn", rank=1000)
    full = FullLLLaplace(model, likelihood)
    ours.fit(loader)
    fit_reference(full, loader)
    torch.testing.assert_close(dense_H(ours), full.H, rtol=1e-5, atol=1e-10)
    for la in (ours, full):
        la.prior_precision = 0.6
    torch.testing.assert_close(ours.log_marginal_likelihood(), full.log_marginal_likelihood(),
                               **TOL)
    torch.testing.assert_close(ours(X[:4]), full(X[:4]), **TOL)


def test_marglik_training_runs_and_improves():
    torch.manual_seed(0)
    X = torch.randn(64, 2)
    y = (X[:, 0] * X[:, 1] > 0).long()
    loader = DataLoader(TensorDataset(X, y), batch_size=16)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 2))
    la, model, margliks, losses = marglik_training(
        model, loader, likelihood="classification", hessian_structure="lowrank_ggn",
        n_epochs=20, n_epochs_burnin=2, marglik_frequency=2, n_hypersteps=5,
        backend=None, optimizer_kwargs={"lr": 1e-2},
    )
    assert isinstance(la, LowRankGGNLaplace)
    assert margliks[-1] < margliks[0]  # negative log marginal likelihood decreases
    assert all(math.isfinite(m) for m in margliks)


@pytest.mark.dense
@pytest.mark.parametrize("prior_structure", ["layerwise", "diag"])
def test_marglik_training_with_per_layer_priors_equals_full_at_full_rank(prior_structure):
    """laplace-torch's marglik_training (weights and prior precisions together): with
    full rank, the same trajectory, priors and final posterior as FullLaplace's."""
    X = torch.randn(48, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = (X[:, 0] * X[:, 1] > 0).long()
    runs = {}
    for structure in ("lowrank_ggn", "full"):
        torch.manual_seed(0)
        model = _mlp(2).double()
        # not shuffled: laplace-torch's own fit draws an extra batch (another shuffle)
        loader = DataLoader(TensorDataset(X, y), batch_size=16)
        runs[structure] = marglik_training(
            model, loader, likelihood="classification", hessian_structure=structure,
            prior_structure=prior_structure, n_epochs=6, n_hypersteps=5, backend=None,
            optimizer_kwargs={"lr": 1e-2},
        )
    (ours, _, ours_ml, ours_loss), (full, _, full_ml, full_loss) = runs["lowrank_ggn"], runs["full"]
    assert isinstance(ours, LowRankGGNLaplace) and ours.kept_fraction > 1 - 1e-12
    torch.testing.assert_close(torch.tensor(ours_loss), torch.tensor(full_loss), **TOL)
    torch.testing.assert_close(torch.tensor(ours_ml), torch.tensor(full_ml), **TOL)
    torch.testing.assert_close(ours.prior_precision, full.prior_precision, **TOL)
    torch.testing.assert_close(ours.log_marginal_likelihood(), full.log_marginal_likelihood(),
                               **TOL)


@pytest.mark.parametrize("chunk", [1, 300])
def test_glm_predictive_in_float64_slices_equals_full_laplace(monkeypatch, chunk):
    """The float64 products of factored and dense blocks, widened a slice at a time.

    ``chunk=1``: one output unit (factored) or one parameter (dense) per slice;
    ``300``: several. A per-parameter prior precision takes the per-entry path.
    """
    from lowrank_laplace.factor import weights

    ours, full, X = fit_pair("mlp-classification")
    monkeypatch.setattr(weights, "WIDE_ENTRIES", chunk)
    prior = torch.linspace(0.5, 2.0, ours.n_params, dtype=torch.float64)
    for prec in (0.9, prior):
        ours.prior_precision = full.prior_precision = prec
        for joint in (False, True):
            mu_o, var_o = ours._glm_predictive_distribution(X[:5], joint=joint)
            mu_f, var_f = full._glm_predictive_distribution(X[:5], joint=joint)
            torch.testing.assert_close(mu_o, mu_f, **TOL)
            torch.testing.assert_close(var_o, var_f, **TOL)


def test_nn_predictive_and_model_left_as_it_was():
    model, likelihood, X, y, loader = make_problem("mlp-classification")
    model.train()
    before = [p.detach().clone() for p in model.parameters()]
    LowRankGGNLaplace(model, likelihood, rank=3, low_memory=True).fit(loader)  # 2 passes
    la = LowRankGGNLaplace(model, likelihood, rank=1000)
    la.fit(loader)
    probs = la(X[:4], pred_type="glm")
    torch.manual_seed(0)
    nn_probs = la(X[:4], pred_type="nn", link_approx="mc", n_samples=20)
    assert probs.shape == nn_probs.shape == (4, 3)
    torch.testing.assert_close(nn_probs.sum(-1), torch.ones(4, dtype=torch.float64))
    assert model.training
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert sum(len(m._forward_hooks) + len(m._backward_hooks) for m in model.modules()) == 0
    params = {n: p.detach() for n, p in model.named_parameters()}
    torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (X,)))(params)


def test_state_dict_round_trip_and_mismatch():
    ours, full, X = fit_pair("mlp-classification")
    ours.prior_precision = 1.3
    state = ours.state_dict()
    model2 = _mlp(3).double()
    model2.load_state_dict(ours.model.state_dict())
    la2 = LowRankGGNLaplace(model2, "classification")
    la2.load_state_dict(state)
    torch.testing.assert_close(la2.log_marginal_likelihood(), ours.log_marginal_likelihood(), **TOL)
    torch.testing.assert_close(la2(X[:3]), ours(X[:3]), **TOL)
    other = LowRankGGNLaplace(nn.Sequential(nn.Linear(3, 3)).double(), "classification")
    with pytest.raises(ValueError, match="different number of parameters"):
        other.load_state_dict(state)



def _halves(X, y, cut=14, batch_size=5):
    first = DataLoader(TensorDataset(X[:cut], y[:cut]), batch_size=batch_size)
    second = DataLoader(TensorDataset(X[cut:], y[cut:]), batch_size=batch_size)
    return first, second


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("name", ["mlp-classification", "cnn-regression"])
def test_online_update_equals_full_laplace_online(name, dense, monkeypatch):
    """fit(A); move the parameters; fit(B, override=False) as laplace-torch's FullLaplace."""
    if dense:
        set_tuning(monkeypatch, dense_max_dim=2048)
    model, likelihood, X, y, _ = make_problem(name)
    first, second = _halves(X, y)
    ours = Laplace(model, likelihood, subset_of_weights="all", hessian_structure="lowrank_ggn",
                   rank=1000, prior_precision=0.7)
    full = FullLaplace(model, likelihood, prior_precision=0.7)
    ours.fit(first)
    fit_reference(full, first)
    with torch.no_grad():  # an online learner moves on before the next update
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ours.fit(second, override=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        full.fit(second, override=False)
    finally:
        torch.set_default_dtype(old)
    assert ours.n_data == full.n_data == len(X)
    scale = full.H.abs().max()
    torch.testing.assert_close(dense_H(ours), full.H, rtol=1e-5, atol=1e-8 * scale)
    torch.testing.assert_close(ours.mean, full.mean, **TOL)
    torch.testing.assert_close(ours.loss, torch.as_tensor(full.loss, dtype=torch.float64), **TOL)
    torch.testing.assert_close(ours.log_marginal_likelihood(), full.log_marginal_likelihood(),
                               **TOL)
    torch.testing.assert_close(ours(X[:4], pred_type="glm"), full(X[:4], pred_type="glm"), **TOL)


def test_online_update_truncated_merges_the_two_fits(tune):
    """Truncated: the top-r of the two rank-r fits' sum, with the exact residual diagonal."""
    model, likelihood, X, y, _ = make_problem("cnn-regression", n=40)
    first, second = _halves(X, y, cut=22)
    tune(oversampling=0.75)
    kwargs = dict(rank=4, residual="diagonal")
    parts = [LowRankGGNLaplace(model, likelihood, **kwargs) for _ in range(2)]
    parts[0].fit(first)
    parts[1].fit(second)
    online = LowRankGGNLaplace(model, likelihood, **kwargs)
    online.fit(first)
    online.fit(second, override=False)
    both = sum(dense_H(la) for la in parts)
    evals, evecs = torch.linalg.eigh(both)
    top = evecs[:, -4:] @ torch.diag(evals[-4:]) @ evecs[:, -4:].T
    torch.testing.assert_close(dense_H(online), top, rtol=1e-6, atol=1e-9 * evals[-1])
    torch.testing.assert_close(online.trace, parts[0].trace + parts[1].trace, **TOL)
    full = fit_reference(FullLaplace(model, likelihood), DataLoader(TensorDataset(X, y)))
    U, lam = online.H
    torch.testing.assert_close(online.residual_diagonal,
                               (full.H.diagonal() - (U**2) @ lam).clamp(min=0),
                               rtol=1e-6, atol=1e-9 * evals[-1])
    torch.testing.assert_close(online.loss, parts[0].loss + parts[1].loss, **TOL)



def test_online_update_continues_from_a_loaded_state():
    model, likelihood, X, y, _ = make_problem("mlp-regression")
    first, second = _halves(X, y)
    kwargs = dict(rank=4, residual="diagonal")
    la = LowRankGGNLaplace(model, likelihood, **kwargs)
    la.fit(first)
    restored = LowRankGGNLaplace(model, likelihood, **kwargs)
    restored.load_state_dict(la.state_dict())
    for obj in (la, restored):
        obj.fit(second, override=False)
    torch.testing.assert_close(dense_H(restored), dense_H(la), rtol=0, atol=0)
    torch.testing.assert_close(restored.residual_diagonal, la.residual_diagonal, rtol=0, atol=0)
    assert restored.n_data == la.n_data == len(X)
    torch.testing.assert_close(restored.log_marginal_likelihood(), la.log_marginal_likelihood())

def test_override_false_on_a_fresh_object_is_a_plain_fit():
    model, likelihood, X, y, loader = make_problem("mlp-classification")
    plain = LowRankGGNLaplace(model, likelihood, rank=5)
    plain.fit(loader)
    fresh = LowRankGGNLaplace(model, likelihood, rank=5)
    fresh.fit(loader, override=False)
    torch.testing.assert_close(dense_H(fresh), dense_H(plain), **TOL)
    assert fresh.n_data == plain.n_data == len(X)

def test_errors():
    model, likelihood, X, y, loader = make_problem("mlp-classification")
    la = LowRankGGNLaplace(model, likelihood)
    with pytest.raises(AttributeError, match="not fitted"):
        la(X[:2])
    with pytest.raises(ValueError, match="train_loader is empty"):
        la.fit(DataLoader(TensorDataset(X[:0], y[:0]), batch_size=4))
    with pytest.raises(ValueError, match="needs a .dataset"):
        la.fit([(X, y)])
    last = LowRankGGNLLLaplace(model, likelihood)
    with pytest.raises(ValueError, match="override=False"):  # as laplace-torch's LLLaplace
        last.fit(loader, override=False)
    from laplace.curvature import BackPackEF, BackPackGGN, CurvlinopsEF, CurvlinopsHessian

    for cls in (LowRankGGNLaplace, LowRankGGNLLLaplace):
        for ef in (BackPackEF, CurvlinopsEF):
            with pytest.raises(ValueError, match=f"backend={ef.__name__} asks for the empir"):
                cls(model, likelihood, backend=ef)
        with pytest.raises(ValueError, match="backend=CurvlinopsHessian asks for the Hessian"):
            cls(model, likelihood, backend=CurvlinopsHessian)
        with pytest.raises(ValueError, match="pass mc_samples=1"):
            cls(model, likelihood, backend=BackPackGGN, backend_kwargs={"stochastic": True})
        cls(model, likelihood, backend=BackPackGGN, backend_kwargs={"stochastic": True},
            mc_samples=1)  # consistent: accepted
    with pytest.raises(ValueError, match="integer class targets"):
        la.fit(DataLoader(TensorDataset(X, y.double()), batch_size=4))
    reg = LowRankGGNLaplace(model, "regression")
    with pytest.raises(ValueError, match="floating-point targets"):
        reg.fit(loader)
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        LowRankGGNLaplace(model, likelihood, rank=0)
    with pytest.raises(ValueError, match="memory_budget=10 bytes is too small for one sample"):
        LowRankGGNLaplace(model, likelihood, memory_budget=10).fit(loader)
    with pytest.raises(ValueError, match="micro_batch_size must be a positive integer"):
        LowRankGGNLaplace(model, likelihood, micro_batch_size=0)
    with pytest.raises(ValueError, match="memory_budget must be positive"):
        LowRankGGNLaplace(model, likelihood, memory_budget=-1.0).fit(loader)
    with pytest.raises(ValueError, match="subsample_fraction must lie in"):
        LowRankGGNLaplace(model, likelihood, subsample_fraction=1.5)
    bad = X.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="hold NaN or infinite values"):
        la.fit(DataLoader(TensorDataset(bad, y), batch_size=4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_device_and_dtype(device, dtype):
    model, likelihood, X, y, _ = make_problem("cnn-classification")
    model = model.to(device=device, dtype=dtype)
    loader = DataLoader(TensorDataset(X.to(device, dtype), y.to(device)), batch_size=8)
    la = LowRankGGNLaplace(model, likelihood, rank=50)
    la.fit(loader)
    probs = la(X[:3].to(device, dtype))
    assert probs.device.type == device and probs.dtype == dtype
    assert la.H[0].device.type == device and la.H[0].dtype == dtype
    assert torch.isfinite(la.log_marginal_likelihood())


def test_exported_names():
    assert ll.LowRankGGNLaplace is LowRankGGNLaplace
    assert LowRankGGNLaplace._key == ("all", "lowrank_ggn")
    assert LowRankGGNLLLaplace._key == ("last_layer", "lowrank_ggn")
    import lowrank_laplace.factor
    from lowrank_laplace.engine import FactorEngine

    assert FactorEngine is ll.FactorEngine
    # the engine imports factor, never the reverse (no import cycle, no re-export)
    assert not hasattr(lowrank_laplace.factor, "FactorEngine")


def test_diagonal_correction_against_dense_reference(tune):
    model, likelihood, X, y, loader = make_problem("cnn-regression", n=40, batch_size=16)
    full = fit_reference(FullLaplace(model, likelihood), loader)
    tune(oversampling=8.0)
    la = LowRankGGNLaplace(model, likelihood, rank=5, residual="diagonal")
    la.fit(loader)
    U, lam = la.H
    residual = full.H.diagonal() - (U**2) @ lam
    torch.testing.assert_close(la.residual_diagonal, residual.clamp(min=0), rtol=1e-6, atol=1e-9)
    assert residual.min() > -1e-9  # the dropped curvature is PSD, so its diagonal too
    for prior in (torch.tensor(0.8, dtype=torch.float64),
                  torch.rand(la.n_params, dtype=torch.float64) + 0.3):
        for sigma in (1.0, 0.7):
            la.prior_precision, la.sigma_noise = prior, sigma
            full.prior_precision, full.sigma_noise = prior, sigma
            h = 1 / sigma**2
            d = full.prior_precision_diag + h * la.residual_diagonal
            P = h * U @ torch.diag(lam) @ U.T + torch.diag(d)
            torch.testing.assert_close(la.log_det_posterior_precision, torch.logdet(P), **TOL)
            expected = (full.log_likelihood
                        - 0.5 * (torch.logdet(P) - full.log_det_prior_precision + full.scatter))
            torch.testing.assert_close(la.log_marginal_likelihood(), expected, **TOL)
            Js, f_mu = full.backend.jacobians(X[:6])
            cov = torch.linalg.inv(P)
            mu, var = la(X[:6], pred_type="glm")
            torch.testing.assert_close(mu, f_mu, **TOL)
            torch.testing.assert_close(var, Js @ cov @ Js.transpose(1, 2), **TOL)
            eye = torch.eye(la.n_params, dtype=torch.float64)
            S = (la.sample_from_noise(eye) - la.mean).T
            torch.testing.assert_close(S @ S.T, cov, rtol=1e-5, atol=1e-8 * cov.abs().max())
            torch.testing.assert_close(la.posterior_covariance, cov, rtol=1e-5,
                                       atol=1e-8 * cov.abs().max())
            torch.testing.assert_close(la.posterior_variance, cov.diagonal(), **TOL)


def test_diagonal_correction_vanishes_at_full_rank():
    model, likelihood, X, y, loader = make_problem("mlp-classification")
    la = LowRankGGNLaplace(model, likelihood, rank=1000, residual="diagonal")
    la.fit(loader)
    full = fit_reference(FullLaplace(model, likelihood), loader)
    assert la.residual_diagonal.abs().max() < 1e-10 * full.H.abs().max()
    torch.testing.assert_close(la.log_marginal_likelihood(), full.log_marginal_likelihood(), **TOL)
    torch.testing.assert_close(la(X[:4]), full(X[:4]), **TOL)


@pytest.mark.dense
@pytest.mark.parametrize("name", ["mlp-classification", "cnn-regression"])
def test_dense_path_for_small_models(name):
    """Up to dense_max_dim parameters the GGN is summed densely: exact, also truncated."""
    model, likelihood, X, y, loader = make_problem(name)
    full = fit_reference(FullLaplace(model, likelihood), loader)
    la = LowRankGGNLaplace(model, likelihood, rank=1000, residual="diagonal")
    la.fit(loader)
    torch.testing.assert_close(dense_H(la), full.H, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(la.trace, torch.trace(full.H), **TOL)
    torch.testing.assert_close(la.log_marginal_likelihood(), full.log_marginal_likelihood(), **TOL)
    # truncated: exactly the dense top 3, and the exact residual diagonal
    top = LowRankGGNLaplace(model, likelihood, rank=3, residual="diagonal")
    top.fit(loader)
    evals, evecs = torch.linalg.eigh(full.H)
    U, lam = evecs.flip(1)[:, :3], evals.flip(0)[:3]
    torch.testing.assert_close(top.H[1], lam, rtol=1e-9, atol=0)
    torch.testing.assert_close(dense_H(top), U @ torch.diag(lam) @ U.T, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(top.residual_diagonal,
                               (torch.diagonal(full.H) - (U**2) @ lam).clamp(min=0),
                               rtol=1e-7, atol=1e-10)


def test_last_layer_state_dict_into_a_fresh_object():
    """As laplace-torch's own serialisation test: the new object finds its last layer."""
    model, likelihood, X, y, loader = make_problem("mlp-classification")
    la = Laplace(model, likelihood, subset_of_weights="last_layer",
                 hessian_structure="lowrank_ggn")
    la.fit(loader)
    fresh = Laplace(model, likelihood, subset_of_weights="last_layer",
                    hessian_structure="lowrank_ggn")
    fresh.load_state_dict(la.state_dict())
    assert fresh.n_params == la.n_params
    torch.testing.assert_close(fresh(X[:4]), la(X[:4]), **TOL)
    torch.testing.assert_close(fresh.log_marginal_likelihood(), la.log_marginal_likelihood(),
                               **TOL)


@pytest.mark.filterwarnings("ignore:solver='sketch' has not converged")
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_state_is_flat_and_loads_without_pickle(subset, tmp_path, tune):
    """laplace-torch's ``test_serialize_no_pickle`` (a weights-only load, flat values), with
    every optional part present: the sketch's check, the measured complement, the null
    directions and the quadrature. A state of the earlier nested form loads the same."""
    from lowrank_laplace.laplace_torch.persistence import PARTS, unflatten

    tune(dense_max_dim=0)
    model, likelihood, X, y, loader = make_problem("mlp-classification", n=60, batch_size=16)
    # passes of 2 samples: one streaming merge must not cover the data
    kwargs = dict(subset_of_weights=subset, hessian_structure="lowrank_ggn", rank=3,
                  solver="sketch", micro_batch_size=2)
    la = Laplace(model, likelihood, **kwargs)
    la.fit(loader)
    la.refine_complement(loader)
    la.optimize_prior_precision()
    assert la.fit_report.check is not None and la._null is not None
    assert la._quadrature is not None and la._quadrature.passes == 1
    assert la._fitted_data.loss is not None and la._fitted_data.target_energy is not None
    torch.save(la.state_dict(), tmp_path / "state.bin")
    state = torch.load(tmp_path / "state.bin", weights_only=True)
    own = set(state) - set(ParametricLaplace.state_dict(la))  # laplace-torch's keys are its own
    for key in own:
        if state[key] is not None:
            assert isinstance(state[key], (list, tuple, int, float, str, bool, torch.Tensor)), key
    nested = {k: v for k, v in state.items() if k.split(".")[0] not in PARTS}
    nested.update({part: unflatten(state, part) for part in PARTS})
    for saved in (state, nested):
        fresh = Laplace(model, likelihood, **kwargs)
        fresh.load_state_dict(saved)
        assert fresh.fit_report == la.fit_report
        assert fresh._quadrature.steps == la._quadrature.steps
        assert fresh._fitted_data == la._fitted_data
        torch.testing.assert_close(fresh.log_marginal_likelihood(),
                                   la.log_marginal_likelihood(), **TOL)
        torch.testing.assert_close(fresh(X[:4]), la(X[:4]), **TOL)


class _FailingLoader:
    """Yields its first batch, then raises (a broken data pipeline)."""

    def __init__(self, loader):
        self.loader, self.dataset = loader, loader.dataset

    def __iter__(self):
        batches = iter(self.loader)
        yield next(batches)
        raise RuntimeError("disk gone")


def test_fit_is_transactional():
    model, likelihood, X, y, loader = make_problem("mlp-classification")
    la = LowRankGGNLaplace(model, likelihood, rank=5)
    la.fit(loader)
    before = (la.mean.clone(), la.H[0].clone(), la.H[1].clone(), la.n_data, la.loss, la.trace)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    with pytest.raises(RuntimeError, match="disk gone"):
        la.fit(_FailingLoader(loader))
    after = (la.mean, la.H[0], la.H[1], la.n_data, la.loss, la.trace)
    for b, a in zip(before, after):
        assert torch.equal(torch.as_tensor(b), torch.as_tensor(a))


@pytest.mark.parametrize("name, value", [("prior_precision", -1.0), ("prior_precision", 0.0),
                                         ("prior_precision", float("nan")),
                                         ("sigma_noise", 0.0), ("sigma_noise", -2.0),
                                         ("temperature", 0.0), ("temperature", float("inf"))])
def test_nonpositive_hyperparameters_are_refused_where_set(name, value):
    model = _mlp(3).double()
    with pytest.raises(ValueError, match=f"{name} must be positive and finite"):
        LowRankGGNLaplace(model, "regression", **{name: value})
    la = LowRankGGNLaplace(model, "regression")
    with pytest.raises(ValueError, match=f"{name} must be positive and finite"):
        setattr(la, name, value)
    if name == "prior_precision":  # per-parameter vectors too
        with pytest.raises(ValueError, match="prior_precision must be positive"):
            la.prior_precision = torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_sample_before_fit_says_fit_first(subset):
    model, likelihood, *_ = make_problem("mlp-classification")
    la = Laplace(model, likelihood, subset_of_weights=subset, hessian_structure="lowrank_ggn")
    with pytest.raises((ValueError, AttributeError), match="fit"):
        la.sample(3)
