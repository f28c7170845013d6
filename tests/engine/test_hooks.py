"""The hooks backend against dense float64 references: trainable linear, embedding and
norm layers behind frozen modules (attention, custom code), tokens, dicts, in-place
activations; and the checks that guard it."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import lowrank_laplace as ll
from lowrank_laplace.engine import FactorEngine
from tests import reference as ref

TOL = dict(rtol=1e-8, atol=1e-10)


class TokenModel(nn.Module):
    """Trainable embedding, LayerNorm, MLP and head around frozen attention."""

    def __init__(self, vocab=11, width=6, out=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, width, padding_idx=0)
        self.norm = nn.LayerNorm(width)
        self.att = nn.MultiheadAttention(width, 2, batch_first=True).requires_grad_(False)
        self.up = nn.Linear(width, 2 * width)
        self.act = nn.ReLU(inplace=True)
        self.down = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, out)

    def forward(self, x):
        h = self.norm(self.emb(x))
        h = h + self.att(h, h, h, need_weights=False)[0]
        h = h + self.down(self.act(self.up(h)))
        return self.head(h.mean(1))


class Adapter(nn.Module):
    """A frozen base layer with a trainable low-rank adapter, an RMSNorm and a head."""

    def __init__(self, width=5, rank=2, out=2):
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.lora_A = nn.Linear(width, rank, bias=False)
        self.lora_B = nn.Linear(rank, width, bias=False)
        self.norm = nn.RMSNorm(width, eps=1e-5)
        self.head = nn.Linear(width, out)

    def forward(self, x):
        h = self.base(x) + 2.0 * self.lora_B(self.lora_A(x))
        out = self.head(F.gelu(self.norm(h)))
        return out.mean(1) if out.dim() == 3 else out


class DictTokens(nn.Module):
    """Hugging-Face style: the whole dict, a padding mask and a batch-wide table."""

    def __init__(self):
        super().__init__()
        self.tokens = TokenModel()

    def forward(self, batch):
        t = self.tokens
        h = t.norm(t.emb(batch["input_ids"]) + batch["positions"])
        mask = batch["attention_mask"]
        h = h + t.att(h, h, h, key_padding_mask=mask == 0, need_weights=False)[0]
        h = h + t.down(t.act(t.up(h)))
        weights = mask[..., None].to(h.dtype)
        return t.head((h * weights).sum(1) / weights.sum(1))


def _case(name, loss, n=5, seed=0):
    torch.manual_seed(seed)
    if name == "tokens":
        model, X = TokenModel(), torch.randint(0, 11, (n, 4))
    elif name == "adapter":
        model, X = Adapter(), torch.randn(n, 3, 5)  # three positions per sample
    elif name == "adapter_flat":
        model, X = Adapter(), torch.randn(n, 5)
    else:
        model = DictTokens()
        ids = torch.randint(1, 11, (n, 4))
        mask = (torch.arange(4)[None] < torch.randint(2, 5, (n, 1))).long()
        X = {"input_ids": ids * mask, "attention_mask": mask,
             "positions": torch.randn(1, 4, 6, dtype=torch.float64)}
    model = model.double().eval()
    if isinstance(X, torch.Tensor) and X.is_floating_point():
        X = X.double()
    C = 2 if name.startswith("adapter") else 3
    if loss.startswith("ce"):
        loss_func, y = nn.CrossEntropyLoss(reduction=loss[3:]), torch.randint(0, C, (n,))
    else:
        loss_func, y = nn.MSELoss(reduction=loss[4:]), torch.randn(n, C, dtype=torch.float64)
    return model, loss_func, X, y


CASES = ["tokens", "adapter", "adapter_flat", "dict"]
LOSSES = ["ce-mean", "ce-sum", "mse-mean", "mse-sum"]


def _dense(factor):
    """``V``, ``(D, M)``, from its blocks."""
    return torch.cat([block.to_dense() for block in factor.group_blocks()], dim=1).T


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("name", CASES)
def test_factor_gradient_and_per_sample_gradients_are_exact(name, loss):
    model, loss_func, X, y = _case(name, loss)
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y, batch_grad=True)
        assert engine.backend == "hooks" == factor.backend
    V = _dense(factor)
    torch.testing.assert_close(V @ V.T, ref.ggn(model, loss_func, X, y), **TOL)
    torch.testing.assert_close(torch.cat([factor.grad[i] for i in sorted(factor.grad)]),
                               ref.gradient(model, loss_func, X, y), **TOL)
    per_sample = torch.cat([factor.batch_grads[i].to_dense()
                            for i in sorted(factor.batch_grads)], dim=1)
    rho = 1 / len(y) if loss_func.reduction == "mean" else 1.0  # gradients of rho l_n
    torch.testing.assert_close(per_sample, rho * ref.per_sample_grads(model, loss_func, X, y),
                               **TOL)


@pytest.mark.parametrize("name", ["tokens", "dict"])
def test_subsampling_and_low_memory_eigenpairs(name):
    model, loss_func, X, y = _case(name, "ce-mean", n=6)
    sub = [0, 2, 5]
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y, subsampling=sub)
    V = _dense(factor)
    torch.testing.assert_close(V @ V.T, ref.ggn(model, loss_func, X, y, subsampling=sub),
                               **TOL) if name == "tokens" else None
    one = ll.ggn_eigh(model, loss_func, X, y, top_k=3)
    two = ll.ggn_eigh(model, loss_func, X, y, top_k=3, low_memory=True)
    assert one.backend == two.backend == "hooks"
    torch.testing.assert_close(two.eigenvalues, one.eigenvalues, **TOL)
    torch.testing.assert_close((two.eigenvectors * one.eigenvectors).sum(0).abs(),
                               torch.ones(3, dtype=torch.float64), **TOL)


def test_monte_carlo_factor_estimates_the_ggn():
    model, loss_func, X, y = _case("adapter_flat", "ce-sum", n=3)
    torch.manual_seed(1)
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y, mc_samples=20000)
    assert factor.num_vectors == 20000
    V = _dense(factor)
    G = ref.ggn(model, loss_func, X, y)
    # Monte-Carlo error of 20,000 samples: a few percent of the largest entry
    assert float((V @ V.T - G).abs().max()) < 0.05 * float(G.abs().max())


def test_newton_and_directional_take_the_gradient_from_the_same_pass():
    model, loss_func, X, y = _case("tokens", "ce-mean")
    one = ll.damped_newton_step(model, loss_func, X, y, damping=0.5)
    two = ll.damped_newton_step(model, loss_func, X, y, damping=0.5, low_memory=True)
    torch.testing.assert_close(two, one, **TOL)
    dd = ll.directional_derivatives(model, loss_func, X, y, top_k=2)
    low = ll.directional_derivatives(model, loss_func, X, y, top_k=2, low_memory=True)
    torch.testing.assert_close(low.gammas.abs(), dd.gammas.abs(), **TOL)
    torch.testing.assert_close(low.lambdas, dd.lambdas, **TOL)


class Reused(nn.Module):
    """A trainable weight used outside its module as well."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x)) + F.linear(x, self.lin.weight))


