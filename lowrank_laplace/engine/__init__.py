"""Computes the GGN factor ``V`` of a mini-batch: ``FactorEngine`` picks the backend that fits."""

from lowrank_laplace.engine.base import EngineBase
from lowrank_laplace.engine.factor_engine import BACKENDS, FactorEngine, check_backend
from lowrank_laplace.engine.request import Request
from lowrank_laplace.engine.rng import RNGReplay, rng_state, set_rng_state

__all__ = ["BACKENDS", "EngineBase", "FactorEngine", "RNGReplay", "Request", "check_backend",
           "rng_state", "set_rng_state"]
