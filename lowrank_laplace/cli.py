"""The ``lowrank-laplace`` command (also ``python -m lowrank_laplace``).

``lowrank-laplace calibrate`` (the main job) trains a small CNN on real MNIST images
that ship offline, fits ``lowrank_ggn`` Laplace posteriors on all weights and on the
last layer next to laplace-torch's ``kron`` and ``diag``, and reports calibration,
rotation shift and OOD detection (see :mod:`lowrank_laplace.calibration`).

``lowrank-laplace spectrum`` trains a small network on scikit-learn's digits (real
data that ships offline), then prints the mini-batch GGN spectrum for the four
approximation cases of the ViViT paper (exact / Monte-Carlo loss Hessian, full /
sub-sampled batch): leading eigenvalues, the exact trace and the fraction of it
the top-k keep, per-direction gradient and curvature SNRs, and the run time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch
from torch import nn

from lowrank_laplace import calibration, plots
from lowrank_laplace.calibration import METHODS
from lowrank_laplace.directional import directional_from_factor
from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.spectrum import gram_eigh


class CLIError(Exception):
    """An error the user can fix; reported as one line, exit code 2."""


def _digits(seed: int):
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise CLIError("the digits data set needs scikit-learn: pip install scikit-learn") from err
    data = load_digits()
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
        CLIError: For an unknown architecture.
    """
    if arch == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10),
        )
    if arch == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    raise CLIError(f"unknown model {arch!r}: choose 'cnn' or 'mlp'")


def _train(model, X, y, epochs: int, device) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_func = nn.CrossEntropyLoss()
    for _ in range(epochs):
        for idx in torch.randperm(len(y)).split(64):
            opt.zero_grad()
            loss_func(model(X[idx].to(device)), y[idx].to(device)).backward()
            opt.step()


