"""The torch.func backend: ``V`` from vmapped vector-Jacobian products (docs/concepts.md).

Each sample's loss-Hessian factor columns, and its loss gradient for the per-sample
gradients, are pulled back by one VJP each, vmapped over columns and the samples of a
chunk; a parameter's rows become a :class:`~lowrank_laplace.factor.blocks.DenseBlock`,
except an ``nn.Linear`` weight called once on vector inputs, which stays a
:class:`~lowrank_laplace.factor.blocks.KronBlock`. Tied weights are exact. Shapes:
``N_c`` samples of a chunk, ``V`` vectors per sample.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import MutableMapping
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_map

from lowrank_laplace.engine.base import EngineBase
from lowrank_laplace.engine.model_copy import removing
from lowrank_laplace.engine.request import Collector
from lowrank_laplace.engine.rng import forked_rng, rng_state, set_rng_state
from lowrank_laplace.factor import DenseBlock, KronBlock, factor_columns
from lowrank_laplace.factor.loss_sqrt import hessian_sqrt, mc_noise, per_sample_scale
from lowrank_laplace.utils import batches, checks

#: Bytes of a chunk's vmapped products (docs/benchmarks/design_measurements.md).
CHUNK_BUDGET = 2**30


class FuncEngine(EngineBase):
    """The torch.func backend (arguments as :class:`~lowrank_laplace.engine.base.EngineBase`'s).

    ``chunk_budget`` is the bytes one chunk of vmapped products may take.
    """

    backend = "functorch"
    gradient_in_factor_pass = True

    def __init__(self, model: nn.Module, loss_func: nn.Module, eval_mode: bool = False,
                 chunk_budget: int = CHUNK_BUDGET):
        super().__init__(model, loss_func, eval_mode)
        self._names = [name for name, _ in self._copy.named_parameters()]
        self._aliases = _aliases(self._copy)
        self.chunk_budget = chunk_budget
        self._features: Optional[int] = None  # sum of leaf output sizes of one sample
        self._factored: Dict[str, nn.Module] = {}  # factored nn.Linear weights, by name
        #: Whether the samples are vmapped (else looped); decided on the first batch.
        self.vectorize = True
        self._has_rnn = any(isinstance(m, nn.RNNBase) for m in self._copy.modules())

    def _check_model(self, model: nn.Module, eval_mode: bool) -> None:
        _refuse_prelu(model)

    def _factored_ids(self) -> set:
        return {id(p) for name, p in zip(self._names, self.model.parameters())
                if name in self._factored}

    def _vector_entries(self, feature_sizes: List[int], one_block: bool) -> int:
        # all of V is held (no factored layers), plus the products' intermediates
        return self.dense_param_count() + sum(feature_sizes)

    def probe(self, inputs: Any, targets: Optional[Tensor] = None) -> None:
        """See :meth:`EngineBase.probe`: the products on one sample, vmapped else looped."""
        outputs, sizes = self.sizing_forward(inputs)
        checks.check_outputs(outputs)
        if targets is not None:  # a target error is not a torch.func failure
            checks.check_targets(self.loss_func, outputs.new_zeros(len(targets),
                                                                    outputs.shape[1]), targets)
        stack: List[str] = []
        names = {m: n for n, m in self._copy.named_modules()}

        def enter(module, inp):
            stack.append(names.get(module, "?"))

        def leave(module, inp, out):
            if stack:
                stack.pop()

        handles = [h for m in self._copy.modules()
                   for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
        device = batches.batch_device(inputs)
        first = batches.take(inputs, slice(0, 1))
        y = outputs.new_zeros(1, outputs.shape[1]) if targets is None else targets[:1]
        self._sync()
        params, aliases = self._param_dicts()
        with removing(handles):
            try:
                # train-mode dropout draws from a forked generator: the caller's do not move
                with forked_rng(device), warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    self.vectorize = True
                    try:
                        self._products(first, y, params, aliases, 0, True, (1, 1), {})
                    except Exception:  # noqa: BLE001 - vmap failed: one sample at a time
                        self.vectorize = False
                        stack.clear()
                        self._products(first, y, params, aliases, 0, True, (1, 1), {})
                    self._factored = self._factorable(first, y, params, aliases, device)
                _warn_if_looping(caught, self.vectorize)
            except Exception as err:  # noqa: BLE001 - re-raised with the module named
                raise _cannot_differentiate(err, stack[-1] if stack else "") from err
        self._features = sum(sizes)

    def _factorable(self, first: Any, y: Tensor, params: Dict[str, Tensor],
                    aliases: Dict[str, List[str]], device: torch.device
                    ) -> Dict[str, nn.Module]:
        """Linear weights called once per sample, factored rows equal to expanded (draws RNG)."""
        names = {id(p): name for name, p in zip(self._names, self._copy_params)}
        candidates, calls = {}, {}
        for module in self._copy.modules():
            name = names.get(id(getattr(module, "weight", None)))
            if isinstance(module, nn.Linear) and name in params and len(aliases[name]) == 1:
                candidates[name] = module

        def count(module, inp, out):  # once, on the sample's one row
            once = inp[0].ndim == 2 and inp[0].shape[0] == 1
            calls[module] = calls.get(module, 0) + (1 if once else 2)

        handles = [m.register_forward_hook(count) for m in candidates.values()]
        with removing(handles), torch.no_grad():
            self._copy(first)
        candidates = {n: m for n, m in candidates.items() if calls.get(m) == 1}
        if not candidates:
            return {}
        state = rng_state(device)
        _, plain, _ = self._products(first, y, params, aliases, 0, True, (1, 1), {})
        set_rng_state(state, device)
        _, rows, zs = self._products(first, y, params, aliases, 0, True, (1, 1), candidates)
        return {n: m for n, m in candidates.items()
                if torch.allclose(plain[n].flatten(2),
                                  (rows[n][..., None] * zs[n][:, None, None, :]).flatten(2))}

    def _param_dicts(self):
        """The differentiated parameters of the copy by name, and their aliases."""
        params = {name: p.detach() for name, p in zip(self._names, self._copy_params)
                  if p.requires_grad}
        return params, {name: self._aliases[name] for name in params}

    def _products(self, inputs: Any, targets: Optional[Tensor], params: Dict[str, Tensor],
                  aliases: Dict[str, List[str]], mc_samples: int, curvature: bool,
                  rho: Tuple[float, float], factored: Dict[str, nn.Module]
                  ) -> Tuple[Tensor, Dict[str, Tensor], Dict[str, Tensor]]:
        """Outputs, rows ``(N_c, V + 1, ...)`` (``rho``-scaled VJPs of ``s`` and ``g``), inputs."""
        n = batches.batch_size(inputs)
        model, loss = self._copy, self.loss_func
        ref = next(iter(params.values()))
        noise = mc_noise(loss, n, self.num_outputs, mc_samples, ref) if curvature else None

        vectorize = self.vectorize
        fixed = {name: params[name] for name in factored}  # not differentiated
        free = {name: p for name, p in params.items() if name not in factored}
        shifts = {name: params[name].new_zeros(params[name].shape[0]) for name in factored}

        def sample(x, y, nz):
            def f(p, delta):
                batched = tree_map(lambda t: t.unsqueeze(0) if isinstance(t, Tensor) else t, x)
                # a tied parameter goes in under each owning module's name, once each
                full = {alias: p[name] for name, names in aliases.items() if name in p
                        for alias in names}
                full.update(fixed)
                inputs_of = {}
                # before the user's forward hooks, which act on the shifted output
                handles = [module.register_forward_hook(_shift_hook(name, delta, inputs_of),
                                                        prepend=True)
                           for name, module in factored.items()]
                with removing(handles), _plain_rnn(self._has_rnn):
                    out = functional_call(model, full, (batched,), tie_weights=False)
                return out.squeeze(0), {k: z.squeeze(0) for k, z in inputs_of.items()}

            out, pull, zs = vjp(f, free, shifts, has_aux=True)
            rows = [rho[0] * _output_gradient(loss, out, y)[None]]
            if curvature:
                rows.insert(0, rho[1]**0.5 * hessian_sqrt(
                    loss, out[None], mc_samples, None if nz is None else nz[None])[:, 0])
            cotangents = torch.cat(rows)
            if vectorize:
                grads, out_vectors = vmap(pull)(cotangents)
                return out, {**grads, **out_vectors}, zs
            pulled = [{**g, **s} for g, s in map(pull, cotangents)]
            return out, {k: torch.stack([r[k] for r in pulled]) for k in pulled[0]}, zs

        if vectorize:
            x_dims = _batched_dims(inputs, n)
            return vmap(sample, in_dims=(x_dims, None if targets is None else 0,
                                         None if noise is None else 0),
                        randomness="different")(inputs, targets, noise)
        # one sample at a time: models vmap cannot batch (LSTM, data-dependent branches)
        results = [sample(batches.take(inputs, i, n), None if targets is None else targets[i],
                          None if noise is None else noise[i]) for i in range(n)]
        rows = {k: torch.stack([r[1][k] for r in results]) for k in results[0][1]}
        zs = {k: torch.stack([r[2][k] for r in results]) for k in results[0][2]}
        return torch.stack([r[0] for r in results]), rows, zs

    def _chunk_size(self, num_vectors: int, itemsize: int) -> int:
        per_sample = itemsize * (num_vectors + 1) * (self.dense_param_count()
                                                    + 2 * (self._features or 0))
        return max(1, self.chunk_budget // max(per_sample, 1))

    def _pass(self, inputs: Any, targets: Optional[Tensor], mc_samples: int,
              subsampling: Optional[List[int]], collector: Collector
              ) -> Tuple[Tensor, Tensor, Dict[int, Tensor]]:
        if self._features is None:
            self.probe(inputs, targets)
            self._sync(collector.groups)
        n = checks.check_batch(inputs, targets)
        num_out = self.num_outputs
        ref = self._copy_params[0]
        if targets is None:
            targets = torch.zeros(n, num_out, dtype=ref.dtype, device=ref.device)
        checks.check_targets(self.loss_func, ref.new_zeros(n, num_out), targets)
        mean = self.loss_func.reduction == "mean"
        curv = list(range(n)) if subsampling is None else subsampling
        rest = [] if subsampling is None else sorted(set(range(n)) - set(subsampling))
        num_vectors = factor_columns(self.loss_func, (n, num_out), mc_samples)
        params, aliases = self._param_dicts()
        factored = {name: m for name, m in self._factored.items() if name in params}
        chunk = self._chunk_size(num_vectors, ref.element_size())
        outputs = ref.new_zeros(n, num_out)
        width = {name: p.shape[0] if name in factored else p.numel()
                 for name, p in params.items()}
        # rows written in place, ordered (vector, sample): no concatenated copies
        v_rows = {name: p.new_empty(num_vectors, len(curv), width[name])
                  for name, p in params.items()}
        g_rows = {name: p.new_zeros(n, width[name]) for name, p in params.items()}
        z_rows = {name: params[name].new_zeros(n, params[name].shape[1]) for name in factored}
        for indices, curvature in ((curv, True), (rest, False)):
            for start in range(0, len(indices), chunk):
                idx = torch.tensor(indices[start:start + chunk], device=targets.device)
                with warnings.catch_warnings():  # the probe warned once if it loops
                    warnings.filterwarnings("ignore", message=_NO_BATCHING_RULE)
                    out, rows, zs = self._products(
                        batches.take(inputs, idx, n), targets[idx], params, aliases,
                        mc_samples, curvature,
                        (1 / n if mean else 1.0, 1 / len(curv) if mean else 1.0), factored)
                outputs[idx] = out
                for name, z in zs.items():
                    z_rows[name][idx] = z
                for name, r in rows.items():
                    g_rows[name][idx] = r[:, -1].reshape(len(idx), -1)
                    if curvature:
                        v_rows[name][:, start:start + len(idx)] = \
                            r[:, :-1].reshape(len(idx), num_vectors, -1).transpose(0, 1)
        loss = self._loss(outputs, targets)
        checks.check_finite(loss)
        grad = {}
        by_name = dict(zip(self._names, range(len(self._names))))
        for name in params:
            i = by_name[name]
            if i not in collector.group_of:
                continue
            per_sample = g_rows.pop(name)
            if name in factored:
                z = z_rows.pop(name)
                z_curv = z if subsampling is None else z[torch.tensor(curv, device=z.device)]
                block = KronBlock(v_rows.pop(name), z_curv)
                grad[i] = (per_sample.T @ z).flatten()
                grads = KronBlock(per_sample[None], z)
            else:
                block = DenseBlock(v_rows.pop(name).view(num_vectors * len(curv), -1))
                grad[i] = per_sample.sum(0)
                grads = DenseBlock(per_sample)
            collector.add(i, block, grads if collector.batch_grad else None)
        return outputs, loss, grad


@contextlib.contextmanager
def _plain_rnn(has_rnn: bool):
    """Run RNNs (``has_rnn``) without cuDNN, whose weight flattening fails on torch.func tensors."""
    before = torch.backends.cudnn.enabled
    if has_rnn:
        torch.backends.cudnn.enabled = False
    try:
        yield
    finally:
        torch.backends.cudnn.enabled = before


def _shift_hook(name: str, delta: Dict[str, Tensor], inputs_of: Dict[str, Tensor]):
    """Forward hook adding a zero shift (its gradient: ``s``) to an output; keeps the input."""
    def hook(module, inp, out):
        inputs_of[name] = inp[0]
        return out + delta[name]

    return hook


def _aliases(model: nn.Module) -> Dict[str, List[str]]:
    """Parameter name -> its names under each owning module object, once each (functional_call)."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    aliases: Dict[str, List[str]] = {name: [] for name in canonical.values()}
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            aliases[canonical[id(p)]].append(f"{prefix}.{name}" if prefix else name)
    return aliases


def _batched_dims(inputs: Any, n: int):
    """``in_dims`` for vmap: 0 for tensors with ``n`` rows, ``None`` otherwise."""
    if isinstance(inputs, MutableMapping):
        return {k: 0 if isinstance(v, Tensor) and v.ndim and v.shape[0] == n else None
                for k, v in inputs.items()}
    return 0


def _output_gradient(loss: nn.Module, out: Tensor, y: Tensor) -> Tensor:
    """Gradient of one sample's loss ``l_n`` w.r.t. its outputs, ``(C,)``."""
    if isinstance(loss, nn.MSELoss):
        return 2 * per_sample_scale(loss, out.shape[0]) * (out - y)
    onehot = (torch.arange(out.shape[0], device=out.device) == y).to(out.dtype)
    return out.softmax(0) - onehot


def _cannot_differentiate(err: Exception, module: str) -> NotImplementedError:
    """The error that names where torch.func failed and the ways out."""
    where = f"in module {module!r} " if module else ""
    return NotImplementedError(
        f"The functorch backend cannot differentiate this model: "
        f"{type(err).__name__} {where}({err}). torch.func needs operations it "
        "can differentiate (no conversions to NumPy or Python numbers on the "
        "path to the outputs). Ways out: rewrite that module, compute "
        "the curvature of the layers after it only (laplace-torch's "
        "subset_of_weights='last_layer', or param_groups), or use a model "
        "BackPACK supports (backend='backpack').")


#: The words of the warning that samples are looped (a ``warnings.filterwarnings`` pattern).
LOOPING = ".*so the functorch backend computes V one sample at a time"
#: torch.func's warning that an operation has no batching rule (it then loops).
_NO_BATCHING_RULE = "There is a performance drop because we have not yet implemented"


def _warn_if_looping(caught: list, vectorized: bool) -> None:
    """Warn once (the fit's engine) where samples are looped, not batched; re-emit the rest."""
    loops = set()
    for w in caught:
        found = re.search(r"batching rule for (\S+?)\.", str(w.message))
        if found and str(w.message).startswith(_NO_BATCHING_RULE):
            loops.add(found.group(1))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    what = (f"torch.func has no batching rule for {', '.join(sorted(loops))}"
            if vectorized else "torch.func cannot vmap this model")
    if loops or not vectorized:
        warnings.warn(
            f"{what}, so the functorch backend computes V one sample at a time (slow). "
            "The hooks backend needs no vmap: it takes models whose trainable "
            "parameters are linear, embedding or norm layers (e.g. LoRA adapters and "
            "heads over a frozen model); 'eager' attention also batches.",
            UserWarning, stacklevel=1)


def _refuse_prelu(model: nn.Module) -> None:
    """Refuse ``nn.PReLU``: vmap broadcasts its slopes against the wrong axis."""
    prelu = [name for name, m in model.named_modules() if isinstance(m, nn.PReLU)]
    if prelu:
        raise NotImplementedError(
            f"The functorch backend cannot batch nn.PReLU (layers {prelu}) correctly. "
            "The hooks backend takes PReLU where every trainable parameter sits in "
            "linear, embedding, norm or PReLU layers; else freeze the slopes into "
            "nn.LeakyReLU(negative_slope=...).")
