"""Worker side of ``bench_laplace.py``: one method's phases in a fresh process.

``bench_laplace.py --worker`` runs :func:`worker_main`, which builds the problem,
then times and memory-measures the ``fit``, ``glm`` and ``nn`` phases of one
method and prints one JSON record per phase (prefixed by :data:`RESULT_MARKER`)
for the driver to collect. Also holds the method specifications
(:data:`METHODS`) and phase names shared with the driver and the report.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks import _harness, _problems
from benchmarks._harness import REPO_ROOT, GiB

#: Parameters of the scikit-learn digits MLP (64-50-50-10, tanh).
DIGITS_NUM_PARAMS = 6310
#: Classes by problem: the synthetic problems and the real digits data.
NUM_CLASSES = {**_problems.NUM_CLASSES, "digits": 10}
#: Parameters by problem.
EXPECTED_NUM_PARAMS = {**_problems.EXPECTED_NUM_PARAMS, "digits": DIGITS_NUM_PARAMS}
#: Problem names.
PROBLEMS = (*_problems.PROBLEMS, "digits")


def make_digits(
    N: int, n_train: int, seed: int = 0, device: str | torch.device = "cpu"
) -> tuple[nn.Sequential, nn.CrossEntropyLoss, torch.Tensor, torch.Tensor]:
    """A small real problem: scikit-learn's digits and a 64-50-50-10 tanh MLP.

    The first ``n_train`` of ``N`` shuffled points train the network to a MAP
    estimate (100 full-batch Adam steps, not timed), as a Laplace fit would start from.

    Args:
        N: Points (at most 1,797).
        n_train: Training points among them.
        seed: Seed of the shuffle and the initialisation.
        device: Device of model and data.

    Returns:
        ``(model, loss_func, X, y)`` as :func:`_problems.make_problem`.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    perm = torch.randperm(len(data.target), generator=torch.Generator().manual_seed(seed))[:N]
    X = torch.tensor(data.data, dtype=torch.float32)[perm] / 16.0
    y = torch.as_tensor(data.target)[perm]
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(),
                          nn.Linear(50, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(100):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X[:n_train]), y[:n_train]).backward()
        optimizer.step()
    return model.to(device), nn.CrossEntropyLoss(), X.to(device), y.to(device)


def make_problem(name: str, N: int, n_train: int, seed: int = 0,
                 device: str | torch.device = "cpu"):
    """The problem's model, loss and data (see :func:`_problems.make_problem`).

    Args:
        name: Problem name (one of :data:`PROBLEMS`).
        N: Points.
        n_train: Training points among them (used by ``digits`` to train the MAP).
        seed: Seed.
        device: Device.

    Returns:
        ``(model, loss_func, X, y)``.
    """
    if name == "digits":
        return make_digits(N, n_train, seed=seed, device=device)
    return _problems.make_problem(name, N, seed=seed, device=device)

