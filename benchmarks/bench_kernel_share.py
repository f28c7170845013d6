"""The kernel's share of the CPU time of a default fit, beside training the same network.

Temporaries above glibc's mmap threshold are mapped afresh and zero-filled by the kernel
on first touch: system CPU time and minor faults that training barely has. One worker
trains the MNIST CNN of :mod:`lowrank_laplace.toolkit.training` (``train``, the
baseline), then runs the default posterior's ``fit``, ``marglik`` and GLM ``predictive``,
recording each phase's user and system CPU seconds, minor faults and wall time::

    python -m benchmarks.bench_kernel_share --out benchmarks/results/kernel_share

writes ``kernel_share.json`` (date, machine, versions) and prints a Markdown table.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import _harness
from benchmarks._worker import run_phases, worker_setup

PHASES = ("train", "fit", "marglik", "predictive")


def counted(fn: Callable[[], Any]) -> Callable[[], dict]:
    """``fn`` that returns its CPU times, minor faults and wall time (and its output)."""
    def run() -> dict:
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        out = fn()
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
        user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
        return {"out": out, "wall_s": wall, "user_s": user, "system_s": system,
                "minflt": after.ru_minflt - before.ru_minflt,
                "kernel_share": system / max(user + system, 1e-9)}
    return run


def worker_main(config: dict[str, Any]):
    """Train the CNN, then fit, tune and predict with the default posterior."""
    from laplace import Laplace

    import lowrank_laplace  # noqa: F401  (registers lowrank_ggn)
    from lowrank_laplace.toolkit import datasets, training
    from lowrank_laplace.toolkit.options import CalibrationConfig

    setup = worker_setup(config)
    torch.manual_seed(config["seed"])
    split = datasets.image_split("mnist", seed=config["seed"], max_train=config["n_train"])
    study = CalibrationConfig(dataset="mnist", epochs=config["epochs"],
                              n_train=config["n_train"], seed=config["seed"])
    loader = split.loaders(study.batch_size, study.seed)["train"]
    x_test = split.test[0][:config["n_test"]]
    state: dict[str, Any] = {}
    setup.update(D=sum(p.numel() for p in training.make_cnn("mnist").parameters()),
                 n_train=len(split.train[1]), n_test=len(x_test))

    def train():
        state["model"] = training.train_or_load(study, split, torch.device("cpu"), print)

    def fit():
        state["la"] = Laplace(state["model"], "classification", subset_of_weights="all",
                              hessian_structure="lowrank_ggn")
        state["la"].fit(loader)
        return {"kept_fraction": float(state["la"].kept_fraction)}

    def marglik():
        state["la"].optimize_prior_precision(method="marglik")
        return {"prior_precision": state["la"].prior_precision.flatten().tolist()}

    def predictive():
        probs = state["la"](x_test, pred_type="glm", link_approx="probit")
        return {"probs_sum_sq": float((probs.double() ** 2).sum()),
                "probs_max": float(probs.max(-1).values.double().mean())}

    def describe(result: dict) -> dict:
        return {k: v for k, v in result.items() if k != "out"} | {"result": result["out"]}

    steps = {"train": train, "fit": fit, "marglik": marglik, "predictive": predictive}
    run_phases(setup, [(name, counted(steps[name]), describe) for name in PHASES], config)


def table(record: dict) -> str:
    """The Markdown table of one run's phases."""
    rows = ["| phase | wall [s] | user [s] | system [s] | kernel share | minor faults |",
            "|---|---:|---:|---:|---:|---:|"]
    for name in PHASES:
        p = record["phases"][name]
        if p.get("status") != "ok":
            rows.append(f"| {name} | {p.get('status')} | | | | |")
            continue
        rows.append(f"| {name} | {p['wall_s']:.2f} | {p['user_s']:.2f} | {p['system_s']:.2f}"
                    f" | {100 * p['kernel_share']:.1f}% | {p['minflt']:,} |")
    return "\n".join(rows)


def driver_main(args) -> dict:
    """Run the worker, write the JSON file and print the table."""
    config = {"seed": args.seed, "epochs": args.epochs, "n_train": args.n_train,
              "n_test": args.n_test, "threads": args.threads, "phases": list(PHASES)}
    record = _harness.run_config("benchmarks.bench_kernel_share", config, args)
    out = Path(args.out or "benchmarks/results/kernel_share")
    out.mkdir(parents=True, exist_ok=True)
    machine = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "platform": platform.platform(), "cpu_count": os.cpu_count(),
               "torch": torch.__version__, "loadavg_after": list(os.getloadavg())}
    payload = {"machine": machine, "label": args.label, "record": record}
    (out / f"kernel_share{args.label}.json").write_text(json.dumps(payload, indent=2))
    print(table(record))
    print(f"wrote {out / f'kernel_share{args.label}.json'}")
    return payload


def parse_args(argv: Sequence[str] | None = None):
    """Parse command line arguments."""
    parser = _harness.script_parser(__doc__, "threads", "timeout", "blas_threads",
                                    "omp_wait_policy", "seed", "out")
    parser.add_argument("--epochs", type=int, default=3, help="Training epochs.")
    parser.add_argument("--n-train", type=int, default=2000, help="Training images.")
    parser.add_argument("--n-test", type=int, default=500, help="Test images predicted.")
    parser.add_argument("--label", default="", help="Suffix of the JSON file's name.")
    return parser.parse_args(argv)


main = _harness.script_main(parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
