"""The calibration study behind ``lowrank-laplace calibrate``.

Trains (or loads) a small CNN on an offline image data set, fits the Laplace posteriors
of :data:`~lowrank_laplace.toolkit.options.METHODS`, tunes their prior precision and
evaluates in-distribution calibration, rotation shift and out-of-distribution detection.
The report's schema::

    {"methods": {name: {"in_distribution": {"accuracy", "nll", "ece", "mce", "brier",
                                              "confidence"},
                        "shift": {"<angle>": {"accuracy", "nll", "ece"}, ...},
                        "predict_s", "ood_auroc", "fit_s", "posterior": {...}}
                        # or {"error": "why it could not run"}
     "config": {...},
     "machine": {"date", "cpu_name", "cpu_count", "platform", "python", "torch",
                 "device", "device_name", "version_<package>"},
     "faithfulness": {...}}  # with both lowrank_ggn_all and full_all (--dataset digits)
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Tuple

import torch
from torch import Tensor

from lowrank_laplace.laplace_torch.report import FitReport
from lowrank_laplace.toolkit import datasets, metrics, plots
from lowrank_laplace.toolkit.options import (
    ABLATIONS,
    LAPLACE_METHODS,
    METHODS,
    TRAINED_METHODS,
    CalibrationConfig,
    UserError,
    check_study,
    default_methods,
    silent,
)
from lowrank_laplace.toolkit.posteriors import (
    fit_laplace,
    make_predictor,
    marglik_prior_full,
    posterior_info,
    predict_batched,
    rotation_scores,
)
from lowrank_laplace.toolkit.training import make_cnn, marglik_train, train_or_load

__all__ = ["LAPLACE_METHODS", "METHODS", "TABLE_COLUMNS", "CalibrationConfig", "UserError",
           "default_methods", "faithfulness", "format_report", "load_split", "make_cnn",
           "marglik_prior_full", "run"]

_DISPLAY_NAMES = {"mnist": "MNIST", "digits": "scikit-learn digits"}


def _machine_record(device: torch.device) -> dict:
    """When and where a report was made: UTC date, CPU, device and package versions."""
    import contextlib
    import datetime
    import importlib.metadata
    import os
    import platform

    cpu_name = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu_name = next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), cpu_name)
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "cpu_name": cpu_name, "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name,
    }
    for package in ("lowrank_laplace", "laplace-torch", "backpack-for-pytorch"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            record[f"version_{package}"] = importlib.metadata.version(package)
    return record


def _evaluate(predict: Callable[[Tensor], Tensor], split: datasets.Split, ood: Tensor,
              config: CalibrationConfig, device: torch.device) -> Tuple[dict, Tensor]:
    """A method's report entry (in distribution, rotated, OOD) and its test probabilities."""
    start = time.perf_counter()
    probs = predict_batched(predict, split.test[0], config.batch_size, device)
    predict_s = time.perf_counter() - start
    entry = {"in_distribution": metrics.classification_metrics(probs, split.test[1]),
             "shift": rotation_scores(predict, split.test, config, device,
                                      ("accuracy", "nll", "ece"), unrotated=probs),
             "predict_s": predict_s,
             "ood_auroc": metrics.ood_auroc(
                 probs, predict_batched(predict, ood, config.batch_size, device))}
    return entry, probs


def load_split(config: CalibrationConfig) -> datasets.Split:
    """Return the study's data split (seeded; ``n_train`` / ``n_test`` caps applied).

    Args:
        config: The options.
    """
    torch.manual_seed(config.seed)
    split = datasets.image_split(config.dataset, seed=config.seed, max_train=config.n_train)
    if config.n_test:
        split.test = (split.test[0][: config.n_test], split.test[1][: config.n_test])
    return split


