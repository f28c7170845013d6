"""Square roots of the loss Hessian w.r.t. the ``(N, C)`` model outputs, shared by every backend."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn


def factor_columns(loss_func: nn.Module, output_shape: tuple, mc_samples: int) -> int:
    """Return the columns of ``V`` per sample: ``mc_samples``, ``C - 1`` (exact CE), else ``C``.

    Args:
        loss_func: The loss module.
        output_shape: Shape of a batch's outputs, ``(N, C, ...)``.
        mc_samples: ``0`` (exact GGN) or Monte-Carlo samples.
    """
    if mc_samples:
        return mc_samples
    if isinstance(loss_func, nn.CrossEntropyLoss) and len(output_shape) == 2:
        return max(1, output_shape[1] - 1)
    return output_shape[1]


def reduced_cross_entropy_sqrt(logits: Tensor, reduction: str) -> Tensor:
    """Return a ``C - 1``-column square root ``(C - 1, N, C)`` of the cross-entropy Hessian.

    With ``t = sqrt(softmax(logits))`` and the Householder reflection
    ``H = I - 2 u u^T / (u^T u)``, ``u = t + e_C`` (``H t = -e_C``), the first ``C - 1``
    columns of ``H`` span ``t``'s complement and ``S = diag(t) H[:, :C-1]`` gives
    ``S S^T = diag(p) - p p^T``; returned in BackPACK's layout.

    Args:
        logits: Shape ``(N, C)``, ``C >= 2``.
        reduction: The loss's reduction (``"mean"`` divides by ``sqrt(N)``).
    """
    num, classes = logits.shape
    t = logits.detach().softmax(1).sqrt()
    last = torch.zeros(classes, dtype=t.dtype, device=t.device)
    last[-1] = 1
    u = t + last  # no in-place update: also runs under torch.func.vmap
    coef = 2 / (u * u).sum(1)  # (N,)
    eye = torch.eye(classes - 1, classes, dtype=t.dtype, device=t.device)
    house = eye[:, None, :] - (coef[:, None] * u[:, : classes - 1]).T[:, :, None] * u[None]
    sqrt_h = t[None] * house  # (C - 1, N, C)
    if reduction == "mean":
        sqrt_h = sqrt_h / num**0.5
    return sqrt_h


def per_sample_scale(loss: nn.Module, num_outputs: int) -> float:
    """Return ``c``: ``l_n = c *`` the sum-reduced loss of sample ``n`` (``1/C`` for MSE mean)."""
    return 1 / num_outputs if isinstance(loss, nn.MSELoss) and loss.reduction == "mean" else 1.0


def mc_noise(loss: nn.Module, num: int, classes: int, mc_samples: int,
             like: Tensor) -> Optional[Tensor]:
    """Return :func:`hessian_sqrt`'s ``noise`` (``None`` if exact) in ``like``'s dtype, device."""
    if not mc_samples:
        return None
    if isinstance(loss, nn.MSELoss):
        return torch.randn(num, mc_samples, classes, dtype=like.dtype, device=like.device)
    return torch.rand(num, mc_samples, dtype=like.dtype, device=like.device)


def hessian_sqrt(loss: nn.Module, out: Tensor, mc_samples: int,
                 noise: Optional[Tensor]) -> Tensor:
    """Return ``s`` ``(V, N, C)``: ``sum_v s_vn s_vn^T`` is (an MC estimate of) ``l_n``'s Hessian.

    Tensor operations over the batch only, so that it also runs under ``torch.func.vmap``.

    Args:
        loss: ``CrossEntropyLoss`` or ``MSELoss``.
        out: Outputs ``(N, C)``.
        mc_samples: ``0`` exact, else ``M``.
        noise: ``(N, M)`` uniforms (cross-entropy) or ``(N, M, C)`` normals (MSE).
    """
    num, classes = out.shape
    if isinstance(loss, nn.MSELoss):
        scale = (2 * per_sample_scale(loss, classes)) ** 0.5
        if mc_samples:
            return (scale / mc_samples**0.5) * noise.transpose(0, 1)
        eye = torch.eye(classes, dtype=out.dtype, device=out.device)
        return scale * eye[:, None, :].expand(classes, num, classes)
    p = out.softmax(1)
    if mc_samples:  # s = (p - e_y) / sqrt(M), y ~ Categorical(p) by inverse CDF
        cdf = p.cumsum(1)
        lower = torch.cat([cdf.new_zeros(num, 1), cdf[:, :-1]], 1)
        upper = torch.cat([cdf[:, :-1], cdf.new_full((num, 1), float("inf"))], 1)
        u = noise[:, :, None]
        onehot = ((u >= lower[:, None]) & (u < upper[:, None])).to(out.dtype)
        return ((p[:, None] - onehot) / mc_samples**0.5).transpose(0, 1)
    if classes == 1:  # one logit: the cross-entropy is constant
        return out.new_zeros(1, num, 1)
    return reduced_cross_entropy_sqrt(out, "sum")
