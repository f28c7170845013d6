r"""The GGN factor ``V`` of a mini-batch and the products and Gram matrices it offers.

The generalized Gauss-Newton matrix of a loss :math:`L(\theta) = \rho \sum_n
\ell_n(f(x_n, \theta), y_n)` (``rho = 1/N`` for ``reduction='mean'``, ``1`` for
``'sum'``) factorises as

.. math::
    G = \rho \sum_n J_n^\top \nabla_f^2 \ell_n J_n = V V^\top, \qquad
    V = \sqrt{\rho}\,[v_{11}, \dots, v_{NC}], \quad v_{nc} = J_n^\top s_{nc},

with :math:`\nabla_f^2 \ell_n = \sum_c s_{nc} s_{nc}^\top` (exact) or a
Monte-Carlo estimate with ``M`` sampled vectors instead of ``C``.
:class:`GGNFactor` holds ``V`` per parameter (weights of ``nn.Linear`` layers as
:class:`~lowrank_laplace.factor.blocks.KronBlock`, never expanded); it is computed by
:class:`~lowrank_laplace.engine.FactorEngine` (one BackPACK backward pass, or vmapped
torch.func vector-Jacobian products).

Shape glossary:
    N: batch size; N_S: number of curvature samples (``len(subsampling)`` or N).
    C: model outputs; M: columns of ``V`` (``C * N_S`` exact, ``mc_samples * N_S``).
    D: number of parameters of a group.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lowrank_laplace.factor.blocks import Block, Weight


@dataclass
class GGNFactor:
    r"""The GGN factor ``V`` of one mini-batch, split into parameter groups.

    Attributes:
        groups: Parameter indices (into ``list(model.parameters())``) per group.
        shapes: Shape of every parameter (indexed like the model's parameters).
        blocks: Kept blocks of ``V^T`` per parameter index (may be empty when only
            Gram matrices were requested).
        grams: Gram matrices ``V^T V`` per group accumulated during the backward
            pass (``None`` entries where not requested).
        num_vectors: Vectors per sample (``C`` exact, ``C - 1`` for exact
            cross-entropy, ``mc_samples`` for MC).
        num_curv_samples: Number of samples in the curvature (``N_S``).
        sample_scale: ``G_n = sample_scale * sum_c v_{nc} v_{nc}^T`` is the
            per-sample GGN of the sample's own loss ``l_n`` (``N_S`` for mean,
            ``1`` for sum reduction).
        grad: Flat mini-batch gradient per parameter index (if requested).
        batch_grads: Blocks of per-sample gradients of ``rho * l_n`` (if requested).
        num_samples: Batch size ``N``.
        reduction: The loss reduction, ``'mean'`` or ``'sum'``.
        loss: The mini-batch loss (detached).
        outputs: The model outputs on the batch (detached), shape ``(N, C)``.
        projected: ``V y`` restricted to each parameter for the matrices ``y`` given
            to :meth:`FactorEngine.compute` as ``project`` (``(d, K)`` per index).
        t_projected: ``V^T x`` per group for the matrices ``x`` given as
            ``t_project`` (``(M, K)`` per group index).
        t_batch_grads: ``V^T [g_1, ..., g_N]`` per group accumulated in the pass
            (``cross_batch_grads``), shape ``(M, N)``.
        diagonals: GGN diagonal per parameter index accumulated in the pass
            (``compute_diag``).
        backend: The backend that computed ``V`` (``'backpack'``, ``'hooks'`` or ``'functorch'``).
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
        """Number of columns ``M`` of ``V``."""
        return self.num_vectors * self.num_curv_samples

    def group_dim(self, group: int = 0) -> int:
        """Number of parameters ``D`` in a group.

        Args:
            group: Group index.

        Returns:
            The dimension of the group's parameter space.
        """
        return sum(self.shapes[i].numel() for i in self.groups[group])

    def projected_flat(self, group: int = 0) -> Tensor:
        """``V y`` of a group from the projection pass, flat over its parameters.

        Args:
            group: Group index.

        Returns:
            Tensor of shape ``(D, K)``.

        Raises:
            RuntimeError: If the group was not projected.
        """
        try:
            return torch.cat([self.projected[i] for i in self.groups[group]], dim=0)
        except KeyError as err:
            raise RuntimeError("This group was not projected (see compute(project=...)).") \
                from err

    def split_flat(self, x: Tensor, group: int = 0) -> List[Tensor]:
        """Split a flat ``(D, K)`` matrix over a group into its parameters' rows (views)."""
        sizes = [self.shapes[i].numel() for i in self.groups[group]]
        return list(torch.split(x, sizes, dim=0))

    def group_blocks(self, group: int = 0) -> List[Block]:
        """The kept blocks of a group's parameters, in order.

        Raises:
            RuntimeError: If ``V`` was computed without keeping its blocks.
        """
        try:
            return [self.blocks[i] for i in self.groups[group]]
        except KeyError as err:
            raise RuntimeError(
                "V was not kept for this group (it was computed with keep_blocks=False)."
            ) from err

    def take_samples(self, start: int, stop: int) -> "GGNFactor":
        """The factor of curvature samples ``start:stop`` (blocks only).

        Lets one backward pass feed several merges: a streaming fit computes ``V`` for
        as many samples as fit the memory budget and merges them in the pieces its
        cost model prefers. Gram matrices, gradients and products are not carried
        over; ``loss`` stays with the whole pass (zero here).

        Args:
            start: First curvature sample.
            stop: One past the last one.

        Returns:
            The factor of ``stop - start`` curvature samples.
        """
        blocks = {i: b.take_samples(start, stop, self.num_vectors)
                  for i, b in self.blocks.items()}
        return replace(
            self, blocks=blocks, grams=[], grad={}, batch_grads={}, projected={},
            t_projected={}, t_batch_grads={}, diagonals={}, outputs=None,
            num_curv_samples=stop - start, num_samples=stop - start,
            loss=torch.zeros_like(self.loss),
        )

    def gram(self, group: int = 0) -> Tensor:
        """Return the Gram matrix ``V^T V`` of a group, shape ``(M, M)`` (computed once).

        Args:
            group: Group index.

        Returns:
            The Gram matrix.
        """
        if len(self.grams) > group and self.grams[group] is not None:
            return self.grams[group]
        gram = sum(b.gram() for b in self.group_blocks(group))
        # kept, so the exact trace (its diagonal) and later calls cost nothing more
        self.grams.extend([None] * (group + 1 - len(self.grams)))
        self.grams[group] = gram
        return gram

    def trace(self, group: int = 0) -> Tensor:
        """Return the exact GGN trace ``tr(V V^T) = tr(V^T V)`` of a group.

        Args:
            group: Group index.

        Returns:
            Scalar tensor.
        """
        if len(self.grams) > group and self.grams[group] is not None:
            return self.grams[group].diagonal().sum()
        return sum(b.row_sq_norms().sum() for b in self.group_blocks(group))

    def weighted_gram(self, weights: Sequence[Weight], group: int = 0) -> Tensor:
        """Return ``V^T diag(w) V`` with one weight (scalar or ``(d,)``) per parameter.

        Args:
            weights: Weights for the group's parameters, in group order.
            group: Group index.

        Returns:
            Tensor of shape ``(M, M)``.
        """
        return sum(b.weighted_gram(w) for b, w in zip(self.group_blocks(group), weights))

    def sample_gram(self, weights: Sequence[Weight], group: int = 0) -> Tensor:
        """Per-sample blocks of ``V^T diag(w) V``: ``(N_S, V, V)`` for vectors ``V``.

        Args:
            weights: Weights for the group's parameters, in group order.
            group: Group index.

        Returns:
            Tensor of shape ``(N_S, num_vectors, num_vectors)``.
        """
        return sum(
            b.sample_gram(self.num_vectors, w) for b, w in zip(self.group_blocks(group), weights)
        )

    def diag(self, group: int = 0) -> Tensor:
        """Return the exact diagonal of ``G = V V^T`` over the group, shape ``(D,)``.

        Args:
            group: Group index.

        Returns:
            The GGN diagonal (linear-layer blocks stay factored).
        """
        if self.diagonals and all(i in self.diagonals for i in self.groups[group]):
            return torch.cat([self.diagonals[i] for i in self.groups[group]])
        return torch.cat([b.diag_outer() for b in self.group_blocks(group)])

    def t_matmul(self, x: Tensor, group: int = 0) -> Tensor:
        """Return ``V^T x``.

        Args:
            x: Flat vectors over the group's parameters, shape ``(D, K)``.
            group: Group index.

        Returns:
            Tensor of shape ``(M, K)``.
        """
        parts = self.split_flat(x, group)
        return sum(b.t_matmul(p) for b, p in zip(self.group_blocks(group), parts))

    def matmul(self, y: Tensor, group: int = 0) -> Tensor:
        """Return ``V y`` as flat vectors over the group's parameters.

        Args:
            y: Tensor of shape ``(M, K)``.
            group: Group index.

        Returns:
            Tensor of shape ``(D, K)``.
        """
        out = y.new_zeros(self.group_dim(group), y.shape[1])
        return self.matmul_add_(out, y, group)

    def matmul_add_(self, out: Tensor, y: Tensor, group: int = 0) -> Tensor:
        """Accumulate ``out += V y`` in place, one parameter slice at a time.

        Avoids materialising ``V y`` next to ``out`` (both ``D x K``).

        Args:
            out: Tensor of shape ``(D, K)``, updated in place.
            y: Tensor of shape ``(M, K)``.
            group: Group index.

        Returns:
            ``out``.
        """
        for block, part in zip(self.group_blocks(group), self.split_flat(out, group)):
            block.matmul_add_(part, y)
        return out

    def block_slices(self, x: Tensor, group: int = 0) -> List[Tuple[int, Block, Tensor]]:
        """Each block of a group with its rows of a flat matrix over the group.

        Args:
            x: Tensor of shape ``(D, K)``.
            group: Group index.

        Returns:
            ``(parameter index, block, slice of x)`` per parameter of the group; the
            slices are views of ``x``.
        """
        return list(zip(self.groups[group], self.group_blocks(group), self.split_flat(x, group)))

    def matvec(self, x: Tensor, group: int = 0) -> Tensor:
        """Return the GGN-vector products ``G x = V (V^T x)``.

        Args:
            x: Tensor of shape ``(D, K)``.
            group: Group index.

        Returns:
            Tensor of shape ``(D, K)``.
        """
        return self.matmul(self.t_matmul(x, group), group)

    def grad_dtype(self) -> torch.dtype:
        """The dtype of the model's parameters."""
        return next(iter(self.grad.values())).dtype

    def grad_device(self) -> torch.device:
        """The device of the model's parameters."""
        return next(iter(self.grad.values())).device

    def grad_flat(self, group: int = 0) -> Tensor:
        """Return the mini-batch gradient, flat over the group's parameters.

        Args:
            group: Group index.

        Returns:
            Tensor of shape ``(D,)``.
        """
        return torch.cat([self.grad[i] for i in self.groups[group]])

    def t_matmul_batch_grads(self, group: int = 0) -> Tensor:
        """Return ``V^T [g_1, ..., g_N]`` with the per-sample gradients of ``rho l_n``.

        Args:
            group: Group index.

        Returns:
            Tensor of shape ``(M, N)``.
        """
        if group in self.t_batch_grads:
            return self.t_batch_grads[group]
        return sum(
            self.blocks[i].cross(self.batch_grads[i]) for i in self.groups[group]
        )


def damped_gram_solve(gram: Tensor, rhs: Tensor, damping: float) -> Tensor:
    """``(delta I + V^T V)^{-1} rhs`` by a Cholesky factor of the damped Gram matrix.

    Args:
        gram: ``V^T V``, shape ``(M, M)``.
        rhs: Shape ``(M, K)``.
        damping: ``delta > 0``.

    Returns:
        Tensor of shape ``(M, K)``.
    """
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    return torch.cholesky_solve(rhs, torch.linalg.cholesky(gram + damping * eye))
