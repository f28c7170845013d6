r"""Streaming low-rank merge of GGN factors over a data set.

laplace-torch's curvature is a *sum* over the training set, :math:`H = \sum_b V_b
V_b^\top`. We keep a factor :math:`W = U \mathrm{diag}(\lambda)^{1/2}` (``D x r``) with
:math:`W W^\top \approx H` and merge every (micro-)batch factor :math:`V_b`:
:math:`Z = [W, V_b]`, eigen-decompose the small matrix

.. math::
    Z^\top Z = \begin{pmatrix} \mathrm{diag}(\lambda) & \mathrm{diag}(\lambda)^{1/2}
    U^\top V_b \\ V_b^\top U \mathrm{diag}(\lambda)^{1/2} & V_b^\top V_b \end{pmatrix}
    = Q \mathrm{diag}(\mu) Q^\top,

keep the leading ``r + p`` eigenpairs (``p``: oversampling while streaming) and set
:math:`U \leftarrow Z Q_{:, :r+p} \mathrm{diag}(\mu)^{-1/2}`. The result is exact
whenever the total rank fits, needs one pass over the data, holds ``O(D (r + M))``
memory, and is the same operation that merges factors of several processes. The
dropped curvature is known exactly: running trace minus kept eigenvalues.

Shape glossary:
    D: parameters; r: kept rank; M: columns of one batch factor.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from lowrank_laplace._linalg import eigh
from lowrank_laplace.factor import GGNFactor


class StreamingMerge:
    """Accumulates ``H = sum_b V_b V_b^T`` as a truncated eigendecomposition.

    Args:
        rank: Number of eigenpairs kept in the end (``r >= 1``).
        oversampling: Extra eigenpairs kept while streaming (``p >= 0``), which
            makes the truncation more accurate when the total rank exceeds ``r``.
        track_diagonal: Also accumulate the exact diagonal of the sum (for the
            residual diagonal of :meth:`result`).

    Raises:
        ValueError: For ``rank < 1`` or negative oversampling.
    """

    def __init__(self, rank: int, oversampling: int = 0, track_diagonal: bool = False):
        if isinstance(rank, bool) or int(rank) != rank or rank < 1:
            raise ValueError(f"rank must be a positive integer, got {rank!r}.")
        if isinstance(oversampling, bool) or int(oversampling) != oversampling or oversampling < 0:
            raise ValueError(f"oversampling must be a non-negative integer, got {oversampling!r}.")
        self.rank = int(rank)
        self.oversampling = int(oversampling)
        self.eigenvectors: Optional[Tensor] = None  # (D, k)
        self.eigenvalues: Optional[Tensor] = None  # (k,)
        self.trace: Optional[Tensor] = None
        self.track_diagonal = track_diagonal
        self.diagonal: Optional[Tensor] = None  # exact diagonal of the merged sum
        self.num_merges = 0

    @property
    def _keep(self) -> int:
        return self.rank + self.oversampling

    def add_factor(self, factor: GGNFactor, group: int = 0, scale: float = 1.0) -> None:
        """Merge ``scale * V V^T`` of one group of a batch factor.

        Args:
            factor: Batch factor with kept blocks.
            group: Group index.
            scale: Non-negative factor applied to the batch's GGN.
        """
        gram = factor.gram(group) * scale
        diagonal = factor.diag(group) * scale if self.track_diagonal else None
        self._add_trace_and_diagonal(gram.diagonal().sum(), diagonal)
        if self.eigenvectors is None:
            evals, q = _top_eigh(gram, self._keep)
            self.eigenvectors = factor.matmul(q, group) * (scale**0.5) / evals.sqrt()
            self.eigenvalues = evals
            self.num_merges += 1
            return
        U, lam = self.eigenvectors, self.eigenvalues
        r = lam.numel()
        cross = factor.t_matmul(U, group).T * (scale**0.5) * lam.sqrt()[:, None]  # (r, M)
        small = torch.cat(
            [torch.cat([torch.diag(lam), cross], 1), torch.cat([cross.T, gram], 1)], 0
        )
        evals, q = _top_eigh(small, self._keep)
        # U_new = (U diag(lam)^1/2 Q_top + sqrt(scale) V Q_bot) diag(evals)^-1/2, with the
        # scalings folded into the small matrices and V Q_bot added in place
        inv = evals.rsqrt()[None, :]
        new = U @ (lam.sqrt()[:, None] * q[:r] * inv)
        self.eigenvectors = factor.matmul_add_(new, q[r:] * (scale**0.5) * inv, group)
        self.eigenvalues = evals
        self.num_merges += 1

    def _add_trace_and_diagonal(self, trace: Tensor, diagonal: Tensor) -> None:
        self.trace = trace if self.trace is None else self.trace + trace
        if diagonal is not None:
            self.diagonal = diagonal if self.diagonal is None else self.diagonal + diagonal

    def add_lowrank(self, eigenvectors: Tensor, eigenvalues: Tensor, trace: Tensor,
                    diagonal: Optional[Tensor] = None) -> None:
        """Merge another truncated eigendecomposition (e.g. from another process).

        Args:
            eigenvectors: Orthonormal vectors, shape ``(D, k)``.
            eigenvalues: Positive eigenvalues, shape ``(k,)``.
            trace: The exact trace of the other curvature.
            diagonal: The exact diagonal of the other curvature, shape ``(D,)``
                (needed when tracking the diagonal).
        """
        self._add_trace_and_diagonal(trace, diagonal)
        if self.eigenvectors is None:
            self.eigenvectors, self.eigenvalues = eigenvectors, eigenvalues
            return
        W = torch.cat(
            [self.eigenvectors * self.eigenvalues.sqrt(), eigenvectors * eigenvalues.sqrt()], 1
        )
        evals, q = _top_eigh(W.T @ W, self._keep)
        self.eigenvectors = (W @ q) / evals.sqrt()
        self.eigenvalues = evals
        self.num_merges += 1

    def merge_across(self, group: Any) -> None:
        """Merge the factors of all processes of a ``torch.distributed`` group.

        Every process all-gathers the small factors (``D x (rank + oversampling)``,
        zero-padded), traces and diagonals, and merges them in rank order, so every
        process ends with the same result. Exact whenever the total rank fits.

        Args:
            group: The process group (e.g. ``torch.distributed.group.WORLD``).

        Raises:
            RuntimeError: If no process merged anything.
        """
        import torch.distributed as dist

        world = dist.get_world_size(group)
        U, lam = self.eigenvectors, self.eigenvalues
        if U is None:
            raise RuntimeError("merge_across needs a local factor on every process.")
        dim, keep = U.shape[0], self._keep
        padded_U = U.new_zeros(dim, keep)
        padded_lam = lam.new_zeros(keep)
        padded_U[:, : lam.numel()] = U
        padded_lam[: lam.numel()] = lam
        diagonal = self.diagonal if self.track_diagonal else U.new_zeros(dim)
        local = [padded_U, padded_lam, self.trace.reshape(1), diagonal,
                 torch.tensor([lam.numel()], device=U.device)]
        gathered = []
        for tensor in local:
            parts = [torch.empty_like(tensor) for _ in range(world)]
            dist.all_gather(parts, tensor.contiguous(), group=group)
            gathered.append(parts)
        self.eigenvectors = self.eigenvalues = self.trace = self.diagonal = None
        for Ui, li, ti, di, ki in zip(*gathered):
            k = int(ki)
            self.add_lowrank(Ui[:, :k], li[:k], ti[0], di if self.track_diagonal else None)

    def result(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """The leading ``rank`` eigenpairs, the exact trace and the residual diagonal.

        Returns:
            ``(eigenvectors (D, k), eigenvalues (k,), trace, residual (D,))`` with
            ``k <= rank`` and ``residual = diag(H) - diag(U diag(lambda) U^T)``, the
            diagonal of the dropped curvature (clamped at zero against rounding;
            ``None`` unless the diagonal is tracked).

        Raises:
            RuntimeError: If nothing was merged.
        """
        if self.eigenvectors is None:
            raise RuntimeError("Nothing was merged: the data loader was empty.")
        k = min(self.rank, self.eigenvalues.numel())
        U, lam = self.eigenvectors[:, :k], self.eigenvalues[:k]
        residual = None
        if self.track_diagonal:
            residual = (self.diagonal - (U**2) @ lam).clamp(min=0)
        return U, lam, self.trace, residual


def _top_eigh(mat: Tensor, keep: int) -> Tuple[Tensor, Tensor]:
    """Leading eigenpairs of a symmetric PSD matrix, numerically zero ones dropped.

    The small eigenproblem is solved in float64 (cheap at this size, and the kept
    basis is rotated by its eigenvectors at every merge, so their orthogonality
    matters) and cast back.
    """
    evals, evecs = eigh(mat.double())
    evals, evecs = evals.flip(0).to(mat.dtype), evecs.flip(1).to(mat.dtype)
    # drop only numerically non-positive directions: a rank-style cutoff
    # (lambda_max * n * eps) discarded float32 curvature of the size of a typical
    # prior precision, which changed predictive variances by tens of percent
    tol = evals[0].clamp(min=0) * 10 * torch.finfo(mat.dtype).eps
    num = int(min(keep, int((evals > tol).sum())))
    num = max(num, 1)
    return evals[:num].clamp(min=torch.finfo(mat.dtype).tiny), evecs[:, :num]
