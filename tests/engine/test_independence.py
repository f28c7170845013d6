"""Per-sample curvature needs independent samples: the check compares a sample's outputs
alone and next to a *distinct* sample, so duplicated leading rows, identical batches and
one-sample batches do not hide a layer that couples the samples."""

import pytest
import torch
from torch import nn

import lowrank_laplace as ll
from lowrank_laplace.engine import FactorEngine

BACKENDS = ["auto", "backpack", "hooks", "functorch"]


class Centered(nn.Module):
    """A trainable layer, then a centring over the batch (batch statistics)."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.lin(x)
        return self.head(torch.tanh(h - h.mean(0)))


def _batch(n=6):
    torch.manual_seed(0)
    return torch.randn(n, 3, dtype=torch.float64), torch.randint(0, 2, (n,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", ["two_leading_duplicates", "all_identical", "one_sample"])
def test_coupled_samples_are_refused_whatever_the_leading_rows(rows, backend):
    X, y = _batch()
    if rows == "two_leading_duplicates":  # oversampling, augmentation, sorted data
        X[1] = X[0]
    elif rows == "all_identical":
        X[:] = X[0]
    else:
        X, y = X[:1], y[:1]
    model = Centered().double()
    with pytest.raises(ValueError, match="depends on the other samples"):
        ll.ggn_eigh(model, nn.CrossEntropyLoss(), X, y, backend=backend)


class CenteredTokens(nn.Module):
    """Token inputs (nothing to perturb), centred over the batch."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(7, 4), nn.Linear(4, 2)

    def forward(self, ids):
        h = self.emb(ids).mean(1)
        return self.head(h - h.mean(0))


@pytest.mark.parametrize("backend", ["auto", "functorch"])
def test_a_batch_without_distinct_samples_leaves_the_check_to_the_next(backend):
    """Identical token rows have no distinct sample to compare with (and integer inputs
    cannot be perturbed): the first batch with two distinct samples is checked."""
    model = CenteredTokens().double()
    same = torch.tensor([[1, 2, 3]] * 4)
    y = torch.tensor([0, 1, 0, 1])
    with FactorEngine(model, nn.CrossEntropyLoss(), backend=backend) as engine:
        engine.compute(same[:1], y[:1])
        engine.compute(same, y)
        with pytest.raises(ValueError, match="depends on the other samples"):
            engine.compute(torch.tensor([[1, 2, 3], [1, 2, 3], [4, 5, 6], [1, 1, 1]]), y)


def test_the_hooks_backend_sees_the_coupling_in_its_own_check():
    """Its per-sample gradient check runs on two samples (a one-sample batch's twice),
    where a sample's rows carry the other's gradient too."""
    model = CenteredTokens().double()
    with FactorEngine(model, nn.CrossEntropyLoss(), backend="hooks") as engine, \
            pytest.raises(NotImplementedError, match="differ from autograd's"):
        engine.compute(torch.tensor([[1, 2, 3]]), torch.tensor([0]))
