"""An explicit block ``B`` (``(M, d)``) of ``V^T``; its methods are documented at ``Block``."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Tuple

import torch
from torch import Tensor

from lowrank_laplace.factor import weights
from lowrank_laplace.factor.weights import SMALL_DTYPE, Weight, weight_slice, weighted_product
from lowrank_laplace.utils.linalg import stored_transposed

if TYPE_CHECKING:
    from lowrank_laplace.factor.blocks import Block


def symmetrized(square: Tensor) -> Tensor:
    """``(A + A^T) / 2``: exactly symmetric whatever the BLAS kernel produced."""
    return (square + square.T) / 2


#: ``B^T y`` is ``(y^T B)^T`` from ``d >= _WIDE_COLUMNS``, ``M >= 8 K`` (tuning constants:
#: docs/benchmarks/design_measurements.md).
_WIDE_COLUMNS = 4096
#: Intermediate elements per row chunk of :meth:`DenseBlock.t_matmul_khatri_rao`.
_KHATRI_RAO_CHUNK = 2**22
#: Entries squared per step of :meth:`DenseBlock.diag_outer` (a core's L2 in float32).
_DIAG_CHUNK_ENTRIES = 2**18
#: From this many columns a CPU block's diagonal adds squared rows into this many
#: accumulators, a slab at a time (one row at a time woke the thread pool every row).
_ROW_WISE_DIAG_COLUMNS, _ROW_WISE_DIAG_ROWS = 2**15, 16


class DenseBlock:
    """Explicit block ``B`` (:class:`~lowrank_laplace.factor.blocks.Block`).

    Args:
        rows: ``B``, ``(M, d)``.
    """

    #: Kept as factors (see ``Block.factored``).
    factored = False

    def __init__(self, rows: Tensor):
        self.rows = rows

    @property
    def num_rows(self) -> int:
        """Rows ``M``."""
        return self.rows.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The block's dtype."""
        return self.rows.dtype

    @property
    def nbytes(self) -> int:
        """Bytes the block holds."""
        return self.rows.numel() * self.rows.element_size()

    def wide_slices(self, width: int) -> Iterator[Tuple[int, int, "DenseBlock"]]:
        """See ``Block.wide_slices``: slices of columns."""
        rows = self.rows
        step = max(1, weights.WIDE_ENTRIES // max(rows.shape[0] + width, 1))
        for lo in range(0, rows.shape[1], step):
            hi = min(lo + step, rows.shape[1])
            yield lo, hi, DenseBlock(rows[:, lo:hi].to(SMALL_DTYPE))

    def wide_parts(self, U: Tensor, weight: Weight
                   ) -> Iterator[Tuple["DenseBlock", Tensor, Weight]]:
        """See ``Block.wide_parts``: the slices of :meth:`wide_slices`."""
        for lo, hi, sliced in self.wide_slices(U.shape[1]):
            params = slice(lo, hi)
            yield (sliced, weighted_product(sliced, U, weight, params),
                   weight_slice(weight, params))

    def to(self, dtype: torch.dtype) -> "DenseBlock":
        """See ``Block.to``."""
        return self if self.dtype == dtype else DenseBlock(self.rows.to(dtype))

    def scale_(self, alpha: float) -> "DenseBlock":
        """See ``Block.scale_``."""
        self.rows.mul_(alpha)
        return self

    def to_dense(self) -> Tensor:
        """See ``Block.to_dense``."""
        return self.rows

    def take_samples(self, start: int, stop: int, num_vectors: int) -> "DenseBlock":
        """See ``Block.take_samples`` (a copy unless one vector per sample)."""
        rows = self.rows.reshape(num_vectors, -1, self.rows.shape[1])[:, start:stop]
        return DenseBlock(rows.reshape(-1, self.rows.shape[1]))

    def gram(self) -> Tensor:
        """``B B^T``, ``(M, M)``, exactly symmetric.

        For many rows only the upper block triangle is multiplied and mirrored (the Gram
        of expanded convolution blocks is among an exact fit's largest costs); diagonal
        blocks are averaged with their transposes, as BLAS need not be bitwise symmetric.
        """
        rows = self.rows
        num = rows.shape[0]
        parts = min(6, num // 64) if num >= 192 else 1  # 6 parts beat 3 for large M
        if parts == 1:
            return symmetrized(rows @ rows.T)
        out = rows.new_empty(num, num)
        edges = [num * i // parts for i in range(parts + 1)]
        for lo, hi in zip(edges[:-1], edges[1:]):
            upper = rows[lo:hi] @ rows[lo:].T  # rows lo:hi, columns lo:
            out[lo:hi, lo:] = upper
            out[lo:hi, lo:hi] = symmetrized(upper[:, : hi - lo])
            out[hi:, lo:hi] = upper[:, hi - lo:].T
        return out

    def cross(self, other: Block) -> Tensor:
        """See ``Block.cross``."""
        return self.rows @ other.to_dense().T

    def weighted_gram(self, weight: Weight) -> Tensor:
        """See ``Block.weighted_gram`` (a scalar weight scales the result)."""
        if _is_scalar(weight):  # scale the small result, not a copy of the rows
            return (self.rows @ self.rows.T) * weight
        return (self.rows * weight) @ self.rows.T

    def sample_gram(self, num_vectors: int, weight: Weight = 1.0) -> Tensor:
        """See ``Block.sample_gram`` (a scalar weight scales the result)."""
        rows = self.rows.reshape(num_vectors, -1, self.rows.shape[1])
        if _is_scalar(weight):  # the GLM predictive's scalar prior: no weighted copy
            return torch.einsum("vnd,knd->nvk", rows, rows) * weight
        return torch.einsum("vnd,knd->nvk", rows * weight, rows)

    def row_sq_norms(self) -> Tensor:
        """See ``Block.row_sq_norms``: a reduction, no squared copy."""
        return torch.linalg.vector_norm(self.rows, dim=1).square()

    def diag_outer(self) -> Tensor:
        """``diag(B^T B)`` (this parameter's GGN diagonal), ``(d,)``, without a squared copy.

        On the CPU a wide block adds slabs of 16 squared rows into 16 accumulators; else
        chunks of about ``2^18`` entries (at least 64 rows) are squared.
        """
        rows = self.rows
        if rows.device.type == "cpu" and rows.shape[1] >= _ROW_WISE_DIAG_COLUMNS:
            acc = rows.new_zeros(max(1, min(_ROW_WISE_DIAG_ROWS, len(rows))), rows.shape[1])
            for slab in rows.split(len(acc)):
                acc[: len(slab)].addcmul_(slab, slab)
            return acc.sum(0)
        out = rows.new_zeros(rows.shape[1])
        for chunk in rows.split(max(64, _DIAG_CHUNK_ENTRIES // max(1, out.numel()))):
            out.add_((chunk * chunk).sum(0))
        return out

    def t_matmul(self, x: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """See ``Block.t_matmul``."""
        if x.dtype != self.dtype:  # blocks of several dtypes: the wider one
            return self.to(w := torch.promote_types(self.dtype, x.dtype)).t_matmul(x.to(w), out)
        return self.rows @ x if out is None else out.addmm_(self.rows, x)

    def t_matmul_khatri_rao(self, p: Tensor, q: Tensor, out: Optional[Tensor] = None
                            ) -> Tensor:
        r"""See ``Block.t_matmul_khatri_rao``.

        With row ``m`` as an ``out x in`` matrix ``B_m``, ``(B x)_{mk} = p_k^\top B_m q_k``.
        With fewer rows than ``max(out, in)`` the products ``B_m q_k`` (or ``B_m^\top p_k``)
        come first, in row chunks, and ``x`` is never formed; else ``x`` is formed.
        """
        if out is not None:
            return out.add_(self.t_matmul_khatri_rao(p, q))
        if p.dtype != self.dtype:  # blocks of several dtypes: the wider one
            wide = torch.promote_types(self.dtype, p.dtype)
            return self.to(wide).t_matmul_khatri_rao(p.to(wide), q.to(wide))
        (k, out_dim), in_dim = p.shape, q.shape[1]
        if out_dim * in_dim != self.rows.shape[1]:
            raise ValueError(
                f"Khatri-Rao factors of sizes {out_dim} x {in_dim} do not match the "
                f"block's {self.rows.shape[1]} columns.")
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
        """See ``Block.matmul``."""
        if y.dtype != self.dtype:  # blocks of several dtypes: the wider one
            return self.to(w := torch.promote_types(self.dtype, y.dtype)).matmul(y.to(w))
        if self._read_along_d(y):
            return (y.T @ self.rows).T
        return self.rows.T @ y

    def matmul_add_(self, out: Tensor, y: Tensor) -> Tensor:
        """See ``Block.matmul_add_``."""
        if out.dtype != self.dtype or y.dtype != out.dtype:  # blocks of several dtypes
            return self.to(out.dtype).matmul_add_(out, y.to(out.dtype))
        if self._read_along_d(y) and not stored_transposed(out):
            return out.add_((y.T @ self.rows).T)
        return out.addmm_(self.rows.T, y)  # a transposed out gets wide K x d rows

    def _read_along_d(self, y: Tensor) -> bool:
        """Whether ``B^T y`` is formed as ``(y^T B)^T`` (see ``_WIDE_COLUMNS``)."""
        return self.rows.shape[1] >= _WIDE_COLUMNS and self.rows.shape[0] >= 8 * y.shape[1]


def _is_scalar(weight: Weight) -> bool:
    """Whether a weight is one number (a Python scalar or a one-entry tensor)."""
    return not isinstance(weight, torch.Tensor) or weight.numel() == 1



class SampleConcat(DenseBlock):
    """Explicit blocks of passes as one (rows ``(v, n)``), concatenated only when read whole.

    Args:
        parts: Blocks of ``num_vectors * N_i`` rows.
        num_vectors: Vectors per sample.
    """

    def __init__(self, parts: list, num_vectors: int):
        self.parts, self.num_vectors = parts, num_vectors

    @functools.cached_property
    def rows(self) -> Tensor:
        """``B``, formed on first use."""
        return self._by_part(lambda p: p.rows)

    dtype = property(lambda self: self.parts[0].dtype)

    def _by_part(self, product: Callable[[DenseBlock], Tensor]) -> Tensor:
        """Row-wise results of the parts, rows in ``(v, n)`` order."""
        outs = [(o := product(p)).reshape(self.num_vectors, -1, *o.shape[1:])
                for p in self.parts]
        return torch.cat(outs, dim=1).flatten(0, 1)

    def _add_by_part(self, out: Tensor, product: Callable[[DenseBlock], Tensor]) -> Tensor:
        """Add the parts' row-wise results into their rows of ``out`` (no concatenation)."""
        rows, start = out.view(self.num_vectors, -1, out.shape[1]), 0
        for part in self.parts:
            stop = start + part.num_rows // self.num_vectors
            rows[:, start:stop] += product(part).view(self.num_vectors, stop - start, -1)
            start = stop
        return out

    def t_matmul(self, x: Tensor, out: Optional[Tensor] = None) -> Tensor:  # noqa: D102
        if out is not None:
            return self._add_by_part(out, lambda p: p.t_matmul(x))
        return self._by_part(lambda p: p.t_matmul(x))

    def t_matmul_khatri_rao(self, p: Tensor, q: Tensor,  # noqa: D102
                            out: Optional[Tensor] = None) -> Tensor:
        if out is not None:
            return self._add_by_part(out, lambda part: part.t_matmul_khatri_rao(p, q))
        return self._by_part(lambda part: part.t_matmul_khatri_rao(p, q))

    def row_sq_norms(self) -> Tensor:  # noqa: D102
        return self._by_part(lambda p: p.row_sq_norms())

    def diag_outer(self) -> Tensor:  # noqa: D102
        return sum(p.diag_outer() for p in self.parts)

    def matmul_add_(self, out: Tensor, y: Tensor) -> Tensor:  # noqa: D102
        ys = y.reshape(self.num_vectors, -1, y.shape[1]).split(
            [p.num_rows // self.num_vectors for p in self.parts], dim=1)
        for part, y_part in zip(self.parts, ys):
            part.matmul_add_(out, y_part.reshape(-1, y.shape[1]))
        return out
