r"""The measured dropped curvature per layer, for layerwise and per-parameter priors.

Layer ``l`` holds ``c_l`` dropped directions and the mass ``T_l`` of the exact residual
diagonal. Its dropped curvature is taken as the network's measured spectrum scaled by
``s_l = (T_l / c_l) / (T / c)``, its mean dropped eigenvalue over the network's; each
layer's variance and log det are then read at its own mean prior.

Shape glossary:
    D: parameters; r: kept rank; L: layers; k: quadrature nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lowrank_laplace.factor.wide import WIDE


def segment_sums(values: Tensor, sizes: Sequence[int]) -> Tensor:
    """Return the sums ``(L, ...)`` of ``values`` ``(D, ...)`` over segments of ``sizes`` rows."""
    return torch.stack([part.sum(0) for part in values.split(list(sizes))])


@dataclass
class LayerScales:
    """Each layer's share of the dropped curvature.

    Attributes:
        sizes: Parameters per layer ``D_l``.
        norms: ``||U_{l,k}||^2``, ``(L, r)``, float64.
        complement: Dropped directions per layer ``c_l``, ``(L,)``, float64.
        scales: ``s_l``, ``(L,)``, float64 (``0`` for a layer without dropped mass).
    """

    sizes: List[int]
    norms: Tensor
    complement: Tensor
    scales: Tensor

    @classmethod
    def build(cls, eigenvectors: Tensor, mass: float, residual_diagonal: Tensor,
              sizes: Sequence[int]) -> Optional["LayerScales"]:
        """Return the dropped curvature split over its layers (``None``: one layer or none kept).

        Args:
            eigenvectors: Kept ``U``, ``(D, r)``.
            mass: The exact dropped mass ``T``.
            residual_diagonal: ``(D,)``; its layer sums, scaled to ``T``, are their masses.
            sizes: Parameters per layer.
        """
        sizes = [int(s) for s in sizes]
        if len(sizes) < 2 or eigenvectors.shape[1] == 0 or sum(sizes) != eigenvectors.shape[0]:
            return None
        norms = torch.stack([(part.to(WIDE) ** 2).sum(0)
                             for part in eigenvectors.detach().split(sizes)]).cpu()
        complement = (torch.tensor(sizes, dtype=WIDE) - norms.sum(1)).clamp(min=0)
        shares = segment_sums(residual_diagonal.detach().to(WIDE).clamp(min=0), sizes).cpu()
        if float(shares.sum()) <= 0:  # no diagonal mass to go by: as the dropped directions
            shares = complement
        masses = shares * (mass / max(float(shares.sum()), 1e-300))
        mean = mass / max(float(complement.sum()), 1e-300)
        scales = torch.where(complement > 1e-9, masses / complement.clamp(min=1e-9) / mean,
                             torch.zeros_like(masses))
        return cls(sizes, norms, complement, scales)

    def layer_means(self, values: Tensor) -> Tensor:
        """Per-layer means of a scalar, an ``(L,)`` (itself) or a ``(D,)`` vector, ``(L,)``."""
        if values.numel() == 1:
            return values.reshape(()).expand(len(self.sizes))
        if values.numel() == len(self.sizes):
            return values
        return segment_sums(values, self.sizes) / values.new_tensor(self.sizes)

    def shift(self, scale: Tensor, prior: Tensor, spectrum: Any, anchor: float
              ) -> Tuple[Tensor, Tensor]:
        r"""Each layer's shift ``rho_l = 1 / v_l - delta_l`` ``(L,)`` and the layers' log det.

        Float64, differentiable in ``scale`` and ``prior`` (the layers' mean priors).

        Args:
            scale: ``h``.
            prior: The prior precision, scalar or ``(D,)``.
            spectrum: The measured :class:`~lowrank_laplace.posterior.quadrature.DroppedQuadrature`.
            anchor: The last kept eigenvalue (the variance's lower clamp).
        """
        delta = self.layer_means(prior.to(WIDE))
        complement = self.complement.to(delta.device)
        h = torch.as_tensor(scale).to(delta) * self.scales.to(delta.device)
        rho = spectrum.shift(h, delta, anchor)
        share = complement / complement.sum().clamp(min=1e-300)
        return rho, (share * spectrum.logdet(h, delta, complement.sum())).sum()
