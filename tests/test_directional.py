"""Directional derivatives, Newton steps and inverse products against brute force."""

import pytest
import torch

import lowrank_laplace as ll
from tests import reference as ref
from tests.conftest import make_case

TOL = dict(rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("low_memory", [False, True], ids=["one-pass", "low-memory"])
def test_directional_derivatives_brute_force(case, low_memory):
    model, loss_func, X, y = case
    dd = ll.directional_derivatives(model, loss_func, X, y, top_k=3, low_memory=low_memory)
    U = dd.eigenvectors
    g_n = ref.per_sample_grads(model, loss_func, X, y)
    G_n = ref.per_sample_ggns(model, loss_func, X, y)
    torch.testing.assert_close(dd.gammas, g_n @ U, **TOL)
    lambdas = torch.einsum("dk,nde,ek->nk", U, G_n, U)
    torch.testing.assert_close(dd.lambdas, lambdas, **TOL)
    if loss_func.reduction == "mean":
        g = ref.gradient(model, loss_func, X, y)
        torch.testing.assert_close(dd.gammas.mean(0), U.T @ g, **TOL)
        torch.testing.assert_close(dd.lambdas.mean(0), dd.eigenvalues, **TOL)
    else:
        torch.testing.assert_close(dd.lambdas.sum(0), dd.eigenvalues, **TOL)
    torch.testing.assert_close(dd.gamma_snr, dd.gammas.mean(0) ** 2 / dd.gammas.var(0), **TOL)
    n = dd.lambdas.shape[0]
    var = ((dd.lambdas - dd.lambdas.mean(0)) ** 2).sum(0) / (n - 1)
    torch.testing.assert_close(dd.lambda_snr, dd.lambdas.mean(0) ** 2 / var, **TOL)


@pytest.mark.parametrize("low_memory", [False, True], ids=["one-pass", "low-memory"])
def test_directional_derivatives_subsampling_and_groups(low_memory):
    model, loss_func, X, y = make_case("cnn", "ce-mean", n=6)
    sub = [1, 2, 5]
    dd = ll.directional_derivatives(model, loss_func, X, y, top_k=2, subsampling=sub,
                                    low_memory=low_memory)
    assert dd.gammas.shape == (6, 2) and dd.lambdas.shape == (3, 2)
    G_n = ref.per_sample_ggns(model, loss_func, X, y, subsampling=sub)
    U = dd.eigenvectors
    torch.testing.assert_close(dd.lambdas, torch.einsum("dk,nde,ek->nk", U, G_n, U), **TOL)
    torch.testing.assert_close(dd.gammas, ref.per_sample_grads(model, loss_func, X, y) @ U, **TOL)

    params = list(model.parameters())
    groups = [{"params": params[:2]}, {"params": params[2:]}]
    dds = ll.directional_derivatives(model, loss_func, X, y, top_k=2, param_groups=groups,
                                     low_memory=low_memory)
    d = sum(p.numel() for p in params[:2])
    g_n = ref.per_sample_grads(model, loss_func, X, y)
    torch.testing.assert_close(dds[0].gammas, g_n[:, :d] @ dds[0].eigenvectors, **TOL)
    torch.testing.assert_close(dds[1].gammas, g_n[:, d:] @ dds[1].eigenvectors, **TOL)


def test_snr_needs_two_samples():
    with pytest.raises(ValueError, match="at least two samples"):
        ll.snr(torch.ones(1, 3))


@pytest.mark.parametrize("low_memory", [False, True], ids=["one-pass", "low-memory"])
@pytest.mark.parametrize("top_k", [None, 2])
def test_damped_newton_step(case, top_k, low_memory):
    model, loss_func, X, y = case
    damping = 0.5
    step = ll.damped_newton_step(model, loss_func, X, y, damping=damping, top_k=top_k,
                                 low_memory=low_memory)
    G = ref.ggn(model, loss_func, X, y)
    g = ref.gradient(model, loss_func, X, y)
    evals, evecs = torch.linalg.eigh(G)
    evals, evecs = evals.flip(0), evecs.flip(1)
    keep = evals > 1e-10 * evals[0]
    evals, evecs = evals[keep], evecs[:, keep]
    if top_k is not None:
        evals, evecs = evals[:top_k], evecs[:, :top_k]
    expected = -evecs @ ((evecs.T @ g) / (evals + damping))
    torch.testing.assert_close(step, expected, **TOL)


def test_newton_step_block_diagonal():
    model, loss_func, X, y = make_case("mlp", "mse-mean")
    params = list(model.parameters())
    groups = [{"params": params[:2]}, {"params": params[2:]}]
    step = ll.damped_newton_step(model, loss_func, X, y, damping=1.0, param_groups=groups)
    G = ref.ggn(model, loss_func, X, y)
    g = ref.gradient(model, loss_func, X, y)
    d = sum(p.numel() for p in params[:2])
    parts = []
    for sl in (slice(0, d), slice(d, None)):
        evals, evecs = torch.linalg.eigh(G[sl, sl])
        keep = evals > 1e-10 * evals.max()
        evals, evecs = evals[keep], evecs[:, keep]
        parts.append(-evecs @ ((evecs.T @ g[sl]) / (evals + 1.0)))
    torch.testing.assert_close(step, torch.cat(parts), **TOL)



def test_low_memory_newton_step_replays_draws():
    """Dropout in train mode, MC draws, sub-sampling and groups: the low-memory passes
    give the one-pass step, inverse products and directional derivatives; the caller's
    RNG advances as by one pass."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 3, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Dropout(0.3),
        torch.nn.Linear(48, 4),
    ).double()
    X, y = torch.randn(10, 1, 6, 6, dtype=torch.float64), torch.randint(0, 4, (10,))
    loss_func = torch.nn.CrossEntropyLoss()
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[4].parameters())}]
    before = [p.detach().clone() for p in model.parameters()]
    for kwargs in (dict(mc_samples=2), dict(subsampling=[0, 3, 5], param_groups=groups),
                   dict(mc_samples=1, top_k=3)):
        torch.manual_seed(5)
        one = ll.damped_newton_step(model, loss_func, X, y, damping=0.5, **kwargs)
        after_one = torch.get_rng_state()
        torch.manual_seed(5)
        three = ll.damped_newton_step(model, loss_func, X, y, damping=0.5, low_memory=True,
                                      **kwargs)
        assert torch.equal(torch.get_rng_state(), after_one)
        torch.testing.assert_close(three, one, rtol=1e-10, atol=1e-12 * one.abs().max())
        vec = torch.randn(one.shape[0], 2, dtype=torch.float64)
        extra = {k: v for k, v in kwargs.items() if k != "top_k"}
        torch.manual_seed(5)
        inv = ll.ggn_inverse_matvec(model, loss_func, X, y, vec, damping=0.5, **extra)
        torch.manual_seed(5)
        inv2 = ll.ggn_inverse_matvec(model, loss_func, X, y, vec, damping=0.5, low_memory=True,
                                     **extra)
        torch.testing.assert_close(inv2, inv, rtol=1e-10, atol=1e-12 * inv.abs().max())
        torch.manual_seed(5)
        dd = ll.directional_derivatives(model, loss_func, X, y, **kwargs)
        torch.manual_seed(5)
        dd2 = ll.directional_derivatives(model, loss_func, X, y, low_memory=True, **kwargs)
        for a, b in zip(*(r if isinstance(r, list) else [r] for r in (dd, dd2))):
            for name in ("gammas", "lambdas", "eigenvalues", "eigenvectors"):
                torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=1e-10,
                                           atol=1e-12 * getattr(a, name).abs().max())
    # the user's model comes back as it was: mode, parameters, no hooks
    assert model.training and all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert sum(len(m._forward_hooks) + len(m._backward_hooks) + len(m._forward_pre_hooks)
               for m in model.modules()) == 0

@pytest.mark.parametrize("low_memory", [False, True], ids=["one-pass", "low-memory"])
def test_inverse_matvec_full_and_block_diagonal(case, low_memory):
    model, loss_func, X, y = case
    G = ref.ggn(model, loss_func, X, y)
    D = G.shape[0]
    x = torch.randn(D, 2, dtype=G.dtype)
    delta = 0.3
    out = ll.ggn_inverse_matvec(model, loss_func, X, y, x, damping=delta,
                                low_memory=low_memory)
    eye = torch.eye(D, dtype=G.dtype)
    torch.testing.assert_close(out, torch.linalg.solve(G + delta * eye, x), **TOL)
    params = list(model.parameters())
    groups = [{"params": [p]} for p in params]
    out = ll.ggn_inverse_matvec(model, loss_func, X, y, x[:, 0], damping=delta, param_groups=groups,
                                low_memory=low_memory)
    sizes = [p.numel() for p in params]
    starts = torch.tensor([0] + sizes).cumsum(0).tolist()
    blocks = [G[a : a + s, a : a + s] for a, s in zip(starts, sizes)]
    B = torch.block_diag(*blocks)
    torch.testing.assert_close(out, torch.linalg.solve(B + delta * eye, x[:, 0]), **TOL)


def test_newton_and_inverse_errors():
    model, loss_func, X, y = make_case("mlp", "ce-mean")
    for low_memory in (False, True):
        with pytest.raises(ValueError, match="damping must be a finite non-negative"):
            ll.damped_newton_step(model, loss_func, X, y, damping=-1.0, low_memory=low_memory)
    D = sum(p.numel() for p in model.parameters())
    for low_memory in (False, True):
        with pytest.raises(ValueError, match="damping must be a finite positive"):
            ll.ggn_inverse_matvec(model, loss_func, X, y, torch.ones(D, dtype=X.dtype),
                                  damping=0.0, low_memory=low_memory)
        with pytest.raises(ValueError, match="vec has 3 entries"):
            ll.ggn_inverse_matvec(model, loss_func, X, y, torch.ones(3, dtype=X.dtype),
                                  damping=1.0, low_memory=low_memory)


@pytest.mark.parametrize("damping", [float("nan"), float("inf"), -1.0, "0.5"])
def test_bad_damping_is_refused_before_work(damping):
    model, loss_func, X, y = make_case("mlp", "ce-mean")
    for low_memory in (False, True):
        with pytest.raises(ValueError, match="damping must be a finite non-negative"):
            ll.damped_newton_step(model, loss_func, X, y, damping=damping,
                                  low_memory=low_memory)
    vec = torch.ones(sum(p.numel() for p in model.parameters()), dtype=X.dtype)
    with pytest.raises(ValueError, match="damping must be a finite positive"):
        ll.ggn_inverse_matvec(model, loss_func, X, y, vec, damping=damping)
    with pytest.raises(ValueError, match="damping must be a finite positive"):
        ll.ggn_inverse_matvec(model, loss_func, X, y, vec, damping=0.0)


@pytest.mark.parametrize("backend", ["functorch", "backpack"])
@pytest.mark.parametrize("subsampling", [None, [5, 0, 2]])
def test_low_memory_replays_train_mode_dropout(backend, subsampling):
    """Every low-memory pass sees the dropout masks of the one-pass computation
    (the first call's probe draws from a forked generator, the functorch Newton step
    takes its gradient from the vmapped Gram pass), so the results agree."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(6, 3)).double()
    X, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    loss_func = torch.nn.CrossEntropyLoss()
    vec = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    kw = dict(backend=backend, subsampling=subsampling)
    calls = {
        "newton": lambda **k: ll.damped_newton_step(model, loss_func, X, y, damping=0.5,
                                                    **kw, **k),
        "inverse": lambda **k: ll.ggn_inverse_matvec(model, loss_func, X, y, vec, 0.5,
                                                     **kw, **k),
        "eigh": lambda **k: ll.ggn_eigh(model, loss_func, X, y, top_k=3, **kw,
                                        **k).eigenvalues,
        "directional": lambda **k: ll.directional_derivatives(model, loss_func, X, y,
                                                              top_k=3, **kw, **k).lambdas,
    }
    for name, call in calls.items():
        torch.manual_seed(7)
        one = call()
        torch.manual_seed(7)
        two = call(low_memory=True)
        torch.testing.assert_close(two, one, rtol=1e-9, atol=1e-12 * one.abs().max(),
                                   msg=lambda m, name=name: f"{name}: {m}")
        torch.manual_seed(8)
        other = call()
        assert not torch.allclose(other, one), "the masks should differ between seeds"
    assert model.training  # left as it was
