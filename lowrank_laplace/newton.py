r"""Damped Newton steps and inverse GGN-vector products in the GGN's nonzero eigenspace.

Both are summed in the Gram space of ``V`` (ViViT): a step
:math:`-\sum_k \gamma_k/(\lambda_k+\delta)\, e_k` needs one transformation to
parameter space, and :math:`(G + \delta I)^{-1} x` follows from the matrix inversion
lemma with the ``M x M`` damped Gram matrix.

Shape glossary:
    N: batch size; M: columns of ``V``; D: parameters; K: vectors.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import Tensor, nn

from lowrank_laplace.engine import FactorEngine, RNGReplay
from lowrank_laplace.factor import GGNFactor, damped_gram_solve
from lowrank_laplace.minibatch import MiniBatch, take_options
from lowrank_laplace.spectrum import gram_eigh
from lowrank_laplace.utils import batches, checks


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
    checks.check_damping(damping)
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


def damped_newton_step(model: nn.Module, loss_func: nn.Module, inputs: Tensor,
                       targets: Tensor, damping: float = 1.0, top_k: Optional[int] = None,
                       **options: Any) -> Tensor:
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
        **options: The curvature's options
            (:class:`~lowrank_laplace.minibatch.CurvatureOptions`: ``mc_samples``,
            ``subsampling``, ``param_groups``, ``low_memory``, ``backend``).

    Returns:
        Flat step, shape ``(D,)``: over ``model.parameters()`` with
        ``requires_grad`` or, with ``param_groups``, the groups concatenated.

    Raises:
        ValueError: If ``damping`` is negative, NaN or infinite.
        MemoryError: If ``V`` (with ``low_memory``, its largest block) would not fit
            the device's available memory; raised before any backward pass.
        TypeError: For an unknown keyword option.
    """
    checks.check_damping(damping)  # before any backward pass
    curvature, _ = take_options(options, (), "damped_newton_step")
    batch = MiniBatch(model, loss_func, inputs, targets, curvature)
    with batch.engine("damped_newton_step") as engine:
        if curvature.low_memory:
            return _two_pass_step(engine, batch.pass_args, damping, top_k)
        factor = batch.compute(engine)
    return torch.cat([newton_step_from_factor(factor, damping, g, top_k)
                      for g in range(len(factor.groups))])


def _two_pass_step(engine: FactorEngine, args: tuple, damping: float,
                   top_k: Optional[int]) -> Tensor:
    """The step from a Gram pass (with ``V^T g``) and a projection pass (``low_memory``)."""
    replay = RNGReplay(batches.batch_device(args[0]))
    if engine.gradient_in_factor_pass:
        # V^T g from the Gram pass's own per-sample gradients: its random draws are
        # shared with them, and the step pass replays them
        first = dict(batch_grad=True, cross_batch_grads=True)
    else:
        grads = engine.gradient(args[0], args[1], args[4])
        replay.restart()  # the Gram pass sees the gradient pass's dropout masks
        first = dict(t_project=[g[:, None] for g in grads])

    def coefficients(grams: GGNFactor) -> List[Tensor]:
        out = []
        for g in range(len(grams.groups)):
            vtg = grams.t_matmul_batch_grads(g).sum(1) if engine.gradient_in_factor_pass \
                else grams.t_projected[g][:, 0]
            evals, gvecs, _ = gram_eigh(grams, g, top_k)
            out.append(_newton_gram_coefficients(evals, gvecs, vtg, damping)[:, None])
        return out

    grams, second = engine.gram_and_projection(*args, coefficients, replay=replay, **first)
    return torch.cat([second.projected_flat(g)[:, 0] for g in range(len(grams.groups))])


def ggn_inverse_matvec(model: nn.Module, loss_func: nn.Module, inputs: Tensor,
                       targets: Tensor, vec: Tensor, damping: float, **options: Any) -> Tensor:
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
        **options: The curvature's options
            (:class:`~lowrank_laplace.minibatch.CurvatureOptions`: ``mc_samples``,
            ``subsampling``, ``param_groups``, ``low_memory``, ``backend``).

    Returns:
        Tensor of the same shape as ``vec``.

    Raises:
        ValueError: If ``vec`` is not a ``(D,)`` or ``(D, K)`` tensor of the
            parameters' dtype, or ``damping <= 0``.
        MemoryError: If ``V`` (with ``low_memory``, its largest block) would not fit
            the device's available memory; raised before any backward pass.
        TypeError: For an unknown keyword option.
    """
    checks.check_damping(damping, positive=True)
    curvature, _ = take_options(options, (), "ggn_inverse_matvec")
    parts = _split_vector(model, vec, curvature.param_groups)
    batch = MiniBatch(model, loss_func, inputs, targets, curvature)
    with batch.engine("ggn_inverse_matvec") as engine:
        if not curvature.low_memory:
            factor = batch.compute(engine)
            out = torch.cat([inverse_matvec_from_factor(factor, p, damping, g)
                             for g, p in enumerate(parts)])
            return out if vec.ndim == 2 else out[:, 0]
        first, second = engine.gram_and_projection(
            *batch.pass_args,
            lambda grams: [damped_gram_solve(grams.gram(g), grams.t_projected[g], damping)
                           for g in range(len(parts))],
            t_project=parts,
        )
    out = torch.cat([(p - second.projected_flat(g)) / damping for g, p in enumerate(parts)])
    return out if vec.ndim == 2 else out[:, 0]


def _split_vector(model: nn.Module, vec: Tensor, param_groups: Optional[List[dict]]
                  ) -> List[Tensor]:
    """``vec`` as ``(D_g, K)`` parts per group, after checking its shape and dtype."""
    groups = checks.resolve_param_groups(model, param_groups)
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
    return list(torch.split(x, dims, dim=0))


def inverse_matvec_from_factor(factor: GGNFactor, x: Tensor, damping: float,
                               group: int = 0) -> Tensor:
    r"""``(G + delta I)^{-1} x`` of a group by the matrix inversion lemma.

    :math:`(G + \delta I)^{-1} = \delta^{-1}[I - V(\delta I + V^\top V)^{-1}V^\top]`,
    solved with a Cholesky factor of the ``M x M`` damped Gram matrix.

    Args:
        factor: The GGN factor with kept blocks.
        x: Tensor of shape ``(D, K)``.
        damping: ``delta > 0``.
        group: Group index.

    Returns:
        Tensor of shape ``(D, K)``.

    Raises:
        ValueError: If ``damping <= 0``.
    """
    checks.check_damping(damping, positive=True)
    inner = damped_gram_solve(factor.gram(group), factor.t_matmul(x, group), damping)
    return (x - factor.matmul(inner, group)) / damping
