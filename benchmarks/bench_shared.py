"""Benchmark Laplace where users run it: shared machines, defaults, marglik training.

Problem: scikit-learn's digits and the 64-50-50-10 tanh MLP of ``_laplace_worker``
(``make_digits``: D = 6,310 weights), float32, 1,400 training points in batches of 128,
397 held-out test points. Two parts:

``fit``
    The network is trained to a MAP first (100 full-batch Adam steps, not timed); then
    ``Laplace(model, "classification", subset_of_weights="all", ...)`` is fitted
    (``la.fit(train_loader)``), tuned by ``la.optimize_prior_precision(method="marglik")``
    (laplace-torch's defaults) and evaluated by the GLM probit predictive on the test
    points (test NLL and accuracy). Methods: ``lowrank_ggn`` with its default arguments,
    ``lowrank_ggn`` with ``solver="sketch"``, laplace-torch's ``kron`` and ``diag``
    (default backend). Every configuration runs ``--repeat`` times (default 3), each in a
    fresh process, in rounds over the methods; times are medians.
``train``
    laplace-torch's ``marglik_training`` from a fresh initialisation of the same MLP:
    ``--epochs`` epochs (default 20), ``prior_structure="layerwise"``, Adam with
    ``lr=1e-2`` (``optimizer_kwargs``), ``backend=None`` (laplace-torch's default
    backend), its defaults otherwise (``n_hypersteps=10``, ``marglik_frequency=1``,
    ``n_epochs_burnin=0``, ``lr_hyp=0.1``); ``hessian_structure`` ``lowrank_ggn`` and
    ``kron`` (``full`` with ``--with-full``; several minutes). Recorded: total time, test
    NLL and accuracy of the returned posterior (GLM probit), the learned per-layer prior
    precisions. One run per configuration (a fresh process), to keep the run short.

Conditions: ``quiet`` and ``loaded``: beside a competing process (this script with
``--load-proc``) running a loop of ``--load-size`` x ``--load-size`` float32 matmuls
(default 1500) on ``--load-threads`` torch threads (default 2), started before the
measured worker and killed (its process group) after it. ``fit`` runs both conditions;
``train`` runs ``quiet`` (and ``loaded`` with ``--load``).

The workers run the way a user runs the library: torch's default number of threads and,
unlike the other benchmark scripts, neither ``OMP_WAIT_POLICY`` nor
``OPENBLAS_NUM_THREADS`` set (``--omp-wait-policy PASSIVE --blas-threads 1`` restores the
harness's settings). Imports, data and MAP training are not timed. Peak memory is the
worker's RSS high-water mark. Before every worker the driver records the load average
and the CPU share other processes use (``_harness.other_cpu_load``); during each
measured phase, the CPU share of other processes (not counting the synthetic load) and
of the load. The workers record the git commit of the library and a hash of its
sources.

Targets (printed with PASS/FAIL; ratios within one run):

- ``fit``: ``lowrank_ggn`` (defaults) fit + marglik <= 3x ``kron``'s, quiet;
- ``fit``: ``lowrank_ggn`` loaded <= 3x its own quiet time, and <= 3x ``kron``'s loaded;
- ``train``: ``lowrank_ggn`` marglik_training time <= 3x ``kron``'s (each condition run);
- ``train``: ``lowrank_ggn``'s test NLL <= ``full``'s (with ``--with-full``).

Examples:
    Smoke test (one run each, 2 training epochs, ``benchmarks/results/quick``)::

        python -m benchmarks.bench_shared --quick

    The recorded run (raw JSON and figure into the docs, table records for
    ``render_tables.py``)::

        python -m benchmarks.bench_shared --with-full --load \\
            --out docs/benchmarks/shared --tables-out benchmarks/results/tables

Results: ``<out>/shared.json`` and ``<out>/shared.png``; with ``--tables-out`` the
records ``shared_fit.json``, ``shared_train.json`` and ``shared_targets.json``
(``render_tables.py`` format; their ``sources`` name ``--table-source``/``shared.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import threading
import time
import warnings
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import _harness, _laplace_worker, _load
from benchmarks._harness import BUSY_WARN_PERCENT, REPO_ROOT, GiB

RESULT_MARKER = "__BENCH_SHARED__"
LOAD_MARKER = "__BENCH_SHARED_LOAD__"
N_TRAIN, N_TEST, BATCH_SIZE = 1400, 397, 128
PARTS: tuple[str, ...] = ("fit", "train")
CONDITIONS: tuple[str, ...] = ("quiet", "loaded")
CONDITION_LABELS = {"quiet": "quiet", "loaded": "beside a busy process"}
#: Methods of each part.
FIT_METHODS: tuple[str, ...] = ("lowrank_ggn", "lowrank_ggn_sketch", "kron", "diag")
TRAIN_METHODS: tuple[str, ...] = ("lowrank_ggn", "kron", "full")
LABELS = {"lowrank_ggn": "`lowrank_ggn` (defaults)",
          "lowrank_ggn_sketch": '`lowrank_ggn`, `solver="sketch"`',
          "kron": "`kron`", "diag": "`diag`", "full": "`full`"}
FIT_PHASES: tuple[str, ...] = ("fit", "marglik", "glm")
OURS, PEER = "lowrank_ggn", "kron"
#: Target factors.
TARGET_VS_KRON = 3.0
TARGET_LOADED_VS_QUIET = 3.0
PACKAGES: tuple[str, ...] = (*_harness.DEFAULT_PACKAGES, "laplace-torch")


###############################################################################
#                                  Workers                                    #
###############################################################################


def _emit(record: dict[str, Any]):
    """Print a record as one JSON line on stdout (see :func:`_harness.emit`)."""
    _harness.emit(RESULT_MARKER, record)


def _measure(phase: str, fn, load_pid: int) -> tuple[dict, Any]:
    """Time and memory-measure a phase; separate the synthetic load from others' CPU.

    Args:
        phase: Phase name.
        fn: The phase (no arguments).
        load_pid: Process id of the competing load (``0``: none).

    Returns:
        The record of :func:`_laplace_worker._measure` (``other_cpu_percent_during_phase``
        without the load, whose share is ``load_cpu_percent_during_phase``) and the
        output of ``fn``.
    """
    load0 = _load.process_cpu_seconds(load_pid)
    start = time.perf_counter()
    record, out = _laplace_worker._measure(phase, fn, torch.device("cpu"))
    wall = time.perf_counter() - start
    load1 = _load.process_cpu_seconds(load_pid)
    if load0 is not None and load1 is not None and wall > 0:
        share = 100.0 * (load1 - load0) / (wall * (os.cpu_count() or 1))
        record["load_cpu_percent_during_phase"] = share
        others = record.get("other_cpu_percent_during_phase")
        if others is not None:
            record["other_cpu_percent_during_phase"] = max(0.0, others - share)
    return record, out


def _mlp() -> nn.Sequential:
    """The digits MLP of :func:`_laplace_worker.make_digits` (64-50-50-10, tanh)."""
    return nn.Sequential(nn.Linear(64, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(),
                         nn.Linear(50, 10))


def _digits(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shuffled digits of :func:`_laplace_worker.make_digits` (same order)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    perm = torch.randperm(len(data.target), generator=torch.Generator().manual_seed(seed))[:n]
    return torch.tensor(data.data, dtype=torch.float32)[perm] / 16.0, \
        torch.as_tensor(data.target)[perm]


def _test_metrics(probs: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Test NLL (mean over points) and accuracy of predictive probabilities."""
    probs = probs.detach().double()
    nll = -probs[torch.arange(len(y)), y].clamp_min(1e-300).log().mean()
    return {"test_nll": float(nll), "test_acc": float((probs.argmax(-1) == y).double().mean())}


