"""The model zoo through laplace-torch: full rank equals FullLaplace; dict batches,
BatchNorm in train mode and the factor backend option."""

import pytest
import torch
from laplace import FullLaplace, Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lowrank_laplace as ll
from tests.engine.test_backpack_layer_options import WRONG, build
from tests.engine.test_models import DictModel, zoo_case

TOL = dict(rtol=1e-5, atol=1e-8)
KW = dict(subset_of_weights="all", hessian_structure="lowrank_ggn", rank=1000)


@pytest.fixture
def no_mha_fastpath():
    """laplace-torch's Jacobians use forward-mode AD, which the fused attention
    kernels do not support: the reference runs the plain math path."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    with sdpa_kernel(SDPBackend.MATH):
        yield
    torch.backends.mha.set_fastpath_enabled(enabled)


def fit_full(model, loader, likelihood="classification"):
    """laplace-torch's FullLaplace in float64 (its backend builds eyes in the default)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        full = FullLaplace(model, likelihood)
        full.fit(loader)
    finally:
        torch.set_default_dtype(old)
    return full


def check_equal(ours, full, X):
    for la in (ours, full):
        la.prior_precision = 0.7
    torch.testing.assert_close(ours.log_det_posterior_precision,
                               full.log_det_posterior_precision, **TOL)
    torch.testing.assert_close(ours.log_marginal_likelihood(),
                               full.log_marginal_likelihood(), **TOL)
    f_mu, f_var = ours._glm_predictive_distribution(X)
    r_mu, r_var = full._glm_predictive_distribution(X)
    torch.testing.assert_close(f_mu, r_mu, **TOL)
    torch.testing.assert_close(f_var, r_var, rtol=1e-5, atol=1e-8 * r_var.abs().max())


@pytest.mark.parametrize("name", ["transformer", "tied_params", "lstm", "class_cnn"])
def test_full_rank_equals_full_laplace(name, no_mha_fastpath):
    model, _, X, y = zoo_case(name, n=10)
    loader = DataLoader(TensorDataset(X, y), batch_size=4)
    ours = Laplace(model, "classification", **KW)
    ours.fit(loader)
    assert ours.factor_backend_used == ("backpack" if name == "class_cnn" else "functorch")
    check_equal(ours, fit_full(model, loader), X)


@pytest.mark.parametrize("name", ["transformer", "tied_params", "lstm"])
def test_sketch_at_full_rank_equals_full_laplace(name, no_mha_fastpath, tune):
    """The sketch's Khatri-Rao test slices against the functorch backend's blocks
    (explicit ones get the formed slice): exact where the GGN's rank fits."""
    model, _, X, y = zoo_case(name, n=10)
    loader = DataLoader(TensorDataset(X, y), batch_size=4)
    # passes of 2 samples: one streaming merge must not cover the data
    tune(dense_max_dim=0)
    ours = Laplace(model, "classification", **KW, solver="sketch", micro_batch_size=2)
    ours.fit(loader)
    assert ours.fit_path == "sketch"
    check_equal(ours, fit_full(model, loader), X)


def test_factor_backends_agree_and_are_visible():
    model, _, X, y = zoo_case("frozen", n=10)
    loader = DataLoader(TensorDataset(X, y), batch_size=4)
    fits = {}
    for backend in ("auto", "backpack", "functorch"):
        la = Laplace(model, "classification", factor_backend=backend, **KW)
        la.fit(loader)
        fits[backend] = la
    assert fits["auto"].factor_backend_used == "backpack"
    assert fits["functorch"].factor_backend_used == "functorch"
    for la in fits.values():
        la.prior_precision = 0.5
    torch.testing.assert_close(fits["functorch"].log_marginal_likelihood(),
                               fits["backpack"].log_marginal_likelihood(), **TOL)
    with pytest.raises(ValueError, match="backend must be one of"):
        Laplace(model, "classification", factor_backend="x", **KW)


@pytest.mark.parametrize("name", ["conv2d_circular", "conv1d_same", "avg_pool2d_divisor_override",
                                  "embedding_padding_idx"])
def test_layer_options_backpack_gets_wrong_fit_exactly(name):
    """``auto`` fits such layers with an exact backend; ``backpack`` refuses before any pass."""
    model, _, X, y = build(WRONG[name][0], n=10)
    loader = DataLoader(TensorDataset(X, y), batch_size=4)
    ours = Laplace(model, "classification", **KW)
    ours.fit(loader)
    assert ours.factor_backend_used != "backpack"
    check_equal(ours, fit_full(model, loader), X)
    with pytest.raises(ValueError, match="BackPACK would compute a wrong GGN"):
        Laplace(model, "classification", factor_backend="backpack", **KW).fit(loader)


@pytest.mark.slow
def test_dict_batches_equal_tuple_batches():
    torch.manual_seed(0)
    model = DictModel().double()
    _, _, X, y = zoo_case("transformer", n=10)
    records = [{"input_ids": x, "labels": t} for x, t in zip(X, y)]
    dict_loader = DataLoader(records, batch_size=4)
    tuple_loader = DataLoader(TensorDataset(X, y), batch_size=4)
    from_dict = Laplace(model, "classification", dict_key_x="input_ids",
                        dict_key_y="labels", **KW)
    from_dict.fit(dict_loader)
    from_tuple = Laplace(model.inner, "classification", **KW)
    from_tuple.fit(tuple_loader)
    for la in (from_dict, from_tuple):
        la.prior_precision = 0.7
    torch.testing.assert_close(from_dict.log_marginal_likelihood(),
                               from_tuple.log_marginal_likelihood(), **TOL)
    probs = from_dict({"input_ids": X, "labels": y}, pred_type="glm", link_approx="probit")
    torch.testing.assert_close(probs, from_tuple(X, pred_type="glm", link_approx="probit"),
                               **TOL)


def test_batchnorm_in_train_mode_fits_in_eval_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Tanh(),
                          nn.Linear(4, 2)).double()
    X, y = torch.randn(9, 3, dtype=torch.float64), torch.randint(0, 2, (9,))
    loader = DataLoader(TensorDataset(X, y), batch_size=4)
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    la = Laplace(model, "classification", **KW)
    la.fit(loader)
    assert model.training  # the user's mode is kept; the fit ran in eval mode
    after_fit = torch.get_rng_state()
    torch.set_rng_state(rng)
    list(loader)  # iterating the loader draws its base seed; the fit draws nothing else
    assert torch.equal(after_fit, torch.get_rng_state())
    for k, v in model.state_dict().items():
        assert torch.equal(v, stats[k]), k
    reference = Laplace(nn.Sequential(*model).eval(), "classification", **KW)
    reference.fit(loader)
    torch.testing.assert_close(la.H[1], reference.H[1], **TOL)


def test_sizing_forward_draws_nothing():
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)).double()
    X = torch.randn(5, 3, dtype=torch.float64)
    for backend in ("backpack", "functorch"):
        rng = torch.get_rng_state()
        with ll.FactorEngine(model, nn.CrossEntropyLoss(), backend=backend) as engine:
            engine.bytes_per_sample(X)
        assert torch.equal(torch.get_rng_state(), rng)
