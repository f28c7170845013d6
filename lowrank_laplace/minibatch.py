"""The mini-batch GGN the ViViT functions work on: the problem and its options, once.

:func:`~lowrank_laplace.spectrum.ggn_eigh`,
:func:`~lowrank_laplace.directional.directional_derivatives`,
:func:`~lowrank_laplace.newton.damped_newton_step` and
:func:`~lowrank_laplace.newton.ggn_inverse_matvec` all compute ``V`` of one batch the
same way; their keyword options (``mc_samples``, ``subsampling``, ``param_groups``,
``low_memory``, ``backend``) are validated here into a :class:`MiniBatch`, which opens
the engine and runs its passes.

Shape glossary:
    N: batch size; M: columns of ``V``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from torch import Tensor, nn

from lowrank_laplace.engine import FactorEngine, check_backend
from lowrank_laplace.factor import GGNFactor
from lowrank_laplace.utils import checks


@dataclass(frozen=True)
class CurvatureOptions:
    """How a mini-batch's ``V`` is computed.

    Attributes:
        mc_samples: ``0`` for the exact GGN, ``M >= 1`` for a Monte-Carlo estimate
            from ``M`` sampled outputs per sample.
        subsampling: Indices of the samples used for the curvature (the loss of the
            subset, with its own reduction); gradients use the whole batch.
        param_groups: Optimizer-style groups (``[{"params": [...]}, ...]``) for a
            block-diagonal GGN; ``None`` is the whole network as one block.
        low_memory: Never hold all of ``V``: one more backward pass instead, holding
            one layer's block at a time.
        backend: ``'auto'``, ``'backpack'``, ``'hooks'`` or ``'functorch'``: which
            engine computes ``V`` (see :mod:`lowrank_laplace.engine`).
    """

    mc_samples: int = 0
    subsampling: Optional[Sequence[int]] = None
    param_groups: Optional[List[dict]] = None
    low_memory: bool = False
    backend: str = "auto"

    def __post_init__(self):
        checks.check_mc_samples(self.mc_samples)
        check_backend(self.backend)


#: The keyword options of the mini-batch functions.
OPTIONS = tuple(f.name for f in fields(CurvatureOptions))


def take_options(options: Dict[str, Any], extra: Sequence[str], caller: str
                 ) -> Tuple[CurvatureOptions, Dict[str, Any]]:
    """A function's keyword options: the curvature's, and its own ``extra`` ones.

    Args:
        options: The keyword arguments given.
        extra: The names the function takes besides :data:`OPTIONS`.
        caller: The function's name, for the message.

    Returns:
        ``(CurvatureOptions, {extra name: value})``.

    Raises:
        TypeError: For an unknown keyword, naming it.
    """
    unknown = sorted(set(options) - set(OPTIONS) - set(extra))
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword arguments {unknown}: it takes "
                        f"{', '.join(OPTIONS + tuple(extra))}.")
    return (CurvatureOptions(**{k: v for k, v in options.items() if k in OPTIONS}),
            {k: v for k, v in options.items() if k in extra})


@dataclass(frozen=True)
class MiniBatch:
    """One mini-batch's GGN problem: model, loss, batch and the curvature's options.

    Attributes:
        model: The network (left unchanged; no hooks remain).
        loss_func: ``nn.CrossEntropyLoss`` or ``nn.MSELoss``.
        inputs: Inputs, shape ``(N, ...)`` (or a dict batch).
        targets: Targets, shape ``(N,)`` or ``(N, C)``.
        options: How ``V`` is computed.
    """

    model: nn.Module
    loss_func: nn.Module
    inputs: Any
    targets: Optional[Tensor]
    options: CurvatureOptions = CurvatureOptions()

    @property
    def grouped(self) -> bool:
        """Whether the caller gave parameter groups (one result per group)."""
        return self.options.param_groups is not None

    @contextlib.contextmanager
    def engine(self, caller: str, low_memory: Optional[bool] = None
               ) -> Iterator[FactorEngine]:
        """The engine, after checking that ``V`` fits the device (before any pass).

        Args:
            caller: The function's name, for the memory message.
            low_memory: Whether the passes hold one block at a time (default: the
                option).

        Yields:
            The open :class:`~lowrank_laplace.engine.FactorEngine`.
        """
        opts = self.options
        low = opts.low_memory if low_memory is None else low_memory
        with FactorEngine(self.model, self.loss_func, backend=opts.backend) as engine:
            engine.check_memory(self.inputs, opts.subsampling, opts.mc_samples, low, caller)
            yield engine

    @property
    def pass_args(self) -> tuple:
        """``(inputs, targets, mc_samples, subsampling, param_groups)`` of the passes."""
        opts = self.options
        return (self.inputs, self.targets, opts.mc_samples, opts.subsampling,
                opts.param_groups)

    def compute(self, engine: FactorEngine, **flags: Any) -> GGNFactor:
        """One pass of ``engine`` over the batch (``flags``: what it collects).

        Args:
            engine: The open engine.
            **flags: :class:`~lowrank_laplace.engine.Request` fields.

        Returns:
            The factor.
        """
        return engine.compute(*self.pass_args, **flags)

    def results(self, values: list) -> Any:
        """One result per group with parameter groups, else the only one."""
        return values if self.grouped else values[0]
