"""Computes the GGN factor ``V`` of a mini-batch with the backend that fits the model.

``'backpack'``, ``'hooks'`` and ``'functorch'`` produce the same blocks; ``'auto'`` takes
the first, in this order, that accepts the model (docs/concepts.md, "The backends").
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type

from torch import Tensor, nn

from lowrank_laplace.engine.backpack.backend import BackpackEngine
from lowrank_laplace.engine.base import EngineBase
from lowrank_laplace.engine.functorch import LOOPING, FuncEngine
from lowrank_laplace.engine.hooks import HooksEngine
from lowrank_laplace.engine.rng import RNGReplay
from lowrank_laplace.factor import GGNFactor
from lowrank_laplace.utils import batches, checks

#: Values of the ``backend`` argument.
BACKENDS = ("auto", "backpack", "hooks", "functorch")
#: The backends each value tries, in order.
CANDIDATES = {
    "auto": (BackpackEngine, HooksEngine, FuncEngine),
    "backpack": (BackpackEngine,),
    "hooks": (HooksEngine,),
    "functorch": (FuncEngine,),
}


def check_backend(backend: str) -> str:
    """Return a valid ``backend`` argument (one of :data:`BACKENDS`); raise ``ValueError`` else."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    return backend


class FactorEngine:
    """Computes :class:`GGNFactor` objects for a model without touching it (a private copy).

    Args:
        model: The network; its output must have shape ``(N, C)``.
        loss_func: ``nn.CrossEntropyLoss`` or ``nn.MSELoss`` with mean/sum reduction.
        eval_mode: Evaluate in eval mode (as laplace-torch's fits); ``False`` mirrors the model.
        backend: ``'auto'``, ``'backpack'``, ``'hooks'`` or ``'functorch'``.

    Attributes:
        rejected: Why ``'auto'`` passed over each backend: name -> reason.
    """

    def __init__(self, model: nn.Module, loss_func: nn.Module, eval_mode: bool = False,
                 backend: str = "auto"):
        self.requested_backend = check_backend(backend)
        checks.check_loss_func(loss_func)
        self.model, self.loss_func, self.eval_mode = model, loss_func, eval_mode
        self.rejected: Dict[str, str] = {}
        if backend == "auto":
            checks.check_batchnorm_mode(model, eval_mode)
        self._candidates: List[Type[EngineBase]] = list(CANDIDATES[backend])
        self._impl: EngineBase = self._next_backend(None)
        self._confirmed = not self._candidates
        self._closed = self._independence_checked = False

    def _next_backend(self, reason: Optional[Exception]) -> EngineBase:
        """The next candidate that accepts the model (the last one must)."""
        if reason is not None:
            self._impl.close()
            self.rejected[self._impl.backend] = str(reason)
        while True:
            cls = self._candidates.pop(0)
            try:
                return cls(self.model, self.loss_func, self.eval_mode)
            except NotImplementedError as err:
                if not self._candidates:
                    raise self._refused_by_all(err) from err
                self.rejected[cls.backend] = str(err)

    def _refused_by_all(self, err: NotImplementedError) -> NotImplementedError:
        """The last candidate's refusal, with the reasons of those passed over before."""
        if not self.rejected:
            return err
        others = "; ".join(f"{name}: {why}" for name, why in self.rejected.items())
        return NotImplementedError(f"{err} (No other backend takes the model either: "
                                   f"{others})")

    @property
    def backpack_problem(self) -> Optional[str]:
        """Why ``'auto'`` did not choose BackPACK (``None`` if it did or was not asked)."""
        return self.rejected.get("backpack")

    @property
    def backend(self) -> str:
        """The backend in use (before the first batch, the one chosen from the model alone)."""
        return self._impl.backend

    @property
    def gradient_in_factor_pass(self) -> bool:
        """See :attr:`EngineBase.gradient_in_factor_pass` (of the backend in use)."""
        return self._impl.gradient_in_factor_pass

    def _engine(self, inputs: Any, targets: Any = None) -> EngineBase:
        """The backend for these inputs (``'auto'`` probes the candidates on the first)."""
        if self._closed:
            raise RuntimeError("The engine is closed: create a new FactorEngine.")
        checks.check_batch(inputs, targets)
        if not self._independence_checked:  # until a batch has two distinct samples
            self._independence_checked = self._impl.check_independent(inputs)
        while not self._confirmed:
            try:
                self._impl.probe(inputs, targets)
                self._confirmed = True
            except NotImplementedError as err:
                if not self._candidates:
                    raise self._refused_by_all(err) from err
                self._impl = self._next_backend(err)
        return self._impl

    @property
    def num_outputs(self) -> Optional[int]:
        """Model outputs ``C``, known after a forward pass."""
        return self._impl.num_outputs

    def dense_param_count(self, largest: bool = False) -> int:
        """See :meth:`EngineBase.dense_param_count` (of the backend in use)."""
        return self._impl.dense_param_count(largest)

    def bytes_per_sample(self, inputs: Any, num_vectors: Optional[int] = None,
                         one_block: bool = False) -> int:
        """See :meth:`EngineBase.bytes_per_sample` (of the backend for ``inputs``)."""
        return self._engine(inputs).bytes_per_sample(inputs, num_vectors, one_block)

    def check_memory(self, inputs: Any, subsampling: Optional[List[int]], mc_samples: int,
                     low_memory: bool, caller: str) -> None:
        """Refuse, before any backward pass, a ``V`` the device cannot hold.

        The estimate is :meth:`bytes_per_sample` (with ``low_memory``: of the largest block)
        times the curvature samples.

        Args:
            inputs: The batch.
            subsampling: Curvature samples (``None``: all).
            mc_samples: ``0`` (exact) or Monte-Carlo samples per data point.
            low_memory: The passes hold one block of ``V`` at a time.
            caller: The function's name, for the message.

        Raises:
            MemoryError: If the estimate exceeds the available memory, naming the ways out.
        """
        n = checks.check_batch(inputs, None)
        n = len(subsampling) if subsampling is not None else n
        need = n * self.bytes_per_sample(inputs, mc_samples or None, one_block=low_memory)
        device = batches.batch_device(inputs)
        free = batches.available_memory(device)
        if need <= free:
            return
        if low_memory:
            ways = "a smaller batch, subsampling=..."
        else:
            lean = n * self.bytes_per_sample(inputs, mc_samples or None, one_block=True)
            ways = (f"low_memory=True (about {batches.format_bytes(lean)}: one block of V "
                    "at a time, a second backward pass), a smaller batch, subsampling=...")
        ways += ", mc_samples=1" if not mc_samples else ", fewer mc_samples"
        raise MemoryError(
            f"{caller}: {'the largest block of ' if low_memory else ''}V for {n} samples "
            f"needs about {batches.format_bytes(need)}, but {device.type} has "
            f"{batches.format_bytes(free)} available. Ways out: {ways}.")

    def gradient(self, inputs: Any, targets: Any,
                 param_groups: Optional[List[dict]] = None) -> list:
        """See :meth:`EngineBase.gradient` (of the backend for ``inputs``)."""
        return self._engine(inputs, targets).gradient(inputs, targets, param_groups)

    def compute(self, inputs: Any, targets: Any, *args: Any, **kwargs: Any) -> GGNFactor:
        """See :meth:`EngineBase.compute` (of the backend for ``inputs``)."""
        return self._engine(inputs, targets).compute(inputs, targets, *args, **kwargs)

    def gram_and_projection(self, inputs: Any, targets: Any, mc_samples: int,
                            subsampling: Optional[List[int]],
                            param_groups: Optional[List[dict]],
                            coefficients: Callable[[GGNFactor], List[Tensor]],
                            replay: Optional[RNGReplay] = None, **first: Any
                            ) -> Tuple[GGNFactor, GGNFactor]:
        """Return the factors of two passes never holding all of ``V``: Gram matrices, then ``V y``.

        ``coefficients`` turns the first factor into ``y`` per group; the second pass, whose
        factor holds ``projected``, replays the first's random draws.

        Args:
            inputs: Inputs.
            targets: Targets.
            mc_samples: ``0`` (exact) or Monte-Carlo samples.
            subsampling: Curvature sample indices or ``None``.
            param_groups: Optimizer-style groups; ``None`` is one group.
            coefficients: The first pass's factor -> ``y`` ``(M, K)`` per group.
            replay: The draws to replay (default: those of the first pass, from now).
            **first: More :class:`~lowrank_laplace.engine.request.Request` fields of the first pass.
        """
        replay = RNGReplay(batches.batch_device(inputs)) if replay is None else replay
        args = (inputs, targets, mc_samples, subsampling, param_groups)
        grams = self.compute(*args, keep_blocks=False, compute_grams=True, **first)
        replay.mark()
        ys = coefficients(grams)
        with replay:
            projected = self.compute(*args, keep_blocks=False, project=ys)
        return grams, projected

    def close(self) -> None:
        """Remove everything the backend installed (BackPACK's hooks)."""
        self._impl.close()
        self._closed = True

    def __enter__(self) -> "FactorEngine":
        return self

    def __exit__(self, *args) -> None:
        self.close()


@contextlib.contextmanager
def jacobian_engine(model: nn.Module, backend: str) -> Iterator[FactorEngine]:
    """An MSE-sum engine on the model in eval mode (``V = sqrt(2) J^T``).

    Without the functorch looping warning, which the fit already gave.

    Args:
        model: The network (left unchanged).
        backend: The engine's backend.

    Yields:
        The open engine.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=LOOPING)
        with FactorEngine(model, nn.MSELoss(reduction="sum"), eval_mode=True,
                          backend=backend) as engine:
            yield engine
