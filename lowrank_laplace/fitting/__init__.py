"""From a loader to the leading eigenpairs of the training-set GGN.

A plan decided at the first batch, sibling solvers (dense sum, streaming merges, one-pass
sketch) over one base, and the batch loop that feeds them.

Shape glossary (every module of the package):
    D: parameters; D_gram: expanded parameters plus ``out + in`` per factored linear weight;
    r: kept rank; k: eigenpairs kept while fitting (``r`` + oversampling); l: sketch (test
    matrix) columns; M: columns of a batch factor or merge; K: columns of another matrix;
    N: samples of a batch; C: model outputs.
"""

from lowrank_laplace.fitting.sketch import SketchMerge
from lowrank_laplace.fitting.streaming import StreamingMerge

__all__ = ["SketchMerge", "StreamingMerge"]
