"""Benchmark full-network Laplace approximations: fit, predictive and peak memory.

Every method of :data:`METHODS` (``lowrank_ggn`` variants; laplace-torch's
``diag``, ``kron`` and ``full`` with BackPACK or the default backend; ``eigsh`` on
curvlinops' GGN) on all weights of a problem of ``_problems.py``, in fresh workers. The
phases, each timed with its peak memory above the state before it: ``fit`` (with
``--marglik`` also the marglik prior tuning; with ``--warm-fit`` after an untimed first
fit), the GLM probit predictive ``glm`` and the NN MC predictive ``nn``. ``full`` is
skipped where its ``D x D`` matrices exceed the memory cap; the predictives after a
killed one run in a new worker (:func:`run_method`).

Examples::

    python -m benchmarks.bench_laplace --quick   # mlp, 128 points, rank 20
    python -m benchmarks.bench_laplace --problems 3c3d --wait-for bench_eigh pytest \\
        --wait-idle 900
    python -m benchmarks.bench_laplace --problems 2c2d --resume \\
        --method-timeout diag_default=600

Writes ``<out>/laplace_<problem>.json`` and ``<out>/laplace_<problem>.png``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import _harness, _problems, _worker
from benchmarks._laplace_report import PHASES, plot, summarize
from benchmarks._problems import LAPLACE_NUM_CLASSES, LAPLACE_NUM_PARAMS, LAPLACE_PROBLEMS
from benchmarks._report import DEFAULT_PACKAGES, machine_info, print_machine, read_run
from benchmarks._worker import GiB, emit, measure

#: Method name -> specification. ``kind`` is ``'ours'``, ``'laplace'`` (laplace-torch
#: peer) or ``'lanczos'``; ``backend`` is ``'backpack'`` or ``None`` (laplace-torch's
#: default backend).
METHODS: dict[str, dict[str, Any]] = {
    "lowrank_exact": {"kind": "ours", "mc_samples": 0, "label": "lowrank_ggn exact"},
    "lowrank_mc": {"kind": "ours", "mc_samples": 1, "label": "lowrank_ggn MC(1)"},
    "lowrank_default": {"kind": "ours", "mc_samples": 0, "solver": None,
                        "label": "lowrank_ggn, default arguments"},
    "lowrank_exact_sketch": {"kind": "ours", "mc_samples": 0, "solver": "sketch",
                             "label": "lowrank_ggn exact, sketch"},
    "lowrank_mc_sketch": {"kind": "ours", "mc_samples": 1, "solver": "sketch",
                          "label": "lowrank_ggn MC(1), sketch"},
    "lowrank_exact_lowmem": {"kind": "ours", "mc_samples": 0, "low_memory": True,
                             "label": "lowrank_ggn exact, low_memory"},
    "diag_backpack": {"kind": "laplace", "structure": "diag", "backend": "backpack",
                      "label": "diag BackPackGGN"},
    "diag_default": {"kind": "laplace", "structure": "diag", "backend": None,
                     "label": "diag default backend"},
    "kron_backpack": {"kind": "laplace", "structure": "kron", "backend": "backpack",
                      "label": "kron BackPackGGN"},
    "kron_default": {"kind": "laplace", "structure": "kron", "backend": None,
                     "label": "kron default backend"},
    "full_backpack": {"kind": "laplace", "structure": "full", "backend": "backpack",
                      "label": "full BackPackGGN"},
    "full_default": {"kind": "laplace", "structure": "full", "backend": None,
                     "label": "full default backend"},
    "lanczos": {"kind": "lanczos", "label": "eigsh on curvlinops GGN"},
}


def laplace_kwargs(method: str, config: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of ``laplace.Laplace`` for a method of ours or laplace-torch's."""
    spec = METHODS[method]
    kwargs: dict[str, Any] = {"subset_of_weights": "all"}
    if spec["kind"] == "ours":
        kwargs.update(hessian_structure="lowrank_ggn", rank=config["rank"],
                      mc_samples=spec["mc_samples"], low_memory=spec.get("low_memory", False),
                      solver=spec.get("solver", "streaming"))
        if kwargs["solver"] is None:  # the library's default solver
            del kwargs["solver"]
    else:
        kwargs["hessian_structure"] = spec["structure"]
        if spec["backend"] == "backpack":
            from laplace.curvature import BackPackGGN

            kwargs["backend"] = BackPackGGN
    return kwargs


