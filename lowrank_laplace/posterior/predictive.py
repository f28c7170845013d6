r"""GLM predictive moments without materialising the ``(B, C, D)`` Jacobian.

The linearised predictive needs :math:`f(x)` and :math:`J P^{-1} J^\top`. With the
low-rank precision of :mod:`lowrank_laplace.posterior`,

.. math::
    J P^{-1} J^\top = J P_0^{-1} J^\top - (J P_0^{-1} W) K^{-1} (J P_0^{-1} W)^\top.

Both terms come from the engine itself: for ``MSELoss(reduction="sum")`` the loss
Hessian is :math:`2I`, so BackPACK's factor has columns :math:`\sqrt{2} J_n^\top e_c`:
``V = sqrt(2) J^T``. The per-sample ``C x C`` blocks of :math:`J P_0^{-1} J^\top`
are per-sample Gram blocks (linear layers stay factored) and :math:`J P_0^{-1} W`
is ``V^T (P_0^{-1} W)``, all accumulated from one backward pass per micro-batch.

Shape glossary:
    B: test inputs; C: outputs; D: parameters; r: rank.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.engine.functorch import LOOPING
from lowrank_laplace.factor import GGNFactor
from lowrank_laplace.factor.weights import SMALL_DTYPE, Weight
from lowrank_laplace.fitting import budget
from lowrank_laplace.posterior.precision import LowRankPrecision
from lowrank_laplace.utils.batches import take
from lowrank_laplace.utils.checks import check_batch


@contextlib.contextmanager
def jacobian_engine(model: nn.Module, backend: str) -> Iterator[FactorEngine]:
    """An MSE-sum engine on the model in eval mode: its ``V`` is ``sqrt(2) J^T``.

    Its passes come after a fit of the same model, which already said whether the
    functorch backend loops over samples, so they do not say it again.

    Args:
        model: The network (left unchanged).
        backend: The engine's backend.

    Yields:
        The open engine.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=LOOPING)
        with FactorEngine(model, nn.MSELoss(reduction="sum"), eval_mode=True,
                          backend=backend) as engine:
            yield engine


def jacobian_factor(engine: FactorEngine, inputs: Tensor) -> GGNFactor:
    """One backward pass giving ``V = sqrt(2) J^T`` on ``inputs`` (MSE-sum engine).

    Args:
        engine: Engine built with ``nn.MSELoss(reduction="sum")``.
        inputs: Inputs, shape ``(B, ...)``.

    Returns:
        The :class:`~lowrank_laplace.factor.GGNFactor` (its ``outputs`` are ``f(x)``).
    """
    return engine.compute(inputs, None, gradient=False)


def glm_moments(
    engine: FactorEngine,
    inputs: Tensor,
    precision: LowRankPrecision,
    weights: List[Weight],
    joint: bool = False,
) -> Tuple[Tensor, Tensor]:
    r"""Mean and (co)variance of the linearised predictive on a batch.

    Args:
        engine: Engine built with ``nn.MSELoss(reduction="sum")`` on the model.
        inputs: Inputs, shape ``(B, ...)``.
        precision: The posterior precision.
        weights: :math:`P_0^{-1}` per parameter (scalar or ``(d,)``), in the
            order of the model's trainable parameters.
        joint: Return the joint ``(B C, B C)`` covariance instead of the per-input
            ``(B, C, C)`` blocks.

    Returns:
        ``f_mu`` of shape ``(B, C)`` and ``f_var`` of shape ``(B, C, C)`` (or
        ``(B C, B C)`` with ``joint``, ordered like ``f_mu.flatten()``).
    """
    factor = jacobian_factor(engine, inputs)
    num_out, num_in = factor.num_vectors, factor.num_samples
    jdj, jdw = _small_products(factor, precision, weights, joint)
    jdw = jdw.reshape(num_out, num_in, -1).transpose(0, 1)  # (B, C, r), rows were (c, n)
    if joint:  # rows/cols ordered (c, n) -> (n, c)
        jdj = jdj.reshape(num_out, num_in, num_out, num_in).permute(1, 0, 3, 2)
        jdj = jdj.reshape(num_in * num_out, num_in * num_out)
        f_var = precision.functional_variance(jdj, jdw.reshape(num_in * num_out, -1))
    else:
        f_var = precision.functional_variance(jdj, jdw)
    # a bfloat16 head's outputs are given in the posterior's own dtype
    dtype = torch.promote_types(factor.outputs.dtype, precision.U.dtype)
    return factor.outputs.to(dtype), f_var.to(dtype)


def _small_products(factor: GGNFactor, precision: LowRankPrecision, weights: List[Weight],
                    joint: bool) -> Tuple[Tensor, Tensor]:
    """``J P_0^{-1} J^T`` and ``J P_0^{-1} W`` in float64, one parameter at a time.

    ``V = sqrt(2) J^T``. Each block is widened to float64 on its own, a slice of its
    entries at a time (:meth:`~lowrank_laplace.factor.blocks.Block.wide_parts`), so the
    predictive variance, a difference of these products that cancels when ``J`` lies
    mostly in the kept subspace, keeps float64 accuracy for a float32 model. No large
    float64 copy is made.

    Returns:
        ``jdj``: ``(B, C, C)`` per input, or ``(C B, C B)`` ordered ``(c, n)`` with
        ``joint``; ``jdw``: ``(C B, r)`` ordered ``(c, n)``.
    """
    jdj, jdw = 0, 0
    for block, U, w in zip(factor.group_blocks(0), factor.split_flat(precision.U, 0), weights):
        for wide, product, w_wide in block.wide_parts(U, w):
            if joint:
                jdj = jdj + wide.weighted_gram(w_wide)
            else:
                jdj = jdj + wide.sample_gram(factor.num_vectors, w_wide)
            jdw = jdw + product
    return jdj / 2, jdw * precision.ell.to(SMALL_DTYPE).sqrt() / 2**0.5


