"""Benchmark Laplace where users run it: shared machines, defaults, marglik training.

The digits MLP of ``bench_laplace`` (1,400 training and 397 test points). Part ``fit``:
the ``Laplace`` fit of the MAP network, marglik prior tuning and the GLM probit
predictive, ``--repeat`` runs each (medians); part ``train``: laplace-torch's
``marglik_training`` from scratch with ``lowrank_ggn`` and ``kron`` (``full`` with
``--with-full``), one run each. Conditions: ``quiet``, and ``loaded`` beside a
``_load.CompetingLoad`` (``train`` only with ``--load``). The workers run as a user
does: torch's default threads, neither ``OMP_WAIT_POLICY`` nor ``OPENBLAS_NUM_THREADS``.

Examples::

    python -m benchmarks.bench_shared --quick   # one run each, 2 epochs
    python -m benchmarks.bench_shared --with-full --load \\
        --out docs/benchmarks/shared --tables-out benchmarks/results/tables

Writes ``<out>/shared.json`` and ``<out>/shared.png``; with ``--tables-out`` the records
``shared_fit.json``, ``shared_train.json`` and ``shared_targets.json`` (their ``sources``
name ``--table-source``).
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import _harness
from benchmarks._problems import digits_data, digits_mlp, make_digits
from benchmarks._report import DEFAULT_PACKAGES, machine_info, print_machine, read_run, write_tables
from benchmarks._shared_report import (
    BATCH_SIZE,
    CONDITIONS,
    FIT_METHODS,
    FIT_PHASES,
    N_TEST,
    N_TRAIN,
    PARTS,
    TRAIN_METHODS,
    plot,
    print_summary,
    summarize,
    table_records,
)
from benchmarks._worker import LAPLACE_PREIMPORTS, run_phases, worker_setup


def test_metrics(probs: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Test NLL (mean over points) and accuracy of predictive probabilities."""
    probs = probs.detach().double()
    nll = -probs[torch.arange(len(y)), y].clamp_min(1e-300).log().mean()
    return {"test_nll": float(nll), "test_acc": float((probs.argmax(-1) == y).double().mean())}


def fit_phases(model: torch.nn.Module, data: list, config: dict[str, Any]) -> list[tuple]:
    """The ``fit`` part's phases: fit, marglik prior tuning, GLM predictive."""
    import laplace
    from torch.utils.data import DataLoader, TensorDataset

    X_train, y_train, X_test, y_test = data
    loader = DataLoader(TensorDataset(X_train, y_train), batch_size=BATCH_SIZE)
    kwargs: dict[str, Any] = {"hessian_structure": config["method"]}
    if config["method"].startswith("lowrank_ggn"):
        kwargs["hessian_structure"] = "lowrank_ggn"
        if config["method"].endswith("_sketch"):
            kwargs["solver"] = "sketch"
    state: dict[str, Any] = {}

    def fit():
        torch.manual_seed(config["seed"])
        state["la"] = laplace.Laplace(model, "classification", subset_of_weights="all",
                                      **kwargs)
        state["la"].fit(loader)
        return state["la"]

    def fitted(la) -> dict[str, Any]:
        fields = {"H_type": type(la).__name__,
                  "backend": type(getattr(la, "backend", None)).__name__}
        for key in ("rank", "fit_path", "kept_fraction"):
            value = getattr(la, key, None)
            if isinstance(value, (int, float, str)) or torch.is_tensor(value):
                fields[key] = float(value) if torch.is_tensor(value) else value
        return fields

    def marglik():
        state["la"].optimize_prior_precision(method="marglik")
        return {"prior_precision": state["la"].prior_precision.detach().reshape(-1).tolist()[:8]}

    def glm():
        return state["la"](X_test, pred_type="glm", link_approx="probit").detach()

    return [("fit", fit, fitted), ("marglik", marglik, dict),
            ("glm", glm, lambda probs: test_metrics(probs, y_test))]


def train_phases(model: torch.nn.Module, data: list, config: dict[str, Any]) -> list[tuple]:
    """The ``train`` part's phase: laplace-torch's ``marglik_training`` from scratch."""
    from laplace.marglik_training import marglik_training
    from torch.utils.data import DataLoader, TensorDataset

    X_train, y_train, X_test, y_test = data
    loader = DataLoader(TensorDataset(X_train, y_train), batch_size=BATCH_SIZE, shuffle=True,
                        generator=torch.Generator().manual_seed(config["seed"]))

    def train():
        return marglik_training(
            model, loader, "classification", hessian_structure=config["method"],
            backend=None, optimizer_kwargs={"lr": 1e-2}, n_epochs=config["epochs"],
            prior_structure="layerwise")

    def trained(out) -> dict[str, Any]:
        la, net, margliks, losses = out
        with torch.no_grad():
            map_metrics = test_metrics(net(X_test).softmax(-1), y_test)
        probs = la(X_test, pred_type="glm", link_approx="probit")
        return {"prior_precision": la.prior_precision.detach().reshape(-1).tolist(),
                "neg_log_marglik": [float(m) for m in margliks],
                "train_loss": [float(v) for v in losses],
                "backend": type(getattr(la, "backend", None)).__name__,
                "H_type": type(la).__name__, "map": map_metrics,
                **test_metrics(probs, y_test)}

    return [("train", train, trained)]


