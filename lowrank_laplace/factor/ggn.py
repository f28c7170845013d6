"""The GGN factor ``V`` of a mini-batch (``G = V V^T``, docs/concepts.md) and its products.

Shape glossary:
    N: batch size; N_S: curvature samples (``len(subsampling)`` or N); C: outputs;
    M: columns of ``V`` (``C * N_S`` exact, ``mc_samples * N_S``); D: parameters of a group.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

import torch
from torch import Tensor

from lowrank_laplace.factor.blocks import Block


@dataclass
class GGNFactor:
    """The GGN factor ``V`` of one mini-batch, split into parameter groups.

    The dicts are keyed by parameter index (into ``list(model.parameters())``) unless
    said otherwise; what the pass did not collect is empty. Methods act on the
    parameters of group ``group`` (default 0), flat in group order.

    Attributes:
        groups: Parameter indices per group.
        shapes: Shape of every parameter.
        blocks: Kept blocks of ``V^T``.
        grams: ``V^T V`` per group accumulated in the pass (``None`` where not requested).
        num_vectors: Vectors per sample (``C``, ``C - 1`` exact cross-entropy, ``mc_samples``).
        num_curv_samples: Curvature samples ``N_S``.
        sample_scale: ``G_n = sample_scale * sum_c v_nc v_nc^T`` is the GGN of the sample's
            own loss ``l_n`` (``N_S`` for mean, ``1`` for sum reduction).
        grad: Flat mini-batch gradients.
        batch_grads: Blocks of per-sample gradients of ``rho * l_n``.
        num_samples: Batch size ``N``.
        reduction: ``'mean'`` or ``'sum'``.
        loss: The mini-batch loss (detached).
        outputs: The model outputs ``(N, C)`` (detached).
        projected: ``V y`` per parameter, ``(d, K)``, for the ``project`` matrices.
        t_projected: ``V^T x`` per group index, ``(M, K)``, for the ``t_project`` matrices.
        t_batch_grads: ``V^T [g_1, ..., g_N]`` per group index, ``(M, N)``.
        diagonals: GGN diagonals accumulated in the pass.
        backend: ``'backpack'``, ``'hooks'`` or ``'functorch'``.
    """

    groups: List[List[int]]
    shapes: List[torch.Size]
    num_vectors: int
    num_curv_samples: int
    sample_scale: float
    num_samples: int
    reduction: str
    loss: Tensor
    outputs: Optional[Tensor] = None
    blocks: Dict[int, Block] = field(default_factory=dict)
    grams: List[Optional[Tensor]] = field(default_factory=list)
    grad: Dict[int, Tensor] = field(default_factory=dict)
    batch_grads: Dict[int, Block] = field(default_factory=dict)
    projected: Dict[int, Tensor] = field(default_factory=dict)
    t_projected: Dict[int, Tensor] = field(default_factory=dict)
    t_batch_grads: Dict[int, Tensor] = field(default_factory=dict)
    diagonals: Dict[int, Tensor] = field(default_factory=dict)
    backend: str = ""
    #: Products with ``V`` need no pass (a ``RecomputedFactor``'s recompute it).
    recomputed = False

    @property
    def num_columns(self) -> int:
        """Columns ``M`` of ``V``."""
        return self.num_vectors * self.num_curv_samples

    def group_dim(self, group: int = 0) -> int:
        """Parameters ``D`` of the group."""
        return sum(self.shapes[i].numel() for i in self.groups[group])

    def projected_flat(self, group: int = 0) -> Tensor:
        """``V y`` of the group from the projection pass, ``(D, K)``.

        Raises:
            RuntimeError: If the group was not projected.
        """
        try:
            return torch.cat([self.projected[i] for i in self.groups[group]], dim=0)
        except KeyError as err:
            raise RuntimeError("This group was not projected (see compute(project=...)).") \
                from err

    def split_flat(self, x: Tensor, group: int = 0) -> List[Tensor]:
        """Views of a flat ``(D, K)`` matrix's rows per parameter of the group."""
        sizes = [self.shapes[i].numel() for i in self.groups[group]]
        return list(torch.split(x, sizes, dim=0))

    def group_blocks(self, group: int = 0) -> List[Block]:
        """The kept blocks of the group's parameters, in order.

        Raises:
            RuntimeError: If the blocks were not kept.
        """
        try:
            return [self.blocks[i] for i in self.groups[group]]
        except KeyError as err:
            raise RuntimeError(
                "V was not kept for this group (it was computed with keep_blocks=False).") from err

    def take_samples(self, start: int, stop: int) -> "GGNFactor":
        """Return the factor of curvature samples ``start:stop``, blocks only (``loss`` zero).

        One pass can thus feed several merges.
        """
        blocks = {i: b.take_samples(start, stop, self.num_vectors)
                  for i, b in self.blocks.items()}
        return replace(
            self, blocks=blocks, grams=[], grad={}, batch_grads={}, projected={},
            t_projected={}, t_batch_grads={}, diagonals={}, outputs=None,
            num_curv_samples=stop - start, num_samples=stop - start,
            loss=torch.zeros_like(self.loss))

    def gram(self, group: int = 0) -> Tensor:
        """``V^T V`` of the group, ``(M, M)``, computed once."""
        if len(self.grams) > group and self.grams[group] is not None:
            return self.grams[group]
        gram = sum(b.gram() for b in self.group_blocks(group))
        # kept, so the exact trace (its diagonal) and later calls cost nothing more
        self.grams.extend([None] * (group + 1 - len(self.grams)))
        self.grams[group] = gram
        return gram

    def trace(self, group: int = 0) -> Tensor:
        """The exact GGN trace ``tr(V^T V)`` of the group."""
        if len(self.grams) > group and self.grams[group] is not None:
            return self.grams[group].diagonal().sum()
        return sum(b.row_sq_norms().sum() for b in self.group_blocks(group))

    def diag(self, group: int = 0) -> Tensor:
        """The exact diagonal of ``G = V V^T`` over the group, ``(D,)``."""
        if self.diagonals and all(i in self.diagonals for i in self.groups[group]):
            return torch.cat([self.diagonals[i] for i in self.groups[group]])
        return torch.cat([b.diag_outer() for b in self.group_blocks(group)])

    def t_matmul(self, x: Tensor, group: int = 0) -> Tensor:
        """``V^T x`` for ``x`` ``(D, K)``, ``(M, K)``."""
        out = None
        for block, part in zip(self.group_blocks(group), self.split_flat(x, group)):
            if out is not None and out.dtype == torch.promote_types(out.dtype, block.dtype):
                out = block.t_matmul(part, out)  # added in place
            else:  # the first, or a wider dtype than the sum so far
                out = block.t_matmul(part) if out is None else block.t_matmul(part) + out
        return out

    def matmul(self, y: Tensor, group: int = 0) -> Tensor:
        """``V y`` for ``y`` ``(M, K)``, ``(D, K)``."""
        out = y.new_zeros(self.group_dim(group), y.shape[1])
        return self.matmul_add_(out, y, group)

    def matmul_add_(self, out: Tensor, y: Tensor, group: int = 0) -> Tensor:
        """``out += V y`` in place for ``out`` ``(D, K)``, by parameter; returns ``out``."""
        for block, part in zip(self.group_blocks(group), self.split_flat(out, group)):
            block.matmul_add_(part, y)
        return out

    def matvec(self, x: Tensor, group: int = 0) -> Tensor:
        """GGN-vector products ``G x = V (V^T x)``, ``(D, K)``."""
        return self.matmul(self.t_matmul(x, group), group)

    def grad_dtype(self) -> torch.dtype:
        """The dtype of the model's parameters."""
        return next(iter(self.grad.values())).dtype

    def grad_device(self) -> torch.device:
        """The device of the model's parameters."""
        return next(iter(self.grad.values())).device

    def grad_flat(self, group: int = 0) -> Tensor:
        """The group's mini-batch gradient, ``(D,)``."""
        return torch.cat([self.grad[i] for i in self.groups[group]])

    def t_matmul_batch_grads(self, group: int = 0) -> Tensor:
        """``V^T [g_1, ..., g_N]`` with the per-sample gradients of ``rho l_n``, ``(M, N)``."""
        if group in self.t_batch_grads:
            return self.t_batch_grads[group]
        return sum(
            self.blocks[i].cross(self.batch_grads[i]) for i in self.groups[group])


def damped_gram_solve(gram: Tensor, rhs: Tensor, damping: float) -> Tensor:
    """Return ``(delta I + V^T V)^{-1} rhs`` ``(M, K)`` by a Cholesky factor.

    Args:
        gram: ``V^T V``, ``(M, M)``.
        rhs: Shape ``(M, K)``.
        damping: ``delta > 0``.
    """
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    return torch.cholesky_solve(rhs, torch.linalg.cholesky(gram + damping * eye))
