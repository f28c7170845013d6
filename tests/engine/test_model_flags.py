"""Module options that change how gradients are formed but not the function the model
computes (``Embedding(scale_grad_by_freq=True)``, ``sparse=True``) do not change its GGN:
every backend computes the function's GGN, against a dense float64 reference. Models no
backend can run (scripted, on the meta device) are refused before any work; a trainable
layer that is computed but unused gets its zero block."""

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
@pytest.mark.parametrize("option", ["scale_grad_by_freq", "sparse"])
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


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _data():
    torch.manual_seed(1)
    return torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compile_with", ["script", "trace"])
def test_scripted_models_are_refused_before_any_work(compile_with, backend):
    X, y = _data()
    model = torch.jit.script(_mlp()) if compile_with == "script" else \
        torch.jit.trace(_mlp(), X)
    with pytest.raises(TypeError, match=r"TorchScript module .*pass the nn.Module"):
        ll.ggn_eigh(model, nn.CrossEntropyLoss(), X, y, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_tensors_are_refused_before_any_work(backend):
    X, y = _data()
    with pytest.raises(ValueError, match="inputs are on the meta device"):
        ll.ggn_eigh(_mlp(), nn.CrossEntropyLoss(), X.to("meta"), y, backend=backend)
    with pytest.raises(ValueError, match="targets are on the meta device"):
        ll.ggn_eigh(_mlp(), nn.CrossEntropyLoss(), X, y.to("meta"), backend=backend)
    with pytest.raises(ValueError, match=r"parameters are on the meta device \(0.weight"):
        ll.ggn_eigh(_mlp().to("meta"), nn.CrossEntropyLoss(), X, y, backend=backend)


class Unused(nn.Module):
    """A trainable layer whose output the model computes and drops."""

    def __init__(self):
        super().__init__()
        self.seq, self.unused = _mlp(), nn.Linear(3, 4).double()

    def forward(self, x):
        self.unused(x)
        return self.seq(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_computed_but_unused_layer_gets_zero_blocks(backend):
    model, (X, y) = Unused(), _data()
    loss_func = nn.CrossEntropyLoss()
    res = ll.ggn_eigh(model, loss_func, X, y, top_k=None, backend=backend)
    assert res.backend == ("backpack" if backend == "auto" else backend)
    G = ref.ggn(model, loss_func, X, y)
    assert torch.count_nonzero(G[-16:]) == 0 and G.trace() > 0
    torch.testing.assert_close(res.eigenvectors @ torch.diag(res.eigenvalues)
                               @ res.eigenvectors.T, G, **TOL)
