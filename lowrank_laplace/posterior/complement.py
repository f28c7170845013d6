r"""The complement variance measured on a probe of training inputs.

The spectral residual (:mod:`~lowrank_laplace.posterior.residual`) gives every
direction outside the kept eigenvectors ``U`` one variance :math:`v`, which enters
every predictive variance through the part of an input's Jacobian outside ``U``.
Its modelled value weights a power-law tail by a fitted law of Jacobian energies, which
can miss the exact value on a MAP-trained CNN (see the posterior-quality page of the
docs). Here :math:`v` is measured instead, from ``m`` training inputs (the
*probe*) whose Jacobians :math:`J_n` (``C x D``) one backward pass gives:

* the probe's Jacobian rows projected out of ``U``, :math:`J_c = (I - U U^\top) J^\top`
  (``D x mC``), and their energy :math:`E = \|J_c\|_F^2`;
* the complement GGN sub-sampled on the probe,
  :math:`G_c \approx (N / m) \sum_n (I - UU^\top) J_n^\top \Lambda_n J_n (I - UU^\top)`
  (:math:`\Lambda_n = S_n S_n^\top` the loss Hessian on laplace-torch's scale), with
  eigenpairs :math:`(\mu_k, e_k)`, and the probe's energies on them
  :math:`q_k = \|J_c^\top e_k\|^2`;

so that

.. math:: v(\delta) = \frac{1}{E}\Big(\sum_k \frac{q_k}{h\mu_k + \delta}
          + \frac{E - \sum_k q_k}{h\mu_0 + \delta}\Big)

at every prior precision :math:`\delta` and GGN scale :math:`h`, with :math:`\mu_0` the
smallest resolved eigenvalue (:func:`measure_complement`). Nothing of size
``D x mC`` is formed: with the Jacobian factor's Gram matrix
:math:`F^\top F` and :math:`Z = F^\top U` (one backward pass, the ViViT Gram of its
blocks), :math:`M = J_c^\top J_c = (F^\top F - Z Z^\top)/2` holds it all:
:math:`G_c`'s nonzero eigenvalues are those of :math:`K = (N/m)\, S^\top M S` (``S``
block-diagonal over inputs), and :math:`q_k = (N/m) \|M S a_k\|^2 / \mu_k` for the
eigenvectors :math:`a_k` of ``K``.

The probe's inputs are training inputs, part of the GGN they are weighed against; a
test input is not. So each half of the probe is weighed against the GGN sub-sampled
from the other half (``m / 2`` inputs, scaled by ``N / (m / 2)``), and the two halves'
energies are pooled (a probe covering the whole training set uses the exact GGN
instead). A GGN sub-sampled from ``n`` of ``N`` inputs spreads its spectrum, so the
measured :math:`v` is biased upwards, by about :math:`1/n - 1/N`; the same measurement
with the halves' first halves removes that term:
:math:`v = v_n - (v_{n/2} - v_n)(1 - n / N)`, clamped to
:math:`[1 / (h\lambda_r + \delta), 1 / \delta]` (no dropped direction is curved more
than the last kept eigenvalue :math:`\lambda_r`). Weighing the probe against a GGN that
holds its own inputs instead under-states what test inputs see (measured on the
posterior-quality page).

Shape glossary:
    D: parameters; r: kept rank; m: probe inputs; C: outputs; V: loss-factor columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

#: Relative size (of the un-projected Gram's trace) below which a complement eigenvalue
#: or energy is not resolved: ``M`` is a difference of two Gram matrices and holds their
#: rounding, about ``eps`` times their trace, 1e-7 in float32. One floor for every dtype,
#: so that float32 and float64 fits of one model agree even at tiny prior precisions.
RESOLUTION = 1e-6
#: Fewest inputs of a sub-sampled GGN that the bias correction measures again on.
MIN_HALF = 16
_FIELDS = ("mu", "q", "mu_half", "q_half", "energy", "fraction", "floor")


@dataclass
class MeasuredComplement:
    """The measured complement spectrum, on the GGN's own scale (before ``h``).

    Attributes:
        mu: Eigenvalues of the complement GGNs sub-sampled on each half of the probe,
            one after the other, ``(k,)``.
        q: The other half's Jacobian energies on their eigenvectors, ``(k,)``.
        mu_half: The same on the halves' first halves (``None``: no bias correction).
        q_half: Their energies (of the other whole half's Jacobians).
        energy: The probe's Jacobian energy outside ``U``, :math:`E`, a scalar tensor.
        fraction: Inputs of one sub-sampled GGN over the training set, ``n / N``.
        floor: The smallest resolved eigenvalue; the energy outside ``mu``'s
            directions counts as curved by it.
    """

    mu: Tensor
    q: Tensor
    mu_half: Optional[Tensor]
    q_half: Optional[Tensor]
    energy: Tensor
    fraction: float
    floor: float = 0.0

    def variance(self, scale: Tensor, prior: Tensor, anchor: float) -> Tensor:
        r"""The complement variance :math:`v` at GGN scale ``h`` and prior ``delta``.

        Args:
            scale: ``h`` (may carry gradients).
            prior: The prior precision ``delta``, a scalar (may carry gradients).
            anchor: The last kept eigenvalue ``lambda_r`` (the lower clamp).

        Returns:
            Float64 scalar tensor.
        """
        delta = torch.as_tensor(prior).to(device=self.mu.device, dtype=torch.float64)
        h = torch.as_tensor(scale).to(device=self.mu.device, dtype=torch.float64)
        full = _variance(self.mu, self.q, self.energy, self.floor, h, delta)
        if self.mu_half is None:
            value = full
        else:
            half = _variance(self.mu_half, self.q_half, self.energy, self.floor, h, delta)
            value = full - (half - full) * (1 - self.fraction)
        low = 1 / (h * anchor + delta)
        return torch.minimum(torch.maximum(value, low), 1 / delta)

    def shift(self, scale: Tensor, prior: Tensor, anchor: float) -> Tensor:
        r"""The precision shift :math:`\rho = 1 / v - \delta \ge 0` (float64 scalar)."""
        delta = torch.as_tensor(prior).to(device=self.mu.device, dtype=torch.float64)
        return (1 / self.variance(scale, delta, anchor) - delta).clamp(min=0)

    def to(self, device: torch.device) -> "MeasuredComplement":
        """The same measurement on ``device``."""
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return MeasuredComplement(move(self.mu), move(self.q), move(self.mu_half),
                                  move(self.q_half), move(self.energy), self.fraction,
                                  self.floor)

    def state(self) -> Dict[str, object]:
        """A plain dict for ``state_dict`` (tensors on the CPU)."""
        cpu = self.to(torch.device("cpu"))
        return {name: getattr(cpu, name) for name in _FIELDS}

    @classmethod
    def from_state(cls, state: Optional[Dict[str, object]]) -> Optional["MeasuredComplement"]:
        """Inverse of :meth:`state` (``None`` stays ``None``)."""
        if state is None:
            return None
        return cls(**{name: state[name] for name in _FIELDS})


def _variance(mu: Tensor, q: Tensor, energy: Tensor, floor: float, h: Tensor,
              delta: Tensor) -> Tensor:
    """``v`` of one measurement (float64).

    Energy outside every resolved direction counts as curved by ``floor``.
    """
    unresolved = (energy - q.sum()).clamp(min=0)
    return ((q / (h * mu + delta)).sum() + unresolved / (h * floor + delta)) / energy


def measure_complement(gram: Tensor, Z: Tensor, loss_sqrt: Tensor, num_data: int
                       ) -> Optional[MeasuredComplement]:
    r"""The complement spectrum from a probe's Jacobian factor.

    Complement eigenvalues below :data:`RESOLUTION` times the GGN's trace (as the
    probe estimates it) are not resolved: their directions' energy, and all energy
    outside the resolved directions, counts as curved by that floor. Flat directions
    (e.g. the sum of the logits under the cross-entropy) so get :math:`1 / \delta`
    wherever :math:`\delta` is above ``h`` times the floor, as in the full GGN's
    posterior, and a bounded variance below it, the same in float32 and float64.

    Args:
        gram: :math:`F^\top F` of the probe's Jacobian factor :math:`F = \sqrt 2 J^\top`
            (the MSE-sum engine's), columns ordered ``(c, n)``, shape ``(C m, C m)``.
        Z: :math:`F^\top U`, shape ``(C m, r)``.
        loss_sqrt: Rows :math:`s_{vn}` of the loss Hessian on laplace-torch's scale,
            :math:`\Lambda_n = \sum_v s_{vn} s_{vn}^\top`, shape ``(V, m, C)``.
        num_data: Training inputs ``N`` the GGN sums over.

    Returns:
        The measurement, or ``None`` where the probe has no energy outside ``U``.
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
    weight = num_data / m
    # the GGN's trace as the probe estimates it: the scale of M's rounding in K
    trace = weight * float(torch.einsum("vnc,vnb,cnbn->", S, S,
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
