"""The GGN factor ``V`` of a mini-batch: its per-parameter blocks and what they offer.

Every backend of :mod:`lowrank_laplace.engine` produces these blocks, collected in a
:class:`~lowrank_laplace.factor.ggn.GGNFactor`.
"""

from lowrank_laplace.factor.blocks import Block, DenseBlock, KronBlock, Weight, cat_blocks
from lowrank_laplace.factor.ggn import GGNFactor, damped_gram_solve
from lowrank_laplace.factor.loss_sqrt import factor_columns, reduced_cross_entropy_sqrt

__all__ = [
    "Block",
    "DenseBlock",
    "GGNFactor",
    "KronBlock",
    "Weight",
    "cat_blocks",
    "damped_gram_solve",
    "factor_columns",
    "reduced_cross_entropy_sqrt",
]
