"""Products ``B diag(w) U`` of a block under a diagonal weight (prior variances), in float64.

Blocks widen a slice of entries at a time (``Block.wide_parts``); these helpers weight
the matching rows of ``U``. Shapes: ``M`` rows of a block, ``d`` entries of the
parameter, ``r`` columns of ``U``.
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
    """Return the weights ``w`` of the entries ``params`` in float64 (a scalar whole)."""
    if not isinstance(w, Tensor):
        return w
    return (w[params] if w.numel() > 1 else w).to(SMALL_DTYPE)


def weighted_product(block: Any, U: Tensor, w: Weight, params: slice) -> Tensor:
    """Return ``B diag(w) U_s`` ``(M, r)`` in float64 for a float64 block over the rows ``params``.

    ``U`` ``(d, r)`` and ``w`` cover all of the parameter's entries.
    """
    w_s = weight_slice(w, params)
    U_s = U[params].to(SMALL_DTYPE)
    if isinstance(w_s, Tensor) and w_s.numel() > 1:
        return block.t_matmul(U_s * w_s[:, None])
    return block.t_matmul(U_s) * w_s
