"""Benchmark Laplace where users run it: shared machines, defaults, marglik training.

The digits MLP of ``bench_laplace`` (1,400 training and 397 test points). Part ``fit``:
the ``Laplace`` fit of the MAP network, marglik prior tuning and the GLM probit
predictive, ``--repeat`` runs each (medians); part ``train``: laplace-torch's
``marglik_training`` from scratch with ``lowrank_ggn`` and ``kron`` (``full`` with
``--with-full``), ``--train-repeat`` runs each (medians; alternating fresh processes:
this kind of machine's speed moves within minutes); part ``medium``: the same phases as
``fit`` on the main job's MNIST CNN (real offline MNIST, ``MEDIUM_TRAIN`` training
images, trained to a MAP untimed), timed over all three phases. Conditions: ``quiet``,
and ``loaded`` beside a ``_load.CompetingLoad`` (``train`` only with ``--load``). The
workers run as a user does: torch's default threads, neither ``OMP_WAIT_POLICY`` nor
``OPENBLAS_NUM_THREADS``.

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

from benchmarks import _harness, _report
from benchmarks._problems import digits_data, digits_mlp, make_digits
from benchmarks._report import find, fmt, gib, others_cpu, phase_ok, ratio, target
from benchmarks._worker import LAPLACE_PREIMPORTS, run_phases, worker_setup

N_TRAIN, N_TEST, BATCH_SIZE = 1400, 397, 128
PARTS: tuple[str, ...] = ("fit", "train", "medium")
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
#: The medium part: MNIST training and test images, MAP training epochs, methods.
MEDIUM_TRAIN, MEDIUM_TEST, MEDIUM_EPOCHS = 2000, 500, 3
MEDIUM_METHODS: tuple[str, ...] = ("lowrank_ggn", "kron")
#: Target factors.
TARGET_VS_KRON = 3.0
#: ``marglik_training`` on a quiet machine.
TARGET_TRAIN_VS_KRON = 2.0
TARGET_LOADED_VS_QUIET = 3.0


def config_key(part: str, condition: str, method: str) -> str:
    """Name of a configuration, e.g. ``'fit/quiet/kron'``."""
    return f"{part}/{condition}/{method}"


def _find(records: Sequence[dict], part: str, condition: str, method: str) -> dict | None:
    return find(records, part=part, condition=condition, method=method)


def _time(record: dict | None) -> float | None:
    """The measured time: fit + marglik (``fit`` part) or marglik_training (``train``)."""
    if record is None:
        return None
    if record["part"] == "train":
        r = phase_ok(record, "train")
        return None if r is None else r["time_s"]
    phases = [phase_ok(record, p) for p in FIT_PHASES[:3 if record["part"] == "medium" else 2]]
    return None if None in phases else sum(p["time_s"] for p in phases)


def _metrics(record: dict | None) -> dict | None:
    """The phase that holds the test metrics (``glm`` or ``train``), if it succeeded."""
    if record is None:
        return None
    return phase_ok(record, "train" if record["part"] == "train" else "glm")


def summarize(records: Sequence[dict]) -> dict[str, Any]:
    """A run's ``ratios`` (by configuration key: time over kron's in the same condition and,
    if loaded, over its own quiet time) and ``targets`` (``_report.target``)."""
    ratios: dict[str, dict] = {}
    for r in records:
        peer = _find(records, r["part"], r["condition"], PEER)
        quiet = _find(records, r["part"], "quiet", r["method"])
        ratios[config_key(r["part"], r["condition"], r["method"])] = {
            "vs_kron": ratio(_time(r), _time(peer)),
            "vs_own_quiet": ratio(_time(r), _time(quiet)) if r["condition"] != "quiet"
            else None}
    targets = []

    def add(name, where, value, bound):
        targets.append(target(name, where, value, bound))

    fit = "digits, fit + marglik"
    add(f"{OURS} <= {TARGET_VS_KRON:g}x {PEER}'s", f"{fit}, quiet",
        ratios.get(config_key("fit", "quiet", OURS), {}).get("vs_kron"), TARGET_VS_KRON)
    if _find(records, "fit", "loaded", OURS) is not None:
        add(f"{OURS} beside a busy process <= {TARGET_LOADED_VS_QUIET:g}x its quiet time",
            fit, ratios[config_key("fit", "loaded", OURS)]["vs_own_quiet"],
            TARGET_LOADED_VS_QUIET)
        add(f"{OURS} <= {TARGET_VS_KRON:g}x {PEER}'s", f"{fit}, beside a busy process",
            ratios[config_key("fit", "loaded", OURS)]["vs_kron"], TARGET_VS_KRON)
    medium = "MNIST CNN, fit + marglik + GLM predictive, beside a busy process"
    if _find(records, "medium", "loaded", OURS) is not None:
        add(f"{OURS} <= {TARGET_LOADED_VS_QUIET:g}x its quiet time", medium,
            ratios[config_key("medium", "loaded", OURS)]["vs_own_quiet"],
            TARGET_LOADED_VS_QUIET)
        add(f"{OURS} <= {PEER}'s time", medium,
            ratios[config_key("medium", "loaded", OURS)]["vs_kron"], 1.0)
    for condition in CONDITIONS:
        if _find(records, "train", condition, OURS) is None:
            continue
        bound = TARGET_TRAIN_VS_KRON if condition == "quiet" else TARGET_VS_KRON
        add(f"{OURS} <= {bound:g}x {PEER}'s",
            f"digits, marglik_training, {CONDITION_LABELS[condition]}",
            ratios[config_key("train", condition, OURS)]["vs_kron"], bound)
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
    parts = [f"{r['part']:<5} {r['condition']:<6} {r['method']:<18}",
             f"{fmt(t) if t is not None else _report.failure_text(r):>10} s",
             f"{fmt(ratio['vs_kron'])}x kron",
             f"{fmt(ratio['vs_own_quiet'])}x own quiet" if r["condition"] != "quiet" else "",
             f"NLL {fmt(m.get('test_nll'), 4)}", f"acc {fmt(m.get('test_acc'), 3)}",
             f"peak {gib(r.get('worker_peak_bytes'))} GiB",
             f"others {fmt(others_cpu(r), 2)}%"]
    return "  " + ", ".join(p for p in parts if p)


def print_summary(records: Sequence[dict], summary: dict[str, Any]):
    """Print the results and the targets."""
    print("\nResults (fit: median of the runs of fit + marglik; train: median of the runs of "
          "marglik_training):")
    for r in records:
        print(_row_line(r, summary["ratios"]), flush=True)
    _report.print_targets(summary["targets"])
    _report.warn_others(records)


def plot(payload: dict[str, Any], path: Path):
    """Bar charts of a run: fit + marglik and marglik_training time, test NLL."""
    records = payload["records"]
    colors = {"quiet": "tab:blue", "loaded": "tab:orange"}
    with _report.figure(path, 1, 3, figsize=(15, 4.4), rect=(0, 0, 1, 0.93)) as (fig, axes):
        quiet = [r for r in records if r["condition"] == "quiet"]
        for i, r in enumerate(quiet):
            _report.value_bar(axes[2], i, (_metrics(r) or {}).get("test_nll"), 0.0, "{:.3f}",
                              width=0.7,
                              color="tab:green" if r["part"] == "fit" else "tab:purple")
        axes[2].set_xticks(range(len(quiet)))
        axes[2].set_xticklabels([r["part"] + "\n" + r["method"].replace("_sketch", "\nsketch")
                                 for r in quiet], fontsize=7)
        axes[2].set_ylabel("test NLL, GLM probit (quiet runs)")
        for ax, part, label in ((axes[0], "fit", "fit + marglik [s] (median of runs)"),
                                (axes[1], "train", "marglik_training [s] (one run)")):
            methods = [m for m in (FIT_METHODS if part == "fit" else TRAIN_METHODS)
                       if any(r["part"] == part and r["method"] == m for r in records)]
            for i, method in enumerate(methods):
                for j, condition in enumerate(CONDITIONS):
                    r = _find(records, part, condition, method)
                    if r is not None:
                        _report.value_bar(ax, i + (j - 0.5) * 0.4, _time(r), width=0.4,
                                          color=colors[condition])
            ax.set_xticks(range(len(methods)))
            ax.set_xticklabels([m.replace("_sketch", "\nsketch") for m in methods], fontsize=8)
            ax.set_yscale("log")
            ax.set_ylabel(label)
        _report.box_legend(fig, [colors[c] for c in CONDITIONS],
                           [CONDITION_LABELS[c] for c in CONDITIONS])
        info = payload["machine"]
        fig.suptitle(f"digits MLP (D = {payload['settings'].get('D', '?')}), {N_TRAIN} / "
                     f"{N_TEST} points; {_report.machine_text(info)}, torch "
                     f"{info.get('torch')}, commit {payload['git_head'][:7]}; red x: failed",
                     fontsize=9)


def _row(r: dict[str, Any], ratios: dict[str, dict]) -> list[str]:
    """A configuration's row of the ``shared_fit`` or ``shared_train`` table."""
    t, m = _time(r), _metrics(r) or {}
    ratio_ = ratios[config_key(r["part"], r["condition"], r["method"])]
    others = others_cpu(r)
    vs_kron = "-" if r["method"] == PEER or ratio_["vs_kron"] is None else \
        fmt(ratio_["vs_kron"]) + "x"
    vs_quiet = "-" if ratio_["vs_own_quiet"] is None else fmt(ratio_["vs_own_quiet"]) + "x"
    head = [CONDITION_LABELS[r["condition"]], LABELS[r["method"]]]
    metrics = [fmt(m.get("test_nll"), 4), fmt(m.get("test_acc"), 3)]
    tail = [gib(r.get("worker_peak_bytes")), "-" if others is None else f"{others:.0f}"]
    if r["part"] == "train":
        prior = m.get("prior_precision") or []
        return [*head, fmt(t) if t is not None else _report.failure_text(r), vs_kron, vs_quiet,
                *metrics, ", ".join(f"{p:.3g}" for p in prior) or "-", *tail]
    fit, marglik = phase_ok(r, "fit"), phase_ok(r, "marglik")
    prior = (marglik or {}).get("prior_precision") or []
    return [*head, fmt(fit["time_s"]) if fit else _report.failure_text(r),
            fmt(marglik["time_s"]) if marglik else "-", fmt(t), vs_kron, vs_quiet, *metrics,
            fmt(prior[0]) if len(prior) == 1 else "-", *tail]


