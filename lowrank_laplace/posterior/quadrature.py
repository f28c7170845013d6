r"""Lanczos quadrature of the curvature a rank-``r`` fit drops, over the whole training set.

Lanczos runs on the deflated GGN ``P H P`` (``P`` projects out the kept eigenvectors
and the logit-shift directions), one GGN-matrix product over the training loader a step:
Jacobian starts ``P J^T eps`` give the complement variance of the whole data (a
:class:`MeasuredComplement`), Gaussian starts the dropped spectrum's nodes and counts
(log det, marglik). The runs stop once two steps moved both by less than
:data:`TOLERANCE` at :data:`CHECK_PRIOR` times the prior (docs/benchmarks/posterior_quality.md,
"Lanczos quadrature of the dropped curvature").

Shape glossary:
    D: parameters; r: kept rank; s: Lanczos runs; k: steps.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.engine.rng import forked_rng
from lowrank_laplace.fitting import loader as loaders
from lowrank_laplace.fitting.budget import micro_batch_size, resolve_memory_budget
from lowrank_laplace.fitting.config import FitConfig
from lowrank_laplace.fitting.fit import FitResult, FitTarget
from lowrank_laplace.posterior.complement import MeasuredComplement
from lowrank_laplace.posterior.null import NullDirections
from lowrank_laplace.posterior.predictive import jacobian_engine, micro_batches
from lowrank_laplace.utils.batches import batch_device, format_bytes, take, to_device
from lowrank_laplace.utils.checks import check_batch

#: The default of the ``refine_below`` option: below this kept share of the GGN trace a
#: fit with the spectral residual refines its complement itself; every measured problem
#: below it came closer to the full GGN's prior and NLL (docs/benchmarks/).
DEFAULT_REFINE_BELOW = 0.7
#: Lanczos runs of each kind (Jacobian starts, Gaussian starts).
RUNS = 8
#: Fewest and most Lanczos steps (each one pass over the training data).
MIN_STEPS, MAX_STEPS = 4, 32
#: The runs stop when two steps moved the variance and log det by less than this share...
TOLERANCE = 0.01
#: ...at this multiple of the current prior (marglik tuning may move it down).
CHECK_PRIOR = 0.5
#: Training inputs (the first) whose Jacobians start the complement's runs.
START_INPUTS = 256
#: Random output combinations per input of a Jacobian start where the model has more.
START_PROJECTIONS = 16
#: A run ends (an invariant subspace) where a step leaves less than this share of it.
BREAKDOWN = 1e-10
#: Relative tolerance on the summed squared targets of a pass over the fitted data (float64
#: sums of non-negative terms in another order agree far closer).
TARGET_RTOL = 1e-9
#: Share of the memory budget the first pass's factors may keep for the later passes.
CACHE_SHARE = 0.5


@dataclass(frozen=True)
class DroppedQuadrature:
    """What the Lanczos runs found, on the GGN's own scale (before ``h``).

    Attributes:
        complement: The complement variance of the Jacobian starts (whole data).
        nodes: Ritz values of the Gaussian starts: the dropped spectrum's nodes.
        counts: Directions per node; they sum to the dropped directions outside the
            logit-shift ones.
        steps: Lanczos steps (passes over the training data).
        converged: Whether the runs met :data:`TOLERANCE` before :data:`MAX_STEPS`.
        seconds: Wall time of the passes.
        checked_prior: The prior precision the convergence was checked at (below it the
            Gauss rule may under-state the complement).
    """

    complement: MeasuredComplement
    nodes: Tensor
    counts: Tensor
    steps: int
    converged: bool
    seconds: float
    checked_prior: float = 0.0

    def holds(self, complement: Optional[MeasuredComplement]) -> bool:
        """Whether ``complement`` is this refinement's (also after ``load_state_dict``)."""
        return complement is not None and complement.mu.shape == self.complement.mu.shape \
            and bool((complement.mu == self.complement.mu.to(complement.mu)).all())

    def kept_complement(self, probed: Optional[MeasuredComplement]) -> MeasuredComplement:
        """The complement to keep: the probe's where it covered the whole data, else this one."""
        return probed if probed is not None and probed.fraction >= 1 else self.complement

    def state(self) -> Dict[str, Any]:
        """A plain dict for ``state_dict`` (tensors on the CPU)."""
        return {**vars(self), "complement": self.complement.state(), "nodes": self.nodes.cpu(),
                "counts": self.counts.cpu()}

    @classmethod
    def from_state(cls, state: Optional[Dict[str, Any]], device: torch.device
                   ) -> Optional["DroppedQuadrature"]:
        """Inverse of :meth:`state` on ``device`` (``None`` stays ``None``)."""
        if state is None:
            return None
        complement = MeasuredComplement.from_state(state["complement"]).to(device)
        return cls(complement, state["nodes"], state["counts"], int(state["steps"]),
                   bool(state["converged"]), float(state["seconds"]),
                   float(state.get("checked_prior", 0.0)))


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
    def of_fit(cls, fit: FitResult) -> "FittedData":
        """What a pass over a fit's data reproduces (its loss only where reproducible)."""
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


