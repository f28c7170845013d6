"""Warm starts: a posterior's refit after its model moved sketches from its last fit."""

import pytest
import torch
from laplace import Laplace
from laplace.marglik_training import marglik_training
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lowrank_laplace  # noqa: F401  (registers hessian_structure="lowrank_ggn")
from lowrank_laplace.fitting import plan
from lowrank_laplace.fitting.config import FitConfig
from lowrank_laplace.fitting.plan import FitPlan, make_solver
from lowrank_laplace.fitting.sketch import SketchMerge
from lowrank_laplace.laplace_torch import LowRankGGNLaplace
from tests.reference import ggn

RANK = 5


def _problem(seed=0, n=200):
    """A 283-weight MLP on 200 points, where ``solver="auto"`` sketches 20 columns.

    The inputs span two dimensions, so the GGN's spectrum decays within the sketch's
    columns and its convergence check passes (a flat one would stream instead).
    """
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 20), nn.Tanh(), nn.Linear(20, 3)).double()
    X = torch.randn(n, 2, dtype=torch.float64) @ torch.randn(2, 10, dtype=torch.float64)
    y = torch.randint(0, 3, (n,))
    return model, X, y, DataLoader(TensorDataset(X, y), batch_size=50)


@pytest.fixture(autouse=True)
def streaming(tune):
    tune(dense_max_dim=0)


def _laplace(model, **kw):
    return Laplace(model, "classification", subset_of_weights="all",
                   hessian_structure="lowrank_ggn", rank=RANK, **kw)


