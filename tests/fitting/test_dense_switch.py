"""The fit's choice between a dense GGN sum and streaming merges (``fit_path``)."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowrank_laplace import LowRankGGNLaplace, LowRankGGNLLLaplace
from lowrank_laplace.fitting import plan
from lowrank_laplace.fitting.cost import dense_bytes, dense_cost, streaming_cost
from tests.conftest import set_tuning

GiB = 2**30


def _problem(n=40, out=4, seed=0, batch_size=8):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, out)).double()
    X = torch.randn(n, 5, dtype=torch.float64)
    y = torch.randint(0, out, (n,))
    return model, DataLoader(TensorDataset(X, y), batch_size=batch_size)


def _fit(model, loader, dense_max_dim, monkeypatch, cls=LowRankGGNLaplace, **kwargs):
    kwargs.setdefault("solver", "streaming")  # the merges these tests count (default: auto)
    oversampling = kwargs.pop("oversampling", None)
    set_tuning(monkeypatch, dense_max_dim=dense_max_dim)
    if oversampling is not None:
        set_tuning(monkeypatch, oversampling=oversampling / kwargs.get("rank", 100))
    la = cls(model, "classification", **kwargs)
    la.fit(loader)
    return la


def choose_dense(dim, columns_per_sample, keep, gram_dim, num_data, samples_per_merge,
                 budget, itemsize, dense_max_dim, monkeypatch=None):
    """:func:`plan.choose_dense` of these sizes under ``DENSE_MAX_DIM = dense_max_dim``."""
    sizes = plan.FitSizes(dim=dim, gram_dim=gram_dim, columns=columns_per_sample,
                          vector_bytes=1, block_bytes=1, itemsize=itemsize, batch_size=1,
                          num_data=num_data, budget=budget)
    monkeypatch.setattr(plan, "DENSE_MAX_DIM", dense_max_dim)
    return plan.choose_dense(sizes, keep, num_data, samples_per_merge)


def _dense_H(la):
    U, lam = la.H
    return U @ torch.diag(lam) @ U.T


def test_dense_bytes_count_the_sum_and_its_float64_eigendecomposition():
    assert dense_bytes(1000, 4) == 1000 * 1000 * (4 + 24)


def test_a_budget_too_small_for_the_dense_matrix_streams(monkeypatch):
    kwargs = dict(dim=500, columns_per_sample=9, keep=120, gram_dim=500, num_data=1000,
                  samples_per_merge=20, itemsize=4, dense_max_dim=2048)
    assert choose_dense(budget=dense_bytes(500, 4), **kwargs, monkeypatch=monkeypatch)
    assert not choose_dense(budget=dense_bytes(500, 4) - 1, **kwargs,
                            monkeypatch=monkeypatch)


def test_zero_dense_max_dim_always_streams(monkeypatch):
    assert not choose_dense(10, 1, 5, 10, 100, 10, GiB, 8, dense_max_dim=0,
                            monkeypatch=monkeypatch)


def test_small_problems_that_streaming_would_truncate_stay_dense(monkeypatch):
    # streaming is cheaper here (few samples, large D^3), but would truncate
    args = dict(dim=2000, columns_per_sample=9, keep=120, gram_dim=400, num_data=50,
                samples_per_merge=25, budget=GiB, itemsize=4)
    assert dense_cost(2000, 450) > streaming_cost(9, 120, 2000, 400, 50, 25)
    assert choose_dense(dense_max_dim=2048, **args, monkeypatch=monkeypatch)
    assert not choose_dense(dense_max_dim=1000, **args, monkeypatch=monkeypatch)
    assert not choose_dense(dense_max_dim=None, **args, monkeypatch=monkeypatch)


def test_exact_streaming_is_taken_when_cheaper(monkeypatch):
    # total rank 5 * 9 = 45 fits the 120 kept eigenpairs: streaming is exact too
    assert not choose_dense(2000, 9, 120, 400, 5, 5, GiB, 4, dense_max_dim=2048,
                            monkeypatch=monkeypatch)


def test_large_dim_is_dense_only_when_the_cost_model_says_so(monkeypatch):
    # many samples into a few thousand parameters: one D x D sum beats ~1,000 merges
    many = dict(dim=3000, columns_per_sample=1, keep=1000, gram_dim=3000,
                num_data=20000, samples_per_merge=20, budget=GiB, itemsize=4,
                dense_max_dim=1)
    assert dense_cost(3000, 20000) < streaming_cost(1, 1000, 3000, 3000, 20000, 20)
    assert choose_dense(**many, monkeypatch=monkeypatch)
    # the digits MLP (6,310 weights, 1,400 samples, 9 columns each): streaming
    assert not choose_dense(6310, 9, 120, 384, 1400, 23, GiB, 4, dense_max_dim=2048,
                            monkeypatch=monkeypatch)


def test_fit_path_is_visible_and_both_paths_agree_when_the_rank_fits(monkeypatch):
    """Total rank 40 * 3 = 120 <= keep: dense and streaming are both exact."""
    model, loader = _problem()
    assert LowRankGGNLaplace(model, "classification").fit_path is None
    dense = _fit(model, loader, 2048, monkeypatch, rank=200, residual="diagonal")
    stream = _fit(model, loader, 0, monkeypatch, rank=200, residual="diagonal")
    assert (dense.fit_path, stream.fit_path) == ("dense", "streaming")
    torch.testing.assert_close(_dense_H(stream), _dense_H(dense), rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(stream.H[1], dense.H[1], rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(stream.trace, dense.trace, rtol=1e-10, atol=0)
    torch.testing.assert_close(stream.residual_diagonal, dense.residual_diagonal,
                               rtol=0, atol=1e-9)
    torch.testing.assert_close(stream.log_marginal_likelihood(),
                               dense.log_marginal_likelihood(), rtol=1e-7, atol=1e-10)


def test_truncated_dense_fit_is_the_exact_top_eigenpairs(monkeypatch):
    """With the rank below the GGN's, the dense path gives exactly its top eigenpairs."""
    model, loader = _problem()
    full = _fit(model, loader, 2048, monkeypatch, rank=200)
    top = _fit(model, loader, 2048, monkeypatch, rank=5, oversampling=0)
    assert top.fit_path == "dense"
    evals, evecs = torch.linalg.eigh(_dense_H(full))
    U, lam = evecs.flip(1)[:, :5], evals.flip(0)[:5]
    torch.testing.assert_close(top.H[1], lam, rtol=1e-9, atol=0)
    torch.testing.assert_close(_dense_H(top), U @ torch.diag(lam) @ U.T, rtol=1e-7,
                               atol=1e-10)


