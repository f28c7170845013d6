"""A model zoo (class-based, residual, ResNet, LayerNorm, transformer, LSTM, tied
weights, frozen layers) against dense torch.func references, in float64."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowrank_laplace as ll
from tests import reference as ref
from tests.conftest import make_case

TOL = dict(rtol=1e-5, atol=1e-8)


class ClassCNN(nn.Module):
    """Class-based CNN with functional activations, pooling and ``view``."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 3, 3, padding=1), nn.Conv2d(3, 2, 3)
        self.fc1 = nn.Linear(2 * 1 * 1, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = torch.tanh(self.conv2(x))
        return self.fc1(x.view(x.size(0), -1))


class Residual(nn.Module):
    """A hand-written residual block: ``h + conv2(relu(conv1(h)))``."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 2, 3, padding=1)
        self.conv1, self.conv2 = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)
        self.head = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):
        h = self.stem(x)
        h = h + self.conv2(F.relu(self.conv1(h)))
        return self.head(F.relu(h).flatten(1))


def tiny_resnet():
    """Stem, one torchvision BasicBlock with a downsampling shortcut, pooled head."""
    from torchvision.models.resnet import BasicBlock

    down = nn.Sequential(nn.Conv2d(2, 3, 1, stride=2, bias=False), nn.BatchNorm2d(3))
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1, bias=False), nn.BatchNorm2d(2), nn.ReLU(),
        BasicBlock(2, 3, stride=2, downsample=down), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(3, 3),
    )
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


def tiny_wide_resnet():
    """Stem and one torchvision Bottleneck of Wide-ResNet width (``base_width=128``)."""
    from torchvision.models.resnet import Bottleneck

    down = nn.Sequential(nn.Conv2d(2, 8, 1, bias=False), nn.BatchNorm2d(8))
    return nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), Bottleneck(2, 2, downsample=down, base_width=128),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    ).eval()


class Transformer(nn.Module):
    """Embedding, one encoder layer with a padding mask, mean pooling, linear head."""

    def __init__(self, vocab=7, width=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(0.1 * torch.randn(5, width))
        self.layer = nn.TransformerEncoderLayer(width, 2, dim_feedforward=6, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(width, 3)

    def forward(self, tokens):
        pad = tokens == 0
        h = self.layer(self.embed(tokens) + self.pos, src_key_padding_mask=pad)
        keep = (~pad).to(h.dtype)[..., None]
        return self.head((h * keep).sum(1) / keep.sum(1))


class LSTMClassifier(nn.Module):
    """LSTM over a sequence, last hidden state to a linear head."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(2, 3, batch_first=True)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class GRUClassifier(nn.Module):
    """GRU over a sequence, last output to a linear head."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(2, 3, batch_first=True)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class Tied(nn.Module):
    """An encoder whose transposed weight is reused by the decoder."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 3)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        return self.out(torch.tanh(F.linear(h, self.enc.weight.T)))


class TiedModules(nn.Module):
    """One ``nn.Linear`` registered under two names and applied twice."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = self.a
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def tied_params():
    """Two ``nn.Linear`` layers of one ``nn.Sequential`` sharing their weight."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3), nn.Tanh(),
                          nn.Linear(3, 3))
    model[2].weight = model[0].weight
    return model


def layernorm_mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.GELU(), nn.Linear(5, 3))


def frozen_mlp():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh(),
                          nn.Linear(4, 3))
    model[2].requires_grad_(False)
    return model


