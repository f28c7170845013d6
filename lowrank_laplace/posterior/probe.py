r"""The spectral residual's probe: what a fit measures on its first training inputs.

One Jacobian pass with all outputs, on the fit's Jacobian engine, gives the kept
eigenvectors' Jacobian energies (the exponent ``beta``, :func:`jacobian_exponent`), the
complement variance (:mod:`~lowrank_laplace.posterior.complement`) and the rank check
(:func:`variance_change`, from the same measurement). Data-parallel fits sum the energies
and take process 0's measurement.

Shape glossary:
    D: Laplace parameters; r: kept rank; m: measured probe inputs; C: outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.factor.loss_sqrt import hessian_sqrt
from lowrank_laplace.fitting.budget import (
    micro_batch_size,
    resolve_memory_budget,
    samples_in_budget,
)
from lowrank_laplace.fitting.config import FitConfig
from lowrank_laplace.fitting.fit import FitResult
from lowrank_laplace.fitting.loader import likelihood_loss
from lowrank_laplace.posterior.complement import (
    MeasuredComplement,
    UnresolvedTail,
    measure_complement,
)
from lowrank_laplace.posterior.null import NullDirections, moves_outputs_alike
from lowrank_laplace.posterior.predictive import jacobian_energies, micro_batches
from lowrank_laplace.utils.batches import batch_device, take
from lowrank_laplace.utils.checks import check_batch

#: Training inputs (the first) a fit with the spectral residual keeps for its probe.
PROBE_SIZE = 256
#: Random output combinations over the whole probe for the energies (each input
#: carries ``ceil(PROBE_COLUMNS / inputs)``, or all ``C`` if not fewer); ``None``: exact.
PROBE_COLUMNS = 512
#: Measure the complement variance on the probe (scalar priors) instead of modelling it.
MEASURE_COMPLEMENT = True
#: Fewest probe inputs the complement variance is measured on (else it is modelled).
MIN_MEASURED = 32
#: Most Jacobian columns (inputs times outputs) of the measurement.
MAX_COLUMNS = 1024


@dataclass(frozen=True)
class ProbeResult:
    """What the probe pass measured.

    Attributes:
        exponent: The Jacobian-weighting exponent ``beta``.
        complement: The measured complement variance (``None``: modelled).
        variance_change: :func:`variance_change` from the leading half of the kept
            eigenpairs to all (``None``: not measured).
        null: The logit-shift directions the probe checked (``None``: none).
    """

    exponent: float = 0.0
    complement: Optional[MeasuredComplement] = None
    variance_change: Optional[float] = None
    null: Optional[NullDirections] = None


def probe_residual(run: Any, fit: FitResult, head: Tuple[str, Optional[NullDirections]],
                   prior: Optional[Tuple[float, float]] = None) -> ProbeResult:
    """``beta`` of the spectral residual, the measured complement and the rank check.

    The measurement covers the probe inputs within half the memory budget and
    :data:`MAX_COLUMNS` columns (none below :data:`MIN_MEASURED` inputs); it checks the
    candidate logit-shift directions and measures the complement outside them.

    Args:
        run: The open :class:`~lowrank_laplace.fitting.fit.LoaderFit` of the fit: its
            Jacobian engine, options and data-parallel process group.
        fit: The fit, with its probe inputs.
        head: The likelihood (``"classification"`` or ``"regression"``) and the
            candidate logit-shift directions (``posterior.null.head_directions``).
        prior: ``(h, delta)`` of a scalar prior to measure under; ``None``: no
            measurement.

    Returns:
        The :class:`ProbeResult`.
    """
    U, lam, probe = fit.eigenvectors, fit.eigenvalues, fit.probe
    if U.shape[1] in (0, U.shape[0]) or probe is None:  # nothing kept, or nothing dropped
        return ProbeResult()
    (likelihood, null), measure = head, prior is not None and MEASURE_COMPLEMENT
    config, group = run.config, run.group
    engine = run.jacobian  # the fit's Jacobian engine, opened on first use
    null = None if null is None else _checked_head(engine, probe.batches[0], null)
    inputs = sum(check_batch(x, None) for x in probe.batches)
    projections = None if PROBE_COLUMNS is None else -(-PROBE_COLUMNS // max(inputs, 1))
    if projections is not None and projections >= fit.n_outputs:
        projections = None  # no cheaper than the exact energies
    if (projections or fit.n_outputs) > probe.cap:  # fewer random ones fit the budget
        projections = probe.cap
    complement, energy, rank_check = None, None, None
    if measure and (group is None or dist.get_rank(group) == 0):
        complement, energy, rank_check = _measure(
            engine, probe.batches, fit, config, (likelihood_loss(likelihood), prior, null))
    if energy is None or projections is not None or group is not None:
        micro = micro_batch_size(engine, probe.batches[0], projections,
                                 config.memory_budget, config.micro_batch_size)
        energy = jacobian_energies(engine, probe.batches, U, micro, projections,
                                   probe.rng)
    if group is not None:
        dist.all_reduce(energy, group=group)
        if measure:
            complement, rank_check = _broadcast(complement, U, group), None
    exponent = jacobian_exponent(lam, energy)
    change = None if rank_check is None else rank_check(exponent)
    return ProbeResult(exponent, complement, change, null)


def jacobian_exponent(eigenvalues: Tensor, energies: Tensor) -> float:
    r"""The exponent ``beta`` of ``e_k ~ lambda_k^beta``, clamped to ``[0, 1]``.

    Least squares of ``log e_k`` on ``log lambda_k`` over pairs with both positive
    (``lambda`` above ``1e-12`` of the largest); 0 with fewer than two distinct ones.

    Args:
        eigenvalues: Kept ``lambda``, ``(r,)``.
        energies: Jacobian energies ``e_k = sum_n ||J_n u_k||^2``, ``(r,)``.

    Returns:
        ``beta``.
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


