"""The hooks backend's layer rules: one small class per layer type, found in a table.

A rule knows which parameters of its layer may be trainable and forms their blocks
from the layer's input ``a`` and output vectors ``g``. :data:`RULES` maps module types
to rules, :data:`NAMED_RULES` matches layers by class name; adding one:
``docs/contributing.md``. Shapes: ``V`` vectors per sample, ``N`` samples, ``T``
positions per sample (1 without a token axis), ``in``/``out`` features.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lowrank_laplace.factor import DenseBlock, KronBlock
from lowrank_laplace.factor.blocks import Block


def positions(g: Tensor, width: int) -> Tensor:
    """Return the vectors ``g`` ``(V, N, *, out)`` at a layer's output as ``(V, N, T, width)``."""
    return g.reshape(g.shape[0], g.shape[1], -1, width)


def bias_rows(gs: Tensor) -> Block:
    """Return a bias's rows ``(V N, width)``: the vectors ``gs`` ``(V, N, T, width)`` summed."""
    num_vectors, n, _, width = gs.shape
    return DenseBlock(gs.sum(2).reshape(num_vectors * n, width))


def weight_rows(pattern: str, gs: Tensor, a: Tensor) -> Block:
    """Return a matrix weight's rows ``sum_t g_t a_t^T``, expanded, ``(V N, out * in)``.

    Args:
        pattern: The einsum from ``(V, N, T, out)`` and ``(N, T, in)`` to the weight's
            layout per row (``"vnto,nti->vnoi"`` for ``(out, in)``).
        gs: The vectors ``(V, N, T, out)``.
        a: The layer's input ``(N, *, in)``.
    """
    num_vectors, n = gs.shape[:2]
    a3 = a.reshape(n, -1, a.shape[-1])
    rows = torch.einsum(pattern, gs, a3.to(gs.dtype))
    return DenseBlock(rows.reshape(num_vectors * n, -1))


class LayerRule:
    """How the hooks backend forms one layer type's blocks of ``V^T`` rows."""

    #: The parameters the layer may hold trainable.
    params: Tuple[str, ...] = ("weight", "bias")
    #: What the layer contributes, for the message refusing other parameters.
    label = ""

    def matches(self, module: nn.Module) -> bool:
        """Return whether the rule takes a module (rules in :data:`NAMED_RULES` only)."""
        return False

    def block(self, module: nn.Module, param: str, a: Tensor, g: Tensor) -> Block:
        """Return the block of rows ``(v, n)`` of ``V^T`` for one parameter, ``V N`` rows.

        Args:
            module: The layer.
            param: The parameter's name in the layer (one of :attr:`params`).
            a: The layer's input ``(N, *, in)`` (indices for an embedding).
            g: The vectors at the layer's output ``(V, N, *, out)``.
        """
        raise NotImplementedError


class LinearRule(LayerRule):
    """``nn.Linear``: ``y = W a + b``; a weight on vector inputs stays factored."""

    label = "nn.Linear weights and biases"

    def block(self, module: nn.Module, param: str, a: Tensor, g: Tensor) -> Block:
        """See :meth:`LayerRule.block`."""
        gs = positions(g, g.shape[-1])
        if param == "bias":
            return bias_rows(gs)
        if a.dim() == 2:
            return KronBlock(g, a)
        return weight_rows("vnto,nti->vnoi", gs, a)


class Conv1DRule(LayerRule):
    """Hugging Face's ``Conv1D`` (GPT-2): ``y = a W + b`` with ``W`` of shape ``(in, out)``."""

    label = "Hugging Face Conv1D weights and biases"

    def matches(self, module: nn.Module) -> bool:
        """See :meth:`LayerRule.matches`."""
        return type(module).__name__ == "Conv1D" and hasattr(module, "nf")

    def block(self, module: nn.Module, param: str, a: Tensor, g: Tensor) -> Block:
        """See :meth:`LayerRule.block`."""
        gs = positions(g, g.shape[-1])
        if param == "bias":
            return bias_rows(gs)
        return weight_rows("vnto,nti->vnio", gs, a)


class EmbeddingRule(LayerRule):
    """``nn.Embedding``: a sample's row is ``sum_t e_{idx_t} g_t^T`` (padding rows: none)."""

    params = ("weight",)
    label = "nn.Embedding weights"

    def block(self, module: nn.Module, param: str, a: Tensor, g: Tensor) -> Block:
        """See :meth:`LayerRule.block`."""
        gs = positions(g, g.shape[-1])
        num_vectors, n, count, dim = gs.shape
        idx = a.reshape(n, count)
        if module.padding_idx is not None:  # its rows get no gradient
            gs = gs * (idx != module.padding_idx)[None, :, :, None].to(gs.dtype)
        offsets = idx + torch.arange(n, device=idx.device)[:, None] * module.num_embeddings
        rows = gs.new_zeros(num_vectors, n * module.num_embeddings, dim)
        rows.index_add_(1, offsets.reshape(-1), gs.reshape(num_vectors, n * count, dim))
        return DenseBlock(rows.reshape(num_vectors * n, module.num_embeddings * dim))


