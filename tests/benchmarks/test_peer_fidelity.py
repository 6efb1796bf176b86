"""benchmarks/peer_fidelity.py's parts that need no peer environment: bits per weight counted from an OpenVINO IR
that NNCF compressed here, and from a GGUF's tensor list; the checkpoint rewritten for the peers' transformers 4.x.
Building and running the peers needs benchmarks/peer_env.sh's environment and is measured by hand (its __main__)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from benchmark_modules import load

from toolchain.models.registry import embedded_path


@pytest.fixture(scope="module")
def peers():
    return load("peer_fidelity", "peer_fidelity")


def tiny_ir(path: Path) -> Path:
    """Embedding [64, 128] -> up [256, 128] -> down [128, 256] -> lm_head [64, 128], compressed by NNCF the way
    optimum-cli's int4 default does (INT4_ASYM; embeddings and the last MatMul int8 per channel), group 64."""
    import nncf
    import openvino as ov
    from openvino import opset13 as ops

    rng = np.random.default_rng(0)

    def weight(rows: int, cols: int, name: str):
        return ops.constant(rng.standard_normal((rows, cols)).astype(np.float32), name=name)

    ids = ops.parameter([1, -1], np.int64, name="input_ids")
    hidden = ops.gather(weight(64, 128, "model.embed_tokens.weight"), ids, 0)
    hidden = ops.matmul(hidden, weight(256, 128, "model.layers.0.mlp.up_proj.weight"), False, True)
    hidden = ops.matmul(hidden, weight(128, 256, "model.layers.0.mlp.down_proj.weight"), False, True)
    logits = ops.matmul(hidden, weight(64, 128, "lm_head.weight"), False, True)
    logits.output(0).get_tensor().set_names({"logits"})
    model = nncf.compress_weights(ov.Model([logits], [ids]), mode=nncf.CompressWeightsMode.INT4_ASYM,
                                  group_size=64, ratio=1.0)
    ov.save_model(model, path / "openvino_model.xml", compress_to_fp16=False)
    return path / "openvino_model.xml"


def test_ir_bits_count_payload_scales_and_zero_points(peers, tmp_path) -> None:
    bits = peers.ir_bits(tiny_ir(tmp_path))
    assert bits["types"] == {"u4": 2, "u8": 2}
    # int4 in groups of 64 with an f16 scale and a u4 zero point per group
    assert bits["linear"] == pytest.approx(4 + (16 + 4) / 64)
    assert bits["linear_parameters"] == 2 * 256 * 128
    # embeddings and lm_head: u8 per row with an f16 scale and a u8 zero point per row of 128
    table = 8 + (16 + 8) / 128
    assert bits["parameters"] == 2 * 256 * 128 + 2 * 64 * 128
    assert bits["all"] == pytest.approx((2 * 32768 * (4 + 20 / 64) + 2 * 8192 * table) / (65536 + 16384))


def test_gguf_bits_count_blocks_and_leave_vectors_out(peers) -> None:
    tensors = [
        {"name": "token_embd.weight", "type": "Q8_0", "shape": [128, 640], "elements": 81920, "bytes": 87040},
        {"name": "output.weight", "type": "Q8_0", "shape": [128, 640], "elements": 81920, "bytes": 87040},
        {"name": "blk.0.attn_norm.weight", "type": "F32", "shape": [128], "elements": 128, "bytes": 512},
        {"name": "blk.0.ffn_down.weight", "type": "Q4_K", "shape": [256, 128], "elements": 32768, "bytes": 18432},
        {"name": "blk.0.attn_q.weight", "type": "Q5_0", "shape": [128, 128], "elements": 16384, "bytes": 11264},
        # stacked experts: one weight matrix of three dimensions
        {"name": "blk.1.ffn_up_exps.weight", "type": "Q5_0", "shape": [128, 64, 16], "elements": 131072,
         "bytes": 90112},
    ]
    bits = peers.gguf_bits(tensors)
    assert bits["types"] == {"Q8_0": 2, "Q4_K": 1, "Q5_0": 2}
    assert bits["linear_parameters"] == 32768 + 16384 + 131072
    assert bits["linear"] == pytest.approx((32768 * 4.5 + (16384 + 131072) * 5.5) / 180224)
    assert bits["all"] == pytest.approx((32768 * 4.5 + 147456 * 5.5 + 163840 * 8.5) / 344064)


@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "r1-distill-llama-tiny", "r1-distill-qwen-tiny"])
def test_peer_checkpoint_keeps_rope_for_transformers_4(peers, tmp_path, name) -> None:
    source = embedded_path(name)
    out = peers.peer_checkpoint(source, tmp_path / name)
    original = json.loads((source / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    rope = original["rope_parameters"]
    assert config["rope_theta"] == rope["rope_theta"]
    if rope["rope_type"] == "default":
        assert "rope_scaling" not in config
    else:
        assert config["rope_scaling"]["type"] == config["rope_scaling"]["rope_type"] == rope["rope_type"]
        assert config["rope_scaling"]["factor"] == rope["factor"]
    assert config["rope_parameters"] == rope  # llama.cpp's converter reads this one first
    tokenizer = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "<think>" in tokenizer["additional_special_tokens"]
    assert (out / "model.safetensors").resolve() == (source / "model.safetensors").resolve()


def test_a_refusal_is_the_peers_cause_not_its_wrapper(peers) -> None:
    quantize = ("main: quantizing 'model-f32.gguf' to 'model-q4_k_m.gguf' as Q4_K_M\n"
                "llama_model_quantize: failed to quantize: key not found in model: deepseek2.attention.q_lora_rank\n"
                "llama_quantize: failed to quantize model from 'model-f32.gguf'\n")
    assert peers._error_line(quantize) == ("llama_model_quantize: failed to quantize: key not found in model: "
                                           "deepseek2.attention.q_lora_rank")
    traceback = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                 "ValueError: The current version of Transformers does not allow for the export of the model. "
                 "Maximum required is 4.53.3, got: 4.57.6\n")
    assert peers._error_line(traceback).startswith("ValueError: The current version of Transformers")
