r"""The dropped curvature, measured: Lanczos quadrature on the GGN outside the kept basis.

Runs on the deflated GGN ``P H P`` (``P`` projects out the kept eigenvectors and the
logit-shift directions), by the fit's own kept factors (no pass over the data) or by
passes over a loader (``la.refine_complement``). Jacobian starts ``P J_S^T eps`` of the
first inputs ``S`` give the complement variance ``v`` per unit of Jacobian energy by Gauss
quadrature; on the fit's factors they multiply by the GGN without ``S``'s own curvature,
so ``v`` is that of unseen inputs. Gaussian starts give the dropped spectrum's nodes and
counts (log det, marglik). Each run's Gauss and Gauss-Radau rules bound both from either
side; the runs stop once the bracket is within :data:`TOLERANCE` at :data:`CHECK_PRIOR`
times the prior and keep its midpoint, the two rules at half weight (docs/explanation.md).

Shape glossary:
    D: parameters; r: kept rank; s: Lanczos runs; k: steps.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.engine.rng import forked_rng
from lowrank_laplace.fitting.base import factor_dtype
from lowrank_laplace.fitting.budget import micro_batch_size, resolve_memory_budget
from lowrank_laplace.fitting.config import FitConfig
from lowrank_laplace.fitting.products import FactorCache, FittedData, kept_products
from lowrank_laplace.posterior.null import NullDirections
from lowrank_laplace.posterior.predictive import micro_batches
from lowrank_laplace.posterior.probe import ProbeColumns
from lowrank_laplace.utils.batches import batch_device, format_bytes, take
from lowrank_laplace.utils.checks import check_batch, outside_stacklevel

#: Lanczos runs of each kind (Jacobian starts, Gaussian starts).
RUNS = 8
#: Fewest and most Lanczos steps (fewer where the basis of more exceeds the memory budget).
MIN_STEPS, MAX_STEPS = 2, 32
#: The runs stop when half the bracket of the variance and log det is this share of them...
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
        mu: Ritz values of the Jacobian starts (the complement's nodes).
        q: Their weights, the starts' Jacobian energy on each.
        nodes: Ritz values of the Gaussian starts: the dropped spectrum's nodes.
        counts: Directions per node; they sum to the dropped directions outside the
            logit-shift ones.
        steps: Lanczos steps (``0``: nothing measured, the mean dropped eigenvalue in
            every dropped direction, :meth:`flat`).
        converged: Whether the runs met :data:`TOLERANCE` before :data:`MAX_STEPS`.
        seconds: Wall time of the runs.
        checked_prior: The prior precision the convergence was checked at (below it the
            Gauss rule may under-state the complement).
        passes: Passes over the training loader (``0``: the fit's own factors).
        samples: ``(m, K, N)``: inputs held out of the Jacobian runs' GGN, inputs whose
            factors the runs multiplied by, inputs fitted.
        error: Half the Gauss/Gauss-Radau bracket of the variance and log det at the
            checked prior, relative: a bound on the kept midpoint rule's error there.
        columns: The Jacobian starts as the rank check reads them (not saved).
    """

    mu: Tensor
    q: Tensor
    nodes: Tensor
    counts: Tensor
    steps: int
    converged: bool
    seconds: float
    checked_prior: float = 0.0
    passes: int = 0
    samples: Tuple[int, int, int] = (0, 0, 0)
    error: float = 0.0
    columns: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def flat(cls, mass: float, free: int) -> "DroppedQuadrature":
        """Nothing measured: the mean dropped eigenvalue in all ``free`` directions."""
        level, one = torch.tensor([mass / max(free, 1), 1.0], dtype=torch.float64).split(1)
        return cls(level, one, level.clone(), one * max(free, 0), 0, False, 0.0)

    def variance(self, scale: Tensor, prior: Tensor, anchor: float) -> Tensor:
        r"""The complement variance ``v = sum q / (h mu + delta) / sum q`` (float64).

        Clamped to ``[1 / (h lambda_r + delta), 1 / delta]``; of the broadcast shape of
        ``scale`` and ``prior`` (one per layer, say), differentiable in both.
        """
        mu = self.mu.to(device=prior.device, dtype=torch.float64)
        q = self.q.to(mu)
        h, delta = (torch.as_tensor(x).to(mu)[..., None] for x in (scale, prior))
        value = (q / (h * mu + delta)).sum(-1) / q.sum().clamp(min=torch.finfo(mu.dtype).tiny)
        h, delta = h[..., 0], delta[..., 0]
        return torch.minimum(torch.maximum(value, 1 / (h * anchor + delta)), 1 / delta)

    def shift(self, scale: Tensor, prior: Tensor, anchor: float) -> Tensor:
        """The precision shift ``rho = 1 / v - delta >= 0``, shaped as :meth:`variance`."""
        delta = torch.as_tensor(prior).to(torch.float64)
        return (1 / self.variance(scale, delta, anchor) - delta).clamp(min=0)

    def logdet(self, scale: Tensor, prior: Tensor, num: Any) -> Tensor:
        """The ``num`` dropped directions' log det: the measured nodes, the rest the prior's.

        Of the broadcast shape of ``scale`` and ``prior``, as :meth:`variance`.
        """
        nodes = self.nodes.to(device=prior.device, dtype=torch.float64)
        counts = self.counts.to(nodes)
        h, delta = (torch.as_tensor(x).to(nodes)[..., None] for x in (scale, prior))
        return (counts * torch.log(h * nodes + delta)).sum(-1) \
            + (num - counts.sum()) * delta[..., 0].log()

    def state(self) -> Dict[str, Any]:
        """A plain dict for ``state_dict`` (tensors on the CPU, without the columns)."""
        values = {k: v for k, v in vars(self).items() if k != "columns"}
        return {**values, **{k: getattr(self, k).cpu() for k in ("mu", "q", "nodes", "counts")},
                "samples": list(self.samples)}

    @classmethod
    def from_state(cls, state: Optional[Dict[str, Any]]) -> Optional["DroppedQuadrature"]:
        """Inverse of :meth:`state` (``None`` stays ``None``; an older version's converts)."""
        if state is None:
            return None
        if "mu" not in state:  # an older version's: its complement held the Jacobian rule
            state = {**state, **state["complement"], "samples": (0, 0, 0)}
        return cls(state["mu"], state["q"], state["nodes"], state["counts"], int(state["steps"]),
                   bool(state["converged"]), float(state["seconds"]),
                   float(state.get("checked_prior", 0.0)), int(state.get("passes", state["steps"])),
                   tuple(int(x) for x in state["samples"]),
                   float(state.get("error", state.get("moved", 0.0))))


