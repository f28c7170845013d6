"""Unusual inputs to the laplace-torch classes: the right answer or one clear error first.

The right answers are checked against laplace-torch's ``FullLaplace`` or a dense
float64 computation; every refusal happens before the fit does its work.
"""

import math

import numpy as np
import pytest
import torch
from laplace import FullLaplace, Laplace
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import lowrank_laplace  # noqa: F401  (registers lowrank_ggn)
from lowrank_laplace import LowRankGGNLaplace, LowRankGGNLLLaplace
from lowrank_laplace.posterior import predictive

STRUCTURES = ["all", "last_layer"]


def _mlp(out=2):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(),
                         nn.Linear(5, out)).double()


def _data(n=24, regression=False):
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(n, 2, generator=gen, dtype=torch.float64) if regression else \
        torch.randint(0, 2, (n,), generator=gen)
    return X, y


def _loader(n=24, batch_size=8, regression=False):
    return DataLoader(TensorDataset(*_data(n, regression)), batch_size=batch_size)


class _Counting:
    """A loader that counts the batches it yields."""

    def __init__(self, loader):
        self.loader, self.dataset, self.count = loader, loader.dataset, 0

    def __iter__(self):
        for batch in self.loader:
            self.count += 1
            yield batch

    def __len__(self):
        return len(self.loader)


@pytest.mark.parametrize("subset", STRUCTURES)
@pytest.mark.parametrize("name, value", [("sigma_noise", "1.2"), ("prior_precision", "1.0"),
                                         ("sigma_noise", None), ("prior_precision", [1.0])])
def test_hyperparameters_of_the_wrong_type_raise_laplace_torchs_value_error(subset, name, value):
    with pytest.raises(ValueError, match=f"{name} must be a positive float or a torch.Tensor"):
        Laplace(_mlp(), "regression", subset, "lowrank_ggn", **{name: value})


@pytest.mark.parametrize("prior", [0.7, torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0, 5.0])])
def test_log_prob_before_fit_is_the_prior_density_as_in_full_laplace(prior):
    model = _mlp()
    ours = LowRankGGNLaplace(model, "classification", prior_precision=prior)
    full = FullLaplace(model, "classification", prior_precision=prior)
    theta = torch.randn(ours.n_params, dtype=torch.float64)
    variance = 1 / ours.prior_precision_diag
    expected = torch.distributions.Normal(0, variance.sqrt()).log_prob(theta).sum()
    assert torch.allclose(ours.log_prob(theta), expected)
    assert torch.allclose(ours.log_prob(theta), full.log_prob(theta))
    assert torch.allclose(ours.log_prob(theta, normalized=False),
                          -(theta**2 / variance).sum() / 2)


@pytest.mark.parametrize("query", ["log_prob", "predict", "sample"])
def test_last_layer_queries_before_fit_say_not_fitted(query):
    la = Laplace(_mlp(), "classification", "last_layer", "lowrank_ggn")
    calls = {"log_prob": lambda: la.log_prob(torch.zeros(12)),
             "predict": lambda: la(_data()[0]), "sample": lambda: la.sample(3)}
    with pytest.raises(AttributeError, match="Laplace not fitted. Run fit"):
        calls[query]()


@pytest.mark.parametrize("subset", STRUCTURES)
def test_empty_loader_and_batches_of_arrays_are_refused(subset):
    empty = DataLoader(TensorDataset(*_data(0)), batch_size=8)
    with pytest.raises(ValueError, match="train_loader is empty"):
        Laplace(_mlp(), "classification", subset, "lowrank_ggn").fit(empty)
    X, y = _data()
    arrays = _Counting(DataLoader(TensorDataset(X, y), batch_size=8,
                                  collate_fn=lambda b: tuple(np.stack(c) for c in zip(*b))))
    la = Laplace(_mlp(), "classification", subset, "lowrank_ggn", low_memory=True)
    with pytest.raises(TypeError, match=r"got \(ndarray, ndarray\): wrap arrays"):
        la.fit(arrays)


@pytest.mark.parametrize("subset", STRUCTURES)
def test_batches_with_sample_weights_are_refused_naming_the_pair(subset):
    X, y = _data()
    weights = torch.ones(len(y), dtype=torch.float64)
    triples = _Counting(DataLoader(TensorDataset(X, y, weights), batch_size=8))
    la = Laplace(_mlp(), "classification", subset, "lowrank_ggn")
    with pytest.raises(ValueError, match=r"must yield \(X, y\) pairs or dict batches, got a "
                                         r"list of 3 items: .* no sample weights"):
        la.fit(triples)
    assert triples.count == 1


