"""Streaming merge, factor concatenation and the reduced cross-entropy factor."""

import pytest
import torch
from torch import nn

from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.engine.backpack.extensions import reduced_cross_entropy_sqrt
from lowrank_laplace.fitting.base import merge_blocks, wide_combine, wide_products
from lowrank_laplace.fitting.cost import merge_size
from lowrank_laplace.fitting.dense import DenseSum
from lowrank_laplace.fitting.streaming import StreamingMerge, concat_factors
from tests.conftest import make_case
from tests.reference import ggn

TOL = dict(rtol=1e-7, atol=1e-9)


def _factors(arch, batches, n=4, seed=0, loss="ce-sum"):
    model, loss_func, X, y = make_case(arch, loss, n=n * batches, seed=seed)
    engine = FactorEngine(model, loss_func)
    factors = [engine.compute(Xb, yb) for Xb, yb in zip(X.split(n), y.split(n))]
    engine.close()
    return model, loss_func, X, y, factors


def _dense_top(G, k):
    evals, evecs = torch.linalg.eigh(G)
    return evals.flip(0)[:k], evecs.flip(1)[:, :k]


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_repeated_data_is_exact_and_lazy(arch):
    """Merging the same factors twice keeps the rank: every second merge is lazy."""
    model, loss_func, X, y, factors = _factors(arch, batches=3)
    G = ggn(model, loss_func, X, y)
    total = int(torch.linalg.matrix_rank(G))
    merge = StreamingMerge(rank=total)
    for f in factors + factors + factors:
        merge.add_factor(f)
    U, lam, trace, _ = merge.result()
    torch.testing.assert_close(U @ torch.diag(lam) @ U.T, 3 * G, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(U.T @ U, torch.eye(U.shape[1], dtype=U.dtype), **TOL)
    torch.testing.assert_close(trace, 3 * torch.trace(G), **TOL)
    assert merge.num_merges == 9


@pytest.mark.parametrize("arch", ["mlp", "cnn", "conv1d"])
def test_lazy_equals_explicit_rotation_when_truncating(arch):
    """The lazy basis update is the explicit rotation in exact arithmetic."""
    *_, factors = _factors(arch, batches=6, n=3)
    results = []
    for lazy in (True, False):
        merge = StreamingMerge(rank=4, oversampling=2, track_diagonal=True, lazy=lazy)
        for i, f in enumerate(factors):
            merge.add_factor(f, scale=1.0 + i)  # varying scales stress the coordinates
        results.append(merge.result())
    (U1, l1, t1, r1), (U2, l2, t2, r2) = results
    torch.testing.assert_close(l1, l2, **TOL)
    torch.testing.assert_close(U1 @ torch.diag(l1) @ U1.T, U2 @ torch.diag(l2) @ U2.T, **TOL)
    torch.testing.assert_close(r1, r2, **TOL)
    torch.testing.assert_close(t1, t2, **TOL)


def test_lazy_merge_stays_orthonormal_in_float32():
    """Many merges of random factors with swaps at the tail, in float32."""
    torch.manual_seed(0)
    dim, keep = 300, 12
    lazy, eager = StreamingMerge(keep), StreamingMerge(keep, lazy=False)

    class Factor:  # the part of GGNFactor's interface StreamingMerge uses
        def __init__(self, V):
            self.V = V

        def group_dim(self, group=0):
            return self.V.shape[0]

        def gram(self, group=0):
            return self.V.T @ self.V

        def diag(self, group=0):
            return (self.V**2).sum(1)

        def t_matmul(self, x, group=0):
            return self.V.T @ x

        def matmul(self, y, group=0):
            return self.V @ y

        def matmul_add_(self, out, y, group=0):
            return out.addmm_(self.V, y)

    basis = torch.linalg.qr(torch.randn(dim, 40))[0]
    for _step in range(60):
        scales = torch.logspace(0, -3, 40) * torch.rand(40)
        V = basis @ (scales[:, None] * torch.randn(40, 7)) + 1e-4 * torch.randn(dim, 7)
        lazy.add_factor(Factor(V))
        eager.add_factor(Factor(V.double()))
    U, lam, *_ = lazy.result()
    U2, lam2, *_ = eager.result()
    assert lazy.num_lazy_corrections > 0 and lazy.num_deferred > 0
    assert (U.T @ U - torch.eye(keep)).abs().max() < 1e-5
    torch.testing.assert_close(lam.double(), lam2, rtol=1e-4, atol=0)
    overlap = torch.linalg.matrix_norm(U.double().T @ U2) ** 2 / keep
    assert overlap > 1 - 1e-6


def test_concat_factors_stacks_scaled_columns():
    *_, factors = _factors("cnn", batches=3, n=2)
    scales = [1.0, 4.0, 0.25]
    chunk = concat_factors(factors, scales)
    assert chunk.num_curv_samples == 6 and chunk.num_columns == sum(f.num_columns for f in factors)
    D = factors[0].group_dim()
    eye = torch.eye(D, dtype=torch.float64)
    # same GGN and the same columns per sample (order (v, n) within the chunk)
    G = sum(s * f.matmul(f.t_matmul(eye)) for f, s in zip(factors, scales))
    torch.testing.assert_close(chunk.matmul(chunk.t_matmul(eye)), G, **TOL)
    Vc = chunk.t_matmul(eye).reshape(chunk.num_vectors, 6, D)
    parts = [(s**0.5 * f.t_matmul(eye)).reshape(f.num_vectors, 2, D)
             for f, s in zip(factors, scales)]
    torch.testing.assert_close(Vc, torch.cat(parts, dim=1), **TOL)
    torch.testing.assert_close(chunk.gram(), Vc.reshape(-1, D) @ Vc.reshape(-1, D).T, **TOL)
    assert concat_factors(factors[:1], [1.0]) is factors[0]


@pytest.mark.parametrize("classes", [2, 3, 7])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reduced_cross_entropy_sqrt(classes, reduction):
    logits = torch.randn(5, classes, dtype=torch.float64) * 3
    S = reduced_cross_entropy_sqrt(logits, reduction)
    assert S.shape == (classes - 1, 5, classes)
    p = logits.softmax(1)
    H = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    if reduction == "mean":
        H = H / 5
    torch.testing.assert_close(torch.einsum("vnc,vnd->ncd", S, S), H, **TOL)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_cross_entropy_factor_has_one_column_less(reduction):
    model, _, X, y = make_case("mlp", f"ce-{reduction}", n=6)
    loss_func = nn.CrossEntropyLoss(reduction=reduction)
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y, subsampling=[0, 2, 5])
    C = 3
    assert factor.num_vectors == C - 1 and factor.num_columns == (C - 1) * 3
    eye = torch.eye(factor.group_dim(), dtype=torch.float64)
    G = ggn(model, loss_func, X, y, subsampling=[0, 2, 5])
    torch.testing.assert_close(factor.matmul(factor.t_matmul(eye)), G, **TOL)


