"""Small dense linear algebra shared by the stages."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def squared_rows_dot(mat: Tensor, weights: Tensor, entries: int = 2**20) -> Tensor:
    """``(mat ** 2) @ weights`` over row chunks of about ``entries`` entries.

    The squared ``D x k`` copy of a basis is the largest temporary of a fit's end,
    and faulting in its fresh pages cost more than the arithmetic; one reused chunk
    does not (docs/benchmarks/design_measurements.md).
    A GPU takes chunks of ``64 * entries`` (fewer launches); operands that autograd
    tracks take the plain expression.

    Args:
        mat: Matrix ``(D, k)``.
        weights: Vector ``(k,)`` or matrix ``(k, j)`` of ``mat``'s dtype.
        entries: Entries squared at a time on the CPU.

    Returns:
        Tensor of shape ``(D,)`` or ``(D, j)``.
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


def wide_inner(a: Tensor, b: Optional[Tensor] = None, rows: int = 2**18) -> Tensor:
    """``a^T b`` in float64, over row chunks each cast on its own (no ``D x k`` copy).

    Inner products of float32 bases rounded in float32 carry errors of ``eps`` times
    the columns' norms, which hide small eigenvalues and a basis's complement.

    Args:
        a: Shape ``(D, k)``.
        b: Shape ``(D, l)`` (``None``: ``a``, and the result is exactly symmetric).
        rows: Rows per chunk.

    Returns:
        Shape ``(k, l)``, float64.
    """
    other = a if b is None else b
    out = a.new_zeros(a.shape[1], other.shape[1], dtype=torch.float64)
    for part_a, part_b in zip(a.split(rows), other.split(rows)):
        part_a = part_a.to(torch.float64)
        out += part_a.T @ (part_a if b is None else part_b.to(torch.float64))
    return (out + out.T) / 2 if b is None else out


def top_eigh(mat: Tensor, keep: int, factor_dtype: Optional[torch.dtype] = None,
             formed_in: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
    """Leading eigenpairs of a symmetric PSD Gram matrix, unresolved ones dropped.

    The small eigenproblem is solved in float64 (cheap at this size, and every
    merge builds the new eigenvectors from its eigenvectors, so their orthogonality
    matters) and cast back to ``mat``'s dtype. Two roundings bound what it resolves:

    * Its factors ``Z`` (``mat = Z^T Z``) stored in ``factor_dtype`` move an
      eigenvalue ``mu`` by up to about ``eps_f sqrt(mu tr(mat))``: pairs below
      ``eps_f^2 tr(mat)`` are dropped (measured on float32 MLPs against float64,
      eigenvalues above it were within a few percent).
    * ``mat`` formed in ``formed_in`` is rounded at about ``eps_p lambda_max``. A
      float64 product of float32 factors thus resolves eigenvalues far below
      float32's ``eps lambda_max``; pairs below ``10 eps_p lambda_max`` are dropped.
      A product formed in lower precision (a low-memory pass's float32 Gram matrix)
      keeps pairs down to ``0.1 eps_p lambda_max``, noisy as they are, as a dense
      float32 posterior (laplace-torch's ``FullLaplace``) keeps its whole noisy
      spectrum: dropping them leaves those directions the prior variance alone, which
      changed predictive variances at a prior precision of 0.01 by tens of percent,
      while keeping them stayed within ``FullLaplace``'s own float32 error (a merge
      that forms its eigenvectors ``Z q / sqrt(mu)`` in float32 cannot go lower: they
      lose orthogonality by about ``eps_f sqrt(lambda_max / mu)``).

    Args:
        mat: Symmetric PSD matrix, shape ``(n, n)``.
        keep: Most eigenpairs returned (at least one is).
        factor_dtype: The dtype of the factors ``mat`` is the Gram matrix of
            (``None``: ``mat``'s).
        formed_in: The dtype its entries were computed in (``None``: ``mat``'s; a
            float32 product cast to float64 is still rounded like float32).

    Returns:
        Descending eigenvalues ``(k,)`` (positive) and eigenvectors ``(n, k)``, in
        ``mat``'s dtype.
    """
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
    evals, evecs = torch.linalg.eigh((mat + mat.T) / 2)
    return evals.flip(0), evecs.flip(1)