#: Method name -> specification. ``kind`` is ``'ours'``, ``'laplace'`` (laplace-torch
#: peer) or ``'lanczos'``; ``backend`` is ``'backpack'`` or ``None`` (laplace-torch's
#: default backend).
METHODS: dict[str, dict[str, Any]] = {
    "lowrank_exact": {"kind": "ours", "mc_samples": 0, "label": "lowrank_ggn exact"},
    "lowrank_mc": {"kind": "ours", "mc_samples": 1, "label": "lowrank_ggn MC(1)"},
    "lowrank_default": {
        "kind": "ours",
        "mc_samples": 0,
        "solver": None,
        "label": "lowrank_ggn, default arguments",
    },
    "lowrank_exact_sketch": {
        "kind": "ours",
        "mc_samples": 0,
        "solver": "sketch",
        "label": "lowrank_ggn exact, sketch",
    },
    "lowrank_mc_sketch": {
        "kind": "ours",
        "mc_samples": 1,
        "solver": "sketch",
        "label": "lowrank_ggn MC(1), sketch",
    },
    "lowrank_exact_lowmem": {
        "kind": "ours",
        "mc_samples": 0,
        "low_memory": True,
        "label": "lowrank_ggn exact, low_memory",
    },
    "diag_backpack": {
        "kind": "laplace",
        "structure": "diag",
        "backend": "backpack",
        "label": "diag BackPackGGN",
    },
    "diag_default": {
        "kind": "laplace",
        "structure": "diag",
        "backend": None,
        "label": "diag default backend",
    },
    "kron_backpack": {
        "kind": "laplace",
        "structure": "kron",
        "backend": "backpack",
        "label": "kron BackPackGGN",
    },
    "kron_default": {
        "kind": "laplace",
        "structure": "kron",
        "backend": None,
        "label": "kron default backend",
    },
    "full_backpack": {
        "kind": "laplace",
        "structure": "full",
        "backend": "backpack",
        "label": "full BackPackGGN",
    },
    "full_default": {
        "kind": "laplace",
        "structure": "full",
        "backend": None,
        "label": "full default backend",
    },
    "lanczos": {"kind": "lanczos", "label": "eigsh on curvlinops GGN"},
}
PHASES: tuple[str, ...] = ("fit", "glm", "nn")
PHASE_LABELS = {"fit": "fit", "glm": "GLM probit predictive", "nn": "NN MC predictive"}
RESULT_MARKER = "__BENCH_LAPLACE_PHASE__"


def _emit(record: dict[str, Any]):
    """Print a phase record as one JSON line on stdout (see :func:`_harness.emit`).

    Args:
        record: The record.
    """
    _harness.emit(RESULT_MARKER, record)


def library_fingerprint() -> dict[str, Any]:
    """Identify the state of the ``lowrank_laplace`` sources (they may change between runs).

    Returns:
        ``git_head`` of the repository (if available) and ``sources_sha1``, a hash
        over the package's ``*.py`` files (including uncommitted changes).
    """
    import hashlib

    info: dict[str, Any] = {}
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if head.returncode == 0:
            info["git_head"] = head.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    digest = hashlib.sha1()
    package = REPO_ROOT / "lowrank_laplace"
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    info["sources_sha1"] = digest.hexdigest()
    return info


def _set_memory_cap(limit_bytes: int, device: torch.device) -> dict[str, Any]:
    """Cap the worker's address space, at most to what the machine can back.

    Args:
        limit_bytes: Requested cap (``<= 0``: no cap).
        device: Device of the run (no cap on CUDA, whose driver needs huge virtual
            address ranges).

    Returns:
        ``mem_limit_bytes`` (the cap in effect or ``None``) and, if the cap was
        lowered to the available memory, ``mem_limit_requested_bytes``.
    """
    info: dict[str, Any] = {"mem_limit_bytes": None}
    if device.type == "cuda" or limit_bytes <= 0:
        return info
    cap = limit_bytes
    try:
        import psutil

        # address space in use plus the physical memory still available
        backed = psutil.virtual_memory().available + psutil.Process().memory_info().vms
        if backed < cap:
            info["mem_limit_requested_bytes"] = cap
            cap = backed
    except ImportError:  # pragma: no cover
        pass
    info["mem_limit_bytes"] = _harness.limit_address_space(cap)
    return info


