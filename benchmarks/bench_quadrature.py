"""Lanczos quadrature of the dropped curvature against the exact full-GGN posterior.

A design measured beside ``bench_faithful``'s cached exact references (run that first
with ``--cache``): the default fit at rank 100, then Lanczos runs on the deflated
whole-data GGN ``P G P`` (``P`` projects out the kept eigenvectors and the logit-shift
directions; every step one GGN-matrix product over all training inputs):

- Jacobian starts ``P J^T eps`` (random signs over the first probe inputs' outputs):
  Gauss quadrature of ``b^T (h P G P + delta)^{-1} b`` gives the complement variance
  ``v`` per unit of Jacobian energy, weighted as the inputs' energies weight it;
- Gaussian starts in the range of ``P`` (stochastic Lanczos quadrature): nodes and
  counts of the dropped spectrum, which replace the modelled tail in the marglik and
  the log det.

Each variant's per-point functional variance is compared with the exact posterior's,
at the variant's own marglik prior and at the exact one (``docs/posterior_quality.md``,
"Lanczos quadrature of the dropped curvature")::

    python -m benchmarks.bench_quadrature --problems mnist_aug_early --cache CACHE
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.func import functional_call, jvp, vjp, vmap

from benchmarks import _faithful_report as report
from benchmarks import bench_faithful as faithful
from benchmarks._exact import chunks, jacobians, trainable_names
from benchmarks._faithful_problems import build_model, make_data
from lowrank_laplace.posterior.complement import MeasuredComplement

#: Probe inputs the Jacobian starts combine (the fit's first training inputs).
PROBE = 256


def ggn_product(model, inputs) -> tuple[Callable[[Tensor], Tensor], int]:
    """``X (s, D) -> G X`` over all ``inputs`` (softmax cross-entropy GGN), and ``D``."""
    names = trainable_names(model)
    params = {n: p.detach() for n, p in model.named_parameters() if n in names}
    shapes = [params[n].shape for n in names]
    sizes = [params[n].numel() for n in names]

    def product(X: Tensor) -> Tensor:
        tangents = {n: t.reshape(len(X), *s) for n, t, s in zip(names, X.split(sizes, 1), shapes)}
        out = torch.zeros_like(X)
        for part in chunks(inputs, 3000):
            def logits(p, part=part):
                return functional_call(model, p, (part,))
            value, back = vjp(logits, params)
            probs = value.softmax(-1)
            JX = vmap(lambda t: jvp(logits, (params,), (t,))[1])(tangents)
            HJX = probs * JX - probs * (probs * JX).sum(-1, keepdim=True)
            grads = vmap(back)(HJX)[0]
            out += torch.cat([grads[n].flatten(1) for n in names], 1)
        return out

    return product, sum(sizes)


def lanczos(apply: Callable[[Tensor], Tensor], starts: Tensor, steps: int
            ) -> tuple[Tensor, Tensor]:
    """Independent Lanczos runs (full reorthogonalization), one per row of ``starts``.

    Returns the Ritz values ``(s, k)`` and their Gauss weights ``||b||^2 y_1^2``.
    """
    norms = starts.norm(dim=1, keepdim=True)
    basis, alphas, betas = [starts / norms], [], []
    beta, previous = torch.zeros_like(norms), torch.zeros_like(starts)
    for _ in range(steps):
        W = apply(basis[-1])
        alpha = (W * basis[-1]).sum(1, keepdim=True)
        W = W - alpha * basis[-1] - beta * previous
        for q in basis:
            W = W - (W * q).sum(1, keepdim=True) * q
        beta = W.norm(dim=1, keepdim=True)
        alphas.append(alpha[:, 0])
        betas.append(beta[:, 0])
        previous = basis[-1]
        basis.append(W / beta)
    A, B = torch.stack(alphas, 1), torch.stack(betas, 1)[:, :-1]
    T = torch.diag_embed(A) + torch.diag_embed(B, 1) + torch.diag_embed(B, -1)
    theta, Y = torch.linalg.eigh(T)
    return theta.clamp(min=0), Y[:, 0] ** 2 * norms**2


def quadrature(la, model, data, steps: int, runs: int) -> dict:
    """The two kinds of Lanczos runs on the deflated GGN of ``la``'s fit."""
    product, dim = ggn_product(model, data.fit[0])
    U, null = la.H[0].double(), la.residual_model.null

    def project(X: Tensor) -> Tensor:
        X = X - (X @ U) @ U.T
        return X if null is None else X - null.expand(null.project(X), dim)

    inputs = data.fit[0][:PROBE]
    J, _ = jacobians(model, trainable_names(model), inputs)
    outside = project(J.reshape(-1, dim)).reshape(J.shape)
    generator = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (runs, *J.shape[:2]), generator=generator).double() * 2 - 1
    jacobian = torch.einsum("smc,mcd->sd", signs, outside)
    gaussian = project(torch.randn(runs, dim, generator=generator, dtype=torch.float64))
    start = time.perf_counter()
    theta, weight = lanczos(lambda X: project(product(project(X))),
                            torch.cat([jacobian, gaussian]), steps)
    free = dim - U.shape[1] - (0 if null is None else null.count)
    nodes, counts = theta[runs:].flatten(), (weight[runs:] / weight[runs:].sum(1, keepdim=True)
                                             * free / runs).flatten()
    return {"mu": theta[:runs].flatten(), "q": weight[:runs].flatten(), "nodes": nodes,
            "counts": counts, "free": free, "seconds": time.perf_counter() - start}


