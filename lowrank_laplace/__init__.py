"""lowrank_laplace: Laplace posteriors on the exact low-rank structure of the GGN.

Importing it registers ``hessian_structure="lowrank_ggn"`` with laplace-torch's
``Laplace`` factory (``subset_of_weights="all"`` and ``"last_layer"``).

The mini-batch engine (ViViT): the GGN ``G = V V^T`` with ``V`` computed in one
backward pass; its nonzero spectrum lives in the small Gram matrix ``V^T V``. The
subpackages follow the data flow: :mod:`~lowrank_laplace.factor` (``V`` and its
blocks) -> :mod:`~lowrank_laplace.engine` (computing ``V``) -> the ViViT functions
(:mod:`~lowrank_laplace.spectrum`, :mod:`~lowrank_laplace.directional`,
:mod:`~lowrank_laplace.newton`) -> :mod:`~lowrank_laplace.fitting` (a loader's GGN)
-> :mod:`~lowrank_laplace.posterior` -> :mod:`~lowrank_laplace.laplace_torch`;
:mod:`~lowrank_laplace.toolkit` holds data, metrics, plots and the CLI.
"""

import warnings as _warnings

from lowrank_laplace.directional import (
    DirectionalDerivatives,
    directional_derivatives,
    directional_from_factor,
    snr,
)
from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.engine.backpack import supported_modules
from lowrank_laplace.factor import GGNFactor
from lowrank_laplace.fitting import SketchMerge, StreamingMerge
from lowrank_laplace.newton import damped_newton_step, ggn_inverse_matvec, newton_step_from_factor
from lowrank_laplace.posterior import LowRankPrecision, Residual
from lowrank_laplace.spectrum import LowRankGGN, ggn_eigh, ggn_eigvals, gram_eigh, lowrank_ggn
from lowrank_laplace.utils import moved as _moved
from lowrank_laplace.utils.checks import layerwise_param_groups

with _warnings.catch_warnings():
    # importing laplace-torch imports its optional asdl backend, which calls the
    # deprecated torch.jit.script: nothing a user can act on. Hidden during this import
    # only; the user's warning filters are the same before and after.
    _warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated",
                             category=FutureWarning)
    from lowrank_laplace.laplace_torch import LowRankGGNLaplace, LowRankGGNLLLaplace

_moved.install()


def __getattr__(name: str):
    """``lowrank_laplace.merge`` and the other moved modules, with a deprecation warning."""
    old = f"{__name__}.{name}"
    if old in _moved.MOVED:
        import importlib

        return importlib.import_module(old)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DirectionalDerivatives",
    "FactorEngine",
    "GGNFactor",
    "LowRankGGN",
    "LowRankGGNLLLaplace",
    "LowRankGGNLaplace",
    "LowRankPrecision",
    "Residual",
    "SketchMerge",
    "StreamingMerge",
    "damped_newton_step",
    "directional_derivatives",
    "directional_from_factor",
    "ggn_eigh",
    "ggn_eigvals",
    "ggn_inverse_matvec",
    "gram_eigh",
    "layerwise_param_groups",
    "lowrank_ggn",
    "newton_step_from_factor",
    "snr",
    "supported_modules",
]
__version__ = "0.1.0"
