r"""laplace-torch's marginal-likelihood tuning of a scalar prior, on scalars.

Under a scalar prior the marginal likelihood depends on :math:`\delta` only through the
curvature's spectrum (:meth:`~lowrank_laplace.posterior.Residual.curvature_spectrum`:
weights :math:`c_j` of eigenvalues :math:`a_j`) and the scatter
:math:`s = \|\theta_* - \mu_0\|^2`; in :math:`x = \log\delta`:

.. math::

    \frac{\partial (-\log p(\mathcal{D} \mid \delta))}{\partial x} = \tfrac12 \Big(\delta s
    - \sum_j \frac{c_j a_j}{a_j + \delta}\Big).

:func:`tune_scalar_prior` runs laplace-torch's ``n_steps`` Adam steps on :math:`x` from
its starting point on that gradient, in float64 scalars instead of autograd: the same
optimum. Layerwise and per-parameter priors keep laplace-torch's loop.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Optional, Tuple

import numpy as np
from laplace.baselaplace import ParametricLaplace
from torch import Tensor

#: ``torch.optim.Adam``'s defaults, which laplace-torch's loop uses.
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8

_SIGNATURE = inspect.signature(ParametricLaplace.optimize_prior_precision)


def scalar_marglik_call(la: Any, args: tuple, kwargs: dict
                        ) -> Optional[Tuple[dict, Tuple[Tensor, Tensor]]]:
    """laplace-torch's arguments when a call tunes a scalar prior by marginal likelihood.

    Args:
        la: The fitted Laplace object.
        args: Positional arguments of ``optimize_prior_precision``.
        kwargs: Its keyword arguments.

    Returns:
        The bound arguments (defaults applied, without ``self``) and the curvature's
        spectrum at the posterior's scale (``Residual.curvature_spectrum``), or ``None``
        for any other call (grid search, a layerwise or per-parameter prior, a
        ``"diagonal"`` residual, an unfitted posterior, arguments laplace-torch refuses).
    """
    try:
        bound = _SIGNATURE.bind(la, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    call = {name: value for name, value in bound.arguments.items() if name != "self"}
    init = call["init_prior_prec"]
    scalar_init = np.size(init) == 1 if not hasattr(init, "numel") else init.numel() == 1
    if call["method"] != "marglik" or not scalar_init \
            or call["prior_structure"] != "scalar" or getattr(la, "H", None) is None:
        return None
    spectrum = la.residual_model.curvature_spectrum(la.H[1], float(la._H_factor))
    return None if spectrum is None else (call, spectrum)


def tune_scalar_prior(la: Any, spectrum: Tuple[Tensor, Tensor], init: float, n_steps: int,
                      lr: float) -> float:
    """laplace-torch's Adam steps on ``log delta``, on the closed-form gradient.

    Args:
        la: The fitted Laplace object (its posterior under a scalar prior).
        spectrum: The curvature's eigenvalues and their counts, from :func:`scalar_marglik_call`.
        init: The starting prior precision.
        n_steps: Adam steps.
        lr: Adam's learning rate.

    Returns:
        The tuned prior precision (with a warning where it lies below the prior its
        refinement's Lanczos quadrature was checked at).
    """
    a, c = (t.numpy() for t in spectrum)
    diff = (la.mean - la.prior_mean).detach().double()
    scatter = float(diff @ diff)
    x, m, v = math.log(init), 0.0, 0.0
    beta1, beta2 = ADAM_BETAS
    for step in range(1, int(n_steps) + 1):
        delta = math.exp(x)
        grad = 0.5 * (delta * scatter - float(np.dot(c, a / (a + delta))))
        m = beta1 * m + (1 - beta1) * grad
        v = beta2 * v + (1 - beta2) * grad * grad
        denom = math.sqrt(v) / math.sqrt(1 - beta2**step) + ADAM_EPS
        x -= lr / (1 - beta1**step) * m / denom
    tuned, found = math.exp(x), getattr(la, "_quadrature", None)
    if found is not None and tuned < found.checked_prior:
        warnings.warn(
            f"The tuned prior precision {tuned:.3g} is below {found.checked_prior:.3g}, the "
            "lowest its Lanczos quadrature of the complement was checked at, which may "
            "under-state the complement there: call la.refine_complement(train_loader) at "
            "this prior and tune again.", UserWarning, stacklevel=4)
    return tuned
