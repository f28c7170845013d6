"""Hugging Face models as clients: a config-built GPT-2 classifier with PEFT LoRA
adapters over dict batches, in laplace-torch's own recipe (a wrapper returning the
logits, ``dict_key_y``), exact at full rank against ``FullLaplace(CurvlinopsGGN)``."""

import copy
import warnings

import pytest
import torch
from laplace import FullLaplace, Laplace
from laplace.curvature import CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lowrank_laplace  # noqa: F401 (registers hessian_structure="lowrank_ggn")

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOL = dict(rtol=1e-8, atol=1e-10)


def lora_gpt2(attention: str, classes: int = 3) -> nn.Module:
    """A 2-layer GPT-2 classifier (random weights) with LoRA on the attention input."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, num_labels=classes,
        pad_token_id=0, bos_token_id=1, eos_token_id=1)
    base = transformers.GPT2ForSequenceClassification._from_config(
        config, attn_implementation=attention)
    lora = peft.LoraConfig(r=2, lora_alpha=8, target_modules=["c_attn"], task_type="SEQ_CLS")
    return Logits(peft.get_peft_model(base, lora)).double().eval()


class Logits(nn.Module):
    """laplace-torch's Hugging Face recipe: the model takes the dict, returns logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch):
        return self.model(input_ids=batch["input_ids"],
                          attention_mask=batch["attention_mask"]).logits


class Sequences(Dataset):
    """Padded token sequences of 3-8 tokens with class labels."""

    def __init__(self, n, length=8, seed=1, classes=3):
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, length + 1, (n,), generator=gen)
        self.mask = (torch.arange(length)[None] < lengths[:, None]).long()
        self.ids = torch.randint(2, 50, (n, length), generator=gen) * self.mask
        self.labels = torch.randint(0, classes, (n,), generator=gen)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "labels": self.labels[i]}


def _reference(model, loader, **kwargs):
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # curvlinops builds its identity in it
    try:
        full = FullLaplace(model, "classification", backend=CurvlinopsGGN, **kwargs)
        full.fit(loader)
    finally:
        torch.set_default_dtype(old)
    return full


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dense_max_dim", [0, 2048])
def test_lora_gpt2_equals_full_laplace(attention, dense_max_dim, tune):
    eager = lora_gpt2("eager")  # the reference's forward-mode products need eager
    ours_model = lora_gpt2(attention)
    ours_model.load_state_dict(eager.state_dict())
    loader = DataLoader(Sequences(12), batch_size=5)
    tune(dense_max_dim=dense_max_dim)
    la = Laplace(ours_model, "classification", subset_of_weights="all",
                 hessian_structure="lowrank_ggn", rank=10**4, prior_precision=0.5)
    la.fit(loader)
    assert la.factor_backend_used == "hooks"
    assert la.fit_path == ("dense" if dense_max_dim else "streaming")
    full = _reference(eager, loader, prior_precision=0.5)
    U, lam = la.H
    torch.testing.assert_close(U @ torch.diag(lam) @ U.T, full.H, **TOL)
    torch.testing.assert_close(la.log_marginal_likelihood(), full.log_marginal_likelihood(),
                               **TOL)
    test = next(iter(DataLoader(Sequences(6, seed=2), batch_size=6)))
    torch.testing.assert_close(la(test, pred_type="glm", link_approx="probit"),
                               full(test, pred_type="glm", link_approx="probit"), **TOL)
    assert not any(m._forward_hooks for m in ours_model.modules())


@pytest.mark.slow
def test_lora_gpt2_monte_carlo_and_sketch_fits_run_on_the_hooks_backend(tune):
    model = lora_gpt2("sdpa")
    loader = DataLoader(Sequences(20), batch_size=8)
    tune(dense_max_dim=0)
    for kwargs in (dict(mc_samples=1), dict(solver="sketch", rank=8)):
        la = Laplace(model, "classification", subset_of_weights="all",
                     hessian_structure="lowrank_ggn", **kwargs)
        la.fit(loader)
        assert la.factor_backend_used == "hooks" and 0 < float(la.kept_fraction) <= 1 + 1e-9
        la.optimize_prior_precision(method="marglik", n_steps=5)
        probs = la(next(iter(loader)), pred_type="glm", link_approx="probit")
        torch.testing.assert_close(probs.sum(1), torch.ones(8, dtype=torch.float64))


def test_bad_inputs_fail_before_any_work_with_the_way_out():
    model = lora_gpt2("sdpa")
    loader = DataLoader(Sequences(8), batch_size=4)
    la = Laplace(_ModelOutput(model.model), "classification", subset_of_weights="all",
                 hessian_structure="lowrank_ggn")
    with pytest.raises(ValueError, match="ModelOutput: wrap the model"):
        la.fit(loader)
    la = Laplace(model, "classification", subset_of_weights="all",
                 hessian_structure="lowrank_ggn", dict_key_y="label")
    with pytest.raises(KeyError, match=r"dict_key_y='label' \(keys: \['attention_mask'"):
        la.fit(loader)
    padded = Sequences(8)
    padded.mask[3] = 0
    padded.ids[3] = 0
    la = Laplace(model, "classification", subset_of_weights="all",
                 hessian_structure="lowrank_ggn")
    with pytest.raises(ValueError, match=r"Samples \[3\] of the batch are padding only"):
        la.fit(DataLoader(padded, batch_size=8))
    assert la.H is None  # nothing fitted


class _ModelOutput(nn.Module):
    """Takes the dict batch but returns the Hugging Face output object, not the logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch):
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


@pytest.mark.parametrize("solver", ["auto", "streaming", "sketch", "low_memory"])
def test_bfloat16_base_with_float32_adapters(tune, solver):
    """As LLM users load them: a bfloat16 model, PEFT's float32 LoRA adapters and a
    bfloat16 head trained beside them. Every path fits, the spectral residual's probe
    included, and the posterior (its prior, its probabilities) is the Laplace parameters'
    float32, as a float64 copy of the same network says to bfloat16's precision."""
    tune(dense_max_dim=0)
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, num_labels=3,
        pad_token_id=0, bos_token_id=1, eos_token_id=1)
    base = transformers.GPT2ForSequenceClassification(config).to(torch.bfloat16)
    lora = peft.LoraConfig(r=2, target_modules=["c_attn"], modules_to_save=["score"],
                           task_type="SEQ_CLS")
    model = Logits(peft.get_peft_model(base, lora)).eval()
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    assert dtypes == {torch.bfloat16, torch.float32}  # adapters float32, head bfloat16
    options = dict(rank=8, solver=solver) if solver != "low_memory" else \
        dict(rank=8, solver="streaming", low_memory=True)
    if solver == "sketch":
        options["micro_batch_size"] = 4
    loader = DataLoader(Sequences(40), batch_size=8)
    la = Laplace(model, "classification", subset_of_weights="all",
                 hessian_structure="lowrank_ggn", **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a small sketch may say it has not converged
        la.fit(loader)
    la.optimize_prior_precision(method="marglik", n_steps=20)
    probs = la(next(iter(loader)), pred_type="glm", link_approx="probit")
    assert la.prior_precision.dtype == probs.dtype == torch.float32
    assert la.H[0].dtype == torch.float32 and (
        la.dropped_quadrature is not None or "not measured" in str(la.fit_report))
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(1), torch.ones(8))
    wide = copy.deepcopy(model).double()
    ref = Laplace(wide, "classification", subset_of_weights="all",
                  hessian_structure="lowrank_ggn", rank=8, solver="streaming")
    ref.fit(loader)
    assert abs(float(la.trace / ref.trace) - 1) < 0.05  # bfloat16 activations