class LanczosRuns:
    """Independent Lanczos runs with full reorthogonalization, one per row of ``starts``.

    Args:
        starts: ``(s, D)`` float64; a zero row is a run without steps.
        steps: The most steps the runs take (their basis is held for them).
    """

    def __init__(self, starts: Tensor, steps: int):
        self.norms = starts.norm(dim=1)
        self.active = self.norms > 0
        self.basis = starts.new_zeros(len(starts), steps + 1, starts.shape[1])  # (s, k, D)
        self.basis[:, 0] = starts / self.norms.clamp(min=torch.finfo(starts.dtype).tiny)[:, None]
        self.alphas: List[Tensor] = []
        self.betas: List[Tensor] = []
        self.length = torch.zeros(len(starts), dtype=torch.long)

    @property
    def current(self) -> Tensor:
        """The vectors the next product is of, ``(s, D)`` (ended runs: zero)."""
        return self.basis[:, len(self.alphas)]

    def step(self, product: Tensor) -> None:
        """One step with ``product`` ``= A q_k`` of :attr:`current`, ``(s, D)`` float64."""
        k = len(self.alphas)
        q, W, held = self.basis[:, k], product.clone(), self.basis[:, : k + 1]
        alpha = (W * q).sum(1)
        W -= alpha[:, None] * q
        for _ in range(2):  # twice is enough: the products carry the model's rounding
            W -= torch.bmm(torch.bmm(held, W[:, :, None]).transpose(1, 2), held)[:, 0]
        beta = W.norm(dim=1)
        self.length += self.active.long()
        self.alphas.append(alpha)
        self.betas.append(beta)
        self.active &= beta > BREAKDOWN * product.norm(dim=1).clamp(min=1e-300)
        self.basis[:, k + 1] = torch.where(self.active[:, None], W / beta.clamp(
            min=torch.finfo(W.dtype).tiny)[:, None], torch.zeros_like(W))

    def rules(self) -> List[Tuple[Tensor, Tensor]]:
        """Every run's Gauss rule: Ritz values (clamped at 0) and weights ``||b||^2 y_1^2``."""
        alphas, betas, out = torch.stack(self.alphas, 1), torch.stack(self.betas, 1), []
        for i, k in enumerate(self.length.tolist()):
            if k == 0:
                out.append((alphas.new_zeros(0), alphas.new_zeros(0)))
                continue
            off = betas[i, : k - 1]
            T = torch.diag(alphas[i, :k]) + torch.diag(off, 1) + torch.diag(off, -1)
            theta, Y = torch.linalg.eigh(T)
            out.append((theta.clamp(min=0), Y[0] ** 2 * self.norms[i] ** 2))
        return out


def gauss_estimates(rules: List[Tuple[Tensor, Tensor]], scale: float, prior: float
                    ) -> Tuple[float, float]:
    """The Jacobian runs' variance and the Gaussian runs' mean ``log(1 + h theta / delta)``.

    What the stopping rule watches, at ``(h, delta)`` (zero without weight).
    """
    estimates = []
    for part, f in ((rules[:RUNS], lambda t: 1 / (scale * t + prior)),
                    (rules[RUNS:], lambda t: torch.log1p(scale * t / prior))):
        nodes, weights = torch.cat([r[0] for r in part]), torch.cat([r[1] for r in part])
        total = float(weights.sum())
        estimates.append(float((weights * f(nodes)).sum()) / total if total > 0 else 0.0)
    return estimates[0], estimates[1]


