r"""laplace-torch's posterior interface, served from a stored low-rank fit.

Variances, samples, log det, Jacobian variances and the GLM predictive of the precision
``P = U diag(ell) U^T + diag(d)``.

Shape glossary:
    D: Laplace parameters; r: kept rank; B: inputs; C: outputs.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from lowrank_laplace.fitting.budget import dense_identity
from lowrank_laplace.posterior import DroppedCurvature, LowRankPrecision, Residual
from lowrank_laplace.posterior.predictive import glm_predictive, prior_variance_weights
from lowrank_laplace.posterior.quadrature import DroppedQuadrature
from lowrank_laplace.utils.batches import to_device
from lowrank_laplace.utils.threads import (
    SMALL_WORK,
    on_one_thread_if_small,
    on_spare_cores,
    scoped_backward,
)


class PosteriorQueries:
    """The posterior side of ``hessian_structure="lowrank_ggn"`` (a mixin).

    Its fit sets ``H = (U, lambda)``, ``trace``, ``rank_bound``, ``residual_diagonal``
    and ``_gram_cache``.
    """

    @property
    def query_work(self) -> int:
        """Multiply-adds of a query's largest product, ``D (r + 1)`` (small: one thread)."""
        rank = 0 if getattr(self, "H", None) is None else self.H[0].shape[1]
        return (self.n_params or 0) * (rank + 1)

    @property
    def kept_fraction(self) -> Tensor:
        """Fraction of the exact GGN trace (total curvature) the kept rank holds."""
        self._check_H_init()
        if float(self.trace) <= 0:  # a zero GGN: nothing to keep, nothing dropped
            return torch.ones((), dtype=self.H[1].dtype, device=self.H[1].device)
        return self.H[1].sum() / self.trace

    @property
    def posterior_precision(self) -> Tuple[Tuple[Tensor, Tensor], Tensor]:
        """``((U, ell), d)`` with ``P = U diag(ell) U^T + diag(d)``, ``d`` of shape ``(D,)``.

        The scaled kept eigenvalues and the prior precision diagonal, both shifted by the
        residual model (:mod:`lowrank_laplace.posterior.residual`). The softmax head's
        logit-shift directions, where the model keeps them at the prior, follow ``U`` as
        columns whose ``ell`` (the prior minus ``d``) is negative.
        """
        precision = self._precision()
        U, ell, null, d = precision.U, precision.ell, precision.null, precision.d
        if d.numel() == 1:
            d = d.expand(self.n_params).clone()
        if null is not None:
            eye = torch.eye(null.directions.count, dtype=U.dtype, device=U.device)
            U = torch.cat([U, null.directions.expand(eye, self.n_params).T], 1)
            ell = torch.cat([ell, (null.prior - null.held).to(ell.dtype)])
        return (U, ell), d

    @property
    def dropped_quadrature(self) -> Optional[DroppedQuadrature]:
        """The Lanczos quadrature of the dropped curvature (``posterior.quadrature``).

        ``None`` where nothing was measured (another residual model, nothing dropped, a
        fit that kept no factors); the spectral residual then puts the mean dropped
        eigenvalue in every dropped direction.
        """
        return self._quadrature

    @property
    def residual_model(self) -> Residual:
        """The fitted :class:`~lowrank_laplace.posterior.Residual` (the dropped curvature)."""
        self._check_H_init()
        if self._residual_model is None:
            self._residual_model = self.options.residual_model.from_fit(DroppedCurvature(
                self.H[0], self.H[1], self.trace, self.rank_bound or self.n_params,
                self.residual_diagonal, self._layer_sizes(), self._null, self._quadrature))
        return self._residual_model

    def _layer_sizes(self) -> Optional[List[int]]:
        """Parameters per layer (laplace-torch's ``n_layers`` parameter tensors)."""
        sizes = [p.numel() for p in getattr(self, "params", None) or ()]
        return sizes if sizes and sum(sizes) == self.n_params else None

    def _layer_prior(self, dtype: Optional[torch.dtype] = None
                     ) -> Optional[Tuple[List[int], Tensor]]:
        """``(sizes, delta_l)`` for a layerwise prior (one value per parameter tensor)."""
        prior = torch.as_tensor(self.prior_precision)
        sizes = self._layer_sizes()
        if sizes is None or prior.ndim != 1 or prior.numel() in (1, self.n_params) \
                or prior.numel() != len(sizes):
            return None
        return sizes, prior.to(device=self._device, dtype=dtype or self._dtype)

    @property
    def prior_precision_diag(self) -> Tensor:
        """laplace-torch's prior precision diagonal ``(D,)``; a layerwise one by one repeat."""
        dtype = torch.promote_types(torch.as_tensor(self.prior_precision).dtype, self._dtype)
        layer = self._layer_prior(dtype)
        if layer is None:
            return super().prior_precision_diag
        sizes, prior = layer
        return prior.repeat_interleave(torch.tensor(sizes, device=self._device),
                                       output_size=self.n_params)

    def _check_H_init(self) -> None:
        """Refuse a posterior query before :meth:`fit`, with laplace-torch's message."""
        if getattr(self, "H", None) is None:
            raise AttributeError("Laplace not fitted. Run fit() first.")

    def _prior(self) -> Tensor:
        """The prior precision as a scalar tensor or a ``(D,)`` diagonal."""
        prior = torch.as_tensor(self.prior_precision, device=self._device, dtype=self._dtype)
        return prior.reshape(()) if prior.numel() == 1 else self.prior_precision_diag

    def _precision(self) -> LowRankPrecision:
        self._check_H_init()
        return self.residual_model.precision(self.H[0], self.H[1], self._H_factor,
                                             self._prior(), self._gram_cache,
                                             self._layer_prior())

    @on_one_thread_if_small
    def log_marginal_likelihood(self, prior_precision: Optional[Tensor] = None,
                                sigma_noise: Optional[Tensor] = None) -> Tensor:
        """laplace-torch's Laplace log marginal likelihood, with the low-rank log det.

        Args:
            prior_precision: Evaluate at this prior precision (sets it).
            sigma_noise: Evaluate at this observation noise (regression; sets it).

        Returns:
            Scalar tensor, differentiable in both.
        """
        parent = super().log_marginal_likelihood
        prior = self.prior_precision if prior_precision is None else prior_precision
        sigma = self.sigma_noise if sigma_noise is None else sigma_noise
        regression = self.likelihood == "regression"
        inputs = [torch.as_tensor(prior), torch.as_tensor(sigma)]
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs) \
                or self.query_work >= SMALL_WORK or torch.device(self._device).type != "cpu":
            return parent(prior_precision, sigma_noise)
        # a small posterior's gradient on one thread too; keep the caller's tensors
        value = scoped_backward(lambda p, s: parent(p, s if regression else None), inputs,
                                self.query_work, self._device)
        self.prior_precision = prior
        if regression:
            self.sigma_noise = sigma
        return value

    @on_one_thread_if_small
    def log_prob(self, value: Tensor, normalized: bool = True) -> Tensor:
        """Log density of ``value`` under the posterior; under the prior before :meth:`fit`.

        Before a fit: the prior ``N(prior_mean, P_0^{-1})``, as in laplace-torch's ``FullLaplace``.

        Args:
            value: Parameter vector, shape ``(D,)``.
            normalized: ``False`` returns only the term depending on ``value``.

        Returns:
            Scalar tensor.

        Raises:
            AttributeError: Before the fit of a last-layer posterior whose layer is not known yet.
        """
        if getattr(self, "H", None) is not None:
            return super().log_prob(value, normalized)
        if self.n_params is None:
            self._check_H_init()
        empty = torch.zeros(self.n_params, 0, device=self._device, dtype=self._dtype)
        prior = LowRankPrecision(empty, empty.new_zeros(0), self._prior())
        log_prob = -prior.square_norm(value - self.mean) / 2
        if normalized:
            log_prob = log_prob + (prior.logdet() - self.n_params * math.log(2 * math.pi)) / 2
        return log_prob

    @property
    @on_one_thread_if_small
    def posterior_variance(self) -> Tensor:
        """Marginal posterior variances ``diag(P^{-1})``, shape ``(D,)``, in ``O(D r)``."""
        return self._precision().inverse_diagonal()

    @property
    def posterior_covariance(self) -> Tensor:
        """The dense posterior covariance ``P^{-1}``, shape ``(D, D)`` (small models).

        Raises:
            ValueError: If the ``D x D`` matrix exceeds ``memory_budget``.
        """
        cov = self._precision().solve(self._dense_identity("posterior_covariance"))
        return (cov + cov.T) / 2

    @property
    def posterior_scale(self) -> Tensor:
        """A dense square root ``S`` of the covariance, ``S S^T = P^{-1}``, ``(D, D)``.

        The map that :meth:`sample` applies to standard normal noise (symmetric for
        a scalar prior without diagonal correction; not triangular, unlike
        laplace-torch's full Cholesky factor).

        Raises:
            ValueError: If the ``D x D`` matrix exceeds ``memory_budget``.
        """
        return self._precision().sqrt_inv_matmul(self._dense_identity("posterior_scale"))

    def _dense_identity(self, what: str) -> Tensor:
        self._check_H_init()
        return dense_identity(self.n_params, self._dtype, self._device, self.memory_budget, what)

    @property
    @on_one_thread_if_small
    def log_det_posterior_precision(self) -> Tensor:
        """``log det P`` by the determinant lemma (closed form for a scalar prior)."""
        return self._precision().logdet()

    @on_one_thread_if_small
    def square_norm(self, value: Tensor) -> Tensor:
        """``(value - mean)^T P (value - mean)``.

        Args:
            value: Parameter vector, shape ``(D,)``.

        Returns:
            Scalar tensor.
        """
        return self._precision().square_norm(value - self.mean)

    @on_one_thread_if_small
    def functional_variance(self, Js: Tensor) -> Tensor:
        """``J P^{-1} J^T`` per input from explicit Jacobians.

        Args:
            Js: Jacobians, shape ``(B, C, D)``.

        Returns:
            Tensor of shape ``(B, C, C)``.
        """
        return self._precision().jacobian_variance(Js)

    @on_one_thread_if_small
    def functional_covariance(self, Js: Tensor) -> Tensor:
        """Joint ``J P^{-1} J^T`` over all inputs and outputs from explicit Jacobians.

        Args:
            Js: Jacobians, shape ``(B, C, D)``.

        Returns:
            Tensor of shape ``(B C, B C)``.
        """
        return self._precision().jacobian_variance(Js.reshape(-1, Js.shape[-1]))

    @on_one_thread_if_small
    def sample_from_noise(self, eps: Tensor) -> Tensor:
        """Posterior samples as a linear map of standard normal noise.

        Args:
            eps: Noise, shape ``(D, n)``.

        Returns:
            Samples ``mean + S eps`` with ``S S^T = P^{-1}``, shape ``(n, D)``.
        """
        return self.mean + self._precision().sqrt_inv_matmul(eps).T

    def sample(self, n_samples: int = 100, generator: Optional[torch.Generator] = None) -> Tensor:
        """Draw parameter samples from the posterior ``N(mean, P^{-1})``.

        Args:
            n_samples: Number of samples.
            generator: Random number generator.

        Returns:
            Samples, shape ``(n_samples, D)``.
        """
        self._check_H_init()  # before n_params is used: a last layer is found by fit
        if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 0:
            raise ValueError(f"n_samples must be a non-negative int, got {n_samples!r}.")
        eps = torch.randn(self.n_params, n_samples, device=self._device, dtype=self._dtype,
                          generator=generator)
        return self.sample_from_noise(eps)

    # -------------------------------------------------------------- predictive
    def _glm_predictive_distribution(self, X: Union[Tensor, MutableMapping],
                                     joint: bool = False, diagonal_output: bool = False
                                     ) -> Tuple[Tensor, Tensor]:
        if self.enable_backprop:
            return super()._glm_predictive_distribution(X, joint, diagonal_output)
        return self._engine_predictive(self.model, X, joint, diagonal_output)

    @on_spare_cores
    def _engine_predictive(self, module: torch.nn.Module, X: Union[Tensor, MutableMapping],
                           joint: bool, diagonal_output: bool) -> Tuple[Tensor, Tensor]:
        """The GLM predictive with ``module``'s Jacobians from the fit's engine."""
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                "lowrank_ggn's GLM predictive forms Jacobians by backward passes, which "
                "torch.inference_mode() forbids: predict under torch.no_grad() instead (in "
                "Lightning, Trainer(inference_mode=False)), or use pred_type='nn'."
            )
        precision = self._precision()
        sizes = [p.numel() for p in self._curvature_target()[2]]
        prior = torch.as_tensor(self.prior_precision)
        per_layer = (self.options.residual_model.constant_per_layer
                     and prior.numel() == len(sizes)
                     and prior.numel() != self.n_params)
        weights = prior_variance_weights(precision, sizes, per_layer)
        f_mu, f_var = glm_predictive(
            module, to_device(X, self._device), precision, weights,
            backend=self.factor_backend, joint=joint, memory_budget=self.memory_budget,
            micro_batch_size=self.micro_batch_size,
        )
        if diagonal_output and not joint:
            f_var = torch.diagonal(f_var, dim1=-2, dim2=-1)
        return f_mu, f_var
