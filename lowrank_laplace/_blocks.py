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
  (``z_out = W z_in``): every row is ``vec(s_m z_{n(m)}^T)``, so only the
  backpropagated vectors ``s`` (``(M, out)``) and the layer inputs ``z``
  (``(N, in)``) are stored, never ``B`` itself (paper appendix, "Optimized Gram
  matrix computation for linear layers").
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

Weight = Union[float, Tensor]


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

    def gram(self) -> Tensor:
        """Return ``B B^T``, shape ``(M, M)``."""
        return self.rows @ self.rows.T

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
        """Return the squared norm of every row, shape ``(M,)``."""
        return (self.rows**2).sum(1)

    def t_matmul(self, x: Tensor) -> Tensor:
        """Return ``B x`` (i.e. ``V^T x`` restricted to this parameter).

        Args:
            x: Tensor of shape ``(d, K)``.

        Returns:
            Tensor of shape ``(M, K)``.
        """
        return self.rows @ x

    def matmul(self, y: Tensor) -> Tensor:
        """Return ``B^T y`` (i.e. ``V y`` restricted to this parameter).

        Args:
            y: Tensor of shape ``(M, K)``.

        Returns:
            Tensor of shape ``(d, K)``.
        """
        return self.rows.T @ y


class KronBlock:
    """Linear-layer weight block with rows ``vec(s_m z_{idx[m]}^T)`` (row-major).

    Args:
        s: Backpropagated vectors at the layer output, shape ``(M, out)``.
        z: Layer inputs, shape ``(N, in)``.
        idx: Sample index of each row, shape ``(M,)`` (long).
    """

    def __init__(self, s: Tensor, z: Tensor, idx: Tensor):
        self.s = s
        self.z = z
        self.idx = idx

    @property
    def num_rows(self) -> int:
        """Number of rows ``M``."""
        return self.s.shape[0]

    def scale_(self, alpha: float) -> "KronBlock":
        """Scale the block in place.

        Args:
            alpha: Scalar factor.

        Returns:
            The block itself.
        """
        self.s = self.s * alpha
        return self

    def to_dense(self) -> Tensor:
        """Return ``B`` explicitly, shape ``(M, out * in)``."""
        zs = self.z[self.idx]
        return (self.s[:, :, None] * zs[:, None, :]).flatten(start_dim=1)

    def gram(self) -> Tensor:
        """Return ``B B^T`` from two small Gram matrices, shape ``(M, M)``."""
        zz = self.z @ self.z.T
        return (self.s @ self.s.T) * zz[self.idx][:, self.idx]

    def cross(self, other: Block) -> Tensor:
        """Return ``B B'^T`` with another block of the same parameter.

        Args:
            other: Block with ``M'`` rows over the same parameter.

        Returns:
            Tensor of shape ``(M, M')``.
        """
        if isinstance(other, KronBlock):
            zz = self.z @ other.z.T
            return (self.s @ other.s.T) * zz[self.idx][:, other.idx]
        return self.t_matmul(other.to_dense().T)

    def row_sq_norms(self) -> Tensor:
        """Return the squared norm of every row, shape ``(M,)``."""
        return (self.s**2).sum(1) * (self.z**2).sum(1)[self.idx]

    def weighted_gram(self, weight: Weight) -> Tensor:
        """Return ``B diag(w) B^T``, shape ``(M, M)``.

        Args:
            weight: Scalar (keeps the factored form) or per-entry weights ``(d,)``
                (expands the block).

        Returns:
            The weighted Gram matrix.
        """
        if isinstance(weight, Tensor) and weight.numel() > 1:
            return DenseBlock(self.to_dense()).weighted_gram(weight)
        return self.gram() * weight

    def sample_gram(self, num_vectors: int, weight: Weight = 1.0) -> Tensor:
        """Per-sample diagonal blocks of ``B diag(w) B^T`` for rows ordered ``(v, n)``.

        Args:
            num_vectors: Vectors per sample ``V`` (``M = V * N``, ``idx[m] = m % N``).
            weight: Scalar (keeps the factored form) or per-entry weights ``(d,)``.

        Returns:
            Tensor of shape ``(N, V, V)``.
        """
        if isinstance(weight, Tensor) and weight.numel() > 1:
            return DenseBlock(self.to_dense()).sample_gram(num_vectors, weight)
        s = self.s.reshape(num_vectors, -1, self.s.shape[1])
        zz = (self.z[self.idx[: s.shape[1]]] ** 2).sum(1)
        return torch.einsum("vno,kno->nvk", s, s) * (zz * weight)[:, None, None]

    def t_matmul(self, x: Tensor) -> Tensor:
        """Return ``B x`` without expanding ``B``.

        Args:
            x: Tensor of shape ``(out * in, K)``.

        Returns:
            Tensor of shape ``(M, K)``.
        """
        out_dim, in_dim = self.s.shape[1], self.z.shape[1]
        x = x.T.reshape(-1, out_dim, in_dim)  # (K, out, in)
        xz = x @ self.z.T  # (K, out, N)
        return (xz[:, :, self.idx] * self.s.T[None]).sum(1).T

    def matmul(self, y: Tensor) -> Tensor:
        """Return ``B^T y`` without expanding ``B``.

        Args:
            y: Tensor of shape ``(M, K)``.

        Returns:
            Tensor of shape ``(out * in, K)``.
        """
        num_samples = self.z.shape[0]
        # sum rows that share a sample first: (K, N, out), then contract with z
        ys = y.T[:, :, None] * self.s[None]  # (K, M, out)
        acc = ys.new_zeros(y.shape[1], num_samples, self.s.shape[1])
        acc.index_add_(1, self.idx, ys)
        return (acc.transpose(1, 2) @ self.z).flatten(start_dim=1).T


Block = Union[DenseBlock, KronBlock]
