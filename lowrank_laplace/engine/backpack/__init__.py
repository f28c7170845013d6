"""The BackPACK backend: one backward pass of ``SqrtGGNExact``/``SqrtGGNMC``."""

from lowrank_laplace.engine.backpack.backend import BackpackEngine
from lowrank_laplace.engine.backpack.extensions import supported_modules

__all__ = ["BackpackEngine", "supported_modules"]
