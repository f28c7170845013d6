"""The GGN spectrum demo behind ``lowrank-laplace spectrum``.

Trains a small network on scikit-learn's digits (real data that ships offline), then
prints the mini-batch GGN spectrum for the four approximation cases of the ViViT paper
(exact / Monte-Carlo loss Hessian, full / sub-sampled batch): leading eigenvalues, the
exact trace and the fraction of it the top-k keep, per-direction gradient and
curvature SNRs, and the run time. The report's schema::

    {"config": {<the command's options>, "num_params"},
     "cases": {name: {"rank", "eigenvalues", "trace", "top_k_kept_fraction",
                      "gamma_snr", "lambda_snr", "time_s"}, ...}}
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Tuple

import torch
from torch import Tensor, nn

from lowrank_laplace.directional import directional_from_factor
from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.spectrum import gram_eigh
from lowrank_laplace.toolkit import plots
from lowrank_laplace.toolkit.options import UserError, make_writable_dir

if TYPE_CHECKING:
    from lowrank_laplace.directional import DirectionalDerivatives
    from lowrank_laplace.factor import GGNFactor


def load_digits(seed: int) -> Tuple[Tensor, Tensor]:
    """scikit-learn's digits as ``(N, 1, 8, 8)`` images in ``[0, 1]``, shuffled.

    Args:
        seed: Seed of the shuffling permutation.

    Returns:
        The images and their ``long`` labels.

    Raises:
        UserError: If scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise UserError("the digits data set needs scikit-learn: pip install scikit-learn") from err
    data = sklearn_digits()
    X = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    return X[perm], y[perm]


def make_model(arch: str) -> nn.Module:
    """Small networks for 8x8 single-channel images with 10 classes.

    Args:
        arch: ``'cnn'`` or ``'mlp'``.

    Returns:
        The network (an ``nn.Sequential`` of BackPACK-supported layers).

    Raises:
        UserError: For an unknown architecture.
    """
    if arch == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10),
        )
    if arch == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    raise UserError(f"unknown model {arch!r}: choose 'cnn' or 'mlp'")


def train(model: nn.Module, X: Tensor, y: Tensor, epochs: int, device: torch.device) -> None:
    """Train with Adam on the cross-entropy, in shuffled mini-batches of 64.

    Args:
        model: The network, trained in place.
        X: The inputs.
        y: The labels.
        epochs: Passes over the data.
        device: Where the network lives.
    """
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_func = nn.CrossEntropyLoss()
    for _ in range(epochs):
        for idx in torch.randperm(len(y)).split(64):
            opt.zero_grad()
            loss_func(model(X[idx].to(device)), y[idx].to(device)).backward()
            opt.step()


def resolve_device(name: str) -> torch.device:
    """The torch device of ``--device``, checked.

    Args:
        name: E.g. ``'cpu'`` or ``'cuda'``.

    Returns:
        The device.

    Raises:
        UserError: If CUDA is asked for but absent, or the name is no device.
    """
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but CUDA is not available")
    try:
        return torch.device(name)
    except RuntimeError as err:
        raise UserError(f"invalid --device {name!r}") from err


def _check_writable(out: Path) -> None:
    """Create ``out`` and check that files can be written there, before any work."""
    try:
        make_writable_dir(out)
    except OSError as err:
        raise UserError(f"cannot write to output directory {str(out)!r}: {err.strerror}") from err


