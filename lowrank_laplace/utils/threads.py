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
from typing import Any, Callable, ContextManager, TypeVar

import torch

from lowrank_laplace.utils.linalg import cpu_threads

#: Work (e.g. ``D r`` multiply-adds per product) below which the posterior's queries
#: run on one CPU thread.
SMALL_WORK = 2**24

F = TypeVar("F", bound=Callable[..., Any])


def small_work(work: float, device: Any) -> ContextManager[None]:
    """One CPU thread for work below :data:`SMALL_WORK`, else the user's setting.

    Args:
        work: Size of the block's largest operation (multiply-adds).
        device: Where it runs (only the CPU has a thread pool to spare).

    Returns:
        A context manager.
    """
    if torch.device(device).type == "cpu" and work < SMALL_WORK:
        return cpu_threads(1)
    return contextlib.nullcontext()


def on_one_thread_if_small(method: F) -> F:
    """Run a posterior method under :func:`small_work` of its object's ``query_work``."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with small_work(self.query_work, self._device):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
