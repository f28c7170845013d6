"""Gram matrices and products of ``V`` in float64, from blocks of lower precision.

Each block is widened a slice at a time, so no float64 copy of a whole block or of a
``D x K`` matrix is made (why: docs/concepts.md). Shapes: ``M`` rows of a block,
``d`` entries of its parameter, ``K`` columns of a product.
"""

from __future__ import annotations

from typing import Iterator, Tuple, Union

import torch
from torch import Tensor

from lowrank_laplace.factor import weights
from lowrank_laplace.factor.dense_block import DenseBlock
from lowrank_laplace.factor.kron_block import KronBlock

#: The dtype of the products.
WIDE = torch.float64


def widen(block: Union[DenseBlock, KronBlock]) -> Union[DenseBlock, KronBlock]:
    """A factored block in float64 (small factors, widened once per merge); a dense one as is."""
    return block.to(WIDE) if isinstance(block, KronBlock) else block


def wide_gram(block: Union[DenseBlock, KronBlock]) -> Tensor:
    """Return ``B B^T`` ``(M, M)`` of a block in float64, exactly symmetric."""
    if isinstance(block, KronBlock):
        gram = block.to(WIDE).gram()
        return (gram + gram.T) / 2
    rows = block.rows
    if rows.dtype == WIDE:
        return block.gram()
    gram = 0
    step = max(1, weights.WIDE_ENTRIES // max(rows.shape[0], 1))
    for lo in range(0, rows.shape[1], step):
        part = rows[:, lo:lo + step].to(WIDE)
        gram = gram + part @ part.T
    return (gram + gram.T) / 2


def wide_t_matmul(block: Union[DenseBlock, KronBlock], x: Tensor) -> Tensor:
    """Return ``B x`` ``(M, K)`` in float64 for ``x`` ``(d, K)`` of any floating dtype."""
    if isinstance(block, KronBlock) or block.rows.dtype != WIDE:
        return sum(sub.t_matmul(x[lo:hi].to(WIDE))
                   for lo, hi, sub in wide_slices(block, x.shape[1]))
    return block.rows @ x.to(WIDE)


def wide_slices(block: Union[DenseBlock, KronBlock], width: int
                ) -> Iterator[Tuple[int, int, Union[DenseBlock, KronBlock]]]:
    """Return ``block.wide_slices(width)`` (see ``Block.wide_slices``)."""
    return block.wide_slices(width)