def _measure(engine: FactorEngine, probe: List[Any], fit: FitResult, config: FitConfig,
             data: tuple) -> Tuple[Optional[MeasuredComplement], Optional[Tensor],
                                   Optional[Callable[[float], Optional[float]]]]:
    """The complement on the probe inputs that fit, exact energies of ``U`` and the rank check.

    The energies only where those inputs are the whole probe; the rank check maps ``beta``
    to :func:`variance_change`. ``data``: ``((loss, factor), (h, delta), null)``.
    """
    (U, lam, num_data), (loss, prior, null) = (fit.eigenvectors, fit.eigenvalues,
                                               fit.n_data), data
    budget = resolve_memory_budget(config.memory_budget, batch_device(probe[0]))
    try:
        fits, _ = samples_in_budget(engine, probe[0], None, budget / 2, False)
    except ValueError:  # not one input's C vectors: the model stays
        return None, None, None
    total = sum(check_batch(x, None) for x in probe)
    m = min(total, fits, num_data, MAX_COLUMNS // max(engine.num_outputs or 1, 1))
    if m < MIN_MEASURED:
        return None, None, None
    micro = micro_batch_size(engine, probe[0], None, config.memory_budget,
                             config.micro_batch_size)
    factors, left = [], m
    for inputs in probe:
        n = check_batch(inputs, None)
        factors += [engine.compute(chunk, None, gradient=False)
                    for chunk in micro_batches(take(inputs, slice(0, left), n), micro)]
        left -= min(n, left)
        if left == 0:
            break
    classes = engine.num_outputs
    gram, Z, outputs = _assemble(factors, U, classes, m)
    ZN = None if null is None else torch.cat([null.factor_product(f).to(Z).reshape(
        classes, f.num_samples, -1) for f in factors], 1).reshape(classes * m, -1)
    outside = Z if ZN is None else torch.cat([Z, ZN], 1)  # the complement: outside both
    loss_func, factor = loss
    S = hessian_sqrt(loss_func, outputs.to(torch.float64), 0, None) * factor ** 0.5
    energy = (Z**2).sum(0).div(2).to(U.dtype) if m == total else None  # E[V V^T] = 2 J^T J
    full = measure_complement(gram, outside, S, num_data)
    if full is None or lam.numel() < 2:
        return full, energy, None
    null_energy = None if ZN is None else (ZN**2).sum(1) / 2
    probe = ProbeColumns(gram.diagonal() / 2, Z / 2**0.5, classes, null_energy)
    known = 0 if null is None else null.count

    def rank_check(exponent: float) -> Optional[float]:
        tail = _unresolved(fit, lam.numel(), exponent, known)
        variance = full.variance(torch.tensor(prior[0]), torch.tensor(prior[1]),
                                 float(lam[-1]), tail)
        return variance_change(probe, lam, variance, prior)

    return full, energy, rank_check


def _checked_head(engine: FactorEngine, inputs: Any, null: NullDirections
                  ) -> Optional[NullDirections]:
    """The candidate directions if they move every output alike on the first inputs, or ``None``."""
    n = check_batch(inputs, None)
    factor = engine.compute(take(inputs, slice(0, min(n, MIN_MEASURED)), n), None,
                            gradient=False)
    alike = moves_outputs_alike(null.factor_product(factor), engine.num_outputs)
    return null if alike else None


def _unresolved(fit: FitResult, rank: int, exponent: float, known: int) -> UnresolvedTail:
    """The modelled tail beyond a fit's leading ``rank`` eigenpairs (``known`` null ones apart)."""
    lam, dim = fit.eigenvalues[:rank].double().cpu(), fit.eigenvectors.shape[0]
    mass = max(float(fit.trace) - float(lam.sum()), 0.0)
    return UnresolvedTail.of_fit(lam, mass, fit.rank_bound, dim, exponent, known)


@dataclass(frozen=True)
class ProbeColumns:
    """The measured probe inputs' Jacobians, as the rank check needs them.

    Attributes:
        norms: ``||J_nc||^2``, ordered ``(c, n)``, ``(C m,)``.
        projections: ``J_nc U``, ``(C m, r)``, float64.
        classes: Outputs ``C``.
        null: ``||J_nc N||^2`` on the logit-shift directions (``None``: none known).
    """

    norms: Tensor
    projections: Tensor
    classes: int
    null: Optional[Tensor] = None


def predictive_variance(probe: ProbeColumns, eigenvalues: Tensor, variance: Tensor,
                        prior: Tuple[float, float], lumped: Optional[int] = None) -> Tensor:
    r"""Each probe input's GLM variance summed over outputs, under the spectral residual.

    ``sum_c (sum_k z_nck^2 / (h lambda_k + delta) + v (||J_nc||^2 - sum_k z_nck^2))``, the
    logit-shift directions' energy apart at ``1 / delta``. With ``lumped = k``, the kept
    directions from ``k`` on join the complement: their exact eigenvalues and the probe's
    energies on them pool with ``v`` into one variance, as a rank-``k`` fit's residual
    would hold them.

    Args:
        probe: The probe's Jacobian columns.
        eigenvalues: The kept ``lambda``, ``(r,)``.
        variance: The complement variance ``v`` outside all ``r``.
        prior: ``(h, delta)``.
        lumped: Kept directions treated as kept (``None``: all).

    Returns:
        ``(m,)``, float64.
    """
    (scale, delta), lam = prior, eigenvalues.to(probe.projections)
    z2 = probe.projections[:, : lam.numel()] ** 2
    inverse = 1 / (scale * lam + delta)
    null = 0 if probe.null is None else probe.null
    outside = (probe.norms - z2.sum(1) - null).clamp(min=0)
    v, k = variance.to(z2.dtype), lam.numel() if lumped is None else lumped
    if k < lam.numel():  # pooled: energy-weighted mean of the lumped and outside variances
        pooled = z2[:, k:].sum(0)
        total = pooled.sum() + outside.sum()
        v = ((pooled * inverse[k:]).sum() + v * outside.sum()) / total.clamp(
            min=torch.finfo(z2.dtype).tiny)
        outside = outside + z2[:, k:].sum(1)
    inside = z2[:, :k] @ inverse[:k]
    return (inside + v * outside + null / delta).reshape(probe.classes, -1).sum(0)


def variance_change(probe: ProbeColumns, eigenvalues: Tensor, variance: Tensor,
                    prior: Tuple[float, float]) -> float:
    """Median relative change of the probe inputs' predictive variance from half to all.

    The leading half of the kept eigenpairs against all of them: the directions the half
    drops join its complement (:func:`predictive_variance` with ``lumped``).

    Args:
        probe: The probe's Jacobian columns.
        eigenvalues: The kept ``lambda``, ``(r,)``, ``r >= 2``.
        variance: The complement variance ``v`` outside all of them.
        prior: ``(h, delta)``.

    Returns:
        ``median |var_half - var| / var`` over the inputs.
    """
    var = predictive_variance(probe, eigenvalues, variance, prior)
    var_half = predictive_variance(probe, eigenvalues, variance, prior,
                                   eigenvalues.numel() // 2)
    return float(((var_half - var).abs() / var.clamp(min=1e-300)).median())


def _assemble(factors: List[Any], U: Tensor, classes: int, m: int
              ) -> Tuple[Tensor, Tensor, Tensor]:
    """The Gram matrix, ``F^T U`` and outputs of the probe, columns ordered ``(c, n)``."""
    wide = torch.float64
    gram = torch.zeros(classes, m, classes, m, dtype=wide, device=U.device)
    Z = torch.zeros(classes, m, U.shape[1], dtype=wide, device=U.device)
    starts = [sum(f.num_samples for f in factors[:i]) for i in range(len(factors))]
    spans = [slice(start, start + f.num_samples) for start, f in zip(starts, factors)]
    for i, (fi, si) in enumerate(zip(factors, spans)):
        ni = fi.num_samples
        # the factor's dtype, as its Gram matrix: M = (F^T F - Z Z^T) / 2 cancels alike
        Z[:, si] = fi.t_matmul(U).to(wide).reshape(classes, ni, -1)
        for fj, sj in zip(factors[i:], spans[i:]):
            block = sum(a.cross(b) for a, b in zip(fi.group_blocks(), fj.group_blocks()))
            block = block.to(wide).reshape(classes, ni, classes, fj.num_samples)
            gram[:, si, :, sj] = block
            gram[:, sj, :, si] = block.permute(2, 3, 0, 1)
    outputs = torch.cat([f.outputs.reshape(f.num_samples, -1) for f in factors])
    return gram.reshape(classes * m, classes * m), Z.reshape(classes * m, -1), outputs


def _broadcast(measured: Optional[MeasuredComplement], U: Tensor, group: Any
               ) -> Optional[MeasuredComplement]:
    """Process 0's measurement on every process (``None`` stays ``None``)."""
    box = [None if measured is None else measured.state()]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group,
                               device=U.device)
    return None if box[0] is None else MeasuredComplement.from_state(box[0]).to(U.device)