def spectrum(args: argparse.Namespace) -> dict:
    """Run the ``spectrum`` sub-command.

    Args:
        args: Parsed command-line arguments.

    Returns:
        The report (also printed, and written to ``--out`` if given).

    Raises:
        CLIError: For invalid options.
    """
    device = _device(args.device)
    if args.dataset != "digits":
        raise CLIError(f"unknown dataset {args.dataset!r}: the spectrum demo uses 'digits'")
    torch.manual_seed(args.seed)
    X, y = _digits(args.seed)
    if not 8 <= args.batch_size <= len(y):
        raise CLIError(f"--batch-size must lie in [8, {len(y)}]")
    model = make_model(args.model).to(device)
    _train(model, X, y, args.epochs, device)
    model.eval()
    loss_func = nn.CrossEntropyLoss()
    Xb, yb = X[: args.batch_size].to(device), y[: args.batch_size].to(device)
    sub = list(range(max(args.batch_size // 8, 2)))
    cases = {
        "exact, full batch": dict(mc_samples=0, subsampling=None),
        "exact, sub-sampled": dict(mc_samples=0, subsampling=sub),
        "mc (M=1), full batch": dict(mc_samples=1, subsampling=None),
        "mc (M=1), sub-sampled": dict(mc_samples=1, subsampling=sub),
    }
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
    with FactorEngine(model, loss_func) as engine:
        engine.compute(Xb[:8], yb[:8])  # warm-up: the first call installs the hooks
        for name, kw in cases.items():
            start = time.perf_counter()
            factor = engine.compute(Xb, yb, batch_grad=True, **kw)
            dd = directional_from_factor(factor, top_k=args.top_k)
            elapsed = time.perf_counter() - start
            report["cases"][name] = _summary(name, factor, dd, elapsed)
    print("SNRs are medians over the top-k directions (squared mean / variance over samples).")
    if args.out is not None:
        _write(report, args.out)
    return report


def _summary(name: str, factor, dd, elapsed: float) -> dict:
    """Summarise one case (all eigenvalues and the trace come from the same factor)."""
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


def _device(name: str) -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError("--device cuda was asked for, but CUDA is not available")
    try:
        return torch.device(name)
    except RuntimeError as err:
        raise CLIError(f"invalid --device {name!r}") from err


def _write(report: dict, out: Path) -> None:
    """Write ``spectrum.json``, the spectrum plot and the SNR plot."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "spectrum.json").write_text(json.dumps(report, indent=2))
        cases = report["cases"]
        evals = {n: torch.tensor(c["eigenvalues"]) for n, c in cases.items()}
        plots.close(plots.spectrum(evals, path=out / "spectrum.png"))
        fig, axes = plots.plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
        for (key, label), ax in zip([("gamma_snr", "gradient SNR"),
                                     ("lambda_snr", "curvature SNR")], axes):
            for name, c in cases.items():
                ax.semilogy(range(1, len(c[key]) + 1), c[key], "o-", ms=3, label=name)
            ax.set_xlabel("eigenvector k (descending eigenvalue)")
            ax.set_title(label)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "snr.png", dpi=110)
        plots.close(fig)
    except OSError as err:
        raise CLIError(f"cannot write to output directory {str(out)!r}: {err.strerror}") from err
    print(f"wrote {out / 'spectrum.json'}, {out / 'spectrum.png'} and {out / 'snr.png'}")


def calibrate(args: argparse.Namespace) -> dict:
    """Run the ``calibrate`` sub-command.

    Args:
        args: Parsed command-line arguments.

    Returns:
        The report (also written to ``--out/calibration.json``).

    Raises:
        CLIError: For invalid options.
    """
    try:
        angles = [float(a) for a in args.angles.split(",") if a.strip()]
    except ValueError as err:
        raise CLIError(f"--angles must be comma-separated numbers, got {args.angles!r}") from err
    config = calibration.CalibrationConfig(
        dataset=args.dataset, epochs=args.epochs, checkpoint=args.checkpoint,
        save_checkpoint=args.save_checkpoint, n_train=args.n_train, n_test=args.n_test,
        batch_size=args.batch_size, rank=args.rank, mc_samples=args.mc_samples,
        prior=args.prior, angles=angles, methods=args.methods.split(","), device=args.device,
        seed=args.seed, out=str(args.out),
    )
    try:
        report = calibration.run(config)
    except calibration.UserError as err:
        raise CLIError(str(err)) from err
    print(calibration.format_table(report))
    print()
    print(calibration.format_shift(report))
    print(f"\nwrote {args.out / 'calibration.json'} and reliability diagrams to {args.out}")
    return report


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser.

    Returns:
        The parser.
    """
    parser = argparse.ArgumentParser(
        prog="lowrank-laplace",
        description="Low-rank GGN curvature and Laplace posteriors for PyTorch networks.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    spec = sub.add_parser("spectrum", help="print the mini-batch GGN spectrum (4 cases)")
    spec.add_argument("--dataset", default="digits", help="data set (default: digits)")
    spec.add_argument("--model", default="cnn", help="'cnn' (default) or 'mlp'")
    spec.add_argument("--batch-size", type=int, default=128)
    spec.add_argument("--top-k", type=int, default=10)
    spec.add_argument("--epochs", type=int, default=2, help="training epochs before")
    spec.add_argument("--device", default="cpu")
    spec.add_argument("--seed", type=int, default=0)
    spec.add_argument("--out", type=Path, default=None, help="write JSON + PNG here")
    spec.set_defaults(func=spectrum)

    cal = sub.add_parser("calibrate", help="train, fit Laplace posteriors, report calibration")
    cal.add_argument("--dataset", default="mnist", help="mnist (default) or digits")
    cal.add_argument("--epochs", type=int, default=5)
    cal.add_argument("--checkpoint", default=None, help="load the CNN's state_dict from here")
    cal.add_argument("--save-checkpoint", default=None, help="save the trained CNN here")
    cal.add_argument("--n-train", type=int, default=0, help="cap on training points (0: all)")
    cal.add_argument("--n-test", type=int, default=0, help="cap on test points (0: all)")
    cal.add_argument("--batch-size", type=int, default=128)
    cal.add_argument("--rank", type=int, default=100, help="rank of lowrank_ggn posteriors")
    cal.add_argument("--mc-samples", type=int, default=0, help="0: exact GGN; M: MC GGN")
    cal.add_argument("--prior", default="marglik", help="marglik (default) or gridsearch")
    cal.add_argument("--angles", default="0,15,30,60,90,120,180",
                     help="rotation angles for the shift evaluation")
    cal.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
    cal.add_argument("--device", default="cpu")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--out", type=Path, default=Path("results"), help="output directory")
    cal.set_defaults(func=calibrate)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``lowrank-laplace`` command.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code.
    """
    import matplotlib

    matplotlib.use("Agg")  # plots are written to files, never shown
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except CLIError as err:
        print(f"lowrank-laplace: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
