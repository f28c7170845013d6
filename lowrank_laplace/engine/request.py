"""What one pass collects: a :class:`Request`, and the :class:`Collector` that serves it.

Shapes: ``N`` batch size, ``M`` columns of ``V``, ``D_g`` parameters of a group, ``K`` vectors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import Tensor

from lowrank_laplace.factor.blocks import Block


@dataclass(frozen=True)
class Request:
    """What one pass collects besides the loss, the outputs and the gradient.

    Per-group fields hold one entry (or ``None``) per group; results go to the
    :class:`~lowrank_laplace.factor.GGNFactor` field named.

    Attributes:
        keep_blocks: Keep the blocks of ``V`` (``False``: free each once consumed).
        compute_grams: Accumulate each group's Gram matrix (``grams``).
        batch_grad: Also compute per-sample gradients (``batch_grads``).
        cross_batch_grads: Accumulate ``V^T [g_1, ..., g_N]`` instead (``t_batch_grads``).
        compute_diag: Accumulate the GGN diagonal (``diagonals``).
        project: Per group ``y`` ``(M, K)``: form ``V y`` (``projected``).
        t_project: Per group ``x`` ``(D_g, K)`` or a list of them: ``V^T x`` (``t_projected``).
        project_into: Per group ``(out (D_g, K), y (M, K))``: ``out += V y`` in place.
        gradient: Also return the mini-batch gradient (``grad``; free except with hooks).

    Raises:
        ValueError: For nothing to return, or ``cross_batch_grads`` without ``batch_grad``.
    """

    keep_blocks: bool = True
    compute_grams: bool = False
    batch_grad: bool = False
    cross_batch_grads: bool = False
    compute_diag: bool = False
    project: Optional[Sequence[Optional[Tensor]]] = None
    t_project: Optional[Sequence[Any]] = None
    project_into: Optional[Sequence[Optional[Tuple[Tensor, Tensor]]]] = None
    gradient: bool = True

    def __post_init__(self):
        if not (self.keep_blocks or self.compute_grams or self.project is not None
                or self.t_project is not None or self.project_into is not None):
            raise ValueError("Request keep_blocks, compute_grams and/or project.")
        if self.cross_batch_grads and not self.batch_grad:
            raise ValueError("cross_batch_grads needs batch_grad=True.")

    def check_groups(self, num_groups: int) -> None:
        """Refuse (``ValueError``) a per-group argument without ``num_groups`` entries."""
        for name in ("project", "t_project", "project_into"):
            value = getattr(self, name)
            if value is not None and len(value) != num_groups:
                raise ValueError(f"{name} needs one entry per group ({num_groups}), "
                                 f"got {len(value)}.")


class Collector:
    """Hands each block of ``V`` to the consumers a request asks for; what is not kept is freed.

    ``groups`` holds the parameter indices per group, ``sizes`` the entries of every parameter.
    """

    def __init__(self, groups: List[List[int]], request: Request, sizes: List[int]):
        self.groups, self.request = groups, request
        self.group_of = {i: g for g, members in enumerate(groups) for i in members}
        self.batch_grad = request.batch_grad
        # the per-group products split per parameter: V^T x parts, (out part, y)
        self.t_parts: Dict[int, List[Tensor]] = {}
        self.t_listed: Dict[int, bool] = {}
        self.into: Dict[int, Tuple[Tensor, Tensor]] = {}
        for g, members in enumerate(groups):
            split = [sizes[i] for i in members]
            if request.t_project is not None and request.t_project[g] is not None:
                mats = request.t_project[g]
                self.t_listed[g] = not isinstance(mats, Tensor)
                parts = [m.split(split) for m in (mats if self.t_listed[g] else [mats])]
                for j, i in enumerate(members):
                    self.t_parts[i] = [p[j] for p in parts]
            if request.project_into is not None and request.project_into[g] is not None:
                out, y = request.project_into[g]
                self.into.update((i, (part, y)) for i, part in zip(members, out.split(split)))
        self.grams: List[Optional[Tensor]] = [None] * len(groups)
        self.kept: Dict[int, Block] = {}
        self.batch_grads: Dict[int, Block] = {}
        self.projected: Dict[int, Tensor] = {}
        self.t_projected: Dict[int, List[Tensor]] = {}
        self.t_batch: Dict[int, Tensor] = {}
        self.diagonals: Dict[int, Tensor] = {}
        self.done: set = set()

    def add(self, i: int, block: Block, grads: Optional[Block] = None) -> None:
        """Consume parameter ``i``'s block ``(M, d)`` (and per-sample ``grads`` ``(N, d)``)."""
        g, request = self.group_of[i], self.request
        self.done.add(i)
        if request.compute_grams:
            gram = block.gram()
            self.grams[g] = gram if self.grams[g] is None else self.grams[g] + gram
        if request.keep_blocks:
            self.kept[i] = block
        if request.project is not None and request.project[g] is not None:
            self.projected[i] = block.matmul(request.project[g])
        if request.compute_diag:
            self.diagonals[i] = block.diag_outer()
        if i in self.into:
            block.matmul_add_(*self.into[i])
        if i in self.t_parts:
            parts = [block.t_matmul(x) for x in self.t_parts[i]]
            acc = self.t_projected.get(g)
            self.t_projected[g] = parts if acc is None else [a + b for a, b in zip(acc, parts)]
        if request.batch_grad:
            if request.cross_batch_grads:
                part = block.cross(grads)
                self.t_batch[g] = part if g not in self.t_batch else self.t_batch[g] + part
            else:
                self.batch_grads[i] = grads

    def missing(self) -> List[int]:
        """Parameter indices of the groups that received no block."""
        return [i for i in self.group_of if i not in self.done]

    def t_projections(self) -> Dict[int, Any]:
        """``V^T x`` per group: a matrix, or a list where a list was requested."""
        return {g: v if self.t_listed[g] else v[0] for g, v in self.t_projected.items()}
