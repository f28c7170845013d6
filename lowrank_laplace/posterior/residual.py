r"""Models of the curvature a rank-``r`` truncation drops: one class per model.

A fit knows the dropped mass ``T = tr(H) - sum(lambda)`` exactly. Each model, found by
name in :data:`RESIDUALS`, is one consistent posterior (log det, marglik, predictive,
samples). Derivations: docs/benchmarks/posterior_quality.md; a new model: docs/contributing.md.

Shape glossary:
    D: parameters; r: kept rank; n: rank bound of the GGN.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, ClassVar, Dict, Optional, Sequence, Tuple, Type

import torch
from torch import Tensor

from lowrank_laplace.posterior.layers import LayerScales
from lowrank_laplace.posterior.null import NullDirections, NullShift
from lowrank_laplace.posterior.precision import GramCache, LowRankPrecision
from lowrank_laplace.posterior.quadrature import DroppedQuadrature

#: A layerwise prior: parameters per layer and one precision per layer.
LayerPrior = Tuple[Sequence[int], Tensor]


@dataclass(frozen=True)
class DroppedCurvature:
    """What a fit tells about the curvature its rank drops, on the GGN's own scale.

    Attributes:
        eigenvectors: Kept ``U``, ``(D, r)``.
        eigenvalues: Kept ``lambda`` (descending), ``(r,)``.
        trace: The exact trace of ``H``.
        rank_bound: Upper bound on the rank of ``H``.
        diagonal: ``diag(H - U diag(lambda) U^T)``, or ``None``.
        layer_sizes: Parameters per layer (laplace-torch's parameter tensors).
        null: The GGN's checked logit-shift directions (spectral), or ``None``.
        quadrature: The Lanczos quadrature of the dropped curvature (spectral;
            :mod:`~lowrank_laplace.posterior.quadrature`), or ``None``.
    """

    eigenvectors: Tensor
    eigenvalues: Tensor
    trace: Tensor
    rank_bound: int
    diagonal: Optional[Tensor] = None
    layer_sizes: Optional[Sequence[int]] = None
    null: Optional[NullDirections] = None
    quadrature: Optional[DroppedQuadrature] = None

    @property
    def mass(self) -> float:
        """The exact dropped curvature ``tr(H) - sum(lambda)``, zero within the trace's rounding."""
        trace = self.trace
        dtype = trace.dtype if torch.is_tensor(trace) and trace.is_floating_point() \
            else torch.float64
        mass = float(trace) - float(self.eigenvalues.double().sum())
        return mass if mass > torch.finfo(dtype).eps * abs(float(trace)) else 0.0


class Residual:
    """A model of the dropped curvature, built from a fit (:meth:`from_fit`).

    Attributes:
        dim: Number of parameters ``D``.
        mass: The exact dropped curvature ``tr(H) - sum(lambda)``.
        anchor: The last kept eigenvalue (``0`` where nothing is kept).
    """

    #: The model's name (the ``residual`` option).
    name: ClassVar[str] = ""
    #: What it puts in the dropped directions where nothing was measured (the fit report).
    summary: ClassVar[str] = ""
    #: A fit with this model tracks the GGN diagonal.
    tracks_diagonal: ClassVar[bool] = False
    #: The model cannot be built without the residual diagonal.
    needs_diagonal: ClassVar[bool] = False
    #: A fit with this model keeps probe inputs for a probe pass after it.
    needs_probe: ClassVar[bool] = False
    #: The precision's diagonal is constant over a layer under a layerwise prior.
    constant_per_layer: ClassVar[bool] = True

    def __init__(self, dropped: DroppedCurvature):
        self.dim = dropped.eigenvectors.shape[0]
        self.mass = dropped.mass
        self.anchor = float(dropped.eigenvalues[-1]) if dropped.eigenvalues.numel() else 0.0

    @classmethod
    def from_fit(cls, dropped: DroppedCurvature) -> "Residual":
        """Return the model of a fit's dropped curvature.

        Args:
            dropped: What the fit tells about it.

        Raises:
            ValueError: For a model that needs the residual diagonal without it.
        """
        if cls.needs_diagonal and dropped.diagonal is None:
            raise ValueError(
                f"residual={cls.name!r} needs the residual diagonal, which this fit did "
                f"not keep: refit with residual={cls.name!r}.")
        return cls(dropped)

    def complement_variance(self, scale: Tensor, prior: Tensor) -> Optional[Tensor]:
        """The measured complement variance ``v`` at ``h`` (``None``: not measured)."""
        return None

    def precision(self, eigenvectors: Tensor, eigenvalues: Tensor, scale: Tensor,
                  prior: Tensor, gram_cache: Optional[GramCache] = None,
                  layer_prior: Optional[LayerPrior] = None) -> LowRankPrecision:
        r"""Return the ``LowRankPrecision`` with this residual, differentiable in scale and prior.

        Args:
            eigenvectors: Kept ``U``, ``(D, r)``.
            eigenvalues: Kept ``lambda``, ``(r,)``.
            scale: ``h = 1 / sigma^2 / T`` (laplace-torch's ``_H_factor``).
            prior: Prior precision ``d``, scalar or ``(D,)``.
            gram_cache: Passed on to ``LowRankPrecision``.
            layer_prior: ``(sizes, delta_l)`` for a layerwise prior (``prior`` its
                expansion): ``O(L r^2)`` algebra.
        """
        ell, extra = scale * eigenvalues, (gram_cache, layer_prior)
        if self.dim == eigenvalues.numel():  # nothing dropped
            return Residual._precision(self, eigenvectors, ell, scale, prior, extra)
        return self._precision(eigenvectors, ell, scale, prior, extra)

    def _precision(self, eigenvectors: Tensor, ell: Tensor, scale: Tensor, prior: Tensor,
                   extra: Tuple[Optional[GramCache], Optional[LayerPrior]]
                   ) -> LowRankPrecision:
        """The precision without a residual (``extra``: cache, layer prior); models add theirs."""
        return LowRankPrecision(eigenvectors, ell, prior, gram_cache=extra[0],
                                layers=_shifted(extra[1], 0))

    def curvature_spectrum(self, eigenvalues: Tensor, scale: float
                           ) -> Optional[Tuple[Tensor, Tensor]]:
        r"""Return nonzero curvature eigenvalues ``a`` and counts ``c`` (float64, CPU), or ``None``.

        ``log det P = sum_j c_j log(a_j + delta) + (D - sum_j c_j) log delta`` under a
        scalar prior: the kept ``h lambda`` and the modelled dropped ones. ``None`` for a
        per-parameter residual.

        Args:
            eigenvalues: Kept ``lambda``, ``(r,)``.
            scale: ``h``.
        """
        kept = eigenvalues.detach().to(device="cpu", dtype=torch.float64) * scale
        values, counts = self._dropped_spectrum(kept, scale)
        values, counts = torch.cat([kept, *values]), torch.cat([torch.ones_like(kept), *counts])
        keep = values > 0
        return values[keep], counts[keep]

    def _dropped_spectrum(self, kept: Tensor, scale: float) -> Tuple[list, list]:
        """The modelled dropped eigenvalues and their counts (none by default)."""
        return [], []


def _shifted(layer_prior: Optional[LayerPrior], shift: Tensor) -> Optional[LayerPrior]:
    """A layerwise prior shifted by ``shift`` (``None`` stays ``None``)."""
    return None if layer_prior is None else (layer_prior[0], layer_prior[1] + shift)


class NoResidual(Residual):
    """``R = 0``: the dropped directions see only the prior."""

    name = "none"
    summary = "nothing: the prior alone"


class DiagonalResidual(Residual):
    """The exact diagonal of the residual, added to the prior's."""

    name = "diagonal"
    summary = "the exact GGN diagonal of the dropped curvature"
    tracks_diagonal = needs_diagonal = True
    constant_per_layer = False

    def __init__(self, dropped: DroppedCurvature):
        super().__init__(dropped)
        self.diagonal = dropped.diagonal

    def _precision(self, eigenvectors, ell, scale, prior, extra):
        diag = self.diagonal.to(ell.dtype)
        return LowRankPrecision(eigenvectors, ell, prior + scale * diag, gram_cache=extra[0])

    def curvature_spectrum(self, eigenvalues: Tensor, scale: float) -> None:
        """``None``: the residual differs per parameter (see :class:`Residual`)."""
        return None


class IsotropicResidual(Residual):
    """The mean dropped eigenvalue ``rho = T / (D - r)`` in every dropped direction."""

    name = "isotropic"
    summary = "the mean dropped eigenvalue in every dropped direction"

    def _precision(self, eigenvectors, ell, scale, prior, extra):
        gram_cache, layer_prior = extra
        rho = scale * self.mass / (self.dim - ell.numel())
        return LowRankPrecision(eigenvectors, (ell - rho).clamp(min=0), prior + rho,
                                gram_cache=gram_cache, layers=_shifted(layer_prior, rho))

    def _dropped_spectrum(self, kept, scale):
        num = self.dim - kept.numel()
        if num <= 0:
            return [], []
        rho = scale * self.mass / num  # the kept directions hold max(h lambda, rho)
        kept.clamp_(min=rho)
        return [kept.new_tensor([rho])], [kept.new_tensor([float(num)])]


class SpectralResidual(Residual):
    """The dropped curvature measured by Lanczos quadrature, in random dropped directions.

    The complement variance ``v`` (the shift ``1 / v - delta`` outside ``U``) and the
    dropped log det come from the measured spectrum (``posterior.quadrature``), else the
    mean dropped eigenvalue everywhere. Checked logit-shift directions keep the prior's
    variance (``posterior.null``); a layerwise or per-parameter prior reads each layer's
    share at its own prior (``posterior.layers``).

    Attributes:
        spectrum: The measured (or flat) :class:`DroppedQuadrature`.
        measured: Whether the spectrum was measured.
        null: The logit-shift directions (``None``: none known).
    """

    name = "spectral"
    summary = "the mean dropped eigenvalue (nothing measured)"
    tracks_diagonal = needs_probe = True

    def __init__(self, dropped: DroppedCurvature):
        super().__init__(dropped)
        rank, dim, mass = dropped.eigenvalues.numel(), self.dim, self.mass
        self.null = dropped.null if rank < dim else None
        found = dropped.quadrature if mass > 0 and rank < dim else None
        self.measured = found is not None and found.steps > 0
        free = dim - rank - (0 if self.null is None else self.null.count)
        self.spectrum = found if self.measured else DroppedQuadrature.flat(mass, free)
        self._layers: Optional[LayerScales] = None  # the split, built on first use
        self._split: Optional[Callable[[], Optional[LayerScales]]] = None
        if dropped.diagonal is not None and dropped.layer_sizes and mass > 0 and rank < dim:
            self._split = functools.partial(LayerScales.build, dropped.eigenvectors, mass,
                                            dropped.diagonal, dropped.layer_sizes)

    @property
    def layers(self) -> Optional[LayerScales]:
        """The dropped curvature split over layers (built on first use), or ``None``."""
        if self._split is not None:
            self._layers, self._split = self._split(), None
        return self._layers

    @layers.setter
    def layers(self, value: Optional[LayerScales]) -> None:
        self._layers, self._split = value, None

    def _precision(self, eigenvectors, ell, scale, prior, extra):
        gram_cache, layer_prior = extra
        num = self.dim - ell.numel()
        if prior.numel() > 1 and self.layers is not None:  # the split on first use
            kept, d, offset, layers = self._layer_parts(ell, scale, prior, layer_prior)
        else:  # one shift everywhere
            mean = prior.to(torch.float64).mean().reshape(())
            kept = self.spectrum.shift(scale, mean, self.anchor).to(ell.dtype)
            d, layers = prior + kept, _shifted(layer_prior, kept)
            # against the d the precision holds, so its (D - r) log d cancels exactly
            offset = self.spectrum.logdet(scale, mean, num) \
                - num * torch.log(d.to(torch.float64).mean())
        return LowRankPrecision(eigenvectors, (ell - kept).clamp(min=0), d,
                                logdet_offset=offset.to(ell.dtype), gram_cache=gram_cache,
                                layers=layers,
                                null=functools.partial(self._null_shift, prior, d))

    def _null_shift(self, prior: Tensor, held: Tensor) -> Optional[NullShift]:
        """The prior's variance on the null directions, where the precision holds ``held``."""
        if self.null is None:
            return None
        count = self.null.count  # a scalar is constant on every direction
        means = [x.reshape(()).expand(count) if x.numel() == 1 else self.null.column_means(x)
                 for x in (prior, held)]  # a prior per parameter: not eigenvectors
        return None if any(m is None for m in means) else NullShift(self.null, *means)

    def _dropped_spectrum(self, kept, scale):
        if self.dim - kept.numel() <= 0:
            return [], []
        nodes, counts = (t.to(device="cpu", dtype=torch.float64)
                         for t in (self.spectrum.nodes, self.spectrum.counts))
        return [nodes * scale], [counts]

    def _layer_parts(self, ell: Tensor, scale: Tensor, prior: Tensor,
                     layer_prior: Optional[LayerPrior]) -> tuple:
        """Shift on ``U``, ``d``, log det offset and constant ``d_l`` of a prior per layer.

        Each layer's shift is the whole network's (``rho`` and log det at the prior's mean)
        plus its own share's change from that mean to its prior: zero for a constant
        prior, which is therefore the scalar prior's posterior. The three readings of the
        spectrum (whole, layers at their priors, layers at the mean) are one evaluation.
        """
        layers, num = self.layers, self.dim - ell.numel()
        given = layer_prior is not None and list(layer_prior[0]) == layers.sizes
        h, delta, count = layers.readings(scale, layer_prior[1] if given else prior, num)
        rho, logdet = self.spectrum.shift(h, delta, self.anchor), \
            self.spectrum.logdet(h, delta, count)
        whole, own, at_mean = rho.split([1, len(layers.sizes), len(layers.sizes)])
        rho = (whole + own - at_mean).clamp(min=0).to(ell.dtype)
        logdet = logdet[0] + layers.share_sum(logdet[1:])
        sizes = torch.tensor(layers.sizes, device=ell.device)
        d = prior + rho.repeat_interleave(sizes, output_size=self.dim)
        kept = layers.norms.to(device=ell.device, dtype=ell.dtype).T @ rho
        constant = (layers.sizes, layer_prior[1] + rho) if given else None
        log_d = torch.log(layers.layer_means((d if constant is None else constant[1]).to(
            torch.float64)))
        offset = logdet - (layers.complement.to(ell.device) * log_d).sum()
        return kept, d, offset, constant

    def complement_variance(self, scale: Tensor, prior: Tensor) -> Optional[Tensor]:
        """See :meth:`Residual.complement_variance` (``None``: nothing measured)."""
        delta = torch.as_tensor(prior).to(torch.float64)
        return self.spectrum.variance(scale, delta, self.anchor) if self.measured else None


#: The residual models by name (the ``residual`` option).
RESIDUALS: Dict[str, Type[Residual]] = {
    cls.name: cls for cls in (SpectralResidual, IsotropicResidual, DiagonalResidual, NoResidual)
}
#: The default residual model.
DEFAULT_RESIDUAL = "spectral"


def residual_class(name: str) -> Type[Residual]:
    """Return the residual model class of a name.

    Args:
        name: One of :data:`RESIDUALS`.

    Raises:
        ValueError: For anything else.
    """
    try:
        return RESIDUALS[name]
    except (KeyError, TypeError):
        allowed = ", ".join(repr(n) for n in RESIDUALS)
        raise ValueError(f"residual must be one of {allowed}, got {name!r}.") from None
