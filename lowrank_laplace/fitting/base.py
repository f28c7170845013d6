r"""What every solver of a fit shares: ``H = sum_b V_b V_b^T`` as its leading eigenpairs.

A solver receives the micro-batch factors of a fit (:meth:`Solver.add_factor`),
truncated eigendecompositions (:meth:`Solver.add_lowrank`, online updates and other
processes) and returns the leading ``rank`` eigenpairs with the exact trace and, if
tracked, the diagonal of the dropped curvature (:meth:`Solver.result`). The siblings:
:class:`~lowrank_laplace.fitting.dense.DenseSum` (exact ``D x D`` sum),
:class:`~lowrank_laplace.fitting.streaming.StreamingMerge` (truncated merges) and
:class:`~lowrank_laplace.fitting.sketch.SketchMerge` (one-pass Nyström sketch).

Shape glossary:
    D: parameters; r: kept rank; k: eigenpairs kept while fitting (r + oversampling).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from torch import Tensor


class Solver:
    """The common state and contract of the fit's solvers.

    Args:
        rank: Number of eigenpairs kept in the end (``r >= 1``).
        oversampling: Extra eigenpairs (or sketch columns) kept while fitting
            (``p >= 0``).
        track_diagonal: Also accumulate the exact diagonal of the sum (for the
            residual diagonal of :meth:`result`).

    Raises:
        ValueError: For ``rank < 1`` or negative oversampling.
    """

    #: The fit path this solver takes (``FitPlan.path``).
    solver = ""

    def __init__(self, rank: int, oversampling: int = 0, track_diagonal: bool = False):
        if isinstance(rank, bool) or int(rank) != rank or rank < 1:
            raise ValueError(f"rank must be a positive integer, got {rank!r}.")
        if isinstance(oversampling, bool) or int(oversampling) != oversampling or oversampling < 0:
            raise ValueError(f"oversampling must be a non-negative integer, got {oversampling!r}.")
        self.rank = int(rank)
        self.oversampling = int(oversampling)
        self.track_diagonal = track_diagonal
        self.eigenvalues: Optional[Tensor] = None  # (k,)
        self.trace: Optional[Tensor] = None
        self.diagonal: Optional[Tensor] = None  # exact diagonal of the merged sum
        self.num_merges = 0

    @property
    def keep(self) -> int:
        """Eigenpairs (or sketch columns) kept while fitting, ``rank + oversampling``."""
        return self.rank + self.oversampling

    @property
    def eigenvectors(self) -> Optional[Tensor]:
        """The kept orthonormal eigenvectors, ``(D, k)`` (``None`` before a merge)."""
        raise NotImplementedError

    def add_factor(self, factor: Any, group: int = 0, scale: float = 1.0) -> None:
        """Add ``scale * V V^T`` of one group of a batch factor.

        Args:
            factor: A :class:`~lowrank_laplace.factor.GGNFactor` with kept blocks,
                or a :class:`~lowrank_laplace.fitting.recompute.RecomputedFactor`.
            group: Group index.
            scale: Non-negative factor applied to the batch's GGN.
        """
        raise NotImplementedError

    def add_lowrank(self, eigenvectors: Tensor, eigenvalues: Tensor, trace: Tensor,
                    diagonal: Optional[Tensor] = None) -> None:
        """Add another truncated eigendecomposition (another process, an earlier fit).

        Args:
            eigenvectors: Orthonormal vectors, shape ``(D, k)``.
            eigenvalues: Non-negative eigenvalues, shape ``(k,)``.
            trace: The exact trace of the other curvature.
            diagonal: Its exact diagonal, shape ``(D,)`` (needed when tracking it).
        """
        raise NotImplementedError

    def merge_across(self, group: Any) -> None:
        """Combine the results of all processes of a ``torch.distributed`` group.

        Args:
            group: The process group (e.g. ``torch.distributed.group.WORLD``).
        """
        raise NotImplementedError

    def projection_targets(self) -> List[Tensor]:
        """The ``D x K`` matrices whose products ``V^T x`` the next factor must offer.

        A low-memory fit computes them in the backward pass that yields the Gram
        matrix (see :class:`~lowrank_laplace.fitting.recompute.RecomputedFactor`).

        Returns:
            The matrices (none by default).
        """
        return []

    def add_trace_and_diagonal(self, trace: Tensor, diagonal: Optional[Tensor]) -> None:
        """Accumulate the exact trace and (if given) diagonal of an added curvature.

        Args:
            trace: Its trace.
            diagonal: Its diagonal, ``(D,)``, or ``None``.
        """
        self.trace = trace if self.trace is None else self.trace + trace
        if diagonal is not None:
            self.diagonal = diagonal if self.diagonal is None else self.diagonal + diagonal

    def sum_trace_across(self, group: Any) -> None:
        """Replace the trace by its sum over the processes of a group.

        Args:
            group: The process group.
        """
        import torch.distributed as dist

        trace = self.trace.reshape(1).clone()
        dist.all_reduce(trace, group=group)
        self.trace = trace[0]

    def result(self) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """The leading ``rank`` eigenpairs, the exact trace and the residual diagonal.

        Returns:
            ``(eigenvectors (D, k), eigenvalues (k,), trace, residual (D,))`` with
            ``k <= rank`` and ``residual = diag(H) - diag(U diag(lambda) U^T)``, the
            diagonal of the dropped curvature (clamped at zero against rounding;
            ``None`` unless the diagonal is tracked).

        Raises:
            RuntimeError: If nothing was merged.
        """
        vectors = self.eigenvectors
        if vectors is None:
            raise RuntimeError("Nothing was merged: the data loader was empty.")
        k = min(self.rank, self.eigenvalues.numel())
        U, lam = vectors[:, :k], self.eigenvalues[:k]
        residual = None
        if self.track_diagonal:
            residual = (self.diagonal - (U**2) @ lam).clamp(min=0)
        return U, lam, self.trace, residual
