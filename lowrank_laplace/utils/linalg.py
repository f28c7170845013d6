"""Small dense linear algebra shared by the stages."""

from __future__ import annotations

import os
from typing import ContextManager, Optional, Tuple

import torch
from torch import Tensor

from lowrank_laplace.utils.threads import cpu_threads


def squared_rows_dot(mat: Tensor, weights: Tensor, entries: int = 2**20) -> Tensor:
    """Return ``(mat ** 2) @ weights`` ``(D,)`` or ``(D, j)``, squaring row chunks in one buffer.

    A fresh squared ``D x k`` copy costs more in page faults than in arithmetic
    (docs/benchmarks/design_measurements.md). A GPU takes ``64 * entries``; operands
    autograd tracks take the plain expression.

    Args:
        mat: Matrix ``(D, k)``.
        weights: ``(k,)`` or ``(k, j)``, of ``mat``'s dtype.
        entries: Entries squared at a time on the CPU.
    """
    if mat.device.type != "cpu":
        entries *= 64
    rows = max(1, entries // max(1, mat.shape[1]))
    tracked = torch.is_grad_enabled() and (mat.requires_grad or weights.requires_grad)
    if mat.shape[0] <= rows or tracked:
        return (mat * mat) @ weights
    out = mat.new_empty(mat.shape[0], *weights.shape[1:])
    buffer = mat.new_empty(rows, mat.shape[1])
    for start in range(0, mat.shape[0], rows):
        chunk = mat[start:start + rows]
        square = torch.mul(chunk, chunk, out=buffer[: chunk.shape[0]])
        torch.matmul(square, weights, out=out[start:start + chunk.shape[0]])
    return out


def stored_transposed(mat: Tensor) -> bool:
    """Whether a ``(d, K)`` matrix is a view of rows of a ``(K, D)`` tensor."""
    return mat.dim() == 2 and min(mat.shape) > 1 and mat.stride(0) == 1


def rotate(basis: Tensor, mat: Tensor, in_place: bool, rows: int = 2**16) -> Tensor:
    """``basis @ mat`` for a square ``mat``, in place by chunks (no ``D x k`` copy)."""
    if not in_place or mat.shape[0] != mat.shape[1]:
        return basis @ mat
    if stored_transposed(basis):
        for chunk in basis.T.split(rows, dim=1):
            chunk.copy_(mat.T @ chunk)
        return basis
    for chunk in basis.split(rows):
        chunk.copy_(chunk @ mat)
    return basis


#: Float64 entries of :func:`wide_inner`'s cast chunks (16 MB: a freed chunk's pages are
#: reused, where a larger one is mapped and faulted in anew;
#: docs/benchmarks/design_measurements.md).
WIDE_INNER_ENTRIES = 2**21


def wide_inner(a: Tensor, b: Optional[Tensor] = None) -> Tensor:
    """Return ``a^T b`` ``(k, l)`` in float64, one row chunk cast at a time (see docs/concepts.md).

    Args:
        a: Shape ``(D, k)``.
        b: Shape ``(D, l)``; ``None``: ``a`` (the result is then exactly symmetric).
    """
    other = a if b is None else b
    rows = max(1, WIDE_INNER_ENTRIES // max(1, a.shape[1] + other.shape[1]))
    out = a.new_zeros(a.shape[1], other.shape[1], dtype=torch.float64)
    for part_a, part_b in zip(a.split(rows), other.split(rows)):
        part_a = part_a.to(torch.float64)
        out += part_a.T @ (part_a if b is None else part_b.to(torch.float64))
    return (out + out.T) / 2 if b is None else out


def top_eigh(mat: Tensor, keep: int, factor_dtype: Optional[torch.dtype] = None,
             formed_in: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
    """Return the leading eigenpairs of a PSD Gram matrix, in float64, unresolved ones dropped.

    Pairs below ``eps_f^2 tr(mat)`` (the factors' rounding) or ``10 eps_p lambda_max``
    (the product's; ``0.1 eps_p lambda_max`` below float64) are dropped (docs/concepts.md).
    Eigenvalues ``(k,)`` (descending, positive) and vectors ``(n, k)`` are in ``mat``'s dtype.

    Args:
        mat: Symmetric PSD matrix ``(n, n)``.
        keep: Most eigenpairs returned (at least one is).
        factor_dtype: Dtype (``eps_f``) of the factors ``Z``, ``mat = Z^T Z`` (``None``: same).
        formed_in: Dtype (``eps_p``) its entries were computed in (``None``: ``mat``'s).
    """
    with lapack_threads(mat):
        evals, evecs = torch.linalg.eigh(mat.double())
    evals, evecs = evals.flip(0), evecs.flip(1)
    eps_f = torch.finfo(factor_dtype or mat.dtype).eps
    eps_p = torch.finfo(formed_in or mat.dtype).eps
    unit = 10 * eps_p if eps_p <= torch.finfo(torch.float64).eps else eps_p / 10
    tol = torch.maximum(evals[0].clamp(min=0) * unit, evals.clamp(min=0).sum() * eps_f**2)
    num = max(min(keep, int((evals > tol).sum())), 1)
    evals, evecs = evals[:num].to(mat.dtype), evecs[:, :num].to(mat.dtype)
    return evals.clamp(min=torch.finfo(mat.dtype).tiny), evecs


def sym_eigh(mat: Tensor) -> Tuple[Tensor, Tensor]:
    """Descending eigenpairs of the symmetric part of a matrix, in float64."""
    mat = mat.double()
    with lapack_threads(mat):
        evals, evecs = torch.linalg.eigh((mat + mat.T) / 2)
    return evals.flip(0), evecs.flip(1)


def lapack_threads(mat: Tensor) -> ContextManager[None]:
    """The threads of a LAPACK call on ``mat``: one on the CPU where OpenMP threads sleep.

    Under the user's ``OMP_WAIT_POLICY=passive`` every barrier of LAPACK's reduction wakes
    the pool, so one thread is faster there; under the default policy two are
    (docs/benchmarks/design_measurements.md).
    """
    passive = os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"
    return cpu_threads(1 if passive and mat.device.type == "cpu" else None)
