"""The commands' options, the studies' methods, and the checks run before any work.

Every option is a row of a table (:class:`Option`) that builds the command's parser and the
studies' configs, which the same parsers check. Torch is imported only to check a GPU or a
checkpoint.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields, make_dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

#: Laplace methods: name -> ``subset_of_weights``, ``hessian_structure`` and further
#: ``Laplace(...)`` options (``lowrank_ggn`` also gets ``rank``, ``mc_samples``, ``solver``).
LAPLACE_METHODS = {
    "lowrank_ggn_all": ("all", "lowrank_ggn", {}),
    "lowrank_ggn_all_isotropic": ("all", "lowrank_ggn", {"residual": "isotropic"}),
    "lowrank_ggn_all_diag": ("all", "lowrank_ggn", {"residual": "diagonal"}),
    "lowrank_ggn_all_none": ("all", "lowrank_ggn", {"residual": "none"}),
    "lowrank_ggn_last_layer": ("last_layer", "lowrank_ggn", {}),
    "full_last_layer": ("last_layer", "full", {}),
    "full_all": ("all", "full", {}),
    "kron_all": ("all", "kron", {}),
    "diag_all": ("all", "diag", {}),
}
#: Methods whose dense D x D posterior fits only the small network of these data sets.
SMALL_ONLY = {"full_all": ("digits",)}
#: The names of :data:`lowrank_laplace.posterior.residual.RESIDUALS`.
RESIDUAL_MODELS = ("spectral", "isotropic", "diagonal", "none")
#: Opt-in methods: the all-weights posterior with the other residual models (the rank study
#: compares them at every rank), switched on its fit.
ABLATIONS = ("lowrank_ggn_all_isotropic", "lowrank_ggn_all_diag", "lowrank_ggn_all_none")
#: Opt-in methods -> the ``hessian_structure`` of the network they train (marglik_training).
TRAINED_METHODS = {"lowrank_ggn_marglik": "lowrank_ggn"}
#: Every method, in report order (``map``: the trained network alone).
METHODS = ("map",) + tuple(LAPLACE_METHODS) + tuple(TRAINED_METHODS)
#: Each CNN's parameter count (its largest rank), the classes and ``digits``' size, repeated
#: (as are the residual names) to check options without torch or data; a test compares them.
CNN_PARAMETERS = {"mnist": 20522, "digits": 3658}
NUM_CLASSES = 10
DIGITS_SIZE = 1797
SOLVERS = ("auto", "streaming", "sketch")
PRIOR_TUNINGS = ("marglik", "gridsearch")
#: How the rank study's network is trained: a MAP, or laplace-torch's ``marglik_training``.
TRAININGS = ("map", "marglik")


class UserError(Exception):
    """A problem the user can fix (bad option, missing file); reported in one line."""


def silent(message: str) -> None:
    """The default progress log of the studies: prints nothing.

    Args:
        message: The progress line, ignored.
    """


def fits(method: str, dataset: str) -> bool:
    """Return whether a method's posterior fits the data set's network (:data:`SMALL_ONLY`).

    Args:
        method: A name of :data:`METHODS`.
        dataset: ``'mnist'`` or ``'digits'``.
    """
    return dataset in SMALL_ONLY.get(method, (dataset,))


def default_methods(dataset: str) -> List[str]:
    """Return the methods that fit the data set's network, in report order, opt-in ones left out.

    Args:
        dataset: ``'mnist'`` or ``'digits'``.
    """
    return [m for m in METHODS if fits(m, dataset) and m not in (*TRAINED_METHODS, *ABLATIONS)]


# ---- reading the command line's text (argparse types: errors name the flag, exit code 2)

def _number(kind: type, minimum: float, noun: str, maximum: float = math.inf) -> Callable:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not (minimum <= value <= maximum and (kind is int or math.isfinite(value))):
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}")
        return value
    return parse


POSITIVE = _number(int, 1, "a positive integer")
NONNEGATIVE = _number(int, 0, "an integer >= 0")
#: Seeds: what torch, numpy and scikit-learn all take.
SEED = _number(int, 0, "an integer from 0 to 2**32 - 1", 2**32 - 1)
NONNEGATIVE_NUMBER = _number(float, 0, "a number >= 0")


def _device(text: str) -> str:
    kind, _, index = text.partition(":")
    if text in ("cpu", "cuda", "mps") or (kind == "cuda" and index.isdigit()):
        return text
    if kind == "meta":
        raise argparse.ArgumentTypeError(
            "'meta' tensors have shapes but no values, so a network on it can be neither "
            "trained nor evaluated: use cpu, cuda, cuda:N or mps")
    raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or mps, got {text!r}")


def _out_dir(text: str) -> Path:
    if not text.strip():  # Path('') would silently be '.'
        raise argparse.ArgumentTypeError(
            f"an empty path, got {text!r}: use --out . for the current folder")
    return Path(text)


def _angles(text: str) -> List[float]:
    try:
        angles = [float(a) for a in text.split(",") if a.strip()]
    except ValueError:
        angles = []
    if not angles or not all(math.isfinite(a) for a in angles):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return angles


def _ranks(text: str) -> List[int]:
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"ranks must be comma-separated integers, got {text!r}") from err
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"ranks must be integers >= 1, got {text!r}")
    return ranks


# ---- what a parsed value must be to work (UserError: one line, exit code 2)

def _methods(text: str) -> Optional[List[str]]:
    methods = [m.strip() for m in text.split(",")] if text.strip() else None
    for i, method in enumerate(methods or ()):
        if method not in METHODS:
            raise UserError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
        if method in methods[:i]:
            raise UserError(f"method {method!r} is listed twice")
    return methods


def _residuals(text: str) -> List[str]:
    residuals = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in residuals if r not in RESIDUAL_MODELS]
    if unknown or not residuals:
        raise UserError(f"unknown residual model {(unknown or [text])[0]!r}: choose from "
                        f"{', '.join(RESIDUAL_MODELS)}")
    return residuals


def _mc_samples(samples: int) -> int:
    if samples > NUM_CLASSES:
        raise UserError(
            f"mc_samples {samples} is more than the {NUM_CLASSES} classes: the exact GGN "
            f"(mc_samples 0) needs {NUM_CLASSES} columns per point, so more samples cost "
            "more than it and are noisier")
    return samples


@dataclass(frozen=True)
class Option:
    """One option of a command: the parser's argument and the config's field.

    Attributes:
        name: The config's field; the flag is ``--`` and the name with ``-`` for ``_``.
        default: The default as the command line spells it (``--help`` shows it).
        help: The option's line in ``--help``.
        parse: Reads and checks the text (an argparse ``type``); ``None`` keeps the text.
        choices: The values accepted (empty: any).
        unknown: The error for a value outside ``choices`` (``{!r}``: the value).
        listed: Whether argparse lists the ``choices`` in ``--help`` and refuses others.
        convert: Turns the parsed value into the config's, or raises :class:`UserError`.
    """

    name: str
    default: Any
    help: str
    parse: Optional[Callable[[str], Any]] = None
    choices: Tuple[str, ...] = ()
    unknown: str = ""
    listed: bool = False
    convert: Optional[Callable[[Any], Any]] = None


def _to_config(option: Option, value: Any) -> Any:
    """The config's value of a parsed one (UserError for one no run can use)."""
    if option.choices and value not in option.choices:
        raise UserError(option.unknown.format(value))
    return value if option.convert is None else option.convert(value)


