"""Benchmark models beyond plain stacks: torchvision ResNet-18 and a transformer encoder.

The parts (``--parts``), every configuration in fresh workers (``_harness.py``):

- ``eigh``: top-``k`` GGN eigenpairs by ``ggn_eigh`` against SciPy's ``eigsh`` on
  curvlinops' GGN operator, as in ``bench_eigh.py``;
- ``laplace``: ``lowrank_ggn`` (exact, MC) fit and GLM probit predictive against
  laplace-torch's ``kron`` with each of its backends, and one gradient pass (the floor);
- ``backends``: the torch.func engine of ``ggn_eigh`` against BackPACK's on ``3c3d``;
- ``scale`` (``gpu_check.sh resnet50k``): ResNet-18 with default arguments next to
  last-layer ``kron`` and ``full``, all-weights ``kron`` and one training epoch, shrunk
  to ``--fit-budget-s`` / ``--pred-budget-s`` (records: ``n_fit``, ``n_pred``);
- ``mnist``: ResNet-18 trained ``--epochs`` on MNIST; test metrics of the MAP and the
  marglik-tuned posteriors.

The transformer runs attention with PyTorch's math kernel and without the fused fast path
(the peers' forward-mode products need it). The default sizes (:data:`SIZES`) suit a CPU;
the targets' are ``--device cuda --N 128 --n-train 1024 --n-test 128``.

Examples::

    python -m benchmarks.bench_models --quick   # smoke test (tiny sizes)
    python -m benchmarks.bench_models           # default CPU run

Writes ``<out>/models.json``, ``<out>/models.png`` and the docs' table records
``<out>/models_tables/*.json`` (their ``sources`` name ``docs/benchmarks/models.json``).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks import _harness, _models_report, _problems, _worker
from benchmarks._models_report import MODELS, PART_METHODS, PARTS, plot, summarize, table_records
from benchmarks._report import DEFAULT_PACKAGES, VERDICTS, machine_info, print_machine, write_tables
from benchmarks._worker import ggn_eigsh, num_cores, probs_warnings, run_phases, worker_setup

NUM_CLASSES = 10
#: Sizes by model when the command line leaves them open: CPU runs, and ``--quick``.
SIZES = {"N": {"resnet18": 16, "transformer": 32, "3c3d": 128},
         "n_train": {"resnet18": 32, "transformer": 256, "scale": 256, "mnist": 512},
         "n_test": {"resnet18": 8, "transformer": 128, "scale": 64, "mnist": 256}}
QUICK_SIZES = {"N": {"resnet18": 4, "transformer": 8, "3c3d": 16},
               "n_train": {"resnet18": 8, "transformer": 16, "scale": 64, "mnist": 64},
               "n_test": {"resnet18": 2, "transformer": 4, "scale": 16, "mnist": 32}}


class TransformerClassifier(nn.Module):
    """Token and position embeddings, a masked transformer encoder (4 heads), mean pooling
    and a head; token 0 is padding, masked in attention and left out of the pooling."""

    def __init__(self, vocab: int, width: int, layers: int, seq_len: int, num_classes: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.pos = nn.Parameter(0.02 * torch.randn(seq_len, width))
        layer = nn.TransformerEncoderLayer(width, 4, dim_feedforward=4 * width, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``(N, num_classes)`` of token ids ``(N, seq_len)``."""
        pad = tokens == 0
        h = self.encoder(self.embed(tokens) + self.pos, src_key_padding_mask=pad)
        keep = (~pad).to(h.dtype)[..., None]
        return self.head((h * keep).sum(1) / keep.sum(1))


