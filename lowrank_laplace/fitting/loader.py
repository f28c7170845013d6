"""What a fit reads from a training loader: its size, batches and targets, checked.

Batches are ``(X, y)`` tensors or dict batches (targets under ``dict_key_y``); what a fit
cannot use is refused, with the way out, before any work.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from lowrank_laplace.utils.batches import refuse_meta

#: Samples planned for a dataset without a length (the plan streams; ``n_data`` is counted).
UNKNOWN_SIZE = 2**40


def likelihood_loss(likelihood: str) -> Tuple[nn.Module, float]:
    """Return ``(CrossEntropyLoss(sum), 1)`` or ``(MSELoss(sum), 0.5)``: laplace-torch's GGN.

    Args:
        likelihood: ``"classification"`` or ``"regression"``.
    """
    if likelihood == "regression":
        return nn.MSELoss(reduction="sum"), 0.5
    return nn.CrossEntropyLoss(reduction="sum"), 1.0


def check_likelihood_targets(likelihood: str, y: Tensor) -> None:
    """Refuse a batch's targets ``y`` that do not match the ``likelihood``.

    Raises:
        ValueError: For float classes, integer regression targets or wrong shapes.
    """
    if likelihood == "regression":
        if y.ndim != 2 or not y.is_floating_point():
            raise ValueError(
                "likelihood='regression' needs floating-point targets of the output's "
                f"shape (N, C), got dtype {y.dtype} and shape {tuple(y.shape)}.")
    elif y.is_floating_point() or y.ndim != 1:
        raise ValueError(
            "likelihood='classification' needs integer class targets of shape (N,), "
            f"got dtype {y.dtype} and shape {tuple(y.shape)}.")


def loader_size(loader: Any) -> Optional[int]:
    """Return ``len(loader.dataset)``, or ``None`` for a dataset without ``__len__``.

    Args:
        loader: A training loader.

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


def planned_samples(loader: Any, num_data: Optional[int], batch: int) -> int:
    """Return the samples this process streams (as the loader tells) or :data:`UNKNOWN_SIZE`.

    Args:
        loader: The training loader.
        num_data: :func:`loader_size`.
        batch: Samples of its first batch.
    """
    planned = UNKNOWN_SIZE if num_data is None else num_data
    try:
        return min(planned, len(loader) * batch)
    except TypeError:  # no __len__, or one that raises (an IterableDataset's loader)
        return planned


def check_params(params: List[Tensor]) -> None:
    """Refuse empty ``params`` to fit, or parameters on the ``meta`` device.

    Raises:
        ValueError: For no parameters, or parameters on the ``meta`` device.
    """
    if not params:
        raise ValueError(
            "The model has no trainable parameters: the posterior covers the parameters "
            "with requires_grad=True, so unfreeze the ones it should cover.")
    if any(p.is_meta for p in params):
        raise ValueError(
            "The model's parameters are on the 'meta' device and hold no values: load "
            "its weights (e.g. model.to_empty(device='cpu') and load_state_dict) first.")


def check_batch_types(X: Any, y: Any) -> None:
    """Refuse a batch's inputs ``X`` and targets ``y`` that are not tensors.

    Raises:
        TypeError: For inputs neither a tensor nor a dict, or targets not a tensor.
    """
    if not isinstance(X, (Tensor, MutableMapping)) or not isinstance(y, Tensor):
        raise TypeError(
            "train_loader must yield (X, y) tensors or dict batches, got "
            f"({type(X).__name__}, {type(y).__name__}): wrap arrays with torch.as_tensor "
            "(e.g. in a TensorDataset).")


def as_pair(data: Any) -> Tuple[Any, Any]:
    """Return a loader's (non-dict) batch as its two items ``(X, y)``.

    Raises:
        ValueError: For a batch that is not a pair (e.g. ``(X, y, w)`` with sample weights).
    """
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return data[0], data[1]
    what = (f"a {type(data).__name__} of {len(data)} items"
            if isinstance(data, (tuple, list)) else f"a {type(data).__name__}")
    raise ValueError(
        f"train_loader must yield (X, y) pairs or dict batches, got {what}: the GGN "
        "posterior takes inputs and targets only (laplace-torch's form; no sample weights "
        "or extra fields). Yield (X, y), e.g. from a Dataset whose __getitem__ returns "
        "(x, y) or a collate_fn that drops the rest.")


def target_energy(y: Tensor) -> Tensor:
    """Return the targets' squares summed in float64: the fingerprint of a pass's data.

    Its terms are non-negative, so no cancellation hides a difference between two passes.
    """
    return y.detach().to(torch.float64).square().sum()


def unpack(data: Any, dict_key_y: str) -> Tuple[Any, Tensor]:
    """Return a loader's batch as checked ``(X, y)``; a dict batch is the inputs whole.

    Args:
        data: What the loader yielded.
        dict_key_y: The targets' key in dict batches.

    Raises:
        KeyError: For a dict batch without ``dict_key_y`` (laplace-torch's exception).
        ValueError: For a batch that is not a pair (:func:`as_pair`).
        TypeError: See :func:`check_batch_types`.
    """
    if isinstance(data, MutableMapping):
        if dict_key_y not in data:
            raise KeyError(
                f"The loader's dict batches have no targets under "
                f"dict_key_y={dict_key_y!r} (keys: {sorted(data)}): pass the "
                "key of the labels as dict_key_y.")
        X, y = data, data[dict_key_y]
    else:
        X, y = as_pair(data)
    check_batch_types(X, y)
    check_finite_inputs(X)
    return X, y


def check_finite_inputs(X: Any) -> None:
    """Refuse inputs ``X`` holding NaN or inf (a saturating network hides them until the GGN).

    Raises:
        ValueError: Naming the entry, or for inputs on the ``meta`` device (no values).
    """
    refuse_meta("inputs", X.values() if isinstance(X, MutableMapping) else [X])
    entries = X.items() if isinstance(X, MutableMapping) else [("inputs", X)]
    for key, value in entries:
        if isinstance(value, Tensor) and value.is_floating_point() and \
                not bool(torch.isfinite(value).all()):
            raise ValueError(
                f"The loader's {key!r} hold NaN or infinite values: the GGN of such an "
                "input is not defined. Clean or clip the data first.")


def batches(loader: Any, dict_key_y: str) -> Iterator[Tuple[Any, Tensor]]:
    """Yield the loader's batches as checked ``(X, y)`` pairs (:func:`unpack`).

    Args:
        loader: The training loader.
        dict_key_y: The targets' key in dict batches.
    """
    for data in loader:
        yield unpack(data, dict_key_y)
