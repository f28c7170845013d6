"""The hooks backend: ``V`` from batched backward passes, without vmap (docs/concepts.md).

For models whose trainable parameters all sit in layers with a rule
(:mod:`~lowrank_laplace.engine.hooks_rules`): one forward pass records each trainable
layer's input ``a`` and shifts its output by zero; one backward pass per loss-Hessian
column gives the vectors ``g`` at the outputs; the rule turns them into the block.
Shapes: ``N`` samples, ``T`` positions per sample, ``V`` vectors per sample.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from lowrank_laplace.engine.base import EngineBase, distinct_sample
from lowrank_laplace.engine.hooks_rules import LayerRule, rule_for, supported_parameters
from lowrank_laplace.engine.model_copy import removing
from lowrank_laplace.engine.request import Collector
from lowrank_laplace.engine.rng import forked_rng, rng_state, set_rng_state
from lowrank_laplace.factor.loss_sqrt import hessian_sqrt, mc_noise
from lowrank_laplace.utils import batches, checks


def trainable_layers(model: nn.Module) -> Dict[str, Tuple[nn.Module, LayerRule]]:
    """Return every module holding trainable parameters, with its rule: name -> ``(module, rule)``.

    Raises:
        NotImplementedError: Naming the trainable parameters no rule covers, or tied ones.
    """
    layers, problems = {}, []
    for name, module in model.named_modules():
        own = [p for p, t in module.named_parameters(recurse=False) if t.requires_grad]
        if not own:
            continue
        rule = rule_for(module)
        outside = [p for p in own if rule is None or p not in rule.params]
        if outside:
            problems += [f"{name}.{p} ({type(module).__name__})" for p in outside]
        else:
            layers[name] = (module, rule)
    params = dict(model.named_parameters(remove_duplicate=False))
    problems += [f"{' = '.join(names)} (tied)" for names in checks.shared_parameters(model)
                 if params[names[0]].requires_grad]
    if problems:
        raise NotImplementedError(
            "The hooks backend takes models whose trainable parameters are "
            f"{supported_parameters()}, each owned by one module; not: "
            f"{', '.join(problems)}.")
    return layers


def per_sample(a: Tensor, g: Tensor, n: int, name: str) -> Tuple[Tensor, Tensor]:
    """Return a layer's input ``a`` and vectors ``g`` as ``(N, ...)``, ``(V, N, ...)``, per sample.

    ``a`` has ``N'`` rows, ``g`` is ``(V, N', ...)`` (``(V, N, ...)`` for a shared row), ``name``
    is the layer's. Several rows per sample (``(B, 2, d)`` pairs reshaped to ``(2 B, d)``) are
    taken ``k`` consecutive rows per sample, as a reshape gives (the gradient check confirms);
    one row shared by all samples (a lookup broadcast later) is expanded, each sample's
    vectors there being its own.

    Raises:
        NotImplementedError: If ``N'`` is neither a multiple of ``N`` nor 1.
    """
    if a.shape[0] == 1 and g.shape[1] == n:
        a = a.expand(n, *a.shape[1:])
    rows = a.shape[0]
    if rows == n:
        return a, g
    if rows % n:
        raise NotImplementedError(
            f"Layer {name!r} sees {rows} rows for a batch of {n} samples: the hooks "
            "backend cannot tell which rows belong to which sample (rows must be "
            "grouped by sample, or one row shared by all).")
    return a.reshape(n, rows // n, *a.shape[1:]), g.reshape(g.shape[0], n, rows // n,
                                                              *g.shape[2:])


class HooksEngine(EngineBase):
    """The hooks backend (arguments as :class:`~lowrank_laplace.engine.base.EngineBase`'s)."""

    backend = "hooks"
    gradient_in_factor_pass = True  # one forward pass: the gradient shares its draws

    def __init__(self, model: nn.Module, loss_func: nn.Module, eval_mode: bool = False):
        super().__init__(model, loss_func, eval_mode)
        self._layers = trainable_layers(self._copy)
        self._probed = False

    def _check_model(self, model: nn.Module, eval_mode: bool) -> None:
        trainable_layers(model)

    def _vector_entries(self, feature_sizes: List[int], one_block: bool) -> int:
        # expanded blocks plus the vectors at every layer output of a backward pass
        return self.dense_param_count(largest=one_block) + sum(feature_sizes)

    def _record(self, names: List[str], n: int
                ) -> Tuple[Dict[str, Tuple[Tensor, Tensor]], list]:
        """Hooks keeping layers' inputs and adding zero shifts (a row per sample) to outputs."""
        record: Dict[str, Tuple[Tensor, Tensor]] = {}

        def hook_for(name):
            def hook(module, args, out):
                if name in record:
                    raise NotImplementedError(
                        f"Layer {name!r} runs more than once per forward pass: the hooks "
                        "backend needs each trainable layer called once.")
                if not torch.is_grad_enabled():  # its shift would get no gradient
                    raise NotImplementedError(
                        f"Layer {name!r} runs with gradient tracking off (inside "
                        "torch.utils.checkpoint(..., use_reentrant=True), or "
                        "torch.no_grad()): the hooks backend cannot see its gradients. "
                        "Ways out: checkpoint with use_reentrant=False (the hooks backend "
                        "takes it), or freeze the layer (requires_grad_(False)).")
                if out.shape[0] == 1 and n > 1:  # shared by the samples: one row each
                    shift = out.new_zeros(n, *out.shape[1:], requires_grad=True)
                else:
                    shift = torch.zeros_like(out, requires_grad=True)
                record[name] = (args[0].detach(), shift)
                return out + shift
            return hook

        # before the user's forward hooks, which are part of the function
        handles = [self._layers[name][0].register_forward_hook(hook_for(name), prepend=True)
                   for name in names]
        return record, handles

    def _vectors(self, inputs: Any, targets: Optional[Tensor], names: List[str],
                 columns, gradient: bool = True
                 ) -> Tuple[Tensor, Tensor, Dict[str, Tuple[Tensor, Optional[Tensor], list]]]:
        """One forward pass; per layer its input, the loss's vectors and the ``columns``' ones."""
        record, handles = self._record(names, batches.batch_size(inputs))
        with removing(handles), torch.enable_grad():
            outputs, loss = self._forward_loss(inputs, targets)
        order = [name for name in names if name in record]
        shifts = [record[name][1] for name in order]
        cols = columns(outputs.detach())
        num_cols = 0 if cols is None else len(cols)

        def pulled(out: Tensor, cotangent: Optional[Tensor], retain: bool) -> List[Tensor]:
            grads = torch.autograd.grad(out, shifts, grad_outputs=cotangent,
                                        retain_graph=retain, allow_unused=True)
            return [torch.zeros_like(s) if g is None else g for s, g in zip(shifts, grads)]

        g_loss = pulled(loss, None, num_cols > 0) if gradient else [None] * len(shifts)
        g_cols = [pulled(outputs, cols[v], v < num_cols - 1) for v in range(num_cols)]
        found = {name: (record[name][0], g_loss[k], [g[k] for g in g_cols])
                 for k, name in enumerate(order)}
        return outputs.detach(), loss.detach(), found

    def _pass(self, inputs: Any, targets: Optional[Tensor], mc_samples: int,
              subsampling: Optional[List[int]], collector: Collector
              ) -> Tuple[Tensor, Tensor, Dict[int, Tensor]]:
        self.probe(inputs, targets)
        n = checks.check_batch(inputs, targets)
        curv = list(range(n)) if subsampling is None else subsampling
        mean = self.loss_func.reduction == "mean"

        def columns(outputs: Tensor) -> Tensor:
            noise = mc_noise(self.loss_func, len(curv), outputs.shape[1], mc_samples, outputs)
            s = hessian_sqrt(self.loss_func, outputs[curv], mc_samples, noise)
            if mean:
                s = s / len(curv) ** 0.5
            full = s.new_zeros(s.shape[0], n, outputs.shape[1])
            full[:, curv] = s
            return full

        names = [name for name, (module, _) in self._layers.items()
                 if any(self._index[id(p)] in collector.group_of
                        for p in module.parameters(recurse=False) if p.requires_grad)]
        gradient = collector.request.gradient or collector.batch_grad
        outputs, loss, found = self._vectors(inputs, targets, names, columns, gradient)
        idx = torch.tensor(curv, device=outputs.device)
        grad = {}
        for name, (a_rows, g_loss, g_cols) in found.items():
            module, rule = self._layers[name]
            a, g = per_sample(a_rows, torch.stack(g_cols), n, name)
            if gradient:
                g_loss = per_sample(a_rows, g_loss[None], n, name)[1][0]
            a_curv, g = (a, g) if subsampling is None else (a[idx], g[:, idx])
            for pname, param in module.named_parameters(recurse=False):
                i = self._index.get(id(param))
                if i is None or i not in collector.group_of:
                    continue
                grads = None
                if gradient:
                    grads = rule.block(module, pname, a, g_loss[None])
                    # the rows' sum, B^T 1: a factored block is not expanded for it
                    grad[i] = grads.matmul(g_loss.new_ones(n, 1))[:, 0]
                collector.add(i, rule.block(module, pname, a_curv, g),
                              grads if collector.batch_grad else None)
        return outputs, loss, grad

    def probe(self, inputs: Any, targets: Optional[Tensor] = None) -> None:
        """See :meth:`EngineBase.probe`: the rules' per-sample gradients are autograd's."""
        if self._probed:
            return
        self._sync()
        n = batches.batch_size(inputs)
        # two samples, distinct where the batch has them (else the one sample twice)
        j = distinct_sample(inputs, n)
        pair = [0, j if j is not None else min(1, n - 1)]
        first = batches.take(inputs, pair, n)
        y = None if targets is None else targets[pair]
        with forked_rng(batches.batch_device(inputs)):
            self._check_gradients(first, y)
        self._probed = True

    def _check_gradients(self, first: Any, targets: Optional[Tensor]) -> None:
        """Each sample's gradients from the rules equal autograd's (per sample, not summed)."""
        params = {i: p for i, p in enumerate(self._copy_params) if p.requires_grad}
        names = [n for n, _ in self._copy.named_parameters()]
        outputs, record = self._hooked_forward(first)
        if targets is None:  # any targets will do: the gradients are compared
            targets = outputs.detach().argmax(1) if isinstance(
                self.loss_func, nn.CrossEntropyLoss) else torch.zeros_like(outputs)
        n = outputs.shape[0]
        order = [name for name in self._layers if name in record]
        shifts = [record[k][1] for k in order]
        wrong = set()
        for k in range(n):
            with torch.enable_grad():
                loss = self._loss(outputs[k:k + 1], targets[k:k + 1])
            both = torch.autograd.grad(loss, [*params.values(), *shifts], retain_graph=True,
                                       allow_unused=True)  # one backward pass for both
            exact, pulled = both[:len(params)], both[len(params):]
            ours = self._rows(order, record, pulled, n)
            for (i, p), e in zip(params.items(), exact):
                e = torch.zeros_like(p).flatten() if e is None else e.flatten()
                o = ours.get(i, torch.zeros(n, e.numel(), dtype=e.dtype, device=e.device))
                target = torch.zeros_like(o)
                target[k] = e
                if float((o - target).norm()) > 1e-4 * float(e.norm()) + 1e-9:
                    wrong.add(names[i])
        if wrong:
            raise NotImplementedError(
                f"The hooks backend's per-sample gradients differ from autograd's for "
                f"{sorted(wrong)}: a trainable parameter is used outside its module, its "
                "layer computes something else than the rule of its type assumes, or its "
                "rows do not belong to the samples in order.")

    def _hooked_forward(self, first: Any) -> Tuple[Tensor, Dict[str, Tuple[Tensor, Tensor]]]:
        """The forward pass with the zero shifts, checked against the plain one (same draws)."""
        device = batches.batch_device(first)
        state = rng_state(device)
        with torch.no_grad():
            plain = self._net(first)
        checks.check_outputs(plain)
        set_rng_state(state, device)
        record, handles = self._record(list(self._layers), batches.batch_size(first))
        with removing(handles):
            try:
                with torch.enable_grad():
                    outputs = self._net(first)
            except NotImplementedError:  # a refusal of the hooks, already explained
                raise
            except (RuntimeError, ValueError, IndexError) as err:
                raise NotImplementedError(
                    f"The model fails with the hooks backend's zero shifts on its trainable "
                    f"layers' outputs ({type(err).__name__}: {err}): a layer's output is "
                    "used in a way that depends on its shape.") from err
        if outputs.shape != plain.shape or not torch.allclose(outputs.detach(), plain):
            raise NotImplementedError(
                "The model computes other outputs with the hooks backend's zero shifts on "
                "its trainable layers' outputs: a layer's output is used in a way that "
                "depends on its shape.")
        return outputs, record

    def _rows(self, order: List[str], record: dict, pulled: tuple, n: int) -> Dict[int, Tensor]:
        """Per-sample gradient rows ``(n, d)`` of every parameter from pulled vectors."""
        ours = {}
        for name, g in zip(order, pulled):
            module, rule = self._layers[name]
            g = torch.zeros_like(record[name][1]) if g is None else g
            a, g = per_sample(record[name][0], g[None], n, name)
            for pname, param in module.named_parameters(recurse=False):
                if param.requires_grad:
                    ours[self._index[id(param)]] = rule.block(module, pname, a, g).to_dense()
        return ours
