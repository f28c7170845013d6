"""A BERT full fine-tune on the hooks backend: every trainable parameter sits in Embedding,
Linear and LayerNorm layers; the position embeddings are looked up once for the whole
batch (index tensors of batch size 1 that broadcast), and each sample's rows of a shared
lookup are its own output vectors there. Exact at full rank in float64 against a dense
torch.func reference."""

import pytest
import torch
from torch import nn

from lowrank_laplace.engine import FactorEngine
from tests import reference as ref

transformers = pytest.importorskip("transformers")

TOL = dict(rtol=1e-8, atol=1e-10)


class Logits(nn.Module):
    """The Hugging Face model on a dict batch, returning the logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch):
        return self.model(input_ids=batch["input_ids"],
                          attention_mask=batch["attention_mask"]).logits


def micro_bert(attention):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=20, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=8, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForSequenceClassification._from_config(
        config, attn_implementation=attention)
    return Logits(model).double().eval()


def _batch(n=5, length=6):
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, length + 1, (n,), generator=gen)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    ids = torch.randint(1, 20, (n, length), generator=gen) * mask
    return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (n,), generator=gen)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bert_full_fine_tune_is_exact_on_the_hooks_backend(reduction):
    eager = micro_bert("eager")  # the reference's Jacobians
    model = micro_bert("sdpa")
    X, y = _batch()
    loss_func = nn.CrossEntropyLoss(reduction=reduction)
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y, batch_grad=True)
        assert engine.backend == "hooks", engine.rejected
    V = torch.cat([b.to_dense() for b in factor.group_blocks()], dim=1).T
    assert V.shape[0] == sum(p.numel() for p in model.parameters())
    torch.testing.assert_close(V @ V.T, ref.ggn(eager, loss_func, X, y), **TOL)
    torch.testing.assert_close(torch.cat([factor.grad[i] for i in sorted(factor.grad)]),
                               ref.gradient(eager, loss_func, X, y), **TOL)
    rho = 1 / len(y) if reduction == "mean" else 1.0
    per_sample = torch.cat([factor.batch_grads[i].to_dense()
                            for i in sorted(factor.batch_grads)], dim=1)
    torch.testing.assert_close(per_sample, rho * ref.per_sample_grads(eager, loss_func, X, y),
                               **TOL)


class SharedTable(nn.Module):
    """A trainable layer on a frozen table of three rows, the same for every sample."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(3, 4))
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(x + self.lin(self.table).sum(0))


def test_rows_that_belong_to_no_sample_are_refused_naming_the_layer():
    torch.manual_seed(0)
    model = SharedTable().double()
    X, y = torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 2, (4,))
    loss_func = nn.CrossEntropyLoss()
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y)
        assert engine.backend == "functorch"
        assert "Layer 'lin' sees 3 rows for a batch of 2 samples" in engine.rejected["hooks"]
    V = factor.matmul(torch.eye(factor.num_columns, dtype=torch.float64))
    torch.testing.assert_close(V @ V.T, ref.ggn(model, loss_func, X, y), **TOL)
