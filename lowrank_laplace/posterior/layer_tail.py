r"""The spectral residual per layer: each parameter tensor's share of the dropped curvature.

Layer ``l`` holds the mass ``T_l`` (its residual diagonal's sum) and ``c_l`` dropped
directions, ``n_l`` of which carry a power law continuing the kept spectrum
(docs/benchmarks/posterior_quality.md, "The models" and "Per-layer priors").

Shape glossary:
    D: parameters; r: kept rank; L: layers; m: modelled tail eigenvalues.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lowrank_laplace.factor.wide import WIDE


def segment_sums(values: Tensor, sizes: Sequence[int]) -> Tensor:
    """Return the sums ``(L, ...)`` of ``values`` ``(D, ...)`` over segments of ``sizes`` rows."""
    return torch.stack([part.sum(0) for part in values.split(list(sizes))])


def spectral_tail(eigenvalues: Tensor, mass: float, rank_bound: int, dim: int) -> Tensor:
    """Return the modelled dropped eigenvalues of a fit: :func:`power_law_tail` from the last kept.

    Over the ``min(rank_bound, D) - r`` directions the rank allows (all ``D - r`` if none).

    Args:
        eigenvalues: Kept ``lambda`` (descending), ``(r,)``.
        mass: The exact dropped curvature.
        rank_bound: Upper bound on the rank of the GGN.
        dim: Parameters ``D``.
    """
    rank = eigenvalues.numel()
    count = min(max(int(rank_bound), rank), dim) - rank
    if count == 0 and mass > 0:  # a bound that cannot hold the mass: spread it
        count = dim - rank
    anchor = float(eigenvalues[-1]) if rank else 0.0
    return power_law_tail(anchor, mass, max(rank, 1), count)


def power_law_tail(anchor: float, mass: float, start: int, count: int,
                   stride: float = 1.0) -> Tensor:
    r"""Return ``a (i / s)^-alpha``, ``i = s + j sigma``, ``j = 1..n``, summing to ``mass``.

    Float64 ``(count,)``, non-increasing; ``alpha`` by bisection; a mass above the flat
    continuation is spread evenly.

    Args:
        anchor: The last kept eigenvalue ``a``.
        mass: The total the tail must hold.
        start: The last kept index ``s = r >= 1``.
        count: Tail eigenvalues ``n``.
        stride: Spacing ``sigma >= 1`` of the indices (a layer's positions in the whole tail).
    """
    if count <= 0:
        return torch.zeros(0, dtype=torch.float64)
    if mass <= 0 or anchor <= 0 or anchor * count <= mass:
        return torch.full((count,), max(mass, 0.0) / count, dtype=torch.float64)
    steps = torch.arange(1, count + 1, dtype=torch.float64) * stride
    log_ratio = torch.log1p(steps / start)
    lo, hi = 0.0, 1.0
    while float((anchor * torch.exp(-hi * log_ratio)).sum()) > mass:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if float((anchor * torch.exp(-mid * log_ratio)).sum()) > mass:
            lo = mid
        else:
            hi = mid
    return anchor * torch.exp(-hi * log_ratio)


@dataclass
class LayerTails:
    """The modelled dropped eigenvalues of each layer, on the GGN's own scale.

    Attributes:
        sizes: Parameters per layer ``D_l``.
        norms: ``||U_{l,k}||^2``, ``(L, r)``, float64.
        complement: Dropped directions per layer ``c_l``, ``(L,)``, float64.
        tail: The layers' tail eigenvalues one after the other, ``(m,)``.
        index: The layer of each tail eigenvalue, ``(m,)``.
        zeros: Dropped directions without curvature per layer, ``(L,)``.
        weights: Directions each tail eigenvalue of a layer stands for (``1``, or
            ``c_l / n_l`` where ``c_l < n_l``), ``(L,)``.
    """

    sizes: List[int]
    norms: Tensor
    complement: Tensor
    tail: Tensor
    index: Tensor
    zeros: Tensor
    weights: Tensor
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, eigenvectors: Tensor, eigenvalues: Tensor, mass: float,
              residual_diagonal: Tensor, sizes: Sequence[int], tail_count: int,
              ) -> Optional["LayerTails"]:
        """Return the dropped curvature split over its layers (``None``: one layer or none kept).

        Args:
            eigenvectors: Kept ``U``, ``(D, r)``.
            eigenvalues: Kept ``lambda`` (descending), ``(r,)``.
            mass: The exact dropped mass ``T``.
            residual_diagonal: ``(D,)``; its layer sums, scaled to ``T``, are their masses.
            sizes: Parameters per layer.
            tail_count: The network's nonzero dropped eigenvalues ``n - r``.
        """
        sizes = [int(s) for s in sizes]
        rank = eigenvalues.numel()
        if len(sizes) < 2 or rank == 0 or sum(sizes) != eigenvectors.shape[0]:
            return None
        norms = torch.stack([(part.to(WIDE) ** 2).sum(0)
                             for part in eigenvectors.detach().split(sizes)])
        complement = (torch.tensor(sizes, dtype=WIDE) - norms.sum(1).cpu()).clamp(min=0)
        shares = segment_sums(residual_diagonal.detach().to(WIDE).clamp(min=0), sizes).cpu()
        if float(shares.sum()) > 0:
            masses = shares * (mass / float(shares.sum()))
        else:  # no diagonal mass to go by: in proportion to the dropped directions
            masses = complement * (mass / max(float(complement.sum()), 1e-300))
        anchor = float(eigenvalues[-1])
        free = max(float(complement.sum()), 1e-300)
        tails, index, zeros, weights = [], [], [], []
        for layer, (c, m) in enumerate(zip(complement.tolist(), masses.tolist())):
            count = 0 if m <= 0 or c <= 1e-9 else max(1, int(round(tail_count * c / free)))
            # fewer dropped directions than one eigenvalue (a layer U nearly spans):
            # its eigenvalues count c / count times, so count weight + zeros = c always
            weight = min(1.0, c / count) if count else 1.0
            stride = tail_count / count if count else 1.0
            tails.append(power_law_tail(anchor, m / weight, rank, count, max(stride, 1.0)))
            index.append(torch.full((count,), layer, dtype=torch.long))
            zeros.append(max(c - count, 0.0))
            weights.append(weight)
        return cls(sizes, norms.cpu(), complement, torch.cat(tails), torch.cat(index),
                   torch.tensor(zeros, dtype=WIDE), torch.tensor(weights, dtype=WIDE))

    @classmethod
    def whole(cls, tail: Tensor, dim: int, dropped: int) -> "LayerTails":
        """Return the network-wide tail as one layer without norms (for :meth:`shift` only).

        Args:
            tail: The modelled dropped eigenvalues, ``(m,)``.
            dim: Parameters ``D``.
            dropped: Dropped directions ``D - r``.
        """
        count = tail.numel()
        return cls([dim], torch.zeros(1, 0, dtype=WIDE), torch.tensor([float(dropped)], dtype=WIDE),
                   tail, torch.zeros(count, dtype=torch.long),
                   torch.tensor([float(dropped - count)], dtype=WIDE),
                   torch.ones(1, dtype=WIDE))

    @property
    def num_layers(self) -> int:
        """Number of layers ``L``."""
        return len(self.sizes)

    def layer_means(self, values: Tensor) -> Tensor:
        """Per-layer means of a scalar or a ``(D,)`` vector, shape ``(L,)``."""
        if values.numel() == 1:
            return values.reshape(()).expand(self.num_layers)
        return segment_sums(values, self.sizes) / values.new_tensor(self.sizes)

    def shift(self, scale: Tensor, prior: Tensor, exponent: float,
              device: torch.device) -> Tuple[Tensor, Tensor]:
        r"""Return each layer's shift ``rho_l`` ``(L,)`` and the tails' log det, at mean priors.

        Float64, differentiable in ``scale`` and ``prior``.

        Args:
            scale: ``h``.
            prior: The prior precision, scalar or ``(D,)``.
            exponent: The Jacobian-weighting exponent ``beta``.
            device: Where the posterior lives.
        """
        index, raw, zeros, count, weight = self._prior_free(exponent, device)
        delta = self.layer_means(prior.to(WIDE))
        tail = torch.as_tensor(scale).to(device=device, dtype=WIDE) * raw
        shifted = tail + delta[index]
        inverse = 1 / shifted
        empty = torch.zeros(self.num_layers, dtype=WIDE, device=device)
        if weight is not None:
            num = empty.index_add(0, index, weight * tail * inverse)
            den = empty.index_add(0, index, weight * inverse)
            rho = torch.where(den > 0, num / den.clamp(min=torch.finfo(WIDE).tiny), empty)
        else:
            num = empty.index_add(0, index, count * tail * inverse)
            rho = num / (empty.index_add(0, index, count * inverse) + zeros / delta)
        logdet = (count * torch.log(shifted)).sum() + (zeros * torch.log(delta)).sum()
        return rho, logdet

    def _prior_free(self, exponent: float, device: torch.device) -> Tuple[Tensor, ...]:
        """:meth:`shift`'s prior-free factors (index, tail, zeros, weights, Jacobian weights)."""
        key = (float(exponent), str(device))
        if key not in self._cache:
            index, raw = self.index.to(device), self.tail.to(device=device, dtype=WIDE)
            weight = None
            if exponent > 0 and raw.numel() and float(raw.max()) > 0:
                weight = (raw / raw.max()) ** exponent
            self._cache[key] = (index, raw, self.zeros.to(device),
                                self.weights.to(device)[index], weight)
        return self._cache[key]
