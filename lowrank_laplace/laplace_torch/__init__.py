"""``hessian_structure="lowrank_ggn"`` for laplace-torch: the only subpackage importing it."""

from lowrank_laplace.laplace_torch.laplace import LowRankGGNLaplace, LowRankGGNLLLaplace

__all__ = ["LowRankGGNLLLaplace", "LowRankGGNLaplace"]
