"""How faithful the posteriors are where rank 100 keeps little of the GGN.

Networks trained to their MAP on real offline data (:mod:`benchmarks._faithful_problems`):
every posterior of :data:`METHODS`, each with its own marglik-tuned scalar prior, against
the exact full-GGN Laplace posterior (:mod:`benchmarks._exact`); the measurements are
described in ``docs/benchmarks/posterior_quality.md``.

    python -m benchmarks.bench_faithful --out docs/benchmarks/faithful

writes ``faithful.json`` (with date, machine, commit) and ``faithful.png`` and prints a
markdown table per problem. The exact references (each problem's MAP network, exact
spectrum, marglik prior and test-set predictive, well under 2 MB a problem) are
committed under ``docs/benchmarks/faithful/references`` (``--references``), so a fresh
machine refits every posterior in minutes; one is computed (and stored) where none is
stored for the problem and ranks, or with ``--recompute-reference``.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from laplace import Laplace
from torch import Tensor

import lowrank_laplace  # noqa: F401  (registers hessian_structure="lowrank_ggn")
from benchmarks import _exact
from benchmarks import _faithful_report as report
from benchmarks._faithful_problems import Problem, build_model, loader, make_data, train_map
from benchmarks._harness import RESULTS_DIR
from benchmarks._report import machine_info
from benchmarks._worker import default_dtype, git

#: The problems (see ``docs/benchmarks/posterior_quality.md`` for what each stands for).
PROBLEMS: dict[str, Problem] = {
    "mnist_mlp": Problem("mnist", "mlp", {"hidden": [40]}, pool=2, standardize=0.02,
                         n_train=800, n_test=200, rotations=(30, 45),
                         note="MNIST 14x14 standardized, tanh MLP 196-40-10"),
    "mnist_early": Problem("mnist", "mlp", {"hidden": [40]}, pool=2, standardize=0.02,
                           n_train=800, n_test=200, rotations=(30, 45), epochs=1,
                           note="the same MLP after one epoch"),
    "mnist_wide": Problem("mnist", "mlp", {"hidden": [30]}, standardize=0.02, n_train=400,
                          n_test=200, rotations=(30, 45), epochs=50,
                          note="MNIST 28x28 standardized, tanh MLP 784-30-10, 400 images"),
    "mnist_aug": Problem("mnist", "mlp", {"hidden": [40]}, pool=2, standardize=0.02,
                         n_train=4500, augment=4, n_test=500, rotations=(30, 45),
                         note="MNIST 14x14, tanh MLP 196-40-10, 4,500 images augmented 4x"),
    "mnist_aug_early": Problem("mnist", "mlp", {"hidden": [10]}, standardize=0.02,
                               n_train=4500, augment=4, n_test=500, rotations=(30, 45),
                               epochs=1, note="MNIST 28x28, tanh MLP 784-10-10 after one "
                               "epoch on 4,500 images augmented 4x"),
    "mnist_cnn": Problem("mnist", "cnn", {}, encoding="image", pool=2, n_train=3500,
                         n_test=500, epochs=20, note="MNIST 14x14, small ReLU CNN"),
    "digits_lora": Problem("digits", "gpt2_lora", {"targets": ("c_attn", "c_proj", "c_fc")},
                           encoding="tokens", pool=2, n_train=600, n_test=200, epochs=60,
                           rotations=(30, 45),
                           note="digits 4x4 as 16 grey-level tokens, LoRA on a random GPT-2"),
    "client_digits": Problem("digits", "mlp", {"hidden": [84]}, n_train=1257, n_test=360,
                             epochs=100, dtype="float32", marglik_steps=100,
                             note="the client's digits MLP 64-84-10 (float32, TU's calls)"),
    "client_digits_calib": Problem("digits", "mlp", {"hidden": [84]}, n_train=1257,
                                   n_test=360, epochs=100, dtype="float32",
                                   marglik_steps=100, calibration=180,
                                   note="the same, posteriors fitted on 180 held-out images"),
}
#: The problems the study runs unless named: ``digits_lora``'s evaluation, ``torch.func``
#: Jacobians of a GPT-2 in chunks of :data:`CHUNK` inputs beside the fitted posteriors,
#: was killed at 24 GB of memory (2026-12-07); it runs only when named in ``--problems``.
DEFAULT_PROBLEMS = tuple(name for name in PROBLEMS if name != "digits_lora")


@dataclass(frozen=True)
class Method:
    """A laplace-torch posterior: ``hessian_structure``, ``subset_of_weights``, further
    keyword arguments of ``Laplace(model, "classification", ...)``, and whether it is
    fitted once per rank of ``--ranks``."""

    structure: str
    subset: str = "all"
    options: dict = field(default_factory=dict)
    ranked: bool = False


#: The posteriors compared with the exact one.
METHODS: dict[str, Method] = {
    "default": Method("lowrank_ggn", ranked=True),
    "streaming": Method("lowrank_ggn", options={"solver": "streaming"}, ranked=True),
    "kron": Method("kron"),
    "diag": Method("diag"),
    "last_layer": Method("full", subset="last_layer"),
    "residual_none": Method("lowrank_ggn", options={"residual": "none"}, ranked=True),
    "auto_rank": Method("lowrank_ggn", options={"rank": "auto"}),
}
DEFAULT_METHODS = ("default", "streaming", "kron", "diag", "last_layer")
#: Adam steps of every method's marglik tuning (laplace-torch's lr 0.1, from 1).
MARGLIK_STEPS = 300
#: Inputs per Jacobian evaluation on the test sets.
CHUNK = 100
#: Where the compact exact references are committed.
REFERENCES = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "faithful" / \
    "references"


@dataclass
class Fitted:
    """A fitted, tuned posterior and what was recorded about it."""

    label: str
    method: str
    rank: Optional[int]
    la: Any
    record: dict
    index: Optional[Tensor] = None  # the columns of the full Jacobian it covers


def cast(inputs, dtype: torch.dtype):
    """Floating-point inputs in ``dtype`` (token dicts unchanged)."""
    if isinstance(inputs, Tensor) and inputs.is_floating_point():
        return inputs.to(dtype)
    return inputs


def reference(name: str, problem: Problem, ranks: Sequence[int], directory: Path,
              recompute: bool = False) -> dict:
    """The trained MAP network and its exact posterior (eigenvalues, prior, predictive per
    test set split at ``ranks``, timings): from ``directory/<name>.pt`` where it holds the
    same problem and ranks (unless ``recompute``), else computed and stored there."""
    key = repr((problem, sorted(ranks)))
    path = directory / f"{name}.pt"
    if not recompute and path.exists():
        stored = load_reference(path)
        if stored.get("key") == key:
            print(f"{name}: exact reference loaded from {path}", flush=True)
            return stored
        print(f"{name}: {path} holds another problem or ranks: recomputing", flush=True)
    data = make_data(problem)
    model = build_model(problem, data.features)
    start = time.perf_counter()
    train = train_map(model, problem, *data.train)
    train["seconds"] = time.perf_counter() - start
    ref = exact_reference(model, problem, data, ranks)
    ref.update(key=key, state=model.state_dict(), train=train)
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(_compact(ref), path)
    return ref


def _compact(value: Any) -> Any:
    """A reference as stored: without the top eigenvectors (nothing reads them), its
    floating-point tensors in float32 except the MAP weights (rounding far below the
    study's errors), plain values only (``torch.load(weights_only=True)`` reads it)."""
    if isinstance(value, dict):
        return {k: (v if k == "state" else _compact(v)) for k, v in value.items()
                if k != "top_vectors"}
    if isinstance(value, Tensor) and value.is_floating_point():
        return value.detach().to("cpu", torch.float32).clone()
    return value


def load_reference(path: Path) -> dict:
    """A stored reference, its float32 tensors widened to float64 (the MAP weights as
    stored)."""
    def widen(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: (v if k == "state" else widen(v)) for k, v in value.items()}
        if isinstance(value, Tensor) and value.dtype == torch.float32:
            return value.double()
        return value

    return widen(torch.load(path, weights_only=True))


def exact_reference(model, problem: Problem, data, ranks: Sequence[int]) -> dict:
    """Everything the study needs from the exact full-GGN posterior of ``model``."""
    ggn = _exact.build_ggn(model, data.fit[0], "classification", space=problem.space)
    params = torch.cat([p.detach().flatten() for n, p in model.named_parameters()
                        if n in set(_exact.trainable_names(model))])
    sq_norm = float((params**2).sum())
    delta = _exact.marglik_prior(ggn.eigenvalues, sq_norm)
    start = time.perf_counter()
    lam, U = ggn.top_pairs(max(ranks))
    seconds = dict(ggn.seconds, top_pairs=time.perf_counter() - start)
    start = time.perf_counter()
    sets = {name: _exact.exact_predictive(ggn, model, X, delta, ranks, CHUNK)
            for name, (X, _) in data.tests.items()}
    seconds["predictive"] = time.perf_counter() - start
    return {"dim": ggn.dim, "space": ggn.space, "size": len(ggn.matrix),
            "eigenvalues": ggn.eigenvalues, "trace": ggn.trace, "sq_norm": sq_norm,
            "delta": delta, "top_values": lam, "top_vectors": U, "sets": sets,
            "seconds": seconds}


def fit_method(key: str, rank: Optional[int], model, fit_set, steps: int,
               **options: Any) -> Fitted:
    """Fit one posterior on ``fit_set`` (inputs, labels), with ``options`` besides its own,
    and tune its scalar prior."""
    method = METHODS[key]
    kwargs = {**method.options, **options}
    if method.ranked:
        kwargs["rank"] = rank
    if isinstance(fit_set[0], dict):
        kwargs["dict_key_y"] = "labels"
    label = key if rank is None else f"{key} r={rank}"
    record: dict[str, Any] = {"method": key, "rank": rank, "structure": method.structure,
                              "subset": method.subset, "options": method.options}
    start = time.perf_counter()
    la = Laplace(model, "classification", subset_of_weights=method.subset,
                 hessian_structure=method.structure, **kwargs)
    la.fit(loader(*fit_set))
    record["fit_s"] = time.perf_counter() - start
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.optimize_prior_precision(method="marglik", n_steps=steps, lr=0.1)
    record["marglik_s"] = time.perf_counter() - start
    record["prior_precision"] = float(la.prior_precision.reshape(-1)[0])
    return Fitted(label, key, rank, la, record)


def column_index(model, fitted: Fitted) -> Optional[Tensor]:
    """Columns of the full Jacobian a last-layer posterior covers (``None``: all)."""
    if fitted.record["subset"] == "all":
        return None
    copy = fitted.la.model.model
    last = {id(p) for p in fitted.la.model.last_layer.parameters()}
    wanted = [n for n, p in copy.named_parameters() if id(p) in last]
    params = dict(model.named_parameters())
    offsets, start = {}, 0
    for n in _exact.trainable_names(model):
        offsets[n] = (start, start + params[n].numel())
        start += params[n].numel()
    return torch.cat([torch.arange(*offsets[n]) for n in wanted])


def lowrank_facts(fitted: Fitted, ref: dict) -> dict:
    """The kept eigenpairs against the exact top-``r`` ones, and the measured complement
    (the subspace overlap only where the reference was just computed: a stored one keeps
    no eigenvectors)."""
    U, lam = fitted.la.H
    r = lam.numel()
    exact = ref["eigenvalues"].double().sort(descending=True).values[:r].to(lam)
    overlap = None
    if "top_vectors" in ref:
        k = min(r, ref["top_vectors"].shape[1])  # a chosen rank may pass the stored vectors
        overlap = float((ref["top_vectors"][:, :k].T @ U.double()).pow(2).sum() / k)
    facts = {
        "rank": r, "eigenvalues": lam.tolist(), "kept_fraction": float(fitted.la.kept_fraction),
        "exact_top_share": float(exact.sum()) / ref["trace"],
        "kept_vs_exact_top": float(lam.sum() / exact.sum()),
        "top_eigenvalue_ratio": float(lam[0] / exact[0]),
        "last_eigenvalue_ratio": float(lam[-1] / exact[-1]),
        "eigenvalue_mean_rel_error": float(((lam - exact).abs() / exact).mean()),
        "subspace_overlap": overlap, "fit_path": fitted.la.fit_path,
        "fit_report": str(fitted.la.fit_report),
    }
    measured = fitted.la.residual_model.complement_variance(torch.tensor(1.0),
                                                           torch.tensor(ref["delta"]))
    if measured is not None:
        facts["measured_v_at_exact_prior"] = float(measured)
    return facts


def evaluate(fits: list[Fitted], model, data, ref: dict) -> None:
    """Predict every test set with every posterior into its record's metrics."""
    names = _exact.trainable_names(model)
    delta = ref["delta"]
    for set_name, (X, y) in data.tests.items():
        parts: dict[str, dict[str, list]] = {f.label: {} for f in fits}
        for part in _exact.chunks(X, CHUNK):
            J, _ = _exact.jacobians(model, names, part)
            for f in [f for f in fits if "error" not in f.record]:
                try:
                    _accumulate(f, parts[f.label], part, J.double(), delta)
                except Exception as exc:  # noqa: BLE001  (recorded: a method may not apply)
                    print(f"{f.label}: predictive failed: {exc!r}", flush=True)
                    f.record["error"] = f"predictive: {exc!r}"
        exact = ref["sets"][set_name]
        for f in [f for f in fits if "error" not in f.record]:
            got = {k: torch.cat(v) for k, v in parts[f.label].items()}
            f.record.setdefault("sets", {})[set_name] = report.set_metrics(
                got, dict(exact, delta=delta), y, f.record.get("measured_v_at_exact_prior"),
                f.rank)
    for f in fits:
        if "error" in f.record:
            f.record.pop("sets", None)


def _accumulate(f: Fitted, acc: dict, X, J: Tensor, delta: float) -> None:
    la = f.la
    if f.index is not None:
        J = J[..., f.index]
    with torch.no_grad():
        probs = la(cast(X, la.mean.dtype), pred_type="glm", link_approx="probit")
    own = la.prior_precision
    var_own = la.functional_variance(J.to(la.mean.dtype))
    la.prior_precision = delta
    var_same = la.functional_variance(J.to(la.mean.dtype))
    la.prior_precision = own
    acc.setdefault("probs", []).append(probs.double())
    acc.setdefault("f_var", []).append(var_own.double())
    acc.setdefault("f_var_same", []).append(var_same.double())
    if f.record["structure"] == "lowrank_ggn":
        JU = J @ la.H[0].to(J.dtype)
        outside = (J**2).sum((1, 2)) - (JU**2).sum((1, 2))
        acc.setdefault("energy_outside", []).append(outside)
        null = getattr(la.residual_model, "null", None)  # the logit-shift directions
        energy = outside * 0 if null is None else (null.project(J) ** 2).sum((1, 2))
        acc.setdefault("null_energy", []).append(energy)


def run_problem(name: str, problem: Problem, args: argparse.Namespace) -> dict:
    """The reference, every method's fit and their measurements on one problem."""
    ref = reference(name, problem, args.ranks, args.references, args.recompute_reference)
    data = make_data(problem)
    model = build_model(problem, data.features).double()
    model.load_state_dict(ref["state"])
    model.eval()
    dtype = getattr(torch, problem.dtype)
    work = model if dtype == torch.float64 else copy.deepcopy(model).to(dtype)
    fit_set = (cast(data.fit[0], dtype), data.fit[1])
    steps = problem.marglik_steps or args.marglik_steps
    fits = []
    for key in args.methods:
        for rank in (args.ranks if METHODS[key].ranked else [None]):
            try:
                with default_dtype(dtype):
                    fitted = fit_method(key, rank, work, fit_set, steps)
            except Exception as exc:  # noqa: BLE001  (recorded: a method may not apply)
                print(f"{name}: {key} failed: {exc!r}", flush=True)
                fits.append(Fitted(key, key, rank, None, {"method": key, "error": repr(exc)}))
                continue
            fitted.index = column_index(model, fitted)
            if fitted.record["structure"] == "lowrank_ggn":
                fitted.record.update(lowrank_facts(fitted, ref))
            fits.append(fitted)
            print(f"{name}: {fitted.label} fitted ({fitted.record['fit_s']:.1f} s)", flush=True)
    with default_dtype(dtype):
        evaluate([f for f in fits if f.la is not None], model, data, ref)
    record = report.problem_record(problem, ref, data, args.ranks)
    record["methods"] = {f.label: f.record for f in fits}
    record["targets"] = report.targets(record, args.ranks)
    record["design"] = report.design_facts(record, args.ranks)
    return record


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command line of the study (checked before anything is computed)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", default=",".join(DEFAULT_PROBLEMS),
                        help=f"comma-separated subset of {', '.join(PROBLEMS)}")
    parser.add_argument("--ranks", default="100,30", help="comma-separated ranks")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"comma-separated subset of {', '.join(METHODS)}")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "faithful")
    parser.add_argument("--references", type=Path, default=REFERENCES,
                        help="where the exact references (and MAP networks) are stored")
    parser.add_argument("--recompute-reference", action="store_true",
                        help="compute the exact references again (and store them)")
    parser.add_argument("--references-only", action="store_true",
                        help="only make sure every problem's reference is stored")
    parser.add_argument("--update", action="store_true",
                        help="keep the other problems of an existing faithful.json in --out")
    parser.add_argument("--marglik-steps", type=int, default=MARGLIK_STEPS)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default); on a machine shared with "
                        "other work one thread avoids waiting for a second core")
    parser.add_argument("--tiny", action="store_true",
                        help="seconds-long smoke configuration (tiny networks and data)")
    args = parser.parse_args(argv)
    args.problems = _choices(parser, args.problems, PROBLEMS, "--problems")
    args.methods = _choices(parser, args.methods, METHODS, "--methods")
    try:
        args.ranks = sorted({int(r) for r in args.ranks.split(",")}, reverse=True)
    except ValueError:
        parser.error(f"--ranks must be comma-separated integers, got {args.ranks!r}")
    if not args.ranks or min(args.ranks) < 1:
        parser.error("--ranks must be positive integers")
    return args


