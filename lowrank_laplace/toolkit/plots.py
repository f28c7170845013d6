"""Plots for calibration, curvature spectra and predictive uncertainty (matplotlib).

Every function returns the matplotlib figure and, given ``path``, saves it as PNG.
matplotlib's backend is left alone (figures show inline in notebooks; the command uses Agg).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Union

import matplotlib.pyplot as plt
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from torch import Tensor

PathLike = Union[str, Path, None]


def _finish(fig: Figure, path: PathLike) -> Figure:
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def reliability_diagram(probs: Tensor, targets: Tensor, n_bins: int = 15,
                        title: str = "", path: PathLike = None) -> Figure:
    """Return a reliability diagram: accuracy per confidence bin against the diagonal.

    Bars: each bin's accuracy; line: (mean confidence, accuracy) of the non-empty bins. The
    title carries the ECE (same bins), a lower panel the share of points per bin.

    Args:
        probs: Predictive probabilities, shape ``(N, C)``.
        targets: Class indices, shape ``(N,)``.
        n_bins: Number of equal-width confidence bins.
        title: Title (the ECE is appended).
        path: Where to save the PNG (optional).
    """
    conf, pred = probs.max(1)
    edges = torch.linspace(0, 1, n_bins + 1)
    idx = torch.bucketize(conf, edges[1:-1])
    count, acc, avg_conf = (torch.zeros(n_bins).index_add_(0, idx, v) for v in (
        torch.ones_like(conf), (pred == targets).float(), conf))
    nonempty = count > 0
    bin_acc = (acc / count.clamp_min(1))[nonempty]
    bin_conf = (avg_conf / count.clamp_min(1))[nonempty]
    ece = float((count[nonempty] / count.sum() * (bin_acc - bin_conf).abs()).sum())
    fig, (ax, hist) = plt.subplots(2, 1, figsize=(4.5, 5.5), sharex=True,
                                   gridspec_kw={"height_ratios": [3, 1]})
    # matplotlib gets numpy arrays (tensors trigger NumPy's __array_wrap__ deprecation)
    centers, count, nonempty, bin_acc, bin_conf = (t.numpy() for t in (
        (edges[:-1] + edges[1:]) / 2, count, nonempty, bin_acc, bin_conf))
    ax.bar(centers[nonempty], bin_acc, width=1 / n_bins, edgecolor="k", alpha=0.7,
           label="Accuracy per bin")
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="Perfect calibration")
    ax.plot(bin_conf, bin_acc, "o-", color="C3", ms=3, label="Accuracy vs. mean confidence")
    ax.set(xlim=(0, 1), ylim=(0, 1), ylabel="Accuracy")
    fig.suptitle(f"{title + ': ' if title else ''}ECE = {ece:.4f}")
    # the legend sits between the title and the axes, never over the bars
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=1, fontsize=7, frameon=False)
    hist.bar(centers, count / count.sum(), width=1 / n_bins, edgecolor="k", alpha=0.7)
    hist.set(xlabel="Confidence", ylabel="Fraction of points")
    return _finish(fig, path)


def confidence_histograms(confidences: Dict[str, Tensor], title: str = "",
                          path: PathLike = None) -> Figure:
    """Return overlaid histograms of top-1 confidence (e.g. in- vs out-of-distribution).

    Args:
        confidences: Named 1-D tensors of confidences.
        title: Axes title.
        path: Where to save the PNG (optional).
    """
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, conf in confidences.items():
        ax.hist(conf.cpu().numpy(), bins=20, range=(0, 1), alpha=0.5, label=name, density=True)
    ax.set(xlabel="Confidence", ylabel="Density", title=title)
    ax.legend()
    return _finish(fig, path)


def spectrum(eigenvalues: Dict[str, Tensor], title: str = "GGN spectrum",
             path: PathLike = None) -> Figure:
    """Return a figure of eigenvalues by index (log scale) and their histogram, per case.

    Args:
        eigenvalues: Named descending eigenvalue tensors.
        title: Figure title.
        path: Where to save the PNG (optional).
    """
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name, evals in eigenvalues.items():
        evals = evals.detach().cpu()
        left.semilogy(range(1, len(evals) + 1), evals.numpy(), label=name)
        right.hist(torch.log10(evals.clamp_min(1e-30)).numpy(), bins=30, alpha=0.5, label=name)
    left.set(xlabel="Index k (descending)", ylabel="Eigenvalue")
    right.set(xlabel="log10 eigenvalue", ylabel="Count")
    left.legend(fontsize=8)
    fig.suptitle(title)
    return _finish(fig, path)


def regression_band(x_train: Tensor, y_train: Tensor, x_grid: Tensor,
                    predictions: Dict[str, Sequence[Tensor]], title: str = "",
                    path: PathLike = None) -> Figure:
    """Return a figure of 1-D regression data, predictive means and two-standard-deviation bands.

    Args:
        x_train: Training inputs, shape ``(N, 1)``.
        y_train: Training targets, shape ``(N, 1)``.
        x_grid: Evaluation inputs, shape ``(G, 1)``.
        predictions: Named ``(mean, std)`` pairs on the grid.
        title: Axes title.
        path: Where to save the PNG (optional).
    """
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = x_grid.flatten().cpu().numpy()
    ax.scatter(x_train.flatten().cpu(), y_train.flatten().cpu(), s=8, c="k", label="data")
    for i, (name, (mean, std)) in enumerate(predictions.items()):
        m, s = mean.flatten().cpu().numpy(), std.flatten().cpu().numpy()
        ax.plot(x, m, color=f"C{i}", label=name)
        ax.fill_between(x, m - 2 * s, m + 2 * s, color=f"C{i}", alpha=0.2)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _finish(fig, path)


def uncertainty_map(predict: Callable[[Tensor], Tensor], X: Tensor, y: Tensor,
                    title: str = "", resolution: int = 80, ax: Optional[Axes] = None,
                    path: PathLike = None) -> Figure:
    """Return a map of the confidence of ``predict`` on a 2-D grid, with the data.

    Args:
        predict: Maps inputs ``(G, 2)`` to probabilities ``(G, C)``.
        X: Data inputs, shape ``(N, 2)``.
        y: Labels, shape ``(N,)``.
        title: Axes title.
        resolution: Grid points per axis.
        ax: Existing axes to draw into (optional).
        path: Where to save the PNG (optional).
    """
    lo, hi = X.min(0).values - 1.0, X.max(0).values + 1.0
    gx, gy = torch.meshgrid(torch.linspace(lo[0], hi[0], resolution),
                            torch.linspace(lo[1], hi[1], resolution), indexing="xy")
    grid = torch.stack([gx.flatten(), gy.flatten()], 1)
    conf = predict(grid).max(1).values.reshape(resolution, resolution).detach().cpu()
    if ax is None:
        _, ax = plt.subplots(figsize=(4, 3.5))
    contour = ax.contourf(gx.numpy(), gy.numpy(), conf.numpy(), levels=20, cmap="viridis",
                          vmin=0.5, vmax=1.0)
    ax.scatter(X[:, 0].cpu(), X[:, 1].cpu(), c=y.cpu(), cmap="coolwarm", s=8, edgecolors="k",
               linewidths=0.3)
    ax.set_title(title)
    ax.figure.colorbar(contour, ax=ax, label="confidence")
    return _finish(ax.figure, path)


_METRIC_NAMES = {"ece": "ECE", "nll": "NLL", "mce": "MCE", "brier": "Brier score"}


def metric_name(metric: str) -> str:
    """Return the display name of a metric key, e.g. ``'ece'`` -> ``'ECE'``.

    Args:
        metric: A key of :func:`lowrank_laplace.toolkit.metrics.classification_metrics`.
    """
    return _METRIC_NAMES.get(metric, metric.capitalize())


def shift_curves(results: Dict[str, Dict[str, Dict[str, float]]], metric: str = "ece",
                 title: Optional[str] = None, path: PathLike = None) -> Figure:
    """Return a figure of a metric against the rotation angle, one line per method.

    Args:
        results: ``{method: {angle: {metric: value}}}`` (angles as strings).
        metric: Which metric to plot.
        title: Axes title (default: ``'<metric> under rotation'``).
        path: Where to save the PNG (optional).
    """
    name = metric_name(metric)
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for method, by_angle in results.items():
        angles = sorted(by_angle, key=float)
        ax.plot([float(a) for a in angles], [by_angle[a][metric] for a in angles], "o-",
                ms=3, label=method)
    ax.set(xlabel="Rotation angle [deg]", ylabel=name,
           title=f"{name} under rotation" if title is None else title)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
    return _finish(fig, path)


def snr_curves(cases: Dict[str, Dict[str, Sequence[float]]], path: PathLike = None) -> Figure:
    """Return a figure of gradient and curvature SNRs per eigen-direction, one line per case.

    Args:
        cases: ``{case: {"gamma_snr": [...], "lambda_snr": [...]}}`` (descending
            eigenvalue order, as in the ``spectrum`` command's report).
        path: Where to save the PNG (optional).
    """
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for (key, label), ax in zip([("gamma_snr", "Gradient SNR"),
                                 ("lambda_snr", "Curvature SNR")], axes):
        for name, case in cases.items():
            ax.semilogy(range(1, len(case[key]) + 1), case[key], "o-", ms=3, label=name)
        ax.set(xlabel="Eigenvector k (descending eigenvalue)", title=label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylabel("SNR (squared mean / variance)")
    axes[0].legend(fontsize=7)
    return _finish(fig, path)


def close(fig: Optional[object]) -> None:
    """Close a figure, freeing its memory.

    Args:
        fig: The figure.
    """
    plt.close(fig)
