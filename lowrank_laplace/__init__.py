"""lowrank_laplace: Laplace posteriors on the exact low-rank structure of the GGN.

Importing it registers ``hessian_structure="lowrank_ggn"`` (``subset_of_weights="all"`` and
``"last_layer"``) with laplace-torch's ``Laplace``, in either import order
(:mod:`lowrank_laplace.utils.laplace_registration`). The import is cheap (no torch): each
public name is imported where it lives on first use.

The GGN is ``G = V V^T`` with ``V`` from one backward pass; its nonzero spectrum lives in the
small Gram matrix ``V^T V`` (ViViT). Data flows :mod:`~lowrank_laplace.factor` (``V``) ->
:mod:`~lowrank_laplace.engine` -> :mod:`~lowrank_laplace.spectrum`,
:mod:`~lowrank_laplace.directional`, :mod:`~lowrank_laplace.newton` ->
:mod:`~lowrank_laplace.fitting` (a loader's GGN) -> :mod:`~lowrank_laplace.posterior` ->
:mod:`~lowrank_laplace.laplace_torch`; :mod:`~lowrank_laplace.toolkit` holds data, metrics,
plots and the CLI.
"""

import importlib as _importlib
import importlib.util as _importlib_util

from lowrank_laplace.utils import laplace_registration as _registration

#: The public names, each with the module it is imported from on first use.
_HOMES = {
    "DirectionalDerivatives": "lowrank_laplace.directional",
    "FactorEngine": "lowrank_laplace.engine",
    "GGNFactor": "lowrank_laplace.factor",
    "LowRankGGN": "lowrank_laplace.spectrum",
    "LowRankGGNLLLaplace": _registration.LAPLACE_CLASSES,
    "LowRankGGNLaplace": _registration.LAPLACE_CLASSES,
    "LowRankPrecision": "lowrank_laplace.posterior",
    "Residual": "lowrank_laplace.posterior",
    "SketchMerge": "lowrank_laplace.fitting",
    "StreamingMerge": "lowrank_laplace.fitting",
    "damped_newton_step": "lowrank_laplace.newton",
    "fit_lowrank_ggn": "lowrank_laplace.laplace_torch.fitted",
    "directional_derivatives": "lowrank_laplace.directional",
    "directional_from_factor": "lowrank_laplace.directional",
    "ggn_eigh": "lowrank_laplace.spectrum",
    "ggn_eigvals": "lowrank_laplace.spectrum",
    "ggn_inverse_matvec": "lowrank_laplace.newton",
    "gram_eigh": "lowrank_laplace.spectrum",
    "layerwise_param_groups": "lowrank_laplace.utils.checks",
    "lowrank_ggn": "lowrank_laplace.spectrum",
    "newton_step_from_factor": "lowrank_laplace.newton",
    "snr": "lowrank_laplace.directional",
    "supported_modules": "lowrank_laplace.engine.backpack",
}

_registration.register_with_laplace()


def __getattr__(name: str):
    """A public name (imported from its home on first use) or a subpackage."""
    if name in _HOMES:
        home = _HOMES[name]
        module = (_registration.import_laplace_classes()
                  if home == _registration.LAPLACE_CLASSES else _importlib.import_module(home))
        value = getattr(module, name)
        globals()[name] = value  # later lookups skip this function
        return value
    path = f"{__name__}.{name}"
    if not name.startswith("_") and _importlib_util.find_spec(path) is not None:
        return _importlib.import_module(path)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    """The module's names, the public ones not yet imported included."""
    return sorted(set(globals()) | set(__all__))


__all__ = list(_HOMES)
__version__ = "0.1.0"
