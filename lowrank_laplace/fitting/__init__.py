"""From a loader to the leading eigenpairs of the training-set GGN.

A plan decided at the first batch, sibling solvers (dense sum, streaming merges, one-pass
sketch) over one base, and the batch loop that feeds them.
"""

from lowrank_laplace.fitting.sketch import SketchMerge
from lowrank_laplace.fitting.streaming import StreamingMerge

__all__ = ["SketchMerge", "StreamingMerge"]