def _default(option: Option) -> Any:
    """The config's default: the option's default read like the command line's text."""
    text = isinstance(option.default, str) and option.parse is not None
    return _to_config(option, option.parse(option.default) if text else option.default)


def _check(option: Option, value: Any) -> None:
    """Check a config's value by reading it as the command line would spell it."""
    if value is None and _default(option) is None:
        return
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    try:
        read = _to_config(option, text if option.parse is None else option.parse(text))
    except argparse.ArgumentTypeError as err:
        message = str(err)
        raise UserError(message if message.startswith(option.name)
                        else f"{option.name}: {message}") from None
    if read != (list(value) if isinstance(value, tuple) else value):
        raise UserError(f"invalid {option.name} {value!r}")


_COUNTS = ", ".join(f"{name} {count}" for name, count in CNN_PARAMETERS.items())
DEVICE = Option("device", "cpu", "torch device: cpu, cuda, cuda:N or mps", _device)
#: The options ``calibrate`` and ``rank-study`` share, in ``--help`` order.
STUDY_OPTIONS = (
    Option("dataset", "mnist", " or ".join(CNN_PARAMETERS), choices=tuple(CNN_PARAMETERS),
           unknown=f"unknown dataset {{!r}}: choose one of {', '.join(CNN_PARAMETERS)}"),
    Option("epochs", 30, "training epochs", NONNEGATIVE),
    Option("weight_decay", 10.0, "precision of the Gaussian prior the MAP network is trained "
           "under (L2 term delta/(2N) ||theta||^2 on the mean loss)", NONNEGATIVE_NUMBER),
    Option("checkpoint", None, "load the CNN's state_dict from this file instead of training"),
    Option("save_checkpoint", None, "save the trained CNN to this file (not with --checkpoint)"),
    Option("n_train", 0, "cap on training points, 0 for all", NONNEGATIVE),
    Option("n_test", 0, "cap on test points, 0 for all", NONNEGATIVE),
    Option("batch_size", 128, "batch size for training, fitting and prediction", POSITIVE),
    Option("mc_samples", 0, "0: exact GGN; M: Monte-Carlo GGN with M samples (at most the "
           f"{NUM_CLASSES} classes: the exact GGN costs as much)", NONNEGATIVE,
           convert=_mc_samples),
    Option("solver", "auto", "lowrank_ggn's fit: auto (the library's default: a sketch of "
           "4 x rank columns where cheaper), streaming merges, or the one-pass sketch of "
           "rank + oversampling columns", choices=SOLVERS, listed=True,
           unknown=f"unknown solver {{!r}}: use {' or '.join(SOLVERS)}"),
    Option("prior", "marglik", "prior precision tuning: " + " or ".join(PRIOR_TUNINGS),
           choices=PRIOR_TUNINGS,
           unknown=f"unknown prior tuning {{!r}}: use {' or '.join(PRIOR_TUNINGS)}"),
    DEVICE,
    Option("seed", 0, "random seed", SEED),
    Option("out", "results", "output directory (. for the current one)", _out_dir,
           convert=str),
)
#: ``calibrate``'s options, in ``--help`` order (also :data:`CalibrationConfig`'s fields).
CALIBRATE_OPTIONS = STUDY_OPTIONS + (
    Option("rank", 100, "rank of the lowrank_ggn posteriors (at most the CNN's parameter "
           f"count: {_COUNTS})", POSITIVE),
    Option("angles", "0,15,30,60,90,120,180",
           "rotation angles in degrees for the shift evaluation", _angles),
    Option("methods", "", "comma-separated methods; empty: all of "
           + ",".join(m for m in METHODS if m not in (*TRAINED_METHODS, *ABLATIONS))
           + " (full_all on --dataset digits only); opt-in: " + ",".join(ABLATIONS)
           + " (the other residual models, on lowrank_ggn_all's fit), "
           + ",".join(TRAINED_METHODS) + " (trains its own network with laplace-torch's "
           "marglik_training, layerwise priors)", convert=_methods),
)
#: ``rank-study``'s options, in ``--help`` order.
RANK_STUDY_OPTIONS = STUDY_OPTIONS + (
    Option("ranks", "10,30,100,300,1000", "comma-separated ranks (each at most the CNN's "
           f"parameter count: {_COUNTS})", _ranks),
    Option("residuals", ",".join(RESIDUAL_MODELS), "comma-separated residual models",
           convert=_residuals),
    Option("train", "map", "map: the calibration CNN, every posterior tunes a scalar prior; "
           "marglik: trained with laplace-torch's marglik_training (lowrank_ggn at its "
           "default rank, layerwise priors), every posterior keeps the learned priors",
           choices=TRAININGS, listed=True,
           unknown=f"unknown training {{!r}}: choose from {', '.join(TRAININGS)}"),
    Option("angles", "0,60,90", "rotation angles in degrees (0 is always scored)", _angles),
)
#: ``spectrum``'s options, in ``--help`` order.
SPECTRUM_OPTIONS = (
    Option("dataset", "digits", "data set (only digits)", choices=("digits",),
           unknown="unknown dataset {!r}: the spectrum demo uses 'digits'"),
    Option("model", "cnn", "architecture: cnn or mlp", choices=("cnn", "mlp"),
           unknown="unknown model {!r}: choose 'cnn' or 'mlp'"),
    Option("batch_size", 128, f"mini-batch size N (8 to {DIGITS_SIZE}); the sub-sample is N/8",
           POSITIVE),
    Option("top_k", 10, "leading directions for the kept trace and SNRs (at most N/8)",
           POSITIVE),
    Option("epochs", 2, "training epochs before the spectrum", NONNEGATIVE),
    DEVICE,
    Option("seed", 0, "random seed", SEED),
    Option("out", None, "directory for spectrum.json, spectrum.png and snr.png (if not "
           "given, only print)", _out_dir),
)


