"""The one-pass Nyström sketch (``solver="sketch"``) against dense references."""

import dataclasses

import pytest
import torch
from laplace import FullLaplace, Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowrank_laplace import LowRankGGNLaplace
from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.factor import GGNFactor
from lowrank_laplace.fitting import plan
from lowrank_laplace.fitting.config import FitConfig
from lowrank_laplace.fitting.cost import sketch_cost, streaming_cost
from lowrank_laplace.fitting.fit import LoaderFit
from lowrank_laplace.fitting.plan import measure_sizes, merge_plan
from lowrank_laplace.fitting.sketch import SketchMerge
from lowrank_laplace.fitting.streaming import StreamingMerge
from tests.conftest import make_case, set_tuning
from tests.laplace_torch.test_laplace import dense_H, fit_reference, make_problem
from tests.reference import ggn

TOL = dict(rtol=1e-7, atol=1e-9)


@pytest.fixture(autouse=True)
def streaming(monkeypatch):
    """The toy models are small enough for the dense path, which the sketch keeps."""
    set_tuning(monkeypatch, dense_max_dim=0)


def _factors(arch, batches, n=4, seed=0, dtype=torch.float64):
    model, loss_func, X, y = make_case(arch, "ce-sum", n=n * batches, seed=seed, dtype=dtype)
    with FactorEngine(model, loss_func) as engine:
        factors = [engine.compute(Xb, yb) for Xb, yb in zip(X.split(n), y.split(n))]
    return model, loss_func, X, y, factors


def _nystrom_top(G, omega, k):
    """Top-``k`` eigenpairs of ``Y (Omega^T Y)^+ Y^T``, ``Y = G Omega``, densely."""
    Y = G @ omega
    approx = Y @ torch.linalg.pinv(omega.T @ Y, hermitian=True) @ Y.T
    evals, evecs = torch.linalg.eigh((approx + approx.T) / 2)
    return evals.flip(0)[:k], evecs.flip(1)[:, :k]


@pytest.mark.parametrize("arch", ["mlp", "cnn", "conv1d"])
def test_exact_when_the_rank_fits(arch):
    """With at least rank(G) sketch columns the eigenpairs are the GGN's."""
    model, loss_func, X, y, factors = _factors(arch, batches=3)
    G = ggn(model, loss_func, X, y)
    total = int(torch.linalg.matrix_rank(G))
    merge = SketchMerge(rank=total, oversampling=3, track_diagonal=True)
    for i, f in enumerate(factors):
        merge.add_factor(f, scale=1.0 + i)
    scaled = sum((1.0 + i) * ggn(model, loss_func, Xb, yb)
                 for i, (Xb, yb) in enumerate(zip(X.split(4), y.split(4))))
    U, lam, trace, residual = merge.result()
    assert lam.shape == (total,)
    scale = scaled.abs().max()
    torch.testing.assert_close(U @ torch.diag(lam) @ U.T, scaled, rtol=0, atol=1e-9 * scale)
    torch.testing.assert_close(U.T @ U, torch.eye(total, dtype=U.dtype), **TOL)
    torch.testing.assert_close(trace, torch.trace(scaled), **TOL)
    torch.testing.assert_close(residual, torch.zeros_like(residual), rtol=0,
                               atol=1e-9 * scale)
    assert merge.num_merges == 3


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_truncated_equals_the_dense_nystrom_approximation(arch):
    """Below the GGN's rank: the top eigenpairs of the dense Nyström approximation
    with the same test matrix; they never exceed the GGN's own eigenvalues."""
    model, loss_func, X, y, factors = _factors(arch, batches=6, n=3)
    G = ggn(model, loss_func, X, y)
    rank, oversampling = 4, 5
    merge = SketchMerge(rank, oversampling, track_diagonal=True, seed=3)
    for f in factors:
        merge.add_factor(f)
    # the linear layers' slices are Khatri-Rao, kept as their factors
    assert any(merge._omega.factors(i) is not None for i in range(len(merge._omega.parts)))
    omega = merge._omega.dense()
    U, lam, trace, residual = merge.result()
    evals, evecs = _nystrom_top(G, omega, rank)
    torch.testing.assert_close(lam, evals, rtol=1e-6, atol=0)
    torch.testing.assert_close(U @ torch.diag(lam) @ U.T, evecs @ torch.diag(evals) @ evecs.T,
                               rtol=0, atol=1e-6 * evals[0])
    exact = torch.linalg.eigvalsh(G).flip(0)[:rank]
    assert (lam <= exact * (1 + 1e-9)).all()
    assert lam.sum() < exact.sum()  # a truncating sketch keeps less
    torch.testing.assert_close(trace, torch.trace(G), **TOL)
    torch.testing.assert_close(residual, (G.diagonal() - (U**2) @ lam).clamp(min=0), **TOL)


