"""What the hooks backend cannot see it refuses, naming the layer and the way out; what
it can see it measures exactly (against dense float64 torch.func references)."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import lowrank_laplace as ll
from lowrank_laplace.engine import FactorEngine
from tests import reference as ref

TOL = dict(rtol=1e-8, atol=1e-10)


class Checkpointed(nn.Module):
    """A trainable block (with a LayerNorm, which BackPACK cannot take) under
    ``torch.utils.checkpoint``; ``upstream`` puts a trainable layer before it, so that the
    checkpoint's input requires grad."""

    def __init__(self, reentrant=None, upstream=False):
        super().__init__()
        self.inp = nn.Linear(3, 3) if upstream else nn.Identity()
        self.block = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Tanh())
        self.head = nn.Linear(4, 2)
        self.reentrant = reentrant

    def forward(self, x):
        h = self.inp(x)
        if self.reentrant is None:
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


def _checkpointed(reentrant, upstream):
    torch.manual_seed(0)
    plain = Checkpointed(None, upstream).double()
    model = Checkpointed(reentrant, upstream).double()
    model.load_state_dict(plain.state_dict())
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    return plain, model, X, y


@pytest.mark.parametrize("upstream", [False, True])
def test_reentrant_checkpointing_is_refused_naming_the_layer(upstream):
    _, model, X, y = _checkpointed(True, upstream)
    loss_func = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # checkpoint's own warning on inputs without grad
        with pytest.raises(NotImplementedError,
                           match=r"'block.0' runs with gradient tracking off .*"
                                 r"use_reentrant=True.*use_reentrant=False"):
            ll.ggn_eigh(model, loss_func, X, y, backend="hooks")
        # no backend takes it: 'auto' says why each one refused, the hooks backend's
        # reason (the checkpointed layer and the way out) among them
        with pytest.raises(NotImplementedError, match=r"hooks: Layer 'block.0' runs with"):
            ll.ggn_eigh(model, loss_func, X, y)


@pytest.mark.parametrize("upstream", [False, True])
def test_non_reentrant_checkpointing_is_exact_on_the_hooks_backend(upstream):
    plain, model, X, y = _checkpointed(False, upstream)
    loss_func = nn.CrossEntropyLoss()
    res = ll.ggn_eigh(model, loss_func, X, y, top_k=None)
    assert res.backend == "hooks"  # torch.func does not take saved-tensor hooks
    G = ref.ggn(plain, loss_func, X, y)
    torch.testing.assert_close(res.eigenvectors @ torch.diag(res.eigenvalues)
                               @ res.eigenvectors.T, G, **TOL)


class CheckpointedMLP(nn.Module):
    """Layers BackPACK knows, one block of them under ``torch.utils.checkpoint``."""

    def __init__(self, reentrant):
        super().__init__()
        self.inp, self.block = nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 4), nn.Tanh())
        self.head, self.reentrant = nn.Linear(4, 2), reentrant

    def forward(self, x):
        return self.head(checkpoint(self.block, self.inp(x), use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [True, False])
def test_backpack_refuses_checkpointing_before_any_pass(reentrant):
    torch.manual_seed(0)
    model = CheckpointedMLP(reentrant).double()
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    loss_func = nn.CrossEntropyLoss()
    why = "runs with gradient tracking off" if reentrant else "runs again in the backward"
    with pytest.raises(NotImplementedError, match=f"BackPACK cannot .*'block.0' {why}"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # checkpoint's own warning under no_grad
        ll.ggn_eigh(model, loss_func, X, y, backend="backpack")
    if reentrant:
        return
    res = ll.ggn_eigh(model, loss_func, X, y, top_k=None)
    assert res.backend == "hooks"
    plain = nn.Sequential(model.inp, model.block, model.head)
    torch.testing.assert_close(res.eigenvectors @ torch.diag(res.eigenvalues)
                               @ res.eigenvectors.T, ref.ggn(plain, loss_func, X, y), **TOL)


class SequenceFirst(nn.Module):
    """A trainable ``Linear`` on ``(T, N, d)``: its rows are positions, not samples."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):  # x: (N, T, d)
        h = torch.tanh(self.lin(x.transpose(0, 1)))  # (T, N, d)
        return self.head(h.mean(0))


def test_a_one_sample_first_batch_does_not_hide_rows_split_wrongly():
    """The gradient check runs on two samples even when the first batch holds one."""
    torch.manual_seed(0)
    model = SequenceFirst().double()
    X, y = torch.randn(5, 4, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    loss_func = nn.CrossEntropyLoss(reduction="sum")
    with FactorEngine(model, loss_func) as engine:
        engine.compute(X[:1], y[:1])
        factor = engine.compute(X[1:], y[1:])
        assert engine.backend == "functorch"
        assert "differ from autograd's for ['lin.bias', 'lin.weight']" in \
            engine.rejected["hooks"]
    V = factor.matmul(torch.eye(factor.num_columns, dtype=torch.float64))
    torch.testing.assert_close(V @ V.T, ref.ggn(model, loss_func, X[1:], y[1:]), **TOL)
    with pytest.raises(NotImplementedError, match="differ from autograd's"):
        with FactorEngine(model, loss_func, backend="hooks") as engine:
            engine.compute(X[:1], y[:1])
