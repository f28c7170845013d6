"""Per-sample directional derivatives along GGN eigenvectors and their SNRs.

Slopes ``gamma_nk = e_k^T g_n`` and curvatures ``lambda_nk = e_k^T G_n e_k`` of each
sample's own loss, both from the Gram space (derivation: concepts page, "Directional
derivatives").

Shape glossary:
    N: batch size; N_S: curvature samples; K: eigenpairs; D: parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Union

from torch import Tensor, nn

from lowrank_laplace.factor import GGNFactor
from lowrank_laplace.minibatch import MiniBatch, take_options
from lowrank_laplace.spectrum import gram_eigh, to_parameter_space


def snr(samples: Tensor) -> Tensor:
    """Return the SNR of each column, ``(K,)``: squared mean over unbiased variance.

    Args:
        samples: Tensor of shape ``(N, K)`` with ``N >= 2``.

    Raises:
        ValueError: If fewer than two samples are given.
    """
    if samples.shape[0] < 2:
        raise ValueError("An SNR needs at least two samples.")
    return samples.mean(0) ** 2 / samples.var(0, unbiased=True)


@dataclass
class DirectionalDerivatives:
    """First- and second-order directional derivatives along GGN eigenvectors.

    Attributes:
        gammas: ``gamma_nk = e_k^T g_n`` for every sample of the batch, ``(N, K)``.
        lambdas: ``lambda_nk = e_k^T G_n e_k`` for every curvature sample, ``(N_S, K)``.
        eigenvalues: GGN eigenvalues ``lambda_k``, ``(K,)``.
        eigenvectors: GGN eigenvectors ``e_k``, ``(D, K)``.
        reduction: The loss reduction; for ``'mean'`` the column means of ``gammas`` and
            ``lambdas`` are ``e_k^T g`` and ``lambda_k``.
        backend: The engine that computed ``V`` (``'backpack'``, ``'hooks'``, ``'functorch'``).
    """

    gammas: Tensor
    lambdas: Tensor
    eigenvalues: Tensor
    eigenvectors: Tensor
    reduction: str
    backend: str = ""

    @property
    def gamma_snr(self) -> Tensor:
        """Gradient SNR along each direction, ``(K,)``."""
        return snr(self.gammas)

    @property
    def lambda_snr(self) -> Tensor:
        """Curvature SNR along each direction, ``(K,)``."""
        return snr(self.lambdas)


def directional_from_factor(factor: GGNFactor, group: int = 0, top_k: Optional[int] = 10,
                            threshold: Optional[float] = None,
                            indices: Optional[Sequence[int]] = None) -> DirectionalDerivatives:
    """Return one group's directional derivatives along the selected eigenvectors.

    Args:
        factor: Factor computed with ``batch_grad=True`` and kept blocks.
        group: Group index.
        top_k: Number of leading eigenpairs; ``None`` for all nonzero ones.
        threshold: Keep only eigenvalues ``>= threshold``.
        indices: Keep these positions of the descending nonzero spectrum instead.

    Raises:
        ValueError: If the factor has no per-sample gradients.
    """
    evals, gvecs = _directional_eigh(factor, group, top_k, threshold, indices)
    return _directional(factor, group, evals, gvecs,
                        to_parameter_space(factor, evals, gvecs, group))


def _directional_eigh(factor: GGNFactor, group: int, top_k, threshold, indices):
    if not (factor.batch_grads or group in factor.t_batch_grads):
        raise ValueError("The factor has no per-sample gradients: compute it with batch_grad=True.")
    return gram_eigh(factor, group, top_k, threshold, indices)[:2]


def _directional(factor: GGNFactor, group: int, evals: Tensor, gvecs: Tensor,
                 eigenvectors: Tensor) -> DirectionalDerivatives:
    """Slopes and curvatures from the selected Gram eigenpairs of one group."""
    # BackPACK's column order is (vector, sample)
    sq = gvecs.reshape(factor.num_vectors, factor.num_curv_samples, -1).pow(2).sum(0)
    lambdas = factor.sample_scale * evals * sq
    grad_scale = factor.num_samples if factor.reduction == "mean" else 1
    proj = factor.t_matmul_batch_grads(group)  # (M, N)
    gammas = grad_scale * (proj.T @ gvecs) / evals.sqrt()
    return DirectionalDerivatives(gammas, lambdas, evals, eigenvectors, factor.reduction,
                                  factor.backend)


def directional_derivatives(model: nn.Module, loss_func: nn.Module, inputs: Tensor,
                            targets: Tensor, top_k: Optional[int] = 10, **options: Any
                            ) -> Union[DirectionalDerivatives, List[DirectionalDerivatives]]:
    """Return per-sample slopes and curvatures along the GGN's eigenvectors, one backward pass.

    A :class:`DirectionalDerivatives` (a list, one per group, with ``param_groups``).
    ``gammas`` use every sample of the batch; the GGN, its eigenvectors and ``lambdas`` (a
    row per curvature sample) follow ``mc_samples`` and ``subsampling``. ``low_memory=True``
    never holds all of ``V`` or of the per-sample gradients.

    Args:
        model: The network (left unchanged).
        loss_func: ``nn.CrossEntropyLoss`` or ``nn.MSELoss``.
        inputs: Inputs, shape ``(N, ...)``.
        targets: Targets.
        top_k: Number of leading eigenpairs; ``None`` for all nonzero ones.
        **options: ``threshold`` and ``indices`` as in
            :func:`~lowrank_laplace.spectrum.gram_eigh`, and the fields of
            :class:`~lowrank_laplace.minibatch.CurvatureOptions`.

    Raises:
        MemoryError: If ``V`` (or with ``low_memory`` its largest block) would not fit.
        TypeError: For an unknown keyword option.
    """
    curvature, extra = take_options(options, ("threshold", "indices"),
                                    "directional_derivatives")
    select = (top_k, extra.get("threshold"), extra.get("indices"))
    batch = MiniBatch(model, loss_func, inputs, targets, curvature)
    if not curvature.low_memory:
        with batch.engine("directional_derivatives") as engine:
            factor = batch.compute(engine, batch_grad=True)
        return batch.results([directional_from_factor(factor, g, *select)
                              for g in range(len(factor.groups))])
    selected = []

    def coefficients(grams: GGNFactor) -> List[Tensor]:
        selected.extend(_directional_eigh(grams, g, *select) for g in range(len(grams.groups)))
        return [gvecs / evals.sqrt() for evals, gvecs in selected]

    with batch.engine("directional_derivatives") as engine:
        first, second = engine.gram_and_projection(*batch.pass_args, coefficients,
                                                   batch_grad=True, cross_batch_grads=True)
    return batch.results([_directional(first, g, evals, gvecs, second.projected_flat(g))
                          for g, (evals, gvecs) in enumerate(selected)])