def _dirty() -> bool | None:
    """Whether ``lowrank_laplace/`` has uncommitted changes (``None``: unknown)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "lowrank_laplace"],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=10,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def run_worker(args: argparse.Namespace):
    """Build the problem, then run and report one configuration's phases.

    Args:
        args: Parsed command line arguments of the worker.
    """
    from torch.utils.data import DataLoader, TensorDataset

    if args.threads:
        torch.set_num_threads(args.threads)
    base = {"part": args.part, "method": args.method}
    setup: dict[str, Any] = {**base, "phase": "setup", "status": "ok",
                             "threads": torch.get_num_threads(),
                             "lowrank_laplace": _laplace_worker.library_fingerprint(),
                             "lowrank_laplace_dirty": _dirty()}
    warnings.filterwarnings("ignore")
    import laplace
    from laplace.marglik_training import marglik_training

    import lowrank_laplace  # noqa: F401 (registers hessian_structure="lowrank_ggn")

    n = N_TRAIN + N_TEST
    if args.part == "fit":  # trained to a MAP (untimed)
        model, _, X, y = _laplace_worker.make_digits(n, N_TRAIN, seed=args.seed)
    else:  # marglik_training trains from a fresh initialisation
        X, y = _digits(n, args.seed)
        torch.manual_seed(args.seed)
        model = _mlp()
    X_train, y_train, X_test, y_test = X[:N_TRAIN], y[:N_TRAIN], X[N_TRAIN:], y[N_TRAIN:]
    setup["D"] = sum(p.numel() for p in model.parameters())
    _harness.preimport((*_harness.DEFAULT_PREIMPORTS, "curvlinops", "asdl"))
    setup["rss_bytes"] = _harness.current_rss_bytes()
    _emit(setup)

    if args.part == "train":
        loader = DataLoader(TensorDataset(X_train, y_train), batch_size=BATCH_SIZE,
                            shuffle=True, generator=torch.Generator().manual_seed(args.seed))

        def train():
            return marglik_training(
                model, loader, "classification", hessian_structure=args.method,
                backend=None, optimizer_kwargs={"lr": 1e-2}, n_epochs=args.epochs,
                prior_structure="layerwise")

        record, out = _measure("train", train, args.load_pid)
        record.update(base)
        if out is not None:
            la, net, margliks, losses = out
            record["prior_precision"] = la.prior_precision.detach().reshape(-1).tolist()
            record["neg_log_marglik"] = [float(m) for m in margliks]
            record["train_loss"] = [float(v) for v in losses]
            record["backend"] = type(getattr(la, "backend", None)).__name__
            record["H_type"] = type(la).__name__
            with torch.no_grad():
                record["map"] = _test_metrics(net(X_test).softmax(-1), y_test)
            probs = la(X_test, pred_type="glm", link_approx="probit")
            record.update(_test_metrics(probs, y_test))
        _emit(record)
        return

    loader = DataLoader(TensorDataset(X_train, y_train), batch_size=BATCH_SIZE)
    kwargs: dict[str, Any] = {"hessian_structure": args.method}
    if args.method.startswith("lowrank_ggn"):
        kwargs["hessian_structure"] = "lowrank_ggn"
        if args.method.endswith("_sketch"):
            kwargs["solver"] = "sketch"

    def fit():
        torch.manual_seed(args.seed)
        la = laplace.Laplace(model, "classification", subset_of_weights="all", **kwargs)
        la.fit(loader)
        return la

    record, la = _measure("fit", fit, args.load_pid)
    record.update(base)
    if la is not None:
        record["H_type"] = type(la).__name__
        record["backend"] = type(getattr(la, "backend", None)).__name__
        for key in ("rank", "fit_path", "kept_fraction"):
            value = getattr(la, key, None)
            if isinstance(value, (int, float, str)) or torch.is_tensor(value):
                record[key] = float(value) if torch.is_tensor(value) else value
    _emit(record)
    if la is None:
        return
    record, _ = _measure("marglik", lambda: la.optimize_prior_precision(method="marglik"),
                         args.load_pid)
    record.update(base)
    if record["status"] == "ok":
        record["prior_precision"] = la.prior_precision.detach().reshape(-1).tolist()[:8]
    _emit(record)
    if record["status"] != "ok":
        return
    record, probs = _measure(
        "glm", lambda: la(X_test, pred_type="glm", link_approx="probit").detach(),
        args.load_pid)
    record.update(base)
    if probs is not None:
        record.update(_test_metrics(probs, y_test))
    _emit(record)


def load_main(args: argparse.Namespace):
    """The competing work: square float32 matmuls on ``--load-threads`` threads.

    Args:
        args: Parsed command line arguments (``load_threads``, ``load_size``).
    """
    _load.matmul_load(args.load_threads, args.load_size, LOAD_MARKER)


def worker_main(args: argparse.Namespace):
    """Run a worker (or, with ``--load-proc``, the competing load)."""
    if args.load_proc:
        load_main(args)
        return
    with _harness.failures_reported(RESULT_MARKER, part=args.part, method=args.method,
                                    phase="setup"):
        run_worker(args)


###############################################################################
#                                  Driver                                     #
###############################################################################


def start_load(args: argparse.Namespace) -> _load.CompetingLoad:
    """Start the competing process of the ``loaded`` condition (this script with ``--load-proc``).

    It runs as a user's busy process would: without our OMP/BLAS settings.

    Args:
        args: Parsed command line arguments of the driver.

    Returns:
        The running load.
    """
    cmd = _harness.module_command(
        "benchmarks.bench_shared", "--worker", "--load-proc",
        f"--load-threads={args.load_threads}", f"--load-size={args.load_size}")
    env = {k: v for k, v in _harness.worker_env(args).items()
           if k not in ("OMP_WAIT_POLICY", "OPENBLAS_NUM_THREADS")}
    return _load.CompetingLoad(cmd, env, LOAD_MARKER)


def config_key(part: str, condition: str, method: str) -> str:
    """Name of a configuration, e.g. ``'fit/quiet/kron'``."""
    return f"{part}/{condition}/{method}"


def run_worker_process(part: str, condition: str, method: str,
                       args: argparse.Namespace) -> dict[str, Any]:
    """Run one configuration in a fresh worker (beside the load if ``loaded``).

    Args:
        part: ``'fit'`` or ``'train'``.
        condition: ``'quiet'`` or ``'loaded'``.
        method: Method name.
        args: Parsed command line arguments of the driver.

    Returns:
        The record: ``setup``, ``phases`` (phase -> record), ``worker_peak_bytes``, the
        machine's state before (``loadavg_before``, ``cpu_busy_before_percent``) and, if
        loaded, ``load``.
    """
    busy = _harness.wait_for_idle_cpu(args.wait_idle)
    record: dict[str, Any] = {"part": part, "condition": condition, "method": method,
                              "loadavg_before": list(os.getloadavg()),
                              "cpu_busy_before_percent": busy, "phases": {}}
    load = start_load(args) if condition == "loaded" else None
    cmd = _harness.module_command(
        "benchmarks.bench_shared", "--worker", f"--part={part}", f"--method={method}",
        f"--epochs={args.epochs}", f"--seed={args.seed}", f"--threads={args.threads}",
        f"--load-pid={load.pid if load else 0}")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO_ROOT, env=_harness.worker_env(args),
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    stderr_tail: deque = deque(maxlen=40)
    readers = [threading.Thread(target=_harness.read_lines, args=(proc.stdout, lines),
                                daemon=True),
               threading.Thread(target=_harness.read_lines,
                                args=(proc.stderr, None, stderr_tail), daemon=True)]
    for t in readers:
        t.start()
    expected = ["setup", *(FIT_PHASES if part == "fit" else ("train",))]
    failure, deadline = None, time.perf_counter() + args.timeout
    while any(p not in record["phases"] and p != "setup" for p in expected[1:]):
        try:
            line = lines.get(timeout=max(0.0, deadline - time.perf_counter()))
        except queue.Empty:
            _harness.kill_group(proc)
            failure = {"status": "timeout", "reason": f"worker exceeded {args.timeout:g} s"}
            break
        if line is None:
            proc.wait()
            status, reason = _harness.classify_exit(proc.returncode)
            failure = {"status": status, "reason": reason}
            break
        if not line.startswith(RESULT_MARKER):
            continue
        entry = json.loads(line[len(RESULT_MARKER):])
        if entry["phase"] == "setup":
            record["setup"] = entry
        else:
            record["phases"][entry["phase"]] = entry
        if entry.get("status") != "ok":
            break
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        _harness.kill_group(proc)
    for t in readers:
        t.join(timeout=5)
    record["subprocess_wall_s"] = time.perf_counter() - start
    if load is not None:
        load_cpu = load.cpu_seconds()
        record["load"] = load.stop()
        if load_cpu is not None:
            record["load"]["cpu_percent_during"] = 100.0 * load_cpu / (
                record["subprocess_wall_s"] * (os.cpu_count() or 1))
    for phase in expected[1:]:
        if phase not in record["phases"]:
            record["phases"][phase] = {"phase": phase, "status": "skipped",
                                       "reason": "an earlier phase failed"}
    if failure is not None:
        failure["stderr_tail"] = "".join(stderr_tail)[-2000:]
        missing = [p for p in expected[1:] if record["phases"][p]["status"] == "skipped"]
        if missing:
            record["phases"][missing[0]] = {"phase": missing[0], **failure}
        else:
            record["setup"] = {"phase": "setup", **failure}
    peaks = [r.get("rss_peak_bytes") for r in (record.get("setup", {}),
                                                *record["phases"].values())]
    peaks = [p for p in peaks if p is not None]
    record["worker_peak_bytes"] = max(peaks) if peaks else None
    return record


def _ok(record: dict | None, phase: str) -> dict | None:
    """A phase's record if it succeeded, else ``None``."""
    if record is None:
        return None
    r = record["phases"].get(phase)
    return r if r and r.get("status") == "ok" else None


