"""lowrank_laplace: Laplace posteriors on the exact low-rank structure of the GGN.

Importing it registers ``hessian_structure="lowrank_ggn"`` with laplace-torch's
``Laplace`` factory (``subset_of_weights="all"`` and ``"last_layer"``).

The mini-batch engine (ViViT): the GGN ``G = V V^T`` with ``V`` computed by BackPACK
in one backward pass; its nonzero spectrum lives in the small Gram matrix ``V^T V``.
"""

import warnings as _warnings

from lowrank_laplace._checks import layerwise_param_groups
from lowrank_laplace._extensions import supported_modules
from lowrank_laplace.directional import (
    DirectionalDerivatives,
    damped_newton_step,
    directional_derivatives,
    directional_from_factor,
    ggn_inverse_matvec,
    newton_step_from_factor,
    snr,
)
from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.factor import GGNFactor

with _warnings.catch_warnings():
    # importing laplace-torch imports its optional asdl backend, which calls the
    # deprecated torch.jit.script: nothing a user can act on. Hidden during this import
    # only; the user's warning filters are the same before and after.
    _warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated",
                             category=FutureWarning)
    from lowrank_laplace.laplace_backend import LowRankGGNLaplace, LowRankGGNLLLaplace
from lowrank_laplace.merge import StreamingMerge
from lowrank_laplace.posterior import LowRankPrecision
from lowrank_laplace.residual import Residual
from lowrank_laplace.sketch import SketchMerge
from lowrank_laplace.spectrum import (
    LowRankGGN,
    ggn_eigh,
    ggn_eigvals,
    gram_eigh,
    lowrank_ggn,
)

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
