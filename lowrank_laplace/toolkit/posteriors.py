"""The studies' Laplace posteriors (laplace-torch's ``Laplace(...)``): fit, tuned, predicting."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lowrank_laplace.toolkit import datasets, metrics
from lowrank_laplace.toolkit.options import (
    LAPLACE_METHODS,
    SMALL_ONLY,
    CalibrationConfig,
    fits,
)


def fit_laplace(name: str, model: nn.Module, config: CalibrationConfig,
                loaders: Dict[str, DataLoader], fitted: dict,
                prior: Optional[Tensor] = None) -> Any:
    """Return a method's posterior, fitted (or a shared fit's residual switched), tuned.

    Args:
        name: A key of :data:`~lowrank_laplace.toolkit.options.LAPLACE_METHODS`.
        model: The trained network.
        config: The options (rank, Monte-Carlo samples, solver, prior tuning, dataset).
        loaders: Fit on ``loaders["train"]``, grid search on ``loaders["val"]``.
        fitted: Fits so far, updated (every residual model of a subset shares one fit).
        prior: A prior precision to keep instead of tuning (e.g. learned layerwise).

    Raises:
        ValueError: For a dense posterior on a data set too large for it.
    """
    from laplace import Laplace

    import lowrank_laplace  # noqa: F401  (registers lowrank_ggn)

    subset, structure, options = LAPLACE_METHODS[name]
    if not fits(name, config.dataset):
        raise ValueError(f"{name} needs a dense D x D posterior: run it with --dataset "
                         f"{' or '.join(SMALL_ONLY[name])}")
    residual = options.get("residual", "spectral")
    key = (subset, structure)
    if key not in fitted:
        if structure == "lowrank_ggn":  # spectral: it measures its weighting and tracks the
            # GGN diagonal, so every residual model is switched on the same fit
            kwargs = dict(rank=config.rank, mc_samples=config.mc_samples, solver=config.solver,
                          **options) | {"residual": "spectral"}
        else:  # laplace-torch's BackPACK backend: far faster GLM Jacobians for these CNNs
            from laplace.curvature import BackPackGGN

            kwargs = dict(backend=BackPackGGN, **options)
        fitted[key] = Laplace(model, "classification", subset_of_weights=subset,
                              hessian_structure=structure, **kwargs)
        fitted[key].fit(loaders["train"])
    la = fitted[key]
    if structure == "lowrank_ggn":
        la.residual = residual
    _tune_prior(la, config, loaders, prior)
    return la


def _tune_prior(la: Any, config: CalibrationConfig, loaders: Dict[str, DataLoader],
                prior: Optional[Tensor]) -> None:
    """Set ``prior``, or tune a scalar prior afresh (marglik, or grid search on ``val``)."""
    if prior is not None:
        la.prior_precision = prior.clone()
    elif config.prior == "marglik" and type(la).__name__ == "FullLaplace":
        la.prior_precision = marglik_prior_full(la)
    elif config.prior == "marglik":
        la.optimize_prior_precision(method="marglik")
    else:
        la.optimize_prior_precision(method="gridsearch", val_loader=loaders["val"],
                                    pred_type="glm", link_approx="probit", grid_size=20)


def marglik_prior_full(la: Any, n_steps: int = 100, lr: float = 0.1) -> float:
    r"""Return the scalar prior of laplace-torch's marglik tuning of a ``FullLaplace``.

    From one eigendecomposition instead of a ``D x D`` factorisation per Adam step: the
    same Adam steps on :math:`\log\delta` (from ``delta = 1``) minimise, with the
    eigenvalues :math:`\lambda` of ``H``, :math:`\tfrac12 (\sum \log(h\lambda_i + \delta)
    - D \log\delta + \delta \|\theta - \mu_0\|^2)`.

    Args:
        la: A fitted ``FullLaplace`` (scalar prior).
        n_steps: Adam steps (laplace-torch's default).
        lr: Adam learning rate (laplace-torch's default).
    """
    h_factor = 1 / la.sigma_noise.square() / la.temperature  # laplace-torch's own formula
    lam = torch.linalg.eigvalsh(la.H.double()).clamp(min=0) * float(h_factor)
    scatter = float(((la.mean - la.prior_mean).double() ** 2).sum())
    log_delta = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([log_delta], lr=lr)
    for _ in range(n_steps):
        opt.zero_grad()
        delta = log_delta.exp()
        loss = 0.5 * (torch.log(lam + delta).sum() - lam.numel() * log_delta + delta * scatter)
        loss.backward()
        opt.step()
    return float(log_delta.detach().exp())


def posterior_info(la: Optional[object]) -> dict:
    """Return ``{"prior_precision": mean}`` of a fitted posterior, and more keys as follows.

    A layerwise prior adds ``"prior_precisions"``; ``lowrank_ggn`` adds ``"rank"``,
    ``"kept_fraction"``, ``"residual"`` and its ``"fit_report"`` (as a dict).

    Args:
        la: A fitted posterior, or ``None`` (the MAP network: ``{}``).
    """
    if la is None:
        return {}
    prior = torch.as_tensor(la.prior_precision).detach().cpu()
    info: dict = {"prior_precision": float(prior.mean())}
    if prior.numel() > 1:
        info["prior_precisions"] = prior.flatten().tolist()
    if hasattr(la, "kept_fraction"):
        info.update(rank=int(la.H[1].numel()), kept_fraction=float(la.kept_fraction),
                    residual=la.residual)
        if getattr(la, "fit_report", None) is not None:  # a shared fit: this residual
            info["fit_report"] = dict(la.fit_report.as_dict(), residual=la.residual)
    return info


def make_predictor(name: str, model: nn.Module, la: Any) -> Callable[[Tensor], Tensor]:
    """Return inputs -> class probabilities: the GLM predictive with probit, or the MAP's.

    Args:
        name: The method; ``'map'`` is the network's own softmax.
        model: The trained network.
        la: The method's fitted posterior (ignored for ``'map'``).
    """
    if name == "map":
        return lambda X: torch.softmax(model(X), -1)
    return lambda X: la(X, pred_type="glm", link_approx="probit")


def predict_batched(predict: Callable[[Tensor], Tensor], X: Tensor, batch_size: int,
                    device: torch.device) -> Tensor:
    """Return the probabilities of all inputs on the CPU, predicted in batches, no gradients.

    Args:
        predict: Inputs -> class probabilities (see :func:`make_predictor`).
        X: The inputs.
        batch_size: Inputs per call of ``predict``.
        device: Where the network lives.
    """
    with torch.no_grad():
        out = [predict(chunk.to(device)).detach().cpu() for chunk in torch.split(X, batch_size)]
    return torch.cat(out)


def rotation_scores(predict: Callable[[Tensor], Tensor], test: Tuple[Tensor, Tensor],
                    config: CalibrationConfig, device: torch.device,
                    keys: Sequence[str], unrotated: Optional[Tensor] = None) -> dict:
    """Return ``{"<angle>": {key: value}}``: metrics on the test images rotated by each angle.

    Args:
        predict: Inputs -> class probabilities.
        test: The test images and labels.
        config: The options (angles, batch size).
        device: Where the network lives.
        keys: Which :func:`~lowrank_laplace.toolkit.metrics.classification_metrics` to keep.
        unrotated: The test images' probabilities, if already predicted: reused for the
            angles that leave the images as they are (multiples of 360 degrees).
    """
    out = {}
    for angle in config.angles:
        if unrotated is not None and angle % 360 == 0:  # rotate() returns the images
            probs = unrotated
        else:
            probs = predict_batched(predict, datasets.rotate(test[0], angle),
                                    config.batch_size, device)
        scores = metrics.classification_metrics(probs, test[1])
        out[f"{angle:g}"] = {k: scores[k] for k in keys}
    return out