def table_records(payload: dict[str, Any], source: str) -> dict[str, dict]:
    """The docs' table records ``shared_fit``, ``shared_train`` and ``shared_targets``."""
    common, records = _report.table_common(payload, [source]), payload["records"]
    ratios, s = payload["summary"]["ratios"], payload["settings"]
    tables = {"shared_fit": {
        **common,
        "note": f"Median of {s['repeat']} fresh processes per row; D = {s.get('D')}.",
        "columns": ["machine", "method", "fit [s]", "marglik [s]", "fit + marglik [s]",
                    "/ kron's", "/ own quiet", "test NLL", "test acc.", "prior prec.",
                    "worker peak RSS [GiB]", "others' CPU [%]"],
        "rows": [_row(r, ratios) for r in records if r["part"] == "fit"]}}
    if any(r["part"] == "train" for r in records):
        tables["shared_train"] = {
            **common, "note": "One run (a fresh process) per row.",
            "columns": ["machine", "method", "marglik_training [s]", "/ kron's",
                        "/ own quiet", "test NLL", "test acc.",
                        "prior precisions (per parameter tensor)",
                        "worker peak RSS [GiB]", "others' CPU [%]"],
            "rows": [_row(r, ratios) for r in records if r["part"] == "train"]}
    if any(r["part"] == "medium" for r in records):
        tables["shared_medium"] = {
            **common, "note": f"Median of {s['repeat']} fresh processes per row; the MNIST CNN "
            f"of the main job, {MEDIUM_TRAIN} training images; time: fit + marglik + GLM.",
            "columns": ["machine", "method", "fit [s]", "marglik [s]", "fit + marglik [s]",
                        "/ kron's", "/ own quiet", "test NLL", "test acc.", "prior prec.",
                        "worker peak RSS [GiB]", "others' CPU [%]"],
            "rows": [_row(r, ratios) for r in records if r["part"] == "medium"]}
    tables["shared_targets"] = {**common, "note": "Ratios within one run.",
                                "columns": ["target", "where", "measured", "verdict"],
                                "rows": _report.target_rows(payload["summary"]["targets"])}
    return tables


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
    if config["part"] == "medium" and config["method"] == PEER:  # as the main job runs it:
        from laplace.curvature import BackPackGGN  # far faster on CNNs than the default

        kwargs["backend"] = BackPackGGN
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

    def glm():  # the medium part in batches, as a user predicts a CNN's test set
        size = BATCH_SIZE if config["part"] == "medium" else len(X_test)
        return torch.cat([state["la"](X, pred_type="glm", link_approx="probit").detach()
                          for X in X_test.split(size)])

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
    if config["part"] == "medium":
        model, data = medium_problem(seed)
        setup["D"] = sum(p.numel() for p in model.parameters())
        run_phases(setup, fit_phases(model, data, config), config,
                   (*LAPLACE_PREIMPORTS, "asdl"))
        return
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