class NormRule(LayerRule):
    """A norm's affine parameters: ``y = w * x_hat + b`` with ``x_hat`` the normalised input."""

    def normalized(self, module: nn.Module, a: Tensor) -> Tensor:
        """Return the input ``a`` ``(N, *, d)`` normalised, not yet scaled, as ``(N, T, d)``."""
        raise NotImplementedError

    def block(self, module: nn.Module, param: str, a: Tensor, g: Tensor) -> Block:
        """See :meth:`LayerRule.block`."""
        width = module.weight.numel()
        gs = positions(g, width)
        if param == "bias":
            return bias_rows(gs)
        num_vectors, n = gs.shape[:2]
        return DenseBlock((gs * self.normalized(module, a)[None]).sum(2)
                          .reshape(num_vectors * n, width))


class LayerNormRule(NormRule):
    """``nn.LayerNorm``: ``x_hat = (a - mean) / sqrt(var + eps)`` over the normalised shape."""

    label = "nn.LayerNorm weights and biases"

    def normalized(self, module: nn.Module, a: Tensor) -> Tensor:
        """See :meth:`NormRule.normalized`."""
        x = F.layer_norm(a, module.normalized_shape, None, None, module.eps)
        return x.reshape(a.shape[0], -1, module.weight.numel())


class RMSNormRule(NormRule):
    """Any ``*RMSNorm`` with a weight: ``x_hat = a / sqrt(mean(a^2) + eps)``.

    ``eps``: ``variance_epsilon`` (Hugging Face), ``eps``, else the dtype's machine epsilon.
    """

    params = ("weight",)
    label = "*RMSNorm weights"

    def matches(self, module: nn.Module) -> bool:
        """See :meth:`LayerRule.matches`."""
        return type(module).__name__.endswith("RMSNorm") and isinstance(
            getattr(module, "weight", None), nn.Parameter)

    def normalized(self, module: nn.Module, a: Tensor) -> Tensor:
        """See :meth:`NormRule.normalized`."""
        eps = getattr(module, "eps", None)
        eps = getattr(module, "variance_epsilon", eps)
        eps = torch.finfo(a.dtype).eps if eps is None else eps
        axes = tuple(range(-module.weight.dim(), 0))
        x = a * torch.rsqrt(a.pow(2).mean(axes, keepdim=True) + eps)
        return x.reshape(a.shape[0], -1, module.weight.numel())


class PReLURule(LayerRule):
    """``nn.PReLU``: ``y = max(0, a) + w min(0, a)``, one slope or one per channel."""

    params = ("weight",)
    label = "nn.PReLU slopes"

    def block(self, module: nn.Module, param: str, a: Tensor, g: Tensor) -> Block:
        """See :meth:`LayerRule.block`."""
        num_vectors, n = g.shape[:2]
        rows = g * a.clamp(max=0).to(g.dtype)[None]
        if module.weight.numel() == 1:
            return DenseBlock(rows.reshape(num_vectors * n, -1).sum(1, keepdim=True))
        channels = rows.movedim(-1 if a.dim() == 2 else 2, -1)
        return DenseBlock(channels.reshape(num_vectors, n, -1, module.weight.numel())
                          .sum(2).reshape(num_vectors * n, -1))


#: Module type -> its rule (a subclass takes its closest listed base's rule).
RULES: Dict[type, LayerRule] = {
    nn.Linear: LinearRule(),
    nn.Embedding: EmbeddingRule(),
    nn.LayerNorm: LayerNormRule(),
    nn.PReLU: PReLURule(),
}

#: Rules of layers known by their class name, asked in order after :data:`RULES`.
NAMED_RULES: Tuple[LayerRule, ...] = (Conv1DRule(), RMSNormRule())


def rule_for(module: nn.Module) -> Optional[LayerRule]:
    """Return the rule of a layer whose per-sample gradients are known, else ``None``."""
    for cls in type(module).__mro__:
        if cls in RULES:
            return RULES[cls]
    return next((rule for rule in NAMED_RULES if rule.matches(module)), None)


def supported_parameters() -> str:
    """Return the rules' labels, comma-separated, for messages."""
    return ", ".join(rule.label for rule in (*RULES.values(), *NAMED_RULES))
