"""The package's import hooks: moved module paths, and registering with laplace-torch.

The module paths of version 0.1 are kept for one release as deprecated aliases:
``import lowrank_laplace.merge`` still works and gives the module's new home
(:mod:`lowrank_laplace.fitting.streaming`), with a ``FutureWarning`` that names it.

laplace-torch's ``Laplace`` factory finds ``hessian_structure="lowrank_ggn"`` among the
subclasses of its base classes when it is called, so :mod:`lowrank_laplace.laplace_torch`
must be imported before the first call. ``import lowrank_laplace`` does not import
torch; :func:`register_with_laplace` imports the classes at once if laplace-torch is
already imported, and otherwise right after laplace-torch's own import finishes.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Iterator, Optional, Sequence

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


#: The subpackage holding the laplace-torch classes (the only one importing laplace-torch).
LAPLACE_CLASSES = "lowrank_laplace.laplace_torch"


@contextlib.contextmanager
def _quiet_laplace_import() -> Iterator[None]:
    """Hide the one warning importing laplace-torch prints, inside the block only.

    Importing laplace-torch imports its optional asdl backend, which calls the
    deprecated ``torch.jit.script``: nothing a user can act on. The user's warning
    filters are the same before and after.

    Yields:
        Nothing.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated",
                                category=FutureWarning)
        yield


def import_laplace_classes() -> ModuleType:
    """Import :data:`LAPLACE_CLASSES` (and with it laplace-torch), which registers them.

    Returns:
        The module.
    """
    with _quiet_laplace_import():
        return importlib.import_module(LAPLACE_CLASSES)


class LaplaceFinder(importlib.abc.MetaPathFinder):
    """Imports :data:`LAPLACE_CLASSES` as soon as the top-level ``laplace`` module has run.

    It finds nothing itself: it asks the other finders for ``laplace``'s spec and wraps
    that spec's loader's ``exec_module`` for this one import.
    """

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        """``laplace``'s own spec, its module's execution followed by ours; else ``None``.

        Args:
            fullname: The dotted module path being imported.
            path: Passed on to the other finders.
            target: Passed on to the other finders.

        Returns:
            The spec or ``None``.
        """
        if fullname != "laplace":
            return None
        for finder in [f for f in sys.meta_path if f is not self]:
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            try:
                with _quiet_laplace_import():
                    run(module)
            finally:
                with contextlib.suppress(AttributeError):
                    del loader.exec_module  # the loader's own method again
            _uninstall_laplace_finder()
            import_laplace_classes()  # laplace is complete (and in sys.modules) by now

        loader.exec_module = exec_then_register
        return spec


def _uninstall_laplace_finder() -> None:
    """Remove every :class:`LaplaceFinder` from ``sys.meta_path``."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, LaplaceFinder)]


def register_with_laplace() -> None:
    """Register the laplace-torch classes now if ``laplace`` is imported, else when it is.

    Importing :mod:`lowrank_laplace` calls this; a second call changes nothing.
    """
    if "laplace" in sys.modules:
        import_laplace_classes()
    elif not any(isinstance(f, LaplaceFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, LaplaceFinder())
