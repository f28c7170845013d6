"""Benchmark top-k eigenpairs of the mini-batch GGN (ViViT paper's run-time figure).

Compares the time and peak memory to obtain the top-``k`` eigenpairs of the
mini-batch generalized Gauss-Newton (GGN) matrix of a ``CrossEntropyLoss``
(``reduction='mean'``) for

- ``ours_*``: ``lowrank_laplace.ggn_eigh`` in four variants (exact or 1-sample
  Monte-Carlo GGN, full mini-batch or the first ``N // 8`` samples),
  corresponding to the paper's "vivit exact mb", "vivit exact sub",
  "vivit mc mb" and "vivit mc sub",
- ``power``: PyHessian-style power iteration with deflation on GGN-vector
  products computed with ``torch.func`` (at most 100 products per eigenpair,
  relative tolerance ``1e-3`` on the eigenvalue estimate),
- ``eigsh``: ``scipy.sparse.linalg.eigsh(k=k, which='LA')`` (ARPACK/Lanczos) on
  curvlinops' ``GGNLinearOperator`` (float32, default tolerance).

Every configuration (method, problem, k) runs in a fresh subprocess (this script
with ``--worker``) that reports wall time and memory of the eigen-solver call only
(model and data creation and imports are excluded) as JSON on stdout. Timeouts,
OOM kills and exceptions are recorded as failures and do not abort the run.

The methods and the worker live in ``_eigh_methods.py``; summaries, target checks,
tables and plots in ``_eigh_report.py``.

Examples:
    Smoke test (small MLP, N=32, k in {1, 2})::

        python -m benchmarks.bench_eigh --quick

    Full run of the paper's figure on CPU::

        python -m benchmarks.bench_eigh --problems 3c3d 2c2d --N 128 --N-2c2d 64

Results are written to ``<out>/eigh_<problem>.json`` and
``<out>/eigh_<problem>.png``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _eigh_methods, _harness
from benchmarks._eigh_methods import METHODS, RESULT_MARKER
from benchmarks._eigh_report import plot, summarize
from benchmarks._harness import (
    BUSY_WARN_PERCENT,
    REPO_ROOT,
    GiB,
    machine_info,
    worker_env,
)
from benchmarks._problems import EXPECTED_NUM_PARAMS, NUM_CLASSES, PROBLEMS

###############################################################################
#                                  Driver                                     #
###############################################################################


def run_subprocess(
    problem: str, method: str, N: int, k: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Run one configuration in a fresh Python process.

    Args:
        problem: Problem name.
        method: Method name.
        N: Mini-batch size.
        k: Number of eigenpairs.
        args: Parsed command line arguments of the driver.

    Returns:
        The worker's record, or a failure record (timeout, killed, crash).
    """
    cmd = _harness.module_command(
        "benchmarks.bench_eigh",
        "--worker",
        f"--problem={problem}",
        f"--method={method}",
        f"--N={N}",
        f"--k={k}",
        f"--device={args.device}",
        f"--seed={args.seed}",
        f"--threads={args.threads}",
    )
    if not args.verify:
        cmd.append("--no-verify")
    busy = _harness.wait_for_idle_cpu(args.wait_idle)
    base = {
        "problem": problem,
        "method": method,
        "N": N,
        "k": k,
        "cpu_busy_before_percent": busy,
    }
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=args.timeout,
            cwd=REPO_ROOT,
            env=worker_env(args),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {
            **base,
            "status": "timeout",
            "reason": f"timeout after {args.timeout:.0f} s",
            "subprocess_wall_s": time.perf_counter() - start,
        }
    wall = time.perf_counter() - start

    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            record = json.loads(line[len(RESULT_MARKER) :])
            record["subprocess_wall_s"] = wall
            record["cpu_busy_before_percent"] = busy
            if record.get("status") != "ok" and proc.stderr:
                record["stderr_tail"] = proc.stderr[-2000:]
            return record

    status, reason = _harness.classify_exit(proc.returncode)
    return {
        **base,
        "status": status,
        "reason": reason,
        "returncode": proc.returncode,
        "stderr_tail": proc.stderr[-2000:],
        "subprocess_wall_s": wall,
    }


