r"""Gram matrices and products of ``V`` in float64, from blocks of lower precision.

A float32 Gram matrix ``V^T V`` (or cross product ``V^T U``) is rounded at about
``eps lambda_max``, so its eigenvalues below that are noise, although the float32
factor ``V`` itself determines them far more finely (an eigenvalue ``mu`` moves by
about ``eps sqrt(mu lambda_max)`` when ``V`` is rounded). The fit's eigenproblems are
small, so their inputs are formed here in float64: each block is widened a slice at a
time (a dense block by columns, a factored linear block by output units), so no
float64 copy of a whole block or of the ``D x K`` matrix is made. For float64 blocks
these are the ordinary products.

Shape glossary:
    M: rows of a block (columns of ``V``); d: entries of the parameter; K: columns of
    a product.
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
    """A factored block in float64 (its factors are small); a dense block as it is.

    Widen a factor's blocks once for all of a merge's products: a dense block is
    widened a slice at a time by each product instead.
    """
    return block.to(WIDE) if isinstance(block, KronBlock) else block


def wide_gram(block: Union[DenseBlock, KronBlock]) -> Tensor:
    """``B B^T`` in float64, shape ``(M, M)``, exactly symmetric.

    Args:
        block: A dense or factored block.

    Returns:
        The Gram matrix.
    """
    if isinstance(block, KronBlock):
        gram = block.to(WIDE).gram()
        return (gram + gram.T) / 2
    rows = block.rows
    if rows.dtype == WIDE:
        return block.gram()
    gram = 0
    step = max(1, weights.WIDE_ENTRIES // max(rows.shape[0], 1))
    for lo, hi in _ranges(rows.shape[1], step):
        part = rows[:, lo:hi].to(WIDE)
        gram = gram + part @ part.T
    return (gram + gram.T) / 2


def wide_t_matmul(block: Union[DenseBlock, KronBlock], x: Tensor) -> Tensor:
    """``B x`` in float64, shape ``(M, K)``, for ``x`` of shape ``(d, K)``.

    Args:
        block: A dense or factored block.
        x: The matrix (any floating dtype).

    Returns:
        The product.
    """
    if isinstance(block, KronBlock) or block.rows.dtype != WIDE:
        return sum(sub.t_matmul(x[lo:hi].to(WIDE))
                   for lo, hi, sub in wide_slices(block, x.shape[1]))
    return block.rows @ x.to(WIDE)


def wide_slices(block: Union[DenseBlock, KronBlock], width: int
                ) -> Iterator[Tuple[int, int, Union[DenseBlock, KronBlock]]]:
    """The block over slices of its parameter's entries, in float64.

    A factored block is sliced by output units (its entries are ordered
    ``(out, in)``), a dense one by columns, each slice small enough that it and a
    ``(slice, width)`` float64 matrix stay near
    :data:`~lowrank_laplace.factor.weights.WIDE_ENTRIES` entries.

    Args:
        block: A dense or factored block.
        width: Columns of the matrices the slices will be multiplied with.

    Yields:
        ``(lo, hi, sub)``: entries ``lo:hi`` of the parameter and the float64 block
        over them.
    """
    if isinstance(block, KronBlock):
        wide = block.to(WIDE)
        in_dim = wide.z.shape[1]
        step = max(1, weights.WIDE_ENTRIES // max(in_dim * width, 1))
        for lo, hi in _ranges(wide.s.shape[2], step):
            yield lo * in_dim, hi * in_dim, KronBlock(wide.s[:, :, lo:hi], wide.z)
        return
    rows = block.rows
    step = max(1, weights.WIDE_ENTRIES // max(rows.shape[0] + width, 1))
    for lo, hi in _ranges(rows.shape[1], step):
        yield lo, hi, DenseBlock(rows[:, lo:hi].to(WIDE))


def _ranges(total: int, step: int) -> Iterator[Tuple[int, int]]:
    """``(lo, hi)`` of consecutive ranges of ``step`` covering ``range(total)``."""
    for lo in range(0, total, step):
        yield lo, min(lo + step, total)
