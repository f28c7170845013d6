"""The studies' network: the small CNN of a data set, trained under its prior or loaded."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from lowrank_laplace.toolkit import datasets
from lowrank_laplace.toolkit.options import CalibrationConfig

#: The Adam learning rate of both trainings.
LEARNING_RATE = 2e-3


def make_cnn(dataset: str) -> nn.Module:
    """Return a data set's small CNN: BackPACK-supported layers, 10 outputs.

    Args:
        dataset: ``'mnist'`` (28x28) or ``'digits'`` (8x8).
    """
    kernel, padding, flat, hidden = (5, 0, 256, 64) if dataset == "mnist" else (3, 1, 64, 32)
    return nn.Sequential(
        nn.Conv2d(1, 8, kernel, padding=padding), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, kernel, padding=padding), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, 10),
    )


def train_or_load(config: CalibrationConfig, split: datasets.Split, device: torch.device,
                  log: Callable[[str], None]) -> nn.Module:
    """Return the data set's CNN in eval mode, loaded or trained (and saved if asked).

    Training minimises the mean cross-entropy plus ``weight_decay / (2 N) ||theta||^2``
    with Adam: the MAP under the Gaussian prior the Laplace methods assume.

    Args:
        config: The options (dataset, checkpoints, epochs, batch size, weight decay, seed).
        split: The data; its training part is used.
        device: Where the network lives.
        log: Receives a line per epoch (or one for the loaded checkpoint).
    """
    model = make_cnn(config.dataset).to(device)
    if config.checkpoint is not None:  # options.check_checkpoint made sure it fits
        model.load_state_dict(torch.load(config.checkpoint, map_location=device, weights_only=True))
        log(f"loaded the {config.dataset} CNN from {config.checkpoint}")
        return model.eval()
    opt = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    loss_func = nn.CrossEntropyLoss()
    loader = split.loaders(config.batch_size, config.seed)["train"]
    decay = config.weight_decay / (2 * len(split.train[1]))
    for epoch in range(config.epochs):
        start, total, count = time.perf_counter(), 0.0, 0
        for X, y in loader:
            opt.zero_grad()
            loss = loss_func(model(X.to(device)), y.to(device))
            penalty = decay * sum((p**2).sum() for p in model.parameters())
            (loss + penalty).backward()
            opt.step()
            total, count = total + float(loss.detach()) * len(y), count + len(y)
        log(f"training epoch {epoch + 1}/{config.epochs}: loss {total / max(count, 1):.4f} "
            f"({time.perf_counter() - start:.1f} s)")
    if config.save_checkpoint is not None:
        torch.save(model.state_dict(), config.save_checkpoint)
    return model.eval()


def marglik_train(config: CalibrationConfig, split: datasets.Split, device: torch.device,
                  structure: str, log: Callable[[str], None]) -> Any:
    """Return the posterior of a fresh CNN trained by laplace-torch's ``marglik_training``.

    Weights and layerwise prior precisions are learned together (Immer et al. 2021), with
    Adam as in :func:`train_or_load`; the posterior keeps the learned priors.

    Args:
        config: The options (dataset, epochs, batch size, seed).
        split: The data; its training part is used.
        device: Where the network lives.
        structure: laplace-torch's ``hessian_structure``, e.g. ``"lowrank_ggn"``.
        log: Receives one line when training is done.
    """
    from laplace.marglik_training import marglik_training

    import lowrank_laplace  # noqa: F401  (registers lowrank_ggn)

    torch.manual_seed(config.seed)
    model = make_cnn(config.dataset).to(device)
    loader = split.loaders(config.batch_size, config.seed)["train"]
    start = time.perf_counter()
    la, model, margliks, _ = marglik_training(
        model, loader, likelihood="classification", hessian_structure=structure,
        prior_structure="layerwise", n_epochs=config.epochs,
        optimizer_kwargs={"lr": LEARNING_RATE})
    model.eval()
    log(f"marglik training ({structure}, {config.epochs} epoch{'s' * (config.epochs != 1)}): "
        f"{time.perf_counter() - start:.1f} s, log marglik {-margliks[-1]:.1f}")
    return la
