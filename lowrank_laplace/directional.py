r"""Per-sample directional derivatives, damped Newton steps and inverse products.

Along a GGN eigenvector :math:`e_k` the quadratic model of sample ``n`` has slope
:math:`\gamma_{nk} = e_k^\top g_n` and curvature :math:`\lambda_{nk} = e_k^\top G_n
e_k`, where :math:`g_n, G_n` are gradient and GGN of the sample's own loss
:math:`\ell_n` (the batch loss is their mean or sum). Both come from the Gram
space: with :math:`e_k = V \tilde g_k / \sqrt{\lambda_k}`,
:math:`\lambda_{nk} = s\,\lambda_k \sum_c \tilde g_{k,(c,n)}^2` (``s = N`` for mean,
``1`` for sum reduction) and :math:`\gamma_{nk} = s\,\tilde g_k^\top (V^\top
g^{(\rho)}_n) / \sqrt{\lambda_k}` with BackPACK's per-sample gradients
:math:`g^{(\rho)}_n` of the reduced loss.

Shape glossary:
    N: batch size; N_S: curvature samples; K: eigenpairs; D: parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from lowrank_laplace import _checks
from lowrank_laplace.engine import FactorEngine, RNGReplay
from lowrank_laplace.factor import GGNFactor, damped_gram_solve
from lowrank_laplace.spectrum import gram_eigh, to_parameter_space


def snr(samples: Tensor) -> Tensor:
    r"""Signal-to-noise ratio per column: squared mean over unbiased variance.

    .. math:: \mathrm{SNR}_k = \bar x_k^2 / (\tfrac{1}{N-1}\sum_n (x_{nk}-\bar x_k)^2)

    Args:
        samples: Tensor of shape ``(N, K)`` with ``N >= 2``.

    Returns:
        Tensor of shape ``(K,)``.

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
        lambdas: ``lambda_nk = e_k^T G_n e_k`` for every curvature sample,
            ``(N_S, K)`` (``N_S = len(subsampling)`` when sub-sampling).
        eigenvalues: GGN eigenvalues ``lambda_k``, ``(K,)``.
        eigenvectors: GGN eigenvectors ``e_k``, ``(D, K)``.
        reduction: The loss reduction; for ``'mean'`` the column means of
            ``gammas`` and ``lambdas`` are ``e_k^T g`` and ``lambda_k``.
        backend: The backend that computed ``V`` (``'backpack'`` or ``'functorch'``).
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


def directional_from_factor(
    factor: GGNFactor,
    group: int = 0,
    top_k: Optional[int] = 10,
    threshold: Optional[float] = None,
    indices: Optional[Sequence[int]] = None,
) -> DirectionalDerivatives:
    """Directional derivatives of one group from a factor with per-sample gradients.

    Args:
        factor: Factor computed with ``batch_grad=True`` and kept blocks.
        group: Group index.
        top_k: Number of leading eigenpairs; ``None`` for all nonzero ones.
        threshold: Keep only eigenvalues ``>= threshold``.
        indices: Keep these positions of the descending nonzero spectrum instead.

    Returns:
        The directional derivatives along the selected eigenvectors.

    Raises:
        ValueError: If the factor has no per-sample gradients.
    """
    evals, gvecs = _directional_eigh(factor, group, top_k, threshold, indices)
    return _directional(factor, group, evals, gvecs,
                        to_parameter_space(factor, evals, gvecs, group))


def _directional_eigh(factor: GGNFactor, group: int, top_k, threshold, indices):
    if not (factor.batch_grads or group in factor.t_batch_grads):
        raise ValueError("The factor has no per-sample gradients: compute it with batch_grad=True.")
    evals, gvecs, _ = gram_eigh(factor, group, top_k, threshold, indices)
    return evals, gvecs


def _directional(factor: GGNFactor, group: int, evals: Tensor, gvecs: Tensor,
                 eigenvectors: Tensor) -> DirectionalDerivatives:
    """Slopes and curvatures from the selected Gram eigenpairs of one group."""
    # BackPACK's column order is (vector, sample)
    sq = gvecs.reshape(factor.num_vectors, factor.num_curv_samples, -1).pow(2).sum(0)
    lambdas = factor.sample_scale * evals * sq
    grad_scale = factor.num_samples if factor.reduction == "mean" else 1
    proj = factor.t_matmul_batch_grads(group)  # (M, N)
    gammas = grad_scale * (proj.T @ gvecs) / evals.sqrt()
    return DirectionalDerivatives(
        gammas=gammas,
        lambdas=lambdas,
        eigenvalues=evals,
        eigenvectors=eigenvectors,
        reduction=factor.reduction,
        backend=factor.backend,
    )


