"""Training the embedded DeepSeek-V3 model's MTP layer (toolchain/export/mtp_reference.py) with the main model
frozen, and measuring how often it drafts the main model's own next-next token.

The main model is trained first and is not touched here (no gradient, eval mode): its weights, figures and
artifacts are what they were. The MTP layer learns token t+2 from the main model's final-normed hidden state at t
and the embedding of token t+1, on the same packed rows the main model trained on. Its tensors are appended to
the checkpoint's model.safetensors under the hub's names (``model.layers.N.*``, N = num_hidden_layers), without
copies of the embedding and head, which it shares with the main model (float32: ~0.5 M values).

DeepSeek-V3.2's MTP layer has a lightning indexer, which transformers runs without gradients: it is trained as the
main layers' are (toolchain/models/indexer_training.py), from its own KL loss beside the layer's LM loss, with
the same dense warm-up (its attention over every key for the first ``dense_steps``) and then sparse training.

DeepSeek-V4's MTP block (toolchain/export/deepseek_v4_mtp_reference.py) learns from the main model's
hyper-connection streams before hc_head instead, and is appended under V4's hub names (``mtp.0.*``, unquantized),
which transformers ignores when it loads the main model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from toolchain.export.mtp_block import MtpModule, mtp_block
from toolchain.models import corpus
from toolchain.models.indexer_training import IndexerSettings, IndexerTap
from toolchain.models.train import TrainSettings, run_steps, seed_everything

MTP_SETTINGS = TrainSettings(steps=1000)
HELDOUT_TEXTS = 200


def new_mtp(model, settings: TrainSettings = MTP_SETTINGS) -> MtpModule:
    """An MTP layer over ``model``'s embedding, head and rotary embedding, as its family wires it, initialised from
    the settings' seed (so its weights do not depend on what ran before)."""
    seed_everything(settings.seed, settings.threads)
    mtp = mtp_block(model.config.model_type).new(model, model.config.num_hidden_layers)
    mtp.layer.apply(model._init_weights)
    return mtp


def main_outputs(model, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the frozen main model's final-normed hidden state, what its MTP layer reads: the same, or V4's streams
    before hc_head) at every position of ``rows``."""
    with torch.no_grad():
        return mtp_block(model.config.model_type).main_outputs(model, input_ids=rows)


def mtp_batches(model, rows: torch.Tensor):
    """(hidden [B, S-2, H] (V4: [B, S-2, hc, H]), next ids [B, S-2], labels [B, S-2]) of a batch of rows: what
    the MTP layer reads of the frozen main model at t, token t+1, target t+2."""
    hidden = main_outputs(model, rows)[1]
    return hidden[:, :-2], rows[:, 1:-1], rows[:, 2:]


def train_mtp(model, mtp: MtpModule, rows: torch.Tensor, pad: int,
              settings: TrainSettings = MTP_SETTINGS, log: Callable[[str], None] | None = None,
              indexer: IndexerSettings | None = None) -> dict:
    """Train ``mtp.layer`` only (the embedding and head are the frozen main model's); returns the final loss.
    ``indexer``: the layer's lightning indexer's training (module doc), for a V3.2 MTP layer."""
    seed_everything(settings.seed, settings.threads)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    mtp.layer.train()
    tap, dense_steps = None, 0
    if indexer is not None:  # the KL reads the attention's probabilities, which the eager implementation returns
        implementation = mtp.layer.config._attn_implementation
        mtp.layer.config._attn_implementation = "eager"
        tap, dense_steps = IndexerTap(None, [mtp.layer.block.self_attn]), indexer.dense_steps
    recent: dict[str, list[float]] = {"lm": [], "kl": []}

    def loss_of(batch: torch.Tensor, step: int) -> torch.Tensor:
        hidden, next_ids, targets = mtp_batches(model, batch)
        if tap is not None:
            tap.dense = step < dense_steps
        logits, _ = mtp(hidden, next_ids)
        labels = targets.masked_fill(targets == pad, -100)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100)
        if tap is None:
            return loss
        kl = tap.layer_kl(0, next_ids != pad)
        recent["lm"] = [*recent["lm"], loss.item()][-50:]
        recent["kl"] = [*recent["kl"], kl.item()][-50:]
        return loss + kl

    generator = torch.Generator().manual_seed(settings.seed + 1)  # not the main model's batch order
    try:
        loss = run_steps(list(mtp.layer.parameters()), rows, settings, generator, loss_of, log, "mtp step")
    finally:
        if tap is not None:
            tap.remove()
            mtp.layer.config._attn_implementation = implementation
    mtp.layer.eval()
    if tap is None:
        return {"mtp_final_train_loss": loss}
    # run_steps' loss is their sum; the LM loss alone is what V3's figure is
    return {"mtp_final_train_loss": round(sum(recent["lm"]) / len(recent["lm"]), 4),
            "mtp_final_indexer_kl": round(sum(recent["kl"]) / len(recent["kl"]), 4)}


@torch.no_grad()
def teacher_forced_acceptance(model, mtp: MtpModule, sequences: list[list[int]]) -> dict:
    """Over every position t of each sequence with a t+2: how often the MTP layer's argmax (from the main model's
    hidden state at t and the text's token t+1) is the main model's greedy token at t+2 (its argmax at t+1, on the
    same text), which is what a self-speculative step accepts; and how often it is the text's token t+2."""
    agree = correct = count = 0
    for ids in sequences:
        if len(ids) < 3:
            continue
        tokens = torch.tensor([ids])
        final, hidden = main_outputs(model, tokens)
        main_next = model.lm_head(final).argmax(-1)[0]  # [S]: the greedy token after each position
        logits, _ = mtp(hidden[:, :-2], tokens[:, 1:-1])
        draft = logits.argmax(-1)[0]  # [S-2]: the draft of token t+2
        agree += int((draft == main_next[1:-1]).sum())
        correct += int((draft == tokens[0, 2:]).sum())
        count += len(ids) - 2
    return {"mtp_acceptance": round(agree / count, 4), "mtp_accuracy": round(correct / count, 4),
            "mtp_positions": count}


def heldout_sequences(tokenizer, n: int = HELDOUT_TEXTS, seed: int = 0) -> list[list[int]]:
    return [tokenizer(t)["input_ids"] for t in corpus.text_samples("heldout", n, seed)]


def make_mtp(model, tokenizer, rows: torch.Tensor, checkpoint: Path, settings: TrainSettings = MTP_SETTINGS,
             log: Callable[[str], None] | None = None, indexer: IndexerSettings | None = None) -> dict:
    """Train the MTP layer over the trained ``model``, append it to ``checkpoint``/model.safetensors and return its
    training record (settings, wall time, acceptance on held-out text). ``indexer``: train_mtp's."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    mtp = new_mtp(model, settings)
    start = time.perf_counter()
    losses = train_mtp(model, mtp, rows, tokenizer.pad_token_id, settings, log, indexer)
    wall = time.perf_counter() - start
    metrics = {**teacher_forced_acceptance(model, mtp, heldout_sequences(tokenizer)), **losses,
               "heldout_texts": HELDOUT_TEXTS}
    file = checkpoint / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - a safetensors handle
        metadata = f.metadata()
    tensors.update(mtp_block(model.config.model_type).hub_tensors(model, mtp))
    save_file(tensors, str(file), metadata=metadata)
    return {"layer": mtp.index, "parameters": sum(p.numel() for p in mtp.layer.parameters()),
            "settings": vars(settings) | (vars(indexer) if indexer else {}), "wall_time_s": round(wall, 1),
            "threads": torch.get_num_threads(), "metrics": metrics}

