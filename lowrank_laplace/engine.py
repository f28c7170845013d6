r"""Computes the GGN factor ``V`` of a mini-batch in one BackPACK backward pass.

BackPACK's ``SqrtGGNExact`` / ``SqrtGGNMC`` extensions deliver ``V`` block by block
for each parameter during one backward pass; an extension hook hands each block to
the consumers (Gram matrix, kept copy, projection ``V y``) right away, so blocks that
are only needed for Gram quantities or projections are freed inside the backward
pass. The engine works on a private copy of the model, which it leaves as it was.

Sub-sampling: with ``subsampling=S`` the curvature is that of the loss evaluated on
the samples ``S`` only, with the loss's own reduction (``1/|S|`` for ``'mean'``),
while gradients still use the whole batch.

Shape glossary:
    N: batch size; N_S: number of curvature samples (``len(subsampling)`` or N).
    C: model outputs; M: columns of ``V`` (``C * N_S`` exact, ``mc_samples * N_S``).
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from backpack import backpack, extend
from backpack.context import CTX
from torch import Tensor, nn

from lowrank_laplace import _checks
from lowrank_laplace._blocks import Block, DenseBlock, KronBlock
from lowrank_laplace._extensions import (
    batch_grad_extension,
    factor_columns,
    sqrt_ggn_extension,
    supported_modules,
)
from lowrank_laplace.factor import GGNFactor


class FactorEngine:
    """Computes :class:`GGNFactor` objects for a model without touching it.

    BackPACK needs hooks on every module. The engine extends a private deep copy of
    the model and loss, copies the user's current parameter values into it before
    every computation, and removes all of its hooks in :meth:`close`. The user's
    model keeps its parameters, mode and ``requires_grad`` flags, and gets no hooks.

    Args:
        model: The network; its output must have shape ``(N, C)``.
        loss_func: ``nn.CrossEntropyLoss`` or ``nn.MSELoss`` with mean/sum reduction.
        eval_mode: Evaluate the private copy in eval mode whatever the model's mode
            (as laplace-torch does when fitting); ``False`` mirrors the model's mode.
    """

    def __init__(self, model: nn.Module, loss_func: nn.Module, eval_mode: bool = False):
        _checks.check_loss_func(loss_func)
        _checks.check_model(model, supported_modules(), allow_train_batchnorm=eval_mode)
        self.eval_mode = eval_mode
        self.model = model
        self.loss_func = loss_func
        self._copy = copy.deepcopy(model)
        self._loss = copy.deepcopy(loss_func)
        self.num_outputs: Optional[int] = None  # model outputs, known after a forward pass
        self._handles = None  # BackPACK hooks, installed at the first computation
        self._closed = False
        self._copy_params = list(self._copy.parameters())
        self._index = {id(p): i for i, p in enumerate(self._copy_params)}

    def _extend(self, inputs: Tensor) -> None:
        """Check the forward pass on one sample, then install BackPACK's hooks.

        The check draws no random numbers from the caller's generators (dropout in
        train mode), so every pass sees the same draws whether or not it extends.
        """
        devices = [inputs.device] if inputs.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            _checks.checked_forward(self._copy, inputs[:1])
        num_handles = len(CTX.hook_handles)
        extend(self._copy)
        extend(self._loss)
        self._handles = CTX.hook_handles[num_handles:]

    def dense_param_count(self, largest: bool = False) -> int:
        """Entries of ``V``'s rows that are stored explicitly, per column.

        Trainable parameters count fully, except ``nn.Linear`` weights, which are
        kept factored (``out + in`` numbers per column).

        Args:
            largest: Count only the largest single parameter's block (what a pass
                that frees every block after its layer holds at once).

        Returns:
            The count.
        """
        sizes = [0]
        for module in self._copy.modules():
            for name, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    factored = isinstance(module, nn.Linear) and name == "weight"
                    sizes.append(sum(p.shape) if factored else p.numel())
        return max(sizes) if largest else sum(sizes)

    def bytes_per_sample(self, inputs: Tensor, num_vectors: Optional[int] = None,
                         one_block: bool = False) -> int:
        """Estimate the memory one sample adds to a computation of ``V``.

        Counts the expanded blocks (``num_vectors`` vectors over every trainable
        parameter except factored ``nn.Linear`` weights) and the backpropagated
        vectors at every layer output, measured by a forward pass on one sample.

        Args:
            inputs: A batch of inputs (only the first sample is used).
            num_vectors: Vectors per sample (``mc_samples`` for MC); ``None`` uses
                the exact GGN's (``C``, or ``C - 1`` for cross-entropy).
            one_block: Count only the largest block (passes that keep no blocks).

        Returns:
            Estimated bytes per sample.
        """
        dense, feature_sizes = self.dense_param_count(largest=one_block), [0]

        def hook(module, inp, out):
            if isinstance(out, Tensor):
                feature_sizes.append(out[0].numel())

        leaves = [m for m in self._copy.modules() if not list(m.children())]
        handles = [m.register_forward_hook(hook) for m in leaves]
        try:
            with torch.no_grad():
                outputs = self._copy(inputs[:1])
        finally:
            for h in handles:
                h.remove()
        self.num_outputs = outputs.shape[-1]
        if num_vectors is None:
            num_vectors = factor_columns(self.loss_func, outputs.shape, 0)
        itemsize = torch.finfo(inputs.dtype).bits // 8 if inputs.is_floating_point() else 4
        return itemsize * num_vectors * (dense + 2 * max(feature_sizes))

    def close(self) -> None:
        """Remove every BackPACK hook the engine installed."""
        handles = self._handles or []
        for handle in handles:
            handle.remove()
        ids = {id(h) for h in handles}
        CTX.hook_handles = [h for h in CTX.hook_handles if id(h) not in ids]
        self._handles = []
        self._closed = True

    def __enter__(self) -> "FactorEngine":
        return self

    def __exit__(self, *args) -> None:
        self.close()

    def _sync(self, groups: List[List[int]]) -> None:
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

    def _forward_loss(self, inputs: Tensor, targets: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """Forward pass of the private copy and its checked, finite loss.

        ``targets=None`` (MSE only) uses zeros: the GGN of MSELoss does not depend on
        the targets.
        """
        outputs = self._copy(inputs)
        if targets is None:
            targets = torch.zeros_like(outputs.detach())
        _checks.check_targets(self.loss_func, outputs, targets)
        loss = self._loss(outputs, targets)
        _checks.check_finite(loss)
        return outputs, loss

    def gradient(self, inputs: Tensor, targets: Optional[Tensor],
                 param_groups: Optional[List[dict]] = None) -> List[Tensor]:
        """The mini-batch gradient per group from a plain backward pass (no BackPACK).

        Args:
            inputs: Inputs, shape ``(N, ...)``.
            targets: Targets (``None`` for ``MSELoss`` uses zeros).
            param_groups: Optimizer-style groups; ``None`` is one group.

        Returns:
            One flat gradient per group, shape ``(D_g,)``.
        """
        if self._closed:
            raise RuntimeError("The engine is closed: create a new FactorEngine.")
        groups = _checks.resolve_param_groups(self.model, param_groups)
        self._sync(groups)
        with torch.enable_grad():
            _, loss = self._forward_loss(inputs, targets)
            params = [self._copy_params[i] for g in groups for i in g]
            with warnings.catch_warnings():  # BackPACK's hooks are installed but idle
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                grads = torch.autograd.grad(loss, params, allow_unused=True)
        flat = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        sizes = [sum(self._copy_params[i].numel() for i in g) for g in groups]
        return list(torch.cat([g.flatten() for g in flat]).split(sizes))

    def compute(
        self,
        inputs: Tensor,
        targets: Optional[Tensor],
        mc_samples: int = 0,
        subsampling: Optional[Sequence[int]] = None,
        param_groups: Optional[List[dict]] = None,
        keep_blocks: bool = True,
        compute_grams: bool = False,
        batch_grad: bool = False,
        project: Optional[Sequence[Optional[Tensor]]] = None,
        t_project: Optional[Sequence[Optional[Tensor]]] = None,
        cross_batch_grads: bool = False,
        compute_diag: bool = False,
        project_into: Optional[Sequence[Optional[Tuple[Tensor, Tensor]]]] = None,
    ) -> GGNFactor:
        """Run one backward pass and collect ``V`` (and gradients).

        Args:
            inputs: Inputs, shape ``(N, ...)``.
            targets: Targets, shape ``(N,)`` (class indices) or ``(N, C)``; ``None``
                for ``MSELoss`` uses zeros (the GGN of MSE does not depend on them).
            mc_samples: ``0`` for the exact GGN, ``M >= 1`` for Monte-Carlo.
            subsampling: Indices of the samples used for the curvature.
            param_groups: Optimizer-style groups of the model's parameters;
                ``None`` is one group of all trainable parameters.
            keep_blocks: Keep the blocks of ``V`` (needed for eigenvectors and
                products). ``False`` frees each block inside the backward pass.
            compute_grams: Accumulate each group's Gram matrix during the pass.
            batch_grad: Also compute per-sample gradients (BackPACK ``BatchGrad``).
            project: One matrix ``y`` (``(M, K)``) or ``None`` per group: ``V y`` is
                formed block by block inside the backward pass (``factor.projected``),
                so with ``keep_blocks=False`` no more than one block of ``V`` is
                alive at a time.
            t_project: One matrix ``x`` (``(D_g, K)``, flat over the group's
                parameters), a list of such matrices, or ``None`` per group: ``V^T x``
                is accumulated block by block inside the backward pass
                (``factor.t_projected``, a list where a list was given).
            cross_batch_grads: With ``batch_grad``: accumulate ``V^T [g_1, ..., g_N]``
                per group block by block (``factor.t_batch_grads``) instead of
                keeping the per-sample gradients.
            compute_diag: Accumulate the GGN diagonal per parameter block by block
                (``factor.diag``) without keeping the blocks.
            project_into: One pair ``(out, y)`` (``(D_g, K)``, ``(M, K)``) or ``None``
                per group: ``out += V y`` in place, block by block.

        Returns:
            The factor.

        Raises:
            RuntimeError: If the engine was closed.
            ValueError: If neither blocks, Gram matrices nor projections are
                requested, or ``targets`` is ``None`` for a loss other than MSE.
        """
        if self._closed:
            raise RuntimeError("The engine is closed: create a new FactorEngine.")
        if not (keep_blocks or compute_grams or project is not None or t_project is not None
                or project_into is not None):
            raise ValueError("Request keep_blocks, compute_grams and/or project.")
        if cross_batch_grads and not batch_grad:
            raise ValueError("cross_batch_grads needs batch_grad=True.")
        if targets is None and not isinstance(self.loss_func, nn.MSELoss):
            raise ValueError("targets=None is only allowed for MSELoss.")
        n = _checks.check_batch(inputs, inputs if targets is None else targets)
        mc_samples = _checks.check_mc_samples(mc_samples)
        subsampling = _checks.check_subsampling(subsampling, n)
        groups = _checks.resolve_param_groups(self.model, param_groups)
        for name, value in (("project", project), ("t_project", t_project),
                            ("project_into", project_into)):
            if value is not None and len(value) != len(groups):
                raise ValueError(f"{name} needs one entry per group ({len(groups)}), "
                                 f"got {len(value)}.")
        t_parts: Dict[int, List[Tensor]] = {}  # t_project split per parameter
        t_listed: Dict[int, bool] = {}  # group's t_project given as a list
        into: Dict[int, Tuple[Tensor, Tensor]] = {}  # project_into: (out part, y)
        for g, members in enumerate(groups):
            sizes = [self._copy_params[i].numel() for i in members]
            if t_project is not None and t_project[g] is not None:
                mats = t_project[g]
                t_listed[g] = not isinstance(mats, Tensor)
                splits = [m.split(sizes) for m in (mats if t_listed[g] else [mats])]
                for j, i in enumerate(members):
                    t_parts[i] = [parts[j] for parts in splits]
            if project_into is not None and project_into[g] is not None:
                out, y = project_into[g]
                into.update((i, (part, y)) for i, part in zip(members, out.split(sizes)))
        self._sync(groups)
        if self._handles is None:
            self._extend(inputs)

        n_curv = n if subsampling is None else len(subsampling)
        mean = self.loss_func.reduction == "mean"
        # BackPACK normalises by the full batch; rescale to the subset's own loss
        rescale = math.sqrt(n / n_curv) if (mean and subsampling is not None) else 1.0
        group_of = {i: g for g, members in enumerate(groups) for i in members}
        grams: List[Optional[Tensor]] = [None] * len(groups)
        kept: Dict[int, Block] = {}
        batch_grads: Dict[int, Block] = {}
        projected: Dict[int, Tensor] = {}
        t_projected: Dict[int, List[Tensor]] = {}
        t_done: set = set()
        t_batch: Dict[int, Tensor] = {}
        diagonals: Dict[int, Tensor] = {}

        ext = sqrt_ggn_extension(mc_samples, subsampling)
        exts = [ext, batch_grad_extension()] if batch_grad else [ext]

        def consume(module: nn.Module) -> None:
            for param in module.parameters(recurse=False):
                i = self._index.get(id(param))
                if i is None or not param.requires_grad:
                    continue
                value = getattr(param, ext.savefield)
                delattr(param, ext.savefield)
                block = _as_block(value, lead=2)
                if rescale != 1.0:
                    block.scale_(rescale)
                if compute_grams:
                    g = group_of[i]
                    gram = block.gram()
                    grams[g] = gram if grams[g] is None else grams[g] + gram
                if keep_blocks:
                    kept[i] = block
                if project is not None and project[group_of[i]] is not None:
                    projected[i] = block.matmul(project[group_of[i]])
                if compute_diag:
                    diagonals[i] = block.diag_outer()
                if i in into:
                    block.matmul_add_(*into[i])
                    t_done.add(("into", i))
                if i in t_parts:
                    g = group_of[i]
                    parts = [block.t_matmul(x) for x in t_parts[i]]
                    acc = t_projected.get(g)
                    t_projected[g] = parts if acc is None else [a + b for a, b in zip(acc, parts)]
                    t_done.add(i)
                if batch_grad:
                    grads_i = _as_block(param.grad_batch, lead=1)
                    del param.grad_batch
                    if cross_batch_grads:
                        g = group_of[i]
                        part = block.cross(grads_i)
                        t_batch[g] = part if g not in t_batch else t_batch[g] + part
                    else:
                        batch_grads[i] = grads_i

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

        grad = {}
        for i in group_of:
            p = self._copy_params[i]
            grad[i] = (p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
            p.grad = None
        wanted = {i for i in group_of if keep_blocks} | {
            i for i in group_of if project is not None and project[group_of[i]] is not None
        }
        missing = [i for i in wanted if i not in kept and i not in projected]
        missing += [i for i in t_parts if i not in t_done]
        missing += [i for i in into if ("into", i) not in t_done]
        if missing:
            names = [n for n, p in self._copy.named_parameters() if self._index[id(p)] in missing]
            raise RuntimeError(
                f"BackPACK produced no GGN factor for parameters {names}: they do not "
                "influence the loss through supported layers."
            )
        num_vectors = factor_columns(self.loss_func, outputs.shape, mc_samples)
        return GGNFactor(
            groups=groups,
            shapes=[p.shape for p in self._copy_params],
            num_vectors=num_vectors,
            num_curv_samples=n_curv,
            sample_scale=float(n_curv) if mean else 1.0,
            num_samples=n,
            reduction=self.loss_func.reduction,
            loss=loss.detach(),
            outputs=outputs.detach(),
            blocks=kept,
            grams=grams if compute_grams else [],
            grad=grad,
            batch_grads=batch_grads,
            projected=projected,
            t_projected={g: v if t_listed[g] else v[0] for g, v in t_projected.items()},
            t_batch_grads=t_batch,
            diagonals=diagonals,
        )


def _as_block(value, lead: int) -> Block:
    """Wrap a BackPACK result as a block of rows.

    Args:
        value: A block, or a tensor of shape ``(*lead_dims, *param.shape)``
            (``(vectors, samples, ...)`` for ``V``, ``(samples, ...)`` for
            per-sample gradients).
        lead: Number of leading dimensions that index rows.

    Returns:
        The block.
    """
    if isinstance(value, (DenseBlock, KronBlock)):
        return value
    return DenseBlock(value.detach().reshape(math.prod(value.shape[:lead]), -1))


class RNGReplay:
    """Replay the random draws of an engine pass (MC samples, dropout) in later passes.

    Created before the first pass, it saves the global RNG state (and that of a CUDA
    device); :meth:`mark` records the state after the first pass. Every ``with``
    block restores the saved state, so the pass inside draws the same numbers, and
    on exit the caller's RNG is left as after the first pass only.

    Args:
        device: The device of the inputs (its generator is replayed too if CUDA).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.start = rng_state(device)
        self.after_first = None

    def mark(self) -> None:
        """Record the state after the first pass."""
        self.after_first = rng_state(self.device)

    def restart(self) -> None:
        """Set the RNG back to the saved state (before a pass that counts as first)."""
        set_rng_state(self.start, self.device)

    def __enter__(self) -> "RNGReplay":
        if self.after_first is None:
            self.mark()
        set_rng_state(self.start, self.device)
        return self

    def __exit__(self, *exc) -> None:
        set_rng_state(self.after_first, self.device)


def rng_state(device: torch.device) -> Tuple[Tensor, Optional[Tensor]]:
    """The global CPU generator's state and, for a CUDA device, that device's.

    Args:
        device: The device whose generator is saved besides the CPU's.

    Returns:
        ``(cpu_state, cuda_state or None)``.
    """
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: Tuple[Tensor, Optional[Tensor]], device: torch.device) -> None:
    """Restore a state from :func:`rng_state`.

    Args:
        state: ``(cpu_state, cuda_state or None)``.
        device: The device the CUDA state belongs to.
    """
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
