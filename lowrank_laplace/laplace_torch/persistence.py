"""Saving and restoring a fitted low-rank posterior (laplace-torch's ``state_dict``).

laplace-torch's state is flat: tensors and plain values (``torch.load(...,
weights_only=True)``, its ``test_serialize_no_pickle``). The posterior's optional parts
(:data:`PARTS`: the fit report, the null directions, the quadrature, what a pass over
the fitted data gives) are saved field by field under
``"<part>.<field>"`` keys, nested fields under ``"<part>.<field>.<field>"``; a state of
the earlier nested form loads too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional

import torch

from lowrank_laplace.fitting.products import FittedData
from lowrank_laplace.laplace_torch.report import FitReport
from lowrank_laplace.posterior import residual_class
from lowrank_laplace.posterior.null import NullDirections
from lowrank_laplace.posterior.quadrature import DroppedQuadrature

#: The optional parts of the state, each saved flat under its name as key prefix.
PARTS = ("fit_report", "null_directions", "quadrature", "fitted_data")
#: Joins a part's name and its (nested) field names in a key.
SEPARATOR = "."


def flatten(prefix: str, values: Dict[str, Any]) -> Dict[str, Any]:
    """Return ``values`` (nested dicts of plain values) as one flat dict of prefixed keys."""
    flat = {}
    for key, value in values.items():
        name = f"{prefix}{SEPARATOR}{key}"
        flat.update(flatten(name, value) if isinstance(value, dict) else {name: value})
    return flat


def unflatten(state: Dict[str, Any], prefix: str) -> Optional[Dict[str, Any]]:
    """Return the nested dict saved under ``prefix`` (inverse of :func:`flatten`), else ``None``.

    A state of the earlier form holds the nested dict (or ``None``) under ``prefix`` itself.
    """
    if prefix in state:
        return state[prefix]
    start, nested = prefix + SEPARATOR, None
    for key, value in state.items():
        if not key.startswith(start):
            continue
        nested = {} if nested is None else nested
        *path, leaf = key[len(start):].split(SEPARATOR)
        node = nested
        for name in path:
            node = node.setdefault(name, {})
        node[leaf] = value
    return nested


class StatePersistence:
    """``state_dict`` / ``load_state_dict`` of :class:`~lowrank_laplace.LowRankGGNLaplace`."""

    def state_dict(self) -> dict:
        """laplace-torch's state plus the exact GGN trace, the options and the residual's fit."""
        state = super().state_dict()
        state.update(trace=self.trace, rank=self.rank, mc_samples=self.mc_samples,
                     residual_diagonal=self.residual_diagonal, residual=self.residual,
                     rank_bound=self.rank_bound)
        parts = dict(zip(PARTS, (self.fit_report, self._null, self._quadrature,
                                 self._fitted_data)))
        for name, part in parts.items():
            if part is not None:
                state.update(flatten(name, part.as_dict() if name == "fit_report"
                                     else part.state()))
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a fitted posterior.

        Args:
            state_dict: From :meth:`state_dict` of the same model type.

        Raises:
            ValueError: If the state belongs to another model, Laplace type, residual
                model or curvature (``mc_samples``), or does not hold a valid low-rank
                curvature (negative or non-finite eigenvalues, eigenvectors that are not
                orthonormal, a trace below their sum).
        """
        self._check_state(state_dict)
        super().load_state_dict(state_dict)
        U = self.H[0]
        expected = self._expected_dim()
        if expected is not None and U.shape[0] != expected:
            raise ValueError(
                f"The saved eigenvectors have {U.shape[0]} rows but the model has "
                f"{expected} Laplace parameters."
            )
        self.trace = state_dict.get("trace")
        self.residual_diagonal = state_dict.get("residual_diagonal")
        self.rank_bound = state_dict.get("rank_bound")
        self._null = NullDirections.from_state(unflatten(state_dict, "null_directions"))
        self._quadrature = DroppedQuadrature.from_state(unflatten(state_dict, "quadrature"))
        self._residual_model = None
        self.fit_report = FitReport.from_dict(unflatten(state_dict, "fit_report"))
        report = self.fit_report
        if report is not None and report.refinable and self._quadrature is None \
                and report.not_measured is None and report.kept_fraction < 1 - 1e-9:
            # an earlier version's spectral state
            self.fit_report = replace(report, not_measured="saved by an earlier version, "
                                      "which did not measure it this way")
        self._fitted_data = FittedData.from_state(unflatten(state_dict, "fitted_data"))

    def _check_state(self, state: dict) -> None:
        """Refuse a state this object cannot take before any of it is loaded."""
        saved = state.get("residual", "diagonal" if state.get("residual_diagonal") is not None
                          else "none")
        if residual_class(saved) is not self.options.residual_model:
            raise ValueError(
                f"The state was fitted with residual={saved!r} but this object uses "
                f"residual={self.residual!r}: construct it with residual={saved!r}."
            )
        mc = state.get("mc_samples", 0)
        if mc != self.mc_samples:  # online updates would mix two curvatures
            raise ValueError(
                f"The state was fitted with mc_samples={mc} but this object uses "
                f"mc_samples={self.mc_samples}: construct it with mc_samples={mc}."
            )
        H = state.get("H")
        if H is None:
            return
        U, lam = H
        tol = 100 * torch.finfo(U.dtype).eps ** 0.5
        eye = torch.eye(U.shape[1], dtype=torch.float64, device=U.device)
        off = float((U.double().T @ U.double() - eye).abs().max()) if U.shape[1] else 0.0
        if not (bool(torch.isfinite(lam).all()) and bool((lam >= 0).all())
                and bool(torch.isfinite(U).all()) and off <= tol):
            raise ValueError(
                "The state's curvature is not a low-rank GGN: its eigenvalues must be finite "
                "and non-negative and its eigenvectors orthonormal. Save it with "
                "state_dict() of a fitted lowrank_ggn posterior."
            )
        trace = state.get("trace")
        if trace is not None and float(trace) < float(lam.double().sum()) * (1 - tol) - tol:
            raise ValueError("The state's trace is below the sum of its kept eigenvalues.")
