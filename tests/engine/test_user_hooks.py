"""Forward hooks and pre-hooks are part of the model's function: every backend computes the
GGN of the function the model computes (against a dense float64 torch.func reference,
which runs the hooks) or refuses it clearly, and ``'auto'`` moves on; backward hooks
change no function and do not fire; the user's model keeps exactly its own hooks."""

import warnings

import pytest
import torch
import torch.nn.utils.prune as prune
from torch import nn

import lowrank_laplace as ll
from tests import reference as ref

TOL = dict(rtol=1e-8, atol=1e-10)


def _double_output(model):
    model[0].register_forward_hook(lambda module, args, out: 2 * out)


def _scale_output_in_place(model):
    def hook(module, args, out):
        out.mul_(3)  # returns nothing: the output changes in place

    model[0].register_forward_hook(hook)


def _shift_input(model):
    model[2].register_forward_pre_hook(lambda module, args: (args[0] + 1,))


def _shift_input_kwargs(model):
    model[2].register_forward_pre_hook(lambda module, args, kwargs: ((args[0] - 1,), kwargs),
                                       with_kwargs=True)


def _prune(model):
    prune.l1_unstructured(model[0], "weight", amount=0.5)


def _weight_norm(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in favour of parametrizations
        model[0] = nn.utils.weight_norm(model[0])


def _observer(model):
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    model[2].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))


#: case -> (how the hooks are added, the backend 'auto' takes, backends that refuse)
CASES = {
    "double_output": (_double_output, "hooks", {"backpack"}),
    "scale_output_in_place": (_scale_output_in_place, "hooks", {"backpack"}),
    "shift_input": (_shift_input, "hooks", {"backpack"}),
    "shift_input_kwargs": (_shift_input_kwargs, "hooks", {"backpack"}),
    "prune": (_prune, "functorch", {"backpack", "hooks"}),
    "weight_norm": (_weight_norm, "functorch", {"backpack", "hooks"}),
    "observer": (_observer, "backpack", set()),
}
REFUSALS = {
    "backpack": "forward hooks or pre-hooks that are part of the model's function",
    "hooks": "not: 0.weight_",
}


def _model(case):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    CASES[case][0](model)
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    return model, X, y


def _hooks(model):
    return [(dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
            for m in model.modules()]


@pytest.mark.parametrize("backend", ["auto", "backpack", "hooks", "functorch"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_hooks_are_part_of_the_function(case, backend):
    model, X, y = _model(case)
    _, chosen, refusing = CASES[case]
    loss_func = nn.CrossEntropyLoss()
    before = _hooks(model)
    if backend in refusing:
        with pytest.raises(NotImplementedError, match=REFUSALS[backend]):
            ll.ggn_eigh(model, loss_func, X, y, backend=backend)
    else:
        res = ll.ggn_eigh(model, loss_func, X, y, top_k=None, backend=backend)
        assert res.backend == (chosen if backend == "auto" else backend)
        G = ref.ggn(model, loss_func, X, y)
        assert G.trace() > 0
        torch.testing.assert_close(res.eigenvectors @ torch.diag(res.eigenvalues)
                                   @ res.eigenvectors.T, G, **TOL)
    assert _hooks(model) == before


def test_hooks_change_what_the_reference_computes():
    """The cases are not vacuous: each hook changes the GGN the model's layers alone give."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    G = ref.ggn(plain, nn.CrossEntropyLoss(), X, y)
    for case in ("double_output", "scale_output_in_place", "shift_input",
                 "shift_input_kwargs"):
        model = _model(case)[0]
        assert not torch.allclose(ref.ggn(model, nn.CrossEntropyLoss(), X, y), G), case


@pytest.mark.parametrize("backend", ["auto", "hooks", "functorch"])
def test_backward_hooks_do_not_fire(backend):
    model, X, y = _model("double_output")
    calls = []
    model[2].register_full_backward_hook(lambda module, g_in, g_out: calls.append(1))
    model[0].register_full_backward_pre_hook(lambda module, g_out: calls.append(1))
    before = _hooks(model)
    res = ll.ggn_eigh(model, nn.CrossEntropyLoss(), X, y, top_k=None, backend=backend)
    assert calls == [] and _hooks(model) == before
    same = _model("double_output")[0]  # torch.func takes no backward hooks
    torch.testing.assert_close(res.eigenvectors @ torch.diag(res.eigenvalues)
                               @ res.eigenvectors.T,
                               ref.ggn(same, nn.CrossEntropyLoss(), X, y), **TOL)
