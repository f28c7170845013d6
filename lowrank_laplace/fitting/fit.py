r"""A loader's GGN as its leading eigenpairs: one engine, one plan, one pass.

:class:`LoaderFit` streams the batches into its plan's solver, merges across processes and
with an earlier fit, and keeps inputs for a probe pass; :func:`fit_loader` is one call (the
eigenpairs alone: :func:`lowrank_laplace.fit_lowrank_ggn` adds the residual's measurements).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, List, Optional, Tuple

import torch
import tqdm
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.engine.factor_engine import jacobian_engine
from lowrank_laplace.fitting import loader as loaders
from lowrank_laplace.fitting.budget import resolve_memory_budget
from lowrank_laplace.fitting.config import FitConfig, SolverKind
from lowrank_laplace.fitting.distributed import resolve_process_group
from lowrank_laplace.fitting.plan import (
    FitPlan,
    agree,
    choose_plan,
    flat_plan,
    keep_while_fitting,
    make_solver,
    measure_sizes,
)
from lowrank_laplace.fitting.products import CACHE_SHARE, FactorCache, FittedData, GGNProducts
from lowrank_laplace.fitting.streamer import BatchStreamer
from lowrank_laplace.fitting.streaming import StreamingMerge
from lowrank_laplace.utils.batches import take, to_device
from lowrank_laplace.utils.checks import check_batch
from lowrank_laplace.utils.linalg import squared_rows_dot
from lowrank_laplace.utils.threads import SpareCores, cpu_threads


def _identity(X: Any) -> Any:
    return X


@dataclass(frozen=True)
class FitTarget:
    """What a fit computes the GGN of.

    Attributes:
        model: The module whose GGN is computed (its trainable parameters).
        likelihood: ``"classification"`` or ``"regression"`` (laplace-torch's GGN).
        params: The parameters of the mean (``None``: ``model``'s trainable ones).
        to_inputs: Maps a batch's inputs to ``model``'s (e.g. last-layer features).
        dict_key_y: The targets' key in dict batches.
        device: Where the fit runs (``None``: the parameters').
    """

    model: nn.Module
    likelihood: str
    params: Optional[List[Tensor]] = None
    to_inputs: Callable[[Any], Any] = _identity
    dict_key_y: str = "labels"
    device: Optional[torch.device] = None


@dataclass
class ProbeInputs:
    """Training inputs a fit kept for a probe pass after it.

    Attributes:
        batches: The first inputs the loader yielded, as batches.
        cap: Most vectors per input a pass may carry within the budget.
        rng: The fit's private random stream, continued by the probe.
    """

    batches: List[Any]
    cap: int
    rng: Any


#: A sketch passes its check where its leading eigenvalues reach this share (else
#: ``solver="auto"`` streams instead), by whether a Rayleigh-Ritz step refined it: half its
#: random columns' against all (``nystrom.sub_sketch_share``), or the Nyström eigenvalues'
#: of the Ritz values (docs/benchmarks/design_measurements.md); the check's name, and what
#: a warning says moved them.
SKETCH_CONVERGED = {
    False: (0.95, "sketch convergence", "when the second half of its columns was added"),
    True: (0.90, "sketch convergence (Rayleigh-Ritz on the kept factors)",
           "in the Rayleigh-Ritz step"),
}


@dataclass(frozen=True)
class FastPathCheck:
    """A fast path's own check after the fit, and what the fit did about it.

    Attributes:
        name: What was checked (``"sketch convergence"``, with how).
        value: The measured quantity (``SketchMerge.convergence``).
        threshold: The value it must reach.
        passed: Whether it did.
        action: ``"kept"``, ``"streamed instead"`` or ``"warned"``.
    """

    name: str
    value: float
    threshold: float
    passed: bool
    action: str


@dataclass
class FitResult:
    """A fitted low-rank GGN over a training set, on the GGN's own scale.

    Attributes:
        mean: The parameters at the fit (the posterior mean), ``(D,)``.
        eigenvectors: Kept orthonormal eigenvectors ``U``, ``(D, r)``.
        eigenvalues: Kept eigenvalues ``lambda``, ``(r,)``.
        trace: The exact GGN trace over the data.
        residual_diagonal: Diagonal of the dropped curvature, ``(D,)``, or ``None``.
        loss: The summed loss times laplace-torch's Hessian factor.
        n_data: Samples fitted (over all processes).
        n_outputs: Model outputs ``C``.
        factor_backend: The backend that computed ``V``.
        fit_path: ``"dense"``, ``"streaming"`` or ``"sketch"``.
        rank_bound: ``min(D, samples * columns)``.
        warm_started: Whether the sketch started from a basis.
        probe: The inputs kept for a probe pass, or ``None``.
        check: The sketch's own check (``None`` where no sketch ran).
        target_energy: The fitted targets' squares summed (over all processes; ``None``:
            unknown): with
            ``loss`` and ``n_data``, what a later pass over the same data reproduces.
        loss_reproducible: Whether a pass over the data at ``mean`` reproduces ``loss``
            (not after an online update, whose earlier losses were at other parameters).
    """

    mean: Tensor
    eigenvectors: Tensor
    eigenvalues: Tensor
    trace: Tensor
    residual_diagonal: Optional[Tensor]
    loss: Any
    n_data: int
    n_outputs: int
    factor_backend: str
    fit_path: str
    rank_bound: int
    warm_started: bool = False
    probe: Optional[ProbeInputs] = field(default=None, repr=False)
    check: Optional[FastPathCheck] = None
    target_energy: Optional[float] = None
    loss_reproducible: bool = True


class LoaderFit:
    """A fit over a loader, as a context manager: one engine, plan and thread scope.

    A small fit runs on one thread; a larger one takes the cores other processes leave,
    re-read at every batch (:class:`~lowrank_laplace.utils.threads.SpareCores`). Work
    inside it after :meth:`run` (a probe pass) keeps the fit's threads until exit.

    Args:
        target: What the GGN is computed of.
        config: The fit's options.
        process_group: Group to merge across; ``"default"``: the initialised default one.
        keep_factors: Keep the first pass's factors (within
            :data:`~lowrank_laplace.fitting.products.CACHE_SHARE` of the memory budget;
            the leading ones where not all fit) and its first inputs, for the Lanczos
            quadrature after the fit, which then reads the data no more. Not with
            curvature sub-sampling.

    Attributes:
        cache: The first pass's factors (``None``: not kept).
        group: The process group merged across (``None``: this process alone).
        passes: Passes over the training data so far (a sketch that falls back streams
            again; ``rank="auto"`` fits once per rank).
    """

    def __init__(self, target: FitTarget, config: FitConfig, process_group: Any = "default",
                 keep_factors: bool = False):
        self.target, self.config = target, config
        self.cache: Optional[FactorCache] = None
        self._keep = keep_factors and config.subsample_fraction in (None, 1)
        self.params = [p for p in target.model.parameters() if p.requires_grad] \
            if target.params is None else target.params
        loaders.check_params(self.params)
        self.device = self.params[0].device if target.device is None else target.device
        self.group = resolve_process_group(process_group)
        self.loss_func, self.scale = loaders.likelihood_loss(target.likelihood)
        self._scope = contextlib.ExitStack()
        self.engine: Optional[FactorEngine] = None
        self.plan: Optional[FitPlan] = None
        self.probe: Optional[ProbeInputs] = None
        self._probe_cap = 1
        self._sizes: Optional[Any] = None
        self._jacobian: Optional[FactorEngine] = None
        self._cores: Optional[SpareCores] = None  # re-read at every batch (large fits)
        self.passes = 0

    def __enter__(self) -> "LoaderFit":
        self.engine = self._scope.enter_context(FactorEngine(
            self.target.model, self.loss_func, eval_mode=True,
            backend=self.config.factor_backend))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scope.close()

    def run(self, loader: Any, previous: Optional[FitResult] = None,
            warm_basis: Optional[Tensor] = None, progress_bar: bool = False) -> FitResult:
        """Return the :class:`FitResult` of the low-rank GGN over the whole loader.

        Data-parallel, every process streams its shard and all end with the same result,
        ``n_data`` counting all samples.

        Args:
            loader: Yields ``(X, y)`` or dict batches; ``loader.dataset`` has a length.
            previous: An earlier fit to add to (online updates, ``override=False``).
            warm_basis: ``(D, b)`` first test columns of an auto sketch (the last eigenvectors).
            progress_bar: Show a tqdm progress bar over batches.

        Raises:
            ValueError: For a loader without ``dataset``, an empty loader, bad targets, or a
                budget too small for one sample.
        """
        known = loaders.loader_size(loader)
        mean = parameters_to_vector(self.params).detach()
        stream, loss, seen = self._pass(loader, known, warm_basis, progress_bar)
        if self.group is None:  # else after the processes' merge
            stream.solver.finalize()
        if self._rounded(stream):  # a float32 sketch rounded a kept eigenvalue
            if self.plan.widen:  # one more pass, in float64
                self.plan = self.plan.widened()
                stream, loss, seen = self._pass(loader, known, warm_basis, False)
            else:
                warnings.warn(
                    f"solver='sketch' accumulated its sketch in {self.params[0].dtype} (its "
                    "float64 D x l matrix exceeds a quarter of memory_budget, or low_memory=True) "
                    "and rounded kept eigenvalues: eigenvalues below about eps * lambda_max are "
                    "lost, and variances in weakly determined directions can be far off at small "
                    "prior precisions. solver='streaming', a larger memory_budget (or a float64 "
                    "model) resolves them.", UserWarning, stacklevel=3)
        form = None if self.cache is None or self.group is not None else \
            self.cache.quadratic_form()
        if self.plan.path == "sketch" and form is not None:  # the kept factors refine it
            stream.solver.rayleigh_ritz(form)
        loss, num_data, targets = self._reduce(stream, loss, seen, known, mean.dtype)
        check = self._check(stream)
        if check is not None and check.action == "streamed instead":
            self.plan = flat_plan(self._sizes, self.config)
            stream, loss, seen = self._pass(loader, known, None, False)
            loss, num_data, targets = self._reduce(stream, loss, seen, known, mean.dtype)
        result = stream.solver.result()
        if previous is not None:
            result = merge_fits(self.config, previous, result)
            loss, num_data = previous.loss + loss, previous.n_data + num_data
            targets = None if previous.target_energy is None else \
                previous.target_energy + targets
        U, lam, trace, residual = result
        if float(trace) <= 0:  # a zero GGN has no eigenpairs, not a fake tiny one
            U, lam = U[:, :0], lam[:0]
        samples = math.ceil(num_data * (self.config.subsample_fraction or 1.0))
        return FitResult(
            mean=mean, eigenvectors=U, eigenvalues=lam, trace=trace,
            residual_diagonal=residual, loss=loss, n_data=num_data,
            n_outputs=stream.n_outputs, factor_backend=self.engine.backend,
            fit_path=self.plan.path, rank_bound=min(mean.numel(), samples * self._sizes.columns),
            warm_started=stream.solver.warm_columns > 0, probe=self.probe, check=check,
            target_energy=targets, loss_reproducible=previous is None,
        )

    def _pass(self, loader: Any, known: Optional[int], warm_basis: Optional[Tensor],
              progress_bar: bool, sink: Any = None) -> Tuple[BatchStreamer, Any, int]:
        """One pass: the streamer (its solver, or ``sink``, filled), loss and samples.

        A fit's pass (no ``sink``) keeps the probe inputs.
        """
        self.passes += 1
        config, target = self.config, self.target
        keep = 0 if sink is not None else config.probe_inputs
        stream, kept, loss, seen = None, [], 0.0, 0
        pbar = tqdm.tqdm(loaders.batches(loader, target.dict_key_y), disable=not progress_bar,
                         desc="[lowrank_ggn: merging GGN factors]")
        for X, y in pbar:
            X, y = target.to_inputs(to_device(X, self.device)), y.to(self.device)
            loaders.check_likelihood_targets(target.likelihood, y)
            if stream is None:  # the first batch: plan, solver, streamer
                stream = self._start(X, len(y),
                                     loaders.planned_samples(loader, known, len(y)),
                                     warm_basis, sink)
                stream.tap = self._cache_tap(sink)
            if seen < keep:  # inputs for a probe pass after the fit
                kept.append(take(X, slice(0, keep - seen), len(y)))
            if self._cores is not None:
                self._cores.step()
            loss = loss + stream.add(X, y)
            seen += len(y)
            if progress_bar and stream.solver.eigenvalues is not None:
                share = float(stream.solver.eigenvalues[: config.rank].sum()
                              / stream.solver.trace)
                pbar.set_postfix(kept_trace=f"{share:.3f}")
        if stream is None:
            raise ValueError("train_loader yielded no batches: nothing to fit.")
        stream.flush()
        if stream.tap is not None:
            self.cache.close_pass()
            self.cache.inputs = kept
        if sink is None:
            self.probe = ProbeInputs(kept, self._probe_cap, stream.rng) if kept else None
        return stream, loss, seen

    def _cache_tap(self, sink: Any) -> Optional[Callable[[Any, float], None]]:
        """Where the first fit pass's factors go (``None``: not kept, or kept already)."""
        if not self._keep or sink is not None or self.cache is not None or self.plan.low_memory:
            return None
        budget = resolve_memory_budget(self.config.memory_budget, self.device)
        self.cache = FactorCache(int(CACHE_SHARE * budget), partial=True)
        return self.cache.offer

    def stream(self, loader: Any, sink: Any) -> FittedData:
        """One more pass over ``loader`` into ``sink``, the fit's way, and what it saw here.

        ``sink`` takes the factors as a solver would (``add_factor``); the GGN is the full
        one (no curvature sub-sampling), so every pass multiplies by the same matrix.
        """
        stream, loss, seen = self._pass(loader, None, None, False, sink)
        return FittedData(seen, float(loss), float(stream.target_energy))

    def products(self, loader: Any, fitted: FittedData) -> GGNProducts:
        """The GGN times vectors, a pass over ``loader`` each (must reproduce ``fitted``)."""
        return GGNProducts(self, loader, fitted)

    @property
    def jacobian(self) -> FactorEngine:
        """An MSE-sum engine on the model (``V = sqrt(2) J^T``), opened once, closed with the fit.

        The passes after the fit (probe, quadrature starts) share it.
        """
        if self._jacobian is None:
            self._jacobian = self._scope.enter_context(
                jacobian_engine(self.target.model, self.config.factor_backend))
        return self._jacobian

    def first_inputs(self, loader: Any, count: int) -> List[Any]:
        """The first ``count`` training inputs as batches (model inputs, on the fit's device).

        The fit's probe inputs where it kept as many, else read from ``loader``.
        """
        kept = [] if self.probe is None else self.probe.batches
        if sum(check_batch(x, None) for x in kept) >= count:
            return kept
        inputs, seen = [], 0
        with torch.random.fork_rng(devices=[]):  # a shuffling loader's draws stay private
            for X, y in loaders.batches(loader, self.target.dict_key_y):
                X = self.target.to_inputs(to_device(X, self.device))
                inputs.append(take(X, slice(0, count - seen), len(y)))
                seen += len(y)
                if seen >= count:
                    break
        return inputs

    def reconfigure(self, config: FitConfig) -> None:
        """Fit again with ``config`` (another rank): a new plan, the same threads."""
        self.config, self.plan = config, None

    def _start(self, X: Any, batch: int, num_data: int, warm_basis: Optional[Tensor],
               sink: Any = None) -> BatchStreamer:
        """At the first batch: plan (thread scope entered once), probe budget, solver, streamer.

        A ``sink`` takes the solver's place, with the full GGN (not sub-sampled).
        """
        if self.plan is None:
            sizes = measure_sizes(self.engine, X, batch, num_data, self.config,
                                  self.group is not None, self._keep)
            plan = choose_plan(sizes, self.config)
            if self.group is not None:
                plan = choose_plan(sizes, self.config, agree(self.group, plan, self.device))
            if self._sizes is None and plan.threads is not None:  # a small fit
                self._scope.enter_context(cpu_threads(plan.threads))
            elif self._sizes is None:  # the cores other processes leave, batch by batch
                self._cores = self._scope.enter_context(SpareCores(self.device))
            self.plan, self._sizes = plan, sizes
            if self.config.probe_inputs:
                self._probe_cap = probe_cap(sizes)
        config = self.config if sink is None else replace(self.config, subsample_fraction=None)
        solver = sink if sink is not None else make_solver(
            self.plan, config, self.params, basis=None if self.group is not None else warm_basis)
        offset = 0 if self.group is None else torch.distributed.get_rank(self.group)
        return BatchStreamer(self.engine, self.plan, config, solver, self.scale,
                             config.seed + offset, self.device)

    def _check(self, stream: BatchStreamer) -> Optional[FastPathCheck]:
        """The sketch's convergence check: an unconverged auto sketch streams, else warns."""
        if self.plan.path != "sketch":
            return None
        value = stream.solver.convergence
        bound, name, moved = SKETCH_CONVERGED[stream.solver.ritz]
        passed = value >= bound
        auto = self.config.solver == SolverKind.AUTO and self.group is None
        action = "kept" if passed else ("streamed instead" if auto else "warned")
        if action == "warned":
            warnings.warn(
                f"solver='sketch' has not converged: its leading {self.config.rank} "
                f"eigenvalues grew by {1 / max(value, 1e-12) - 1:.0%} {moved}, so its "
                "columns miss more of the GGN's leading curvature (a flat spectrum). "
                "solver='streaming' (or 'auto') keeps more of it.",
                UserWarning, stacklevel=4)
        return FastPathCheck(name, value, bound, passed, action)

    def _rounded(self, stream: BatchStreamer) -> bool:
        """Whether a sketch accumulated below float64 rounded its kept eigenvalues."""
        plan = self.plan
        if plan.path != "sketch" or self.params[0].dtype == torch.float64 \
                or plan.sketch_dtype is not None:
            return False
        return not stream.solver.resolves()

    def _reduce(self, stream: BatchStreamer, loss: Any, seen: int, known: Optional[int],
                dtype: torch.dtype) -> Tuple[Any, int, float]:
        """Merge the solvers across processes; the loss, sample count and target sum of all."""
        num_data = seen if known is None else known
        if self.group is None:
            return loss, num_data, float(stream.target_energy)
        import torch.distributed as dist

        stream.solver.merge_across(self.group)
        wide = torch.float64
        totals = torch.stack([torch.as_tensor(loss, device=self.device).to(wide),
                              torch.tensor(float(seen), dtype=wide, device=self.device),
                              stream.target_energy.to(self.device)])
        dist.all_reduce(totals, group=self.group)
        return totals[0].to(dtype), int(totals[1]), float(totals[2])


def probe_cap(sizes: Any) -> int:
    """Return the most vectors per input (``>= 1``) a probe pass may carry in ``sizes.budget``.

    Raises:
        ValueError: If one vector of one input does not fit the budget.
    """
    if sizes.vector_bytes > sizes.budget:
        raise ValueError(
            f"memory_budget={sizes.budget:,} bytes is too small for the residual model's "
            f"probe pass (about {sizes.vector_bytes:,} bytes per input): raise "
            "memory_budget, or pass a residual model without a probe (e.g. "
            "residual='isotropic').")
    return max(1, sizes.budget // sizes.vector_bytes)


def merge_fits(config: FitConfig, previous: FitResult, current: tuple
               ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Return an earlier fit's ``(U, lam, trace, residual)`` merged with this one's.

    Args:
        config: The fit's options.
        previous: The earlier fit.
        current: This fit's ``(U, lam, trace, residual diagonal)``.
    """
    first = (previous.eigenvectors, previous.eigenvalues, previous.trace,
             previous.residual_diagonal)
    # a previous fit without the diagonal (an older state) merges without it
    track = config.track_diagonal and previous.residual_diagonal is not None
    both = StreamingMerge(config.rank, keep_while_fitting(config.rank) - config.rank, track)
    for U, lam, trace, residual in (first, current):
        diagonal = residual + squared_rows_dot(U, lam) if track else None
        both.add_lowrank(U, lam, trace, diagonal)
    return both.result()


def fit_loader(model: nn.Module, likelihood: str, loader: Any, config: FitConfig, *,
               previous: Optional[FitResult] = None, process_group: Any = "default",
               progress_bar: bool = False) -> FitResult:
    """Return the :class:`FitResult` of ``model``'s trainable parameters (:meth:`LoaderFit.run`).

    Args:
        model: The module whose GGN is computed.
        likelihood: ``"classification"`` or ``"regression"``.
        loader: Yields ``(X, y)`` or dict batches (targets under ``"labels"``).
        config: The fit's options.
        previous: An earlier fit to add this loader's curvature to.
        process_group: ``torch.distributed`` group to merge across.
        progress_bar: Show a tqdm progress bar over batches.
    """
    with LoaderFit(FitTarget(model, likelihood), config, process_group) as fit:
        return fit.run(loader, previous=previous, progress_bar=progress_bar)