def directional_derivatives(
    model: nn.Module,
    loss_func: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    top_k: Optional[int] = 10,
    mc_samples: int = 0,
    subsampling: Optional[Sequence[int]] = None,
    param_groups: Optional[List[dict]] = None,
    *,
    threshold: Optional[float] = None,
    indices: Optional[Sequence[int]] = None,
    low_memory: bool = False,
    backend: str = "auto",
) -> Union[DirectionalDerivatives, List[DirectionalDerivatives]]:
    """Per-sample slopes and curvatures along the GGN's eigenvectors, one backward pass.

    Gradients (``gammas``) always use every sample of the batch; the GGN, its
    eigenvectors and ``lambdas`` use the curvature approximation chosen by
    ``mc_samples`` and ``subsampling`` (``lambdas`` then has one row per
    curvature sample; for MC they are MC estimates of the per-sample curvature).

    ``low_memory=True`` never holds all of ``V`` or of the per-sample gradients: one
    pass accumulates the Gram matrix and ``V^T [g_1, ..., g_N]`` block by block, a
    second maps the selected eigenvectors to parameter space block by block (random
    draws replayed).

    Args:
        model: The network (left unchanged).
        loss_func: ``nn.CrossEntropyLoss`` or ``nn.MSELoss``.
        inputs: Inputs, shape ``(N, ...)``.
        targets: Targets.
        top_k: Number of leading eigenpairs; ``None`` for all nonzero ones.
        mc_samples: ``0`` for the exact GGN, ``M >= 1`` for Monte-Carlo.
        subsampling: Indices of the samples used for the curvature.
        param_groups: Optimizer-style groups for a block-diagonal GGN.
        threshold: Keep only eigenvalues ``>= threshold``.
        indices: Keep these positions of the descending nonzero spectrum instead.
        low_memory: Two backward passes, never holding all of ``V`` (see above).
        backend: ``'auto'``, ``'backpack'`` or ``'functorch'`` (see
            :mod:`lowrank_laplace.engine`); the result's ``backend`` says which ran.

    Returns:
        :class:`DirectionalDerivatives` (a list, one per group, with ``param_groups``).

    Raises:
        MemoryError: If ``V`` (with ``low_memory``, its largest block) would not fit
            the device's available memory; raised before any backward pass.
    """
    if not low_memory:
        with FactorEngine(model, loss_func, backend=backend) as engine:
            engine.check_memory(inputs, subsampling, mc_samples, False,
                                "directional_derivatives")
            factor = engine.compute(
                inputs, targets, mc_samples, subsampling, param_groups, batch_grad=True
            )
        results = [
            directional_from_factor(factor, g, top_k, threshold, indices)
            for g in range(len(factor.groups))
        ]
        return results if param_groups is not None else results[0]
    replay = RNGReplay(_checks.batch_device(inputs))
    with FactorEngine(model, loss_func, backend=backend) as engine:
        engine.check_memory(inputs, subsampling, mc_samples, True, "directional_derivatives")
        first = engine.compute(inputs, targets, mc_samples, subsampling, param_groups,
                               keep_blocks=False, compute_grams=True, batch_grad=True,
                               cross_batch_grads=True)
        replay.mark()
        selected = [_directional_eigh(first, g, top_k, threshold, indices)
                    for g in range(len(first.groups))]
        with replay:
            second = engine.compute(
                inputs, targets, mc_samples, subsampling, param_groups, keep_blocks=False,
                project=[gvecs / evals.sqrt() for evals, gvecs in selected],
            )
    results = [
        _directional(first, g, evals, gvecs, second.projected_flat(g))
        for g, (evals, gvecs) in enumerate(selected)
    ]
    return results if param_groups is not None else results[0]


def _check_damping(damping, positive: bool = False) -> None:
    """Refuse a NaN, infinite or negative (``positive``: non-positive) damping."""
    try:
        value = math.nan if isinstance(damping, (str, bytes)) else float(damping)
    except (TypeError, ValueError, RuntimeError):
        value = math.nan
    if isinstance(damping, bool) or not math.isfinite(value) or value < 0 or (
            positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"damping must be a finite {kind} number, got {damping!r}.")


def newton_step_from_factor(
    factor: GGNFactor,
    damping: float,
    group: int = 0,
    top_k: Optional[int] = None,
) -> Tensor:
    r"""Damped Newton step :math:`-\sum_k \gamma_k/(\lambda_k+\delta)\, e_k` of a group.

    Summed in Gram space, :math:`\sum_k c_k e_k = V \sum_k c_k \tilde g_k /
    \sqrt{\lambda_k}`, so only one transformation to parameter space is needed.

    Args:
        factor: The GGN factor with kept blocks and gradient.
        damping: ``delta >= 0`` added to every eigenvalue.
        group: Group index.
        top_k: Number of leading directions (``None``: all nonzero).

    Returns:
        Flat step over the group's parameters, shape ``(D,)``.

    Raises:
        ValueError: If ``damping`` is negative.
    """
    _check_damping(damping)
    evals, gvecs, _ = gram_eigh(factor, group, top_k)
    vtg = factor.t_matmul(factor.grad_flat(group)[:, None], group)[:, 0]
    return factor.matmul(_newton_gram_coefficients(evals, gvecs, vtg, damping)[:, None],
                         group)[:, 0]


