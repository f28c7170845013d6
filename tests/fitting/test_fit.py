"""fit_loader on its own (no laplace-torch object) against the dense GGN."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowrank_laplace.fitting.config import FitConfig
from lowrank_laplace.fitting.fit import FitResult, fit_loader
from tests import reference as ref

TOL = dict(rtol=1e-7, atol=1e-9)


def _problem(likelihood, n=20, out=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, out)).double()
    X = torch.randn(n, 4, dtype=torch.float64)
    y = torch.randint(0, out, (n,)) if likelihood == "classification" else \
        torch.randn(n, out, dtype=torch.float64)
    return model, X, y, DataLoader(TensorDataset(X, y), batch_size=6)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("dense_max_dim, path", [(0, "streaming"), (2048, "dense")])
def test_full_rank_fit_is_laplace_torchs_ggn(likelihood, dense_max_dim, path, tune):
    model, X, y, loader = _problem(likelihood)
    before = [p.detach().clone() for p in model.parameters()]
    tune(dense_max_dim=dense_max_dim)
    options = FitConfig(rank=1000, track_diagonal=True)
    result = fit_loader(model, likelihood, loader, options)
    assert isinstance(result, FitResult) and result.fit_path == path
    # laplace-torch's GGN: cross-entropy summed, or 1/2 the summed squared error's
    loss_func, factor = (nn.CrossEntropyLoss(reduction="sum"), 1.0) \
        if likelihood == "classification" else (nn.MSELoss(reduction="sum"), 0.5)
    G = factor * ref.ggn(model, loss_func, X, y)
    U, lam = result.eigenvectors, result.eigenvalues
    torch.testing.assert_close(U @ torch.diag(lam) @ U.T, G, **TOL)
    torch.testing.assert_close(result.trace, G.trace(), **TOL)
    torch.testing.assert_close(result.residual_diagonal, torch.zeros_like(G.diagonal()),
                               rtol=0, atol=1e-9)
    with torch.no_grad():
        torch.testing.assert_close(result.loss, factor * loss_func(model(X), y), **TOL)
    assert result.n_data == len(X) and result.n_outputs == 3
    assert result.factor_backend == "backpack" and result.probe is None
    torch.testing.assert_close(result.mean, torch.cat([p.flatten() for p in before]))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_previous_fit_is_merged_like_another_batch(tune):
    model, X, y, loader = _problem("classification")
    tune(dense_max_dim=0)
    half = len(X) // 2
    first, second = (DataLoader(TensorDataset(X[s], y[s]), batch_size=6)
                     for s in (slice(0, half), slice(half, None)))
    options = FitConfig(rank=1000)
    both = fit_loader(model, "classification", second, options,
                           previous=fit_loader(model, "classification", first, options))
    whole = fit_loader(model, "classification", loader, options)
    torch.testing.assert_close(both.eigenvectors @ torch.diag(both.eigenvalues)
                               @ both.eigenvectors.T,
                               whole.eigenvectors @ torch.diag(whole.eigenvalues)
                               @ whole.eigenvectors.T, **TOL)
    assert both.n_data == whole.n_data and torch.allclose(both.loss, whole.loss)


def test_bad_loaders_and_targets_fail_before_any_pass():
    model, X, y, loader = _problem("classification")
    options = FitConfig()
    with pytest.raises(ValueError, match="needs a .dataset"):
        fit_loader(model, "classification", [(X, y)], options)
    with pytest.raises(ValueError, match="train_loader is empty"):
        fit_loader(model, "classification", DataLoader(TensorDataset(X[:0], y[:0])),
                        options)
    with pytest.raises(ValueError, match="integer class targets"):
        fit_loader(model, "classification",
                        DataLoader(TensorDataset(X, y.double()), batch_size=5), options)


def test_the_fit_keeps_its_first_inputs_for_a_probe_pass():
    model, X, y, loader = _problem("classification")
    result = fit_loader(model, "classification", loader, FitConfig(probe_inputs=8))
    kept = torch.cat(result.probe.batches)
    torch.testing.assert_close(kept, X[:8], rtol=0, atol=0)
    assert result.probe.cap >= 1
    assert fit_loader(model, "classification", loader, FitConfig()).probe is None


def _package_frames(stack):
    """Frames of the package's own modules, outermost first."""
    import lowrank_laplace

    root = lowrank_laplace.__file__.rsplit("/", 1)[0]
    return [f for f in reversed(stack) if f.filename.startswith(root)]


@pytest.mark.parametrize("solver", ["streaming", "sketch", "dense"])
def test_the_fit_reaches_the_eigensolver_in_at_most_eight_package_frames(
        monkeypatch, tune, solver):
    """From ``la.fit`` down to ``torch.linalg.eigh``: a short call chain.

    Streaming's deepest: ``fit``, ``fit_posterior``, ``run``, ``_pass``, the streamer's
    ``add``, ``add_factor``, ``_merge_eigh``, ``top_eigh`` (every merge after the first).
    """
    import inspect

    from laplace import Laplace

    import lowrank_laplace  # noqa: F401

    tune(dense_max_dim=2048 if solver == "dense" else 0)
    model, X, y, loader = _problem("classification", n=40)
    depths, eigh = [], torch.linalg.eigh

    def recording(*args, **kwargs):
        frames = _package_frames(inspect.stack()[1:])
        names = [f.function for f in frames]
        if "fit" in names:
            depths.append(len(frames) - names.index("fit"))
        return eigh(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", recording)
    la = Laplace(model, "classification", subset_of_weights="all",
                 hessian_structure="lowrank_ggn", rank=4, residual="none",
                 solver="auto" if solver == "dense" else solver,
                 micro_batch_size=None if solver == "dense" else 2)
    la.fit(loader)
    assert la.fit_path == solver and depths
    assert max(depths) <= 8, depths


def test_a_fit_sets_the_thread_count_at_most_once(monkeypatch):
    """One scoped setting per fit (set, then restored), whatever the batches."""
    from laplace import Laplace

    import lowrank_laplace  # noqa: F401

    calls, setter = [], torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), setter(n)))
    before = torch.get_num_threads()
    model, X, y, loader = _problem("classification", n=40)
    la = Laplace(model, "classification", subset_of_weights="all",
                 hessian_structure="lowrank_ggn", rank=4)
    la.fit(loader)
    assert len(calls) <= 2 and torch.get_num_threads() == before
