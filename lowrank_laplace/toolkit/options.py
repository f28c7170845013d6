"""The studies' options, method table and user errors: plain Python, no torch.

The command's argument parser (:mod:`lowrank_laplace.toolkit.cli`) reads its choices
and defaults from here, so ``lowrank-laplace --help`` and argument errors need none of
the heavy imports; the studies (:mod:`~lowrank_laplace.toolkit.calibration`,
:mod:`~lowrank_laplace.toolkit.rank_study`) share the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

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

#: Every method of the study, in report order (``map``: the trained network alone).
METHODS = ("map",) + tuple(LAPLACE_METHODS)


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
    """Every method that fits the data set's network (``full_all`` only on small ones).

    Args:
        dataset: ``'mnist'`` or ``'digits'``.

    Returns:
        Method names in report order.
    """
    return [m for m in METHODS if fits(m, dataset)]


class UserError(Exception):
    """A problem the user can fix (bad option, missing file); reported in one line."""


def silent(message: str) -> None:
    """The default progress log of the studies: prints nothing.

    Args:
        message: The progress line, ignored.
    """


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
        solver: ``lowrank_ggn``'s fitting algorithm, ``'streaming'`` or the opt-in,
            approximate ``'sketch'``.
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
    solver: str = "streaming"
    weight_decay: float = 10.0
    prior: str = "marglik"
    angles: List[float] = field(default_factory=lambda: [0, 15, 30, 60, 90, 120, 180])
    methods: Optional[List[str]] = None
    device: str = "cpu"
    seed: int = 0
    out: str = "results"