def fit_fields(la: Any, kind: str, config: dict[str, Any], device: torch.device) -> dict:
    """What a fit record holds besides its measurement (and the timed marglik tuning)."""
    fields: dict[str, Any] = {"H_type": type(la.H).__name__}
    if kind == "ours":
        fields.update(kept_fraction=float(la.kept_fraction), trace=float(la.trace),
                      eigenvalues=la.H[1].detach().double().cpu().sort(
                          descending=True).values.tolist())
    if getattr(la, "fit_path", None) is not None:
        fields["fit_path"] = la.fit_path
    if config["marglik"]:  # laplace-torch's default marglik prior tuning, timed apart
        tuned, _ = measure("marglik", lambda: la.optimize_prior_precision(method="marglik"),
                           device)
        fields.update(marglik_time_s=tuned.get("time_s"), marglik_status=tuned["status"],
                      prior_precision=la.prior_precision.detach().cpu().tolist())
    return fields


def worker_main(config: dict[str, Any]):
    """Run the fit (always, also before the predictives of a rerun; with ``warm_fit`` after
    an untimed first fit, ``first_fit_s``) and the requested predictives of one method."""
    from torch.utils.data import DataLoader, TensorDataset

    setup = _worker.worker_setup(config)
    device = torch.device(config["device"])
    torch.manual_seed(config["seed"])
    spec, n_train = METHODS[config["method"]], config["n_train"]
    model, _, X, y = _problems.make_laplace_problem(
        config["problem"], n_train + config["n_test"], n_train, seed=config["seed"], device=device)
    loader = DataLoader(TensorDataset(X[:n_train], y[:n_train]),
                        batch_size=config["batch_size"], shuffle=False)
    setup.update(D=sum(p.numel() for p in model.parameters() if p.requires_grad),
                 C=LAPLACE_NUM_CLASSES[config["problem"]])
    if spec["kind"] == "lanczos":
        import curvlinops  # noqa: F401
    else:
        import laplace

        import lowrank_laplace  # noqa: F401 (registers hessian_structure="lowrank_ggn")

        kwargs = laplace_kwargs(config["method"], config)
        setup["laplace_kwargs"] = {k: getattr(v, "__name__", v) for k, v in kwargs.items()}
    _worker.preimport(_worker.LAPLACE_PREIMPORTS)
    emit(setup)

    if spec["kind"] == "lanczos":
        batches = list(loader)
        record, out = measure("fit", lambda: _worker.ggn_eigsh(
            model, nn.CrossEntropyLoss(reduction="sum"), batches, n_train, config["rank"]),
            device)
        if out is not None:
            record.update(num_matvecs=out[2], eigenvalues=out[0].double().tolist(),
                          eigenvectors_shape=list(out[1].shape))
        emit(record)
        return

    def fit():
        torch.manual_seed(config["seed"])
        la = laplace.Laplace(model, "classification", **kwargs)
        la.fit(loader)
        return la

    # the process's first fit apart (kernels, handles); the record is the next one's
    first = measure("fit", fit, device)[0] if config["warm_fit"] else None
    record, la = measure("fit", fit, device)
    if first is not None:
        record["first_fit_s"] = first.get("time_s")
    if la is not None:
        record.update(fit_fields(la, spec["kind"], config, device))
    emit(record)
    if la is None:
        return
    X_test, n_test, C = X[n_train:], config["n_test"], LAPLACE_NUM_CLASSES[config["problem"]]
    predictives = {
        "glm": lambda: la(X_test, pred_type="glm", link_approx="probit").detach(),
        "nn": lambda: la(X_test, pred_type="nn", link_approx="mc",
                         n_samples=config["nn_samples"]).detach()}
    for phase in [p for p in config["phases"] if p != "fit"]:
        torch.manual_seed(config["seed"])
        record, probs = measure(phase, predictives[phase], device)
        if probs is not None:
            record.update(_worker.probs_warnings(n_test, C)(probs))
        if phase == "nn":
            record["n_samples"] = config["nn_samples"]
        del probs
        emit(record)


# ``full`` needs about this many D x D float32 matrices (curvature, posterior
# precision and its Cholesky factor / inverse).
FULL_NUM_MATRICES = 3
#: Settings that must match for ``--resume`` to reuse a previous record.
RESUME_KEYS = ("n_train", "batch_size", "n_test", "rank", "nn_samples", "seed",
               "mem_limit_gib")


