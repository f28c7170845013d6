"""How faithful a fit is, in numbers a user can read (``la.fit_report``, ``repr(la)``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, Optional, Tuple

from lowrank_laplace.fitting.fit import FastPathCheck, FitResult
from lowrank_laplace.posterior.residual import residual_class

#: What each fit path is called in the report.
PATH_NAMES = {"dense": "a dense GGN sum (exact)", "streaming": "streaming merges",
              "sketch": "a one-pass sketch"}


@dataclass(frozen=True)
class FitReport:
    """The last fit's faithfulness.

    Attributes:
        rank: Eigenpairs kept.
        num_params: Laplace parameters ``D``.
        kept_fraction: Share of the exact GGN trace the kept eigenvalues hold.
        fit_path: ``"dense"``, ``"streaming"`` or ``"sketch"``: what ran in the end.
        factor_backend: What computed ``V``.
        residual: The model of the dropped curvature.
        check: The sketch's own check and what the fit did about it (``None``: no sketch ran).
        variance_change: Median relative change of the predictive variance of the
            Lanczos quadrature's Jacobian starts (random combinations of the first training
            inputs' Jacobians) from the leading half of the kept eigenpairs to all, at the
            fit's prior (``None``: not measured, e.g. without the spectral residual).
        warm_started: Whether the sketch started from this posterior's last fit.
        ranks_tried: ``(rank, variance change)`` of every fit (``rank="auto"`` fits several).
        null_directions: The softmax head's logit-shift directions the probe checked,
            which keep the prior's variance (``0``: none).
        quadrature_steps: Lanczos steps that measured the dropped curvature (``0``: not
            measured).
        quadrature_passes: Their passes over the training data (``0``: the fit's own
            factors, or none run).
        quadrature_converged: Whether the runs converged (``None``: not run).
        quadrature_error: The quadrature's error bound at half the prior: half its
            Gauss/Gauss-Radau bracket of the complement variance and log det, relative
            (``None``: not run).
        quadrature_samples: ``(m, K, N)``: inputs held out of the Jacobian runs' GGN,
            inputs whose curvature the runs multiplied by, inputs fitted.
        not_measured: Why a spectral fit did not measure the dropped curvature (``None``:
            it did, or another model).
        refinable: Whether the residual model takes ``refine_complement``.
        fit_passes: The fit's passes over the training data (``refine_complement`` adds
            ``quadrature_passes``).
    """

    rank: int
    num_params: int
    kept_fraction: float
    fit_path: str
    factor_backend: str
    residual: str
    check: Optional[FastPathCheck] = None
    variance_change: Optional[float] = None
    warm_started: bool = False
    ranks_tried: Tuple[Tuple[int, Optional[float]], ...] = ()
    null_directions: int = 0
    quadrature_steps: int = 0
    quadrature_converged: Optional[bool] = None
    quadrature_error: Optional[float] = None
    quadrature_samples: Tuple[int, int, int] = (0, 0, 0)
    not_measured: Optional[str] = None
    refinable: bool = False
    fit_passes: int = 1
    quadrature_passes: int = 0

    @property
    def estimator(self) -> str:
        """What decided the dropped curvature's variance and log det, in words."""
        if self.kept_fraction >= 1 - 1e-9 or self.rank >= self.num_params:
            return "nothing dropped"
        model = residual_class(self.residual)
        if not model.needs_probe:  # a simple model (also one switched on a spectral fit)
            return model.summary
        if self.quadrature_steps:
            where = "the fit's own factors" if not self.quadrature_passes else \
                "passes over the training data"
            return f"measured by Lanczos quadrature on {where}"
        return model.summary

    @classmethod
    def of_fit(cls, result: FitResult, checks: Tuple[int, Optional[float]],
               ranks_tried: Tuple[Tuple[int, Optional[float]], ...], kept_fraction: float,
               options: Any, passes: int = 1) -> "FitReport":
        """The report of a fit (``passes`` over the data) and the ranks it tried.

        ``checks``: the checked null directions and the rank check's variance change.
        """
        return cls(
            rank=result.eigenvalues.numel(), num_params=result.mean.numel(),
            kept_fraction=kept_fraction, fit_path=result.fit_path,
            factor_backend=result.factor_backend, residual=options.residual,
            check=result.check, variance_change=checks[1],
            warm_started=result.warm_started, ranks_tried=ranks_tried,
            null_directions=checks[0], refinable=options.residual_model.needs_probe,
            fit_passes=passes)

    def measured(self, found: Any) -> "FitReport":
        """This report with a quadrature (a ``DroppedQuadrature``): its steps, passes, error."""
        return replace(self, quadrature_steps=found.steps, quadrature_passes=found.passes,
                       quadrature_converged=found.converged, quadrature_error=found.error,
                       quadrature_samples=tuple(found.samples), not_measured=None)

    def __str__(self) -> str:
        lines = [f"lowrank_ggn fit: rank {self.rank} of {self.num_params:,} parameters, "
                 f"{PATH_NAMES.get(self.fit_path, self.fit_path)} "
                 f"({self.factor_backend} backend{', warm start' if self.warm_started else ''})",
                 f"  kept share of the GGN trace: {self.kept_fraction:.3f} "
                 f"(the rest: residual={self.residual!r})",
                 f"  dropped curvature: {self.estimator}; passes over the training data: "
                 f"{self.fit_passes + self.quadrature_passes}"
                 + (f" (fit {self.fit_passes}, quadrature {self.quadrature_passes})"
                    if self.quadrature_passes else "")]
        c = self.check
        if c is not None:
            lines.append(f"  {c.name}: {'passed' if c.passed else 'failed'} ({c.value:.3f}, "
                         f"needs {c.threshold:.2f}); {c.action}")
        if self.variance_change is not None:
            lines.append(f"  predictive variance on the probe inputs: changes by "
                         f"{self.variance_change:.1%} from rank {self.rank // 2} to "
                         f"{self.rank}")
        if self.quadrature_steps:
            held, kept, fitted = self.quadrature_samples
            on = f" on {kept:,} of {fitted:,} inputs' factors" if 0 < kept < fitted else ""
            out = f", the Jacobian runs' {held:,} inputs held out" if held else ""
            moved = "" if self.quadrature_error is None else \
                f" (to within {self.quadrature_error:.1%})"  # None: an older state
            lines.append(
                f"  complement variance and dropped spectrum: Lanczos quadrature, "
                f"{self.quadrature_steps} steps{on}{out}; "
                + (f"converged{moved}" if self.quadrature_converged else
                   f"not converged{moved}: la.refine_complement(loader) after tuning the prior"))
        elif self.not_measured and self.kept_fraction < 1 - 1e-9:
            lines.append(f"  not measured ({self.not_measured}): "
                         "la.refine_complement(loader of all the fitted data) measures it")
        if self.null_directions:
            lines.append(f"  logit-shift directions: {self.null_directions} null directions of "
                         "the GGN keep the prior's variance (checked on the probe)")
        if len(self.ranks_tried) > 1:
            tried = ", ".join(f"{r} ({'-' if c is None else f'{c:.1%}'})"
                              for r, c in self.ranks_tried)
            lines.append(f"  rank='auto' tried: {tried}")
        return "\n".join(lines)

    def as_dict(self) -> Dict[str, Any]:
        """The report as plain values (for JSON reports and ``state_dict``), with the estimator."""
        return {**asdict(self), "estimator": self.estimator}

    @classmethod
    def from_dict(cls, values: Optional[Dict[str, Any]]) -> Optional["FitReport"]:
        """Inverse of :meth:`as_dict` (``None`` stays ``None``)."""
        if values is None:
            return None
        values = dict(values)
        values.pop("estimator", None)  # derived
        check = values.pop("check", None)
        values["ranks_tried"] = tuple(tuple(t) for t in values.get("ranks_tried", ()))
        values["quadrature_samples"] = tuple(values.get("quadrature_samples", (0, 0, 0)))
        values.pop("complement_resolved", None)  # an older version's field
        if "quadrature_moved" in values:  # an older version's error estimate
            values["quadrature_error"] = values.pop("quadrature_moved")
        return cls(**values, check=None if check is None else FastPathCheck(**check))
