"""Lanczos quadrature of the dropped curvature against dense float64 references."""

import warnings

import pytest
import torch
from laplace import FullLaplace, Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowrank_laplace import LowRankGGNLaplace
from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.factor.dense_block import SampleConcat
from lowrank_laplace.fitting.fit import FitTarget, LoaderFit
from lowrank_laplace.fitting.products import (
    FactorCache,
    FittedData,
    kept_products,
    kept_quadratic_form,
)
from lowrank_laplace.fitting.streaming import concat_factors
from lowrank_laplace.posterior import quadrature
from lowrank_laplace.posterior.quadrature import LanczosRuns
from tests import reference
from tests.laplace_torch.test_laplace import fit_reference


def _psd(dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(dim, dim, generator=g, dtype=torch.float64)
    return A @ A.T / dim, g


def test_lanczos_rules_are_exact_quadratic_forms_once_the_krylov_space_is_full():
    A, g = _psd(12)
    starts = torch.randn(3, 12, generator=g, dtype=torch.float64)
    starts[2] = 0  # a run without steps
    runs = LanczosRuns(starts, 15)
    for _ in range(15):  # past the dimension: the runs end themselves
        runs.step(runs.current @ A)
    assert runs.length.tolist() == [12, 12, 0] and not runs.active.any()
    for (theta, weight), b in zip(runs.rules()[0][:2], starts):
        for delta in (0.01, 1.0):
            exact = b @ torch.linalg.solve(A + delta * torch.eye(12, dtype=A.dtype), b)
            assert float((weight / (theta + delta)).sum()) == pytest.approx(float(exact),
                                                                           rel=1e-9)
    assert runs.rules()[0][2][0].numel() == 0


def test_a_start_in_a_small_invariant_subspace_ends_early():
    """A run that ends early keeps its own rule beside a full one (rules of each length
    come from one batched eigendecomposition)."""
    A = torch.diag(torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64))
    starts = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    runs = LanczosRuns(starts, 4)
    for _ in range(4):
        runs.step(runs.current @ A)
    (theta, weight), (theta_full, weight_full) = runs.rules()[0]
    assert runs.length.tolist() == [2, 4]
    torch.testing.assert_close(theta, torch.tensor([2.0, 3.0], dtype=torch.float64))
    torch.testing.assert_close(weight, torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(theta_full, A.diagonal().sort().values)
    torch.testing.assert_close(weight_full, torch.ones(4, dtype=torch.float64))

@pytest.mark.parametrize("zeros", [0, 20])
def test_gauss_and_gauss_radau_rules_bracket_the_exact_quadratic_forms(zeros):
    """Against the dense solve and eigendecomposition: Gauss under, Gauss-Radau (node at 0)
    over ``b^T (hA + delta)^{-1} b``, the other way round for ``log(1 + h lambda / delta)``;
    the kept midpoint rule (both at half weight) is within half the bracket, which closes."""
    A, g = _psd(60, seed=3)
    if zeros:  # a null space, as the deflated GGN has: the Radau node's own eigenvalue
        Q = torch.linalg.qr(torch.randn(60, 60, generator=g, dtype=A.dtype))[0]
        lam = torch.linalg.eigvalsh(A)
        lam[:zeros] = 0
        A = (Q * lam) @ Q.T
    starts = torch.randn(2 * quadrature.RUNS, 60, generator=g, dtype=torch.float64)
    lam, vecs = torch.linalg.eigh(A)
    energy = (starts @ vecs) ** 2  # each start's weight on each eigenvalue
    runs, widths = LanczosRuns(starts, 8), []
    for _ in range(8):
        runs.step(runs.current @ A)
        for h, delta in ((1.0, 0.05), (2.0, 1.0)):
            exact = [float((energy[: quadrature.RUNS] / (h * lam.clamp(min=0) + delta)).sum()
                           / energy[: quadrature.RUNS].sum()),
                     float((energy[quadrature.RUNS:] * torch.log1p(h * lam.clamp(min=0) / delta)
                            ).sum() / energy[quadrature.RUNS:].sum())]
            rules = runs.rules()
            gauss = quadrature.gauss_estimates(rules[0], h, delta)
            radau = quadrature.gauss_estimates(rules[1], h, delta)
            assert gauss[0] <= exact[0] * (1 + 1e-9) and radau[0] >= exact[0] * (1 - 1e-9)
            assert gauss[1] >= exact[1] * (1 - 1e-9) and radau[1] <= exact[1] * (1 + 1e-9)
            width = quadrature.bracket_width(rules, h, delta)
            for estimate, value in zip(quadrature.gauss_estimates(
                    [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]) / 2)
                     for a, b in zip(*rules)], h, delta), exact):
                assert abs(estimate - value) <= width * abs(estimate) * (1 + 1e-6) + 1e-12
        widths.append(quadrature.bracket_width(runs.rules(), 1.0, 0.05))
    assert widths[-1] < widths[0] / 10



