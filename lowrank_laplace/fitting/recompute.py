"""A micro-batch's GGN factor for low-memory fits: recomputed by passes instead of kept."""

from __future__ import annotations

from typing import Any, List, Optional

from torch import Tensor

from lowrank_laplace.engine import RNGReplay
from lowrank_laplace.utils.batches import batch_device


class RecomputedFactor:
    """What a solver asks of a ``GGNFactor`` (one group), with one block of ``V`` alive.

    Construction runs one backward pass for the Gram matrix, diagonal and the products
    ``V^T x`` with the solver's ``projection_targets``; each ``V y`` recomputes ``V`` in
    another pass with the same random draws.

    Args:
        engine: The fit's engine.
        inputs: The micro-batch's inputs.
        targets: Its targets.
        mc_samples: ``0`` or MC samples per data point.
        subsampling: Curvature sample indices or ``None``.
        targets_x: The matrices ``x`` whose ``V^T x`` the solver will ask for.
        diagonal: Also accumulate the GGN diagonal.
        gram: Accumulate the Gram matrix (else the trace comes from the diagonal).
    """

    #: Products with ``V`` recompute it.
    recomputed = True

    def __init__(self, engine: Any, inputs: Any, targets: Tensor,
                 mc_samples: int, subsampling: Optional[List[int]],
                 targets_x: List[Tensor], diagonal: bool, gram: bool = True):
        self._engine, self._gram = engine, gram
        self._args = (inputs, targets, mc_samples, subsampling)
        self._replay = RNGReplay(batch_device(inputs))
        first = engine.compute(*self._args, keep_blocks=False, compute_grams=gram,
                               compute_diag=diagonal or not gram,
                               t_project=[list(targets_x)] if targets_x else None)
        self._replay.mark()
        self._products = list(zip(targets_x, first.t_projected.get(0, [])))
        self.first, self.loss, self.outputs = first, first.loss, first.outputs
        self.num_columns, self.num_curv_samples = first.num_columns, first.num_curv_samples

    def group_dim(self, group: int = 0) -> int:
        """Parameters ``D``."""
        return self.first.group_dim(group)

    def gram(self, group: int = 0) -> Tensor:
        """``V^T V`` from the first pass."""
        return self.first.gram(group)

    def diag(self, group: int = 0) -> Tensor:
        """The GGN diagonal from the first pass."""
        return self.first.diag(group)

    def trace(self, group: int = 0) -> Tensor:
        """The exact trace (from the Gram matrix, else from the diagonal)."""
        return self.first.trace(group) if self._gram else self.first.diag(group).sum()

    def t_matmul(self, x: Tensor, group: int = 0) -> Tensor:
        """``V^T x`` for one of the matrices given before the first pass.

        Raises:
            RuntimeError: For any other matrix.
        """
        for target, product in self._products:
            if target is x:
                return product
        raise RuntimeError("RecomputedFactor: V^T x is only available for the merge's "
                           "projection targets given before the pass.")

    def matmul_add_(self, out: Tensor, y: Tensor, group: int = 0) -> Tensor:
        """``out += V y`` by another backward pass (same random draws)."""
        with self._replay:
            self._engine.compute(*self._args, keep_blocks=False, project_into=[(out, y)])
        return out

    def matmul(self, y: Tensor, group: int = 0) -> Tensor:
        """``V y`` by another backward pass."""
        out = y.new_zeros(self.group_dim(group), y.shape[1])
        return self.matmul_add_(out, y, group)
