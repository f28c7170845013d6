"""End-to-end calibration study behind ``lowrank-laplace calibrate``.

Trains (or loads) a small CNN on an offline image data set, fits Laplace posteriors
(``lowrank_ggn`` on all weights, with and without the diagonal correction, and on the
last layer; laplace-torch's ``kron`` and ``diag`` on all weights), tunes their prior
precision, and evaluates in-distribution calibration, rotation shift and
out-of-distribution detection. The report's schema::

    {"methods": {name: {"in_distribution": {"accuracy", "nll", "ece", "mce", "brier",
                                              "confidence"},
                        "shift": {"<angle>": {"accuracy", "nll", "ece"}, ...},
                        "ood_auroc": float, "fit_s": float, "predict_s": float}
                        # or {"error": "why it could not run"}
     "config": {...},
     "machine": {"date", "cpu_name", "cpu_count", "platform", "python", "torch",
                 "device", "device_name", "version_<package>"}}
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from lowrank_laplace import datasets, metrics, plots

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
_SMALL_ONLY = {"full_all": ("digits",)}
#: Residual models that can share one fit (switched afterwards): all but "diagonal".
_SHARED_RESIDUALS = ("spectral", "isotropic", "none")
_DISPLAY_NAMES = {"mnist": "MNIST", "digits": "scikit-learn digits"}

#: Every method of the study, in report order (``map``: the trained network alone).
METHODS = ("map",) + tuple(LAPLACE_METHODS)


def default_methods(dataset: str) -> List[str]:
    """Every method that fits the data set's network (``full_all`` only on small ones).

    Args:
        dataset: ``'mnist'`` or ``'digits'``.

    Returns:
        Method names in report order.
    """
    return [m for m in METHODS if _fits(m, dataset)]


def _fits(method: str, dataset: str) -> bool:
    """Whether a method's posterior fits the data set's network (see ``_SMALL_ONLY``)."""
    return dataset in _SMALL_ONLY.get(method, (dataset,))


class UserError(Exception):
    """A problem the user can fix (bad option, missing file); reported in one line."""


# numeric options and their smallest valid value, checked before any work
_MINIMUM = {"epochs": 0, "n_train": 0, "n_test": 0, "batch_size": 1, "rank": 1,
            "mc_samples": 0, "seed": 0}


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


def _silent(message: str) -> None:
    """The default progress log of :func:`run`: prints nothing."""


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


def machine_record(device: torch.device) -> dict:
    """When and where a report was made: UTC date, CPU, device and package versions.

    Args:
        device: The torch device of the run.

    Returns:
        The record (see the module docstring).
    """
    import datetime
    import importlib.metadata
    import os
    import platform

    cpu_name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu_name = next((line.split(":", 1)[1].strip() for line in f
                             if line.startswith("model name")), cpu_name)
    except OSError:
        pass
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "cpu_name": cpu_name, "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else cpu_name,
    }
    for package in ("lowrank_laplace", "laplace-torch", "backpack-for-pytorch"):
        try:
            record[f"version_{package}"] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:  # pragma: no cover
            pass
    return record


def make_cnn(dataset: str) -> nn.Module:
    """The small CNN used for a data set.

    Args:
        dataset: ``'mnist'`` (28x28) or ``'digits'`` (8x8).

    Returns:
        An ``nn.Sequential`` of BackPACK-supported layers with 10 outputs.
    """
    if dataset == "mnist":
        return nn.Sequential(
            nn.Conv2d(1, 8, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10),
        )
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10),
    )


def validate(config: CalibrationConfig) -> torch.device:
    """Check the options before any expensive work.

    Args:
        config: The options.

    Returns:
        The torch device.

    Raises:
        UserError: For a negative count (a zero batch size or rank), a non-finite
            angle, an unknown dataset, method, solver or prior method, a missing checkpoint,
            a checkpoint to save into a missing folder, CUDA asked for but absent, or an
            unwritable output directory.
    """
    for name, minimum in _MINIMUM.items():
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise UserError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if not (isinstance(config.weight_decay, (int, float)) and math.isfinite(config.weight_decay)
            and config.weight_decay >= 0):
        raise UserError(f"weight_decay must be a finite number >= 0, got "
                        f"{config.weight_decay!r}")
    if config.methods is None:
        config.methods = default_methods(config.dataset)
    if not config.angles or not all(math.isfinite(float(a)) for a in config.angles):
        raise UserError(f"angles must be finite numbers, got {config.angles!r}")
    if config.dataset not in datasets.IMAGE_DATASETS:
        raise UserError(f"unknown dataset {config.dataset!r}: choose one of "
                        f"{', '.join(datasets.IMAGE_DATASETS)}")
    unknown = [m for m in config.methods if m not in METHODS]
    if unknown:
        raise UserError(f"unknown method {unknown[0]!r}: choose from {', '.join(METHODS)}")
    if config.solver not in ("streaming", "sketch"):
        raise UserError(f"unknown solver {config.solver!r}: use streaming or sketch")
    if config.prior not in ("marglik", "gridsearch"):
        raise UserError(f"unknown prior tuning {config.prior!r}: use marglik or gridsearch")
    if config.checkpoint is not None and not Path(config.checkpoint).is_file():
        raise UserError(f"checkpoint {config.checkpoint!r} does not exist")
    if config.save_checkpoint is not None and not Path(config.save_checkpoint).parent.is_dir():
        raise UserError(f"cannot save the checkpoint to {config.save_checkpoint!r}: its "
                        "folder does not exist")
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but CUDA is not available")
    try:
        make_writable_dir(Path(config.out))
    except OSError as err:
        raise UserError(f"output directory {str(config.out)!r} is not writable: "
                        f"{err.strerror}") from err
    return torch.device(config.device)


def _train_or_load(config: CalibrationConfig, split: datasets.Split, device,
                   log: Callable[[str], None]) -> nn.Module:
    model = make_cnn(config.dataset).to(device)
    if config.checkpoint is not None:
        state = torch.load(config.checkpoint, map_location=device, weights_only=True)
        try:
            model.load_state_dict(state)
        except (RuntimeError, KeyError, TypeError) as err:
            raise UserError(f"checkpoint {config.checkpoint!r} does not fit the "
                            f"{config.dataset} CNN (another architecture?)") from err
        log(f"loaded the {config.dataset} CNN from {config.checkpoint}")
        return model.eval()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    loss_func = nn.CrossEntropyLoss()
    loader = split.loaders(config.batch_size, config.seed)["train"]
    decay = config.weight_decay / (2 * len(split.train[1]))  # Gaussian prior, mean loss
    for epoch in range(config.epochs):
        start, total, count = time.perf_counter(), 0.0, 0
        for X, y in loader:
            opt.zero_grad()
            loss = loss_func(model(X.to(device)), y.to(device))
            penalty = decay * sum((p**2).sum() for p in model.parameters())
            (loss + penalty).backward()
            opt.step()
            total, count = total + float(loss.detach()) * len(y), count + len(y)
        log(f"training epoch {epoch + 1}/{config.epochs}: loss {total / max(count, 1):.4f} "
            f"({time.perf_counter() - start:.1f} s)")
    if config.save_checkpoint is not None:
        torch.save(model.state_dict(), config.save_checkpoint)
    return model.eval()


def _fit_laplace(name: str, model: nn.Module, config: CalibrationConfig, loaders,
                 fitted: dict) -> object:
    """Fit (or reuse: residual models other than ``diagonal`` share one fit) and tune."""
    from laplace import Laplace

    import lowrank_laplace  # noqa: F401  (registers lowrank_ggn)

    subset, structure, options = LAPLACE_METHODS[name]
    if not _fits(name, config.dataset):
        raise ValueError(f"{name} needs a dense D x D posterior: run it with --dataset "
                         f"{' or '.join(_SMALL_ONLY[name])}")
    residual = options.get("residual", "spectral")
    key = (subset, structure, residual if residual not in _SHARED_RESIDUALS else "shared")
    if key in fitted:
        la = fitted[key]
        la.residual = residual
        _tune_prior(la, config, loaders)
        return la
    if structure == "lowrank_ggn":
        kwargs = dict(rank=config.rank, mc_samples=config.mc_samples, solver=config.solver,
                      **options)
    else:
        # laplace-torch's default (curvlinops) GLM predictive computes Jacobians with
        # torch.func; its BackPACK backend is ~30x faster here (47 s vs 1.4 s for 128
        # MNIST test points on 2 CPU cores)
        from laplace.curvature import BackPackGGN

        kwargs = dict(backend=BackPackGGN, **options)
    la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure,
                 **kwargs)
    la.fit(loaders["train"])
    fitted[key] = la
    _tune_prior(la, config, loaders)
    return la


def _tune_prior(la, config: CalibrationConfig, loaders) -> None:
    """Tune a scalar prior precision by marglik or by grid search on the validation split.

    Both start afresh (marglik from 1, the grid from its own values), so a shared fit
    tuned for an earlier residual model does not bias the next.
    """
    if config.prior == "marglik" and type(la).__name__ == "FullLaplace":
        la.prior_precision = marglik_prior_full(la)
    elif config.prior == "marglik":
        la.optimize_prior_precision(method="marglik")
    else:
        la.optimize_prior_precision(method="gridsearch", val_loader=loaders["val"],
                                    pred_type="glm", link_approx="probit", grid_size=20)


def marglik_prior_full(la, n_steps: int = 100, lr: float = 0.1) -> float:
    r"""laplace-torch's marglik prior tuning of a ``FullLaplace``, from one eigendecomposition.

    ``FullLaplace.optimize_prior_precision`` factors the ``D x D`` precision at every
    Adam step (minutes for a few thousand weights on a CPU). With the eigenvalues
    :math:`\lambda` of ``H`` the objective is
    :math:`\tfrac12 (\sum \log(h\lambda_i + \delta) - D \log\delta + \delta \|\theta - \mu_0\|^2)`,
    minimised here by the same Adam steps on :math:`\log\delta` (from ``delta = 1``).

    Args:
        la: A fitted ``FullLaplace`` (scalar prior).
        n_steps: Adam steps (laplace-torch's default).
        lr: Adam learning rate (laplace-torch's default).

    Returns:
        The tuned scalar prior precision.
    """
    lam = torch.linalg.eigvalsh(la.H.double()).clamp(min=0) * float(la._H_factor)
    scatter = float(((la.mean - la.prior_mean).double() ** 2).sum())
    log_delta = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([log_delta], lr=lr)
    for _ in range(n_steps):
        opt.zero_grad()
        delta = log_delta.exp()
        loss = 0.5 * (torch.log(lam + delta).sum() - lam.numel() * log_delta + delta * scatter)
        loss.backward()
        opt.step()
    return float(log_delta.detach().exp())


def _posterior_info(la) -> dict:
    """Tuned prior precision and, for ``lowrank_ggn``, rank, kept trace and residual model."""
    if la is None:
        return {}
    prior = torch.as_tensor(la.prior_precision)
    info = {"prior_precision": float(prior.mean())}
    if hasattr(la, "kept_fraction"):
        info.update(rank=int(la.H[1].numel()), kept_fraction=float(la.kept_fraction),
                    residual=la.residual)
    return info


def _predictor(name: str, model: nn.Module, la) -> Callable[[Tensor], Tensor]:
    if name == "map":
        return lambda X: torch.softmax(model(X), -1)
    return lambda X: la(X, pred_type="glm", link_approx="probit")


def _predict(predict, X: Tensor, batch_size: int, device) -> Tensor:
    with torch.no_grad():
        out = [predict(chunk.to(device)).detach().cpu() for chunk in torch.split(X, batch_size)]
    return torch.cat(out)


def evaluate(predict, split: datasets.Split, ood: Tensor, config: CalibrationConfig,
             device) -> Tuple[dict, Tensor]:
    """In-distribution, shift and OOD metrics of one predictor.

    Args:
        predict: Maps inputs to predictive probabilities.
        split: The data.
        ood: Out-of-distribution inputs.
        config: The options.
        device: Where the model lives.

    Returns:
        The method's report entry (without timings) and its test probabilities.
    """
    X, y = split.test
    start = time.perf_counter()
    probs = _predict(predict, X, config.batch_size, device)
    predict_s = time.perf_counter() - start
    entry = {"in_distribution": metrics.classification_metrics(probs, y), "shift": {},
             "predict_s": predict_s}
    for angle in config.angles:
        p = _predict(predict, datasets.rotate(X, angle), config.batch_size, device)
        full = metrics.classification_metrics(p, y)
        entry["shift"][f"{angle:g}"] = {k: full[k] for k in ("accuracy", "nll", "ece")}
    entry["ood_auroc"] = metrics.ood_auroc(probs, _predict(predict, ood, config.batch_size,
                                                           device))
    return entry, probs


def load_split(config: CalibrationConfig) -> datasets.Split:
    """The study's data split (seeded; ``n_train`` / ``n_test`` caps applied).

    Args:
        config: The options.

    Returns:
        The split.
    """
    torch.manual_seed(config.seed)
    split = datasets.image_split(config.dataset, seed=config.seed, max_train=config.n_train)
    if config.n_test:
        split.test = (split.test[0][: config.n_test], split.test[1][: config.n_test])
    return split


def run(config: CalibrationConfig, log: Callable[[str], None] = _silent) -> dict:
    """Run the study and write ``calibration.json`` plus PNG plots to ``config.out``.

    Args:
        config: The options.
        log: Receives one short progress line per step (default: nothing).

    Returns:
        The report (see the module docstring for its schema).
    """
    device = validate(config)
    split = load_split(config)
    size = split.train[0].shape[-1]
    ood = datasets.ood_images(len(split.test[1]), size, seed=config.seed)
    loaders = split.loaders(config.batch_size, config.seed)
    log(f"{config.dataset}: {len(split.train[1])} training, {len(split.test[1])} test points")
    model = _train_or_load(config, split, device, log)
    report = {"methods": {}, "config": asdict(config) | {
        "n_train_used": len(split.train[1]), "n_test_used": len(split.test[1]),
        "num_params": sum(p.numel() for p in model.parameters()),
        "ood": "grayscale crops of scikit-learn's sample photographs"},
        "machine": machine_record(device)}
    out = Path(config.out)
    fitted: dict = {}
    for i, name in enumerate(config.methods, 1):
        try:
            start = time.perf_counter()
            la = None if name == "map" else _fit_laplace(name, model, config, loaders, fitted)
            fit_s = time.perf_counter() - start
            entry, probs = evaluate(_predictor(name, model, la), split, ood, config, device)
        except (RuntimeError, MemoryError, ValueError, NotImplementedError) as err:
            report["methods"][name] = {"error": f"{type(err).__name__}: {err}"}
            log(f"[{i}/{len(config.methods)}] {name}: could not run ({type(err).__name__})")
            continue
        entry["fit_s"] = fit_s
        entry["posterior"] = _posterior_info(la)
        report["methods"][name] = entry
        log(f"[{i}/{len(config.methods)}] {name}: fit {fit_s:.1f} s, "
            f"predict {entry['predict_s']:.1f} s")
        fig = plots.reliability_diagram(probs, split.test[1], title=name,
                                        path=out / f"reliability_{name}.png")
        plots.close(fig)
    shifts = {n: m["shift"] for n, m in report["methods"].items() if "shift" in m}
    if shifts:
        for metric in ("ece", "accuracy"):
            plots.close(plots.shift_curves(
                shifts, metric, path=out / f"shift_{metric}.png",
                title=f"{plots.metric_name(metric)} under rotation "
                f"({_DISPLAY_NAMES.get(config.dataset, config.dataset)} test set)"))
    (out / "calibration.json").write_text(json.dumps(report, indent=2))
    return report


#: Columns of the printed table: header, how to read the value from a method's report
#: entry, and its number format. Add a metric here to print it.
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


def format_table(report: dict) -> str:
    """The report as a text table: a row per method, a column per :data:`TABLE_COLUMNS` entry.

    Args:
        report: From :func:`run`.

    Returns:
        The table.
    """
    widths = [max(len(header) + 2, 9) for header, _, _ in TABLE_COLUMNS]
    header = f"{'method':<24}" + "".join(
        f"{h:>{w}}" for (h, _, _), w in zip(TABLE_COLUMNS, widths))
    lines = [header, "-" * len(header)]
    for name, m in report["methods"].items():
        if "error" in m:
            lines.append(f"{name:<24}  could not run: {m['error'][:70]}")
            continue
        lines.append(f"{name:<24}" + "".join(f"{get(m):>{w}{fmt}}" for (_, get, fmt), w
                                             in zip(TABLE_COLUMNS, widths)))
    return "\n".join(lines)


def format_notes(report: dict) -> str:
    """How to read the table: the low-rank posteriors' rank, kept trace and residual model.

    Args:
        report: From :func:`run`.

    Returns:
        A few lines of text.
    """
    lines = ["prior: tuned prior precision; kept: share of the exact GGN trace the rank keeps."]
    for name, m in report["methods"].items():
        info = m.get("posterior", {})
        if "residual" in info:
            lines.append(f"{name}: rank {info['rank']}, kept {info['kept_fraction']:.3f}, "
                         f"residual={info['residual']!r}")
    if any(n.startswith("full") for n in report["methods"]):
        lines.append("full_*: laplace-torch's exact full-GGN posterior, the reference the "
                     "low-rank ones approximate.")
    lines.append("lowrank_ggn_all (residual='spectral', the default) is the product; "
                 "_isotropic and _none reuse its fit, so their fit time is prior tuning only.")
    return "\n".join(lines)


def format_shift(report: dict) -> str:
    """ECE under rotation per method and angle, as a text table.

    Args:
        report: From :func:`run`.

    Returns:
        The table.
    """
    methods = {n: m for n, m in report["methods"].items() if "shift" in m}
    if not methods:
        return ""
    angles = list(next(iter(methods.values()))["shift"])
    header = f"{'ECE under rotation':<24}" + "".join(f"{a + 'deg':>9}" for a in angles)
    rows = [header] + [f"{n:<24}" + "".join(f"{m['shift'][a]['ece']:>9.4f}" for a in angles)
                       for n, m in methods.items()]
    return "\n".join(rows)