def _config_class(name: str, options: Sequence[Option], names: Sequence[str], summary: str,
                  bases: tuple = ()) -> type:
    """A dataclass with a field per name, its default and meaning from ``options``."""
    table = {o.name: o for o in options}
    doc = summary + "\n\nAttributes:\n" + "".join(f"    {n}: {table[n].help}\n" for n in names)
    cls = make_dataclass(name, [(n, Any, field(default_factory=partial(_default, table[n])))
                                for n in names], bases=bases,
                         namespace={"__doc__": doc, "__module__": __name__})
    cls.OPTIONS = tuple(table[f.name] for f in fields(cls))
    return cls


#: Options of the calibration study: a field per option of :data:`CALIBRATE_OPTIONS`.
CalibrationConfig = _config_class(
    "CalibrationConfig", CALIBRATE_OPTIONS,
    ("dataset", "epochs", "checkpoint", "save_checkpoint", "n_train", "n_test", "batch_size",
     "rank", "mc_samples", "solver", "weight_decay", "prior", "angles", "methods", "device",
     "seed", "out"),
    "Options of the calibration study (the command's flags); ``methods=None``: all that fit.")
#: Options of the rank study: :data:`CalibrationConfig`'s and :data:`RANK_STUDY_OPTIONS`.
RankStudyConfig = _config_class(
    "RankStudyConfig", CALIBRATE_OPTIONS + RANK_STUDY_OPTIONS,
    ("angles", "train", "ranks", "residuals"),
    "Options of the rank study: the calibration study's plus the ranks and residual models.",
    bases=(CalibrationConfig,))


