"""Module options that change how gradients are formed but not the function the model
computes (``Embedding(scale_grad_by_freq=True)``, ``sparse=True``) do not change its GGN:
every backend computes the function's GGN, against a dense float64 reference."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacfwd

import lowrank_laplace as ll
from tests import reference as ref

TOL = dict(rtol=1e-8, atol=1e-10)
BACKENDS = ["auto", "backpack", "hooks", "functorch"]


def _tokens(**options):
    """An embedding (repeated tokens within and across samples), flattened, a head."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 3, **options), nn.Flatten(), nn.Tanh(),
                          nn.Linear(12, 2)).double()
    X = torch.tensor([[1, 1, 2, 3], [1, 4, 4, 4], [5, 1, 2, 2], [0, 0, 1, 3]])
    return model, X, torch.tensor([0, 1, 1, 0])


def test_scale_grad_by_freq_changes_the_gradient_not_the_function():
    """Forward-mode derivatives (no backward pass) of the scaled model are those of the
    plain model: the plain model's GGN is the function's."""
    scaled, X, _ = _tokens(scale_grad_by_freq=True)
    plain = _tokens()[0]
    params = {k: v.detach() for k, v in scaled.named_parameters()}
    fwd = jacfwd(lambda w: functional_call(scaled, {**params, "0.weight": w}, (X,)))(
        params["0.weight"]).reshape(len(X), 2, -1)
    torch.testing.assert_close(fwd, ref.jacobian(plain, X)[:, :, :18], **TOL)
    # the backward pass scales by the tokens' frequencies: not the function's Jacobian
    assert not torch.allclose(ref.jacobian(scaled, X), ref.jacobian(plain, X))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("option", ["scale_grad_by_freq"])
def test_embedding_options_of_the_backward_pass_keep_the_functions_ggn(option, backend):
    model, X, y = _tokens(**{option: True})
    loss_func = nn.CrossEntropyLoss()
    res = ll.ggn_eigh(model, loss_func, X, y, top_k=None, backend=backend)
    assert res.backend == ("backpack" if backend == "auto" else backend)
    G = ref.ggn(_tokens()[0], loss_func, X, y)
    torch.testing.assert_close(res.eigenvectors @ torch.diag(res.eigenvalues)
                               @ res.eigenvectors.T, G, **TOL)
    grad = ll.damped_newton_step(model, loss_func, X, y, damping=1.0, backend=backend)
    expected = ll.damped_newton_step(_tokens()[0], loss_func, X, y, damping=1.0,
                                     backend=backend)
    torch.testing.assert_close(grad, expected, **TOL)
    assert getattr(model[0], option)  # the user's model keeps its option
