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
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.engine.rng import forked_rng
from lowrank_laplace.fitting.base import factor_dtype
from lowrank_laplace.fitting.budget import micro_batch_size, resolve_memory_budget
from lowrank_laplace.fitting.config import FitConfig
from lowrank_laplace.fitting.products import FittedData
from lowrank_laplace.posterior.complement import MeasuredComplement
from lowrank_laplace.posterior.null import NullDirections
from lowrank_laplace.posterior.predictive import micro_batches
from lowrank_laplace.utils.batches import batch_device, format_bytes
from lowrank_laplace.utils.checks import check_batch

#: The default of the ``refine_below`` option: below this kept share of the GGN trace a
#: fit with the spectral residual refines its complement itself. Every measured problem
#: below it came closer to the full GGN's prior and NLL; above it (0.876-0.986) small
#: training sets moved away (docs/benchmarks/posterior_quality.md).
DEFAULT_REFINE_BELOW = 0.85
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
        passes: Passes over the training loader (steps after the first use the first
            pass's factors where they fit the memory budget).
    """

    complement: MeasuredComplement
    nodes: Tensor
    counts: Tensor
    steps: int
    converged: bool
    seconds: float
    checked_prior: float = 0.0
    passes: int = 0

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
                   float(state.get("checked_prior", 0.0)),
                   int(state.get("passes", state["steps"])))


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


def lanczos_quadrature(run: Any, loader: Any, kept: Tuple[Tensor, Optional[NullDirections], int],
                       prior: Tuple[float, float], fitted: FittedData) -> DroppedQuadrature:
    """Run the Lanczos quadrature of a fit's dropped curvature over a training loader.

    Args:
        run: The open :class:`~lowrank_laplace.fitting.fit.LoaderFit` of the fitted model:
            its loop makes the passes, its Jacobian engine the starts, its options (memory
            budget, seed) and process group (products summed over it) hold.
        loader: The training loader (one pass per step).
        kept: ``(U, null, C)``: the kept eigenvectors ``(D, r)``, the checked logit-shift
            directions (``None``: none) and the model's outputs.
        prior: ``(h, delta)``: the scale and the scalar prior the stopping rule checks at.
        fitted: What the fitted data's pass gave, which every pass of the loader must
            reproduce (checked before its product is used).

    Returns:
        The :class:`DroppedQuadrature`.

    Raises:
        MemoryError: If the Lanczos basis of :data:`MAX_STEPS` steps does not fit the
            memory budget (naming ``memory_budget``).
        ValueError: If the loader yields no batch.
        OtherDataError: If a pass of the loader does not reproduce ``fitted``.
    """
    U, null, outputs = kept
    dim, wide, config = U.shape[0], torch.float64, run.config
    _check_basis_memory(dim, config, U.device)
    basis = U.to(wide)

    def project(X: Tensor) -> Tensor:  # rows (s, D)
        X = X - (X @ basis) @ basis.T
        return X if null is None else X - null.expand(null.project(X), dim)

    generator = torch.Generator().manual_seed(config.seed)  # the same on every process
    gaussian = torch.randn(RUNS, dim, generator=generator, dtype=wide).to(U.device)
    inputs = run.first_inputs(loader, START_INPUTS)
    jacobian = _jacobian_starts(run.jacobian, inputs, config, outputs, generator).to(U.device)
    if run.group is not None:
        dist.all_reduce(jacobian, group=run.group)  # every process's first inputs
    runs = LanczosRuns(project(torch.cat([jacobian, gaussian])), MAX_STEPS)
    start, (scale, delta), steps, converged = time.perf_counter(), prior, 0, False
    history: List[Tuple[float, float]] = []
    products = run.products(loader, fitted)
    while steps < MAX_STEPS and bool(runs.active.any()):
        runs.step(project(products(runs.current)))
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
    return replace(found, checked_prior=CHECK_PRIOR * delta, passes=products.passes)


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


def _jacobian_starts(engine: FactorEngine, inputs: List[Any], config: FitConfig, outputs: int,
                     generator: torch.Generator) -> Tensor:
    """``J^T eps`` over the first :data:`START_INPUTS` training inputs, ``(RUNS, D)`` float64.

    ``eps``: random signs on every output, or on :data:`START_PROJECTIONS` random output
    combinations per input where the model has more.
    """
    projections = START_PROJECTIONS if outputs > START_PROJECTIONS else 0
    starts, seen = None, 0
    for X in inputs:
        micro = micro_batch_size(engine, X, projections or None, config.memory_budget,
                                 config.micro_batch_size)
        for chunk in micro_batches(X, micro):
            with forked_rng(batch_device(chunk)):
                torch.manual_seed(config.seed + seen)
                factor = engine.compute(chunk, None, mc_samples=projections, gradient=False)
            signs = torch.randint(0, 2, (factor.num_columns, RUNS), generator=generator)
            part = factor.matmul((2 * signs - 1).to(factor_dtype(factor))).T.to(torch.float64)
            starts = part if starts is None else starts + part
            seen += check_batch(chunk, None)
    if starts is None:
        raise ValueError("refine_complement: train_loader yielded no batches: pass a loader "
                         "of the data the posterior was fitted on.")
    return starts / 2**0.5  # the MSE-sum factor is sqrt(2) J^T
