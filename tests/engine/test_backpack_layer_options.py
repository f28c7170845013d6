"""Every layer BackPACK takes, with its non-default constructor options, against dense
torch.func GGNs in float64: options its derivatives get wrong go to an exact backend under
``backend="auto"`` and are refused, naming the layer and the way out, under ``"backpack"``."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowrank_laplace as ll
from tests import reference as ref

TOL = dict(rtol=1e-5, atol=1e-8)
SHAPES = {1: (2, 8), 2: (2, 6, 8), 3: (2, 5, 4, 6)}


def trainable(layer, dim):
    """``layer`` (with parameters) on an input of ``dim`` spatial axes, then a linear head."""
    with torch.no_grad():
        size = layer(torch.randn(1, *SHAPES[dim]))[0].numel()
    return nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.Linear(size, 3)), SHAPES[dim]


def after_conv(layer, dim):
    """A trainable convolution, then the parameter-free ``layer``, then a linear head."""
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dim - 1](2, 2, 2)
    with torch.no_grad():
        size = layer(conv(torch.randn(1, *SHAPES[dim])))[0].numel()
    return nn.Sequential(conv, layer, nn.Flatten(), nn.Linear(size, 3)), SHAPES[dim]


class Embedded(nn.Module):
    """An embedding of three tokens, flattened into a linear head."""

    def __init__(self, **options):
        super().__init__()
        self.embed, self.head = nn.Embedding(5, 3, **options), nn.Linear(9, 3)

    def forward(self, tokens):
        return self.head(self.embed(tokens).flatten(1))


class FunctionalPool(nn.Module):
    """A class-based model with a functional average pool in ceil mode."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(2, 2, 2), nn.Linear(24, 3)

    def forward(self, x):
        return self.head(F.avg_pool2d(self.conv(x), 2, ceil_mode=True).flatten(1))


#: Options BackPACK's derivatives get wrong (or fail on): name -> (model and input shape,
#: the layer and option the refusal names, as text).
WRONG = {
    "conv1d_same": (lambda: trainable(nn.Conv1d(2, 2, 3, padding="same"), 1),
                    "'0' (Conv1d) has padding='same'"),
    "conv2d_same_even_kernel": (lambda: trainable(nn.Conv2d(2, 2, 2, padding="same"), 2),
                                "'0' (Conv2d) has padding='same'"),
    "conv2d_same_dilated": (lambda: trainable(nn.Conv2d(2, 2, 3, padding="same", dilation=2), 2),
                            "'0' (Conv2d) has padding='same'"),
    "conv3d_same": (lambda: trainable(nn.Conv3d(2, 2, 3, padding="same"), 3),
                    "'0' (Conv3d) has padding='same'"),
    **{f"conv{d}d_{mode}": (
        lambda d=d, mode=mode: trainable((nn.Conv1d, nn.Conv2d, nn.Conv3d)[d - 1](
            2, 2, 3, padding=1, padding_mode=mode), d),
        f"'0' (Conv{d}d) has padding_mode='{mode}'")
       for d in (1, 2, 3) for mode in ("circular", "reflect", "replicate")},
    "conv_transpose1d_output_padding": (
        lambda: trainable(nn.ConvTranspose1d(2, 2, 3, stride=2, padding=1, output_padding=1), 1),
        "'0' (ConvTranspose1d) has output_padding=(1,)"),
    "conv_transpose2d_output_padding": (
        lambda: trainable(nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1, output_padding=1), 2),
        "'0' (ConvTranspose2d) has output_padding=(1, 1)"),
    "avg_pool1d_ceil_mode": (lambda: after_conv(nn.AvgPool1d(2, ceil_mode=True), 1),
                             "'1' (AvgPool1d) has ceil_mode=True"),
    "avg_pool2d_ceil_mode": (lambda: after_conv(nn.AvgPool2d(2, ceil_mode=True), 2),
                             "'1' (AvgPool2d) has ceil_mode=True"),
    "avg_pool3d_ceil_mode": (lambda: after_conv(nn.AvgPool3d(2, ceil_mode=True), 3),
                             "'1' (AvgPool3d) has ceil_mode=True"),
    "avg_pool2d_count_exclude_pad": (
        lambda: after_conv(nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False), 2),
        "'1' (AvgPool2d) has count_include_pad=False"),
    "avg_pool2d_divisor_override": (lambda: after_conv(nn.AvgPool2d(2, divisor_override=3), 2),
                                    "'1' (AvgPool2d) has divisor_override=3"),
    "avg_pool3d_divisor_override": (lambda: after_conv(nn.AvgPool3d(2, divisor_override=3), 3),
                                    "'1' (AvgPool3d) has divisor_override=3"),
    "batchnorm2d_without_affine": (
        lambda: after_conv(nn.BatchNorm2d(2, affine=False).eval(), 2),
        "'1' (BatchNorm2d) has affine=False"),
    "embedding_padding_idx": (lambda: (Embedded(padding_idx=0), None),
                              "'embed' (Embedding) has padding_idx=0"),
    "embedding_max_norm": (lambda: (Embedded(max_norm=0.5), None),
                           "'embed' (Embedding) has max_norm=0.5"),
    "functional_avg_pool_ceil_mode": (lambda: (FunctionalPool(), SHAPES[2]),
                                      "'avg_pool2d' (AvgPool2d) has ceil_mode=True"),
}

