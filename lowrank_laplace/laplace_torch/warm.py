r"""Warm starts: a refit after the model moved begins from the same posterior's last fit.

After more training the last fit's eigenvectors ``U`` lie close to the new leading
eigenspace: a sketch taking them as its first test columns
(:class:`~lowrank_laplace.fitting.omega.BasisOmega`) is exact on their span and draws
fewer random columns (:data:`~lowrank_laplace.fitting.plan.WARM_SKETCH_OVERSAMPLING`).

Only the same object's last fit is a source, and only if the parameters moved since:
refitting unchanged weights stays a cold start, so fitting one network twice gives one answer.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import Tensor
from torch.nn.utils import parameters_to_vector


def warm_basis(la: Any, params: List[Tensor]) -> Optional[Tensor]:
    """The basis a refit of ``la`` at ``params`` starts from: its last eigenvectors.

    Args:
        la: The posterior about to be refitted.
        params: The parameters about to be fitted.

    Returns:
        The last fit's eigenvectors ``(D, r)``, or ``None`` (unfitted, nothing kept,
        other shapes, dtype or device, or the same parameters as at that fit).
    """
    H = getattr(la, "H", None)
    if H is None or not torch.is_tensor(H[0]) or H[0].ndim != 2 or H[0].shape[1] == 0:
        return None
    basis, mean = H[0], la.mean
    if mean.numel() != sum(p.numel() for p in params) or mean.dtype != params[0].dtype \
            or mean.device != params[0].device or basis.shape[0] != mean.numel():
        return None
    return None if torch.equal(mean, parameters_to_vector(params).detach()) else basis
