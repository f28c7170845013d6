r"""The exact solver: ``H = sum_b V_b V_b^T`` dense in float64, eigendecomposed at the end."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lowrank_laplace.factor import weights
from lowrank_laplace.factor.wide import WIDE
from lowrank_laplace.fitting.base import Solver
from lowrank_laplace.utils.linalg import top_eigh


class DenseSum(Solver):
    """Sums the GGN densely and keeps its leading eigenpairs (exact; arguments as ``Solver``)."""

    path = "dense"

    def __init__(self, rank: int, oversampling: int = 0, track_diagonal: bool = False):
        super().__init__(rank, oversampling, track_diagonal)
        self._dense: Optional[Tensor] = None  # (D, D) float64 sum until finalised

    def _add(self, V: Tensor, scale: float) -> Tensor:
        """Add ``scale * V V^T`` in float64, a slice of columns at a time; its trace."""
        if self._vectors is not None:
            raise RuntimeError("DenseSum: the sum was already eigendecomposed.")
        if self._dense is None:
            self._dense = V.new_zeros(V.shape[0], V.shape[0], dtype=WIDE)
            self._dtype = V.dtype
        trace = V.new_zeros((), dtype=WIDE)
        for cols in V.split(max(1, weights.WIDE_ENTRIES // max(V.shape[0], 1)), dim=1):
            cols = cols.to(WIDE)
            self._dense.addmm_(cols, cols.T, alpha=scale)
            trace = trace + scale * (cols * cols).sum()
        return trace

    def add_factor(self, factor: Any, group: int = 0, scale: float = 1.0) -> None:
        """:meth:`Solver.add_factor`; a recomputed factor's ``V`` comes from ``V I``."""
        self.num_merges += 1
        if factor.recomputed:  # no blocks kept: V from its products with the identity
            like = factor.trace(group)  # the factor's dtype and device
            eye = torch.eye(factor.num_columns, dtype=like.dtype, device=like.device)
            self.add_trace_and_diagonal(self._add(factor.matmul(eye, group), scale), None)
            return
        # V expanded from its blocks a slice of samples at a time, not as V I_M
        samples = factor.num_curv_samples
        step = max(1, weights.WIDE_ENTRIES // max(factor.group_dim(group) * factor.num_vectors, 1))
        trace = factor.trace(group).new_zeros((), dtype=WIDE)
        for start in range(0, samples, step):
            part = factor if step >= samples else factor.take_samples(
                start, min(samples, start + step))
            rows = torch.cat([block.to_dense() for block in part.group_blocks(group)], dim=1)
            trace = trace + self._add(rows.T, scale)
        self.add_trace_and_diagonal(trace, None)

    def add_lowrank(self, eigenvectors: Tensor, eigenvalues: Tensor, trace: Tensor,
                    diagonal: Optional[Tensor] = None) -> None:
        """:meth:`Solver.add_lowrank`, exact; the other's dropped part is lost."""
        self.num_merges += 1
        self.add_trace_and_diagonal(trace, None)
        self._add(eigenvectors * eigenvalues.sqrt(), 1.0)

    def merge_across(self, group: Any) -> None:
        """Sum the dense matrices and traces of all processes of ``group`` (exact)."""
        self.sum_trace_across(group, self._dense)
        self._finalize()

    def _finalize(self) -> None:
        """Replace the accumulated ``D x D`` sum by its leading eigenpairs."""
        if self._dense is None:
            return
        H, self._dense = self._dense, None
        if self.track_diagonal:
            self.diagonal = H.diagonal().to(self._dtype)
        evals, vectors = top_eigh(H, self.keep, self._dtype)
        del H
        self._vectors = vectors.to(self._dtype)
        self.keep_eigenvalues(evals, self._dtype)
