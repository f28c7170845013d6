"""The engine's contract: requests, the backend chosen by probing, capabilities, and
the two-pass Gram-then-projection helper against one pass with kept blocks."""

import pytest
import torch
from torch import nn

from lowrank_laplace.engine import FactorEngine, Request

TOL = dict(rtol=1e-10, atol=1e-12)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _batch(n=6):
    return torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 3, (n,))


@pytest.mark.parametrize("flags, msg", [
    (dict(keep_blocks=False), "Request keep_blocks, compute_grams and/or project"),
    (dict(cross_batch_grads=True), "cross_batch_grads needs batch_grad=True"),
])
def test_bad_requests(flags, msg):
    with pytest.raises(ValueError, match=msg):
        Request(**flags)
    model, (X, y) = _mlp(), _batch()
    with FactorEngine(model, nn.CrossEntropyLoss()) as engine, \
            pytest.raises(ValueError, match=msg):
        engine.compute(X, y, **flags)


def test_per_group_arguments_need_one_entry_per_group():
    model, (X, y) = _mlp(), _batch()
    with FactorEngine(model, nn.CrossEntropyLoss()) as engine, \
            pytest.raises(ValueError, match=r"project needs one entry per group \(1\), got 2"):
        engine.compute(X, y, request=Request(keep_blocks=False, project=[None, None]))


def test_auto_probes_and_falls_back_with_the_reason():
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 3)).double()
    X, y = _batch()
    with FactorEngine(model, nn.CrossEntropyLoss()) as engine:
        assert engine.backend == "hooks" and "LayerNorm" in engine.backpack_problem
        assert engine.gradient_in_factor_pass
        engine.compute(X, y)
    with FactorEngine(_mlp(), nn.CrossEntropyLoss()) as engine:
        engine.compute(X, y)
        assert engine.backend == "backpack" and engine.rejected == {}
        assert not engine.gradient_in_factor_pass
    attention = _Attention().double()  # trainable attention: only torch.func takes it
    with FactorEngine(attention, nn.CrossEntropyLoss()) as engine:
        engine.compute(X, y)
        assert engine.backend == "functorch" and set(engine.rejected) == {"backpack", "hooks"}
        assert "in_proj_weight (MultiheadAttention)" in engine.rejected["hooks"]
    with pytest.raises(NotImplementedError):
        FactorEngine(model, nn.CrossEntropyLoss(), backend="backpack")


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = x[:, None, :].expand(-1, 2, -1)
        return self.head(self.att(h, h, h, need_weights=False)[0].mean(1))


@pytest.mark.parametrize("backend", ["backpack", "functorch"])
def test_gram_and_projection_equal_one_pass(backend):
    model, (X, y) = _mlp(), _batch()
    model.insert(1, nn.Dropout(0.3))  # train mode: the second pass must replay the masks
    model.train()
    torch.manual_seed(3)
    with FactorEngine(model, nn.CrossEntropyLoss(), backend=backend) as engine:
        grams, projected = engine.gram_and_projection(
            X, y, 1, None, None, lambda f: [f.gram(0)[:, :2]])
        torch.manual_seed(3)
        whole = engine.compute(X, y, mc_samples=1)
    torch.testing.assert_close(grams.gram(0), whole.gram(0), **TOL)
    torch.testing.assert_close(projected.projected_flat(0), whole.matmul(whole.gram(0)[:, :2]),
                               **TOL)
