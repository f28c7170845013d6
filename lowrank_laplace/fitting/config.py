"""The options of a fit over a loader, validated once, in one frozen record.

:class:`FitConfig` is what every step of a fit reads: the plan
(:func:`~lowrank_laplace.fitting.plan.choose_plan`), the batch loop and the solver.
laplace-torch's classes extend it with the posterior's own options
(:class:`~lowrank_laplace.laplace_torch.options.LowRankOptions`) and pass that same
object down. Tuning constants that users do not decide are module constants next to
the code that reads them (e.g. :data:`~lowrank_laplace.fitting.plan.DENSE_MAX_DIM`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional, Union

from lowrank_laplace.engine import check_backend
from lowrank_laplace.utils.batches import parse_memory
from lowrank_laplace.utils.checks import Choice, check_mc_samples

#: Leading eigenpairs kept by default.
DEFAULT_RANK = 100


class SolverKind(Choice):
    """How the batches' factors become the leading eigenpairs (the ``solver`` option)."""

    AUTO = "auto"
    STREAMING = "streaming"
    SKETCH = "sketch"


def check_count(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    """Refuse anything but an integer of at least ``minimum`` (or ``None`` if allowed).

    Args:
        name: The option's name, for the message.
        value: Its value.
        minimum: The smallest value allowed.
        allow_none: Whether ``None`` is allowed.

    Raises:
        ValueError: For any other value.
    """
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            int(value) != value or value < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"{name} must be a {kind} integer, got {value!r}.")


def _check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or \
            not -2**63 <= seed < 2**64:
        raise ValueError(f"seed must be an integer (a torch.Generator seed), got {seed!r}.")


@dataclass(frozen=True)
class FitConfig:
    r"""The options of a fit, validated and normalised when the record is made.

    Attributes:
        rank: Number of leading GGN eigenpairs kept (default 100). Exact whenever the
            GGN's rank over the whole training set fits.
        mc_samples: ``0`` for the exact GGN, ``M >= 1`` for a Monte-Carlo GGN with
            ``M`` sampled outputs per sample (classification).
        subsample_fraction: Curvature from this random fraction of every batch
            (rescaled to stay unbiased); ``None`` uses every sample.
        memory_budget: Bytes (or a fraction of free memory, or a size such as
            ``"2GiB"``) one micro-batch's ``V`` may take; batches are split
            automatically. Default: 1 GiB on the CPU, a quarter of the free device
            memory (at least 1 GiB) on CUDA.
        micro_batch_size: Upper bound on samples per backward pass; ``None`` chooses
            it from the memory budget and a cost model of the merge.
        seed: Seed for curvature sub-sampling, the Monte-Carlo draws of
            ``mc_samples`` (offset by the process rank when fitting data-parallel)
            and the sketch's test matrix; the fit leaves the global random state
            untouched.
        low_memory: Never hold a micro-batch's whole ``V``: each micro-batch is one
            merge computed by two backward passes (Gram matrix, diagonal and
            products with the basis; then the basis update ``V C``), each holding one
            layer's block at a time, so ``memory_budget`` buys larger micro-batches
            for about 1.5 times the backward cost. Ignored when the fit sums densely.
        factor_backend: What computes the GGN factor ``V`` (laplace-torch's
            ``backend`` names its own curvature class, hence another name):
            ``"backpack"``, ``"hooks"``, ``"functorch"`` or ``"auto"`` (the first of
            these that takes the model; see :class:`~lowrank_laplace.engine.FactorEngine`).
        solver: ``"auto"`` (default: a one-pass sketch where the cost model finds it
            cheaper than streaming merges and its float64 matrix fits the budget's
            share, else streaming merges; see
            :func:`~lowrank_laplace.fitting.plan.choose_plan`), ``"streaming"``
            (truncated merges, :class:`~lowrank_laplace.fitting.StreamingMerge`) or
            ``"sketch"`` (a one-pass randomized Nyström sketch,
            :class:`~lowrank_laplace.fitting.SketchMerge`). All are exact when the
            GGN's rank over the data fits, and none applies when the fit sums densely.
        track_diagonal: Also accumulate the exact GGN diagonal (the residual models
            that need it set this).
        probe_inputs: Training inputs (the first the loader yields) the fit keeps for
            a probe pass after it (the residual models that need one set this).
    """

    rank: int = DEFAULT_RANK
    mc_samples: int = 0
    subsample_fraction: Optional[float] = None
    memory_budget: Union[int, float, str, None] = None
    micro_batch_size: Optional[int] = None
    seed: int = 0
    low_memory: bool = False
    factor_backend: str = "auto"
    solver: SolverKind = SolverKind.AUTO
    track_diagonal: bool = False
    probe_inputs: int = 0

    def __post_init__(self):
        check_count("rank", self.rank, 1)
        check_mc_samples(self.mc_samples)
        check_count("micro_batch_size", self.micro_batch_size, 1, allow_none=True)
        check_count("probe_inputs", self.probe_inputs, 0)
        _check_seed(self.seed)
        budget = parse_memory(self.memory_budget)  # refuses nan, inf and 1.5 bytes
        if budget is not None and budget <= 0:
            raise ValueError(f"memory_budget must be positive, got {self.memory_budget!r}.")
        fraction = self.subsample_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"subsample_fraction must lie in (0, 1], got {fraction!r}.")
        set_ = object.__setattr__  # frozen: normalised once, here
        for name in ("rank", "mc_samples", "seed", "probe_inputs"):
            set_(self, name, int(getattr(self, name)))
        set_(self, "low_memory", bool(self.low_memory))
        set_(self, "track_diagonal", bool(self.track_diagonal))
        set_(self, "solver", SolverKind.parse(self.solver, "solver"))
        set_(self, "factor_backend", check_backend(self.factor_backend))
