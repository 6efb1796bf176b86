"""Checkpoint variants the embedded models do not cover (project issue #10): MLA whose key and value head sizes
are equal, and tied embeddings."""

from __future__ import annotations

import json

import onnx
import onnx_ir as ir
import pytest
from conftest import COMMON, MLA, make_checkpoint
from onnx import numpy_helper
from transformers import DeepseekV2Config, DeepseekV3Config, Qwen2Config

from toolchain.recipe import CompressSection
from toolchain.stages.alone import compile_artifact, compress, export, optimize

VOCAB, HIDDEN = COMMON["vocab_size"], COMMON["hidden_size"]


@pytest.mark.parametrize("config", [
    # 8 + 8 == 16: a head size ORT's GroupQueryAttention takes, so only its MLA check keeps it away
    DeepseekV2Config(**COMMON, **{**MLA, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16},
                     q_lora_rank=None, n_routed_experts=8, topk_method="greedy", n_group=1, topk_group=1),
    # 4 + 8 == 12: not a GQA head size; fuse-mla-attention took it before, but counted it as "mha"
    DeepseekV3Config(**COMMON, **{**MLA, "qk_nope_head_dim": 4, "qk_rope_head_dim": 8, "v_head_dim": 12},
                     q_lora_rank=24, n_routed_experts=8, n_group=2, topk_group=1, rope_interleave=True),
], ids=["v2-16", "v3-12"])
def test_mla_with_equal_key_and_value_head_sizes_optimizes_for_onnxruntime(tmp_path, config):
    # fuse-mla-attention takes the per-head cache only (the latent one has no attention op to become)
    export(str(make_checkpoint(config, tmp_path / "ckpt")), tmp_path / "export", parity=(), mla_cache="per-head")
    report = optimize(tmp_path / "export", tmp_path / "out", "onnxruntime", new_tokens=8)
    layers = config.num_hidden_layers
    assert report["counts"]["fuse-mla-attention"] == {"mla": layers}
    assert "fuse-group-query-attention" not in report["counts"]
    assert report["output"]["op_types"]["Attention"] == layers
    assert "com.microsoft.GroupQueryAttention" not in report["output"]["op_types"]
    parity = report["parity"]["onnxruntime"]
    assert parity["passed"] and parity["tokens_identical"]
    assert parity["max_relative_diff"] <= 1e-4


@pytest.fixture(scope="module")
def tied_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    config = Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True)
    report = export(str(make_checkpoint(config, root / "ckpt")), root / "export")  # parity on both backends
    return root / "export", report


def weight_bytes(path) -> dict[str, int]:
    """Bytes of each float initializer (the int64 shape constants aside)."""
    return {t.name: numpy_helper.to_array(t).nbytes for t in onnx.load(path).graph.initializer
            if t.data_type == onnx.TensorProto.FLOAT}


def test_tied_embeddings_are_stored_once_and_match_pytorch(tied_export, tiny_checkpoints, tmp_path):
    export_dir, report = tied_export
    for backend in ("onnxruntime", "openvino"):
        parity = report["parity"][backend]
        assert parity["passed"] and parity["tokens_identical"], (backend, parity["max_relative_diff"])
    tied = weight_bytes(export_dir / "model.onnx")
    graph = onnx.load(export_dir / "model.onnx").graph
    tables = [t.name for t in graph.initializer if sorted(t.dims) == sorted([VOCAB, HIDDEN])]
    assert tables == ["embed_tokens.weight"]
    readers = [n for n in graph.node if "embed_tokens.weight" in n.input]
    assert sorted(n.op_type for n in readers) == ["Gather", "Gemm"]
    gemm = next(n for n in readers if n.op_type == "Gemm")
    assert list(gemm.input).index("embed_tokens.weight") == 1
    assert {a.name: onnx.helper.get_attribute_value(a) for a in gemm.attribute} == {"transB": 1}
    # the same architecture untied (qwen2 of conftest) stores one more table, [hidden, vocab]
    export(str(tiny_checkpoints["qwen2"]), tmp_path / "untied", parity=())
    untied = weight_bytes(tmp_path / "untied" / "model.onnx")
    assert sum(untied.values()) - sum(tied.values()) == VOCAB * HIDDEN * 4
    assert untied["lm_head/weight"] == VOCAB * HIDDEN * 4 and "lm_head/weight" not in tied


def one_table(readers: set[str], found: list[tuple[str, str, set[str]]]) -> None:
    """Exactly one tensor of the table's size, 8-bit, read (through its dequantization) by both uses."""
    assert len(found) == 1, found
    _, dtype, users = found[0]
    assert dtype == "uint8" and users == readers, found


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_tied_table_is_compressed_once_for_both_uses(tied_export, tmp_path, backend):
    export_dir, _ = tied_export
    optimize(export_dir, tmp_path / "passes", backend, new_tokens=4)
    report = compress(tmp_path / "passes", tmp_path / "int4", CompressSection(scheme="int4-grouped"), target=backend)
    table = next(w for w in report["per_weight"] if w["weight"] == "embed_tokens.weight")
    assert table["planned"] == "int8" and table["precision"].startswith("int8-asym")  # the embeddings policy
    assert table["weight_error"] < 0.01
    if backend == "onnxruntime":
        model = ir.load(tmp_path / "int4" / "model.onnx")
        found = [(v.name, v.dtype.name.lower(), {n.op_type for n, _ in v.uses()})
                 for v in model.graph.initializers.values() if v.const_value.size == VOCAB * HIDDEN]
        one_table({"Gather", "MatMulNBits"}, found)
        assert "DequantizeLinear" not in {n.op_type for n in model.graph}  # no step dequantizes the whole table
    else:
        import openvino as ov

        model = ov.Core().read_model(str(tmp_path / "int4" / "openvino_model.xml"))
        found = []
        for op in model.get_ops():
            if op.get_type_name() == "Constant" and sorted(op.get_output_shape(0)) == sorted([VOCAB, HIDDEN]):
                users, frontier = set(), [op]
                while frontier:  # through the decompression (Convert, Subtract, Multiply) to the readers
                    for target in frontier.pop().output(0).get_target_inputs():
                        node = target.get_node()
                        if node.get_type_name() in ("Gather", "MatMul"):
                            users.add(node.get_type_name())
                        else:
                            frontier.append(node)
                found.append((op.get_friendly_name(), str(op.get_element_type().to_dtype()), users))
        one_table({"Gather", "MatMul"}, found)
    compiled = compile_artifact(tmp_path / "int4", tmp_path / "artifact", backend)
    verification = compiled["verification"]
    assert verification["passed"] and verification["tokens_identical"]
    assert json.loads((tmp_path / "artifact" / "compile.json").read_text())["verification"]["passed"]