def run(config: CalibrationConfig, log: Callable[[str], None] = silent) -> dict:
    """Run the study and write ``calibration.json`` plus PNG plots to ``config.out``.

    Args:
        config: The options (``methods=None``: every method that fits the data set).
        log: Receives one short progress line per step (default: nothing).

    Returns:
        The report (see the module docstring for its schema).

    Raises:
        UserError: For an option the study cannot work with, before any work.
    """
    check_study(config)
    if config.methods is None:
        config = replace(config, methods=default_methods(config.dataset))
    device, out = torch.device(config.device), Path(config.out)
    split = load_split(config)
    ood = datasets.ood_images(len(split.test[1]), split.train[0].shape[-1], seed=config.seed)
    loaders = split.loaders(config.batch_size, config.seed)
    log(f"{config.dataset}: {len(split.train[1])} training, {len(split.test[1])} test points")
    model = train_or_load(config, split, device, log)
    report = {"methods": {}, "config": asdict(config) | {
        "n_train_used": len(split.train[1]), "n_test_used": len(split.test[1]),
        "num_params": sum(p.numel() for p in model.parameters()),
        "ood": "grayscale crops of scikit-learn's sample photographs"},
        "machine": _machine_record(device)}
    fitted: dict = {}
    for i, name in enumerate(config.methods, 1):
        step = f"[{i}/{len(config.methods)}] {name}"
        try:
            start = time.perf_counter()
            if name in TRAINED_METHODS:  # a network of its own, trained with it
                la = marglik_train(config, split, device, TRAINED_METHODS[name], log)
            else:
                la = None if name == "map" else fit_laplace(name, model, config, loaders, fitted)
            fit_s = time.perf_counter() - start
            entry, probs = _evaluate(make_predictor(name, model, la), split, ood, config, device)
        except (RuntimeError, MemoryError, ValueError, NotImplementedError) as err:
            report["methods"][name] = {"error": f"{type(err).__name__}: {err}"}
            log(f"{step}: could not run ({type(err).__name__})")
            continue
        report["methods"][name] = entry | {"fit_s": fit_s, "posterior": posterior_info(la)}
        log(f"{step}: fit {fit_s:.1f} s, predict {entry['predict_s']:.1f} s")
        plots.close(plots.reliability_diagram(probs, split.test[1], title=name,
                                              path=out / f"reliability_{name}.png"))
    shifts = {n: m["shift"] for n, m in report["methods"].items() if "shift" in m}
    for metric in ("ece", "accuracy") if shifts else ():
        plots.close(plots.shift_curves(
            shifts, metric, path=out / f"shift_{metric}.png",
            title=f"{plots.metric_name(metric)} under rotation "
            f"({_DISPLAY_NAMES.get(config.dataset, config.dataset)} test set)"))
    if faithful := faithfulness(report):
        report["faithfulness"] = faithful
    (out / "calibration.json").write_text(json.dumps(report, indent=2))
    return report


#: The product's row and the exact posterior it approximates (``--dataset digits``).
DEFAULT_ROW, REFERENCE_ROW = "lowrank_ggn_all", "full_all"


def faithfulness(report: dict) -> dict:
    """Return the default row's NLL and ECE relative to ``full_all``'s (``{}`` without both).

    ``{"in_distribution": {"nll": r, "ece": r}, "shift": {angle: {...}}, "largest": r}``
    with ``r = ours / full_all's - 1``.

    Args:
        report: From :func:`run`.
    """
    ours, full = (report["methods"].get(n, {}) for n in (DEFAULT_ROW, REFERENCE_ROW))
    if "in_distribution" not in ours or "in_distribution" not in full:
        return {}

    def relative(a: dict, b: dict) -> dict:
        return {k: a[k] / b[k] - 1 for k in ("nll", "ece") if k in a and b.get(k)}

    out = {"in_distribution": relative(ours["in_distribution"], full["in_distribution"]),
           "shift": {a: relative(ours["shift"][a], full["shift"][a])
                     for a in ours.get("shift", {}) if a in full.get("shift", {})}}
    values = [*out["in_distribution"].values(),
              *(v for rel in out["shift"].values() for v in rel.values())]
    out["largest"] = max((abs(v) for v in values), default=math.nan)
    return out


def _format_faithfulness(report: dict) -> str:
    """The default row against ``full_all`` and its largest deviation (or nothing)."""
    faithful = report.get("faithfulness") or faithfulness(report)
    if not faithful:
        return ""
    columns = {"in-dist": faithful["in_distribution"]} | {
        f"{a}deg": rel for a, rel in faithful["shift"].items()}
    title = f"{DEFAULT_ROW} / {REFERENCE_ROW} - 1"
    width = max(24, len(title) + 1)
    lines = [title.ljust(width) + "".join(f"{c:>9}" for c in columns)]
    for metric in ("nll", "ece"):
        lines.append(metric.upper().ljust(width) + "".join(
            f"{100 * rel[metric]:>8.1f}%" if metric in rel else f"{'-':>9}"
            for rel in columns.values()))
    lines.append(f"largest deviation from the full GGN's posterior: "
                 f"{100 * faithful['largest']:.1f}%")
    return "\n".join(lines)


