"""The BackPACK backend: ``V`` of a mini-batch in one backward pass (docs/concepts.md).

The only module importing BackPACK besides its extensions. With ``subsampling=S`` the
curvature is that of the loss on ``S`` with its own reduction; gradients use the batch.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import MutableMapping
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from backpack import backpack, extend
from backpack.context import CTX
from backpack.utils.module_classification import is_no_op
from torch import Tensor, nn

from lowrank_laplace.engine.backpack.buffers import RowBuffers
from lowrank_laplace.engine.backpack.convert import convert
from lowrank_laplace.engine.backpack.extensions import (
    batch_grad_extension,
    sqrt_ggn_extension,
    supported_modules,
)
from lowrank_laplace.engine.base import EngineBase
from lowrank_laplace.engine.model_copy import function_hooks, removing
from lowrank_laplace.engine.request import Collector
from lowrank_laplace.engine.rng import forked_rng
from lowrank_laplace.factor import factor_columns
from lowrank_laplace.factor.blocks import Block, DenseBlock
from lowrank_laplace.utils import checks

_ADAPTIVE_POOLS = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)

#: Held by every BackPACK pass and change to its hooks: BackPACK's state (``CTX``) is
#: process-wide. Re-entrant: a probe that fails closes the engine.
_BACKPACK_LOCK = threading.RLock()


def serialized(method: Callable[..., Any]) -> Callable[..., Any]:
    """Return a method of :class:`BackpackEngine`, run holding the lock on BackPACK's globals."""
    @functools.wraps(method)
    def locked(*args, **kwargs):
        with _BACKPACK_LOCK:
            return method(*args, **kwargs)

    return locked


class UnsupportedLayerOptions(NotImplementedError, ValueError):
    """A layer BackPACK knows, with constructor options its derivatives get wrong.

    A ``NotImplementedError`` (``backend='auto'`` passes BackPACK over) and a ``ValueError``
    (an explicit ``backend='backpack'`` was asked for what it cannot compute).
    """


def _padded(module: nn.Module) -> bool:
    """Whether a convolution pads its input (``"same"``, or any explicit padding)."""
    padding = module.padding
    return padding == "same" if isinstance(padding, str) else any(p > 0 for p in padding)


_CONV_OPTIONS = (
    (lambda m: m.padding == "same",
     "padding='same' (BackPACK's derivatives pad symmetrically by an explicit amount)"),
    (lambda m: m.padding_mode != "zeros" and _padded(m),
     "padding_mode={padding_mode!r} (BackPACK's derivatives assume zero padding)"),
)
_CONV_TRANSPOSE_OPTIONS = (
    (lambda m: any(p > 0 for p in m.output_padding),
     "output_padding={output_padding} (BackPACK's derivatives leave it out)"),
)
_AVG_POOL_OPTIONS = (
    (lambda m: m.ceil_mode, "ceil_mode=True (BackPACK's derivatives assume whole windows)"),
    (lambda m: not m.count_include_pad,
     "count_include_pad=False (BackPACK's derivatives divide by the whole window)"),
    (lambda m: getattr(m, "divisor_override", None) is not None,  # AvgPool1d has none
     "divisor_override={divisor_override} (BackPACK's derivatives divide by the window "
     "size)"),
)
_BATCHNORM_OPTIONS = (
    (lambda m: not m.affine, "affine=False (BackPACK's derivatives need the affine weight)"),
)
_EMBEDDING_OPTIONS = (
    (lambda m: m.padding_idx is not None,
     "padding_idx={padding_idx} (BackPACK's derivatives take every index)"),
    (lambda m: m.max_norm is not None,
     "max_norm={max_norm} (BackPACK's derivatives do not renormalise)"),
)

#: Layer type -> ``(predicate, option)`` pairs: the constructor options BackPACK's
#: derivatives of that layer silently get wrong or fail on (checked in float64 against
#: dense torch.func GGNs, ``tests/engine/test_backpack_layer_options.py``). ``option`` is
#: formatted with the layer's attributes. ``backend='auto'`` passes such models to a
#: backend that is exact for them; ``backend='backpack'`` refuses them.
UNSUPPORTED_OPTIONS: Dict[type, Tuple[Tuple[Callable[[nn.Module], bool], str], ...]] = {
    nn.Conv1d: _CONV_OPTIONS, nn.Conv2d: _CONV_OPTIONS, nn.Conv3d: _CONV_OPTIONS,
    nn.ConvTranspose1d: _CONV_TRANSPOSE_OPTIONS, nn.ConvTranspose2d: _CONV_TRANSPOSE_OPTIONS,
    nn.ConvTranspose3d: _CONV_TRANSPOSE_OPTIONS,
    nn.AvgPool1d: _AVG_POOL_OPTIONS, nn.AvgPool2d: _AVG_POOL_OPTIONS,
    nn.AvgPool3d: _AVG_POOL_OPTIONS,
    nn.BatchNorm1d: _BATCHNORM_OPTIONS, nn.BatchNorm2d: _BATCHNORM_OPTIONS,
    nn.BatchNorm3d: _BATCHNORM_OPTIONS,
    nn.Embedding: _EMBEDDING_OPTIONS,
}