def worker_main(config: dict[str, Any]):
    """Build the problem (the ``fit`` part trains a MAP first, untimed), run the phases."""
    setup = worker_setup(config)
    warnings.filterwarnings("ignore")
    import lowrank_laplace  # noqa: F401 (registers hessian_structure="lowrank_ggn")

    n, seed = N_TRAIN + N_TEST, config["seed"]
    if config["part"] == "fit":  # trained to a MAP (untimed)
        model, _, X, y = make_digits(n, N_TRAIN, seed=seed)
    else:  # marglik_training trains from a fresh initialisation
        X, y = digits_data(n, seed)
        torch.manual_seed(seed)
        model = digits_mlp()
    data = [X[:N_TRAIN], y[:N_TRAIN], X[N_TRAIN:], y[N_TRAIN:]]
    setup["D"] = sum(p.numel() for p in model.parameters())
    phases = (fit_phases if config["part"] == "fit" else train_phases)(model, data, config)
    run_phases(setup, phases, config, (*LAPLACE_PREIMPORTS, "asdl"))


def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The configurations, in run order (the ``train`` part runs once each)."""
    load = {"threads": args.load_threads, "size": args.load_size, "env": "user"}
    common = {"epochs": args.epochs, "seed": args.seed, "threads": args.threads or None,
              "timeout": args.timeout}
    configs = []
    if "fit" in args.parts:
        configs += [{"part": "fit", "condition": c, "method": m, "phases": list(FIT_PHASES),
                     "repeat": args.repeat} for c in args.conditions for m in args.fit_methods]
    if "train" in args.parts:
        configs += [{"part": "train", "condition": c, "method": m, "phases": ["train"],
                     "repeat": 1}
                    for c in args.conditions if c == "quiet" or args.load
                    for m in TRAIN_METHODS if m != "full" or args.with_full]
    return [{**c, **common, **({"load": load} if c["condition"] == "loaded" else {})}
            for c in configs]


def driver_main(args: argparse.Namespace) -> dict[str, Any]:
    """Run every configuration, write JSON, figure and tables; print and return the summary."""
    out = Path(args.out)
    path = out / "shared.json"
    if args.replot:
        payload = read_run(path)
        if payload is None:
            return {}
        payload["summary"] = summarize(payload["records"])
        path.write_text(json.dumps(payload, indent=2))
    else:
        info = machine_info("cpu", (*DEFAULT_PACKAGES, "laplace-torch"))
        print_machine(info)
        configs = configurations(args)
        settings = {"problem": "digits MLP 64-50-50-10 tanh", "D": None, "n_train": N_TRAIN,
                    "n_test": N_TEST, "batch_size": BATCH_SIZE, "dtype": "float32",
                    "repeat": args.repeat, "train_repeat": 1, "epochs": args.epochs,
                    "threads": args.threads or "torch default", "device": "cpu",
                    "load_threads": args.load_threads, "load_size": args.load_size,
                    "timeout_s": args.timeout, "seed": args.seed,
                    "configurations": ["/".join(c[k] for k in ("part", "condition", "method"))
                                       for c in configs]}
        print(f"{len(configs)} configurations: fit rows {args.repeat} run(s) each (median), "
              f"train rows 1 run each", flush=True)
        plan = _harness.Plan("benchmarks.bench_shared", configs,
                             ("part", "condition", "method"), path, settings, info)
        records = plan.run(args)
        payload = plan.write(records, summarize(records), args)
    plot(payload, out / "shared.png")
    print_summary(payload["records"], payload["summary"])
    print(f"Wrote {path} and {out / 'shared.png'}", flush=True)
    if args.tables_out:
        write_tables(table_records(payload, f"{args.table_source}/shared.json"),
                     args.tables_out)
    return payload["summary"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv``; default ``sys.argv[1:]``)."""
    parser = _harness.script_parser(
        __doc__, "threads", "blas_threads", "omp_wait_policy", "timeout", "wait_for",
        "wait_max", "wait_poll", "wait_idle", "retry_busy", "seed", "out", "replot",
        "repeat", timeout=1500.0, repeat=3,
        # the user's environment, not the harness's settings (see the module docstring)
        blas_threads=0, omp_wait_policy="")
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
    parser.add_argument("--load-threads", type=int, default=2,
                        help="torch threads of the busy process.")
    parser.add_argument("--load-size", type=int, default=1500,
                        help="Matrix size of the busy process's matmuls.")
    parser.add_argument("--tables-out", default=None,
                        help="Write the docs' table records here (e.g. "
                        "benchmarks/results/tables).")
    parser.add_argument("--table-source", default="docs/benchmarks/shared",
                        help="Where the raw run is kept (named as the tables' source).")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke test: one run per configuration, 2 training epochs.")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = str(_harness.RESULTS_DIR / ("quick" if args.quick else "shared"))
    if args.quick:
        args.repeat, args.epochs = 1, min(args.epochs, 2)
    return args


main = _harness.script_main(parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
