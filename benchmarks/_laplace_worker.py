"""Worker side of ``bench_laplace.py``: one method's phases in a fresh process.

The worker builds the problem, then times and memory-measures the ``fit`` and the
requested predictive phases (``glm``, ``nn``) of one method (``_worker.measure``) and
prints one JSON record per phase. Also holds the method specifications
(:data:`METHODS`) and phase names shared with the driver and the report.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from benchmarks._problems import LAPLACE_NUM_CLASSES, make_laplace_problem
from benchmarks._worker import (
    LAPLACE_PREIMPORTS,
    emit,
    ggn_eigsh,
    measure,
    preimport,
    probs_warnings,
    worker_setup,
)

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
PHASES: tuple[str, ...] = ("fit", "glm", "nn")


def laplace_kwargs(method: str, config: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of ``laplace.Laplace`` (besides model and likelihood) for a method
    of kind ``'ours'`` or ``'laplace'`` (``config``: its ``rank``)."""
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

    setup = worker_setup(config)
    device = torch.device(config["device"])
    torch.manual_seed(config["seed"])
    spec, n_train = METHODS[config["method"]], config["n_train"]
    model, _, X, y = make_laplace_problem(config["problem"], n_train + config["n_test"],
                                          n_train, seed=config["seed"], device=device)
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
    preimport(LAPLACE_PREIMPORTS)
    emit(setup)

    if spec["kind"] == "lanczos":
        batches = list(loader)
        record, out = measure("fit", lambda: ggn_eigsh(
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
            record.update(probs_warnings(n_test, C)(probs))
        if phase == "nn":
            record["n_samples"] = config["nn_samples"]
        del probs
        emit(record)
