"""An explicit block ``B`` (``(M, d)``) of a column-stacked matrix such as ``V``.

Shape glossary:
    M: rows (columns of ``V``); d: entries of the parameter; K: vectors in a product.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Tuple

import torch
from torch import Tensor

from lowrank_laplace.factor import weights
from lowrank_laplace.factor.weights import SMALL_DTYPE, Weight, weight_slice, weighted_product
from lowrank_laplace.utils.linalg import stored_transposed

if TYPE_CHECKING:
    from lowrank_laplace.factor.blocks import Block


def _symmetrized(square: Tensor) -> Tensor:
    """``(A + A^T) / 2``: exactly symmetric whatever the BLAS kernel produced."""
    return (square + square.T) / 2


#: ``B^T y`` is formed as ``(y^T B)^T`` for wide blocks (``d >= _WIDE_COLUMNS``) with
#: many rows for few columns of ``y`` (``M >= 8 K``): reading the rows along ``d`` is
#: faster for wide convolution blocks with many rows, and slower than the plain product
#: with few rows against many columns, as in a streaming merge
#: (docs/benchmarks/design_measurements.md).
_WIDE_COLUMNS = 4096
#: Elements of the intermediate ``(rows, out or in, K)`` of an explicit block's product
#: with Khatri-Rao columns, per chunk of rows (a wide range of chunk sizes around it
#: performed alike; docs/benchmarks/design_measurements.md).
_KHATRI_RAO_CHUNK = 2**22
#: Entries squared per step of :meth:`DenseBlock.diag_outer` (about a core's L2 cache in
#: float32; docs/benchmarks/design_measurements.md).
_DIAG_CHUNK_ENTRIES = 2**18
#: From this many columns a CPU block's diagonal adds one squared row at a time (below,
#: chunks were faster; docs/benchmarks/design_measurements.md).
_ROW_WISE_DIAG_COLUMNS = 2**15


class DenseBlock:
    """Explicit block ``B`` of shape ``(M, d)``.

    Args:
        rows: The block, shape ``(M, d)``.
    """

    #: Kept as factors (see :attr:`KronBlock.factored`): no, explicit rows.
    factored = False

    def __init__(self, rows: Tensor):
        self.rows = rows

    @property
    def num_rows(self) -> int:
        """Number of rows ``M``."""
        return self.rows.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The block's dtype."""
        return self.rows.dtype

    @property
    def nbytes(self) -> int:
        """Bytes the block holds."""
        return self.rows.numel() * self.rows.element_size()

    def wide_parts(self, U: Tensor, weight: Weight
                   ) -> Iterator[Tuple["DenseBlock", Tensor, Weight]]:
        """Float64 slices of the block with their products ``B_s diag(w_s) U_s``.

        Slices of ``d`` keep each widened copy of rows and of ``U`` near
        :data:`~lowrank_laplace.factor.weights.WIDE_ENTRIES` entries; the rows of ``U``
        of a slice are contiguous. No large float64 copy is made.

        Args:
            U: Shape ``(d, r)``.
            weight: The parameter's weight (scalar or ``(d,)``).

        Yields:
            ``(float64 slice of the block, its product, its weight)``.
        """
        rows = self.rows
        step = max(1, weights.WIDE_ENTRIES // max(rows.shape[0] + U.shape[1], 1))
        for lo in range(0, rows.shape[1], step):
            params = slice(lo, min(lo + step, rows.shape[1]))
            sliced = DenseBlock(rows[:, params].to(SMALL_DTYPE))
            yield (sliced, weighted_product(sliced, U, weight, params),
                   weight_slice(weight, params))

    def to(self, dtype: torch.dtype) -> "DenseBlock":
        """Return the block in ``dtype`` (itself if it already is)."""
        return self if self.rows.dtype == dtype else DenseBlock(self.rows.to(dtype))

    def scale_(self, alpha: float) -> "DenseBlock":
        """Scale the block in place.

        Args:
            alpha: Scalar factor.

        Returns:
            The block itself.
        """
        self.rows.mul_(alpha)
        return self

    def to_dense(self) -> Tensor:
        """Return ``B`` explicitly, shape ``(M, d)``."""
        return self.rows

    def take_samples(self, start: int, stop: int, num_vectors: int) -> "DenseBlock":
        """The rows of samples ``start:stop`` (a copy unless one vector per sample).

        Args:
            start: First sample.
            stop: One past the last sample.
            num_vectors: Vectors per sample ``V`` (rows are ordered ``(v, n)``).

        Returns:
            A block with ``num_vectors * (stop - start)`` rows.
        """
        rows = self.rows.reshape(num_vectors, -1, self.rows.shape[1])[:, start:stop]
        return DenseBlock(rows.reshape(-1, self.rows.shape[1]))

    def gram(self) -> Tensor:
        """Return ``B B^T``, shape ``(M, M)``.

        For many rows only the upper block triangle is multiplied (three row
        blocks: 6 of 9 block products) and mirrored; a general matrix product does
        not exploit the symmetry, and this Gram of the expanded convolution blocks
        is one of the largest costs of an exact fit (faster on CPU for ``M`` of a few
        hundred and ``d`` ~ 1e5; docs/benchmarks/design_measurements.md).

        The result is exactly symmetric: a BLAS product ``A A^T`` need not be
        bitwise symmetric (e.g. MKL's AVX512 kernels), so each diagonal block is
        averaged with its transpose.
        """
        rows = self.rows
        num = rows.shape[0]
        parts = min(6, num // 64) if num >= 192 else 1  # 6 parts beat 3 for large M
        if parts == 1:
            return _symmetrized(rows @ rows.T)
        out = rows.new_empty(num, num)
        edges = [num * i // parts for i in range(parts + 1)]
        for lo, hi in zip(edges[:-1], edges[1:]):
            upper = rows[lo:hi] @ rows[lo:].T  # rows lo:hi, columns lo:
            out[lo:hi, lo:] = upper
            out[lo:hi, lo:hi] = _symmetrized(upper[:, : hi - lo])
            out[hi:, lo:hi] = upper[:, hi - lo:].T
        return out

    def cross(self, other: Block) -> Tensor:
        """Return ``B B'^T`` with another block of the same parameter.

        Args:
            other: Block with ``M'`` rows over the same parameter.

        Returns:
            Tensor of shape ``(M, M')``.
        """
        return self.rows @ other.to_dense().T

    def weighted_gram(self, weight: Weight) -> Tensor:
        """Return ``B diag(w) B^T``, shape ``(M, M)``.

        Args:
            weight: Scalar or per-entry weights of shape ``(d,)``.

        Returns:
            The weighted Gram matrix.
        """
        if _is_scalar(weight):  # scale the small result, not a copy of the rows
            return (self.rows @ self.rows.T) * weight
        return (self.rows * weight) @ self.rows.T

    def sample_gram(self, num_vectors: int, weight: Weight = 1.0) -> Tensor:
        """Per-sample diagonal blocks of ``B diag(w) B^T`` for rows ordered ``(v, n)``.

        Args:
            num_vectors: Vectors per sample ``V`` (``M = V * N``).
            weight: Scalar or per-entry weights of shape ``(d,)``.

        Returns:
            Tensor of shape ``(N, V, V)``.
        """
        rows = self.rows.reshape(num_vectors, -1, self.rows.shape[1])
        if _is_scalar(weight):  # the GLM predictive's scalar prior: no weighted copy
            return torch.einsum("vnd,knd->nvk", rows, rows) * weight
        return torch.einsum("vnd,knd->nvk", rows * weight, rows)

    def row_sq_norms(self) -> Tensor:
        """Return the squared norm of every row, shape ``(M,)``.

        A reduction, not a squared copy of the block (an expanded convolution block
        is the largest tensor of a pass).
        """
        return torch.linalg.vector_norm(self.rows, dim=1).square()

    def diag_outer(self) -> Tensor:
        """Return the diagonal of ``B^T B`` (this parameter's GGN diagonal), ``(d,)``.

        No squared copy of the block: on the CPU a wide block (an expanded convolution)
        adds one squared row at a time into the result, which stays in cache; narrower
        blocks, and any on a GPU, square about ``2^18`` entries (at least 64 rows) at a
        time, one step for a bias's few columns, whose fixed 64-row chunks were many
        small launches that a GPU fit waits on (docs/benchmarks/design_measurements.md).
        """
        rows = self.rows
        out = rows.new_zeros(rows.shape[1])
        if rows.device.type == "cpu" and out.numel() >= _ROW_WISE_DIAG_COLUMNS:
            for row in rows:
                out.addcmul_(row, row)
            return out
        for chunk in rows.split(max(64, _DIAG_CHUNK_ENTRIES // max(1, out.numel()))):
            out.add_((chunk * chunk).sum(0))
        return out

    def t_matmul(self, x: Tensor) -> Tensor:
        """Return ``B x`` (i.e. ``V^T x`` restricted to this parameter).

        Args:
            x: Tensor of shape ``(d, K)``.

        Returns:
            Tensor of shape ``(M, K)``.
        """
        if x.dtype != self.dtype:  # blocks of several dtypes: the wider one
            wide = torch.promote_types(self.dtype, x.dtype)
            return self.to(wide).t_matmul(x.to(wide))
        return self.rows @ x

    def t_matmul_khatri_rao(self, p: Tensor, q: Tensor) -> Tensor:
        r"""Return ``B x`` for ``x`` of Khatri-Rao columns ``x_k = p_k \otimes q_k``.

        Row ``m`` of ``B`` as an ``out x in`` matrix ``B_m`` gives
        ``(B x)_{mk} = p_k^\top B_m q_k``. With fewer rows than ``max(out, in)`` the
        products ``B_m q_k`` (or ``B_m^\top p_k``) come first, in chunks of rows of
        ``_KHATRI_RAO_CHUNK`` intermediate elements, and ``x`` is never formed; with more,
        ``x`` is formed and multiplied (its ``out in K`` entries are then the smaller
        intermediate). Both take the multiply-adds of the explicit product, but with
        few rows not forming ``x`` is faster, by far for large weights
        (docs/benchmarks/design_measurements.md).

        Args:
            p: Output factors, shape ``(K, out)``.
            q: Input factors, shape ``(K, in)``.

        Returns:
            Tensor of shape ``(M, K)``.
        """
        if p.dtype != self.dtype:  # blocks of several dtypes: the wider one
            wide = torch.promote_types(self.dtype, p.dtype)
            return self.to(wide).t_matmul_khatri_rao(p.to(wide), q.to(wide))
        (k, out_dim), in_dim = p.shape, q.shape[1]
        if out_dim * in_dim != self.rows.shape[1]:
            raise ValueError(
                f"Khatri-Rao factors of sizes {out_dim} x {in_dim} do not match the "
                f"block's {self.rows.shape[1]} columns."
            )
        if self.num_rows >= max(out_dim, in_dim):
            return self.rows @ (p[:, :, None] * q[:, None, :]).reshape(k, -1).T
        first, second = (q.T.contiguous(), p.T.contiguous()) if in_dim >= out_dim else \
            (p.T.contiguous(), q.T.contiguous())
        step = max(1, _KHATRI_RAO_CHUNK // max(k * min(out_dim, in_dim), 1))
        pieces = []
        for chunk in self.rows.split(step):
            mats = chunk.reshape(-1, out_dim, in_dim)
            if in_dim < out_dim:
                mats = mats.transpose(1, 2)
            # (rows, out, K) = B_m q_k (or (rows, in, K) = B_m^T p_k), then the other
            pieces.append((mats @ first).mul_(second).sum(1))
        return torch.cat(pieces)

    def matmul(self, y: Tensor) -> Tensor:
        """Return ``B^T y`` (i.e. ``V y`` restricted to this parameter).

        Args:
            y: Tensor of shape ``(M, K)``.

        Returns:
            Tensor of shape ``(d, K)``.
        """
        if y.dtype != self.dtype:  # blocks of several dtypes: the wider one
            wide = torch.promote_types(self.dtype, y.dtype)
            return self.to(wide).matmul(y.to(wide))
        if self._read_along_d(y):
            return (y.T @ self.rows).T
        return self.rows.T @ y

    def matmul_add_(self, out: Tensor, y: Tensor) -> Tensor:
        """Accumulate ``out += B^T y`` in place.

        Args:
            out: Tensor of shape ``(d, K)``.
            y: Tensor of shape ``(M, K)``.

        Returns:
            ``out``.
        """
        if out.dtype != self.dtype or y.dtype != out.dtype:  # blocks of several dtypes
            return self.to(out.dtype).matmul_add_(out, y.to(out.dtype))
        if self._read_along_d(y) and not stored_transposed(out):
            return out.add_((y.T @ self.rows).T)
        return out.addmm_(self.rows.T, y)  # a transposed out gets wide K x d rows

    def _read_along_d(self, y: Tensor) -> bool:
        """Whether ``B^T y`` is faster as ``(y^T B)^T`` (see ``_WIDE_COLUMNS``)."""
        return self.rows.shape[1] >= _WIDE_COLUMNS and self.rows.shape[0] >= 8 * y.shape[1]


def _is_scalar(weight: Weight) -> bool:
    """Whether a weight is one number (a Python scalar or a one-entry tensor)."""
    return not isinstance(weight, torch.Tensor) or weight.numel() == 1