#: Non-default options BackPACK computes exactly: ``auto`` keeps it.
RIGHT = {
    "conv1d_groups": lambda: trainable(nn.Conv1d(2, 4, 3, groups=2, padding=1), 1),
    "conv1d_padding_valid": lambda: trainable(nn.Conv1d(2, 2, 3, padding="valid"), 1),
    "conv2d_stride_dilation_padding": lambda: trainable(
        nn.Conv2d(2, 2, 2, stride=2, dilation=2, padding=1, bias=False), 2),
    "conv2d_circular_without_padding": lambda: trainable(
        nn.Conv2d(2, 2, 3, padding_mode="circular"), 2),
    "conv3d_groups": lambda: trainable(nn.Conv3d(2, 2, 3, groups=2, padding=1), 3),
    "conv_transpose2d_groups_dilation": lambda: trainable(
        nn.ConvTranspose2d(2, 4, 3, stride=2, groups=2, dilation=2), 2),
    "conv_transpose1d_stride_padding_dilation": lambda: trainable(
        nn.ConvTranspose1d(2, 2, 3, stride=2, padding=1, dilation=2, bias=False), 1),
    "conv_transpose3d_stride": lambda: trainable(nn.ConvTranspose3d(2, 2, 2, stride=2), 3),
    "max_pool1d_ceil_mode_padding": lambda: after_conv(
        nn.MaxPool1d(3, stride=2, padding=1, ceil_mode=True), 1),
    "max_pool2d_ceil_mode": lambda: after_conv(nn.MaxPool2d(2, ceil_mode=True), 2),
    "max_pool2d_dilation": lambda: after_conv(nn.MaxPool2d(2, stride=1, dilation=2), 2),
    "max_pool3d_ceil_mode": lambda: after_conv(nn.MaxPool3d(2, ceil_mode=True), 3),
    "avg_pool2d_padding": lambda: after_conv(nn.AvgPool2d(3, stride=2, padding=1), 2),
    "zero_pad2d": lambda: after_conv(nn.ZeroPad2d((1, 0, 2, 1)), 2),
    "leaky_relu_elu_slopes": lambda: (nn.Sequential(
        nn.Linear(4, 3), nn.LeakyReLU(0.3), nn.Linear(3, 3), nn.ELU(0.5), nn.Linear(3, 3)),
        (4,)),
    "sigmoid_logsigmoid_selu_dropout": lambda: (nn.Sequential(
        nn.Linear(4, 3), nn.Sigmoid(), nn.Linear(3, 3), nn.LogSigmoid(), nn.Linear(3, 3),
        nn.SELU(), nn.Dropout(0.3), nn.Linear(3, 3)), (4,)),
    "batchnorm2d_eval": lambda: after_conv(nn.BatchNorm2d(2, eps=0.1).eval(), 2),
    "batchnorm3d_eval": lambda: after_conv(nn.BatchNorm3d(2, momentum=None).eval(), 3),
    "batchnorm1d_eval": lambda: (nn.Sequential(
        nn.Linear(4, 3), nn.BatchNorm1d(3, momentum=0.5, eps=0.1).eval(), nn.Linear(3, 3)),
        (4,)),
    "embedding": lambda: (Embedded(), None),
}


def build(model_fn, n=3, seed=0):
    """The model in float64 and eval mode, inputs and class targets, seeded."""
    torch.manual_seed(seed)
    model, shape = model_fn()
    model = model.double().eval()
    if shape is None:  # token ids, with repeats and the padding index
        X = torch.randint(0, 5, (n, 3))
        X[0, :2] = 0
    else:
        X = torch.randn(n, *shape, dtype=torch.float64)
    return model, nn.CrossEntropyLoss(), X, torch.randint(0, 3, (n,))


def dense_ggn_error(model, loss_func, X, y, backend):
    """The backend used and the relative error of ``V V^T`` against the dense GGN."""
    G = ref.ggn(model, loss_func, X, y)
    with ll.FactorEngine(model, loss_func, backend=backend) as engine:
        factor = engine.compute(X, y)
        V = factor.matmul(torch.eye(factor.num_columns, dtype=torch.float64))
    return factor.backend, V @ V.T, G


@pytest.mark.parametrize("name", list(WRONG))
def test_auto_takes_an_exact_backend_for_options_backpack_gets_wrong(name):
    model, loss_func, X, y = build(WRONG[name][0])
    backend, GGN, G = dense_ggn_error(model, loss_func, X, y, "auto")
    assert backend != "backpack"
    torch.testing.assert_close(GGN, G, rtol=1e-5, atol=1e-8 * G.abs().max())


@pytest.mark.parametrize("name", list(WRONG))
def test_backpack_refuses_options_it_gets_wrong(name):
    model, loss_func, X, y = build(WRONG[name][0])
    with pytest.raises(ValueError, match=f"Layer {re.escape(WRONG[name][1])}.*backend='functorch'"):
        with ll.FactorEngine(model, loss_func, backend="backpack") as engine:
            engine.compute(X, y)


@pytest.mark.parametrize("name", list(RIGHT))
def test_backpack_is_exact_with_the_options_it_keeps(name):
    model, loss_func, X, y = build(RIGHT[name])
    backend, GGN, G = dense_ggn_error(model, loss_func, X, y, "auto")
    assert backend == "backpack"
    torch.testing.assert_close(GGN, G, rtol=1e-5, atol=1e-8 * G.abs().max())
