"""Rank study behind ``lowrank-laplace rank-study``: posterior quality against rank.

Trains (or loads) the calibration study's CNN (:mod:`lowrank_laplace.toolkit.calibration`), fits
the all-weights ``lowrank_ggn`` posterior at every rank of ``ranks`` for every residual
model (``spectral``, ``isotropic`` and ``none`` share one fit per rank; ``diagonal``
needs its own), tunes each one's scalar prior like the calibration study, and scores
the GLM predictive (probit) in distribution and on rotated test images: NLL, ECE and
Brier score. MAP, laplace-torch's ``kron`` and ``diag`` and, where it fits, the full
GGN (``--dataset digits``) are the reference lines. The report's schema::

    {"config": {...},
     "references": {name: {"<angle>": {"nll", "ece", "brier", "accuracy"}, ...,
                           "posterior": {...}}},
     "lowrank": [{"rank", "residual", "kept_fraction", "prior_precision",
                  "jacobian_exponent", "fit_s", "scores": {"<angle>": {...}}}, ...]}

``fit_s`` is the fit plus the prior tuning, as in the calibration study (a model that
reuses its rank's shared fit counts its tuning only).

With ``train="marglik"`` the network is the one laplace-torch's ``marglik_training``
learns together with layerwise prior precisions (the calibration study's
``lowrank_ggn_marglik`` row, a ``lowrank_ggn`` posterior of the default rank), and every
posterior keeps those learned priors instead of tuning its own: the study then shows
how fast the low-rank posterior of that network approaches the full GGN's under the
same priors. The trained posterior itself is the reference ``lowrank_ggn_marglik``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List

import torch

from lowrank_laplace.posterior.residual import RESIDUALS
from lowrank_laplace.toolkit import calibration, datasets, metrics, plots
from lowrank_laplace.toolkit.options import (
    LAPLACE_METHODS,
    CalibrationConfig,
    UserError,
    check_training,
    fits,
    silent,
)
from lowrank_laplace.toolkit.posteriors import (
    fit_laplace,
    make_predictor,
    posterior_info,
    predict_batched,
)
from lowrank_laplace.toolkit.training import marglik_train, train_or_load

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Metrics of the study, in plot order.
METRICS = ("nll", "ece", "brier")
#: Reference posteriors drawn as horizontal lines (``full_all`` where it fits).
REFERENCES = ("map", "full_all", "kron_all", "diag_all")


@dataclass
class RankStudyConfig(CalibrationConfig):
    """Options of the rank study: the calibration study's plus the ranks and models.

    Attributes:
        train: ``"map"`` (the calibration CNN, each posterior tunes a scalar prior) or
            ``"marglik"`` (trained with ``marglik_training``; every posterior keeps the
            learned layerwise priors).
        ranks: Ranks of the ``lowrank_ggn`` posteriors.
        residuals: Residual models (see :mod:`lowrank_laplace.posterior.residual`).
        angles: Rotation angles scored besides the unrotated test set (``0`` always).
        out: Output directory for ``rank_study.json`` and ``rank_study.png``.
    """

    train: str = "map"
    ranks: List[int] = field(default_factory=lambda: [10, 30, 100, 300, 1000])
    residuals: List[str] = field(default_factory=lambda: list(RESIDUALS))
    angles: List[float] = field(default_factory=lambda: [0, 60, 90])


def validate(config: RankStudyConfig) -> torch.device:
    """Check the options before any work (see :func:`calibration.validate`).

    Args:
        config: The options.

    Returns:
        The torch device.

    Raises:
        UserError: For an invalid option, a rank below 1, an unknown
            residual model or training, or a checkpoint with ``train="marglik"``.
    """
    check_training(config.train, config)
    if not config.ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 1
                               for r in config.ranks):
        raise UserError(f"ranks must be integers >= 1, got {config.ranks!r}")
    unknown = [r for r in config.residuals if r not in RESIDUALS]
    if unknown or not config.residuals:
        raise UserError(f"unknown residual model {unknown[:1] or config.residuals!r}:"
                        f" choose from {', '.join(RESIDUALS)}")
    config.methods = [m for m in REFERENCES if fits(m, config.dataset)]
    if 0 not in config.angles:
        config.angles = [0.0] + list(config.angles)
    return calibration.validate(config)


def _scores(predict: Callable, split: datasets.Split, config: RankStudyConfig,
            device: torch.device) -> dict:
    """NLL, ECE, Brier score and accuracy per rotation angle."""
    X, y = split.test
    out = {}
    for angle in config.angles:
        probs = predict_batched(predict, datasets.rotate(X, angle), config.batch_size, device)
        full = metrics.classification_metrics(probs, y)
        out[f"{angle:g}"] = {k: full[k] for k in METRICS + ("accuracy",)}
    return out


def _method_of(residual: str) -> str:
    """The calibration study's all-weights ``lowrank_ggn`` method with this residual."""
    for name, (subset, structure, options) in LAPLACE_METHODS.items():
        if (subset, structure) == ("all", "lowrank_ggn") and \
                options.get("residual", "spectral") == residual:
            return name
    raise ValueError(f"no calibration method has residual={residual!r}")


