"""``la.refine_complement``: Lanczos quadrature of the dropped curvature, for laplace-torch.

:mod:`~lowrank_laplace.posterior.quadrature` runs the Lanczos steps, each a pass of the fit's
loop (:class:`~lowrank_laplace.fitting.fit.LoaderFit`); this mixin checks the call,
skips a fit's own refinement on data that changes between passes, and stores what it found.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import torch

from lowrank_laplace.fitting.fit import FitTarget, LoaderFit
from lowrank_laplace.fitting.products import FittedData, OtherDataError
from lowrank_laplace.posterior.quadrature import lanczos_quadrature
from lowrank_laplace.utils.checks import refuse_inference_mode


class ComplementRefinement:
    """``refine_complement`` of :class:`~lowrank_laplace.LowRankGGNLaplace` (a mixin).

    Its fit sets ``H``, ``n_data``, what a pass over its data gives (``_fitted_data``), the
    probe's complement and null directions, and ``fit_report``; ``_curvature_target``
    names what the GGN is of.
    """

    def refine_complement(self, train_loader: Any) -> None:
        """Measure the dropped curvature by Lanczos quadrature over the whole training set.

        One pass over ``train_loader`` per Lanczos step on the GGN outside the kept
        eigenvectors (:mod:`~lowrank_laplace.posterior.quadrature`), converged at half the
        current prior; the results replace the probe's complement variance and the tail's
        log det and marglik. A later :meth:`fit` discards them.

        Raises:
            AttributeError: Before :meth:`fit`.
            ValueError: For a residual model other than ``"spectral"``, a Monte-Carlo
                GGN (``mc_samples``), whose kept eigenpairs another draw would not match, a
                loader that yields no batch, or one whose pass does not reproduce the fitted
                data's sample count, summed loss (``la.loss``, to ``sqrt(eps)`` of the
                model's dtype) and summed squared targets (random augmentation, other
                samples).
            MemoryError: If the Lanczos basis does not fit ``memory_budget``.
        """
        self._check_H_init()
        refuse_inference_mode("refine_complement")
        if not self.options.residual_model.needs_probe:
            raise ValueError(f"refine_complement measures the spectral residual; this "
                             f"posterior uses residual={self.residual!r}: set "
                             "residual='spectral'.")
        if self.options.mc_samples:
            raise ValueError(
                f"refine_complement measures the exact GGN outside the kept eigenvectors; "
                f"this posterior was fitted on a Monte-Carlo GGN (mc_samples="
                f"{self.options.mc_samples}), whose draws it would not match: refit with "
                "mc_samples=0 to refine it.")
        module, to_inputs, params = self._curvature_target()
        target = FitTarget(module, self.likelihood, params, to_inputs, self.dict_key_y,
                           self._device)
        with LoaderFit(target, self.options.at_rank(max(self.H[1].numel(), 1))) as run:
            self._refine(train_loader, run)

    def _refine_after_fit(self, train_loader: Any, run: LoaderFit) -> None:
        """A fit's own refinement; skipped with a warning where the loader gives other data."""
        try:
            self._refine(train_loader, run)
        except OtherDataError as err:  # e.g. random augmentation drawn on every pass
            warnings.warn(
                f"The fit kept {self.fit_report.kept_fraction:.0%} of the GGN trace but did "
                "not refine its complement by Lanczos quadrature: the loader gave other data "
                f"on its next pass. {err} The probe's complement stays; "
                "la.refine_complement(loader) measures it on a loader that repeats its data.",
                UserWarning, stacklevel=3)  # the caller of la.fit

    def _refine(self, train_loader: Any, run: LoaderFit) -> None:
        """Run the Lanczos quadrature over ``train_loader`` in ``run``'s loop."""
        prior = (float(self._H_factor), float(torch.as_tensor(self.prior_precision).mean()))
        found = lanczos_quadrature(run, train_loader, (self.H[0], self._null, self.n_outputs),
                                   prior, self._fitted_data or FittedData(int(self.n_data)))
        previous, probed = self._quadrature, self._complement
        if previous is not None and previous.holds(probed):  # an earlier refinement's
            probed = None
        self._quadrature, self._residual_model = found, None
        self._complement = found.kept_complement(probed)
        self.fit_report = replace(self.fit_report, complement_resolved=None,
                                  quadrature_steps=found.steps,
                                  quadrature_passes=found.passes,
                                  quadrature_converged=found.converged)
