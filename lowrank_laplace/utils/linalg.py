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

    MKL's multi-threaded symmetric eigensolver was measured much slower than its
    single-threaded one for the matrices met here (a few hundred to a few thousand
    rows, on a loaded machine; docs/benchmarks/design_measurements.md), so the CPU
    path pins one thread for the call and restores the setting afterwards.

    Args:
        mat: Symmetric matrix, shape ``(n, n)``.

    Returns:
        Ascending eigenvalues ``(n,)`` and eigenvectors ``(n, n)``.
    """
    if mat.device.type != "cpu":
        return torch.linalg.eigh(mat)
    with cpu_threads(1):
        return torch.linalg.eigh(mat)


def stored_transposed(mat: Tensor) -> bool:
    """Whether a ``(d, K)`` matrix has unit stride down its columns.

    That is, whether it is a view of rows of a ``(K, D)`` tensor, as the sketch's test
    matrix and sketch are.
    """
    return mat.dim() == 2 and min(mat.shape) > 1 and mat.stride(0) == 1


def rotate(basis: Tensor, mat: Tensor, in_place: bool, rows: int = 2**16) -> Tensor:
    """``basis @ mat`` for a square ``mat``, in place by row chunks (no ``D x k`` copy).

    A basis stored transposed (a view of rows of a ``k x D`` tensor, such as the
    sketch's) is rotated by column chunks of that tensor, ``mat^T @ chunk``.
    """
    if not in_place or mat.shape[0] != mat.shape[1]:
        return basis @ mat
    if stored_transposed(basis):
        for chunk in basis.T.split(rows, dim=1):
            chunk.copy_(mat.T @ chunk)
        return basis
    for chunk in basis.split(rows):
        chunk.copy_(chunk @ mat)
    return basis


def top_eigh(mat: Tensor, keep: int) -> Tuple[Tensor, Tensor]:
    """Leading eigenpairs of a symmetric PSD matrix, numerically zero ones dropped.

    The small eigenproblem is solved in float64 (cheap at this size, and every
    merge builds the new eigenvectors from its eigenvectors, so their orthogonality
    matters) and cast back.
    """
    evals, evecs = eigh(mat.double())
    evals, evecs = evals.flip(0).to(mat.dtype), evecs.flip(1).to(mat.dtype)
    # drop only numerically non-positive directions: a rank-style cutoff
    # (lambda_max * n * eps) discarded float32 curvature of the size of a typical
    # prior precision, which changed predictive variances by tens of percent
    tol = evals[0].clamp(min=0) * 10 * torch.finfo(mat.dtype).eps
    num = int(min(keep, int((evals > tol).sum())))
    num = max(num, 1)
    return evals[:num].clamp(min=torch.finfo(mat.dtype).tiny), evecs[:, :num]


def sym_eigh(mat: Tensor) -> Tuple[Tensor, Tensor]:
    """Descending eigenpairs of the symmetric part of a matrix, in float64."""
    mat = mat.double()
    evals, evecs = eigh((mat + mat.T) / 2)
    return evals.flip(0), evecs.flip(1)
