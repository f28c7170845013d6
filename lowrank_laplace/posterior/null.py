r"""The logit-shift directions of a softmax head: null directions of the GGN, known exactly.

Under cross-entropy the loss Hessian ``diag(p) - p p^T`` annihilates ``1``: for a final
linear layer ``z = W h + b`` with ``C`` outputs the ``H + 1`` orthonormal directions
``dW = 1 a^T / sqrt(C)``, ``db = c 1 / sqrt(C)`` have no curvature, and the exact
posterior gives them the prior's variance. The spectral residual treats them apart
(:class:`NullShift`) once the probe checked that they shift all outputs alike
(docs/benchmarks/posterior_quality.md, "The models").

Shape glossary:
    D: parameters; C: outputs; H: the head's input features; k: directions (``H + 1``).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

import torch
from torch import Tensor, nn

#: Most entries of the weight's block of ``N`` (``C H x H``): a wider head is left to the model.
MAX_ENTRIES = 2**22
#: Largest relative spread of a direction's output change that counts as moving outputs alike.
ALIKE = 1e-4


@dataclass(frozen=True)
class NullDirections:
    """The logit-shift directions of a final ``nn.Linear`` among the Laplace parameters.

    Attributes:
        weight: Index of the head's weight among the parameter tensors.
        bias: Index of its bias (``None``: no trainable bias).
        offsets: First row of every parameter tensor in the flat vector.
        classes: Outputs ``C``.
        features: Input features ``H``.
    """

    weight: int
    bias: Optional[int]
    offsets: Sequence[int]
    classes: int
    features: int

    @property
    def count(self) -> int:
        """Directions ``k``."""
        return self.features + (self.bias is not None)

    def _rows(self, index: int, size: int) -> slice:
        return slice(self.offsets[index], self.offsets[index] + size)

    def project(self, x: Tensor) -> Tensor:
        """``N^T x`` along the last dimension: ``(..., D)`` to ``(..., k)``."""
        C, H = self.classes, self.features
        w = x[..., self._rows(self.weight, C * H)].unflatten(-1, (C, H)).sum(-2)
        if self.bias is not None:
            w = torch.cat([w, x[..., self._rows(self.bias, C)].sum(-1, keepdim=True)], -1)
        return w / C**0.5

    def expand(self, y: Tensor, dim: int) -> Tensor:
        """``N y`` along the last dimension: ``(..., k)`` to ``(..., D)``."""
        C, H = self.classes, self.features
        out = y.new_zeros(*y.shape[:-1], dim)
        out[..., self._rows(self.weight, C * H)] = \
            y[..., None, :H].expand(*y.shape[:-1], C, H).flatten(-2) / C**0.5
        if self.bias is not None:
            out[..., self._rows(self.bias, C)] = y[..., H:] / C**0.5
        return out

    def column_means(self, d: Tensor) -> Optional[Tensor]:
        """A ``(D,)`` diagonal's value on every direction, ``(k,)`` (``None``: not constant)."""
        C, H = self.classes, self.features
        parts = [d[self._rows(self.weight, C * H)].unflatten(-1, (C, H))]
        if self.bias is not None:
            parts.append(d[self._rows(self.bias, C)][:, None])
        tol, means = 64 * torch.finfo(d.dtype).eps, []
        for part in parts:  # (C, directions of the part)
            mean = part.mean(0)
            if not bool(((part - mean).abs() <= tol * part.abs()).all()):
                return None
            means.append(mean)
        return torch.cat(means)

    def factor_product(self, factor: Any) -> Tensor:
        """``V^T N`` of a factor over all Laplace parameters, ``(M, k)``."""
        C, H = self.classes, self.features
        blocks = factor.group_blocks(0)
        block = blocks[self.weight]
        eye = torch.eye(H, dtype=block.dtype, device=factor.outputs.device)
        out = block.t_matmul(eye.repeat(C, 1) / C**0.5)
        if self.bias is not None:
            block = blocks[self.bias]
            ones = torch.full((C, 1), C**-0.5, dtype=block.dtype, device=eye.device)
            out = torch.cat([out, block.t_matmul(ones).to(out.dtype)], -1)
        return out

    def state(self) -> Dict[str, Any]:
        """A plain dict for ``state_dict``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: Optional[Dict[str, Any]]) -> Optional["NullDirections"]:
        """Inverse of :meth:`state` (``None`` stays ``None``)."""
        return None if state is None else cls(**{**state, "offsets": tuple(state["offsets"])})


def head_directions(model: nn.Module, params: Sequence[Tensor], likelihood: str,
                    outputs: int) -> Optional[NullDirections]:
    """The candidate logit-shift directions of a classifier, unchecked (``None``: none).

    Those of the last ``nn.Linear`` with ``outputs`` outputs and a Laplace weight.

    Args:
        model: The network.
        params: The Laplace parameters, in order.
        likelihood: ``"classification"`` (cross-entropy) or ``"regression"``.
        outputs: Outputs ``C``.
    """
    if likelihood != "classification" or outputs < 2:
        return None
    index = {id(p): i for i, p in enumerate(params)}
    heads = [m for m in model.modules() if isinstance(m, nn.Linear)
             and m.out_features == outputs and id(m.weight) in index]
    if not heads or outputs * heads[-1].in_features**2 > MAX_ENTRIES:
        return None
    head = heads[-1]
    offsets = tuple(itertools.accumulate((p.numel() for p in params[:-1]), initial=0))
    bias = None if head.bias is None else index.get(id(head.bias))
    return NullDirections(index[id(head.weight)], bias, offsets, outputs, head.in_features)


def moves_outputs_alike(product: Tensor, classes: int) -> bool:
    """Whether ``J N`` (rows ordered ``(c, n)``) moves every output alike at every input."""
    J = product.to(torch.float64).reshape(classes, -1, product.shape[-1])
    spread = (J - J.mean(0)).norm()
    return bool(J.norm() > 0 and spread <= ALIKE * J.norm())


@dataclass(frozen=True)
class NullShift:
    """The posterior's correction on the null directions: their variance is the prior's.

    The precision's diagonal holds ``held`` there; the directions are its eigenvectors, so
    every product changes by a diagonal in their basis.

    Attributes:
        directions: The null directions.
        prior: The prior precision on each direction, ``(k,)``.
        held: The precision's diagonal on each direction, ``(k,)``.
    """

    directions: NullDirections
    prior: Tensor
    held: Tensor

    def apply(self, x: Tensor, gap: Tensor) -> Tensor:
        """``N diag(gap) N^T x`` for ``x`` ``(D, K)``."""
        inner = self.directions.project(x.T) * gap.to(x.dtype)
        return self.directions.expand(inner, x.shape[0]).T

    @property
    def variance_gap(self) -> Tensor:
        """``1 / prior - 1 / held``, ``(k,)``."""
        return 1 / self.prior - 1 / self.held

    @property
    def scale_gap(self) -> Tensor:
        """``prior^{-1/2} - held^{-1/2}``, ``(k,)``."""
        return self.prior.rsqrt() - self.held.rsqrt()

    def jacobian_variance(self, JN: Tensor) -> Tensor:
        """The added ``J N diag(gap) N^T J^T`` from ``J N`` ``(..., C, k)``."""
        return (JN * self.variance_gap.to(JN.dtype)) @ JN.transpose(-1, -2)

    def diagonal(self, dim: int) -> Tensor:
        """The added ``diag(N diag(gap) N^T)``, ``(D,)``."""
        gap = self.variance_gap / self.directions.classes**0.5
        return self.directions.expand(gap, dim)