def lanczos_quadrature(target: FitTarget, loader: Any,
                       kept: Tuple[Tensor, Optional[NullDirections], int],
                       config: FitConfig, prior: Tuple[float, float], fitted: FittedData,
                       group: Any = None) -> DroppedQuadrature:
    """Run the Lanczos quadrature of a fit's dropped curvature over a training loader.

    Args:
        target: What the fit computed the GGN of.
        loader: The training loader (one pass per step).
        kept: ``(U, null, C)``: the kept eigenvectors ``(D, r)``, the checked logit-shift
            directions (``None``: none) and the model's outputs.
        config: The fit's options (backend, memory budget, micro-batches, seed).
        prior: ``(h, delta)``: the scale and the scalar prior the stopping rule checks at.
        fitted: What the fitted data's pass gave, which every pass of the loader must
            reproduce (checked before the first Lanczos step).
        group: The data-parallel process group (products are summed over it), or ``None``.

    Returns:
        The :class:`DroppedQuadrature`.

    Raises:
        MemoryError: If the Lanczos basis of :data:`MAX_STEPS` steps does not fit the
            memory budget (naming ``memory_budget``).
        ValueError: If the loader yields no batch.
        OtherDataError: If a pass of the loader does not reproduce ``fitted``.
    """
    U, null, outputs = kept
    dim, wide = U.shape[0], torch.float64
    _check_basis_memory(dim, config, U.device)

    basis = U.to(wide)

    def project(X: Tensor) -> Tensor:  # rows (s, D)
        X = X - (X @ basis) @ basis.T
        return X if null is None else X - null.expand(null.project(X), dim)

    generator = torch.Generator().manual_seed(config.seed)  # the same on every process
    gaussian = torch.randn(RUNS, dim, generator=generator, dtype=wide).to(U.device)
    jacobian = _jacobian_starts(target, loader, config, outputs, generator).to(U.device)
    if group is not None:
        dist.all_reduce(jacobian, group=group)  # every process's first inputs
    runs = LanczosRuns(project(torch.cat([jacobian, gaussian])), MAX_STEPS)
    start, (scale, delta), steps, converged = time.perf_counter(), prior, 0, False
    history: List[Tuple[float, float]] = []
    cache = FactorCache(int(CACHE_SHARE * resolve_memory_budget(config.memory_budget,
                                                                U.device)))
    with FactorEngine(target.model, loaders.likelihood_loss(target.likelihood)[0],
                      eval_mode=True, backend=config.factor_backend) as engine:
        while steps < MAX_STEPS and bool(runs.active.any()):
            seen = PassSums(loaders.likelihood_loss(target.likelihood)[1])
            product = _ggn_product(cache.passes(_factors(engine, target, loader, config,
                                                         seen)), target, runs.current)
            if seen.batches:  # a fresh pass over the loader (not the kept factors)
                fitted.check(seen.result(), group, U.dtype, product.device)
            if group is not None:
                dist.all_reduce(product, group=group)
            runs.step(project(product))
            steps += 1
            history.append(gauss_estimates(runs.rules(), scale, CHECK_PRIOR * delta))
            if steps >= MIN_STEPS and all(abs(now - then) <= TOLERANCE * abs(now) for now, then
                                          in zip(history[-1], history[-3])):
                converged = True
                break
        converged = converged or not bool(runs.active.any())
    if not converged:
        _warn_unconverged(history, steps, CHECK_PRIOR * delta)
    free = dim - U.shape[1] - (0 if null is None else null.count)
    found = _found(runs.rules(), free, steps, converged, time.perf_counter() - start)
    return replace(found, checked_prior=CHECK_PRIOR * delta)