@pytest.mark.parametrize("limit", ["samples", "bytes"])
def test_deferred_linear_layer_products_equal_immediate_ones(monkeypatch, limit):
    """Factored linear-layer blocks queued over several factors (and added when the
    queue is full or the sketch is read) give the sketch of adding each at once."""
    from lowrank_laplace.fitting import sketch as sketch_module

    *_, factors = _factors("mlp", batches=7, n=3)
    scales = [1.0 + 0.5 * i for i in range(len(factors))]
    results = []
    for queue in ("none", limit):
        if queue == "none":
            monkeypatch.setattr(sketch_module, "_KRON_SAMPLES", 1)
        elif queue == "samples":
            monkeypatch.setattr(sketch_module, "_KRON_SAMPLES", 7)  # full after 3 factors
        else:
            monkeypatch.setattr(sketch_module, "_KRON_SAMPLES", 10**9)
            monkeypatch.setattr(sketch_module, "_KRON_BYTES", 2_000)
        merge = SketchMerge(4, 3, seed=1)
        for f, scale in zip(factors, scales):
            merge.add_factor(f, scale=scale)
            if queue == "bytes":  # a cap on all parameters' queued factors together
                assert sum(b.nbytes + p.numel() * p.element_size() for bs, ps, _ in
                           merge._kron.values() for b, p in zip(bs, ps)) < 2_000
        pending = sum(len(blocks) for blocks, _, _ in merge._kron.values())
        assert (pending == 0) == (queue == "none")
        results.append(merge.result())
    (U1, l1, t1, _), (U2, l2, t2, _) = results
    torch.testing.assert_close(l2, l1, **TOL)
    torch.testing.assert_close(U2 @ torch.diag(l2) @ U2.T, U1 @ torch.diag(l1) @ U1.T, **TOL)
    torch.testing.assert_close(t2, t1, **TOL)


@pytest.mark.parametrize("test_matrix", ["gaussian", "kronecker"])
def test_error_within_the_expected_bound_on_average(test_matrix):
    """Tropp et al.'s bound: E ||G - [[G_hat]]_r||_* <= (1 + r/(l - r - 1)) ||G - [[G]]_r||_*
    for a Gaussian test matrix; averaged over 20 seeds, with a margin for the
    average's spread. The Khatri-Rao slices of the linear layers (no theorem) meet
    it as well."""
    model, loss_func, X, y, factors = _factors("mlp", batches=8, n=4)
    G = ggn(model, loss_func, X, y)
    rank, oversampling = 3, 6
    exact = torch.linalg.eigvalsh(G).flip(0)
    best = exact[rank:].clamp(min=0).sum()
    errors = []
    for seed in range(20):
        merge = SketchMerge(rank, oversampling, seed=seed, test_matrix=test_matrix)
        for f in factors:
            merge.add_factor(f)
        U, lam, _, _ = merge.result()
        errors.append(torch.linalg.svdvals(G - U @ torch.diag(lam) @ U.T).sum())
    bound = (1 + rank / (rank + oversampling - rank - 1)) * best
    assert torch.stack(errors).mean() <= 1.2 * bound
    assert min(errors) >= best * (1 - 1e-9)  # no rank-r matrix beats the truncated SVD