def _newton_gram_coefficients(evals: Tensor, gvecs: Tensor, vtg: Tensor,
                              damping: float) -> Tensor:
    """``y`` with ``V y = -sum_k gamma_k / (lambda_k + delta) e_k`` (``M``-vector).

    ``gamma_k = e_k^T g = g_k^T V^T g / sqrt(lambda_k)`` and ``e_k = V g_k /
    sqrt(lambda_k)``, so ``y = -G diag(1 / (lambda (lambda + delta))) G^T V^T g``.
    """
    gammas = (gvecs.T @ vtg) / evals.sqrt()
    return gvecs @ (-gammas / (evals + damping) / evals.sqrt())


def damped_newton_step(
    model: nn.Module,
    loss_func: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    damping: float = 1.0,
    top_k: Optional[int] = None,
    mc_samples: int = 0,
    subsampling: Optional[Sequence[int]] = None,
    param_groups: Optional[List[dict]] = None,
    low_memory: bool = False,
    *,
    backend: str = "auto",
) -> Tensor:
    """Damped Newton step in the GGN's nonzero eigenspace, from one backward pass.

    ``step = sum_k -gamma_k / (lambda_k + damping) e_k`` with ``gamma_k = e_k^T g``.
    With ``param_groups`` each group gets its own (block-diagonal) step.

    ``low_memory=True`` never holds all of ``V``: with BackPACK a plain backward
    pass gives the gradient ``g``, a second pass accumulates the Gram matrix and
    ``V^T g`` block by block, and a third forms the step ``V y`` block by block; the
    functorch backend takes ``V^T g`` from the Gram pass's per-sample gradients
    (two passes). Random draws (Monte-Carlo samples, dropout masks) are replayed, so
    the result is the same as in one pass.

    Args:
        model: The network (left unchanged).
        loss_func: ``nn.CrossEntropyLoss`` or ``nn.MSELoss``.
        inputs: Inputs, shape ``(N, ...)``.
        targets: Targets.
        damping: ``delta >= 0``.
        top_k: Number of leading directions (``None``: all nonzero ones).
        mc_samples: ``0`` for the exact GGN, ``M >= 1`` for Monte-Carlo.
        subsampling: Indices of the samples used for the curvature.
        param_groups: Optimizer-style groups for a block-diagonal GGN.
        low_memory: Two or three backward passes instead of one, holding at most
            one layer's block of ``V`` at a time (see above).
        backend: ``'auto'``, ``'backpack'`` or ``'functorch'`` (see
            :mod:`lowrank_laplace.engine`).

    Returns:
        Flat step, shape ``(D,)``: over ``model.parameters()`` with
        ``requires_grad`` or, with ``param_groups``, the groups concatenated.

    Raises:
        ValueError: If ``damping`` is negative, NaN or infinite.
        MemoryError: If ``V`` (with ``low_memory``, its largest block) would not fit
            the device's available memory; raised before any backward pass.
    """
    _check_damping(damping)  # before any backward pass
    if not low_memory:
        with FactorEngine(model, loss_func, backend=backend) as engine:
            engine.check_memory(inputs, subsampling, mc_samples, False, "damped_newton_step")
            factor = engine.compute(inputs, targets, mc_samples, subsampling, param_groups)
        steps = [
            newton_step_from_factor(factor, damping, g, top_k)
            for g in range(len(factor.groups))
        ]
        return torch.cat(steps)
    replay = RNGReplay(_checks.batch_device(inputs))
    with FactorEngine(model, loss_func, backend=backend) as engine:
        engine.check_memory(inputs, subsampling, mc_samples, True, "damped_newton_step")
        if engine.backend == "functorch":
            # V^T g from the Gram pass's own per-sample gradients: every dropout mask
            # is drawn by one vmapped pass, which the step pass replays
            first = engine.compute(inputs, targets, mc_samples, subsampling, param_groups,
                                   keep_blocks=False, compute_grams=True, batch_grad=True,
                                   cross_batch_grads=True)
            vtgs = [first.t_matmul_batch_grads(g).sum(1) for g in range(len(first.groups))]
        else:
            grads = engine.gradient(inputs, targets, param_groups)
            replay.restart()  # the Gram pass sees the gradient pass's dropout masks
            first = engine.compute(inputs, targets, mc_samples, subsampling, param_groups,
                                   keep_blocks=False, compute_grams=True,
                                   t_project=[g[:, None] for g in grads])
            vtgs = [first.t_projected[g][:, 0] for g in range(len(first.groups))]
        replay.mark()
        coefficients = []
        for g in range(len(first.groups)):
            evals, gvecs, _ = gram_eigh(first, g, top_k)
            coefficients.append(_newton_gram_coefficients(evals, gvecs, vtgs[g], damping))
        with replay:
            second = engine.compute(inputs, targets, mc_samples, subsampling, param_groups,
                                    keep_blocks=False, project=[c[:, None] for c in coefficients])
    return torch.cat([second.projected_flat(g)[:, 0] for g in range(len(first.groups))])


