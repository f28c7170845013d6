"""Input validation: every check raises a clear error before expensive work."""

from __future__ import annotations

import math
import sys
from collections.abc import MutableMapping
from enum import Enum
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

from lowrank_laplace.utils.batches import batch_size, refuse_meta

SUPPORTED_LOSSES = (nn.CrossEntropyLoss, nn.MSELoss)
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def check_batchnorm_mode(model: nn.Module, allow_train: bool) -> None:
    """Refuse BatchNorm in training mode unless ``allow_train`` (the passes run in eval mode).

    Raises:
        ValueError: For a BatchNorm layer in training mode.
    """
    if allow_train:
        return
    for name, module in model.named_modules():
        if isinstance(module, _BATCHNORMS) and module.training:
            raise ValueError(
                f"Layer {name or type(model).__name__!r} ({type(module).__name__}) is in "
                "training mode, which couples the samples of a batch: call model.eval() "
                "first.")


def shared_parameters(model: nn.Module) -> List[List[str]]:
    """Return the names of each parameter used by several modules, one list per parameter."""
    owners: Dict[int, List[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    return [names for names in owners.values() if len(names) > 1]


def check_model_runs(model: nn.Module) -> None:
    """Refuse models the engine cannot run.

    Raises:
        TypeError: For a TorchScript module in the model.
        ValueError: For parameters or buffers on the meta device.
    """
    scripted = [name or type(model).__name__ for name, m in model.named_modules()
                if isinstance(m, torch.jit.ScriptModule)]
    if scripted:
        raise TypeError(
            f"{scripted[0]!r} is a TorchScript module (torch.jit.script / trace): the "
            "engine needs module hooks and torch.func, which TorchScript modules do not "
            "take; pass the nn.Module it was compiled from.")
    meta = [name for name, t in (*model.named_parameters(), *model.named_buffers())
            if t.is_meta]
    if meta:
        raise ValueError(
            f"The model's parameters are on the meta device ({', '.join(meta[:3])}"
            f"{', ...' if len(meta) > 3 else ''}), which holds shapes but no values: "
            "materialise them first (model.to_empty(device=...) and load_state_dict).")


def check_loss_func(loss_func: nn.Module) -> None:
    """Check that the loss is supported and uses mean or sum reduction.

    Raises:
        TypeError: If the loss is not ``CrossEntropyLoss`` or ``MSELoss``.
        ValueError: For another reduction, class weights or label smoothing.
    """
    if not isinstance(loss_func, SUPPORTED_LOSSES):
        raise TypeError(
            f"Unsupported loss {type(loss_func).__name__}: use nn.CrossEntropyLoss "
            "(classification) or nn.MSELoss (regression).")
    if loss_func.reduction not in ("mean", "sum"):
        raise ValueError(
            f"Loss reduction {loss_func.reduction!r} is not supported: the GGN needs "
            "reduction='mean' or reduction='sum'.")
    if isinstance(loss_func, nn.CrossEntropyLoss):
        if loss_func.weight is not None or loss_func.label_smoothing != 0.0:
            raise ValueError(
                "CrossEntropyLoss with class weights or label smoothing is not "
                "supported: create it as nn.CrossEntropyLoss(reduction=...).")


def check_batch(inputs: Any, targets: Optional[Tensor]) -> int:
    """Check a mini-batch and return its size ``N``.

    Args:
        inputs: Inputs ``(N, ...)``, or a dict batch passed whole to the model.
        targets: Targets ``(N, ...)``, or ``None`` (MSE).

    Raises:
        TypeError: If inputs or targets are not tensors.
        ValueError: For an empty batch, meta tensors, or differing batch sizes.
    """
    if isinstance(inputs, MutableMapping):
        if targets is None and not any(isinstance(v, Tensor) and v.ndim
                                       for v in inputs.values()):
            raise ValueError("A dict batch needs at least one tensor with a batch axis.")
    elif not isinstance(inputs, Tensor):
        raise TypeError(
            "inputs must be a torch.Tensor or a dict batch (MutableMapping), got "
            f"{type(inputs).__name__}.")
    elif inputs.ndim == 0 or inputs.shape[0] == 0:
        raise ValueError("Empty batch: inputs must have shape (N, ...) with N >= 1.")
    if targets is not None and not isinstance(targets, Tensor):
        raise TypeError("targets must be a torch.Tensor.")
    tensors = [inputs] if isinstance(inputs, Tensor) else list(inputs.values())
    for what, values in (("inputs", tensors), ("targets", [targets])):
        refuse_meta(what, values)
    n = batch_size(inputs) if targets is None else (targets.shape[0] if targets.ndim else 0)
    if n == 0:
        raise ValueError("Empty batch: the batch must hold at least one sample.")
    if isinstance(inputs, Tensor) and targets is not None and targets.shape[0] != inputs.shape[0]:
        raise ValueError(
            f"inputs have {inputs.shape[0]} samples but targets have shape "
            f"{tuple(targets.shape)}: the first dimensions must match.")
    if isinstance(inputs, MutableMapping):
        check_padding(inputs)
    return n


def check_padding(batch: MutableMapping) -> None:
    """Refuse sequences that are padding only: a transformer's output on them is undefined.

    Raises:
        ValueError: Naming the samples whose ``attention_mask`` is all zero.
    """
    mask = batch.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.ndim < 2:
        return
    empty = (mask.reshape(mask.shape[0], -1) == 0).all(1).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"Samples {empty[:10]} of the batch are padding only (attention_mask all "
            "zero): drop them from the data before fitting or predicting.")


def check_outputs(outputs: Any) -> None:
    """Check that the model returned a ``(N, C)`` tensor (else raise ``ValueError``)."""
    if not isinstance(outputs, Tensor) or outputs.ndim != 2:
        shape = tuple(outputs.shape) if isinstance(outputs, Tensor) else type(outputs).__name__
        hint = ""
        if not isinstance(outputs, Tensor) and hasattr(outputs, "logits"):
            hint = (" (a Hugging Face ModelOutput: wrap the model in an nn.Module whose "
                    "forward returns model(**batch).logits, as laplace-torch's example does)")
        raise ValueError(
            f"The model output must have shape (N, C) (a tensor), got {shape}{hint}; add "
            "an nn.Flatten layer, or wrap the model so that it returns the logits.")


def check_targets(loss_func: nn.Module, outputs: Tensor, targets: Tensor) -> None:
    """Check that targets match the loss and the model outputs ``(N, C)`` (checked before).

    Raises:
        ValueError: If shapes, dtypes or class indices do not fit.
    """
    if isinstance(loss_func, nn.CrossEntropyLoss):
        if targets.dtype != torch.long or targets.shape != outputs.shape[:1]:
            raise ValueError(
                "CrossEntropyLoss needs class-index targets of dtype torch.long and "
                f"shape (N,) = {tuple(outputs.shape[:1])}, got dtype {targets.dtype} "
                f"and shape {tuple(targets.shape)}.")
        ignore = loss_func.ignore_index
        if bool((targets == ignore).any()):
            raise ValueError(
                f"targets contain ignore_index={ignore}: the loss skips those samples, "
                "which the GGN engine does not support; drop them from the batch.")
        if bool(((targets < 0) | (targets >= outputs.shape[1])).any()):  # one device sync
            raise ValueError(
                f"Class indices must lie in [0, {outputs.shape[1]}), got values in "
                f"[{int(targets.min())}, {int(targets.max())}].")
    else:
        if targets.shape != outputs.shape or not targets.is_floating_point():
            raise ValueError(
                "MSELoss needs floating-point targets of the output's shape "
                f"{tuple(outputs.shape)}, got dtype {targets.dtype} and shape "
                f"{tuple(targets.shape)}.")


def check_subsampling(subsampling: Optional[Sequence[int]], n: int) -> Optional[List[int]]:
    """Return curvature sub-sampling indices into a batch of ``n`` as a list (``None``: all).

    Raises:
        ValueError: For an empty list, indices out of range or duplicates.
    """
    if subsampling is None:
        return None
    if isinstance(subsampling, Tensor):
        subsampling = subsampling.tolist()
    if any(isinstance(i, bool) or int(i) != i for i in subsampling):
        raise ValueError(f"subsampling must hold integer sample indices, got {subsampling!r}.")
    indices = [int(i) for i in subsampling]
    if not indices:
        raise ValueError("subsampling is empty: pass None to use the full batch.")
    if min(indices) < 0 or max(indices) >= n:
        raise ValueError(
            f"subsampling indices must lie in [0, {n}) for a batch of {n} samples, "
            f"got values in [{min(indices)}, {max(indices)}].")
    if len(set(indices)) != len(indices):
        raise ValueError("subsampling contains duplicate indices.")
    return indices


def check_mc_samples(mc_samples: int) -> int:
    """Return the number of Monte-Carlo samples, ``0`` (exact GGN) or ``M >= 1``, as ``int``.

    Raises:
        ValueError: If negative or not an integer.
    """
    if isinstance(mc_samples, bool) or int(mc_samples) != mc_samples or mc_samples < 0:
        raise ValueError(
            f"mc_samples must be 0 (exact GGN) or a positive integer, got {mc_samples!r}.")
    return int(mc_samples)


def resolve_param_groups(
    model: nn.Module, param_groups: Optional[List[Dict[str, Any]]]
) -> List[List[int]]:
    """Return optimizer-style groups as indices into ``list(model.parameters())``, per group.

    Args:
        model: The network.
        param_groups: Dicts with key ``"params"``; ``None``: one of the trainable ones.

    Raises:
        ValueError: For empty groups, foreign parameters, or a parameter in several.
    """
    params = list(model.parameters())
    if param_groups is None:
        group = [i for i, p in enumerate(params) if p.requires_grad]
        if not group:
            raise ValueError("The model has no parameters with requires_grad=True.")
        return [group]
    if not isinstance(param_groups, (list, tuple)):
        raise ValueError("param_groups must be a list of dicts with key 'params'.")
    if not param_groups:
        raise ValueError(
            "param_groups is empty: pass None for one group of all trainable parameters.")
    position = {id(p): i for i, p in enumerate(params)}
    groups, seen = [], set()
    for g, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(
                f"param_groups[{g}] must be a dict with key 'params' (optimizer style).")
        members = list(group["params"])
        if not members:
            raise ValueError(f"param_groups[{g}] has no parameters.")
        for p in members:
            if id(p) not in position:
                raise ValueError(f"param_groups[{g}] holds a parameter not in the model.")
            if id(p) in seen:
                raise ValueError(f"A parameter appears in more than one group ({g}).")
            seen.add(id(p))
        groups.append([position[id(p)] for p in members])
    return groups


def layerwise_param_groups(model: nn.Module) -> List[Dict[str, Any]]:
    """Return a group ``{"params": [...], "name": name}`` per module owning trainable parameters.

    Args:
        model: The network.
    """
    groups = []
    for name, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if params:
            groups.append({"params": params, "name": name})
    return groups


def check_finite(loss: Tensor) -> None:
    """Refuse a NaN or infinite loss (``ValueError``)."""
    if not torch.isfinite(loss).all():
        raise ValueError(
            f"The loss is not finite ({loss.item()}): check inputs, targets and "
            "parameters for NaN/inf.")


def check_damping(damping: Any, positive: bool = False) -> None:
    """Refuse (``ValueError``) a damping that is not finite and non-negative (``positive``: > 0)."""
    try:
        value = math.nan if isinstance(damping, (str, bytes)) else float(damping)
    except (TypeError, ValueError, RuntimeError):
        value = math.nan
    if isinstance(damping, bool) or not math.isfinite(value) or value < 0 or (
            positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"damping must be a finite {kind} number, got {damping!r}.")


class Choice(str, Enum):
    """A named choice among fixed strings; equal to, printed and repr'd as its value."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def parse(cls, value: Any, name: str) -> "Choice":
        """Return the member for ``value`` (a member or its string); ``name``: the argument's."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}.") from None


def refuse_inference_mode(what: str) -> None:
    """Refuse a call under ``torch.inference_mode()``, which forbids its backward passes.

    Args:
        what: The call, for the message.

    Raises:
        RuntimeError: Under ``torch.inference_mode()``.
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"lowrank_ggn's {what} differentiates the model (the GGN factor comes from "
            "backward passes), which torch.inference_mode() forbids: call it outside, or "
            "under torch.no_grad() instead (it enables gradients where it needs them). "
            "In Lightning, Trainer(inference_mode=False)."
        )


def outside_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside this package (of ``la.fit``, say).

    For ``warnings.warn`` in a function of the package, evaluated there.
    """
    frame, level = sys._getframe(2), 2  # the caller of warnings.warn's caller
    while frame is not None and frame.f_globals.get("__name__", "").startswith("lowrank_"):
        frame, level = frame.f_back, level + 1
    return level
