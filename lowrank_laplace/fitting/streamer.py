"""The batch loop of a fit: loader batches -> micro-batch factors -> the plan's solver.

Shape glossary:
    N: samples of a batch; D: parameters.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple, Union

import torch
from torch import Tensor

from lowrank_laplace.engine.rng import PrivateRNG
from lowrank_laplace.factor import GGNFactor
from lowrank_laplace.fitting.base import Solver
from lowrank_laplace.fitting.plan import FitPlan, equal_parts, make_solver, plan_fit
from lowrank_laplace.fitting.recompute import RecomputedFactor
from lowrank_laplace.fitting.streaming import concat_factors
from lowrank_laplace.utils.batches import take
from lowrank_laplace.utils.linalg import cpu_threads


class BatchStreamer:
    """Streams loader batches into the solver its :class:`FitPlan` names.

    At the first batch the plan is decided (:func:`plan_fit`) and the solver built
    (:func:`make_solver`); neither changes afterwards. Every batch is split into
    micro-batches that fit the memory budget; the curvature sub-samples and
    Monte-Carlo samples come from private streams; groups of micro-batch factors of
    the plan's merge size are merged together (or, with ``low_memory``, every
    micro-batch on its own through a :class:`RecomputedFactor`).

    Args:
        engine: The fit's :class:`~lowrank_laplace.engine.FactorEngine`.
        scale: Factor applied to every batch's GGN (the likelihood's Hessian scale).
        seed: Seed of the private streams (sub-sampling, MC draws, a sketch's test
            matrix).
        device: The fit's device.
        rank: Eigenpairs kept in the end.
        oversampling: Extra eigenpairs (or sketch columns) while fitting.
        mc_samples: ``0`` (exact) or MC samples per data point.
        subsample_fraction: Curvature sub-sampling fraction or ``None``.
        memory_budget: ``memory_budget`` as given by the user.
        micro_batch_size: ``micro_batch_size`` as given by the user.
        track_diagonal: Track the GGN diagonal.
        low_memory: Merge every micro-batch from recomputing passes (dropped when
            the fit sums densely).
        solver: ``"auto"``, ``"streaming"`` or ``"sketch"``, as asked.
        dense_max_dim: See :func:`plan_fit`.
        test_matrix: A sketch's test matrix.
        sketch_seed: Seed of a sketch's test matrix (the same on every process).
        process_group: ``torch.distributed`` group whose processes must take the
            same path (``None``: this process alone).
        wide_sketch: Accumulate a float32 sketch in float64 where it fits (see
            :func:`plan_fit`).
        warm_basis: Directions a sketch chosen by ``solver="auto"`` starts from, ``(D,
            b)`` (see :func:`make_solver`; not for data-parallel fits).

    Attributes:
        plan: The :class:`FitPlan` (``None`` before the first batch).
        solver: The solver that receives the factors (``None`` before it).
    """

    def __init__(self, engine: Any, *, scale: float, seed: int, device: torch.device,
                 rank: int, oversampling: int, mc_samples: int,
                 subsample_fraction: Optional[float], memory_budget: Union[int, float, None],
                 micro_batch_size: Optional[int], track_diagonal: bool, low_memory: bool,
                 solver: str = "streaming", dense_max_dim: Optional[int] = 0,
                 test_matrix: str = "kronecker", sketch_seed: int = 0,
                 process_group: Any = None, wide_sketch: bool = False,
                 warm_basis: Optional[Tensor] = None):
        self.engine, self.scale = engine, scale
        self.rank, self.oversampling = rank, oversampling
        self.mc_samples, self.fraction = mc_samples, subsample_fraction
        self.budget, self.cap = memory_budget, micro_batch_size
        self.track_diagonal, self.low_memory = track_diagonal, low_memory
        self.requested, self.dense_max_dim = solver, dense_max_dim
        self.test_matrix, self.sketch_seed = test_matrix, sketch_seed
        self.group, self.wide_sketch = process_group, wide_sketch
        self.warm_basis = warm_basis
        self.generator = torch.Generator().manual_seed(seed)  # sub-sampling
        self.rng = PrivateRNG(seed, device)  # MC draws
        self.plan: Optional[FitPlan] = None
        self.solver: Optional[Solver] = None
        self.n_outputs: Optional[int] = None
        self.pending: List[GGNFactor] = []
        self.pending_scales: List[float] = []

    @property
    def path(self) -> Optional[str]:
        """The plan's path (``None`` before the first batch)."""
        return None if self.plan is None else self.plan.path

    def _start(self, X: Any, batch_size: int, num_data: int) -> None:
        """Decide the plan and build its solver."""
        keep = self.rank + self.oversampling
        self.plan = plan_fit(
            self.engine, X, batch_size=batch_size, num_data=num_data, keep=keep,
            mc_samples=self.mc_samples, subsample_fraction=self.fraction,
            memory_budget=self.budget, micro_batch_size=self.cap,
            low_memory=self.low_memory, solver=self.requested,
            dense_max_dim=self.dense_max_dim, process_group=self.group, rank=self.rank,
            wide_sketch=self.wide_sketch,
        )
        params = [p for p in self.engine.model.parameters() if p.requires_grad]
        warm = self.warm_basis if self.requested == "auto" and self.group is None else None
        self.solver = make_solver(self.plan, self.rank, self.oversampling, self.track_diagonal,
                                  self.sketch_seed, self.test_matrix, params[0],
                                  [p.shape for p in params], basis=warm)

    def add(self, X: Any, y: Tensor, num_data: int) -> Tensor:
        """Stream one batch; returns its scaled loss.

        Args:
            X: Inputs of the batch (on the fit's device).
            y: Targets.
            num_data: Samples this process streams (for the plan).

        Returns:
            The batch's loss times ``scale``.
        """
        if self.plan is None:
            self._start(X, len(y), num_data)
        with cpu_threads(self.plan.batch_threads()):
            return self._add(X, y)

    def _add(self, X: Any, y: Tensor) -> Tensor:
        plan = self.plan
        micro = equal_parts(len(y), plan.micro)  # 128 in passes of <= 38: four of 32
        loss = 0.0
        for start in range(0, len(y), micro):  # tensor or dict batches
            Xc, yc = take(X, slice(start, start + micro), len(y)), y[start:start + micro]
            sub, sub_scale = subsample_indices(len(yc), self.fraction, self.generator)
            with self.rng:
                if plan.low_memory:  # one merge per micro-batch, V recomputed
                    batch = RecomputedFactor(self.engine, Xc, yc, self.mc_samples, sub,
                                             self.solver.projection_targets(),
                                             self.track_diagonal,
                                             gram=plan.path != "sketch")
                    self.solver.add_factor(batch, scale=self.scale * sub_scale)
                else:
                    batch = self.engine.compute(Xc, yc, mc_samples=self.mc_samples,
                                                subsampling=sub, gradient=False)
            loss = loss + self.scale * batch.loss
            self.n_outputs = batch.outputs.shape[-1]
            if not plan.low_memory:
                self._queue(batch, sub_scale, plan.chunk)
        return loss

    def _queue(self, batch: GGNFactor, sub_scale: float, chunk: int) -> None:
        """Queue a pass's factor; merge whole passes of up to ``chunk`` samples.

        A merge never straddles passes: a pass that does not fit the pending merge
        flushes it first, and a pass larger than ``chunk`` is merged in equal pieces
        (:meth:`~lowrank_laplace.factor.GGNFactor.take_samples`), or whole by sketches
        and dense sums, which are linear in their factors. Merging a pass's tail with
        the next pass's head would copy the split pass's blocks and then the
        concatenated merge.
        """
        total = batch.num_curv_samples
        pending = sum(f.num_curv_samples for f in self.pending)
        if self.pending and pending + total > chunk:
            self.flush()
            pending = 0
        if total > chunk and self.plan.path == "streaming":
            size = equal_parts(total, chunk)
            for start in range(0, total, size):
                self.pending.append(batch.take_samples(start, min(total, start + size)))
                self.pending_scales.append(sub_scale)
                self.flush()
            return
        self.pending.append(batch)
        self.pending_scales.append(sub_scale)
        if pending + total >= chunk:
            self.flush()

    def flush(self) -> None:
        """Merge the pending micro-batch factors as one."""
        if self.pending:
            with cpu_threads(self.plan.batch_threads()):
                self.solver.add_factor(concat_factors(self.pending, self.pending_scales),
                                       scale=self.scale)
            self.pending.clear()
            self.pending_scales.clear()


def subsample_indices(n: int, fraction: Optional[float], generator: torch.Generator
                      ) -> Tuple[Optional[List[int]], float]:
    """Random curvature sub-sample of a micro-batch and the factor that unbiases it.

    Args:
        n: Samples in the micro-batch.
        fraction: ``subsample_fraction`` (``None`` or 1: all samples).
        generator: The fit's private generator.

    Returns:
        ``(indices or None, n / len(indices))``.
    """
    if fraction is None or fraction == 1:
        return None, 1.0
    k = max(1, round(fraction * n))
    # the generator lives on the CPU whatever torch.set_default_device says
    return torch.randperm(n, generator=generator, device="cpu")[:k].tolist(), n / k


