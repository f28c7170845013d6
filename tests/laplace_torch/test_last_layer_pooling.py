"""Last-layer Laplace on models that select or pool positions after their last layer.

A Hugging Face sequence classifier with right padding reads the last *real* token's logits,
where laplace-torch's ``feature_reduction="pick_last"`` features are the last position's.
The posterior must be the model's own function's: its curvature equals laplace-torch's
``full`` (Curvlinops differentiates the model) and the dense torch.func GGN, its GLM
predictive the exact ``J P^-1 J^T`` of the model's outputs.
"""

import pytest
import torch
from laplace import Laplace
from laplace.curvature import CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lowrank_laplace  # noqa: F401 (registers hessian_structure="lowrank_ggn")
from tests.laplace_torch.test_transformers import Logits, Sequences
from tests.reference import ggn, jacobian

transformers = pytest.importorskip("transformers")

TOL = dict(rtol=1e-8, atol=1e-10)
PRIOR = 2.0


def gpt2_classifier() -> nn.Module:
    """A 2-layer GPT-2 sequence classifier (random weights), padding id 0, float64."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16, num_labels=3,
        pad_token_id=0, bos_token_id=1, eos_token_id=1)
    base = transformers.GPT2ForSequenceClassification._from_config(
        config, attn_implementation="eager")
    return Logits(base).double().eval()


def _head_group(model: nn.Module, name: str):
    return [i for i, (n, _) in enumerate(model.named_parameters()) if n.startswith(name)]


def _dense(la) -> torch.Tensor:
    U, lam = la.H
    return U @ torch.diag(lam) @ U.T


def _laplace(model, name, **kwargs):
    return Laplace(model, "classification", subset_of_weights="last_layer",
                   hessian_structure="lowrank_ggn", last_layer_name=name,
                   feature_reduction="pick_last", prior_precision=PRIOR, residual="none",
                   **kwargs)


def _check_predictive(la, model, group, X):
    """The GLM predictive against the dense ``J P^-1 J^T`` of the model's outputs."""
    J = jacobian(model, X, group)
    P = _dense(la) + PRIOR * torch.eye(J.shape[-1], dtype=J.dtype)
    exact = J @ torch.linalg.solve(P, J.transpose(1, 2))
    f_mu, f_var = la._glm_predictive_distribution(X)
    torch.testing.assert_close(f_mu, model(X).detach(), **TOL)
    torch.testing.assert_close(f_var, exact, **TOL)
    f_mu, f_var = la._glm_predictive_distribution(X, joint=True)
    torch.testing.assert_close(f_var.diagonal(), exact.diagonal(dim1=1, dim2=2).flatten(),
                               **TOL)


@pytest.mark.parametrize("backend", ["auto", "hooks", "functorch"])
def test_right_padding_gives_the_models_own_ggn(backend):
    model = gpt2_classifier()
    for p in model.parameters():
        p.requires_grad_(False)
    name = "model.score"
    for p in model.model.score.parameters():
        p.requires_grad_(True)
    data = Sequences(18, length=8)
    loader = DataLoader(data, batch_size=6)
    la = _laplace(model, name, factor_backend=backend)
    la.fit(loader)
    assert la.whole_model
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # curvlinops builds its identity in it
    try:
        full = Laplace(model, "classification", subset_of_weights="last_layer",
                       hessian_structure="full", last_layer_name=name,
                       feature_reduction="pick_last", backend=CurvlinopsGGN)
        full.fit(loader)
    finally:
        torch.set_default_dtype(old)
    group = _head_group(model, name)
    X = {"input_ids": data.ids, "attention_mask": data.mask}
    exact = ggn(model, nn.CrossEntropyLoss(reduction="sum"), X, data.labels, group)
    torch.testing.assert_close(_dense(la), exact, **TOL)
    torch.testing.assert_close(full.H, exact, **TOL)  # laplace-torch's full agrees
    test = next(iter(DataLoader(Sequences(5, seed=4), batch_size=5)))
    _check_predictive(la, model, group, {k: test[k] for k in ("input_ids", "attention_mask")})
    assert all(p.grad is None for p in model.parameters())


class PoolAfterHead(nn.Module):
    """A token model whose head scores every position; the output picks position 0."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.body(x))[:, 0]


def _tokens(n=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 5, 4, generator=gen, dtype=torch.float64)
    return X, torch.randint(0, 3, (n,), generator=gen)


@pytest.mark.parametrize("reduction, whole", [("pick_last", True), ("pick_first", False)])
def test_tensor_model_picking_after_its_head(reduction, whole):
    model = PoolAfterHead().double().eval()
    X, y = _tokens()
    loader = DataLoader(TensorDataset(X, y), batch_size=8)
    la = Laplace(model, "classification", subset_of_weights="last_layer",
                 hessian_structure="lowrank_ggn", last_layer_name="head",
                 feature_reduction=reduction, prior_precision=PRIOR, residual="none")
    la.fit(loader)
    assert la.whole_model is whole
    group = _head_group(model, "head")
    exact = ggn(model, nn.CrossEntropyLoss(reduction="sum"), X, y, group)
    torch.testing.assert_close(_dense(la), exact, **TOL)
    _check_predictive(la, model, group, _tokens(6, seed=1)[0])
    la.enable_backprop = True
    if whole:
        with pytest.raises(ValueError, match="enable_backprop=True needs the last layer"):
            la._glm_predictive_distribution(X[:2])
    else:
        f_mu, f_var = la._glm_predictive_distribution(X[:2])
        assert f_mu.requires_grad  # laplace-torch detaches the features themselves


def test_plain_mlp_keeps_the_features_path():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    X, y = torch.randn(20, 4, dtype=torch.float64), torch.randint(0, 3, (20,))
    la = Laplace(model, "classification", subset_of_weights="last_layer",
                 hessian_structure="lowrank_ggn", prior_precision=PRIOR, residual="none")
    la.fit(DataLoader(TensorDataset(X, y), batch_size=7))
    assert not la.whole_model and la.factor_backend_used == "backpack"
    group = _head_group(model, "2.")
    exact = ggn(model, nn.CrossEntropyLoss(reduction="sum"), X, y, group)
    torch.testing.assert_close(_dense(la), exact, **TOL)
    _check_predictive(la, model, group, X[:5])


def test_a_loaded_whole_model_posterior_refines_as_the_fitted_one():
    """``whole_model`` is state: the loaded object refines its complement as the fitted
    one; a state that does not record it is refused with the way out."""
    model = PoolAfterHead().double().eval()
    X, y = _tokens(40)
    loader = DataLoader(TensorDataset(X, y), batch_size=8)
    kwargs = dict(subset_of_weights="last_layer", hessian_structure="lowrank_ggn",
                  last_layer_name="head", feature_reduction="pick_last", rank=4)
    la = Laplace(model, "classification", **kwargs)
    la.fit(loader)
    state = la.state_dict()
    la.refine_complement(loader)
    loaded = Laplace(model, "classification", **kwargs)
    loaded.load_state_dict(state)
    assert la.whole_model and loaded.whole_model
    loaded.refine_complement(loader)
    assert loaded.fit_report.quadrature_steps == la.fit_report.quadrature_steps
    torch.testing.assert_close(loaded.log_marginal_likelihood(), la.log_marginal_likelihood(),
                               rtol=1e-10, atol=0)
    older = Laplace(model, "classification", **kwargs)
    older.load_state_dict({k: v for k, v in state.items() if k != "whole_model"})
    with pytest.raises(ValueError, match=r"does not record whole_model\). Fit it on this"):
        older.refine_complement(loader)
