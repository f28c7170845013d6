r"""One-pass randomized Nyström sketch of the GGN over a data set (``solver="sketch"``).

Every batch factor adds ``V_b (V_b^T Omega)`` to ``Y = H Omega`` for a fixed test matrix
``Omega`` (``D x l``); the eigenpairs come once, at the end, from the Nyström
approximation. Exact where the GGN's rank fits ``l``, else an under-estimate; a
Kronecker-structured ``Omega``, float64 accumulation and data-parallel sums: see
docs/concepts.md, "One-pass sketch".
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from lowrank_laplace.factor import Block, cat_blocks
from lowrank_laplace.factor.wide import WIDE
from lowrank_laplace.fitting.base import Solver
from lowrank_laplace.fitting.nystrom import nystrom_core, nystrom_eigenpairs, sub_sketch_share
from lowrank_laplace.fitting.omega import BasisOmega, Omega
from lowrank_laplace.utils.linalg import rotate, sym_eigh

#: Factored linear-layer blocks of consecutive passes are added together, up to this
#: many samples per parameter and bytes queued in all (each product writes a whole
#: ``d x l`` slice, so small ones are memory-bound).
_KRON_SAMPLES = 256
_KRON_BYTES = 64 * 2**20
#: The fit's test matrix: ``"kronecker"`` (Khatri-Rao slices for matrix-shaped
#: weights) or ``"gaussian"``.
TEST_MATRIX = "kronecker"
#: A float32 sketch is kept when every kept eigenvalue is this many times its shift
#: ``nu``; else the fit redoes it in float64.
RESOLVED_RATIO = 1e3


class SketchMerge(Solver):
    """Accumulates ``H = sum_b V_b V_b^T`` as a one-pass Nyström sketch ``Y = H Omega``.

    The eigenpairs are formed when :meth:`result` or :attr:`eigenvectors` is first read;
    ``rank``, ``oversampling`` (extra sketch columns) and ``track_diagonal`` as for ``Solver``.

    Args:
        seed: Seed of ``Omega``; processes that merge their sketches need the same.
        test_matrix: ``"kronecker"`` (Khatri-Rao slices for matrix-shaped weights) or
            ``"gaussian"``; entries of variance ``1 / D``, uncorrelated, either way.
        accumulate: The dtype of ``Omega``, ``Y`` and the products (``None``: the
            factors', as recomputed factors need).
        basis: ``(D, b)`` warm start, the first ``b`` test columns.

    Raises:
        ValueError: For a bad rank, oversampling (``Solver``), basis or ``test_matrix``.
    """

    path = "sketch"

    def __init__(self, rank: int, oversampling: int = 0, track_diagonal: bool = False,
                 seed: int = 0, test_matrix: str = "kronecker",
                 accumulate: Optional[torch.dtype] = None, basis: Optional[Tensor] = None):
        super().__init__(rank, oversampling, track_diagonal)
        if basis is not None and not 0 < basis.shape[1] < self.keep:
            raise ValueError(
                f"A warm-start basis needs between 1 and {self.keep - 1} columns (fewer "
                f"than the sketch's {self.keep}), got {basis.shape[1]}.")
        if test_matrix not in ("kronecker", "gaussian"):
            raise ValueError(f"test_matrix must be 'kronecker' or 'gaussian', got {test_matrix!r}.")
        self.test_matrix = test_matrix
        self.seed = int(seed)
        self.accumulate = accumulate
        self.basis = basis  # the warm start's columns, until the test matrix is drawn
        self.warm_columns = 0 if basis is None else basis.shape[1]
        self._omega: Optional[Union[Omega, BasisOmega]] = None  # the test matrix
        self._projection: Optional[Tensor] = None  # Omega formed, for low-memory passes
        self._sketch: Optional[Tensor] = None  # Y = H Omega, laid out like Omega
        self.shift: Optional[float] = None  # nu of the last finalisation
        # sub_sketch_share of the last finalisation, formed when first read (a
        # Rayleigh-Ritz step replaces it unread)
        self._convergence: Union[float, Callable[[], float]] = 1.0
        self.ritz = False  # whether rayleigh_ritz refined the eigenpairs
        # parameter index -> (blocks, scaled V^T Omega rows, sketch slice) not yet added
        self._kron: Dict[int, Tuple[List[Block], List[Tensor], Tensor]] = {}

    def _test_matrix(self, dim: int, like: Tensor,
                     shapes: Optional[List[torch.Size]] = None) -> Omega:
        """The test matrix, drawn once, at most ``D`` columns (the sketch is stored ``(l, D)``)."""
        if self._omega is None:
            self._omega = Omega(min(self.keep, dim) - self.warm_columns, dim, like, self.seed,
                                shapes, kronecker=self.test_matrix == "kronecker")
            if self.basis is not None:
                self._omega = BasisOmega(self.basis, self._omega)
                self.basis = None  # the test matrix holds its copy
        return self._omega

    def add_factor(self, factor: Any, group: int = 0, scale: float = 1.0) -> None:
        """Add ``scale * V V^T Omega`` of one group to the sketch (:meth:`Solver.add_factor`)."""
        dim = factor.group_dim(group)
        self.num_merges += 1
        trace = factor.trace(group) * scale
        diagonal = factor.diag(group) * scale if self.track_diagonal else None
        self.add_trace_and_diagonal(trace, diagonal)
        if factor.recomputed:  # V^T Omega from its pass
            if self.accumulate is not None:
                raise ValueError("A low-memory sketch accumulates in the factors' dtype.")
            omega = self._test_matrix(dim, trace)
            proj = factor.t_matmul(self._projection, group) * scale
            self._dtype = proj.dtype
        else:
            blocks = factor.group_blocks(group)
            # the widest of the blocks' dtypes (a bfloat16 head beside float32 adapters)
            self._dtype = functools.reduce(torch.promote_types, [b.dtype for b in blocks])
            blocks = [block.to(self.accumulate or self._dtype) for block in blocks]
            omega = self._test_matrix(dim, trace.to(self.accumulate or self._dtype),
                                      [factor.shapes[i] for i in factor.groups[group]])
            proj = omega.block_products(blocks) * scale  # (M, l)
        if self._sketch is None:  # (D, l), stored as (l, D)
            self._sketch = torch.zeros(omega.cols, dim, dtype=omega.dtype,
                                       device=omega.device).T
        if factor.recomputed:
            factor.matmul_add_(self._sketch, proj, group)
            return
        for index, block, part in zip(factor.groups[group], blocks,
                                      factor.split_flat(self._sketch, group)):
            if block.factored:
                self._defer(index, block, proj, part)
            else:
                block.matmul_add_(part, proj)

    def _defer(self, index: int, block: Block, proj: Tensor, part: Tensor) -> None:
        """Queue a factored block's product ``part += B^T proj`` (see ``_KRON_SAMPLES``)."""
        queued = self._kron.get(index)
        if queued and queued[0][0].num_vectors != block.num_vectors:  # other vectors/sample
            self._add_deferred(index)
        blocks, projs, _ = self._kron.setdefault(index, ([], [], part))
        blocks.append(block)
        projs.append(proj)
        if sum(b.num_samples for b in blocks) >= _KRON_SAMPLES:
            self._add_deferred(index)
        elif sum(b.nbytes + p.numel() * p.element_size() for bs, ps, _ in self._kron.values()
                 for b, p in zip(bs, ps)) >= _KRON_BYTES:  # a batch's V^T Omega per parameter
            self._add_deferred()

    def _add_deferred(self, index: Optional[int] = None) -> None:
        """Add the queued products of one parameter (``None``: of all) to the sketch."""
        for key in list(self._kron) if index is None else [index]:
            blocks, projs, part = self._kron.pop(key)
            if len(blocks) == 1:
                blocks[0].matmul_add_(part, projs[0])
                continue
            vecs = blocks[0].num_vectors
            proj = torch.cat([p.view(vecs, -1, p.shape[1]) for p in projs], dim=1)
            merged = cat_blocks(blocks, [1.0] * len(blocks), vecs)
            merged.matmul_add_(part, proj.view(-1, proj.shape[2]))

    def projection_targets(self) -> List[Tensor]:
        """``[Omega]``, formed once for low-memory passes' ``V^T Omega`` (empty before drawn)."""
        if self._omega is None:
            return []
        if self._projection is None:
            self._projection = self._omega.dense()
        return [self._projection]

    def prepare(self, dim: int, like: Tensor,
                shapes: Optional[List[torch.Size]] = None) -> None:
        """Draw the test matrix before the first factor (low-memory fits need it).

        Args:
            dim: Parameters ``D`` of the group.
            like: A tensor with the fit's dtype and device.
            shapes: The group's parameter shapes (``None``: all Gaussian).
        """
        self._test_matrix(dim, like, shapes)

    def add_lowrank(self, eigenvectors: Tensor, eigenvalues: Tensor, trace: Tensor,
                    diagonal: Optional[Tensor] = None) -> None:
        """Add ``U diag(lambda) U^T Omega`` (:meth:`Solver.add_lowrank`)."""
        self.add_trace_and_diagonal(trace, diagonal)
        if eigenvalues.numel() == 0:
            return
        dim = eigenvectors.shape[0]
        self._dtype = eigenvectors.dtype
        eigenvectors = eigenvectors.to(self.accumulate or self._dtype)
        eigenvalues = eigenvalues.to(eigenvectors.dtype)
        omega = self._test_matrix(dim, eigenvectors)
        if self._sketch is None:
            self._sketch = eigenvectors.new_zeros(omega.cols, dim).T  # stored as (l, D)
        projected = omega.t_matmul(eigenvectors).T  # U^T Omega, (k, l)
        self._sketch.addmm_(eigenvectors, eigenvalues[:, None] * projected)
        self.num_merges += 1

    def merge_across(self, group: Any) -> None:
        """Sum the sketches, traces and diagonals of all processes (same ``Omega``).

        Args:
            group: The process group.

        Raises:
            RuntimeError: If some process sketched nothing.
        """
        if self._sketch is None:
            raise RuntimeError("merge_across needs a local sketch on every process.")
        self._add_deferred()
        self.sum_trace_across(group, self._sketch.T)  # its contiguous (l, D) storage

    def resolves(self, ratio: Optional[float] = None) -> bool:
        """Whether every kept eigenvalue is ``ratio`` times its shift ``nu`` (finalises).

        Args:
            ratio: Smallest ``lambda / nu`` (``None``: :data:`RESOLVED_RATIO`).

        Returns:
            ``True`` also when nothing was kept.
        """
        self._finalize()
        lam = self.eigenvalues
        if lam is None or lam.numel() == 0 or self.shift is None:
            return True
        ratio = RESOLVED_RATIO if ratio is None else ratio
        return float(lam[: self.rank].min()) >= ratio * self.shift

    def rayleigh_ritz(self, quadratic_form: Callable[[Tensor], Tensor]) -> None:
        r"""Replace the Nyström eigenpairs by ``H``'s Ritz pairs on their span (finalises).

        With ``U`` the Nyström eigenvectors, the eigenpairs of ``U^T H U`` (float64) give
        ``U W`` and ``theta``: the kept eigenvalues become the exact curvature of their
        directions (Nyström's under-state it), at the cost of one product ``V^T U``.
        :attr:`convergence` becomes the Nyström eigenvalues' sum over the Ritz values'.

        Args:
            quadratic_form: ``X -> X H X^T`` of rows ``X`` ``(k, D)``, float64 (the fit's
                kept factors).
        """
        self._finalize()
        U = self._vectors
        if U is None or U.shape[1] == 0:
            return
        theta, W = sym_eigh(quadratic_form(U.T.to(WIDE)))
        theta = theta.clamp(min=0)
        nystrom, ritz = float(self._exact[1].sum()), float(theta.sum())
        self._convergence = nystrom / ritz if ritz > 0 else 1.0
        self._vectors = rotate(U, W.to(U.dtype), in_place=True)
        self.keep_eigenvalues(theta, self._dtype)
        self.ritz = True

    @property
    def convergence(self) -> float:
        """``sub_sketch_share`` of the sketch, ``1.0`` where converged (finalises it).

        After :meth:`rayleigh_ritz`: the Nyström eigenvalues' share of the Ritz values.
        """
        self._finalize()
        if callable(self._convergence):
            self._convergence = self._convergence()
        return self._convergence

    def _finalize(self) -> None:
        """Replace the sketch by its eigenpairs (:func:`nystrom_eigenpairs`)."""
        if self._sketch is None:
            return
        self._add_deferred()
        Y, omega = self._sketch, self._omega
        self._sketch = self._omega = self._projection = None
        chol, self.shift = nystrom_core(Y, omega)
        del omega  # the test matrix is freed before the eigenvectors are formed
        vectors, lam, gram = nystrom_eigenpairs(Y, chol, self.shift, self.rank)
        self._vectors = vectors.to(self._dtype)
        self.keep_eigenvalues(lam, self._dtype)
        half = self.warm_columns + (chol.shape[0] - self.warm_columns) // 2
        self._convergence = functools.partial(sub_sketch_share, chol, gram, self.shift,
                                              self.rank, half)
