"""Registering ``hessian_structure="lowrank_ggn"`` with laplace-torch, in either import order.

``Laplace`` finds the structure among its base classes' subclasses when called, so
:mod:`lowrank_laplace.laplace_torch` is imported at once if ``laplace`` is, else right
after laplace-torch's own import (``import lowrank_laplace`` does not import torch).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import sys
import warnings
from types import ModuleType
from typing import Iterator, Optional, Sequence

#: The subpackage holding the laplace-torch classes (the only one importing laplace-torch).
LAPLACE_CLASSES = "lowrank_laplace.laplace_torch"


@contextlib.contextmanager
def _quiet_laplace_import() -> Iterator[None]:
    """Hide laplace-torch's import warning (asdl's ``torch.jit.script``) inside the block only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated",
                                category=FutureWarning)
        yield


def import_laplace_classes() -> ModuleType:
    """Return :data:`LAPLACE_CLASSES`, imported (with laplace-torch), which registers them."""
    with _quiet_laplace_import():
        return importlib.import_module(LAPLACE_CLASSES)


class LaplaceFinder(importlib.abc.MetaPathFinder):
    """Imports :data:`LAPLACE_CLASSES` as soon as the top-level ``laplace`` module has run.

    It finds nothing itself: it wraps the ``exec_module`` of ``laplace``'s own spec's loader.
    """

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        """Return ``laplace``'s own spec, its module's execution followed by ours; else ``None``."""
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
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, LaplaceFinder)]
            import_laplace_classes()  # laplace is complete (and in sys.modules) by now

        loader.exec_module = exec_then_register
        return spec


def register_with_laplace() -> None:
    """Register the laplace-torch classes now if ``laplace`` is imported, else when it is."""
    if "laplace" in sys.modules:
        import_laplace_classes()
    elif not any(isinstance(f, LaplaceFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, LaplaceFinder())