def study_config(args: argparse.Namespace, config_class: type) -> Any:
    """Return a study's config from its command's arguments, checked (:func:`check_study`).

    Args:
        args: The parsed arguments (options the command lacks keep their defaults).
        config_class: :data:`CalibrationConfig` or :data:`RankStudyConfig`.

    Raises:
        UserError: For any option the run could not work with.
    """
    config = config_class(**{o.name: _to_config(o, getattr(args, o.name))
                             for o in config_class.OPTIONS if hasattr(args, o.name)})
    check_study(config)
    return config


def check_study(config: Any) -> None:
    """Every check of a study's options, then create the output directory (last).

    Args:
        config: A :data:`CalibrationConfig` or :data:`RankStudyConfig`.

    Raises:
        UserError: For any option the run could not work with.
    """
    for option in config.OPTIONS:
        _check(option, getattr(config, option.name))
    dataset, count = config.dataset, CNN_PARAMETERS[config.dataset]
    for method in config.methods or ():
        if not fits(method, dataset):
            raise UserError(
                f"method {method} cannot run on --dataset {dataset}: its dense D x D posterior "
                f"is too large for the {dataset} CNN (D = {count:,}); it runs on --dataset "
                f"{' or '.join(SMALL_ONLY[method])}")
    for rank in [config.rank, *getattr(config, "ranks", ())]:
        if rank > count:
            raise UserError(f"rank {rank} is more than the {count:,} parameters of the "
                            f"{dataset} CNN, the largest rank its posterior can have")
    if getattr(config, "train", "map") == "marglik" and (config.checkpoint
                                                          or config.save_checkpoint):
        raise UserError("--train marglik trains its own network: drop --checkpoint and "
                        "--save-checkpoint")
    _check_checkpoint_paths(config.checkpoint, config.save_checkpoint)
    _check_device(config.device)
    if config.checkpoint is not None:
        _check_checkpoint(config.checkpoint, dataset)
    _make_writable_dir(config.out, "output directory {!r} is not writable: {}")


