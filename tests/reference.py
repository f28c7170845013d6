"""Dense references built independently of BackPACK (torch.func Jacobians)."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev


def _group_params(model: nn.Module, group: Optional[Sequence[int]]):
    named = list(model.named_parameters())
    if group is None:
        group = [i for i, (_, p) in enumerate(named) if p.requires_grad]
    return [named[i][0] for i in group], {n: p.detach() for n, p in named}


def _aliases(model: nn.Module):
    """Canonical parameter name -> its names under every distinct owning module."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    aliases = {n: [] for n in canonical.values()}
    for prefix, module in model.named_modules():
        for n, p in module.named_parameters(recurse=False):
            aliases[canonical[id(p)]].append(f"{prefix}.{n}" if prefix else n)
    return aliases


def jacobian(model: nn.Module, X: Tensor, group=None) -> Tensor:
    """Jacobian of the outputs w.r.t. a group's parameters, shape (N, C, D)."""
    names, values = _group_params(model, group)

    aliases = _aliases(model)

    def f(*theta):
        params = dict(values)
        params.update(zip(names, theta))
        # every (module, attribute) once: a module registered twice is swapped once
        full = {alias: params[name] for name, group in aliases.items() for alias in group}
        return functional_call(model, full, (X,), tie_weights=False)

    jacs = jacrev(f, argnums=tuple(range(len(names))))(*[values[n] for n in names])
    N, C = jacs[0].shape[:2]
    return torch.cat([j.reshape(N, C, -1) for j in jacs], dim=2)


def output_hessian(loss_func: nn.Module, out: Tensor, y: Tensor) -> Tensor:
    """Hessian of the batch loss w.r.t. the outputs, shape (N, C, N, C)."""
    return hessian(lambda o: loss_func(o, y))(out.detach())


def ggn(model, loss_func, X, y, group=None, subsampling=None) -> Tensor:
    """Dense GGN J^T H J of the loss on the batch (or on the subset), (D, D)."""
    if subsampling is not None:
        X, y = X[list(subsampling)], y[list(subsampling)]
    J = jacobian(model, X, group)
    N, C, D = J.shape
    H = output_hessian(loss_func, model(X), y).reshape(N * C, N * C)
    Jf = J.reshape(N * C, D)
    return Jf.T @ H @ Jf


def per_sample_ggns(model, loss_func, X, y, group=None, subsampling=None) -> Tensor:
    """Per-sample GGNs G_n of the sample's own loss l_n, shape (N, D, D)."""
    if subsampling is not None:
        X, y = X[list(subsampling)], y[list(subsampling)]
    J = jacobian(model, X, group)
    N = J.shape[0]
    H = output_hessian(loss_func, model(X), y)
    scale = N if loss_func.reduction == "mean" else 1
    return torch.stack([scale * J[n].T @ H[n, :, n, :] @ J[n] for n in range(N)])


def per_sample_grads(model, loss_func, X, y, group=None) -> Tensor:
    """Gradients g_n of the samples' own losses l_n, shape (N, D)."""
    J = jacobian(model, X, group)
    out = model(X).detach()
    grad_out = torch.func.grad(lambda o: loss_func(o, y))(out)
    scale = len(y) if loss_func.reduction == "mean" else 1
    return scale * torch.einsum("ncd,nc->nd", J, grad_out)


def gradient(model, loss_func, X, y, group=None) -> Tensor:
    """Mini-batch gradient, shape (D,)."""
    g = per_sample_grads(model, loss_func, X, y, group)
    return g.mean(0) if loss_func.reduction == "mean" else g.sum(0)


def block_diag(mats: List[Tensor]) -> Tensor:
    """Block-diagonal matrix."""
    return torch.block_diag(*mats)
