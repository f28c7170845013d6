r"""Last-layer Laplace (``subset_of_weights="last_layer"``) with the last layer's low-rank GGN.

laplace-torch's reduced features (``forward_with_features``, ``feature_reduction``) give the
last layer's GGN only where the model's output is the last layer on them; a model that picks
positions after its last layer (a Hugging Face classifier with right padding reads the last
real token, ``"pick_last"`` the last position) does not. Every fitted and predicted batch is
checked; where they differ, the fit and the GLM predictive differentiate the whole model with
respect to the last layer: the model's own GGN, as laplace-torch's ``full`` computes it.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Optional

import torch
from laplace.lllaplace import LLLaplace
from torch import Tensor, nn

from lowrank_laplace.fitting.loader import (
    as_pair,
    check_batch_types,
    check_finite_inputs,
    loader_size,
)
from lowrank_laplace.laplace_torch.laplace import (
    LowRankGGNLaplace,
    check_positive,
    refuse_other_curvature,
)
from lowrank_laplace.laplace_torch.options import split_options
from lowrank_laplace.utils.batches import batch_size, to_device


class LowRankGGNLLLaplace(LLLaplace, LowRankGGNLaplace):
    """Last-layer Laplace with the last layer's exact low-rank GGN.

    Same options as :class:`LowRankGGNLaplace` plus laplace-torch's last-layer
    arguments (``last_layer_name``, ``feature_reduction``).

    Attributes:
        whole_model: Whether the last fit differentiated the whole model, because the
            last layer on its features did not give the model's outputs.
    """

    _key = ("last_layer", "lowrank_ggn")

    def __init__(self, model: nn.Module, likelihood: str, *args: Any,
                 diagonal_correction: Optional[bool] = None, **kwargs: Any):
        options = split_options(kwargs)
        super().__init__(model, likelihood, *args, **kwargs)
        self._set_options(diagonal_correction, options)
        refuse_other_curvature(self)
        self.whole_model = False
        if self.model.last_layer is None:  # laplace-torch checks the prior at fit
            check_positive("prior_precision", self._prior_precision)

    def fit(self, train_loader: Any, override: bool = True,
            progress_bar: bool = False) -> None:
        """Find the last layer on the loader's first batch, then fit its low-rank GGN.

        Args:
            train_loader: As in :meth:`LowRankGGNLaplace.fit`.
            override: Must be ``True`` (laplace-torch's last-layer posteriors have no
                online updates).
            progress_bar: Show a tqdm progress bar over batches.

        Raises:
            ValueError: For a loader without ``dataset``, an empty loader, a frozen
                last layer, or what :meth:`LowRankGGNLaplace.fit` refuses.
            TypeError: For batches that do not hold tensors.
        """
        loader_size(train_loader)
        if self.model.last_layer is None:  # laplace-torch feeds it the first batch
            data = next(iter(train_loader), None)
            if data is None:
                raise ValueError("train_loader yielded no batches: nothing to fit.")
            X = data if isinstance(data, MutableMapping) else as_pair(data)[0]
            if not isinstance(data, MutableMapping):
                check_batch_types(*as_pair(data))
            check_finite_inputs(X)  # before laplace-torch's forward pass on it
        self.whole_model = False
        try:
            LLLaplace.fit(self, train_loader, override=override, progress_bar=progress_bar)
        except _FeaturesMissOutputs:  # found before any curvature of that batch
            self.whole_model = True
            LLLaplace.fit(self, train_loader, override=override, progress_bar=progress_bar)

    def state_dict(self) -> dict:
        """The posterior's state (see :meth:`LowRankGGNLaplace.state_dict`) and ``whole_model``."""
        return {**super().state_dict(), "whole_model": self.whole_model}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a fitted posterior (see :meth:`LowRankGGNLaplace.load_state_dict`).

        Args:
            state_dict: From :meth:`state_dict` (one without ``whole_model``: ``False``).
        """
        super().load_state_dict(state_dict)
        self.whole_model = bool(state_dict.get("whole_model", False))

    def refine_complement(self, train_loader: Any) -> None:
        """See :meth:`LowRankGGNLaplace.refine_complement`.

        Raises:
            ValueError: Also where the last layer on the loader's features does not give
                the model's outputs but the posterior is the last layer's on its features.
        """
        try:
            super().refine_complement(train_loader)
        except _FeaturesMissOutputs as err:
            raise ValueError(
                "refine_complement: on train_loader's batches the last layer on its "
                "features does not give the model's outputs (the model selects or pools "
                "positions after its last layer), but this posterior is the last layer's "
                "curvature on its features (whole_model=False: fitted where they agreed, "
                "or loaded from a state that does not record whole_model). Fit it on this "
                "loader (la.fit(train_loader) then differentiates the whole model), or "
                "pass the loader it was fitted on.") from err

    def _expected_dim(self) -> Optional[int]:
        last = getattr(self.model, "last_layer", None)
        return None if last is None else sum(p.numel() for p in last.parameters())

    def _curvature_target(self):
        last = self.model.last_layer
        if not all(p.requires_grad for p in last.parameters()):
            raise ValueError(
                "The last layer's parameters must require gradients: the last-layer "
                "posterior covers all of them. Unfreeze them (requires_grad_(True))."
            )
        if self.whole_model:
            return _WholeModel(self.model.model, last), (lambda X: X), list(last.parameters())
        extractor, head = self.model, _LastLayer(last)

        def features(X):
            f, phi = _outputs_and_features(extractor, X, grad=False)
            n = batch_size(X)  # several rows per sample (reward pairs): grouped per sample
            phi = phi if phi.shape[0] == n else phi.reshape(n, -1, *phi.shape[1:])
            with torch.no_grad():
                if not _same(head(phi), f):
                    raise _FeaturesMissOutputs
            return phi

        return head, features, list(last.parameters())

    def _glm_predictive_distribution(self, X, joint: bool = False,
                                     diagonal_output: bool = False):
        self._check_H_init()  # before laplace-torch looks for the last layer
        X = to_device(X, self._device)
        f, phi = _outputs_and_features(self.model, X, grad=self.enable_backprop)
        if _same(self.model.last_layer(phi), f):  # laplace-torch's last-layer Jacobians
            Js = _head_jacobians(phi, f, self.model.last_layer.bias is not None)
            f_var = self.functional_covariance(Js) if joint else self.functional_variance(Js)
            f_mu = f.flatten() if joint else f
        elif self.enable_backprop:
            raise ValueError(
                "enable_backprop=True needs the last layer on its features to give the "
                "model's outputs; this model selects or pools positions after its last "
                "layer (e.g. right padding with feature_reduction='pick_last'): use left "
                "padding, or enable_backprop=False.")
        else:
            return self._engine_predictive(_WholeModel(self.model.model, self.model.last_layer),
                                           X, joint, diagonal_output)
        if diagonal_output and not joint:
            f_var = torch.diagonal(f_var, dim1=-2, dim2=-1)
        return (f_mu, f_var) if self.enable_backprop else (f_mu.detach(), f_var.detach())


class _FeaturesMissOutputs(Exception):
    """The last layer on its features does not give the model's outputs."""

    def __init__(self):
        super().__init__("the last layer on its features does not give the model's outputs")


