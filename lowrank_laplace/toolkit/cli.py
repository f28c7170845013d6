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
import contextlib
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import torch
from torch import nn

from lowrank_laplace import calibration, plots, rank_study
from lowrank_laplace.calibration import METHODS
from lowrank_laplace.directional import directional_from_factor
from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.residual import RESIDUALS
from lowrank_laplace.spectrum import gram_eigh


class CLIError(Exception):
    """An error the user can fix; reported as one line, exit code 2."""


# Third-party warnings that every run would print and that say nothing about the user's
# job: (category, message regex). Filtered inside the command only (``quiet_warnings``),
# so that library users keep their own warning settings.
HARMLESS_WARNINGS = (
    # laplace-torch warns on every Laplace(...) that the default link approximation is
    # probit; the command always passes link_approx explicitly
    (UserWarning, r"By default `link_approx` is `probit`"),
    # torch warns when BackPACK's / laplace-torch's full backward hooks fire on a
    # network whose inputs do not require gradients (always so here)
    (UserWarning, r"Full backward hook is firing when gradients are computed"),
    # laplace-torch's optional asdl backend scripts a function when it is imported
    (FutureWarning, r"`torch\.jit\.script` is deprecated"),
)


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    """Hide :data:`HARMLESS_WARNINGS` inside the block; other warnings still show.

    Yields:
        Nothing; the previous warning filters are restored on exit.
    """
    with warnings.catch_warnings():
        for category, message in HARMLESS_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def _number(kind: type, minimum: Optional[float] = None, what: str = "") -> Callable[[str], float]:
    """An argparse ``type`` that parses ``kind`` and checks ``value >= minimum``.

    Args:
        kind: ``int`` or ``float``.
        minimum: Smallest accepted value (``None``: any finite value).
        what: Description for the message, e.g. ``'a positive integer'``.

    Returns:
        The parser function; it raises ``argparse.ArgumentTypeError`` (exit code 2).
    """
    noun = what or (f"{'an integer' if kind is int else 'a number'}"
                    + ("" if minimum is None else f" >= {minimum:g}"))

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not math.isfinite(value) or (minimum is not None and value < minimum):
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse


POSITIVE = _number(int, 1, "a positive integer")
NONNEGATIVE = _number(int, 0, "an integer >= 0")


def _angles(text: str) -> List[float]:
    """Parse ``--angles``: comma-separated finite numbers (degrees).

    Args:
        text: The option's value.

    Returns:
        The angles.

    Raises:
        ArgumentTypeError: For anything else (exit code 2).
    """
    try:
        angles = [float(a) for a in text.split(",") if a.strip()]
    except ValueError:
        angles = []
    if not angles or not all(math.isfinite(a) for a in angles):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return angles


def _ranks(text: str) -> List[int]:
    """Parse ``--ranks``: comma-separated integers >= 1."""
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"ranks must be comma-separated integers, got {text!r}") from err
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"ranks must be integers >= 1, got {text!r}")
    return ranks


