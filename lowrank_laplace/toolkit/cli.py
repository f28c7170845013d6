"""The ``lowrank-laplace`` command (also ``python -m lowrank_laplace``).

``calibrate``, ``rank-study`` and ``spectrum``, parsed by the tables of
:mod:`~lowrank_laplace.toolkit.options`. Every option is checked before a command imports its
study, loads data or trains; a refused run prints one line, exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence

from lowrank_laplace.toolkit.options import (
    CALIBRATE_OPTIONS,
    RANK_STUDY_OPTIONS,
    SPECTRUM_OPTIONS,
    CalibrationConfig,
    Option,
    RankStudyConfig,
    UserError,
    check_spectrum,
    study_config,
)

#: Third-party warnings every run would print, saying nothing of the user's job: (category,
#: message regex). Hidden inside the command only: library users keep their own settings.
HARMLESS_WARNINGS = (
    # laplace-torch, on every Laplace(...): the command always passes link_approx
    (UserWarning, r"By default `link_approx` is `probit`"),
    # torch, when full backward hooks fire on a network whose inputs need no gradients
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


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # the report goes to stdout


def _spectrum(args: argparse.Namespace) -> None:
    """Run the demo, which prints its table (and writes its files to ``--out``)."""
    from lowrank_laplace.toolkit import spectrum_demo

    spectrum_demo.run(args)


def _calibrate(config: CalibrationConfig) -> None:
    """Run the calibration study, then print its tables."""
    from lowrank_laplace.toolkit import calibration

    report, out = calibration.run(config, log=_progress), Path(config.out)
    print(calibration.format_report(report))
    print(f"\nwrote {out / 'calibration.json'} and reliability diagrams to {out}")


def _rank_study(config: RankStudyConfig) -> None:
    """Run the rank study, then print its table."""
    from lowrank_laplace.toolkit import rank_study

    report, out = rank_study.run(config, log=_progress), Path(config.out)
    print(rank_study.format_table(report))
    print(f"\nwrote {out / 'rank_study.json'} and {out / 'rank_study.png'}")


class Command(NamedTuple):
    """A sub-command: its options, ``--help`` texts, checks and work.

    Attributes:
        options: Its options, in ``--help`` order.
        summary: Its line in the command's ``--help``.
        description: Its own ``--help`` text.
        prepare: Checks the parsed arguments (or raises UserError), returns what ``run`` takes.
        run: The work, imported when it starts.
    """

    options: Sequence[Option]
    summary: str
    description: str
    prepare: Callable[[argparse.Namespace], Any]
    run: Callable[[Any], Any]


COMMANDS = {
    "spectrum": Command(
        SPECTRUM_OPTIONS, "print the mini-batch GGN spectrum (4 cases)",
        "Train a small network on scikit-learn's digits, then print the mini-batch GGN "
        "spectrum for four cases (exact or Monte-Carlo loss Hessian, full or sub-sampled "
        "batch); with --out also write spectrum.json, spectrum.png and snr.png.",
        check_spectrum, _spectrum),
    "calibrate": Command(
        CALIBRATE_OPTIONS, "train, fit Laplace posteriors, report calibration",
        "Train (or load) a small CNN, fit Laplace posteriors, tune their prior precision and "
        "report calibration, rotation shift and OOD detection; writes calibration.json and "
        "PNG plots to --out.", partial(study_config, config_class=CalibrationConfig),
        _calibrate),
    "rank-study": Command(
        RANK_STUDY_OPTIONS, "posterior quality of lowrank_ggn against rank, per residual model",
        "Train (or load) the calibration CNN, fit the all-weights lowrank_ggn posterior at "
        "every rank for every residual model, and write test NLL, ECE and Brier score in "
        "distribution and under rotation against rank, with MAP, kron, diag and (digits) the "
        "full GGN as references: rank_study.json and rank_study.png in --out.",
        partial(study_config, config_class=RankStudyConfig), _rank_study),
}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``prog: error: ...``), exit code 2."""

    def error(self, message: str):
        """Report a usage error in one line and exit with code 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser built from :data:`COMMANDS` (``--help`` shows defaults)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = _Parser(prog="lowrank-laplace", formatter_class=fmt, description="Low-rank GGN "
                     "curvature and Laplace posteriors for PyTorch networks.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, command in COMMANDS.items():
        cmd = sub.add_parser(name, formatter_class=fmt, help=command.summary,
                             description=command.description)
        for option in command.options:
            cmd.add_argument("--" + option.name.replace("_", "-"), type=option.parse,
                             default=option.default, help=option.help,
                             choices=option.choices if option.listed else None)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Return the exit code of the ``lowrank-laplace`` command run on ``argv``.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2), already reported
        return exit_.code if isinstance(exit_.code, int) else 2
    command = COMMANDS[args.command]
    try:
        with quiet_warnings():
            checked = command.prepare(args)  # every option, before imports, data and training
            import matplotlib

            matplotlib.use("Agg")  # plots are written to files, never shown
            command.run(checked)
    except UserError as err:
        print(f"lowrank-laplace: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