ZOO = {
    "class_cnn": (ClassCNN, lambda n: torch.randn(n, 1, 6, 6)),
    "residual": (Residual, lambda n: torch.randn(n, 1, 4, 4)),
    "resnet_block": (tiny_resnet, lambda n: torch.randn(n, 1, 6, 6)),
    "wide_resnet_block": (tiny_wide_resnet, lambda n: torch.randn(n, 1, 5, 5)),
    "layernorm_gelu": (layernorm_mlp, lambda n: torch.randn(n, 4)),
    "transformer": (Transformer, lambda n: torch.cat(
        [torch.randint(1, 7, (n, 3)), torch.randint(0, 7, (n, 2))], dim=1)),
    "lstm": (LSTMClassifier, lambda n: torch.randn(n, 4, 2)),
    "gru": (GRUClassifier, lambda n: torch.randn(n, 4, 2)),
    "tied": (Tied, lambda n: torch.randn(n, 4)),
    "tied_modules": (TiedModules, lambda n: torch.randn(n, 3)),
    "tied_params": (tied_params, lambda n: torch.randn(n, 3)),
    "frozen": (frozen_mlp, lambda n: torch.randn(n, 4)),
}


def zoo_case(name, loss="ce", n=4, seed=0):
    torch.manual_seed(seed)
    model_fn, input_fn = ZOO[name]
    model = model_fn().double()
    X = input_fn(n)
    X = X.double() if X.is_floating_point() else X
    if loss == "ce":
        return model, nn.CrossEntropyLoss(), X, torch.randint(0, 3, (n,))
    return model, nn.MSELoss(reduction="sum"), X, torch.randn(n, 3, dtype=torch.float64)


def nonzero_eigvals(G):
    evals = torch.linalg.eigvalsh(G).flip(0)
    return evals[evals > 1e-10 * evals[0]]


@pytest.mark.parametrize("loss", ["ce", "mse"])
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_spectrum_directional_newton(name, loss):
    model, loss_func, X, y = zoo_case(name, loss)
    G = ref.ggn(model, loss_func, X, y)
    res = ll.ggn_eigh(model, loss_func, X, y, top_k=None)
    expected = nonzero_eigvals(G)
    torch.testing.assert_close(res.eigenvalues, expected, rtol=1e-5, atol=1e-8 * expected[0])
    U, lam = res.eigenvectors, res.eigenvalues
    torch.testing.assert_close(G @ U, U * lam, rtol=1e-5, atol=1e-8 * G.abs().max())
    torch.testing.assert_close(U.T @ U, torch.eye(U.shape[1], dtype=U.dtype), **TOL)
    torch.testing.assert_close(res.trace, torch.trace(G), **TOL)

    dd = ll.directional_derivatives(model, loss_func, X, y, top_k=3)
    grads = ref.per_sample_grads(model, loss_func, X, y)
    E = dd.eigenvectors
    signs = torch.sign((E * U[:, :3]).sum(0))
    torch.testing.assert_close(dd.gammas, grads @ E, **TOL)
    torch.testing.assert_close(E * signs, U[:, :3], rtol=1e-5, atol=1e-7)
    Gn = ref.per_sample_ggns(model, loss_func, X, y)
    torch.testing.assert_close(dd.lambdas, torch.einsum("dk,nde,ek->nk", E, Gn, E), **TOL)

    damping = 0.5
    step = ll.damped_newton_step(model, loss_func, X, y, damping=damping)
    g = ref.gradient(model, loss_func, X, y)
    expected_step = -U @ ((U.T @ g) / (lam + damping))
    torch.testing.assert_close(step, expected_step, rtol=1e-5, atol=1e-8)
    x = torch.randn(G.shape[0], dtype=G.dtype)
    inv = ll.ggn_inverse_matvec(model, loss_func, X, y, x, damping)
    eye = torch.eye(G.shape[0], dtype=G.dtype)
    torch.testing.assert_close(inv, torch.linalg.solve(G + damping * eye, x), **TOL)


#: Models BackPACK takes (class-based ones after its torch.fx conversion).
BACKPACK = ("frozen", "class_cnn", "residual", "resnet_block", "wide_resnet_block")


#: Models whose trainable parameters all sit in linear, embedding and norm layers.
HOOKS = ("layernorm_gelu",)


def test_auto_backend_choice():
    chosen = {name: ll.ggn_eigh(*zoo_case(name), top_k=2).backend for name in ZOO}
    assert chosen == {n: "backpack" if n in BACKPACK else "hooks" if n in HOOKS
                      else "functorch" for n in ZOO}