def _writable(out: Path) -> None:
    """Create ``out`` and check that files can be written there, before any work.

    Args:
        out: The output directory.

    Raises:
        CLIError: If it cannot be created or written to.
    """
    try:
        calibration.make_writable_dir(out)
    except OSError as err:
        raise CLIError(f"cannot write to output directory {str(out)!r}: {err.strerror}") from err


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
    make_model(args.model)  # an unknown architecture fails here, before any work
    X, y = _digits(args.seed)
    if not 8 <= args.batch_size <= len(y):
        raise CLIError(f"--batch-size must lie in [8, {len(y)}]")
    sub = list(range(max(args.batch_size // 8, 2)))
    if args.top_k > len(sub):
        # the sub-sampled Monte-Carlo case has one GGN direction per sub-sampled point
        raise CLIError(f"--top-k must be at most {len(sub)} (the sub-sample of "
                       f"--batch-size {args.batch_size}), got {args.top_k}")
    if args.out is not None:
        _writable(args.out)
    torch.manual_seed(args.seed)
    model = make_model(args.model).to(device)
    _train(model, X, y, args.epochs, device)
    model.eval()
    loss_func = nn.CrossEntropyLoss()
    Xb, yb = X[: args.batch_size].to(device), y[: args.batch_size].to(device)
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
        plots.close(plots.spectrum(evals, title="Mini-batch GGN spectrum",
                                   path=out / "spectrum.png"))
        plots.close(plots.snr_curves(cases, path=out / "snr.png"))
    except OSError as err:
        raise CLIError(f"cannot write to output directory {str(out)!r}: {err.strerror}") from err
    print(f"wrote {out / 'spectrum.json'}, {out / 'spectrum.png'} and {out / 'snr.png'}")


def _study_options(args: argparse.Namespace) -> dict:
    """The config fields ``calibrate`` and ``rank-study`` share (see :func:`_study_arguments`)."""
    names = ("dataset", "epochs", "checkpoint", "save_checkpoint", "n_train", "n_test",
             "batch_size", "mc_samples", "solver", "weight_decay", "prior", "angles", "device",
             "seed")
    return {name: getattr(args, name) for name in names} | {"out": str(args.out)}


def calibrate(args: argparse.Namespace) -> dict:
    """Run the ``calibrate`` sub-command.

    Args:
        args: Parsed command-line arguments.

    Returns:
        The report (also written to ``--out/calibration.json``).

    Raises:
        CLIError: For invalid options.
    """
    config = calibration.CalibrationConfig(
        rank=args.rank, methods=args.methods.split(",") if args.methods else None,
        **_study_options(args))
    try:
        report = calibration.run(config, log=_progress)
    except calibration.UserError as err:
        raise CLIError(str(err)) from err
    print(calibration.format_table(report))
    print(calibration.format_notes(report))
    print()
    print(calibration.format_shift(report))
    print(f"\nwrote {args.out / 'calibration.json'} and reliability diagrams to {args.out}")
    return report


def rank_study_command(args: argparse.Namespace) -> dict:
    """Run the ``rank-study`` sub-command.

    Args:
        args: Parsed command-line arguments.

    Returns:
        The report (also written to ``--out/rank_study.json``).

    Raises:
        CLIError: For invalid options.
    """
    config = rank_study.RankStudyConfig(
        ranks=args.ranks, residuals=[r for r in args.residuals.split(",") if r],
        **_study_options(args))
    try:
        report = rank_study.run(config, log=_progress)
    except calibration.UserError as err:
        raise CLIError(str(err)) from err
    print(rank_study.format_table(report))
    print(f"\nwrote {args.out / 'rank_study.json'} and {args.out / 'rank_study.png'}")
    return report


def _progress(message: str) -> None:
    """Print a progress line to stderr (the report goes to stdout)."""
    print(message, file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``prog: error: ...``), exit code 2."""

    def error(self, message: str):
        """Report a usage error in one line and exit with code 2.

        Args:
            message: What is wrong.
        """
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser; ``--help`` shows every option's default.

    Returns:
        The parser.
    """
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = _Parser(
        prog="lowrank-laplace", formatter_class=fmt,
        description="Low-rank GGN curvature and Laplace posteriors for PyTorch networks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    spec = sub.add_parser(
        "spectrum", formatter_class=fmt, help="print the mini-batch GGN spectrum (4 cases)",
        description="Train a small network on scikit-learn's digits, then print the "
        "mini-batch GGN spectrum for four cases (exact or Monte-Carlo loss Hessian, full or "
        "sub-sampled batch); with --out also write spectrum.json, spectrum.png and snr.png.")
    spec.add_argument("--dataset", default="digits", help="data set (only digits)")
    spec.add_argument("--model", default="cnn", help="architecture: cnn or mlp")
    spec.add_argument("--batch-size", type=POSITIVE, default=128,
                      help="mini-batch size N (8 to 1797); the sub-sample is N/8")
    spec.add_argument("--top-k", type=POSITIVE, default=10,
                      help="leading directions for the kept trace and SNRs (at most N/8)")
    spec.add_argument("--epochs", type=NONNEGATIVE, default=2,
                      help="training epochs before the spectrum")
    spec.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    spec.add_argument("--seed", type=NONNEGATIVE, default=0, help="random seed")
    spec.add_argument("--out", type=Path, default=None,
                      help="directory for spectrum.json, spectrum.png and snr.png "
                      "(if not given, only print)")
    spec.set_defaults(func=spectrum)

    cal = sub.add_parser(
        "calibrate", formatter_class=fmt,
        help="train, fit Laplace posteriors, report calibration",
        description="Train (or load) a small CNN, fit Laplace posteriors, tune their prior "
        "precision and report calibration, rotation shift and OOD detection; writes "
        "calibration.json and PNG plots to --out.")
    _study_arguments(cal)
    cal.add_argument("--rank", type=POSITIVE, default=100,
                     help="rank of the lowrank_ggn posteriors")
    cal.add_argument("--angles", type=_angles, default="0,15,30,60,90,120,180",
                     help="rotation angles in degrees for the shift evaluation")
    cal.add_argument("--methods", default="",
                     help="comma-separated methods; empty: all of " + ",".join(METHODS)
                     + " (full_all on --dataset digits only)")
    cal.set_defaults(func=calibrate)

    study = sub.add_parser(
        "rank-study", formatter_class=fmt,
        help="posterior quality of lowrank_ggn against rank, per residual model",
        description="Train (or load) the calibration CNN, fit the all-weights lowrank_ggn "
        "posterior at every rank for every residual model, and write test NLL, ECE and "
        "Brier score in distribution and under rotation against rank, with MAP, kron, "
        "diag and (digits) the full GGN as references: rank_study.json and "
        "rank_study.png in --out.")
    _study_arguments(study)
    study.add_argument("--ranks", type=_ranks, default="10,30,100,300,1000",
                       help="comma-separated ranks")
    study.add_argument("--residuals", default=",".join(RESIDUALS),
                       help="comma-separated residual models")
    study.add_argument("--angles", type=_angles, default="0,60,90",
                       help="rotation angles in degrees (0 is always scored)")
    study.set_defaults(func=rank_study_command)
    return parser


def _study_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``calibrate`` and ``rank-study`` share (data, network, tuning, output)."""
    parser.add_argument("--dataset", default="mnist", help="mnist or digits")
    parser.add_argument("--epochs", type=NONNEGATIVE, default=30, help="training epochs")
    parser.add_argument("--weight-decay", type=_number(float, 0), default=10.0,
                        help="precision of the Gaussian prior the MAP network is trained under "
                        "(L2 term delta/(2N) ||theta||^2 on the mean loss)")
    parser.add_argument("--checkpoint", default=None, help="load the CNN's state_dict from here")
    parser.add_argument("--save-checkpoint", default=None, help="save the trained CNN here")
    parser.add_argument("--n-train", type=NONNEGATIVE, default=0,
                        help="cap on training points, 0 for all")
    parser.add_argument("--n-test", type=NONNEGATIVE, default=0,
                        help="cap on test points, 0 for all")
    parser.add_argument("--batch-size", type=POSITIVE, default=128,
                        help="batch size for training, fitting and prediction")
    parser.add_argument("--mc-samples", type=NONNEGATIVE, default=0,
                        help="0: exact GGN; M: Monte-Carlo GGN with M samples")
    parser.add_argument("--solver", default="streaming", choices=("streaming", "sketch"),
                        help="lowrank_ggn's fit: streaming merges, or the faster, approximate "
                        "one-pass sketch")
    parser.add_argument("--prior", default="marglik",
                        help="prior precision tuning: marglik or gridsearch")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--seed", type=NONNEGATIVE, default=0, help="random seed")
    parser.add_argument("--out", type=Path, default=Path("results"), help="output directory")


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``lowrank-laplace`` command.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code.
    """
    import matplotlib

    matplotlib.use("Agg")  # plots are written to files, never shown
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2), already reported
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        with quiet_warnings():
            args.func(args)
    except CLIError as err:
        print(f"lowrank-laplace: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
