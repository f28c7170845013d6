"""Products of a block with a matrix under a diagonal weight, in float64 slices.

The GLM predictive forms ``B P_0^{-1} U`` block by block (``P_0^{-1}`` the prior
variances, a scalar or one per parameter entry): a block widens itself to float64 a
slice of its parameter's entries at a time (:meth:`DenseBlock.wide_parts`,
:meth:`KronBlock.wide_parts`), and these helpers weight the matching rows of ``U``.

Shape glossary:
    M: rows of a block; d: entries of the parameter; r: columns of ``U``.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import Tensor

#: A scalar or per-entry weight of a parameter.
Weight = Union[float, Tensor]
#: The dtype of the products.
SMALL_DTYPE = torch.float64
#: Float64 entries of a widened slice of a block or of ``U`` (32 MiB).
WIDE_ENTRIES = 2**22


def weight_slice(w: Weight, params: slice) -> Weight:
    """The weights of the entries ``params`` in float64 (a scalar whole).

    Args:
        w: A scalar or per-entry weight.
        params: The entries.

    Returns:
        Their weight.
    """
    if not isinstance(w, Tensor):
        return w
    return (w[params] if w.numel() > 1 else w).to(SMALL_DTYPE)


def weighted_product(block: Any, U: Tensor, w: Weight, params: slice) -> Tensor:
    """``B diag(w) U_s`` in float64 for the rows ``params`` of ``U`` (``B`` float64).

    A per-entry weight scales the rows of ``U_s`` before the product, a scalar one the
    product's columns after it.

    Args:
        block: A float64 block over the entries ``params``.
        U: Shape ``(d, r)`` (all of the parameter's entries).
        w: The parameter's weight.
        params: The entries of the block.

    Returns:
        Shape ``(M, r)``.
    """
    w_s = weight_slice(w, params)
    U_s = U[params].to(SMALL_DTYPE)
    if isinstance(w_s, Tensor) and w_s.numel() > 1:
        return block.t_matmul(U_s * w_s[:, None])
    return block.t_matmul(U_s) * w_s
