"""The options of a fit, validated once in one frozen record read by every step.

laplace-torch's classes extend it (``LowRankOptions``); tuning constants users do not
decide live next to the code that reads them.
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
#: Seeds lie in ``[-SEED_LIMIT, SEED_LIMIT)``: a seed plus the offsets the passes add (per
#: batch, sample and process) stays a valid ``torch.Generator`` seed (64 bits).
SEED_LIMIT = 2**63


class SolverKind(Choice):
    """How the batches' factors become the leading eigenpairs (the ``solver`` option)."""

    AUTO = "auto"
    STREAMING = "streaming"
    SKETCH = "sketch"


def check_count(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    """Refuse option ``name``'s ``value`` unless an integer ``>= minimum`` or an allowed ``None``.

    Raises:
        ValueError: For any other value.
    """
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not value.is_integer()) or value < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"{name} must be a {kind} integer, got {value!r}.")


@dataclass(frozen=True)
class FitConfig:
    r"""The options of a fit, validated and normalised when the record is made.

    Attributes:
        rank: Leading GGN eigenpairs kept; exact whenever the GGN's rank fits.
        mc_samples: ``0`` for the exact GGN, ``M >= 1`` sampled outputs per sample.
        subsample_fraction: Curvature from this random fraction of every batch (unbiased).
        memory_budget: What one micro-batch's ``V`` may take (see ``resolve_memory_budget``).
        micro_batch_size: Upper bound on samples per backward pass.
        seed: Seed of sub-sampling, MC draws (plus the process rank) and the sketch, in
            ``[-2**63, 2**63)``.
        low_memory: Never hold a micro-batch's whole ``V``: two backward passes per merge,
            one layer's block at a time (ignored by the dense sum).
        factor_backend: ``"backpack"``, ``"hooks"``, ``"functorch"`` or ``"auto"``.
        solver: ``"auto"`` (``choose_plan``), ``"streaming"`` or ``"sketch"``.
        track_diagonal: Also accumulate the exact GGN diagonal.
        probe_inputs: First training inputs kept for a probe pass after the fit.
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
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or \
                not -SEED_LIMIT <= seed < SEED_LIMIT:
            raise ValueError(
                f"seed must be an integer in [-2**63, 2**63), got {seed!r}: it seeds "
                "torch.Generator (64 bits), and the passes add per-batch offsets to it.")
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
