"""GGN-matrix products over a training loader: one pass each, through the fit's batch loop.

Each pass streams the loader as a fit does (:class:`~lowrank_laplace.fitting.fit.LoaderFit`:
its engine, plan, micro-batches, seeds and low-memory recomputation) into a
:class:`ProductSink` instead of a solver. Every fresh pass must reproduce the fitted data
(:class:`FittedData`); the first pass's factors serve the later ones while they fit
:data:`CACHE_SHARE` of the memory budget, and where the fit kept its own pass's factors
(``LoaderFit(keep_factors=True)``) no pass reads the data again.

Shape glossary:
    D: parameters; s: vectors multiplied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lowrank_laplace.factor import DenseBlock
from lowrank_laplace.factor.dense_block import SampleConcat
from lowrank_laplace.fitting.base import factor_dtype
from lowrank_laplace.fitting.budget import resolve_memory_budget

#: Relative tolerance on the summed squared targets of a pass over the fitted data (float64
#: sums of non-negative terms in another order agree far closer).
TARGET_RTOL = 1e-9
#: Share of the memory budget the first pass's factors may keep for the later passes.
CACHE_SHARE = 0.5
#: Fewest samples a partial cache keeps (fewer are dropped when the factors overflow it).
MIN_PARTIAL = 256


class OtherDataError(ValueError):
    """A loader's pass does not reproduce the data the posterior was fitted on."""


@dataclass(frozen=True)
class FittedData:
    """What a pass over the fitted data reproduces: its samples, summed loss and targets.

    The loss is laplace-torch's (``la.loss``: summed, times the Hessian factor); the sums
    are unchanged by shuffling, and ``None`` is unknown (a state saved without them) or not
    reproducible (the loss after an online update, whose earlier losses were at other
    parameters).

    Attributes:
        samples: Samples fitted (over all processes).
        loss: The summed loss.
        target_energy: The targets' squares summed, or ``None``.
    """

    samples: int
    loss: Optional[float] = None
    target_energy: Optional[float] = None

    @classmethod
    def of_fit(cls, fit: Any) -> "FittedData":
        """What a pass over a ``FitResult``'s data reproduces (its loss only where reproducible)."""
        return cls(int(fit.n_data), float(fit.loss) if fit.loss_reproducible else None,
                   fit.target_energy)

    def state(self) -> Dict[str, Any]:
        """A plain dict for ``state_dict``."""
        return dict(vars(self))

    @classmethod
    def from_state(cls, state: Optional[Dict[str, Any]]) -> Optional["FittedData"]:
        """Inverse of :meth:`state` (``None`` stays ``None``)."""
        return None if state is None else cls(**state)

    def check(self, seen: "FittedData", group: Any, dtype: torch.dtype,
              device: torch.device) -> None:
        """Refuse a pass (``seen``, this process's share) that is not of the fitted data.

        The loss may differ by rounding (another batching or order): it must agree to
        ``sqrt(eps)`` of the model's ``dtype``, the targets' squares to :data:`TARGET_RTOL`.

        Raises:
            OtherDataError: Naming what differs and the way out.
        """
        if group is not None:
            totals = torch.tensor([seen.samples, seen.loss, seen.target_energy],
                                  dtype=torch.float64, device=device)
            dist.all_reduce(totals, group=group)
            seen = FittedData(int(totals[0]), float(totals[1]), float(totals[2]))
        way_out = ("pass a loader of all the data the posterior was fitted on (after online "
                   "updates, of every fitted loader's data) that gives the same samples on "
                   "every pass: without random augmentation (e.g. the training set with the "
                   "evaluation transform); shuffling is fine.")
        if seen.samples != self.samples:
            raise OtherDataError(
                f"refine_complement: train_loader yields {seen.samples:,} samples where the "
                f"posterior was fitted on {self.samples:,}: {way_out}")
        tol = torch.finfo(dtype).eps ** 0.5
        checked = (("summed squared targets", self.target_energy, seen.target_energy,
                    TARGET_RTOL), ("summed loss", self.loss, seen.loss, tol))
        for what, fitted, now, rtol in checked:
            if fitted is not None and abs(now - fitted) > rtol * max(abs(fitted), abs(now)):
                raise OtherDataError(
                    f"refine_complement: train_loader's {what} is {now:.8g} where the "
                    f"fitted data's was {fitted:.8g} (relative difference "
                    f"{abs(now - fitted) / max(abs(fitted), abs(now)):.2g}, more than "
                    f"{rtol:.2g}), so it does not give the samples the posterior was "
                    f"fitted on (or the model's parameters changed since the fit: refit "
                    f"then): {way_out}")


