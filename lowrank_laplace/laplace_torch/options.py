"""The options of ``hessian_structure="lowrank_ggn"``, validated once, in one record.

The laplace-torch classes build :class:`LowRankOptions` once, in their constructor, and
pass this same object down the fit.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, Optional, Tuple, Type

from lowrank_laplace.fitting.config import FitConfig
from lowrank_laplace.laplace_torch import rank as auto_rank
from lowrank_laplace.posterior import probe
from lowrank_laplace.posterior.residual import DEFAULT_RESIDUAL, Residual, residual_class


@dataclass(frozen=True)
class LowRankOptions(FitConfig):
    r"""What ``hessian_structure="lowrank_ggn"`` adds to laplace-torch's arguments.

    The fit's options (:class:`~lowrank_laplace.fitting.config.FitConfig`: ``rank``,
    ``mc_samples``, ``subsample_fraction``, ``memory_budget``, ``micro_batch_size``,
    ``seed``, ``low_memory``, ``factor_backend``, ``solver``) and:

    Attributes:
        rank: Eigenpairs kept, or ``"auto"``: the rank chosen from the data, doubled from
            100 while the probe inputs' predictive variance still moves with it
            (:mod:`~lowrank_laplace.laplace_torch.rank`).
        residual: Model of the curvature the rank truncation drops
            (:mod:`lowrank_laplace.posterior.residual`): ``"spectral"`` (default),
            ``"isotropic"``, ``"diagonal"`` (tracks the GGN diagonal) or ``"none"``.
        warm_start: A refit of this posterior after its parameters moved starts the
            sketch from its last eigenvectors (:mod:`~lowrank_laplace.laplace_torch.warm`);
            ``False``: every fit starts cold.
    """

    residual: str = DEFAULT_RESIDUAL
    warm_start: bool = True
    track_diagonal: bool = field(default=False, init=False)
    probe_inputs: int = field(default=0, init=False)

    def __post_init__(self):
        model = residual_class(self.residual)
        set_ = object.__setattr__  # frozen: derived once, here
        set_(self, "residual", model.name)
        set_(self, "warm_start", bool(self.warm_start))
        set_(self, "track_diagonal", model.tracks_diagonal)
        set_(self, "probe_inputs", probe.PROBE_SIZE if model.needs_probe else 0)
        auto = isinstance(self.rank, str) and self.rank == auto_rank.AUTO
        if auto:  # the rest validated as for the first rank it fits
            set_(self, "rank", auto_rank.AUTO_RANK_START)
        super().__post_init__()
        if auto:
            set_(self, "rank", auto_rank.AUTO)

    def at_rank(self, rank: int) -> "LowRankOptions":
        """These options with an integer rank (what a fit of ``rank="auto"`` runs)."""
        return replace(self, rank=rank)

    @property
    def first_rank(self) -> int:
        """The rank a fit starts with (``AUTO_RANK_START`` for ``rank="auto"``)."""
        return auto_rank.AUTO_RANK_START if self.rank == auto_rank.AUTO else self.rank

    @property
    def residual_model(self) -> Type[Residual]:
        """The residual model's class (:data:`~lowrank_laplace.posterior.RESIDUALS`)."""
        return residual_class(self.residual)


#: The options a user passes (``Laplace(..., rank=...)``), in order.
OPTION_NAMES: Tuple[str, ...] = tuple(f.name for f in fields(LowRankOptions) if f.init)


def split_options(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Take the ``lowrank_ggn`` options out of a constructor's keyword arguments.

    Args:
        kwargs: The keyword arguments (changed: the options are removed).

    Returns:
        The options.
    """
    return {name: kwargs.pop(name) for name in list(kwargs) if name in OPTION_NAMES}


def resolve_residual(residual: str, diagonal_correction: Optional[bool]) -> str:
    """The residual model, honouring the deprecated ``diagonal_correction`` flag.

    Args:
        residual: The ``residual`` argument.
        diagonal_correction: ``None``, or the deprecated flag (``True``:
            ``"diagonal"``, ``False``: ``"none"``).

    Returns:
        The residual model's name.

    Raises:
        ValueError: If the flag contradicts ``residual``.
    """
    model = residual_class(residual)
    if diagonal_correction is None:
        return model.name
    alias = "diagonal" if diagonal_correction else "none"
    warnings.warn(
        f"diagonal_correction={diagonal_correction!r} is deprecated: pass "
        f"residual={alias!r} instead.", FutureWarning, stacklevel=5,
    )
    if model not in (residual_class(DEFAULT_RESIDUAL), residual_class(alias)):
        raise ValueError(
            f"diagonal_correction={diagonal_correction!r} (residual={alias!r}) contradicts "
            f"residual={residual!r}: pass residual alone."
        )
    return alias