def _outputs_and_features(extractor: nn.Module, X: Any, grad: bool):
    """laplace-torch's ``forward_with_features``, with or without gradients."""
    with torch.set_grad_enabled(grad):
        f, phi = extractor.forward_with_features(X)
    return (f, phi) if grad else (f.detach(), phi.detach())


def _same(out: Tensor, f: Tensor) -> bool:
    """Whether the last layer's output on the features is the model's output ``f``."""
    if out.numel() != f.numel():
        return False
    tol = torch.finfo(f.dtype).eps ** 0.5
    scale = 1.0 + float(f.detach().abs().max()) if f.numel() else 1.0
    return torch.allclose(out.reshape(f.shape).to(f.dtype), f, rtol=tol, atol=tol * scale)


def _head_jacobians(phi: Tensor, f: Tensor, bias: bool) -> Tensor:
    """A linear last layer's Jacobians ``(B, C, D)`` on features ``phi``, laplace-torch's order."""
    n, outputs = phi.shape[0], f.numel() // phi.shape[0]
    identity = torch.eye(outputs, device=phi.device, dtype=phi.dtype).expand(n, -1, -1)
    Js = torch.einsum("kp,kij->kijp", phi, identity).reshape(n, outputs, -1)
    return torch.cat([Js, identity], dim=2) if bias else Js


class _LastLayer(nn.Module):
    """The last layer on per-sample features; ``(N, k, d)`` features give ``(N, k C)``.

    A pairwise reward model's curvature outputs are the ``k`` scores of a sample.
    """

    def __init__(self, last: nn.Module):
        super().__init__()
        self.last = last

    def forward(self, features: Tensor) -> Tensor:
        out = self.last(features)
        return out.flatten(1) if out.dim() == 3 else out


class _WholeModel(nn.Module):
    """The model as a function of its last layer's parameters alone (the rest held fixed).

    The model is kept outside the module tree: the engine sees the last layer's parameters.
    """

    def __init__(self, model: nn.Module, last: nn.Module):
        super().__init__()
        self.last = last
        object.__setattr__(self, "model", model)

    def forward(self, X: Any) -> Tensor:
        return self.model(X)
