"""The BackPACK backend: one backward pass of ``SqrtGGNExact``/``SqrtGGNMC``.

:mod:`~lowrank_laplace.engine.backpack.backend` runs the pass,
:mod:`~lowrank_laplace.engine.backpack.convert` rewrites functional operations into
modules, :mod:`~lowrank_laplace.engine.backpack.extensions` holds the per-layer
extensions.
"""

from lowrank_laplace.engine.backpack.backend import BackpackEngine
from lowrank_laplace.engine.backpack.extensions import supported_modules

__all__ = ["BackpackEngine", "supported_modules"]