def make_model(name: str, n: int, config: dict[str, Any]) -> tuple[nn.Module, Tensor, Tensor]:
    """``(model, X, y)``: ``'resnet18'``, ``'transformer'`` or ``'3c3d'`` (seeded, eval
    mode; the transformer's sizes from the configuration) and ``n`` random labelled
    inputs."""
    if name == "3c3d":
        model, _, X, y = _problems.make_problem("3c3d", n, seed=config["seed"])
        return model.eval(), X, y
    torch.manual_seed(config["seed"])
    generator = torch.Generator().manual_seed(config["seed"] + 1)
    if name == "resnet18":
        import torchvision

        model = torchvision.models.resnet18(num_classes=NUM_CLASSES)
        X = torch.randn(n, 3, 32, 32, generator=generator)
    else:
        seq_len, vocab = config["seq_len"], config["vocab"]
        model = TransformerClassifier(vocab, config["width"], config["layers"], seq_len,
                                      NUM_CLASSES)
        lengths = torch.randint(max(1, seq_len // 4), seq_len + 1, (n,), generator=generator)
        tokens = torch.randint(1, vocab, (n, seq_len), generator=generator)
        X = tokens * (torch.arange(seq_len)[None] < lengths[:, None])
    y = torch.randint(0, NUM_CLASSES, (n,), generator=generator)
    return model.eval(), X, y


def _eigh_call(method: str, model: nn.Module, X: Tensor, y: Tensor, config: dict[str, Any]
               ) -> tuple[Callable[[], Any], dict[str, Any]]:
    """The measured call of an ``eigh`` or ``backends`` method (eigenvalues, eigenvectors)
    and the dict it fills (engine used, number of GGN-vector products)."""
    loss_func = nn.CrossEntropyLoss()
    extra: dict[str, Any] = {}
    if method == "eigsh":
        import curvlinops  # noqa: F401

        def call():
            evals, evecs, extra["num_products"] = ggn_eigsh(model, loss_func, [(X, y)], len(y),
                                                            config["k"])
            return evals, evecs

        return call, extra

    import lowrank_laplace as ll

    backend = "auto" if method == "ours" else method

    def call():
        torch.manual_seed(config["seed"])
        result = ll.ggn_eigh(model, loss_func, X, y, top_k=config["k"], backend=backend,
                             low_memory=config["low_memory"])
        extra.update(backend_used=result.backend,
                     kept_fraction=float(result.eigenvalues.sum() / result.trace))
        return result.eigenvalues, result.eigenvectors

    return call, extra


def _laplace_phases(method: str, model: nn.Module, X: Tensor, y: Tensor,
                    config: dict[str, Any]) -> list[tuple[str, Callable[[], Any]]]:
    """The phases ``fit`` and (except ``grad_pass``) ``glm`` of a ``laplace`` method."""
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(X[: config["n_train"]], y[: config["n_train"]]),
                        batch_size=min(config["batch_size"], config["n_train"]), shuffle=False)
    X_test = X[config["n_train"] :]
    if method == "grad_pass":
        loss_func = nn.CrossEntropyLoss(reduction="sum")

        def grad_pass():
            for xb, yb in loader:
                model.zero_grad(set_to_none=True)
                loss_func(model(xb), yb).backward()
            model.zero_grad(set_to_none=True)

        return [("fit", grad_pass, lambda out: {})]

    import laplace

    import lowrank_laplace  # noqa: F401 (registers hessian_structure="lowrank_ggn")

    if method.startswith("kron"):
        kwargs: dict[str, Any] = {"hessian_structure": "kron"}
        if method != "kron_default":
            from laplace.curvature import AsdlGGN, BackPackGGN

            kwargs["backend"] = BackPackGGN if method == "kron_backpack" else AsdlGGN
    else:
        kwargs = {"hessian_structure": "lowrank_ggn", "rank": config["rank"],
                  "mc_samples": 1 if method == "lowrank_mc" else 0}
    state: dict[str, Any] = {}

    def fit():
        torch.manual_seed(config["seed"])
        la = laplace.Laplace(model, "classification", subset_of_weights="all", **kwargs)
        la.fit(loader)
        state["la"] = la
        return la

    def glm():
        return state["la"](X_test, pred_type="glm", link_approx="probit").detach()

    def fitted(la) -> dict[str, Any]:
        if not method.startswith("lowrank"):
            return {"H_type": type(la.H).__name__}
        return {"H_type": type(la.H).__name__, "kept_fraction": float(la.kept_fraction),
                "backend_used": la.factor_backend_used}

    return [("fit", fit, fitted), ("glm", glm, probs_warnings(len(X_test), NUM_CLASSES))]


def _scale_phases(method: str, model: nn.Module, X: Tensor, y: Tensor, config: dict[str, Any]
                  ) -> list[tuple]:
    """``fit``, ``marglik``, ``glm`` and NN ``samples`` of a ``scale`` method."""
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(X[: config["n_train"]], y[: config["n_train"]]),
                        config["batch_size"])
    if method == "train_epoch":
        return [("fit", lambda: _problems.train(model, loader))]
    make, state = _problems.posterior(method, model, config["seed"]), {}
    loader, sizes = _worker.fit_within(lambda part: make().fit(part), loader,
                                       config["fit_budget_s"])

    def fit() -> dict:
        state["la"] = la = make()
        la.fit(loader)
        kept = {"kept_fraction": float(la.kept_fraction)} if hasattr(la, "kept_fraction") \
            else {}
        return {"H_type": type(la.H).__name__, **sizes, **kept}

    tests = X[config["n_train"]:].split(config["pred_batch"])

    def predict(kind: str) -> Callable[[], dict]:
        def call() -> dict:
            la, samples = state["la"], config["samples"]
            out = _worker.chunks_within(
                lambda x: la(x, pred_type="glm", link_approx="probit") if kind == "glm"
                else la.predictive_samples(x, pred_type="nn", n_samples=samples),
                tests, config["pred_budget_s"])
            return {"n_pred": out.shape[-2], **(probs_warnings(len(out), NUM_CLASSES)(out)
                                                if kind == "glm" else {})}
        return call

    def marglik() -> dict:
        state["la"].optimize_prior_precision(method="marglik", n_steps=config["marglik_steps"])
        return {"prior_precision": state["la"].prior_precision.cpu().reshape(-1)[:4].tolist()}

    return [(name, fn, lambda fields: fields) for name, fn in (
        ("fit", fit), ("marglik", marglik), ("glm", predict("glm")),
        ("samples", predict("samples")))]


