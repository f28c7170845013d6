r"""Low-rank plus diagonal posterior precision: solves, log-determinants, samples.

``P = U diag(ell) U^T + diag(d)`` through its ``r x r`` capacitance matrix, nothing
``O(D^2)`` (docs/concepts.md, "The posterior precision").

Shape glossary:
    D: parameters; r: rank; B: inputs; C: outputs; K: vectors.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from lowrank_laplace.posterior.null import NullShift
from lowrank_laplace.utils.linalg import squared_rows_dot, wide_inner

_ROWS = 2**18  # rows per chunk of D x r products with a diagonal


class GramCache:
    """``U^T U`` (and its layers' blocks) in float64, recomputed only for a new ``U``.

    A weak reference and the version counter identify ``U`` (no old basis kept alive).
    """

    def __init__(self):
        self._ref, self._version, self._gram, self._layers = None, None, None, None

    def __getstate__(self) -> dict:
        """Pickle empty: the Gram matrix is derived, and a weak reference cannot be."""
        return {"_ref": None, "_version": None, "_gram": None, "_layers": None}

    def _current(self, U: Tensor) -> None:
        """Forget everything derived from another ``U`` (or another version of it)."""
        if self._ref is None or self._ref() is not U or self._version != U._version:
            self._gram, self._layers = None, None
            self._ref, self._version = weakref.ref(U), U._version

    def get(self, U: Tensor) -> Tensor:
        """The float64 Gram matrix of ``U``, shape ``(r, r)``."""
        self._current(U)
        if self._gram is None:
            self._gram = wide_inner(U)
        return self._gram

    def layer_grams(self, U: Tensor, sizes: Sequence[int]) -> Tensor:
        """Return the float64 ``U_l^T U_l``, ``(L, r, r)``, of ``U``'s blocks of ``sizes`` rows."""
        self._current(U)
        sizes = tuple(int(n) for n in sizes)
        if self._layers is None or self._layers[0] != sizes:
            grams = torch.stack([wide_inner(part) for part in U.split(list(sizes))])
            self._layers = (sizes, grams)
        return self._layers[1]


class LowRankPrecision:
    r"""The matrix :math:`P = U \mathrm{diag}(\ell) U^\top + \mathrm{diag}(d)`.

    Args:
        eigenvectors: Orthonormal ``U``, ``(D, r)``.
        eigenvalues: ``ell > 0``, ``(r,)`` (scaled by ``1/sigma^2/T``).
        prior_precision: ``d``, a scalar tensor or ``(D,)``.
        logdet_offset: Added to :meth:`logdet` (a residual model's); ``None``: none.
        gram_cache: A :class:`GramCache` shared by posteriors of the same ``U``.
        layers: ``(sizes, d_l)`` for ``d`` constant over row blocks: the capacitance
            then costs ``O(L r^2)`` (used where ``L r <= D``).
        null: Null directions of the GGN whose variance is the prior's, not ``1 / d``
            (every product but :meth:`logdet`, which the residual model's offset holds), or
            a function returning them, called when a product first needs them.
    """

    def __init__(self, eigenvectors: Tensor, eigenvalues: Tensor, prior_precision: Tensor,
                 logdet_offset: Optional[Tensor] = None, gram_cache: Optional[GramCache] = None,
                 layers: Optional[Tuple[Sequence[int], Tensor]] = None,
                 null: Union[None, NullShift, Callable[[], Optional[NullShift]]] = None):
        self.U, self._null = eigenvectors, null
        self.layers = layers if layers is not None and \
            len(layers[0]) * eigenvectors.shape[1] <= eigenvectors.shape[0] else None
        self.gram_cache = gram_cache if gram_cache is not None else GramCache()
        self.logdet_offset = logdet_offset
        self.ell = eigenvalues
        prior_precision = torch.as_tensor(prior_precision, dtype=eigenvectors.dtype,
                                          device=eigenvectors.device)
        self.isotropic = prior_precision.numel() == 1
        self.d = prior_precision.reshape(()) if self.isotropic else prior_precision
        self._sqrt_parts = None

    @functools.cached_property
    def null(self) -> Optional[NullShift]:
        """The null directions' correction (``None``: none)."""
        return self._null() if callable(self._null) else self._null

    @property
    def dim(self) -> int:
        """Dimension ``D``."""
        return self.U.shape[0]

    def w_over_d(self) -> Tensor:
        """``P_0^{-1} W`` (``D x r``), to contract with Jacobians."""
        W = self.U * self.ell.sqrt()
        return W / self.d if self.isotropic else W / self.d[:, None]

    @functools.cached_property
    def capacitance_cholesky(self) -> Tensor:
        """Lower Cholesky factor of ``K = I + W^T P_0^{-1} W``, shape ``(r, r)``."""
        return self._capacitance_cholesky(self.U.dtype, orthonormal=self.isotropic)

    @functools.cached_property
    def wide_capacitance_cholesky(self) -> Tensor:
        """Float64 Cholesky factor of ``K`` from the actual ``U^T U`` (lower-precision ``U``)."""
        return self._capacitance_cholesky(torch.float64, orthonormal=False)

    def _capacitance_cholesky(self, dtype: torch.dtype, orthonormal: bool) -> Tensor:
        """Cholesky factor of ``K`` in ``dtype``; ``orthonormal`` takes ``U^T U = I``."""
        ell, d = self.ell.to(dtype), self.d.to(dtype)
        s = ell.sqrt()
        if orthonormal:  # scalar prior: K = I + diag(ell / d)
            K = torch.diag(ell / d)
        elif self.isotropic:  # U^T U / d, U^T U from the (shared) float64 cache
            K = s[:, None] * self.gram_cache.get(self.U).to(dtype) / d * s[None, :]
        elif self.layers is not None:  # sum_l U_l^T U_l / d_l from the cached blocks
            sizes, layer_d = self.layers
            grams = self.gram_cache.layer_grams(self.U, sizes).to(dtype)
            K = s[:, None] * (grams / layer_d.to(dtype)[:, None, None]).sum(0) * s[None, :]
        else:  # U^T diag(1/d) U over row chunks: no D x r temporary
            K = 0
            for U, d_rows in zip(self.U.split(_ROWS), d.split(_ROWS)):
                U = U.to(dtype)
                K = K + (U / d_rows[:, None]).T @ U
            K = s[:, None] * K * s[None, :]
        K = K + torch.eye(K.shape[0], dtype=K.dtype, device=K.device)
        return torch.linalg.cholesky(K)

    def logdet(self) -> Tensor:
        """``log det P`` by the matrix determinant lemma (plus ``logdet_offset``)."""
        if self.isotropic:
            r = self.ell.numel()
            out = torch.log(self.ell + self.d).sum() + (self.dim - r) * torch.log(self.d)
        else:
            chol = self.capacitance_cholesky
            out = torch.log(self.d).sum() + 2 * torch.log(chol.diagonal()).sum()
        return out if self.logdet_offset is None else out + self.logdet_offset

    def inverse_diagonal(self) -> Tensor:
        """Return ``diag(P^{-1})``, ``(D,)``, by Woodbury (float64 for a lower-precision ``U``)."""
        out = self._inverse_diagonal()
        return out if self.null is None else out + self.null.diagonal(self.dim).to(out.dtype)

    def _inverse_diagonal(self) -> Tensor:
        if self.isotropic and self.U.dtype != torch.float64 and self.U.shape[1]:
            wide = self._wide_inverse_diagonal()
            if wide is not None:
                return wide
        if self.isotropic:
            coeff = 1 / (self.ell + self.d) - 1 / self.d
            return squared_rows_dot(self.U, coeff) + 1 / self.d
        # minus the squared column norms of L^{-1} A^T, A = P_0^{-1} W, K = L L^T
        chol, root = self.capacitance_cholesky, self.ell.sqrt()
        parts = []
        for U, d in zip(self.U.split(_ROWS), self.d.split(_ROWS)):
            half = torch.linalg.solve_triangular(chol, ((U * root) / d[:, None]).T, upper=False)
            parts.append(1 / d - (half**2).sum(0))
        return torch.cat(parts)

    def _wide_inverse_diagonal(self) -> Optional[Tensor]:
        """Isotropic ``diag(P^{-1})`` by ``P``'s eigenbasis on ``span(U)`` (``None``: singular)."""
        wide = torch.float64
        chol, info = torch.linalg.cholesky_ex(self.gram_cache.get(self.U))
        if int(info) != 0:
            return None
        R = chol.T  # U^T U = R^T R
        s, W = torch.linalg.eigh((R * self.ell.to(wide)) @ R.T)
        T = torch.linalg.solve_triangular(R, W, upper=True)  # R^{-1} W
        d = self.d.to(wide)
        inverse = 1 / (s.clamp(min=0) + d)
        parts = []
        for U in self.U.split(_ROWS):
            sq = (U.to(wide) @ T) ** 2
            parts.append(sq @ inverse + (1 - sq.sum(1)) / d)
        return torch.cat(parts).to(self.U.dtype)

    def matmul(self, x: Tensor) -> Tensor:
        """Return ``P x`` for ``x`` of shape ``(D,)`` or ``(D, K)``."""
        x2 = x if x.ndim == 2 else x[:, None]
        d = self.d if self.isotropic else self.d[:, None]
        out = self.U @ (self.ell[:, None] * (self.U.T @ x2)) + d * x2
        if self.null is not None:
            out = out + self.null.apply(x2, self.null.prior - self.null.held)
        return out if x.ndim == 2 else out[:, 0]

    def solve(self, x: Tensor) -> Tensor:
        """Return ``P^{-1} x`` by the Woodbury identity, ``x`` of shape ``(D,)`` or ``(D, K)``."""
        x2 = x if x.ndim == 2 else x[:, None]
        if self.isotropic:
            coeff = 1 / (self.ell + self.d) - 1 / self.d
            out = x2 / self.d + self.U @ (coeff[:, None] * (self.U.T @ x2))
        else:
            wd = self.w_over_d()
            inner = torch.cholesky_solve(wd.T @ x2, self.capacitance_cholesky)
            out = x2 / self.d[:, None] - wd @ inner
        if self.null is not None:
            out = out + self.null.apply(x2, self.null.variance_gap)
        return out if x.ndim == 2 else out[:, 0]

    def square_norm(self, delta: Tensor) -> Tensor:
        """Return ``delta^T P delta`` (a scalar tensor) for ``delta`` of shape ``(D,)``."""
        return delta @ self.matmul(delta)

    def sqrt_inv_matmul(self, eps: Tensor) -> Tensor:
        """Return ``S eps``, ``S S^T = P^{-1}``, for given noise of shape ``(D,)`` or ``(D, K)``."""
        x = eps if eps.ndim == 2 else eps[:, None]
        if self.isotropic:
            coeff = 1 / (self.ell + self.d).sqrt() - 1 / self.d.sqrt()
            out = x / self.d.sqrt() + self.U @ (coeff[:, None] * (self.U.T @ x))
        else:
            if self._sqrt_parts is None:
                d_sqrt = self.d.sqrt()
                Q, R = torch.linalg.qr((self.U * self.ell.sqrt()) / d_sqrt[:, None])
                s, Y = torch.linalg.eigh(R @ R.T)
                QY = Q @ Y
                self._sqrt_parts = (d_sqrt, QY, 1 / (1 + s.clamp(min=0)).sqrt() - 1)
            d_sqrt, QY, coeff = self._sqrt_parts
            out = (x + QY @ (coeff[:, None] * (QY.T @ x))) / d_sqrt[:, None]
        if self.null is not None:
            out = out + self.null.apply(x, self.null.scale_gap)
        return out if eps.ndim == 2 else out[:, 0]

    def jacobian_variance(self, Js: Tensor) -> Tensor:
        """Return ``J P^{-1} J^T``, ``(..., C, C)``, from Jacobians ``Js`` ``(..., C, D)``."""
        jn = None if self.null is None else self.null.directions.project(Js)
        return self.functional_variance((Js / self.d) @ Js.transpose(-1, -2),
                                        Js @ self.w_over_d(), jn)

    def functional_variance(self, jdj: Tensor, jdw: Tensor, jn: Optional[Tensor] = None
                            ) -> Tensor:
        r"""Return ``J P^{-1} J^T``, ``(..., C, C)`` in ``jdw``'s dtype.

        Float64 products of a lower-precision posterior use
        :attr:`wide_capacitance_cholesky`.

        Args:
            jdj: ``J P_0^{-1} J^T``, ``(..., C, C)``.
            jdw: ``J P_0^{-1} W``, ``W = U diag(ell)^{1/2}``, ``(..., C, r)``.
            jn: ``J N`` on the null directions, ``(..., C, k)`` (``None``: none).
        """
        if jn is not None and self.null is not None:
            jdj = jdj + self.null.jacobian_variance(jn.to(jdj.dtype))
        if jdw.shape[-1] == 0:  # nothing kept (a zero GGN): the prior's variance
            return jdj
        wide = jdw.dtype == torch.float64 and self.U.dtype != torch.float64
        chol = self.wide_capacitance_cholesky if wide else self.capacitance_cholesky
        flat = jdw.reshape(-1, jdw.shape[-1]).T  # (r, ...C)
        half = torch.linalg.solve_triangular(chol, flat, upper=False)
        half = half.T.reshape(jdw.shape)
        return jdj - half @ half.transpose(-1, -2)
