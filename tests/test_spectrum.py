"""Eigenpairs from the Gram matrix against dense eigendecompositions."""

import pytest
import torch

import lowrank_laplace as ll
from lowrank_laplace.utils import batches
from tests import reference as ref
from tests.conftest import make_case, one_pass_and_low_memory

TOL = dict(rtol=1e-5, atol=1e-8)


def dense_nonzero_eigvals(G):
    evals = torch.linalg.eigvalsh(G).flip(0)
    return evals[evals > 1e-10 * evals[0]]


def check_eigenpairs(res, G):
    U, lam = res.eigenvectors, res.eigenvalues
    # residual G e = lambda e and orthonormality; tiny eigenvalues filtered by the solver
    torch.testing.assert_close(G @ U, U * lam, rtol=1e-5, atol=1e-8 * G.abs().max())
    torch.testing.assert_close(U.T @ U, torch.eye(U.shape[1], dtype=U.dtype), **TOL)


def test_all_eigenvalues_and_vectors(case):
    model, loss_func, X, y = case
    res = ll.ggn_eigh(model, loss_func, X, y, top_k=None)
    assert res.all_eigenvalues is not None
    G = ref.ggn(model, loss_func, X, y)
    expected = dense_nonzero_eigvals(G)
    torch.testing.assert_close(res.eigenvalues, expected, rtol=1e-5, atol=1e-8 * expected[0])
    torch.testing.assert_close(res.all_eigenvalues, res.eigenvalues)
    check_eigenpairs(res, G)
    torch.testing.assert_close(res.trace, torch.trace(G), **TOL)
    torch.testing.assert_close(res.kept_fraction, torch.ones((), dtype=G.dtype), **TOL)
    # matrix-vector products with G (full rank selection) and with its truncation
    x = torch.randn(G.shape[0], dtype=G.dtype)
    torch.testing.assert_close(res.matvec(x), G @ x, rtol=1e-5, atol=1e-8 * G.abs().max())


@pytest.mark.parametrize("arch", ["mlp", "cnn", "bn_adaptive"])
def test_selections(arch):
    model, loss_func, X, y = make_case(arch, "ce-mean", n=6)
    G = ref.ggn(model, loss_func, X, y)
    expected = dense_nonzero_eigvals(G)
    top = ll.ggn_eigh(model, loss_func, X, y, top_k=3)
    torch.testing.assert_close(top.eigenvalues, expected[:3], **TOL)
    check_eigenpairs(top, G)
    torch.testing.assert_close(top.kept_fraction, expected[:3].sum() / torch.trace(G), **TOL)
    U, lam = top.eigenvectors, top.eigenvalues
    x = torch.randn(G.shape[0], 2, dtype=G.dtype)
    torch.testing.assert_close(top.matvec(x), U @ torch.diag(lam) @ U.T @ x, **TOL)

    thr = float(expected[4] + expected[5]) / 2  # between two eigenvalues: no ties
    above = ll.ggn_eigh(model, loss_func, X, y, top_k=None, threshold=thr)
    torch.testing.assert_close(above.eigenvalues, expected[expected >= thr], **TOL)

    picked = ll.ggn_eigh(model, loss_func, X, y, top_k=None, indices=[1, 4])
    torch.testing.assert_close(picked.eigenvalues, expected[[1, 4]], **TOL)
    check_eigenpairs(picked, G)

    per_param = top.eigenvectors_per_param()
    assert [t.shape[1:] for t in per_param] == [p.shape for p in model.parameters()]
    flat = torch.cat([t.reshape(3, -1) for t in per_param], dim=1).T
    torch.testing.assert_close(flat, top.eigenvectors)


@pytest.mark.parametrize("solver", ["arpack", "matrix_free"])
@pytest.mark.parametrize("loss", ["ce-mean", "mse-sum"])
def test_arpack_matches_eigh(loss, solver):
    model, loss_func, X, y = make_case("cnn", loss, n=8)
    dense = ll.ggn_eigh(model, loss_func, X, y, top_k=4, solver="eigh")
    lanczos = ll.ggn_eigh(model, loss_func, X, y, top_k=4, solver=solver)
    assert lanczos.all_eigenvalues is None
    torch.testing.assert_close(lanczos.eigenvalues, dense.eigenvalues, **TOL)
    check_eigenpairs(lanczos, ref.ggn(model, loss_func, X, y))
    torch.testing.assert_close(lanczos.trace, dense.trace, **TOL)


