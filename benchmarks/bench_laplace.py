"""Benchmark full-network Laplace approximations: fit, predictive and peak memory.

Compares, on all weights of a classifier (``CrossEntropyLoss``), ``--n-train``
random training points (default 1,024, batch size 128) and ``--n-test`` test
points (default 128):

- ``lowrank_exact`` / ``lowrank_mc``: ``hessian_structure="lowrank_ggn"`` (this
  library, registered with laplace-torch's ``Laplace`` factory by ``import
  lowrank_laplace``) with rank ``--rank`` on the exact GGN (``mc_samples=0``) or a
  1-sample Monte-Carlo GGN (``mc_samples=1``). Also records ``la.kept_fraction``.
- ``lowrank_default``: the exact fit with the library's default arguments (no
  ``solver``: ``"auto"`` picks the sketch, streaming or the dense sum by cost), graded
  against the exact fit's bounds. The record names the path taken (``fit_path``).
- ``lowrank_exact_sketch`` / ``lowrank_mc_sketch``: the same fits with the opt-in,
  approximate ``solver="sketch"`` (one-pass Nyström sketch), graded against the same
  bounds, with the trace they keep next to streaming's.
- ``lowrank_exact_lowmem``: the exact fit with ``low_memory=True`` (two passes per
  micro-batch, never a whole micro-batch's ``V``).
- ``{diag,kron,full}_backpack``: laplace-torch with ``backend=BackPackGGN``,
- ``{diag,kron,full}_default``: laplace-torch with its default backend (no
  ``backend`` argument; ``CurvlinopsGGN`` in laplace-torch 0.3). ``full`` is
  skipped (without starting a worker) where the ``D x D`` matrices cannot fit the
  memory cap; the record holds the estimate ``D^2 * 4`` bytes.
- problems: the synthetic ``3c3d``, ``2c2d`` and ``mlp`` of ``_problems.py``, and
  ``digits`` (scikit-learn's digits, a 64-50-50-10 tanh MLP of 6,310 weights trained
  to a MAP first; e.g. ``--n-train 1400 --batch-size 64``). With ``--marglik`` each
  fit record also holds the time of laplace-torch's marglik prior tuning. With
  ``--warm-fit`` every worker fits once untimed before the measured fit (its time is
  recorded as ``first_fit_s``): on a GPU the process's first fit also loads the CUDA
  kernels and library handles it touches first, which a notebook or a
  ``marglik_training`` loop pays once.
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

- ``lowrank_exact`` fit time <= 2x ``kron_backpack`` fit time (3c3d, 2c2d, mlp), and
  with ``--marglik`` fit + marglik tuning <= 3x ``kron_backpack``'s; the same bounds
  for ``lowrank_default``,
- ``lowrank_mc`` fit time <= 0.5x ``kron_backpack`` fit time (3c3d, 2c2d; 1x else),
- ``lanczos`` fit time >= 5x ``lowrank_exact`` fit time (same rank),
- GLM predictive peak memory (above the fitted state) of ``lowrank_exact`` on
  ``3c3d`` < 2 GiB.

Examples:
    Smoke test (mlp, 128 training points, rank 20, about a minute; written to
    ``benchmarks/results/quick``)::

        python -m benchmarks.bench_laplace --quick

    Full run on 3c3d, waiting for other benchmarks/tests to leave the CPU::

        python -m benchmarks.bench_laplace --problems 3c3d \\
            --wait-for bench_eigh pytest --wait-idle 900

    Continue an interrupted run, with a shorter limit for a slow peer::

        python -m benchmarks.bench_laplace --problems 2c2d --resume \\
            --method-timeout diag_default=600

Results are written to ``<out>/laplace_<problem>.json`` and
``<out>/laplace_<problem>.png``.

The worker side lives in ``_laplace_worker.py``; summaries, targets and figures
in ``_laplace_report.py``.
"""

from __future__ import annotations

import argparse
import copy
import json
import queue
import resource
import statistics
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _harness
from benchmarks._harness import BUSY_WARN_PERCENT, REPO_ROOT, RESULTS_DIR, GiB
from benchmarks._laplace_report import _progress, plot, summarize
from benchmarks._laplace_worker import (
    EXPECTED_NUM_PARAMS,
    METHODS,
    NUM_CLASSES,
    PHASES,
    PROBLEMS,
    RESULT_MARKER,
    library_fingerprint,
    worker_main,
)

#: Time limit of a worker's start (imports, model and data), at least ``--timeout``.
SETUP_TIMEOUT_S = 300.0

# ``full`` needs about this many D x D float32 matrices (curvature, posterior
# precision and its Cholesky factor / inverse).
FULL_NUM_MATRICES = 3


