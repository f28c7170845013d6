r"""Computes the GGN factor ``V`` of a mini-batch with the backend that fits the model.

Two backends produce the same per-parameter blocks of ``V`` for the same consumers
(:mod:`~lowrank_laplace._engine_base`):

* ``'backpack'`` (:mod:`~lowrank_laplace._backpack_backend`): one BackPACK backward
  pass, blocks freed layer by layer, linear weights kept factored. It takes models
  built from modules BackPACK knows, each called once, without tied parameters.
* ``'functorch'`` (:mod:`~lowrank_laplace._func_backend`): vmapped vector-Jacobian
  products of the loss-Hessian factor's columns; any model torch.func
  differentiates (LayerNorm, attention, embeddings, LSTM, tied weights, functional
  operations, dict inputs).

``backend='auto'`` (the default) picks BackPACK when it supports the model (checked
statically, then on the first sample) and torch.func otherwise; the engine's
:attr:`FactorEngine.backend` and every factor's ``backend`` say which one ran.

Shape glossary:
    N: batch size; N_S: number of curvature samples (``len(subsampling)`` or N).
    C: model outputs; M: columns of ``V`` (``C * N_S`` exact, ``mc_samples * N_S``).
"""

from __future__ import annotations

from typing import Any, List, Optional

from torch import nn

from lowrank_laplace import _checks
from lowrank_laplace._backpack_backend import BackpackEngine
from lowrank_laplace._engine_base import (  # noqa: F401 - the engine's public helpers
    EngineBase,
    RNGReplay,
    rng_state,
    set_rng_state,
)
from lowrank_laplace._func_backend import FuncEngine
from lowrank_laplace.factor import GGNFactor

#: Values of the ``backend`` argument.
BACKENDS = ("auto", "backpack", "functorch")


