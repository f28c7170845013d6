"""BackPACK extensions tuned for ``V`` (docs/benchmarks/design_measurements.md).

Linear weights on 2d inputs stay factored; ``Conv1d``/``Conv2d`` weights (``groups=1``,
zero padding) are expanded by one batched product with the unfolded input per vector;
adaptive average pools get the ``SqrtGGN`` mapping BackPACK lacks; exact cross-entropy
backpropagates ``C - 1`` columns (:func:`~lowrank_laplace.factor.reduced_cross_entropy_sqrt`);
elementwise activations multiply in place where nothing else reads the matrix; the
engine's :class:`~lowrank_laplace.engine.backpack.buffers.RowBuffers` take the conv rows
and the max-pools' scattered matrices from pass to pass.
Shapes: ``V`` vectors per sample, ``N`` samples, ``P`` output positions of a conv
layer, ``Q = in * prod(kernel)``.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
from backpack.core.derivatives.adaptive_avg_pool_nd import (
    AdaptiveAvgPool1dDerivatives,
    AdaptiveAvgPool2dDerivatives,
    AdaptiveAvgPool3dDerivatives,
)
from backpack.core.derivatives.maxpool1d import MaxPool1DDerivatives
from backpack.core.derivatives.maxpool2d import MaxPool2DDerivatives
from backpack.core.derivatives.maxpool3d import MaxPool3DDerivatives
from backpack.extensions import BatchGrad, SqrtGGNExact, SqrtGGNMC
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.firstorder.batch_grad.conv1d import BatchGradConv1d
from backpack.extensions.firstorder.batch_grad.conv2d import BatchGradConv2d
from backpack.extensions.firstorder.batch_grad.linear import BatchGradLinear
from backpack.extensions.secondorder.hbp import LossHessianStrategy
from backpack.extensions.secondorder.sqrt_ggn import activations
from backpack.extensions.secondorder.sqrt_ggn.base import SqrtGGNBaseModule
from backpack.extensions.secondorder.sqrt_ggn.convnd import SqrtGGNConv1d, SqrtGGNConv2d
from backpack.extensions.secondorder.sqrt_ggn.linear import SqrtGGNLinear
from backpack.extensions.secondorder.sqrt_ggn.losses import SqrtGGNCrossEntropyLoss
from backpack.utils.subsampling import subsample
from torch import Tensor, nn
from torch.nn.functional import pad

from lowrank_laplace.engine.backpack.buffers import RowBuffers
from lowrank_laplace.factor import reduced_cross_entropy_sqrt
from lowrank_laplace.factor.blocks import DenseBlock, KronBlock
from lowrank_laplace.factor.conv_block import ConvBlock, factored_gram_pays


def _linear_weight(module: nn.Linear, mat: Tensor, subsampling) -> Optional[KronBlock]:
    """A linear layer's weight block from ``mat`` ``(V, N, out)``, ``None`` beyond 2d inputs."""
    if module.input0.ndim != 2:
        return None
    z = subsample(module.input0, subsampling=subsampling).detach()
    return KronBlock(mat.detach(), z)


def _conv_weight(module: nn.Module, mat: Tensor, subsampling,
                 buffers: Optional[RowBuffers] = None) -> Optional[DenseBlock]:
    """A conv weight's rows ``(V N, out Q)`` from ``mat`` ``(V, N, out, *spatial)``, or ``None``.

    Written into ``buffers``' buffer for the module where it is free; a
    :class:`~lowrank_laplace.factor.conv_block.ConvBlock` keeping ``mat`` and the patches
    where its Gram is cheaper from them.
    """
    if (module.groups != 1 or isinstance(module.padding, str)
            or module.padding_mode != "zeros"):
        return None
    x = subsample(module.input0, subsampling=subsampling).detach()
    kernel, dilation = module.kernel_size, module.dilation
    padding, stride = module.padding, module.stride
    if isinstance(module, nn.Conv1d):
        x = x.unsqueeze(2)
        kernel, dilation = (1, *kernel), (1, *dilation)
        padding, stride = (0, *padding), (1, *stride)
    cols_t = unfold_input(x, kernel, dilation, padding, stride).transpose(1, 2)  # (N, P, Q)
    num_vecs, num_samples, out_channels = mat.shape[:3]
    mat = mat.detach().reshape(num_vecs, num_samples, out_channels, -1)  # (V, N, out, P)
    shape = (num_vecs, num_samples, out_channels, cols_t.shape[2])
    rows = mat.new_empty(shape) if buffers is None else buffers.empty(module, shape, mat)
    for v in range(num_vecs):
        torch.matmul(mat[v], cols_t, out=rows[v])
    rows = rows.reshape(num_vecs * num_samples, -1)
    if factored_gram_pays(num_vecs, out_channels, *cols_t.shape[1:]):
        return ConvBlock(rows, mat.transpose(0, 1).contiguous(), cols_t.contiguous())
    return DenseBlock(rows)


