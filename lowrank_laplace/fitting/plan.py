"""The fit's plan: one pure function of the first batch's sizes and the options.

:func:`measure_sizes` reads what one sample's ``V`` costs (one forward pass of a
sample) and the memory budget; :func:`choose_plan` turns those sizes and the
:class:`~lowrank_laplace.fitting.config.FitConfig` into a frozen :class:`FitPlan`
(the path: a dense sum, streaming merges or a one-pass sketch; the sizes of passes and
merges; the thread count), asking the cost model
(:mod:`~lowrank_laplace.fitting.cost`); :func:`make_solver` builds the solver the plan
names. Nothing changes after the first batch.

Shape glossary:
    D: parameters; k: kept eigenpairs (rank + oversampling); M: columns of a merge.
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
from lowrank_laplace.fitting.budget import resolve_memory_budget
from lowrank_laplace.fitting.config import FitConfig, SolverKind
from lowrank_laplace.fitting.dense import DenseSum
from lowrank_laplace.fitting.sketch import SketchMerge
from lowrank_laplace.fitting.streaming import StreamingMerge
from lowrank_laplace.utils.batches import batch_device

#: Extra eigenpairs kept while streaming, as a share of the rank (``rank // 5``):
#: merges that keep only ``rank`` lose accuracy in the last kept eigenpairs.
OVERSAMPLING = 0.2
#: Up to this many parameters (typically a last layer) the fit sums the GGN densely
#: and eigendecomposes it once (exact) wherever streaming would truncate and the
#: ``D x D`` matrix fits the memory budget (:func:`choose_dense`); ``0`` never sums
#: densely, ``None`` leaves the choice to the cost model alone.
DENSE_MAX_DIM = 2048
#: Streaming fits whose merges of ``S`` samples into a ``D x k`` basis have ``S D k``
#: below this, and whose passes hold fewer than :data:`SINGLE_THREAD_PASS_ENTRIES`
#: entries of ``V``, run on one CPU thread: their many small products would wake the
#: thread team for too little work each time, and beside another busy process every
#: wake-up waits for a core (docs/benchmarks/design_measurements.md).
SINGLE_THREAD_MERGE_WORK = 2**26
#: See :data:`SINGLE_THREAD_MERGE_WORK`: entries of ``V`` in one backward pass.
SINGLE_THREAD_PASS_ENTRIES = 2**22
#: Sketch fits whose whole sketch (:func:`~lowrank_laplace.fitting.cost.sketch_cost`,
#: in Gram multiply-adds) costs less than this run on one CPU thread too: their
#: products are still too small to share between threads beside a busy process
#: (docs/benchmarks/design_measurements.md).
SINGLE_THREAD_SKETCH_WORK = 2**34
#: Sketch merges span several passes up to this many bytes of ``V``: larger products
#: are faster for factored linear layers, while for expanded convolution blocks merging
#: passes only adds concatenated copies (docs/benchmarks/design_measurements.md).
SKETCH_MERGE_BYTES = 2**28
#: Below this many parameters per kept eigenpair, a merge rotates the ``D x k`` basis
#: explicitly (``D k^2``, cheap) instead of the lazy update's ``k x k`` SVD and
#: bookkeeping.
LAZY_MIN_DIM_PER_EIGENPAIR = 200
#: The fit paths: a dense sum, streaming merges, a one-pass sketch.
PATHS = ("dense", "streaming", "sketch")
#: A sketch of float32 factors is redone in float64 (when its float32 pass rounded
#: its kept eigenvalues) where its ``D x l`` float64 matrix takes at most this share of
#: the memory budget; elsewhere it stays float32, which rounds away eigenvalues below
#: ``eps32 * lambda_max``, and the fit warns. ``solver="auto"`` sketches only where it
#: fits this share.
WIDE_SKETCH_SHARE = 0.25
#: ``solver="auto"`` sketches with ``rank * (1 + AUTO_SKETCH_OVERSAMPLING)`` columns
#: (or ``rank + oversampling`` if more): fewer under-estimate the last kept eigenvalues
#: enough to tune the marglik prior too strong (docs/benchmarks/design_measurements.md,
#: docs/posterior_quality.md).
AUTO_SKETCH_OVERSAMPLING = 3
#: A sketch warm-started from a basis of ``b`` directions (``solver="auto"``; the same
#: posterior's last eigenvectors) draws ``rank * WARM_SKETCH_OVERSAMPLING`` random
#: columns besides them, at most as many columns as the cold sketch in all
#: (docs/benchmarks/design_measurements.md).
WARM_SKETCH_OVERSAMPLING = 2


def keep_while_fitting(rank: int) -> int:
    """Eigenpairs kept while streaming: ``rank`` plus :data:`OVERSAMPLING` of it."""
    return rank + int(rank * OVERSAMPLING)


@dataclass(frozen=True)
class FitSizes:
    """What the first batch tells a plan: sizes, the memory budget and the device.

    Attributes:
        dim: Parameters ``D``.
        gram_dim: Entries of ``V``'s rows stored explicitly per column (``D_gram``).
        columns: Columns of ``V`` per curvature sample (``C``, ``C - 1`` or ``M``).
        vector_bytes: Bytes one column of one sample's ``V`` takes in a pass.
        block_bytes: The same for a pass that holds one block at a time.
        itemsize: Bytes per parameter entry.
        batch_size: Samples of the loader's batches.
        num_data: Samples this process streams.
        budget: The memory budget in bytes.
        device: ``"cpu"``, ``"cuda"``, ...
        float64: Whether the parameters are float64.
        grouped: A data-parallel fit (every process takes the same path).
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

    def limit(self, low_memory: bool, budget: Optional[int] = None) -> Tuple[int, int]:
        """Samples whose ``V`` fits the budget, and one sample's bytes.

        Raises:
            ValueError: If one sample does not fit the budget.
        """
        budget = self.budget if budget is None else budget
        per_sample = self.columns * (self.block_bytes if low_memory else self.vector_bytes)
        if per_sample > budget:
            raise ValueError(
                f"memory_budget={budget:,} bytes is too small for one sample (about "
                f"{per_sample:,} bytes of V): raise memory_budget, use mc_samples=1, or "
                "subset_of_weights='last_layer'."
            )
        return max(1, budget // per_sample), per_sample


def measure_sizes(engine: Any, X: Any, batch_size: int, num_data: int, config: FitConfig,
                  grouped: bool = False) -> FitSizes:
    """The :class:`FitSizes` of a fit from its first batch (one forward pass of a sample).

    Args:
        engine: The :class:`~lowrank_laplace.engine.FactorEngine` that computes ``V``.
        X: The first batch of inputs.
        batch_size: Samples of the loader's batches.
        num_data: Samples this process streams.
        config: The fit's options (``mc_samples``, ``memory_budget``).
        grouped: A data-parallel fit.

    Returns:
        The sizes.
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
        float64=params[0].dtype == torch.float64, grouped=grouped,
    )


@dataclass(frozen=True)
class FitPlan:
    """How a fit runs, decided once at its first batch.

    Attributes:
        path: ``"dense"``, ``"streaming"`` or ``"sketch"``: the solver.
        micro: Samples per backward pass.
        chunk: Samples per merge.
        low_memory: Every micro-batch is one merge computed by recomputing passes.
        lazy: Streaming merges update the basis lazily.
        threads: CPU threads of the fit (``1`` for small fits; ``None``: the user's
            setting).
        dim: Parameters ``D``.
        keep: Eigenpairs (or sketch columns) kept while fitting.
        sketch_dtype: The dtype a sketch accumulates in (``None``: the factors').
        widen: A float32 sketch whose float64 matrix fits: redone in float64 if its
            first pass rounded its kept eigenvalues (:meth:`widened`).
        dense: Whether the dense sum was chosen (every process agrees on it).
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
    """Samples per backward pass and samples per merge.

    The merge size comes from :func:`~lowrank_laplace.fitting.cost.merge_size`;
    merges spanning several batches hold their factors and one concatenated copy, so
    they are limited to half the memory budget.

    Args:
        sizes: The first batch's sizes.
        config: The options (``micro_batch_size`` caps passes).
        keep: Eigenpairs kept while streaming (rank + oversampling).
        low_memory: Every micro-batch is one merge computed by passes that hold one
            block of ``V`` at a time (no concatenated copies).
        path: ``"streaming"`` or ``"sketch"`` (passes sized as for streaming, merges
            of one pass or of whole passes up to :data:`SKETCH_MERGE_BYTES` of ``V``
            and half the budget).

    Returns:
        ``(micro-batch size, merge size)`` in samples. Without ``low_memory`` a
        micro-batch (one backward pass) may be larger than a merge and is then
        merged in pieces.
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
    # a pass may feed several merges (GGNFactor.take_samples): fewer, larger passes
    # of whole merges, with room for the pending samples and a merge's concatenated copy
    micro = min(chunk, limit) * max(1, (limit - 2 * chunk) // max(1, chunk))
    if path == "sketch":
        # no eigenproblem per merge: a merge is one pass, or whole passes up to
        # SKETCH_MERGE_BYTES of V and half the budget (their factors and the
        # concatenated copy). Passes as large as streaming's, not larger: BackPACK's
        # intermediates grow with the pass, and so does the fit's peak
        size = min(micro, batch)  # a pass never spans loader batches
        span = min(limit // 2, SKETCH_MERGE_BYTES // per_sample)
        return micro, size * max(1, span // size)
    return micro, chunk


def choose_solver(sizes: FitSizes, config: FitConfig) -> Tuple[str, int]:
    """What ``solver="auto"`` runs: a sketch where it is cheaper, else streaming merges.

    The sketch has ``max(keep, rank * (1 + AUTO_SKETCH_OVERSAMPLING))`` columns. It is
    taken where its ``D x l`` matrix accumulates in float64 within
    :data:`WIDE_SKETCH_SHARE` of the budget, so that a float32 model loses nothing to
    it, and, on the CPU, its cost (:func:`~lowrank_laplace.fitting.cost.sketch_cost`)
    is below streaming's (:func:`~lowrank_laplace.fitting.cost.streaming_cost`). That
    cost model is the CPU's: on a CUDA device the sketch's products take milliseconds,
    while every streaming merge waits on a small eigendecomposition, so there the
    sketch is taken wherever it fits (docs/benchmarks.md, "Default arguments and LoRA
    adapters on an H200"). Low-memory and data-parallel fits stream.

    Args:
        sizes: The first batch's sizes.
        config: The options.

    Returns:
        ``("sketch" or "streaming", columns kept while fitting)``.
    """
    keep = keep_while_fitting(config.rank)
    columns = min(sizes.dim, max(keep, config.rank * (1 + AUTO_SKETCH_OVERSAMPLING)))
    if config.low_memory or sizes.grouped or \
            sizes.dim * columns * 8 > WIDE_SKETCH_SHARE * sizes.budget:
        return "streaming", keep
    if sizes.device == "cuda":
        return "sketch", columns
    _, chunk = merge_plan(sizes, config, keep)
    args = (sizes.columns, keep, sizes.dim, sizes.gram_dim, sizes.num_data)
    stream = cost.streaming_cost(*args, chunk)
    if cost.sketch_cost(sizes.columns, columns, sizes.dim, sizes.gram_dim,
                        sizes.num_data) < stream:
        return "sketch", columns
    return "streaming", keep


def choose_plan(sizes: FitSizes, config: FitConfig,
                agreed: Optional[Tuple[bool, bool]] = None) -> FitPlan:
    """Decide the fit's path and sizes: a pure function of sizes and options.

    The dense sum is chosen by :func:`choose_dense`
    (up to :data:`DENSE_MAX_DIM` parameters wherever streaming would truncate); a
    requested sketch whose data one streaming merge covers takes that merge instead (it
    multiplies ``V`` once where the sketch multiplies it twice, and it is the exact
    truncation); a dense sum needs ``V y`` products, so it drops ``low_memory``.

    Args:
        sizes: The first batch's sizes (:func:`measure_sizes`).
        config: The options.
        agreed: ``(dense, single)`` as every process of a data-parallel fit agreed on
            them (the minimum of each process's own plan's :attr:`FitPlan.dense` and
            :attr:`FitPlan.single`); ``None``: this plan's own.

    Returns:
        The plan.
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
                        samples, (dense, single))


def choose_dense(sizes: FitSizes, keep: int, samples: int, merge_samples: int,
                 rival: str = "streaming") -> bool:
    """Whether to sum ``H`` densely (exact) instead of streaming truncated merges.

    Dense needs the ``D x D`` sum and its eigendecomposition to fit the memory
    budget; then it is taken when it is cheaper than its rival
    (:func:`~lowrank_laplace.fitting.cost.dense_cost` against the rival's cost), and
    also, up to :data:`DENSE_MAX_DIM` parameters, whenever streaming would truncate
    (the GGN's rank over the data exceeds the ``k`` kept eigenpairs), so that small
    problems stay exact. ``DENSE_MAX_DIM = 0`` never sums densely; ``None`` leaves the
    choice to the cost alone.

    Args:
        sizes: The first batch's sizes.
        keep: Eigenpairs kept while streaming ``k``.
        samples: Curvature samples streamed.
        merge_samples: Samples per streaming merge (the merge plan).
        rival: ``"streaming"`` merges or a one-pass ``"sketch"``.

    Returns:
        ``True`` for the dense path.
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
                 keep: int, samples: int, flags: Tuple[bool, bool]) -> FitPlan:
    """The :class:`FitPlan` of :func:`choose_plan`'s decisions (threads, laziness, dtype)."""
    micro, chunk = passes
    pass_entries = min(micro, sizes.batch_size) * (
        sizes.columns * sizes.vector_bytes // sizes.itemsize)
    small = path != "dense" and _small_fit(sizes, path, keep, samples, chunk, pass_entries)
    wide = path == "sketch" and not low_memory and not sizes.float64 and \
        sizes.dim * keep * 8 <= WIDE_SKETCH_SHARE * sizes.budget
    return FitPlan(
        path=path, micro=micro, chunk=chunk, low_memory=low_memory,
        lazy=sizes.dim >= LAZY_MIN_DIM_PER_EIGENPAIR * keep,
        threads=1 if small and sizes.device == "cpu" else None,
        dim=sizes.dim, keep=keep, widen=wide, dense=flags[0], single=flags[1],
    )


def _small_fit(sizes: FitSizes, path: str, keep: int, samples: int, chunk: int,
               pass_entries: int) -> bool:
    """Whether a streaming or sketch fit is small enough for one CPU thread.

    Streaming: merges below :data:`SINGLE_THREAD_MERGE_WORK`; sketch: the whole sketch
    below :data:`SINGLE_THREAD_SKETCH_WORK`; both: passes below
    :data:`SINGLE_THREAD_PASS_ENTRIES` entries of ``V``.
    """
    if pass_entries >= SINGLE_THREAD_PASS_ENTRIES:
        return False
    if path == "sketch":
        work = cost.sketch_cost(sizes.columns, min(keep, sizes.dim), sizes.dim,
                                sizes.gram_dim, samples)
        return work < SINGLE_THREAD_SKETCH_WORK
    return chunk * sizes.dim * keep < SINGLE_THREAD_MERGE_WORK


def agree(group: Any, plan: FitPlan, device: torch.device) -> Tuple[bool, bool]:
    """The plan's ``(dense, single)``, true only where they are true on every process.

    Args:
        group: The ``torch.distributed`` process group.
        plan: This process's own plan.
        device: Where the collective runs.

    Returns:
        The agreed flags, for :func:`choose_plan`.
    """
    import torch.distributed as dist

    flags = torch.tensor([float(plan.dense), float(plan.single)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    return bool(flags[0].item()), bool(flags[1].item())


def make_solver(plan: FitPlan, config: FitConfig, params: List[Tensor],
                basis: Optional[Tensor] = None) -> Solver:
    """The solver a plan names.

    Args:
        plan: The fit's plan.
        config: The options (rank, diagonal, seed of a sketch's test matrix).
        params: The fitted parameters (a low-memory sketch draws its test matrix
            before the first pass, in their dtype, device and shapes).
        basis: A warm start for a sketch that ``solver="auto"`` chose, ``(D, b)``:
            the sketch has ``b + rank * WARM_SKETCH_OVERSAMPLING`` columns, at most
            the plan's, and ignores it where that leaves no random column or the fit
            recomputes its passes.

    Returns:
        A :class:`~lowrank_laplace.fitting.dense.DenseSum`,
        :class:`~lowrank_laplace.fitting.streaming.StreamingMerge` or
        :class:`~lowrank_laplace.fitting.sketch.SketchMerge`.
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
    """Size of the fewest, most equal parts of ``total`` of at most ``largest`` each.

    Slicing by this step gives equal parts where ``total`` allows (128 in parts of at
    most 38: four of 32, not 38, 38, 38 and 14), else a smaller last one.

    Args:
        total: What is split.
        largest: The largest part allowed (``>= 1``).

    Returns:
        The step ``ceil(total / ceil(total / largest))``.
    """
    return -(-total // -(-total // max(1, largest)))
