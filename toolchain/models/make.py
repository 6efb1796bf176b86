"""Build, train, evaluate and save the embedded models: `dstc models make`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from toolchain.models import corpus
from toolchain.models.configs import build_config
from toolchain.models.indexer_training import IndexerSettings, top_k_attention_mass, train_with_indexer
from toolchain.models.mtp_training import MTP_SETTINGS, make_mtp
from toolchain.models.parameters import parameter_count
from toolchain.models.registry import EMBEDDED, embedded_path
from toolchain.models.tokenizer import build_tokenizer, save_tokenizer
from toolchain.models.train import (
    TrainSettings,
    exact_match,
    perplexity,
    seed_everything,
    torch_generate_fn,
    torch_logits_fn,
    train,
    training_rows,
)

SETTINGS = {
    **{name: TrainSettings(steps=1000) for name in EMBEDDED},
    # Fewer text lines: the V2-Lite model is slower to learn the first answer digit, and needs the denser
    # arithmetic to get past that plateau within the step budget.
    "deepseek-v2-lite-tiny": TrainSettings(steps=1000, n_texts=8000),
}
# The embedded models trained with an MTP layer (toolchain/models/mtp_training.py), after their main model (V3.2's
# with its indexer's KL loss, as its main layers'; V4's a block over its hyper-connection streams).
MTP_MODELS = ("deepseek-v3-tiny", "deepseek-v32-tiny", "deepseek-v4-tiny")
# V4's block in 400 steps, not 1000: each step runs the frozen main model's four V4 layers (compressors, indexer,
# hyper-connections) too, 1.25 s a step on one thread of this 2-core machine under load (500 s)
MTP_SETTINGS_OF = {"deepseek-v4-tiny": TrainSettings(steps=400)}
# The embedded models whose lightning indexer is trained with DeepSeek's KL loss (toolchain/models/indexer_training.py).
INDEXER_MODELS = {"deepseek-v32-tiny": IndexerSettings()}
HELDOUT_PROBLEMS = 500
HELDOUT_TEXTS = 200


def evaluate(model: torch.nn.Module, tokenizer, n_problems: int = HELDOUT_PROBLEMS, n_texts: int = HELDOUT_TEXTS,
             seed: int = 0) -> dict:
    """Held-out exact-match on the arithmetic task and held-out text perplexity (with uniform for scale)."""
    problems = corpus.task_examples("heldout", n_problems, seed)
    texts = [tokenizer(t)["input_ids"] for t in corpus.text_samples("heldout", n_texts, seed)]
    return {
        "exact_match": round(exact_match(torch_generate_fn(model, tokenizer), problems), 4),
        "perplexity": round(perplexity(torch_logits_fn(model), texts), 4),
        "uniform_perplexity": len(tokenizer),
        "heldout_problems": n_problems,
        "heldout_texts": n_texts,
    }


def _set_correction_bias(model: torch.nn.Module, seed: int) -> None:
    """Small nonzero e_score_correction_bias (a buffer, never trained) so that expert choice depends on it."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_((torch.rand(bias.shape, generator=generator) - 0.5) * 0.2)


def _set_hash_routes(model: torch.nn.Module, n_experts: int, seed: int) -> None:
    """A fixed random token -> experts table for V4's hash-routed layers (tid2eid, a buffer transformers initialises
    to zeros, every token to expert 0): distinct experts per token, a different table in each layer, as shipped."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        if table is not None:
            order = torch.rand(table.shape[0], n_experts, generator=generator).argsort(dim=-1)
            table.copy_(order[:, :table.shape[1]])


def make_model(name: str, path: Path, tokenizer) -> dict:
    settings = SETTINGS[name]
    rows, size = training_rows(tokenizer, settings)
    seed_everything(settings.seed, settings.threads)
    config = build_config(name)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        _set_correction_bias(model, settings.seed)
        _set_hash_routes(model, getattr(config, "n_routed_experts", 0), settings.seed)
    start = time.perf_counter()
    if name in INDEXER_MODELS:
        losses = train_with_indexer(model, rows, tokenizer.pad_token_id, settings, INDEXER_MODELS[name])
    else:
        losses = train(model, rows, tokenizer.pad_token_id, settings)
    wall = time.perf_counter() - start
    metrics = {**evaluate(model, tokenizer), **losses}
    if name in INDEXER_MODELS:
        texts = [tokenizer(t)["input_ids"] for t in corpus.text_samples("heldout", HELDOUT_TEXTS, 0)]
        metrics["top_k_attention_mass"] = top_k_attention_mass(model, texts)

    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id, do_sample=False).save_pretrained(path)
    save_tokenizer(tokenizer, path)
    record = {
        "model": name,
        "parameters": parameter_count(model),
        "corpus": size,
        "settings": vars(settings) | (vars(INDEXER_MODELS[name]) if name in INDEXER_MODELS else {}),
        "wall_time_s": round(wall, 1),
        "threads": torch.get_num_threads(),
        "metrics": metrics,
    }
    if name in MTP_MODELS:
        record["mtp"] = make_mtp(model, tokenizer, rows, path, MTP_SETTINGS_OF.get(name, MTP_SETTINGS),
                                 indexer=INDEXER_MODELS.get(name))
    (path / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return metrics


def make_models(names: list[str] | None, out_root: Path) -> Iterator[tuple[str, Path, dict]]:
    """Train and save each named embedded model (all by default) under ``out_root`` (the package's own folder,
    EMBEDDED_ROOT, when the models are remade for a release)."""
    names = names or list(EMBEDDED)
    for name in names:
        embedded_path(name)  # rejects an unknown name before any training
    out_root = Path(out_root)
    tokenizer = build_tokenizer()
    for name in names:
        path = out_root / name
        yield name, path, make_model(name, path, tokenizer)