def _time(record: dict | None) -> float | None:
    """The measured time: fit + marglik (``fit`` part) or marglik_training (``train``)."""
    if record is None:
        return None
    if record["part"] == "train":
        r = _ok(record, "train")
        return None if r is None else r["time_s"]
    fit, marglik = _ok(record, "fit"), _ok(record, "marglik")
    return None if fit is None or marglik is None else fit["time_s"] + marglik["time_s"]


def _metrics(record: dict | None) -> dict | None:
    """The phase that holds the test metrics (``glm`` or ``train``), if it succeeded."""
    if record is None:
        return None
    return _ok(record, "glm" if record["part"] == "fit" else "train")


def median_record(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record of repeated runs: the run of median total time, every phase's median.

    Args:
        runs: Records of one configuration.

    Returns:
        The combined record (``repeat_time_s`` lists the totals of the runs).
    """
    if len(runs) == 1:
        return {**runs[0], "repeats": 1}
    totals = sorted((t, i) for i, r in enumerate(runs) if (t := _time(r)) is not None)
    base = runs[totals[(len(totals) - 1) // 2][1]] if totals else runs[0]
    record = json.loads(json.dumps(base))
    for phase, entry in record["phases"].items():
        values = [r["phases"][phase]["time_s"] for r in runs if _ok(r, phase)]
        if entry.get("status") == "ok" and values:
            entry["time_s"] = statistics.median(values)
            entry["repeat_time_s"] = values
        others = [r["phases"][phase].get("other_cpu_percent_during_phase") for r in runs]
        others = [v for v in others if v is not None]
        if others:  # the most disturbed of the runs
            entry["other_cpu_percent_during_phase"] = max(others)
    record["repeat_total_s"] = [t for t, _ in totals]
    record["repeats"] = len(runs)
    record["worker_peak_bytes"] = max((r["worker_peak_bytes"] for r in runs
                                       if r.get("worker_peak_bytes")), default=None)
    return record


def _find(records: Sequence[dict], part: str, condition: str, method: str) -> dict | None:
    for r in records:
        if (r["part"], r["condition"], r["method"]) == (part, condition, method):
            return r
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _others(record: dict) -> float | None:
    """Largest CPU share of other processes (not the load) during a measured phase."""
    values = [r.get("other_cpu_percent_during_phase") for r in record["phases"].values()
              if r.get("status") == "ok"]
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _status(record: dict | None) -> str:
    """Short description of why a configuration has no time."""
    if record is None:
        return "not run"
    for r in (record.get("setup", {}), *record["phases"].values()):
        if r.get("status") not in ("ok", "skipped", None):
            reason = str(r.get("reason") or "").splitlines()
            return f"{r['status']}: {reason[0][:60]}" if reason else r["status"]
    return "-"


def summarize(records: Sequence[dict]) -> dict[str, Any]:
    """Ratios and targets of a run.

    Args:
        records: Configuration records (repeats combined).

    Returns:
        ``ratios`` (by configuration key: time over kron's in the same condition and,
        if loaded, over the method's own quiet time) and ``targets`` (name, where,
        value, bound, ``passed``; ``None``: not measurable).
    """
    ratios: dict[str, dict] = {}
    for r in records:
        peer = _find(records, r["part"], r["condition"], PEER)
        quiet = _find(records, r["part"], "quiet", r["method"])
        ratios[config_key(r["part"], r["condition"], r["method"])] = {
            "vs_kron": _ratio(_time(r), _time(peer)),
            "vs_own_quiet": _ratio(_time(r), _time(quiet)) if r["condition"] != "quiet"
            else None}
    targets = []

    def add(name, where, value, bound):
        targets.append({"name": name, "where": where, "value": value, "bound": bound,
                        "passed": None if value is None else value <= bound})

    fit = "digits, fit + marglik"
    add(f"{OURS} <= {TARGET_VS_KRON:g}x {PEER}'s", f"{fit}, quiet",
        ratios.get(config_key("fit", "quiet", OURS), {}).get("vs_kron"), TARGET_VS_KRON)
    if _find(records, "fit", "loaded", OURS) is not None:
        add(f"{OURS} beside a busy process <= {TARGET_LOADED_VS_QUIET:g}x its quiet time",
            fit, ratios[config_key("fit", "loaded", OURS)]["vs_own_quiet"],
            TARGET_LOADED_VS_QUIET)
        add(f"{OURS} <= {TARGET_VS_KRON:g}x {PEER}'s", f"{fit}, beside a busy process",
            ratios[config_key("fit", "loaded", OURS)]["vs_kron"], TARGET_VS_KRON)
    for condition in CONDITIONS:
        if _find(records, "train", condition, OURS) is None:
            continue
        add(f"{OURS} <= {TARGET_VS_KRON:g}x {PEER}'s",
            f"digits, marglik_training, {CONDITION_LABELS[condition]}",
            ratios[config_key("train", condition, OURS)]["vs_kron"], TARGET_VS_KRON)
        ours = _metrics(_find(records, "train", condition, OURS))
        full = _metrics(_find(records, "train", condition, "full"))
        if _find(records, "train", condition, "full") is not None:
            value = None if ours is None or full is None else \
                ours["test_nll"] / full["test_nll"]
            add(f"{OURS}'s test NLL <= full's (ratio)",
                f"digits, marglik_training, {CONDITION_LABELS[condition]}", value, 1.0)
    return {"ratios": ratios, "targets": targets}


def _row_line(r: dict, ratios: dict) -> str:
    t, m = _time(r), _metrics(r) or {}
    ratio = ratios[config_key(r["part"], r["condition"], r["method"])]
    peak = r.get("worker_peak_bytes")
    parts = [f"{r['part']:<5} {r['condition']:<6} {r['method']:<18}",
             f"{_fmt(t) if t is not None else _status(r):>10} s",
             f"{_fmt(ratio['vs_kron'])}x kron",
             f"{_fmt(ratio['vs_own_quiet'])}x own quiet" if r["condition"] != "quiet" else "",
             f"NLL {_fmt(m.get('test_nll'), 4)}", f"acc {_fmt(m.get('test_acc'), 3)}",
             f"peak {'-' if peak is None else f'{peak / GiB:.2f}'} GiB",
             f"others {_fmt(_others(r), 2)}%"]
    return "  " + ", ".join(p for p in parts if p)


def print_summary(records: Sequence[dict], summary: dict[str, Any]):
    """Print the results and the targets."""
    print("\nResults (fit: median of the runs of fit + marglik; train: one run of "
          "marglik_training):")
    for r in records:
        print(_row_line(r, summary["ratios"]), flush=True)
    for t in summary["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}x"
        print(f"  TARGET [{t['where']}] {t['name']}: {value} -> "
              f"{'PASS' if t['passed'] else 'FAIL' if t['passed'] is False else 'n/a'}",
              flush=True)
    others = [v for v in (_others(r) for r in records) if v is not None]
    if others and max(others) > BUSY_WARN_PERCENT:
        print(f"  WARNING: other processes used up to {max(others):.0f}% of the CPU during "
              "a measured phase; timings may be inflated.", flush=True)


def plot(payload: dict[str, Any], path: Path):
    """Bar charts: fit + marglik time, marglik_training time (log scales), test NLL.

    Args:
        payload: The run as written to ``shared.json``.
        path: Output path of the figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = payload["records"]
    colors = {"quiet": "tab:blue", "loaded": "tab:orange"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    panels = [("fit", "fit + marglik [s] (median of runs)", _time),
              ("train", "marglik_training [s] (one run)", _time),
              (None, "test NLL, GLM probit (quiet runs)", None)]
    for ax, (part, label, value_of) in zip(axes, panels):
        if part is None:
            rows = [(r, r["part"] + "\n" + r["method"].replace("_sketch", "\nsketch"))
                    for r in records if r["condition"] == "quiet"]
            for i, (r, _) in enumerate(rows):
                m = _metrics(r)
                if m is None:
                    ax.plot(i, 0.0, "x", color="tab:red", ms=9)
                    continue
                color = "tab:green" if r["part"] == "fit" else "tab:purple"
                ax.bar(i, m["test_nll"], 0.7, color=color)
                ax.text(i, m["test_nll"], f"{m['test_nll']:.3f}", ha="center", va="bottom",
                        fontsize=7)
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels([name for _, name in rows], fontsize=7)
            ax.set_ylabel(label)
            continue
        methods = [m for m in (FIT_METHODS if part == "fit" else TRAIN_METHODS)
                   if any(r["part"] == part and r["method"] == m for r in records)]
        for i, method in enumerate(methods):
            for j, condition in enumerate(CONDITIONS):
                r = _find(records, part, condition, method)
                if r is None:
                    continue
                x = i + (j - 0.5) * 0.4
                value = value_of(r)
                if value is None:
                    ax.plot(x, 1.0, "x", color="tab:red", ms=9)
                    continue
                ax.bar(x, value, 0.4, color=colors[condition])
                ax.text(x, value, f"{value:.3g}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(methods)))
        ax.set_xticklabels([m.replace("_sketch", "\nsketch") for m in methods], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel(label)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[c]) for c in CONDITIONS]
    fig.legend(handles, [CONDITION_LABELS[c] for c in CONDITIONS], loc="upper right",
               fontsize=8, ncol=2)
    info = payload["machine"]
    fig.suptitle(f"digits MLP (D = {payload['settings'].get('D', '?')}), {N_TRAIN} / "
                 f"{N_TEST} points; {info.get('cpu_name')} ({info.get('cpu_count_usable')} "
                 f"cores), torch {info.get('torch')}, commit "
                 f"{payload['git_head'][:7]}; red x: failed", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table_records(payload: dict[str, Any], source: str) -> dict[str, dict]:
    """The docs' table records (``render_tables.py`` format) of a run.

    Args:
        payload: The run as written to ``shared.json``.
        source: Path of the kept raw run, relative to the repository root.

    Returns:
        Records by table id: ``shared_fit``, ``shared_train`` (if run) and
        ``shared_targets``.
    """
    info, records, summary = payload["machine"], payload["records"], payload["summary"]
    machine = {key: info.get(key) for key in (
        "cpu_name", "cpu_count", "cpu_count_usable", "device", "device_name",
        "total_memory_bytes", "platform")}
    versions = {"python": info.get("python"), "torch": info.get("torch")}
    versions.update({key[len("version_"):]: value for key, value in info.items()
                     if key.startswith("version_")})
    prints = [r["setup"]["lowrank_laplace"] for r in records
              if r.get("setup", {}).get("lowrank_laplace")]
    heads = sorted({f.get("git_head", "?")[:7] for f in prints}) or [payload["git_head"][:7]]
    dirty = any(r.get("setup", {}).get("lowrank_laplace_dirty") for r in records)
    versions["lowrank_laplace commit"] = ", ".join(heads) + (
        " (sources changed during the run)"
        if len({f.get("sources_sha1") for f in prints}) > 1 else "") + (
        " with uncommitted changes" if dirty else "")
    common = {"date": info["date"][:10], "machine": machine, "versions": versions,
              "sources": [source]}
    tables: dict[str, dict] = {}
    fit_rows, train_rows = [], []
    for r in records:
        t, m = _time(r), _metrics(r) or {}
        ratio = summary["ratios"][config_key(r["part"], r["condition"], r["method"])]
        peak = r.get("worker_peak_bytes")
        others = _others(r)
        vs_kron = "-" if r["method"] == PEER or ratio["vs_kron"] is None else \
            _fmt(ratio["vs_kron"]) + "x"
        vs_quiet = "-" if ratio["vs_own_quiet"] is None else _fmt(ratio["vs_own_quiet"]) + "x"
        common_cells = [CONDITION_LABELS[r["condition"]], LABELS[r["method"]]]
        tail = [_fmt(m.get("test_nll"), 4), _fmt(m.get("test_acc"), 3),
                "-" if peak is None else f"{peak / GiB:.2f}",
                "-" if others is None else f"{others:.0f}"]
        if r["part"] == "fit":
            fit, marglik = _ok(r, "fit"), _ok(r, "marglik")
            prior = (marglik or {}).get("prior_precision") or []
            fit_rows.append([*common_cells,
                             _fmt(fit["time_s"]) if fit else _status(r),
                             _fmt(marglik["time_s"]) if marglik else "-",
                             _fmt(t), vs_kron, vs_quiet, *tail[:2],
                             _fmt(prior[0]) if len(prior) == 1 else "-", *tail[2:]])
        else:
            prior = m.get("prior_precision") or []
            train_rows.append([*common_cells, _fmt(t) if t is not None else _status(r),
                               vs_kron, vs_quiet, *tail[:2],
                               ", ".join(f"{p:.3g}" for p in prior) or "-", *tail[2:]])
    s = payload["settings"]
    tables["shared_fit"] = {
        **common,
        "note": f"Median of {s['repeat']} fresh processes per row; D = {s.get('D')}.",
        "columns": ["machine", "method", "fit [s]", "marglik [s]", "fit + marglik [s]",
                    "/ kron's", "/ own quiet", "test NLL", "test acc.", "prior prec.",
                    "worker peak RSS [GiB]", "others' CPU [%]"],
        "rows": fit_rows}
    if train_rows:
        tables["shared_train"] = {
            **common, "note": "One run (a fresh process) per row.",
            "columns": ["machine", "method", "marglik_training [s]", "/ kron's",
                        "/ own quiet", "test NLL", "test acc.",
                        "prior precisions (per parameter tensor)",
                        "worker peak RSS [GiB]", "others' CPU [%]"],
            "rows": train_rows}
    target_rows = []
    for t in summary["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "not measurable"}[t["passed"]]
        target_rows.append([t["name"], t["where"],
                            "-" if t["value"] is None else f"{t['value']:.2f}x", verdict])
    tables["shared_targets"] = {**common, "note": "Ratios within one run.",
                                "columns": ["target", "where", "measured", "verdict"],
                                "rows": target_rows}
    return tables


def plan(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """The ``(part, condition, method)`` configurations, in run order."""
    configs = []
    if "fit" in args.parts:
        configs += [("fit", c, m) for c in args.conditions for m in args.fit_methods]
    if "train" in args.parts:
        conditions = [c for c in args.conditions if c == "quiet" or args.load]
        methods = [m for m in TRAIN_METHODS if m != "full" or args.with_full]
        configs += [("train", c, m) for c in conditions for m in methods]
    return configs


def _settings(args: argparse.Namespace, records: Sequence[dict]) -> dict[str, Any]:
    setup = next((r["setup"] for r in records if r.get("setup", {}).get("status") == "ok"),
                 {})
    return {"problem": "digits MLP 64-50-50-10 tanh", "D": setup.get("D"),
            "n_train": N_TRAIN, "n_test": N_TEST, "batch_size": BATCH_SIZE,
            "dtype": "float32", "repeat": args.repeat, "train_repeat": 1,
            "epochs": args.epochs, "threads": args.threads or "torch default",
            "worker_threads": setup.get("threads"), "load_threads": args.load_threads,
            "load_size": args.load_size, "timeout_s": args.timeout, "seed": args.seed,
            "configurations": [config_key(*c) for c in plan(args)]}


def driver_main(args: argparse.Namespace) -> dict[str, Any]:
    """Run every configuration, write JSON, figure and tables, print the targets.

    Args:
        args: Parsed command line arguments of the driver.

    Returns:
        The summary.
    """
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "shared.json"
    started = time.perf_counter()
    if args.replot:
        payload = json.loads(path.read_text())
    else:
        info = _harness.machine_info("cpu", PACKAGES)
        info["lowrank_laplace_sources"] = _laplace_worker.library_fingerprint()
        info["lowrank_laplace_dirty"] = _dirty()
        info["loadavg_at_start"] = list(os.getloadavg())
        info["cpu_busy_at_start_percent"] = _harness.other_cpu_load(interval=2.0)
        head = info["lowrank_laplace_sources"].get("git_head", "?")
        print(f"Machine: {info['cpu_name']} ({info['cpu_count_usable']} usable cores), torch "
              f"{info['torch']}, laplace-torch {info.get('version_laplace-torch')}; commit "
              f"{head[:7]}{' (dirty)' if info['lowrank_laplace_dirty'] else ''}; load "
              f"average {info['loadavg_at_start'][0]:.2f}, CPU busy "
              f"{info['cpu_busy_at_start_percent']}% before the run", flush=True)
        configs = plan(args)
        runs: dict[str, list] = {config_key(*c): [] for c in configs}
        print(f"{len(configs)} configurations: fit rows {args.repeat} run(s) each (median), "
              f"train rows 1 run each", flush=True)

        def payload_of(summary):
            records = [median_record(runs[k]) for k in runs if runs[k]]
            return {"settings": _settings(args, records), "machine": info, "git_head": head,
                    "worker_env": {"OPENBLAS_NUM_THREADS": args.blas_threads or None,
                                   "OMP_WAIT_POLICY": args.omp_wait_policy or None},
                    "records": records, "summary": summary,
                    "total_wall_s": time.perf_counter() - started}

        order = [c for round_ in range(args.repeat) for c in configs
                 if c[0] == "fit" or round_ == 0]
        for i, config in enumerate(order):
            key = config_key(*config)
            record = run_worker_process(*config, args)
            runs[key].append(record)
            t, m = _time(record), _metrics(record) or {}
            print(f"  [{i + 1}/{len(order)}] {key}: "
                  f"{_fmt(t) if t is not None else _status(record)} s, NLL "
                  f"{_fmt(m.get('test_nll'), 4)}, load avg before "
                  f"{record['loadavg_before'][0]:.2f}, others {_fmt(_others(record), 2)}%",
                  flush=True)
            path.write_text(json.dumps(payload_of(None), indent=2))
        payload = payload_of(None)
    payload["summary"] = summarize(payload["records"])
    path.write_text(json.dumps(payload, indent=2))
    plot(payload, out / "shared.png")
    print_summary(payload["records"], payload["summary"])
    print(f"Wrote {path} and {out / 'shared.png'}", flush=True)
    if args.tables_out:
        tables_dir = Path(args.tables_out)
        tables_dir.mkdir(parents=True, exist_ok=True)
        for table_id, rec in table_records(payload, f"{args.table_source}/shared.json").items():
            (tables_dir / f"{table_id}.json").write_text(json.dumps(rec, indent=2) + "\n")
        print(f"Wrote the table records to {tables_dir}/", flush=True)
    return payload["summary"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse command line arguments.

    Args:
        argv: Arguments; defaults to ``sys.argv[1:]``.

    Returns:
        Parsed arguments.
    """
    parser = _harness.script_parser(__doc__)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS,
                        help="fit: fit + marglik; train: marglik_training.")
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS),
                        choices=CONDITIONS, help="quiet, or loaded (beside a busy process).")
    parser.add_argument("--fit-methods", nargs="+", default=list(FIT_METHODS),
                        choices=FIT_METHODS, help="Methods of the fit part.")
    parser.add_argument("--with-full", action="store_true",
                        help="marglik_training with hessian_structure='full' too (minutes).")
    parser.add_argument("--load", action="store_true",
                        help="marglik_training beside the busy process too.")
    parser.add_argument("--epochs", type=int, default=20, help="marglik_training epochs.")
    parser.add_argument("--repeat", type=int, default=3,
                        help="Fresh processes per fit configuration (median).")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads in workers (0: torch's default).")
    parser.add_argument("--load-threads", type=int, default=2,
                        help="torch threads of the busy process.")
    parser.add_argument("--load-size", type=int, default=1500,
                        help="Matrix size of the busy process's matmuls.")
    _harness.add_worker_env_arguments(parser)
    # the user's environment, not the harness's settings (see the module docstring)
    parser.set_defaults(blas_threads=0, omp_wait_policy="")
    parser.add_argument("--timeout", type=float, default=1500.0,
                        help="Time limit of a worker in seconds.")
    parser.add_argument("--wait-idle", type=float, default=0.0,
                        help="Before each worker, wait up to this many seconds for the CPU "
                        f"to be < {BUSY_WARN_PERCENT:g}%% busy; 0: do not wait.")
    parser.add_argument("--seed", type=int, default=0, help="Random seed.")
    parser.add_argument("--out", default=None,
                        help="Output directory (default: benchmarks/results/shared, with "
                        "--quick benchmarks/results/quick).")
    parser.add_argument("--tables-out", default=None,
                        help="Write the docs' table records here (e.g. "
                        "benchmarks/results/tables).")
    parser.add_argument("--table-source", default="docs/benchmarks/shared",
                        help="Where the raw run is kept (named as the tables' source).")
    parser.add_argument("--replot", action="store_true",
                        help="Run nothing: summary, figure and tables of <out>/shared.json.")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke test: one run per configuration, 2 training epochs.")
    # worker-only arguments
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--load-pid", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--load-proc", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = str(_harness.RESULTS_DIR / ("quick" if args.quick else "shared"))
    if args.quick and not args.worker:
        args.repeat, args.epochs = 1, min(args.epochs, 2)
    return args


def main(argv: Sequence[str] | None = None):
    """Entry point (``argv`` defaults to ``sys.argv[1:]``): see :func:`_harness.run_script`."""
    _harness.run_script(argv, parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