def test_merge_size_cost_model():
    # conv-heavy exact (3c3d-like): a few dozen samples per merge
    conv = merge_size(columns_per_sample=9, keep=120, dim=895_210, gram_dim=173_000,
                      num_data=1024, limit=150)
    assert 16 <= conv <= 64
    # linear-heavy MC (2c2d-like): the whole data set in one merge
    assert merge_size(1, 120, 3_274_634, 57_000, num_data=1024, limit=2000) == 1024
    # never above the memory limit or the data, at least one sample
    assert merge_size(1, 120, 3_274_634, 57_000, num_data=1024, limit=300) <= 300
    assert merge_size(9, 120, 10**6, 10**5, num_data=5, limit=100) <= 5
    assert merge_size(9, 120, 10**6, 10**9, num_data=100, limit=0) == 1


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_dense_sum_is_the_exact_truncation(arch):
    model, loss_func, X, y, factors = _factors(arch, batches=4, n=3)
    G = ggn(model, loss_func, X, y)
    merge = DenseSum(rank=3, oversampling=1, track_diagonal=True)
    for _i, f in enumerate(factors):
        merge.add_factor(f, scale=2.0)
    U, lam, trace, residual = merge.result()
    evals, evecs = _dense_top(2 * G, 3)
    torch.testing.assert_close(lam, evals, **TOL)
    torch.testing.assert_close(U @ torch.diag(lam) @ U.T, evecs @ torch.diag(evals) @ evecs.T,
                               **TOL)
    torch.testing.assert_close(trace, 2 * torch.trace(G), **TOL)
    torch.testing.assert_close(residual, (2 * G.diagonal() - (evecs**2) @ evals).clamp(min=0),
                               **TOL)
    assert merge.num_merges == 4


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_wide_products_and_combine_are_float64_products(arch):
    """Float32 blocks (factored and dense): Gram matrix, ``V^T x`` and ``B R + V y`` in
    float64, against the explicit float64 ``V``."""
    model, loss_func, X, y = make_case(arch, "ce-sum", n=6, dtype=torch.float32)
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y)
    # V from the blocks widened first (a float32 s z^T would round the products)
    V = torch.cat([b.to(torch.float64).to_dense() for b in factor.group_blocks()], 1).T
    dim, k = V.shape[0], 5
    torch.manual_seed(1)
    basis, x = torch.randn(dim, k), torch.randn(dim, 3)
    blocks = merge_blocks(factor)
    gram, (product,), formed = wide_products(factor, blocks, [x])
    assert formed == torch.float64
    torch.testing.assert_close(gram, V.T @ V, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(product, V.T @ x.double(), rtol=1e-12, atol=1e-12)
    coeffs, rotation = torch.randn(V.shape[1], k, dtype=torch.float64), torch.randn(k, k)
    expected = basis.double() @ rotation.double() + V @ coeffs
    out = wide_combine(factor, blocks, coeffs, torch.float32, 0, basis, rotation)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected.float(), rtol=0, atol=0)  # rounded once
    A, B = torch.randn(k, 2, dtype=torch.float64), torch.randn(k, 2, dtype=torch.float64)
    expected = basis.double() @ (torch.eye(k, dtype=torch.float64) + A @ B.T) + V @ coeffs
    wide_combine(factor, blocks, coeffs, torch.float32, 0, basis, (A, B), in_place=True)
    torch.testing.assert_close(basis, expected.float(), rtol=0, atol=0)
