"""The ``lowrank-laplace`` command (also ``python -m lowrank_laplace``).

``lowrank-laplace calibrate`` (the main job) trains a small CNN on real MNIST images
that ship offline, fits ``lowrank_ggn`` Laplace posteriors on all weights and on the
last layer next to laplace-torch's ``kron`` and ``diag``, and reports calibration,
rotation shift and OOD detection (see :mod:`lowrank_laplace.toolkit.calibration`).

``lowrank-laplace rank-study`` scores the all-weights ``lowrank_ggn`` posterior against
rank (see :mod:`lowrank_laplace.toolkit.rank_study`).

``lowrank-laplace spectrum`` trains a small network on scikit-learn's digits and prints
the mini-batch GGN spectrum for the four approximation cases of the ViViT paper (see
:mod:`lowrank_laplace.toolkit.spectrum_demo`).

The arguments are parsed and checked first: the parser and the checks need only
:mod:`~lowrank_laplace.toolkit.options` (torch too for a GPU device or a checkpoint to
load), and each command imports its study (laplace-torch, matplotlib) after that, so
``--help`` and argument errors take a fraction of a second, and every option a run
cannot work with is refused in one line (exit code 2) before any data is loaded or a
network trained.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional

from lowrank_laplace.toolkit.options import (
    CNN_PARAMETERS,
    METHODS,
    NUM_CLASSES,
    PRIOR_TUNINGS,
    RESIDUAL_MODELS,
    SOLVERS,
    TRAINED_METHODS,
    TRAININGS,
    CalibrationConfig,
    UserError,
    check_device,
    check_study,
    check_training,
)


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


def _number(kind: type, minimum: Optional[float] = None, what: str = "",
            maximum: Optional[float] = None) -> Callable[[str], float]:
    """An argparse ``type`` that parses ``kind`` and checks ``minimum <= value <= maximum``.

    Args:
        kind: ``int`` or ``float``.
        minimum: Smallest accepted value (``None``: any finite value).
        what: Description for the message, e.g. ``'a positive integer'``.
        maximum: Largest accepted value (``None``: no bound).

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
        if not math.isfinite(value) or (minimum is not None and value < minimum) or \
                (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse


POSITIVE = _number(int, 1, "a positive integer")
NONNEGATIVE = _number(int, 0, "an integer >= 0")
#: Seeds: what torch, numpy and scikit-learn all take.
SEED = _number(int, 0, "an integer from 0 to 2**32 - 1", maximum=2**32 - 1)


def _device(text: str) -> str:
    """Parse ``--device``: ``cpu``, ``cuda``, ``cuda:N`` or ``mps``.

    Whether the machine has it is checked after parsing (:func:`check_device`).

    Args:
        text: The option's value.

    Returns:
        The device name.

    Raises:
        ArgumentTypeError: For anything else, ``meta`` included (exit code 2).
    """
    kind, _, index = text.partition(":")
    if text in ("cpu", "cuda", "mps") or (kind == "cuda" and index.isdigit()):
        return text
    if kind == "meta":
        raise argparse.ArgumentTypeError(
            "'meta' tensors have shapes but no values, so a network on it can be neither "
            "trained nor evaluated: use cpu, cuda, cuda:N or mps")
    raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or mps, got {text!r}")


def _out_dir(text: str) -> Path:
    """Parse ``--out``: a folder path, not empty (``Path('')`` would silently be ``.``).

    Args:
        text: The option's value.

    Returns:
        The path.

    Raises:
        ArgumentTypeError: For an empty or blank path (exit code 2).
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"an empty path, got {text!r}: use --out . for the current folder")
    return Path(text)


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


def _checked(run: Callable[..., Any], *args, **kwargs) -> Any:
    """Call a command's checks or work; its :class:`UserError` becomes a :class:`CLIError`.

    Args:
        run: The work (a study's or the demo's ``run``) or a check.
        *args: Passed to ``run``.
        **kwargs: Passed to ``run``.

    Returns:
        What ``run`` returns (the report, or nothing).

    Raises:
        CLIError: For a problem the user can fix (one line, exit code 2).
    """
    try:
        return run(*args, **kwargs)
    except UserError as err:
        raise CLIError(str(err)) from err


def _check_spectrum(args: argparse.Namespace) -> None:
    """The ``spectrum`` options checked before its imports (the demo checks the rest)."""
    _checked(check_device, args.device)


def _check_calibrate(args: argparse.Namespace) -> None:
    """Check the ``calibrate`` options before any work (``options.check_study``)."""
    _checked(check_study, _calibration_config(args))


def _check_rank_study(args: argparse.Namespace) -> None:
    """Check the ``rank-study`` options before any work (``options.check_study``)."""
    residuals = _residuals(args)
    unknown = [r for r in residuals if r not in RESIDUAL_MODELS]
    if unknown or not residuals:
        raise CLIError(f"unknown residual model {(unknown or [args.residuals])[0]!r}: choose "
                       f"from {', '.join(RESIDUAL_MODELS)}")
    config = CalibrationConfig(**_study_options(args))
    _checked(check_training, args.train, config)
    _checked(check_study, config, args.ranks)


#: Each sub-command's checks, run before its imports and work.
CHECKS = {"spectrum": _check_spectrum, "calibrate": _check_calibrate,
          "rank-study": _check_rank_study}


def spectrum(args: argparse.Namespace) -> dict:
    """Run the ``spectrum`` sub-command (see :mod:`lowrank_laplace.toolkit.spectrum_demo`).

    Args:
        args: Parsed command-line arguments.

    Returns:
        The report (also printed, and written to ``--out`` if given).

    Raises:
        CLIError: For invalid options.
    """
    from lowrank_laplace.toolkit import spectrum_demo

    return _checked(spectrum_demo.run, args)


def _study_options(args: argparse.Namespace) -> dict:
    """The config fields ``calibrate`` and ``rank-study`` share (see :func:`_study_arguments`)."""
    names = ("dataset", "epochs", "checkpoint", "save_checkpoint", "n_train", "n_test",
             "batch_size", "mc_samples", "solver", "weight_decay", "prior", "angles", "device",
             "seed")
    return {name: getattr(args, name) for name in names} | {"out": str(args.out)}


def _calibration_config(args: argparse.Namespace) -> CalibrationConfig:
    """The ``calibrate`` options as the study's config (``--methods ''``: all that fit)."""
    methods = [m.strip() for m in args.methods.split(",")] if args.methods.strip() else None
    return CalibrationConfig(rank=args.rank, methods=methods, **_study_options(args))


def _residuals(args: argparse.Namespace) -> List[str]:
    """The ``rank-study`` residual models, in order."""
    return [r.strip() for r in args.residuals.split(",") if r.strip()]


def calibrate(args: argparse.Namespace) -> dict:
    """Run the ``calibrate`` sub-command: the calibration study, then its text tables.

    Args:
        args: Parsed command-line arguments.

    Returns:
        The report (also written to ``--out/calibration.json``).

    Raises:
        CLIError: For invalid options.
    """
    from lowrank_laplace.toolkit import calibration

    report = _checked(calibration.run, _calibration_config(args), log=_progress)
    print(calibration.format_table(report))
    print(calibration.format_notes(report))
    print()
    print(calibration.format_shift(report))
    faithful = calibration.format_faithfulness(report)
    if faithful:
        print()
        print(faithful)
    print(f"\nwrote {args.out / 'calibration.json'} and reliability diagrams to {args.out}")
    return report


def rank_study_command(args: argparse.Namespace) -> dict:
    """Run the ``rank-study`` sub-command: posterior quality against rank.

    Args:
        args: Parsed command-line arguments.

    Returns:
        The report (also written to ``--out/rank_study.json``, and plotted in
        ``--out/rank_study.png``).

    Raises:
        CLIError: For invalid options.
    """
    from lowrank_laplace.toolkit import rank_study

    config = rank_study.RankStudyConfig(
        ranks=args.ranks, residuals=_residuals(args), train=args.train, **_study_options(args))
    report = _checked(rank_study.run, config, log=_progress)
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
    spec.add_argument("--device", type=_device, default="cpu",
                      help="torch device: cpu, cuda, cuda:N or mps")
    spec.add_argument("--seed", type=SEED, default=0, help="random seed")
    spec.add_argument("--out", type=_out_dir, default=None,
                      help="directory for spectrum.json, spectrum.png and snr.png "
                      "(if not given, only print)")
    spec.set_defaults(func=spectrum)

    cal = _study_parser(
        sub, "calibrate", "train, fit Laplace posteriors, report calibration",
        "Train (or load) a small CNN, fit Laplace posteriors, tune their prior precision "
        "and report calibration, rotation shift and OOD detection; writes calibration.json "
        "and PNG plots to --out.")
    cal.add_argument("--rank", type=POSITIVE, default=100,
                     help="rank of the lowrank_ggn posteriors (at most the CNN's parameter "
                     "count: " + _parameter_counts() + ")")
    cal.add_argument("--angles", type=_angles, default="0,15,30,60,90,120,180",
                     help="rotation angles in degrees for the shift evaluation")
    cal.add_argument("--methods", default="",
                     help="comma-separated methods; empty: all of "
                     + ",".join(m for m in METHODS if m not in TRAINED_METHODS)
                     + " (full_all on --dataset digits only); opt-in: "
                     + ",".join(TRAINED_METHODS) + " (trains its own network with "
                     "laplace-torch's marglik_training, layerwise priors)")
    cal.set_defaults(func=calibrate)

    study = _study_parser(
        sub, "rank-study", "posterior quality of lowrank_ggn against rank, per residual model",
        "Train (or load) the calibration CNN, fit the all-weights lowrank_ggn posterior at "
        "every rank for every residual model, and write test NLL, ECE and Brier score in "
        "distribution and under rotation against rank, with MAP, kron, diag and (digits) "
        "the full GGN as references: rank_study.json and rank_study.png in --out.")
    study.add_argument("--ranks", type=_ranks, default="10,30,100,300,1000",
                       help="comma-separated ranks (each at most the CNN's parameter count: "
                       + _parameter_counts() + ")")
    study.add_argument("--residuals", default=",".join(RESIDUAL_MODELS),
                       help="comma-separated residual models")
    study.add_argument("--train", default="map", choices=TRAININGS,
                       help="map: the calibration CNN, every posterior tunes a scalar prior; "
                       "marglik: trained with laplace-torch's marglik_training (lowrank_ggn "
                       "at its default rank, layerwise priors), every posterior keeps the "
                       "learned priors")
    study.add_argument("--angles", type=_angles, default="0,60,90",
                       help="rotation angles in degrees (0 is always scored)")
    study.set_defaults(func=rank_study_command)
    return parser


def _parameter_counts() -> str:
    """``'mnist 20522, digits 3658'``: each data set's CNN parameter count, for ``--help``."""
    return ", ".join(f"{name} {count}" for name, count in CNN_PARAMETERS.items())


def _study_parser(sub, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    """Add a study's sub-command with the options all studies share (:func:`_study_arguments`).

    Args:
        sub: The sub-parsers of :func:`build_parser`.
        name: The sub-command.
        summary: Its line in the command's ``--help``.
        description: Its own ``--help`` text.

    Returns:
        The sub-command's parser, for its own options.
    """
    parser = sub.add_parser(name, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                            help=summary, description=description)
    _study_arguments(parser)
    return parser


def _study_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``calibrate`` and ``rank-study`` share (data, network, tuning, output)."""
    parser.add_argument("--dataset", default="mnist", help=" or ".join(CNN_PARAMETERS))
    parser.add_argument("--epochs", type=NONNEGATIVE, default=30, help="training epochs")
    parser.add_argument("--weight-decay", type=_number(float, 0), default=10.0,
                        help="precision of the Gaussian prior the MAP network is trained under "
                        "(L2 term delta/(2N) ||theta||^2 on the mean loss)")
    parser.add_argument("--checkpoint", default=None,
                        help="load the CNN's state_dict from this file instead of training")
    parser.add_argument("--save-checkpoint", default=None,
                        help="save the trained CNN to this file (not with --checkpoint)")
    parser.add_argument("--n-train", type=NONNEGATIVE, default=0,
                        help="cap on training points, 0 for all")
    parser.add_argument("--n-test", type=NONNEGATIVE, default=0,
                        help="cap on test points, 0 for all")
    parser.add_argument("--batch-size", type=POSITIVE, default=128,
                        help="batch size for training, fitting and prediction")
    parser.add_argument("--mc-samples", type=NONNEGATIVE, default=0,
                        help="0: exact GGN; M: Monte-Carlo GGN with M samples (at most the "
                        f"{NUM_CLASSES} classes: the exact GGN costs as much)")
    parser.add_argument("--solver", default="auto", choices=SOLVERS,
                        help="lowrank_ggn's fit: auto (the library's default: a sketch of "
                        "4 x rank columns where cheaper), streaming merges, or the one-pass "
                        "sketch of rank + oversampling columns")
    parser.add_argument("--prior", default="marglik",
                        help="prior precision tuning: " + " or ".join(PRIOR_TUNINGS))
    parser.add_argument("--device", type=_device, default="cpu",
                        help="torch device: cpu, cuda, cuda:N or mps")
    parser.add_argument("--seed", type=SEED, default=0, help="random seed")
    parser.add_argument("--out", type=_out_dir, default=Path("results"),
                        help="output directory (. for the current one)")


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``lowrank-laplace`` command.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code.
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2), already reported
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        with quiet_warnings():
            CHECKS[args.command](args)  # every option, before imports, data and training
            import matplotlib

            matplotlib.use("Agg")  # plots are written to files, never shown
            args.func(args)
    except CLIError as err:
        print(f"lowrank-laplace: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