def _mnist_phases(config: dict[str, Any], device: torch.device) -> list[tuple]:
    """MNIST: ``train`` a ResNet-18, then the test metrics of its MAP and each posterior."""
    import torchvision
    from torch.utils.data import DataLoader, TensorDataset

    from lowrank_laplace.toolkit import metrics

    X_train, y_train, X_test, y_test = _problems.mnist_rgb(config["n_train"], config["n_test"],
                                                           config["seed"], device)
    train = TensorDataset(X_train, y_train)
    torch.manual_seed(config["seed"])
    model = torchvision.models.resnet18(num_classes=NUM_CLASSES).to(device)

    def scores(predict: Callable[[Tensor], Tensor]) -> dict:
        probs = torch.cat([predict(x).detach() for x in X_test.split(config["pred_batch"])])
        return {"metrics": metrics.classification_metrics(probs, y_test)}

    def evaluated(method: str) -> Callable[[], dict]:
        def run() -> dict:
            la = _problems.posterior(method, model, config["seed"])()
            la.fit(DataLoader(train, config["batch_size"]))
            la.optimize_prior_precision(method="marglik", n_steps=config["marglik_steps"])
            return scores(lambda x: la(x, pred_type="glm", link_approx="probit"))
        return run

    def train_map():
        _problems.train(model, DataLoader(train, config["batch_size"], shuffle=True),
                        config["epochs"])

    return [("train", train_map), ("map", lambda: scores(lambda x: model(x).softmax(-1)),
                                   lambda m: m),
            *((m, evaluated(m), lambda m: m) for m in _models_report.MNIST_PHASES[2:])]


def worker_main(config: dict[str, Any]):
    """Run one configuration (:func:`configurations`), one record per measured phase."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    setup = worker_setup(config)
    device = torch.device(config["device"])
    if config["model"] == "transformer":
        torch.backends.mha.set_fastpath_enabled(False)
    if config["part"] == "mnist":
        run_phases(setup, _mnist_phases(config, device), config, stop_on_failure=False)
        return
    n = config["N"] if "N" in config else config["n_train"] + config["n_test"]
    model, X, y = make_model(config["model"], n, config)
    model, X, y = model.to(device), X.to(device), y.to(device)
    setup.update(D=sum(p.numel() for p in model.parameters() if p.requires_grad), N=n)
    if config["part"] == "scale":
        phases = _scale_phases(config["method"], model, X, y, config)
    elif config["part"] == "laplace":
        phases = _laplace_phases(config["method"], model, X, y, config)
    else:
        call, extra = _eigh_call(config["method"], model, X, y, config)
        phases = [("eigh", call, lambda out: {
            "eigenvalues": out[0].detach().double().sort(descending=True).values.tolist(),
            "eigenvectors_shape": list(out[1].shape), **extra})]
    kernel = sdpa_kernel(SDPBackend.MATH) if config["model"] == "transformer" else None
    with kernel or contextlib.nullcontext():
        run_phases(setup, phases, config)


def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every ``(part, model, method)`` configuration with its sizes."""
    common = {k: getattr(args, k) for k in (
        "k", "seed", "threads", "rank", "batch_size", "mem_limit_gib", "vocab", "width",
        "layers", "seq_len", "device", "low_memory", "fit_budget_s", "pred_budget_s",
        "pred_batch", "samples", "epochs", "marglik_steps")}
    phases = {"laplace": ["fit", "glm"], "scale": list(_models_report.SCALE_PHASES),
              "mnist": list(_models_report.MNIST_PHASES), "eigh": ["eigh"], "backends": ["eigh"]}
    configs = []
    for part in args.parts:
        models = {"backends": ("3c3d",), "scale": ("resnet18",), "mnist": ("resnet18",)}
        for model in models.get(part, args.models):
            names = ("N",) if part in ("eigh", "backends") else ("n_train", "n_test")
            size = {k: getattr(args, k) or args.sizes[k].get(part, args.sizes[k].get(model))
                    for k in names}
            configs += [{"part": part, "model": model, "method": method, **size, **common,
                         "phases": ["fit"] if method in ("grad_pass", "train_epoch")
                         else phases[part]} for method in PART_METHODS[part]]
    return configs


