"""The CPU threads of a public call: set once, restored afterwards.

Beside a busy process every wake-up of PyTorch's thread pool waits for a core, and the
thousands of small operations of a small model's algebra stall
(docs/benchmarks/design_measurements.md). So a call whose largest operation is small runs
on one thread, decided from sizes alone. A larger call takes the cores no other process
is running on as it starts (:func:`spare_threads`), a fit at each of its batches
(:class:`SpareCores`): the threads of a pool wait at every barrier for the slowest, and
one of them sharing a core with another process's work stalls them all.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence, TypeVar

import torch

#: Work (e.g. ``D r`` multiply-adds) below which a posterior's queries run on one thread.
SMALL_WORK = 2**24
#: Readings after one that finds other processes running (the fewest count).
CONFIRM_READINGS = 2

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def cpu_threads(num: Optional[int]) -> Iterator[None]:
    """Run a block with ``num`` PyTorch CPU threads, restoring the setting afterwards.

    ``None`` or more than the current setting changes nothing.
    """
    threads = torch.get_num_threads()
    if num is None or num >= threads:
        yield
        return
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def others_running() -> Optional[int]:
    """Threads of other processes running or ready to run right now, or ``None`` (unknown).

    Linux: the machine's runnable threads (``/proc/loadavg``) less this process's own
    (``/proc/self/task``, whose pool threads may still spin after their last work).
    """
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        tasks = os.listdir("/proc/self/task")
    except (OSError, ValueError, IndexError):  # another system
        return None
    own = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                own += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):  # a thread that just ended runs nothing
            continue
    return max(running - own, 0)


def spare_threads(device: Any) -> Optional[int]:
    """Threads for a call on ``device`` starting now: the cores other processes leave (>= 1).

    ``None`` (the user's setting) off the CPU, with one thread set already, on a quiet
    machine or where the load is unknown.
    """
    if torch.device(device).type != "cpu" or torch.get_num_threads() <= 1:
        return None  # nothing to spare: the machine is not read
    return _cores_left()


def _cores_left() -> Optional[int]:
    """The cores other processes leave now (>= 1); ``None`` when quiet or unknown.

    A reading that finds others running is checked twice more, 1 ms apart, and the fewest
    count: a passing thread (a kernel worker) is rarely still runnable, a busy process's
    always is.
    """
    others = others_running()
    for _ in range(CONFIRM_READINGS):
        if not others:
            break
        time.sleep(0.001)
        others = min(others, others_running() or 0)
    if not others:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    return max(cores - others, 1)


class SpareCores:
    """A long call's threads on ``device``: :func:`spare_threads`, re-read at every step.

    One reading as the call starts can catch another process's passing work (one exiting
    and freeing its memory is runnable for a while) and leave a quiet machine's other
    cores idle for a whole fit; a busy neighbour is seen at every step. The user's
    setting is the most taken, and restored at exit.
    """

    def __init__(self, device: Any):
        cpu = torch.device(device).type == "cpu"
        self._user = torch.get_num_threads() if cpu else 1  # one: nothing to spare

    def __enter__(self) -> "SpareCores":
        self.step()
        return self

    def step(self) -> None:
        """Take the cores other processes leave now (``/proc``; 2 ms more to confirm others)."""
        if self._user <= 1:
            return
        left = _cores_left()
        threads = self._user if left is None else min(left, self._user)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def __exit__(self, *exc: Any) -> None:
        if self._user > 1 and torch.get_num_threads() != self._user:
            torch.set_num_threads(self._user)


def small_work(work: float, device: Any) -> ContextManager[None]:
    """Return the thread context of a call: one thread below :data:`SMALL_WORK`, else spare.

    Spare: :func:`spare_threads`; other devices than the CPU get a null context.

    Args:
        work: Multiply-adds of the call's largest operation.
        device: Where it runs (only the CPU has a pool to spare).
    """
    if torch.device(device).type != "cpu":
        return contextlib.nullcontext()
    return cpu_threads(1 if work < SMALL_WORK else spare_threads(device))


def on_spare_cores(method: F) -> F:
    """Run a posterior method on :func:`spare_threads` where its object lives on the CPU.

    For work that scales with the model (the GLM predictive's backward passes), not ``D r``.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with cpu_threads(spare_threads(self._device)):
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
    """Return ``fn(*inputs)``, its backward (a user's ``loss.backward()``) under :func:`small_work`.

    Gradients reach ``inputs`` only: ``fn`` must not depend on other tensors requiring them.

    Args:
        fn: Scalar function of the inputs.
        inputs: Tensors, some requiring gradients.
        work: Size of the largest operation (see :func:`small_work`).
        device: Where it runs.
    """
    return _ScopedBackward.apply(fn, work, device, *inputs)