@pytest.mark.parametrize("name", BACKPACK)
def test_both_backends_agree_on_converted_models(name):
    model, loss_func, X, y = zoo_case(name)
    factors = {}
    for backend in ("backpack", "functorch"):
        with ll.FactorEngine(model, loss_func, backend=backend) as engine:
            factors[backend] = engine.compute(X, y, batch_grad=True)
    a, b = factors["backpack"], factors["functorch"]
    torch.testing.assert_close(b.gram(), a.gram(), **TOL)
    torch.testing.assert_close(b.grad_flat(), a.grad_flat(), **TOL)
    torch.testing.assert_close(b.t_matmul_batch_grads(), a.t_matmul_batch_grads(), **TOL)


@pytest.mark.parametrize("name", ["tied", "tied_modules", "tied_params"])
def test_tied_weights_exact_in_every_mode(name):
    """The block of a shared parameter sums its uses; BackPACK refuses, never guesses."""
    model, loss_func, X, y = zoo_case(name)
    G = ref.ggn(model, loss_func, X, y)
    for low_memory in (False, True):
        res = ll.ggn_eigh(model, loss_func, X, y, top_k=None, low_memory=low_memory)
        torch.testing.assert_close(res.trace, torch.trace(G), **TOL)
        assert res.eigenvectors.shape[0] == sum(p.numel() for p in model.parameters())
    with pytest.raises(NotImplementedError, match="tied|not the output of another module"):
        ll.ggn_eigh(model, loss_func, X, y, backend="backpack")


@pytest.mark.parametrize("arch", ["mlp", "cnn", "conv1d", "bn_adaptive", "residual"])
@pytest.mark.parametrize("loss", ["ce-mean", "mse-sum"])
def test_both_backends_agree(arch, loss):
    model, loss_func, X, y = make_case(arch, loss)
    sub = [3, 0, 1]
    factors = {}
    for backend in ("backpack", "functorch"):
        with ll.FactorEngine(model, loss_func, backend=backend) as engine:
            factors[backend] = engine.compute(X, y, subsampling=sub, batch_grad=True)
        assert factors[backend].backend == backend
    a, b = factors["backpack"], factors["functorch"]
    eye = torch.eye(a.num_columns, dtype=torch.float64)
    torch.testing.assert_close(b.matmul(eye), a.matmul(eye), **TOL)
    torch.testing.assert_close(b.grad_flat(), a.grad_flat(), **TOL)
    torch.testing.assert_close(b.t_matmul_batch_grads(), a.t_matmul_batch_grads(), **TOL)
    torch.testing.assert_close(b.loss, a.loss, **TOL)


@pytest.mark.parametrize("loss", ["ce-mean", "mse-mean"])
def test_functorch_monte_carlo_is_unbiased(loss):
    model, loss_func, X, y = make_case("mlp", loss, n=3)
    G = ref.ggn(model, loss_func, X, y)
    torch.manual_seed(1)
    with ll.FactorEngine(model, loss_func, backend="functorch") as engine:
        V = engine.compute(X, y, mc_samples=4000).matmul(torch.eye(12000, dtype=G.dtype))
    # 4000 draws per sample: Monte-Carlo error ~ 2% of the largest entry
    torch.testing.assert_close(V @ V.T, G, rtol=0, atol=0.1 * G.abs().max())


def test_functorch_low_memory_replays_mc_draws():
    model, loss_func, X, y = zoo_case("layernorm_gelu")
    torch.manual_seed(3)
    one = ll.ggn_eigh(model, loss_func, X, y, top_k=3, mc_samples=2)
    torch.manual_seed(3)
    two = ll.ggn_eigh(model, loss_func, X, y, top_k=3, mc_samples=2, low_memory=True)
    torch.testing.assert_close(two.eigenvalues, one.eigenvalues, **TOL)
    torch.testing.assert_close(two.eigenvectors, one.eigenvectors, **TOL)


