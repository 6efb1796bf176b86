"""Export: graph interface, exact parity through the KV cache on ORT and OpenVINO, run-time routing, determinism."""

from __future__ import annotations

import json
from collections import Counter
from contextlib import contextmanager

import numpy as np
import onnx
import pytest
from conftest import tiny_configs

from toolchain.export.architectures import architecture_for
from toolchain.export.decoder import build_decoder
from toolchain.export.graph import save_graph
from toolchain.export.reference import is_moe, watch_expert_choice
from toolchain.models.registry import EMBEDDED
from toolchain.reference.whole import TorchDecoder
from toolchain.source import load, resolve
from toolchain.stages.alone import export
from toolchain.verify.parity import Case, compare, parity_cases



def check_report(report: dict, backends=("onnxruntime", "openvino")) -> None:
    for backend in backends:
        result = report["parity"][backend]
        assert result["passed"], (backend, result["max_relative_diff"])
        assert result["tokens_identical"]
        assert result["max_relative_diff"] <= result["tolerance_relative_to_logits_range"]
        names = {c["name"] for c in result["cases"]}
        assert names == {"short", "long", "batch2-left-padded"}
        assert all(c["steps"] >= 16 for c in result["cases"])


# DeepSeek-V4's export with full parity takes about a minute (its reference runs a padded batch row by row, the
# graph re-pools every compressed window each step): slow; test_v4_hub_layout_exports_exactly is its fast check.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "deepseek_v4" else n
                                  for n in sorted(tiny_configs())])
def test_random_architecture_matches_pytorch_on_both_backends(tiny_checkpoints, tmp_path, name):
    report = export(str(tiny_checkpoints[name]), tmp_path / "out")
    check_report(report)
    on_disk = json.loads((tmp_path / "out" / "export.json").read_text())
    assert on_disk["parity"]["onnxruntime"]["max_abs_diff"] == report["parity"]["onnxruntime"]["max_abs_diff"]


@pytest.fixture(scope="module")
def v4_hub(tmp_path_factory):
    """A tiny DeepSeek-V4 in the hub layout as shipped (FP8 attention, FP4 experts, bf16 compressors, int64 hash
    table, one MTP block): sliding + hash MoE, CSA, HCA of 16 so that the long prompt crosses its blocks, 8 indexer
    heads (with 2, relu zeroes both heads' scores of some entries, and bit-equal scores at the k-th place leave the
    choice to how each runtime breaks ties)."""
    from conftest import TINY_V4
    from transformers import AutoConfig

    from toolchain.models.shape_faithful import write_random_checkpoint

    config = AutoConfig.for_model("deepseek_v4", **{
        **TINY_V4, "index_n_heads": 8, "compress_ratios": None,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}})
    return write_random_checkpoint(config, tmp_path_factory.mktemp("v4") / "hub", seed=3, mtp_layers=1)


def test_v4_hub_layout_exports_exactly(v4_hub, tmp_path):
    """The FP4 / FP8 hub layout through dstc's reader: the graph is exact against transformers on the dequantized
    weights (on ONNX Runtime: what is read does not depend on the backend, and OpenVINO runs V4's graph exactly in
    tests/export/test_deepseek_v4.py), the MTP block skipped and said so."""
    report = export(str(v4_hub), tmp_path / "out", parity=("onnxruntime",), new_tokens=4)
    result = report["parity"]["onnxruntime"]
    assert result["passed"] and result["tokens_identical"]
    assert result["max_relative_diff"] <= result["tolerance_relative_to_logits_range"]
    assert report["source"]["skipped_layers"] == [3]
    graph = onnx.load(tmp_path / "out" / "model.onnx").graph
    assert {i.name for i in graph.input} >= {"past_key_values.1.indexer_kv", "past_key_values.2.compressor_kv"}