def driver_main(args: argparse.Namespace) -> dict[str, Any]:
    """Run all configurations, write JSON, tables and figure; print and return the targets."""
    out = Path(args.out)
    info = machine_info(args.device, (*DEFAULT_PACKAGES, "laplace-torch", "torchvision"))
    print_machine(info)
    settings = {"parts": list(args.parts), "models": list(args.models), "device": args.device,
                "threads": args.threads or num_cores(),
                "transformer": {"vocab": args.vocab, "width": args.width, "layers": args.layers,
                                "seq_len": args.seq_len, "heads": 4, "ff": 4 * args.width},
                **{k: getattr(args, k) for k in (
                    "k", "rank", "batch_size", "seed", "low_memory", "timeout", "mem_limit_gib",
                    "fit_budget_s", "pred_budget_s", "pred_batch", "samples", "epochs",
                    "marglik_steps")}}
    plan = _harness.Plan("benchmarks.bench_models", configurations(args),
                         ("part", "model", "method"), out / "models.json", settings, info)
    records = plan.run(args)
    summary = summarize(records, settings)
    payload = plan.write(records, summary, args)
    plot(payload, out / "models.png")
    write_tables(table_records(payload, "docs/benchmarks/models.json"), out / "models_tables")
    print("\nTargets:")
    for key, item in summary.items():
        unit = item.get("unit", "x")
        value = "-" if item["value"] is None else f"{item['value']:.2f}{unit}"
        extra = f" ({item['peer_failure'][:100]})" if item.get("peer_failure") else ""
        target = "" if item["target"] is None else f" (target {item['target']:g}{unit})"
        print(f"  {key:<32} {value:>8}{target}: {VERDICTS[item['ok']]}{extra}")
    print(f"\nWrote {plan.path} and {out / 'models.png'}")
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``sizes`` holds the sizes it leaves open."""
    parser = _harness.script_parser(
        __doc__, "timeout", "mem_limit_gib", "device", "out", "seed", "threads",
        "blas_threads", "omp_wait_policy", "wait_for", "wait_max", "wait_poll", "wait_idle",
        "retry_busy", "repeat", timeout=900.0, out=str(_harness.RESULTS_DIR))
    parser.add_argument("--parts", nargs="+", choices=PARTS,
                        default=list(_models_report.DEFAULT_PARTS))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--N", type=int, default=None,
                        help="Batch of the eigenpairs (default: resnet18 16, transformer "
                        "32, 3c3d 128).")
    parser.add_argument("--n-train", type=int, default=None,
                        help="Laplace training points (default: resnet18 32, transformer 256).")
    parser.add_argument("--n-test", type=int, default=None,
                        help="GLM predictive points (default: resnet18 8, transformer 128).")
    parser.add_argument("--k", type=int, default=10, help="Number of leading eigenpairs.")
    parser.add_argument("--rank", type=int, default=100, help="Rank of `lowrank_ggn`.")
    parser.add_argument("--batch-size", type=int, default=128, help="Laplace loader batch.")
    parser.add_argument("--low-memory", action="store_true",
                        help="ggn_eigh with low_memory=True (two passes).")
    parser.add_argument("--fit-budget-s", type=float, default=0.0, help="scale: fit "
                        "only the first batches that fit this budget (0: all).")
    parser.add_argument("--pred-budget-s", type=float, default=0.0, help="scale: predict "
                        "only the test chunks that fit this budget (0: all).")
    parser.add_argument("--pred-batch", type=int, default=500, help="Predictive chunk.")
    parser.add_argument("--samples", type=int, default=10, help="scale: NN samples.")
    parser.add_argument("--epochs", type=int, default=3, help="mnist: training epochs.")
    parser.add_argument("--marglik-steps", type=int, default=100, help="scale, mnist: steps "
                        "of the marginal-likelihood prior tuning (laplace-torch's default).")
    parser.add_argument("--vocab", type=int, default=1000, help="Transformer vocabulary.")
    parser.add_argument("--width", type=int, default=128, help="Transformer width.")
    parser.add_argument("--layers", type=int, default=4, help="Transformer layers.")
    parser.add_argument("--seq-len", type=int, default=64, help="Transformer sequence length.")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke test: tiny sizes (N 4, 16 / 4 points, 2-layer "
                        "transformer of width 32), output in <out>/quick.")
    args = parser.parse_args(argv)
    args.sizes = QUICK_SIZES if args.quick else SIZES
    if args.quick:
        args.width, args.layers, args.seq_len, args.k = 32, 2, 16, 4
        args.out = str(Path(args.out) / "quick")
    return args


main = _harness.script_main(parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
