r"""Models of the curvature a rank-``r`` truncation drops.

The fit keeps the leading eigenpairs :math:`U \mathrm{diag}(\lambda) U^\top` of the GGN
sum :math:`H` and knows the dropped curvature's total exactly: the *residual mass*
:math:`T = \mathrm{tr}(H) - \sum_i \lambda_i`. Leaving the residual
:math:`R = H - U \mathrm{diag}(\lambda) U^\top` out (``"none"``) gives the
``D - r`` dropped directions the prior variance only, and its log-determinant, in
which only ``r`` eigenvalues depend on the prior precision, drives the marginal
likelihood towards weak priors. The models, each one consistent posterior:

``"spectral"`` (default)
    The dropped eigenvalues follow a power law that continues the kept spectrum,
    :math:`\tilde\lambda_i = \lambda_r (i / r)^{-\alpha}` for
    :math:`i = r+1 \dots n`, with :math:`\alpha` fixed by the exact mass
    :math:`\sum_i \tilde\lambda_i = T` and :math:`n` the GGN's rank bound
    (``min(D, N x columns per sample)``). Their eigenvectors are unknown, so they are
    taken at random in the complement of ``U``: every member of that family has the
    same :math:`\log\det P` (used by the marginal likelihood). Per-layer and
    per-parameter priors split the tail over layers, each with its exact share of the
    mass (:mod:`~lowrank_laplace.posterior.layer_tail`). The
    covariance is the kept part plus the complement with one variance
    :math:`v = \sum_i w_i / (h \tilde\lambda_i + \delta) / \sum_i w_i`, the
    tail's variances weighted by how much of an input's Jacobian falls in each
    direction. That weight is measured on the kept eigenpairs and extrapolated: the
    fit computes the Jacobian energies :math:`e_k = \sum_n \|J_n u_k\|^2` of the
    kept eigenvectors on a probe of training inputs, fits
    :math:`e_k \propto \lambda_k^\beta` (least squares in log-log, clamped to
    :math:`0 \le \beta \le 1`) and takes :math:`w_i = \tilde\lambda_i^\beta`.
    :math:`\beta = 0` is the plain mean over random directions (every direction
    equally likely to be seen), :math:`\beta = 1` the weighting of the training
    set's own curvature, under which the model reproduces the training points'
    curvature-weighted predictive variance. The random-direction mean (``beta=0``) is
    much too wide at ranks of a few percent of ``D``, because inputs' Jacobians load
    on the large tail eigenvalues, not on the prior-only directions.
``"isotropic"``
    :math:`R \approx \rho (I - U U^\top)` with :math:`\rho = T / (D - r)`, the mean
    dropped eigenvalue (probabilistic PCA's noise term).
``"diagonal"``
    :math:`R \approx \mathrm{diag}(H) - \mathrm{diag}(U \mathrm{diag}(\lambda) U^\top)`,
    the exact diagonal of the residual (the fit tracks the GGN diagonal).
``"none"``
    :math:`R = 0` (laplace-torch's plain low-rank semantics).

The isotropic and spectral models enter the algebra of
:class:`~lowrank_laplace.posterior.LowRankPrecision` as a shift,
:math:`P = U \mathrm{diag}(h\lambda - \rho) U^\top + (P_0 + \rho I)`, plus (spectral)
a log-determinant offset; nothing costs more than the model without residual.
Why the spectral model is the default: a flat residual overstates
:math:`\log\det(R + \delta I)` of a decaying tail (by Jensen's inequality), so the
marginal likelihood of the isotropic and diagonal models overshoots the prior
precision (sklearn digits MLP, rank 100: +36% and +30% against the full GGN's,
spectral +11%); with the Jacobian weighting its predictive is also the closest to the
full GGN's at the default rank (test NLL +2.6% on digits, +3.1% on a diabetes
regression MLP). See the posterior-quality page of the docs.

Shape glossary:
    D: parameters; r: kept rank; n: rank bound of the GGN.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lowrank_laplace.posterior.complement import MeasuredComplement
from lowrank_laplace.posterior.layer_tail import LayerTails, power_law_tail
from lowrank_laplace.posterior.precision import GramCache, LowRankPrecision
from lowrank_laplace.utils.checks import Choice


class ResidualKind(Choice):
    """The residual models (the ``residual`` option)."""

    SPECTRAL = "spectral"
    ISOTROPIC = "isotropic"
    DIAGONAL = "diagonal"
    NONE = "none"


#: The residual models' names.
RESIDUALS = tuple(m.value for m in ResidualKind)
DEFAULT_RESIDUAL = "spectral"


def check_residual(residual: str) -> ResidualKind:
    """Validate a residual model's name.

    Args:
        residual: One of :data:`RESIDUALS`.

    Returns:
        The model.

    Raises:
        ValueError: For anything else.
    """
    return ResidualKind.parse(residual, "residual")


def jacobian_exponent(eigenvalues: Tensor, energies: Tensor) -> float:
    r"""The exponent :math:`\beta` of :math:`e_k \propto \lambda_k^\beta`, clamped to ``[0, 1]``.

    Least squares of :math:`\log e_k` on :math:`\log \lambda_k` with an intercept,
    over the pairs where both are positive (eigenvalues above ``1e-12`` of the
    largest). Fewer than two such pairs, or eigenvalues that are all equal, give 0.

    Args:
        eigenvalues: Kept GGN eigenvalues ``lambda``, shape ``(r,)``.
        energies: Jacobian energies ``e_k = sum_n ||J_n u_k||^2`` of the kept
            eigenvectors, shape ``(r,)``.

    Returns:
        ``beta`` as a float.
    """
    lam = eigenvalues.detach().to(torch.float64).cpu()
    energy = energies.detach().to(torch.float64).cpu()
    if lam.numel() == 0:
        return 0.0
    valid = (lam > 1e-12 * lam.max().clamp(min=0)) & (energy > 0) & (lam > 0)
    x, y = lam[valid].log(), energy[valid].log()
    if x.numel() < 2 or float(x.max() - x.min()) < 1e-9:
        return 0.0
    x = x - x.mean()
    beta = float((x * (y - y.mean())).sum() / (x * x).sum())
    return min(max(beta, 0.0), 1.0)


@dataclass
class Residual:
    """What a residual model needs of a fit, on the GGN's own scale (before ``1/sigma^2/T``).

    Attributes:
        model: One of :data:`RESIDUALS`.
        dim: Number of parameters ``D``.
        mass: The exact dropped curvature ``tr(H) - sum(lambda)`` (``>= 0``).
        diagonal: Residual diagonal, shape ``(D,)`` (``"diagonal"`` only).
        tail: Modelled dropped eigenvalues, shape ``(n - r,)`` (``"spectral"`` only).
        exponent: Jacobian-weighting exponent ``beta`` of the spectral covariance.
        layers: The tail split over layers (``"spectral"`` with the residual diagonal
            and more than one layer; see :mod:`~lowrank_laplace.posterior.layer_tail`).
        complement: The complement variance measured on the probe (``"spectral"``;
            see :mod:`~lowrank_laplace.posterior.complement`), used for scalar and
            per-parameter priors in place of the Jacobian-weighted tail.
        anchor: The last kept eigenvalue (the measured variance's lower clamp).
    """

    model: ResidualKind
    dim: int
    mass: float
    diagonal: Optional[Tensor] = None
    tail: Optional[Tensor] = None
    exponent: float = 0.0
    complement: Optional[MeasuredComplement] = None
    anchor: float = 0.0
    _whole: dict = field(default_factory=dict, repr=False, compare=False)
    _layers: Optional[LayerTails] = field(default=None, repr=False, compare=False)
    # builds _layers on first use: only layerwise and per-parameter priors read them
    _split: Optional[Callable[[], LayerTails]] = field(default=None, repr=False, compare=False)

    @property
    def layers(self) -> Optional[LayerTails]:
        """The tail split over layers (built on first use), or ``None``."""
        if self._split is not None:
            self._layers, self._split = self._split(), None
        return self._layers

    @layers.setter
    def layers(self, value: Optional[LayerTails]) -> None:
        self._layers, self._split = value, None

    @classmethod
    def from_fit(cls, model: str, eigenvalues: Tensor, trace: Tensor, dim: int,
                 rank_bound: int, diagonal: Optional[Tensor] = None,
                 exponent: float = 0.0, eigenvectors: Optional[Tensor] = None,
                 layer_sizes: Optional[Sequence[int]] = None,
                 complement: Optional[MeasuredComplement] = None) -> "Residual":
        """Build the model's quantities from a fit.

        Args:
            model: One of :data:`RESIDUALS`.
            eigenvalues: Kept eigenvalues ``lambda`` (descending), shape ``(r,)``.
            trace: Exact trace of ``H``.
            dim: Number of parameters ``D``.
            rank_bound: Upper bound on the rank of ``H`` (e.g. ``N (C - 1)``).
            diagonal: The residual diagonal (needed by ``"diagonal"``).
            exponent: The spectral model's Jacobian-weighting exponent ``beta``
                (see :func:`jacobian_exponent`).
            eigenvectors: Kept ``U`` (the spectral model splits its tail over
                layers with them and ``diagonal``).
            layer_sizes: Parameters per layer (laplace-torch's parameter tensors).
            complement: The measured complement variance (``"spectral"`` only).

        Returns:
            The residual.

        Raises:
            ValueError: For ``"diagonal"`` without the residual diagonal.
        """
        model = check_residual(model)
        rank = eigenvalues.numel()
        # in float64: a float32 sum is rounded at eps lambda_max, which can exceed the
        # mass of a few dropped eigenvalues (a fit's trace is float64 for this); a
        # trace held in lower precision leaves its rounding undecided: zero
        dtype = trace.dtype if torch.is_tensor(trace) and trace.is_floating_point() \
            else torch.float64
        mass = float(trace) - float(eigenvalues.double().sum())
        mass = mass if mass > torch.finfo(dtype).eps * abs(float(trace)) else 0.0
        if model == "diagonal" and diagonal is None:
            raise ValueError(
                "residual='diagonal' needs the residual diagonal, which this fit did not "
                "keep: refit with residual='diagonal'."
            )
        tail, layers = None, None
        anchor = float(eigenvalues[-1]) if rank else 0.0
        if model == "spectral":
            count = min(max(int(rank_bound), rank), dim) - rank
            if count == 0 and mass > 0:  # a bound that cannot hold the mass: spread it
                count = dim - rank
            tail = power_law_tail(anchor, mass, max(rank, 1), count)
            if diagonal is not None and eigenvectors is not None and layer_sizes \
                    and mass > 0 and rank < dim:
                layers = functools.partial(LayerTails.build, eigenvectors, eigenvalues, mass,
                                           diagonal, layer_sizes, count)
        measured = complement if model == "spectral" and mass > 0 else None
        return cls(model, dim, mass, diagonal if model == "diagonal" else None, tail,
                   float(exponent), measured, anchor, _split=layers)

    def precision(self, eigenvectors: Tensor, eigenvalues: Tensor, scale: Tensor,
                  prior: Tensor, gram_cache: Optional[GramCache] = None,
                  layer_prior: Optional[Tuple[Sequence[int], Tensor]] = None,
                  ) -> LowRankPrecision:
        r"""The posterior precision with this residual.

        Args:
            eigenvectors: Kept ``U``, shape ``(D, r)``.
            eigenvalues: Kept ``lambda``, shape ``(r,)``.
            scale: ``h = 1 / sigma^2 / T`` (laplace-torch's ``_H_factor``); may carry
                gradients.
            prior: Prior precision ``d``: a scalar tensor or shape ``(D,)``; may carry
                gradients.
            gram_cache: Passed on to
                :class:`~lowrank_laplace.posterior.LowRankPrecision`.
            layer_prior: ``(sizes, delta_l)`` for a prior constant over each layer
                (laplace-torch's layerwise prior, ``prior`` its expansion): the
                precision's algebra then costs ``O(L r^2)``, not ``O(D r^2)``.

        Returns:
            The :class:`~lowrank_laplace.posterior.LowRankPrecision`.
        """
        ell = scale * eigenvalues
        dim, rank = self.dim, eigenvalues.numel()

        def layered(shift: Tensor) -> Optional[Tuple[Sequence[int], Tensor]]:
            return None if layer_prior is None else (layer_prior[0], layer_prior[1] + shift)

        if self.model == "none" or dim == rank:
            return LowRankPrecision(eigenvectors, ell, prior, gram_cache=gram_cache,
                                    layers=layered(0))
        if self.model == "diagonal":
            diag = self.diagonal.to(ell.dtype)
            return LowRankPrecision(eigenvectors, ell, prior + scale * diag, gram_cache=gram_cache)
        num, offset = dim - rank, None
        if self.model == "isotropic":
            rho = scale * self.mass / num
            d = prior + rho
        elif prior.numel() > 1 and self.layers is not None:  # builds the split on first use
            return self._layer_precision(eigenvectors, ell, scale, prior, gram_cache,
                                         layer_prior)
        else:
            rho, tail_logdet = self._spectral_shift(scale, prior, num, ell.device)
            rho = rho.to(ell.dtype)
            d = prior + rho
            # against the d the precision holds, so its (D - r) log d cancels exactly
            offset = (tail_logdet - num * torch.log(d.to(torch.float64).mean())).to(ell.dtype)
        return LowRankPrecision(eigenvectors, (ell - rho).clamp(min=0), d,
                                logdet_offset=offset, gram_cache=gram_cache,
                                layers=layered(rho))

    def curvature_spectrum(self, eigenvalues: Tensor, scale: float,
                           ) -> Optional[Tuple[Tensor, Tensor]]:
        r"""The curvature's nonzero eigenvalues under a scalar prior, for the log det.

        Under a scalar prior :math:`\delta` every model but ``"diagonal"`` gives
        :math:`\log\det P = \sum_j c_j \log(a_j + \delta) + (D - \sum_j c_j)
        \log\delta`: the kept :math:`h\lambda_k`, and the modelled dropped ones
        (``"spectral"``: the tail :math:`h\tilde\lambda_i`; ``"isotropic"``: the mean
        :math:`\rho` on all ``D - r`` dropped directions). The marginal likelihood's
        dependence on :math:`\delta` is then a scalar function (see
        :mod:`~lowrank_laplace.laplace_torch.tuning`). As :meth:`precision` with a
        scalar prior, whose shift never exceeds the last kept eigenvalue.

        Args:
            eigenvalues: Kept ``lambda``, shape ``(r,)``.
            scale: ``h = 1 / sigma^2 / T``.

        Returns:
            ``(a, c)``, float64 on the CPU, or ``None`` for ``"diagonal"`` (a
            per-parameter residual).
        """
        if self.model == "diagonal":
            return None
        kept = eigenvalues.detach().to(device="cpu", dtype=torch.float64) * scale
        values, counts = [kept], [torch.ones_like(kept)]
        num = self.dim - kept.numel()
        if self.model == "isotropic" and num > 0:
            rho = scale * self.mass / num  # the kept directions hold max(h lambda, rho)
            values = [kept.clamp(min=rho), kept.new_tensor([rho])]
            counts.append(kept.new_tensor([float(num)]))
        elif self.model == "spectral" and num > 0 and self.tail is not None:
            values.append(self.tail.to(device="cpu", dtype=torch.float64) * scale)
            counts.append(torch.ones_like(values[-1]))
        values, counts = torch.cat(values), torch.cat(counts)
        keep = values > 0
        return values[keep], counts[keep]

    def _layer_precision(self, eigenvectors: Tensor, ell: Tensor, scale: Tensor,
                         prior: Tensor, gram_cache: Optional[GramCache],
                         layer_prior: Optional[Tuple[Sequence[int], Tensor]],
                         ) -> LowRankPrecision:
        r"""The spectral model with one tail per layer.

        The complement of layer ``l`` gets precision :math:`\delta + \rho_l`; the kept
        directions keep :math:`h\lambda_k + \delta` on the diagonal of ``U``'s basis
        (:math:`\ell_k - \sum_l \rho_l \|U_{l,k}\|^2`). The log-determinant offset
        trades the complement's :math:`\sum_l c_l \log(\delta_l + \rho_l)` for the
        tails'.
        """
        layers = self.layers
        rho, tail_logdet = layers.shift(scale, prior, self.exponent, ell.device)
        rho = rho.to(ell.dtype)
        sizes = torch.tensor(layers.sizes, device=ell.device)
        d = prior + rho.repeat_interleave(sizes, output_size=self.dim)
        kept = (layers.norms.to(device=ell.device, dtype=ell.dtype).T @ rho)
        if layer_prior is not None and list(layer_prior[0]) == layers.sizes:
            layer_d = layer_prior[1] + rho
            log_d = torch.log(layer_d.to(torch.float64))
            constant = (layers.sizes, layer_d)
        else:
            log_d = torch.log(layers.layer_means(d.to(torch.float64)))  # as the tails' delta_l
            constant = None
        offset = tail_logdet - (layers.complement.to(ell.device) * log_d).sum()
        return LowRankPrecision(eigenvectors, (ell - kept).clamp(min=0), d,
                                logdet_offset=offset.to(ell.dtype), gram_cache=gram_cache,
                                layers=constant)

    def _spectral_shift(self, scale: Tensor, prior: Tensor, num: int,
                        device: torch.device) -> Tuple[Tensor, Tensor]:
        r"""The spectral model's shift :math:`\rho` and the tail's log-determinant.

        :math:`\rho = 1 / v - \delta = \sum_i w_i t_i / (t_i + \delta) \big/ \sum_i w_i
        / (t_i + \delta)`: a ratio of positive sums, where the form
        :math:`\delta m / (1 - m)` with :math:`m` the weighted mean of
        :math:`t / (t + \delta)` cancels to nothing once :math:`\delta \ll t`. Both in
        float64 (they sum ``n - r`` terms), differentiable in ``scale`` and ``prior``.

        Args:
            scale: ``h``.
            prior: The prior precision (its mean stands for a non-scalar one).
                Computed by :meth:`~lowrank_laplace.posterior.layer_tail.LayerTails.shift`
                on the whole network as one layer.
            num: Dropped directions ``D - r``.
            device: Where the posterior lives.

        Returns:
            ``rho`` and :math:`\sum_i \log(t_i + \delta)` over all ``D - r`` dropped
            directions, both float64 scalars.
        """
        whole = self._whole.get(num)
        if whole is None:  # one layer, the network; kept with its prior-free factors
            whole = self._whole[num] = LayerTails.whole(self.tail, self.dim, num)
        rho, logdet = whole.shift(scale, prior, self.exponent, device)
        if self.complement is not None:  # measured on the probe, at this prior
            delta = prior.to(torch.float64).mean() if prior.numel() > 1 else prior
            return self.complement.to(device).shift(scale, delta, self.anchor), logdet
        return rho[0], logdet
