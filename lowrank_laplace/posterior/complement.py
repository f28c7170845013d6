r"""The complement variance measured on a probe of training inputs.

The spectral residual's variance ``v`` outside ``U``, from the probe's ``(C m) x (C m)``
Gram matrix: each half's complement GGN against the other half's Jacobian energy
(:class:`UnresolvedTail` for what a half cannot resolve; docs/benchmarks/posterior_quality.md).

Shape glossary:
    D: parameters; r: kept rank; m: probe inputs; C: outputs; V: loss-factor columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from lowrank_laplace.posterior.layer_tail import spectral_tail

#: Share of the probe's GGN trace below which a complement eigenvalue or energy is not
#: resolved (``M`` holds two Gram matrices' rounding); one floor for every dtype, so
#: float32 and float64 fits agree at tiny priors.
RESOLUTION = 1e-6
#: Fewest inputs of a sub-sampled GGN that the bias correction measures again on.
MIN_HALF = 16


@dataclass
class MeasuredComplement:
    """The measured complement spectrum, on the GGN's own scale (before ``h``).

    Attributes:
        mu: Eigenvalues of the complement GGNs of both probe halves, ``(k,)``.
        q: The other half's Jacobian energies on their eigenvectors, ``(k,)``.
        mu_half: The same on the halves' first halves (``None``: no bias correction).
        q_half: Their energies.
        energy: The probe's Jacobian energy outside ``U``, ``E``.
        fraction: ``n / N`` of one sub-sampled GGN.
        floor: The smallest resolved eigenvalue; unresolved energy is curved by it.
    """

    mu: Tensor
    q: Tensor
    mu_half: Optional[Tensor]
    q_half: Optional[Tensor]
    energy: Tensor
    fraction: float
    floor: float = 0.0

    def variance(self, scale: Tensor, prior: Tensor, anchor: float,
                 tail: Optional["UnresolvedTail"] = None) -> Tensor:
        r"""Return the complement variance ``v`` (float64 scalar) at scale ``h``, prior ``delta``.

        Args:
            scale: ``h`` (may carry gradients).
            prior: Scalar ``delta`` (may carry gradients).
            anchor: The last kept eigenvalue ``lambda_r`` (the lower clamp).
            tail: The modelled curvature of the energy a probe half leaves unresolved
                (``None``: all of it curved by the floor).
        """
        delta = torch.as_tensor(prior).to(device=self.mu.device, dtype=torch.float64)
        h = torch.as_tensor(scale).to(device=self.mu.device, dtype=torch.float64)
        tail = tail if self.fraction < 1 else None  # the whole data: nothing unresolved

        def measured(mu: Tensor, q: Tensor) -> Tensor:
            unresolved = 1 / (h * self.floor + delta) if tail is None else \
                tail.variance(mu.numel() // 2, h, delta, self.floor)
            return _variance(mu, q, self.energy, h, delta, unresolved)

        value = measured(self.mu, self.q)
        if self.mu_half is not None:  # the sub-sample's bias extrapolated away
            value = value - (measured(self.mu_half, self.q_half) - value) * (1 - self.fraction)
        low = 1 / (h * anchor + delta)
        return torch.minimum(torch.maximum(value, low), 1 / delta)

    @property
    def resolved_share(self) -> float:
        """Share of the probe's complement energy its halves resolve (the rest meets the tail)."""
        return min(float(self.q.sum() / self.energy), 1.0)

    def shift(self, scale: Tensor, prior: Tensor, anchor: float,
              tail: Optional["UnresolvedTail"] = None) -> Tensor:
        r"""The precision shift :math:`\rho = 1 / v - \delta \ge 0` (float64 scalar)."""
        delta = torch.as_tensor(prior).to(device=self.mu.device, dtype=torch.float64)
        return (1 / self.variance(scale, delta, anchor, tail) - delta).clamp(min=0)

    def to(self, device: torch.device) -> "MeasuredComplement":
        """The same measurement on ``device``."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return MeasuredComplement(**{name: value.to(device) if torch.is_tensor(value) else value
                                     for name, value in values.items()})

    def state(self) -> Dict[str, object]:
        """A plain dict for ``state_dict`` (tensors on the CPU)."""
        cpu = self.to(torch.device("cpu"))
        return {f.name: getattr(cpu, f.name) for f in fields(cpu)}

    @classmethod
    def from_state(cls, state: Optional[Dict[str, object]]) -> Optional["MeasuredComplement"]:
        """Inverse of :meth:`state` (``None`` stays ``None``)."""
        return None if state is None else cls(**{f.name: state[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class UnresolvedTail:
    """Where the energy a probe half leaves unresolved lies: the modelled tail.

    A half of ``n`` inputs resolves at most ``n V`` complement directions; the energy it
    leaves is spread over the modelled tail beyond the ``k`` it resolved (weighted
    ``t^beta``) and the null directions beyond the GGN's rank (curved by the floor).

    Attributes:
        tail: Modelled dropped eigenvalues (descending, GGN scale), ``(n - r,)``.
        exponent: The Jacobian-weighting exponent ``beta``.
        free: Dropped directions ``D - r``.
    """

    tail: Tensor
    exponent: float
    free: int
    _parts: Dict[tuple, Optional[Tuple[Tensor, Tensor, float]]] = field(
        default_factory=dict, compare=False, repr=False)

    @classmethod
    def of_fit(cls, eigenvalues: Tensor, mass: float, rank_bound: int, dim: int,
               exponent: float, known: int = 0) -> "UnresolvedTail":
        """The modelled tail beyond a fit's kept eigenvalues (:func:`spectral_tail`).

        Args:
            eigenvalues: Kept ``lambda`` (descending), ``(r,)``.
            mass: The exact dropped curvature.
            rank_bound: Upper bound on the rank of the GGN.
            dim: Parameters ``D``.
            exponent: The Jacobian-weighting exponent ``beta``.
            known: Null directions known apart (the logit-shift directions): neither in
                the tail nor among the free directions.
        """
        tail = spectral_tail(eigenvalues, mass, min(rank_bound, dim - known), dim)
        return cls(tail, exponent, dim - eigenvalues.numel() - known)

    def variance(self, resolved: int, scale: Tensor, prior: Tensor, floor: float) -> Tensor:
        """The variance per unit of unresolved energy where ``resolved`` are resolved.

        A float64 scalar, differentiable in ``scale`` and ``prior``.
        """
        flat = 1 / (scale * floor + prior)
        parts = self._beyond(resolved, prior.device)
        if parts is None:
            return flat
        beyond, weight, share = parts
        curved = (weight / (scale * beyond + prior)).sum() / weight.sum()
        return share * curved + (1 - share) * flat

    def _beyond(self, resolved: int, device: torch.device
                ) -> Optional[Tuple[Tensor, Tensor, float]]:
        """The tail beyond ``resolved``, its weights ``t^beta`` and its share, or ``None``."""
        key = (resolved, str(device))
        if key not in self._parts:
            beyond = self.tail[resolved:].to(device=device, dtype=torch.float64)
            free = self.free - resolved
            top = float(beyond.max()) if beyond.numel() else 0.0
            self._parts[key] = None if free <= 0 or top <= 0 else (
                beyond, (beyond / top) ** self.exponent, min(beyond.numel() / free, 1.0))
        return self._parts[key]


def _variance(mu: Tensor, q: Tensor, energy: Tensor, h: Tensor, delta: Tensor,
              unresolved: Tensor) -> Tensor:
    """``v`` of one measurement; ``unresolved``: the variance per unit of unresolved energy."""
    rest = (energy - q.sum()).clamp(min=0)
    return ((q / (h * mu + delta)).sum() + rest * unresolved) / energy


def measure_complement(gram: Tensor, Z: Tensor, loss_sqrt: Tensor, num_data: int
                       ) -> Optional[MeasuredComplement]:
    r"""Return the complement spectrum of a probe (``None``: no energy outside ``U``).

    Energy below the :data:`RESOLUTION` floor counts as curved by it (flat directions get
    ``1 / delta`` above ``h`` times the floor and a bounded variance below, in either dtype).

    Args:
        gram: ``F^T F`` of the probe's factor ``F = sqrt(2) J^T``, columns ``(c, n)``,
            ``(C m, C m)``.
        Z: ``F^T U``, ``(C m, r)``.
        loss_sqrt: Loss-Hessian rows ``s_vn`` on laplace-torch's scale, ``(V, m, C)``.
        num_data: Training inputs ``N``.
    """
    wide = torch.float64
    num_vectors, m, classes = loss_sqrt.shape
    Z, gram = Z.to(wide), gram.to(wide)
    M = (gram - Z @ Z.T) / 2
    M = (M + M.T) / 2
    energy = M.diagonal().sum()
    if float(energy) <= RESOLUTION * float(gram.diagonal().sum()) / 2:
        return None
    S = loss_sqrt.to(wide)
    # the GGN's trace as the probe estimates it: the scale of M's rounding in K
    trace = num_data / m * float(torch.einsum("vnc,vnb,cnbn->", S, S,
                                        gram.reshape(classes, m, classes, m))) / 2
    floor = RESOLUTION * trace
    # M S: columns (v, n') of the probe's complement GGN factor, rows (c, n)
    MS = torch.einsum("anbk,vkb->anvk", M.reshape(classes, m, classes, m), S)
    MS = MS.reshape(classes * m, num_vectors * m)
    K = torch.einsum("vnc,cnwk->vnwk", S, MS.reshape(classes, m, num_vectors, m))
    K = K.reshape(num_vectors * m, num_vectors * m)
    every = torch.arange(m, device=M.device)
    if m >= num_data:  # the probe is the data: its GGN is the exact one
        mu, q = _spectrum(K, MS, 1.0, floor)
        return MeasuredComplement(mu, q, None, None, energy, 1.0, floor)
    half = m // 2
    first, second = every[:half], every[half:2 * half]
    energy = M.diagonal().reshape(classes, m)[:, :2 * half].sum()

    def cross(ggn_sets):  # each half's GGN with the other half's energies
        parts = []
        for g, e in zip(ggn_sets, (second, first)):
            cols = _index(num_vectors, m, g)
            parts.append(_spectrum(K[cols][:, cols], MS[_index(classes, m, e)][:, cols],
                                   num_data / g.numel(), floor))
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    mu, q = cross((first, second))
    mu_half = q_half = None
    if half // 2 >= MIN_HALF:
        mu_half, q_half = cross((first[:half // 2], second[:half // 2]))
    return MeasuredComplement(mu, q, mu_half, q_half, energy, half / num_data, floor)


def _spectrum(K: Tensor, MS: Tensor, weight: float, floor: float) -> Tuple[Tensor, Tensor]:
    """Eigenvalues of ``weight K`` from ``floor`` up, and the probe's energies on them."""
    evals, A = torch.linalg.eigh((K + K.T) / 2)
    keep = weight * evals >= floor
    evals, A = evals[keep], A[:, keep]
    q = ((MS @ A) ** 2).sum(0) / evals  # ||J_c^T e||^2 = ||M S a||^2 / lambda_K
    return weight * evals, q


def _index(width: int, m: int, inputs: Tensor) -> Tensor:
    """Rows or columns ``(k, n)`` (``k < width``, ``n`` in ``inputs``) in ``(k, n)`` order."""
    return (torch.arange(width, device=inputs.device)[:, None] * m + inputs[None]).reshape(-1)
