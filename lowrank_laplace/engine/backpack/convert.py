"""Rewrites a model's forward pass into modules BackPACK knows (torch.fx).

Functional activations (``torch.relu``, ``F.relu``, ``x.relu()``, tanh, sigmoid), pools
(``F.max_pool2d``, ``F.avg_pool2d``, 1d) and ``x.view(x.size(0), -1)`` / ``reshape``
become modules; then BackPACK's converter (``extend(model, use_converter=True)``) turns
additions, scalings and ``flatten`` into its modules. The caller checks the outputs.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn.functional as F
from backpack.custom_module.graph_utils import BackpackTracer, convert_module_to_backpack
from torch import nn
from torch.fx import GraphModule, Node

_ACTIVATIONS: Dict[object, Callable[[], nn.Module]] = {
    torch.relu: nn.ReLU, F.relu: nn.ReLU, "relu": nn.ReLU,
    torch.tanh: nn.Tanh, F.tanh: nn.Tanh, "tanh": nn.Tanh,
    torch.sigmoid: nn.Sigmoid, F.sigmoid: nn.Sigmoid, "sigmoid": nn.Sigmoid,
}
_MAX_ARGS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")
_AVG_ARGS = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")
#: Functional pool -> its module and the module's positional arguments after the input.
_POOLS = {F.max_pool2d: (nn.MaxPool2d, _MAX_ARGS), F.avg_pool2d: (nn.AvgPool2d, _AVG_ARGS),
          F.max_pool1d: (nn.MaxPool1d, _MAX_ARGS), F.avg_pool1d: (nn.AvgPool1d, _AVG_ARGS)}


def _module_for(node: Node):
    """The module replacing a functional node and its input, or ``None``."""
    if node.op not in ("call_function", "call_method"):
        return None
    # keyword arguments at their defaults change nothing
    extra = {k: v for k, v in node.kwargs.items()
             if not (k in ("inplace", "return_indices") and v is False)}
    if node.target in _ACTIVATIONS and len(node.args) == 1 and not extra:
        return _ACTIVATIONS[node.target](), node.args[0]
    if node.op == "call_function" and node.target in _POOLS:
        cls, names = _POOLS[node.target]
        if len(node.args) - 1 > len(names) or any(k not in names for k in extra):
            return None
        kwargs = dict(zip(names, node.args[1:]))
        kwargs.update(extra)
        return cls(**kwargs), node.args[0]
    if node.op == "call_method" and node.target in ("view", "reshape") \
            and len(node.args) == 3 and node.args[2] == -1:
        size = node.args[1]
        if (isinstance(size, Node) and size.op == "call_method" and size.target == "size"
                and size.args == (node.args[0], 0)):
            return nn.Flatten(), node.args[0]
    return None


def _functional_to_modules(model: nn.Module) -> GraphModule:
    """Trace the model and replace functional activations, pools and flattens."""
    graph = BackpackTracer().trace(model)
    root = GraphModule(model, graph)
    count = 0
    for node in list(graph.nodes):
        found = _module_for(node)
        if found is None:
            continue
        module, source = found
        # named after the call it replaces, so messages about it name that call
        name = node.name if not hasattr(root, node.name) else f"{node.name}_{count}"
        count += 1
        root.add_submodule(name, module)
        with graph.inserting_after(node):
            new = graph.call_module(name, (source,))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    graph.lint()
    return GraphModule(root, graph)


def convert(model: nn.Module) -> GraphModule:
    """Return a network of BackPACK modules computing ``model``'s function, with its parameters."""
    return convert_module_to_backpack(_functional_to_modules(model), debug=False)
