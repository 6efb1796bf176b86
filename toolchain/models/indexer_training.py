"""Training DeepSeek-V3.2's lightning indexer as DeepSeek does (DeepSeek-V3.2 paper, "Continued pre-training").

transformers runs the indexer's forward without gradients, so plain causal-LM training leaves it at its random
initialisation. Here each layer's indexer learns from an auxiliary loss of its own,

    KL(p || softmax(I)),   p = the main attention's probabilities over the keys, summed over heads and
                               L1-normalised (detached); I = the indexer's scores of those keys,

averaged over the non-padding queries and summed over layers, while the main model learns from the LM loss alone:
the indexer's inputs (the layer's normed hidden state and the query's latent) are detached, and its top-k passes
no gradient. One run of ``settings.steps`` steps has DeepSeek's two stages:

- dense warm-up (the first ``dense_steps``): the main attention attends to every causal key (the indexer's choice
  is replaced by all keys), and the KL is over all of them;
- sparse training: the main attention attends to the indexer's top-k, as at inference, and the KL is over the
  chosen keys only.

DeepSeek warms the indexer up on a trained dense model with the rest frozen; the embedded model is trained from
scratch, so here the main model trains through both stages.

transformers' modules are used as they are: hooks read the indexer's inputs and the main attention's
probabilities (the eager attention returns them; the model is switched to it for training and back after), and
in the dense stage replace the indexer's output. The scores are computed again, with gradients, from the
indexer's own projections (``index_scores``; the test checks that their top-k is the module's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

from toolchain.models.train import TrainSettings, run_steps, seed_everything

if TYPE_CHECKING:
    from toolchain.export.weights import HFModule


@dataclass(frozen=True)
class IndexerSettings:
    # Steps of the dense warm-up, out of the run's TrainSettings.steps: half, as the indexer learns which keys to
    # choose only while every key is attended (the sparse stage's KL sees the chosen keys only).
    dense_steps: int = 500


def index_scores(indexer: HFModule, hidden: torch.Tensor, q_latent: torch.Tensor,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """The indexer's scores [B, S, T] (as DeepseekV32Indexer computes them without gradients):
    sum_h weights_proj(h)[h] * heads^-0.5 * relu(q_h . k * dim^-0.5), q and k half-split-rotated on their first
    qk_rope_head_dim values, plus the additive mask [B, S, T]."""
    batch, seq, _ = hidden.shape
    rope = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_latent).view(batch, seq, indexer.n_heads, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
    cos, sin = position_embeddings
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., rope:]], dim=-1)  # [B, S, H, D]
    k = torch.cat([k_rot, k[..., rope:]], dim=-1).squeeze(2)  # [B, T, D]
    per_head = torch.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * indexer.softmax_scale)  # [B, S, H, T]
    weights = indexer.weights_proj(hidden) * indexer.n_heads ** -0.5
    return torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2) + mask


class IndexerTap:
    """Hooks on every layer's attention (or on ``attentions``: an MTP layer's, toolchain/models/mtp_training.py):
    the indexer's inputs and chosen keys, the attention's probabilities, and (while ``dense``) all keys in place of
    the indexer's choice."""

    def __init__(self, model: HFModule, attentions: Sequence[HFModule] = ()):
        self.attentions = list(attentions) or [layer.self_attn for layer in model.model.layers]
        self.dense = False
        self.inputs: list[tuple] = [()] * len(self.attentions)
        self.chosen: list[torch.Tensor | None] = [None] * len(self.attentions)
        self.probs: list[torch.Tensor | None] = [None] * len(self.attentions)
        self.handles = []
        for i, attn in enumerate(self.attentions):
            self.handles += [attn.indexer.register_forward_pre_hook(self._keep_inputs(i)),
                             attn.indexer.register_forward_hook(self._choice(i)),
                             attn.register_forward_hook(self._keep_probs(i))]

    def _keep_inputs(self, i: int):
        def hook(_module, args):
            hidden, q_latent, position_embeddings, mask = args[:4]  # the eager mask: additive float
            self.inputs[i] = (hidden.detach(), q_latent.detach(), position_embeddings, mask)
        return hook

    def _choice(self, i: int):
        def hook(_module, _args, chosen):
            if self.dense:
                batch, seq, _ = chosen.shape
                total = self.inputs[i][3].shape[-1]
                chosen = torch.arange(total, dtype=chosen.dtype).expand(batch, seq, total)
            self.chosen[i] = chosen
            return chosen
        return hook

    def _keep_probs(self, i: int):
        def hook(_module, _args, output):
            self.probs[i] = output[1]
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def layer_kl(self, i: int, queries: torch.Tensor) -> torch.Tensor:
        """Layer i's KL(main attention || indexer softmax) over the keys attended, averaged over the ``queries``
        [B, S] (a bool mask)."""
        probs = self.probs[i]
        assert probs is not None, "the attention returns its probabilities in the eager implementation only"
        target = probs.detach().float().sum(dim=1)
        target = target / target.sum(dim=-1, keepdim=True)
        scores = index_scores(self.attentions[i].indexer, *self.inputs[i])
        chosen = self.chosen[i]
        assert chosen is not None
        attended = torch.zeros(scores.shape, dtype=torch.bool).scatter(-1, chosen.long(), True)
        log_q = torch.log_softmax(scores.masked_fill(~attended, torch.finfo(scores.dtype).min), dim=-1)
        terms = torch.where(target > 0, target * (torch.log(target) - log_q), torch.zeros(()))
        return terms.sum(dim=-1)[queries].mean()


