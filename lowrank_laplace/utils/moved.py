"""The module paths of version 0.1, kept for one release as deprecated aliases.

``import lowrank_laplace.merge`` still works and gives the module's new home
(:mod:`lowrank_laplace.fitting.streaming`), with a ``FutureWarning`` that names it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Optional, Sequence

#: Old module path -> new module path.
MOVED = {
    "lowrank_laplace.merge": "lowrank_laplace.fitting.streaming",
    "lowrank_laplace.sketch": "lowrank_laplace.fitting.sketch",
    "lowrank_laplace.residual": "lowrank_laplace.posterior.residual",
    "lowrank_laplace.predictive": "lowrank_laplace.posterior.predictive",
    "lowrank_laplace.laplace_backend": "lowrank_laplace.laplace_torch.laplace",
    "lowrank_laplace.datasets": "lowrank_laplace.toolkit.datasets",
    "lowrank_laplace.metrics": "lowrank_laplace.toolkit.metrics",
    "lowrank_laplace.plots": "lowrank_laplace.toolkit.plots",
    "lowrank_laplace.calibration": "lowrank_laplace.toolkit.calibration",
    "lowrank_laplace.rank_study": "lowrank_laplace.toolkit.rank_study",
    "lowrank_laplace.cli": "lowrank_laplace.toolkit.cli",
}


def warn_moved(old: str, stacklevel: int = 3) -> str:
    """Warn that a module path moved and return its new path.

    Args:
        old: The old dotted path (a key of :data:`MOVED`).
        stacklevel: Passed to :func:`warnings.warn`.

    Returns:
        The new dotted path.
    """
    new = MOVED[old]
    warnings.warn(f"{old} is deprecated and will be removed in version 0.3: import {new}.",
                  FutureWarning, stacklevel=stacklevel)
    return new


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new path (the same module object)."""

    def create_module(self, spec) -> ModuleType:
        module = importlib.import_module(warn_moved(spec.name, stacklevel=8))
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module is already imported."""


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old module paths of :data:`MOVED`."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        """A spec that aliases ``fullname`` if it moved, else ``None``.

        Args:
            fullname: The dotted module path being imported.
            path: Unused (meta path finder protocol).
            target: Unused.

        Returns:
            The spec or ``None``.
        """
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias())


def install() -> None:
    """Register the finder once (importing :mod:`lowrank_laplace` does)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