def unsupported_option(module: nn.Module) -> Optional[str]:
    """Return the first option of ``module`` BackPACK gets wrong (:data:`UNSUPPORTED_OPTIONS`)."""
    for cls in type(module).__mro__:
        for applies, option in UNSUPPORTED_OPTIONS.get(cls, ()):
            if applies(module):
                return option.format(**vars(module))
    return None


def check_model(model: nn.Module, supported: Sequence[type]) -> None:
    """Check that BackPACK can backpropagate the GGN factor through every layer.

    ``supported`` are the module classes with a ``SqrtGGN`` extension.

    Raises:
        UnsupportedLayerOptions: Naming the first layer with options BackPACK gets wrong.
        NotImplementedError: Naming the first unsupported layer or tied parameter.
    """
    for name, module in model.named_modules():
        option = unsupported_option(module)
        if option is not None:
            raise UnsupportedLayerOptions(
                f"Layer {name or type(model).__name__!r} ({type(module).__name__}) has "
                f"{option}, so BackPACK would compute a wrong GGN: use backend='functorch' "
                "(exact for any layer options) or 'auto', which chooses it (laplace-torch: "
                "factor_backend='functorch' or 'auto').")
    tied = checks.shared_parameters(model)
    if tied:
        raise NotImplementedError(
            f"Parameters {tied[0]} are one tied parameter used by several modules; "
            "BackPACK would treat each use as a parameter of its own. The functorch "
            "backend handles tied weights exactly (backend='auto' or 'functorch').")
    for name, module in model.named_modules():
        name = name or type(model).__name__
        if isinstance(module, tuple(supported)):
            continue
        if list(module.children()):  # a container: traced through, unless it owns parameters
            if list(module.parameters(recurse=False)):
                raise NotImplementedError(
                    f"Module {name!r} ({type(module).__name__}) owns parameters but "
                    "is not a layer BackPACK supports: use backend='functorch' (or "
                    "'auto').")
        elif not is_no_op(module):
            raise NotImplementedError(
                f"Layer {name!r} ({type(module).__name__}) is not supported by BackPACK's "
                "GGN factor extension: use backend='functorch' (or 'auto'), replace it "
                "with a supported layer, or compute the curvature of the layers after it "
                "only (e.g. laplace-torch's subset_of_weights='last_layer').")


def checked_forward(model: nn.Module, inputs: Tensor) -> Tensor:
    """Return the output of a forward pass that verifies every operation is a module BackPACK sees.

    Raises:
        NotImplementedError: For a functional operation between modules, a module
            called twice, or an adaptive average pooling of unequal windows.
    """
    produced = {id(inputs)}
    keep_alive = [inputs]
    called = set()
    problems = []
    names = {m: n for n, m in model.named_modules()}

    def hook(module, inp, out):
        if module in called:
            problems.append(f"module {names[module]!r} is called more than once")
        called.add(module)
        for t in inp:
            if isinstance(t, Tensor) and id(t) not in produced and not problems:
                problems.append(
                    f"the input of {names[module]!r} ({type(module).__name__}) is not "
                    "the output of another module")
        if isinstance(module, _ADAPTIVE_POOLS) and not problems:
            spatial = inp[0].shape[2:]  # (N, C, *spatial)
            if any(i % o for i, o in zip(spatial, out.shape[2:])):
                problems.append(
                    f"{names[module]!r} ({type(module).__name__}) maps input size "
                    f"{tuple(spatial)} to {tuple(out.shape[2:])}, which does not divide "
                    "it (BackPACK needs equal pooling windows)")
        for t in out if isinstance(out, tuple) else (out,):
            produced.add(id(t))
            keep_alive.append(t)

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    with removing(handles):
        outputs = model(inputs)
    if id(outputs) not in produced and not problems:
        problems.append("the model output is not the output of a module")
    if problems:
        raise NotImplementedError(
            f"BackPACK cannot compute this model's GGN factor: {problems[0]}. The "
            "functorch backend can (backend='auto' or 'functorch'); for BackPACK use "
            "modules instead of functional operations (nn.ReLU, nn.Flatten, "
            "backpack.custom_module.branching.Parallel/SumModule for residuals).")
    return outputs


