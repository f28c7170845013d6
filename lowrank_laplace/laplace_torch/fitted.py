"""One fit of the posterior: the low-rank GGN and what its residual model measured.

:func:`fit_posterior` is what ``LowRankGGNLaplace.fit`` runs and :func:`fit_lowrank_ggn`
(the call without laplace-torch's classes) returns: the loader's leading eigenpairs
(:class:`~lowrank_laplace.fitting.fit.LoaderFit`, ``rank="auto"``'s doublings), the
residual's probe and, where the fit keeps less than ``refine_below``, the Lanczos
quadrature of the dropped curvature, all in one loop over the data.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import Tensor, nn

from lowrank_laplace.fitting.fit import FitResult, FitTarget, LoaderFit
from lowrank_laplace.fitting.products import FittedData, OtherDataError
from lowrank_laplace.laplace_torch.options import LowRankOptions
from lowrank_laplace.laplace_torch.rank import AUTO, next_rank
from lowrank_laplace.laplace_torch.report import FitReport
from lowrank_laplace.posterior import DroppedCurvature, LowRankPrecision, Residual, quadrature
from lowrank_laplace.posterior.null import head_directions
from lowrank_laplace.posterior.probe import ProbeResult, probe_residual
from lowrank_laplace.posterior.quadrature import DroppedQuadrature, lanczos_quadrature


@dataclass
class FittedPosterior:
    """A fitted low-rank GGN with its residual model's measurements.

    Attributes:
        result: The eigenpairs, trace and data counts (:class:`FitResult`).
        probed: What the probe measured (:class:`ProbeResult`).
        quadrature: The Lanczos quadrature's result (``None``: not refined).
        report: The fit report.
        options: The options it was fitted with.
        layer_sizes: Parameters per parameter tensor.
    """

    result: FitResult
    probed: ProbeResult
    quadrature: Optional[DroppedQuadrature]
    report: FitReport
    options: LowRankOptions
    layer_sizes: Tuple[int, ...]

    def dropped(self) -> DroppedCurvature:
        """What the fit tells about the curvature its rank drops."""
        result, probed, found = self.result, self.probed, self.quadrature
        complement = probed.complement if found is None else found.kept_complement(
            probed.complement)
        return DroppedCurvature(
            result.eigenvectors, result.eigenvalues, result.trace,
            result.rank_bound or result.mean.numel(), result.residual_diagonal,
            probed.exponent, list(self.layer_sizes), complement, probed.null,
            None if found is None else (found.nodes, found.counts))

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
    """Fit the low-rank GGN over ``loader``, probe its residual and refine it where it keeps little.

    Args:
        target: What the GGN is of.
        loader: The training loader.
        options: The validated options.
        prior: ``(h, delta)``: laplace-torch's Hessian factor and the prior's mean, where
            the probe measures and the refinement checks its convergence.
        previous: An earlier fit to add to (online updates: never refined).
        run_args: ``(process_group, warm-start basis, progress_bar)``.

    Returns:
        The :class:`FittedPosterior`.
    """
    group, basis, progress_bar = run_args
    rank, history = options.first_rank, []
    # a fit that may refine itself keeps its factors for the refinement's products
    keep = previous is None and options.residual_model.needs_probe and options.refine_below > 0
    with LoaderFit(target, options.at_rank(rank), group, keep_factors=keep) as run:
        while rank is not None:  # one fit, or rank="auto"'s doubling ranks
            result = run.run(loader, previous, basis, progress_bar)
            head = (target.likelihood, head_directions(target.model, run.params,
                                                       target.likelihood, result.n_outputs))
            probed = probe_residual(run, result, head, prior)
            history.append((result.eigenvalues.numel(), probed.variance_change))
            rank = None if options.rank != AUTO or run.group is not None else next_rank(
                rank, probed.variance_change, (result.rank_bound, result.mean.numel(),
                                               options.memory_budget, run.device))
            if rank is not None:
                run.reconfigure(options.at_rank(rank))
                basis = result.eigenvectors if options.warm_start else None
        kept = 1.0 if float(result.trace) <= 0 else \
            float(result.eigenvalues.sum() / result.trace)
        report = FitReport.of_fit(result, probed, tuple(history), kept, options, run.passes)
        fitted = FittedPosterior(result, probed, None, report, options,
                                 tuple(p.numel() for p in run.params))
        if previous is None and report.refinable and not options.mc_samples \
                and kept < options.refine_below \
                and quadrature.basis_fits(result.mean.numel(), options, run.device):
            fitted.quadrature = _refined(run, loader, fitted, prior)
            if fitted.quadrature is not None:
                fitted.report = report.refined(fitted.quadrature)
    return fitted


def _refined(run: LoaderFit, loader: Any, fitted: FittedPosterior,
             prior: Tuple[float, float]) -> Optional[DroppedQuadrature]:
    """A fit's own refinement; ``None``, with a warning, where the loader gives other data."""
    result = fitted.result
    try:
        return lanczos_quadrature(run, loader, (result.eigenvectors, fitted.probed.null,
                                                result.n_outputs), prior,
                                  FittedData.of_fit(result))
    except OtherDataError as err:  # e.g. random augmentation drawn on every pass
        warnings.warn(
            f"The fit kept {fitted.report.kept_fraction:.0%} of the GGN trace but did "
            "not refine its complement by Lanczos quadrature: the loader gave other data "
            f"on its next pass. {err} The probe's complement stays; "
            "la.refine_complement(loader) measures it on a loader that repeats its data.",
            UserWarning, stacklevel=4)  # the caller of la.fit or fit_lowrank_ggn
        return None


def fit_lowrank_ggn(model: nn.Module, likelihood: str, loader: Any,
                    options: Optional[LowRankOptions] = None, *,
                    prior_precision: float = 1.0, sigma_noise: float = 1.0,
                    process_group: Any = "default",
                    progress_bar: bool = False) -> FittedPosterior:
    """Fit the posterior of ``model``'s trainable parameters without laplace-torch's classes.

    The same fit as ``Laplace(model, likelihood, subset_of_weights="all",
    hessian_structure="lowrank_ggn", prior_precision=..., sigma_noise=..., **options).fit``
    (eigenpairs, probe, refinement), so :meth:`FittedPosterior.precision` at that prior is
    the precision ``la`` holds.

    Args:
        model: The network (left as it was).
        likelihood: ``"classification"`` or ``"regression"``.
        loader: Yields ``(X, y)`` or dict batches (targets under ``"labels"``).
        options: The ``lowrank_ggn`` options (``None``: the defaults).
        prior_precision: The scalar prior the probe measures at.
        sigma_noise: The regression noise (``1`` for classification).
        process_group: ``torch.distributed`` group to merge across.
        progress_bar: Show a tqdm progress bar over batches.
    """
    options = LowRankOptions() if options is None else options
    prior = (1 / sigma_noise**2, float(prior_precision))
    return fit_posterior(FitTarget(model, likelihood), loader, options, prior,
                         run_args=(process_group, None, progress_bar))
