r"""The Nyström approximation of a sketch ``Y = H Omega``: its eigenpairs and its check.

Tropp, Yurtsever, Udell and Cevher (2017), "Fixed-rank approximation of a
positive-semidefinite matrix from streaming data", Algorithm 3: the stable evaluation of
:math:`\hat H = Y (\Omega^\top Y)^{+} Y^\top` with a small shift :math:`\nu`
(:func:`nystrom_core`, :func:`nystrom_eigenpairs`), and the convergence check of
:class:`~lowrank_laplace.fitting.sketch.SketchMerge` from the same small matrices
(:func:`sub_sketch_share`).

Shape glossary:
    D: parameters; l: sketch columns.
"""

from __future__ import annotations

import math
from typing import Any, Tuple

import torch
from torch import Tensor

from lowrank_laplace.utils.linalg import rotate, stored_transposed, sym_eigh


def nystrom_core(Y: Tensor, omega: Any) -> Tuple[Tensor, float]:
    """The shifted sketch ``Y_nu`` (in place) and the Cholesky factor of its core.

    Tropp et al.'s stable evaluation of the Nyström approximation
    ``Y (Omega^T Y)^+ Y^T``: ``Y_nu = Y + nu Omega`` and ``B = Omega^T Y_nu = C^T C``
    (Cholesky); :func:`nystrom_eigenpairs` takes it from there, without the test matrix.

    Args:
        Y: The sketch ``H Omega``, ``(D, l)``; overwritten by ``Y_nu``.
        omega: The test matrix (:class:`~lowrank_laplace.fitting.omega.Omega` or
            :class:`~lowrank_laplace.fitting.omega.BasisOmega`).

    Returns:
        ``(C, nu)``: the upper Cholesky factor, float64 ``(l, l)``, and the shift.

    Raises:
        RuntimeError: For a sketch that is not finite, or a core that stays indefinite.
    """
    eps = torch.finfo(Y.dtype).eps
    # nu: large enough that B is positive definite despite rounding. Tropp et
    # al.'s sqrt(D) eps ||Y|| bounds the worst case of a working-precision
    # product, but every Nyström eigenvalue picks up a share of nu's mass in all
    # D directions, which moved the smallest kept eigenvalues on float32 tests.
    # The typical rounding is ~eps ||Y||_F (test columns of about unit norm), and
    # a Cholesky failure raises nu tenfold
    norm = float(torch.linalg.vector_norm(Y))
    if not math.isfinite(norm):
        raise RuntimeError("The sketch is not finite: the GGN factors were not.")
    nu = 2 * eps * norm if norm > 0 else 1.0
    omega.add_to_(Y, nu)  # Y_nu, in place
    B = omega.t_matmul(Y).double()
    gram_o = None
    for _ in range(8):
        chol, info = torch.linalg.cholesky_ex((B + B.T) / 2, upper=True)
        if int(info) == 0:
            return chol, nu
        # rounding beyond the estimate: a larger shift
        gram_o = omega.gram().double() if gram_o is None else gram_o
        omega.add_to_(Y, 9 * nu)
        B, nu = B + 9 * nu * gram_o, 10 * nu
    raise RuntimeError("The Nyström core stayed indefinite.")


def nystrom_eigenpairs(Y: Tensor, chol: Tensor, nu: float, rank: int
                       ) -> Tuple[Tensor, Tensor]:
    """The leading eigenpairs of the Nyström approximation, from :func:`nystrom_core`.

    ``E = Y_nu C^{-1}`` (so ``H_nu = E E^T``), whose singular pairs give the
    eigenpairs. ``E`` is conditioned like the square root of the approximation,
    so its Gram matrix in working precision resolves them as the streaming
    merge's Gram matrices do (``Y_nu``'s own Gram matrix would square ``H``'s
    condition number instead).

    Args:
        Y: The shifted sketch ``Y_nu``, ``(D, l)``; overwritten.
        chol: The upper Cholesky factor ``C`` of its core.
        nu: The shift.
        rank: Eigenpairs wanted.

    Returns:
        ``(vectors, eigenvalues, E^T E)``: at most ``rank`` eigenpairs above the
        rounding shift (at least one), in ``Y``'s dtype, and the float64 ``(l, l)``
        Gram matrix of ``E`` (for :func:`sub_sketch_share`).
    """
    dtype, eps = Y.dtype, torch.finfo(Y.dtype).eps
    eye = torch.eye(chol.shape[0], dtype=chol.dtype, device=chol.device)
    inv = torch.linalg.solve_triangular(chol, eye, upper=True)  # C^{-1}
    # E = Y_nu C^{-1} explicitly, in place: its Gram matrix has the condition
    # number of the square root of H, where Y_nu's own would square H's
    E = rotate(Y, inv.to(dtype), in_place=True)
    gram = (E.T @ E).double()
    sigma2, W = sym_eigh(gram)
    lam = sigma2 - nu
    tol = max(float(lam[0]) * 10 * eps, nu)  # below the shift: rounding
    num = max(1, min(rank, int((lam > tol).sum())))
    # the first num left singular vectors E W sigma^-1, in E's layout; E is freed
    W = (W[:, :num] / sigma2[:num].clamp(min=nu).sqrt()).to(dtype)
    vectors = (W.T @ E.T).T if stored_transposed(E) else E @ W
    return vectors, lam[:num], gram


def sub_sketch_share(chol: Tensor, gram: Tensor, nu: float, rank: int, columns: int
                     ) -> float:
    r"""How much of the kept eigenvalues' sum the sketch's first ``columns`` columns give.

    The Nyström approximation of a column subset ``S`` of the test matrix is that of the
    sketch ``Y_S``: its eigenvalues are those of :math:`B_S^{-1/2} (Y^\top Y)_{SS}
    B_S^{-1/2}` less the shift, with :math:`B = \Omega^\top Y = C^\top C` and
    :math:`Y^\top Y = C^\top (E^\top E) C`, so nothing of size ``D`` is touched. A
    sketch whose leading eigenvalues still grow when the second half of its columns is
    added has not converged: the GGN's spectrum is too flat for its columns, and its
    eigenvalues under-estimate the exact ones by more than the growth says.

    Args:
        chol: The upper Cholesky factor ``C`` of the sketch's core (float64, ``(l, l)``).
        gram: ``E^T E`` (float64, ``(l, l)``) of :func:`nystrom_eigenpairs`.
        nu: The shift.
        rank: Eigenpairs kept.
        columns: The subset: the first ``columns`` columns.

    Returns:
        The subset's sum of its leading ``rank`` eigenvalues over the whole sketch's
        (``1.0`` where the subset is the whole sketch).
    """
    if columns >= chol.shape[0] or columns < 1:
        return 1.0
    core = chol.T @ chol
    full_gram = chol.T @ gram @ chol  # Y_nu^T Y_nu
    sub = torch.linalg.cholesky_ex(core[:columns, :columns], upper=True)[0]
    inv = torch.linalg.solve_triangular(
        sub, torch.eye(columns, dtype=sub.dtype, device=sub.device), upper=True)
    sigma2, _ = sym_eigh(inv.T @ full_gram[:columns, :columns] @ inv)
    sums = [float((values[:rank] - nu).clamp(min=0).sum())
            for values in (sigma2, torch.linalg.eigvalsh(gram).flip(0))]
    return sums[0] / sums[1] if sums[1] > 0 else 1.0
