"""One fit of the posterior: the low-rank GGN and its measured dropped curvature.

:func:`fit_posterior` is what ``LowRankGGNLaplace.fit`` runs and :func:`fit_lowrank_ggn`
(the call without laplace-torch's classes) returns: the loader's leading eigenpairs
(:class:`~lowrank_laplace.fitting.fit.LoaderFit`, ``rank="auto"``'s doublings) and, for
the spectral residual, the Lanczos quadrature of the dropped curvature on the fit's own
factors, all in one pass over the data.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Tuple

import torch
from torch import Tensor, nn

from lowrank_laplace.fitting.fit import FitResult, FitTarget, LoaderFit
from lowrank_laplace.fitting.products import MIN_PARTIAL, FittedData
from lowrank_laplace.laplace_torch.options import LowRankOptions
from lowrank_laplace.laplace_torch.rank import AUTO, next_rank
from lowrank_laplace.laplace_torch.report import FitReport
from lowrank_laplace.posterior import DroppedCurvature, LowRankPrecision, Residual, quadrature
from lowrank_laplace.posterior.null import NullDirections, head_directions
from lowrank_laplace.posterior.probe import checked_null, variance_change
from lowrank_laplace.posterior.quadrature import DroppedQuadrature, lanczos_quadrature


@dataclass
class FittedPosterior:
    """A fitted low-rank GGN with its measured dropped curvature.

    Attributes:
        result: The eigenpairs, trace and data counts (:class:`FitResult`).
        null: The checked logit-shift directions (``None``: none).
        quadrature: The Lanczos quadrature's result (``None``: not measured).
        report: The fit report.
        options: The options it was fitted with.
        layer_sizes: Parameters per parameter tensor.
    """

    result: FitResult
    null: Optional[NullDirections]
    quadrature: Optional[DroppedQuadrature]
    report: FitReport
    options: LowRankOptions
    layer_sizes: Tuple[int, ...]

    def dropped(self) -> DroppedCurvature:
        """What the fit tells about the curvature its rank drops."""
        result = self.result
        return DroppedCurvature(
            result.eigenvectors, result.eigenvalues, result.trace,
            result.rank_bound or result.mean.numel(), result.residual_diagonal,
            list(self.layer_sizes), self.null, self.quadrature)

    def residual(self) -> Residual:
        """The options' residual model of the dropped curvature."""
        return self.options.residual_model.from_fit(self.dropped())

    def precision(self, prior_precision: Any = 1.0, sigma_noise: float = 1.0,
                  temperature: float = 1.0) -> LowRankPrecision:
        """The posterior precision (laplace-torch's, as ``la`` of the same fit holds it).

        Args:
            prior_precision: Scalar or one value per parameter.
            sigma_noise: The regression noise (``1`` for classification).
            temperature: laplace-torch's temperature.
        """
        U, lam = self.result.eigenvectors, self.result.eigenvalues
        scale = torch.tensor(1 / (sigma_noise**2 * temperature), dtype=U.dtype, device=U.device)
        prior = torch.as_tensor(prior_precision, dtype=U.dtype, device=U.device).reshape(-1)
        return self.residual().precision(U, lam, scale, prior)


def fit_posterior(target: FitTarget, loader: Any, options: LowRankOptions,
                  prior: Tuple[float, float], previous: Optional[FitResult] = None,
                  run_args: Tuple[Any, Optional[Tensor], bool] = ("default", None, False)
                  ) -> FittedPosterior:
    """Fit the low-rank GGN over ``loader`` and measure what its rank drops.

    Args:
        target: What the GGN is of.
        loader: The training loader.
        options: The validated options.
        prior: ``(h, delta)``: laplace-torch's Hessian factor and the prior's mean, where
            the quadrature checks its convergence and the rank check reads the variance.
        previous: An earlier fit to add to (online updates: not measured, their GGN
            spans earlier loaders).
        run_args: ``(process_group, warm-start basis, progress_bar)``.

    Returns:
        The :class:`FittedPosterior`.
    """
    group, basis, progress_bar = run_args
    rank, history = options.first_rank, []
    spectral = options.residual_model.needs_probe
    with LoaderFit(target, options.at_rank(rank), group,
                   keep_factors=spectral and previous is None) as run:
        while rank is not None:  # one fit, or rank="auto"'s doubling ranks
            result = run.run(loader, previous, basis, progress_bar)
            null = None
            if spectral and result.probe is not None:
                null = checked_null(run.jacobian, result.probe.batches[0], head_directions(
                    target.model, run.params, target.likelihood, result.n_outputs))
            found, why = _measured(run, result, null, (options, prior, previous))
            change = None if found is None else _rank_check(result, found, prior)
            history.append((result.eigenvalues.numel(), change))
            rank = None if options.rank != AUTO or run.group is not None else next_rank(
                rank, change, (result.rank_bound, result.mean.numel(),
                               options.memory_budget, run.device))
            if rank is not None:
                run.reconfigure(options.at_rank(rank))
                basis = result.eigenvectors if options.warm_start else None
        kept = 1.0 if float(result.trace) <= 0 else \
            float(result.eigenvalues.sum() / result.trace)
        report = FitReport.of_fit(result, (0 if null is None else null.count, change),
                                  tuple(history), kept, options, run.passes)
        report = report.measured(found) if found is not None else \
            replace(report, not_measured=why)
    return FittedPosterior(result, null, found, report, options,
                           tuple(p.numel() for p in run.params))


