r"""The GGN factor ``V`` of a mini-batch, computed in one BackPACK backward pass.

The generalized Gauss-Newton matrix of a loss :math:`L(\theta) = \rho \sum_n
\ell_n(f(x_n, \theta), y_n)` (``rho = 1/N`` for ``reduction='mean'``, ``1`` for
``'sum'``) factorises as

.. math::
    G = \rho \sum_n J_n^\top \nabla_f^2 \ell_n J_n = V V^\top, \qquad
    V = \sqrt{\rho}\,[v_{11}, \dots, v_{NC}], \quad v_{nc} = J_n^\top s_{nc},

with :math:`\nabla_f^2 \ell_n = \sum_c s_{nc} s_{nc}^\top` (exact) or a
Monte-Carlo estimate with ``M`` sampled vectors instead of ``C``. BackPACK's
``SqrtGGNExact`` / ``SqrtGGNMC`` extensions deliver ``V`` block by block for each
parameter during one backward pass; an extension hook hands each block to the
consumers (Gram matrix, kept copy) right away, so blocks that are only needed for
Gram quantities are freed inside the backward pass. Weights of ``nn.Linear``
layers are kept as :class:`~lowrank_laplace._blocks.KronBlock` (inputs and
backpropagated vectors) and never expanded.

Sub-sampling: with ``subsampling=S`` the curvature is that of the loss evaluated on
the samples ``S`` only, with the loss's own reduction (``1/|S|`` for ``'mean'``),
while gradients still use the whole batch.

Shape glossary:
    N: batch size; N_S: number of curvature samples (``len(subsampling)`` or N).
    C: model outputs; M: columns of ``V`` (``C * N_S`` exact, ``mc_samples * N_S``).
    D: number of parameters of a group.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from backpack import backpack, extend
from backpack.context import CTX
from torch import Tensor, nn

from lowrank_laplace import _checks
from lowrank_laplace._blocks import Block, DenseBlock, KronBlock, Weight
from lowrank_laplace._extensions import (
    batch_grad_extension,
    factor_columns,
    sqrt_ggn_extension,
    supported_modules,
)


@dataclass
class GGNFactor:
    r"""The GGN factor ``V`` of one mini-batch, split into parameter groups.

    Attributes:
        groups: Parameter indices (into ``list(model.parameters())``) per group.
        shapes: Shape of every parameter (indexed like the model's parameters).
        blocks: Kept blocks of ``V^T`` per parameter index (may be empty when only
            Gram matrices were requested).
        grams: Gram matrices ``V^T V`` per group accumulated during the backward
            pass (``None`` entries where not requested).
        num_vectors: Vectors per sample (``C`` exact, ``C - 1`` for exact
            cross-entropy, ``mc_samples`` for MC).
        num_curv_samples: Number of samples in the curvature (``N_S``).
        sample_scale: ``G_n = sample_scale * sum_c v_{nc} v_{nc}^T`` is the
            per-sample GGN of the sample's own loss ``l_n`` (``N_S`` for mean,
            ``1`` for sum reduction).
        grad: Flat mini-batch gradient per parameter index (if requested).
        batch_grads: Blocks of per-sample gradients of ``rho * l_n`` (if requested).
        num_samples: Batch size ``N``.
        reduction: The loss reduction, ``'mean'`` or ``'sum'``.
        loss: The mini-batch loss (detached).
        outputs: The model outputs on the batch (detached), shape ``(N, C)``.
        projected: ``V y`` restricted to each parameter for the matrices ``y`` given
            to :meth:`FactorEngine.compute` as ``project`` (``(d, K)`` per index).
    """

    groups: List[List[int]]
    shapes: List[torch.Size]
    num_vectors: int
    num_curv_samples: int
    sample_scale: float
    num_samples: int
    reduction: str
    loss: Tensor
    outputs: Optional[Tensor] = None
    blocks: Dict[int, Block] = field(default_factory=dict)
    grams: List[Optional[Tensor]] = field(default_factory=list)
    grad: Dict[int, Tensor] = field(default_factory=dict)
    batch_grads: Dict[int, Block] = field(default_factory=dict)
    projected: Dict[int, Tensor] = field(default_factory=dict)

    @property
    def num_columns(self) -> int:
        """Number of columns ``M`` of ``V``."""
        return self.num_vectors * self.num_curv_samples

    def group_dim(self, group: int = 0) -> int:
        """Number of parameters ``D`` in a group.

        Args:
            group: Group index.

        Returns:
            The dimension of the group's parameter space.
        """
        return sum(self.shapes[i].numel() for i in self.groups[group])

    def projected_flat(self, group: int = 0) -> Tensor:
        """``V y`` of a group from the projection pass, flat over its parameters.

        Args:
            group: Group index.

        Returns:
            Tensor of shape ``(D, K)``.

        Raises:
            RuntimeError: If the group was not projected.
        """
        try:
            return torch.cat([self.projected[i] for i in self.groups[group]], dim=0)
        except KeyError as err:
            raise RuntimeError("This group was not projected (see compute(project=...)).") \
                from err

    def _split(self, x: Tensor, group: int) -> List[Tensor]:
        sizes = [self.shapes[i].numel() for i in self.groups[group]]
        return list(torch.split(x, sizes, dim=0))

    def _blocks(self, group: int) -> List[Block]:
        try:
            return [self.blocks[i] for i in self.groups[group]]
        except KeyError as err:
            raise RuntimeError(
                "V was not kept for this group (it was computed with keep_blocks=False)."
            ) from err

    def gram(self, group: int = 0) -> Tensor:
        """Return the Gram matrix ``V^T V`` of a group, shape ``(M, M)``.

        Args:
            group: Group index.

        Returns:
            The Gram matrix.
        """
        if len(self.grams) > group and self.grams[group] is not None:
            return self.grams[group]
        return sum(b.gram() for b in self._blocks(group))

    def trace(self, group: int = 0) -> Tensor:
        """Return the exact GGN trace ``tr(V V^T) = tr(V^T V)`` of a group.

        Args:
            group: Group index.

        Returns:
            Scalar tensor.
        """
        if len(self.grams) > group and self.grams[group] is not None:
            return self.grams[group].diagonal().sum()
        return sum(b.row_sq_norms().sum() for b in self._blocks(group))

    def weighted_gram(self, weights: Sequence[Weight], group: int = 0) -> Tensor:
        """Return ``V^T diag(w) V`` with one weight (scalar or ``(d,)``) per parameter.

        Args:
            weights: Weights for the group's parameters, in group order.
            group: Group index.

        Returns:
            Tensor of shape ``(M, M)``.
        """
        return sum(b.weighted_gram(w) for b, w in zip(self._blocks(group), weights))

    def sample_gram(self, weights: Sequence[Weight], group: int = 0) -> Tensor:
        """Per-sample blocks of ``V^T diag(w) V``: ``(N_S, V, V)`` for vectors ``V``.

        Args:
            weights: Weights for the group's parameters, in group order.
            group: Group index.

        Returns:
            Tensor of shape ``(N_S, num_vectors, num_vectors)``.
        """
        return sum(
            b.sample_gram(self.num_vectors, w) for b, w in zip(self._blocks(group), weights)
        )

    def diag(self, group: int = 0) -> Tensor:
        """Return the exact diagonal of ``G = V V^T`` over the group, shape ``(D,)``.

        Args:
            group: Group index.

        Returns:
            The GGN diagonal (linear-layer blocks stay factored).
        """
        return torch.cat([b.diag_outer() for b in self._blocks(group)])

    def t_matmul(self, x: Tensor, group: int = 0) -> Tensor:
        """Return ``V^T x``.

        Args:
            x: Flat vectors over the group's parameters, shape ``(D, K)``.
            group: Group index.

        Returns:
            Tensor of shape ``(M, K)``.
        """
        parts = self._split(x, group)
        return sum(b.t_matmul(p) for b, p in zip(self._blocks(group), parts))

    def matmul(self, y: Tensor, group: int = 0) -> Tensor:
        """Return ``V y`` as flat vectors over the group's parameters.

        Args:
            y: Tensor of shape ``(M, K)``.
            group: Group index.

        Returns:
            Tensor of shape ``(D, K)``.
        """
        out = y.new_zeros(self.group_dim(group), y.shape[1])
        return self.matmul_add_(out, y, group)

    def matmul_add_(self, out: Tensor, y: Tensor, group: int = 0) -> Tensor:
        """Accumulate ``out += V y`` in place, one parameter slice at a time.

        Avoids materialising ``V y`` next to ``out`` (both ``D x K``).

        Args:
            out: Tensor of shape ``(D, K)``, updated in place.
            y: Tensor of shape ``(M, K)``.
            group: Group index.

        Returns:
            ``out``.
        """
        for block, part in zip(self._blocks(group), self._split(out, group)):
            block.matmul_add_(part, y)
        return out

    def matvec(self, x: Tensor, group: int = 0) -> Tensor:
        """Return the GGN-vector products ``G x = V (V^T x)``.

        Args:
            x: Tensor of shape ``(D, K)``.
            group: Group index.

        Returns:
            Tensor of shape ``(D, K)``.
        """
        return self.matmul(self.t_matmul(x, group), group)

    def inverse_matvec(self, x: Tensor, damping: float, group: int = 0) -> Tensor:
        r"""Return ``(G + delta I)^{-1} x`` by the matrix inversion lemma.

        :math:`(G + \delta I)^{-1} = \delta^{-1}[I - V(\delta I + V^\top V)^{-1}V^\top]`,
        solved with a Cholesky factor of the ``M x M`` damped Gram matrix.

        Args:
            x: Tensor of shape ``(D, K)``.
            damping: ``delta > 0``.
            group: Group index.

        Returns:
            Tensor of shape ``(D, K)``.

        Raises:
            ValueError: If ``damping <= 0``.
        """
        if not damping > 0:
            raise ValueError(f"damping must be positive, got {damping}.")
        gram = self.gram(group)
        eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
        chol = torch.linalg.cholesky(gram + damping * eye)
        inner = torch.cholesky_solve(self.t_matmul(x, group), chol)
        return (x - self.matmul(inner, group)) / damping

    def grad_dtype(self) -> torch.dtype:
        """The dtype of the model's parameters."""
        return next(iter(self.grad.values())).dtype

    def grad_device(self) -> torch.device:
        """The device of the model's parameters."""
        return next(iter(self.grad.values())).device

    def grad_flat(self, group: int = 0) -> Tensor:
        """Return the mini-batch gradient, flat over the group's parameters.

        Args:
            group: Group index.

        Returns:
            Tensor of shape ``(D,)``.
        """
        return torch.cat([self.grad[i] for i in self.groups[group]])

    def t_matmul_batch_grads(self, group: int = 0) -> Tensor:
        """Return ``V^T [g_1, ..., g_N]`` with the per-sample gradients of ``rho l_n``.

        Args:
            group: Group index.

        Returns:
            Tensor of shape ``(M, N)``.
        """
        return sum(
            self.blocks[i].cross(self.batch_grads[i]) for i in self.groups[group]
        )


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
        """Check the forward pass on one sample, then install BackPACK's hooks."""
        with torch.no_grad():
            _checks.checked_forward(self._copy, inputs[:1])
        num_handles = len(CTX.hook_handles)
        extend(self._copy)
        extend(self._loss)
        self._handles = CTX.hook_handles[num_handles:]

    def dense_param_count(self) -> int:
        """Entries of ``V``'s rows that are stored explicitly, per column.

        Trainable parameters count fully, except ``nn.Linear`` weights, which are
        kept factored (``out + in`` numbers per column).

        Returns:
            The count.
        """
        dense = 0
        for module in self._copy.modules():
            for name, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    factored = isinstance(module, nn.Linear) and name == "weight"
                    dense += sum(p.shape) if factored else p.numel()
        return dense

    def bytes_per_sample(self, inputs: Tensor, num_vectors: Optional[int] = None) -> int:
        """Estimate the memory one sample adds to a computation of ``V``.

        Counts the expanded blocks (``num_vectors`` vectors over every trainable
        parameter except factored ``nn.Linear`` weights) and the backpropagated
        vectors at every layer output, measured by a forward pass on one sample.

        Args:
            inputs: A batch of inputs (only the first sample is used).
            num_vectors: Vectors per sample (``mc_samples`` for MC); ``None`` uses
                the exact GGN's (``C``, or ``C - 1`` for cross-entropy).

        Returns:
            Estimated bytes per sample.
        """
        dense, feature_sizes = self.dense_param_count(), [0]

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

        Returns:
            The factor.

        Raises:
            RuntimeError: If the engine was closed.
            ValueError: If neither blocks, Gram matrices nor projections are
                requested, or ``targets`` is ``None`` for a loss other than MSE.
        """
        if self._closed:
            raise RuntimeError("The engine is closed: create a new FactorEngine.")
        if not (keep_blocks or compute_grams or project is not None):
            raise ValueError("Request keep_blocks, compute_grams and/or project.")
        if targets is None and not isinstance(self.loss_func, nn.MSELoss):
            raise ValueError("targets=None is only allowed for MSELoss.")
        n = _checks.check_batch(inputs, inputs if targets is None else targets)
        mc_samples = _checks.check_mc_samples(mc_samples)
        subsampling = _checks.check_subsampling(subsampling, n)
        groups = _checks.resolve_param_groups(self.model, param_groups)
        if project is not None and len(project) != len(groups):
            raise ValueError(f"project needs one entry per group ({len(groups)}), "
                             f"got {len(project)}.")
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
                if batch_grad:
                    batch_grads[i] = _as_block(param.grad_batch, lead=1)
                    del param.grad_batch

        with torch.enable_grad():
            outputs = self._copy(inputs)
            if targets is None:  # the GGN of MSELoss does not depend on the targets
                targets = torch.zeros_like(outputs.detach())
            _checks.check_targets(self.loss_func, outputs, targets)
            loss = self._loss(outputs, targets)
            _checks.check_finite(loss)
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