def unfold_input(x: Tensor, kernel: Tuple[int, int], dilation: Tuple[int, int],
                 padding: Tuple[int, int], stride: Tuple[int, int]) -> Tensor:
    """Return the patches ``(N, C kh kw, H' W')`` of a 2d convolution's input (as ``F.unfold``).

    From strided views of ``x`` ``(N, C, H, W)`` and one copy; the rest are ``(h, w)`` pairs
    (``padding`` with zeros).
    """
    x = pad(x, (padding[1], padding[1], padding[0], padding[0]))
    for d in range(2):
        span = (kernel[d] - 1) * dilation[d] + 1
        x = x.unfold(2 + d, span, stride[d])
        if dilation[d] > 1:
            x = x[..., :: dilation[d]]
    n, c, h, w, kh, kw = x.shape  # (N, C, H', W', kh, kw)
    return x.permute(0, 1, 4, 5, 2, 3).reshape(n, c * kh * kw, h * w)


def _sqrt_ggn(base, weight_fn):
    """``base`` with the weight's block from ``weight_fn`` where it applies, else BackPACK's."""

    class _SqrtGGN(base):
        def weight(self, ext, module, g_inp, g_out, backproped):  # noqa: D102
            block = weight_fn(module, backproped, ext.get_subsampling())
            if block is not None:
                return block
            return self.derivatives.param_mjp(
                "weight", module, g_inp, g_out, backproped, sum_batch=False,
                subsampling=ext.get_subsampling())

    return _SqrtGGN


def _batch_grad(base, weight_fn):
    class _BatchGrad(base):
        def weight(self, ext, module, g_inp, g_out, backproped):  # noqa: D102
            block = weight_fn(module, g_out[0].unsqueeze(0), None)
            if block is None:
                return self._derivatives.param_mjp(
                    "weight", module, g_inp, g_out, g_out[0], sum_batch=False)
            return block

    return _BatchGrad


class _SqrtGGNCrossEntropy(SqrtGGNCrossEntropyLoss):
    def backpropagate(self, ext, module, grad_inp, grad_out, backproped):  # noqa: D102
        logits = module.input0
        if (ext.get_loss_hessian_strategy() != LossHessianStrategy.EXACT
                or logits.ndim != 2 or logits.shape[1] < 2):
            return super().backpropagate(ext, module, grad_inp, grad_out, backproped)
        sqrt_h = reduced_cross_entropy_sqrt(
            subsample(logits, subsampling=ext.get_subsampling()), "sum")
        # BackPACK normalises a mean loss by the full batch size
        return sqrt_h / logits.shape[0] ** 0.5 if module.reduction == "mean" else sqrt_h


def _in_place_elementwise(base):
    """An activation's extension multiplying in place where nothing else reads the matrix."""

    class _InPlace(base):
        def backpropagate(self, ext, module, g_inp, g_out, backproped):  # noqa: D102
            if (isinstance(backproped, Tensor) and backproped.is_contiguous()
                    and not backproped.requires_grad and _exclusive(ext, backproped)):
                df = self.derivatives.df(module, g_inp, g_out,
                                         subsampling=ext.get_subsampling())
                return backproped.mul_(df.to(backproped.dtype))
            return super().backpropagate(ext, module, g_inp, g_out, backproped)

    _InPlace.__name__ = _InPlace.__qualname__ = f"_InPlace{base.__name__}"
    return _InPlace


def _exclusive(ext, mat: Tensor) -> bool:
    """Whether no quantity the extension still keeps shares ``mat``'s storage."""
    ptr = mat.untyped_storage().data_ptr()
    saved = ext.saved_quantities._saved_quantities.values()  # BackPACK keeps it private
    return all(not isinstance(q, Tensor) or q.untyped_storage().data_ptr() != ptr
               for q in saved)


