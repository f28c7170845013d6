r"""The spectral residual's probe: what a fit measures on a few training inputs.

After the eigenpairs, a fit with ``residual="spectral"`` runs the model's Jacobian
(an MSE-sum engine, no targets) over the first ``probe_size`` training inputs:

* the kept eigenvectors' Jacobian energies, whose law against the eigenvalues gives
  the exponent :math:`\beta` of the modelled complement variance
  (:func:`~lowrank_laplace.posterior.residual.jacobian_exponent`);
* with ``measure_complement`` (the default), the complement variance itself
  (:mod:`~lowrank_laplace.posterior.complement`): one pass with all ``C`` outputs over
  the first ``MAX_COLUMNS / C`` probe inputs (as many as fit half the memory budget),
  their Gram matrix, and the small eigenproblems it gives.

Data-parallel fits sum the energies over processes and take process 0's
measurement, so every process ends with the same posterior.

Shape glossary:
    D: Laplace parameters; r: kept rank; m: measured probe inputs; C: outputs.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor, nn

from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.factor.loss_sqrt import hessian_sqrt
from lowrank_laplace.fitting.budget import (
    micro_batch_size,
    resolve_memory_budget,
    samples_in_budget,
)
from lowrank_laplace.posterior.complement import MeasuredComplement, measure_complement
from lowrank_laplace.posterior.predictive import jacobian_energies
from lowrank_laplace.posterior.residual import jacobian_exponent
from lowrank_laplace.utils.batches import batch_device, take
from lowrank_laplace.utils.checks import check_batch

#: Fewest probe inputs the complement variance is measured on (else it is modelled).
MIN_MEASURED = 32
#: Most Jacobian columns (inputs times outputs) of the measurement: its Gram matrix
#: grows with their square, its eigenproblems with the cube of a half's; fewer columns
#: leave more of the sub-sampled GGN's bias (docs/benchmarks/design_measurements.md).
MAX_COLUMNS = 1024


def probe_vector_cap(engine: Any, X: Any, memory_budget: Any) -> int:
    """The most vectors per input the Jacobian probe's pass may carry within the budget.

    Checked at the first batch, so that a budget too small for the probe fails before
    the fit instead of after it.

    Args:
        engine: The fit's engine (the same model).
        X: The first batch's inputs.
        memory_budget: ``memory_budget`` as given by the user.

    Returns:
        Vectors per input, ``>= 1``.

    Raises:
        ValueError: If one vector of one input does not fit the budget.
    """
    try:
        cap, _ = samples_in_budget(engine, X, 1, memory_budget, False)
    except ValueError as err:  # said for the probe, not for the fit's own V
        budget = resolve_memory_budget(memory_budget, batch_device(X))
        raise ValueError(
            f"memory_budget={budget:,} bytes is too small for the spectral residual's "
            f"Jacobian probe (about {engine.bytes_per_sample(X, 1):,} bytes per input): "
            "raise memory_budget, pass probe_size=0 (no Jacobian weighting) or another "
            "residual model."
        ) from err
    return int(cap)


def probe_residual(model: nn.Module, options: Any, probe: Tuple[List[Any], Any],
                   U: Tensor, lam: Tensor, group: Any, stream: Any, num_data: int,
                   loss: Tuple[nn.Module, float]
                   ) -> Tuple[float, Optional[MeasuredComplement]]:
    """``beta`` of the spectral residual and the measured complement variance.

    ``beta`` takes one extra backward pass per probe micro-batch, carrying random
    output combinations per input (``probe_columns``; drawn in the fit's private
    stream) or all outputs. The measurement takes another, with all outputs, over
    the probe inputs whose Jacobian factor fits half the memory budget, at most
    :data:`MAX_COLUMNS` Jacobian columns (at least :data:`MIN_MEASURED` inputs, else
    ``None``).

    Args:
        model: The module whose GGN was fitted.
        options: The fit's :class:`~lowrank_laplace.laplace_torch.options.LowRankOptions`.
        probe: ``(input batches, vectors per input that fit the budget)``.
        U: Kept eigenvectors, ``(D, r)``.
        lam: Kept eigenvalues, ``(r,)``.
        group: The data-parallel process group, or ``None``.
        stream: The fit's :class:`~lowrank_laplace.fitting.streamer.BatchStreamer`.
        num_data: Samples the GGN sums over (all processes).
        loss: The likelihood's summed loss and laplace-torch's factor on it.

    Returns:
        ``(beta, measurement or None)``.
    """
    probe, cap = probe
    if U.shape[1] in (0, U.shape[0]) or not probe:  # nothing kept, or nothing dropped
        return 0.0, None
    with FactorEngine(model, nn.MSELoss(reduction="sum"), eval_mode=True,
                      backend=options.factor_backend) as engine:
        inputs = sum(check_batch(x, None) for x in probe)
        projections = None if options.probe_columns is None else \
            -(-options.probe_columns // max(inputs, 1))
        if projections is not None and projections >= stream.n_outputs:
            projections = None  # no cheaper than the exact energies
        if (projections or stream.n_outputs) > cap:  # fewer random ones fit the budget
            projections = cap
        micro = micro_batch_size(engine, probe[0], projections, options.memory_budget,
                                 options.micro_batch_size)
        energy = jacobian_energies(engine, probe, U, micro, projections, stream.rng)
        measured = None
        if options.measure_complement and (group is None or _rank(group) == 0):
            measured = _measure(engine, probe, U, options, num_data, loss)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(energy, group=group)
        if options.measure_complement:
            measured = _broadcast(measured, U, group)
    return jacobian_exponent(lam, energy), measured


def _measure(engine: FactorEngine, probe: List[Any], U: Tensor, options: Any,
             num_data: int, loss: Tuple[nn.Module, float]) -> Optional[MeasuredComplement]:
    """The complement measurement on the probe inputs whose factor fits the budget."""
    budget = resolve_memory_budget(options.memory_budget, batch_device(probe[0]))
    try:
        fits, _ = samples_in_budget(engine, probe[0], None, budget / 2, False)
    except ValueError:  # not one input's C vectors: the model stays
        return None
    total = sum(check_batch(x, None) for x in probe)
    m = min(total, fits, num_data, MAX_COLUMNS // max(engine.num_outputs or 1, 1))
    if m < MIN_MEASURED:
        return None
    micro = micro_batch_size(engine, probe[0], None, options.memory_budget,
                             options.micro_batch_size)
    factors, left = [], m
    for inputs in probe:
        n = check_batch(inputs, None)
        for start in range(0, min(n, left), micro):
            chunk = take(inputs, slice(start, min(start + micro, n, left)), n)
            factors.append(engine.compute(chunk, None, gradient=False))
        left -= min(n, left)
        if left == 0:
            break
    classes = engine.num_outputs
    gram, Z, outputs = _assemble(factors, U, classes, m)
    loss_func, factor = loss
    S = hessian_sqrt(loss_func, outputs.to(torch.float64), 0, None) * factor ** 0.5
    return measure_complement(gram, Z, S, num_data)


def _assemble(factors: List[Any], U: Tensor, classes: int, m: int
              ) -> Tuple[Tensor, Tensor, Tensor]:
    """The Gram matrix, ``F^T U`` and outputs of the probe, columns ordered ``(c, n)``."""
    wide = torch.float64
    gram = torch.zeros(classes, m, classes, m, dtype=wide, device=U.device)
    Z = torch.zeros(classes, m, U.shape[1], dtype=wide, device=U.device)
    spans, start = [], 0
    for f in factors:
        spans.append(slice(start, start + f.num_samples))
        start += f.num_samples
    for i, (fi, si) in enumerate(zip(factors, spans)):
        ni = fi.num_samples
        Z[:, si] = fi.t_matmul(U).to(wide).reshape(classes, ni, -1)
        for fj, sj in zip(factors[i:], spans[i:]):
            block = sum(a.cross(b) for a, b in zip(fi.group_blocks(), fj.group_blocks()))
            block = block.to(wide).reshape(classes, ni, classes, fj.num_samples)
            gram[:, si, :, sj] = block
            gram[:, sj, :, si] = block.permute(2, 3, 0, 1)
    outputs = torch.cat([f.outputs.reshape(f.num_samples, -1) for f in factors])
    return gram.reshape(classes * m, classes * m), Z.reshape(classes * m, -1), outputs


def _rank(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def _broadcast(measured: Optional[MeasuredComplement], U: Tensor, group: Any
               ) -> Optional[MeasuredComplement]:
    """Process 0's measurement on every process (``None`` stays ``None``)."""
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0)
    sizes = torch.zeros(3, dtype=torch.float64, device=U.device)
    if measured is not None:
        half = 0 if measured.mu_half is None else measured.mu_half.numel()
        sizes = torch.tensor([1.0, measured.mu.numel(), half], dtype=torch.float64,
                             device=U.device)
    dist.broadcast(sizes, src=src, group=group)
    present, k, k_half = (int(s) for s in sizes.tolist())
    if not present:
        return None
    flat = torch.zeros(2 * k + 2 * k_half + 3, dtype=torch.float64, device=U.device)
    if measured is not None:
        parts = [measured.mu, measured.q] + (
            [measured.mu_half, measured.q_half] if k_half else [])
        flat = torch.cat([p.reshape(-1).to(flat) for p in parts] + [
            measured.energy.reshape(1).to(flat),
            flat.new_tensor([measured.fraction, measured.floor])])
    dist.broadcast(flat, src=src, group=group)
    mu, q, rest = flat[:k], flat[k:2 * k], flat[2 * k:]
    mu_half = q_half = None
    if k_half:
        mu_half, q_half, rest = rest[:k_half], rest[k_half:2 * k_half], rest[2 * k_half:]
    return MeasuredComplement(mu, q, mu_half, q_half, rest[0], float(rest[1]),
                              float(rest[2]))