def full_skip(problem: str, args: argparse.Namespace) -> str | None:
    """Why ``full`` cannot run on a problem: its ``D x D`` matrices exceed the memory cap."""
    need = LAPLACE_NUM_PARAMS[problem] ** 2 * 4
    if args.mem_limit_gib > 0 and FULL_NUM_MATRICES * need <= args.mem_limit_gib * GiB:
        return None
    return (f"D^2*4 = {need / GiB:,.1f} GiB per D x D matrix (x{FULL_NUM_MATRICES}: "
            f"curvature, precision, factor) exceeds the memory cap of "
            f"{args.mem_limit_gib:g} GiB")


def configurations(problem: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One configuration per method of a problem."""
    configs = []
    for method in args.methods:
        spec = METHODS[method]
        config = {"problem": problem, "method": method, "label": spec["label"],
                  "kind": spec["kind"], "D": LAPLACE_NUM_PARAMS[problem],
                  "phases": ["fit"] if spec["kind"] == "lanczos" else list(PHASES),
                  "timeout": args.method_timeouts.get(method, args.timeout),
                  **{k: getattr(args, k) for k in (
                      "device", "rank", "n_train", "batch_size", "n_test", "nn_samples",
                      "seed", "threads", "mem_limit_gib", "marglik", "warm_fit")}}
        if spec.get("structure") == "full" and full_skip(problem, args):
            config.update(skip=full_skip(problem, args),
                          estimated_bytes=LAPLACE_NUM_PARAMS[problem] ** 2 * 4)
        configs.append(config)
    return configs


def run_method(module: str, config: dict[str, Any], args: argparse.Namespace) -> dict:
    """Run a method; the predictives after one whose worker was killed run in a new worker,
    which refits first (the fit's ``refits``; ``restarts`` lists the new workers)."""
    record = _harness.run_worker(module, config, args)
    while record["phases"]["fit"].get("status") == "ok":
        lost = [p for p in config["phases"] if record["phases"][p]["status"] == "skipped"]
        if not lost:
            break
        more = _harness.run_worker(module, {**config, "phases": lost}, args)
        refit = more["phases"].pop("fit", None)
        if refit is not None:
            record["phases"]["fit"].setdefault("refits", []).append(
                {k: refit.get(k) for k in ("status", "time_s", "peak_delta_bytes")})
        failed = None if refit and refit.get("status") == "ok" else \
            refit or more["phases"][lost[0]]  # the refit failed, or its worker died
        for phase in lost:
            record["phases"][phase] = more["phases"][phase] if failed is None else {
                "phase": phase, "status": failed.get("status"),
                "reason": f"refit before this phase failed: {failed.get('reason')}"}
        record.setdefault("restarts", []).append(
            {k: more.get(k) for k in ("setup", "subprocess_wall_s", "other_cpu_percent_during",
                                      "cpu_busy_before_percent")})
        loads = [w.get("other_cpu_percent_during") for w in (record, *record["restarts"])]
        record["other_cpu_percent_during"] = max((v for v in loads if v is not None),
                                                 default=None)
    return record


def replot(args: argparse.Namespace) -> dict[str, Any]:
    """Summaries and figures of the existing ``<out>/laplace_<problem>.json`` files."""
    summaries = {}
    for problem in args.problems:
        path = Path(args.out) / f"laplace_{problem}.json"
        payload = read_run(path)
        if payload is None:
            continue
        settings = payload.get("settings", payload)  # older files hold them on top
        for key in ("n_train", "batch_size", "n_test", "rank", "nn_samples"):
            setattr(args, key, settings[key])
        summaries[problem] = payload["summary"] = summarize(problem, payload["records"], args)
        path.write_text(json.dumps(payload, indent=2))
        plot(problem, payload["records"], path.with_suffix(".png"), payload["machine"], args)
        print(f"\nWrote {path} and {path.with_suffix('.png')}", flush=True)
    return summaries


def driver_main(args: argparse.Namespace) -> dict[str, Any]:
    """Run all methods on all problems, write JSON and figures; the summaries by problem."""
    if args.replot:
        return replot(args)
    info = machine_info(args.device, (*DEFAULT_PACKAGES, "laplace-torch",
                                      "asdfghjkl"))
    print_machine(info)
    summaries = {}
    for problem in args.problems:
        print(f"\n### Problem {problem}: methods = {args.methods}, timeout {args.timeout:g} s "
              f"per phase {args.method_timeouts or ''}, memory cap {args.mem_limit_gib:g} GiB",
              flush=True)
        settings = {"problem": problem, "D": LAPLACE_NUM_PARAMS[problem],
                    "C": LAPLACE_NUM_CLASSES[problem], "device": args.device,
                    "methods": list(args.methods), "timeout_s_per_phase": args.timeout,
                    "method_timeouts_s": args.method_timeouts, **{k: getattr(args, k) for k in (
                        "n_train", "batch_size", "n_test", "rank", "nn_samples", "marglik",
                        "warm_fit", "mem_limit_gib", "retry_busy", "repeat", "seed",
                        "threads")}}
        plan = _harness.Plan("benchmarks.bench_laplace", configurations(problem, args),
                             ("method",), Path(args.out) / f"laplace_{problem}.json",
                             settings, info)
        plan.run_one, plan.label = run_method, problem
        records = plan.run(args, RESUME_KEYS)
        summaries[problem] = summarize(problem, records, args)
        plan.write(records, summaries[problem], args)
        plot(problem, records, plan.path.with_suffix(".png"), info, args)
        print(f"\nWrote {plan.path} and {plan.path.with_suffix('.png')}", flush=True)
    return summaries


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv``; default ``sys.argv[1:]``), ``--quick`` applied."""
    parser = _harness.script_parser(
        __doc__, "device", "timeout", "mem_limit_gib", "out", "seed", "threads",
        "blas_threads", "omp_wait_policy", "wait_for", "wait_max", "wait_poll", "wait_idle",
        "retry_busy", "repeat", "resume", "rerun", "replot", mem_limit_gib=20.0,
        retry_busy=2)
    parser.add_argument("--problems", nargs="+", default=list(LAPLACE_PROBLEMS),
                        choices=LAPLACE_PROBLEMS, help="Problems.")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS),
                        help="Methods.")
    parser.add_argument("--rank", type=int, default=100, help="Rank of lowrank_ggn/Lanczos.")
    parser.add_argument("--n-train", type=int, default=1024, help="Training points.")
    parser.add_argument("--batch-size", type=int, default=128, help="Training batch size.")
    parser.add_argument("--n-test", type=int, default=128, help="Test points (one batch).")
    parser.add_argument("--nn-samples", type=int, default=20,
                        help="Samples of the NN MC predictive.")
    parser.add_argument("--method-timeout", nargs="*", default=[], metavar="METHOD=SECONDS",
                        help="Time limit per phase for single methods, overriding --timeout "
                        "(e.g. diag_default=900 lanczos=3600).")
    parser.add_argument("--marglik", action="store_true",
                        help="After each fit, also time laplace-torch's marglik prior tuning "
                        "(optimize_prior_precision(method='marglik'), default settings).")
    parser.add_argument("--warm-fit", action="store_true",
                        help="Fit once untimed in each worker before the measured fit "
                        "(recorded as first_fit_s): the measured fit then finds the "
                        "device's kernels loaded.")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke test: mlp, n-train 128, n-test 32, rank 20, 5 NN samples, "
                        "timeout 120 s, no --retry-busy.")
    args = parser.parse_args(argv)
    args.method_timeouts = {}
    for item in args.method_timeout:
        name, _, value = item.partition("=")
        if name not in METHODS or not value:
            parser.error(f"--method-timeout expects METHOD=SECONDS, got {item!r}.")
        args.method_timeouts[name] = float(value)
    if args.out is None:
        args.out = str(_harness.RESULTS_DIR / ("quick" if args.quick else ""))
    if args.quick:
        args.problems = ["mlp"]
        args.n_train, args.n_test, args.rank, args.nn_samples = 128, 32, 20, 5
        args.timeout = min(args.timeout, 120.0)
        args.method_timeouts = {m: min(t, 120.0) for m, t in args.method_timeouts.items()}
        args.retry_busy = 0
    if args.rank < 1 or args.n_train < 1 or args.n_test < 1 or args.batch_size < 1:
        parser.error("--rank, --n-train, --n-test and --batch-size must be positive.")
    return args


main = _harness.script_main(parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