def test_param_groups_block_diagonal():
    model, loss_func, X, y = make_case("cnn", "mse-mean")
    params = list(model.parameters())
    groups = [{"params": params[:2]}, {"params": params[2:]}]
    results = ll.ggn_eigh(model, loss_func, X, y, top_k=None, param_groups=groups)
    eigvals = ll.ggn_eigvals(model, loss_func, X, y, param_groups=groups)
    G = ref.ggn(model, loss_func, X, y)
    d = sum(p.numel() for p in params[:2])
    for res, ev, block in zip(results, eigvals, [G[:d, :d], G[d:, d:]]):
        expected = dense_nonzero_eigvals(block)
        torch.testing.assert_close(res.eigenvalues, expected, rtol=1e-5, atol=1e-8 * expected[0])
        torch.testing.assert_close(ev, res.eigenvalues, **TOL)
        check_eigenpairs(res, block)


def test_eigvals_stagewise(case):
    model, loss_func, X, y = case
    evals = ll.ggn_eigvals(model, loss_func, X, y)
    expected = dense_nonzero_eigvals(ref.ggn(model, loss_func, X, y))
    torch.testing.assert_close(evals, expected, rtol=1e-5, atol=1e-8 * expected[0])


def test_mc_and_subsampling_eigenpairs():
    model, loss_func, X, y = make_case("mlp", "ce-mean", n=8)
    sub = [0, 3, 5]
    res = ll.ggn_eigh(model, loss_func, X, y, top_k=None, subsampling=sub)
    G_sub = ref.ggn(model, loss_func, X, y, subsampling=sub)
    torch.testing.assert_close(res.eigenvalues, dense_nonzero_eigvals(G_sub), **TOL)
    torch.manual_seed(0)
    mc = ll.ggn_eigh(model, loss_func, X, y, top_k=None, mc_samples=1)
    assert mc.eigenvalues.numel() <= X.shape[0]  # rank <= N * mc_samples



def test_low_memory_eigenpairs_against_dense(case):
    """Two backward passes (Gram, then V q block by block) give the exact eigenpairs."""
    model, loss_func, X, y = case
    G = ref.ggn(model, loss_func, X, y)
    expected = dense_nonzero_eigvals(G)
    res = ll.ggn_eigh(model, loss_func, X, y, top_k=3, low_memory=True)
    torch.testing.assert_close(res.eigenvalues, expected[:3], rtol=1e-5, atol=1e-8 * expected[0])
    check_eigenpairs(res, G)
    torch.testing.assert_close(res.trace, torch.trace(G), **TOL)


@pytest.mark.parametrize("mc_samples", [0, 2])
def test_low_memory_replays_mc_draws_and_groups(mc_samples):
    model, loss_func, X, y = make_case("cnn", "ce-mean", n=8)
    params = list(model.parameters())
    for groups in (None, [{"params": params[:2]}, {"params": params[2:]}]):
        torch.manual_seed(7)
        one = ll.ggn_eigh(model, loss_func, X, y, top_k=4, mc_samples=mc_samples,
                          param_groups=groups)
        after_one = torch.get_rng_state()
        torch.manual_seed(7)
        two = ll.ggn_eigh(model, loss_func, X, y, top_k=4, mc_samples=mc_samples,
                          param_groups=groups, low_memory=True)
        # the same curvature (same draws), and the caller's RNG advanced as by one pass
        assert torch.equal(torch.get_rng_state(), after_one)
        for a, b in zip(*(r if isinstance(r, list) else [r] for r in (one, two))):
            torch.testing.assert_close(b.eigenvalues, a.eigenvalues, **TOL)
            torch.testing.assert_close(b.eigenvectors.T @ a.eigenvectors,
                                       torch.diag((b.eigenvectors.T @ a.eigenvectors).diagonal()),
                                       rtol=0, atol=1e-6)
            torch.testing.assert_close(b.eigenvectors.abs(), a.eigenvectors.abs(), **TOL)
    with pytest.raises(ValueError, match="matrix_free.*low_memory=False"):
        ll.ggn_eigh(model, loss_func, X, y, top_k=2, solver="matrix_free", low_memory=True)

def test_selection_errors():
    model, loss_func, X, y = make_case("mlp", "ce-mean")
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        ll.ggn_eigh(model, loss_func, X, y, top_k=0)
    with pytest.raises(ValueError, match="indices must lie in"):
        ll.ggn_eigh(model, loss_func, X, y, top_k=None, indices=[100])
    with pytest.raises(ValueError, match="either indices or top_k"):
        ll.ggn_eigh(model, loss_func, X, y, top_k=2, indices=[0])
    with pytest.raises(ValueError, match="solver must be one of"):
        ll.ggn_eigh(model, loss_func, X, y, solver="qr")
    for solver in ("arpack", "matrix_free"):
        with pytest.raises(ValueError, match="computes top_k eigenpairs only"):
            ll.ggn_eigh(model, loss_func, X, y, top_k=None, solver=solver)


