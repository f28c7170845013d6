"""The low-rank plus diagonal precision's layerwise path against its general one."""

import pytest
import torch

from lowrank_laplace.posterior.precision import GramCache, LowRankPrecision


def _problem(dtype, sizes=(7, 3, 12, 2), rank=5):
    torch.manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(sum(sizes), rank, dtype=torch.float64))
    ell = torch.rand(rank, dtype=torch.float64) * 10 + 0.1
    layer_d = torch.rand(len(sizes), dtype=torch.float64) + 0.2
    return U.to(dtype), ell.to(dtype), layer_d.to(dtype), list(sizes)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_layer_constant_prior_equals_the_general_diagonal(dtype):
    U, ell, layer_d, sizes = _problem(dtype)
    d = layer_d.repeat_interleave(torch.tensor(sizes))
    general = LowRankPrecision(U, ell, d)
    layered = LowRankPrecision(U, ell, d, layers=(sizes, layer_d), gram_cache=GramCache())
    assert layered.layers is not None and general.layers is None
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layered.logdet(), general.logdet(), **tol)
    x = torch.randn(U.shape[0], 3, dtype=dtype)
    torch.testing.assert_close(layered.solve(x), general.solve(x), **tol)
    torch.testing.assert_close(layered.inverse_diagonal(), general.inverse_diagonal(), **tol)
    J = torch.randn(4, 2, U.shape[0], dtype=dtype)
    torch.testing.assert_close(layered.jacobian_variance(J), general.jacobian_variance(J), **tol)
    # the dense truth
    P = (U.double() * ell.double()) @ U.double().T + torch.diag(d.double())
    torch.testing.assert_close(layered.logdet().double(), torch.logdet(P), **tol)


def test_layerwise_gradient_equals_the_general_one():
    U, ell, layer_d, sizes = _problem(torch.float64)
    grads = []
    for use_layers in (True, False):
        delta = layer_d.clone().requires_grad_(True)
        d = delta.repeat_interleave(torch.tensor(sizes))
        P = LowRankPrecision(U, ell, d, layers=(sizes, delta) if use_layers else None)
        x = torch.randn(U.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        value = P.logdet() + (x * P.solve(x)).sum()
        grads.append(torch.autograd.grad(value, delta)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)


def test_layer_grams_follow_the_basis_and_fall_back_when_large():
    U, ell, layer_d, sizes = _problem(torch.float64)
    cache = GramCache()
    grams = cache.layer_grams(U, sizes)
    for gram, part in zip(grams, U.split(sizes)):
        torch.testing.assert_close(gram, part.T @ part)
    assert cache.layer_grams(U, sizes) is grams  # cached
    U.mul_(2.0)  # an in-place change is a new basis
    torch.testing.assert_close(cache.layer_grams(U, sizes)[0], 4 * grams[0])
    # more layer Gram entries than U has: the general path
    many = [1] * U.shape[0]
    P = LowRankPrecision(U, ell, torch.ones(U.shape[0], dtype=torch.float64),
                         layers=(many, torch.ones(len(many), dtype=torch.float64)))
    assert P.layers is None