def check_spectrum(args: argparse.Namespace) -> argparse.Namespace:
    """Return ``args`` after every check of the ``spectrum`` options (creating ``--out``).

    Args:
        args: The parsed arguments.

    Raises:
        UserError: For any option the demo could not work with.
    """
    for option in SPECTRUM_OPTIONS:
        _check(option, getattr(args, option.name))
    if not 8 <= args.batch_size <= DIGITS_SIZE:
        raise UserError(f"--batch-size must lie in [8, {DIGITS_SIZE}]")
    subsample = max(args.batch_size // 8, 2)
    if args.top_k > subsample:  # the sub-sampled MC case has a direction per point
        raise UserError(f"--top-k must be at most {subsample} (the sub-sample of "
                        f"--batch-size {args.batch_size}), got {args.top_k}")
    _check_device(args.device)
    if args.out is not None:
        _make_writable_dir(args.out, "cannot write to output directory {!r}: {}")
    return args


def _check_checkpoint_paths(checkpoint: Optional[str], save_checkpoint: Optional[str]) -> None:
    """That the checkpoint can be read, or that the trained network can be saved."""
    if checkpoint is not None:
        path = Path(checkpoint)
        for broken, what in ((not path.exists(), "does not exist"),
                             (not path.is_file(), "is not a file"),
                             (not os.access(path, os.R_OK), "is not readable"),
                             (path.is_file() and path.stat().st_size == 0, "is an empty file")):
            if broken:
                raise UserError(f"checkpoint {checkpoint!r} {what}")
    if save_checkpoint is None:
        return
    if checkpoint is not None:
        raise UserError(f"nothing to save to {save_checkpoint!r}: the network is loaded from "
                        f"{checkpoint!r}, not trained")
    path = Path(save_checkpoint)
    for broken, what in ((path.is_dir() or save_checkpoint.endswith(("/", os.sep)),
                          f"it names a folder, not a file (e.g. {str(path / 'cnn.pt')!r})"),
                         (not path.parent.is_dir(), "its folder does not exist"),
                         (not os.access(path.parent, os.W_OK), "its folder is not writable")):
        if broken:
            raise UserError(f"cannot save the checkpoint to {save_checkpoint!r}: {what}")


def _check_device(name: str) -> None:
    """That this machine has the device (imports torch unless it is ``cpu``)."""
    if name == "cpu":
        return
    import torch

    kind, _, index = name.partition(":")
    available = torch.backends.mps.is_available() if kind == "mps" else torch.cuda.is_available()
    if not available:
        raise UserError(f"device {name!r} was requested, but {kind.upper()} is not available "
                        "on this machine")
    count = torch.cuda.device_count() if kind == "cuda" else 0
    if index and int(index) >= count:
        raise UserError(f"device {name!r} was requested, but this machine has {count} CUDA "
                        f"device(s): cuda:0 to cuda:{count - 1}")


def _check_checkpoint(path: str, dataset: str) -> None:
    """That the checkpoint loads into the data set's CNN (imports torch)."""
    import torch

    from lowrank_laplace.toolkit.training import make_cnn

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # whatever the reason, the file cannot be used
        text = str(err).strip()  # torch's messages run to paragraphs: keep the gist
        text = text.split("WeightsUnpickler error:", 1)[-1].strip()  # what the file held
        gist = text.splitlines()[0].split(". ")[0].strip()[:160] if text else ""
        raise UserError(f"cannot load checkpoint {path!r} as a state_dict saved by "
                        f"torch.save: {gist or type(err).__name__}") from err
    try:
        make_cnn(dataset).load_state_dict(state)
    except (RuntimeError, KeyError, TypeError, AttributeError, ValueError) as err:
        raise UserError(f"checkpoint {path!r} does not fit the {dataset} CNN (another "
                        "architecture?)") from err


def _make_writable_dir(out: Any, refusal: str) -> None:
    """Create ``out`` and write a file there, or raise ``refusal`` (folder, reason)."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / ".write_test").write_text("")
        (Path(out) / ".write_test").unlink()
    except OSError as err:
        raise UserError(refusal.format(str(out), err.strerror)) from err
