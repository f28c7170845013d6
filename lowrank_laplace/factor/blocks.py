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

from typing import Iterator, List, Protocol, Tuple

import torch
from torch import Tensor

from lowrank_laplace.factor.dense_block import DenseBlock
from lowrank_laplace.factor.kron_block import KronBlock
from lowrank_laplace.factor.weights import Weight


class Block(Protocol):
    """What every block of ``V`` offers (:class:`DenseBlock`, :class:`KronBlock`).

    Consumers outside :mod:`lowrank_laplace.factor` use these methods only: a new kind
    of block implements them, and nothing else changes.
    """

    #: Kept as factors: concatenated products of several blocks are cheap
    #: (:func:`cat_blocks`); such blocks also offer ``num_vectors`` and ``num_samples``.
    factored: bool

    @property
    def num_rows(self) -> int:
        """Rows ``M``."""

    @property
    def dtype(self) -> torch.dtype:
        """The block's dtype."""

    @property
    def nbytes(self) -> int:
        """Bytes the block holds."""

    def wide_parts(self, U: Tensor, weight: Weight) -> Iterator[Tuple["Block", Tensor,
                                                                     Weight]]:
        """Float64 parts of the block with their products ``B_s diag(w_s) U_s``."""

    def to_dense(self) -> Tensor:
        """``B``, ``(M, d)``."""

    def gram(self) -> Tensor:
        """``B B^T``, ``(M, M)``."""

    def cross(self, other: "Block") -> Tensor:
        """``B B'^T`` with another block of the same parameter."""

    def row_sq_norms(self) -> Tensor:
        """Squared norms of the rows, ``(M,)``."""

    def diag_outer(self) -> Tensor:
        """``diag(B^T B)``, ``(d,)``."""

    def t_matmul(self, x: Tensor) -> Tensor:
        """``B x`` for ``x`` of shape ``(d, K)``."""

    def matmul(self, y: Tensor) -> Tensor:
        """``B^T y`` for ``y`` of shape ``(M, K)``."""

    def matmul_add_(self, out: Tensor, y: Tensor) -> Tensor:
        """``out += B^T y`` in place."""

    def take_samples(self, start: int, stop: int, num_vectors: int) -> "Block":
        """The rows of samples ``start:stop``."""


def cat_blocks(blocks: List[Block], alphas: list, num_vectors: int) -> Block:
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
