"""Small dense linear algebra: float64 inner products and the eigenpair cutoff."""

import pytest
import torch

from lowrank_laplace.utils.linalg import top_eigh, wide_inner


def _graded_factor(dim=60, cols=30, smallest=1e-6, seed=0):
    """A float32 factor ``Z`` with singular values from 1 down to ``smallest``."""
    torch.manual_seed(seed)
    left = torch.linalg.qr(torch.randn(dim, cols, dtype=torch.float64))[0]
    right = torch.linalg.qr(torch.randn(cols, cols, dtype=torch.float64))[0]
    sigma = torch.logspace(0, torch.log10(torch.tensor(smallest)).item(), cols,
                           dtype=torch.float64)
    return ((left * sigma) @ right.T).float()


def test_wide_inner_is_the_float64_product(monkeypatch):
    from lowrank_laplace.utils import linalg

    monkeypatch.setattr(linalg, "WIDE_INNER_ENTRIES", 64 * 12)  # chunks of 64 rows or more
    torch.manual_seed(0)
    a, b = torch.randn(1000, 7), torch.randn(1000, 5)
    torch.testing.assert_close(wide_inner(a, b), a.double().T @ b.double(),
                               rtol=1e-14, atol=1e-12)
    gram = wide_inner(a)
    assert torch.equal(gram, gram.T)
    torch.testing.assert_close(gram, a.double().T @ a.double(), rtol=1e-14, atol=1e-12)


def test_float64_gram_of_float32_factors_keeps_small_eigenvalues():
    """Eigenvalues 1 .. 1e-14 of a float32 factor: the float64 Gram matrix resolves
    them down to ``eps32^2 tr``; a float32 one only down to about ``eps32``."""
    Z = _graded_factor(smallest=1e-7)
    exact = torch.linalg.svdvals(Z.double()) ** 2  # of the float32 factor itself
    evals, evecs = top_eigh(wide_inner(Z), 30, torch.float32)
    floor = float(exact.sum()) * torch.finfo(torch.float32).eps ** 2
    assert 20 < evals.numel() == int((exact > floor).sum()) < 30
    # float64 rounding of the Gram matrix: eps64 lambda_max
    torch.testing.assert_close(evals, exact[: evals.numel()], rtol=1e-8, atol=1e-15)
    torch.testing.assert_close(evecs.T @ evecs, torch.eye(evals.numel(), dtype=torch.float64),
                               rtol=0, atol=1e-12)
    # formed in float32: kept down to a tenth of eps lambda_max, noisy below eps
    narrow, _ = top_eigh((Z.T @ Z).double(), 30, torch.float32, torch.float32)
    eps = torch.finfo(torch.float32).eps
    assert float(narrow[-1]) > 0.1 * eps * float(exact[0])
    assert narrow.numel() < evals.numel()


def test_float64_cutoff_is_unchanged():
    """Float64 factors: pairs below ``10 eps lambda_max`` are rounding."""
    Z = _graded_factor(smallest=1e-9).double()
    evals, _ = top_eigh(Z.T @ Z, 30)
    exact = torch.linalg.svdvals(Z) ** 2
    tol = 10 * torch.finfo(torch.float64).eps * float(exact[0])
    assert evals.numel() == int((exact > tol).sum())


@pytest.mark.parametrize("entries", [7, 2**20])  # row chunks of one entry, or one chunk
@pytest.mark.parametrize("transposed", [False, True])
def test_squared_rows_dot_is_the_product_of_the_squares(entries, transposed):
    from lowrank_laplace.utils.linalg import squared_rows_dot

    torch.manual_seed(0)
    mat = torch.randn(3, 50, dtype=torch.float64).T if transposed else \
        torch.randn(50, 3, dtype=torch.float64)
    for weights in (torch.rand(3, dtype=torch.float64), torch.rand(3, 2, dtype=torch.float64)):
        torch.testing.assert_close(squared_rows_dot(mat, weights, entries),
                                   (mat**2) @ weights, rtol=1e-12, atol=0)


def test_squared_rows_dot_keeps_autograd():
    from lowrank_laplace.utils.linalg import squared_rows_dot

    torch.manual_seed(0)
    mat = torch.randn(50, 3, dtype=torch.float64)
    weights = torch.rand(3, dtype=torch.float64, requires_grad=True)
    squared_rows_dot(mat, weights, entries=7).sum().backward()
    torch.testing.assert_close(weights.grad, (mat**2).sum(0), rtol=1e-12, atol=0)