def probe_graph(net: nn.Module, sample: Tensor) -> Tuple[Optional[str], List[Tensor]]:
    """Return what BackPACK's pass would miss: the first problem (or ``None``), unused parameters.

    A module running with gradient tracking off (reentrant checkpointing, ``no_grad``)
    gives it nothing; one running again in the backward pass overwrites what it read; a
    trainable parameter the output does not depend on gets no block. ``net`` is extended,
    ``sample`` one input ``(1, ...)``.

    Raises:
        RuntimeError: What the passes raise otherwise (e.g. in-place operations on views).
    """
    names = {m: n for n, m in net.named_modules()}
    backward, problems = [False], []

    def hook(module, args):
        if backward[0]:
            problems.append(f"module {names[module]!r} runs again in the backward pass "
                            "(gradient checkpointing recomputes it)")
        elif not torch.is_grad_enabled():
            problems.append(f"module {names[module]!r} runs with gradient tracking off "
                            "(torch.utils.checkpoint(..., use_reentrant=True), or "
                            "torch.no_grad())")

    handles = [m.register_forward_pre_hook(hook) for m in net.modules()
               if not list(m.children())]
    params = [p for p in net.parameters() if p.requires_grad]
    grads = [None] * len(params)
    with removing(handles):
        try:
            out = net(sample)
            backward[0] = True
            if isinstance(out, Tensor) and out.requires_grad and params:
                with warnings.catch_warnings():  # BackPACK's hooks are installed but idle
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    grads = torch.autograd.grad(out.sum(), params, allow_unused=True)
        except RuntimeError as err:
            if not problems and "checkpoint" not in str(err):
                raise
            problems.append(f"gradient checkpointing ({err})")
    return (problems[0] if problems else None,
            [p for p, g in zip(params, grads) if g is None])


