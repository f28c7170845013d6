"""The fit's plan: a pure function of the first batch's sizes and the options.

:func:`measure_sizes` reads the sizes, :func:`choose_plan` makes the frozen :class:`FitPlan`
from the cost model, :func:`make_solver` its solver. Measurements behind the constants:
docs/benchmarks/design_measurements.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from lowrank_laplace.factor import factor_columns
from lowrank_laplace.fitting import cost, sketch
from lowrank_laplace.fitting.base import Solver
from lowrank_laplace.fitting.budget import resolve_memory_budget, samples_that_fit
from lowrank_laplace.fitting.config import FitConfig, SolverKind
from lowrank_laplace.fitting.dense import DenseSum
from lowrank_laplace.fitting.products import CACHE_SHARE
from lowrank_laplace.fitting.sketch import SketchMerge
from lowrank_laplace.fitting.streaming import StreamingMerge
from lowrank_laplace.utils.batches import batch_device

#: Extra eigenpairs kept while streaming, as a share of the rank.
OVERSAMPLING = 0.2
#: Where ``solver="auto"``'s sketch found the spectrum flat, streaming keeps this share of
#: the rank more, at least the next count (docs/benchmarks/posterior_quality.md, "Where the rank
#: keeps under 40%").
FLAT_OVERSAMPLING = 1.0
FLAT_MIN_EXTRA = 64
#: Up to this many parameters the fit sums densely wherever streaming would truncate
#: and the matrix fits; ``0``: never, ``None``: the cost model decides alone.
DENSE_MAX_DIM = 2048
#: Streaming fits run on one CPU thread below these merge ``S D k`` and entries of ``V`` in
#: a pass (sketches, whose products are few and wide, take the idle cores).
SINGLE_THREAD_MERGE_WORK = 2**26
SINGLE_THREAD_PASS_ENTRIES = 2**22
#: Sketch merges span several passes up to this many bytes of ``V``.
SKETCH_MERGE_BYTES = 2**28
#: Below this many parameters per kept eigenpair, merges rotate the basis explicitly.
LAZY_MIN_DIM_PER_EIGENPAIR = 200
#: A float32 sketch that rounded kept eigenvalues is redone in float64 if its float64
#: ``D x l`` takes at most this share of the budget; ``solver="auto"`` sketches within it.
WIDE_SKETCH_SHARE = 0.25
#: ``solver="auto"`` sketches with ``rank * (1 + AUTO_SKETCH_OVERSAMPLING)`` columns
#: (fewer tuned the marglik prior too strong; docs/benchmarks/design_measurements.md)...
AUTO_SKETCH_OVERSAMPLING = 3
#: ...and with ``rank`` plus this share of it, at least the next count, where the fit keeps
#: its factors, whose Rayleigh-Ritz step then makes the kept eigenvalues exact on the
#: sketch's span (docs/benchmarks/design_measurements.md).
RITZ_SKETCH_OVERSAMPLING = 0.5
RITZ_MIN_EXTRA = 50
#: Random columns per rank of a warm-started sketch besides its basis (at most the cold
#: sketch's columns in all).
WARM_SKETCH_OVERSAMPLING = 2


def keep_while_fitting(rank: int, flat: bool = False) -> int:
    """Eigenpairs kept while streaming: ``rank`` plus :data:`OVERSAMPLING` of it.

    On a ``flat`` spectrum :data:`FLAT_OVERSAMPLING` of it, at least :data:`FLAT_MIN_EXTRA`.
    """
    if flat:
        return rank + max(int(rank * FLAT_OVERSAMPLING), FLAT_MIN_EXTRA)
    return rank + int(rank * OVERSAMPLING)


@dataclass(frozen=True)
class FitSizes:
    """What the first batch tells a plan.

    Attributes:
        dim: Parameters ``D``.
        gram_dim: ``D_gram`` (see :mod:`~lowrank_laplace.fitting.cost`).
        columns: Columns of ``V`` per curvature sample.
        vector_bytes: Bytes of one column of one sample's ``V`` in a pass.
        block_bytes: The same for a pass holding one block at a time.
        itemsize: Bytes per parameter entry.
        batch_size: Samples of the loader's batches.
        num_data: Samples this process streams.
        budget: The memory budget in bytes.
        device: ``"cpu"``, ``"cuda"``, ...
        float64: Whether the parameters are float64.
        grouped: A data-parallel fit.
        cached: The fit keeps its pass's factors for products after it (a sketch then
            refines its eigenpairs by Rayleigh-Ritz on them).
    """

    dim: int
    gram_dim: int
    columns: int
    vector_bytes: int
    block_bytes: int
    itemsize: int
    batch_size: int
    num_data: int
    budget: int
    device: str = "cpu"
    float64: bool = True
    grouped: bool = False
    cached: bool = False

    def ritz(self) -> bool:
        """Whether a sketch's Rayleigh-Ritz step can run: every factor fits the cache."""
        kept = self.num_data * self.columns * self.vector_bytes
        return self.cached and not self.grouped and kept <= CACHE_SHARE * self.budget

    def limit(self, low_memory: bool) -> Tuple[int, int]:
        """Samples whose ``V`` fits the budget, and one sample's bytes.

        Raises:
            ValueError: If one sample does not fit the budget.
        """
        per_sample = self.columns * (self.block_bytes if low_memory else self.vector_bytes)
        return samples_that_fit(per_sample, self.budget)


