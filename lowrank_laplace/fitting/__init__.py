"""From a loader to the leading eigenpairs of the training-set GGN.

The fit's plan (path, sizes, laziness, threads) is decided once at the first batch;
the solvers (dense sum, streaming merges, one-pass sketch) are siblings over one base;
the batch loop feeds them micro-batch factors.
"""

from lowrank_laplace.fitting.sketch import SketchMerge
from lowrank_laplace.fitting.streaming import StreamingMerge

__all__ = ["SketchMerge", "StreamingMerge"]
