"""The GGN factor ``V`` of a mini-batch, as every backend produces it: per-parameter blocks."""

from lowrank_laplace.factor.blocks import Block, DenseBlock, KronBlock, Weight, cat_blocks
from lowrank_laplace.factor.ggn import GGNFactor, damped_gram_solve
from lowrank_laplace.factor.loss_sqrt import factor_columns, reduced_cross_entropy_sqrt

__all__ = ["Block", "DenseBlock", "GGNFactor", "KronBlock", "Weight", "cat_blocks",
           "damped_gram_solve", "factor_columns", "reduced_cross_entropy_sqrt"]
