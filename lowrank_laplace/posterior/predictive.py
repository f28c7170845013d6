r"""GLM predictive moments without materialising the ``(B, C, D)`` Jacobian.

An MSE-sum engine's factor is ``V = sqrt(2) J^T``: ``J P_0^{-1} J^T`` and
``J P_0^{-1} W`` come from one backward pass per micro-batch (docs/concepts.md, "The
posterior precision").

Shape glossary:
    B: test inputs; C: outputs; D: parameters; r: rank.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.engine.factor_engine import jacobian_engine
from lowrank_laplace.factor import GGNFactor
from lowrank_laplace.factor.weights import SMALL_DTYPE, Weight
from lowrank_laplace.fitting import budget
from lowrank_laplace.posterior.precision import LowRankPrecision
from lowrank_laplace.utils.batches import take
from lowrank_laplace.utils.checks import check_batch

#: A pass's largest temporaries (a block of ``V``, the vectors at the widest layer) stay
#: below glibc's mmap ceiling: larger ones are mapped and zero-filled anew in every pass.
PASS_BYTES = 2**25
#: ...but a pass takes at least this many inputs: smaller ones cost more than the pages.
MIN_PASS = 64


def glm_moments(engine: FactorEngine, inputs: Tensor, precision: LowRankPrecision,
                weights: List[Weight], joint: bool = False) -> Tuple[Tensor, Tensor]:
    r"""Mean and (co)variance of the linearised predictive on a batch.

    Args:
        engine: An MSE-sum engine on the model.
        inputs: ``(B, ...)``.
        precision: The posterior precision.
        weights: ``P_0^{-1}`` per trainable parameter (scalar or ``(d,)``).
        joint: The joint ``(B C, B C)`` covariance instead of ``(B, C, C)`` blocks.

    Returns:
        ``f_mu`` ``(B, C)`` and ``f_var`` ``(B, C, C)`` (or ``(B C, B C)`` ordered like
        ``f_mu.flatten()``).
    """
    factor = engine.compute(inputs, None, gradient=False)  # V = sqrt(2) J^T, outputs f(x)
    num_out, num_in = factor.num_vectors, factor.num_samples
    jdj, jdw = _small_products(factor, precision, weights, joint)
    jdw = jdw.reshape(num_out, num_in, -1).transpose(0, 1)  # (B, C, r), rows were (c, n)
    jn = None if precision.null is None else (  # J N = V^T N / sqrt(2), (B, C, k)
        precision.null.directions.factor_product(factor).to(jdj.dtype) / 2**0.5
    ).reshape(num_out, num_in, -1).transpose(0, 1)
    if joint:  # rows/cols ordered (c, n) -> (n, c)
        jdj = jdj.reshape(num_out, num_in, num_out, num_in).permute(1, 0, 3, 2)
        jdj, jdw = jdj.reshape(num_in * num_out, -1), jdw.reshape(num_in * num_out, -1)
        jn = None if jn is None else jn.reshape(num_in * num_out, -1)
    f_var = precision.functional_variance(jdj, jdw, jn)
    # a bfloat16 head's outputs are given in the posterior's own dtype
    dtype = torch.promote_types(factor.outputs.dtype, precision.U.dtype)
    return factor.outputs.to(dtype), f_var.to(dtype)


def _small_products(factor: GGNFactor, precision: LowRankPrecision, weights: List[Weight],
                    joint: bool) -> Tuple[Tensor, Tensor]:
    """``J P_0^{-1} J^T`` (``(B, C, C)``, or ``(C B, C B)``) and ``J P_0^{-1} W`` (``(C B, r)``).

    In float64 a slice of a block at a time; rows ordered ``(c, n)``.
    """
    jdj, jdw = 0, 0
    for block, U, w in zip(factor.group_blocks(0), factor.split_flat(precision.U, 0), weights):
        for wide, product, w_wide in block.wide_parts(U, w):
            jdj = jdj + (wide.weighted_gram(w_wide) if joint
                         else wide.sample_gram(factor.num_vectors, w_wide))
            jdw = jdw + product
    return jdj / 2, jdw * precision.ell.to(SMALL_DTYPE).sqrt() / 2**0.5


def batched_glm_moments(engine: FactorEngine, inputs: Tensor, precision: LowRankPrecision,
                        weights: List[Weight], micro_batch_size: int) -> Tuple[Tensor, Tensor]:
    """:func:`glm_moments` over micro-batches (per-input variances only).

    Args:
        engine: An MSE-sum engine on the model.
        inputs: ``(B, ...)``.
        precision: The posterior precision.
        weights: ``P_0^{-1}`` per parameter.
        micro_batch_size: Inputs per backward pass.

    Returns:
        ``f_mu`` ``(B, C)`` and ``f_var`` ``(B, C, C)``.
    """
    moments = [glm_moments(engine, chunk, precision, weights)
               for chunk in micro_batches(inputs, micro_batch_size)]
    return torch.cat([mu for mu, _ in moments]), torch.cat([var for _, var in moments])


def prior_variance_weights(precision: LowRankPrecision, sizes: List[int],
                           per_layer: bool) -> List[Weight]:
    """``diag(d)^{-1}`` per parameter in float64 (so the GLM variance's terms cancel).

    Args:
        precision: The posterior precision.
        sizes: Entries of every Laplace parameter.
        per_layer: ``d`` is constant over each parameter.

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
    """The GLM predictive's mean and (co)variance on a batch, in budgeted micro-batches.

    Args:
        model: The network (left unchanged).
        X: Inputs (tensor or dict batch) on the model's device.
        precision: The posterior precision.
        weights: :func:`prior_variance_weights`.
        backend: The engine's backend.
        joint: The joint ``(B C, B C)`` covariance, with a flat mean.
        memory_budget: ``memory_budget`` as given.
        micro_batch_size: Upper bound on inputs per backward pass.

    Returns:
        ``f_mu`` ``(B, C)`` and ``f_var`` ``(B, C, C)`` (or the joint form).
    """
    with jacobian_engine(model, backend) as engine:
        if joint:
            f_mu, f_var = glm_moments(engine, X, precision, weights, joint=True)
            return f_mu.flatten(), f_var
        micro = min(budget.micro_batch_size(engine, X, None, memory_budget, micro_batch_size),
                    max(MIN_PASS, PASS_BYTES // engine.bytes_per_sample(X, one_block=True)))
        return batched_glm_moments(engine, X, precision, weights, micro)


def micro_batches(inputs: Any, size: int) -> Iterator[Any]:
    """Consecutive slices of ``size`` samples of a tensor or dict batch."""
    num = check_batch(inputs, None)
    for start in range(0, num, size):
        yield take(inputs, slice(start, start + size), num)