def _warn_unconverged(history: List[Tuple[float, float]], steps: int, prior: float) -> None:
    """Warn with how much the last two steps moved the estimates at the checked ``prior``."""
    moved = max(abs(now - then) / max(abs(now), 1e-300)
                for now, then in zip(history[-1], history[-min(3, len(history))]))
    warnings.warn(
        f"refine_complement has not converged in {steps} passes at prior precision "
        f"{prior:.3g}: the last two moved the complement variance or log det by "
        f"{moved:.1%} (needs {TOLERANCE:.0%}), so it may under-state the complement "
        "variance there. A larger prior converges in fewer passes: after tuning it, "
        "la.refine_complement(train_loader) measures again.",
        UserWarning, stacklevel=5)  # the caller of la.fit or la.refine_complement


def _found(rules: List[Tuple[Tensor, Tensor]], free: int, steps: int, converged: bool,
           seconds: float) -> DroppedQuadrature:
    """The runs' Gauss rules as a :class:`DroppedQuadrature` (``free`` dropped directions)."""
    mu = torch.cat([r[0] for r in rules[:RUNS]])
    q = torch.cat([r[1] for r in rules[:RUNS]])
    used = [(r, float(r[1].sum())) for r in rules[RUNS:]]
    used, empty = [(r, t) for r, t in used if t > 0], [mu.new_zeros(0)]
    nodes = torch.cat([r[0] for r, _ in used] + empty)
    counts = torch.cat([r[1] / t for r, t in used] + empty) * free / max(len(used), 1)
    complement = MeasuredComplement(mu, q, None, None, q.sum(), 1.0, 0.0)
    return DroppedQuadrature(complement, nodes.cpu(), counts.cpu(), steps, converged, seconds)


def basis_fits(dim: int, config: FitConfig, device: torch.device) -> bool:
    """Whether the Lanczos basis of ``dim`` parameters fits the memory budget."""
    return _basis_bytes(dim) <= resolve_memory_budget(config.memory_budget, device)


def _basis_bytes(dim: int) -> int:
    """Bytes of the Lanczos basis of :data:`MAX_STEPS` steps (float64)."""
    return (MAX_STEPS + 3) * 2 * RUNS * dim * 8


def _check_basis_memory(dim: int, config: FitConfig, device: torch.device) -> None:
    """Refuse a Lanczos basis the memory budget cannot hold."""
    need = _basis_bytes(dim)
    budget = resolve_memory_budget(config.memory_budget, device)
    if need > budget:
        raise MemoryError(
            f"refine_complement: the Lanczos basis of {MAX_STEPS} steps for {dim:,} "
            f"parameters needs about {format_bytes(need)}, above the memory budget of "
            f"{format_bytes(budget)}: raise memory_budget (e.g. memory_budget=0.5 for half "
            "the free memory).")


class PassSums:
    """What one pass over the loader gave: batches, samples, summed loss and squared targets.

    Args:
        scale: laplace-torch's Hessian factor on the loss (as in ``la.loss``).
    """

    def __init__(self, scale: float):
        self.scale, self.batches, self.samples = scale, 0, 0
        self.sums: Optional[Tensor] = None  # loss and targets, float64, on the device

    def add(self, y: Tensor, factor: Any) -> None:
        """Count a micro-batch: its targets ``y`` and its factor's samples and (unscaled) loss."""
        loss = factor.loss
        self.batches += 1
        self.samples += factor.num_samples
        sums = torch.stack([loss.detach().to(torch.float64),
                            loaders.target_energy(y)])
        self.sums = sums if self.sums is None else self.sums + sums

    def result(self) -> FittedData:
        """The pass as a :class:`FittedData` (this process's share)."""
        loss, targets = (0.0, 0.0) if self.sums is None else self.sums.tolist()
        return FittedData(self.samples, self.scale * loss, targets)


def _batches(target: FitTarget, loader: Any) -> Any:
    """The loader's ``(inputs, targets)`` on the model's device, torch's generator left alone."""
    device = target.device or _first_param(target).device
    with torch.random.fork_rng(devices=[]):  # a pass's draws leave the caller's stream
        for X, y in loaders.batches(loader, target.dict_key_y):
            yield target.to_inputs(to_device(X, device)), y.to(device)


