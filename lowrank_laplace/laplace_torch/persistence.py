"""Saving and restoring a fitted low-rank posterior (laplace-torch's ``state_dict``)."""

from __future__ import annotations

import torch

from lowrank_laplace.laplace_torch.report import FitReport
from lowrank_laplace.posterior import residual_class
from lowrank_laplace.posterior.complement import MeasuredComplement
from lowrank_laplace.posterior.null import NullDirections
from lowrank_laplace.posterior.quadrature import DroppedQuadrature


class StatePersistence:
    """``state_dict`` / ``load_state_dict`` of :class:`~lowrank_laplace.LowRankGGNLaplace`."""

    def state_dict(self) -> dict:
        """laplace-torch's state plus the exact GGN trace, the options and the residual's fit."""
        state = super().state_dict()
        state.update(trace=self.trace, rank=self.rank, mc_samples=self.mc_samples,
                     residual_diagonal=self.residual_diagonal, residual=self.residual,
                     rank_bound=self.rank_bound, jacobian_exponent=self._jacobian_exponent,
                     target_sum=self.target_sum,
                     fit_report=None if self.fit_report is None else self.fit_report.as_dict())
        parts = {"measured_complement": self._complement, "null_directions": self._null,
                 "quadrature": self._quadrature}
        state.update({key: None if part is None else part.state() for key, part in parts.items()})
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
        self.target_sum = state_dict.get("target_sum")  # absent from older states
        self._jacobian_exponent = float(state_dict.get("jacobian_exponent", 0.0))
        complement = MeasuredComplement.from_state(state_dict.get("measured_complement"))
        self._complement = None if complement is None else complement.to(U.device)
        self._null = NullDirections.from_state(state_dict.get("null_directions"))
        self._quadrature = DroppedQuadrature.from_state(state_dict.get("quadrature"), U.device)
        self._residual_model = None
        self.fit_report = FitReport.from_dict(state_dict.get("fit_report"))

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
