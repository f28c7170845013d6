r"""One-pass randomized Nyström sketch of the GGN over a data set (``solver="sketch"``).

An alternative to :class:`~lowrank_laplace.fitting.streaming.StreamingMerge` that trades
accuracy for speed (``solver="auto"`` runs it with ``l = 4 rank`` columns where it is
the cheaper fit, or from the same posterior's last eigenvectors and ``2 rank`` random
columns: with ``l = 1.2 rank`` its posteriors missed the full GGN's test NLL by more,
docs/posterior_quality.md). With a fixed random test matrix :math:`\Omega`
(``D x l``, ``l = rank + oversampling``) every batch factor only adds to the sketch

.. math::
    Y = H \Omega = \sum_b V_b (V_b^\top \Omega),

the two products with ``V`` that a streaming merge pays too, but without its
eigendecomposition of size ``k + M`` per merge and its bookkeeping. After the pass
the Nyström approximation :math:`\hat H = Y (\Omega^\top Y)^{+} Y^\top` gives the
eigenpairs, computed stably with a small shift :math:`\nu` (Tropp, Yurtsever, Udell
and Cevher, 2017, "Fixed-rank approximation of a positive-semidefinite matrix from
streaming data", Algorithm 3):

.. math::
    Y_\nu = Y + \nu \Omega, \quad B = \Omega^\top Y_\nu = L L^\top, \quad
    \hat H_\nu = Y_\nu B^{-1} Y_\nu^\top, \quad \hat H = \hat H_\nu - \nu\,\Pi,

with :math:`\Pi` the projector onto the range of :math:`Y_\nu`; the eigenpairs of
:math:`\hat H_\nu = E E^\top`, :math:`E = Y_\nu L^{-\top}`, come from one ``l x l``
eigenproblem of :math:`E^\top E`.

Properties:

- **Exact** whenever the GGN's rank over the data is at most ``l`` (then ``Y``
  spans its range), like the streaming merge.
- **Otherwise an under-estimate**: :math:`0 \preceq \hat H \preceq H`; the kept
  eigenvalues are at most the true ones and the kept trace is lower than the
  streaming merge's (which tracks the leading eigenspace adaptively). The exact
  trace, and the exact diagonal if tracked, are still accumulated, so the residual
  models see the true dropped curvature. In expectation the nuclear-norm error of
  the rank-``r`` truncation is within ``1 + r / (l - r - 1)`` of the best rank-``r``
  error (Tropp et al., Theorem 4.1, Gaussian test matrix): a larger oversampling
  buys accuracy linearly in cost.
- **Structured where the factor is**: by default (``test_matrix="kronecker"``) the
  slice of a matrix-shaped weight ``(out, in)`` in every column of :math:`\Omega` is a
  Khatri-Rao column :math:`p_k \otimes q_k` of two Gaussian vectors (a tensor random
  projection: Sun, Guo, Tropp and Udell, 2021, "Tensor random projection for low
  memory dimension reduction"). A linear layer's block of ``V`` is factored as
  :math:`s_{vn} \otimes z_n`, so its :math:`V_b^\top \Omega_b` is
  :math:`(s_{vn}^\top p_k)(z_n^\top q_k)`: ``(V N out + N in) l`` multiply-adds
  instead of ``N out in l``, half of the sketch's products with such a layer, and the
  slice is kept as ``p`` and ``q`` (the sketch then holds little more than ``Y``). The
  entries stay uncorrelated with variance ``1 / D``. No bound like the Gaussian one
  is claimed, but the kept trace stayed within half a point of a Gaussian test
  matrix's on the benchmarks' MLP, sklearn digits, DeepOBS 3c3d and 2c2d
  (``benchmarks/bench_sketch_test_matrix.py``), and the bound above held in the tests.
- **Widened to float64 where float32 rounds**: ``accumulate=torch.float64`` holds
  :math:`\Omega`, :math:`Y` and the products with float32 factors in float64 (the
  factors' blocks are widened per pass), so a float32 model's sketch resolves the
  eigenvalues below ``eps32 * lambda_max`` that a float32 :math:`Y` rounds away; the
  eigenvectors are rounded to the factors' dtype once, at the end. It costs about
  twice the float32 sketch, so a fit sketches in float32 first and redoes the pass in
  float64 only when a kept eigenvalue is within ``RESOLVED_RATIO`` of the rounding
  shift (:meth:`SketchMerge.resolves`) and the ``D x l`` float64 matrix is small
  against the memory budget (:data:`~lowrank_laplace.fitting.plan.WIDE_SKETCH_SHARE`).
- **Linear in the data**: sketches of several processes (same :math:`\Omega`) simply
  add, so data-parallel fits all-reduce ``Y`` and equal the single-process sketch.

Shape glossary:
    D: parameters; l: sketch size (rank + oversampling); M: columns of a batch factor.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from lowrank_laplace.factor import Block, cat_blocks
from lowrank_laplace.fitting.base import Solver
from lowrank_laplace.fitting.nystrom import nystrom_core, nystrom_eigenpairs, sub_sketch_share
from lowrank_laplace.fitting.omega import BasisOmega, Omega

#: Factored linear-layer blocks of consecutive passes are added to the sketch together,
#: up to this many samples per parameter and this many bytes of queued factors in all:
#: the product writes the whole ``d x l`` slice of the sketch, so few samples per
#: product are memory-bound and larger products are markedly faster for large layers
#: (docs/benchmarks/design_measurements.md).
_KRON_SAMPLES = 256
_KRON_BYTES = 64 * 2**20
#: The test matrix of the fit's sketches: ``"kronecker"`` draws Khatri-Rao columns in
#: the slices of matrix-shaped weights, so the factored linear layers' products with it
#: come from their Kronecker factors and the slices are kept as those factors;
#: ``"gaussian"`` draws every entry Gaussian (``benchmarks/bench_sketch_test_matrix.py``).
TEST_MATRIX = "kronecker"
#: A float32 sketch keeps its eigenpairs when every kept eigenvalue is this many times
#: its rounding shift ``nu`` (accurate to about its inverse); else the fit redoes it in float64
#: (:meth:`SketchMerge.resolves`).
RESOLVED_RATIO = 1e3


class SketchMerge(Solver):
    """Accumulates ``H = sum_b V_b V_b^T`` as a one-pass Nyström sketch ``Y = H Omega``.

    A sibling of :class:`~lowrank_laplace.fitting.streaming.StreamingMerge` (same
    interface); the eigendecomposition is formed once, when :meth:`result` or
    :attr:`eigenvectors` is first read.

    Args:
        rank: Number of eigenpairs kept in the end (``r >= 1``).
        oversampling: Extra sketch columns (``p >= 0``); the sketch has
            ``l = r + p`` columns and the truncation to ``r`` improves with ``p``.
        track_diagonal: Also accumulate the exact diagonal of the sum.
        seed: Seed of the test matrix ``Omega`` (drawn on the device of the first
            factor); processes that merge their sketches need the same seed.
        test_matrix: ``"kronecker"`` (default): the slice of a matrix-shaped weight
            ``(out, in)`` in every column of ``Omega`` is a Khatri-Rao column
            ``p_k (x) q_k`` of two Gaussian vectors, so a factored linear-layer
            block's ``V_b^T Omega_b`` is ``(S p_k) * (Z q_k)``, without the
            ``N x out x in`` product per column, and the slice is kept as ``p`` and
            ``q`` (``l (out + in)`` numbers, not ``l out in``); other slices stay
            Gaussian. ``"gaussian"``: every entry is Gaussian (the setting of Tropp
            et al.'s error bound). Both have entries of variance ``1 / D``,
            uncorrelated, so ``E[Omega Omega^T] = l I / D``.
        accumulate: The dtype of ``Omega``, the sketch and its products (e.g.
            ``torch.float64`` for float32 factors, whose blocks are then widened per
            pass); ``None``: the factors' dtype. Low-memory (recomputed) factors
            need ``None``.
        basis: A warm start: ``b`` known directions, shape ``(D, b)`` (e.g. the
            eigenvectors of an earlier fit of a model that has moved since), taken
            as the first ``b`` of the ``l`` test columns
            (:class:`~lowrank_laplace.fitting.omega.BasisOmega`); the other
            ``l - b`` are random. ``None``: all random.

    Raises:
        ValueError: For ``rank < 1``, negative oversampling or an unknown
            ``test_matrix``.
    """

    path = "sketch"

    def __init__(self, rank: int, oversampling: int = 0, track_diagonal: bool = False,
                 seed: int = 0, test_matrix: str = "kronecker",
                 accumulate: Optional[torch.dtype] = None, basis: Optional[Tensor] = None):
        super().__init__(rank, oversampling, track_diagonal)
        if basis is not None and not 0 < basis.shape[1] < self.keep:
            raise ValueError(
                f"A warm-start basis needs between 1 and {self.keep - 1} columns (fewer "
                f"than the sketch's {self.keep}), got {basis.shape[1]}."
            )
        if test_matrix not in ("kronecker", "gaussian"):
            raise ValueError(
                f"test_matrix must be 'kronecker' or 'gaussian', got {test_matrix!r}."
            )
        self.test_matrix = test_matrix
        self.seed = int(seed)
        self.accumulate = accumulate
        self._dtype: Optional[torch.dtype] = None  # the factors' dtype (of the result)
        self.basis = basis  # the warm start's columns, until the test matrix is drawn
        self.warm_columns = 0 if basis is None else basis.shape[1]
        self._omega: Optional[Union[Omega, BasisOmega]] = None  # the test matrix
        self._projection: Optional[Tensor] = None  # Omega formed, for low-memory passes
        self._sketch: Optional[Tensor] = None  # Y = H Omega, laid out like Omega
        self.shift: Optional[float] = None  # nu of the last finalisation
        self._convergence = 1.0  # sub_sketch_share of the last finalisation
        self._vectors: Optional[Tensor] = None  # the eigenvectors, once finalised
        # parameter index -> (blocks, scaled V^T Omega rows, sketch slice) not yet added
        self._kron: Dict[int, Tuple[List[Block], List[Tensor], Tensor]] = {}

    # ------------------------------------------------------------------ streaming
    def _test_matrix(self, dim: int, like: Tensor,
                     shapes: Optional[List[torch.Size]] = None) -> Omega:
        """The test matrix (:class:`~lowrank_laplace.fitting.omega.Omega`), drawn once.

        At most ``D`` columns (more could not be independent). With ``shapes`` (the
        group's parameter shapes, in order) and ``test_matrix="kronecker"``, the slices
        of matrix-shaped parameters are Khatri-Rao columns kept as their factors; the
        sketch is stored like the Gaussian slices, as a ``(D, l)`` view of an
        ``(l, D)`` tensor: adding a convolution's block ``V_b (V_b^T Omega)`` into wide
        ``l x d`` rows is faster than into narrow ``d x l`` ones
        (docs/benchmarks/design_measurements.md).
        """
        if self._omega is None:
            self._omega = Omega(min(self.keep, dim) - self.warm_columns, dim, like, self.seed,
                                shapes, kronecker=self.test_matrix == "kronecker")
            if self.basis is not None:
                self._omega = BasisOmega(self.basis, self._omega)
                self.basis = None  # the test matrix holds its copy
        return self._omega

    def add_factor(self, factor: Any, group: int = 0, scale: float = 1.0) -> None:
        """Add ``scale * V V^T Omega`` of one group of a batch factor to the sketch.

        Args:
            factor: Batch factor (blocks kept, or a low-memory recomputed factor).
            group: Group index.
            scale: Non-negative factor applied to the batch's GGN.
        """
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
        elif self._queued_bytes() >= _KRON_BYTES:
            self._add_deferred()

    def _queued_bytes(self) -> int:
        """Bytes of the queued factors (a batch's ``V^T Omega`` counted per parameter)."""
        return sum(b.nbytes + p.numel() * p.element_size()
                   for blocks, projs, _ in self._kron.values()
                   for b, p in zip(blocks, projs))

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
        """The test matrix, whose products ``V^T Omega`` every factor must offer.

        Low-memory passes need it formed (``D x l``; their blocks are gone before the
        merge sees them), so it is formed once, here.

        Returns:
            The formed test matrix (empty before it is drawn).
        """
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
            shapes: The group's parameter shapes, in order (``None``: an all-Gaussian
                test matrix); factors of the group then find the same test matrix
                they would have drawn.
        """
        self._test_matrix(dim, like, shapes)

    def add_lowrank(self, eigenvectors: Tensor, eigenvalues: Tensor, trace: Tensor,
                    diagonal: Optional[Tensor] = None) -> None:
        """Add the sketch of another eigendecomposition, ``U diag(lambda) U^T Omega``.

        The arguments are those of :meth:`~lowrank_laplace.fitting.base.Solver.add_lowrank`.
        """
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
        """Sum the sketches, traces and diagonals of all processes of a group.

        Every process drew the same test matrix (same seed and device type), so the
        summed sketch is the sketch of the whole data set, and every process ends
        with the same result as a single process would.

        Args:
            group: The process group (e.g. ``torch.distributed.group.WORLD``).

        Raises:
            RuntimeError: If some process sketched nothing.
        """
        import torch.distributed as dist

        if self._sketch is None:
            raise RuntimeError("merge_across needs a local sketch on every process.")
        self._add_deferred()
        dist.all_reduce(_storage(self._sketch), group=group)
        self.sum_trace_across(group)
        if self.track_diagonal:
            dist.all_reduce(self.diagonal, group=group)

    # ---------------------------------------------------------------- finalising
    def resolves(self, ratio: Optional[float] = None) -> bool:
        """Whether every kept eigenvalue is ``ratio`` times clear of the rounding shift.

        The Nyström eigenvalues carry rounding of the order of the shift ``nu``
        (``~2 eps ||Y||_F``), so those above ``ratio * nu`` are accurate to about
        ``1 / ratio``; a float32 sketch that fails this is redone in float64 by the fit.
        Finalises the sketch.

        Args:
            ratio: Smallest admissible ``lambda_kept / nu`` (``None``:
                :data:`RESOLVED_RATIO`).

        Returns:
            ``True`` also when nothing was kept.
        """
        self._finalize_sketch()
        lam = self.eigenvalues
        if lam is None or lam.numel() == 0 or self.shift is None:
            return True
        ratio = RESOLVED_RATIO if ratio is None else ratio
        return float(lam[: self.rank].min()) >= ratio * self.shift

    @property
    def convergence(self) -> float:
        """:func:`sub_sketch_share` of the sketch: ``1.0`` where it converged (finalises it)."""
        self._finalize_sketch()
        return self._convergence

    @property
    def eigenvectors(self) -> Optional[Tensor]:
        """The leading orthonormal eigenvectors of the sketch's approximation."""
        self._finalize_sketch()
        return self._vectors

    def _finalize_sketch(self) -> None:
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
        self._convergence = sub_sketch_share(chol, gram, self.shift, self.rank, half)


def _storage(mat: Tensor) -> Tensor:
    """The contiguous tensor behind a matrix or its transpose (collectives need one)."""
    if mat.is_contiguous():
        return mat
    if mat.T.is_contiguous():
        return mat.T
    raise ValueError("The sketch must be contiguous or a transposed contiguous tensor.")
