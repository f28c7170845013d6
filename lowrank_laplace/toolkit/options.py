"""The studies' options, method table, user errors and checks: plain Python.

The command's argument parser (:mod:`lowrank_laplace.toolkit.cli`) reads its choices
and defaults from here, and runs :func:`check_study` before a study's imports, so
``lowrank-laplace --help`` and argument errors need none of the heavy imports (torch is
imported only to check a GPU device or load a checkpoint); the studies
(:mod:`~lowrank_laplace.toolkit.calibration`, :mod:`~lowrank_laplace.toolkit.rank_study`)
share the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

#: Laplace methods: name -> laplace-torch's ``subset_of_weights``, ``hessian_structure``
#: and further options of ``Laplace(...)`` (``lowrank_ggn`` also gets ``rank`` and
#: ``mc_samples`` and ``solver`` from the config).
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
#: Methods whose dense D x D posterior only fits the small network of these data sets.
SMALL_ONLY: Dict[str, Tuple[str, ...]] = {"full_all": ("digits",)}
#: Residual models that can share one fit (switched afterwards): all but "diagonal".
SHARED_RESIDUALS = ("spectral", "isotropic", "none")
#: The names of :data:`lowrank_laplace.posterior.residual.RESIDUALS`, repeated here so
#: that the command's ``--help`` needs no torch (a test checks that the two agree).
RESIDUAL_MODELS = ("spectral", "isotropic", "diagonal", "none")

#: Methods that train a network of their own: laplace-torch's ``marglik_training``
#: (Immer et al. 2021) learns the weights and layerwise prior precisions together with
#: the method's posterior, which is then evaluated like the others. Opt-in (``--methods``):
#: each is a second training run, with a posterior fit per epoch.
TRAINED_METHODS = {"lowrank_ggn_marglik": "lowrank_ggn"}

#: Every method of the study, in report order (``map``: the trained network alone).
METHODS = ("map",) + tuple(LAPLACE_METHODS) + tuple(TRAINED_METHODS)

#: The studies' data sets: :data:`lowrank_laplace.toolkit.datasets.IMAGE_DATASETS`, and
#: the parameter count of each one's CNN (:func:`~lowrank_laplace.toolkit.training.make_cnn`),
#: the largest rank a posterior of it can have. Repeated here so that the options are
#: checked without torch (a test checks that they agree).
CNN_PARAMETERS = {"mnist": 20522, "digits": 3658}
#: Classes of both data sets (digits 0-9): the exact GGN's columns per data point, so a
#: Monte-Carlo GGN with more samples costs more than the exact one and is noisier.
NUM_CLASSES = 10
#: ``lowrank_ggn``'s fitting algorithms and the prior precision tunings.
SOLVERS = ("auto", "streaming", "sketch")
PRIOR_TUNINGS = ("marglik", "gridsearch")
#: How the rank study's network is trained: a MAP, or laplace-torch's ``marglik_training``.
TRAININGS = ("map", "marglik")


def fits(method: str, dataset: str) -> bool:
    """Whether a method's posterior fits the data set's network (see :data:`SMALL_ONLY`).

    Args:
        method: A name of :data:`METHODS`.
        dataset: ``'mnist'`` or ``'digits'``.

    Returns:
        ``False`` only for a dense posterior on a data set too large for it.
    """
    return dataset in SMALL_ONLY.get(method, (dataset,))


def default_methods(dataset: str) -> List[str]:
    """Every post-hoc method that fits the data set's network (``full_all`` only on small ones).

    The :data:`TRAINED_METHODS` are left to ``--methods``.

    Args:
        dataset: ``'mnist'`` or ``'digits'``.

    Returns:
        Method names in report order.
    """
    return [m for m in METHODS if fits(m, dataset) and m not in TRAINED_METHODS]


class UserError(Exception):
    """A problem the user can fix (bad option, missing file); reported in one line."""


def silent(message: str) -> None:
    """The default progress log of the studies: prints nothing.

    Args:
        message: The progress line, ignored.
    """


def check_options(config: CalibrationConfig, ranks: Sequence[int] = ()) -> None:
    """The checks of a study's options that need no torch, before any work.

    Numbers are expected to be integers of the right sign already (the command's
    parser, or :func:`lowrank_laplace.toolkit.calibration.validate`, checks them).

    Args:
        config: The options (``config.methods`` ``None``: :func:`default_methods`).
        ranks: Further ranks to check besides ``config.rank`` (the rank study's).

    Raises:
        UserError: For an unknown dataset, method, solver or prior tuning, a method
            listed twice or too large for the data set's network, a rank above the
            network's parameter count, more Monte-Carlo samples than classes, or
            checkpoint paths that cannot work (see :func:`check_checkpoint_paths`).
    """
    dataset = config.dataset
    if dataset not in CNN_PARAMETERS:
        raise UserError(f"unknown dataset {dataset!r}: choose one of {', '.join(CNN_PARAMETERS)}")
    methods = default_methods(dataset) if config.methods is None else config.methods
    for i, method in enumerate(methods):
        if method not in METHODS:
            raise UserError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
        if method in methods[:i]:
            raise UserError(f"method {method!r} is listed twice")
        if not fits(method, dataset):
            raise UserError(
                f"method {method} cannot run on --dataset {dataset}: its dense D x D posterior "
                f"is too large for the {dataset} CNN (D = {CNN_PARAMETERS[dataset]:,}); it "
                f"runs on --dataset {' or '.join(SMALL_ONLY[method])}")
    for rank in [config.rank, *ranks]:
        if rank > CNN_PARAMETERS[dataset]:
            raise UserError(f"rank {rank} is more than the {CNN_PARAMETERS[dataset]:,} "
                            f"parameters of the {dataset} CNN, the largest rank its posterior "
                            "can have")
    if config.mc_samples > NUM_CLASSES:
        raise UserError(
            f"mc_samples {config.mc_samples} is more than the {NUM_CLASSES} classes: the exact "
            f"GGN (mc_samples 0) needs {NUM_CLASSES} columns per point, so more samples cost "
            "more than it and are noisier")
    if config.solver not in SOLVERS:
        raise UserError(f"unknown solver {config.solver!r}: use {' or '.join(SOLVERS)}")
    if config.prior not in PRIOR_TUNINGS:
        raise UserError(f"unknown prior tuning {config.prior!r}: use "
                        f"{' or '.join(PRIOR_TUNINGS)}")
    if not str(config.out).strip():
        raise UserError("the output directory is empty text: use --out . for the current folder")
    check_checkpoint_paths(config.checkpoint, config.save_checkpoint)


def check_checkpoint_paths(checkpoint: Optional[str], save_checkpoint: Optional[str]) -> None:
    """Check that a checkpoint can be read and that one can be saved, before training.

    Args:
        checkpoint: The file to load the network from (``None``: train it).
        save_checkpoint: The file to save the trained network to (``None``: do not).

    Raises:
        UserError: If ``checkpoint`` is missing, a folder, unreadable or empty, or if
            ``save_checkpoint`` is given with ``checkpoint`` (nothing is trained), names
            a folder, or lies in a missing or read-only folder.
    """
    if checkpoint is not None:
        path = Path(checkpoint)
        if not path.exists():
            raise UserError(f"checkpoint {checkpoint!r} does not exist")
        if not path.is_file():
            raise UserError(f"checkpoint {checkpoint!r} is not a file")
        if not os.access(path, os.R_OK):
            raise UserError(f"checkpoint {checkpoint!r} is not readable")
        if path.stat().st_size == 0:
            raise UserError(f"checkpoint {checkpoint!r} is an empty file")
    if save_checkpoint is None:
        return
    if checkpoint is not None:
        raise UserError(f"nothing to save to {save_checkpoint!r}: the network is loaded from "
                        f"{checkpoint!r}, not trained")
    path = Path(save_checkpoint)
    if path.is_dir() or save_checkpoint.endswith(("/", os.sep)):
        raise UserError(f"cannot save the checkpoint to {save_checkpoint!r}: it names a folder, "
                        f"not a file (e.g. {str(path / 'cnn.pt')!r})")
    if not path.parent.is_dir():
        raise UserError(f"cannot save the checkpoint to {save_checkpoint!r}: its folder does "
                        "not exist")
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"cannot save the checkpoint to {save_checkpoint!r}: its folder is "
                        "not writable")


def check_device(name: str) -> None:
    """Check that this machine has a torch device (imports torch unless it is ``cpu``).

    Args:
        name: ``cpu``, ``cuda``, ``cuda:N`` or ``mps`` (the command's parser checks it).

    Raises:
        UserError: If CUDA, that CUDA device or MPS is not available.
    """
    if name == "cpu":
        return
    import torch

    kind, _, index = name.partition(":")
    if kind == "mps":
        if not torch.backends.mps.is_available():
            raise UserError("device 'mps' was requested, but MPS is not available on this "
                            "machine")
        return
    if not torch.cuda.is_available():
        raise UserError(f"device {name!r} was requested, but CUDA is not available on this "
                        "machine")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise UserError(f"device {name!r} was requested, but this machine has {count} CUDA "
                        f"device(s): cuda:0 to cuda:{count - 1}")


def check_checkpoint(path: str, dataset: str) -> None:
    """Load a checkpoint into the data set's CNN once, before any data is loaded.

    Args:
        path: The checkpoint file (:func:`check_checkpoint_paths` found it).
        dataset: The data set whose CNN it must fit.

    Raises:
        UserError: If it cannot be loaded (no ``torch.save`` file of tensors, damaged,
            unreadable) or does not fit the CNN.
    """
    import torch

    from lowrank_laplace.toolkit.training import make_cnn

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # whatever the reason, the file cannot be used
        raise UserError(f"cannot load checkpoint {path!r} as a state_dict saved by "
                        f"torch.save: {_load_failure(err)}") from err
    try:
        make_cnn(dataset).load_state_dict(state)
    except (RuntimeError, KeyError, TypeError, AttributeError, ValueError) as err:
        raise UserError(f"checkpoint {path!r} does not fit the {dataset} CNN (another "
                        "architecture?)") from err


def _load_failure(err: Exception) -> str:
    """The gist of a ``torch.load`` error in a few words (its messages run to paragraphs)."""
    text = str(err).strip()
    if "WeightsUnpickler error:" in text:  # the part that names what was in the file
        text = text.split("WeightsUnpickler error:", 1)[1].strip()
    gist = text.splitlines()[0].split(". ")[0].strip() if text else ""
    return gist[:160] or type(err).__name__


def check_training(train: str, config: CalibrationConfig) -> None:
    """Check the rank study's training against the other options.

    Args:
        train: One of :data:`TRAININGS`.
        config: The study's options (its checkpoint options).

    Raises:
        UserError: For an unknown training, or a checkpoint with ``"marglik"``.
    """
    if train not in TRAININGS:
        raise UserError(f"unknown training {train!r}: choose from {', '.join(TRAININGS)}")
    if train == "marglik" and (config.checkpoint or config.save_checkpoint):
        raise UserError("--train marglik trains its own network: drop --checkpoint and "
                        "--save-checkpoint")


def check_study(config: CalibrationConfig, ranks: Sequence[int] = ()) -> None:
    """Every check of a study's options, then create the output directory.

    The command runs it before a study's heavy imports, data loading and training; the
    directory is created last, so that a refused run leaves nothing behind.

    Args:
        config: The options.
        ranks: The rank study's ranks (see :func:`check_options`).

    Raises:
        UserError: For any option the run could not work with.
    """
    check_options(config, ranks)
    check_device(config.device)
    if config.checkpoint is not None:
        check_checkpoint(config.checkpoint, config.dataset)
    try:
        make_writable_dir(Path(config.out))
    except OSError as err:
        raise UserError(f"output directory {str(config.out)!r} is not writable: "
                        f"{err.strerror}") from err


def make_writable_dir(out: Path) -> None:
    """Create ``out`` and check that a file can be written there (before any work).

    Args:
        out: The output directory.

    Raises:
        OSError: If it cannot be created or written to.
    """
    out.mkdir(parents=True, exist_ok=True)
    probe = out / ".write_test"
    probe.write_text("")
    probe.unlink()


@dataclass
class CalibrationConfig:
    """Options of the calibration study (the command-line flags).

    Attributes:
        dataset: ``'mnist'`` or ``'digits'``.
        epochs: Training epochs (ignored with ``checkpoint``).
        checkpoint: Load the network's ``state_dict`` from here instead of training.
        save_checkpoint: Save the trained network's ``state_dict`` here.
        n_train: Use at most this many training points (``0``: all).
        n_test: Use at most this many test points (``0``: all).
        batch_size: Batch size for training, fitting and prediction.
        rank: Rank of the ``lowrank_ggn`` posteriors.
        mc_samples: ``0`` exact GGN, ``M >= 1`` Monte-Carlo GGN for ``lowrank_ggn``.
        solver: ``lowrank_ggn``'s fitting algorithm: ``'auto'`` (the library's default:
            a sketch of 4 x rank columns where it is cheaper, else streaming),
            ``'streaming'`` or ``'sketch'``.
        weight_decay: Precision ``delta`` of the Gaussian prior the MAP network is
            trained under: the training loss is the mean cross-entropy plus
            ``delta / (2 N) ||theta||^2`` (Laplace Redux protocol), so the MAP is the
            mode of the posterior the Laplace methods approximate. The default 10 is
            near the evidence's fixed point on the MNIST CNN: trained under it, the
            marglik prior of every all-weights posterior is 12-27 (trained under 1,
            marglik picks 4-13, so the MAP was not the mode of the tuned posterior).
        prior: ``'marglik'`` or ``'gridsearch'`` (on the validation split).
        angles: Rotation angles for the dataset-shift evaluation.
        methods: Methods to run, a subset of :data:`METHODS` (``None``:
            :func:`default_methods` of the data set).
        device: ``'cpu'`` or ``'cuda'``.
        seed: Seed for data split, initialisation and training.
        out: Output directory for the JSON report and PNG plots.
    """

    dataset: str = "mnist"
    epochs: int = 30
    checkpoint: Optional[str] = None
    save_checkpoint: Optional[str] = None
    n_train: int = 0
    n_test: int = 0
    batch_size: int = 128
    rank: int = 100
    mc_samples: int = 0
    solver: str = "auto"
    weight_decay: float = 10.0
    prior: str = "marglik"
    angles: List[float] = field(default_factory=lambda: [0, 15, 30, 60, 90, 120, 180])
    methods: Optional[List[str]] = None
    device: str = "cpu"
    seed: int = 0
    out: str = "results"