def run(config: RankStudyConfig, log: Callable[[str], None] = silent) -> dict:
    """Run the study and write ``rank_study.json`` and ``rank_study.png`` to ``config.out``.

    Args:
        config: The options.
        log: Receives one short progress line per step.

    Returns:
        The report (see the module docstring for its schema).
    """
    import lowrank_laplace  # noqa: F401  (registers lowrank_ggn)

    device = validate(config)
    split = calibration.load_split(config)
    loaders = split.loaders(config.batch_size, config.seed)
    trained, prior = None, None
    if config.train == "marglik":
        trained = marglik_train(config, split, device, "lowrank_ggn", log)
        model, prior = trained.model, trained.prior_precision.detach().clone()
    else:
        model = train_or_load(config, split, device, log)
    report = {"config": asdict(config) | {"n_train_used": len(split.train[1]),
                                          "num_params": sum(p.numel() for p in model.parameters())},
              "references": {}, "lowrank": []}
    fitted: dict = {}
    for name in config.methods + ["lowrank_ggn_marglik"] * (trained is not None):
        la = trained
        if name not in ("map", "lowrank_ggn_marglik"):
            la = fit_laplace(name, model, config, loaders, fitted, prior=prior)
        report["references"][name] = _scores(make_predictor(name, model, la), split, config,
                                             device)
        report["references"][name]["posterior"] = posterior_info(la)
        log(f"reference {name} done")
    for rank in config.ranks:
        at_rank, shared = replace(config, rank=rank), {}  # residual models share fits
        for residual in config.residuals:
            start = time.perf_counter()
            la = fit_laplace(_method_of(residual), model, at_rank, loaders, shared,
                             prior=prior)
            fit_s = time.perf_counter() - start
            report["lowrank"].append({
                "rank": int(la.H[1].numel()), "requested_rank": rank, "residual": residual,
                "kept_fraction": float(la.kept_fraction),
                "prior_precision": float(torch.as_tensor(la.prior_precision).mean()),
                "jacobian_exponent": la.jacobian_exponent, "fit_s": fit_s,
                "scores": _scores(make_predictor("lowrank", model, la), split, config, device)})
        log(f"rank {rank} done")
    out = Path(config.out)
    (out / "rank_study.json").write_text(json.dumps(report, indent=2))
    plots.close(plot(report, out / "rank_study.png"))
    return report


def plot(report: dict, path: Path) -> Figure:
    """NLL, ECE and Brier score against rank, one row per angle, references as lines.

    Args:
        report: The study's report.
        path: Where to save the PNG.

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt

    angles = [f"{a:g}" for a in report["config"]["angles"]]
    fig, axes = plt.subplots(len(angles), len(METRICS), squeeze=False,
                             figsize=(4.2 * len(METRICS), 3.2 * len(angles)))
    residuals = list(dict.fromkeys(r["residual"] for r in report["lowrank"]))
    styles = {"map": ("r", ":"), "full_all": ("k", "--"), "kron_all": ("k", ":"),
              "diag_all": ("k", "-.")}
    for row, angle in enumerate(angles):
        for col, metric in enumerate(METRICS):
            ax = axes[row, col]
            for residual in residuals:
                rows = [r for r in report["lowrank"] if r["residual"] == residual]
                ax.plot([r["rank"] for r in rows], [r["scores"][angle][metric] for r in rows],
                        "o-", label=f"lowrank_ggn ({residual})")
            for name, scores in report["references"].items():
                color, style = styles.get(name, ("0.5", "-"))
                ax.axhline(scores[angle][metric], color=color, linestyle=style, linewidth=1,
                           label=name)
            ax.set_xscale("log")
            ax.set_xlabel("Rank")
            ax.set_ylabel(plots.metric_name(metric))
            ax.set_title(f"{plots.metric_name(metric)}, rotation {angle} deg")
    axes[0, -1].legend(fontsize=7)
    dataset = report["config"]["dataset"]
    fig.suptitle(f"Posterior quality against rank ({dataset}, "
                 f"D = {report['config']['num_params']:,})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return fig


def format_table(report: dict) -> str:
    """The report as text: a row per (rank, residual) and per reference, per angle.

    Args:
        report: The study's report.

    Returns:
        The table.
    """
    angles = [f"{a:g}" for a in report["config"]["angles"]]
    head = f"{'posterior':<34}" + "".join(f"{m + '@' + a:>12}" for a in angles for m in METRICS)
    lines = [head, "-" * len(head)]
    for name, scores in report["references"].items():
        lines.append(f"{name:<34}" + "".join(f"{scores[a][m]:>12.4f}" for a in angles
                                              for m in METRICS))
    for r in report["lowrank"]:
        label = f"rank {r['rank']} {r['residual']} (kept {r['kept_fraction']:.2f})"
        lines.append(f"{label:<34}" + "".join(f"{r['scores'][a][m]:>12.4f}" for a in angles
                                               for m in METRICS))
    return "\n".join(lines)
