r"""The solvers' base (``H = sum_b V_b V_b^T`` as its leading eigenpairs), float64 merges.

Merge precision: docs/concepts.md, "Over a training set".
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from lowrank_laplace.factor import GGNFactor
from lowrank_laplace.factor.wide import WIDE, wide_gram, wide_slices, wide_t_matmul, widen
from lowrank_laplace.utils.linalg import rotate, squared_rows_dot


class Solver:
    """The common state and contract of the fit's solvers.

    Args:
        rank: Eigenpairs kept in the end (``r >= 1``).
        oversampling: Extra eigenpairs (or sketch columns) kept while fitting.
        track_diagonal: Also accumulate the exact diagonal of the sum.

    Raises:
        ValueError: For ``rank < 1`` or negative oversampling.
    """

    #: The fit path this solver takes (``FitPlan.path``).
    path = ""
    #: Test columns taken from a warm-start basis (only a sketch takes any).
    warm_columns = 0

    def __init__(self, rank: int, oversampling: int = 0, track_diagonal: bool = False):
        if isinstance(rank, bool) or int(rank) != rank or rank < 1:
            raise ValueError(f"rank must be a positive integer, got {rank!r}.")
        if isinstance(oversampling, bool) or int(oversampling) != oversampling or oversampling < 0:
            raise ValueError(f"oversampling must be a non-negative integer, got {oversampling!r}.")
        self.rank = int(rank)
        self.oversampling = int(oversampling)
        self.track_diagonal = track_diagonal
        self.eigenvalues: Optional[Tensor] = None  # (k,)
        self._exact: Optional[Tuple[Tensor, Tensor]] = None  # (eigenvalues, in float64)
        self.trace: Optional[Tensor] = None
        self.diagonal: Optional[Tensor] = None  # exact diagonal of the merged sum
        self.num_merges = 0
        self._dtype: Optional[torch.dtype] = None  # the factors' dtype (of the result)
        self._vectors: Optional[Tensor] = None  # eigenvectors formed at the end

    @property
    def keep(self) -> int:
        """Eigenpairs (or sketch columns) kept while fitting, ``rank + oversampling``."""
        return self.rank + self.oversampling

    @property
    def eigenvectors(self) -> Optional[Tensor]:
        """The kept orthonormal eigenvectors, ``(D, k)`` (``None`` before a merge)."""
        self._finalize()
        return self._vectors

    def finalize(self) -> None:
        """Form the eigenpairs from what was accumulated now (else on first read)."""
        self._finalize()

    def _finalize(self) -> None:
        """Form :attr:`eigenvectors` from what was accumulated (solvers that defer them)."""

    def add_factor(self, factor: Any, group: int = 0, scale: float = 1.0) -> None:
        """Add ``scale * V V^T`` of one group of a batch factor.

        Args:
            factor: A ``GGNFactor`` with kept blocks, or a ``RecomputedFactor``.
            group: Group index.
            scale: Non-negative factor on the batch's GGN.
        """
        raise NotImplementedError

    def add_lowrank(self, eigenvectors: Tensor, eigenvalues: Tensor, trace: Tensor,
                    diagonal: Optional[Tensor] = None) -> None:
        """Add another truncated eigendecomposition (another process, an earlier fit).

        Args:
            eigenvectors: Orthonormal, ``(D, k)``.
            eigenvalues: Non-negative, ``(k,)``.
            trace: The exact trace of the other curvature.
            diagonal: Its exact diagonal, ``(D,)`` (needed when tracking it).
        """
        raise NotImplementedError

    def merge_across(self, group: Any) -> None:
        """Combine the results of all processes of the ``torch.distributed`` ``group``."""
        raise NotImplementedError

    def projection_targets(self) -> List[Tensor]:
        """Return the ``D x K`` matrices whose ``V^T x`` a recomputed factor must offer."""
        return []

    def keep_eigenvalues(self, evals: Tensor, dtype: torch.dtype) -> None:
        """Set :attr:`eigenvalues` to descending ``evals`` rounded to ``dtype``; keep float64."""
        narrow = evals.to(dtype).clamp(min=torch.finfo(dtype).tiny)
        self.eigenvalues, self._exact = narrow, (narrow, evals.to(WIDE).clamp(min=0))

    def add_trace_and_diagonal(self, trace: Tensor, diagonal: Optional[Tensor]) -> None:
        """Accumulate an added curvature's exact trace (in float64) and diagonal (or ``None``)."""
        trace = trace.to(WIDE)  # a sum of many terms; the dropped mass is its difference
        self.trace = trace if self.trace is None else self.trace + trace
        if diagonal is not None:
            self.diagonal = diagonal if self.diagonal is None else self.diagonal + diagonal

    def sum_trace_across(self, group: Any, total: Tensor) -> None:
        """Sum ``total``, any diagonal and the trace over the processes of ``group``, in place."""
        import torch.distributed as dist

        dist.all_reduce(total, group=group)
        if self.diagonal is not None:
            dist.all_reduce(self.diagonal, group=group)
        trace = self.trace.reshape(1).clone()
        dist.all_reduce(trace, group=group)
        self.trace = trace[0]

    def result(self) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """Return ``(U (D, k), lambda (k,), trace, residual (D,))``, ``k <= rank``.

        ``residual = diag(H) - diag(U diag(lambda) U^T)`` clamped at zero (``None`` unless
        tracked). The float64 trace is shifted by the rounding of the returned
        eigenvalues, so ``trace - sum(lambda)`` is the exact dropped mass.

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
            residual = (self.diagonal - squared_rows_dot(U, lam)).clamp(min=0)
        exact = self._exact[1][:k] if self._exact is not None and \
            self._exact[0] is self.eigenvalues else lam.to(WIDE)
        trace = self.trace - exact.sum() + lam.to(WIDE).sum()
        return U, lam, trace, residual


def wide_merge(factor: Any, group: int, eigenvalues: Optional[Tensor], keep: int,
               span: float) -> bool:
    """Return whether a merge forms its products and basis in float64 (docs/concepts.md).

    For lower-precision factors with blocks while the kept spectrum is short of ``keep``
    or spans more than ``span eps``.

    Args:
        factor: The batch factor.
        group: Group index.
        eigenvalues: The kept eigenvalues (``None`` before the first merge).
        keep: Eigenpairs kept while fitting.
        span: The widest spectrum, in units of ``eps``, merged in float32.
    """
    if not isinstance(factor, GGNFactor) or factor.recomputed:
        return False
    dtype = factor_dtype(factor, group)
    if dtype == WIDE:
        return False
    if eigenvalues is None or eigenvalues.numel() < keep:
        return True
    return float(eigenvalues[-1]) < span * torch.finfo(dtype).eps * float(eigenvalues[0])


def merge_blocks(factor: Any, group: int = 0) -> Optional[List[Any]]:
    """Return a factor's blocks widened to float64 (``None`` for a ``RecomputedFactor``).

    Args:
        factor: A ``GGNFactor``, or another factor.
        group: Group index.
    """
    if not isinstance(factor, GGNFactor) or factor.recomputed:
        return None
    return [widen(block) for block in factor.group_blocks(group)]


def wide_products(factor: Any, blocks: Optional[List[Any]], targets: Sequence[Tensor],
                  group: int = 0) -> Tuple[Tensor, List[Tensor], torch.dtype]:
    """Return float64 ``V^T V``, one ``V^T x`` per target, and the dtype they were formed in.

    Args:
        factor: The factor (without blocks: its products widened).
        blocks: :func:`merge_blocks` of the factor.
        targets: Matrices ``x``, ``(D, K)``.
        group: Group index.
    """
    if blocks is None:
        gram = factor.gram(group)
        return (gram.to(WIDE), [factor.t_matmul(x, group).to(WIDE) for x in targets],
                gram.dtype)
    gram = sum(wide_gram(block) for block in blocks)
    products = [sum(wide_t_matmul(block, part)
                    for block, part in zip(blocks, factor.split_flat(x, group)))
                for x in targets]
    return gram, products, WIDE


def wide_combine(factor: Any, blocks: Optional[List[Any]], y: Tensor, dtype: torch.dtype,
                 group: int = 0, basis: Optional[Tensor] = None,
                 rotation: Union[Tensor, Tuple[Tensor, Tensor], None] = None,
                 in_place: bool = False) -> Tensor:
    """Return ``basis @ rotation + V y`` ``(D, K)``, rows formed in float64, rounded once.

    Keeps a merge's eigenvectors orthonormal (a factor without blocks: in its own dtype).

    Args:
        factor: The factor.
        blocks: :func:`merge_blocks` of the factor.
        y: ``(M, K)``.
        dtype: The result's dtype.
        group: Group index.
        basis: ``(D, r)``, or ``None`` for zero.
        rotation: ``(r, K)``; ``(A, B)`` for ``I + A B^T`` (no ``D r^2`` product); or ``None``.
        in_place: Write into ``basis`` (``rotation`` square or ``None``).
    """
    correction = rotation if isinstance(rotation, tuple) else None
    if correction is not None:
        rotation = torch.eye(y.shape[1], dtype=WIDE, device=y.device) + \
            correction[0].to(WIDE) @ correction[1].to(WIDE).T
        if blocks is not None:
            rotation = None
    if blocks is None:
        if basis is None:
            return factor.matmul(y.to(dtype), group)
        if rotation is not None:
            basis = rotate(basis, rotation.to(dtype), in_place=in_place)
        elif not in_place:
            basis = basis.clone()
        return factor.matmul_add_(basis, y.to(dtype), group)
    square = rotation is None or rotation.shape[0] == rotation.shape[1]
    out = basis if in_place and basis is not None and square else \
        y.new_empty(factor.group_dim(group), y.shape[1], dtype=dtype)
    y = y.to(WIDE)
    sources = factor.split_flat(basis, group) if basis is not None else [None] * len(blocks)
    for block, source, part in zip(blocks, sources, factor.split_flat(out, group)):
        for lo, hi, sub in wide_slices(block, y.shape[1]):
            buf = _rows(source, lo, hi, y, rotation, correction)
            part[lo:hi].copy_(sub.matmul_add_(buf, y))
    return out


def _rows(source: Optional[Tensor], lo: int, hi: int, y: Tensor,
          rotation: Optional[Tensor], correction: Optional[Tuple[Tensor, Tensor]]
          ) -> Tensor:
    """Float64 rows ``lo:hi`` of ``source @ rotation`` (zeros without a source)."""
    if source is None:
        return y.new_zeros(hi - lo, y.shape[1])
    rows = source[lo:hi]
    if rotation is not None:
        return rows.to(WIDE) @ rotation.to(WIDE)
    rows = rows.to(WIDE, copy=True)  # accumulated into: never the source itself
    if correction is not None:
        rows.addmm_(rows @ correction[0].to(WIDE), correction[1].to(WIDE).T)
    return rows


def factor_dtype(factor: Any, group: int = 0) -> torch.dtype:
    """The dtype of a factor's blocks (of its Gram matrix for one without blocks)."""
    if not isinstance(factor, GGNFactor) or factor.recomputed:
        return factor.gram(group).dtype
    return factor.group_blocks(group)[0].dtype
