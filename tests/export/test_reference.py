"""toolchain.export.reference: the PyTorch reference run one decoder layer at a time gives the logits of the
whole model loaded by transformers' from_pretrained, for every architecture (MoE layers, V2's group-limited
routing fix, tied embeddings) and for an FP8 hub-layout checkpoint with an MTP layer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from conftest import COMMON, make_checkpoint, tiny_configs, wide_v3_config
from toolchain.checkpoint.reader import open_checkpoint
from toolchain.export import reference
from toolchain.models.registry import EMBEDDED, embedded_path
from toolchain.models.shape_faithful import write_fp8_checkpoint

TOLERANCE = 1e-5


def prompt(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of two, the second left-padded."""
    ids = torch.randint(3, vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


def whole_model_logits(path, ids, mask) -> torch.Tensor:
    """transformers' own from_pretrained in fp32, eager, with the exporter's fix_reference: independent of the
    checkpoint reader that both the layer-by-layer reference and sources.load use."""
    from transformers import AutoModelForCausalLM

    from toolchain.export.architectures import architecture_for

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    architecture_for(model.config.model_type).fix_reference(model)
    with torch.no_grad():
        return model.eval()(input_ids=ids, attention_mask=mask).logits


def check_layer_by_layer(path) -> None:
    ids, mask = prompt(reference.reference_config(path).vocab_size)
    want = whole_model_logits(path, ids, mask)
    layers = []
    got = reference.logits(path, ids, mask, on_layer=lambda i, n: layers.append((i, n)))
    assert got.shape == want.shape
    assert (got - want).abs().max() <= TOLERANCE
    assert layers == [(i + 1, len(layers)) for i in range(len(layers))]


@pytest.mark.parametrize("name", sorted(EMBEDDED))
def test_embedded_models_layer_by_layer(name):
    check_layer_by_layer(embedded_path(name))


@pytest.mark.parametrize("name", sorted(tiny_configs()))
def test_tiny_configs_layer_by_layer(name, tiny_checkpoints):
    check_layer_by_layer(tiny_checkpoints[name])


def test_tied_embeddings_layer_by_layer(tmp_path):
    from transformers import LlamaConfig

    path = make_checkpoint(LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=True), tmp_path / "tied")
    assert open_checkpoint(path).tied
    check_layer_by_layer(path)


def test_fp8_checkpoint_layer_by_layer(tmp_path):
    """The FP8 hub layout with an MTP layer gives the logits of its weights dequantized to bf16 (as DeepSeek's own
    fp8_cast_bf16 writes them) and loaded whole."""
    source = make_checkpoint(wide_v3_config(), tmp_path / "source")
    fp8 = write_fp8_checkpoint(source, tmp_path / "fp8", shard_bytes=300_000, mtp_layers=1)
    dequantized = tmp_path / "dequantized"
    dequantized.mkdir()
    with open_checkpoint(fp8) as reader:
        save_file({name: reader.tensor(name, reader.natural_dtype(name)) for name in reader.names()},
                  dequantized / "model.safetensors",
                  metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (dequantized / "config.json").write_text(json.dumps(config))
    shutil.copyfile(fp8 / "generation_config.json", dequantized / "generation_config.json")
    ids, mask = prompt(config["vocab_size"])
    want = whole_model_logits(dequantized, ids, mask)
    assert (reference.logits(fp8, ids, mask) - want).abs().max() <= TOLERANCE
    assert (reference.logits(source, ids, mask) - want).abs().max() > TOLERANCE  # FP8 changed the weights


def test_a_decoder_layer_holds_only_its_own_weights(tiny_checkpoints):
    path = tiny_checkpoints["deepseek_v3"]
    config = reference.reference_config(path)
    with open_checkpoint(path) as reader:
        layer = reference.decoder_layer(config, reader, 1)
        tensors = list(layer.parameters()) + list(layer.buffers())
        assert not any(t.is_meta for t in tensors)
        stored = sum(torch.Size(reader.shape(n)).numel() for n in reader.names() if n.startswith("model.layers.1."))
        assert sum(t.numel() for t in tensors) == stored
        assert hasattr(layer.mlp, "experts")  # a MoE layer, experts fused by transformers from the per-expert names