def test_v4_above_the_end_to_end_budget_skips_parity_and_says_why(tiny_checkpoints, tmp_path, monkeypatch):
    """Layer-by-layer parity builds the shared decoder's layers: a V4 too large for the end-to-end check is exported
    without parity, export.json saying why, rather than failing."""
    from toolchain.verify import parity

    monkeypatch.setattr(parity, "FULL_PARITY_BYTES", 0)
    report = export(str(tiny_checkpoints["deepseek_v4"]), tmp_path / "out")
    assert report["parity"] == {}
    assert "not deepseek_v4's" in report["parity_skipped"]
    assert json.loads((tmp_path / "out" / "export.json").read_text())["parity_skipped"] == report["parity_skipped"]


@pytest.mark.parametrize("name", sorted(EMBEDDED))
def test_embedded_model_matches_pytorch_on_both_backends(tmp_path, name):
    report = export(name, tmp_path / "out")
    check_report(report)
    assert report["source"]["kind"] == "embedded"


def test_graph_interface_uses_optimum_names_and_dynamic_axes(tiny_checkpoints, tmp_path):
    export(str(tiny_checkpoints["deepseek_v3"]), tmp_path / "out", parity=())
    graph = onnx.load(tmp_path / "out" / "model.onnx").graph
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    outputs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in graph.output}
    assert inputs["input_ids"] == ["batch_size", "sequence_length"]
    assert inputs["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert inputs["position_ids"] == ["batch_size", "sequence_length"]
    # the latent cache (the default): key the rotary key (qk_rope_head_dim 8), value the latent (kv_lora_rank 32)
    assert inputs["past_key_values.2.key"] == ["batch_size", 1, "past_sequence_length", 8]
    assert inputs["past_key_values.2.value"] == ["batch_size", 1, "past_sequence_length", 32]
    assert outputs["logits"] == ["batch_size", "sequence_length", 97]
    assert outputs["present.0.key"] == ["batch_size", 1, "total_sequence_length", 8]
    assert outputs["present.0.value"] == ["batch_size", 1, "total_sequence_length", 32]
    assert len(inputs) == 3 + 2 * 3 and len(outputs) == 1 + 2 * 3


def test_export_is_byte_identical_when_repeated(tiny_checkpoints, tmp_path):
    for out in ("a", "b"):
        export(str(tiny_checkpoints["deepseek_v2"]), tmp_path / out, parity=())
    assert (tmp_path / "a" / "model.onnx").read_bytes() == (tmp_path / "b" / "model.onnx").read_bytes()


def test_loading_and_saving_a_graph_again_writes_the_same_bytes(tiny_checkpoints, tmp_path):
    """Each stage loads and saves the graph: weights' metadata (dstc.role, dstc.layer) is written once, however
    often (onnx-ir 1.1 alone doubles it per round, toolchain/export/graph.py load_graph)."""
    from toolchain.export.graph import load_graph

    export(str(tiny_checkpoints["deepseek_v3"]), tmp_path / "exp", parity=())
    first = tmp_path / "exp" / "model.onnx"
    save_graph(load_graph(first), tmp_path / "once.onnx")
    save_graph(load_graph(tmp_path / "once.onnx"), tmp_path / "twice.onnx")
    assert (tmp_path / "once.onnx").read_bytes() == (tmp_path / "twice.onnx").read_bytes()
    roles = [p for t in onnx.load(str(tmp_path / "twice.onnx")).graph.initializer for p in t.metadata_props
             if p.key == "dstc.role" and t.name == "layers.1/mlp/router/gate/weight"]
    assert len(roles) == 1


def test_moe_experts_run_sparse_per_expert(tiny_checkpoints):
    """Each routed expert is three MatMuls fed by a Gather of the tokens NonZero picked for it."""
    model = load(resolve(str(tiny_checkpoints["deepseek_v3"])))
    graph = build_decoder(model, architecture_for("deepseek_v3")).graph
    moe_layers = model.config.num_hidden_layers - model.config.first_k_dense_replace
    experts = model.config.n_routed_experts
    assert sum(n.op_type == "NonZero" for n in graph) == moe_layers * experts
    assert sum(n.op_type == "ScatterND" for n in graph) == moe_layers * experts
    expert_matmuls = [n for n in graph if n.op_type == "MatMul" and "/experts/" in n.name]
    assert len(expert_matmuls) == moe_layers * experts * 3
    # no weight is gathered per token: every expert MatMul reads a plain 2-D initializer
    assert all(n.inputs[1].is_initializer() and len(n.inputs[1].shape) == 2 for n in expert_matmuls)


@contextmanager
def recorded_routing(model):
    """Record, per MoE layer, the set of experts the PyTorch model routes tokens to."""
    used: dict[int, set[int]] = {}
    stops = [watch_expert_choice(layer.mlp, lambda idx, _i=i: used.setdefault(_i, set()).update(idx.flatten()))
             for i, layer in enumerate(model.model.layers) if is_moe(layer.mlp)]
    assert stops, "the model has no MoE layer to watch"
    try:
        yield used
    finally:
        for stop in stops:
            stop()


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_group_limited"])
def test_routing_is_decided_at_run_time(tiny_checkpoints, tmp_path, name):
    """Inputs that route to experts the export-time parity prompts never reached still match PyTorch."""
    source = resolve(str(tiny_checkpoints[name]))
    model = load(source)
    arch = architecture_for(model.config.model_type)
    save_graph(build_decoder(model, arch), tmp_path / "model.onnx")
    # The graph is built from weights, with no example inputs; a short prompt stands for the inputs an
    # exporter would have traced with, and reaches only a few experts.
    example = Case("example", [parity_cases(source.path, model.config.vocab_size)[0].prompts[0][:3]])
    with recorded_routing(model) as seen_at_export:
        first = compare(TorchDecoder.over(model), tmp_path / "model.onnx", "onnxruntime", [example], new_tokens=2,
                        pad_id=0)
    assert first["passed"]
    assert all(len(seen) < model.config.n_routed_experts for seen in seen_at_export.values())

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.config.vocab_size, 24).tolist() for _ in range(4)]
    with recorded_routing(model) as seen_now:
        result = compare(TorchDecoder.over(model), tmp_path / "model.onnx", "onnxruntime", [Case("unseen", prompts)],
                         new_tokens=4, pad_id=0)
    for layer, experts in seen_now.items():
        assert experts - seen_at_export[layer], f"layer {layer}: no expert outside the export-time set"
    assert result["passed"] and result["max_relative_diff"] < 1e-5


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen2"])
def test_the_architecture_module_s_facts_are_written_into_the_graph(tiny_checkpoints, tmp_path, name):
    """Passes, compression, compile and the runtime read these instead of tables keyed by model_type."""
    import json

    import onnx_ir as ir

    from toolchain.compress.engine import graph_weights

    export(str(tiny_checkpoints[name]), tmp_path / "out", parity=())
    model = ir.load(tmp_path / "out" / "model.onnx")
    props = model.metadata_props
    mla = name.startswith("deepseek")
    assert props["dstc.attention"] == ("mla" if mla else "gqa")
    assert json.loads(props["dstc.moe_layers"]) == ([1, 2] if mla else [])
    assert props.get("dstc.moe_lowering") == ("dispatch" if mla else None)  # only a graph with MoE layers has one
    assert props["dstc.genai_model_type"] == ("" if mla else "qwen2")
    layout = json.loads(props["dstc.head_layout"])
    assert layout["o_proj"] == ["in", 12 if mla else 16]
    weights = graph_weights(model, with_arrays=False)
    assert all(w.role is not None for w in weights)
    # a role per weight, as the architecture has them: 3 layers, MoE in 1 and 2 with 16 routed experts and a shared one
    roles = Counter(w.role for w in weights)
    moe = {"router": 2, "shared_expert": 2 * 3, "routed_expert": 2 * 16 * 3} if mla else {}
    assert {role: n for role, n in roles.items() if role != "attention"} == \
        {"embeddings": 1, "lm_head": 1, "mlp": 3 * (1 if mla else 3), **moe}
    assert {w.layer for w in weights if w.role == "attention"} == {0, 1, 2}
