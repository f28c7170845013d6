r"""Streaming low-rank merge of GGN factors over a data set.

Keeps ``W = U diag(lambda)^{1/2}`` and merges every batch factor through the small eigenproblem
of ``[W, V_b]^T [W, V_b]``: exact whenever the total rank fits, one pass, the same operation
across processes; a lazy basis (``U = B R``), float32 merges of wide spectra formed in float64
(docs/concepts.md, "Streaming merges" and "Float32 factors").
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lowrank_laplace.factor import GGNFactor, cat_blocks
from lowrank_laplace.factor.wide import WIDE
from lowrank_laplace.fitting.base import (
    Solver,
    factor_dtype,
    merge_blocks,
    wide_combine,
    wide_merge,
    wide_products,
)
from lowrank_laplace.utils.linalg import lapack_threads, rotate, top_eigh, wide_inner

#: A float32 merge stays float32 while its kept eigenvalues all exceed this multiple
#: of ``eps lambda_max`` (``wide_merge``).
WIDE_SPAN = 1e3


class StreamingMerge(Solver):
    """Accumulates ``H = sum_b V_b V_b^T`` as a truncated eigendecomposition.

    ``rank``, ``oversampling`` (extra eigenpairs kept while streaming) and ``track_diagonal``
    as for ``Solver``.

    Args:
        lazy: Update a basis times small coordinates; ``False`` rotates it every merge.
    """

    path = "streaming"

    def __init__(self, rank: int, oversampling: int = 0, track_diagonal: bool = False,
                 lazy: bool = True):
        super().__init__(rank, oversampling, track_diagonal)
        self.lazy = lazy
        self.tau = 0.1  # singular-value band [tau, 1/tau] of the basis coordinates
        self.max_deferred = 16  # columns of deferred corrections before applying them
        self._basis: Optional[Tensor] = None  # (D, k): eigenvectors U = basis @ coords
        self._coords: Optional[Tensor] = None  # (k, k) float64, or None for the identity
        self._shared = False  # the basis was handed out: copy before updating in place
        # deferred rank-m corrections: the basis is B + sum_i X_i Y_i^T
        self._deferred: List[Tuple[Tensor, Tensor]] = []
        self.num_lazy_corrections = 0  # directions reset in lazy updates
        self.num_deferred = 0  # corrections whose update of the basis was deferred

    @property
    def eigenvectors(self) -> Optional[Tensor]:
        """The kept orthonormal eigenvectors, shape ``(D, k)`` (``None`` before a merge)."""
        if self._basis is None:
            return None
        self._flush()
        if self._coords is not None:
            self._orthonormalize()
        self._shared = True
        return self._basis

    def _orthonormalize(self) -> None:
        """Form ``U = B R`` by a Rayleigh-Ritz step that restores exact orthonormality."""
        basis, coords = self._basis, self._coords.double()
        gram = wide_inner(basis)
        chol, info = torch.linalg.cholesky_ex(gram)
        if int(info) == 0:
            eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
            to_orth = torch.linalg.solve_triangular(chol.T, eye, upper=True)
            inner = chol.T @ coords
        else:  # numerically rank-deficient basis: symmetric inverse square root
            with lapack_threads(gram):
                g, Z = torch.linalg.eigh(gram)
            g = g.clamp(min=g[-1] * torch.finfo(basis.dtype).eps)
            to_orth, inner = Z / g.sqrt(), (Z * g.sqrt()).T @ coords
        lam = self.eigenvalues.double()
        with lapack_threads(inner):
            evals, q = torch.linalg.eigh((inner * lam) @ inner.T)
        evals, q = evals.flip(0), q.flip(1)
        self._basis = rotate(basis, (to_orth @ q).to(basis.dtype), in_place=not self._shared)
        self._coords = None
        self.keep_eigenvalues(evals, basis.dtype)

    @eigenvectors.setter
    def eigenvectors(self, value: Optional[Tensor]) -> None:
        self._basis, self._coords, self._shared, self._deferred = value, None, False, []

    def add_factor(self, factor: GGNFactor, group: int = 0, scale: float = 1.0) -> None:
        """Merge ``scale * V V^T`` of one group of a batch factor (:meth:`Solver.add_factor`)."""
        self.num_merges += 1
        wide = wide_merge(factor, group, self.eigenvalues, self.keep, WIDE_SPAN)
        if self._basis is None and self._first_merge(factor, None, scale, group, wide):
            return
        blocks = merge_blocks(factor, group) if wide else None
        if blocks is not None:
            self._flush()  # a wide merge applies its corrections at once
        if self._basis is None:
            self._first_merge(factor, blocks, scale, group)
            return
        gram, products, formed = wide_products(factor, blocks, self.projection_targets(), group)
        gram = gram * scale
        diagonal = factor.diag(group) * scale if self.track_diagonal else None
        self.add_trace_and_diagonal(gram.diagonal().sum(), diagonal)
        basis, coords, lam = self._basis, self._coords, self.eigenvalues
        proj = products[0].T  # B^T V, (r, M)
        for (_, Y), product in zip(self._deferred, products[1:]):
            proj = proj + Y.to(WIDE) @ product.T
        if coords is not None:
            proj = coords.to(WIDE).T @ proj  # U^T V
        # Z = sqrt(scale) V: U' = U P + Z C' = B (R P) + V (sqrt(scale) C')
        evals, P, C = self._merge_eigh(lam, proj * scale**0.5, gram, formed)
        C = C * scale**0.5
        if coords is not None:
            P = coords.to(WIDE) @ P
        self.keep_eigenvalues(evals, basis.dtype)
        if self._lazy_update(P, C, factor, blocks, group):
            return
        self._flush()
        new = wide_combine(factor, blocks, C, basis.dtype, group, self._basis, P,
                           in_place=not self._shared)
        self._basis, self._coords, self._shared = new, None, False

    def _first_merge(self, factor: GGNFactor, blocks: Optional[List[Any]], scale: float,
                     group: int, narrow_only: bool = False) -> bool:
        """Start the basis from a first merge (``blocks``: formed in float64).

        ``narrow_only``: formed in the factor's own dtype only where its ``keep`` leading
        eigenvalues are resolved and span less than ``WIDE_SPAN eps``, as a later merge's
        kept spectrum is checked; else nothing is done and ``False`` returned, and the merge
        is formed in float64 after this one more Gram matrix
        (docs/benchmarks/design_measurements.md).
        """
        gram, _, formed = wide_products(factor, blocks, [], group)
        gram = gram * scale
        dtype = factor_dtype(factor, group)
        evals, q = top_eigh(gram, self.keep, dtype, formed)
        span = WIDE_SPAN * torch.finfo(dtype).eps
        if narrow_only and (evals.numel() < self.keep
                            or float(evals[-1]) < span * float(evals[0])):
            return False
        diagonal = factor.diag(group) * scale if self.track_diagonal else None
        self.add_trace_and_diagonal(gram.diagonal().sum(), diagonal)
        coeffs = q * (scale**0.5 / evals.sqrt())
        self.eigenvectors = wide_combine(factor, blocks, coeffs, dtype, group)
        self.keep_eigenvalues(evals, dtype)
        return True

    def projection_targets(self) -> List[Tensor]:
        """The basis, then the deferred corrections (empty before the first merge)."""
        if self._basis is None:
            return []
        return [self._basis] + [X for X, _ in self._deferred]

    def _merge_eigh(self, lam: Tensor, cross: Tensor, gram: Tensor,
                    formed: torch.dtype = WIDE) -> Tuple[Tensor, Tensor, Tensor]:
        """Merge ``U diag(lam) U^T`` with ``Z Z^T`` in the space of ``[U, Z]`` (float64).

        ``lam`` ``(r,)``, ``cross = U^T Z`` ``(r, M)``, ``gram = Z^T Z``, ``formed``: their
        dtype. Returns the leading eigenvalues and ``A`` ``(r, k)``, ``C`` ``(M, k)`` with
        orthonormal eigenvectors ``U A + Z C``.
        """
        r, root = lam.numel(), lam.to(WIDE).sqrt()
        cross = cross.to(WIDE) * root[:, None]  # diag(lam)^1/2 U^T Z
        small = torch.cat([torch.cat([torch.diag(lam.to(WIDE)), cross], 1),
                           torch.cat([cross.T, gram.to(WIDE)], 1)], 0)
        evals, q = top_eigh(small, self.keep, lam.dtype, formed)
        inv = evals.rsqrt()[None, :]
        return evals, root[:, None] * q[:r] * inv, q[r:] * inv

    def _lazy_update(self, P: Tensor, C: Tensor, factor: GGNFactor,
                     blocks: Optional[List[Any]], group: int) -> bool:
        """``B' R' = B P + V C`` with ``B' = B E + V C R'^{-1}``, ``E = I +`` rank ``m``.

        ``False`` (rotate explicitly) when the rank changed or ``m > r / 2``. A wide
        merge applies ``E`` at once: a deferred float32 ``B L_m`` would lose a shrinking
        direction to cancellation.
        """
        r = P.shape[0]
        if not self.lazy or P.shape[1] != r:
            return False
        with lapack_threads(P):
            L, S, Qt = torch.linalg.svd(P.double())
        drift = (S < self.tau) | (S > 1 / self.tau)
        # hysteresis: once one drifts, reset all outside the narrower band (one host read)
        wide = (S < self.tau**0.5) | (S > self.tau**-0.5)
        num_drift, num_wide, growing = torch.stack(
            [drift.sum(), wide.sum(), (S > 1 / self.tau).sum()]
        ).tolist()
        bad = wide if num_drift else drift
        m = num_wide if num_drift else 0
        if 2 * m > r:
            return False
        basis = self._basis.clone() if self._shared else self._basis
        S_kept = torch.where(bad, torch.ones_like(S), S)
        coords = (L * S_kept) @ Qt
        coords_inv = (Qt.T / S_kept) @ L.T
        correction = None
        if m and blocks is not None:
            correction = (L[:, bad], L[:, bad] * (S[bad] - 1))
        elif m:
            # (B + sum X Y^T) E = B + (B L_m) diag(S_m - 1) L_m^T + sum X (E^T Y)^T,
            # deferred except for growing directions (docs/concepts.md)
            Lm, dtype = L[:, bad], basis.dtype
            Ym = Lm * (S[bad] - 1)
            self._deferred = [(X, Y + (Lm @ (Ym.T @ Y.double())).to(dtype))
                              for X, Y in self._deferred]
            self._deferred.append(((Lm.T.to(dtype) @ basis.T).T, Ym.to(dtype)))
            self.num_deferred += 1
        self._basis, self._shared = basis, False
        deferred = sum(X.shape[1] for X, _ in self._deferred)
        if deferred > self.max_deferred or growing:
            self._flush()
        wide_combine(factor, blocks, C.double() @ coords_inv, basis.dtype, group,
                     self._basis, correction, in_place=True)
        self._coords = coords  # float64, like every small matrix of the merge
        self.num_lazy_corrections += m
        return True

    def _flush(self) -> None:
        """Apply the deferred corrections: ``B <- B + sum_i X_i Y_i^T``."""
        if not self._deferred:
            return
        if self._shared:
            self._basis, self._shared = self._basis.clone(), False
        for X, Y in self._deferred:
            self._basis.addmm_(X, Y.T)
        self._deferred = []

    def add_lowrank(self, eigenvectors: Tensor, eigenvalues: Tensor, trace: Tensor,
                    diagonal: Optional[Tensor] = None) -> None:
        """Merge another truncated eigendecomposition (:meth:`Solver.add_lowrank`)."""
        self.add_trace_and_diagonal(trace, diagonal)
        if self.eigenvectors is None:
            self.eigenvectors, self.eigenvalues = eigenvectors, eigenvalues
            return
        # both bases are orthonormal: only the cross Gram U_1^T U_2 is needed
        U, lam = self.eigenvectors, self.eigenvalues
        W2 = eigenvalues.sqrt()  # the other factor is U_2 diag(W2)
        evals, A, B = self._merge_eigh(lam, wide_inner(U, eigenvectors) * W2.to(WIDE),
                                       torch.diag(eigenvalues.to(WIDE)))
        B = W2.to(WIDE)[:, None] * B
        new = U.new_empty(U.shape[0], A.shape[1])
        for rows, mine, other in zip(new.split(2**16), U.split(2**16), eigenvectors.split(2**16)):
            rows.copy_(mine.to(WIDE) @ A + other.to(WIDE) @ B)  # formed in float64
        self.eigenvectors = new
        self.keep_eigenvalues(evals, U.dtype)
        self.num_merges += 1

    def merge_across(self, group: Any) -> None:
        """Merge all processes' gathered factors in rank order, on every process.

        Args:
            group: The process group.

        Raises:
            RuntimeError: If no process merged anything.
        """
        import torch.distributed as dist

        world = dist.get_world_size(group)
        U, lam = self.eigenvectors, self.eigenvalues
        if U is None:
            raise RuntimeError("merge_across needs a local factor on every process.")
        pad = self.keep - lam.numel()
        diagonal = self.diagonal if self.track_diagonal else U.new_zeros(U.shape[0])
        local = [F.pad(U, (0, pad)), F.pad(lam, (0, pad)), self.trace.reshape(1), diagonal,
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


def concat_factors(factors: Sequence[GGNFactor], scales: Sequence[float]) -> GGNFactor:
    """One factor whose columns are those of several factors, each times ``sqrt(scale)``.

    Lets one merge span several backward passes.

    Args:
        factors: Factors with the same groups and vectors per sample, blocks kept.
        scales: Non-negative factor on each factor's GGN.

    Returns:
        The concatenated factor (blocks only; ``loss`` is the sum).
    """
    if len(factors) == 1 and scales[0] == 1:
        return factors[0]
    first = factors[0]
    alphas = [float(s) ** 0.5 for s in scales]
    blocks = {i: cat_blocks([f.blocks[i] for f in factors], alphas, first.num_vectors)
              for i in first.blocks}
    return replace(
        first, blocks=blocks, grams=[], grad={}, batch_grads={}, outputs=None,
        num_curv_samples=sum(f.num_curv_samples for f in factors),
        num_samples=sum(f.num_samples for f in factors), loss=sum(f.loss for f in factors),
    )
