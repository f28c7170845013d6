"""Pairwise reward models, as laplace-torch runs them: ``(B, 2, d)`` pairs scored by one
network into ``(B, 2)`` logits while fitting (classification), single inputs scored at
prediction (regression); exact at full rank against laplace-torch's ``full``."""

import pytest
import torch
from laplace import Laplace
from laplace.curvature import CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lowrank_laplace  # noqa: F401 (registers hessian_structure="lowrank_ggn")

TOL = dict(rtol=1e-8, atol=1e-10)


class Reward(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        if x.dim() == 3:  # (B, 2, d) pairs -> (B, 2) scores
            return self.net(x.reshape(-1, x.shape[-1])).reshape(x.shape[0], 2)
        return self.net(x)


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_reward_modeling_equals_full_laplace(subset):
    torch.manual_seed(0)
    model = Reward().double()
    X, y = torch.randn(20, 2, 3, dtype=torch.float64), torch.randint(0, 2, (20,))
    loader = DataLoader(TensorDataset(X, y), batch_size=7)
    ours = Laplace(model, "reward_modeling", subset_of_weights=subset,
                   hessian_structure="lowrank_ggn", rank=1000)
    ours.fit(loader)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        full = Laplace(model, "reward_modeling", subset_of_weights=subset,
                       hessian_structure="full", backend=CurvlinopsGGN)
        full.fit(loader)
    finally:
        torch.set_default_dtype(old)
    U, lam = ours.H
    torch.testing.assert_close(U @ torch.diag(lam) @ U.T, full.H, **TOL)
    torch.testing.assert_close(ours.log_marginal_likelihood(), full.log_marginal_likelihood(),
                               **TOL)
    test = torch.randn(5, 3, dtype=torch.float64)
    for a, b in zip(ours(test, pred_type="glm"), full(test, pred_type="glm")):
        torch.testing.assert_close(a, b, **TOL)
