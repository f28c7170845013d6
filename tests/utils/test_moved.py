"""The module paths of version 0.1 still import, as the same modules, with a warning."""

import importlib
import sys

import pytest

import lowrank_laplace as ll
from lowrank_laplace.utils.moved import MOVED


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_old_path_warns_and_is_the_new_module(old, new):
    sys.modules.pop(old, None)
    vars(ll).pop(old.rsplit(".", 1)[1], None)
    with pytest.warns(FutureWarning, match=f"{old} is deprecated.*import {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_old_attribute_of_the_package():
    sys.modules.pop("lowrank_laplace.merge", None)
    vars(ll).pop("merge", None)  # set by an earlier import of the old path
    with pytest.warns(FutureWarning, match="lowrank_laplace.merge is deprecated"):
        assert ll.merge.StreamingMerge is ll.StreamingMerge
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        ll.nonexistent  # noqa: B018