class BackpackEngine(EngineBase):
    """The BackPACK backend (arguments as :class:`~lowrank_laplace.engine.base.EngineBase`'s).

    Its hooks go on the private copy at the first pass and stay until :meth:`close`.
    """

    backend = "backpack"

    def __init__(self, model: nn.Module, loss_func: nn.Module, eval_mode: bool = False):
        super().__init__(model, loss_func, eval_mode)
        self._handles = None  # BackPACK hooks, installed at the first pass
        self._unused: set = set()  # trainable parameters the output ignores: zero blocks
        self._buffers = RowBuffers()  # conv rows and max-pool matrices, until close()

    def _check_model(self, model: nn.Module, eval_mode: bool) -> None:
        check_model(model, supported_modules())

    @serialized
    def probe(self, inputs: Any, targets: Optional[Tensor] = None) -> None:
        """See :meth:`EngineBase.probe`; then install BackPACK's hooks.

        Refused: unknown layers, dict batches, in-place operations on layer outputs, forward
        hooks that change the function, gradient checkpointing.
        """
        if self._handles is not None:
            return
        if isinstance(inputs, MutableMapping):
            raise NotImplementedError(
                "BackPACK takes tensor inputs, not dict batches: the functorch backend "
                "does (backend='auto' or 'functorch').")
        self._sync()
        problem = None
        with torch.no_grad(), forked_rng(inputs.device):
            with function_hooks(self._copy) as found:
                try:
                    checked_forward(self._copy, inputs[:1])
                except NotImplementedError as err:
                    problem = err
        if found:
            raise NotImplementedError(
                f"Module {found[0]!r} has forward hooks or pre-hooks that are part of the "
                "model's function (they change its output, its input or its attributes, "
                "as torch.nn.utils.prune and weight_norm do): BackPACK's layer "
                "derivatives do not see them. The hooks and functorch backends run them "
                "(backend='auto').")
        if problem is not None:
            self._net = self._converted(inputs[:1], problem)
        num_handles = len(CTX.hook_handles)
        for module in self._net.modules():  # containers are traced through, not hooked
            # a model extended elsewhere carries the flag but not the hooks: extend anew
            if hasattr(module, "_backpack_extend"):
                del module._backpack_extend
            if not list(module.children()):
                extend(module)
        extend(self._loss)
        self._handles = CTX.hook_handles[num_handles:]
        with torch.enable_grad(), forked_rng(inputs.device):
            try:  # BackPACK's module hooks return views that in-place operations break
                problem, unused = probe_graph(self._net, inputs[:1])
            except RuntimeError as err:
                if "inplace" not in str(err):
                    raise
                self.close()
                raise NotImplementedError(
                    "An in-place operation (e.g. ReLU(inplace=True), x.relu_()) modifies a "
                    "layer output, which BackPACK's hooks cannot take: the hooks and "
                    "functorch backends can (backend='auto').") from err
        self._unused = {self._index[id(p)] for p in unused if id(p) in self._index}
        if problem is not None:
            self.close()
            raise NotImplementedError(
                f"BackPACK cannot compute this model's GGN factor: {problem}. Ways out: "
                "backend='auto' (the hooks backend takes non-reentrant checkpointing, "
                "use_reentrant=False), or fit without checkpointing.")

    def _converted(self, sample: Tensor, problem: NotImplementedError) -> nn.Module:
        """The model rewritten into BackPACK modules and checked on ``sample``, else ``problem``."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the converter warns about leftovers
                net = convert(self._copy)
            for module in net.modules():  # modules the converter added
                module.training = False if self.eval_mode else self._copy.training
            check_model(net, supported_modules())
            same = torch.allclose(checked_forward(net, sample), self._copy(sample))
        except UnsupportedLayerOptions:  # a functional pool with such options
            raise
        except Exception:  # noqa: BLE001 - the converter's own errors are not the point
            same = False
        if not same:
            raise NotImplementedError(
                f"{problem} (BackPACK's torch.fx converter could not rewrite it either)"
            ) from problem
        return net

    def _factored_ids(self) -> set:
        return {id(m.weight) for m in self.model.modules() if isinstance(m, nn.Linear)}

    def _vector_entries(self, feature_sizes: List[int], one_block: bool) -> int:
        # expanded blocks plus the backpropagated vectors at the widest layer output
        return self.dense_param_count(largest=one_block) + 2 * max(feature_sizes)

    @serialized
    def close(self) -> None:
        """Remove every BackPACK hook the engine installed."""
        handles = self._handles or []
        for handle in handles:
            handle.remove()
        ids = {id(h) for h in handles}
        CTX.hook_handles = [h for h in CTX.hook_handles if id(h) not in ids]
        self._handles = []
        self._buffers.clear()
        super().close()

    @serialized
    def _autograd(self, loss: Tensor, params: List[Tensor]):
        with warnings.catch_warnings():  # BackPACK's hooks are installed but idle
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            return torch.autograd.grad(loss, params, allow_unused=True)

    @serialized
    def _pass(self, inputs: Tensor, targets: Optional[Tensor], mc_samples: int,
              subsampling: Optional[List[int]], collector: Collector
              ) -> Tuple[Tensor, Tensor, Dict[int, Tensor]]:
        self.probe(inputs)
        n = inputs.shape[0]
        n_curv = n if subsampling is None else len(subsampling)
        mean = self.loss_func.reduction == "mean"
        # BackPACK normalises by the full batch; rescale to the subset's own loss
        rescale = math.sqrt(n / n_curv) if (mean and subsampling is not None) else 1.0
        ext = sqrt_ggn_extension(mc_samples, subsampling, self._buffers)
        exts = [ext, batch_grad_extension()] if collector.batch_grad else [ext]

        def consume(module: nn.Module) -> None:
            for param in module.parameters(recurse=False):
                i = self._index.get(id(param))
                if i is None or not param.requires_grad:
                    continue
                block = _as_block(getattr(param, ext.savefield), lead=2)
                delattr(param, ext.savefield)
                if rescale != 1.0:
                    block.scale_(rescale)
                grads = None
                if collector.batch_grad:
                    grads = _as_block(param.grad_batch, lead=1)
                    del param.grad_batch
                collector.add(i, block, grads)

        with torch.enable_grad():
            outputs, loss = self._forward_loss(inputs, targets)
            # BackPACK builds helper layers (e.g. for AvgPool) in the default dtype
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(outputs.dtype)
            try:
                with backpack(*exts, extension_hook=consume), warnings.catch_warnings():
                    # inputs never require grad; BackPACK's hooks fire on outputs only
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    loss.backward()
            finally:
                torch.set_default_dtype(default_dtype)
        num_vectors = factor_columns(self.loss_func, outputs.shape, mc_samples)
        for i in self._unused.intersection(collector.missing()):
            size = self._copy_params[i].numel()
            collector.add(i, DenseBlock(outputs.new_zeros(num_vectors * n_curv, size)),
                          DenseBlock(outputs.new_zeros(n, size)) if collector.batch_grad
                          else None)
        grad = {}
        for i in collector.group_of:
            p = self._copy_params[i]
            grad[i] = (p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
            p.grad = None
        return outputs, loss, grad


def _as_block(value, lead: int) -> Block:
    """A BackPACK result (a block, or a tensor with ``lead`` row dimensions) as a block."""
    if not isinstance(value, Tensor):  # already a block
        return value
    return DenseBlock(value.detach().reshape(math.prod(value.shape[:lead]), -1))