#: Columns of the printed table: header, value of a method's entry, format (add metrics here).
TABLE_COLUMNS: Tuple[Tuple[str, Callable[[dict], float], str], ...] = tuple(
    (name, (lambda m, name=name: m["in_distribution"][name]), ".4f")
    for name in ("accuracy", "nll", "ece", "mce", "brier", "confidence")
) + (
    ("OOD AUROC", lambda m: m["ood_auroc"], ".4f"),
    ("prior", lambda m: m.get("posterior", {}).get("prior_precision", math.nan), ".3g"),
    ("kept", lambda m: m.get("posterior", {}).get("kept_fraction", math.nan), ".3f"),
    ("fit [s]", lambda m: m["fit_s"], ".2f"),
    ("pred [s]", lambda m: m["predict_s"], ".2f"),
)


def _format_table(report: dict) -> str:
    """A row per method, a column per :data:`TABLE_COLUMNS` entry."""
    widths = [max(len(header) + 2, 9) for header, _, _ in TABLE_COLUMNS]
    header = f"{'method':<24}" + "".join(f"{h:>{w}}" for (h, _, _), w in zip(TABLE_COLUMNS, widths))
    lines = [header, "-" * len(header)]
    for name, m in report["methods"].items():
        if "error" in m:
            lines.append(f"{name:<24}  could not run: {m['error'][:70]}")
            continue
        lines.append(f"{name:<24}" + "".join(f"{get(m):>{w}{fmt}}" for (_, get, fmt), w
                                             in zip(TABLE_COLUMNS, widths)))
    return "\n".join(lines)


def _format_notes(report: dict) -> str:
    """How to read the table: the low-rank posteriors' rank, kept trace and residual model."""
    lines = []
    if DEFAULT_ROW in report["methods"]:
        lines += [f"{DEFAULT_ROW} is the product: faithful to the exact GGN posterior, which is "
                  "itself cautious in distribution on a small training set.",
                  f"{REFERENCE_ROW} is that exact posterior." if REFERENCE_ROW in report["methods"]
                  else f"--dataset digits shows the exact posterior ({REFERENCE_ROW}) beside it."]
    lines.append("prior: tuned prior precision; kept: share of the exact GGN trace the rank keeps.")
    for name, m in report["methods"].items():
        info = m.get("posterior", {})
        if "fit_report" in info:  # the fit's faithfulness report, as la.fit_report prints it
            lines.append(f"{name}: {FitReport.from_dict(info['fit_report'])}")
        elif "residual" in info:
            lines.append(f"{name}: rank {info['rank']}, kept {info['kept_fraction']:.3f}, "
                         f"residual={info['residual']!r}")
    if any(n.startswith("full") for n in report["methods"]):
        lines.append("full_*: laplace-torch's exact full-GGN posterior, the reference the "
                     "low-rank ones approximate.")
    shared = [n for n in ABLATIONS if n in report["methods"]]
    if shared:
        lines.append(f"{', '.join(shared)} reuse {DEFAULT_ROW}'s fit (another residual model), "
                     "so their fit time is prior tuning only.")
    return "\n".join(lines)


def _format_shift(report: dict) -> str:
    """ECE under rotation per method and angle (or nothing, where no method ran)."""
    methods = {n: m for n, m in report["methods"].items() if "shift" in m}
    if not methods:
        return ""
    angles = list(next(iter(methods.values()))["shift"])
    header = f"{'ECE under rotation':<24}" + "".join(f"{a + 'deg':>9}" for a in angles)
    rows = [header] + [f"{n:<24}" + "".join(f"{m['shift'][a]['ece']:>9.4f}" for a in angles)
                       for n, m in methods.items()]
    return "\n".join(rows)


def format_report(report: dict) -> str:
    """Return the report as the command prints it: methods, notes, ECE under rotation.

    With ``full_all``, the default row's deviations from it follow.

    Args:
        report: From :func:`run` (``"methods"`` is all it needs).
    """
    faithful = _format_faithfulness(report)
    return "\n".join([_format_table(report), _format_notes(report), "", _format_shift(report)]
                     + (["", faithful] if faithful else []))