class LanczosRuns:
    """Independent Lanczos runs with full reorthogonalization, one per row of ``starts``.

    Args:
        starts: ``(s, D)`` float64; a zero row is a run without steps.
        steps: The most steps the runs take (their basis is held for them).
    """

    def __init__(self, starts: Tensor, steps: int):
        self.norms = starts.norm(dim=1)
        self.active = self.norms > 0
        self.basis = starts.new_empty(len(starts), steps + 1, starts.shape[1])  # (s, k, D)
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

    def rules(self) -> Tuple[List[Tuple[Tensor, Tensor]], List[Tuple[Tensor, Tensor]]]:
        """Every run's Gauss and Gauss-Radau rules: Ritz values (clamped at 0), weights.

        Weights ``||b||^2 y_1^2``; Gauss-Radau fixes a node at 0 (``T`` bordered by ``beta_k``
        and ``beta_k^2 (T^{-1})_{kk}``): the bound of both estimates from Gauss's other side.
        """
        alphas, betas = torch.stack(self.alphas, 1), torch.stack(self.betas, 1)
        gauss, radau = (dict.fromkeys(range(len(self.length)), (alphas.new_zeros(0),) * 2)
                        for _ in range(2))
        for k in set(self.length.tolist()) - {0}:  # batched eigh per length and rule
            runs = (self.length == k).nonzero()[:, 0]
            off = torch.diag_embed(betas[runs, : k - 1], offset=1)
            T = torch.diag_embed(alphas[runs, :k]) + off + off.mT
            eig = torch.linalg.eigh(T)
            (theta, Y), last = eig, betas[runs, k - 1]
            corner = (Y[:, -1] ** 2 / theta).sum(1) * last ** 2
            ok = torch.isfinite(corner) & (theta.min(1).values > 0)  # else Gauss's node 0
            T = torch.nn.functional.pad(T, (0, 1, 0, 1))
            T[:, k - 1, k] = T[:, k, k - 1] = torch.where(ok, last, 0)
            T[:, k, k] = torch.where(ok, corner, 0)
            for out, (nodes, vectors) in ((gauss, eig), (radau, torch.linalg.eigh(T))):
                weights = vectors[:, 0] ** 2 * self.norms[runs, None] ** 2
                out.update(zip(runs.tolist(), zip(nodes.clamp(min=0), weights)))
        return list(gauss.values()), list(radau.values())


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
    """Measure a fit's dropped curvature by Lanczos quadrature.

    Args:
        run: The open :class:`~lowrank_laplace.fitting.fit.LoaderFit` of the fitted model:
            its kept factors or its loop make the products, its Jacobian engine the starts,
            its options (memory budget, seed) and process group (products summed over it)
            hold.
        loader: The training loader, one pass per step; ``None``: the fit's own kept
            factors (``run.cache``), with the Jacobian runs' inputs held out.
        kept: ``(U, null, C)``: the kept eigenvectors ``(D, r)``, the checked logit-shift
            directions (``None``: none) and the model's outputs.
        prior: ``(h, delta)``: the scale and the scalar prior the stopping rule checks at.
        fitted: What the fitted data's pass gave, which every pass of the loader must
            reproduce (checked before its product is used).

    Returns:
        The :class:`DroppedQuadrature`, with the starts' columns for the rank check.

    Raises:
        MemoryError: If the Lanczos basis of :data:`MIN_STEPS` steps does not fit the
            memory budget (naming ``memory_budget``); between them, the runs take the
            steps it holds.
        ValueError: If the loader yields no batch.
        OtherDataError: If a pass of the loader does not reproduce ``fitted``.
    """
    U, null, outputs = kept
    dim, wide, config = U.shape[0], torch.float64, run.config
    most = _check_basis_memory(dim, config, U.device)
    basis = U.to(wide)

    def project(X: Tensor) -> Tensor:  # rows (s, D)
        X = X - (X @ basis) @ basis.T
        return X if null is None else X - null.expand(null.project(X), dim)

    start = time.perf_counter()
    generator = torch.Generator().manual_seed(config.seed)  # the same on every process
    gaussian = torch.randn(RUNS, dim, generator=generator, dtype=wide).to(U.device)
    if loader is None:
        products = KeptProducts(run.cache, fitted.samples, run.group)
        inputs, samples = products.inputs, products.samples
    else:
        products, inputs = run.products(loader, fitted), run.first_inputs(loader, START_INPUTS)
        samples = (0, fitted.samples, fitted.samples)
    jacobian = _jacobian_starts(run.jacobian, inputs, config, outputs, generator).to(U.device)
    if run.group is not None:
        dist.all_reduce(jacobian, group=run.group)  # every process's first inputs
    columns = start_columns(jacobian, basis, null)
    runs = LanczosRuns(project(torch.cat([jacobian, gaussian])), most)
    (scale, delta), steps, width = prior, 0, 0.0
    while steps < most and bool(runs.active.any()):
        runs.step(project(products(runs.current)))
        steps += 1
        rules = runs.rules()
        width = bracket_width(rules, scale, CHECK_PRIOR * delta)
        if steps >= MIN_STEPS and width <= TOLERANCE:
            break
    converged = width <= TOLERANCE or not bool(runs.active.any())
    if not converged:
        _warn_unconverged(width, (steps, most < MAX_STEPS), CHECK_PRIOR * delta)
    free = dim - U.shape[1] - (0 if null is None else null.count)
    midpoint = [(torch.cat([g[0], r[0]]), torch.cat([g[1], r[1]]) / 2) for g, r in zip(*rules)]
    found = _found(midpoint, free, steps, converged, time.perf_counter() - start)
    return replace(found, checked_prior=CHECK_PRIOR * delta, passes=products.passes,
                   error=width, samples=samples, columns=columns)