def _choices(parser, text: str, table: dict, flag: str) -> list[str]:
    chosen = [c for c in text.split(",") if c]
    unknown = [c for c in chosen if c not in table]
    if unknown or not chosen:
        parser.error(f"{flag}: unknown or empty {unknown}; choose from {', '.join(table)}")
    return chosen


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the study and write ``faithful.json`` and ``faithful.png`` under ``--out``."""
    args = parse_args(argv)
    if args.tiny:
        args.ranks = sorted({min(r, 8) for r in args.ranks}, reverse=True)
        if args.references == REFERENCES:  # not beside the committed ones
            args.references = RESULTS_DIR / "faithful_references_tiny"
    result = {"machine": machine_info("cpu"),
              "commit": (git("rev-parse", "--short", "HEAD") or "unknown").strip(),
              "args": {k: str(v) for k, v in vars(args).items()}, "problems": {}}
    result["machine"]["threads"] = args.threads or torch.get_num_threads()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(args.threads or threads)
        run_all(args, result)
    finally:
        torch.set_num_threads(threads)
    return result


def run_all(args: argparse.Namespace, result: dict) -> None:
    """Run every problem of ``args`` into ``result``, writing JSON and PNG under ``--out``
    (with ``--update`` re-read before every write: other problems' runs are kept)."""
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "faithful.json"
    for name in args.problems:
        problem = PROBLEMS[name].shrink() if args.tiny else PROBLEMS[name]
        if args.references_only:
            with default_dtype(torch.float64):
                reference(name, problem, args.ranks, args.references, args.recompute_reference)
            continue
        with default_dtype(torch.float64):
            record = run_problem(name, problem, args)
        record["run"] = {"commit": result["commit"], "date": result["machine"]["date"]}
        print(report.markdown(name, record), flush=True)
        if args.update and path.exists():
            result["problems"] = {**json.loads(path.read_text())["problems"],
                                  **result["problems"]}
        result["problems"][name] = record
        path.write_text(json.dumps(result, indent=1))
    if result["problems"]:
        report.plot(result, args.out / "faithful.png")


if __name__ == "__main__":
    main()