def check_backend(backend: str) -> str:
    """Validate a ``backend`` argument.

    Args:
        backend: ``'auto'``, ``'backpack'`` or ``'functorch'``.

    Returns:
        The name.

    Raises:
        ValueError: For another value.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    return backend


class FactorEngine:
    """Computes :class:`GGNFactor` objects for a model without touching it.

    The engine works on a private copy of the model (without the user's hooks) and
    copies the user's current parameter values, buffers and modes into it before
    every computation; the user's model keeps its parameters, mode,
    ``requires_grad`` flags and hooks, and gets no new ones.

    Args:
        model: The network; its output must have shape ``(N, C)``.
        loss_func: ``nn.CrossEntropyLoss`` or ``nn.MSELoss`` with mean/sum reduction.
        eval_mode: Evaluate the private copy in eval mode whatever the model's mode
            (as laplace-torch does when fitting); ``False`` mirrors the model's mode.
        backend: ``'auto'``, ``'backpack'`` or ``'functorch'`` (see the module
            docstring).

    Attributes:
        backpack_problem: Why ``'auto'`` did not choose BackPACK (``None`` if it did
            or was not asked).
    """

    def __init__(self, model: nn.Module, loss_func: nn.Module, eval_mode: bool = False,
                 backend: str = "auto"):
        self.requested_backend = check_backend(backend)
        _checks.check_loss_func(loss_func)
        self.model, self.loss_func, self.eval_mode = model, loss_func, eval_mode
        self.backpack_problem: Optional[str] = None
        self._impl: Optional[EngineBase] = None
        self._closed = False
        if backend == "functorch":
            self._impl = FuncEngine(model, loss_func, eval_mode)
        elif backend == "backpack":
            self._impl = BackpackEngine(model, loss_func, eval_mode)
        else:
            _checks.check_batchnorm_mode(model, eval_mode)
            try:
                self._impl = BackpackEngine(model, loss_func, eval_mode)
            except NotImplementedError as err:
                self._use_functorch(err)

    def _use_functorch(self, reason: Exception) -> None:
        if self._impl is not None:
            self._impl.close()
        self.backpack_problem = str(reason)
        self._impl = FuncEngine(self.model, self.loss_func, self.eval_mode)

    @property
    def backend(self) -> str:
        """The backend in use: ``'backpack'`` or ``'functorch'``.

        With ``'auto'``, BackPACK is confirmed on the first batch; before that the
        name is the one chosen from the model alone.
        """
        return self._impl.backend

    def _engine(self, inputs: Any, targets: Any = None) -> EngineBase:
        """The backend for these inputs (``'auto'`` checks BackPACK on the first)."""
        if self._closed:
            raise RuntimeError("The engine is closed: create a new FactorEngine.")
        _checks.check_batch(inputs, targets)
        impl = self._impl
        if self.requested_backend == "auto" and isinstance(impl, BackpackEngine):
            try:
                impl.probe(inputs)
            except NotImplementedError as err:
                self._use_functorch(err)
        return self._impl

    @property
    def num_outputs(self) -> Optional[int]:
        """Model outputs ``C``, known after a forward pass."""
        return self._impl.num_outputs

    def dense_param_count(self, largest: bool = False) -> int:
        """Entries of ``V``'s rows stored explicitly per column (see the backends).

        Args:
            largest: Count only the largest single parameter's block.

        Returns:
            The count.
        """
        return self._impl.dense_param_count(largest)

    def bytes_per_sample(self, inputs: Any, num_vectors: Optional[int] = None,
                         one_block: bool = False) -> int:
        """Estimate the memory one sample adds to a computation of ``V``.

        Args:
            inputs: A batch of inputs (only the first sample is used).
            num_vectors: Vectors per sample (``mc_samples`` for MC); ``None`` uses
                the exact GGN's (``C``, or ``C - 1`` for cross-entropy).
            one_block: Count only the largest block (passes that keep no blocks).

        Returns:
            Estimated bytes per sample.
        """
        return self._engine(inputs).bytes_per_sample(inputs, num_vectors, one_block)

    def check_memory(self, inputs: Any, subsampling: Optional[List[int]], mc_samples: int,
                     low_memory: bool, caller: str) -> None:
        """Refuse, before any backward pass, a ``V`` the device cannot hold.

        The estimate (:meth:`bytes_per_sample` times the curvature samples) counts
        all of ``V``, or with ``low_memory`` the largest block a pass holds, and is
        compared with what the device can still allocate.

        Args:
            inputs: The batch.
            subsampling: Curvature samples (``None``: all).
            mc_samples: ``0`` (exact) or Monte-Carlo samples per data point.
            low_memory: Whether the passes hold one block of ``V`` at a time.
            caller: The function's name, for the message.

        Raises:
            MemoryError: If the estimate exceeds the available memory, naming the
                ways out.
        """
        n = _checks.check_batch(inputs, None)
        n = len(subsampling) if subsampling is not None else n
        need = n * self.bytes_per_sample(inputs, mc_samples or None, one_block=low_memory)
        device = _checks.batch_device(inputs)
        free = _checks.available_memory(device)
        if need <= free:
            return
        gib = 2**30
        if low_memory:
            ways = "a smaller batch, subsampling=..."
        else:
            lean = n * self.bytes_per_sample(inputs, mc_samples or None, one_block=True)
            ways = (f"low_memory=True (about {lean / gib:.1f} GiB: one block of V at a "
                    "time, a second backward pass), a smaller batch, subsampling=...")
        ways += ", mc_samples=1" if not mc_samples else ", fewer mc_samples"
        raise MemoryError(
            f"{caller}: {'the largest block of ' if low_memory else ''}V for {n} samples "
            f"needs about {need / gib:.1f} GiB, but {device.type} has {free / gib:.1f} GiB "
            f"available. Ways out: {ways}."
        )

    def gradient(self, inputs: Any, targets: Any,
                 param_groups: Optional[List[dict]] = None) -> list:
        """The mini-batch gradient per group (see :meth:`EngineBase.gradient`).

        Args:
            inputs: Inputs (tensor or dict batch).
            targets: Targets (``None`` for ``MSELoss`` uses zeros).
            param_groups: Optimizer-style groups; ``None`` is one group.

        Returns:
            One flat gradient per group, shape ``(D_g,)``.
        """
        return self._engine(inputs, targets).gradient(inputs, targets, param_groups)

    def compute(self, inputs: Any, targets: Any, *args: Any, **kwargs: Any) -> GGNFactor:
        """One pass collecting ``V`` (see :meth:`EngineBase.compute` for the options).

        Args:
            inputs: Inputs, shape ``(N, ...)``, or a dict batch passed whole to the
                model.
            targets: Targets (``None`` for ``MSELoss`` uses zeros).
            *args: Positional options of :meth:`EngineBase.compute`.
            **kwargs: Keyword options of :meth:`EngineBase.compute`.

        Returns:
            The factor.
        """
        return self._engine(inputs, targets).compute(inputs, targets, *args, **kwargs)

    def close(self) -> None:
        """Remove everything the backend installed (BackPACK's hooks)."""
        self._impl.close()
        self._closed = True

    def __enter__(self) -> "FactorEngine":
        return self

    def __exit__(self, *args) -> None:
        self.close()
