r"""``hessian_structure="lowrank_ggn"`` for laplace-torch, whose ``Laplace`` factory returns it.

The curvature is the GGN's exact leading eigenpairs
(:class:`~lowrank_laplace.fitting.fit.LoaderFit`); the posterior precision
``U diag(ell) U^T + P_0``, shifted by the residual model, is a
:class:`~lowrank_laplace.posterior.LowRankPrecision`.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import replace
from typing import Any, List, Optional, Tuple

import torch
from laplace.baselaplace import ParametricLaplace
from laplace.lllaplace import LLLaplace
from torch import Tensor, nn

from lowrank_laplace.fitting.fit import FitResult, FitTarget
from lowrank_laplace.fitting.loader import check_params
from lowrank_laplace.fitting.products import FittedData
from lowrank_laplace.laplace_torch.fitted import FittedPosterior, fit_posterior
from lowrank_laplace.laplace_torch.options import (
    OPTION_NAMES,
    LowRankOptions,
    resolve_residual,
    split_options,
)
from lowrank_laplace.laplace_torch.persistence import StatePersistence
from lowrank_laplace.laplace_torch.queries import PosteriorQueries
from lowrank_laplace.laplace_torch.refinement import ComplementRefinement
from lowrank_laplace.laplace_torch.report import FitReport
from lowrank_laplace.laplace_torch.tuning import scalar_marglik_call, tune_scalar_prior
from lowrank_laplace.laplace_torch.warm import warm_basis
from lowrank_laplace.posterior import GramCache, Residual, residual_class
from lowrank_laplace.posterior.null import NullDirections
from lowrank_laplace.posterior.quadrature import DroppedQuadrature
from lowrank_laplace.posterior.residual import DEFAULT_RESIDUAL
from lowrank_laplace.utils.checks import refuse_inference_mode
from lowrank_laplace.utils.threads import on_one_thread_if_small


def check_positive(name: str, value) -> None:
    """Refuse a non-numeric (laplace-torch's ``ValueError``), non-positive or infinite value."""
    if isinstance(value, bool) or not isinstance(value, (Tensor, numbers.Real)):
        raise ValueError(
            f"{name} must be a positive float or a torch.Tensor, got {value!r} of type "
            f"{type(value).__name__}."
        )
    values = torch.as_tensor(value).detach()  # min NaN fails the first comparison
    if not (values.numel() and float(values.min()) > 0 and float(values.max()) < math.inf):
        raise ValueError(
            f"{name} must be positive and finite, got {value!r}: a zero or negative "
            f"{name} has no Gaussian posterior."
        )


def refuse_other_curvature(la: ParametricLaplace) -> None:
    """Refuse laplace-torch backend settings that ask for another curvature than the GGN."""
    name = la._backend_cls.__name__
    for suffix, what in (("EF", "the empirical Fisher"), ("Hessian", "the Hessian")):
        if name.endswith(suffix):
            raise ValueError(
                "hessian_structure='lowrank_ggn' computes the exact (or Monte-Carlo) "
                f"GGN with its own engine; backend={name} asks for {what}, which it "
                "does not provide. Leave backend out or pass a GGN backend."
            )
    if la._backend_kwargs.get("stochastic") and not la.mc_samples:
        raise ValueError(
            "backend_kwargs={'stochastic': True} asks for a Monte-Carlo GGN: pass "
            "mc_samples=1 (the lowrank_ggn option) instead."
        )


class _Option:
    """A read-only view of one field of the object's :class:`LowRankOptions`."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj.options, self.name)

    def __set__(self, obj, value) -> None:
        raise AttributeError(
            f"{self.name} is an option of this posterior, validated once: build a new one "
            f"with {self.name}={value!r}."
        )


class LowRankGGNLaplace(StatePersistence, ComplementRefinement, PosteriorQueries,
                        ParametricLaplace):
    r"""Full-network Laplace with the GGN's exact leading eigenspace as curvature.

    Accepts laplace-torch's ``ParametricLaplace`` arguments (``backend`` only serves
    inherited paths such as ``enable_backprop=True``; an empirical-Fisher or Hessian backend
    raises) and the options of :class:`~lowrank_laplace.laplace_torch.options.LowRankOptions`,
    each readable as an attribute (``la.rank``). ``diagonal_correction`` is a deprecated
    alias of ``residual`` (``True``: ``"diagonal"``, ``False``: ``"none"``).

    Attributes:
        options: The validated :class:`LowRankOptions`.
        fit_path: ``"dense"``, ``"streaming"`` or ``"sketch"`` (``None`` before a fit).
        factor_backend_used: The backend that computed ``V`` in the last fit.
        warm_started: Whether the last fit's sketch started from this posterior's
            previous eigenvectors.
        fit_report: How faithful the last fit is (:class:`FitReport`).
    """

    _key = ("all", "lowrank_ggn")
    fit_path: Optional[str] = None
    warm_started: bool = False

    def __init__(self, model: nn.Module, likelihood: str, *args: Any,
                 diagonal_correction: Optional[bool] = None, **kwargs: Any):
        self._set_options(diagonal_correction, split_options(kwargs))
        meta = [p for p in model.parameters() if p.requires_grad and p.is_meta]
        if meta:  # laplace-torch 0.5 reads the prior's values from them in its __init__
            check_params(meta)
        super().__init__(model, likelihood, *args, **kwargs)
        if not isinstance(self, LLLaplace):  # the last-layer class checks after its options
            refuse_other_curvature(self)

    @property
    def _dtype(self) -> torch.dtype:
        """The Laplace parameters' dtype (laplace-torch's is the model's first parameter's)."""
        params = getattr(self, "params", None)
        return params[0].dtype if params else next(self.model.parameters()).dtype

    def _set_options(self, diagonal_correction: Optional[bool], options: dict) -> None:
        options["residual"] = resolve_residual(options.get("residual", DEFAULT_RESIDUAL),
                                               diagonal_correction)
        self.options = LowRankOptions(**options)
        self.factor_backend_used: Optional[str] = None
        self._null: Optional[NullDirections] = None
        self._quadrature: Optional[DroppedQuadrature] = None
        self._gram_cache = GramCache()  # float64 U^T U, kept across predictive calls
        self.residual_diagonal: Optional[Tensor] = None
        self.trace: Optional[Tensor] = None
        self._fitted_data: Optional[FittedData] = None  # what a pass over the data gives
        self.rank_bound: Optional[int] = None
        self._residual_model: Optional[Residual] = None
        self._fitted_residual: Optional[str] = None
        self.fit_report: Optional[FitReport] = None

    def __repr__(self) -> str:
        head = (f"{type(self).__name__}(rank={self.rank}, residual={self.residual!r}, "
                f"solver={str(self.solver)!r})")
        return head if self.fit_report is None else f"{head}\n{self.fit_report}"

    def _expected_dim(self) -> Optional[int]:
        """Number of Laplace parameters a loaded state must have (``None``: unknown yet)."""
        return self.n_params

    # ---------------------------------------------------------- hyperparameters
    @property
    def prior_precision(self) -> Tensor:
        """laplace-torch's prior precision (scalar, per layer or per parameter), ``> 0``."""
        return ParametricLaplace.prior_precision.fget(self)

    @prior_precision.setter
    def prior_precision(self, value) -> None:
        check_positive("prior_precision", value)
        ParametricLaplace.prior_precision.fset(self, value)

    @property
    def sigma_noise(self) -> Tensor:
        """laplace-torch's observation noise (regression), ``> 0``."""
        return ParametricLaplace.sigma_noise.fget(self)

    @sigma_noise.setter
    def sigma_noise(self, value) -> None:
        check_positive("sigma_noise", value)
        ParametricLaplace.sigma_noise.fset(self, value)

    @property
    def temperature(self) -> float:
        """Posterior temperature ``T > 0`` (the curvature is scaled by ``1/T``)."""
        return self._temperature

    @temperature.setter
    def temperature(self, value) -> None:
        check_positive("temperature", value)
        self._temperature = value

    @on_one_thread_if_small
    def optimize_prior_precision(self, *args: Any, **kwargs: Any) -> None:
        """laplace-torch's prior tuning (marginal likelihood, or grid search on data).

        A scalar prior's marginal likelihood is tuned by the same Adam steps on its
        closed-form gradient (:mod:`~lowrank_laplace.laplace_torch.tuning`).
        """
        scalar = scalar_marglik_call(self, args, kwargs)
        if scalar is None:
            return super().optimize_prior_precision(*args, **kwargs)
        call, spectrum = scalar
        # laplace-torch's checks, warnings and starting point, without its steps
        super().optimize_prior_precision(**{**call, "n_steps": 0, "verbose": False})
        tuned = tune_scalar_prior(self, spectrum, float(self.prior_precision), call["n_steps"],
                                  call["lr"])
        self.prior_precision = torch.tensor([tuned], device=self._device, dtype=self._dtype)
        if call["verbose"]:
            print(f"Optimized prior precision is {self.prior_precision}.")

    @property
    def residual(self) -> str:
        """The residual model's name (see :mod:`lowrank_laplace.posterior.residual`).

        May be changed after a fit to compare models without refitting, except to one
        that needs the residual diagonal (``"diagonal"``), which only a fit with it keeps.
        """
        return self.options.residual

    @residual.setter
    def residual(self, value: str) -> None:
        model = residual_class(value)
        fitted = getattr(self, "H", None) is not None
        if model.needs_diagonal and fitted and self.residual_diagonal is None:
            raise ValueError(
                f"residual={model.name!r} needs the residual diagonal, which this fit did "
                f"not keep: refit with residual={model.name!r}."
            )
        if model.needs_probe and fitted and self._fitted_residual is not None \
                and not residual_class(self._fitted_residual).needs_probe:
            warnings.warn(
                f"This posterior was fitted with residual={self._fitted_residual!r}, "
                "which does not measure the dropped curvature: the spectral model puts the "
                "mean dropped eigenvalue in every dropped direction until "
                "la.refine_complement(train_loader) measures it (or a refit with "
                f"residual={model.name!r}).", UserWarning, stacklevel=2,
            )
        self.options = replace(self.options, residual=model.name)
        self._residual_model = None

    @property
    def diagonal_correction(self) -> bool:
        """Whether the fit tracks the residual diagonal (``residual="diagonal"``)."""
        return self.options.residual_model.needs_diagonal

    def _init_H(self) -> None:
        self.H: Optional[Tuple[Tensor, Tensor]] = None

    # ----------------------------------------------------------------- fitting
    def _curvature_target(self) -> Tuple[nn.Module, Any, List[Tensor]]:
        """The module whose GGN is computed, an input transform, and its parameters."""
        return self.model, (lambda X: X), self.params

    def fit(self, train_loader: Any, override: bool = True, progress_bar: bool = False,
            process_group: Any = "default") -> None:
        """Fit the low-rank GGN over the whole loader (see :class:`LoaderFit`).

        Data-parallel where ``torch.distributed`` is initialised (or a group is passed):
        each process streams its own shard, all end with the same posterior, and
        ``n_data`` counts every process's samples. With the spectral residual the fit
        measures the curvature its rank drops by Lanczos quadrature on its own factors
        (:mod:`~lowrank_laplace.posterior.quadrature`), reading the data no more.

        Args:
            train_loader: Yields ``(X, y)`` batches (or dict batches);
                ``train_loader.dataset`` gives the number of data points.
            override: ``False`` adds this loader's curvature, loss and ``n_data`` to the
                current ones (laplace-torch's online updates; the two eigendecompositions
                merge exactly while the total rank fits ``rank``); the mean moves to the
                model's current parameters.
            progress_bar: Show a tqdm progress bar over batches.
            process_group: ``torch.distributed`` group to merge across; the default
                uses the default group if ``torch.distributed`` is initialised,
                ``None`` fits on this process alone.

        Raises:
            ValueError: For a loader without ``dataset``, an empty loader, mismatched
                targets, or a memory budget too small for one sample.
        """
        refuse_inference_mode("fit")
        previous = None if override or self.H is None else self._fit_result()
        options = self.options
        if previous is not None and options.residual_model.needs_diagonal \
                and previous.residual_diagonal is None:
            raise ValueError(
                f"override=False with residual={self.residual!r} needs the residual "
                "diagonal of the previous fit, which this object does not hold: refit "
                "with override=True."
            )
        module, to_inputs, params = self._curvature_target()
        target = FitTarget(module, self.likelihood, params, to_inputs, self.dict_key_y,
                           self._device)
        basis = warm_basis(self, params) if options.warm_start and previous is None else None
        check_params(params)  # before the prior is read from them (meta tensors)
        # the quadrature's and the rank check's prior: the mean of a layerwise or per-parameter one
        prior = (float(self._H_factor), float(torch.as_tensor(self.prior_precision).mean()))
        self._store(fit_posterior(target, train_loader, options, prior, previous,
                                  (process_group, basis, progress_bar)))

    def _store(self, fitted: FittedPosterior) -> None:
        """Hold a fit's result, its measured dropped curvature and its report."""
        result = fitted.result
        self.warm_started = result.warm_started
        self.mean, self.H = result.mean, (result.eigenvectors, result.eigenvalues)
        self.n_outputs, self.loss, self.n_data = result.n_outputs, result.loss, result.n_data
        self._fitted_data = FittedData.of_fit(result)
        self.trace, self.residual_diagonal = result.trace, result.residual_diagonal
        self.factor_backend_used, self.fit_path = result.factor_backend, result.fit_path
        self.rank_bound, self._null = result.rank_bound, fitted.null
        self._quadrature, self.fit_report = fitted.quadrature, fitted.report
        self._fitted_residual, self._residual_model = self.residual, None

    def _fit_result(self) -> FitResult:
        """The current fit as a :class:`FitResult` (what online updates add to)."""
        U, lam = self.H
        return FitResult(
            mean=self.mean, eigenvectors=U, eigenvalues=lam, trace=self.trace,
            residual_diagonal=self.residual_diagonal, loss=self.loss, n_data=self.n_data,
            n_outputs=self.n_outputs, factor_backend=self.factor_backend_used,
            fit_path=self.fit_path, rank_bound=self.rank_bound,
            target_energy=getattr(self._fitted_data, "target_energy", None),
        )


for _name in OPTION_NAMES:  # la.rank, la.solver, ...: read-only views of la.options
    if not hasattr(LowRankGGNLaplace, _name):  # residual has its own setter
        setattr(LowRankGGNLaplace, _name, _Option(_name))