class KeptProducts:
    """``X -> X H`` by a fit's kept factors, the first :data:`RUNS` rows without their inputs.

    The GGN of the ``K`` inputs kept is scaled to the ``N`` fitted; the first ``m`` (at most
    :data:`START_INPUTS` and a quarter of ``K``) start the Jacobian runs, whose rows
    multiply by the GGN without them, scaled by ``N / (K - m)``: the complement variance
    of unseen inputs, which the training inputs' own curvature would lower. The other
    rows add the ``m`` inputs' product: each factor multiplies only the rows it is in.

    Args:
        cache: The fit's kept factors and first inputs.
        num_data: Inputs fitted ``N`` (over all processes).
        group: The fit's process group (``None``: one process).

    Attributes:
        inputs: The held-out inputs, as batches; samples: ``(m, K, N)``; passes: none.
    """

    def __init__(self, cache: FactorCache, num_data: int, group: Any):
        self.group, self.passes = group, 0
        kept = cache.samples
        first = sum(check_batch(x, None) for x in cache.inputs)
        count = min(first, START_INPUTS, kept // 4)  # held out: none of under four inputs
        self.inputs, left = [], count or min(first, START_INPUTS)
        for x in cache.inputs:
            n = check_batch(x, None)
            if left > 0:
                self.inputs.append(take(x, slice(0, left), n))
            left -= n
        self.held, self.rest = cache.split(count)
        totals = torch.tensor([float(count), float(kept)], dtype=torch.float64)
        if group is not None:
            dist.all_reduce(totals, group=group)
        self.samples = (int(totals[0]), int(totals[1]), int(num_data))

    def __call__(self, X: Tensor) -> Tensor:
        """``X H`` of rows ``X`` ``(s, D)``, float64, summed over the fit's processes."""
        held, kept, num_data = self.samples
        out = self._product(X, self.rest)
        out[RUNS:] += self._product(X[RUNS:], self.held)
        out[:RUNS] *= num_data / (kept - held)
        out[RUNS:] *= num_data / kept
        return out

    def _product(self, X: Tensor, factors: List[Tuple[Any, float]]) -> Tensor:
        """``X H`` by ``factors`` (zero without), summed over processes."""
        out = kept_products(X, factors, factor_dtype(factors[0][0])) if factors else \
            torch.zeros_like(X, dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(out, group=self.group)
        return out


def start_columns(starts: Tensor, basis: Tensor, null: Optional[NullDirections]
                  ) -> ProbeColumns:
    """The Jacobian starts as the rank check reads them: energies, on ``U`` and on the null."""
    return ProbeColumns((starts ** 2).sum(1), starts @ basis,
                        None if null is None else (null.project(starts) ** 2).sum(1))


def bracket_width(rules: Tuple[List[Tuple[Tensor, Tensor]], ...], scale: float, prior: float
                  ) -> float:
    """Half the bracket of the Gauss and Gauss-Radau ``rules`` over its midpoint (error bound)."""
    pairs = zip(*(gauss_estimates(part, scale, prior) for part in rules))
    return max(abs(g - r) / max(abs(g + r), 1e-300) for g, r in pairs)


def _warn_unconverged(width: float, steps: Tuple[int, bool], prior: float) -> None:
    """Warn with the bracket's width at the checked ``prior`` (``steps``: taken, capped)."""
    capped = " (all that memory_budget holds: a larger one allows more)" if steps[1] else ""
    warnings.warn(
        f"The Lanczos quadrature of the dropped curvature has not converged in {steps[0]} "
        f"steps{capped} at prior precision {prior:.3g}: the complement variance or log det is "
        f"known to within {width:.1%} (needs {TOLERANCE:.0%}), so it may be off by as much "
        "there. A larger prior converges in fewer steps: after tuning it, "
        "la.refine_complement(train_loader) measures again.",
        UserWarning, stacklevel=outside_stacklevel())


def _found(rules: List[Tuple[Tensor, Tensor]], free: int, steps: int, converged: bool,
           seconds: float) -> DroppedQuadrature:
    """The runs' Gauss rules as a :class:`DroppedQuadrature` (``free`` dropped directions)."""
    mu = torch.cat([r[0] for r in rules[:RUNS]])
    q = torch.cat([r[1] for r in rules[:RUNS]])
    used = [(r, float(r[1].sum())) for r in rules[RUNS:]]
    used, empty = [(r, t) for r, t in used if t > 0], [mu.new_zeros(0)]
    nodes = torch.cat([r[0] for r, _ in used] + empty)
    counts = torch.cat([r[1] / t for r, t in used] + empty) * free / max(len(used), 1)
    return DroppedQuadrature(mu.cpu(), q.cpu(), nodes.cpu(), counts.cpu(), steps, converged,
                             seconds)


def step_budget(dim: int, config: FitConfig, device: torch.device) -> int:
    """The most steps (at most :data:`MAX_STEPS`) whose float64 basis fits the memory budget."""
    budget = resolve_memory_budget(config.memory_budget, device)
    return min(MAX_STEPS, budget // _step_bytes(dim) - 3)


def _step_bytes(dim: int) -> int:
    """Bytes one more Lanczos step adds to the float64 basis of every run (of both kinds)."""
    return 2 * RUNS * dim * 8


def _check_basis_memory(dim: int, config: FitConfig, device: torch.device) -> int:
    """The most steps the memory budget holds; a MemoryError below :data:`MIN_STEPS`."""
    most = step_budget(dim, config, device)
    if most < MIN_STEPS:
        need, budget = (format_bytes(x) for x in ((MIN_STEPS + 3) * _step_bytes(dim),
                        resolve_memory_budget(config.memory_budget, device)))
        raise MemoryError(f"refine_complement: the Lanczos basis of {MIN_STEPS} steps for "
                          f"{dim:,} parameters needs about {need}, above the memory budget "
                          f"of {budget}: raise memory_budget (e.g. memory_budget=0.5 for "
                          "half the free memory).")
    return most


def _jacobian_starts(engine: FactorEngine, inputs: List[Any], config: FitConfig, outputs: int,
                     generator: torch.Generator) -> Tensor:
    """``J^T eps`` over the first :data:`START_INPUTS` training inputs, ``(RUNS, D)`` float64.

    ``eps``: random signs on every output (or :data:`START_PROJECTIONS` random output
    combinations per input where it has more), each input's scaled to unit Jacobian energy:
    ``v`` is the mean of the inputs' own levels, not one their energies weight.
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
            n, dtype = check_batch(chunk, None), factor_dtype(factor)
            energy = sum(b.row_sq_norms() for b in factor.group_blocks()).reshape(-1, n).sum(0)
            scale = energy.clamp(min=torch.finfo(dtype).tiny).rsqrt().repeat(
                factor.num_columns // n)  # columns (c, n)
            part = factor.matmul((2 * signs - 1).to(dtype) * scale[:, None].to(dtype))
            part = part.T.to(torch.float64)
            starts = part if starts is None else starts + part
            seen += n
    if starts is None:
        raise ValueError("refine_complement: train_loader yielded no batches: pass a loader "
                         "of the data the posterior was fitted on.")
    return starts / 2**0.5  # the MSE-sum factor is sqrt(2) J^T