def test_memory_budget_too_small_for_dense_streams_the_fit(monkeypatch):
    model, loader = _problem()
    dim = sum(p.numel() for p in model.parameters())
    small = dense_bytes(dim, 8) - 1  # still holds a micro-batch's V
    la = _fit(model, loader, 2048, monkeypatch, rank=200, memory_budget=small)
    ref = _fit(model, loader, 2048, monkeypatch, rank=200)
    assert (la.fit_path, ref.fit_path) == ("streaming", "dense")
    torch.testing.assert_close(_dense_H(la), _dense_H(ref), rtol=1e-7, atol=1e-10)


def test_low_memory_is_dropped_on_the_dense_path(monkeypatch):
    model, loader = _problem()
    la = _fit(model, loader, 2048, monkeypatch, rank=200, low_memory=True)
    ref = _fit(model, loader, 0, monkeypatch, rank=200, low_memory=True)
    assert (la.fit_path, ref.fit_path) == ("dense", "streaming")
    torch.testing.assert_close(_dense_H(la), _dense_H(ref), rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("dense_max_dim, path", [(2048, "dense"), (0, "streaming")])
def test_last_layer_reports_its_path(monkeypatch, dense_max_dim, path):
    model, loader = _problem()
    la = _fit(model, loader, dense_max_dim, monkeypatch, cls=LowRankGGNLLLaplace, rank=50)
    assert la.fit_path == path


def test_one_pass_feeds_several_merges_of_the_planned_size(monkeypatch):
    """Passes of a whole batch (8) split into merges of at most 3 samples (3, 3, 2),
    never across passes."""
    import lowrank_laplace.fitting.cost as cost
    from lowrank_laplace import FactorEngine
    from lowrank_laplace.fitting.streaming import StreamingMerge

    model, loader = _problem(n=40, out=4, batch_size=8)
    monkeypatch.setattr(cost, "merge_size", lambda *args, **kwargs: 3)
    passes = []
    compute = FactorEngine.compute
    monkeypatch.setattr(FactorEngine, "compute",
                        lambda self, X, *a, **k: passes.append(len(X)) or compute(self, X, *a, **k))
    la = _fit(model, loader, 0, monkeypatch, rank=4, oversampling=2, residual="diagonal")
    assert la.fit_path == "streaming"
    assert passes[:5] == [8] * 5  # one pass per batch (the spectral residual's probe follows)

    # reference: the same merges, each from its own pass over its samples
    X, y = loader.dataset.tensors
    merge = StreamingMerge(4, 2, track_diagonal=True, lazy=False)
    with FactorEngine(model, nn.CrossEntropyLoss(reduction="sum"), eval_mode=True) as engine:
        for batch in range(0, 40, 8):
            for start, stop in ((0, 3), (3, 6), (6, 8)):
                part = slice(batch + start, batch + stop)
                merge.add_factor(engine.compute(X[part], y[part]))
    U, lam, trace, residual = merge.result()
    assert merge.num_merges == 15
    torch.testing.assert_close(la.H[1], lam, rtol=1e-9, atol=0)
    torch.testing.assert_close(_dense_H(la), U @ torch.diag(lam) @ U.T, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(la.trace, trace, rtol=1e-12, atol=0)


@pytest.mark.parametrize("small, threads", [(True, 1), (False, 2)])
def test_small_fits_run_their_batch_loop_on_one_thread(monkeypatch, small, threads):
    from lowrank_laplace.engine import FactorEngine
    from lowrank_laplace.fitting.streaming import StreamingMerge
    from lowrank_laplace.utils import threads as thread_rules

    model, loader = _problem(n=40, out=4, batch_size=8)
    if not small:
        monkeypatch.setattr(plan, "SINGLE_THREAD_MERGE_WORK", 1)
    monkeypatch.setattr(thread_rules, "others_running", lambda: 0)  # a quiet machine
    seen = []
    add_factor, compute = StreamingMerge.add_factor, FactorEngine.compute
    monkeypatch.setattr(StreamingMerge, "add_factor", lambda self, *a, **k: (
        seen.append(torch.get_num_threads()), add_factor(self, *a, **k))[1])
    monkeypatch.setattr(FactorEngine, "compute", lambda self, *a, **k: (
        seen.append(torch.get_num_threads()), compute(self, *a, **k))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        la = _fit(model, loader, 0, monkeypatch, rank=4, oversampling=2)
        assert torch.get_num_threads() == 2  # restored after every batch
        with torch.no_grad():
            la.log_marginal_likelihood()  # a small posterior's queries: one thread too
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    # the plan is decided before the first pass: every pass and merge on its setting
    assert la.fit_path == "streaming" and set(seen) == {threads}


def test_small_posterior_queries_run_on_one_thread(monkeypatch):
    from lowrank_laplace.posterior import precision

    model, loader = _problem(n=40, out=4, batch_size=8)
    la = _fit(model, loader, 0, monkeypatch, rank=4, oversampling=2)
    seen = []
    logdet = precision.LowRankPrecision.logdet
    monkeypatch.setattr(precision.LowRankPrecision, "logdet", lambda self: (
        seen.append(torch.get_num_threads()), logdet(self))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        la.optimize_prior_precision(method="marglik", n_steps=3)
        la.log_marginal_likelihood()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
    assert la.query_work == la.n_params * (la.H[0].shape[1] + 1)
