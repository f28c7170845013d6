"""The fit's plan, decided once at the first batch: path, sizes, laziness, threads.

:func:`plan_fit` measures what one sample's ``V`` costs, asks the cost model
(:mod:`~lowrank_laplace.fitting.cost`) for the merge size and the path (a dense sum,
streaming merges or a one-pass sketch), and returns a frozen :class:`FitPlan`;
:func:`make_solver` builds the solver the plan names. Nothing changes either after.

Shape glossary:
    D: parameters; k: kept eigenpairs (rank + oversampling); M: columns of a merge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple, Union

import torch
from torch import Tensor

from lowrank_laplace.factor import factor_columns
from lowrank_laplace.fitting import cost
from lowrank_laplace.fitting.base import Solver
from lowrank_laplace.fitting.budget import resolve_memory_budget, samples_in_budget
from lowrank_laplace.fitting.dense import DenseSum
from lowrank_laplace.fitting.sketch import SketchMerge
from lowrank_laplace.fitting.streaming import StreamingMerge
from lowrank_laplace.utils.batches import batch_device
from lowrank_laplace.utils.threads import idle_core_threads

#: Fits whose streaming merges of ``S`` samples into a ``D x k`` basis have ``S D k``
#: below this, and whose passes hold fewer than :data:`SINGLE_THREAD_PASS_ENTRIES`
#: entries of ``V``, run their batch loop on one CPU thread: their many small
#: products would wake the thread team for too little work each time, and beside
#: another busy process every wake-up waits for a core (the digits MLP's fit took
#: 45 s on two threads and 0.9 s on one; docs/benchmarks/design_measurements.md).
SINGLE_THREAD_MERGE_WORK = 2**26
#: See :data:`SINGLE_THREAD_MERGE_WORK`: entries of ``V`` in one backward pass.
SINGLE_THREAD_PASS_ENTRIES = 2**22
#: Sketch fits whose whole sketch (:func:`~lowrank_laplace.fitting.cost.sketch_cost`,
#: in Gram multiply-adds) costs less than this run their batch loop on one CPU thread
#: too: their products are larger than a small merge's but still too small to share
#: between threads beside a busy process (the digits MLP's sketch fit and prior tuning
#: took 6.7 s on two threads and 0.36 s on one there;
#: docs/benchmarks/design_measurements.md).
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
#: ``eps32 * lambda_max``, and the fit warns.
WIDE_SKETCH_SHARE = 0.25
#: ``solver="auto"`` sketches with ``rank * (1 + AUTO_SKETCH_OVERSAMPLING)`` columns
#: (or ``rank + oversampling`` if more): fewer under-estimate the last kept eigenvalues
#: enough to tune the marglik prior too strong (docs/benchmarks/design_measurements.md,
#: docs/posterior_quality.md).
AUTO_SKETCH_OVERSAMPLING = 3
#: A sketch warm-started from a basis of ``b`` directions (``solver="auto"``; an earlier
#: fit's eigenvectors) draws ``rank * WARM_SKETCH_OVERSAMPLING`` random columns besides
#: them, at most as many columns as the cold sketch in all
#: (docs/benchmarks/design_measurements.md).
WARM_SKETCH_OVERSAMPLING = 2


@dataclass(frozen=True)
class FitPlan:
    """How a fit runs, decided once at its first batch.

    Attributes:
        path: ``"dense"``, ``"streaming"`` or ``"sketch"``: the solver.
        micro: Samples per backward pass.
        chunk: Samples per merge.
        low_memory: Every micro-batch is one merge computed by recomputing passes.
        lazy: Streaming merges update the basis lazily.
        threads: CPU threads of the batch loop (``1`` for small fits; ``None``: the
            user's setting).
        idle_cores: A CPU fit of one process, other than a small streaming one: its
            batch loop takes the cores idle at each batch, at most ``threads``
            (:meth:`batch_threads`).
        dim: Parameters ``D``.
        keep: Eigenpairs (or sketch columns) kept while fitting, ``rank +
            oversampling`` unless ``solver="auto"`` chose a larger sketch.
        sketch_dtype: The dtype a sketch accumulates in (``None``: the factors').
        widen: A float32 sketch that may be redone in float64 (its float64 ``D x l``
            matrix fits the budget's share) if its kept eigenvalues are not clear of
            its rounding (:meth:`~lowrank_laplace.fitting.sketch.SketchMerge.resolves`).
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
    idle_cores: bool = False

    def batch_threads(self) -> Optional[int]:
        """CPU threads for the batch loop now (``None``: the user's setting).

        ``threads`` for a small streaming fit (one: two did not help its merges), else
        as many as cores are idle now, at least one
        (:func:`~lowrank_laplace.utils.threads.idle_core_threads`; ``threads`` where
        the load is unknown): beside a busy process a thread team waits for cores at
        every product, while on idle cores a second thread nearly halves a sketch's.
        """
        if self.idle_cores:
            return idle_core_threads(unknown=self.threads)
        return self.threads


def merge_plan(engine: Any, X: Any, mc_samples: int, batch_size: int, num_data: int,
               keep: int, budget: Union[int, float, None], cap: Optional[int],
               low_memory: bool = False, solver: str = "streaming") -> Tuple[int, int]:
    """Samples per backward pass and samples per merge.

    The merge size comes from :func:`~lowrank_laplace.fitting.cost.merge_size`;
    merges spanning several batches hold their factors and one concatenated copy, so
    they are limited to half the memory budget.

    Args:
        engine: The :class:`~lowrank_laplace.engine.FactorEngine` that computes ``V``.
        X: The first batch of inputs.
        mc_samples: ``0`` (exact) or the Monte-Carlo samples per data point.
        batch_size: Samples of the loader's batches.
        num_data: Samples this process streams.
        keep: Eigenpairs kept while streaming (rank + oversampling).
        budget: ``memory_budget`` as given by the user.
        cap: ``micro_batch_size`` as given by the user, or ``None``.
        low_memory: Every micro-batch is one merge computed by passes that hold one
            block of ``V`` at a time (no concatenated copies).
        solver: ``"streaming"`` or ``"sketch"`` (passes sized as for streaming, merges
            of one pass or of whole passes up to ``SKETCH_MERGE_BYTES`` of ``V`` and
            half the budget).

    Returns:
        ``(micro-batch size, merge size)`` in samples. Without ``low_memory`` a
        micro-batch (one backward pass) may be larger than a merge and is then
        merged in pieces.
    """
    limit, per_sample = samples_in_budget(engine, X, mc_samples or None, budget, low_memory)
    limit = limit if cap is None else min(limit, cap)
    cols = factor_columns(engine.loss_func, (1, engine.num_outputs), mc_samples)
    chunk = cost.merge_size(
        columns_per_sample=cols, keep=keep,
        dim=sum(p.numel() for p in engine.model.parameters() if p.requires_grad),
        gram_dim=engine.dense_param_count(), num_data=num_data,
        limit=limit if (low_memory or limit <= batch_size) else max(batch_size, limit // 2),
    )
    if low_memory:
        return chunk, chunk
    # a pass may feed several merges (GGNFactor.take_samples): fewer, larger passes
    # of whole merges, with room for the pending samples and a merge's concatenated copy
    micro = min(chunk, limit) * max(1, (limit - 2 * chunk) // max(1, chunk))
    if solver == "sketch":
        # no eigenproblem per merge: a merge is one pass, or whole passes up to
        # SKETCH_MERGE_BYTES of V and half the budget (their factors and the
        # concatenated copy). Passes as large as streaming's, not larger: BackPACK's
        # intermediates grow with the pass, and so does the fit's peak
        size = min(micro, batch_size)  # a pass never spans loader batches
        span = min(limit // 2, SKETCH_MERGE_BYTES // per_sample)
        return micro, size * max(1, span // size)
    return micro, chunk


def plan_fit(engine: Any, X: Any, *, batch_size: int, num_data: int, keep: int,
             mc_samples: int, subsample_fraction: Optional[float],
             memory_budget: Union[int, float, None], micro_batch_size: Optional[int],
             low_memory: bool, solver: str, dense_max_dim: Optional[int],
             process_group: Any = None, rank: Optional[int] = None,
             wide_sketch: bool = False) -> FitPlan:
    """Decide the fit's path and sizes from its first batch.

    The dense sum is chosen by :func:`~lowrank_laplace.fitting.cost.choose_dense`;
    a requested sketch whose data one streaming merge covers takes that merge
    instead (it multiplies ``V`` once where the sketch multiplies it twice, and it is
    the exact truncation); a dense sum needs ``V y`` products, so it drops
    ``low_memory``. Every process of ``process_group`` takes the same path.

    Args:
        engine: The :class:`~lowrank_laplace.engine.FactorEngine` that computes ``V``.
        X: The first batch of inputs.
        batch_size: Samples of the loader's batches.
        num_data: Samples this process streams.
        keep: Eigenpairs kept while fitting (rank + oversampling).
        mc_samples: ``0`` (exact) or Monte-Carlo samples per data point.
        subsample_fraction: Curvature sub-sampling fraction or ``None``.
        memory_budget: ``memory_budget`` as given by the user.
        micro_batch_size: ``micro_batch_size`` as given by the user.
        low_memory: Merge every micro-batch from recomputing passes.
        solver: ``"streaming"``, ``"sketch"`` or ``"auto"`` (see :func:`choose_solver`).
        dense_max_dim: Largest ``D`` summed densely whenever streaming would truncate
            (``0``: never dense; ``None``: only the cost model decides).
        process_group: ``torch.distributed`` group (``None``: this process alone).
        rank: Eigenpairs kept in the end (``None``: ``keep``; only ``"auto"`` reads it).
        wide_sketch: Accumulate a float32 sketch in float64 where that fits (the
            second pass of a sketch whose float32 pass did not resolve its
            eigenvalues); otherwise a sketch accumulates in the factors' dtype first.

    Returns:
        The plan.
    """
    sizes = dict(budget=memory_budget, cap=micro_batch_size)
    budget = resolve_memory_budget(memory_budget, batch_device(X))
    params = [p for p in engine.model.parameters() if p.requires_grad]
    # dense sums and merges keep rank + oversampling; under "auto" dense competes with streaming
    asked, rival = keep, "streaming" if solver == "auto" else solver
    if solver == "auto":
        solver, keep = choose_solver(engine, X, rank or keep, keep, mc_samples, batch_size,
                                     num_data, budget, micro_batch_size,
                                     low_memory or process_group is not None)
    micro, chunk = merge_plan(engine, X, mc_samples, batch_size, num_data, keep,
                              low_memory=low_memory, solver=solver, **sizes)
    dim = sum(p.numel() for p in params)
    cols = factor_columns(engine.loss_func, (1, engine.num_outputs), mc_samples)
    samples = math.ceil(num_data * (subsample_fraction or 1.0))
    single, streaming = False, (micro, chunk)
    if solver == "sketch":  # would one streaming merge cover the data?
        streaming = merge_plan(engine, X, mc_samples, batch_size, num_data, asked,
                               low_memory=low_memory, **sizes)
        # low-memory merges never span loader batches: one must hold the data
        single = streaming[1] >= samples and (
            not low_memory or min(batch_size, streaming[0]) >= samples)
    dense = cost.choose_dense(  # a streaming rival merges as streaming, not as the sketch
        dim, cols, asked, engine.dense_param_count(), samples, streaming[1],
        budget, params[0].element_size(), dense_max_dim, rival)
    if process_group is not None:
        dense, single = _agree(process_group, X, dense, single)
    path = "dense" if dense else solver
    keep = asked if dense or single else keep
    if single and not dense:
        (micro, chunk), path = streaming, "streaming"
    if dense and low_memory:  # the dense sum needs V y products, not passes
        low_memory = False
        micro, chunk = merge_plan(engine, X, mc_samples, batch_size, num_data, keep,
                                  solver=solver, **sizes)
    pass_entries = min(micro, batch_size) * (
        engine.bytes_per_sample(X, mc_samples or None) // params[0].element_size())
    small = path != "dense" and _small_fit(path, cols, keep, dim, engine.dense_param_count(),
                                           samples, chunk, pass_entries)
    return _frozen_plan(path, micro, chunk, low_memory, keep, dim, small,
                        batch_device(X).type == "cpu", process_group is not None,
                        _sketch_dtype(path, params[0].dtype, dim, keep, budget, low_memory),
                        wide_sketch)


def _frozen_plan(path: str, micro: int, chunk: int, low_memory: bool, keep: int, dim: int,
                 small: bool, cpu: bool, grouped: bool, wide: Optional[torch.dtype],
                 wide_sketch: bool) -> FitPlan:
    """The :class:`FitPlan` of :func:`plan_fit`'s decisions.

    ``wide`` is a float32 sketch's float64 dtype where it fits, taken on the wide pass.
    A data-parallel fit (``grouped``) keeps fixed threads: its processes finish the
    reduced sketch or merge each on its own and must round alike, whatever load each
    sees (the others are that load).
    """
    return FitPlan(
        path=path, micro=micro, chunk=chunk, low_memory=low_memory,
        lazy=dim >= LAZY_MIN_DIM_PER_EIGENPAIR * keep,
        threads=1 if small and cpu else None,
        idle_cores=cpu and not grouped and not (small and path == "streaming"),
        dim=dim, keep=keep, sketch_dtype=wide if wide_sketch else None,
        widen=wide is not None and not wide_sketch,
    )


def _small_fit(path: str, cols: int, keep: int, dim: int, gram_dim: int, samples: int,
               chunk: int, pass_entries: int) -> bool:
    """Whether a streaming or sketch fit is small enough for one CPU thread.

    Streaming: merges below :data:`SINGLE_THREAD_MERGE_WORK`; sketch: the whole sketch
    below :data:`SINGLE_THREAD_SKETCH_WORK`; both: passes below
    :data:`SINGLE_THREAD_PASS_ENTRIES` entries of ``V``.
    """
    if pass_entries >= SINGLE_THREAD_PASS_ENTRIES:
        return False
    if path == "sketch":
        work = cost.sketch_cost(cols, min(keep, dim), dim, gram_dim, samples)
        return work < SINGLE_THREAD_SKETCH_WORK
    return chunk * dim * keep < SINGLE_THREAD_MERGE_WORK


def choose_solver(engine: Any, X: Any, rank: int, keep: int, mc_samples: int,
                  batch_size: int, num_data: int, budget: int, cap: Optional[int],
                  streaming_only: bool) -> Tuple[str, int]:
    """What ``solver="auto"`` runs: a sketch where it is cheaper, else streaming merges.

    The sketch has ``max(keep, rank * (1 + AUTO_SKETCH_OVERSAMPLING))`` columns (its
    accuracy at the default 20% oversampling missed the quality bar). It is taken where
    its ``D x l`` matrix accumulates in float64 within :data:`WIDE_SKETCH_SHARE` of the
    budget, so that a float32 model loses nothing to it, and, on the CPU, its cost
    (:func:`~lowrank_laplace.fitting.cost.sketch_cost`) is below streaming's
    (:func:`~lowrank_laplace.fitting.cost.streaming_cost`). That cost model is the
    CPU's: on a CUDA device the sketch's products take a few milliseconds, while every
    streaming merge waits on a small eigendecomposition, so there the sketch is taken
    wherever it fits (3c3d on an H200: docs/benchmarks.md, "Default arguments and LoRA
    adapters on an H200"). Low-memory and data-parallel fits stream.

    Args:
        engine: The :class:`~lowrank_laplace.engine.FactorEngine` that computes ``V``.
        X: The first batch of inputs.
        rank: Eigenpairs kept in the end.
        keep: ``rank + oversampling``.
        mc_samples: ``0`` (exact) or Monte-Carlo samples per data point.
        batch_size: Samples of the loader's batches.
        num_data: Samples this process streams.
        budget: The memory budget in bytes.
        cap: ``micro_batch_size`` as given by the user, or ``None``.
        streaming_only: Low-memory or data-parallel fits: streaming merges.

    Returns:
        ``("sketch" or "streaming", columns kept while fitting)``.
    """
    dim = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    columns = min(dim, max(keep, rank * (1 + AUTO_SKETCH_OVERSAMPLING)))
    if streaming_only or dim * columns * 8 > WIDE_SKETCH_SHARE * budget:
        return "streaming", keep
    if batch_device(X).type == "cuda":
        return "sketch", columns
    _, chunk = merge_plan(engine, X, mc_samples, batch_size, num_data, keep, budget, cap)
    cols = factor_columns(engine.loss_func, (1, engine.num_outputs), mc_samples)  # probed
    gram = engine.dense_param_count()
    stream = cost.streaming_cost(cols, keep, dim, gram, num_data, chunk)
    if cost.sketch_cost(cols, columns, dim, gram, num_data) < stream:
        return "sketch", columns
    return "streaming", keep


def _sketch_dtype(path: str, dtype: torch.dtype, dim: int, keep: int, budget: int,
                  low_memory: bool) -> Optional[torch.dtype]:
    """float64 for a sketch of float32 factors whose float64 ``D x l`` matrix is small.

    ``None`` elsewhere (float64 factors, other paths, low-memory passes, which project
    in the factors' dtype).
    """
    if path != "sketch" or low_memory or dtype == torch.float64:
        return None
    return torch.float64 if dim * keep * 8 <= WIDE_SKETCH_SHARE * budget else None


def _agree(group: Any, X: Any, dense: bool, single: bool) -> Tuple[bool, bool]:
    """Both flags, true only where they are true on every process of the group."""
    import torch.distributed as dist

    flags = torch.tensor([float(dense), float(single)], device=batch_device(X))
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    return bool(flags[0].item()), bool(flags[1].item())


def make_solver(plan: FitPlan, rank: int, oversampling: int, track_diagonal: bool,
                seed: int = 0, test_matrix: str = "kronecker", like: Optional[Tensor] = None,
                shapes: Optional[List[torch.Size]] = None,
                basis: Optional[Tensor] = None) -> Solver:
    """The solver a plan names.

    Args:
        plan: The fit's plan.
        rank: Eigenpairs kept in the end.
        oversampling: Extra eigenpairs (or sketch columns) while fitting.
        track_diagonal: Track the GGN diagonal.
        seed: Seed of a sketch's test matrix.
        test_matrix: A sketch's test matrix, ``"kronecker"`` or ``"gaussian"``.
        like: A parameter (dtype and device): a low-memory sketch draws its test
            matrix before the first pass, which needs its products.
        shapes: The parameters' shapes, in order (for that test matrix).
        basis: A warm start for a sketch, ``(D, b)`` (``solver="auto"`` only): the sketch
            has ``b + rank * WARM_SKETCH_OVERSAMPLING`` columns, at most the plan's,
            and ignores it where that leaves no random column or the fit recomputes
            its passes.

    Returns:
        A :class:`~lowrank_laplace.fitting.dense.DenseSum`,
        :class:`~lowrank_laplace.fitting.streaming.StreamingMerge` or
        :class:`~lowrank_laplace.fitting.sketch.SketchMerge`.
    """
    if plan.path == "dense":
        return DenseSum(rank, oversampling, track_diagonal)
    if plan.keep > rank + oversampling:  # solver="auto" may sketch with more columns
        oversampling = plan.keep - rank
    if plan.path == "streaming":
        return StreamingMerge(rank, oversampling, track_diagonal, lazy=plan.lazy)
    if basis is not None:
        columns = min(plan.keep, basis.shape[1] + rank * WARM_SKETCH_OVERSAMPLING)
        if plan.low_memory or basis.shape[0] != plan.dim or columns <= basis.shape[1]:
            basis = None
        else:
            oversampling = columns - rank
    sketch = SketchMerge(rank, oversampling, track_diagonal, seed=seed, test_matrix=test_matrix,
                         accumulate=plan.sketch_dtype, basis=basis)
    if plan.low_memory:  # the first pass needs V^T Omega
        sketch.prepare(plan.dim, like, shapes)
    return sketch


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