def _measure(phase: str, fn: Callable[[], Any], device: torch.device) -> tuple[dict, Any]:
    """Time one phase and measure its peak memory; record failures.

    Args:
        phase: Phase name.
        fn: The phase (no arguments).
        device: Device of the run.

    Returns:
        The phase record (``status``, ``time_s``, ``peak_bytes``,
        ``peak_delta_bytes``, ... ; for failures ``reason``, ``traceback`` and the
        time until the failure) and the output of ``fn`` (``None`` on failure).
    """
    gc.collect()
    record: dict[str, Any] = {"phase": phase}
    cuda_before = _harness.cuda_baseline(device)
    record["peak_reset"] = _harness.reset_peak_rss()
    rss_before = _harness.current_rss_bytes()

    out = None
    busy0, own0 = _harness.system_busy_cpu_seconds(), _harness.own_cpu_seconds()
    _harness.sync(device)
    start = time.perf_counter()
    try:
        out = fn()
        _harness.sync(device)
        record["time_s"] = time.perf_counter() - start
        record["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 (every failure is a result)
        record["time_to_failure_s"] = time.perf_counter() - start
        record.update(_harness.failure_record(exc))
    busy1, own1 = _harness.system_busy_cpu_seconds(), _harness.own_cpu_seconds()
    if busy0 is not None and busy1 is not None:
        record["other_cpu_percent_during_phase"] = _harness.other_cpu_percent(
            busy1 - busy0, own1 - own0, time.perf_counter() - start
        )

    rss_peak = _harness.peak_rss_bytes()
    record["rss_before_bytes"] = rss_before
    record["rss_peak_bytes"] = rss_peak
    record["rss_peak_delta_bytes"] = max(0, rss_peak - rss_before)
    if device.type == "cuda":
        record["cuda_before_bytes"] = cuda_before
    record.update(
        _harness.peak_memory(device, cuda_before, rss_peak, record["rss_peak_delta_bytes"])
    )
    if record["status"] != "ok":
        gc.collect()  # release what the failed phase left behind
    return record, out


def _check_probs(probs: Any, n_test: int, C: int) -> list[str]:
    """Check predictive probabilities (untimed).

    Args:
        probs: Output of the predictive.
        n_test: Number of test points.
        C: Number of classes.

    Returns:
        Descriptions of problems (empty if the output is plausible).
    """
    if not isinstance(probs, torch.Tensor):
        return [f"predictive returned {type(probs).__name__}, expected a tensor"]
    problems = []
    if tuple(probs.shape) != (n_test, C):
        problems.append(f"shape {tuple(probs.shape)} != {(n_test, C)}")
    if not torch.isfinite(probs).all():
        problems.append("non-finite probabilities")
    else:
        err = (probs.sum(-1) - 1).abs().max().item()
        if err > 1e-3:
            problems.append(f"probabilities do not sum to 1 (max error {err:.2e})")
    return problems


def _laplace_kwargs(method: str, args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of ``laplace.Laplace`` for a method.

    Args:
        method: Method name (kind ``'ours'`` or ``'laplace'``).
        args: Parsed command line arguments of the worker.

    Returns:
        The keyword arguments besides model and likelihood.
    """
    spec = METHODS[method]
    kwargs: dict[str, Any] = {"subset_of_weights": "all"}
    if spec["kind"] == "ours":
        kwargs.update(
            hessian_structure="lowrank_ggn", rank=args.rank, mc_samples=spec["mc_samples"],
            low_memory=spec.get("low_memory", False), solver=spec.get("solver", "streaming"),
        )
        if kwargs["solver"] is None:  # the library's default solver
            del kwargs["solver"]
    else:
        kwargs["hessian_structure"] = spec["structure"]
        if spec["backend"] == "backpack":
            from laplace.curvature import BackPackGGN

            kwargs["backend"] = BackPackGGN
    return kwargs


def _lanczos_fit(
    model: nn.Module, batches: list, n_train: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Top eigenpairs of the full-data GGN with ``eigsh`` on curvlinops' operator.

    Args:
        model: The network.
        batches: Training data as a list of ``(X, y)`` batches.
        n_train: Number of training points.
        rank: Number of leading eigenpairs.

    Returns:
        Eigenvalues (descending), eigenvectors ``(D, rank)`` and the number of
        GGN-vector products.
    """
    return _harness.ggn_eigsh(model, nn.CrossEntropyLoss(reduction="sum"), batches, n_train,
                              rank)


def run_worker(args: argparse.Namespace):
    """Run the phases of one method and print a JSON record after each.

    The first record is ``phase='setup'`` (problem size, memory cap); then ``fit``
    and the requested predictive phases follow. A failed fit ends the worker.

    Args:
        args: Parsed command line arguments of the worker.
    """
    from torch.utils.data import DataLoader, TensorDataset

    device = torch.device(args.device)
    setup: dict[str, Any] = {"phase": "setup", "status": "ok"}
    setup.update(_set_memory_cap(int(args.mem_limit_gib * GiB), device))
    threads = args.threads or _harness.num_cores()
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)

    spec = METHODS[args.method]
    model, _, X, y = make_problem(
        args.problem, args.n_train + args.n_test, args.n_train, seed=args.seed, device=device
    )
    X_train, y_train = X[: args.n_train], y[: args.n_train]
    X_test = X[args.n_train :]
    train_loader = DataLoader(
        TensorDataset(X_train, y_train), batch_size=args.batch_size, shuffle=False
    )
    D = sum(p.numel() for p in model.parameters() if p.requires_grad)
    C = NUM_CLASSES[args.problem]
    setup.update({"D": D, "C": C, "threads": threads, "device": str(device)})

    if spec["kind"] == "lanczos":
        import curvlinops  # noqa: F401

        batches = list(train_loader)
    else:
        import laplace
        import laplace.curvature  # noqa: F401

        import lowrank_laplace  # noqa: F401 (registers hessian_structure="lowrank_ggn")

        kwargs = _laplace_kwargs(args.method, args)
        setup["lowrank_laplace"] = library_fingerprint()
        setup["laplace_kwargs"] = {k: getattr(v, "__name__", v) for k, v in kwargs.items()}
    _harness.preimport((*_harness.DEFAULT_PREIMPORTS, "curvlinops", "laplace"))
    _emit(setup)

    # fit
    if spec["kind"] == "lanczos":
        record, out = _measure(
            "fit", lambda: _lanczos_fit(model, batches, args.n_train, args.rank), device
        )
        if out is not None:
            evals, evecs, count = out
            record["num_matvecs"] = count
            record["eigenvalues"] = evals.double().tolist()
            record["eigenvectors_shape"] = list(evecs.shape)
        _emit(record)
        return

    def fit():
        torch.manual_seed(args.seed)
        la = laplace.Laplace(model, "classification", **kwargs)
        la.fit(train_loader)
        return la

    # the process's first fit apart (kernels, handles); the record is the next one's
    first = _measure("fit", fit, device)[0] if args.warm_fit else None
    record, la = _measure("fit", fit, device)
    if first is not None:
        record["first_fit_s"] = first.get("time_s")
    if la is not None:
        if spec["kind"] == "ours":
            record["kept_fraction"] = float(la.kept_fraction)
            record["trace"] = float(la.trace)
            evals = la.H[1].detach().double().cpu().sort(descending=True).values
            record["eigenvalues"] = evals.tolist()
        record["H_type"] = type(la.H).__name__
        if getattr(la, "fit_path", None) is not None:
            record["fit_path"] = la.fit_path
        if args.marglik:  # laplace-torch's default marglik prior tuning, timed apart
            tuned, _ = _measure("marglik", lambda: la.optimize_prior_precision(
                method="marglik"), device)
            record["marglik_time_s"] = tuned.get("time_s")
            record["marglik_status"] = tuned["status"]
            record["prior_precision"] = la.prior_precision.detach().cpu().tolist()
    _emit(record)
    if la is None:
        return

    # predictives
    predictives = {
        "glm": lambda: la(X_test, pred_type="glm", link_approx="probit"),
        "nn": lambda: la(X_test, pred_type="nn", link_approx="mc", n_samples=args.nn_samples),
    }
    for phase in args.phases:
        if phase == "fit":
            continue
        torch.manual_seed(args.seed)
        record, probs = _measure(phase, lambda p=phase: predictives[p]().detach(), device)
        if probs is not None:
            problems = _check_probs(probs, args.n_test, C)
            if problems:
                record["warnings"] = problems
        if phase == "nn":
            record["n_samples"] = args.nn_samples
        del probs
        _emit(record)


def worker_main(args: argparse.Namespace):
    """Run the worker; report a setup failure as a JSON record.

    Args:
        args: Parsed command line arguments of the worker.
    """
    with _harness.failures_reported(RESULT_MARKER, phase="setup"):
        run_worker(args)
