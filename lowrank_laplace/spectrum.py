"""Exact GGN spectrum from the small Gram matrix ``V^T V``.

``V^T V`` and ``G = V V^T`` share all nonzero eigenvalues; a Gram eigenvector ``g_k`` gives
the GGN eigenvector ``e_k = V g_k / sqrt(lambda_k)`` (concepts page, "The Gram matrix").

Shape glossary:
    M: columns of ``V``; D: parameters in a group; K: selected eigenpairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn

from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.factor import GGNFactor
from lowrank_laplace.minibatch import MiniBatch, take_options


@dataclass
class LowRankGGN:
    r"""Selected eigenpairs of a (mini-batch) GGN: :math:`G_K = U \mathrm{diag}(\lambda) U^\top`.

    Attributes:
        eigenvalues: Selected eigenvalues, descending, ``(K,)``.
        eigenvectors: Orthonormal eigenvectors, flat in the group's parameter order, ``(D, K)``.
        trace: Exact trace of the GGN (the sum of *all* its eigenvalues).
        all_eigenvalues: Every nonzero eigenvalue, descending (``None`` after ARPACK).
        shapes: Shapes of the group's parameters.
        backend: The engine that computed ``V`` (``'backpack'``, ``'hooks'``, ``'functorch'``).
    """

    eigenvalues: Tensor
    eigenvectors: Tensor
    trace: Tensor
    all_eigenvalues: Optional[Tensor]
    shapes: List[torch.Size]
    backend: str = ""

    @property
    def kept_fraction(self) -> Tensor:
        """Fraction of the GGN trace the selection keeps (1 for a zero GGN)."""
        trace = torch.as_tensor(self.trace)
        if not bool(trace > 0):
            return torch.ones((), dtype=trace.dtype, device=trace.device)
        return self.eigenvalues.sum() / trace

    def eigenvectors_per_param(self) -> List[Tensor]:
        """Return the eigenvectors split per parameter, each ``(K, *param.shape)``."""
        sizes = [s.numel() for s in self.shapes]
        parts = torch.split(self.eigenvectors, sizes, dim=0)
        return [p.T.reshape(-1, *s) for p, s in zip(parts, self.shapes)]

    def matvec(self, x: Tensor) -> Tensor:
        r"""Return the truncated GGN times ``x``, :math:`U \mathrm{diag}(\lambda) U^\top x`.

        Args:
            x: Shape ``(D,)`` or ``(D, K')``, as is the result's.
        """
        U = self.eigenvectors
        return U @ ((self.eigenvalues[:, None] if x.ndim == 2 else self.eigenvalues) * (U.T @ x))


def nonzero_tolerance(eigenvalues: Tensor, dim: int) -> float:
    """Return ``max|eigenvalues| * dim * eps``, below which a Gram eigenvalue counts as zero.

    As for a numerical rank: the Gram's entries carry rounding errors of ``eps * max``.

    Args:
        eigenvalues: Eigenvalues of the Gram matrix.
        dim: Size of the Gram matrix.
    """
    if eigenvalues.numel() == 0:
        return 0.0
    top = float(eigenvalues.abs().max())
    return top * max(dim, 1) * torch.finfo(eigenvalues.dtype).eps


def select(eigenvalues: Tensor, top_k: Optional[int] = None, threshold: Optional[float] = None,
           indices: Optional[Sequence[int]] = None) -> Tensor:
    """Return the positions (long tensor) of the chosen ones of descending nonzero eigenvalues.

    Args:
        eigenvalues: Descending nonzero eigenvalues, shape ``(R,)``.
        top_k: Keep the ``top_k`` largest (``None``: all).
        threshold: Keep eigenvalues ``>= threshold``.
        indices: Keep these positions of the descending spectrum.

    Raises:
        ValueError: For invalid or conflicting criteria.
    """
    num = eigenvalues.numel()
    if indices is not None:
        if top_k is not None or threshold is not None:
            raise ValueError("Pass either indices or top_k/threshold, not both.")
        idx = [int(i) for i in indices]
        if len(set(idx)) != len(idx):
            raise ValueError(f"indices contains duplicates: {list(indices)!r}.")
        if any(i < 0 or i >= num for i in idx):
            raise ValueError(f"indices must lie in [0, {num}) (number of nonzero eigenvalues).")
        return torch.tensor(idx, dtype=torch.long)
    keep = torch.arange(num)
    if threshold is not None:
        keep = keep[eigenvalues.cpu() >= threshold]
    if top_k is not None:
        keep = keep[: _check_top_k(top_k)]
    return keep


def _check_top_k(top_k) -> int:
    if isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1:
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}.")
    return int(top_k)


SOLVERS = ("auto", "eigh", "arpack", "matrix_free")


def gram_eigh(factor: GGNFactor, group: int = 0, top_k: Optional[int] = None,
              threshold: Optional[float] = None, indices: Optional[Sequence[int]] = None,
              solver: str = "auto") -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Return ``(eigenvalues (K,), Gram eigenvectors (M, K), all nonzero eigenvalues)``.

    Of one group's ``V^T V``; the last is ``None`` unless ``'eigh'`` ran.

    Args:
        factor: The GGN factor.
        group: Group index.
        top_k: Number of leading eigenpairs (``None``: all nonzero ones).
        threshold: Keep eigenvalues ``>= threshold``.
        indices: Keep these positions of the descending nonzero spectrum.
        solver: ``'eigh'`` (full eigendecomposition, every nonzero eigenvalue),
            ``'arpack'`` (the ``top_k`` leading Gram eigenpairs by scipy's ``eigsh``, float64,
            to machine precision), ``'matrix_free'`` (ARPACK on ``V^T (V x)``, no Gram; needs
            kept blocks) or ``'auto'`` (``'arpack'`` on the CPU for ``top_k < M / 4``).

    Raises:
        ValueError: For an unknown solver, or an ARPACK solver without ``top_k``.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}.")
    if top_k is not None:
        _check_top_k(top_k)
    only_top = top_k is not None and threshold is None and indices is None
    if solver in ("arpack", "matrix_free") and not only_top:
        raise ValueError(f"solver={solver!r} computes top_k eigenpairs only: pass top_k.")
    num_cols = factor.num_columns
    if solver != "matrix_free":  # every other path needs the Gram: its diagonal is the trace
        factor.gram(group)
    if not bool(factor.trace(group) > 0):  # a zero GGN has no nonzero eigenpairs
        dtype, device = factor.grad_dtype(), factor.grad_device()
        empty = torch.zeros(0, dtype=dtype, device=device)
        return empty, torch.zeros(num_cols, 0, dtype=dtype, device=device), empty
    if solver == "auto":  # ARPACK on the CPU for a small top_k
        small_k = only_top and top_k < num_cols / 4
        solver = "arpack" if small_k and factor.grad_device().type == "cpu" else "eigh"
    if solver != "eigh" and top_k < num_cols - 1:
        return (*_arpack(factor, group, int(top_k), solver == "matrix_free"), None)
    evals, evecs = torch.linalg.eigh(factor.gram(group))
    evals, evecs = evals.flip(0), evecs.flip(1)
    nonzero = evals > nonzero_tolerance(evals, num_cols)
    evals, evecs = evals[nonzero], evecs[:, nonzero]
    keep = select(evals, top_k, threshold, indices).to(evals.device)
    return evals[keep], evecs[:, keep], evals


def _arpack(factor: GGNFactor, group: int, k: int, matrix_free: bool) -> Tuple[Tensor, Tensor]:
    """Top-k Gram eigenpairs by ARPACK (implicitly restarted Lanczos)."""
    from scipy.sparse.linalg import LinearOperator, eigsh

    num_cols = factor.num_columns
    if matrix_free:
        dtype, device = factor.grad_dtype(), factor.grad_device()

        def gram_mv(x: np.ndarray) -> np.ndarray:
            xt = torch.from_numpy(np.asarray(x, dtype=np.float64)).reshape(num_cols, -1)
            xt = xt.to(device=device, dtype=dtype)
            out = factor.t_matmul(factor.matmul(xt, group), group)
            return out.double().cpu().numpy().reshape(x.shape)

        op = LinearOperator((num_cols, num_cols), matvec=gram_mv, matmat=gram_mv,
                            dtype=np.float64)
    else:
        gram = factor.gram(group)
        dtype, device = gram.dtype, gram.device
        op = gram.detach().double().cpu().numpy()
    # fixed start vector: results do not depend on numpy's global random state
    v0 = np.ones(num_cols) / np.sqrt(num_cols)
    evals, evecs = eigsh(op, k=k, which="LA", tol=0, v0=v0)
    order = np.argsort(evals)[::-1].copy()
    evals = torch.from_numpy(evals[order].copy()).to(device=device, dtype=dtype)
    evecs = torch.from_numpy(evecs[:, order].copy()).to(device=device, dtype=dtype)
    positive = evals > 0
    return evals[positive], evecs[:, positive]


def to_parameter_space(factor: GGNFactor, evals: Tensor, gram_evecs: Tensor,
                       group: int = 0) -> Tensor:
    """Return the orthonormal GGN eigenvectors ``e_k = V g_k / sqrt(lambda_k)``, ``(D, K)``.

    Args:
        factor: The GGN factor (with kept blocks).
        evals: Eigenvalues, shape ``(K,)``, all positive.
        gram_evecs: Gram eigenvectors, shape ``(M, K)``.
        group: Group index.
    """
    return factor.matmul(gram_evecs / evals.sqrt(), group)


def lowrank_ggn(factor: GGNFactor, group: int = 0, top_k: Optional[int] = None,
                threshold: Optional[float] = None, indices: Optional[Sequence[int]] = None,
                solver: str = "auto") -> LowRankGGN:
    """Return the selected eigenpairs, exact trace and (``'eigh'``) spectrum of a group's GGN.

    Args:
        factor: The GGN factor with kept blocks.
        group: Group index.
        top_k: Number of leading eigenpairs (``None``: all nonzero ones).
        threshold: Keep eigenvalues ``>= threshold``.
        indices: Keep these positions of the descending nonzero spectrum.
        solver: See :func:`gram_eigh`.
    """
    evals, gvecs, all_evals = gram_eigh(factor, group, top_k, threshold, indices, solver)
    return LowRankGGN(evals, to_parameter_space(factor, evals, gvecs, group), factor.trace(group),
                      all_evals, [factor.shapes[i] for i in factor.groups[group]], factor.backend)


def ggn_eigh(model: nn.Module, loss_func: nn.Module, inputs: Tensor, targets: Tensor,
             top_k: Optional[int] = 10, **options: Any
             ) -> Union[LowRankGGN, List[LowRankGGN]]:
    """Return the eigenpairs of a mini-batch GGN from ``V`` of one backward pass.

    A :class:`LowRankGGN`, or a list with one per group with ``param_groups``. The GGN follows
    the loss's reduction (mean or sum of the per-sample GGNs).

    Args:
        model: The network (left unchanged; no hooks remain).
        loss_func: ``nn.CrossEntropyLoss`` or ``nn.MSELoss``.
        inputs: Inputs, shape ``(N, ...)``.
        targets: Targets, shape ``(N,)`` or ``(N, C)``.
        top_k: Number of leading eigenpairs; ``None`` for all nonzero ones.
        **options: ``threshold``, ``indices`` and ``solver`` as in :func:`gram_eigh`
            (``'matrix_free'`` needs all of ``V``), and the fields of
            :class:`~lowrank_laplace.minibatch.CurvatureOptions`.

    Raises:
        ValueError: For ``low_memory=True`` with ``solver='matrix_free'``.
        MemoryError: If ``V`` (or with ``low_memory`` its largest block) would not fit.
        TypeError: For an unknown keyword option.
    """
    curvature, extra = take_options(options, ("threshold", "indices", "solver"), "ggn_eigh")
    select = (top_k, extra.get("threshold"), extra.get("indices"), extra.get("solver", "auto"))
    batch = MiniBatch(model, loss_func, inputs, targets, curvature)
    if not curvature.low_memory:
        with batch.engine("ggn_eigh") as engine:
            factor = batch.compute(engine)
        return batch.results([lowrank_ggn(factor, g, *select)
                              for g in range(len(factor.groups))])
    if select[3] == "matrix_free":
        raise ValueError("solver='matrix_free' needs all of V: use low_memory=False.")
    with batch.engine("ggn_eigh") as engine:
        return batch.results(_two_pass_eigh(engine, batch.pass_args, *select))


def _two_pass_eigh(engine: FactorEngine, args: tuple, top_k, threshold, indices,
                   solver: str) -> List[LowRankGGN]:
    """Eigenpairs per group from a Gram pass and a projection pass (``low_memory``)."""
    selected = []

    def coefficients(grams: GGNFactor) -> List[Tensor]:
        selected.extend(gram_eigh(grams, g, top_k, threshold, indices, solver)
                        for g in range(len(grams.groups)))
        return [gvecs / evals.sqrt() for evals, gvecs, _ in selected]

    grams, projected = engine.gram_and_projection(*args, coefficients)
    return [LowRankGGN(evals, projected.projected_flat(g), grams.trace(g), all_evals,
                       [grams.shapes[i] for i in grams.groups[g]], grams.backend)
            for g, (evals, _, all_evals) in enumerate(selected)]


def ggn_eigvals(model: nn.Module, loss_func: nn.Module, inputs: Tensor, targets: Tensor,
                **options: Any) -> Union[Tensor, List[Tensor]]:
    """Return all nonzero GGN eigenvalues, descending (a tensor per group with ``param_groups``).

    Holds only each group's Gram matrix: every block of ``V`` is freed during backward.

    Args:
        model: The network (left unchanged).
        loss_func: ``nn.CrossEntropyLoss`` or ``nn.MSELoss``.
        inputs: Inputs, shape ``(N, ...)``.
        targets: Targets.
        **options: The fields of :class:`~lowrank_laplace.minibatch.CurvatureOptions`
            (``low_memory`` is implied).

    Raises:
        MemoryError: If the largest block of ``V`` would not fit.
        TypeError: For an unknown keyword option.
    """
    curvature, _ = take_options(options, (), "ggn_eigvals")
    batch = MiniBatch(model, loss_func, inputs, targets, curvature)
    with batch.engine("ggn_eigvals", low_memory=True) as engine:
        factor = batch.compute(engine, keep_blocks=False, compute_grams=True)
    return batch.results([gram_eigh(factor, g)[2] for g in range(len(factor.groups))])
