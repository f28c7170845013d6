r"""Warm starts: a refit of a model that has moved begins from the last fit's eigenvectors.

Training loops refit the posterior of a network whose weights moved a little since the
last fit: laplace-torch's ``marglik_training`` builds a new ``Laplace`` object and fits
it after every epoch, and a user may refit the same object after more training. The
last fit's eigenvectors ``U`` then lie close to the new leading eigenspace. A sketch
that takes them as its first test columns
(:class:`~lowrank_laplace.fitting.omega.BasisOmega`) is exact on every eigenvector they
span and needs fewer random columns: where ``solver="auto"`` chooses the sketch, a
warm start draws ``2 * rank`` random columns besides the ``rank`` of ``U``
(:data:`~lowrank_laplace.fitting.plan.WARM_SKETCH_OVERSAMPLING`) instead of ``4 *
rank``, and costs less. Along ``marglik_training`` on a digits MLP its
kept eigenvalues stayed as close to the exact ones as the cold sketch's
(docs/benchmarks/design_measurements.md).

Where the basis comes from:

- a refit of the same object: its own last fit;
- a new object: the last fitted posterior of the same class for the same model (the
  same module object), if that posterior is still alive when the new one is built
  (``marglik_training`` builds the next object while the last is still referenced).
  Only weak references are kept, so nothing outlives its owner; a new object holds the
  basis until its fit.

The basis is used only if the model's parameters moved since that fit: refitting
unchanged weights stays a cold start, so fitting one network twice gives one answer,
whatever else was fitted before. ``warm_start=False`` turns warm starts off.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
from torch import Tensor
from torch.nn.utils import parameters_to_vector

#: Model -> weak reference to the last posterior fitted on it.
_LAST: "weakref.WeakKeyDictionary[Any, weakref.ref]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class WarmStart:
    """An earlier fit's eigenvectors and the parameters it was fitted at.

    Attributes:
        basis: The eigenvectors ``U``, ``(D, r)``.
        mean: The parameters of that fit, ``(D,)``.
    """

    basis: Tensor
    mean: Tensor


def start_of(la: Any) -> Optional[WarmStart]:
    """The warm start a fitted posterior offers (``None`` if unfitted or without eigenvectors)."""
    H = getattr(la, "H", None)
    if H is None or not torch.is_tensor(H[0]) or H[0].ndim != 2 or H[0].shape[1] == 0:
        return None
    return WarmStart(H[0], la.mean)


def capture(la: Any) -> Optional[WarmStart]:
    """The warm start of the last live posterior of ``la``'s class fitted on its model.

    Args:
        la: A posterior being built.

    Returns:
        That posterior's :class:`WarmStart`, or ``None``.
    """
    try:
        ref = _LAST.get(la.model)
    except TypeError:  # a model that takes no weak references
        return None
    previous = None if ref is None else ref()
    if previous is None or previous is la or type(previous) is not type(la):
        return None
    return start_of(previous)


def remember(la: Any) -> None:
    """Record ``la`` as the last posterior fitted on its model."""
    try:
        _LAST[la.model] = weakref.ref(la)
    except TypeError:
        pass


def basis_for(start: Optional[WarmStart], params: List[Tensor]) -> Optional[Tensor]:
    """The basis a fit at ``params`` starts from: ``start``'s, if the parameters moved.

    Args:
        start: The candidate warm start.
        params: The parameters about to be fitted.

    Returns:
        ``start.basis``, or ``None`` (no start, other shapes, dtype or device, or the
        same parameters).
    """
    if start is None:
        return None
    mean = start.mean
    if mean.numel() != sum(p.numel() for p in params) or mean.dtype != params[0].dtype \
            or mean.device != params[0].device or start.basis.shape[0] != mean.numel():
        return None
    if torch.equal(mean, parameters_to_vector(params).detach()):
        return None
    return start.basis
