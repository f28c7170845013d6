"""Test problems (DeepOBS architectures on random data) for the benchmarks.

All models are plain :class:`torch.nn.Sequential` containers built from standard
``torch.nn`` layers (no functional ops, no in-place activations) such that
BackPACK, curvlinops and ``torch.func`` can all handle them.

The architectures follow DeepOBS (Schneider et al., 2019):

- ``3c3d``: CIFAR-10 shaped inputs (3x32x32), 10 classes, D = 895,210.
- ``2c2d``: Fashion-MNIST shaped inputs (1x28x28), 10 classes, D = 3,274,634.
- ``mlp``: small fully-connected net on 1x28x28 inputs for quick runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

#: Expected number of parameters of the DeepOBS architectures.
EXPECTED_NUM_PARAMS: dict[str, int] = {
    "3c3d": 895_210,
    "2c2d": 3_274_634,
    "mlp": 784 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10,
}

#: Input shape (without batch axis) of each problem.
INPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "3c3d": (3, 32, 32),
    "2c2d": (1, 28, 28),
    "mlp": (1, 28, 28),
}

#: Number of classes of each problem.
NUM_CLASSES: dict[str, int] = {"3c3d": 10, "2c2d": 10, "mlp": 10}


def make_3c3d(num_classes: int = 10) -> nn.Sequential:
    """DeepOBS' ``3c3d`` network for CIFAR-10 shaped inputs (3x32x32).

    Spatial sizes: 32 -conv5-> 28 -pool-> 14 -conv3-> 12 -pool-> 6 -conv3(pad 1)->
    6 -pool-> 3, hence the flattened feature size is 128 * 3 * 3 = 1152.
    """
    return nn.Sequential(
        nn.Conv2d(3, 64, kernel_size=5),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        nn.Conv2d(64, 96, kernel_size=3),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        nn.Conv2d(96, 128, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        nn.Flatten(),
        nn.Linear(1152, 512),
        nn.ReLU(),
        nn.Linear(512, 256),
        nn.ReLU(),
        nn.Linear(256, num_classes),
    )


def make_2c2d(num_classes: int = 10) -> nn.Sequential:
    """DeepOBS' ``2c2d`` network for Fashion-MNIST shaped inputs (1x28x28).

    Spatial sizes: 28 -conv5(pad 2)-> 28 -pool-> 14 -conv5(pad 2)-> 14 -pool-> 7,
    hence the flattened feature size is 64 * 7 * 7 = 3136.
    """
    return nn.Sequential(
        nn.Conv2d(1, 32, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=2, stride=2),
        nn.Conv2d(32, 64, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=2, stride=2),
        nn.Flatten(),
        nn.Linear(3136, 1024),
        nn.ReLU(),
        nn.Linear(1024, num_classes),
    )


def make_mlp(num_classes: int = 10) -> nn.Sequential:
    """A small MLP (784 -> 128 -> 64 -> classes) on 1x28x28 inputs."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, num_classes),
    )


#: Model constructors of the available problems.
MODELS: dict[str, Callable[[int], nn.Sequential]] = {
    "3c3d": make_3c3d,
    "2c2d": make_2c2d,
    "mlp": make_mlp,
}

#: Names of the available problems.
PROBLEMS = tuple(MODELS)


