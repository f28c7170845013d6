"""Seeded test cases: dicts of lambdas with readable ids, run in float64."""

import os

import pytest
import torch
from backpack.custom_module.branching import Parallel, SumModule
from torch import nn

import lowrank_laplace as ll

# pytest-xdist workers share the cores: each takes its share of torch's threads, and so
# do the processes a test starts (notebook kernels, command-line runs), which read
# OMP_NUM_THREADS: two workers' children on all cores each slowed the suite down
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _bn_eval(channels):
    bn = nn.BatchNorm2d(channels)
    bn.running_mean.uniform_(-0.5, 0.5)
    bn.running_var.uniform_(0.5, 1.5)
    bn.weight.data.uniform_(0.5, 1.5)
    bn.bias.data.uniform_(-0.5, 0.5)
    return bn.eval()


ARCHS = {
    "mlp": dict(
        model_fn=lambda: nn.Sequential(
            nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3)
        ),
        input_fn=lambda n: torch.randn(n, 5),
    ),
    "cnn": dict(
        model_fn=lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(3, 2, 2), nn.Sigmoid(), nn.Flatten(), nn.Linear(8, 3),
        ),
        input_fn=lambda n: torch.randn(n, 2, 6, 6),
    ),
    "conv1d": dict(
        model_fn=lambda: nn.Sequential(
            nn.Conv1d(2, 3, 3), nn.ELU(), nn.AvgPool1d(2), nn.Flatten(),
            nn.Linear(9, 3),
        ),
        input_fn=lambda n: torch.randn(n, 2, 8),
    ),
    "conv_variants": dict(  # stride, dilation, padding; grouped conv uses BackPACK
        model_fn=lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, stride=2, padding=2, dilation=2), nn.Tanh(),
            nn.Conv2d(4, 4, 2, groups=2), nn.Flatten(), nn.Linear(36, 3),
        ),
        input_fn=lambda n: torch.randn(n, 2, 8, 8),
    ),
    "bn_adaptive": dict(
        model_fn=lambda: nn.Sequential(
            nn.Conv2d(1, 3, 3), _bn_eval(3), nn.LeakyReLU(), nn.AdaptiveAvgPool2d(2),
            nn.Flatten(), nn.Dropout(0.3).eval(), nn.Linear(12, 3),
        ),
        input_fn=lambda n: torch.randn(n, 1, 6, 6),
    ),
    "residual": dict(
        model_fn=lambda: nn.Sequential(
            nn.Linear(4, 4),
            Parallel(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Identity(),
                     merge_module=SumModule()),
            nn.Linear(4, 3),
        ),
        input_fn=lambda n: torch.randn(n, 4),
    ),
}

LOSSES = {
    "ce-mean": (lambda: nn.CrossEntropyLoss(), lambda n, c: torch.randint(0, c, (n,))),
    "ce-sum": (lambda: nn.CrossEntropyLoss(reduction="sum"),
               lambda n, c: torch.randint(0, c, (n,))),
    "mse-mean": (lambda: nn.MSELoss(), lambda n, c: torch.randn(n, c)),
    "mse-sum": (lambda: nn.MSELoss(reduction="sum"), lambda n, c: torch.randn(n, c)),
}

CASES = [(a, lo) for a in ARCHS for lo in LOSSES]
CASE_IDS = [f"{a}-{lo}" for a, lo in CASES]


def make_case(arch, loss, n=5, seed=0, device="cpu", dtype=torch.float64):
    """Build (model, loss_func, X, y) for a case, seeded."""
    torch.manual_seed(seed)
    model = ARCHS[arch]["model_fn"]().to(device=device, dtype=dtype)
    X = ARCHS[arch]["input_fn"](n).to(device=device, dtype=dtype)
    loss_fn, target_fn = LOSSES[loss]
    y = target_fn(n, 3).to(device)
    if y.is_floating_point():
        y = y.to(dtype)
    return model, loss_fn(), X, y


@pytest.fixture(params=CASES, ids=CASE_IDS)
def case(request):
    return make_case(*request.param)


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def one_pass_and_low_memory(model, loss_func, X, y, mc_samples, backend="auto"):
    """Top-3 ``ggn_eigh`` and ``damped_newton_step`` in one pass and with ``low_memory``.

    Both pairs start from the same global seed, so the low-memory passes must replay
    the one-pass Monte-Carlo draws.

    Returns:
        ``[(eigh result, step) in one pass, (eigh result, step) with low_memory]``.
    """
    pairs = []
    for low_memory in (False, True):
        torch.manual_seed(1)
        pairs.append((
            ll.ggn_eigh(model, loss_func, X, y, top_k=3, mc_samples=mc_samples,
                        low_memory=low_memory, backend=backend),
            ll.damped_newton_step(model, loss_func, X, y, mc_samples=mc_samples,
                                  low_memory=low_memory, backend=backend),
        ))
    return pairs


#: The package's tuning constants a test may set: name -> (module, attribute). They are
#: read when a fit (or, for probe_size, a posterior's options) needs them.
TUNING = {
    "dense_max_dim": ("lowrank_laplace.fitting.plan", "DENSE_MAX_DIM"),
    "oversampling": ("lowrank_laplace.fitting.plan", "OVERSAMPLING"),
    "test_matrix": ("lowrank_laplace.fitting.sketch", "TEST_MATRIX"),
    "probe_size": ("lowrank_laplace.posterior.probe", "PROBE_SIZE"),
}


def set_tuning(monkeypatch, **values):
    """Set tuning constants of the package for one test (see :data:`TUNING`)."""
    import importlib

    for name, value in values.items():
        module, attribute = TUNING[name]
        monkeypatch.setattr(importlib.import_module(module), attribute, value)


@pytest.fixture
def tune(monkeypatch):
    """``tune(dense_max_dim=0, probe_size=0, ...)``: tuning constants for this test."""
    return lambda **values: set_tuning(monkeypatch, **values)


def pytest_collection_modifyitems(config, items):
    """Start the heavy tests first, so that parallel workers do not end on one of them."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