def batched_glm_moments(
    engine: FactorEngine,
    inputs: Tensor,
    precision: LowRankPrecision,
    weights: List[Weight],
    micro_batch_size: int,
) -> Tuple[Tensor, Tensor]:
    """:func:`glm_moments` over micro-batches (per-input variances only).

    Args:
        engine: Engine built with ``nn.MSELoss(reduction="sum")`` on the model.
        inputs: Inputs, shape ``(B, ...)``.
        precision: The posterior precision.
        weights: :math:`P_0^{-1}` per parameter.
        micro_batch_size: Inputs per backward pass.

    Returns:
        ``f_mu`` of shape ``(B, C)`` and ``f_var`` of shape ``(B, C, C)``.
    """
    mus, variances = [], []
    for chunk in _micro_batches(inputs, micro_batch_size):
        mu, var = glm_moments(engine, chunk, precision, weights)
        mus.append(mu)
        variances.append(var)
    return torch.cat(mus), torch.cat(variances)


def prior_variance_weights(precision: LowRankPrecision, sizes: List[int],
                           per_layer: bool) -> List[Weight]:
    """``diag(d)^{-1}`` of ``precision`` per parameter (scalars where ``d`` is constant).

    In float64 whatever the model's dtype: the GLM variance subtracts products scaled
    by these weights from each other, and a float32 ``1 / d`` rounded differently
    from the capacitance's ``d`` would not cancel.

    Args:
        precision: The posterior precision.
        sizes: Entries of every Laplace parameter, in order.
        per_layer: ``d`` is constant over each parameter (a per-layer prior).

    Returns:
        One weight per parameter: a scalar tensor or its ``(d,)`` diagonal.
    """
    d = precision.d.to(torch.float64)
    if precision.isotropic:
        return [1 / d] * len(sizes)
    inverse = list(torch.split(1 / d, sizes))
    return [w[0] for w in inverse] if per_layer else inverse


def glm_predictive(model: nn.Module, X: Any, precision: LowRankPrecision,
                   weights: List[Weight], *, backend: str = "auto", joint: bool = False,
                   memory_budget: Union[int, float, None] = None,
                   micro_batch_size: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """The GLM predictive's mean and (co)variance of a model on a batch.

    ``V = sqrt(2) J^T`` comes from an MSE-sum engine on the model in eval mode (as
    in laplace-torch's fit), in micro-batches that fit the memory budget.

    Args:
        model: The network (left unchanged).
        X: Inputs (tensor or dict batch) on the model's device.
        precision: The posterior precision.
        weights: :math:`P_0^{-1}` per parameter (:func:`prior_variance_weights`).
        backend: The engine's backend.
        joint: The joint covariance over all inputs and outputs, ``(B C, B C)``,
            with a flat mean.
        memory_budget: ``memory_budget`` as given by the user.
        micro_batch_size: Upper bound on inputs per backward pass.

    Returns:
        ``f_mu`` ``(B, C)`` and ``f_var`` ``(B, C, C)`` (or the joint form).
    """
    with jacobian_engine(model, backend) as engine:
        if joint:
            f_mu, f_var = glm_moments(engine, X, precision, weights, joint=True)
            return f_mu.flatten(), f_var
        micro = budget.micro_batch_size(engine, X, None, memory_budget, micro_batch_size)
        return batched_glm_moments(engine, X, precision, weights, micro)


def jacobian_energies(engine: FactorEngine, batches: List, U: Tensor,
                      micro_batch_size: int, projections: Optional[int] = None,
                      rng: Any = None) -> Tensor:
    r"""Jacobian energies :math:`e_k = \sum_n \|J_n u_k\|^2` of the columns of ``U``.

    The spectral residual model measures with them how an input's Jacobian spreads
    over the GGN's eigen-directions (see
    :func:`~lowrank_laplace.posterior.residual.jacobian_exponent`).

    Exact, the backward passes carry all ``C`` output directions of every input. With
    ``projections = m`` they carry ``m`` random Gaussian combinations of them instead
    (the Monte-Carlo factor of the squared loss): ``E[\|\xi^T J_n u\|^2] = \|J_n u\|^2``,
    so the estimate is unbiased at ``m / C`` of the cost.

    Args:
        engine: Engine built with ``nn.MSELoss(reduction="sum")`` on the model.
        batches: Input batches (tensors or dicts), summed over.
        U: Orthonormal directions, shape ``(D, r)``.
        micro_batch_size: Inputs per backward pass.
        projections: ``None`` for the exact energies, else random projections per
            input.
        rng: Context manager the random projections are drawn in (e.g. the fit's
            private stream); ``None`` draws from the global generator.

    Returns:
        Tensor of shape ``(r,)``.
    """
    energy = U.new_zeros(U.shape[1])
    for inputs in batches:
        for chunk in _micro_batches(inputs, micro_batch_size):
            if projections is None:
                factor = jacobian_factor(engine, chunk)
            else:
                with rng if rng is not None else contextlib.nullcontext():
                    factor = engine.compute(chunk, None, mc_samples=projections,
                                            gradient=False)
            energy += (factor.t_matmul(U) ** 2).sum(0) / 2  # E[V V^T] = 2 J^T J
    return energy


def _micro_batches(inputs: Any, size: int) -> Iterator[Any]:
    """Consecutive slices of ``size`` samples of a tensor or dict batch."""
    num = check_batch(inputs, None)
    for start in range(0, num, size):
        yield take(inputs, slice(start, start + size), num)
