r"""The engine's private copy of the user's model, and the hooks that are part of its function.

Forward hooks and pre-hooks stay on the copy, backward hooks are dropped
(docs/concepts.md, "The backends").
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Dict, Iterator, List

from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

_BACKWARD_HOOK_DICTS = ("_backward_hooks", "_backward_pre_hooks")
_FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")


#: Options of the backward pass only, neutral on the copy (``scale_grad_by_freq``
#: divides a row's gradient by its token count; ``sparse`` gives sparse gradients).
BACKWARD_OPTIONS: Dict[type, Dict[str, Any]] = {
    nn.Embedding: {"scale_grad_by_freq": False, "sparse": False},
    nn.EmbeddingBag: {"scale_grad_by_freq": False, "sparse": False},
}


def private_copy(model: nn.Module) -> nn.Module:
    """Return a deep copy of the model with its forward hooks but without backward hooks.

    Also without BackPACK's ``extend`` hooks; global module hooks still apply. Tensors a
    pre-hook computed from parameters (a pruned ``weight``) are copied detached; options
    of the backward pass take their neutral values (:data:`BACKWARD_OPTIONS`). The user's
    ``model`` is unchanged.
    """
    memo = {id(value): value.detach().clone() for module in model.modules()
            for value in vars(module).values()
            if isinstance(value, Tensor) and not value.is_leaf}
    clone = copy.deepcopy(model, memo)
    for module in clone.modules():
        for name in _BACKWARD_HOOK_DICTS:
            hooks = getattr(module, name, None)
            if isinstance(hooks, dict):
                hooks.clear()
        for name in _FORWARD_HOOK_DICTS:  # BackPACK's own (a model extended elsewhere)
            hooks = getattr(module, name, {})
            for key in [k for k, h in hooks.items() if _is_backpack(h)]:
                del hooks[key]
        if getattr(module, "_is_full_backward_hook", None) is not None:
            module._is_full_backward_hook = None
        for cls, options in BACKWARD_OPTIONS.items():
            if isinstance(module, cls):
                for name, value in options.items():
                    setattr(module, name, value)
    return clone


@contextlib.contextmanager
def removing(handles: List[Any]) -> Iterator[None]:
    """Remove the hooks of ``handles`` when the block exits, however it exits."""
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _is_backpack(hook: Callable) -> bool:
    """Whether a hook is BackPACK's (``extend`` stores each module's input and output)."""
    return (getattr(hook, "__module__", None) or "").split(".")[0] == "backpack"


@contextlib.contextmanager
def function_hooks(net: nn.Module) -> Iterator[List[str]]:
    """Yield the names of modules whose forward hooks take part in the function, as they run.

    A hook that returns a value, changes its tensors in place or changes its module's
    attributes (as pruning does) takes part; one that only looks does not. The hooks of
    ``net`` (the private copy) are restored on exit.
    """
    found: List[str] = []
    saved = []
    for name, module in net.named_modules():
        for attr in _FORWARD_HOOK_DICTS:
            hooks = getattr(module, attr)
            saved.append((hooks, dict(hooks)))
            for key, hook in list(hooks.items()):
                hooks[key] = _watched(hook, name or type(net).__name__, found)
    try:
        yield found
    finally:
        for hooks, original in saved:
            hooks.update(original)


def _watched(hook: Callable, name: str, found: List[str]) -> Callable:
    """A hook that notes ``name`` in ``found`` when it takes part in the function."""
    def state(module: nn.Module, rest: tuple) -> list:
        tensors = [t for t in tree_flatten(rest)[0] if isinstance(t, Tensor)]
        return ([(k, id(v)) for k, v in vars(module).items()]
                + [id(v) for v in (*module._parameters.values(), *module._buffers.values())]
                + [(id(t), t._version) for t in tensors])

    def watched(module: nn.Module, *rest: Any) -> Any:
        before = state(module, rest)
        result = hook(module, *rest)
        if (result is not None or state(module, rest) != before) and name not in found:
            found.append(name)
        return result

    return watched
