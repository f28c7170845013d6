r"""``hessian_structure="lowrank_ggn"`` for laplace-torch.

After ``import lowrank_laplace``, laplace-torch's own factory returns these classes::

    from laplace import Laplace
    la = Laplace(model, "classification", subset_of_weights="all",
                 hessian_structure="lowrank_ggn")
    la.fit(train_loader)

The curvature is laplace-torch's GGN (a sum over the training data, times
``1/sigma^2/T``), represented by its exact leading eigenpairs: ``V`` of every
micro-batch comes from one BackPACK backward pass and is merged into a rank-``r``
eigendecomposition by :class:`~lowrank_laplace.merge.StreamingMerge`. The posterior
precision ``P = U diag(ell) U^T + P_0`` is handled by
:class:`~lowrank_laplace.posterior.LowRankPrecision` (determinant lemma, Woodbury),
and the GLM predictive by :mod:`lowrank_laplace.predictive` without materialising the
``(B, C, D)`` Jacobian. This is the only module that imports laplace-torch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import MutableMapping
from typing import Any, List, Optional, Tuple, Union

import torch
import tqdm
from laplace.baselaplace import ParametricLaplace
from laplace.lllaplace import LLLaplace
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader

from lowrank_laplace._checks import check_batch, take, to_device
from lowrank_laplace._fitting import (
    BatchStreamer,
    micro_batch_size,
    process_rank,
    resolve_memory_budget,
    resolve_process_group,
)
from lowrank_laplace.engine import FactorEngine, check_backend
from lowrank_laplace.merge import StreamingMerge
from lowrank_laplace.posterior import GramCache, LowRankPrecision
from lowrank_laplace.predictive import batched_glm_moments, glm_moments, jacobian_energies
from lowrank_laplace.residual import (
    DEFAULT_RESIDUAL,
    Residual,
    check_residual,
    jacobian_exponent,
)
from lowrank_laplace.sketch import SketchMerge

DEFAULT_RANK = 100
#: The fitting algorithms (see the ``solver`` argument).
SOLVERS = ("streaming", "sketch")


def _check_positive(name: str, value) -> None:
    """Refuse a non-positive or non-finite hyperparameter where it is set."""
    values = torch.as_tensor(value).detach()
    if not (values.numel() and bool(torch.isfinite(values).all() and (values > 0).all())):
        raise ValueError(
            f"{name} must be positive and finite, got {value!r}: a zero or negative "
            f"{name} has no Gaussian posterior."
        )


def _resolve_residual(residual: str, diagonal_correction: Optional[bool]) -> str:
    """The residual model, honouring the deprecated ``diagonal_correction`` flag."""
    check_residual(residual)
    if diagonal_correction is None:
        return residual
    alias = "diagonal" if diagonal_correction else "none"
    warnings.warn(
        f"diagonal_correction={diagonal_correction!r} is deprecated: pass "
        f"residual={alias!r} instead.", FutureWarning, stacklevel=4,
    )
    if residual not in (DEFAULT_RESIDUAL, alias):
        raise ValueError(
            f"diagonal_correction={diagonal_correction!r} (residual={alias!r}) contradicts "
            f"residual={residual!r}: pass residual alone."
        )
    return alias

class LowRankGGNLaplace(ParametricLaplace):
    r"""Full-network Laplace with the GGN's exact leading eigenspace as curvature.

    Accepts every argument of laplace-torch's ``ParametricLaplace`` (``backend`` is
    accepted for compatibility and only used by inherited code paths, e.g. the
    Jacobian fallback when ``enable_backprop=True``), plus:

    Args:
        model: The network (its parameters with ``requires_grad=True`` are the
            Laplace parameters).
        likelihood: ``"classification"`` or ``"regression"``.
        sigma_noise: Observation noise (regression).
        prior_precision: Scalar, per-layer or per-parameter prior precision.
        prior_mean: Prior mean.
        temperature: Posterior temperature.
        enable_backprop: Backpropagate through the predictive (uses laplace-torch's
            Jacobians instead of the engine).
        dict_key_x: laplace-torch's key for dict inputs (dict batches are passed
            whole to the model, as in laplace-torch).
        dict_key_y: The key of the targets in dict batches.
        backend: laplace-torch curvature backend for inherited Jacobian paths; an
            empirical-Fisher backend (``*EF``) raises, since the curvature is always
            the GGN.
        backend_kwargs: Its keyword arguments (``stochastic=True`` needs
            ``mc_samples >= 1``).
        asdl_fisher_kwargs: Ignored (laplace-torch compatibility).
        rank: Number of leading GGN eigenpairs kept (default 100). Exact whenever
            the GGN's rank over the whole training set fits.
        oversampling: Extra eigenpairs kept while streaming (default ``rank // 5``).
        mc_samples: ``0`` for the exact GGN, ``M >= 1`` for a Monte-Carlo GGN with
            ``M`` sampled outputs per sample (classification).
        subsample_fraction: Curvature from this random fraction of every batch
            (rescaled to stay unbiased); ``None`` uses every sample.
        memory_budget: Bytes (or a fraction of free memory) one micro-batch's ``V``
            may take; batches are split automatically. Default: 1 GiB on the CPU,
            a quarter of the free device memory (at least 1 GiB) on CUDA.
        micro_batch_size: Upper bound on samples per backward pass; ``None``
            chooses it from the memory budget and a cost model of the merge.
        residual: Model of the curvature the rank truncation drops (see
            :mod:`lowrank_laplace.residual`): ``"spectral"`` (default: a power-law
            tail continuing the kept spectrum, holding the exact dropped trace, in
            random directions of the complement, its variances weighted by where
            inputs' Jacobians fall; see ``jacobian_exponent``), ``"isotropic"`` (its mean
            eigenvalue in every dropped direction), ``"diagonal"`` (the exact
            diagonal of the dropped curvature, ``P = U diag(ell) U^T + diag(p0 + h r)``
            with ``r = diag(H) - diag(U diag(lambda) U^T)``; the fit tracks the GGN
            diagonal) or ``"none"`` (the dropped directions see only the prior). All
            but ``"diagonal"`` keep ``O(r)`` closed forms for a scalar prior.
        diagonal_correction: Deprecated alias: ``True`` means
            ``residual="diagonal"``, ``False`` means ``residual="none"``.
        seed: Seed for curvature sub-sampling and the Monte-Carlo draws of
            ``mc_samples`` (offset by the process rank when fitting data-parallel);
            the fit leaves the global random state untouched.
        low_memory: Never hold a micro-batch's whole ``V``: each micro-batch is one
            merge computed by two backward passes (Gram matrix, diagonal and
            products with the basis; then the basis update ``V C``), each holding one
            layer's block at a time, so ``memory_budget`` buys larger micro-batches
            for ~1.5x the backward cost. Ignored when the fit sums densely
            (``fit_path == "dense"``).
        factor_backend: What computes the GGN factor ``V`` (laplace-torch's
            ``backend`` names its own curvature class, hence another name):
            ``"backpack"`` (one BackPACK backward pass; models of modules it knows),
            ``"functorch"`` (vmapped torch.func products; any differentiable model:
            attention, LayerNorm, LSTM, tied weights, dict batches) or ``"auto"``
            (BackPACK where it applies). ``factor_backend_used`` tells which ran.
        solver: How the batches' factors become the leading eigenpairs:
            ``"streaming"`` (default: truncated merges, see
            :class:`~lowrank_laplace.merge.StreamingMerge`) or ``"sketch"`` (opt-in,
            approximate: a one-pass randomized Nyström sketch with ``rank +
            oversampling`` columns, :class:`~lowrank_laplace.sketch.SketchMerge`;
            no eigenproblem per merge, so faster on small and fully-connected
            models, slower with millions of parameters and few columns per sample;
            its eigenvalues under-estimate the GGN's wherever its rank exceeds the
            sketch, so it keeps less of the trace). Both are exact when
            the GGN's rank over the data fits, and neither applies when the fit sums
            densely (``fit_path == "dense"``). Where a single streaming merge of all
            the data's columns fits the merge plan (few columns per sample, e.g. the
            Monte-Carlo GGN), ``"sketch"`` takes that merge instead (``fit_path ==
            "streaming"``): it multiplies ``V`` once where the sketch multiplies it
            twice, and it is the exact truncation.
    """

    _key = ("all", "lowrank_ggn")
    #: Training inputs (the first the loader yields) on which the fit measures the
    #: kept eigenvectors' Jacobian energies for the spectral residual's weights.
    _probe_size = 256
    #: Random output combinations over the whole probe for those energies: each input
    #: carries ``ceil(_probe_columns / inputs)`` of them instead of its ``C`` outputs
    #: (an unbiased estimate), or all ``C`` where that is not fewer; ``None`` always
    #: measures exactly. On the digits MLP and DeepOBS 3c3d (256 inputs, 2 of 10
    #: outputs each) the fitted exponent moved by under 0.005 (0.652 +- 0.002 vs 0.656;
    #: 0.935 +- 0.002 vs 0.936) at a fifth of the exact pass's cost.
    _probe_columns: Optional[int] = 512
    #: The fit sums the GGN densely and eigendecomposes it once (exact) when the
    #: ``D x D`` matrix fits ``memory_budget`` and a cost model finds it cheaper than
    #: streaming merges, and also, up to this many parameters (typically a last
    #: layer), whenever streaming would truncate; ``0`` always streams.
    _dense_max_dim = 2048
    #: The sketch's test matrix (``solver="sketch"``, see
    #: :class:`~lowrank_laplace.sketch.SketchMerge`): ``"kronecker"`` draws Khatri-Rao
    #: columns in the slices of matrix-shaped weights, so the factored linear layers'
    #: products with it come from their Kronecker factors and the slices are kept as
    #: those factors (2 CPU cores: the 784-128-64-10 MLP's exact sketch fit 0.49 ->
    #: 0.37 s, DeepOBS 2c2d's 18.5 -> 11.0 s at a 2.05 GiB peak instead of 3.50; kept
    #: trace within half a point); ``"gaussian"`` draws every entry Gaussian.
    _sketch_test_matrix = "kronecker"
    #: ``"dense"``, ``"streaming"`` or ``"sketch"``: the path the last fit took.
    fit_path: Optional[str] = None

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        sigma_noise: Union[float, Tensor] = 1.0,
        prior_precision: Union[float, Tensor] = 1.0,
        prior_mean: Union[float, Tensor] = 0.0,
        temperature: float = 1.0,
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend: Any = None,
        backend_kwargs: Optional[dict] = None,
        asdl_fisher_kwargs: Optional[dict] = None,
        *,
        rank: int = DEFAULT_RANK,
        oversampling: Optional[int] = None,
        mc_samples: int = 0,
        subsample_fraction: Optional[float] = None,
        memory_budget: Union[int, float, None] = None,
        micro_batch_size: Optional[int] = None,
        residual: str = DEFAULT_RESIDUAL,
        diagonal_correction: Optional[bool] = None,
        seed: int = 0,
        low_memory: bool = False,
        factor_backend: str = "auto",
        solver: str = "streaming",
    ):
        self._set_options(rank, oversampling, mc_samples, subsample_fraction, memory_budget,
                          micro_batch_size, residual, diagonal_correction, seed, low_memory,
                          solver)
        self.factor_backend = check_backend(factor_backend)
        self.factor_backend_used: Optional[str] = None
        super().__init__(
            model, likelihood, sigma_noise=sigma_noise, prior_precision=prior_precision,
            prior_mean=prior_mean, temperature=temperature, enable_backprop=enable_backprop,
            dict_key_x=dict_key_x, dict_key_y=dict_key_y, backend=backend,
            backend_kwargs=backend_kwargs,
        )
        if not isinstance(self, LLLaplace):  # the last-layer class checks after its options
            self._check_backend()

    def _expected_dim(self) -> Optional[int]:
        """Number of Laplace parameters a loaded state must have (``None``: unknown yet)."""
        return self.n_params

    # ---------------------------------------------------------- hyperparameters
    @property
    def prior_precision(self) -> Tensor:
        """laplace-torch's prior precision (scalar, per layer or per parameter), ``> 0``."""
        return ParametricLaplace.prior_precision.fget(self)

    @prior_precision.setter
    def prior_precision(self, value) -> None:
        _check_positive("prior_precision", value)
        ParametricLaplace.prior_precision.fset(self, value)

    @property
    def sigma_noise(self) -> Tensor:
        """laplace-torch's observation noise (regression), ``> 0``."""
        return ParametricLaplace.sigma_noise.fget(self)

    @sigma_noise.setter
    def sigma_noise(self, value) -> None:
        _check_positive("sigma_noise", value)
        ParametricLaplace.sigma_noise.fset(self, value)

    @property
    def temperature(self) -> float:
        """Posterior temperature ``T > 0`` (the curvature is scaled by ``1/T``)."""
        return self._temperature

    @temperature.setter
    def temperature(self, value) -> None:
        _check_positive("temperature", value)
        self._temperature = value

    def _check_backend(self) -> None:
        """Refuse laplace-torch backend settings that ask for another curvature."""
        name = self._backend_cls.__name__
        if name.endswith("EF"):
            raise ValueError(
                "hessian_structure='lowrank_ggn' computes the exact (or Monte-Carlo) GGN "
                f"with its own engine; backend={name} asks for the empirical Fisher, "
                "which it does not provide. Leave backend out or pass a GGN backend."
            )
        if self._backend_kwargs.get("stochastic") and not self.mc_samples:
            raise ValueError(
                "backend_kwargs={'stochastic': True} asks for a Monte-Carlo GGN: pass "
                "mc_samples=1 (the lowrank_ggn option) instead."
            )

    def _set_options(self, rank, oversampling, mc_samples, subsample_fraction, memory_budget,
                     micro_batch_size, residual, diagonal_correction, seed,
                     low_memory=False, solver="streaming") -> None:
        StreamingMerge(rank, oversampling or 0)  # validates rank and oversampling
        if solver not in SOLVERS:
            raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}.")
        self.solver = solver
        self.residual = _resolve_residual(residual, diagonal_correction)
        if isinstance(mc_samples, bool) or int(mc_samples) != mc_samples or mc_samples < 0:
            raise ValueError(f"mc_samples must be 0 or a positive integer, got {mc_samples!r}.")
        if subsample_fraction is not None and not 0 < subsample_fraction <= 1:
            raise ValueError(
                f"subsample_fraction must lie in (0, 1], got {subsample_fraction!r}."
            )
        self.rank = int(rank)
        self.oversampling = self.rank // 5 if oversampling is None else int(oversampling)
        self.mc_samples = int(mc_samples)
        self.subsample_fraction = subsample_fraction
        if micro_batch_size is not None and (int(micro_batch_size) != micro_batch_size
                                             or micro_batch_size < 1):
            raise ValueError(
                f"micro_batch_size must be a positive integer, got {micro_batch_size!r}."
            )
        self.memory_budget = memory_budget
        self.micro_batch_size = micro_batch_size
        self.low_memory = bool(low_memory)
        self._jacobian_exponent = 0.0
        self._gram_cache = GramCache()  # float64 U^T U, kept across predictive calls
        self.residual_diagonal: Optional[Tensor] = None
        self.seed = seed
        self.trace: Optional[Tensor] = None
        self.rank_bound: Optional[int] = None
        self._residual_model: Optional[Residual] = None

    @property
    def residual(self) -> str:
        """The residual model (see :mod:`lowrank_laplace.residual`).

        May be changed after a fit to compare models without refitting, except to
        ``"diagonal"``, whose residual diagonal only a fit with it keeps.
        """
        return self._residual

    @residual.setter
    def residual(self, value: str) -> None:
        check_residual(value)
        fitted = getattr(self, "H", None) is not None
        if value == "diagonal" and fitted and getattr(self, "residual_diagonal", None) is None:
            raise ValueError(
                "residual='diagonal' needs the residual diagonal, which this fit did not "
                "keep: refit with residual='diagonal'."
            )
        self._residual = value
        self._residual_model = None

    @property
    def diagonal_correction(self) -> bool:
        """Whether the fit tracks the residual diagonal (``residual="diagonal"``)."""
        return self.residual == "diagonal"

    def _columns_per_sample(self) -> int:
        """Columns of ``V`` per curvature sample: the GGN's rank per data point."""
        if self.mc_samples:
            return self.mc_samples
        outputs = self.n_outputs or 1
        return outputs if self.likelihood == "regression" else max(outputs - 1, 1)

    def _init_H(self) -> None:
        self.H: Optional[Tuple[Tensor, Tensor]] = None

    # ----------------------------------------------------------------- fitting
    def _curvature_target(self) -> Tuple[nn.Module, Any, List[Tensor]]:
        """The module whose GGN is computed, an input transform, and its parameters."""
        return self.model, (lambda X: X), self.params

    def _loss_and_factor(self) -> Tuple[nn.Module, float]:
        if self.likelihood == "regression":
            return nn.MSELoss(reduction="sum"), 0.5
        return nn.CrossEntropyLoss(reduction="sum"), 1.0

    def _check_targets(self, y: Tensor) -> None:
        if self.likelihood == "regression":
            if y.ndim != 2 or not y.is_floating_point():
                raise ValueError(
                    "likelihood='regression' needs floating-point targets of the output's "
                    f"shape (N, C), got dtype {y.dtype} and shape {tuple(y.shape)}."
                )
        elif y.is_floating_point() or y.ndim != 1:
            raise ValueError(
                "likelihood='classification' needs integer class targets of shape (N,), "
                f"got dtype {y.dtype} and shape {tuple(y.shape)}."
            )

    def fit(
        self, train_loader: DataLoader, override: bool = True, progress_bar: bool = False,
        process_group: Any = "default",
    ) -> None:
        """Fit the low-rank GGN over the whole loader by streaming merges.

        Data-parallel: when ``torch.distributed`` is initialised (or a group is
        passed), every process streams the shard its loader yields into a local
        factor; the factors are then all-gathered and merged in rank order, so every
        process ends with the same posterior, and ``n_data`` is the number of
        samples seen by all processes together. Launch e.g. with
        ``torchrun --nproc_per_node=2 script.py`` (gloo on CPU, nccl on GPU) and give
        each process a disjoint shard (a ``DistributedSampler`` pads shards with
        repeated samples unless the data set divides evenly).

        Args:
            train_loader: Yields ``(X, y)`` batches; ``train_loader.dataset`` gives
                the number of data points.
            override: ``False`` keeps the current curvature, loss and ``n_data`` and
                adds this loader's (laplace-torch's online updates): the two
                truncated eigendecompositions are merged like two batches, so the
                result is exact whenever the total rank fits ``rank``. The mean moves
                to the model's current parameters, as in laplace-torch.
            progress_bar: Show a tqdm progress bar over batches.
            process_group: ``torch.distributed`` group to merge across; the
                default uses the default group if ``torch.distributed`` is
                initialised, ``None`` fits on this process alone.

        Raises:
            ValueError: For a loader without ``dataset``, an empty loader, dict inputs,
                mismatched targets, or a memory budget too small for one sample.
        """
        previous = None if override or self.H is None else self._fitted_state()
        dataset = getattr(train_loader, "dataset", None)
        if dataset is None:
            raise ValueError("train_loader needs a .dataset to know the number of data points.")
        num_data = len(dataset)
        if num_data == 0:
            raise ValueError("train_loader is empty: nothing to fit.")
        module, to_inputs, params = self._curvature_target()
        # nothing of self changes until the fit completes (a loader may raise halfway)
        mean = parameters_to_vector(params).detach()
        loss_func, factor = self._loss_and_factor()
        if self.solver == "sketch":  # the same test matrix on every process
            merge = SketchMerge(self.rank, self.oversampling, self.diagonal_correction,
                                dense_max_dim=self._dense_max_dim, seed=self.seed,
                                test_matrix=self._sketch_test_matrix)
        else:
            merge = StreamingMerge(self.rank, self.oversampling, self.diagonal_correction,
                                   dense_max_dim=self._dense_max_dim)
        group = resolve_process_group(process_group)
        offset = 0 if group is None else process_rank(group)
        loss, seen, probe, probed = 0.0, 0, [], 0
        with FactorEngine(module, loss_func, eval_mode=True,
                          backend=self.factor_backend) as engine:
            stream = BatchStreamer(
                engine, merge, scale=factor, seed=self.seed + offset, device=self._device,
                mc_samples=self.mc_samples, subsample_fraction=self.subsample_fraction,
                memory_budget=self.memory_budget, micro_batch_size=self.micro_batch_size,
                keep=self.rank + self.oversampling, diagonal=self.diagonal_correction,
                low_memory=self.low_memory, process_group=group,
            )
            pbar = tqdm.tqdm(train_loader, disable=not progress_bar,
                             desc="[lowrank_ggn: merging GGN factors]")
            for data in pbar:
                if isinstance(data, MutableMapping):  # the whole dict goes to the model
                    X, y = data, data[self.dict_key_y]
                else:
                    X, y = data
                X, y = to_inputs(to_device(X, self._device)), y.to(self._device)
                self._check_targets(y)
                if probed < self._probe_size:  # inputs for the spectral residual's weights
                    probe.append(take(X, slice(0, self._probe_size - probed), len(y)))
                    probed += min(len(y), self._probe_size - probed)
                local = num_data
                if hasattr(train_loader, "__len__"):
                    local = min(num_data, len(train_loader) * len(y))
                loss = loss + stream.add(X, y, local)
                seen += len(y)
                if progress_bar and stream.merge.eigenvalues is not None:
                    kept = float(stream.merge.eigenvalues[: self.rank].sum()
                                 / stream.merge.trace)
                    pbar.set_postfix(kept_trace=f"{kept:.3f}")
            stream.flush()
            backend_used = engine.backend
        merge = stream.merge  # a sketch whose data one streaming merge covers streams
        plan = stream.plan
        if plan is None:
            raise ValueError("train_loader yielded no batches: nothing to fit.")
        if group is not None:
            import torch.distributed as dist

            merge.merge_across(group)
            totals = torch.stack([torch.as_tensor(loss, dtype=self._dtype, device=self._device),
                                  torch.tensor(float(seen), dtype=self._dtype,
                                               device=self._device)])
            dist.all_reduce(totals, group=group)
            loss, num_data = totals[0], int(totals[1])
        U, lam, trace, residual = merge.result()
        if previous is not None:
            U, lam, trace, residual = self._merge_fitted(previous, (U, lam, trace, residual))
            loss, num_data = previous[4] + loss, previous[5] + num_data
        exponent = self._fit_jacobian_exponent(module, probe, U, lam, group, stream.rng,
                                               stream.n_outputs)
        self.mean = mean
        self.n_outputs = stream.n_outputs
        self.H = (U, lam)
        self.factor_backend_used = backend_used
        self.fit_path = stream.path
        self.trace = trace
        self.residual_diagonal = residual
        self.loss = loss
        self.n_data = num_data
        samples = math.ceil(num_data * (self.subsample_fraction or 1.0))
        self.rank_bound = min(self.n_params, samples * self._columns_per_sample())
        self._jacobian_exponent = exponent
        self._residual_model = None

    def _fit_jacobian_exponent(self, module: nn.Module, probe: List[Any], U: Tensor,
                               lam: Tensor, group: Any, rng: Any, num_outputs: int) -> float:
        """``beta`` of the spectral residual from the kept eigenvectors' Jacobian energies.

        One extra backward pass (MSE-sum engine) per probe micro-batch, carrying
        random output combinations per input (``_probe_columns``; drawn in the fit's
        private stream ``rng``) or all ``num_outputs``; summed over processes when
        fitting data-parallel, so every process gets the same value.
        """
        if U.shape[1] in (0, U.shape[0]):  # nothing kept, or nothing dropped
            return 0.0
        with FactorEngine(module, nn.MSELoss(reduction="sum"), eval_mode=True,
                          backend=self.factor_backend) as engine:
            inputs = sum(check_batch(x, None) for x in probe)
            projections = None if self._probe_columns is None else \
                -(-self._probe_columns // max(inputs, 1))
            if projections is not None and projections >= num_outputs:
                projections = None  # no cheaper than the exact energies
            micro = micro_batch_size(engine, probe[0], projections, self.memory_budget,
                                     self.micro_batch_size)
            energy = jacobian_energies(engine, probe, U, micro, projections, rng)
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(energy, group=group)
        return jacobian_exponent(lam, energy)

    @property
    def jacobian_exponent(self) -> float:
        """Exponent ``beta`` weighting the spectral residual's tail (see the residual module).

        Fitted: the kept eigenvectors' Jacobian energies on the first
        ``_probe_size`` training inputs against their eigenvalues. Settable (``0``:
        the plain mean over random directions; ``1``: the training curvature's
        weighting).
        """
        return self._jacobian_exponent

    @jacobian_exponent.setter
    def jacobian_exponent(self, value: float) -> None:
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"jacobian_exponent must be finite and >= 0, got {value}.")
        self._jacobian_exponent = value
        self._residual_model = None

    def _fitted_state(self) -> tuple:
        """``(U, lam, trace, residual, loss, n_data)`` of the current fit."""
        if self.diagonal_correction and self.residual_diagonal is None:
            raise ValueError(
                "override=False with residual='diagonal' needs the residual diagonal "
                "of the previous fit, which this object does not hold: refit with "
                "override=True."
            )
        U, lam = self.H
        return U, lam, self.trace, self.residual_diagonal, self.loss, self.n_data

    def _merge_fitted(self, first: tuple, second: tuple) -> Tuple[Tensor, Tensor, Tensor,
                                                                   Optional[Tensor]]:
        """Merge two fits' ``(U, lam, trace, residual)`` into one (``override=False``)."""
        both = StreamingMerge(self.rank, self.oversampling, self.diagonal_correction)
        for U, lam, trace, residual in (first[:4], second[:4]):
            diagonal = residual + (U**2) @ lam if self.diagonal_correction else None
            both.add_lowrank(U, lam, trace, diagonal)
        return both.result()

    # --------------------------------------------------------------- posterior
    @property
    def kept_fraction(self) -> Tensor:
        """Fraction of the exact GGN trace (total curvature) the kept rank holds."""
        self._check_H_init()
        return self.H[1].sum() / self.trace

    @property
    def posterior_precision(self) -> Tuple[Tuple[Tensor, Tensor], Tensor]:
        """``((U, ell), d)`` with ``P = U diag(ell) U^T + diag(d)``, ``d`` of shape ``(D,)``.

        The matrix whose inverse is the posterior covariance: the scaled kept
        eigenvalues and the prior precision diagonal, both shifted by the residual
        model (see :mod:`lowrank_laplace.residual`).
        """
        precision = self._precision()
        d = precision.d
        if d.numel() == 1:
            d = d.expand(self.n_params).clone()
        return (precision.U, precision.ell), d

    def _prior_term(self) -> Tensor:
        """The prior precision: a scalar tensor when isotropic, else its ``(D,)`` diagonal."""
        prior = torch.as_tensor(self.prior_precision, device=self._device, dtype=self._dtype)
        return prior.reshape(()) if prior.numel() == 1 else self.prior_precision_diag

    @property
    def residual_model(self) -> Residual:
        """The fitted :class:`~lowrank_laplace.residual.Residual` (the dropped curvature)."""
        self._check_H_init()
        if self._residual_model is None:
            self._residual_model = Residual.from_fit(
                self.residual, self.H[1], self.trace, self.n_params,
                self.rank_bound or self.n_params, self.residual_diagonal,
                self._jacobian_exponent,
            )
        return self._residual_model

    @property
    def posterior_variance(self) -> Tensor:
        """Marginal posterior variances ``diag(P^{-1})``, shape ``(D,)``, in ``O(D r)``."""
        return self._precision().inverse_diagonal()

    @property
    def posterior_covariance(self) -> Tensor:
        """The dense posterior covariance ``P^{-1}``, shape ``(D, D)`` (small models).

        Raises:
            ValueError: If the ``D x D`` matrix exceeds ``memory_budget``.
        """
        eye = self._dense_identity("posterior_covariance")
        cov = self._precision().solve(eye)
        return (cov + cov.T) / 2

    @property
    def posterior_scale(self) -> Tensor:
        """A dense square root ``S`` of the covariance, ``S S^T = P^{-1}``, ``(D, D)``.

        The map that :meth:`sample` applies to standard normal noise (symmetric for
        a scalar prior without diagonal correction; not triangular, unlike
        laplace-torch's full Cholesky factor).

        Raises:
            ValueError: If the ``D x D`` matrix exceeds ``memory_budget``.
        """
        return self._precision().sqrt_inv_matmul(self._dense_identity("posterior_scale"))

    def _dense_identity(self, what: str) -> Tensor:
        """``I_D`` for a dense ``D x D`` result, after checking it fits ``memory_budget``."""
        self._check_H_init()
        dim = self.n_params
        need = 2 * dim * dim * (torch.finfo(self._dtype).bits // 8)  # identity and result
        budget = resolve_memory_budget(self.memory_budget, self._device)
        if need > budget:
            raise ValueError(
                f"{what} is a dense {dim:,} x {dim:,} matrix ({need / 2**30:.1f} GiB with "
                f"its workspace), over memory_budget={budget:,} bytes: use "
                "posterior_variance (its diagonal), functional_variance / "
                "functional_covariance (outputs) or sample(), or raise memory_budget."
            )
        return torch.eye(dim, dtype=self._dtype, device=self._device)

    def _precision(self) -> LowRankPrecision:
        self._check_H_init()
        return self.residual_model.precision(self.H[0], self.H[1], self._H_factor,
                                             self._prior_term(), self._gram_cache)

    @property
    def log_det_posterior_precision(self) -> Tensor:
        """``log det P`` by the determinant lemma (closed form for a scalar prior)."""
        return self._precision().logdet()

    def square_norm(self, value: Tensor) -> Tensor:
        """``(value - mean)^T P (value - mean)``.

        Args:
            value: Parameter vector, shape ``(D,)``.

        Returns:
            Scalar tensor.
        """
        return self._precision().square_norm(value - self.mean)

    @staticmethod
    def _jacobian_terms(Js: Tensor, precision: LowRankPrecision):
        """``J P_0^{-1}`` and ``J P_0^{-1} W`` from explicit Jacobians ``(..., D)``."""
        return Js / precision.d, Js @ precision.w_over_d()

    def functional_variance(self, Js: Tensor) -> Tensor:
        """``J P^{-1} J^T`` per input from explicit Jacobians.

        Args:
            Js: Jacobians, shape ``(B, C, D)``.

        Returns:
            Tensor of shape ``(B, C, C)``.
        """
        precision = self._precision()
        jd, jdw = self._jacobian_terms(Js, precision)
        return precision.functional_variance(jd @ Js.transpose(1, 2), jdw)

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """Joint ``J P^{-1} J^T`` over all inputs and outputs from explicit Jacobians.

        Args:
            Js: Jacobians, shape ``(B, C, D)``.

        Returns:
            Tensor of shape ``(B C, B C)``.
        """
        Js = Js.reshape(-1, Js.shape[-1])
        precision = self._precision()
        jd, jdw = self._jacobian_terms(Js, precision)
        return precision.functional_variance(jd @ Js.T, jdw)

    def sample_from_noise(self, eps: Tensor) -> Tensor:
        """Posterior samples as a linear map of standard normal noise.

        Args:
            eps: Noise, shape ``(D, n)``.

        Returns:
            Samples ``mean + S eps`` with ``S S^T = P^{-1}``, shape ``(n, D)``.
        """
        return self.mean + self._precision().sqrt_inv_matmul(eps).T

    def sample(self, n_samples: int = 100, generator: Optional[torch.Generator] = None) -> Tensor:
        """Draw parameter samples from the posterior ``N(mean, P^{-1})``.

        Args:
            n_samples: Number of samples.
            generator: Random number generator.

        Returns:
            Samples, shape ``(n_samples, D)``.
        """
        self._check_H_init()  # before n_params is used: a last layer is found by fit
        eps = torch.randn(self.n_params, n_samples, device=self._device, dtype=self._dtype,
                          generator=generator)
        return self.sample_from_noise(eps)

    # -------------------------------------------------------------- predictive
    def _prior_variance_weights(self, precision: LowRankPrecision) -> List[Union[float, Tensor]]:
        """``diag(d)^{-1}`` of ``precision`` per parameter (scalars where ``d`` is constant).

        In float64 whatever the model's dtype: the GLM variance subtracts products
        scaled by these weights from each other, and a float32 ``1 / d`` rounded
        differently from the capacitance's ``d`` would not cancel.
        """
        params = self._curvature_target()[2]
        d = precision.d.to(torch.float64)
        if precision.isotropic:
            return [1 / d] * len(params)
        prior = torch.as_tensor(self.prior_precision, device=self._device, dtype=self._dtype)
        sizes = [p.numel() for p in params]
        inverse = list(torch.split(1 / d, sizes))
        if (self.residual != "diagonal" and prior.numel() == len(params)
                and prior.numel() != self.n_params):
            return [w[0] for w in inverse]  # per-layer priors: one scalar per parameter
        return inverse

    def _glm_predictive_distribution(
        self,
        X: Union[Tensor, MutableMapping],
        joint: bool = False,
        diagonal_output: bool = False,
    ) -> Tuple[Tensor, Tensor]:
        if self.enable_backprop:
            return super()._glm_predictive_distribution(X, joint, diagonal_output)
        precision = self._precision()
        weights = self._prior_variance_weights(precision)
        X = to_device(X, self._device)
        # V = sqrt(2) J^T from the MSE-sum engine; eval mode as in laplace-torch's fit
        with FactorEngine(self.model, nn.MSELoss(reduction="sum"), eval_mode=True,
                          backend=self.factor_backend) as engine:
            if joint:
                f_mu, f_var = glm_moments(engine, X, precision, weights, joint=True)
                return f_mu.flatten(), f_var
            micro = micro_batch_size(engine, X, None, self.memory_budget,
                                         self.micro_batch_size)
            f_mu, f_var = batched_glm_moments(engine, X, precision, weights, micro)
        if diagonal_output:
            f_var = torch.diagonal(f_var, dim1=-2, dim2=-1)
        return f_mu, f_var

    # ------------------------------------------------------------- persistence
    def state_dict(self) -> dict:
        """laplace-torch's state plus the exact GGN trace and the rank options."""
        state = super().state_dict()
        state.update(trace=self.trace, rank=self.rank, mc_samples=self.mc_samples,
                     residual_diagonal=self.residual_diagonal, residual=self.residual,
                     rank_bound=self.rank_bound, jacobian_exponent=self._jacobian_exponent)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a fitted posterior.

        Args:
            state_dict: From :meth:`state_dict` of the same model type.

        Raises:
            ValueError: If the state belongs to another model or Laplace type.
        """
        super().load_state_dict(state_dict)
        U = self.H[0]
        expected = self._expected_dim()
        if expected is not None and U.shape[0] != expected:
            raise ValueError(
                f"The saved eigenvectors have {U.shape[0]} rows but the model has "
                f"{expected} Laplace parameters."
            )
        self.trace = state_dict.get("trace")
        self.residual_diagonal = state_dict.get("residual_diagonal")
        self.rank_bound = state_dict.get("rank_bound")
        self._jacobian_exponent = float(state_dict.get("jacobian_exponent", 0.0))
        saved = state_dict.get("residual", "diagonal" if self.residual_diagonal is not None
                               else "none")
        if saved != self.residual:
            raise ValueError(
                f"The state was fitted with residual={saved!r} but this object uses "
                f"residual={self.residual!r}: construct it with residual={saved!r}."
            )
        self._residual_model = None


class LowRankGGNLLLaplace(LLLaplace, LowRankGGNLaplace):
    """Last-layer Laplace with the last layer's exact low-rank GGN.

    Same options as :class:`LowRankGGNLaplace` (``rank``, ``oversampling``,
    ``mc_samples``, ``subsample_fraction``, ``memory_budget``, ``micro_batch_size``,
    ``residual``, ``seed``, ``low_memory``, ``factor_backend``, ``solver``) plus
    laplace-torch's last-layer arguments (``last_layer_name``, ``feature_reduction``).
    """

    _key = ("last_layer", "lowrank_ggn")

    def __init__(self, model: nn.Module, likelihood: str, *args, rank: int = DEFAULT_RANK,
                 oversampling: Optional[int] = None, mc_samples: int = 0,
                 subsample_fraction: Optional[float] = None,
                 memory_budget: Union[int, float, None] = None,
                 micro_batch_size: Optional[int] = None, residual: str = DEFAULT_RESIDUAL,
                 diagonal_correction: Optional[bool] = None,
                 seed: int = 0, low_memory: bool = False, factor_backend: str = "auto",
                 solver: str = "streaming", **kwargs):
        super().__init__(model, likelihood, *args, **kwargs)
        self._set_options(rank, oversampling, mc_samples, subsample_fraction, memory_budget,
                          micro_batch_size, residual, diagonal_correction, seed, low_memory,
                          solver)
        self.factor_backend = check_backend(factor_backend)
        self.factor_backend_used: Optional[str] = None
        self._check_backend()

    def _expected_dim(self) -> Optional[int]:
        last = getattr(self.model, "last_layer", None)
        return None if last is None else sum(p.numel() for p in last.parameters())

    def _curvature_target(self):
        last = self.model.last_layer
        extractor = self.model

        def features(X):
            with torch.no_grad():
                return extractor.forward_with_features(X)[1].detach()

        return nn.Sequential(last), features, list(last.parameters())

    def _glm_predictive_distribution(self, X, joint: bool = False,
                                     diagonal_output: bool = False):
        return LLLaplace._glm_predictive_distribution(self, X, joint, diagonal_output)
