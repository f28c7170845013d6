"""Small work on one thread: scoped, restored, and through the backward pass too."""

import pytest
import torch

from lowrank_laplace.utils import threads as threads_module
from lowrank_laplace.utils.threads import SMALL_WORK, scoped_backward, small_work


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


def test_scoped_backward_gradients_and_threads(monkeypatch):
    monkeypatch.setattr(threads_module, "busy_elsewhere", lambda: 0)  # a quiet machine
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
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
        assert _RecordThreads.seen == [2]  # large work on a quiet machine: the user's threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("busy, large", [(0, 2), (None, 2), (1, 1), (5, 1)])
def test_small_work_restores_the_setting(monkeypatch, busy, large):
    """Small work on one thread; large work on the idle cores (the user's two where
    the load is unknown); the user's setting afterwards."""
    monkeypatch.setattr(threads_module, "busy_elsewhere", lambda: busy)
    monkeypatch.setattr(threads_module.os, "sched_getaffinity", lambda pid: {0, 1},
                        raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with small_work(1, "cpu"):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with small_work(SMALL_WORK, "cpu"):
            assert torch.get_num_threads() == large
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_glm_predictive_runs_on_the_idle_cores(monkeypatch):
    """Beside a busy process the GLM predictive takes the idle core, not the pool."""
    from laplace import Laplace
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lowrank_laplace  # noqa: F401
    from lowrank_laplace.laplace_torch import queries

    seen = []
    glm = queries.glm_predictive

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return glm(*args, **kwargs)

    monkeypatch.setattr(queries, "glm_predictive", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    X, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    la = Laplace(model, "classification", subset_of_weights="all",
                 hessian_structure="lowrank_ggn", rank=5)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=16))
    monkeypatch.setattr(threads_module, "busy_elsewhere", lambda: 1)
    monkeypatch.setattr(threads_module.os, "sched_getaffinity", lambda pid: {0, 1},
                        raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        la(X, pred_type="glm", link_approx="probit")
        assert seen == [1] and torch.get_num_threads() == 2
        monkeypatch.setattr(threads_module, "busy_elsewhere", lambda: 0)
        la(X, pred_type="glm", link_approx="probit")
        assert seen == [1, 2]
    finally:
        torch.set_num_threads(before)


def test_busy_elsewhere_reads_a_count_or_none():
    busy = threads_module.busy_elsewhere()
    assert busy is None or busy >= 0


def test_busy_elsewhere_averages_between_readings(monkeypatch):
    """Other processes' cores: the busy time of our CPUs less our own, per second,
    since the last reading; a call soon after gets that average; a snapshot where
    there is no average or the last reading is too old."""
    readings = iter([(100.0, 10.0, 1.0), (100.01, 10.0, 1.0), (101.0, 11.5, 1.5),
                     (101.02, 99.0, 1.5), (200.0, 12.0, 2.0)])
    state = {}

    def advance():
        state["t"], state["busy"], state["own"] = next(readings)

    monkeypatch.setattr(threads_module, "_LAST_READING", {"reading": None, "average": None})
    monkeypatch.setattr(threads_module, "_busy_seconds_of_our_cpus", lambda: state["busy"])
    monkeypatch.setattr(threads_module.os, "times", lambda: (state["own"], 0.0, 0, 0, 0))
    monkeypatch.setattr(threads_module.time, "monotonic", lambda: state["t"])
    monkeypatch.setattr(threads_module, "_running_elsewhere", lambda: 7)
    advance()
    assert threads_module.busy_elsewhere() == 7  # no earlier reading: the snapshot
    advance()
    assert threads_module.busy_elsewhere() == 7  # 10 ms later, still no average
    advance()
    assert threads_module.busy_elsewhere() == pytest.approx(1.0)  # (1.5 - 0.5) / 1 s
    advance()
    assert threads_module.busy_elsewhere() == pytest.approx(1.0)  # 20 ms later: kept
    advance()
    assert threads_module.busy_elsewhere() == 7  # 99 s since the last: the snapshot


@pytest.mark.parametrize("busy, expected", [
    (None, 1),  # unknown load: one thread
    (0, None),  # every core idle: the user's setting
    (1, 3),  # one core busy elsewhere: the three others
    (3, 1),
    (10, 1),  # every core busy: one thread
])
def test_idle_core_threads(monkeypatch, busy, expected):
    monkeypatch.setattr(threads_module, "busy_elsewhere", lambda: busy)
    monkeypatch.setattr(threads_module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3},
                        raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        assert threads_module.idle_core_threads() == expected
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("busy, rows, policy, expected", [
    (0, 300, None, 2), (1, 300, None, 1), (None, 300, None, 1), (0, 100, None, 1),
    (0, 300, "PASSIVE", 1), (0, 300, "active", 2)])
def test_cpu_eigh_takes_the_idle_cores_from_its_row_threshold(monkeypatch, busy, rows,
                                                              policy, expected):
    """A CPU eigendecomposition of at least ``EIGH_PARALLEL_ROWS`` rows runs on the
    idle cores (one where the load is unknown or OpenMP's threads sleep between
    regions), smaller ones on one thread; the user's setting comes back, and the
    result is the eigendecomposition."""
    from lowrank_laplace.utils import linalg

    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)

    seen = []
    eigh = torch.linalg.eigh

    def spy(mat):
        seen.append(torch.get_num_threads())
        return eigh(mat)

    monkeypatch.setattr(linalg.torch.linalg, "eigh", spy)
    monkeypatch.setattr(threads_module, "busy_elsewhere", lambda: busy)
    monkeypatch.setattr(threads_module.os, "sched_getaffinity", lambda pid: {0, 1},
                        raising=False)
    assert linalg.EIGH_PARALLEL_ROWS == 256
    torch.manual_seed(0)
    a = torch.randn(rows, rows, dtype=torch.float64)
    mat = a @ a.T
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        evals, evecs = linalg.eigh(mat)
        assert seen == [expected] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(evecs @ torch.diag(evals) @ evecs.T, mat, rtol=0,
                               atol=1e-9 * float(evals[-1]))