def run_config(
    problem: str, method: str, N: int, k: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Run one configuration ``--repeats`` times, each in a fresh process.

    Args:
        problem, method, N, k, args: As for :func:`run_subprocess`.

    Returns:
        The record of the first successful run with ``time_s`` replaced by the
        median over successful runs (all times in ``times_s``) and the peak memory
        by the maximum; the first failure record if no run succeeded.
    """
    runs = []
    for _ in range(max(1, args.repeats)):
        runs.append(run_subprocess(problem, method, N, k, args))
        if runs[-1].get("status") in {"timeout", "oom", "killed"}:
            break  # do not waste time on repeating hopeless runs
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return runs[0]
    record = dict(ok[0])
    record["times_s"] = [r["time_s"] for r in ok]
    record["time_s"] = _harness.median(record["times_s"])
    for key in ("peak_delta_bytes", "peak_bytes"):
        record[key] = max(r[key] for r in ok)
    during = [r.get("cpu_others_during_percent") for r in ok]
    during = [d for d in during if d is not None]
    record["cpu_others_during_percent"] = max(during) if during else None
    busy = [r.get("cpu_busy_before_percent") for r in runs]
    busy = [b for b in busy if b is not None]
    record["cpu_busy_before_percent"] = max(busy) if busy else None
    if len(ok) < len(runs):
        record["failed_repeats"] = [
            {"status": r.get("status"), "reason": r.get("reason")}
            for r in runs
            if r.get("status") != "ok"
        ]
    return record


def _dump(
    path: Path,
    problem: str,
    N: int,
    records: list[dict[str, Any]],
    info: dict[str, Any],
    args: argparse.Namespace,
    summary: dict[str, Any] | None = None,
):
    """Write the results of a problem to a JSON file.

    Args:
        path: Output path.
        problem: Problem name.
        N: Mini-batch size used.
        records: All records so far.
        info: Machine information.
        args: Parsed command line arguments of the driver.
        summary: Summary from :func:`summarize` (``None`` while running).
    """
    D, C = EXPECTED_NUM_PARAMS[problem], NUM_CLASSES[problem]
    settings = {
        "problem": problem,
        "N": N,
        "D": D,
        "C": C,
        "V_bytes": D * N * C * 4,
        "ks": list(args.ks),
        "methods": list(args.methods),
        "timeout_s": args.timeout,
        "seed": args.seed,
        "repeats": args.repeats,
    }
    _harness.write_results(path, settings, args, info, records, summary)


def driver_main(args: argparse.Namespace):
    """Run all configurations, write JSON and figures, print the summary.

    Args:
        args: Parsed command line arguments of the driver.
    """
    if args.quick:
        args.problems = ["mlp"]
        args.ks = [1, 2]
        args.N_mlp = 32 if args.N_mlp is None else args.N_mlp
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info(args.device)
    print(
        f"Machine: {info['cpu_name']} ({info['cpu_count']} CPUs, "
        f"{info['cpu_count_usable']} usable), torch {info['torch']}, "
        f"device {args.device} ({info['device_name']})"
    )

    all_summaries = {}
    for problem in args.problems:
        N = getattr(args, f"N_{problem}", None) or args.N
        print(
            f"\n### Problem {problem}: N = {N}, ks = {args.ks}, methods = {args.methods}",
            flush=True,
        )
        records: list[dict[str, Any]] = []
        json_path = out / f"eigh_{problem}.json"

        for k in args.ks:
            for method in args.methods:
                record = run_config(problem, method, N, k, args)
                records.append(record)
                if record.get("status") == "ok":
                    msg = (
                        f"{record['time_s']:9.3f} s, peak +"
                        f"{record['peak_delta_bytes'] / GiB:.2f} GiB, "
                        f"lambda_1 = {record['eigenvalues'][0]:.6g}"
                    )
                    if "num_products" in record:
                        msg += f", {record['num_products']} GGNVPs"
                    others = record.get("cpu_others_during_percent")
                    if others is not None and others > BUSY_WARN_PERCENT:
                        msg += f" [other processes: {others:.0f}% CPU]"
                else:
                    msg = f"{record.get('status', '?').upper()}: {record.get('reason')}"
                print(f"  [{problem} N={N}] {method:<16} k={k:<3} {msg}", flush=True)
                _dump(json_path, problem, N, records, info, args)

        summary = summarize(problem, N, records, args.methods, args.ks)
        _dump(json_path, problem, N, records, info, args, summary)
        png_path = out / f"eigh_{problem}.png"
        plot(problem, N, records, args.methods, args.ks, png_path, info)
        print(f"\nWrote {json_path} and {png_path}")
        all_summaries[problem] = summary
    return all_summaries


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse command line arguments.

    Args:
        argv: Arguments; defaults to ``sys.argv[1:]``.

    Returns:
        Parsed arguments.
    """
    parser = _harness.script_parser(__doc__)
    parser.add_argument(
        "--problems",
        nargs="+",
        default=["3c3d", "2c2d"],
        choices=PROBLEMS,
        help="Problems to benchmark.",
    )
    parser.add_argument("--N", type=int, default=128, help="Mini-batch size.")
    for p in PROBLEMS:
        parser.add_argument(
            f"--N-{p}",
            dest=f"N_{p}",
            type=int,
            default=None,
            help=f"Mini-batch size for {p} (overrides --N).",
        )
    parser.add_argument(
        "--ks",
        nargs="+",
        type=int,
        default=[1, 2, 4, 6, 8, 10],
        help="Numbers of leading eigenpairs.",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=METHODS,
        help="Methods to benchmark.",
    )
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda'.")
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="Time limit per subprocess in seconds.",
    )
    parser.add_argument(
        "--out",
        default=str(_harness.RESULTS_DIR),
        help="Output directory for JSON files and figures.",
    )
    parser.add_argument("--seed", type=int, default=0, help="Random seed.")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads in workers (0: number of usable cores).",
    )
    _harness.add_worker_env_arguments(parser)
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        help="Before each run, wait up to this many seconds for other processes to "
        f"leave the CPU (< {BUSY_WARN_PERCENT:g}%% busy); 0: do not wait.",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="Fresh-process runs per configuration (median time is reported).",
    )
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="Skip the (untimed) check of the returned eigenvectors "
        "with independent GGN-vector products (verify: %(default)s).",
    )
    parser.add_argument(
        "--quick", action="store_true", help="Smoke test: problem mlp, N=32, ks 1 2."
    )
    # worker-only arguments
    parser.add_argument("--problem", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.N = getattr(args, f"N_{args.problem}", None) or args.N
    return args


def main(argv: Sequence[str] | None = None):
    """Entry point (``argv`` defaults to ``sys.argv[1:]``): see :func:`_harness.run_script`."""
    _harness.run_script(argv, parse_args, _eigh_methods.worker_main, driver_main)


if __name__ == "__main__":
    main()
