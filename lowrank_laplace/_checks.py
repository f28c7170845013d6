"""Input validation: every check raises a clear error before expensive work."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

SUPPORTED_LOSSES = (nn.CrossEntropyLoss, nn.MSELoss)
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def check_loss_func(loss_func: nn.Module) -> None:
    """Check that the loss is supported and uses mean or sum reduction.

    Args:
        loss_func: The loss function module.

    Raises:
        TypeError: If the loss is not ``CrossEntropyLoss`` or ``MSELoss``.
        ValueError: If the reduction is not ``'mean'`` or ``'sum'``, or the
            cross-entropy loss uses class weights or label smoothing.
    """
    if not isinstance(loss_func, SUPPORTED_LOSSES):
        raise TypeError(
            f"Unsupported loss {type(loss_func).__name__}: use nn.CrossEntropyLoss "
            "(classification) or nn.MSELoss (regression)."
        )
    if loss_func.reduction not in ("mean", "sum"):
        raise ValueError(
            f"Loss reduction {loss_func.reduction!r} is not supported: the GGN needs "
            "reduction='mean' or reduction='sum'."
        )
    if isinstance(loss_func, nn.CrossEntropyLoss):
        if loss_func.weight is not None or loss_func.label_smoothing != 0.0:
            raise ValueError(
                "CrossEntropyLoss with class weights or label smoothing is not "
                "supported: create it as nn.CrossEntropyLoss(reduction=...)."
            )


def check_model(
    model: nn.Module, supported: Sequence[type], allow_train_batchnorm: bool = False
) -> None:
    """Check that BackPACK can backpropagate the GGN factor through every layer.

    Args:
        model: The network.
        supported: Module classes with a BackPACK ``SqrtGGN`` extension.
        allow_train_batchnorm: Accept BatchNorm in training mode (the caller
            evaluates in eval mode).

    Raises:
        NotImplementedError: Naming the first unsupported layer and a workaround.
        ValueError: For a BatchNorm layer in training mode.
    """
    from backpack.utils.module_classification import is_no_op

    for name, module in model.named_modules():
        name = name or type(model).__name__
        children = list(module.children())
        if isinstance(module, _BATCHNORMS) and module.training and not allow_train_batchnorm:
            raise ValueError(
                f"Layer {name!r} ({type(module).__name__}) is in training mode, which "
                "couples the samples of a batch: call model.eval() first."
            )
        if children:
            own_params = list(module.parameters(recurse=False))
            if own_params and not isinstance(module, tuple(supported)):
                raise NotImplementedError(
                    f"Module {name!r} ({type(module).__name__}) owns parameters but "
                    "is not a layer BackPACK supports."
                )
            continue
        if isinstance(module, tuple(supported)) or is_no_op(module):
            continue
        raise NotImplementedError(
            f"Layer {name!r} ({type(module).__name__}) is not supported by BackPACK's "
            "GGN factor extension. Replace it with a supported layer, or compute the "
            "curvature of the layers after it only (e.g. laplace-torch's "
            "subset_of_weights='last_layer' on the features it produces)."
        )


def check_batch(inputs: Tensor, targets: Tensor) -> int:
    """Check a mini-batch and return its size.

    Args:
        inputs: Inputs, shape ``(N, ...)``.
        targets: Targets, shape ``(N, ...)``.

    Returns:
        The batch size ``N``.

    Raises:
        TypeError: If inputs or targets are not tensors.
        ValueError: If the batch is empty or the batch sizes differ.
    """
    if not isinstance(inputs, Tensor) or not isinstance(targets, Tensor):
        raise TypeError("inputs and targets must be torch.Tensor objects.")
    if inputs.ndim == 0 or inputs.shape[0] == 0:
        raise ValueError("Empty batch: inputs must have shape (N, ...) with N >= 1.")
    if targets.ndim == 0 or targets.shape[0] != inputs.shape[0]:
        raise ValueError(
            f"inputs have {inputs.shape[0]} samples but targets have shape "
            f"{tuple(targets.shape)}: the first dimensions must match."
        )
    return inputs.shape[0]


def check_targets(loss_func: nn.Module, outputs: Tensor, targets: Tensor) -> None:
    """Check that targets match the loss and the model outputs.

    Args:
        loss_func: The loss function.
        outputs: Model outputs, shape ``(N, C)``.
        targets: Targets.

    Raises:
        ValueError: If shapes, dtypes or class indices do not fit.
    """
    if outputs.ndim != 2:
        raise ValueError(
            f"The model output must have shape (N, C), got {tuple(outputs.shape)}; "
            "add an nn.Flatten layer."
        )
    if isinstance(loss_func, nn.CrossEntropyLoss):
        if targets.dtype != torch.long or targets.shape != outputs.shape[:1]:
            raise ValueError(
                "CrossEntropyLoss needs class-index targets of dtype torch.long and "
                f"shape (N,) = {tuple(outputs.shape[:1])}, got dtype {targets.dtype} "
                f"and shape {tuple(targets.shape)}."
            )
        if bool(((targets < 0) | (targets >= outputs.shape[1])).any()):  # one device sync
            raise ValueError(
                f"Class indices must lie in [0, {outputs.shape[1]}), got values in "
                f"[{int(targets.min())}, {int(targets.max())}]."
            )
    else:
        if targets.shape != outputs.shape or not targets.is_floating_point():
            raise ValueError(
                "MSELoss needs floating-point targets of the output's shape "
                f"{tuple(outputs.shape)}, got dtype {targets.dtype} and shape "
                f"{tuple(targets.shape)}."
            )


def check_subsampling(subsampling: Optional[Sequence[int]], n: int) -> Optional[List[int]]:
    """Validate curvature sub-sampling indices.

    Args:
        subsampling: Indices into the batch, or ``None`` for all samples.
        n: Batch size.

    Returns:
        The indices as a list, or ``None``.

    Raises:
        ValueError: For an empty list, indices out of range or duplicates.
    """
    if subsampling is None:
        return None
    indices = [int(i) for i in subsampling]
    if not indices:
        raise ValueError("subsampling is empty: pass None to use the full batch.")
    if min(indices) < 0 or max(indices) >= n:
        raise ValueError(
            f"subsampling indices must lie in [0, {n}) for a batch of {n} samples, "
            f"got values in [{min(indices)}, {max(indices)}]."
        )
    if len(set(indices)) != len(indices):
        raise ValueError("subsampling contains duplicate indices.")
    return indices


def check_mc_samples(mc_samples: int) -> int:
    """Validate the number of Monte-Carlo samples.

    Args:
        mc_samples: ``0`` for the exact GGN, ``M >= 1`` for the MC approximation.

    Returns:
        The number as ``int``.

    Raises:
        ValueError: If negative or not an integer.
    """
    if isinstance(mc_samples, bool) or int(mc_samples) != mc_samples or mc_samples < 0:
        raise ValueError(
            f"mc_samples must be 0 (exact GGN) or a positive integer, got {mc_samples!r}."
        )
    return int(mc_samples)


def resolve_param_groups(
    model: nn.Module, param_groups: Optional[List[Dict[str, Any]]]
) -> List[List[int]]:
    """Turn optimizer-style parameter groups into lists of parameter indices.

    Indices refer to ``list(model.parameters())``.

    Args:
        model: The network.
        param_groups: ``None`` (one group of all parameters with
            ``requires_grad=True``) or a list of dicts with key ``"params"``.

    Returns:
        One list of parameter indices per group.

    Raises:
        ValueError: For empty groups, foreign parameters, or a parameter in
            several groups.
    """
    params = list(model.parameters())
    position = {id(p): i for i, p in enumerate(params)}
    if param_groups is None:
        group = [i for i, p in enumerate(params) if p.requires_grad]
        if not group:
            raise ValueError("The model has no parameters with requires_grad=True.")
        return [group]
    groups, seen = [], set()
    for g, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(
                f"param_groups[{g}] must be a dict with key 'params' (optimizer style)."
            )
        members = list(group["params"])
        if not members:
            raise ValueError(f"param_groups[{g}] has no parameters.")
        indices = []
        for p in members:
            if id(p) not in position:
                raise ValueError(f"param_groups[{g}] holds a parameter not in the model.")
            if id(p) in seen:
                raise ValueError(f"A parameter appears in more than one group ({g}).")
            seen.add(id(p))
            indices.append(position[id(p)])
        groups.append(indices)
    return groups


def layerwise_param_groups(model: nn.Module) -> List[Dict[str, Any]]:
    """One parameter group per layer (module owning trainable parameters).

    Args:
        model: The network.

    Returns:
        Optimizer-style groups ``[{"params": [...], "name": layer_name}, ...]`` for a
        per-layer block-diagonal GGN.
    """
    groups = []
    for name, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if params:
            groups.append({"params": params, "name": name})
    return groups


def check_finite(loss: Tensor) -> None:
    """Raise if the loss is NaN or infinite.

    Args:
        loss: Scalar loss.

    Raises:
        ValueError: If the loss is not finite.
    """
    if not torch.isfinite(loss).all():
        raise ValueError(
            f"The loss is not finite ({loss.item()}): check inputs, targets and "
            "parameters for NaN/inf."
        )


def checked_forward(model: nn.Module, inputs: Tensor) -> Tensor:
    """Forward pass that verifies every operation is a module BackPACK sees.

    Args:
        model: The (extended copy of the) network.
        inputs: Inputs.

    Returns:
        The model output.

    Raises:
        NotImplementedError: If a module receives a tensor that no earlier module
            produced (a functional operation such as ``torch.relu`` or ``x.view``
            sits in between), or a module is called twice.
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
                    "the output of another module"
                )
        outs = out if isinstance(out, tuple) else (out,)
        for t in outs:
            produced.add(id(t))
            keep_alive.append(t)

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        outputs = model(inputs)
    finally:
        for h in handles:
            h.remove()
    if id(outputs) not in produced and not problems:
        problems.append("the model output is not the output of a module")
    if problems:
        raise NotImplementedError(
            "BackPACK can only backpropagate through nn.Module layers, but "
            f"{problems[0]}: the forward pass applies a functional operation (e.g. "
            "torch.relu, x.view, x + y). Use modules instead (nn.ReLU, nn.Flatten, "
            "backpack.custom_module.branching.Parallel/SumModule for residuals)."
        )
    return outputs