def _measured(run: LoaderFit, result: FitResult, null: Optional[NullDirections],
              settings: Tuple[LowRankOptions, Tuple[float, float], Optional[FitResult]]
              ) -> Tuple[Optional[DroppedQuadrature], Optional[str]]:
    """The quadrature on the fit's own factors, or ``None`` and why it did not run."""
    options, prior, previous = settings
    dim, rank = result.mean.numel(), result.eigenvalues.numel()
    if not options.residual_model.needs_probe or rank in (0, dim) \
            or float(result.trace) <= float(result.eigenvalues.sum()):
        return None, None
    why = _unmeasurable(run, dim, options, previous)
    if why is not None:
        return None, why
    found = lanczos_quadrature(run, None, (result.eigenvectors, null, result.n_outputs),
                               prior, FittedData.of_fit(result))
    return found, None


def _unmeasurable(run: LoaderFit, dim: int, options: LowRankOptions,
                  previous: Optional[FitResult]) -> Optional[str]:
    """Why the fit's own factors cannot be measured on (``None``: they can)."""
    if previous is not None:
        return "an online update's GGN spans earlier loaders"
    if quadrature.step_budget(dim, options, run.device) < quadrature.MIN_STEPS:
        return "its Lanczos basis exceeds memory_budget"
    cache = run.cache
    if cache is None or not cache.kept or not cache.inputs:
        return (f"the fit kept no factors: fewer than {MIN_PARTIAL} inputs' fit half of "
                "memory_budget, or low_memory, or curvature sub-sampling")
    return None


def _rank_check(result: FitResult, found: DroppedQuadrature, prior: Tuple[float, float]
                ) -> Optional[float]:
    """:func:`variance_change` of the quadrature's Jacobian starts at ``prior``."""
    lam = result.eigenvalues
    if lam.numel() < 2 or found.columns is None:
        return None
    h, delta = prior
    v = found.variance(torch.tensor(h), torch.tensor(delta, dtype=torch.float64),
                       float(lam[-1]))
    return variance_change(found.columns, lam.double().to(found.columns.projections.device),
                           v, prior)


def fit_lowrank_ggn(model: nn.Module, likelihood: str, loader: Any,
                    options: Optional[LowRankOptions] = None, *,
                    prior_precision: float = 1.0, sigma_noise: float = 1.0,
                    process_group: Any = "default",
                    progress_bar: bool = False) -> FittedPosterior:
    """Fit the posterior of ``model``'s trainable parameters without laplace-torch's classes.

    The same fit as ``Laplace(model, likelihood, subset_of_weights="all",
    hessian_structure="lowrank_ggn", prior_precision=..., sigma_noise=..., **options).fit``
    (eigenpairs and the measured dropped curvature), so :meth:`FittedPosterior.precision`
    at that prior is the precision ``la`` holds.

    Args:
        model: The network (left as it was).
        likelihood: ``"classification"`` or ``"regression"``.
        loader: Yields ``(X, y)`` or dict batches (targets under ``"labels"``).
        options: The ``lowrank_ggn`` options (``None``: the defaults).
        prior_precision: The scalar prior the quadrature checks its convergence at.
        sigma_noise: The regression noise (``1`` for classification).
        process_group: ``torch.distributed`` group to merge across.
        progress_bar: Show a tqdm progress bar over batches.
    """
    options = LowRankOptions() if options is None else options
    prior = (1 / sigma_noise**2, float(prior_precision))
    return fit_posterior(FitTarget(model, likelihood), loader, options, prior,
                         run_args=(process_group, None, progress_bar))