###############################################################################
#                                  Driver                                     #
###############################################################################


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
    cmd = _harness.module_command(
        "benchmarks.bench_laplace",
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
    )
    if args.marglik:
        cmd.append("--marglik")
    if args.warm_fit:
        cmd.append("--warm-fit")
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
        threading.Thread(target=_harness.read_lines, args=(proc.stdout, lines), daemon=True),
        threading.Thread(target=_harness.read_lines, args=(proc.stderr, None, stderr_tail),
                         daemon=True),
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
            _harness.kill_group(proc)
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
        _harness.kill_group(proc)
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


def median_record(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from repeated runs of a method: the median time of every phase.

    The record is the run whose fit time is the median (its memory, eigenvalues and
    other fields stay as measured); each phase's ``time_s`` (and the fit's
    ``marglik_time_s``) becomes the median over the runs in which the phase succeeded,
    and ``repeat_times_s`` lists them all.

    Args:
        runs: Records of the same method (one or more).

    Returns:
        The combined record (the record itself for a single run).
    """
    if len(runs) == 1:
        return runs[0]

    def times(phase: str, key: str = "time_s") -> list[float]:
        return [r["phases"][phase][key] for r in runs
                if r["phases"].get(phase, {}).get("status") == "ok"
                and r["phases"][phase].get(key) is not None]

    fits = times("fit")
    middle = sorted(fits)[(len(fits) - 1) // 2] if fits else None
    base = next((r for r in runs if fits and r["phases"]["fit"].get("time_s") == middle),
                runs[0])
    record = copy.deepcopy(base)
    for phase, entry in record["phases"].items():
        for key in ("time_s", "marglik_time_s"):
            values = times(phase, key)
            if entry.get("status") == "ok" and values and key in entry:
                entry[key] = statistics.median(values)
                entry[f"repeat_{key}"] = values
    record["repeats"] = len(runs)
    return record


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
    settings = {
        "problem": problem,
        "D": EXPECTED_NUM_PARAMS[problem],
        "C": NUM_CLASSES[problem],
        "n_train": args.n_train,
        "batch_size": args.batch_size,
        "n_test": args.n_test,
        "rank": args.rank,
        "nn_samples": args.nn_samples,
        "marglik": args.marglik,
        "warm_fit": args.warm_fit,
        "methods": list(args.methods),
        "timeout_s_per_phase": args.timeout,
        "method_timeouts_s": args.method_timeouts,
        "mem_limit_gib": args.mem_limit_gib,
        "retry_busy": args.retry_busy,
        "repeat": args.repeat,
        "seed": args.seed,
    }
    _harness.write_results(path, settings, args, info, records, summary)


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
        todo = []
        for method in args.methods:
            if method in previous and method not in args.rerun:
                records.append(previous[method])
                print(_progress(problem, records[-1]) + " (from previous run)", flush=True)
            else:
                todo.append(method)
        runs: dict[str, list] = {method: [] for method in todo}
        for repeat in range(args.repeat):  # rounds: a drifting machine hits every method
            for method in todo:
                runs[method].append(run_method(problem, method, args))
                suffix = f" (run {repeat + 1} of {args.repeat})" if args.repeat > 1 else ""
                print(_progress(problem, runs[method][-1]) + suffix, flush=True)
        for method in todo:
            records.append(median_record(runs[method]))
            _dump(json_path, problem, records, info, args)
        records.sort(key=lambda r: args.methods.index(r["method"]))
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
    parser = _harness.script_parser(__doc__)
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
        "--marglik",
        action="store_true",
        help="After each fit, also time laplace-torch's marglik prior tuning "
        "(optimize_prior_precision(method='marglik'), default settings).",
    )
    parser.add_argument(
        "--warm-fit",
        action="store_true",
        help="Fit once untimed in each worker before the measured fit (recorded as "
        "first_fit_s): the measured fit then finds the device's kernels loaded.",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads in workers (0: usable cores)."
    )
    _harness.add_worker_env_arguments(parser)
    parser.add_argument(
        "--wait-for",
        nargs="*",
        default=[],
        metavar="PATTERN",
        help="Before each worker, wait while other processes whose command line contains "
        "one of these strings use CPU (e.g. bench_eigh pytest).",
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
        "--repeat",
        type=int,
        default=1,
        help="Run every method this many times (fresh processes, in rounds over the "
        "methods) and record the median time of each phase.",
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
        args.out = str(RESULTS_DIR / "quick") if args.quick else str(RESULTS_DIR)
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
    """Entry point (``argv`` defaults to ``sys.argv[1:]``): see :func:`_harness.run_script`."""
    _harness.run_script(argv, parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
