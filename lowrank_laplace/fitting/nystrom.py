r"""Nyström eigenpairs of a sketch ``Y = H Omega`` and their check (Tropp et al., 2017).

Stable evaluation with a shift ``nu`` (docs/concepts.md, "One-pass sketch").
"""

from __future__ import annotations

import math
from typing import Any, Tuple

import torch
from torch import Tensor

from lowrank_laplace.utils.linalg import rotate, stored_transposed, sym_eigh


def nystrom_core(Y: Tensor, omega: Any) -> Tuple[Tensor, float]:
    """Return ``(C, nu)``: the upper Cholesky factor of ``Omega^T Y_nu = C^T C`` and the shift.

    ``C`` is float64 ``(l, l)``; ``Y_nu = Y + nu Omega`` is formed in place.

    Args:
        Y: The sketch ``H Omega``, ``(D, l)``; overwritten by ``Y_nu``.
        omega: The test matrix (``Omega`` or ``BasisOmega``).

    Raises:
        RuntimeError: For a sketch that is not finite, or a core that stays indefinite.
    """
    eps = torch.finfo(Y.dtype).eps
    # nu ~ the typical rounding, not Tropp et al.'s worst case (docs/concepts.md)
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
        gram_o = omega.gram().double() if gram_o is None else gram_o
        omega.add_to_(Y, 9 * nu)
        B, nu = B + 9 * nu * gram_o, 10 * nu
    raise RuntimeError("The Nyström core stayed indefinite.")


def nystrom_eigenpairs(Y: Tensor, chol: Tensor, nu: float, rank: int
                       ) -> Tuple[Tensor, Tensor]:
    """Return the Nyström ``(vectors, eigenvalues, E^T E)``, ``E = Y_nu C^{-1}``.

    At most ``rank`` (at least one) eigenpairs above the shift, in ``Y``'s dtype; the
    Gram matrix ``(l, l)`` in float64.

    Args:
        Y: The shifted sketch ``Y_nu``, ``(D, l)``; overwritten.
        chol: The upper Cholesky factor ``C`` of its core.
        nu: The shift.
        rank: Eigenpairs wanted.
    """
    dtype, eps = Y.dtype, torch.finfo(Y.dtype).eps
    eye = torch.eye(chol.shape[0], dtype=chol.dtype, device=chol.device)
    inv = torch.linalg.solve_triangular(chol, eye, upper=True)  # C^{-1}
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
    r"""Return the first ``columns`` columns' sum of leading eigenvalues over the sketch's.

    Below one, the eigenvalues were still growing: the sketch has not converged
    (docs/concepts.md, "One-pass sketch"); ``1.0`` where the subset is the whole sketch.

    Args:
        chol: The upper Cholesky factor ``C`` of the core (float64, ``(l, l)``).
        gram: ``E^T E`` of :func:`nystrom_eigenpairs`.
        nu: The shift.
        rank: Eigenpairs kept.
        columns: The subset's size.
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