def measure_sizes(engine: Any, X: Any, batch_size: int, num_data: int, config: FitConfig,
                  grouped: bool = False, cached: bool = False) -> FitSizes:
    """Return the :class:`FitSizes` of a fit from its first batch (one sample's forward).

    Args:
        engine: The ``FactorEngine``.
        X: The first batch of inputs.
        batch_size: Samples of the loader's batches.
        num_data: Samples this process streams.
        config: The fit's options.
        grouped: A data-parallel fit.
        cached: The fit keeps its pass's factors (``FitSizes.cached``).
    """
    vector = engine.bytes_per_sample(X, 1)
    block = engine.bytes_per_sample(X, 1, one_block=True)
    params = [p for p in engine.model.parameters() if p.requires_grad]
    device = batch_device(X)
    return FitSizes(
        dim=sum(p.numel() for p in params), gram_dim=engine.dense_param_count(),
        columns=factor_columns(engine.loss_func, (1, engine.num_outputs), config.mc_samples),
        vector_bytes=vector, block_bytes=block, itemsize=params[0].element_size(),
        batch_size=batch_size, num_data=num_data,
        budget=resolve_memory_budget(config.memory_budget, device), device=device.type,
        float64=params[0].dtype == torch.float64, grouped=grouped, cached=cached,
    )


@dataclass(frozen=True)
class FitPlan:
    """How a fit runs, decided once at its first batch.

    Attributes:
        path: ``"dense"``, ``"streaming"`` or ``"sketch"``.
        micro: Samples per backward pass.
        chunk: Samples per merge.
        low_memory: Every micro-batch is one merge from recomputing passes.
        lazy: Streaming merges update the basis lazily.
        threads: CPU threads (``1`` for small fits; ``None``: the user's setting).
        dim: Parameters ``D``.
        keep: Eigenpairs (or sketch columns) kept while fitting.
        sketch_dtype: The dtype a sketch accumulates in (``None``: the factors').
        widen: A float32 sketch to redo in float64 if it rounded (:meth:`widened`).
        dense: Whether the dense sum was chosen.
        single: Whether one streaming merge replaces a requested sketch.
    """

    path: str
    micro: int
    chunk: int
    low_memory: bool
    lazy: bool
    threads: Optional[int]
    dim: int
    keep: int = 0
    sketch_dtype: Optional[torch.dtype] = None
    widen: bool = False
    dense: bool = False
    single: bool = False

    def widened(self) -> "FitPlan":
        """The plan of a float32 sketch's second pass, accumulated in float64."""
        return replace(self, sketch_dtype=torch.float64, widen=False)


