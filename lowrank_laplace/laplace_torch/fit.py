r"""``fit_lowrank_ggn``: a loader's GGN as its leading eigenpairs, without laplace-torch.

laplace-torch's curvature is a sum over the training data: the fit streams every
batch's factor ``V`` (:mod:`~lowrank_laplace.engine`) into the solver its plan names
(:mod:`~lowrank_laplace.fitting`), merges across processes when fitting
data-parallel, merges with an earlier fit for online updates, and probes the
spectral residual's complement (:mod:`~lowrank_laplace.laplace_torch.probe`). The
laplace-torch classes (:mod:`~lowrank_laplace.laplace_torch.laplace`) store the
:class:`FitResult`.

Shape glossary:
    D: Laplace parameters; r: kept rank; C: model outputs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Tuple

import torch
import tqdm
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.fitting import StreamingMerge
from lowrank_laplace.fitting.distributed import process_rank, resolve_process_group
from lowrank_laplace.fitting.streamer import BatchStreamer
from lowrank_laplace.laplace_torch.options import LowRankOptions
from lowrank_laplace.laplace_torch.probe import probe_residual, probe_vector_cap
from lowrank_laplace.posterior.complement import MeasuredComplement
from lowrank_laplace.posterior.residual import ResidualKind
from lowrank_laplace.utils.batches import take, to_device
from lowrank_laplace.utils.linalg import cpu_threads, squared_rows_dot

#: The likelihoods and the loss whose GGN is laplace-torch's, with its Hessian factor.
LIKELIHOODS = ("classification", "regression")


@dataclass
class FitResult:
    """A fitted low-rank GGN over a training set, on the GGN's own scale.

    Attributes:
        mean: The parameters at the fit (the posterior mean), ``(D,)``.
        eigenvectors: Kept orthonormal eigenvectors ``U``, ``(D, r)``.
        eigenvalues: Kept eigenvalues ``lambda``, ``(r,)``.
        trace: The exact GGN trace over the data.
        residual_diagonal: Diagonal of the dropped curvature (``residual="diagonal"``),
            ``(D,)``, else ``None``.
        loss: The summed loss times laplace-torch's Hessian factor.
        n_data: Samples fitted (over all processes).
        n_outputs: Model outputs ``C``.
        factor_backend: The backend that computed ``V``.
        fit_path: ``"dense"``, ``"streaming"`` or ``"sketch"``.
        rank_bound: Upper bound on the GGN's rank (``min(D, samples * columns)``).
        jacobian_exponent: The spectral residual's exponent ``beta``.
        complement: The spectral residual's measured complement variance, or ``None``
            (see :mod:`~lowrank_laplace.laplace_torch.probe`).
        warm_started: Whether the sketch started from a basis (see ``warm_basis``).
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
    jacobian_exponent: float
    complement: Optional[MeasuredComplement] = None
    warm_started: bool = False


def likelihood_loss(likelihood: str) -> Tuple[nn.Module, float]:
    """The summed loss whose GGN is laplace-torch's, and laplace-torch's factor on it.

    Args:
        likelihood: ``"classification"`` or ``"regression"``.

    Returns:
        ``(loss, factor)``: ``CrossEntropyLoss(sum)`` and 1, or ``MSELoss(sum)`` and
        0.5.
    """
    if likelihood == "regression":
        return nn.MSELoss(reduction="sum"), 0.5
    return nn.CrossEntropyLoss(reduction="sum"), 1.0


def check_targets(likelihood: str, y: Tensor) -> None:
    """Refuse targets that do not match the likelihood.

    Args:
        likelihood: ``"classification"`` or ``"regression"``.
        y: A batch's targets.

    Raises:
        ValueError: For float classes, integer regression targets or wrong shapes.
    """
    if likelihood == "regression":
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


def columns_per_sample(likelihood: str, mc_samples: int, n_outputs: Optional[int]) -> int:
    """Columns of ``V`` per curvature sample: the GGN's rank per data point.

    Args:
        likelihood: ``"classification"`` or ``"regression"``.
        mc_samples: ``0`` or Monte-Carlo samples.
        n_outputs: Model outputs ``C`` (``None``: unknown, counted as 1).

    Returns:
        ``M``, ``C`` (regression) or ``C - 1`` (classification, at least 1).
    """
    if mc_samples:
        return mc_samples
    outputs = n_outputs or 1
    return outputs if likelihood == "regression" else max(outputs - 1, 1)