def train_with_indexer(model: HFModule, rows: torch.Tensor, pad: int, settings: TrainSettings,
                       indexer: IndexerSettings, log: Callable[[str], None] | None = None) -> dict:
    """Causal-LM training of a DeepSeek-V3.2 model with its indexers' KL loss: a dense warm-up, then sparse
    training; returns the final LM loss and indexer KL (means of the last 50 steps)."""
    seed_everything(settings.seed, settings.threads)
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    tap = IndexerTap(model)
    model.train()
    recent: dict[str, list[float]] = {"lm": [], "kl": []}

    def loss_of(batch: torch.Tensor, step: int) -> torch.Tensor:
        tap.dense = step < indexer.dense_steps
        lm = model(input_ids=batch, labels=batch.masked_fill(batch == pad, -100)).loss
        queries = batch != pad
        kl = sum((tap.layer_kl(i, queries) for i in range(len(tap.attentions))), torch.zeros(()))
        recent["lm"] = [*recent["lm"], lm.item()][-50:]
        recent["kl"] = [*recent["kl"], kl.item()][-50:]
        return lm + kl

    try:
        run_steps(list(model.parameters()), rows, settings, torch.Generator().manual_seed(settings.seed), loss_of,
                  log, "step")
    finally:
        tap.remove()
        model.set_attn_implementation(implementation)
    model.eval()
    return {"final_train_loss": round(sum(recent["lm"]) / len(recent["lm"]), 4),
            "final_indexer_kl": round(sum(recent["kl"]) / len(recent["kl"]), 4)}


@torch.no_grad()
def top_k_attention_mass(model: HFModule, sequences: Sequence[Sequence[int]]) -> float:
    """How much of the dense main attention the indexer's top-k holds: the model run densely, the fraction of each
    query's attention (summed over heads, L1-normalised) on the keys its indexer chooses, averaged over layers and
    the queries with more than ``index_topk`` keys (below it every key is chosen). 1.0 would make sparse attention
    dense attention; a random choice of k of T keys holds about k / T."""
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    tap = IndexerTap(model)
    top_k = model.config.index_topk
    total, count = 0.0, 0
    try:
        for ids in sequences:
            tokens = torch.tensor([list(ids)])
            tap.dense = False
            model(input_ids=tokens)
            chosen = [c for c in tap.chosen if c is not None]
            tap.dense = True
            model(input_ids=tokens)
            for probs, keys in zip(tap.probs, chosen):
                assert probs is not None
                mass = probs[0].sum(dim=0)  # [S, T]
                mass = mass / mass.sum(dim=-1, keepdim=True)
                held = mass.gather(-1, keys[0].long()).sum(dim=-1)  # [S]
                total += float(held[top_k:].sum())
                count += max(0, len(ids) - top_k)
    finally:
        tap.remove()
        model.set_attn_implementation(implementation)
    return round(total / count, 4) if count else math.nan