def _reused_zeros(base, buffers: RowBuffers):
    """A max-pool's derivatives scattering into reused zeros (BackPACK's are fresh each pass)."""

    class _Pooled(base):
        def _jac_t_mat_prod(self, module, g_inp, g_out, mat, subsampling=None):
            idx = self.get_pooling_idx(module, subsampling=subsampling).flatten(2)
            mat = mat.flatten(3)  # (V, N, C, output positions), as the indices
            shape = (*mat.shape[:3], module.input0.shape[2:].numel())
            result = buffers.empty(module, shape, mat).zero_()
            result.scatter_add_(3, idx.unsqueeze(0).expand_as(mat), mat)
            return self.reshape_like_input(result, module, subsampling=subsampling)

    return _Pooled()


_MAX_POOLS = {nn.MaxPool1d: MaxPool1DDerivatives, nn.MaxPool2d: MaxPool2DDerivatives,
              nn.MaxPool3d: MaxPool3DDerivatives}

_IN_PLACE_SQRT_GGN = {
    layer: _in_place_elementwise(getattr(activations, f"SqrtGGN{layer.__name__}"))
    for layer in (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.ELU, nn.SELU, nn.LeakyReLU, nn.LogSigmoid)
}

_EXTRA_SQRT_GGN = {
    nn.AdaptiveAvgPool1d: AdaptiveAvgPool1dDerivatives,
    nn.AdaptiveAvgPool2d: AdaptiveAvgPool2dDerivatives,
    nn.AdaptiveAvgPool3d: AdaptiveAvgPool3dDerivatives,
}


def sqrt_ggn_extension(mc_samples: int, subsampling: Optional[List[int]],
                       buffers: Optional[RowBuffers] = None) -> BackpropExtension:
    """Return BackPACK's ``SqrtGGNExact``/``SqrtGGNMC`` with the tuned layer extensions.

    Results are stored under ``ext.savefield``.

    Args:
        mc_samples: ``0`` (exact GGN) or ``M >= 1``.
        subsampling: Active sample indices or ``None``.
        buffers: Where convolution weight rows and max-pool matrices are written
            (``None``: fresh tensors).
    """
    conv_weight = functools.partial(_conv_weight, buffers=buffers)
    if mc_samples:
        ext = SqrtGGNMC(mc_samples=mc_samples, subsampling=subsampling)
    else:
        ext = SqrtGGNExact(subsampling=subsampling)
    ext.set_module_extension(nn.Linear, _sqrt_ggn(SqrtGGNLinear, _linear_weight)(), overwrite=True)
    ext.set_module_extension(nn.CrossEntropyLoss, _SqrtGGNCrossEntropy(), overwrite=True)
    ext.set_module_extension(nn.Conv1d, _sqrt_ggn(SqrtGGNConv1d, conv_weight)(), overwrite=True)
    ext.set_module_extension(nn.Conv2d, _sqrt_ggn(SqrtGGNConv2d, conv_weight)(), overwrite=True)
    for layer, derivatives in _EXTRA_SQRT_GGN.items():
        ext.set_module_extension(layer, SqrtGGNBaseModule(derivatives()), overwrite=True)
    if buffers is not None:
        for layer, derivatives in _MAX_POOLS.items():
            ext.set_module_extension(
                layer, SqrtGGNBaseModule(_reused_zeros(derivatives, buffers)), overwrite=True)
    for layer, extension in _IN_PLACE_SQRT_GGN.items():
        ext.set_module_extension(layer, extension(), overwrite=True)
    return ext


def batch_grad_extension() -> BatchGrad:
    """Return BackPACK's ``BatchGrad`` (results under ``grad_batch``) with the tuned weights."""
    ext = BatchGrad()
    ext.set_module_extension(
        nn.Linear, _batch_grad(BatchGradLinear, _linear_weight)(), overwrite=True)
    ext.set_module_extension(
        nn.Conv1d, _batch_grad(BatchGradConv1d, _conv_weight)(), overwrite=True)
    ext.set_module_extension(
        nn.Conv2d, _batch_grad(BatchGradConv2d, _conv_weight)(), overwrite=True)
    return ext


def supported_modules() -> tuple:
    """The module classes the GGN factor can be backpropagated through."""
    # BackPACK keeps the mapping private; read it through the mangled name.
    ext = sqrt_ggn_extension(0, None)
    return tuple(ext._BackpropExtension__module_extensions.keys())