#: The sample count a fit plans for when the loader's dataset has no length (an
#: ``IterableDataset``): many samples, so the plan streams; ``n_data`` is then counted.
UNKNOWN_SIZE = 2**40


def loader_size(loader: Any) -> Optional[int]:
    """The number of data points of a loader's dataset (``None``: it has no length).

    Args:
        loader: A training loader.

    Returns:
        ``len(loader.dataset)``, or ``None`` for a dataset without ``__len__`` (then
        the fit counts the samples it streams).

    Raises:
        ValueError: For a loader without ``dataset`` or an empty dataset.
    """
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        raise ValueError("train_loader needs a .dataset to know the number of data points.")
    try:
        num_data = len(dataset)
    except TypeError:  # an IterableDataset without __len__
        return None
    if num_data == 0:
        raise ValueError("train_loader is empty: nothing to fit.")
    return num_data


def check_params(params: List[Tensor]) -> None:
    """Refuse a fit without trainable parameters or with parameters holding no data.

    Raises:
        ValueError: For no parameters, or parameters on the ``meta`` device.
    """
    if not params:
        raise ValueError(
            "The model has no trainable parameters: the posterior covers the parameters "
            "with requires_grad=True, so unfreeze the ones it should cover."
        )
    if any(p.is_meta for p in params):
        raise ValueError(
            "The model's parameters are on the 'meta' device and hold no values: load "
            "its weights (e.g. model.to_empty(device='cpu') and load_state_dict) first."
        )


def fit_lowrank_ggn(model: nn.Module, likelihood: str, loader: Iterable,
                    options: LowRankOptions, *, params: Optional[List[Tensor]] = None,
                    to_inputs: Callable[[Any], Any] = lambda X: X,
                    dict_key_y: str = "labels", device: Optional[torch.device] = None,
                    previous: Optional[FitResult] = None, process_group: Any = "default",
                    progress_bar: bool = False,
                    warm_basis: Optional[Tensor] = None) -> FitResult:
    """Fit the low-rank GGN of ``model`` over the whole loader.

    Data-parallel: when ``torch.distributed`` is initialised (or a group is passed),
    every process streams the shard its loader yields into a local factor; the
    factors are then combined, so every process ends with the same result, and
    ``n_data`` counts the samples of all processes together.

    Args:
        model: The module whose GGN is computed (its trainable parameters).
        likelihood: ``"classification"`` or ``"regression"``.
        loader: Yields ``(X, y)`` batches or dict batches; ``loader.dataset`` gives
            the number of data points.
        options: The validated options.
        params: The parameters of the mean (``None``: ``model``'s trainable ones).
        to_inputs: Maps a batch's inputs to ``model``'s (e.g. last-layer features).
        dict_key_y: The key of the targets in dict batches.
        device: Where the fit runs (``None``: the parameters' device).
        previous: An earlier fit to add this loader's curvature to (laplace-torch's
            online updates, ``override=False``); exact whenever the total rank fits.
        process_group: ``torch.distributed`` group to merge across; ``"default"``
            uses the default group if initialised, ``None`` this process alone.
        progress_bar: Show a tqdm progress bar over batches.
        warm_basis: Directions, ``(D, b)``, that a sketch chosen by ``solver="auto"``
            takes as its first test columns (an earlier fit's eigenvectors), with
            fewer random ones (:func:`~lowrank_laplace.fitting.plan.make_solver`).

    Returns:
        The :class:`FitResult`.

    Raises:
        ValueError: For a loader without ``dataset``, an empty loader, mismatched
            targets, a previous fit without the residual diagonal it needs, or a
            memory budget too small for one sample.
    """
    if previous is not None and options.residual == "diagonal" \
            and previous.residual_diagonal is None:
        raise ValueError(
            "override=False with residual='diagonal' needs the residual diagonal of the "
            "previous fit, which this object does not hold: refit with override=True."
        )
    known = loader_size(loader)
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    check_params(params)
    device = params[0].device if device is None else device
    mean = parameters_to_vector(params).detach()
    group = resolve_process_group(process_group)
    args = (model, likelihood, loader, options, to_inputs, dict_key_y, device, group, known,
            progress_bar, mean.dtype, warm_basis)
    stream, loss, num_data, probe = _stream_and_merge(*args)
    if _rounded(stream, params[0].dtype):  # a float32 sketch rounded a kept eigenvalue
        if stream.plan.widen:  # one more pass, in float64
            stream, loss, num_data, probe = _stream_and_merge(*args, wide_sketch=True)
        else:
            _warn_low_precision_sketch(params[0].dtype)
    solver = stream.solver
    with cpu_threads(stream.plan.batch_threads()):  # as for a small fit's batch loop
        U, lam, trace, residual = solver.result()
        if previous is not None:
            U, lam, trace, residual = _merge_fits(options, previous, (U, lam, trace, residual))
            loss, num_data = previous.loss + loss, previous.n_data + num_data
        if float(trace) <= 0:  # a zero GGN has no eigenpairs, not a fake tiny one
            U, lam = U[:, :0], lam[:0]
        exponent, complement = probe_residual(model, options, probe, U, lam, group, stream,
                                              num_data, likelihood_loss(likelihood))
    samples = math.ceil(num_data * (options.subsample_fraction or 1.0))
    columns = columns_per_sample(likelihood, options.mc_samples, stream.n_outputs)
    return FitResult(
        mean=mean, eigenvectors=U, eigenvalues=lam, trace=trace, residual_diagonal=residual,
        loss=loss, n_data=num_data, n_outputs=stream.n_outputs,
        factor_backend=stream.engine.backend, fit_path=stream.path,
        rank_bound=min(mean.numel(), samples * columns), jacobian_exponent=exponent,
        complement=complement, warm_started=solver.warm_columns > 0,
    )


