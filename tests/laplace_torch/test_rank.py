"""rank="auto": the rank doubled while the probe inputs' predictive variance moves."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowrank_laplace import LowRankGGNLaplace
from lowrank_laplace.fitting import plan as plan_module
from lowrank_laplace.laplace_torch import rank as rank_module
from lowrank_laplace.laplace_torch.options import LowRankOptions
from lowrank_laplace.laplace_torch.rank import next_rank
from lowrank_laplace.posterior import quadrature


def test_next_rank_doubles_until_a_bound():
    bounds = (1000, 5000, 2**30, "cpu")
    assert next_rank(100, 0.2, bounds) == 200
    assert next_rank(100, rank_module.AUTO_RANK_TOLERANCE, bounds) is None  # converged
    assert next_rank(100, None, bounds) is None  # not measured: nothing says more helps
    assert next_rank(600, 0.2, bounds) == 1000  # the GGN's rank bound
    assert next_rank(1000, 0.2, bounds) is None
    tight = (1000, 5000, int(5000 * 2 * 200 * 8 / rank_module.AUTO_RANK_MEMORY_SHARE) - 1,
             "cpu")
    assert next_rank(100, 0.2, tight) is None  # the D x 2r basis would not fit


def test_auto_rank_options():
    opts = LowRankOptions(rank="auto")
    assert opts.rank == "auto" and opts.first_rank == rank_module.AUTO_RANK_START
    assert opts.at_rank(40).rank == 40 and opts.at_rank(40).residual == "spectral"
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        LowRankOptions(rank="automatic")


def _problem(n=120):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    X = torch.randn(n, 6, dtype=torch.float64)
    y = torch.randint(0, 4, (n,))
    return model, DataLoader(TensorDataset(X, y), batch_size=40)


@pytest.mark.parametrize("tolerance, ranks", [(-1.0, [4, 8, 16, 32, 64]), (10.0, [4])])
def test_auto_rank_grows_while_the_variance_moves(monkeypatch, tune, tolerance, ranks):
    """Every fit of the schedule runs (here: from rank 4, doubled until the memory cap
    or never), each with its own rank check; the last one is the posterior."""
    tune(dense_max_dim=0)
    monkeypatch.setattr(rank_module, "AUTO_RANK_START", 4)
    monkeypatch.setattr(rank_module, "AUTO_RANK_TOLERANCE", tolerance)
    monkeypatch.setattr(quadrature, "MAX_STEPS", 20)  # its basis within the capped budget
    # sketches of more columns than parameters: exact, so warm and cold fits agree
    monkeypatch.setattr(plan_module, "RITZ_SKETCH_OVERSAMPLING", 3)
    model, loader = _problem()
    dim = sum(p.numel() for p in model.parameters())
    cap = int(dim * 2 * 64 * 8 / rank_module.AUTO_RANK_MEMORY_SHARE)  # up to rank 64
    la = LowRankGGNLaplace(model, "classification", rank="auto", memory_budget=cap)
    la.fit(loader)
    tried = [r for r, _ in la.fit_report.ranks_tried]
    assert tried == ranks and la.H[1].numel() == ranks[-1] == la.fit_report.rank
    assert all(c is not None for _, c in la.fit_report.ranks_tried)
    fixed = LowRankGGNLaplace(model, "classification", rank=ranks[-1], memory_budget=cap)
    fixed.fit(loader)
    torch.testing.assert_close(la.H[1], fixed.H[1], rtol=1e-6, atol=1e-9 * fixed.H[1][0])
    assert la.rank == "auto" and ("rank='auto' tried" in str(la.fit_report)) == (len(ranks) > 1)