def test_layerwise_groups_match_dense_blocks():
    model, loss_func, X, y = make_case("bn_adaptive", "ce-sum")
    groups = ll.layerwise_param_groups(model)
    assert [g["name"] for g in groups] == ["0", "1", "6"]
    results = ll.ggn_eigh(model, loss_func, X, y, top_k=None, param_groups=groups)
    G = ref.ggn(model, loss_func, X, y)
    start = 0
    for res in results:
        d = res.eigenvectors.shape[0]
        check_eigenpairs(res, G[start : start + d, start : start + d])
        start += d


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_results_follow_device_and_dtype(device, dtype):
    model, loss_func, X, y = make_case("cnn", "ce-mean", n=6, device=device, dtype=dtype)
    res = ll.ggn_eigh(model, loss_func, X, y, top_k=3)
    dd = ll.directional_derivatives(model, loss_func, X, y, top_k=3)
    step = ll.damped_newton_step(model, loss_func, X, y)
    for t in (res.eigenvalues, res.eigenvectors, res.trace, dd.gammas, dd.lambdas, step):
        assert t.device.type == device and t.dtype == dtype
    # the low-memory modes replay the device's MC draws: same results as one pass
    (mc, mc_step), (low, low_step) = one_pass_and_low_memory(model, loss_func, X, y, 1)
    assert low.eigenvectors.device.type == device and low_step.dtype == dtype
    torch.testing.assert_close(low.eigenvalues, mc.eigenvalues)
    torch.testing.assert_close(low_step, mc_step)
    cpu = ll.ggn_eigh(model.cpu().double(), loss_func, X.cpu().double(), y.cpu(), top_k=3)
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else TOL  # float32 rounding
    torch.testing.assert_close(res.eigenvalues.cpu().double(), cpu.eigenvalues, **tol)


def _memory_case():
    model, loss_func, X, y = make_case("cnn", "ce-mean", n=6)
    with ll.FactorEngine(model, loss_func) as engine:
        full = 6 * engine.bytes_per_sample(X)
        lean = 6 * engine.bytes_per_sample(X, one_block=True)
    assert lean < full
    return (model, loss_func, X, y), full, lean


def _inverse(model, loss_func, X, y, **kw):
    x = torch.ones(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    return ll.ggn_inverse_matvec(model, loss_func, X, y, x, 0.1, **kw)


MEMORY_CALLS = {
    "ggn_eigh": lambda *c, **kw: ll.ggn_eigh(*c, top_k=2, **kw).eigenvalues,
    "directional_derivatives": lambda *c, **kw: ll.directional_derivatives(
        *c, top_k=2, **kw).lambdas,
    "damped_newton_step": lambda *c, **kw: ll.damped_newton_step(*c, **kw),
    "ggn_inverse_matvec": _inverse,
}


@pytest.mark.parametrize("name", list(MEMORY_CALLS))
def test_v_that_does_not_fit_is_refused_before_any_pass(name, monkeypatch):
    call = MEMORY_CALLS[name]
    case, full, lean = _memory_case()
    expected = call(*case)
    monkeypatch.setattr(batches, "available_memory", lambda device: (full + lean) // 2)
    # sizes of small models in the unit they fill, never "0.0 GiB above 0.0 GiB"
    size = r"[1-9][\d.]* (bytes|KiB|MiB)"
    with pytest.raises(MemoryError, match=rf"{name}: V for 6 samples needs about {size}, but "
                                          rf"cpu has {size} available.* low_memory=True "
                                          rf"\(about {size}:"):
        call(*case)
    torch.testing.assert_close(call(*case, low_memory=True), expected, rtol=1e-6, atol=1e-9)
    monkeypatch.setattr(batches, "available_memory", lambda device: lean // 2)
    with pytest.raises(MemoryError, match="largest block of V .* a smaller batch"):
        call(*case, low_memory=True)


def test_ggn_eigvals_holds_only_the_largest_block(monkeypatch):
    case, full, lean = _memory_case()
    expected = ll.ggn_eigvals(*case)
    monkeypatch.setattr(batches, "available_memory", lambda device: (full + lean) // 2)
    torch.testing.assert_close(ll.ggn_eigvals(*case), expected)
    monkeypatch.setattr(batches, "available_memory", lambda device: lean // 2)
    with pytest.raises(MemoryError, match="ggn_eigvals"):
        ll.ggn_eigvals(*case)