def medium_problem(seed: int) -> tuple[torch.nn.Module, list]:
    """The main job's MNIST CNN trained to a MAP (untimed) and its data split."""
    from lowrank_laplace.toolkit.datasets import load_images
    from lowrank_laplace.toolkit.training import make_cnn

    X, y = load_images("mnist")
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    X, y = X[perm][:MEDIUM_TRAIN + MEDIUM_TEST], y[perm][:MEDIUM_TRAIN + MEDIUM_TEST]
    torch.manual_seed(seed)
    model = make_cnn("mnist")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(MEDIUM_EPOCHS):
        for idx in torch.randperm(MEDIUM_TRAIN).split(BATCH_SIZE):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(X[idx]), y[idx]).backward()
            optimizer.step()
    model.eval()
    return model, [X[:MEDIUM_TRAIN], y[:MEDIUM_TRAIN], X[MEDIUM_TRAIN:], y[MEDIUM_TRAIN:]]


def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The configurations, in run order (the ``train`` part ``--train-repeat`` times each)."""
    load = {"threads": args.load_threads, "size": args.load_size, "env": "user"}
    common = {"epochs": args.epochs, "seed": args.seed, "threads": args.threads or None,
              "timeout": args.timeout}
    configs = []
    if "fit" in args.parts:
        configs += [{"part": "fit", "condition": c, "method": m, "phases": list(FIT_PHASES),
                     "repeat": args.repeat} for c in args.conditions for m in args.fit_methods]
    if "medium" in args.parts:
        configs += [{"part": "medium", "condition": c, "method": m, "phases": list(FIT_PHASES),
                     "repeat": args.repeat} for c in args.conditions for m in MEDIUM_METHODS]
    if "train" in args.parts:
        configs += [{"part": "train", "condition": c, "method": m, "phases": ["train"],
                     "repeat": args.train_repeat}
                    for c in args.conditions if c == "quiet" or args.load
                    for m in TRAIN_METHODS if m != "full" or args.with_full]
    return [{**c, **common, **({"load": load} if c["condition"] == "loaded" else {})}
            for c in configs]


def driver_main(args: argparse.Namespace) -> dict[str, Any]:
    """Run every configuration, write JSON, figure and tables; print and return the summary."""
    out = Path(args.out)
    path = out / "shared.json"
    if args.replot:
        payload = _report.read_run(path)
        if payload is None:
            return {}
        payload["summary"] = summarize(payload["records"])
        path.write_text(json.dumps(payload, indent=2))
    else:
        info = _report.machine_info("cpu", (*_report.DEFAULT_PACKAGES, "laplace-torch"))
        _report.print_machine(info)
        configs = configurations(args)
        settings = {"problem": "digits MLP 64-50-50-10 tanh", "D": None, "n_train": N_TRAIN,
                    "n_test": N_TEST, "batch_size": BATCH_SIZE, "dtype": "float32",
                    "repeat": args.repeat, "train_repeat": args.train_repeat,
                    "epochs": args.epochs,
                    "threads": args.threads or "torch default", "device": "cpu",
                    "load_threads": args.load_threads, "load_size": args.load_size,
                    "timeout_s": args.timeout, "seed": args.seed,
                    "configurations": ["/".join(c[k] for k in ("part", "condition", "method"))
                                       for c in configs]}
        print(f"{len(configs)} configurations: fit rows {args.repeat} run(s) each (median), "
              f"train rows {args.train_repeat} run(s) each (median)", flush=True)
        plan = _harness.Plan("benchmarks.bench_shared", configs,
                             ("part", "condition", "method"), path, settings, info)
        records = plan.run(args)
        payload = plan.write(records, summarize(records), args)
    plot(payload, out / "shared.png")
    print_summary(payload["records"], payload["summary"])
    print(f"Wrote {path} and {out / 'shared.png'}", flush=True)
    if args.tables_out:
        _report.write_tables(table_records(payload, f"{args.table_source}/shared.json"),
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
                        help="fit: fit + marglik; train: marglik_training; medium: the MNIST "
                        "CNN's fit + marglik + GLM predictive.")
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS),
                        choices=CONDITIONS, help="quiet, or loaded (beside a busy process).")
    parser.add_argument("--fit-methods", nargs="+", default=list(FIT_METHODS),
                        choices=FIT_METHODS, help="Methods of the fit part.")
    parser.add_argument("--with-full", action="store_true",
                        help="marglik_training with hessian_structure='full' too (minutes).")
    parser.add_argument("--load", action="store_true",
                        help="marglik_training beside the busy process too.")
    parser.add_argument("--epochs", type=int, default=20, help="marglik_training epochs.")
    parser.add_argument("--train-repeat", type=int, default=1,
                        help="marglik_training runs per method, alternating (median).")
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
        args.repeat, args.train_repeat, args.epochs = 1, 1, min(args.epochs, 2)
    return args


main = _harness.script_main(parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