def test_a_weight_used_outside_its_module_goes_to_functorch():
    model = Reused().double()
    X, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 2, (5,))
    loss_func = nn.CrossEntropyLoss()
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y)
        assert engine.backend == "functorch"
        assert "differ from autograd's for ['lin.weight']" in engine.rejected["hooks"]
    V = _dense(factor)
    torch.testing.assert_close(V @ V.T, ref.ggn(model, loss_func, X, y), **TOL)
    with pytest.raises(NotImplementedError, match="differ from autograd's"):
        with FactorEngine(model, loss_func, backend="hooks") as engine:
            engine.compute(X, y)


@pytest.mark.parametrize("backend", ["auto", "backpack", "hooks", "functorch"])
def test_inplace_activations(backend):
    """In-place activations on layer outputs: BackPACK refuses them with a clear error,
    the other backends are exact (and 'auto' takes the hooks backend)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)).double()
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    loss_func = nn.CrossEntropyLoss()
    if backend == "backpack":
        with pytest.raises(NotImplementedError, match="in-place operation"):
            ll.ggn_eigh(model, loss_func, X, y, backend=backend)
        return
    res = ll.ggn_eigh(model, loss_func, X, y, top_k=None, backend=backend)
    assert res.backend == ("hooks" if backend == "auto" else backend)
    torch.testing.assert_close(res.eigenvectors @ torch.diag(res.eigenvalues)
                               @ res.eigenvectors.T, ref.ggn(model, loss_func, X, y), **TOL)


class Centered(nn.Module):
    """Batch statistics in the forward pass: the samples are coupled."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x - x.mean(0))


class SharedRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, batch):
        return self.lin(batch["x"] + batch["table"].reshape(-1, 3).sum(0))


@pytest.mark.parametrize("backend", ["auto", "backpack", "hooks", "functorch"])
def test_coupled_samples_are_refused_before_any_pass(backend):
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match="depends on the other samples"):
        ll.ggn_eigh(Centered().double(), nn.CrossEntropyLoss(), X, y, backend=backend)
    if backend == "backpack":
        return
    batch = {"x": X, "table": torch.randn(4, 3, dtype=torch.float64)}  # shared, 4 rows
    with pytest.raises(ValueError, match=r"entries split per sample: \['x', 'table'\]"):
        ll.ggn_eigh(SharedRows().double(), nn.CrossEntropyLoss(), batch, y, backend=backend)
    batch["table"] = batch["table"][None]  # a leading 1: not split, exact
    res = ll.ggn_eigh(SharedRows().double(), nn.CrossEntropyLoss(), batch, y, top_k=None,
                      backend=backend)
    G = ref.ggn(SharedRows().double(), nn.CrossEntropyLoss(), batch, y)
    assert G.shape == (8, 8) and res.eigenvalues.numel() >= 1


def test_untouched_model_and_no_leftover_hooks():
    model, loss_func, X, y = _case("tokens", "ce-mean")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    ll.ggn_eigh(model, loss_func, X, y, top_k=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert flags == [p.requires_grad for p in model.parameters()]
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    torch.func.functional_call(model, dict(model.named_parameters()), (X,))


@pytest.mark.parametrize("slopes", [1, 4])
def test_prelu_is_exact_on_the_hooks_backend_and_refused_by_functorch(slopes):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.PReLU(slopes), nn.Linear(4, 2)).double()
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    loss_func = nn.CrossEntropyLoss()
    res = ll.ggn_eigh(model, loss_func, X, y, top_k=None)
    assert res.backend == "hooks"
    torch.testing.assert_close(res.eigenvectors @ torch.diag(res.eigenvalues)
                               @ res.eigenvectors.T, ref.ggn(model, loss_func, X, y), **TOL)
    with pytest.raises(NotImplementedError, match=r"cannot batch nn.PReLU \(layers \['1'\]\)"):
        ll.ggn_eigh(model, loss_func, X, y, backend="functorch")
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.PReLU(2), nn.Flatten(), nn.Linear(8, 2))
    with pytest.raises(NotImplementedError, match="cannot batch nn.PReLU"):
        ll.ggn_eigh(conv.double(), loss_func, torch.randn(4, 1, 4, 4, dtype=torch.float64),
                    y[:4])


class _FusedAttention(nn.Module):
    """Self-attention through ``scaled_dot_product_attention`` (no vmap batching rule)."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.q(x).unsqueeze(1)
        return self.o(nn.functional.scaled_dot_product_attention(h, h, h).mean((1, 2)))


def test_functorch_says_once_that_it_loops_and_the_answer_is_exact():
    """The fit says so; the later passes over the same model (the probe, the GLM
    predictive) do not say it again."""
    from laplace import Laplace
    from torch.utils.data import DataLoader, TensorDataset

    import lowrank_laplace  # noqa: F401

    torch.manual_seed(0)
    model, X = _FusedAttention().double(), torch.randn(6, 5, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with FactorEngine(model, nn.CrossEntropyLoss(reduction="sum"),
                          backend="functorch") as engine:
            factor = engine.compute(X, y)
        la = Laplace(model, "classification", subset_of_weights="all",
                     hessian_structure="lowrank_ggn", factor_backend="functorch", rank=4)
        la.fit(DataLoader(TensorDataset(X, y), batch_size=6))
        la(X, pred_type="glm", link_approx="probit")
    messages = [str(w.message) for w in caught]
    assert sum("one sample at a time (slow)" in m for m in messages) == 2, messages  # 2 fits
    assert not any("There is a performance drop" in m for m in messages), messages
    G = ref.ggn(model, nn.CrossEntropyLoss(reduction="sum"), X, y)
    V = factor.matmul(torch.eye(factor.num_columns, dtype=torch.float64))
    assert torch.allclose(V @ V.T, G, atol=1e-10)