def test_float32_close_to_float64_with_the_same_test_matrix():
    *_, factors64 = _factors("cnn", batches=6, n=3)
    *_, factors32 = _factors("cnn", batches=6, n=3, dtype=torch.float32)
    results = []
    for factors in (factors64, factors32):
        merge = SketchMerge(4, 5, seed=1)
        merge._test_matrix(factors[0].group_dim(), torch.zeros(1),  # float32 draw
                           factors[0].shapes)
        merge._omega = merge._omega.to(factors[0].grad_dtype())
        for f in factors:
            merge.add_factor(f)
        results.append(merge.result())
    (U64, l64, t64, _), (U32, l32, t32, _) = results
    assert U32.dtype == torch.float32
    torch.testing.assert_close(l32.double(), l64, rtol=1e-3, atol=0)
    torch.testing.assert_close((U32.T @ U32).double(), torch.eye(4, dtype=torch.float64),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(t32.double(), t64, rtol=1e-5, atol=0)


def test_float32_factors_accumulated_in_float64_match_the_dense_float64_nystrom():
    """Inputs over three decades give a GGN spectrum over ten. A float32 sketch rounds
    ``Y = H Omega`` at ``eps32 * lambda_max``: it keeps only the eigenpairs above a few
    1e-6 of ``lambda_max``, 7% off there (measured). Accumulated in float64 from the
    same float32 factors, all 40 kept eigenvalues (down to 5e-8 of ``lambda_max``)
    match the dense float64 Nyström approximation with the same test matrix."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).float()
    X = torch.randn(60, 6) * torch.logspace(0, -3, 6)
    y = torch.randint(0, 3, (60,))
    loss_func = nn.CrossEntropyLoss(reduction="sum")
    with FactorEngine(model, loss_func) as engine:
        factors = [engine.compute(Xb, yb) for Xb, yb in zip(X.split(10), y.split(10))]
    G = ggn(copy.deepcopy(model).double(), loss_func, X.double(), y)
    errors = {}
    for accumulate in (None, torch.float64):
        merge = SketchMerge(40, 10, seed=2, accumulate=accumulate)
        for f in factors:
            merge.add_factor(f)
        omega = merge._omega.dense().double()
        U, lam, trace, _ = merge.result()
        assert U.dtype == lam.dtype == torch.float32
        evals, _ = _nystrom_top(G, omega, lam.numel())
        errors[accumulate] = (lam.numel(), float(((lam.double() - evals) / evals).abs().max()))
        if accumulate is not None:
            torch.testing.assert_close((U.T @ U).double(), torch.eye(40, dtype=torch.float64),
                                       rtol=0, atol=1e-5)
            torch.testing.assert_close(trace, torch.trace(G), rtol=1e-5, atol=0)
    assert errors[torch.float64][0] == 40 and errors[torch.float64][1] < 1e-4, errors
    assert errors[None][0] < 30 or errors[None][1] > 1e-2, errors  # what it fixes


def test_add_lowrank_is_linear():
    """Adding an eigendecomposition adds its sketch: equal to adding its factor."""
    *_, factors = _factors("mlp", batches=4)
    first, second = SketchMerge(4, 3, seed=2), SketchMerge(4, 3, seed=2)
    # the same test matrix (Khatri-Rao slices where the factors' blocks are factored)
    second.prepare(factors[0].group_dim(), torch.zeros(1, dtype=torch.float64),
                   factors[0].shapes)
    exact = StreamingMerge(1000)
    for f in factors[:2]:
        first.add_factor(f)
        exact.add_factor(f)
    U, lam, trace, _ = exact.result()
    second.add_lowrank(U, lam, trace)
    for f in factors[2:]:
        first.add_factor(f)
        second.add_factor(f)
    (U1, l1, t1, _), (U2, l2, t2, _) = first.result(), second.result()
    torch.testing.assert_close(l1, l2, **TOL)
    torch.testing.assert_close(U1 @ torch.diag(l1) @ U1.T, U2 @ torch.diag(l2) @ U2.T, **TOL)
    torch.testing.assert_close(t1, t2, **TOL)


@pytest.mark.parametrize("test_matrix", ["kronecker", "gaussian"])
def test_test_matrix_depends_on_seed_not_threads(test_matrix):
    """The draw depends on the seed (and the shapes), not on the threads; entries have
    variance ``1 / D``; with ``"kronecker"`` every column's slice of a matrix-shaped
    parameter is the outer product ``p_k q_k^T`` the sketch keeps, other slices are
    not of rank one."""
    like = torch.zeros(1)
    shapes = [torch.Size(s) for s in [(300, 400), (300,), (20, 3, 5, 5), (10, 300), (10,)]]
    dim = sum(s.numel() for s in shapes)
    threads = torch.get_num_threads()
    draws = []
    for num in (1, 2):
        torch.set_num_threads(num)
        try:
            merge = SketchMerge(3, 2, seed=5, test_matrix=test_matrix)
            draws.append(merge._test_matrix(dim, like, shapes).dense())
        finally:
            torch.set_num_threads(threads)
    torch.testing.assert_close(draws[0], draws[1], rtol=0, atol=0)
    other = SketchMerge(3, 2, seed=6, test_matrix=test_matrix)._test_matrix(dim, like, shapes)
    other = other.dense()
    assert not torch.equal(other, draws[0])
    omega = draws[0]
    assert omega.shape == (dim, 5)
    # unit expected columns (five columns of products of Gaussians spread ~5% about it)
    assert abs(float(omega.square().mean()) * dim - 1) < (0.01 if test_matrix == "gaussian"
                                                          else 0.2)
    slices = dict(zip(range(len(shapes)), omega.split([s.numel() for s in shapes])))
    for position in (0, 3):
        mats = slices[position].T.reshape(5, *shapes[position])
        ranks = torch.linalg.matrix_rank(mats, rtol=1e-4)  # float32 draws
        if test_matrix == "kronecker":
            assert ranks.tolist() == [1] * 5
            p, q = merge._omega.factors(position)
            torch.testing.assert_close(mats, p[:, :, None] * q[:, None, :], rtol=0, atol=0)
        else:
            assert (ranks == min(shapes[position])).all()
            assert merge._omega.factors(position) is None
    conv = slices[2].T.reshape(5, 20, -1)  # the convolution's slice stays Gaussian
    assert (torch.linalg.matrix_rank(conv, rtol=1e-4) == 20).all()
    with pytest.raises(ValueError, match="test_matrix must be"):
        SketchMerge(3, 2, test_matrix="rademacher")
    with pytest.raises(ValueError, match="do not hold"):
        SketchMerge(3, 2)._test_matrix(dim + 1, like, shapes)


@pytest.mark.parametrize("name", ["mlp-classification", "cnn-regression"])
@pytest.mark.parametrize("low_memory", [False, True])
def test_laplace_with_full_rank_equals_full_laplace(name, low_memory):
    model, likelihood, X, y, loader = make_problem(name)
    full = fit_reference(FullLaplace(model, likelihood), loader)
    la = Laplace(model, likelihood, subset_of_weights="all", hessian_structure="lowrank_ggn",
                 rank=1000, solver="sketch", low_memory=low_memory, micro_batch_size=5)
    la.fit(loader)
    assert la.fit_path == "sketch" and la.solver == "sketch"
    torch.testing.assert_close(dense_H(la), full.H, rtol=0, atol=1e-8 * full.H.abs().max())
    torch.testing.assert_close(la.log_marginal_likelihood(), full.log_marginal_likelihood(),
                               rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(la(X[:3]), full(X[:3]), rtol=1e-5, atol=1e-8)


def test_laplace_truncated_keeps_less_than_streaming_and_low_memory_agrees(tune):
    model, likelihood, X, y, loader = make_problem("mlp-classification", n=60, batch_size=16)
    full = fit_reference(FullLaplace(model, likelihood), loader)
    tune(oversampling=10 / 6)
    kw = dict(rank=6, residual="diagonal")
    # passes of 16 samples: one streaming merge no longer covers the data
    sketch = LowRankGGNLaplace(model, likelihood, solver="sketch", micro_batch_size=16, **kw)
    sketch.fit(loader)
    low = LowRankGGNLaplace(model, likelihood, solver="sketch", low_memory=True,
                            micro_batch_size=16, **kw)
    low.fit(loader)
    assert sketch.fit_path == low.fit_path == "sketch"
    stream = LowRankGGNLaplace(model, likelihood, **kw)
    stream.fit(loader)
    exact = torch.linalg.eigvalsh(full.H).flip(0)[:6]
    U, lam = sketch.H
    assert lam.shape == (6,) and (lam <= exact * (1 + 1e-9)).all()
    assert sketch.kept_fraction <= stream.kept_fraction
    torch.testing.assert_close(sketch.trace, torch.trace(full.H), **TOL)
    torch.testing.assert_close(sketch.residual_diagonal,
                               (full.H.diagonal() - (U**2) @ lam).clamp(min=0), **TOL)
    # the low-memory passes sketch with the same test matrix
    torch.testing.assert_close(dense_H(low), dense_H(sketch), rtol=0,
                               atol=1e-9 * exact[0])
    torch.testing.assert_close(low.residual_diagonal, sketch.residual_diagonal, **TOL)


def test_solver_is_validated_and_kept_in_the_last_layer_class(tune):
    model, likelihood, X, y, loader = make_problem("mlp-classification")
    with pytest.raises(ValueError, match="solver must be one of"):
        LowRankGGNLaplace(model, likelihood, solver="lanczos")
    tune(oversampling=0.5)
    la = Laplace(model, likelihood, subset_of_weights="last_layer",
                 hessian_structure="lowrank_ggn", rank=2, solver="sketch",
                 micro_batch_size=4)
    la.fit(loader)
    assert la.solver == "sketch" and la.fit_path == "sketch" and la.H[1].shape == (2,)


def test_plan_and_cost_model(monkeypatch):
    """Passes as large as streaming's, merges of a pass or up to half the budget; the
    sketch's cost is the streaming cost's products without the merges."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    X = torch.randn(16, 4)
    with FactorEngine(model, nn.CrossEntropyLoss(reduction="sum")) as engine:
        for budget, cap, low in ((None, None, False), (4000, None, False), (None, 5, False),
                                 (None, 40, True)):
            config = FitConfig(memory_budget=budget, micro_batch_size=cap)
            sizes = measure_sizes(engine, X, 16, 64, config)
            micro, chunk = merge_plan(sizes, config, 10, low, "sketch")
            assert micro == merge_plan(sizes, config, 10, low)[0]
            limit = min(sizes.limit(low)[0], cap or 2**62)
            if low:  # every micro-batch is one merge
                assert chunk == micro
                continue
            size = min(micro, 16)  # whole passes, pending factors and their copy fit
            assert chunk % size == 0 and (chunk == size or 2 * chunk <= limit)
        # merges span passes only up to SKETCH_MERGE_BYTES of V
        monkeypatch.setattr(plan, "SKETCH_MERGE_BYTES", 1)
        config = FitConfig()
        sizes = measure_sizes(engine, X, 16, 64, config)
        assert merge_plan(sizes, config, 10, path="sketch") == \
            (merge_plan(sizes, config, 10)[0], 16)
    assert sketch_cost(9, 120, 10**5, 400, 1000) < streaming_cost(9, 120, 10**5, 400, 1000, 30)


@pytest.mark.slow
def test_sketch_posterior_tracks_the_full_ggn_on_real_data(tune):
    """Real data (sklearn digits), rank 5% of D: the held-out NLL within 10% of the
    full GGN's. The sketch's eigenvalues under-estimate, so its marglik prior is
    larger than the full GGN's (1.53x here; streaming: 1.10x); more sketch columns
    keep more of the trace and bring the prior closer."""
    from tests.posterior.test_residual import _digits_problem
    from tests.posterior.test_residual import heldout_nll as nll

    model, loader = _digits_problem()
    full = fit_reference(FullLaplace(model, "classification"), loader)
    full.optimize_prior_precision(method="marglik", n_steps=300, lr=0.1)
    kept, prior = {}, {}
    for oversampling in (None, 140):
        tune(oversampling=0.2 if oversampling is None else oversampling / 60)
        la = LowRankGGNLaplace(model, "classification", rank=60, solver="sketch",
                               residual="isotropic")  # the sketch's own eigenvalues decide
        la.fit(loader)
        la.optimize_prior_precision(method="marglik", n_steps=300, lr=0.1)
        kept[oversampling] = float(la.kept_fraction)
        prior[oversampling] = float(la.prior_precision / full.prior_precision)
        assert abs(nll(la) / nll(full) - 1) < 0.10, oversampling
    assert kept[None] < kept[140] < 1
    assert 1 < prior[140] < prior[None] < 1.8, prior


def test_small_models_stay_on_the_exact_dense_path(tune):
    """The dense sum (exact) takes precedence over the sketch where it applies."""
    model, likelihood, X, y, loader = make_problem("mlp-classification", n=60, batch_size=16)
    full = fit_reference(FullLaplace(model, likelihood), loader)
    tune(dense_max_dim=2048)
    la = LowRankGGNLaplace(model, likelihood, rank=6, solver="sketch", residual="none")
    la.fit(loader)
    assert la.fit_path == "dense"
    evals = torch.linalg.eigvalsh(full.H).flip(0)[:6]
    torch.testing.assert_close(la.H[1], evals, rtol=1e-8, atol=0)


def test_sketch_streams_whole_equal_passes(monkeypatch, tune):
    """A sketch is linear in its factors: loader batches split into equal passes, no
    pass is ever split at a merge boundary, and the result does not depend on the
    pass size."""
    model, likelihood, X, y, loader = make_problem("mlp-classification", n=60, batch_size=16)
    tune(oversampling=10 / 6)
    # (the quadrature after the fit may cut its held-out inputs out of a merge)
    kw = dict(rank=6, solver="sketch", residual="isotropic")
    one = LowRankGGNLaplace(model, likelihood, micro_batch_size=16, **kw)  # the batches
    one.fit(loader)
    sizes = []
    compute = FactorEngine.compute

    def recording(self, X, y, **kwargs):
        if y is not None:  # not the sizing pass
            sizes.append(len(y))
        return compute(self, X, y, **kwargs)

    def never(*args, **kwargs):
        raise AssertionError("a sketch pass was split")

    monkeypatch.setattr(FactorEngine, "compute", recording)
    monkeypatch.setattr(GGNFactor, "take_samples", never)
    many = LowRankGGNLaplace(model, likelihood, micro_batch_size=5, **kw)
    many.fit(loader)
    assert sizes == [4] * 4 * 3 + [4] * 3  # batches 16, 16, 16, 12 in passes of <= 5
    assert many.fit_path == "sketch"
    torch.testing.assert_close(dense_H(many), dense_H(one), rtol=0,
                               atol=1e-9 * one.H[1].max())


def test_sketch_streams_exactly_where_one_merge_covers_the_data(tune):
    """One streaming merge of all columns multiplies V once, the sketch twice: where
    the plan allows it, solver='sketch' takes that merge, the exact truncation."""
    model, likelihood, X, y, loader = make_problem("mlp-classification", n=60, batch_size=16)
    tune(oversampling=4 / 6)
    kw = dict(rank=6)
    sketch = LowRankGGNLaplace(model, likelihood, solver="sketch", **kw)
    sketch.fit(loader)
    stream = LowRankGGNLaplace(model, likelihood, **kw)
    stream.fit(loader)
    assert sketch.fit_path == stream.fit_path == "streaming" and sketch.solver == "sketch"
    torch.testing.assert_close(dense_H(sketch), dense_H(stream), rtol=0,
                               atol=1e-9 * stream.H[1].max())
    # the best rank-6 approximation of the full GGN: the top eigenvalues, exactly
    full = fit_reference(FullLaplace(model, likelihood), loader)
    torch.testing.assert_close(sketch.H[1], torch.linalg.eigvalsh(full.H).flip(0)[:6],
                               **TOL)
    # low-memory merges do not span loader batches: one merge covers only one batch
    low = LowRankGGNLaplace(model, likelihood, solver="sketch", low_memory=True, **kw)
    low.fit(loader)
    assert low.fit_path == "sketch"
    whole = LowRankGGNLaplace(model, likelihood, solver="sketch", low_memory=True, **kw)
    whole.fit(DataLoader(loader.dataset, batch_size=60))
    assert whole.fit_path == "streaming"
    torch.testing.assert_close(dense_H(whole), dense_H(stream), rtol=0,
                               atol=1e-9 * stream.H[1].max())
    # when passes must be merged apart (here: several passes), it sketches
    small = LowRankGGNLaplace(model, likelihood, solver="sketch", micro_batch_size=16, **kw)
    small.fit(loader)
    assert small.fit_path == "sketch"
    assert small.kept_fraction < sketch.kept_fraction


def test_the_test_matrix_is_freed_before_the_eigenvectors_are_formed(monkeypatch):
    """The finalisation drops its test matrix (Gaussian slices of ``l x d`` entries for
    convolution weights) once the Nyström core is factored, before the ``D x r``
    eigenvectors are formed, and the eigenpairs stay exact for a rank-8 curvature."""
    import gc
    import weakref

    from lowrank_laplace.fitting import sketch as sketch_module

    seen = {}
    core, pairs = sketch_module.nystrom_core, sketch_module.nystrom_eigenpairs

    def spy_core(Y, omega):
        seen["omega"] = weakref.ref(omega)
        return core(Y, omega)

    def spy_pairs(*args):
        gc.collect()
        seen["alive"] = seen["omega"]() is not None
        return pairs(*args)

    monkeypatch.setattr(sketch_module, "nystrom_core", spy_core)
    monkeypatch.setattr(sketch_module, "nystrom_eigenpairs", spy_pairs)
    torch.manual_seed(0)
    U = torch.linalg.qr(torch.randn(300, 8, dtype=torch.float64))[0]
    lam = torch.arange(8, 0, -1, dtype=torch.float64)
    solver = sketch_module.SketchMerge(5, 5)
    solver.add_lowrank(U, lam, lam.sum())
    V = solver.eigenvectors
    assert seen == {"omega": seen["omega"], "alive": False}
    torch.testing.assert_close(solver.eigenvalues[:5], lam[:5], rtol=1e-10, atol=0)
    torch.testing.assert_close((V.T @ U[:, :5]).abs(), torch.eye(5, dtype=torch.float64),
                               rtol=0, atol=1e-8)


@pytest.mark.parametrize("warm", [False, True])
def test_sub_sketch_share_is_the_dense_nystrom_of_the_first_columns(warm):
    """The convergence check: the top-``r`` Nyström eigenvalues of the first columns of
    the test matrix (a warm start's basis and half the random ones) over all columns'."""
    model, loss_func, X, y, factors = _factors("mlp", batches=6, n=3)
    G = ggn(model, loss_func, X, y)
    rank = 4
    basis = torch.linalg.qr(torch.randn(G.shape[0], 2, dtype=torch.float64))[0] \
        if warm else None
    merge = SketchMerge(rank, 8, seed=3, basis=basis)
    for f in factors:
        merge.add_factor(f)
    omega = merge._omega.dense().clone()
    first = (2 if warm else 0) + (12 - (2 if warm else 0)) // 2
    expected = _nystrom_top(G, omega[:, :first], rank)[0].sum() / \
        _nystrom_top(G, omega, rank)[0].sum()
    assert merge.convergence == pytest.approx(float(expected), rel=1e-6)
    assert 0 < merge.convergence <= 1 + 1e-9


def _flat_problem(n=256):
    """An untrained tanh MLP on random data: a flat GGN spectrum at rank 10."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10)).double()
    X = torch.randn(n, 32, dtype=torch.float64)
    y = torch.randint(0, 10, (n,))
    return model, DataLoader(TensorDataset(X, y), batch_size=64)


def test_auto_streams_where_its_sketch_did_not_converge(tune):
    """A flat spectrum: the sketch's eigenvalues still grow with its columns, so
    ``solver="auto"`` streams the data instead; a decaying one keeps the sketch."""
    from lowrank_laplace.fitting.fit import SKETCH_CONVERGED

    tune(dense_max_dim=0)
    model, loader = _flat_problem()
    checks = []
    fit = LoaderFit.run

    def recorded(self, *args, **kwargs):
        result = fit(self, *args, **kwargs)
        checks.append(result.check)
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LoaderFit, "run", recorded)
        auto = LowRankGGNLaplace(model, "classification", rank=10)
        auto.fit(loader)
    stream = LowRankGGNLaplace(model, "classification", rank=10, solver="streaming")
    stream.fit(loader)
    check = checks[0]
    assert check.name.startswith("sketch convergence") and not check.passed
    # the fit kept its factors: a sketch refined by Rayleigh-Ritz
    assert check.threshold == SKETCH_CONVERGED[True][0]
    assert check.value < check.threshold and check.action == "streamed instead"
    assert auto.fit_path == "streaming"
    # on the flat spectrum it streams keeping more eigenpairs: as streaming tuned to them
    assert float(auto.H[1].sum()) >= float(stream.H[1].sum()) * (1 - 1e-9)
    extra = max(int(10 * plan.FLAT_OVERSAMPLING), plan.FLAT_MIN_EXTRA)
    tune(oversampling=extra / 10)
    wide = LowRankGGNLaplace(model, "classification", rank=10, solver="streaming")
    wide.fit(loader)
    torch.testing.assert_close(dense_H(auto), dense_H(wide), rtol=0,
                               atol=1e-9 * wide.H[1].max())
    with pytest.warns(UserWarning, match=r"solver='sketch' has not converged: .* grew by"):
        LowRankGGNLaplace(model, "classification", rank=10, solver="sketch").fit(loader)
    # a spectrum that decays within the sketch's columns: the check passes, it stays
    model, likelihood, X, y, loader = make_problem("mlp-classification", n=60, batch_size=16)
    tune(oversampling=6.0)  # 21 columns for rank 3
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LoaderFit, "run", recorded)
        kept = LowRankGGNLaplace(model, likelihood, rank=3, micro_batch_size=16,
                                 solver="sketch")
        kept.fit(loader)
    assert kept.fit_path == "sketch" and checks[-1].passed and checks[-1].action == "kept"


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_rayleigh_ritz_gives_the_ggn_on_the_nystrom_span(arch):
    """The Ritz pairs of the dense GGN on the Nyström eigenvectors' span: orthonormal,
    ``U^T G U`` diagonal with the eigenvalues, never below Nyström's nor above the GGN's."""
    model, loss_func, X, y, factors = _factors(arch, batches=6, n=3)
    G = ggn(model, loss_func, X, y)
    merge = SketchMerge(4, 4, seed=3)
    for f in factors:
        merge.add_factor(f)
    nystrom_U, nystrom_lam = (t.clone() for t in merge.result()[:2])
    merge.rayleigh_ritz(lambda rows: rows @ G @ rows.T)
    U, lam, trace, _ = merge.result()
    assert merge.ritz and U.shape == nystrom_U.shape
    span = nystrom_U @ nystrom_U.T
    torch.testing.assert_close(span @ U, U, **TOL)  # the same span
    torch.testing.assert_close(U.T @ U, torch.eye(4, dtype=U.dtype), **TOL)
    torch.testing.assert_close(U.T @ G @ U, torch.diag(lam), rtol=0, atol=1e-9 * lam[0])
    exact = torch.linalg.eigvalsh(G).flip(0)[:4]
    assert (lam >= nystrom_lam * (1 - 1e-9)).all() and (lam <= exact * (1 + 1e-9)).all()
    assert merge.convergence == pytest.approx(float(nystrom_lam.sum() / lam.sum()), rel=1e-9)
    # the dropped mass stays exact: the trace minus the kept Ritz values
    torch.testing.assert_close(trace, torch.trace(G), **TOL)


def test_a_fit_keeping_its_factors_refines_its_sketch_by_rayleigh_ritz(tune):
    """Where the fit keeps its factors, ``solver="auto"`` sketches ``rank`` plus half of it,
    at least ``RITZ_MIN_EXTRA``, columns and its eigenvalues are the dense GGN's Rayleigh
    quotients on its eigenvectors; a fit that keeps none (``residual="isotropic"``) keeps
    the ``4 * rank`` Nyström sketch."""
    from tests.laplace_torch.test_warm import _problem as decaying_problem

    tune(dense_max_dim=0)
    model, X, y, loader = decaying_problem()
    likelihood = "classification"
    G = ggn(model, nn.CrossEntropyLoss(reduction="sum"), X, y)
    columns = []
    make = plan.make_solver

    def recorded(fit_plan, *args, **kwargs):
        columns.append(fit_plan.keep)
        return make(fit_plan, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("lowrank_laplace.fitting.fit.make_solver", recorded)
        la = LowRankGGNLaplace(model, likelihood, rank=5)
        la.fit(loader)
        plain = LowRankGGNLaplace(model, likelihood, rank=5, residual="isotropic")
        plain.fit(loader)
    ritz = 5 + max(int(5 * plan.RITZ_SKETCH_OVERSAMPLING), plan.RITZ_MIN_EXTRA)
    assert la.fit_path == plain.fit_path == "sketch" and columns == [ritz, 20] == [55, 20]
    assert la.fit_report.check.passed and "Rayleigh-Ritz" in str(la.fit_report)
    U, lam = la.H
    torch.testing.assert_close(U.T @ G @ U, torch.diag(lam), rtol=0, atol=1e-8 * lam[0])
    exact = torch.linalg.eigvalsh(G).flip(0)[:5]
    assert float(lam.sum()) >= 0.95 * float(exact.sum())
    assert "Rayleigh-Ritz" not in str(plain.fit_report)
    # the same fit without laplace-torch's class: the same eigenpairs
    from lowrank_laplace.laplace_torch.fitted import fit_lowrank_ggn
    from lowrank_laplace.laplace_torch.options import LowRankOptions

    fitted = fit_lowrank_ggn(model, likelihood, loader, LowRankOptions(rank=5))
    torch.testing.assert_close(fitted.result.eigenvalues, lam, rtol=1e-10, atol=0)


def test_plan_sketches_fewer_columns_where_all_factors_are_kept():
    """``FitSizes.ritz``: kept factors that fit the cache's share of the budget."""
    sizes = plan.FitSizes(dim=10**5, gram_dim=400, columns=9, vector_bytes=4 * 10**5 // 4,
                          block_bytes=4000, itemsize=4, batch_size=128, num_data=1000,
                          budget=2**32, float64=False, cached=True)
    config = FitConfig(rank=100)
    assert sizes.ritz() and plan.choose_solver(sizes, config) == ("sketch", 150)
    # small ranks: at least RITZ_MIN_EXTRA more columns
    assert plan.choose_solver(sizes, FitConfig(rank=20)) == ("sketch", 70)
    assert plan.choose_solver(dataclasses.replace(sizes, cached=False), config) == \
        ("sketch", 400)
    overflowing = dataclasses.replace(sizes, num_data=10**6, budget=2**34)
    assert not overflowing.ritz()