def _stream_and_merge(model, likelihood, loader, options, to_inputs, dict_key_y, device,
                      group, known, progress_bar, dtype, warm_basis, wide_sketch=False):
    """Stream the loader and merge across processes: streamer, loss, samples, probe."""
    stream, loss, seen, probe = _stream(model, likelihood, loader, options, to_inputs,
                                        dict_key_y, device, group, known, progress_bar,
                                        wide_sketch, warm_basis)
    num_data = seen if known is None else known
    if group is not None:
        import torch.distributed as dist

        stream.solver.merge_across(group)
        totals = torch.stack([torch.as_tensor(loss, dtype=dtype, device=device),
                              torch.tensor(float(seen), dtype=dtype, device=device)])
        dist.all_reduce(totals, group=group)
        loss, num_data = totals[0], int(totals[1])
    return stream, loss, num_data, probe


def _rounded(stream: BatchStreamer, dtype: torch.dtype) -> bool:
    """Whether a sketch accumulated below float64 rounded its kept eigenvalues."""
    plan = stream.plan
    if plan.path != "sketch" or dtype == torch.float64 or plan.sketch_dtype is not None:
        return False
    with cpu_threads(plan.batch_threads()):
        return not stream.solver.resolves()


def _stream(model, likelihood, loader, options, to_inputs, dict_key_y, device, group,
            num_data, progress_bar, wide_sketch=False, warm_basis=None
            ) -> Tuple[BatchStreamer, Any, int, Tuple[List[Any], Any]]:
    """Stream the loader: the streamer (solver filled), loss, samples, and the probe.

    The probe is the spectral residual's inputs and the most vectors per input its
    pass may carry within the memory budget.
    """
    loss_func, factor = likelihood_loss(likelihood)
    offset = 0 if group is None else process_rank(group)
    loss, seen, probe, probed, cap = 0.0, 0, [], 0, None
    # only the spectral residual weights its tail by the probe's Jacobian energies
    probe_size = options.probe_size if options.residual == ResidualKind.SPECTRAL else 0
    with FactorEngine(model, loss_func, eval_mode=True,
                      backend=options.factor_backend) as engine:
        stream = BatchStreamer(
            engine, scale=factor, seed=options.seed + offset, device=device,
            rank=options.rank, oversampling=options.oversampling,
            mc_samples=options.mc_samples, subsample_fraction=options.subsample_fraction,
            memory_budget=options.memory_budget, micro_batch_size=options.micro_batch_size,
            track_diagonal=options.track_diagonal, low_memory=options.low_memory,
            solver=options.solver.value, dense_max_dim=options.dense_max_dim,
            test_matrix=options.sketch_test_matrix.value, sketch_seed=options.seed,
            process_group=group, wide_sketch=wide_sketch, warm_basis=warm_basis,
        )
        pbar = tqdm.tqdm(loader, disable=not progress_bar,
                         desc="[lowrank_ggn: merging GGN factors]")
        for data in pbar:
            if isinstance(data, MutableMapping):  # the whole dict goes to the model
                if dict_key_y not in data:
                    raise ValueError(
                        f"The loader's dict batches have no targets under "
                        f"dict_key_y={dict_key_y!r} (keys: {sorted(data)}): pass the "
                        "key of the labels as dict_key_y."
                    )
                X, y = data, data[dict_key_y]
            else:
                X, y = data
            check_batch_types(X, y)
            X, y = to_inputs(to_device(X, device)), y.to(device)
            check_targets(likelihood, y)
            if probed < probe_size:  # inputs for the spectral residual's weights
                probe.append(take(X, slice(0, probe_size - probed), len(y)))
                probed += min(len(y), probe_size - probed)
            loss = loss + stream.add(X, y, _planned_samples(loader, num_data, len(y)))
            if probe and cap is None:  # checked at the first batch, before the work
                cap = probe_vector_cap(stream.engine, X, options.memory_budget)
            seen += len(y)
            if progress_bar and stream.solver.eigenvalues is not None:
                kept = float(stream.solver.eigenvalues[: options.rank].sum()
                             / stream.solver.trace)
                pbar.set_postfix(kept_trace=f"{kept:.3f}")
        if stream.plan is None:
            raise ValueError("train_loader yielded no batches: nothing to fit.")
        stream.flush()
    return stream, loss, seen, (probe, cap)


