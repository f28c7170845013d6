"""Benchmark full-network Laplace approximations: fit, predictive and peak memory.

Compares, on all weights of a classifier (``CrossEntropyLoss``), ``--n-train``
random training points (default 1,024, batch size 128) and ``--n-test`` test
points (default 128):

- ``lowrank_exact`` / ``lowrank_mc``: ``hessian_structure="lowrank_ggn"`` (this
  library, registered with laplace-torch's ``Laplace`` factory by ``import
  lowrank_laplace``) with rank ``--rank`` on the exact GGN (``mc_samples=0``) or a
  1-sample Monte-Carlo GGN (``mc_samples=1``). Also records ``la.kept_fraction``.
- ``{diag,kron,full}_backpack``: laplace-torch with ``backend=BackPackGGN``,
- ``{diag,kron,full}_default``: laplace-torch with its default backend (no
  ``backend`` argument; ``CurvlinopsGGN`` in laplace-torch 0.3). ``full`` is
  skipped (without starting a worker) where the ``D x D`` matrices cannot fit the
  memory cap; the record holds the estimate ``D^2 * 4`` bytes.
- ``lanczos``: top-``--rank`` eigenpairs of the same full-data GGN (sum over the
  training points) by ``scipy.sparse.linalg.eigsh(k=rank, which='LA')`` on
  curvlinops' ``GGNLinearOperator`` over all training batches. Fit-equivalent
  only (no predictive).

Every method runs in a fresh worker process (this script with ``--worker``) with
three phases, each timed and memory-measured separately (imports, model and data
creation are excluded):

1. ``fit``: construct ``Laplace(...)`` and call ``la.fit(train_loader)``,
2. ``glm``: ``la(X_test, pred_type="glm", link_approx="probit")``,
3. ``nn``: ``la(X_test, pred_type="nn", link_approx="mc", n_samples=S)``.

The worker prints one JSON record per phase as soon as the phase ends, so a
failing predictive still reports the fit. Exceptions (including out-of-memory
errors, which the address-space cap ``RLIMIT_AS`` turns into catchable
allocation failures) are recorded per phase. Each phase has its own time limit
(``--timeout``); if a worker times out or is killed during a predictive, the
remaining phases are rerun in a new worker (which refits, untimed for the table).

On a shared machine, ``--wait-for``/``--wait-idle`` delay each worker until other
processes leave the CPU, the CPU time other processes used during each worker is
recorded, and ``--retry-busy`` repeats a disturbed method (keeping the least
disturbed run). ``--resume`` reuses the records of an interrupted run (``--rerun``
selects methods to run again) and ``--replot`` redraws figures and tables from the
JSON files. The worker records a fingerprint of the ``lowrank_laplace`` sources.

Peak memory per phase is the RSS high-water mark of the worker during the phase
(reset before each phase via ``/proc/self/clear_refs``; on CUDA the peak of
allocated device memory). Tables and targets use the peak *above* the memory
held right before the phase (``peak_delta_bytes``: model, data and, for the
predictives, the fitted posterior are excluded); the absolute peak is recorded too.

Targets (printed with PASS/FAIL):

- ``lowrank_exact`` fit time <= 3x ``kron_backpack`` fit time,
- ``lowrank_mc`` fit time < ``kron_backpack`` fit time,
- ``lanczos`` fit time >= 5x ``lowrank_exact`` fit time (same rank),
- GLM predictive peak memory (above the fitted state) of ``lowrank_exact`` on
  ``3c3d`` < 2 GiB.

Examples:
    Smoke test (mlp, 128 training points, rank 20, about a minute; written to
    ``benchmarks/results/quick``)::

        python benchmarks/bench_laplace.py --quick

    Full run on 3c3d, waiting for other benchmarks/tests to leave the CPU::

        python benchmarks/bench_laplace.py --problems 3c3d \\
            --wait-for bench_eigh.py pytest --wait-idle 900

    Continue an interrupted run, with a shorter limit for a slow peer::

        python benchmarks/bench_laplace.py --problems 2c2d --resume \\
            --method-timeout diag_default=600

Results are written to ``<out>/laplace_<problem>.json`` and
``<out>/laplace_<problem>.png``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

_problems = importlib.import_module("_problems")
_harness = importlib.import_module("_harness")
EXPECTED_NUM_PARAMS = _problems.EXPECTED_NUM_PARAMS
NUM_CLASSES = _problems.NUM_CLASSES
PROBLEMS = _problems.PROBLEMS
make_problem = _problems.make_problem
GiB = _harness.GiB
BUSY_WARN_PERCENT = _harness.BUSY_WARN_PERCENT

#: Method name -> specification. ``kind`` is ``'ours'``, ``'laplace'`` (laplace-torch
#: peer) or ``'lanczos'``; ``backend`` is ``'backpack'`` or ``None`` (laplace-torch's
#: default backend).
METHODS: dict[str, dict[str, Any]] = {
    "lowrank_exact": {"kind": "ours", "mc_samples": 0, "label": "lowrank_ggn exact"},
    "lowrank_mc": {"kind": "ours", "mc_samples": 1, "label": "lowrank_ggn MC(1)"},
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

# Targets
REFERENCE = "lowrank_exact"
KRON_PEER = "kron_backpack"
TARGET_EXACT_VS_KRON = 3.0  # exact fit time <= 3x BackPACK-kron fit time
TARGET_LANCZOS_SPEEDUP = 5.0  # Lanczos fit time >= 5x exact fit time
TARGET_GLM_MEMORY_BYTES = 2 * GiB  # GLM predictive peak memory on 3c3d
TARGET_GLM_MEMORY_PROBLEM = "3c3d"

#: Time limit of a worker's start (imports, model and data), at least ``--timeout``.
SETUP_TIMEOUT_S = 300.0

# ``full`` needs about this many D x D float32 matrices (curvature, posterior
# precision and its Cholesky factor / inverse).
FULL_NUM_MATRICES = 3


###############################################################################
#                                  Worker                                     #
###############################################################################


def _emit(record: dict[str, Any]):
    """Print a phase record as one JSON line on stdout.

    Args:
        record: The record.
    """
    sys.stdout.flush()
    print(RESULT_MARKER + json.dumps(record), flush=True)


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
    for path in sorted((REPO_ROOT / "lowrank_laplace").glob("*.py")):
        digest.update(path.name.encode())
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
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        cuda_before = torch.cuda.memory_allocated(device)
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
        record["status"] = "oom" if _harness.is_oom(exc) else "error"
        record["reason"] = f"{type(exc).__name__}: {exc}"[:2000]
        record["traceback"] = traceback.format_exc()[-4000:]
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
        cuda_peak = torch.cuda.max_memory_allocated(device)
        record["cuda_peak_bytes"] = cuda_peak
        record["cuda_before_bytes"] = cuda_before
        record["peak_bytes"] = cuda_peak
        record["peak_delta_bytes"] = max(0, cuda_peak - cuda_before)
    else:
        record["peak_bytes"] = rss_peak
        record["peak_delta_bytes"] = record["rss_peak_delta_bytes"]
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
            hessian_structure="lowrank_ggn", rank=args.rank, mc_samples=spec["mc_samples"]
        )
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
    import numpy as np
    from curvlinops import GGNLinearOperator
    from scipy.sparse.linalg import LinearOperator, eigsh

    params = [p for p in model.parameters() if p.requires_grad]
    op = GGNLinearOperator(
        model,
        nn.CrossEntropyLoss(reduction="sum"),
        params,
        batches,
        check_deterministic=False,
        num_data=n_train,
    ).to_scipy(dtype=np.float32)
    matvec = _harness.CountingMatvec(op.matvec)
    counted = LinearOperator(op.shape, matvec=matvec, dtype=op.dtype)
    evals, evecs = eigsh(counted, k=rank, which="LA")
    order = np.argsort(evals)[::-1].copy()
    return (
        torch.from_numpy(evals[order].copy()),
        torch.from_numpy(evecs[:, order].copy()),
        matvec.count,
    )


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
        args.problem, args.n_train + args.n_test, seed=args.seed, device=device
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

        if str(REPO_ROOT) not in sys.path:
            sys.path.append(str(REPO_ROOT))
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

    record, la = _measure("fit", fit, device)
    if la is not None:
        if spec["kind"] == "ours":
            record["kept_fraction"] = float(la.kept_fraction)
            record["trace"] = float(la.trace)
            evals = la.H[1].detach().double().cpu().sort(descending=True).values
            record["eigenvalues"] = evals.tolist()
        record["H_type"] = type(la.H).__name__
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
    try:
        run_worker(args)
    except Exception as exc:  # noqa: BLE001 (report every failure)
        _emit(
            {
                "phase": "setup",
                "status": "oom" if _harness.is_oom(exc) else "error",
                "reason": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-4000:],
            }
        )


###############################################################################
#                                  Driver                                     #
###############################################################################


def _reader(stream, q: queue.Queue, tail: deque | None = None):
    """Forward the lines of a stream into a queue (``None`` marks the end).

    Args:
        stream: Text stream.
        q: Queue receiving result lines (``None`` to only keep a tail).
        tail: Deque collecting the last lines (``None``: do not collect).
    """
    for line in stream:
        if tail is not None:
            tail.append(line)
        if q is not None:
            q.put(line)
    if q is not None:
        q.put(None)


def _kill(proc: subprocess.Popen):
    """Kill a worker and its process group.

    Args:
        proc: The worker (started in its own session).
    """
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def phase_timeout(method: str, args: argparse.Namespace) -> float:
    """Time limit per phase of a method.

    Args:
        method: Method name.
        args: Parsed command line arguments of the driver.

    Returns:
        The ``--method-timeout`` of the method if given, else ``--timeout``.
    """
    return args.method_timeouts.get(method, args.timeout)


def run_worker_process(
    problem: str, method: str, phases: Sequence[str], args: argparse.Namespace
) -> tuple[dict[str, dict], dict | None, dict[str, Any]]:
    """Run one worker with a time limit per phase and collect its phase records.

    Args:
        problem: Problem name.
        method: Method name.
        phases: Phases after the fit (``'glm'``, ``'nn'``); the fit always runs.
        args: Parsed command line arguments of the driver.

    Returns:
        ``(records, failure, info)``: the phase records received (by phase), the
        failure record of the phase that was running when the worker timed out or
        died (``None`` if every phase reported), and process information
        (wall time, CPU load of other processes during the run).
    """
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        f"--problem={problem}",
        f"--method={method}",
        f"--phases={','.join(phases)}",
        f"--device={args.device}",
        f"--rank={args.rank}",
        f"--n-train={args.n_train}",
        f"--batch-size={args.batch_size}",
        f"--n-test={args.n_test}",
        f"--nn-samples={args.nn_samples}",
        f"--seed={args.seed}",
        f"--threads={args.threads}",
        f"--mem-limit-gib={args.mem_limit_gib}",
    ]
    expected = ["setup", "fit"]
    if METHODS[method]["kind"] != "lanczos":
        expected += [p for p in phases if p != "fit"]
    records: dict[str, dict] = {}
    failure = None

    busy0 = _harness.system_busy_cpu_seconds()
    children0 = _harness.own_cpu_seconds(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=_harness.worker_env(args),
        start_new_session=True,
    )
    lines: queue.Queue = queue.Queue()
    stderr_tail: deque = deque(maxlen=60)
    threads = [
        threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True),
        threading.Thread(target=_reader, args=(proc.stderr, None, stderr_tail), daemon=True),
    ]
    for t in threads:
        t.start()

    timeout = phase_timeout(method, args)
    current = 0  # index of the running phase in ``expected``
    deadline = time.perf_counter() + max(timeout, SETUP_TIMEOUT_S)
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.perf_counter()))
        except queue.Empty:
            _kill(proc)
            limit = timeout if current else max(timeout, SETUP_TIMEOUT_S)
            failure = {
                "phase": expected[current],
                "status": "timeout",
                "reason": f"phase exceeded the time limit of {limit:g} s (worker killed)",
                "time_to_failure_s": limit,
            }
            break
        if line is None:  # stdout closed: the worker ended
            proc.wait()
            if current < len(expected):
                status, reason = _harness.classify_exit(proc.returncode)
                failure = {"phase": expected[current], "status": status, "reason": reason}
            break
        if not line.startswith(RESULT_MARKER):
            continue
        record = json.loads(line[len(RESULT_MARKER) :])
        records[record["phase"]] = record
        if record["phase"] == "setup" and record.get("status") != "ok":
            break  # the worker failed before the fit; it exits
        if record["phase"] in expected:
            current = expected.index(record["phase"]) + 1
        if record["phase"] == "fit" and record.get("status") != "ok":
            expected = expected[:current]  # the worker ends after a failed fit
        if current >= len(expected):
            break  # every phase reported; the worker is exiting
        deadline = time.perf_counter() + timeout
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        _kill(proc)
    for t in threads:
        t.join(timeout=5)
    wall = time.perf_counter() - start

    info: dict[str, Any] = {"subprocess_wall_s": wall}
    busy1 = _harness.system_busy_cpu_seconds()
    if busy0 is not None and busy1 is not None:
        info["other_cpu_percent_during"] = _harness.other_cpu_percent(
            busy1 - busy0, _harness.own_cpu_seconds(resource.RUSAGE_CHILDREN) - children0, wall
        )
    failed = failure is not None or any(r.get("status") != "ok" for r in records.values())
    if failed and stderr_tail:
        info["stderr_tail"] = "".join(stderr_tail)[-2000:]
    return records, failure, info


def _full_estimate(problem: str) -> int:
    """Memory of one ``D x D`` float32 matrix of a problem.

    Args:
        problem: Problem name.

    Returns:
        ``D^2 * 4`` bytes.
    """
    D = EXPECTED_NUM_PARAMS[problem]
    return D * D * 4


def _max_other_load(record: dict[str, Any]) -> float | None:
    """Largest CPU share of other processes during any worker of a method record.

    Args:
        record: Method record.

    Returns:
        Percent of all cores, ``None`` if no worker ran or psutil is missing.
    """
    loads = [w.get("other_cpu_percent_during") for w in record["workers"]]
    loads = [v for v in loads if v is not None]
    return max(loads) if loads else None


def run_method(problem: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run a method; repeat it if other processes competed for the CPU meanwhile.

    Up to ``--retry-busy`` repetitions are made while other processes used more
    than :data:`BUSY_WARN_PERCENT` of the CPU during a run; the least disturbed run
    is kept (``busy_attempt_loads`` lists the load of every attempt).

    Args:
        problem: Problem name.
        method: Method name.
        args: Parsed command line arguments of the driver.

    Returns:
        The method record (see :func:`run_method_once`).
    """
    best, loads = None, []
    for attempt in range(1 + max(0, args.retry_busy)):
        record = run_method_once(problem, method, args)
        load = _max_other_load(record)
        loads.append(load)
        if best is None or (load is not None and load < (_max_other_load(best) or 0.0)):
            best = record
        if load is None or load <= BUSY_WARN_PERCENT:
            break
        if any(r.get("status") == "timeout" for r in record["phases"].values()):
            break  # repeating a run that hit the time limit is not worth it
        if attempt < args.retry_busy:
            print(
                f"  [{problem}] {method}: other processes used {load:.0f}% of the CPU "
                "during the run; repeating it",
                flush=True,
            )
    if len(loads) > 1:
        best["busy_attempt_loads"] = loads
    return best


