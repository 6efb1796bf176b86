"""DeepSeek-V3.2's indexer training (toolchain/models/indexer_training.py): scores as the module's, a loss that trains
the indexer only, a dense warm-up that is dense attention, reproducible runs, and the embedded model's indexer."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from toolchain.models import corpus
from toolchain.models.configs import build_config
from toolchain.models.indexer_training import (
    IndexerSettings,
    IndexerTap,
    index_scores,
    top_k_attention_mass,
    train_with_indexer,
)
from toolchain.models.registry import embedded_path
from toolchain.models.train import TrainSettings
from toolchain.tokenizer_loading import load_tokenizer

NAME = "deepseek-v32-tiny"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_path(NAME))


@pytest.fixture(scope="module")
def texts(tokenizer):
    """Held-out texts longer than index_topk (16), so that the indexer chooses."""
    return [ids for ids in (tokenizer(t)["input_ids"] for t in corpus.text_samples("heldout", 40, 1)) if len(ids) > 24]


def _embedded():
    return AutoModelForCausalLM.from_pretrained(embedded_path(NAME)).eval()


def _fresh(seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(build_config(NAME))


def test_recomputed_scores_choose_the_modules_keys(texts):
    """index_scores (with gradients) is the indexer's own computation: its top-k is the module's, in every layer."""
    model = _embedded()
    model.set_attn_implementation("eager")
    tap = IndexerTap(model)
    for ids in texts[:5]:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
        for i, attn in enumerate(tap.attentions):
            scores = index_scores(attn.indexer, *tap.inputs[i])
            ours = scores.topk(model.config.index_topk, dim=-1).indices.sort(dim=-1).values
            assert torch.equal(ours, tap.chosen[i].long().sort(dim=-1).values)
    tap.remove()


def test_the_kl_trains_the_indexer_only_and_the_lm_loss_never_reaches_it(tokenizer, texts):
    model = _fresh()
    model.set_attn_implementation("eager")
    tap = IndexerTap(model)
    batch = torch.tensor([texts[0][:24], texts[1][:24]])
    lm = model(input_ids=batch, labels=batch).loss
    kl = sum(tap.layer_kl(i, batch != tokenizer.pad_token_id) for i in range(len(tap.attentions)))
    assert float(kl.detach()) > 0
    indexer = {name for name, _ in model.named_parameters() if ".indexer." in name}
    assert len(indexer) == 3 * 5  # wq_b, wk, k_norm (weight, bias), weights_proj in each of 3 layers

    def reached(loss):
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True, retain_graph=True)
        return {n for (n, _), g in zip(model.named_parameters(), grads) if g is not None and g.abs().sum() > 0}

    assert reached(kl) == indexer
    assert not reached(lm) & indexer and len(reached(lm)) > 20
    tap.remove()


def test_the_dense_stage_attends_to_every_key(texts):
    """While dense, the model's logits are those of the same model with an index_topk above the sequence's length
    (every causal key chosen), and differ from its sparse logits."""
    model = _embedded()
    ids = torch.tensor([texts[0]])
    with torch.no_grad():
        sparse = model(input_ids=ids).logits
        tap = IndexerTap(model)
        tap.dense = True
        dense = model(input_ids=ids).logits
        tap.remove()
        for layer in model.model.layers:
            layer.self_attn.indexer.index_topk = 1024
        every_key = model(input_ids=ids).logits
    assert torch.equal(dense, every_key)
    assert (dense - sparse).abs().max() > 1e-3


def test_training_is_reproducible_and_leaves_the_model_as_it_found_it(tokenizer, texts):
    rows = torch.tensor([(ids + [tokenizer.pad_token_id] * 32)[:32] for ids in texts[:8]])
    settings = TrainSettings(steps=4, batch_size=4, warmup=1)

    def run():
        model = _fresh()
        losses = train_with_indexer(model, rows, tokenizer.pad_token_id, settings, IndexerSettings(dense_steps=2))
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        return model, losses, digest

    model, losses, digest = run()
    assert run()[1:] == (losses, digest)
    assert losses["final_indexer_kl"] > 0 and losses["final_train_loss"] > 0
    assert model.config._attn_implementation == "sdpa" and not model.training
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_the_embedded_models_indexer_holds_the_attention(texts):
    """The trained indexer chooses the keys the main attention weighs: 0.9005 of it on the 200 held-out texts at
    training, 0.892 on these 18 (random choices of index_topk keys would hold 0.642 of it, and the untrained
    indexer held 0.650)."""
    record = json.loads((embedded_path(NAME) / "training.json").read_text())
    assert record["settings"]["dense_steps"] == IndexerSettings().dense_steps
    assert record["metrics"]["top_k_attention_mass"] == 0.9005
    assert len(texts) == 18 and top_k_attention_mass(_embedded(), texts) == pytest.approx(0.8916, abs=5e-4)