def _warn_low_precision_sketch(dtype: torch.dtype) -> None:
    """Say that a float32 sketch rounded away small kept eigenvalues.

    A float32 model's sketch is redone in float64 where its ``D x l`` float64 matrix
    is small against the memory budget (:func:`~lowrank_laplace.fitting.plan.plan_fit`);
    this warns only where it could not be (a large sketch, or a low-memory fit).
    """
    warnings.warn(
        f"solver='sketch' accumulated its sketch in {dtype} (its float64 D x l matrix "
        "exceeds a quarter of memory_budget, or low_memory=True) and rounded kept "
        "eigenvalues: eigenvalues below about eps * lambda_max are lost, and "
        "variances in weakly determined directions can be far off at small prior "
        "precisions. solver='streaming', a larger memory_budget (or a float64 "
        "model) resolves them.",
        UserWarning, stacklevel=4,
    )


def _planned_samples(loader: Any, num_data: Optional[int], batch: int) -> int:
    """Samples this process streams, as far as the loader tells (for the fit's plan)."""
    planned = UNKNOWN_SIZE if num_data is None else num_data
    try:
        return min(planned, len(loader) * batch)
    except TypeError:  # no __len__, or one that raises (an IterableDataset's loader)
        return planned


def check_batch_types(X: Any, y: Any) -> None:
    """Refuse batches that do not hold tensors (laplace-torch's loaders yield tensors).

    Raises:
        TypeError: For inputs that are neither a tensor nor a dict batch, or targets
            that are not a tensor.
    """
    if not isinstance(X, (Tensor, MutableMapping)) or not isinstance(y, Tensor):
        raise TypeError(
            "train_loader must yield (X, y) tensors or dict batches, got "
            f"({type(X).__name__}, {type(y).__name__}): wrap arrays with torch.as_tensor "
            "(e.g. in a TensorDataset)."
        )


def _merge_fits(options: LowRankOptions, previous: FitResult, current: tuple
                ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Merge an earlier fit's ``(U, lam, trace, residual)`` with this one's."""
    first = (previous.eigenvectors, previous.eigenvalues, previous.trace,
             previous.residual_diagonal)
    # a previous spectral fit without the diagonal (an older state) merges without it
    track = options.track_diagonal and previous.residual_diagonal is not None
    both = StreamingMerge(options.rank, options.oversampling, track)
    for U, lam, trace, residual in (first, current):
        diagonal = residual + squared_rows_dot(U, lam) if track else None
        both.add_lowrank(U, lam, trace, diagonal)
    return both.result()