def num_params(model: nn.Module) -> int:
    """The number of trainable parameters of a model."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def make_problem(
    name: str,
    N: int,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Sequential, nn.CrossEntropyLoss, Tensor, Tensor]:
    """Create a model, loss function and a random mini-batch.

    Model initialization and data are deterministic given ``seed``.

    Args:
        name: Problem name, one of ``'3c3d'``, ``'2c2d'``, ``'mlp'``.
        N: Mini-batch size.
        seed: Random seed for model initialization and data. Default: ``0``.
        device: Device of model and data. Default: ``'cpu'``.
        dtype: Floating point type of model and inputs. Default: ``torch.float32``.

    Returns:
        Tuple ``(model, loss_func, X, y)`` where ``loss_func`` is
        ``nn.CrossEntropyLoss()`` (mean reduction), ``X`` has shape
        ``(N, *input_shape)`` and ``y`` holds ``N`` integer class labels.

    Raises:
        ValueError: If the problem name is unknown or the parameter count of the
            created model does not match the expected one.
    """
    if name not in MODELS:
        raise ValueError(f"Unknown problem {name!r}. Available: {PROBLEMS}.")
    C = NUM_CLASSES[name]

    torch.manual_seed(seed)
    model = MODELS[name](C).to(device=device, dtype=dtype)
    D = num_params(model)
    if D != EXPECTED_NUM_PARAMS[name]:
        raise ValueError(f"{name}: got {D} parameters, expected {EXPECTED_NUM_PARAMS[name]}.")

    generator = torch.Generator().manual_seed(seed + 1)
    X = torch.randn(N, *INPUT_SHAPES[name], generator=generator, dtype=dtype)
    y = torch.randint(0, C, (N,), generator=generator)
    loss_func = nn.CrossEntropyLoss().to(device)

    return model, loss_func, X.to(device), y.to(device)


#: Parameters of the scikit-learn digits MLP (64-50-50-10, tanh).
DIGITS_NUM_PARAMS = 6310
#: The problems of the Laplace benchmarks: the synthetic ones and the real digits data.
LAPLACE_PROBLEMS = (*PROBLEMS, "digits")
#: Parameters and classes of the Laplace benchmarks' problems.
LAPLACE_NUM_PARAMS = {**EXPECTED_NUM_PARAMS, "digits": DIGITS_NUM_PARAMS}
LAPLACE_NUM_CLASSES = {**NUM_CLASSES, "digits": 10}


def digits_data(n: int, seed: int) -> tuple[Tensor, Tensor]:
    """``n`` shuffled points of scikit-learn's digits (at most 1,797), scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    perm = torch.randperm(len(data.target), generator=torch.Generator().manual_seed(seed))[:n]
    return torch.tensor(data.data, dtype=torch.float32)[perm] / 16.0, \
        torch.as_tensor(data.target)[perm]


def digits_mlp() -> nn.Sequential:
    """The 64-50-50-10 tanh MLP of the digits problem."""
    return nn.Sequential(nn.Linear(64, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(),
                         nn.Linear(50, 10))


def make_digits(N: int, n_train: int, seed: int = 0, device: str | torch.device = "cpu"
                ) -> tuple[nn.Sequential, nn.CrossEntropyLoss, Tensor, Tensor]:
    """Digits and its MLP, trained to a MAP on the first ``n_train`` of ``N`` points.

    100 full-batch Adam steps (``lr=1e-2``), as a Laplace fit would start from them.

    Args:
        N: Points (at most 1,797).
        n_train: Training points among them.
        seed: Seed of the shuffle and the initialisation.
        device: Device of model and data.

    Returns:
        ``(model, loss_func, X, y)`` as :func:`make_problem`.
    """
    X, y = digits_data(N, seed)
    torch.manual_seed(seed)
    model = digits_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(100):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X[:n_train]), y[:n_train]).backward()
        optimizer.step()
    return model.to(device), nn.CrossEntropyLoss(), X.to(device), y.to(device)


def make_laplace_problem(name: str, N: int, n_train: int, seed: int = 0,
                         device: str | torch.device = "cpu"):
    """A problem of :data:`LAPLACE_PROBLEMS`: ``(model, loss_func, X, y)``.

    Args:
        name: Problem name.
        N: Points.
        n_train: Training points among them (``digits`` trains its MAP on them).
        seed: Seed.
        device: Device.
    """
    if name == "digits":
        return make_digits(N, n_train, seed=seed, device=device)
    return make_problem(name, N, seed=seed, device=device)