def _problem(likelihood="classification"):
    torch.manual_seed(0)
    X = torch.randn(600, 6, dtype=torch.float64)
    out = 3 if likelihood == "classification" else 2
    y = torch.randint(0, 3, (600,)) if likelihood == "classification" \
        else torch.randn(600, 2, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, out)).double()
    return model, X, y, DataLoader(TensorDataset(X, y), batch_size=100)


def _products(la, model, loader, Qs, room):
    """``H Q^T`` of each ``Q`` in turn through the fit's loop, a cache of ``room`` bytes."""
    target = FitTarget(model, "classification", la.params)
    with LoaderFit(target, la.options.at_rank(5)) as run:
        products = run.products(loader, FittedData(len(loader.dataset)))
        products.cache.room = room
        return [products(Q) for Q in Qs], products


@pytest.mark.parametrize("room", [2**30, 1000, 0])
def test_the_ggn_products_are_the_dense_ggn_whether_the_factors_are_kept_or_not(room):
    """A cache the factors fit is used from the second pass on; one they overflow is not."""
    model, X, y, loader = _problem()
    la = LowRankGGNLaplace(model, "classification", rank=5)
    G = reference.ggn(model, nn.CrossEntropyLoss(reduction="sum"), X, y)
    Qs = [torch.randn(4, G.shape[0], dtype=torch.float64) for _ in range(3)]
    products, run = _products(la, model, loader, Qs, room)
    cache = run.cache
    assert cache.complete == (room == 2**30) and bool(cache.kept) == cache.complete
    assert run.passes == (1 if cache.complete else len(Qs))
    for product, Q in zip(products, Qs):
        torch.testing.assert_close(product, Q @ G, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("solver, dense_max_dim", [("sketch", 0), ("streaming", 0),
                                                   ("auto", 2048)])
def test_the_fits_kept_factors_multiply_by_the_dense_ggn(tune, solver, dense_max_dim):
    """Whatever solver took the fit's factors, the kept ones are the whole GGN, unchanged."""
    tune(dense_max_dim=dense_max_dim)
    model, X, y, loader = _problem()
    la = LowRankGGNLaplace(model, "classification", rank=5, solver=solver)
    G = reference.ggn(model, nn.CrossEntropyLoss(reduction="sum"), X, y)
    Q = torch.randn(4, G.shape[0], dtype=torch.float64)
    target = FitTarget(model, "classification", la.params)
    with LoaderFit(target, la.options, keep_factors=True) as run:
        run.run(loader)
        assert run.cache.complete and run.plan.path == ("dense" if dense_max_dim else solver)
        # blocks of several passes were made one matrix for the products
        blocks = [b for f, _ in run.cache.kept for b in f.blocks.values()]
        assert not any(isinstance(b, SampleConcat) for b in blocks)
        products = run.products(loader, FittedData(len(X)))
        torch.testing.assert_close(products(Q), Q @ G, rtol=1e-9, atol=1e-10)
    assert products.passes == 0


def test_closing_the_pass_makes_concatenated_blocks_one_matrix():
    """``FactorCache.close_pass``: a factor of two passes' blocks multiplies as before."""
    model, X, y, _ = _problem()
    with FactorEngine(model, nn.CrossEntropyLoss(reduction="sum")) as engine:
        factors = [engine.compute(X[i:i + 50], y[i:i + 50]) for i in (0, 50)]
    cache = FactorCache(2**30)
    cache.offer(concat_factors(factors, [1.0, 2.0]), 0.5)
    assert any(isinstance(b, SampleConcat) for b in cache.kept[0][0].blocks.values())
    Q = torch.randn(3, sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    before = kept_products(Q, cache.kept, torch.float64)
    cache.close_pass()
    assert cache.complete
    assert not any(isinstance(b, SampleConcat) for b in cache.kept[0][0].blocks.values())
    torch.testing.assert_close(kept_products(Q, cache.kept, torch.float64), before,
                               rtol=1e-12, atol=1e-12 * before.abs().max())
    G = sum(scale * reference.ggn(model, nn.CrossEntropyLoss(reduction="sum"),
                                  X[i:i + 50], y[i:i + 50]) for i, scale in ((0, 0.5), (50, 1.0)))
    torch.testing.assert_close(before, Q @ G, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(kept_quadratic_form(Q, cache.kept, torch.float64), Q @ G @ Q.T,
                               rtol=1e-9, atol=1e-10)


def test_low_memory_passes_recompute_the_same_products(tune):
    """A low-memory fit's passes recompute ``V`` for ``V (V^T Q)``: nothing to keep."""
    tune(dense_max_dim=0)  # a dense sum would drop low_memory
    model, X, y, loader = _problem()
    la = LowRankGGNLaplace(model, "classification", rank=5, low_memory=True)
    G = reference.ggn(model, nn.CrossEntropyLoss(reduction="sum"), X, y)
    Qs = [torch.randn(4, G.shape[0], dtype=torch.float64) for _ in range(2)]
    products, run = _products(la, model, loader, Qs, 2**30)
    assert not run.cache.complete and run.passes == 2
    for product, Q in zip(products, Qs):
        torch.testing.assert_close(product, Q @ G, rtol=1e-9, atol=1e-10)


def test_monte_carlo_passes_multiply_by_the_same_matrix_kept_or_recomputed():
    model, X, y, loader = _problem()
    la = LowRankGGNLaplace(model, "classification", rank=5, mc_samples=1)
    Q = torch.randn(4, la.n_params, dtype=torch.float64)
    kept, run = _products(la, model, loader, [Q, Q], 2**30)
    fresh, _ = _products(la, model, loader, [Q, Q], 0)
    assert run.cache.complete
    for product in kept[1:] + fresh:
        torch.testing.assert_close(product, kept[0], rtol=1e-12, atol=1e-12)


def _exact_starts(la, loader, count, dim):
    """The Jacobian starts of the first ``count`` inputs, as the quadrature draws them."""
    target = FitTarget(la.model, "classification", la.params)
    generator = torch.Generator().manual_seed(0)
    torch.randn(quadrature.RUNS, dim, generator=generator, dtype=torch.float64)  # Gaussian
    with LoaderFit(target, la.options.at_rank(6)) as run:
        inputs = run.first_inputs(loader, count)
        return quadrature._jacobian_starts(run.jacobian, inputs, la.options, 3, generator)


def test_the_complement_variance_is_the_exact_deflated_quadratic_form(monkeypatch):
    """Run to the end of every Krylov space: the Gauss rule is then exact. The fit's own
    measurement multiplies its Jacobian runs by the GGN without their 150 inputs (a
    quarter of the data), scaled back to ``N``; ``refine_complement``'s passes by the
    whole GGN. Both Gaussian runs give the spectrum of the whole deflated GGN."""
    monkeypatch.setattr(quadrature, "MAX_STEPS", 80)
    monkeypatch.setattr(quadrature, "MIN_STEPS", 80)
    model, X, y, loader = _problem()
    la = LowRankGGNLaplace(model, "classification", rank=6)
    la.fit(loader)
    fitted = la._quadrature
    assert fitted.samples == (150, 600, 600) and fitted.passes == 0
    la.refine_complement(loader)
    refined = la._quadrature
    assert refined.passes == 1 and refined.samples == (0, 600, 600)
    U, null, dim = la.H[0], la._null, la.n_params
    loss = nn.CrossEntropyLoss(reduction="sum")
    G = reference.ggn(model, loss, X, y)
    held_out = (G - reference.ggn(model, loss, X[:150], y[:150])) * 600 / (600 - 150)
    P = torch.eye(dim, dtype=torch.float64) - U @ U.T
    if null is not None:
        P = P - null.expand(null.project(torch.eye(dim, dtype=torch.float64)), dim)
    for found, matrix, count in ((fitted, held_out, 150), (refined, G, 256)):
        starts = _exact_starts(la, loader, count, dim) @ P
        assert found.converged and found.steps < 80
        for h, delta in ((1.0, 1.0), (1.0, 0.05), (0.5, 3.0)):
            solve = torch.linalg.solve(h * P @ matrix @ P + delta * torch.eye(dim, dtype=P.dtype),
                                       starts.T)
            exact = float((starts.T * solve).sum() / (starts**2).sum())
            got = found.variance(torch.tensor(h), torch.tensor(delta, dtype=torch.float64),
                                 1e300)  # no lower clamp
            assert float(got) == pytest.approx(exact, rel=1e-5)
        # the Gaussian runs' nodes are eigenvalues of P G P, their counts its free directions
        exact_eigs = torch.linalg.eigvalsh(P @ G @ P)
        weighty = found.nodes[found.counts > 1e-6 * found.counts.sum()]
        gaps = (weighty[:, None] - exact_eigs[None]).abs().min(1).values
        assert float(gaps.max()) < 1e-6 * float(exact_eigs.max())
        free = dim - U.shape[1] - (0 if null is None else null.count)
        assert float(found.counts.sum()) == pytest.approx(free, rel=1e-10)
    for h, delta in ((1.0, 1.0), (0.5, 0.05)):
        args = (torch.tensor(h), torch.tensor(delta, dtype=torch.float64), dim - 6)
        assert float(fitted.logdet(*args)) == pytest.approx(float(refined.logdet(*args)),
                                                             rel=1e-8)


@pytest.mark.parametrize("likelihood, marglik, fvar", [("classification", 0.01, 0.08),
                                                       ("regression", 0.025, 0.45)])
def test_the_measured_posterior_is_closer_to_the_full_ggn_one(likelihood, marglik, fvar):
    """Against the mean dropped eigenvalue in every dropped direction (nothing measured),
    the marglik moves to the full GGN's at the fit's prior and a tenth of it, and the
    median functional variance of fresh inputs at the fit's prior (below the prior the
    runs were checked at, half the fit's, the Gauss rule may under-state it).

    (The regression problem's complement is spread over directions the inputs weight
    unevenly, which one variance per unit of energy cannot follow.)
    """
    model, X, y, loader = _problem(likelihood)
    full = fit_reference(FullLaplace(model, likelihood), loader)
    la = LowRankGGNLaplace(model, likelihood, rank=6)
    la.fit(loader)
    X_new = torch.randn(40, 6, dtype=torch.float64)

    def errors():
        out = []
        for prior in (1.0, 0.1):
            la.prior_precision = full.prior_precision = prior
            exact = float(full.log_marginal_likelihood())
            out.append(abs(float(la.log_marginal_likelihood()) - exact) / abs(exact))
            var = la._glm_predictive_distribution(X_new)[1].diagonal(dim1=1, dim2=2).sum(1)
            ref = full._glm_predictive_distribution(X_new)[1].diagonal(dim1=1, dim2=2).sum(1)
            out.append(float(((var - ref).abs() / ref).median()))
        return out

    after = errors()
    assert la.fit_report.quadrature_steps >= quadrature.MIN_STEPS
    la._quadrature, la._residual_model = None, None  # nothing measured
    before = errors()
    assert max(after[0], after[2]) < marglik  # at both priors
    assert after[0] < before[0] / 2 and after[2] < before[2] / 2
    assert after[1] < fvar and after[1] < before[1] / 1.5


def test_refinement_is_saved_refused_and_discarded():
    model, X, y, loader = _problem()
    la = Laplace(model, "classification", subset_of_weights="all",
                 hessian_structure="lowrank_ggn", rank=6)
    with pytest.raises(AttributeError, match="fit"):
        la.refine_complement(loader)
    la.fit(loader)
    one = torch.tensor(1.0, dtype=torch.float64)
    own = float(la.residual_model.complement_variance(one, one))
    la.refine_complement(loader)
    marglik = float(la.log_marginal_likelihood())
    refined = float(la.residual_model.complement_variance(one, one))
    assert refined < own  # in sample: the training inputs' own curvature lowers it
    loaded = Laplace(model, "classification", subset_of_weights="all",
                     hessian_structure="lowrank_ggn", rank=6)
    loaded.load_state_dict(la.state_dict())
    assert float(loaded.log_marginal_likelihood()) == pytest.approx(marglik, rel=1e-12)
    assert loaded.fit_report.quadrature_steps == la.fit_report.quadrature_steps
    assert loaded.fit_report.quadrature_passes == 1
    la.fit(loader)  # a new fit measures afresh, on its own factors
    assert la._quadrature.passes == 0 and la.fit_report.quadrature_passes == 0
    assert float(la.residual_model.complement_variance(one, one)) == pytest.approx(own)
    other = LowRankGGNLaplace(model, "classification", rank=6, residual="isotropic")
    other.fit(loader)
    with pytest.raises(ValueError, match="residual='spectral'"):
        other.refine_complement(loader)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        la.refine_complement(loader)


def test_a_monte_carlo_fit_is_measured_on_its_own_draws():
    """A pass would draw another Monte-Carlo GGN than the kept eigenpairs': the fit measures
    on its own kept factors, and ``refine_complement`` refuses."""
    model, X, y, loader = _problem()
    la = LowRankGGNLaplace(model, "classification", rank=6, mc_samples=1)
    la.fit(loader)
    assert la.fit_report.quadrature_steps > 0 and la.fit_report.quadrature_passes == 0
    with pytest.raises(ValueError, match="mc_samples=0 to refine"):
        la.refine_complement(loader)


def test_a_second_refinement_measures_at_the_new_prior():
    """tune -> refine -> tune -> refine ends where one refinement at the tuned prior does."""
    model, X, y, loader = _problem()
    twice = LowRankGGNLaplace(model, "classification", rank=6)
    twice.fit(loader)
    twice.prior_precision = 5.0
    twice.refine_complement(loader)
    twice.prior_precision = 0.5
    twice.refine_complement(loader)
    once = LowRankGGNLaplace(model, "classification", rank=6, prior_precision=0.5)
    once.fit(loader)
    once.refine_complement(loader)
    assert twice._quadrature.checked_prior == pytest.approx(once._quadrature.checked_prior)
    torch.testing.assert_close(twice.log_marginal_likelihood(), once.log_marginal_likelihood())
    X_test = X[:20]
    torch.testing.assert_close(twice._glm_predictive_distribution(X_test)[1],
                               once._glm_predictive_distribution(X_test)[1])


def test_last_layer_refinement_leaves_the_model_as_it_was():
    model, X, y, loader = _problem()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    la = Laplace(model, "classification", subset_of_weights="last_layer",
                 hessian_structure="lowrank_ggn", rank=4)
    la.fit(loader)
    la.refine_complement(loader)
    full = fit_reference(Laplace(model, "classification", subset_of_weights="last_layer",
                                 hessian_structure="full"), loader)
    assert float(la.log_marginal_likelihood()) == pytest.approx(
        float(full.log_marginal_likelihood()), rel=0.01)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())


def test_a_float32_refinement_matches_the_float64_one():
    model, X, y, _ = _problem()
    found = []
    for dtype in (torch.float32, torch.float64):
        loader = DataLoader(TensorDataset(X.to(dtype), y), batch_size=100)
        la = LowRankGGNLaplace(model.to(dtype), "classification", rank=6)
        la.fit(loader)
        la.refine_complement(loader)
        found.append((float(la.log_marginal_likelihood()), la.fit_report.quadrature_steps))
    assert found[0][1] == found[1][1]
    assert found[0][0] == pytest.approx(found[1][0], rel=1e-5)


def test_an_unconverged_quadrature_warns_with_the_number(monkeypatch):
    monkeypatch.setattr(quadrature, "MIN_STEPS", 3)
    monkeypatch.setattr(quadrature, "MAX_STEPS", 3)
    monkeypatch.setattr(quadrature, "TOLERANCE", 0.0)
    model, X, y, loader = _problem()
    la = LowRankGGNLaplace(model, "classification", rank=6)
    message = r"not converged in 3 steps at prior precision 0\.5: .* within \d+\.\d%.* after tuning"
    with pytest.warns(UserWarning, match=message) as caught:
        la.fit(loader)
    assert caught[0].filename == __file__  # points at the call of fit
    assert la.fit_report.quadrature_converged is False
    assert "not converged (to within" in str(la.fit_report)
    with pytest.warns(UserWarning, match=message):
        la.refine_complement(loader)


def test_an_online_update_is_not_measured_from_its_last_loader_alone():
    """The GGN of ``override=False`` sums every fitted loader's: measuring needs them all."""
    model, X, y, _ = _problem()
    first, second = (DataLoader(TensorDataset(X[s], y[s]), batch_size=100)
                     for s in (slice(0, 400), slice(400, 600)))
    la = LowRankGGNLaplace(model, "classification", rank=6)
    la.fit(first)
    assert la.fit_report.quadrature_steps > 0
    la.fit(second, override=False)
    assert la.fit_report.quadrature_steps == 0 and la._quadrature is None
    assert "not measured (an online update" in str(la.fit_report)
    assert "loader of all the fitted data" in str(la.fit_report)
    with pytest.raises(ValueError, match="yields 200 samples where the posterior was fitted "
                                         "on 600"):
        la.refine_complement(second)
    la.refine_complement(DataLoader(TensorDataset(X, y), batch_size=100))
    assert la.fit_report.quadrature_converged


def test_tuning_below_the_checked_prior_warns_and_a_new_refinement_clears_it():
    model, X, y, loader = _problem()
    la = LowRankGGNLaplace(model, "classification", rank=6)
    la.fit(loader)
    la.prior_precision = 100.0  # the runs converge at 50
    la.refine_complement(loader)
    assert la._quadrature.checked_prior == pytest.approx(50.0)
    with pytest.warns(UserWarning, match=r"below 50, the lowest .* la\.refine_complement"):
        la.optimize_prior_precision(method="marglik", n_steps=100, lr=0.1)
    tuned = float(la.prior_precision)
    assert tuned < 50
    la.refine_complement(loader)
    assert la._quadrature.checked_prior == pytest.approx(tuned / 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        la.optimize_prior_precision(method="marglik", n_steps=100, lr=0.1,
                                    init_prior_prec=tuned)
    assert not [w for w in caught if "Lanczos quadrature" in str(w.message)]
    loaded = LowRankGGNLaplace(model, "classification", rank=6)
    loaded.load_state_dict(la.state_dict())
    assert loaded._quadrature.checked_prior == pytest.approx(tuned / 2)


@pytest.mark.slow
def test_where_the_rank_keeps_little_of_real_data_the_measurement_tracks_the_full_ggn():
    """sklearn digits, rank 6 of D = 1,210 (kept share 0.62): the measured posterior's
    marglik prior (within 10%), functional variance on held-out images (20%) and held-out
    NLL (12%) are close to the full GGN's, and closer than the mean dropped eigenvalue's
    (``isotropic``)."""
    from sklearn.datasets import load_digits

    from tests.posterior.test_residual import _digits_problem, heldout_nll

    model, loader = _digits_problem()
    X_test = torch.tensor(load_digits().data[500:900] / 16.0, dtype=torch.float64)
    full = fit_reference(FullLaplace(model, "classification"), loader)
    full.optimize_prior_precision(method="marglik", n_steps=300, lr=0.1)
    exact = full._glm_predictive_distribution(X_test)[1].diagonal(dim1=1, dim2=2).sum(1)
    found = {}
    for residual in ("spectral", "isotropic"):
        la = LowRankGGNLaplace(model, "classification", rank=6, residual=residual)
        la.fit(loader)
        la.optimize_prior_precision(method="marglik", n_steps=300, lr=0.1)
        var = la._glm_predictive_distribution(X_test)[1].diagonal(dim1=1, dim2=2).sum(1)
        found[residual] = (la.fit_report.quadrature_steps, float(la.kept_fraction),
                           abs(float(la.prior_precision / full.prior_precision) - 1),
                           float(((var - exact).abs() / exact).median()),
                           abs(heldout_nll(la) / heldout_nll(full) - 1))
    measured, flat = found["spectral"], found["isotropic"]
    assert measured[0] >= quadrature.MIN_STEPS and measured[1] < 0.7
    assert measured[2] < 0.1 and measured[2] < flat[2] / 2, found
    assert measured[3] < 0.2 and measured[3] < flat[3], found
    # rank 6 keeps 0.62 of the trace: +9.9% here, +0.7% at rank 10 (bench_quadrature --digits)
    assert measured[4] < 0.12 and measured[4] < flat[4], found


class _Augmented(torch.utils.data.Dataset):
    """The problem's data with fresh Gaussian noise on every read (random augmentation)."""

    def __init__(self, X, y):
        self.X, self.y = X, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.X[i] + 0.1 * torch.randn_like(self.X[i]), self.y[i]


def test_a_loader_of_other_data_is_refused_before_any_lanczos_step():
    """Same count, other samples (or the same samples augmented afresh): refused; the same
    samples shuffled or batched otherwise: measured."""
    model, X, y, loader = _problem()
    la = LowRankGGNLaplace(model, "classification", rank=6)
    la.fit(loader)
    own = la._quadrature
    others = {
        "other inputs": TensorDataset(torch.randn_like(X), y),
        "other labels": TensorDataset(X, (y + 1) % 3),
        "permuted labels": TensorDataset(X, y[torch.randperm(len(y))]),
        "fresh augmentation": _Augmented(X, y),
    }
    for name, data in others.items():
        with pytest.raises(ValueError, match="does not give the samples the posterior was "
                                             "fitted on .*without random augmentation"):
            la.refine_complement(DataLoader(data, batch_size=100))
        assert la._quadrature is own and la.fit_report.quadrature_passes == 0, name
    with pytest.raises(ValueError, match="yielded no batches"):
        la.refine_complement(DataLoader(TensorDataset(X[:0], y[:0]), batch_size=100))
    loaded = LowRankGGNLaplace(model, "classification", rank=6)
    loaded.load_state_dict(la.state_dict())  # the state carries what the data gave
    with pytest.raises(ValueError, match="summed squared targets"):
        loaded.refine_complement(DataLoader(others["other labels"], batch_size=100))
    la.refine_complement(DataLoader(TensorDataset(X, y), batch_size=64, shuffle=True))
    assert la.fit_report.quadrature_passes > 0


def test_after_an_online_update_the_targets_are_checked_but_not_the_moved_loss():
    """An online update's loss sums losses at other parameters: a pass cannot reproduce it,
    while the count and the targets still tell the fitted data from other data."""
    model, X, y, _ = _problem()
    first, second = (DataLoader(TensorDataset(X[s], y[s]), batch_size=100)
                     for s in (slice(0, 400), slice(400, 600)))
    la = LowRankGGNLaplace(model, "classification", rank=6)
    la.fit(first)
    with torch.no_grad():  # an online learner moves on before the next update
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    la.fit(second, override=False)
    assert la._fitted_data.loss is None and la._fitted_data.samples == 600
    with pytest.raises(ValueError, match="summed squared targets"):
        la.refine_complement(DataLoader(TensorDataset(X, (y + 1) % 3), batch_size=100))
    la.refine_complement(DataLoader(TensorDataset(X, y), batch_size=100))
    assert la.fit_report.quadrature_steps > 0


def test_a_fit_on_a_loader_that_augments_afresh_is_measured_on_its_own_factors(monkeypatch):
    """The fit's kept factors are its own draw of the data: no pass draws another. Where
    they do not fit the budget nothing is measured, and the report says why."""
    model, X, y, _ = _problem()
    la = LowRankGGNLaplace(model, "classification", rank=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        la.fit(DataLoader(_Augmented(X, y), batch_size=100))
    assert la.fit_report.quadrature_steps > 0 and la.fit_report.quadrature_passes == 0
    for module in ("fitting.fit", "fitting.products"):
        monkeypatch.setattr(f"lowrank_laplace.{module}.CACHE_SHARE", 0)
    la = LowRankGGNLaplace(model, "classification", rank=6)
    la.fit(DataLoader(_Augmented(X, y), batch_size=100))
    assert la._quadrature is None and la.fit_report.quadrature_steps == 0
    assert "not measured (the fit kept no factors: fewer than 256 inputs' fit half of" \
        in str(la.fit_report)
    assert la.fit_report.refinable


@pytest.mark.parametrize("seed", [2**63 - 1, -2**63])
def test_the_extreme_seeds_fit_and_measure(seed):
    """The passes add batch offsets to the seed: the accepted range leaves room for them."""
    model, X, y, loader = _problem()
    LowRankGGNLaplace(model, "classification", rank=6, seed=seed, mc_samples=1).fit(loader)
    la = LowRankGGNLaplace(model, "classification", rank=6, seed=seed)
    la.fit(loader)
    assert la.fit_report.quadrature_steps > 0


def test_the_memory_budget_caps_the_steps_and_the_kept_inputs(monkeypatch):
    """A budget whose Lanczos basis holds fewer than MAX_STEPS steps runs as many as it
    holds (and says so where they do not converge); one whose half keeps the factors of
    fewer than MIN_PARTIAL inputs keeps none and measures nothing, saying why."""
    monkeypatch.setattr(quadrature, "TOLERANCE", 0.0)  # run to the cap
    model, X, y, _ = _problem()
    dim = sum(p.numel() for p in model.parameters())
    budget = 300_000  # (25 + 3) steps' basis; half of it keeps 60 inputs' factors
    steps = budget // (2 * quadrature.RUNS * dim * 8) - 3
    assert quadrature.MIN_STEPS <= steps < quadrature.MAX_STEPS
    small = DataLoader(TensorDataset(X[:60], y[:60]), batch_size=20)
    la = LowRankGGNLaplace(model, "classification", rank=6, memory_budget=budget)
    with pytest.warns(UserWarning, match="all that memory_budget holds"):
        la.fit(small)
    assert la.fit_report.quadrature_steps == steps
    assert la.fit_report.quadrature_samples == (15, 60, 60)
    la = LowRankGGNLaplace(model, "classification", rank=6, memory_budget=budget)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=20))
    assert la.dropped_quadrature is None
    assert la.fit_report.not_measured.startswith("the fit kept no factors: fewer than 256")


def test_a_state_of_the_earlier_version_loads():
    """The earlier version saved the Jacobian rule under ``quadrature.complement`` and its
    error estimate as ``quadrature_moved``: a refined state keeps its spectrum and reads
    that as ``quadrature_error``, an unrefined one loads unmeasured, saying so; both
    reports print."""
    model, X, y, loader = _problem()
    la = LowRankGGNLaplace(model, "classification", rank=6)
    la.fit(loader)
    state = la.state_dict()
    old = {k: v for k, v in state.items() if not k.startswith(("quadrature.",
                                                                "fit_report.quadrature_e"))}
    old.update({"quadrature.complement.mu": state["quadrature.mu"],
                "quadrature.complement.q": state["quadrature.q"],
                "quadrature.complement.fraction": 1.0, "jacobian_exponent": 0.3,
                "fit_report.complement_resolved": None, "fit_report.quadrature_moved": 0.004,
                "measured_complement.mu": state[
                    "quadrature.mu"]})
    old.update({f"quadrature.{k}": state[f"quadrature.{k}"]
                for k in ("nodes", "counts", "steps", "converged", "seconds")})
    unrefined = {k: v for k, v in old.items() if not k.startswith("quadrature.")}
    unrefined.update({"fit_report.quadrature_steps": 0, "fit_report.quadrature_converged": None})
    for saved, measured in ((old, True), (unrefined, False)):
        loaded = LowRankGGNLaplace(model, "classification", rank=6)
        loaded.load_state_dict(saved)
        assert (loaded.dropped_quadrature is not None) == measured
        text = str(loaded.fit_report)
        assert ("saved by an earlier version" in text) == (not measured)
        if measured:
            assert loaded.fit_report.quadrature_error == 0.004
            torch.testing.assert_close(loaded.log_marginal_likelihood(),
                                       la.log_marginal_likelihood())
