"""Small work on one thread: scoped, restored, decided from sizes, through the backward."""

import ast
from pathlib import Path

import pytest
import torch

from lowrank_laplace.utils.threads import SMALL_WORK, cpu_threads, scoped_backward, small_work

PACKAGE = Path(__file__).resolve().parents[2] / "lowrank_laplace"


class _RecordThreads(torch.autograd.Function):
    """Identity whose backward records the thread count it runs with."""

    seen = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _RecordThreads.seen.append(torch.get_num_threads())
        return grad


def _fn(a, b, c):
    return (_RecordThreads.apply(a) ** 2 * b).sum() + torch.log(c).sum() * a.sum()


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_scoped_backward_gradients_and_threads(two_threads):
    a = torch.rand(5, dtype=torch.float64, requires_grad=True)
    b = torch.rand(5, dtype=torch.float64)  # no gradient wanted
    c = (torch.rand(3, dtype=torch.float64) + 1).requires_grad_(True)
    expected = torch.autograd.grad(_fn(a, b, c), (a, c))
    _RecordThreads.seen.clear()
    value = scoped_backward(_fn, (a, b, c * 1.0), 10, "cpu")  # a non-leaf input too
    assert value.requires_grad and value.grad_fn is not None
    got = torch.autograd.grad(value, (a, c))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    assert _RecordThreads.seen == [1]  # the inner backward ran on one thread
    assert torch.get_num_threads() == 2  # and the setting came back
    _RecordThreads.seen.clear()
    torch.autograd.grad(scoped_backward(_fn, (a, b, c), SMALL_WORK, "cpu"), a)
    assert _RecordThreads.seen == [2]  # large work: the user's threads


def test_small_work_restores_the_setting(two_threads):
    """Small work on one thread; large work on the user's setting; restored after."""
    with small_work(1, "cpu"):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with small_work(SMALL_WORK, "cpu"):
        assert torch.get_num_threads() == 2
    with small_work(1, "meta"):  # only the CPU has a pool to spare
        assert torch.get_num_threads() == 2


def test_cpu_threads_restores_the_setting_and_never_raises_it(two_threads):
    with cpu_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with cpu_threads(8):
        assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), cpu_threads(1):
        raise RuntimeError
    assert torch.get_num_threads() == 2


def test_the_glm_predictive_keeps_the_users_setting(monkeypatch, two_threads):
    """Queries never read the machine's load: the predictive runs on the user's threads."""
    from laplace import Laplace
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lowrank_laplace  # noqa: F401
    from lowrank_laplace.laplace_torch import queries

    seen = []
    glm = queries.glm_predictive
    monkeypatch.setattr(queries, "glm_predictive",
                        lambda *a, **k: (seen.append(torch.get_num_threads()), glm(*a, **k))[1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    X, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    la = Laplace(model, "classification", subset_of_weights="all",
                 hessian_structure="lowrank_ggn", rank=5)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=16))
    la(X, pred_type="glm", link_approx="probit")
    assert seen == [2] and torch.get_num_threads() == 2


def test_no_module_reads_the_machines_load():
    """Thread counts are decided from sizes: no CPU statistics, no load average."""
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for source in ("/proc/stat", "/proc/loadavg", "/proc/self/task", "getloadavg"):
            assert source not in text, (path, source)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("sched_getaffinity", "times"), (path, node.lineno)
