"""Per-parameter blocks ``B`` (``(M, d)``) of ``V^T``: rows are ``V``'s columns on a parameter.

:class:`DenseBlock` holds ``B``; :class:`KronBlock` keeps a linear weight's rows
``vec(s_{vn} z_n^T)`` as the factors ``s`` and ``z``. Shapes: ``M`` columns of ``V``
(``C N`` exact, ``mc_samples N``, ``N`` for gradients); ``d`` entries of the
parameter; ``K`` vectors in a product.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Protocol, Tuple

import torch
from torch import Tensor

from lowrank_laplace.factor.dense_block import DenseBlock, SampleConcat
from lowrank_laplace.factor.kron_block import KronBlock
from lowrank_laplace.factor.weights import Weight


class Block(Protocol):
    """What every block offers: consumers outside :mod:`lowrank_laplace.factor` use only this.

    :class:`DenseBlock` and :class:`KronBlock` document their methods here. An operand of
    another dtype (blocks of several dtypes) is multiplied in the wider of the two.
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
        """Yield ``(B_s, B_s diag(w_s) U_s, w_s)`` for float64 parts ``B_s`` of the block.

        ``U`` is ``(d, r)``, ``weight`` the parameter's (scalar or ``(d,)``). Each part and its
        widened rows of ``U`` stay near ``WIDE_ENTRIES`` entries.
        """

    def wide_slices(self, width: int) -> Iterator[Tuple[int, int, "Block"]]:
        """Yield ``(lo, hi, sub)``: the block in float64 on entries ``lo:hi``, slice by slice.

        Factored blocks are sliced by output units; a slice and a ``(slice, width)`` float64
        matrix (``width``: the columns it will be multiplied with) stay near ``WIDE_ENTRIES``.
        """

    def to(self, dtype: torch.dtype) -> "Block":
        """The block in ``dtype`` (itself if it already is)."""

    def scale_(self, alpha: float) -> "Block":
        """Scale the block in place by a scalar ``alpha`` and return it."""

    def to_dense(self) -> Tensor:
        """``B``, ``(M, d)``."""

    def take_samples(self, start: int, stop: int, num_vectors: int) -> "Block":
        """Return the rows ``(v, n)`` of samples ``start:stop`` (``num_vectors`` per sample)."""

    def gram(self) -> Tensor:
        """``B B^T``, ``(M, M)``."""

    def cross(self, other: "Block") -> Tensor:
        """Return ``B B'^T`` ``(M, M')`` with another block (``M'`` rows) of the same parameter."""

    def weighted_gram(self, weight: Weight) -> Tensor:
        """Return ``B diag(w) B^T``, ``(M, M)``, for a ``weight`` scalar or ``(d,)``."""

    def sample_gram(self, num_vectors: int, weight: Weight = 1.0) -> Tensor:
        """Return the per-sample diagonal blocks ``(N, V, V)`` of ``B diag(w) B^T``.

        ``num_vectors`` is ``V`` (``M = V N``), ``weight`` a scalar or ``(d,)``.
        """

    def row_sq_norms(self) -> Tensor:
        """Squared norms of the rows, ``(M,)``."""

    def diag_outer(self) -> Tensor:
        """``diag(B^T B)`` (the parameter's GGN diagonal), ``(d,)``."""

    def t_matmul(self, x: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """Return ``B x`` ``(M, K)`` (``V^T x`` on this parameter) for ``x`` ``(d, K)``.

        ``out``: add the product into this ``(M, K)`` tensor in place and return it (no
        ``M x K`` temporary where the block can avoid one).
        """

    def t_matmul_khatri_rao(self, p: Tensor, q: Tensor, out: Optional[Tensor] = None
                            ) -> Tensor:
        r"""Return ``B x`` ``(M, K)`` for ``x`` of Khatri-Rao columns ``x_k = p_k \otimes q_k``.

        Args:
            p: Output factors ``(K, out)``.
            q: Input factors ``(K, in)``.
            out: As for :meth:`t_matmul`.

        Raises:
            ValueError: If the factors' sizes do not match the parameter's.
        """

    def matmul(self, y: Tensor) -> Tensor:
        """Return ``B^T y`` ``(d, K)`` (``V y`` on this parameter) for ``y`` ``(M, K)``."""

    def matmul_add_(self, out: Tensor, y: Tensor) -> Tensor:
        """Add ``B^T y`` (``y`` ``(M, K)``) into ``out`` ``(d, K)`` in place and return ``out``."""


def cat_blocks(blocks: List[Block], alphas: list, num_vectors: int) -> Block:
    """Return scaled blocks of one parameter concatenated along the samples, rows ``(v, n)``.

    Factored if all blocks are.

    Args:
        blocks: Blocks, each with ``num_vectors * N_i`` rows.
        alphas: One scalar factor per block.
        num_vectors: Vectors per sample.
    """
    if all(isinstance(b, KronBlock) for b in blocks):
        s = torch.cat([b.s if a == 1 else b.s * a for b, a in zip(blocks, alphas)], dim=1)
        return KronBlock(s, torch.cat([b.z for b in blocks], dim=0))
    return SampleConcat([b if a == 1 and not b.factored else DenseBlock(b.to_dense() * a)
                         for b, a in zip(blocks, alphas)], num_vectors)