@pytest.mark.parametrize("subset", STRUCTURES)
def test_meta_inputs_to_a_cpu_model_are_refused_in_fit_and_prediction(subset):
    X, y = _data()
    meta = "inputs are on the meta device, which holds shapes but no values"
    la = Laplace(_mlp(), "classification", subset, "lowrank_ggn")
    with pytest.raises(ValueError, match=meta):
        la.fit(DataLoader(TensorDataset(X.to("meta"), y), batch_size=8))
    la.fit(_loader())
    for query in (lambda: la(X.to("meta")), lambda: la(X.to("meta"), joint=True),
                  lambda: la.predictive_samples(X.to("meta"), n_samples=2)):
        with pytest.raises(ValueError, match=meta):
            query()


@pytest.mark.parametrize("subset", STRUCTURES)
def test_frozen_and_meta_parameters_are_refused_before_the_fit(subset):
    frozen = _mlp().requires_grad_(False)
    loader = _Counting(_loader())
    match = "no trainable parameters" if subset == "all" else "must require gradients"
    with pytest.raises(ValueError, match=match):
        Laplace(frozen, "classification", subset, "lowrank_ggn").fit(loader)
    meta = _mlp().to("meta")
    with pytest.raises(ValueError, match="'meta' device and hold no values"):
        Laplace(meta, "classification", "all", "lowrank_ggn").fit(loader)
    assert loader.count <= 3  # first batches only (the last layer is found on one)


@pytest.mark.parametrize("subset", STRUCTURES)
def test_iterable_dataset_without_length_counts_its_samples(subset):
    X, y = _data(30)

    class Stream(IterableDataset):
        def __iter__(self):
            yield from ((X[i:i + 7], y[i:i + 7]) for i in range(0, 30, 7))

    streamed = Laplace(_mlp(), "classification", subset, "lowrank_ggn", rank=80)
    streamed.fit(DataLoader(Stream(), batch_size=None))
    mapped = Laplace(_mlp(), "classification", subset, "lowrank_ggn", rank=80)
    mapped.fit(DataLoader(TensorDataset(X, y), batch_size=7))
    assert streamed.n_data == 30
    dense = [(U * lam) @ U.T for U, lam in (streamed.H, mapped.H)]
    assert torch.allclose(dense[0], dense[1], atol=1e-10)
    assert torch.allclose(streamed.log_marginal_likelihood(),
                          mapped.log_marginal_likelihood())


@pytest.mark.parametrize("n", [-1, 2.0, True])
def test_sample_count_must_be_a_non_negative_int(n):
    la = Laplace(_mlp(), "classification", "all", "lowrank_ggn")
    la.fit(_loader())
    with pytest.raises(ValueError, match="n_samples must be a non-negative int"):
        la.sample(n)
    assert la.sample(0).shape == (0, la.n_params)


def test_zero_ggn_keeps_no_eigenpairs_and_matches_full_laplace():
    X = torch.zeros(8, 3, dtype=torch.float64)  # no bias: every Jacobian is zero
    loader = DataLoader(TensorDataset(X, torch.zeros(8, 2, dtype=torch.float64)),
                        batch_size=4)
    model = nn.Sequential(nn.Linear(3, 2, bias=False)).double()
    ours = Laplace(model, "regression", "all", "lowrank_ggn", prior_precision=0.5)
    ours.fit(loader)
    full = FullLaplace(model, "regression", prior_precision=0.5)
    full.fit(loader)
    assert ours.H[0].shape == (6, 0) and ours.H[1].numel() == 0
    assert float(ours.kept_fraction) == 1.0
    assert torch.allclose(ours.log_marginal_likelihood(), full.log_marginal_likelihood())
    assert torch.allclose(ours.posterior_variance, torch.full((6,), 2.0, dtype=torch.float64))
    Xt = torch.randn(4, 3, dtype=torch.float64)
    for a, b in zip(ours(Xt, pred_type="glm"), full(Xt, pred_type="glm")):
        assert torch.allclose(a, b)


