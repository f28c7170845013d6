"""``la.refine_complement``: Lanczos quadrature of the dropped curvature, for laplace-torch.

:mod:`~lowrank_laplace.posterior.quadrature` runs the Lanczos steps, each a pass of the fit's
loop (:class:`~lowrank_laplace.fitting.fit.LoaderFit`); this mixin checks the call and
stores what it found in place of the fit's own measurement.
"""

from __future__ import annotations

from typing import Any

import torch

from lowrank_laplace.fitting.fit import FitTarget, LoaderFit
from lowrank_laplace.fitting.products import FittedData
from lowrank_laplace.posterior.quadrature import DroppedQuadrature, lanczos_quadrature
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
        current prior; the result replaces the fit's own measurement (on its kept factors,
        converged at the fit's prior). A later :meth:`fit` discards it. Its Jacobian starts
        are training inputs whose curvature the passes include, so where the training set
        is small its complement variance is that of the training inputs, below a test
        input's: the fit's own measurement holds them out.

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

    def _refine(self, train_loader: Any, run: LoaderFit) -> None:
        """Run the Lanczos quadrature over ``train_loader`` in ``run``'s loop."""
        prior = (float(self._H_factor), float(torch.as_tensor(self.prior_precision).mean()))
        found = lanczos_quadrature(run, train_loader, (self.H[0], self._null, self.n_outputs),
                                   prior, self._fitted_data or FittedData(int(self.n_data)))
        self._store_refinement(found)

    def _store_refinement(self, found: DroppedQuadrature) -> None:
        """Hold a quadrature's result and its fields of the fit report."""
        self._quadrature, self._residual_model = found, None
        self.fit_report = self.fit_report.measured(found)
