"""Small work on one thread, larger work on the cores other processes leave: scoped,
restored, through the backward."""

import ast
from pathlib import Path

import pytest
import torch

from lowrank_laplace.utils import threads
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
def two_threads(monkeypatch):
    """Two threads on a machine where no other process runs (whatever the test machine's)."""
    monkeypatch.setattr(threads, "others_running", lambda: 0)
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


@pytest.mark.parametrize("others, expected", [(0, 2), (2, 1)])
def test_the_glm_predictive_runs_on_the_cores_others_leave(monkeypatch, two_threads, others,
                                                           expected):
    """On a quiet machine the user's threads; beside busy processes the spare cores."""
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
    monkeypatch.setattr(threads, "others_running", lambda: others)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    la(X, pred_type="glm", link_approx="probit")
    assert seen == [expected] and torch.get_num_threads() == 2


def test_only_the_threads_module_reads_the_machines_load():
    """One decision per public call, in one place: no other module reads the machine."""
    for path in PACKAGE.rglob("*.py"):
        if path.name == "threads.py" and path.parent.name == "utils":
            continue
        text = path.read_text()
        for source in ("/proc/stat", "/proc/loadavg", "/proc/self/task", "getloadavg"):
            assert source not in text, (path, source)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("sched_getaffinity", "times"), (path, node.lineno)


def test_others_running_counts_other_processes_only():
    """This process's own threads never count, whatever they do."""
    count = threads.others_running()
    assert count is None or count >= 0  # None off Linux
    if count is None:
        pytest.skip("no /proc here")
    spinning = torch.ones(512, 512)
    for _ in range(3):  # the pool's threads may still spin right after their work
        spinning @ spinning
    assert threads.others_running() is not None


@pytest.mark.parametrize("others, expected", [(0, 2), (1, 1), (2, 1), (7, 1)])
def test_larger_work_takes_the_cores_others_leave(monkeypatch, two_threads, others, expected):
    monkeypatch.setattr(threads, "others_running", lambda: others)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with small_work(SMALL_WORK, "cpu"):
        assert torch.get_num_threads() == expected
    assert torch.get_num_threads() == 2
    with small_work(1, "cpu"):  # small work: one thread whatever the machine does
        assert torch.get_num_threads() == 1


def test_a_fit_beside_busy_processes_runs_on_the_spare_cores(monkeypatch, two_threads):
    """The fit takes the spare cores at each batch and restores the user's setting."""
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lowrank_laplace import LowRankGGNLaplace
    from lowrank_laplace.fitting import fit as fitting

    monkeypatch.setattr(threads, "others_running", lambda: 3)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    seen = []
    run = fitting.LoaderFit._pass

    def recording(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        seen.append(torch.get_num_threads())
        return out

    monkeypatch.setattr(fitting.LoaderFit, "_pass", recording)
    monkeypatch.setattr(fitting, "choose_plan", _large(fitting.choose_plan))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    X, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    la = LowRankGGNLaplace(model, "classification", rank=5)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=16))
    assert seen and set(seen) == {1} and torch.get_num_threads() == 2


def _large(choose):
    """``choose_plan`` as for a fit above the small-fit size (no thread setting of its own)."""
    from dataclasses import replace

    return lambda *args, **kwargs: replace(choose(*args, **kwargs), threads=None)


def test_a_fit_rereads_the_spare_cores_at_every_batch(monkeypatch, two_threads):
    """Another process runnable as the fit starts (one exiting) costs one batch's threads,
    not the whole fit's; a busy one that appears later is seen at the next batch."""
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lowrank_laplace import LowRankGGNLaplace
    from lowrank_laplace.fitting import fit as fitting
    from lowrank_laplace.fitting.streamer import BatchStreamer

    later = iter([0, 0, 2])  # read before the second, third and fourth batch
    machine = {"others": 1}  # as the fit starts and before its first batch
    monkeypatch.setattr(threads, "others_running", lambda: machine["others"])
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    seen, add = [], BatchStreamer.add

    def recording(self, X, y):
        seen.append(torch.get_num_threads())
        out = add(self, X, y)
        machine["others"] = next(later, 0)
        return out

    monkeypatch.setattr(BatchStreamer, "add", recording)
    monkeypatch.setattr(fitting, "choose_plan", _large(fitting.choose_plan))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    X, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    la = LowRankGGNLaplace(model, "classification", rank=5, residual="none")
    la.fit(DataLoader(TensorDataset(X, y), batch_size=16))
    assert seen == [1, 2, 2, 1] and torch.get_num_threads() == 2


@pytest.mark.parametrize("readings, expected", [
    ([1, 0], None),  # a passing thread: gone at the second reading
    ([2, 1, 2], 1),  # a busy process: the fewest of three readings
    ([0], None),
])
def test_a_reading_of_other_processes_is_confirmed(monkeypatch, two_threads, readings,
                                                   expected):
    readings = iter(readings)
    monkeypatch.setattr(threads, "others_running", lambda: next(readings))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert threads.spare_threads("cpu") == expected


@pytest.mark.parametrize("policy, inside", [("PASSIVE", 1), ("passive", 1), ("ACTIVE", 2),
                                            (None, 2)])
def test_lapack_calls_take_one_thread_where_openmp_threads_sleep(monkeypatch, two_threads,
                                                                 policy, inside):
    """``eigh`` and friends on one thread under ``OMP_WAIT_POLICY=passive`` (the CPU only),
    the user's setting otherwise; restored after."""
    from lowrank_laplace.utils.linalg import lapack_threads, top_eigh

    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    with lapack_threads(torch.zeros(2, 2)):
        assert torch.get_num_threads() == inside
    with lapack_threads(torch.zeros(2, 2, device="meta")):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 2
    A = torch.randn(6, 4, dtype=torch.float64)
    evals, _ = top_eigh(A.T @ A, 4)
    torch.testing.assert_close(evals, torch.linalg.eigvalsh(A.T @ A).flip(0))
    assert torch.get_num_threads() == 2
