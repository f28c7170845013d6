"""Small work on one CPU thread: what a library running beside other work owes it.

PyTorch runs a matrix product, a batched product or an MKL vector function (``exp``,
``log``) on every thread of its pool, however small the operands. On a quiet machine
the cost is a wake-up of the pool per operation; beside another busy process every
wake-up waits for a core, and the posterior algebra of a small model (a few thousand
parameters, a few hundred kept eigenpairs), which makes thousands of such calls,
slowed from 0.08 s to 5.9 s (docs/benchmarks/design_measurements.md). The helpers
here run such work on one thread, scoped, restoring the user's setting afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Any, Callable, ContextManager, Optional, Sequence, TypeVar

import torch

from lowrank_laplace.utils.linalg import cpu_threads

#: Work (e.g. ``D r`` multiply-adds per product) below which the posterior's queries
#: run on one CPU thread.
SMALL_WORK = 2**24

F = TypeVar("F", bound=Callable[..., Any])


#: The last reading :func:`busy_elsewhere` averages from, ``(wall s, busy s of our CPUs,
#: own CPU s)``, and the average it gave (``None``: none yet).
_LAST_READING: dict = {"reading": None, "average": None}
#: Averages span at least this many seconds, at most :data:`AVERAGE_MAX_S`.
AVERAGE_MIN_S, AVERAGE_MAX_S = 0.05, 30.0


def busy_elsewhere() -> Optional[float]:
    """Cores other processes keep busy (Linux), ``None`` where unknown.

    Averaged since the last reading where that was 0.05-30 s ago: the busy CPU time of
    the CPUs this process may use (``/proc/stat``) less its own, per second. A call
    sooner after the last reading gets that reading's average; without one, a snapshot
    of the runnable count (:func:`_running_elsewhere`), which also counts threads that
    only pass by (docs/benchmarks/design_measurements.md).
    """
    now, last = time.monotonic(), _LAST_READING["reading"]
    if last is not None and now - last[0] < AVERAGE_MIN_S:
        average = _LAST_READING["average"]
        return _running_elsewhere() if average is None else average
    try:
        busy = _busy_seconds_of_our_cpus()
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    own = sum(os.times()[:2])
    average = None
    if last is not None and now - last[0] <= AVERAGE_MAX_S:
        average = max(0.0, (busy - last[1]) - (own - last[2])) / (now - last[0])
    _LAST_READING.update(reading=(now, busy, own), average=average)
    return _running_elsewhere() if average is None else average


def _busy_seconds_of_our_cpus() -> float:
    """Busy CPU seconds since boot of the CPUs this process may run on (``/proc/stat``).

    Only those CPUs: in a container pinned to a few cores of a large machine, the
    other cores' work is not competing with ours.
    """
    ours = {f"cpu{i}" for i in os.sched_getaffinity(0)}
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *ticks = line.split()[:9]
            if name in ours:
                busy += sum(map(int, ticks)) - int(ticks[3]) - int(ticks[4])  # less idle, iowait
    return busy / os.sysconf("SC_CLK_TCK")


def _running_elsewhere() -> Optional[int]:
    """Threads of other processes running on the CPUs now, ``None`` where unknown.

    The runnable count of ``/proc/loadavg`` less this process's own running threads
    (its thread pool may still be spinning after a parallel region).
    """
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        own = 0
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/stat") as f:
                    stat = f.read()
            except OSError:  # the thread ended meanwhile
                continue
            own += stat[stat.rindex(")") + 2] == "R"
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - own)


def idle_core_threads(unknown: Optional[int] = 1) -> Optional[int]:
    """Threads for CPU work now: the pool's where as many cores are idle.

    Otherwise as many as there are idle cores, at least one. Beside a busy process
    every wake-up of a thread team waits for a core, while on idle cores a second
    thread nearly halves a sketch fit's products (docs/benchmarks/design_measurements.md).

    Args:
        unknown: The count where the load is unknown (not Linux).

    Returns:
        A thread count for :func:`~lowrank_laplace.utils.linalg.cpu_threads`
        (``None``: the user's setting).
    """
    busy = busy_elsewhere()
    if busy is None:
        return unknown
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    idle = round((cores or 1) - busy)  # a tenth of a core of daemons leaves a core idle
    return None if idle >= torch.get_num_threads() else max(1, idle)


def small_work(work: float, device: Any) -> ContextManager[None]:
    """One CPU thread for work below :data:`SMALL_WORK`, else :func:`idle_cores`.

    Args:
        work: Size of the block's largest operation (multiply-adds).
        device: Where it runs (only the CPU has a thread pool to spare).

    Returns:
        A context manager.
    """
    if torch.device(device).type != "cpu":
        return contextlib.nullcontext()
    return cpu_threads(1) if work < SMALL_WORK else idle_cores()


def idle_cores(device: Any = "cpu") -> ContextManager[None]:
    """Large CPU work on the cores idle now (never more threads than the user's setting).

    The user's setting on a quiet machine (and where the load is unknown), fewer
    threads beside busy processes (:func:`idle_core_threads`).

    Args:
        device: Where the work runs (another device's work is left as it is).

    Returns:
        A context manager.
    """
    if torch.device(device).type != "cpu":
        return contextlib.nullcontext()
    return cpu_threads(idle_core_threads(unknown=None))


def on_idle_cores(method: F) -> F:
    """Run a method of an object with a ``_device`` under :func:`idle_cores`."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with idle_cores(self._device):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def on_one_thread_if_small(method: F) -> F:
    """Run a posterior method under :func:`small_work` of its object's ``query_work``."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with small_work(self.query_work, self._device):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class _ScopedBackward(torch.autograd.Function):
    """``fn(*inputs)`` whose backward also runs under :func:`small_work` (see there)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], work: float, device: Any,
                *inputs: torch.Tensor) -> torch.Tensor:
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        with torch.enable_grad():
            out = fn(*leaves)
        ctx.inner, ctx.work, ctx.device = (out, leaves), work, device
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out, leaves = ctx.inner
        wanted = [t for t in leaves if t.requires_grad]
        with small_work(ctx.work, ctx.device):
            # kept while the outer graph keeps this node (a retained graph may ask again)
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True,
                                             retain_graph=True))
        return (None, None, None, *[next(grads) if t.requires_grad else None for t in leaves])


def scoped_backward(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
                    work: float, device: Any) -> torch.Tensor:
    """``fn(*inputs)``, differentiable in ``inputs``, its backward under :func:`small_work`.

    A user's ``loss.backward()`` runs outside any scope a query sets, on every thread of
    the pool: the many small operations of a marginal-likelihood gradient then stall
    beside other work as the forward would (64-50-50-10 digits MLP, 100 layerwise prior
    steps beside a busy process: 17.4 s, 2.1 s through this; ``kron`` 6.5 s).
    Gradients reach ``inputs`` only: ``fn`` must not depend on other tensors that
    require them.

    Args:
        fn: Scalar function of the inputs.
        inputs: Tensors, some requiring gradients.
        work: Size of the largest operation (see :func:`small_work`).
        device: Where it runs.

    Returns:
        The value, whose gradient flows to ``inputs``.
    """
    return _ScopedBackward.apply(fn, work, device, *inputs)