def merge_plan(sizes: FitSizes, config: FitConfig, keep: int, low_memory: bool = False,
               path: str = "streaming") -> Tuple[int, int]:
    """Return ``(samples per backward pass, per merge)``; a larger pass merges in pieces.

    Merges spanning several batches hold their factors and a copy: half the budget.

    Args:
        sizes: The first batch's sizes.
        config: The options.
        keep: Eigenpairs kept while streaming.
        low_memory: One merge per micro-batch, by recomputing passes.
        path: ``"streaming"`` or ``"sketch"`` (up to :data:`SKETCH_MERGE_BYTES` a merge).
    """
    limit, per_sample = sizes.limit(low_memory)
    cap = config.micro_batch_size
    limit = limit if cap is None else min(limit, cap)
    batch = sizes.batch_size
    chunk = cost.merge_size(
        columns_per_sample=sizes.columns, keep=keep, dim=sizes.dim, gram_dim=sizes.gram_dim,
        num_data=sizes.num_data,
        limit=limit if (low_memory or limit <= batch) else max(batch, limit // 2),
    )
    if low_memory:
        return chunk, chunk
    # a pass may feed several whole merges, with room for pending samples and a copy
    micro = min(chunk, limit) * max(1, (limit - 2 * chunk) // max(1, chunk))
    if path == "sketch":
        # passes no larger than streaming's: BackPACK's intermediates grow with them
        size = min(micro, batch)  # a pass never spans loader batches
        span = min(limit // 2, SKETCH_MERGE_BYTES // per_sample)
        return micro, size * max(1, span // size)
    return micro, chunk


def choose_solver(sizes: FitSizes, config: FitConfig) -> Tuple[str, int]:
    """Return ``solver="auto"``'s ``("sketch" or "streaming", columns kept while fitting)``.

    Fewer columns where the fit's Rayleigh-Ritz step refines them (:meth:`FitSizes.ritz`).

    A sketch needs its float64 ``D x l`` within :data:`WIDE_SKETCH_SHARE` of the budget and,
    on the CPU, a lower cost than streaming (on CUDA fitting is enough:
    docs/benchmarks/measurements.md, "Default arguments and LoRA adapters on an H200").
    Low-memory and data-parallel fits stream.

    Args:
        sizes: The first batch's sizes.
        config: The options.
    """
    keep, rank = keep_while_fitting(config.rank), config.rank
    extra = max(int(rank * RITZ_SKETCH_OVERSAMPLING), RITZ_MIN_EXTRA) if sizes.ritz() else \
        rank * AUTO_SKETCH_OVERSAMPLING
    columns = min(sizes.dim, max(keep, rank + extra))
    if config.low_memory or sizes.grouped or \
            sizes.dim * columns * 8 > WIDE_SKETCH_SHARE * sizes.budget:
        return "streaming", keep
    if sizes.device == "cuda":
        return "sketch", columns
    _, chunk = merge_plan(sizes, config, keep)
    args = (sizes.columns, keep, sizes.dim, sizes.gram_dim, sizes.num_data)
    if cost.sketch_cost(sizes.columns, columns, *args[2:]) < cost.streaming_cost(*args, chunk):
        return "sketch", columns
    return "streaming", keep


def choose_plan(sizes: FitSizes, config: FitConfig,
                agreed: Optional[Tuple[bool, bool]] = None) -> FitPlan:
    """Return the fit's plan: a pure function of sizes and options.

    Dense by :func:`choose_dense`; a sketch whose data one streaming merge covers takes
    that merge (cheaper, and the exact truncation); a dense sum drops ``low_memory``.

    Args:
        sizes: The first batch's sizes.
        config: The options.
        agreed: ``(dense, single)`` of all processes (:func:`agree`); ``None``: its own.
    """
    asked = keep = keep_while_fitting(config.rank)
    path = config.solver.value
    rival = "streaming" if path == SolverKind.AUTO else path
    if path == SolverKind.AUTO:
        path, keep = choose_solver(sizes, config)
    low_memory = config.low_memory
    micro, chunk = merge_plan(sizes, config, keep, low_memory, path)
    samples = math.ceil(sizes.num_data * (config.subsample_fraction or 1.0))
    single, streaming = False, (micro, chunk)
    if path == "sketch":  # would one streaming merge cover the data?
        streaming = merge_plan(sizes, config, asked, low_memory)
        # low-memory merges never span loader batches: one must hold the data
        single = streaming[1] >= samples and (
            not low_memory or min(sizes.batch_size, streaming[0]) >= samples)
    # a streaming rival merges as streaming, not as the sketch
    dense = choose_dense(sizes, asked, samples, streaming[1], rival)
    if agreed is not None:
        dense, single = agreed
    keep = asked if dense or single else keep
    if single and not dense:
        (micro, chunk), path = streaming, "streaming"
    if dense and low_memory:  # the dense sum needs V y products, not passes
        low_memory = False
        micro, chunk = merge_plan(sizes, config, keep, path=path)
    return _frozen_plan(sizes, "dense" if dense else path, (micro, chunk), low_memory, keep,
                        (dense, single))


def flat_plan(sizes: FitSizes, config: FitConfig) -> FitPlan:
    """The plan after ``solver="auto"``'s sketch found the spectrum flat.

    Streaming merges keeping :func:`keep_while_fitting`'s flat share (never in low memory).

    Args:
        sizes: The first batch's sizes.
        config: The options.
    """
    keep = keep_while_fitting(config.rank, flat=True)
    passes = merge_plan(sizes, config, keep)
    return _frozen_plan(sizes, "streaming", passes, False, keep, (False, False))


def choose_dense(sizes: FitSizes, keep: int, samples: int, merge_samples: int,
                 rival: str = "streaming") -> bool:
    """Return whether to sum ``H`` densely: it fits and is cheaper, or is small.

    Small: up to :data:`DENSE_MAX_DIM` parameters wherever streaming would truncate.

    Args:
        sizes: The first batch's sizes.
        keep: Eigenpairs kept while streaming.
        samples: Curvature samples streamed.
        merge_samples: Samples per streaming merge.
        rival: ``"streaming"`` or ``"sketch"``.
    """
    dim, columns, limit = sizes.dim, sizes.columns, DENSE_MAX_DIM
    if limit == 0 or cost.dense_bytes(dim, sizes.itemsize) > sizes.budget:
        return False
    truncates = min(dim, samples * columns) > keep
    if truncates and limit is not None and dim <= limit:
        return True
    if rival == "sketch":
        stream = cost.sketch_cost(columns, keep, dim, sizes.gram_dim, samples)
    else:
        stream = cost.streaming_cost(columns, keep, dim, sizes.gram_dim, samples,
                                     merge_samples)
    return cost.dense_cost(dim, samples * columns) < stream


def _frozen_plan(sizes: FitSizes, path: str, passes: Tuple[int, int], low_memory: bool,
                 keep: int, flags: Tuple[bool, bool]) -> FitPlan:
    """The :class:`FitPlan` of :func:`choose_plan`'s decisions (threads, laziness, dtype)."""
    micro, chunk = passes
    small = path == "streaming" and chunk * sizes.dim * keep < SINGLE_THREAD_MERGE_WORK
    pass_entries = min(micro, sizes.batch_size) * (
        sizes.columns * sizes.vector_bytes // sizes.itemsize)
    small = small and pass_entries < SINGLE_THREAD_PASS_ENTRIES
    wide = path == "sketch" and not low_memory and not sizes.float64 and \
        sizes.dim * keep * 8 <= WIDE_SKETCH_SHARE * sizes.budget
    return FitPlan(
        path=path, micro=micro, chunk=chunk, low_memory=low_memory,
        lazy=sizes.dim >= LAZY_MIN_DIM_PER_EIGENPAIR * keep,
        threads=1 if small and sizes.device == "cpu" else None,
        dim=sizes.dim, keep=keep, widen=wide, dense=flags[0], single=flags[1],
    )


def agree(group: Any, plan: FitPlan, device: torch.device) -> Tuple[bool, bool]:
    """Return ``plan``'s ``(dense, single)``, true where true on all ``group`` (on ``device``)."""
    import torch.distributed as dist

    flags = torch.tensor([float(plan.dense), float(plan.single)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    return bool(flags[0].item()), bool(flags[1].item())


def make_solver(plan: FitPlan, config: FitConfig, params: List[Tensor],
                basis: Optional[Tensor] = None) -> Solver:
    """Return the solver a plan names: ``DenseSum``, ``StreamingMerge`` or ``SketchMerge``.

    Args:
        plan: The fit's plan.
        config: The options.
        params: The fitted parameters (a low-memory sketch draws its test matrix first).
        basis: ``(D, b)`` warm start of an auto sketch, where it leaves random columns.
    """
    rank, track = config.rank, config.track_diagonal
    oversampling = max(plan.keep, keep_while_fitting(rank)) - rank
    if plan.path == "dense":
        return DenseSum(rank, keep_while_fitting(rank) - rank, track)
    if plan.path == "streaming":
        return StreamingMerge(rank, oversampling, track, lazy=plan.lazy)
    if basis is not None:
        columns = min(plan.keep, basis.shape[1] + rank * WARM_SKETCH_OVERSAMPLING)
        usable = config.solver == SolverKind.AUTO and not plan.low_memory and \
            basis.shape[0] == plan.dim and columns > basis.shape[1]
        basis, oversampling = (basis, columns - rank) if usable else (None, oversampling)
    merge = SketchMerge(rank, oversampling, track, seed=config.seed,
                        test_matrix=sketch.TEST_MATRIX, accumulate=plan.sketch_dtype,
                        basis=basis)
    if plan.low_memory:  # the first pass needs V^T Omega
        merge.prepare(plan.dim, params[0], [p.shape for p in params])
    return merge


def equal_parts(total: int, largest: int) -> int:
    """Return the size of the fewest, most equal parts of ``total`` (128 by 38: four of 32).

    Args:
        total: What is split.
        largest: The largest part allowed.
    """
    return -(-total // -(-total // max(1, largest)))