class DictModel(nn.Module):
    """A Hugging-Face-style model: it takes the whole batch dict."""

    def __init__(self):
        super().__init__()
        self.inner = Transformer()

    def forward(self, batch):
        return self.inner(batch["input_ids"])


def test_dict_batch_equals_tuple_batch():
    torch.manual_seed(0)
    model = DictModel().double()
    _, loss_func, X, y = zoo_case("transformer")
    batch = {"input_ids": X, "labels": y, "name": "not a tensor"}
    from_dict = ll.ggn_eigh(model, loss_func, batch, y, top_k=None)
    from_tensor = ll.ggn_eigh(model.inner, loss_func, X, y, top_k=None)
    assert from_dict.backend == "functorch"
    low = ll.ggn_eigh(model, loss_func, batch, y, top_k=3, low_memory=True)
    torch.testing.assert_close(low.eigenvalues, from_tensor.eigenvalues[:3], **TOL)
    torch.testing.assert_close(from_dict.eigenvalues, from_tensor.eigenvalues, **TOL)
    torch.testing.assert_close(from_dict.eigenvectors.abs(), from_tensor.eigenvectors.abs(),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["backpack", "functorch"])
def test_user_model_left_as_it_was(backend):
    model, loss_func, X, y = zoo_case("resnet_block")
    if backend == "backpack":
        model, loss_func, X, y = make_case("bn_adaptive", "ce-mean")
    model[1].train()  # BatchNorm in train mode: the fit's eval mode must not update it
    calls = []
    model.register_forward_hook(lambda *a: None)  # observers: part of no function
    model[0].register_forward_pre_hook(lambda *a: None)
    model[0].register_full_backward_hook(lambda *a: calls.append(1))
    hooks = [(dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
             for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    modes = [m.training for m in model.modules()]
    with ll.FactorEngine(model, loss_func, eval_mode=True, backend=backend) as engine:
        engine.bytes_per_sample(X)
        engine.compute(X, y, batch_grad=True)
        engine.gradient(X, y)
    assert calls == []  # backward hooks never run in internal passes
    assert hooks == [(dict(m._forward_hooks), dict(m._forward_pre_hooks),
                      dict(m._backward_hooks)) for m in model.modules()]
    assert [p.requires_grad for p in model.parameters()] == flags
    assert [m.training for m in model.modules()] == modes
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


@pytest.mark.slow
def test_torchvision_resnet18_top_eigenvalues_against_lanczos():
    """resnet18 (eval mode) through BackPACK's converter vs curvlinops' GGN and eigsh."""
    import numpy as np
    import torchvision
    from curvlinops import GGNLinearOperator
    from scipy.sparse.linalg import eigsh

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    X, y = torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))
    loss_func = nn.CrossEntropyLoss()
    res = ll.ggn_eigh(model, loss_func, X, y, top_k=2, low_memory=True)
    assert res.backend == "backpack"
    params = [p for p in model.parameters() if p.requires_grad]
    op = GGNLinearOperator(model, loss_func, params, [(X, y)], check_deterministic=False)
    expected = np.sort(eigsh(op.to_scipy(), k=2, which="LA", return_eigenvectors=False,
                             tol=1e-3))[::-1]
    # float32 model; Lanczos Ritz values to a relative 1e-3 (kept cheap for CI)
    torch.testing.assert_close(res.eigenvalues, torch.from_numpy(expected.copy()).float(),
                               rtol=2e-3, atol=0)


def test_model_extended_elsewhere_by_backpack():
    """A user model that laplace-torch's BackPACK backend (or extend) already hooked."""
    from backpack import extend

    model, loss_func, X, y = zoo_case("frozen")
    G = ref.ggn(model, loss_func, X, y)  # torch.func refuses BackPACK's hooked modules
    extend(model)
    for backend in ("backpack", "functorch"):
        res = ll.ggn_eigh(model, loss_func, X, y, top_k=None, backend=backend)
        torch.testing.assert_close(res.trace, torch.trace(G), **TOL)
