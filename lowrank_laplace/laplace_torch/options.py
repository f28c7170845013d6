"""The options of ``hessian_structure="lowrank_ggn"``, validated once, in one dataclass.

Shape glossary:
    D: Laplace parameters; r: kept rank.
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass, field
from typing import Optional, Union

from lowrank_laplace.engine import check_backend
from lowrank_laplace.posterior.residual import DEFAULT_RESIDUAL, ResidualKind
from lowrank_laplace.utils.batches import parse_memory
from lowrank_laplace.utils.checks import Choice, check_mc_samples

#: Leading eigenpairs kept by default.
DEFAULT_RANK = 100
#: The default of ``dense_max_dim``, read when the options are created.
DEFAULT_DENSE_MAX_DIM = 2048


class SolverKind(Choice):
    """How the batches' factors become the leading eigenpairs (the ``solver`` option)."""

    AUTO = "auto"
    STREAMING = "streaming"
    SKETCH = "sketch"


class SketchTestMatrix(Choice):
    """The sketch's test matrix (the ``sketch_test_matrix`` option)."""

    KRONECKER = "kronecker"
    GAUSSIAN = "gaussian"


#: The fitting algorithms (values of ``solver``).
SOLVERS = tuple(m.value for m in SolverKind)


def _check_count(name: str, value, minimum: int, allow_none: bool = False) -> None:
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
class LowRankOptions:
    r"""What ``hessian_structure="lowrank_ggn"`` adds to laplace-torch's arguments.

    Attributes:
        rank: Number of leading GGN eigenpairs kept (default 100). Exact whenever the
            GGN's rank over the whole training set fits.
        oversampling: Extra eigenpairs kept while streaming (``None``: ``rank // 5``).
        mc_samples: ``0`` for the exact GGN, ``M >= 1`` for a Monte-Carlo GGN with
            ``M`` sampled outputs per sample (classification).
        subsample_fraction: Curvature from this random fraction of every batch
            (rescaled to stay unbiased); ``None`` uses every sample.
        memory_budget: Bytes (or a fraction of free memory) one micro-batch's ``V``
            may take; batches are split automatically. Default: 1 GiB on the CPU, a
            quarter of the free device memory (at least 1 GiB) on CUDA.
        micro_batch_size: Upper bound on samples per backward pass; ``None`` chooses
            it from the memory budget and a cost model of the merge.
        residual: Model of the curvature the rank truncation drops (see
            :mod:`lowrank_laplace.posterior.residual`): ``"spectral"`` (default: a
            power-law tail continuing the kept spectrum, holding the exact dropped
            trace, in random directions of the complement, its variances weighted by
            where inputs' Jacobians fall), ``"isotropic"`` (its mean eigenvalue in
            every dropped direction), ``"diagonal"`` (the exact diagonal of the
            dropped curvature; the fit tracks the GGN diagonal) or ``"none"`` (the
            dropped directions see only the prior). All but ``"diagonal"`` keep
            ``O(r)`` closed forms for a scalar prior.
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
            ``"backpack"`` (one BackPACK backward pass; models of modules it knows),
            ``"hooks"`` (batched backward passes; trainable linear, embedding and norm
            layers behind frozen modules, e.g. LoRA adapters and heads),
            ``"functorch"`` (vmapped torch.func products; any differentiable model)
            or ``"auto"`` (the first of these that takes the model).
        solver: ``"auto"`` (default: a one-pass sketch with ``4 * rank`` columns
            (or ``rank + oversampling`` if more) where the cost model finds it cheaper
            than streaming merges and its ``D x l`` float64 matrix fits a quarter of
            ``memory_budget``, else streaming merges; low-memory
            and data-parallel fits stream), ``"streaming"`` (truncated merges,
            :class:`~lowrank_laplace.fitting.StreamingMerge`) or ``"sketch"``
            (approximate: a one-pass randomized Nyström sketch with ``rank +
            oversampling`` columns, :class:`~lowrank_laplace.fitting.SketchMerge`;
            its eigenvalues under-estimate the GGN's wherever its rank exceeds the
            sketch, by 30% at the 50th of 100 on a digits MLP with the default
            oversampling). All are exact when the GGN's rank over the data fits, and
            none applies when the fit sums densely. Where a single streaming merge
            of all the data's columns fits the merge plan, a sketch takes that
            merge instead: it multiplies ``V`` once where the sketch multiplies it
            twice, and it is the exact truncation. A float32 model's sketch is
            accumulated in float32 and redone in float64 (a second pass over the
            loader) if a kept eigenvalue came within 1,000 times its rounding shift,
            where the float64 matrix fits a quarter of the budget; else it warns.
        dense_max_dim: The fit sums the GGN densely and eigendecomposes it once
            (exact) when the ``D x D`` matrix fits ``memory_budget`` and the cost
            model finds it cheaper than streaming, and also, up to this many
            parameters (typically a last layer), whenever streaming would truncate;
            ``0`` always streams, ``None`` lets the cost model alone decide.
        probe_size: Training inputs (the first the loader yields) on which the fit
            measures the kept eigenvectors' Jacobian energies for the spectral
            residual's weights.
        probe_columns: Random output combinations over the whole probe for those
            energies: each input carries ``ceil(probe_columns / inputs)`` of them
            instead of its ``C`` outputs (an unbiased estimate), or all ``C`` where
            that is not fewer; ``None`` always measures exactly.
        measure_complement: Measure the spectral residual's complement variance on
            the probe (one more pass with all ``C`` outputs over the probe inputs of at
            most 1,024 Jacobian columns that fit half the memory budget, at least 32; see
            :mod:`~lowrank_laplace.posterior.complement`) instead of modelling it
            from the Jacobian energies. Only a scalar prior uses it (layerwise and
            per-parameter priors keep each layer's modelled variance), so a fit under
            another prior (e.g. inside ``marglik_training``) does not measure it.
        sketch_test_matrix: ``"kronecker"`` draws Khatri-Rao columns in the slices of
            matrix-shaped weights, so the factored linear layers' products with it
            come from their Kronecker factors and the slices are kept as those
            factors; ``"gaussian"`` draws every entry Gaussian (see
            :class:`~lowrank_laplace.fitting.SketchMerge`).
        warm_start: A refit of a model whose parameters moved since the last fit of it
            (the same object's, or a live posterior's of the same model, e.g. inside
            ``marglik_training``) starts the sketch that ``solver="auto"`` chooses from
            that fit's eigenvectors, with ``2 * rank`` random columns besides them
            instead of ``4 * rank`` (:mod:`~lowrank_laplace.laplace_torch.warm`).
            ``False``: every fit starts cold.
    """

    rank: int = DEFAULT_RANK
    oversampling: Optional[int] = None
    mc_samples: int = 0
    subsample_fraction: Optional[float] = None
    memory_budget: Union[int, float, str, None] = None
    micro_batch_size: Optional[int] = None
    residual: ResidualKind = ResidualKind(DEFAULT_RESIDUAL)
    seed: int = 0
    low_memory: bool = False
    factor_backend: str = "auto"
    solver: SolverKind = SolverKind.AUTO
    dense_max_dim: Optional[int] = field(default_factory=lambda: DEFAULT_DENSE_MAX_DIM)
    probe_size: int = 256
    probe_columns: Optional[int] = 512
    measure_complement: bool = True
    sketch_test_matrix: SketchTestMatrix = SketchTestMatrix.KRONECKER
    warm_start: bool = True

    def __post_init__(self):
        _check_count("rank", self.rank, 1)
        _check_count("oversampling", self.oversampling, 0, allow_none=True)
        check_mc_samples(self.mc_samples)
        _check_count("micro_batch_size", self.micro_batch_size, 1, allow_none=True)
        _check_count("dense_max_dim", self.dense_max_dim, 0, allow_none=True)
        _check_count("probe_size", self.probe_size, 0)
        _check_count("probe_columns", self.probe_columns, 1, allow_none=True)
        _check_seed(self.seed)
        budget = parse_memory(self.memory_budget)  # refuses nan, inf and 1.5 bytes
        if budget is not None and budget <= 0:
            raise ValueError(f"memory_budget must be positive, got {self.memory_budget!r}.")
        fraction = self.subsample_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"subsample_fraction must lie in (0, 1], got {fraction!r}.")
        oversampling = self.rank // 5 if self.oversampling is None else self.oversampling
        set_ = object.__setattr__  # frozen: normalised once, here
        set_(self, "rank", int(self.rank))
        set_(self, "oversampling", int(oversampling))
        set_(self, "mc_samples", int(self.mc_samples))
        set_(self, "seed", int(self.seed))
        set_(self, "low_memory", bool(self.low_memory))
        set_(self, "measure_complement", bool(self.measure_complement))
        set_(self, "warm_start", bool(self.warm_start))
        set_(self, "residual", ResidualKind.parse(self.residual, "residual"))
        set_(self, "solver", SolverKind.parse(self.solver, "solver"))
        set_(self, "sketch_test_matrix",
             SketchTestMatrix.parse(self.sketch_test_matrix, "sketch_test_matrix"))
        set_(self, "factor_backend", check_backend(self.factor_backend))

    @property
    def track_diagonal(self) -> bool:
        """Whether the fit tracks the GGN diagonal.

        ``residual="diagonal"`` uses it as is; ``"spectral"`` splits its tail over
        layers with it (:mod:`~lowrank_laplace.posterior.layer_tail`).
        """
        return self.residual in (ResidualKind.DIAGONAL, ResidualKind.SPECTRAL)


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
    ResidualKind.parse(residual, "residual")
    if diagonal_correction is None:
        return residual
    alias = "diagonal" if diagonal_correction else "none"
    warnings.warn(
        f"diagonal_correction={diagonal_correction!r} is deprecated: pass "
        f"residual={alias!r} instead.", FutureWarning, stacklevel=5,
    )
    if residual not in (DEFAULT_RESIDUAL, alias):
        raise ValueError(
            f"diagonal_correction={diagonal_correction!r} (residual={alias!r}) contradicts "
            f"residual={residual!r}: pass residual alone."
        )
    return alias
