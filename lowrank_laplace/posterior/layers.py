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
from typing import List, Optional, Sequence, Tuple

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

    def readings(self, scale: Tensor, prior: Tensor, num: int) -> Tuple[Tensor, Tensor, Tensor]:
        """Where the spectrum is read for a prior per layer: ``h``, ``delta``, directions.

        ``(2L + 1,)`` float64 each, differentiable in ``scale`` and ``prior`` (scalar,
        ``(L,)`` or ``(D,)``): the network at the prior's mean (``num`` dropped directions),
        each layer at its mean prior, each at the prior's mean (``h s_l``, all layers').
        """
        delta = self.layer_means(prior.to(WIDE))
        sizes = delta.new_tensor(self.sizes)
        mean = ((delta * sizes).sum() / sizes.sum()).reshape(1)  # over the D parameters
        h = torch.as_tensor(scale).to(delta).reshape(1)
        scaled = h * self.scales.to(delta.device)
        count = self.complement.sum().to(delta.device).reshape(1).expand(2 * len(self.sizes))
        return (torch.cat([h, scaled, scaled]), torch.cat([mean, delta, mean.expand_as(delta)]),
                torch.cat([count.new_tensor([float(num)]), count]))

    def share_sum(self, logdets: Tensor) -> Tensor:
        """The layers' log det change from the mean prior: :meth:`readings`' last ``2L``."""
        complement = self.complement.to(logdets.device)
        own, at_mean = logdets.split(len(self.sizes))
        return (complement / complement.sum().clamp(min=1e-300) * (own - at_mean)).sum()