def _jacobian_starts(target: FitTarget, loader: Any, config: FitConfig, outputs: int,
                     generator: torch.Generator) -> Tensor:
    """``J^T eps`` over the first :data:`START_INPUTS` training inputs, ``(RUNS, D)`` float64.

    ``eps``: random signs on every output, or on :data:`START_PROJECTIONS` random output
    combinations per input where the model has more outputs.
    """
    projections = START_PROJECTIONS if outputs > START_PROJECTIONS else 0
    param, starts, seen = _first_param(target), None, 0
    with jacobian_engine(target.model, config.factor_backend) as engine:
        for X, _ in _batches(target, loader):
            n = check_batch(X, None)
            micro = micro_batch_size(engine, X, projections or None, config.memory_budget,
                                     config.micro_batch_size)
            for chunk in micro_batches(take(X, slice(0, START_INPUTS - seen), n), micro):
                with forked_rng(batch_device(chunk)):
                    torch.manual_seed(config.seed + seen)
                    factor = engine.compute(chunk, None, mc_samples=projections,
                                            gradient=False)
                signs = torch.randint(0, 2, (factor.num_columns, RUNS), generator=generator)
                signs = (2 * signs - 1).to(param)
                part = factor.matmul(signs).T.to(torch.float64)
                starts = part if starts is None else starts + part
                seen += check_batch(chunk, None)
            if seen >= START_INPUTS:
                break
    if starts is None:
        raise ValueError("refine_complement: train_loader yielded no batches: pass a loader "
                         "of the data the posterior was fitted on.")
    return starts / 2**0.5  # the MSE-sum factor is sqrt(2) J^T


class FactorCache:
    """The factors of a loader's first pass, kept for the later passes while they fit.

    Args:
        room: Bytes the kept blocks may take.
    """

    def __init__(self, room: int):
        self.room, self.kept, self.complete = room, [], False

    def passes(self, fresh: Iterator[Any]) -> Iterable[Any]:
        """The kept factors after a complete first pass, else ``fresh``'s, kept while they fit."""
        if self.complete:
            yield from self.kept
            return
        for factor in fresh:
            if self.room >= 0:
                self.room -= sum(block.nbytes for block in factor.blocks.values())
                if self.room >= 0:
                    self.kept.append(factor)
                else:  # overflowed: every pass recomputes its factors
                    self.kept = []
            yield factor
        self.complete = self.room >= 0


def _factors(engine: FactorEngine, target: FitTarget, loader: Any, config: FitConfig,
             sums: Optional[PassSums] = None) -> Iterator[Any]:
    """The GGN factors of the loader's micro-batches, counted in ``sums`` (if given).

    Monte-Carlo draws are seeded per batch.
    """
    for index, (X, y) in enumerate(_batches(target, loader)):
        n = len(y)
        micro = micro_batch_size(engine, X, config.mc_samples or None, config.memory_budget,
                                 config.micro_batch_size)
        for begin in range(0, n, micro):
            chunk, labels = take(X, slice(begin, begin + micro), n), y[begin:begin + micro]
            with forked_rng(batch_device(chunk)):
                torch.manual_seed(config.seed + 7919 * index + begin)
                factor = engine.compute(chunk, labels, mc_samples=config.mc_samples,
                                        gradient=False)
            if sums is not None:
                sums.add(labels, factor)
            yield factor


def _ggn_product(factors: Iterable[Any], target: FitTarget, Q: Tensor) -> Tensor:
    """``H Q^T`` summed over a pass's factors (laplace-torch's scale), ``(s, D)`` float64."""
    scale = loaders.likelihood_loss(target.likelihood)[1]
    X_t = Q.T.to(_first_param(target).dtype).contiguous()
    out = torch.zeros_like(X_t)
    for factor in factors:
        factor.matmul_add_(out, factor.t_matmul(X_t))
    return out.T.to(torch.float64) * scale


def _first_param(target: FitTarget) -> Tensor:
    """The GGN's first parameter: its dtype and device are the factor's blocks'."""
    return next(p for p in target.model.parameters() if p.requires_grad)