class FactorCache:
    """The factors of a loader's first pass, kept for the later passes while they fit.

    Args:
        room: Bytes the kept blocks may take.
        partial: Keep the leading factors that fit where not all do, if they hold at least
            :data:`MIN_PARTIAL` samples (else none).

    Attributes:
        kept: The kept factors with their scales, in the pass's order.
        complete: Whether every factor of the pass is kept.
        inputs: The pass's first inputs (as the fit's probe kept them).
    """

    def __init__(self, room: int, partial: bool = False):
        self.room, self.partial, self.complete = room, partial, False
        self.kept: List[Tuple[Any, float]] = []
        self.inputs: List[Any] = []

    def offer(self, factor: Any, scale: float) -> None:
        """Keep a first pass's factor while it fits (a recomputed one never does)."""
        if self.room < 0:
            return
        blocks = getattr(factor, "blocks", None)  # a recomputed factor holds none
        self.room = -1 if blocks is None else \
            self.room - sum(block.nbytes for block in blocks.values())
        if self.room >= 0:
            self.kept.append((factor, scale))
        elif not self.partial or self.samples < MIN_PARTIAL:
            self.kept = []  # overflowed: every pass recomputes its factors

    def close_pass(self) -> None:
        """End the first pass: whether it kept every factor; blocks of several passes made one.

        A kept ``SampleConcat`` is copied into one matrix, a block at a time (its parts are
        freed as it is): the products after the fit read it at every step.
        """
        self.complete = self.room >= 0
        for factor, _ in self.kept:
            for index, block in factor.blocks.items():
                if isinstance(block, SampleConcat):
                    factor.blocks[index] = DenseBlock(block.rows)

    def quadratic_form(self) -> Optional[Callable[[Tensor], Tensor]]:
        """``X -> X H X^T`` of rows ``X`` by the kept factors where all were kept, else ``None``."""
        if not self.complete or not self.kept:
            return None
        dtype = factor_dtype(self.kept[0][0])
        return lambda rows: kept_quadratic_form(rows, self.kept, dtype)

    @property
    def samples(self) -> int:
        """Samples whose factors are kept."""
        return sum(factor.num_samples for factor, _ in self.kept)

    def split(self, samples: int) -> Tuple[List[Tuple[Any, float]], List[Tuple[Any, float]]]:
        """The kept factors of the pass's first ``samples`` samples (its first inputs), the rest's.

        Only the factor the bound crosses is copied (in two); the others are shared.
        """
        first, rest, left = [], [], samples
        for factor, scale in self.kept:
            n = factor.num_samples
            if 0 < left < n:
                first.append((factor.take_samples(0, left), scale))
                rest.append((factor.take_samples(left, n), scale))
            else:
                (first if left >= n else rest).append((factor, scale))
            left -= n
        return first, rest


def kept_products(X: Tensor, factors: List[Tuple[Any, float]], dtype: torch.dtype) -> Tensor:
    """``X H`` of rows ``X`` ``(s, D)`` by kept factors, ``sum scale V V^T``, float64."""
    sink = ProductSink(X.T.to(dtype).contiguous())
    for factor, scale in factors:
        sink.add_factor(factor, scale=scale)
    return sink.out.T.to(torch.float64)


def kept_quadratic_form(X: Tensor, factors: List[Tuple[Any, float]], dtype: torch.dtype
                        ) -> Tensor:
    """``X H X^T`` of rows ``X`` ``(s, D)``: ``sum scale W^T W``, ``W = V^T X^T``; float64."""
    X_t = X.T.to(dtype).contiguous()
    out = torch.zeros(X.shape[0], X.shape[0], dtype=torch.float64, device=X.device)
    for factor, scale in factors:
        W = factor.t_matmul(X_t).to(torch.float64)
        out.addmm_(W.T, W, alpha=scale)
    return out


class ProductSink:
    """Takes a pass's factors where a fit's solver would and sums ``scale * V (V^T X)``.

    Args:
        X_t: ``X^T`` ``(D, s)`` in the factors' dtype (a low-memory pass computes
            ``V^T X`` with it).
        cache: Offered every factor, or ``None``.
    """

    path = "products"

    def __init__(self, X_t: Tensor, cache: Optional[FactorCache] = None):
        self.X_t, self.cache = X_t, cache
        self.out = torch.zeros_like(X_t)
        self.eigenvalues = None  # no solver's progress to show

    def projection_targets(self) -> List[Tensor]:
        """``[X^T]``: what a low-memory pass multiplies ``V^T`` with."""
        return [self.X_t]

    def add_factor(self, factor: Any, group: int = 0, scale: float = 1.0) -> None:
        """Add ``scale * V (V^T X)`` of one factor (kept in the cache where it fits)."""
        if self.cache is not None:
            self.cache.offer(factor, scale)
        factor.matmul_add_(self.out, factor.t_matmul(self.X_t, group) * scale, group)


class GGNProducts:
    """``X -> X H``: the GGN (laplace-torch's scale) times vectors, one pass over the loader each.

    Args:
        run: The open :class:`~lowrank_laplace.fitting.fit.LoaderFit` whose loop streams.
        loader: The training loader.
        fitted: What every fresh pass must reproduce (checked before its product is used).

    Attributes:
        passes: Passes over the loader so far.
    """

    def __init__(self, run: Any, loader: Any, fitted: FittedData):
        self.run, self.loader, self.fitted = run, loader, fitted
        if run.cache is not None and run.cache.complete:  # the fit's own pass: its data
            self.cache = run.cache
        else:
            budget = resolve_memory_budget(run.config.memory_budget, run.device)
            self.cache = FactorCache(int(CACHE_SHARE * budget))
        self.passes = 0

    def __call__(self, X: Tensor) -> Tensor:
        """``X H`` of rows ``X`` ``(s, D)``, float64, summed over the fit's processes."""
        dtype = self.run.params[0].dtype
        if self.cache.complete:
            product = kept_products(X, self.cache.kept, dtype)
        else:
            sink = ProductSink(X.T.to(dtype).contiguous(), self.cache)
            with torch.random.fork_rng(devices=[]):  # a pass's draws leave the caller's stream
                seen = self.run.stream(self.loader, sink)
            self.passes += 1
            self.fitted.check(seen, self.run.group, dtype, X.device)
            self.cache.close_pass()
            product = sink.out.T.to(torch.float64)
        if self.run.group is not None:
            dist.all_reduce(product, group=self.run.group)
        return product
