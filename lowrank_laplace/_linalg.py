"""Small dense linear algebra shared by the stages."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor


@contextmanager
def cpu_threads(num: Optional[int]) -> Iterator[None]:
    """Run a block with ``num`` PyTorch CPU threads, restoring the setting afterwards.

    Args:
        num: Threads for the block; ``None`` or more than the current setting leaves
            it unchanged.
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


def eigh(mat: Tensor) -> Tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` that runs single-threaded on the CPU.

    MKL's multi-threaded symmetric eigensolver was measured 10-100x slower than its
    single-threaded one for the matrices met here (a few hundred to a few thousand
    rows, 2 CPU cores, torch 2.14: 6.6 s vs 0.05 s for 450 x 450 under load), so the
    CPU path pins one thread for the call and restores the setting afterwards.

    Args:
        mat: Symmetric matrix, shape ``(n, n)``.

    Returns:
        Ascending eigenvalues ``(n,)`` and eigenvectors ``(n, n)``.
    """
    if mat.device.type != "cpu":
        return torch.linalg.eigh(mat)
    with cpu_threads(1):
        return torch.linalg.eigh(mat)