def ggn_inverse_matvec(
    model: nn.Module,
    loss_func: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    vec: Tensor,
    damping: float,
    mc_samples: int = 0,
    subsampling: Optional[Sequence[int]] = None,
    param_groups: Optional[List[dict]] = None,
    low_memory: bool = False,
    *,
    backend: str = "auto",
) -> Tensor:
    r"""Damped inverse GGN-vector products :math:`(G + \delta I)^{-1} x`.

    Uses the matrix inversion lemma with the ``M x M`` damped Gram matrix. With
    ``param_groups`` the GGN is block-diagonal and each block is inverted on its
    own. ``low_memory=True`` never holds all of ``V``: one pass accumulates the Gram
    matrix and ``V^T x`` block by block, a second forms ``V`` times the small solve
    block by block (random draws replayed).

    Args:
        model: The network (left unchanged).
        loss_func: ``nn.CrossEntropyLoss`` or ``nn.MSELoss``.
        inputs: Inputs, shape ``(N, ...)``.
        targets: Targets.
        vec: Flat vector(s), shape ``(D,)`` or ``(D, K)``, ordered like the
            concatenated groups.
        damping: ``delta > 0``.
        mc_samples: ``0`` for the exact GGN, ``M >= 1`` for Monte-Carlo.
        subsampling: Indices of the samples used for the curvature.
        param_groups: Optimizer-style groups for a block-diagonal GGN.
        low_memory: Two backward passes, never holding all of ``V`` (see above).
        backend: ``'auto'``, ``'backpack'`` or ``'functorch'`` (see
            :mod:`lowrank_laplace.engine`).

    Returns:
        Tensor of the same shape as ``vec``.

    Raises:
        ValueError: If ``vec`` is not a ``(D,)`` or ``(D, K)`` tensor of the
            parameters' dtype, or ``damping <= 0``.
        MemoryError: If ``V`` (with ``low_memory``, its largest block) would not fit
            the device's available memory; raised before any backward pass.
    """
    _check_damping(damping, positive=True)
    groups = _checks.resolve_param_groups(model, param_groups)
    params = list(model.parameters())
    if not isinstance(vec, Tensor) or vec.ndim not in (1, 2):
        raise ValueError("vec must be a tensor of shape (D,) or (D, K), got "
                         f"{tuple(vec.shape) if isinstance(vec, Tensor) else type(vec).__name__}.")
    if vec.dtype != params[groups[0][0]].dtype:
        raise ValueError(f"vec has dtype {vec.dtype}, the model's parameters "
                         f"{params[groups[0][0]].dtype}.")
    dims = [sum(params[i].numel() for i in g) for g in groups]
    if vec.shape[0] != sum(dims):
        raise ValueError(f"vec has {vec.shape[0]} entries, the groups have {sum(dims)}.")
    x = vec if vec.ndim == 2 else vec[:, None]
    parts = list(torch.split(x, dims, dim=0))
    if not low_memory:
        with FactorEngine(model, loss_func, backend=backend) as engine:
            engine.check_memory(inputs, subsampling, mc_samples, False, "ggn_inverse_matvec")
            factor = engine.compute(inputs, targets, mc_samples, subsampling, param_groups)
        out = torch.cat([factor.inverse_matvec(p, damping, g) for g, p in enumerate(parts)])
        return out if vec.ndim == 2 else out[:, 0]
    replay = RNGReplay(_checks.batch_device(inputs))
    with FactorEngine(model, loss_func, backend=backend) as engine:
        engine.check_memory(inputs, subsampling, mc_samples, True, "ggn_inverse_matvec")
        first = engine.compute(inputs, targets, mc_samples, subsampling, param_groups,
                               keep_blocks=False, compute_grams=True, t_project=parts)
        replay.mark()
        inner = [damped_gram_solve(first.gram(g), first.t_projected[g], damping)
                 for g in range(len(groups))]
        with replay:
            second = engine.compute(inputs, targets, mc_samples, subsampling, param_groups,
                                    keep_blocks=False, project=inner)
    out = torch.cat([(p - second.projected_flat(g)) / damping for g, p in enumerate(parts)])
    return out if vec.ndim == 2 else out[:, 0]