def test_residual_none_runs_no_jacobian_probe(monkeypatch):
    calls = []
    real = predictive.jacobian_engine
    monkeypatch.setattr("lowrank_laplace.fitting.fit.jacobian_engine",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    for residual in ("none", "isotropic", "spectral"):
        la = Laplace(_mlp(), "classification", "all", "lowrank_ggn", rank=5,
                     residual=residual)
        la.fit(_loader())
        assert len(calls) == (residual == "spectral")
    with pytest.warns(UserWarning, match="does not measure the dropped curvature"):
        la = Laplace(_mlp(), "classification", "all", "lowrank_ggn", rank=5,
                     residual="none")
        la.fit(_loader())
        la.residual = "spectral"


def test_memory_budget_too_small_for_the_probe_fails_at_the_first_batch():
    model, loader = _mlp(), _Counting(_loader())
    probe_needs = 8 * sum(p.numel() for p in model.parameters())  # one float64 vector
    la = Laplace(model, "classification", "all", "lowrank_ggn", rank=5, low_memory=True,
                 memory_budget=probe_needs // 2)
    with pytest.raises(ValueError, match="too small for the residual model's probe pass"):
        la.fit(loader)
    assert loader.count == 1
    la = Laplace(model, "classification", "all", "lowrank_ggn", rank=5, low_memory=True,
                 memory_budget=probe_needs // 2, residual="isotropic")
    la.fit(loader)  # no probe, so the budget suffices
    assert math.isfinite(float(la.log_marginal_likelihood()))


def test_a_budget_without_room_for_the_lanczos_basis_fits_and_says_so():
    model = _mlp(out=4)
    probe_needs = 8 * sum(p.numel() for p in model.parameters())
    la = Laplace(model, "classification", "all", "lowrank_ggn", rank=5,
                 memory_budget=3 * probe_needs)  # the fit's 3 columns fit, the basis not
    la.fit(_loader())
    assert la.fit_report.quadrature_steps == 0
    assert "not measured (its Lanczos basis exceeds memory_budget)" in str(la.fit_report)
    assert math.isfinite(float(la.log_marginal_likelihood()))


def test_last_layer_text_prior_is_refused_at_construction():
    with pytest.raises(ValueError, match="prior_precision must be a positive float"):
        LowRankGGNLLLaplace(_mlp(), "classification", prior_precision="1.0")


def test_a_float32_sketch_says_what_it_loses_only_where_it_stays_float32(recwarn,
                                                                        monkeypatch, tune):
    """A float32 sketch whose kept eigenvalues are clear of its rounding stays float32,
    one that rounded them is redone in float64 (silently); where the float64 ``D x l``
    matrix exceeds a quarter of the budget it stays float32 and says so."""
    from lowrank_laplace.fitting import sketch

    monkeypatch.setattr(sketch, "RESOLVED_RATIO", 1e30)  # every float32 sketch rounds
    model = _mlp().float()
    X, y = _data()
    loader = DataLoader(TensorDataset(X.float(), y), batch_size=8)
    tune(dense_max_dim=0, probe_size=0)
    kw = dict(rank=5, solver="sketch", micro_batch_size=4)
    la = Laplace(model, "classification", "all", "lowrank_ggn", **kw)
    la.fit(loader)
    assert la.fit_path == "sketch" and la.H[0].dtype == torch.float32
    assert not [w for w in recwarn if "accumulated its sketch" in str(w.message)]
    dim = sum(p.numel() for p in model.parameters())
    budget = 4 * 8 * dim * 6 - 1  # the float64 sketch (6 columns) just over a quarter
    with pytest.warns(UserWarning, match="solver='sketch' accumulated its sketch in torch.float32"):
        Laplace(model, "classification", "all", "lowrank_ggn", memory_budget=budget,
                **kw).fit(loader)


def test_inference_mode_is_refused_with_the_way_out():
    """torch-uncertainty's Lightning test loop runs under inference_mode: the fit and the
    GLM predictive, which need backward passes, say to use no_grad instead."""
    la = Laplace(_mlp(), "classification", "all", "lowrank_ggn", rank=5)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="under torch.no_grad"):
        la.fit(_loader())
    la.fit(_loader())
    X, _ = _data()
    with torch.no_grad():
        probs = la(X[:3], pred_type="glm", link_approx="probit")
    with torch.inference_mode(), pytest.raises(RuntimeError, match="GLM predictive .*no_grad"):
        la(X[:3], pred_type="glm", link_approx="probit")
    assert probs.shape == (3, 2)


def test_non_finite_training_inputs_fail_with_a_clear_error():
    X, y = _data()
    X[5, 0] = float("inf")  # a tanh network maps it to finite outputs, NaN Jacobians
    la = Laplace(_mlp(), "classification", "all", "lowrank_ggn", rank=5)
    with pytest.raises(ValueError, match="hold NaN or infinite values"):
        la.fit(DataLoader(TensorDataset(X, y), batch_size=8))


def test_states_of_another_curvature_or_tampered_ones_are_refused():
    la = Laplace(_mlp(), "classification", "all", "lowrank_ggn", rank=5, mc_samples=1)
    la.fit(_loader())
    state = la.state_dict()
    exact = Laplace(_mlp(), "classification", "all", "lowrank_ggn", rank=5)
    with pytest.raises(ValueError, match="fitted with mc_samples=1 .* uses mc_samples=0"):
        exact.load_state_dict(state)
    assert exact.H is None  # nothing was loaded
    same = Laplace(_mlp(), "classification", "all", "lowrank_ggn", rank=5, mc_samples=1)
    U, lam = state["H"]
    for H in ((U, -lam), (2 * U, lam), (U, lam * float("nan"))):
        with pytest.raises(ValueError, match="not a low-rank GGN"):
            same.load_state_dict({**state, "H": H})
    with pytest.raises(ValueError, match="trace is below the sum"):
        same.load_state_dict({**state, "trace": lam.sum() / 2})
    same.load_state_dict(state)
    torch.testing.assert_close(same.H[1], lam)
