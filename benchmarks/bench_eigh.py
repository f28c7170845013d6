"""Benchmark top-k eigenpairs of the mini-batch GGN (ViViT paper's run-time figure).

Time and peak memory of ``ggn_eigh`` in the paper's four variants and a two-pass one,
PyHessian-style power iteration and SciPy's ``eigsh`` on curvlinops' GGN operator
(``_eigh_methods.py``), every configuration in fresh workers.

Examples::

    python -m benchmarks.bench_eigh --quick   # small MLP, N=32, k in {1, 2}
    python -m benchmarks.bench_eigh --problems 3c3d 2c2d --N 128 --N-2c2d 64

Writes ``<out>/eigh_<problem>.json`` and ``<out>/eigh_<problem>.png``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _harness
from benchmarks._eigh_methods import METHODS, worker_main
from benchmarks._eigh_report import plot, summarize
from benchmarks._problems import EXPECTED_NUM_PARAMS, NUM_CLASSES, PROBLEMS
from benchmarks._report import machine_info, print_machine


def flat(record: dict[str, Any]) -> dict[str, Any]:
    """A configuration's record as the report reads it: its ``eigh`` phase on top."""
    setup, phase = record.get("setup", {}), record["phases"]["eigh"]
    out = {k: v for k, v in record.items() if k not in ("phases", "setup")}
    out.update({k: setup[k] for k in ("D", "C", "label") if k in setup}, **phase)
    if setup.get("status") != "ok":  # the phase was skipped: say why
        out.update({k: setup.get(k) for k in ("status", "reason")})
    return out


def driver_main(args: argparse.Namespace) -> dict[str, Any]:
    """Run all configurations, write JSON and figures; the summaries by problem."""
    out = Path(args.out)
    info = machine_info(args.device)
    print_machine(info)
    summaries = {}
    for problem in args.problems:
        N = getattr(args, f"N_{problem}", None) or args.N
        print(f"\n### Problem {problem}: N = {N}, ks = {args.ks}, methods = {args.methods}",
              flush=True)
        D, C = EXPECTED_NUM_PARAMS[problem], NUM_CLASSES[problem]
        settings = {"problem": problem, "N": N, "D": D, "C": C, "V_bytes": D * N * C * 4,
                    "ks": list(args.ks), "methods": list(args.methods), "device": args.device,
                    "timeout_s": args.timeout, "seed": args.seed, "repeats": args.repeat,
                    "threads": args.threads}
        configs = [{"problem": problem, "method": method, "N": N, "k": k,
                    "device": args.device, "seed": args.seed, "threads": args.threads,
                    "verify": args.verify, "phases": ["eigh"]}
                   for k in args.ks for method in args.methods]
        plan = _harness.Plan("benchmarks.bench_eigh", configs, ("method", "k"),
                             out / f"eigh_{problem}.json", settings, info)
        plan.label = f"{problem} N={N}"
        records = plan.run(args)
        rows = [flat(r) for r in records]
        summaries[problem] = summarize(problem, N, rows, args.methods, args.ks)
        plan.write(records, summaries[problem], args)
        plot(problem, N, rows, args.methods, args.ks, out / f"eigh_{problem}.png", info)
        print(f"\nWrote {plan.path} and {out / f'eigh_{problem}.png'}")
    return summaries


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv``; default ``sys.argv[1:]``)."""
    parser = _harness.script_parser(
        __doc__, "device", "timeout", "out", "seed", "threads", "blas_threads",
        "omp_wait_policy", "repeat", "wait_for", "wait_max", "wait_poll", "wait_idle",
        "retry_busy", out=str(_harness.RESULTS_DIR))
    parser.add_argument("--problems", nargs="+", default=["3c3d", "2c2d"], choices=PROBLEMS,
                        help="Problems to benchmark.")
    parser.add_argument("--N", type=int, default=128, help="Mini-batch size.")
    for p in PROBLEMS:
        parser.add_argument(f"--N-{p}", dest=f"N_{p}", type=int, default=None,
                            help=f"Mini-batch size for {p} (overrides --N).")
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 6, 8, 10],
                        help="Numbers of leading eigenpairs.")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                        help="Methods to benchmark.")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="Skip the (untimed) check of the returned eigenvectors with "
                        "independent GGN-vector products (verify: %(default)s).")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke test: problem mlp, N=32, ks 1 2.")
    args = parser.parse_args(argv)
    if args.quick:
        args.problems, args.ks = ["mlp"], [1, 2]
        args.N_mlp = 32 if args.N_mlp is None else args.N_mlp
    return args


main = _harness.script_main(parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
