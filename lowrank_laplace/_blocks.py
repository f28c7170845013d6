r"""Per-parameter blocks of a column-stacked matrix such as the GGN factor ``V``.

Each block stores the rows of :math:`V^{(i)\top}` that belong to one parameter
:math:`\theta^{(i)}`, i.e. it represents a matrix ``B`` of shape ``(M, d)`` whose
``M`` rows are the columns ``v_m`` of ``V`` restricted to that parameter.

Shape glossary:
    M: number of columns of ``V`` (``C * N`` for the exact GGN, ``mc_samples * N``
        for the Monte-Carlo GGN, ``N`` for per-sample gradients).
    d: number of entries of the parameter.
    K: number of vectors in a product.

Two representations exist:

* :class:`DenseBlock` holds ``B`` explicitly (``(M, d)``).
* :class:`KronBlock` exploits the structure of a linear layer's weight
  (``z_out = W z_in``): every row is ``vec(s_{vn} z_n^T)``, so only the
  backpropagated vectors ``s`` (``(V, N, out)``) and the layer inputs ``z``
  (``(N, in)``) are stored, never ``B`` itself (paper appendix, "Optimized Gram
  matrix computation for linear layers").
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

Weight = Union[float, Tensor]


def _stored_transposed(mat: Tensor) -> bool:
    """Whether a ``(d, K)`` matrix has unit stride down its columns.

    That is, whether it is a view of rows of a ``(K, D)`` tensor, as the sketch's test
    matrix and sketch are.
    """
    return mat.dim() == 2 and min(mat.shape) > 1 and mat.stride(0) == 1


def _symmetrized(square: Tensor) -> Tensor:
    """``(A + A^T) / 2``: exactly symmetric whatever the BLAS kernel produced."""
    return (square + square.T) / 2


#: ``B^T y`` is formed as ``(y^T B)^T`` for wide blocks (``d >= _WIDE``) with many rows
#: for few columns of ``y`` (``M >= 8 K``): reading the rows along ``d`` was 2.5x
#: faster for 3c3d's convolutions (``M = 1152``, ``d = 110592``, ``K = 10``: 38 vs 95
#: ms on 2 CPU cores). With few rows (a streaming merge of ResNet-18's ``M = 18``
#: against ``K = 120``) the transposed sum was 4x slower than the plain product.
_WIDE = 4096
#: Elements of the intermediate ``(rows, out or in, K)`` of an explicit block's product
#: with Khatri-Rao columns, per chunk of rows (2^18 to 2^24 measured within 10%).
_KHATRI_RAO_CHUNK = 2**22


class DenseBlock:
    """Explicit block ``B`` of shape ``(M, d)``.

    Args:
        rows: The block, shape ``(M, d)``.
    """

    def __init__(self, rows: Tensor):
        self.rows = rows

    @property
    def num_rows(self) -> int:
        """Number of rows ``M``."""
        return self.rows.shape[0]

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
        is one of the largest costs of an exact fit (~20% faster on CPU for
        ``M`` of a few hundred, ``d`` ~ 1e5).

        The result is exactly symmetric: a BLAS product ``A A^T`` need not be
        bitwise symmetric (e.g. MKL's AVX512 kernels), so each diagonal block is
        averaged with its transpose.
        """
        rows = self.rows
        num = rows.shape[0]
        parts = min(6, num // 64) if num >= 192 else 1  # 6 parts: 7% faster than 3 at M = 1152
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
        return torch.einsum("vnd,knd->nvk", rows * weight, rows)

    def row_sq_norms(self) -> Tensor:
        """Return the squared norm of every row, shape ``(M,)``.

        A reduction, not a squared copy of the block (an expanded convolution block
        is the largest tensor of a pass).
        """
        return torch.linalg.vector_norm(self.rows, dim=1).square()

    def diag_outer(self) -> Tensor:
        """Return the diagonal of ``B^T B`` (this parameter's GGN diagonal), ``(d,)``.

        Squares a few rows at a time (no squared copy of the block).
        """
        out = self.rows.new_zeros(self.rows.shape[1])
        for chunk in self.rows.split(64):
            out.add_((chunk * chunk).sum(0))
        return out

    def t_matmul(self, x: Tensor) -> Tensor:
        """Return ``B x`` (i.e. ``V^T x`` restricted to this parameter).

        Args:
            x: Tensor of shape ``(d, K)``.

        Returns:
            Tensor of shape ``(M, K)``.
        """
        return self.rows @ x

    def t_matmul_khatri_rao(self, p: Tensor, q: Tensor) -> Tensor:
        r"""Return ``B x`` for ``x`` of Khatri-Rao columns ``x_k = p_k \otimes q_k``.

        Row ``m`` of ``B`` as an ``out x in`` matrix ``B_m`` gives
        ``(B x)_{mk} = p_k^\top B_m q_k``. With fewer rows than ``max(out, in)`` the
        products ``B_m q_k`` (or ``B_m^\top p_k``) come first, in chunks of rows of
        ``_KHATRI_RAO_CHUNK`` intermediate elements, and ``x`` is never formed; with more,
        ``x`` is formed and multiplied (its ``out in K`` entries are then the smaller
        intermediate). Both take the multiply-adds of the explicit product (2 CPU
        cores, ``K = 120``: ``M = 320``, ``768 x 768``: 0.20 s against 0.24 s forming
        ``x``; ``M = 32``, ``3136 x 1024``: 0.15 s against 0.88 s).

        Args:
            p: Output factors, shape ``(K, out)``.
            q: Input factors, shape ``(K, in)``.

        Returns:
            Tensor of shape ``(M, K)``.
        """
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
        if self._read_along_d(y) and not _stored_transposed(out):
            return out.add_((y.T @ self.rows).T)
        return out.addmm_(self.rows.T, y)  # a transposed out gets wide K x d rows

    def _read_along_d(self, y: Tensor) -> bool:
        """Whether ``B^T y`` is faster as ``(y^T B)^T`` (see ``_WIDE``)."""
        return self.rows.shape[1] >= _WIDE and self.rows.shape[0] >= 8 * y.shape[1]


class KronBlock:
    """Linear-layer weight block with rows ``vec(s_{vn} z_n^T)`` (row-major, ``(v, n)``).

    Rows are ordered like BackPACK's columns of ``V``: vector-major, ``m = v N + n``.

    Args:
        s: Backpropagated vectors at the layer output, shape ``(V, N, out)``.
        z: Layer inputs, shape ``(N, in)``.
    """

    def __init__(self, s: Tensor, z: Tensor):
        self.s = s
        self.z = z

    @property
    def num_rows(self) -> int:
        """Number of rows ``M = V * N``."""
        return self.s.shape[0] * self.s.shape[1]

    def _flat_s(self) -> Tensor:
        return self.s.reshape(self.num_rows, self.s.shape[2])

    def to(self, dtype: torch.dtype) -> "KronBlock":
        """Return the block in ``dtype``, still factored (itself if it already is)."""
        if self.s.dtype == dtype and self.z.dtype == dtype:
            return self
        return KronBlock(self.s.to(dtype), self.z.to(dtype))

    def scale_(self, alpha: float) -> "KronBlock":
        """Scale the block in place.

        Args:
            alpha: Scalar factor.

        Returns:
            The block itself.
        """
        self.s = self.s * alpha
        return self

    def take_samples(self, start: int, stop: int, num_vectors: int) -> "KronBlock":
        """The rows of samples ``start:stop``, still factored (``s`` copied contiguous).

        Args:
            start: First sample.
            stop: One past the last sample.
            num_vectors: Vectors per sample (``s.shape[0]``).

        Returns:
            A block with ``num_vectors * (stop - start)`` rows.
        """
        return KronBlock(self.s[:, start:stop].contiguous(), self.z[start:stop])

    def to_dense(self) -> Tensor:
        """Return ``B`` explicitly, shape ``(M, out * in)``."""
        dense = self.s[:, :, :, None] * self.z[None, :, None, :]
        return dense.reshape(self.num_rows, -1)

    def gram(self) -> Tensor:
        """Return ``B B^T`` from two small Gram matrices, shape ``(M, M)``."""
        return self.cross(self)

    def cross(self, other: Block) -> Tensor:
        """Return ``B B'^T`` with another block of the same parameter.

        Args:
            other: Block with ``M'`` rows over the same parameter.

        Returns:
            Tensor of shape ``(M, M')``.
        """
        if not isinstance(other, KronBlock):
            return self.t_matmul(other.to_dense().T)
        (v, n), (v2, n2) = self.s.shape[:2], other.s.shape[:2]
        ss = (self._flat_s() @ other._flat_s().T).reshape(v, n, v2, n2)
        zz = self.z @ other.z.T
        return (ss * zz[None, :, None, :]).reshape(v * n, v2 * n2)

    def row_sq_norms(self) -> Tensor:
        """Return the squared norm of every row, shape ``(M,)``."""
        return ((self.s**2).sum(2) * (self.z**2).sum(1)[None]).flatten()

    def diag_outer(self) -> Tensor:
        """Return the diagonal of ``B^T B`` without expanding ``B``, ``(out * in,)``."""
        return torch.einsum("vno,ni->oi", self.s**2, self.z**2).flatten()

    def t_matmul(self, x: Tensor) -> Tensor:
        """Return ``B x`` without expanding ``B``.

        Args:
            x: Tensor of shape ``(out * in, K)``.

        Returns:
            Tensor of shape ``(M, K)``.
        """
        out_dim, in_dim = self.s.shape[2], self.z.shape[1]
        if _stored_transposed(x):
            # per column k: z (N, in) @ X_k^T (in, out), read along the rows of x^T;
            # the (K, N, out) result serves the per-sample product without a copy
            k, n = x.shape[1], self.z.shape[0]
            x_t = x.T.view(k, out_dim, in_dim)
            zx = torch.bmm(self.z.expand(k, n, in_dim), x_t.transpose(1, 2))
            res = torch.bmm(self.s.transpose(0, 1), zx.permute(1, 2, 0))  # (N, V, K)
            return res.transpose(0, 1).reshape(self.num_rows, -1)
        # per output unit o: z (N, in) @ X_o (in, K); X = x viewed as (out, in, K)
        zx = self.z @ x.reshape(out_dim, in_dim, -1)  # (out, N, K)
        # per sample n: s_n (V, out) @ zx_n (out, K)
        res = self.s.transpose(0, 1) @ zx.transpose(0, 1)  # (N, V, K)
        return res.transpose(0, 1).reshape(self.num_rows, -1)

    def t_matmul_khatri_rao(self, p: Tensor, q: Tensor) -> Tensor:
        r"""Return ``B x`` for ``x`` of Khatri-Rao columns ``x_k = p_k \otimes q_k``.

        Row ``(v, n)`` of ``B`` is ``s_{vn} \otimes z_n``, so
        ``(B x)_{vn,k} = (s_{vn}^\top p_k)(z_n^\top q_k)``: ``(V N out + N in) K``
        multiply-adds instead of ``N out in K``.

        Args:
            p: Output factors, shape ``(K, out)``.
            q: Input factors, shape ``(K, in)``.

        Returns:
            Tensor of shape ``(M, K)``.
        """
        if p.shape[1] != self.s.shape[2] or q.shape[1] != self.z.shape[1]:
            raise ValueError(
                f"Khatri-Rao factors of sizes {p.shape[1]} x {q.shape[1]} do not match "
                f"the block's {self.s.shape[2]} x {self.z.shape[1]}."
            )
        return ((self.s @ p.T) * (self.z @ q.T)).reshape(self.num_rows, -1)

    def matmul(self, y: Tensor) -> Tensor:
        """Return ``B^T y`` without expanding ``B``.

        Args:
            y: Tensor of shape ``(M, K)``.

        Returns:
            Tensor of shape ``(out * in, K)``.
        """
        out = y.new_zeros(self.s.shape[2] * self.z.shape[1], y.shape[1])
        return self.matmul_add_(out, y)

    def matmul_add_(self, out: Tensor, y: Tensor) -> Tensor:
        """Accumulate ``out += B^T y`` in place, without expanding ``B``.

        Args:
            out: Tensor of shape ``(out * in, K)``, contiguous or a view of rows of a
                contiguous ``(K, D)`` tensor.
            y: Tensor of shape ``(M, K)``.

        Returns:
            ``out``.
        """
        v, n = self.s.shape[:2]
        out_dim, in_dim = self.s.shape[2], self.z.shape[1]
        if _stored_transposed(out):
            # per column k: out^T_k (out, in) += acc_k (out, N) @ z (N, in), written
            # along the rows of out^T (per output unit, the strided rows cost 2x)
            k = y.shape[1]
            acc = torch.bmm(y.reshape(v, n, k).permute(1, 2, 0), self.s.transpose(0, 1))
            out.T.view(k, out_dim, in_dim).baddbmm_(acc.permute(1, 2, 0),
                                                    self.z.expand(k, n, in_dim))
            return out
        acc = self.s.permute(1, 2, 0) @ y.reshape(v, n, -1).transpose(0, 1)  # (N, out, K)
        view = out.view(out_dim, in_dim, -1)
        if n < 512:
            # per output unit o: z^T (in, N) @ acc_o (N, K) added into the (out, in, K)
            # view; in place it is ~3x faster than forming the product and adding
            view.baddbmm_(self.z.T.expand(out_dim, in_dim, n), acc.transpose(0, 1))
            return out
        # many samples: one wide product per slab of 16 output units (~1.5x faster)
        for start in range(0, out_dim, 16):
            slab = acc[:, start : start + 16].reshape(n, -1)
            prod = (self.z.T @ slab).view(in_dim, -1, view.shape[2])
            view[start : start + 16].add_(prod.transpose(0, 1))
        return out

    def weighted_gram(self, weight: Weight) -> Tensor:
        """Return ``B diag(w) B^T``, shape ``(M, M)``.

        Args:
            weight: Scalar or per-entry weights ``(d,)`` (both keep the factored form).

        Returns:
            The weighted Gram matrix.
        """
        if isinstance(weight, Tensor) and weight.numel() > 1:
            w = weight.reshape(self.s.shape[2], self.z.shape[1])  # (out, in)
            zz = torch.einsum("ni,pi,oi->npo", self.z, self.z, w)
            v, n = self.s.shape[:2]
            return torch.einsum("vno,kpo,npo->vnkp", self.s, self.s, zz).reshape(v * n, v * n)
        return self.gram() * weight

    def sample_gram(self, num_vectors: int, weight: Weight = 1.0) -> Tensor:
        """Per-sample diagonal blocks of ``B diag(w) B^T``.

        Args:
            num_vectors: Vectors per sample ``V`` (must match the block's layout).
            weight: Scalar or per-entry weights ``(d,)`` (both keep the factored form).

        Returns:
            Tensor of shape ``(N, V, V)``.
        """
        if isinstance(weight, Tensor) and weight.numel() > 1:
            w = weight.reshape(self.s.shape[2], self.z.shape[1])  # (out, in)
            a = (self.z**2) @ w.T  # (N, out)
            return torch.einsum("vno,kno,no->nvk", self.s, self.s, a)
        zz = (self.z**2).sum(1)
        return torch.einsum("vno,kno->nvk", self.s, self.s) * (zz * weight)[:, None, None]


Block = Union[DenseBlock, KronBlock]


def cat_blocks(blocks: list, alphas: list, num_vectors: int) -> Block:
    """Concatenate blocks of the same parameter along the sample axis, scaled.

    The result keeps the row order ``(v, n)`` over the concatenated samples and
    stays factored when every block is a :class:`KronBlock`.

    Args:
        blocks: Blocks over the same parameter, each with ``num_vectors * N_i`` rows.
        alphas: One scalar factor per block.
        num_vectors: Vectors per sample ``V``.

    Returns:
        A block with ``num_vectors * sum(N_i)`` rows.
    """
    if all(isinstance(b, KronBlock) for b in blocks):
        s = torch.cat([b.s if a == 1 else b.s * a for b, a in zip(blocks, alphas)], dim=1)
        return KronBlock(s, torch.cat([b.z for b in blocks], dim=0))
    rows = [b.to_dense() if a == 1 else b.to_dense() * a for b, a in zip(blocks, alphas)]
    rows = [r.reshape(num_vectors, -1, r.shape[1]) for r in rows]
    return DenseBlock(torch.cat(rows, dim=1).reshape(-1, rows[0].shape[2]))