def _move(model, scale=0.05, seed=1):
    """A training step's worth of change."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _exact_top(model, X, y, k=RANK):
    G = ggn(model, nn.CrossEntropyLoss(reduction="sum"), X, y)
    return torch.linalg.eigvalsh(G).flip(0)[:k]


def test_unchanged_weights_refit_cold_and_identically():
    model, X, y, loader = _problem()
    first = _laplace(model)
    first.fit(loader)
    assert first.fit_path == "sketch" and not first.warm_started
    second = _laplace(model)  # built while the first is alive, same weights
    second.fit(loader)
    first.fit(loader)  # the same object again
    assert not second.warm_started and not first.warm_started
    torch.testing.assert_close(second.H[1], first.H[1], rtol=0, atol=0)
    torch.testing.assert_close(second.H[0], first.H[0], rtol=0, atol=0)


def test_a_fit_does_not_depend_on_other_live_posteriors():
    """A new posterior fitted after the model moved starts cold, whatever else is alive:
    the same answer as a fit with no other posterior around."""
    model, X, y, loader = _problem()
    first = _laplace(model)
    first.fit(loader)
    _move(model)
    beside = _laplace(model)  # built and fitted while the first is alive
    beside.fit(loader)
    del first
    alone = _laplace(model)
    alone.fit(loader)
    assert not beside.warm_started and not alone.warm_started
    torch.testing.assert_close(beside.H[1], alone.H[1], rtol=0, atol=0)
    torch.testing.assert_close(beside.H[0], alone.H[0], rtol=0, atol=0)


def test_moved_weights_refit_warm_and_within_the_nystrom_bounds():
    model, X, y, loader = _problem()
    la = _laplace(model)
    la.fit(loader)
    _move(model)
    la.fit(loader)
    assert la.warm_started and la.fit_path == "sketch"
    exact = _exact_top(model, X, y)
    lam = la.H[1]
    assert (lam <= exact * (1 + 1e-9)).all()  # a Nyström approximation never exceeds H
    torch.testing.assert_close(lam, exact, rtol=0.05, atol=0)
    torch.testing.assert_close(la.H[0].T @ la.H[0], torch.eye(RANK, dtype=torch.float64),
                               rtol=0, atol=1e-10)
    torch.testing.assert_close(la.mean, torch.nn.utils.parameters_to_vector(
        model.parameters()).detach(), rtol=0, atol=0)


def test_warm_sketch_of_the_exact_leading_eigenvectors_keeps_their_eigenvalues():
    """Nyström with the top eigenvectors among its test columns is exact on them."""
    model, X, y, loader = _problem()
    G = ggn(model, nn.CrossEntropyLoss(reduction="sum"), X, y)
    evals, evecs = torch.linalg.eigh(G)
    exact, top = evals.flip(0)[:RANK], evecs.flip(1)[:, :RANK]
    from lowrank_laplace.engine import FactorEngine

    with FactorEngine(model, nn.CrossEntropyLoss(reduction="sum")) as engine:
        factors = [engine.compute(Xb, yb) for Xb, yb in zip(X.split(50), y.split(50))]
    warm = SketchMerge(RANK, oversampling=3, basis=top)
    cold = SketchMerge(RANK, oversampling=3)
    for f in factors:
        warm.add_factor(f)
        cold.add_factor(f)
    assert warm.warm_columns == RANK and warm._omega.cols == RANK + 3
    torch.testing.assert_close(warm.result()[1], exact, rtol=1e-9, atol=0)
    assert (cold.result()[1] < exact * (1 - 1e-3)).any()  # 8 random columns are not


def test_make_solver_narrows_an_auto_sketch_around_the_basis():
    sketch_plan = FitPlan(path="sketch", micro=8, chunk=8, low_memory=False, lazy=False,
                          threads=None, dim=283, keep=4 * RANK)
    basis = torch.linalg.qr(torch.randn(283, RANK, dtype=torch.float64))[0]
    auto, params = FitConfig(rank=RANK), [torch.zeros(283, dtype=torch.float64)]
    solver = make_solver(sketch_plan, auto, params, basis=basis)
    assert solver.warm_columns == RANK
    assert solver.keep == RANK * (1 + plan.WARM_SKETCH_OVERSAMPLING)
    narrow = FitPlan(path="sketch", micro=8, chunk=8, low_memory=False, lazy=False,
                     threads=None, dim=283, keep=RANK + 2)
    assert make_solver(narrow, auto, params, basis=basis).warm_columns == RANK
    low = FitPlan(path="sketch", micro=8, chunk=8, low_memory=True, lazy=False,
                  threads=None, dim=283, keep=4 * RANK)
    assert make_solver(low, auto, params, basis=basis).warm_columns == 0
    wrong = make_solver(sketch_plan, auto, params, basis=basis[:100])
    assert wrong.warm_columns == 0
    explicit = make_solver(sketch_plan, FitConfig(rank=RANK, solver="sketch"), params,
                           basis=basis)
    assert explicit.warm_columns == 0  # only a sketch that auto chose starts warm
    with pytest.raises(ValueError, match="warm-start basis"):
        SketchMerge(RANK, 0, basis=basis)


def test_warm_start_off_and_explicit_solver_stay_cold():
    model, X, y, loader = _problem()
    off = _laplace(model, warm_start=False)
    explicit = _laplace(model, solver="sketch")
    for la in (off, explicit):
        la.fit(loader)
    _move(model)
    for la in (off, explicit):
        la.fit(loader)
        assert not la.warm_started
    assert off.warm_start is False


def test_marglik_training_refits_cold():
    """laplace-torch's loop builds a new object per epoch: each fit starts cold, as any
    new posterior does, with the default rank 100."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 40), nn.Tanh(), nn.Linear(40, 3)).double()
    X, y = torch.randn(200, 20, dtype=torch.float64), torch.randint(0, 3, (200,))
    loader = DataLoader(TensorDataset(X, y), batch_size=50)
    flags = []
    fit = LowRankGGNLaplace.fit

    def recorded(self, *args, **kwargs):
        fit(self, *args, **kwargs)
        flags.append((self.fit_path, self.warm_started))

    LowRankGGNLaplace.fit = recorded
    try:
        la, _, margliks, _ = marglik_training(
            model, loader, "classification", hessian_structure="lowrank_ggn", backend=None,
            n_epochs=3, n_hypersteps=2, prior_structure="layerwise")
    finally:
        LowRankGGNLaplace.fit = fit
    assert flags == [("sketch", False)] * 4
    assert isinstance(la, LowRankGGNLaplace) and all(map(torch.isfinite, map(torch.tensor,
                                                                              margliks)))
