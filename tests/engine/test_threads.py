"""Engines in several Python threads at once give each thread the answer it gets alone
(BackPACK keeps its state in process-wide globals during a backward pass)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from lowrank_laplace.engine import FactorEngine


def _problem(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4)).double()
    X, y = torch.randn(32, 6, dtype=torch.float64), torch.randint(0, 4, (32,))
    return model, X, y


def _fit(problem, backend):
    model, X, y = problem
    with FactorEngine(model, nn.CrossEntropyLoss(), backend=backend) as engine:
        results = []
        for _ in range(3):
            factor = engine.compute(X, y, keep_blocks=False, compute_grams=True,
                                    batch_grad=True)
            results += [factor.gram(0), torch.cat([factor.grad[i] for i in sorted(factor.grad)]),
                        *engine.gradient(X, y)]
        assert engine.backend == ("backpack" if backend == "auto" else backend)
    return results


@pytest.mark.parametrize("backend", ["auto", "hooks", "functorch"])
def test_threads_fitting_at_once_get_their_own_answers(backend):
    problems = [_problem(seed) for seed in range(8)]  # the global generator: built alone
    alone = [_fit(problem, backend) for problem in problems]
    with ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda problem: _fit(problem, backend), problems))
    for one, other in zip(alone, together):
        for a, b in zip(one, other):
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
