r"""The exact solver: ``H = sum_b V_b V_b^T`` summed as a dense ``D x D`` matrix.

Taken by the fit's plan where the ``D x D`` sum and its eigendecomposition fit the
memory budget and are cheaper than streaming, or where the parameters are few (a last
layer) and streaming would truncate. One eigendecomposition at the end.

Shape glossary:
    D: parameters; k: eigenpairs kept.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lowrank_laplace.fitting.base import Solver
from lowrank_laplace.utils.linalg import top_eigh


class DenseSum(Solver):
    """Sums the GGN densely and keeps its leading eigenpairs (exact, no truncation).

    Args:
        rank: Number of eigenpairs kept in the end (``r >= 1``).
        oversampling: Extra eigenpairs kept (``p >= 0``).
        track_diagonal: Keep the exact diagonal of the sum.
    """

    solver = "dense"

    def __init__(self, rank: int, oversampling: int = 0, track_diagonal: bool = False):
        super().__init__(rank, oversampling, track_diagonal)
        self._dense: Optional[Tensor] = None  # (D, D) sum until finalised
        self._vectors: Optional[Tensor] = None

    @property
    def eigenvectors(self) -> Optional[Tensor]:
        """The leading eigenvectors of the sum, ``(D, k)`` (formed on first read)."""
        self._finalize()
        return self._vectors

    def _add(self, V: Tensor, scale: float) -> None:
        if self._vectors is not None:
            raise RuntimeError("DenseSum: the sum was already eigendecomposed.")
        if self._dense is None:
            self._dense = V.new_zeros(V.shape[0], V.shape[0])
        self._dense.addmm_(V, V.T, alpha=scale)

    def add_factor(self, factor: Any, group: int = 0, scale: float = 1.0) -> None:
        """Add ``scale * V V^T`` of one group (the diagonal comes from the sum).

        Args:
            factor: Batch factor (``V y`` products are all it needs).
            group: Group index.
            scale: Non-negative factor applied to the batch's GGN.
        """
        self.num_merges += 1
        trace = factor.trace(group) * scale
        self.add_trace_and_diagonal(trace, None)
        eye = torch.eye(factor.num_columns, dtype=trace.dtype, device=trace.device)
        self._add(factor.matmul(eye, group), scale)

    def add_lowrank(self, eigenvectors: Tensor, eigenvalues: Tensor, trace: Tensor,
                    diagonal: Optional[Tensor] = None) -> None:
        """Add ``U diag(lambda) U^T`` to the sum (exact).

        Args:
            eigenvectors: Orthonormal vectors, shape ``(D, k)``.
            eigenvalues: Non-negative eigenvalues, shape ``(k,)``.
            trace: The exact trace of the other curvature (its dropped part is lost).
            diagonal: Unused: the diagonal comes from the sum.
        """
        self.num_merges += 1
        self.add_trace_and_diagonal(trace, None)
        self._add(eigenvectors * eigenvalues.sqrt(), 1.0)

    def merge_across(self, group: Any) -> None:
        """Sum the dense matrices and traces of all processes of a group (exact).

        Args:
            group: The process group.
        """
        import torch.distributed as dist

        dist.all_reduce(self._dense, group=group)
        self.sum_trace_across(group)
        self._finalize()

    def _finalize(self) -> None:
        """Replace the accumulated ``D x D`` sum by its leading eigenpairs."""
        if self._dense is None:
            return
        H, self._dense = self._dense, None
        if self.track_diagonal:
            self.diagonal = H.diagonal().clone()
        self.eigenvalues, self._vectors = top_eigh(H, self.keep)