def run_method_once(problem: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run all phases of one method, restarting the worker after a killed phase.

    Args:
        problem: Problem name.
        method: Method name.
        args: Parsed command line arguments of the driver.

    Returns:
        Record with ``phases`` (phase -> record with ``status`` and, if ``'ok'``,
        ``time_s`` and memory) and process information.
    """
    spec = METHODS[method]
    phases = ("fit",) if spec["kind"] == "lanczos" else PHASES
    record: dict[str, Any] = {
        "problem": problem,
        "method": method,
        "label": spec["label"],
        "kind": spec["kind"],
        "D": EXPECTED_NUM_PARAMS[problem],
        "phases": {},
        "workers": [],
    }

    if spec["kind"] == "laplace" and spec["structure"] == "full":
        need = _full_estimate(problem)
        cap = args.mem_limit_gib * GiB
        if args.mem_limit_gib <= 0 or FULL_NUM_MATRICES * need > cap:
            reason = (
                f"D^2*4 = {need / GiB:,.1f} GiB per D x D matrix "
                f"(x{FULL_NUM_MATRICES}: curvature, precision, factor) exceeds the "
                f"memory cap of {args.mem_limit_gib:g} GiB"
            )
            record["estimated_bytes"] = need
            for phase in phases:
                record["phases"][phase] = {"phase": phase, "status": "skipped", "reason": reason}
            return record

    remaining = list(phases)
    while remaining:
        busy_procs = _harness.wait_for_processes(
            args.wait_for, args.wait_max, poll_s=args.wait_poll
        )
        busy = _harness.wait_for_idle_cpu(args.wait_idle)
        records, failure, info = run_worker_process(problem, method, remaining, args)
        info["cpu_busy_before_percent"] = busy
        if busy_procs:
            info["busy_processes_before"] = busy_procs
        info["phases_requested"] = list(remaining)
        if "setup" in records:
            setup = records.pop("setup")
            info["setup"] = {k: v for k, v in setup.items() if k != "phase"}
            if setup.get("status") != "ok":
                failure = {
                    "phase": "setup",
                    **{k: v for k, v in setup.items() if k != "phase"},
                }
        record["workers"].append(info)

        refit = "fit" not in remaining
        for phase, r in records.items():
            r.update({k: info[k] for k in ("other_cpu_percent_during",) if k in info})
            if phase == "fit" and refit:
                record["phases"]["fit"].setdefault("refits", []).append(
                    {k: r.get(k) for k in ("status", "time_s", "peak_delta_bytes")}
                )
            elif phase in remaining:
                record["phases"][phase] = r
        if failure is not None:
            phase = failure["phase"]
            if "stderr_tail" in info:
                failure["stderr_tail"] = info["stderr_tail"]
            if phase in ("setup", "fit") and not refit:
                target = "fit"
            elif phase in remaining:
                target = phase
            else:  # the refit failed (e.g. it timed out this time)
                target = next(p for p in remaining if p not in records)
                failure["reason"] = f"refit before this phase failed: {failure.get('reason')}"
            record["phases"][target] = {**failure, "phase": target}
        refit_record = records.get("fit") if refit else None
        if failure is None and refit_record is not None and refit_record.get("status") != "ok":
            for target in (p for p in remaining if p not in records):
                record["phases"][target] = {
                    "phase": target,
                    "status": refit_record.get("status"),
                    "reason": f"refit before this phase failed: {refit_record.get('reason')}",
                }
        remaining = [p for p in phases if p not in record["phases"]]
        fit = record["phases"].get("fit")
        if fit is not None and fit.get("status") != "ok":
            for phase in remaining:
                record["phases"][phase] = {
                    "phase": phase,
                    "status": "skipped",
                    "reason": "fit failed",
                }
            break
        if failure is None and remaining:  # should not happen: worker skipped phases
            for phase in remaining:
                record["phases"][phase] = {
                    "phase": phase,
                    "status": "error",
                    "reason": "worker ended without reporting this phase",
                }
            break
    return record


def _phase(records: Sequence[dict], method: str, phase: str) -> dict | None:
    """Find the record of a phase of a method.

    Args:
        records: Method records of a problem.
        method: Method name.
        phase: Phase name.

    Returns:
        The phase record, ``None`` if the method was not run.
    """
    for r in records:
        if r["method"] == method:
            return r["phases"].get(phase)
    return None


def _ok(records: Sequence[dict], method: str, phase: str) -> dict | None:
    """Find the successful record of a phase of a method.

    Args:
        records: Method records of a problem.
        method: Method name.
        phase: Phase name.

    Returns:
        The phase record if it succeeded, else ``None``.
    """
    r = _phase(records, method, phase)
    return r if r is not None and r.get("status") == "ok" else None


def _fmt_cell(r: dict | None, key: str, scale: float = 1.0, fmt: str = "{:.3g}") -> str:
    """Format a table cell: the value of a successful phase or its failure status.

    Args:
        r: Phase record or ``None``.
        key: Value to show.
        scale: Divisor of the value.
        fmt: Format of the value.

    Returns:
        The cell text.
    """
    if r is None:
        return "-"
    if r.get("status") != "ok":
        return str(r.get("status", "fail")).upper()
    value = r.get(key)
    return "-" if value is None else fmt.format(value / scale)


def _verdict(ok: bool | None) -> str:
    """Format the outcome of a target check.

    Args:
        ok: Whether the target is met, ``None`` if it cannot be evaluated.

    Returns:
        ``'PASS'``, ``'FAIL'`` or ``'n/a'``.
    """
    if ok is None:
        return "n/a"
    return "PASS" if ok else "FAIL"


def _rel_dev_eigenvalues(a: Sequence[float], b: Sequence[float], k: int) -> float:
    """Maximum relative deviation of the leading ``k`` eigenvalues of ``a`` from ``b``.

    Args:
        a: Eigenvalues (descending).
        b: Reference eigenvalues (descending).
        k: Number of leading eigenvalues compared.

    Returns:
        ``max_i |a_i - b_i| / |b_i|`` over ``i < k`` (``nan`` if empty).
    """
    devs = [abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a[:k], b[:k])]
    return max(devs) if devs else math.nan


def check_targets(problem: str, records: Sequence[dict]) -> list[dict[str, Any]]:
    """Evaluate the benchmark's targets on one problem.

    A Lanczos run that timed out gives a lower bound on its time, which passes the
    speed-up target if the bound already does.

    Args:
        problem: Problem name.
        records: Method records of the problem.

    Returns:
        One dictionary per target: ``name``, ``value`` (ratio or bytes), ``text``
        and ``passed`` (``None`` if not evaluable).
    """
    targets = []
    ref = _ok(records, REFERENCE, "fit")
    mc = _ok(records, "lowrank_mc", "fit")
    kron = _ok(records, KRON_PEER, "fit")

    def add(name, value, passed, text):
        targets.append({"name": name, "value": value, "passed": passed, "text": text})

    name = f"{REFERENCE} fit <= {TARGET_EXACT_VS_KRON:g}x {KRON_PEER} fit"
    if ref and kron:
        ratio = ref["time_s"] / kron["time_s"]
        add(name, ratio, ratio <= TARGET_EXACT_VS_KRON, f"ratio {ratio:.2f}")
    else:
        add(name, None, None, "missing or failed run")

    name = f"lowrank_mc fit < {KRON_PEER} fit"
    if mc and kron:
        ratio = mc["time_s"] / kron["time_s"]
        add(name, ratio, ratio < 1.0, f"ratio {ratio:.2f}")
    else:
        add(name, None, None, "missing or failed run")

    name = f"lanczos fit >= {TARGET_LANCZOS_SPEEDUP:g}x {REFERENCE} fit"
    lanczos = _phase(records, "lanczos", "fit")
    if ref and lanczos and lanczos.get("status") == "ok":
        ratio = lanczos["time_s"] / ref["time_s"]
        add(name, ratio, ratio >= TARGET_LANCZOS_SPEEDUP, f"speed-up {ratio:.2f}")
    elif ref and lanczos and lanczos.get("status") == "timeout":
        bound = lanczos["time_to_failure_s"] / ref["time_s"]
        passed = True if bound >= TARGET_LANCZOS_SPEEDUP else None
        add(name, bound, passed, f"speed-up > {bound:.2f} (Lanczos timed out)")
    else:
        add(name, None, None, "missing or failed run")

    name = f"{REFERENCE} GLM predictive peak memory < {TARGET_GLM_MEMORY_BYTES / GiB:g} GiB"
    if problem != TARGET_GLM_MEMORY_PROBLEM:
        name += f" (target for {TARGET_GLM_MEMORY_PROBLEM}; informative here)"
    glm = _ok(records, REFERENCE, "glm")
    if glm:
        delta = glm["peak_delta_bytes"]
        passed = delta < TARGET_GLM_MEMORY_BYTES
        text = (
            f"{delta / GiB:.3f} GiB above the fitted state "
            f"({glm['peak_bytes'] / GiB:.2f} GiB absolute process peak)"
        )
        add(name, delta, passed if problem == TARGET_GLM_MEMORY_PROBLEM else None, text)
    else:
        add(name, None, None, "missing or failed run")
    return targets


def summarize(problem: str, records: Sequence[dict], args: argparse.Namespace) -> dict[str, Any]:
    """Print the result table, failures and targets of a problem.

    Args:
        problem: Problem name.
        records: Method records of the problem.
        args: Parsed command line arguments of the driver.

    Returns:
        Summary (targets, eigenvalue deviations, CPU load warnings).
    """
    D, C = EXPECTED_NUM_PARAMS[problem], NUM_CLASSES[problem]
    summary: dict[str, Any] = {}
    print(
        f"\n=== {problem}: D = {D:,}, C = {C}, n_train = {args.n_train} "
        f"(batch {args.batch_size}), n_test = {args.n_test}, rank = {args.rank}, "
        f"NN samples = {args.nn_samples} ==="
    )
    width = max(len(r["method"]) for r in records) + 2
    header = (
        f"{'method':<{width}}{'fit [s]':>10}{'GLM [s]':>10}{'NN [s]':>10}"
        f"{'fit mem':>10}{'GLM mem':>10}{'NN mem':>10}{'GLM abs':>10}{'kept':>8}"
    )
    print("\nTimes in seconds; memory in GiB: peak above the state before the phase")
    print("(GLM abs: absolute peak RSS of the worker during the GLM predictive)\n")
    print(header)
    for r in records:
        m = r["method"]
        fit, glm, nn_ = (r["phases"].get(p) for p in PHASES)
        kept = fit.get("kept_fraction") if fit else None
        row = (
            f"{m:<{width}}"
            f"{_fmt_cell(fit, 'time_s'):>10}{_fmt_cell(glm, 'time_s'):>10}"
            f"{_fmt_cell(nn_, 'time_s'):>10}"
            f"{_fmt_cell(fit, 'peak_delta_bytes', GiB, '{:.2f}'):>10}"
            f"{_fmt_cell(glm, 'peak_delta_bytes', GiB, '{:.2f}'):>10}"
            f"{_fmt_cell(nn_, 'peak_delta_bytes', GiB, '{:.2f}'):>10}"
            f"{_fmt_cell(glm, 'peak_bytes', GiB, '{:.2f}'):>10}"
            f"{'-' if kept is None else f'{kept:.3f}':>8}"
        )
        print(row)
    print("(kept: fraction of the GGN trace held by the kept eigenpairs)")

    fails: dict[tuple, list[str]] = {}  # (method, status, reason, when) -> phases
    for r in records:
        for p, pr in r["phases"].items():
            if pr.get("status") == "ok":
                continue
            when = pr.get("time_to_failure_s")
            when = f" after {when:.1f} s" if when is not None else ""
            key = (r["method"], pr.get("status"), str(pr.get("reason"))[:300], when)
            fails.setdefault(key, []).append(p)
    if fails:
        print("\nFailures and skips:")
        for (m, status, reason, when), phases in fails.items():
            print(f"  {m} {'/'.join(phases)}: {status}{when}: {reason}")
    for r in records:
        for p, pr in r["phases"].items():
            for w in pr.get("warnings", []):
                print(f"  WARNING {r['method']} {p}: {w}")

    # Sanity check (informative): leading eigenvalues of ours vs. Lanczos
    lanczos = _ok(records, "lanczos", "fit")
    summary["eigenvalue_deviation_from_lanczos"] = {}
    if lanczos and lanczos.get("eigenvalues"):
        print("\nLeading GGN eigenvalues vs. Lanczos (max relative deviation, informative):")
        for m in ("lowrank_exact", "lowrank_mc"):
            r = _ok(records, m, "fit")
            if r is None or not r.get("eigenvalues"):
                continue
            devs = {
                k: _rel_dev_eigenvalues(r["eigenvalues"], lanczos["eigenvalues"], k)
                for k in (1, 10, args.rank)
            }
            summary["eigenvalue_deviation_from_lanczos"][m] = devs
            print("  " + m + ": " + ", ".join(f"top {k}: {v:.2e}" for k, v in devs.items()))

    loads = [
        (r["method"], w.get("other_cpu_percent_during"))
        for r in records
        for w in r["workers"]
        if w.get("other_cpu_percent_during") is not None
    ]
    summary["max_other_cpu_percent_during"] = max((v for _, v in loads), default=None)
    # per timed phase (CPU accounting has ~10 ms granularity: phases >= 0.5 s only)
    phase_loads = {
        f"{r['method']} {p}": pr["other_cpu_percent_during_phase"]
        for r in records
        for p, pr in r["phases"].items()
        if pr.get("status") == "ok"
        and pr.get("time_s", 0.0) >= 0.5
        and pr.get("other_cpu_percent_during_phase") is not None
    }
    summary["max_other_cpu_percent_during_timed_phases"] = max(phase_loads.values(), default=None)
    noisy = {k: v for k, v in phase_loads.items() if v > BUSY_WARN_PERCENT}
    if noisy:
        worst = ", ".join(
            f"{k} ({v:.0f}%)" for k, v in sorted(noisy.items(), key=lambda kv: -kv[1])
        )
        print(
            f"\n  WARNING: other processes used more than {BUSY_WARN_PERCENT:g}% of the CPU "
            f"during timed phases: {worst}; these timings may be distorted."
        )
    elif any(v > BUSY_WARN_PERCENT for _, v in loads):
        busy = sorted({m for m, v in loads if v > BUSY_WARN_PERCENT})
        print(
            f"\n  Note: other processes used more than {BUSY_WARN_PERCENT:g}% of the CPU "
            f"during the workers of {busy} (not necessarily during timed phases)."
        )

    targets = check_targets(problem, records)
    summary["targets"] = targets
    print(f"\nTargets ({problem}):")
    for t in targets:
        print(f"  [{_verdict(t['passed']):>4}] {t['name']}: {t['text']}")
    return summary


def plot(problem: str, records: Sequence[dict], path: Path, info: dict[str, Any], args):
    """Bar charts of fit time, predictive times and peak memory per method.

    Failed or skipped phases are drawn as hatched placeholder bars labelled with
    their status.

    Args:
        problem: Problem name.
        records: Method records of the problem.
        path: Output path of the figure.
        info: Machine information.
        args: Parsed command line arguments of the driver.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [r["method"] for r in records]
    panels = [
        ("fit", "fit time [s]"),
        ("glm", "GLM probit predictive time [s]"),
        ("nn", f"NN MC predictive time [s] (S={args.nn_samples})"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.8))
    colors = {"ours": "tab:blue", "laplace": "tab:gray", "lanczos": "tab:orange"}
    kinds = {r["method"]: r["kind"] for r in records}
    x = list(range(len(methods)))

    def bars(ax, phase, value_of, offset=0.0, width=0.8, color=None, label=None, log=True):
        """Draw one bar per method; failures hatched with their status."""
        entries = [_phase(records, m, phase) for m in methods]
        values = [value_of(r) if r and r.get("status") == "ok" else None for r in entries]
        ok_vals = [v for v in values if v is not None and v > 0]
        top = max(ok_vals, default=1.0)
        low = min(ok_vals, default=1.0) if log else 0.0
        for i, (r, v) in enumerate(zip(entries, values)):
            c = color or colors[kinds[methods[i]]]
            if r is None:  # phase does not apply (Lanczos has no predictive)
                if log:
                    ax.text(i + offset, low, "n/a", ha="center", va="bottom", fontsize=7)
                continue
            if v is not None:
                ax.bar(i + offset, v, width, color=c, label=label)
                label = None
                if log:
                    ax.text(i + offset, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
                continue
            status = str(r.get("status"))
            if not log:  # memory panel: a red cross per failed or skipped phase
                ax.plot(i + offset, 0.02 * top, "x", color="tab:red", ms=5)
                continue
            # failed or skipped: hatched bar up to the time of the failure (if known)
            bound = r.get("time_to_failure_s")
            ax.bar(i + offset, bound or top, width, color="none", edgecolor="tab:red", hatch="//")
            text = status.upper() + (f" after {bound:.4g} s" if bound else "")
            ax.text(
                i + offset,
                low,
                text,
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=7,
                color="tab:red",
            )

    for ax, (phase, title) in zip(axes, panels):
        bars(ax, phase, lambda r: r["time_s"])
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)

    ax = axes[3]
    width = 0.27
    for j, (phase, color) in enumerate(
        (("fit", "tab:blue"), ("glm", "tab:green"), ("nn", "tab:purple"))
    ):
        bars(
            ax,
            phase,
            lambda r: r["peak_delta_bytes"] / GiB,
            (j - 1) * width,
            width,
            color,
            phase,
            log=False,
        )
    ax.plot([], [], "x", color="tab:red", label="failed/skipped")
    ax.axhline(TARGET_GLM_MEMORY_BYTES / GiB, color="k", ls="--", lw=1, label="2 GiB")
    ax.set_title("peak memory above the state before the phase [GiB]", fontsize=9)
    ax.legend(fontsize=7)

    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(methods, rotation=60, ha="right", fontsize=7)
        ax.grid(alpha=0.3, axis="y", which="both")
    fig.suptitle(
        f"{problem} (D={EXPECTED_NUM_PARAMS[problem]:,}): Laplace on all weights, "
        f"n_train={args.n_train}, n_test={args.n_test}, rank={args.rank} "
        f"[{info.get('device_name', '')}; hatched: failed/skipped]",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _dump(
    path: Path,
    problem: str,
    records: list[dict],
    info: dict[str, Any],
    args: argparse.Namespace,
    summary: dict[str, Any] | None = None,
):
    """Write the results of a problem to a JSON file.

    Args:
        path: Output path.
        problem: Problem name.
        records: Method records so far.
        info: Machine information.
        args: Parsed command line arguments of the driver.
        summary: Summary from :func:`summarize` (``None`` while running).
    """
    payload = {
        "problem": problem,
        "D": EXPECTED_NUM_PARAMS[problem],
        "C": NUM_CLASSES[problem],
        "n_train": args.n_train,
        "batch_size": args.batch_size,
        "n_test": args.n_test,
        "rank": args.rank,
        "nn_samples": args.nn_samples,
        "methods": list(args.methods),
        "timeout_s_per_phase": args.timeout,
        "method_timeouts_s": args.method_timeouts,
        "mem_limit_gib": args.mem_limit_gib,
        "retry_busy": args.retry_busy,
        "seed": args.seed,
        "threads": args.threads or _harness.num_cores(),
        "worker_env": {
            "OPENBLAS_NUM_THREADS": args.blas_threads or None,
            "OMP_WAIT_POLICY": args.omp_wait_policy or None,
        },
        "machine": info,
        "records": records,
        "summary": summary,
    }
    path.write_text(json.dumps(payload, indent=2))


def _progress(problem: str, record: dict[str, Any]) -> str:
    """One-line description of a method's phases.

    Args:
        problem: Problem name.
        record: Method record.

    Returns:
        The line.
    """
    parts = []
    for phase, r in record["phases"].items():
        if r.get("status") == "ok":
            parts.append(f"{phase} {r['time_s']:.3g} s (+{r['peak_delta_bytes'] / GiB:.2f} GiB)")
        else:
            parts.append(f"{phase} {str(r.get('status')).upper()}")
    fit = record["phases"].get("fit", {})
    if fit.get("kept_fraction") is not None:
        parts.append(f"kept {fit['kept_fraction']:.3f}")
    if fit.get("num_matvecs") is not None:
        parts.append(f"{fit['num_matvecs']} GGNVPs")
    for w in record["workers"]:
        cap = w.get("setup", {}).get("mem_limit_bytes")
        if w.get("setup", {}).get("mem_limit_requested_bytes") and cap:
            parts.append(f"memory cap lowered to {cap / GiB:.1f} GiB (busy machine)")
            break
    return f"  [{problem}] {record['method']:<14} " + ", ".join(parts)


#: Settings that must match for ``--resume`` to reuse a previous record.
RESUME_KEYS = ("n_train", "batch_size", "n_test", "rank", "nn_samples", "seed", "mem_limit_gib")


def _previous_records(path: Path, args: argparse.Namespace) -> dict[str, dict]:
    """Load the method records of a previous run with the same settings.

    Args:
        path: JSON file of the previous run.
        args: Parsed command line arguments of the driver.

    Returns:
        Records by method (empty if there is no file or its settings differ).
    """
    if not path.exists():
        return {}
    payload = json.loads(path.read_text())
    mismatch = [k for k in RESUME_KEYS if payload.get(k) != getattr(args, k)]
    if payload.get("machine", {}).get("device") != args.device:
        mismatch.append("device")
    if mismatch:
        print(f"  --resume: not reusing {path} (different {', '.join(mismatch)})")
        return {}
    return {r["method"]: r for r in payload.get("records", [])}


def driver_main(args: argparse.Namespace) -> dict[str, Any]:
    """Run all methods on all problems, write JSON and figures, print summaries.

    Args:
        args: Parsed command line arguments of the driver.

    Returns:
        Summaries by problem.
    """
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = _harness.machine_info(
        args.device, (*_harness.DEFAULT_PACKAGES, "laplace-torch", "asdfghjkl")
    )
    info["lowrank_laplace_sources"] = library_fingerprint()
    print(
        f"Machine: {info['cpu_name']} ({info['cpu_count']} CPUs, "
        f"{info['cpu_count_usable']} usable), torch {info['torch']}, "
        f"laplace-torch {info.get('version_laplace-torch')}, device {args.device} "
        f"({info['device_name']})"
    )

    summaries = {}
    if args.replot:
        for problem in args.problems:
            json_path = out / f"laplace_{problem}.json"
            if not json_path.exists():
                print(f"--replot: no {json_path}")
                continue
            payload = json.loads(json_path.read_text())
            for key in ("n_train", "batch_size", "n_test", "rank", "nn_samples"):
                setattr(args, key, payload[key])
            records = payload["records"]
            summaries[problem] = summarize(problem, records, args)
            payload["summary"] = summaries[problem]
            json_path.write_text(json.dumps(payload, indent=2))
            png_path = out / f"laplace_{problem}.png"
            plot(problem, records, png_path, payload.get("machine", info), args)
            print(f"\nWrote {json_path} and {png_path}", flush=True)
        return summaries
    for problem in args.problems:
        print(
            f"\n### Problem {problem}: methods = {args.methods}, timeout {args.timeout:g} s "
            f"per phase {args.method_timeouts or ''}, memory cap {args.mem_limit_gib:g} GiB",
            flush=True,
        )
        json_path = out / f"laplace_{problem}.json"
        previous = _previous_records(json_path, args) if args.resume else {}
        records: list[dict[str, Any]] = []
        for method in args.methods:
            if method in previous and method not in args.rerun:
                records.append(previous[method])
                print(_progress(problem, records[-1]) + " (from previous run)", flush=True)
                continue
            records.append(run_method(problem, method, args))
            print(_progress(problem, records[-1]), flush=True)
            _dump(json_path, problem, records, info, args)
        summary = summarize(problem, records, args)
        _dump(json_path, problem, records, info, args, summary)
        png_path = out / f"laplace_{problem}.png"
        plot(problem, records, png_path, info, args)
        print(f"\nWrote {json_path} and {png_path}", flush=True)
        summaries[problem] = summary
    return summaries


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse command line arguments.

    Args:
        argv: Arguments; defaults to ``sys.argv[1:]``.

    Returns:
        Parsed arguments (``--quick`` already applied).
    """
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--problems", nargs="+", default=list(PROBLEMS), choices=PROBLEMS, help="Problems."
    )
    parser.add_argument(
        "--methods", nargs="+", default=list(METHODS), choices=list(METHODS), help="Methods."
    )
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda'.")
    parser.add_argument("--rank", type=int, default=100, help="Rank of lowrank_ggn/Lanczos.")
    parser.add_argument("--n-train", type=int, default=1024, help="Training points.")
    parser.add_argument("--batch-size", type=int, default=128, help="Training batch size.")
    parser.add_argument("--n-test", type=int, default=128, help="Test points (one batch).")
    parser.add_argument(
        "--nn-samples", type=int, default=20, help="Samples of the NN MC predictive."
    )
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="Time limit per phase in seconds."
    )
    parser.add_argument(
        "--method-timeout",
        nargs="*",
        default=[],
        metavar="METHOD=SECONDS",
        help="Time limit per phase for single methods, overriding --timeout "
        "(e.g. diag_default=900 lanczos=3600).",
    )
    parser.add_argument(
        "--mem-limit-gib",
        type=float,
        default=20.0,
        help="Address-space cap (RLIMIT_AS) of CPU workers in GiB, lowered to what the "
        "machine can back; 0: no cap.",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="Output directory (default: benchmarks/results, for --quick "
        "benchmarks/results/quick so that a smoke test keeps the full mlp results).",
    )
    parser.add_argument("--seed", type=int, default=0, help="Random seed.")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads in workers (0: usable cores)."
    )
    parser.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        help="OPENBLAS_NUM_THREADS for NumPy/SciPy in workers (0: do not set).",
    )
    parser.add_argument(
        "--omp-wait-policy", default="PASSIVE", help="OMP_WAIT_POLICY in workers ('' to inherit)."
    )
    parser.add_argument(
        "--wait-for",
        nargs="*",
        default=[],
        metavar="PATTERN",
        help="Before each worker, wait while other processes whose command line contains "
        "one of these strings use CPU (e.g. bench_eigh.py pytest).",
    )
    parser.add_argument(
        "--wait-max", type=float, default=1200.0, help="Maximum wait for --wait-for [s]."
    )
    parser.add_argument(
        "--wait-poll", type=float, default=30.0, help="Polling interval of --wait-for [s]."
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        help="Before each worker, wait up to this many seconds for the CPU to be "
        f"< {BUSY_WARN_PERCENT:g}%% busy; 0: do not wait.",
    )
    parser.add_argument(
        "--retry-busy",
        type=int,
        default=2,
        help="Repeat a method up to this many times if other processes used more than "
        f"{BUSY_WARN_PERCENT:g}%% of the CPU during its run (the least disturbed run is "
        "kept).",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="Reuse the records of methods already in <out>/laplace_<problem>.json from a "
        "run with the same settings (e.g. after an interrupted run).",
    )
    parser.add_argument(
        "--rerun",
        nargs="*",
        default=[],
        choices=list(METHODS),
        metavar="METHOD",
        help="With --resume: run these methods again even if a previous record exists.",
    )
    parser.add_argument(
        "--replot",
        action="store_true",
        help="Run nothing: print the summaries and redraw the figures of the existing "
        "<out>/laplace_<problem>.json files.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Smoke test: mlp, n-train 128, n-test 32, rank 20, 5 NN samples, timeout "
        "120 s, no --retry-busy.",
    )
    # worker-only arguments
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--problem", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--phases", default="fit,glm,nn", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.phases = [p for p in args.phases.split(",") if p]
    args.method_timeouts = {}
    for item in args.method_timeout:
        name, _, value = item.partition("=")
        if name not in METHODS or not value:
            parser.error(f"--method-timeout expects METHOD=SECONDS, got {item!r}.")
        args.method_timeouts[name] = float(value)
    if args.out is None:
        args.out = str(HERE / "results" / "quick") if args.quick else str(HERE / "results")
    if args.quick:
        args.problems = ["mlp"]
        args.n_train, args.n_test, args.rank, args.nn_samples = 128, 32, 20, 5
        args.timeout = min(args.timeout, 120.0)
        args.method_timeouts = {m: min(t, 120.0) for m, t in args.method_timeouts.items()}
        args.retry_busy = 0
    if args.rank < 1 or args.n_train < 1 or args.n_test < 1 or args.batch_size < 1:
        parser.error("--rank, --n-train, --n-test and --batch-size must be positive.")
    return args


def main(argv: Sequence[str] | None = None):
    """Entry point.

    Args:
        argv: Command line arguments; defaults to ``sys.argv[1:]``.
    """
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
    else:
        driver_main(args)


if __name__ == "__main__":
    main()