def run(args: argparse.Namespace) -> dict:
    """Run the demo: check the options, train, print the table, write the report.

    Args:
        args: The ``spectrum`` sub-command's parsed arguments (``dataset``, ``model``,
            ``batch_size``, ``top_k``, ``epochs``, ``device``, ``seed``, ``out``).

    Returns:
        The report (also printed, and written to ``args.out`` if given).

    Raises:
        UserError: For invalid options or an unwritable output directory.
    """
    device = resolve_device(args.device)
    if args.dataset != "digits":
        raise UserError(f"unknown dataset {args.dataset!r}: the spectrum demo uses 'digits'")
    make_model(args.model)  # an unknown architecture fails here, before any work
    X, y = load_digits(args.seed)
    if not 8 <= args.batch_size <= len(y):
        raise UserError(f"--batch-size must lie in [8, {len(y)}]")
    sub = list(range(max(args.batch_size // 8, 2)))
    if args.top_k > len(sub):
        # the sub-sampled Monte-Carlo case has one GGN direction per sub-sampled point
        raise UserError(f"--top-k must be at most {len(sub)} (the sub-sample of "
                        f"--batch-size {args.batch_size}), got {args.top_k}")
    if args.out is not None:
        _check_writable(args.out)
    torch.manual_seed(args.seed)
    model = make_model(args.model).to(device)
    train(model, X, y, args.epochs, device)
    model.eval()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k != "func"}
    config["num_params"] = sum(p.numel() for p in model.parameters())
    report = {"config": config, "cases": {}}
    print(f"GGN spectrum of a {args.model} on digits: D = {report['config']['num_params']:,}, "
          f"N = {args.batch_size}, sub-sample = {len(sub)}, top-k = {args.top_k}")
    header = f"{'case':<24}{'rank':>6}{'lambda_1':>11}{'trace':>11}{'top-k kept':>12}" \
             f"{'grad SNR':>10}{'curv SNR':>10}{'time [s]':>10}"
    print(header)
    print("-" * len(header))
    Xb, yb = X[: args.batch_size].to(device), y[: args.batch_size].to(device)
    report["cases"] = compute_cases(model, Xb, yb, sub, args.top_k)
    print("SNRs are medians over the top-k directions (squared mean / variance over samples).")
    if args.out is not None:
        write_report(report, args.out)
    return report


def compute_cases(model: nn.Module, X: Tensor, y: Tensor, sub: list, top_k: int) -> dict:
    """The four cases' spectra and SNRs on one mini-batch, one printed row each.

    Args:
        model: The trained network (eval mode).
        X: The mini-batch's inputs, on the network's device.
        y: Its labels.
        sub: Indices of the sub-sampled cases' points.
        top_k: Leading directions for the kept trace and the SNRs.

    Returns:
        ``{case name: summary}`` (see :func:`summarize_case`).
    """
    cases = {
        "exact, full batch": dict(mc_samples=0, subsampling=None),
        "exact, sub-sampled": dict(mc_samples=0, subsampling=sub),
        "mc (M=1), full batch": dict(mc_samples=1, subsampling=None),
        "mc (M=1), sub-sampled": dict(mc_samples=1, subsampling=sub),
    }
    out = {}
    with FactorEngine(model, nn.CrossEntropyLoss()) as engine:
        engine.compute(X[:8], y[:8])  # warm-up: the first call installs the hooks
        for name, kw in cases.items():
            start = time.perf_counter()
            factor = engine.compute(X, y, batch_grad=True, **kw)
            dd = directional_from_factor(factor, top_k=top_k)
            elapsed = time.perf_counter() - start
            out[name] = summarize_case(name, factor, dd, elapsed)
    return out


def summarize_case(name: str, factor: GGNFactor, dd: DirectionalDerivatives,
                   elapsed: float) -> dict:
    """Summarise one case and print its row (eigenvalues and trace from the same factor).

    Args:
        name: The case's name.
        factor: Its GGN factor.
        dd: Its directional derivatives (top-k).
        elapsed: Seconds for the factor and the directional derivatives.

    Returns:
        The case's report entry.
    """
    evals = gram_eigh(factor, solver="eigh")[2]
    trace = float(factor.trace())
    entry = {
        "rank": int(evals.numel()),
        "eigenvalues": evals.tolist(),
        "trace": trace,
        "top_k_kept_fraction": float(dd.eigenvalues.sum()) / trace,
        "gamma_snr": dd.gamma_snr.tolist(),
        "lambda_snr": dd.lambda_snr.tolist(),
        "time_s": elapsed,
    }
    print(f"{name:<24}{entry['rank']:>6}{float(evals[0]):>11.4g}{trace:>11.4g}"
          f"{entry['top_k_kept_fraction']:>12.3f}{float(dd.gamma_snr.median()):>10.3g}"
          f"{float(dd.lambda_snr.median()):>10.3g}{elapsed:>10.3f}")
    return entry


def write_report(report: dict, out: Path) -> None:
    """Write ``spectrum.json``, the spectrum plot and the SNR plot to ``out``.

    Args:
        report: From :func:`run`.
        out: The output directory (created if missing).

    Raises:
        UserError: If the files cannot be written.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "spectrum.json").write_text(json.dumps(report, indent=2))
        cases = report["cases"]
        evals = {n: torch.tensor(c["eigenvalues"]) for n, c in cases.items()}
        plots.close(plots.spectrum(evals, title="Mini-batch GGN spectrum",
                                   path=out / "spectrum.png"))
        plots.close(plots.snr_curves(cases, path=out / "snr.png"))
    except OSError as err:
        raise UserError(f"cannot write to output directory {str(out)!r}: {err.strerror}") from err
    print(f"wrote {out / 'spectrum.json'}, {out / 'spectrum.png'} and {out / 'snr.png'}")
