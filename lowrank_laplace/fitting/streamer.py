"""The batch loop of a fit: loader batches -> micro-batch factors -> the plan's solver."""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from lowrank_laplace.engine.rng import PrivateRNG
from lowrank_laplace.factor import GGNFactor
from lowrank_laplace.fitting.base import Solver
from lowrank_laplace.fitting.config import FitConfig
from lowrank_laplace.fitting.loader import target_energy
from lowrank_laplace.fitting.plan import FitPlan, equal_parts
from lowrank_laplace.fitting.recompute import RecomputedFactor
from lowrank_laplace.fitting.streaming import concat_factors
from lowrank_laplace.utils.batches import take


class BatchStreamer:
    """Streams loader batches, in micro-batches, into the plan's solver in merges.

    Args:
        engine: The fit's ``FactorEngine``.
        plan: The fit's plan.
        config: The fit's options.
        solver: The solver that receives the factors.
        scale: Factor on every batch's GGN (the likelihood's Hessian scale).
        seed: Seed of the private streams (sub-sampling, MC draws).
        device: The fit's device.

    Attributes:
        tap: Also given every merge the solver gets, with its scale (``None``: nothing).
        rng: The private stream of the MC draws (a probe's draws continue it).
        n_outputs: Model outputs ``C`` (known after the first batch).
        target_energy: The streamed targets' squares summed, float64
            (:func:`~lowrank_laplace.fitting.loader.target_energy`).
    """

    def __init__(self, engine: Any, plan: FitPlan, config: FitConfig, solver: Solver,
                 scale: float, seed: int, device: torch.device):
        self.engine, self.plan, self.config = engine, plan, config
        self.solver, self.scale = solver, scale
        self.generator = torch.Generator().manual_seed(seed)  # sub-sampling
        self.rng = PrivateRNG(seed, device)  # MC draws
        self.n_outputs: Optional[int] = None
        self.target_energy = torch.zeros((), dtype=torch.float64, device=device)
        self.pending: List[GGNFactor] = []
        self.pending_scales: List[float] = []
        self.queued: List[Tuple[GGNFactor, float]] = []  # passes not yet merged or pending
        self.tap: Optional[Callable[[Any, float], None]] = None

    def add(self, X: Any, y: Tensor) -> Tensor:
        """Stream one batch ``(X, y)`` (on the fit's device); return its loss times ``scale``.

        A pass's factor is merged before the next pass is computed, which may then reuse
        its buffers.
        """
        plan, config, solver = self.plan, self.config, self.solver
        micro = equal_parts(len(y), plan.micro)  # 128 in passes of <= 38: four of 32
        self.target_energy += target_energy(y)
        loss = 0.0
        for start in range(0, len(y), micro):  # tensor or dict batches
            Xc, yc = take(X, slice(start, start + micro), len(y)), y[start:start + micro]
            sub, sub_scale = subsample_indices(len(yc), config.subsample_fraction,
                                               self.generator)
            for merge in self._merges(len(yc) if sub is None else len(sub)):
                if self.tap is not None:
                    self.tap(merge, self.scale)
                solver.add_factor(merge, scale=self.scale)
            merge = None
            with self.rng:
                if plan.low_memory:  # one merge per micro-batch, V recomputed
                    batch = RecomputedFactor(self.engine, Xc, yc, config.mc_samples, sub,
                                             solver.projection_targets(),
                                             config.track_diagonal,
                                             gram=plan.path != "sketch")
                    solver.add_factor(batch, scale=self.scale * sub_scale)
                else:
                    batch = self.engine.compute(Xc, yc, mc_samples=config.mc_samples,
                                                subsampling=sub, gradient=False)
            loss = loss + self.scale * batch.loss
            self.n_outputs = batch.outputs.shape[-1]
            if not plan.low_memory:
                self.queued.append((batch, sub_scale))
            batch = None
        return loss

    def _merges(self, samples: Optional[int]) -> Iterator[GGNFactor]:
        """The merges due before a pass of ``samples`` (``None``: no more passes).

        A merge never straddles passes (that would copy blocks twice); a larger pass is
        streamed in equal pieces, or whole by the linear sketch and dense sum.
        """
        chunk = self.plan.chunk
        while self.queued:
            batch, scale = self.queued.pop(0)
            total = batch.num_curv_samples
            if total > chunk and self.plan.path == "streaming":
                size = equal_parts(total, chunk)
                for start in range(0, total, size):
                    yield concat_factors(
                        [batch.take_samples(start, min(total, start + size))], [scale])
                continue
            self.pending.append(batch)
            self.pending_scales.append(scale)
        pending = sum(f.num_curv_samples for f in self.pending)
        if self.pending and (samples is None or pending + samples > chunk):
            yield self._take_pending()

    def _take_pending(self) -> GGNFactor:
        """The pending micro-batch factors as one, the queue emptied."""
        merged = concat_factors(self.pending, self.pending_scales)
        self.pending, self.pending_scales = [], []
        return merged

    def flush(self) -> None:
        """Merge the queued and pending factors."""
        for merge in self._merges(None):
            if self.tap is not None:
                self.tap(merge, self.scale)
            self.solver.add_factor(merge, scale=self.scale)


def subsample_indices(n: int, fraction: Optional[float], generator: torch.Generator
                      ) -> Tuple[Optional[List[int]], float]:
    """Return a random curvature sub-sample and its factor, ``(indices or None, n / len(indices))``.

    Args:
        n: Samples in the micro-batch.
        fraction: ``subsample_fraction`` (``None`` or 1: all).
        generator: The fit's private generator.
    """
    if fraction is None or fraction == 1:
        return None, 1.0
    k = max(1, round(fraction * n))
    # the generator lives on the CPU whatever torch.set_default_device says
    return torch.randperm(n, generator=generator, device="cpu")[:k].tolist(), n / k
