"""The seam between backends: what every producer of the GGN factor ``V`` shares.

A backend subclasses :class:`EngineBase` and implements one pass,
:meth:`EngineBase._pass`, handing every trainable parameter's block to a
:class:`~lowrank_laplace.engine.request.Collector`; it works on a private copy of the
model (docs/concepts.md, "The backends"). Shapes: ``N`` batch size, ``N_S`` curvature
samples, ``C`` outputs, ``M`` columns of ``V``.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from lowrank_laplace.engine.model_copy import private_copy, removing
from lowrank_laplace.engine.request import Collector, Request
from lowrank_laplace.engine.rng import forked_rng
from lowrank_laplace.factor import GGNFactor, factor_columns
from lowrank_laplace.utils import batches, checks


class EngineBase:
    """Computes :class:`GGNFactor` objects for a model without touching it.

    Arguments as :class:`~lowrank_laplace.engine.factor_engine.FactorEngine`'s, but ``backend``.
    """

    #: The backend's name, as in ``backend=...``.
    backend = ""
    #: ``V`` and the per-sample gradients share a pass's random draws (``V^T g`` needs no replay).
    gradient_in_factor_pass = False

    def __init__(self, model: nn.Module, loss_func: nn.Module, eval_mode: bool = False):
        checks.check_loss_func(loss_func)
        checks.check_model_runs(model)
        checks.check_batchnorm_mode(model, eval_mode)
        self._check_model(model, eval_mode)
        self.eval_mode, self.model, self.loss_func = eval_mode, model, loss_func
        self._copy = private_copy(model)
        self._net = self._copy  # what the passes call (a backend may rewrite it)
        self._loss = copy.deepcopy(loss_func)
        self.num_outputs: Optional[int] = None  # model outputs, known after a forward pass
        self._closed = False
        self._copy_params = list(self._copy.parameters())
        self._index = {id(p): i for i, p in enumerate(self._copy_params)}

    def _check_model(self, model: nn.Module, eval_mode: bool) -> None:
        """Refuse a model the backend cannot handle (before any pass)."""
        raise NotImplementedError

    def _pass(self, inputs, targets, mc_samples: int, subsampling: Optional[List[int]],
              collector: Collector) -> Tuple[Tensor, Tensor, Dict[int, Tensor]]:
        """One pass: blocks to ``collector``; returns ``(outputs, loss, grad per index)``."""
        raise NotImplementedError

    def _vector_entries(self, feature_sizes: List[int], one_block: bool) -> int:
        """Entries per vector per sample a pass holds (blocks and features)."""
        raise NotImplementedError

    def probe(self, inputs: Any, targets: Optional[Tensor] = None) -> None:
        """Check on one sample of a batch, before any pass, that the backend takes the model.

        Draws no random numbers.

        Raises:
            NotImplementedError: If it cannot, naming the module and the way out.
        """

    def _sync(self, groups: Optional[List[List[int]]] = None) -> None:
        """Copy the user's parameters, buffers and modes into the copy (``groups``: trainable)."""
        if groups is None:
            active = {i for i, p in enumerate(self.model.parameters()) if p.requires_grad}
        else:
            active = {i for g in groups for i in g}
        with torch.no_grad():
            for i, (src, dst) in enumerate(zip(self.model.parameters(), self._copy_params)):
                dst.copy_(src)
                dst.requires_grad_(i in active)
                dst.grad = None
            for src, dst in zip(self.model.buffers(), self._copy.buffers()):
                dst.copy_(src)
        for src, dst in zip(self.model.modules(), self._copy.modules()):
            dst.training = False if self.eval_mode else src.training

    def sizing_forward(self, inputs: Any) -> Tuple[Tensor, List[int]]:
        """Return the outputs ``(1, C)`` and leaf output sizes of a forward pass on one sample.

        In the passes' mode, drawing no random numbers.
        """
        sizes = [0]

        def hook(module, inp, out):
            if isinstance(out, Tensor):
                sizes.append(out[0].numel() if out.ndim else 1)

        self._sync()
        leaves = [m for m in self._copy.modules() if not list(m.children())]
        handles = [m.register_forward_hook(hook) for m in leaves]
        with removing(handles), torch.no_grad(), forked_rng(batches.batch_device(inputs)):
            outputs = self._copy(batches.take(inputs, slice(0, 1)))
        if isinstance(outputs, Tensor) and outputs.ndim == 2:
            self.num_outputs = outputs.shape[-1]
        return outputs, sizes

    def check_independent(self, inputs: Any) -> bool:
        """Return whether :func:`check_independent_samples` could check this batch (on the copy)."""
        self._sync()
        return check_independent_samples(self._net, inputs)

    def dense_param_count(self, largest: bool = False) -> int:
        """Return the entries of ``V``'s rows stored, per column (factored weights: ``out + in``).

        Args:
            largest: Count only the largest single parameter's block.
        """
        factored = self._factored_ids()
        sizes = [0] + [sum(p.shape) if id(p) in factored else p.numel()
                       for p in self.model.parameters() if p.requires_grad]
        return max(sizes) if largest else sum(sizes)

    def _factored_ids(self) -> set:
        """Ids of the model's parameters whose blocks :meth:`dense_param_count` counts factored."""
        return set()

    def bytes_per_sample(self, inputs: Any, num_vectors: Optional[int] = None,
                         one_block: bool = False) -> int:
        """Return the estimated bytes one sample adds to a computation of ``V``.

        Args:
            inputs: A batch of inputs (the first sample is used).
            num_vectors: Vectors per sample; ``None``: the exact GGN's.
            one_block: Count only the largest block (passes that keep no blocks).
        """
        outputs, feature_sizes = self.sizing_forward(inputs)
        checks.check_outputs(outputs)
        if num_vectors is None:
            num_vectors = factor_columns(self.loss_func, outputs.shape, 0)
        itemsize = outputs.element_size()
        return itemsize * num_vectors * self._vector_entries(feature_sizes, one_block)

    def close(self) -> None:
        """Release what the backend installed; the engine cannot compute afterwards."""
        self._closed = True

    def __enter__(self) -> "EngineBase":
        return self

    def __exit__(self, *args) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("The engine is closed: create a new FactorEngine.")

    def _forward_loss(self, inputs: Any, targets: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """Forward pass of the copy and its checked, finite loss (``targets=None``: zeros)."""
        outputs = self._net(inputs)
        checks.check_outputs(outputs)
        if targets is None:
            targets = torch.zeros_like(outputs.detach())
        checks.check_targets(self.loss_func, outputs, targets)
        loss = self._loss(outputs, targets)
        checks.check_finite(loss)
        return outputs, loss

    def gradient(self, inputs: Any, targets: Optional[Tensor],
                 param_groups: Optional[List[dict]] = None) -> List[Tensor]:
        """Return the mini-batch gradient per group, flat, from a plain backward pass.

        The arguments are those of :meth:`compute`.
        """
        self._check_open()
        checks.check_batch(inputs, targets)
        groups = checks.resolve_param_groups(self.model, param_groups)
        self._sync(groups)
        with torch.enable_grad():
            _, loss = self._forward_loss(inputs, targets)
            params = [self._copy_params[i] for g in groups for i in g]
            grads = self._autograd(loss, params)
        flat = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        sizes = [sum(self._copy_params[i].numel() for i in g) for g in groups]
        return list(torch.cat([g.flatten() for g in flat]).split(sizes))

    def _autograd(self, loss: Tensor, params: List[Tensor]):
        return torch.autograd.grad(loss, params, allow_unused=True)

    def compute(self, inputs: Any, targets: Optional[Tensor], mc_samples: int = 0,
                subsampling: Optional[Sequence[int]] = None,
                param_groups: Optional[List[dict]] = None,
                request: Optional[Request] = None, **flags: Any) -> GGNFactor:
        """Return the factor (and gradients) of one pass.

        Args:
            inputs: Inputs ``(N, ...)``, or a dict batch passed whole to the model (its
                tensors with ``N`` rows are split per sample).
            targets: Class indices ``(N,)`` or ``(N, C)``; ``None`` (``MSELoss`` only): zeros,
                as the GGN of MSE does not depend on them.
            mc_samples: ``0`` for the exact GGN, ``M >= 1`` for Monte Carlo.
            subsampling: Indices of the samples used for the curvature.
            param_groups: Optimizer-style groups; ``None``: one of all trainable parameters.
            request: What the pass collects (default: the blocks).
            **flags: The fields of a :class:`Request` instead.

        Raises:
            RuntimeError: If the engine was closed, or a parameter got no block.
            ValueError: For an empty request, per-group arguments of another length, or
                ``targets=None`` for a loss other than MSE.
        """
        self._check_open()
        request = Request(**flags) if request is None else request
        if targets is None and not isinstance(self.loss_func, nn.MSELoss):
            raise ValueError("targets=None is only allowed for MSELoss.")
        n = checks.check_batch(inputs, targets)
        mc_samples = checks.check_mc_samples(mc_samples)
        subsampling = checks.check_subsampling(subsampling, n)
        groups = checks.resolve_param_groups(self.model, param_groups)
        request.check_groups(len(groups))
        collector = Collector(groups, request, [p.numel() for p in self._copy_params])
        self._sync(groups)
        outputs, loss, grad = self._pass(inputs, targets, mc_samples, subsampling, collector)
        missing = collector.missing()
        if missing:
            names = [name for name, p in self._copy.named_parameters()
                     if self._index[id(p)] in missing]
            raise RuntimeError(
                f"The {self.backend} backend produced no GGN factor for parameters "
                f"{names}: they do not influence the loss through layers it supports.")
        n_curv = n if subsampling is None else len(subsampling)
        self.num_outputs = outputs.shape[-1]
        return GGNFactor(
            groups=groups, shapes=[p.shape for p in self._copy_params],
            num_vectors=factor_columns(self.loss_func, outputs.shape, mc_samples),
            num_curv_samples=n_curv,
            sample_scale=float(n_curv) if self.loss_func.reduction == "mean" else 1.0,
            num_samples=n, reduction=self.loss_func.reduction, loss=loss.detach(),
            outputs=outputs.detach(), blocks=collector.kept,
            grams=collector.grams if request.compute_grams else [], grad=grad,
            batch_grads=collector.batch_grads, projected=collector.projected,
            t_projected=collector.t_projections(), t_batch_grads=collector.t_batch,
            diagonals=collector.diagonals, backend=self.backend)


def distinct_sample(inputs: Any, n: int) -> Optional[int]:
    """Return the first sample (of ``n``) whose inputs differ from sample 0's, or ``None``."""
    if n < 2:
        return None
    rows = [inputs] if isinstance(inputs, Tensor) else [
        v for v in inputs.values() if isinstance(v, Tensor) and v.ndim and v.shape[0] == n]
    differs = None
    for t in rows:
        here = (t[1:] != t[:1]).reshape(n - 1, -1).any(1)
        differs = here if differs is None else differs | here.to(differs.device)
    found = [] if differs is None else differs.nonzero()
    return int(found[0, 0]) + 1 if len(found) else None


def perturbed_pair(inputs: Any, n: int) -> Optional[Any]:
    """Return sample 0 (of ``n``) beside a copy with its float entries shifted, or ``None``."""
    pair = batches.take(inputs, [0, 0], n)
    entries = {None: pair} if isinstance(pair, Tensor) else {
        k: v for k, v in pair.items()
        if isinstance(inputs[k], Tensor) and inputs[k].ndim and inputs[k].shape[0] == n}
    shifted = False
    for key, t in entries.items():
        if not t.is_floating_point():
            continue
        x = t[1]
        ramp = torch.linspace(1.0, 2.0, x.numel(), dtype=x.dtype, device=x.device)
        t = torch.stack([t[0], x + 0.5 * (1.0 + x.abs().max()) * ramp.reshape(x.shape)])
        shifted = True
        if key is None:
            return t
        pair[key] = t
    return pair if shifted else None


def check_independent_samples(net: nn.Module, inputs: Any) -> bool:
    """Refuse a batch whose first sample's outputs depend on the other samples.

    Its outputs alone and beside a distinct sample (:func:`distinct_sample`, else
    :func:`perturbed_pair`) are compared in eval mode, drawing no random numbers.

    Returns:
        Whether the batch was checked (``False``: no distinct sample, check a later one).

    Raises:
        ValueError: For coupled samples, naming the dict entries split per sample.
    """
    n = batches.batch_size(inputs)
    j = distinct_sample(inputs, n)
    first = batches.take(inputs, [0, j], n) if j is not None else perturbed_pair(inputs, n)
    if first is None:
        return False
    modes = [m.training for m in net.modules()]
    net.eval()
    try:
        with torch.no_grad(), forked_rng(batches.batch_device(inputs)):
            both = net(first)
            if isinstance(both, Tensor) and both.ndim == 2:
                alone = net(batches.take(first, slice(0, 1), 2))
    finally:
        for module, mode in zip(net.modules(), modes):
            module.training = mode
    if not isinstance(both, Tensor) or both.ndim != 2 or not both.is_floating_point() \
            or not bool(torch.isfinite(both).all()):
        return True  # check_outputs and check_finite name the problem
    both, alone = both[0], alone[0]
    tol = max(1e-4, 50 * torch.finfo(both.dtype).eps) * (float(both.abs().max()) + 1.0)
    if float((both - alone).abs().max()) <= tol:
        return True
    per_sample = [] if isinstance(inputs, Tensor) else [
        k for k, v in inputs.items() if isinstance(v, Tensor) and v.ndim and v.shape[0] == n]
    raise ValueError(
        "The model's output for one sample depends on the other samples of the batch "
        "(batch statistics in the forward pass, or a dict entry shared by the whole "
        "batch that has one row per sample and is split like one"
        + (f"; entries split per sample: {per_sample}" if per_sample else "")
        + "): per-sample curvature needs independent samples. Give a shared entry a "
        "first dimension other than the batch size (e.g. unsqueeze(0)), or keep it "
        "in the model.")