def use_quadrature(la, found: dict, spectrum: bool) -> None:
    """Give ``la``'s spectral residual the quadrature's ``v`` (and its dropped spectrum)."""
    residual = la.residual_model
    residual.complement = MeasuredComplement(found["mu"], found["q"], None, None,
                                             found["q"].sum(), 1.0, 0.0)
    if not spectrum:
        return
    nodes, counts, free = found["nodes"], found["counts"], found["free"]
    shift = residual._shift

    def dropped(kept, scale):
        return [nodes * scale], [counts]

    def shifted(scale, prior, num, device):
        rho, _ = shift(scale, prior, num, device)
        delta = prior.to(torch.float64).mean().reshape(())
        h = torch.as_tensor(scale).to(torch.float64)
        return rho, (counts * torch.log(h * nodes + delta)).sum() + (num - free) * delta.log()

    residual._dropped_spectrum, residual._shift = dropped, shifted


def errors(fitted, model, data, ref) -> dict:
    """Median f-var errors (own / exact prior), NLL and the complement ratio per test set."""
    la = fitted.la
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.optimize_prior_precision(method="marglik", n_steps=faithful.MARGLIK_STEPS, lr=0.1)
    v = la.residual_model.complement_variance(torch.tensor(1.0), torch.tensor(ref["delta"]))
    fitted.record.update(measured_v_at_exact_prior=float(v), sets={})
    faithful.evaluate([fitted], model, data, ref)
    out = {"prior": float(la.prior_precision.reshape(-1)[0]), "v_at_exact_prior": float(v)}
    for name, metrics in fitted.record["sets"].items():
        out[name] = {"fvar_error": metrics["fvar_error"]["median"],
                     "fvar_error_at_exact_prior": metrics["fvar_error_at_exact_prior"]["median"],
                     "nll": metrics["nll"],
                     "complement_ratio": metrics.get("complement_ratio_median")}
    return out


def run_problem(name: str, cache: Path, steps: int, runs: int) -> dict:
    """The default fit and its variants on one cached problem."""
    ref = torch.load(cache / f"{name}.pt", weights_only=False)
    problem = faithful.PROBLEMS[name]
    data = make_data(problem)
    model = build_model(problem, data.features).double()
    model.load_state_dict(ref["state"])
    model.eval()
    fitted = faithful.fit_method("default", 100, model, data.fit, faithful.MARGLIK_STEPS)
    exact = {k: s["exact"]["nll"] for k, s in report.exact_sets(ref, data).items()}
    record = {"exact_prior": ref["delta"], "fit_s": fitted.record["fit_s"], "exact_nll": exact}
    record["default"] = errors(fitted, model, data, ref)
    found = quadrature(fitted.la, model, data, steps, runs)
    record["quadrature_s"] = found["seconds"]
    for label, spectrum in (("quadrature_v", False), ("quadrature_v_and_spectrum", True)):
        use_quadrature(fitted.la, found, spectrum)
        fitted.la.prior_precision = 1.0
        record[label] = errors(fitted, model, data, ref)
        print(name, label, json.dumps(record[label]), flush=True)
    return record


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="mnist_aug_early")
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8, help="Lanczos steps (data passes)")
    parser.add_argument("--runs", type=int, default=8, help="runs of each kind")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/quadrature"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = {"steps": args.steps, "runs": args.runs, "git": faithful.git(), "problems": {}}
    path = args.out / "quadrature.json"
    if path.exists():
        result["problems"] = json.loads(path.read_text()).get("problems", {})
    for name in args.problems.split(","):
        result["problems"][name] = run_problem(name, args.cache, args.steps, args.runs)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
