"""``hessian_structure="lowrank_ggn"`` for laplace-torch: the only subpackage importing it."""

from lowrank_laplace.laplace_torch.laplace import LowRankGGNLaplace
from lowrank_laplace.laplace_torch.last_layer import LowRankGGNLLLaplace

__all__ = ["LowRankGGNLLLaplace", "LowRankGGNLaplace"]
