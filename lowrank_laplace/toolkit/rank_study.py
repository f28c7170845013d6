"""The rank study behind ``lowrank-laplace rank-study``: posterior quality against rank.

Fits the calibration study's all-weights ``lowrank_ggn`` posterior at every rank for every
residual model, tunes its prior likewise, and scores the GLM predictive (probit) on the test
images, unrotated and rotated, against MAP, ``kron``, ``diag`` and (digits) the full GGN::

    {"config": {...},
     "references": {name: {"<angle>": {"nll", "ece", "brier", "accuracy"}, ...,
                           "posterior": {...}}},
     "lowrank": [{"rank", "requested_rank", "residual", "kept_fraction",
                  "prior_precision", "quadrature_steps", "fit_s",
                  "scores": {"<angle>": {...}}}, ...]}

``fit_s`` is fit plus prior tuning (only the tuning where a residual model reuses its rank's
shared fit). With ``train="marglik"`` every posterior keeps the layerwise priors that
``marglik_training`` learns with the network (reference ``lowrank_ggn_marglik``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

from lowrank_laplace.toolkit import calibration, plots
from lowrank_laplace.toolkit.options import (
    LAPLACE_METHODS,
    RankStudyConfig,
    check_study,
    fits,
    silent,
)
from lowrank_laplace.toolkit.posteriors import (
    fit_laplace,
    make_predictor,
    posterior_info,
    rotation_scores,
)
from lowrank_laplace.toolkit.training import marglik_train, train_or_load

#: Metrics of the study, in plot order.
METRICS = ("nll", "ece", "brier")
#: Reference posteriors drawn as horizontal lines (``full_all`` where it fits).
REFERENCES = ("map", "full_all", "kron_all", "diag_all")
#: The calibration study's all-weights ``lowrank_ggn`` method of each residual model.
METHOD_OF = {options.get("residual", "spectral"): name
             for name, (subset, structure, options) in LAPLACE_METHODS.items()
             if (subset, structure) == ("all", "lowrank_ggn")}


def run(config: RankStudyConfig, log: Callable[[str], None] = silent) -> dict:
    """Run the study and write ``rank_study.json`` and ``rank_study.png`` to ``config.out``.

    Args:
        config: The options (``angles``: scored besides the unrotated test set).
        log: Receives one short progress line per step.

    Returns:
        The report (see the module docstring for its schema).

    Raises:
        UserError: For an option the study cannot work with, before any work.
    """
    check_study(config)
    config = replace(config, methods=[m for m in REFERENCES if fits(m, config.dataset)],
                     angles=[0.0] * (0 not in config.angles) + list(config.angles))
    device = torch.device(config.device)
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
    keys, fitted = METRICS + ("accuracy",), {}
    for name in config.methods + ["lowrank_ggn_marglik"] * (trained is not None):
        la = trained
        if name not in ("map", "lowrank_ggn_marglik"):
            la = fit_laplace(name, model, config, loaders, fitted, prior=prior)
        report["references"][name] = rotation_scores(
            make_predictor(name, model, la), split.test, config, device, keys)
        report["references"][name]["posterior"] = posterior_info(la)
        log(f"reference {name} done")
    for rank in config.ranks:
        at_rank, shared = replace(config, rank=rank), {}  # residual models share fits
        for residual in config.residuals:
            start = time.perf_counter()
            la = fit_laplace(METHOD_OF[residual], model, at_rank, loaders, shared, prior=prior)
            fit_s = time.perf_counter() - start
            report["lowrank"].append({
                "rank": int(la.H[1].numel()), "requested_rank": rank, "residual": residual,
                "kept_fraction": float(la.kept_fraction),
                "prior_precision": float(torch.as_tensor(la.prior_precision).mean()),
                "quadrature_steps": la.fit_report.quadrature_steps, "fit_s": fit_s,
                "scores": rotation_scores(make_predictor("lowrank", model, la), split.test,
                                          config, device, keys)})
        log(f"rank {rank} done")
    out = Path(config.out)
    (out / "rank_study.json").write_text(json.dumps(report, indent=2))
    plots.close(_plot(report, out / "rank_study.png"))
    return report


def _plot(report: dict, path: Path) -> Figure:
    """NLL, ECE and Brier score against rank, a row per angle, references as lines."""
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
            name = plots.metric_name(metric)
            ax.set(xscale="log", xlabel="Rank", ylabel=name, title=f"{name}, rotation {angle} deg")
    axes[0, -1].legend(fontsize=7)
    fig.suptitle(f"Posterior quality against rank ({report['config']['dataset']}, "
                 f"D = {report['config']['num_params']:,})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return fig


def format_table(report: dict) -> str:
    """Return the report as a table: a row per reference and per (rank, residual).

    Args:
        report: The study's report.
    """
    angles = [f"{a:g}" for a in report["config"]["angles"]]
    head = f"{'posterior':<34}" + "".join(f"{m + '@' + a:>12}" for a in angles for m in METRICS)
    rows = [(name, scores) for name, scores in report["references"].items()] + [
        (f"rank {r['rank']} {r['residual']} (kept {r['kept_fraction']:.2f})", r["scores"])
        for r in report["lowrank"]]
    return "\n".join([head, "-" * len(head)] + [
        f"{label:<34}" + "".join(f"{scores[a][m]:>12.4f}" for a in angles for m in METRICS)
        for label, scores in rows])
