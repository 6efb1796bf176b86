"""MoE lowerings (toolchain/export/moe.py): parity of the fused forms with PyTorch on both backends, a graph that
does not grow with the number of experts, the router's choice found in each form, and their compression."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from conftest import run_cli, tiny_configs
from test_export import check_report

from toolchain.export.reference import is_moe, watch_expert_choice
from toolchain.compress import moe as fused_moe
from toolchain.compress.streaming import blocked_dq_to_nbits
from toolchain.errors import InputError
from toolchain.export import moe
from toolchain.export.architectures import architecture_for
from toolchain.export.decoder import build_decoder
from toolchain.recipe import CompressSection
from toolchain.runtime.engines import GraphRunner, openvino_compile
from toolchain.runtime.routing import router_values
from toolchain.source import load, resolve
from toolchain.stages.alone import compress, export, optimize

# greedy and group-limited V2 routing; V3 with norm_topk_prob true (deepseek_v3) and false (plain_rope); Qwen3-MoE
# without shared experts, norm_topk_prob true (with a dense layer between) and false (every second layer MoE)
ROUTINGS = ("deepseek_v2", "deepseek_v2_group_limited", "deepseek_v3", "deepseek_v3_plain_rope", "qwen3_moe",
            "qwen3_moe_sparse_step")
FUSED = ("fused-onnxruntime", "fused-openvino")


def runtime_types(compiled) -> dict[str, int]:
    """Layer types of an OpenVINO compiled model's execution graph."""
    counts: dict[str, int] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        kind = op.get_rt_info()["layerType"].astype(str)
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def moe_layer_count(name: str) -> int:
    config = tiny_configs()[name]
    return len(architecture_for(config.model_type).moe_layers(config))


@pytest.fixture(scope="module")
def fused_exports(tiny_checkpoints, tmp_path_factory):
    """Each routing's export in each fused lowering, parity checked on every backend that runs it (cached)."""
    root = tmp_path_factory.mktemp("fused")
    done = {}

    def get(name: str, lowering: str):
        if (name, lowering) not in done:
            out = root / f"{name}-{lowering}"
            done[name, lowering] = out, export(str(tiny_checkpoints[name]), out, moe=lowering)
        return done[name, lowering]

    return get


@pytest.mark.parametrize("lowering", FUSED)
@pytest.mark.parametrize("name", ROUTINGS)
def test_fused_lowering_matches_pytorch(fused_exports, name, lowering):
    """Prefill + 16 greedy steps, a left-padded batch of two: ORT within 1e-4 of the logits' range, OpenVINO within
    1e-3, identical tokens; com.microsoft.MoE runs on ORT only, the tiled block on both."""
    out, report = fused_exports(name, lowering)
    backends = ("onnxruntime",) if lowering == "fused-onnxruntime" else ("onnxruntime", "openvino")
    assert sorted(report["parity"]) == sorted(backends)
    check_report(report, backends)
    graph = onnx.load(out / "model.onnx").graph
    ops = [n.op_type for n in graph.node]
    assert "NonZero" not in ops and "ScatterND" not in ops
    layers = moe_layer_count(name)
    if lowering == "fused-onnxruntime":
        assert ops.count("MoE") == layers
        onnx.checker.check_model(onnx.load(out / "model.onnx"), full_check=True)  # the contrib domain is imported
    else:
        assert ops.count("FusedMatMul") == 3 * layers
        # OpenVINO's CPU plugin runs the chosen experts only: the block became its GatherMatmul
        assert runtime_types(openvino_compile(out / "model.onnx")).get("GatherMatmul") == 3 * layers


def test_fused_lowering_runs_the_default_parity_backends_it_can(tiny_checkpoints, tmp_path):
    with pytest.raises(InputError, match="runs on onnxruntime only"):
        export(str(tiny_checkpoints["deepseek_v3"]), tmp_path / "out", parity=("onnxruntime", "openvino"),
               moe="fused-onnxruntime")
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match="moe: Input should be 'auto', 'dispatch'"):
        export(str(tiny_checkpoints["deepseek_v3"]), tmp_path / "out", moe="fused")
    dense = export(str(tiny_checkpoints["llama"]), tmp_path / "dense", new_tokens=2, moe="fused-onnxruntime")
    # no MoE layer: nothing lowered, but the planned section's parity follows the lowering it names (before the
    # build plan, a dense model's export checked both backends here)
    assert sorted(dense["parity"]) == ["onnxruntime"]
    dense = export(str(tiny_checkpoints["llama"]), tmp_path / "dense2", new_tokens=2)
    assert sorted(dense["parity"]) == ["onnxruntime", "openvino"]


@pytest.mark.parametrize("lowering", FUSED)
def test_fused_graph_does_not_grow_with_experts(lowering):
    """The same active work with 4x the experts: the fused graph keeps its node count (dispatch adds 19 per expert
    and layer) and only its stacked weights grow."""
    counts, weights = {}, {}
    for experts in (8, 32):
        config = tiny_configs()["deepseek_v3_plain_rope"]
        config.n_routed_experts = experts
        torch.manual_seed(0)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
        arch = architecture_for("deepseek_v3")
        counts[experts] = {lw: len(build_decoder(model, moe.with_lowering(arch, lw)).graph)
                           for lw in ("dispatch", lowering)}
        graph = build_decoder(model, moe.with_lowering(arch, lowering)).graph
        weights[experts] = sorted(tuple(v.shape) for v in graph.initializers.values() if "/experts/" in v.name)
    assert counts[8][lowering] == counts[32][lowering]
    assert counts[32]["dispatch"] - counts[8]["dispatch"] == 19 * 24 * moe_layer_count("deepseek_v3_plain_rope")
    assert [s[0] for s in weights[32]] == [32] * len(weights[32]) and [s[1:] for s in weights[8]] == \
        [s[1:] for s in weights[32]]


def pytorch_choices(model, ids: np.ndarray) -> dict[int, np.ndarray]:
    """Per MoE layer, the experts transformers' router picks for each token of a prefill of ``ids``."""
    chosen: dict[int, np.ndarray] = {}
    stops = [watch_expert_choice(layer.mlp, lambda idx, _i=i: chosen.__setitem__(_i, idx))
             for i, layer in enumerate(model.model.layers) if is_moe(layer.mlp)]
    try:
        with torch.no_grad():
            model(input_ids=torch.from_numpy(ids))
    finally:
        for stop in stops:
            stop()
    assert chosen, "no MoE layer routed"
    return chosen


@pytest.mark.parametrize("lowering", FUSED)
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_group_limited", "qwen3_moe"])
def test_router_choice_is_found_and_agrees_with_pytorch(fused_exports, tiny_checkpoints, tmp_path, name, lowering):
    """routing.py finds each MoE layer's TopK indices by structure in the ONNX graph and in OpenVINO's IR (what the
    eval's routing agreement reads); they are the experts PyTorch chose."""
    import openvino as ov

    out, _ = fused_exports(name, lowering)
    names = router_values(out / "model.onnx", lowering)
    assert len(names) == moe_layer_count(name)
    if lowering == "fused-openvino":
        ov.save_model(ov.convert_model(str(out / "model.onnx")), tmp_path / "model.xml")
        assert router_values(tmp_path / "model.xml", lowering) == names
    model = load(resolve(str(tiny_checkpoints[name])))
    ids = np.random.default_rng(3).integers(0, model.config.vocab_size, (1, 24))
    expected = pytorch_choices(model, ids)
    arch = architecture_for(model.config.model_type)
    heads, key_dim, value_dim = arch.cache_dims(model.config)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(24)[None]}
    for i in range(model.config.num_hidden_layers):
        feeds[f"past_key_values.{i}.key"] = np.zeros((1, heads, 0, key_dim), np.float32)
        feeds[f"past_key_values.{i}.value"] = np.zeros((1, heads, 0, value_dim), np.float32)
    got = GraphRunner(out / "model.onnx", "onnxruntime", extra_outputs=names)(feeds)
    for layer, value in zip(sorted(expected), names):
        np.testing.assert_array_equal(np.sort(got[value], -1), np.sort(expected[layer], -1))
    assert len({tuple(row) for layer in expected for row in np.sort(expected[layer], -1)}) > 4  # not one choice


@pytest.fixture(scope="module")
def compressed(fused_exports, tiny_checkpoints, tmp_path_factory):
    """INT4 compressions (g128 -> 64 on these widths) of the dispatch and the fused export of deepseek_v3, per
    target and accuracy level (0: fp32 activations on ORT), cached."""
    root = tmp_path_factory.mktemp("compressed")
    done = {}

    def get(lowering: str, target: str, **options):
        key = (lowering, target, tuple(sorted(options.items())))
        if key not in done:
            source = (root / "dispatch" if lowering == "dispatch" else fused_exports("deepseek_v3", lowering)[0])
            if lowering == "dispatch" and not (source / "export.json").is_file():
                export(str(tiny_checkpoints["deepseek_v3"]), source, parity=())
            out = root / f"{lowering}-{target}-{len(done)}"
            # the plain forms compared (prefill-int8, on by default on VNNI / AMX CPUs, is tested on its own)
            section = CompressSection(scheme="int4-grouped", **{"prefill_int8": False, **options})
            done[key] = out, compress(source, out, section, target=target)
        return done[key]

    return get


def expert_rows(summary: dict) -> dict[str, dict]:
    return {r["weight"]: r for r in summary["per_weight"] if r["role"] == "routed_expert"}


@pytest.mark.parametrize("target", ["onnxruntime", "openvino"])
def test_fused_experts_compress_as_nncf_compresses_each_expert(compressed, target):
    """The fused form's experts get NNCF's per-weight INT4 (the dispatch form's MatMuls get it from NNCF's
    whole-model call): the same precision, weight and output errors per expert, routing agreement and next-token
    agreement; ORT runs QMoE at the requested accuracy level, OpenVINO a compressed GatherMatmul."""
    lowering = f"fused-{target}"
    _, reference = compressed("dispatch", target)
    out, summary = compressed(lowering, target)
    ref_rows, rows = expert_rows(reference), expert_rows(summary)
    assert sorted(rows) == sorted(ref_rows) and len(rows) == 16 * 3 * 2
    # NNCF's OpenVINO backend keeps its scales in f16, the fused form (as the streamed one) in f32
    rel = 1e-9 if target == "onnxruntime" else 1e-3
    for name, row in rows.items():
        assert row["precision"] == ref_rows[name]["precision"] == "int4-asym-g64"
        assert row["weight_error"] == pytest.approx(ref_rows[name]["weight_error"], rel=rel)
        # an expert no calibration token reached: the dispatch form measures its output on its layer's other
        # experts' inputs (borrowed_inputs), the fused form does not measure it
        borrowed = ref_rows[name]["borrowed_inputs"]
        assert (row["output_error"] is None) == (borrowed or ref_rows[name]["output_error"] is None)
        if row["output_error"] is not None:
            assert row["output_error"] == pytest.approx(ref_rows[name]["output_error"], rel=max(rel, 1e-6))
    assert 0.02 < max(r["weight_error"] for r in rows.values()) < 0.2
    assert [r["layer"] for r in summary["routing"]] == [1, 2]
    for got, ref in zip(summary["routing"], reference["routing"]):
        assert got["tokens"] == ref["tokens"] and got["agreement"] == pytest.approx(ref["agreement"], abs=0.02)
    assert summary["model"]["top1_agreement"] == pytest.approx(reference["model"]["top1_agreement"], abs=0.01)
    assert summary["model"]["kl_mean"] == pytest.approx(reference["model"]["kl_mean"], rel=0.05)
    if target == "onnxruntime":
        kernels = summary["details"]["onnxruntime_kernels"]
        assert kernels.get("QMoE") == 2 and "MoE" not in kernels
        qmoe = [n for n in onnx.load(out / "model.onnx").graph.node if n.op_type == "QMoE"]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in qmoe[0].attribute}
        assert attrs["expert_weight_bits"] == 4 and attrs["block_size"] == 64 and attrs["accuracy_level"] == 4
    else:
        compiled = openvino_compile(out / "openvino_model.xml")
        gathers = [op for op in compiled.get_runtime_model().get_ordered_ops()
                   if op.get_rt_info()["layerType"].astype(str) == "GatherMatmul"]
        assert len(gathers) == 6
        assert all(op.input(1).get_element_type().get_type_name() == "u4" for op in gathers)


def test_qmoe_computes_with_the_quantized_weights_matmulnbits_gets(compressed):
    """At accuracy level 0 (fp32 activations) QMoE and MatMulNBits compute with their dequantized weights: the
    same quantization packed for each kernel gives the same logits."""
    dispatch, _ = compressed("dispatch", "onnxruntime", accuracy_level=0)
    fused, _ = compressed("fused-onnxruntime", "onnxruntime", accuracy_level=0)
    config = tiny_configs()["deepseek_v3"]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, (2, 11))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.tile(np.arange(11), (2, 1))}
    for i in range(config.num_hidden_layers):  # an empty latent cache (the default): rotary key and latent
        feeds[f"past_key_values.{i}.key"] = np.zeros((2, 1, 0, config.qk_rope_head_dim), np.float32)
        feeds[f"past_key_values.{i}.value"] = np.zeros((2, 1, 0, config.kv_lora_rank), np.float32)
    a = GraphRunner(dispatch / "model.onnx", "onnxruntime")(feeds)["logits"]
    b = GraphRunner(fused / "model.onnx", "onnxruntime")(feeds)["logits"]
    assert np.abs(a - b).max() < 1e-4 * (a.max() - a.min())


@pytest.mark.parametrize("target", ["onnxruntime", "openvino"])
def test_streamed_compression_of_fused_experts(compressed, fused_exports, tmp_path, target):
    """One weight at a time (bounded memory): the same expert errors as the whole-model path, no activations."""
    _, whole = compressed(f"fused-{target}", target)
    out = tmp_path / "streamed"
    summary = compress(fused_exports("deepseek_v3", f"fused-{target}")[0], out,
                       CompressSection(scheme="int4-grouped", streaming="always", prefill_int8=False), target=target)
    rows, whole_rows = expert_rows(summary), expert_rows(whole)
    assert sorted(rows) == sorted(whole_rows)
    assert all(rows[n]["weight_error"] == pytest.approx(whole_rows[n]["weight_error"], rel=1e-9) for n in rows)
    assert all(r["output_error"] is None for r in rows.values())
    graph = onnx.load(out / "model.onnx").graph
    kinds = {n.op_type for n in graph.node}
    assert ("QMoE" in kinds and "MoE" not in kinds) if target == "onnxruntime" else \
        sum(n.op_type == "DequantizeLinear" and "/experts/" in n.name for n in graph.node) == 6


@pytest.mark.parametrize("target", ["onnxruntime", "openvino"])
def test_fused_experts_written_are_each_experts_own_with_nncfs_optimized_functions(compressed, fused_exports,
                                                                                  tmp_path, target, monkeypatch):
    """With NNCF's OpenVINO-optimized functions on at these widths (above 10,000 elements, as every real expert
    is; they reuse the buffers of what they returned, toolchain/compress/lowering.py): the same compressed model
    as NNCF's reference functions give, expert by expert, on both the whole-model and the streamed path."""
    from nncf.quantization.algorithms.weight_compression import weight_lowering

    _, reference = compressed(f"fused-{target}", target)
    source = fused_exports("deepseek_v3", f"fused-{target}")[0]
    compress(source, tmp_path / "reference", CompressSection(scheme="int4-grouped", streaming="always"), target=target)
    monkeypatch.setattr(weight_lowering, "MIN_INPUT_SIZE_FOR_OPTIMIZED_COMPRESSION", 0)
    optimized = compress(source, tmp_path / "whole", CompressSection(scheme="int4-grouped"), target=target)
    compress(source, tmp_path / "streamed", CompressSection(scheme="int4-grouped", streaming="always"), target=target)
    ref_rows, rows = expert_rows(reference), expert_rows(optimized)
    assert all(rows[n]["weight_error"] == pytest.approx(ref_rows[n]["weight_error"], rel=1e-5) for n in rows)
    assert optimized["model"]["kl_mean"] == pytest.approx(reference["model"]["kl_mean"], rel=0.05)

    def expert_tensors(path):
        return {name: v.const_value.numpy() for name, v in ir.load(path / "model.onnx").graph.initializers.items()
                if "/experts/" in name and v.const_value is not None}

    expected, got = expert_tensors(tmp_path / "reference"), expert_tensors(tmp_path / "streamed")
    assert len(expected) >= 6 and got.keys() == expected.keys()
    for name, array in expected.items():
        assert np.allclose(got[name].astype(np.float64), array.astype(np.float64), rtol=1e-6, atol=0), name


@pytest.mark.parametrize("target", ["onnxruntime", "openvino"])
def test_awq_and_scale_estimation_lower_the_fused_experts_output_error(compressed, target):
    """Each expert the calibration tokens reach is quantized with AWQ's scale (NNCF's data-aware step on its
    up_proj -> down_proj) and scale estimation's scales (from its inputs' statistics) instead of NNCF's data-free
    ones: on the tiny V3 their matrices' mean calibration output error falls from 0.090 to 0.072. An expert no
    token reached keeps the data-free quantization, and details.fused_experts counts both."""
    _, free = compressed(f"fused-{target}", target)
    _, aware = compressed(f"fused-{target}", target, awq=True, scale_estimation=True)
    free_rows, rows = expert_rows(free), expert_rows(aware)
    reached = {n for n, r in rows.items() if r["output_error"] is not None}
    experts = {n.rsplit("/", 2)[0] for n in reached}
    assert 0 < len(experts) < 32 and len(reached) == 3 * len(experts)
    assert aware["details"]["fused_experts"] == \
        {"awq": 2 * len(experts), "scale_estimation": 3 * len(experts), "data_free": 3 * (32 - len(experts))}
    assert all(rows[n]["weight_error"] == free_rows[n]["weight_error"] for n in rows.keys() - reached)
    changed = [n for n in reached if rows[n]["weight_error"] != free_rows[n]["weight_error"]]
    assert len(changed) == len(reached)
    before = np.mean([free_rows[n]["output_error"] for n in reached])
    after = np.mean([rows[n]["output_error"] for n in reached])
    assert after < 0.85 * before, (before, after)


def test_whole_model_awq_on_dispatched_experts_gives_unreached_ones_data_free_scales(compressed):
    """NNCF's whole-model AWQ fails on a routed expert no calibration token reaches (an empty activation: an
    IndexError in its statistics); those weights get a data-free INT4 call of their own after the data-aware one,
    named in details.data_free_unreached: the same weights as the data-free build's, while every reached expert's
    differ."""
    _, free = compressed("dispatch", "onnxruntime")
    _, aware = compressed("dispatch", "onnxruntime", awq=True, scale_estimation=True)
    free_rows, rows = expert_rows(free), expert_rows(aware)
    unreached = set(aware["details"]["data_free_unreached"])
    assert unreached and len(unreached) % 3 == 0 and unreached < set(rows)
    assert all(rows[n]["weight_error"] == free_rows[n]["weight_error"] for n in unreached)
    assert all(rows[n]["weight_error"] != free_rows[n]["weight_error"] for n in set(rows) - unreached)


def test_fused_data_aware_quantization_is_the_dispatch_forms(compressed, fused_exports, tiny_checkpoints,
                                                            tmp_path):
    """Streamed, where both forms take their statistics from the checkpoint's layers
    (toolchain/compress/layer_statistics.py): AWQ and scale estimation give every fused expert exactly the values,
    scales and zero points of the dispatch form's MatMulNBits (the same NNCF algorithms on the same matrices and
    rows), which are not the data-free ones where calibration tokens reached the expert."""
    export(str(tiny_checkpoints["deepseek_v3"]), tmp_path / "dispatch", parity=())
    source = fused_exports("deepseek_v3", "fused-onnxruntime")[0]
    options = dict(scheme="int4-grouped", streaming="always", prefill_int8=False)
    aware = dict(awq=True, scale_estimation=True)
    compress(tmp_path / "dispatch", tmp_path / "d", CompressSection(**options, **aware), target="onnxruntime")
    summary = compress(source, tmp_path / "f", CompressSection(**options, **aware), target="onnxruntime")
    compress(source, tmp_path / "free", CompressSection(**options), target="onnxruntime")
    _, whole = compressed("fused-onnxruntime", "onnxruntime", awq=True, scale_estimation=True)
    assert summary["details"]["fused_experts"] == whole["details"]["fused_experts"]

    def initializers(path):
        return {n: v.const_value.numpy() for n, v in ir.load(path / "model.onnx").graph.initializers.items()
                if v.const_value is not None}

    dispatch, fused, free = (initializers(tmp_path / d) for d in ("d", "f", "free"))
    differ = 0
    for layer in (1, 2):
        for key in ("quantized", "scale", "zero_point"):
            fc1, fc2 = (fused[f"layers.{layer}/mlp/experts/{w}_{key}"] for w in ("gate_up_proj", "down_proj"))
            free_fc2 = free[f"layers.{layer}/mlp/experts/down_proj_{key}"]
            for e in range(16):
                for projection, got in (("gate_proj", fc1[e][0::2]), ("up_proj", fc1[e][1::2]),
                                        ("down_proj", fc2[e])):
                    expected = dispatch[f"layers.{layer}/mlp/experts/{e}/{projection}/weight_{key}"]
                    assert np.array_equal(got.reshape(-1), expected.reshape(-1)), (layer, e, projection, key)
                differ += key == "scale" and not np.array_equal(fc2[e], free_fc2[e])
    assert differ == summary["details"]["fused_experts"]["awq"] // 2


def test_gptq_and_ratio_below_one_are_refused_for_fused_experts(fused_exports, tmp_path, monkeypatch, capsys):
    ort_export, ov_export = (fused_exports("deepseek_v3", lw)[0] for lw in FUSED)
    for args in ([ort_export, "--ratio", "0.5"], [ov_export, "--backend", "openvino", "--gptq"]):
        out = tmp_path / str(len(args))
        code, _, err = run_cli(monkeypatch, capsys, "compress", *args, "-o", out)
        assert code == 2 and "gptq and ratio < 1 are not available for fused MoE experts" in err
        assert not out.exists()


def test_int8_fused_experts_and_what_is_refused(fused_exports, tmp_path):
    ort_export, ov_export = (fused_exports("deepseek_v3", lw)[0] for lw in FUSED)
    summary = compress(ort_export, tmp_path / "int8", CompressSection(scheme="int8-per-channel"), target="onnxruntime")
    assert {r["precision"] for r in expert_rows(summary).values()} == {"int8-asym-per-channel"}
    assert summary["details"]["onnxruntime_kernels"].get("QMoE") == 2
    assert max(r["weight_error"] for r in expert_rows(summary).values()) < 0.01
    with pytest.raises(InputError, match="lowered for onnxruntime"):
        compress(ort_export, tmp_path / "a", CompressSection(scheme="int4-grouped"), target="openvino")
    with pytest.raises(InputError, match="lowered for openvino"):
        compress(ov_export, tmp_path / "b", CompressSection(scheme="int4-grouped"), target="onnxruntime")
    with pytest.raises(InputError, match="not available for fused MoE experts"):
        compress(ort_export, tmp_path / "c", CompressSection(scheme="int4-grouped", ratio=0.5), target="onnxruntime")
    with pytest.raises(InputError, match="share one precision"):  # one expert kept fp32 in a QMoE layer
        compress(ort_export, tmp_path / "d",
                 CompressSection(scheme="int4-grouped", ignore=[r"layers\.1/mlp/experts/3/"]), target="onnxruntime")
    # a whole layer's experts kept fp32: that layer stays MoE
    kept = compress(ort_export, tmp_path / "e",
                    CompressSection(scheme="int4-grouped", ignore=[r"layers\.1/mlp/experts/"]), target="onnxruntime")
    precisions = {(r["layer"], r["precision"]) for r in expert_rows(kept).values()}
    assert precisions == {(1, "fp32"), (2, "int4-asym-g64")}
    assert {k: kept["details"]["onnxruntime_kernels"].get(k) for k in ("MoE", "QMoE")} == {"MoE": 1, "QMoE": 1}
    with pytest.raises(InputError, match="cannot stay fp32"):  # NNCF's OpenVINO call would compress them unasked
        compress(ov_export, tmp_path / "f",
                 CompressSection(scheme="int4-grouped", ignore=[r"layers\.1/mlp/experts/"]), target="openvino")


def test_int4_after_the_onnxruntime_passes_stage_is_matmulnbits(tiny_checkpoints, tmp_path):
    """fuse-mla-attention raises the opset to 23, where NNCF writes INT4 as blocked DequantizeLinear -> MatMul
    (ORT runs that as dequantize + fp32 MatMul unless its session fuses it); the compress stage writes
    MatMulNBits with the accuracy level instead, so the artifact states the kernel."""
    # per-head: fuse-mla-attention, which raises the opset, does not take the latent cache
    export(str(tiny_checkpoints["deepseek_v3"]), tmp_path / "exp", parity=(), mla_cache="per-head")
    optimize(tmp_path / "exp", tmp_path / "opt", "onnxruntime", parity=False)
    assert onnx.load(tmp_path / "opt" / "model.onnx", load_external_data=False).opset_import[0].version >= 21
    summary = compress(tmp_path / "opt", tmp_path / "c", CompressSection(scheme="int4-grouped"), target="onnxruntime")
    assert summary["details"]["ort_rewrites"]["blocked_dq_to_matmul_nbits"] > 0
    graph = onnx.load(tmp_path / "c" / "model.onnx").graph
    assert not [n for n in graph.node if n.op_type == "DequantizeLinear"]
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert all(onnx.helper.get_attribute_value(next(a for a in n.attribute if a.name == "accuracy_level")) == 4
               for n in nbits)
    assert summary["model"]["top1_agreement"] > 0.8  # the repacked weights are the quantized ones


def test_blocked_dequantize_linear_becomes_matmulnbits_exactly():
    """The rewrite keeps the values: the dequantized weight MatMulNBits computes is the DequantizeLinear's."""
    from passes.quantize._weights import dequantize_linear, matmul_nbits_weight

    rng = np.random.default_rng(0)
    k, n, block = 64, 24, 32
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    scale = rng.uniform(0.01, 0.1, (k // block, n)).astype(np.float32)
    zp = rng.integers(0, 16, (k // block, n)).astype(np.uint8)
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([2, k]))
    inits = [ir.Value(name=nm, const_value=ir.tensor(a, dtype=dt, name=nm), type=ir.TensorType(dt),
                      shape=ir.Shape(a.shape))
             for nm, a, dt in (("q", q, ir.DataType.UINT4), ("s", scale, ir.DataType.FLOAT),
                               ("z", zp, ir.DataType.UINT4))]
    dq = ir.node("DequantizeLinear", inits, attributes={"axis": 0, "block_size": block}, name="dq")
    expected = dequantize_linear(dq)
    mm = ir.node("MatMul", [x, dq.outputs[0]], name="mm")
    graph = ir.Graph([x], mm.outputs, nodes=[dq, mm], initializers=inits, opset_imports={"": 21})
    model = ir.Model(graph, ir_version=10)
    assert blocked_dq_to_nbits(model) == 1
    (nbits,) = [node for node in model.graph]
    assert nbits.op_type == "MatMulNBits"
    # NNCF's one-per-byte zero points, as to-matmul-nbits then packs them
    np.testing.assert_array_equal(matmul_nbits_weight(nbits), expected)


def test_fused_layers_are_found_and_the_plan_is_per_expert(fused_exports):
    for lowering in FUSED:
        model = ir.load(fused_exports("deepseek_v3", lowering)[0] / "model.onnx")
        layers = fused_moe.fused_layers(model)
        assert [layer.layer for layer in layers] == [1, 2]
        assert all(layer.num_experts == 16 and layer.form == lowering.split("-")[1] for layer in layers)
        assert {s.role for layer in layers for s in layer.weights} == {"routed_expert"}  # the exporter's role
        names = [n for layer in layers for s in layer.weights for _, _, n in layer.names(s)]
        assert len(names) == len(set(names)) == 2 * 16 * 3
        assert "layers.2/mlp/experts/15/down_proj/weight" in names
    report = json.loads((fused_exports("deepseek_v3", "fused-onnxruntime")[0] / "export.json").read_text())
    assert report["graph"]["nodes"] < 400


def test_dstc_export_moe_option_and_recipe_key(tiny_checkpoints, tmp_path, monkeypatch, capsys):
    """``dstc export --moe`` and the recipe's ``export.moe`` offer the lowerings; parity defaults to the backends
    that run the graph, and one that cannot is a one-line error before anything is written."""
    import typing

    from toolchain.cli import cli
    from toolchain.recipe import ExportSection

    assert typing.get_args(ExportSection.model_fields["moe"].annotation) == (moe.AUTO, *moe.LOWERINGS)
    option = next(p for p in cli.commands["export"].params if p.name == "moe")
    assert tuple(option.type.choices) == (moe.AUTO, *moe.LOWERINGS)
    assert ExportSection(moe="fused-onnxruntime").parity == ["onnxruntime"]
    assert ExportSection(moe="fused-openvino").parity == ["onnxruntime", "openvino"]
    with pytest.raises(ValueError, match="runs on onnxruntime only"):
        ExportSection(moe="fused-onnxruntime", parity=["onnxruntime", "openvino"])

    ckpt = tiny_checkpoints["deepseek_v2"]
    code, out, err = run_cli(monkeypatch, capsys, "export", ckpt, "-o", tmp_path / "a", "--moe", "fused-onnxruntime",
                             "--parity", "openvino")
    assert code == 2 and "dstc: error:" in err and "runs on onnxruntime only" in err and not (tmp_path / "a").exists()
    code, out, err = run_cli(monkeypatch, capsys, "export", ckpt, "-o", tmp_path / "b", "--moe", "fused-onnxruntime",
                             "--new-tokens", "2", "--json")
    assert code == 0
    report = json.loads(out)
    assert list(report["parity"]) == ["onnxruntime"] and report["parity"]["onnxruntime"]["passed"]
    assert [n.op_type for n in onnx.load(tmp_path / "b" / "model.onnx").graph.node].count("MoE") == 2


def test_auto_picks_the_lowering_measured_fastest_that_the_build_can_compress():
    pick = lambda *args, **kw: moe.auto_lowering(*args, **kw)[0]  # noqa: E731
    assert pick(None, 256, "int4-grouped", False) == "dispatch"  # an export alone: the form every runtime runs
    assert pick("onnxruntime", 0, "int4-grouped", False) == "dispatch"  # dense
    # ONNX Runtime: QMoE whenever the experts are compressed; its float32 MoE from 64 experts on
    assert [pick("onnxruntime", 16, s, False) for s in ("int4-grouped", "int8-per-head", None)] == \
        ["fused-onnxruntime", "fused-onnxruntime", "dispatch"]
    assert pick("onnxruntime", 64, None, False) == "fused-onnxruntime"
    # OpenVINO: the tiled block from 64 experts on, compressed or not
    assert [pick("openvino", e, s, False) for e in (16, 64, 256) for s in ("int4-grouped", None)] == \
        ["dispatch"] * 2 + ["fused-openvino"] * 4
    # what the compress stage refuses on a fused lowering, and a parity backend the graph would not run on
    assert pick("openvino", 256, "int4-grouped", True) == "dispatch"
    assert pick("onnxruntime", 256, "shipped", False) == "dispatch"
    assert pick("onnxruntime", 16, "int4-grouped", False, ("onnxruntime", "openvino")) == "dispatch"
    assert pick("openvino", 256, None, False, ("onnxruntime", "openvino")) == "fused-openvino"
    # stacked experts are float32: not where the export keeps the checkpoint's bf16
    assert pick("openvino", 256, "int4-grouped", False, None, "bfloat16") == "dispatch"
    # an architecture whose experts have no fused form (DeepSeek-V4's clipped SwiGLU)
    assert pick("onnxruntime", 256, "int4-grouped", False, lowerings=("dispatch",)) == "dispatch"
    assert pick("openvino", 256, None, False, lowerings=("dispatch",)) == "dispatch"


def test_a_build_resolves_auto_before_its_export_stage(tiny_checkpoints, tmp_path):
    """The export stage's configuration holds the lowering auto chose (a dense model's: dispatch, the stage id it
    had before auto), and parity follows it unless the recipe names it."""
    import yaml

    from toolchain.build import plan
    from toolchain.recipe import load_recipe

    def export_config(model, backend, export=None, compress=None):
        recipe = tmp_path / "r.yaml"
        recipe.write_text(yaml.safe_dump({"name": "r", "model": str(model), "compile": {"backend": backend},
                                          **({"export": export} if export else {}),
                                          **({"compress": compress} if compress else {})}))
        logged: list[str] = []
        config = plan(load_recipe(recipe), model, logged.append)[0].config
        return config["moe"], config["parity"], logged

    moe_model, dense = tiny_checkpoints["deepseek_v3"], tiny_checkpoints["qwen2"]
    int4 = {"scheme": "int4-grouped"}
    assert export_config(moe_model, "onnxruntime", compress=int4) == \
        ("fused-onnxruntime", ["onnxruntime"], ["MoE lowering: fused-onnxruntime (16 experts on onnxruntime, "
                                                "compressed)"])
    assert export_config(moe_model, "onnxruntime", {"parity": ["onnxruntime", "openvino"]}, int4)[:2] == \
        ("dispatch", ["onnxruntime", "openvino"])
    assert export_config(moe_model, "openvino", {"moe": "fused-openvino"})[:2] == \
        ("fused-openvino", ["onnxruntime", "openvino"])
    assert export_config(dense, "onnxruntime", compress=int4) == ("dispatch", ["onnxruntime", "openvino"], [])
    # AWQ and scale estimation run on fused experts; GPTQ and ratio < 1 on the dispatch form's only
    assert export_config(moe_model, "onnxruntime", compress={**int4, "awq": True, "scale_estimation": True})[0] == \
        "fused-onnxruntime"
    lowering, parity, logged = export_config(moe_model, "onnxruntime", compress={**int4, "ratio": 0.8})
    assert (lowering, parity) == ("dispatch", ["onnxruntime", "openvino"])
    assert logged[0] == "MoE lowering: dispatch (gptq and ratio < 1 see the dispatch form's experts only)"


def test_prefill_int8_is_not_decided_on_for_dispatched_experts(tiny_checkpoints, tmp_path, monkeypatch):
    """prefill_int8 stores an int8 copy of each 4-bit MatMul: of every routed expert under the dispatch lowering (3x
    their bytes), of none under QMoE. Decided off for dispatched experts where the CPU would turn it on, kept where
    the recipe sets it, and a dense model's decision is the CPU's."""
    import yaml

    from toolchain.build import plan
    from toolchain.recipe import load_recipe
    from toolchain.stages import choices

    monkeypatch.setattr(choices, "has_int8_dot_product", lambda: True)

    def compress_config(model, export=None, **compress):
        recipe = tmp_path / "r.yaml"
        recipe.write_text(yaml.safe_dump({"name": "r", "model": str(model), "compile": {"backend": "onnxruntime"},
                                          "compress": {"scheme": "int4-grouped", **compress},
                                          **({"export": export} if export else {})}))
        logged: list[str] = []
        stages = {s.name: s.config for s in plan(load_recipe(recipe), model, logged.append)}
        return stages["compress"]["prefill_int8"], any(line.startswith("prefill_int8 off") for line in logged)

    moe_model, dense = tiny_checkpoints["deepseek_v3"], tiny_checkpoints["qwen2"]
    assert compress_config(moe_model) == (True, False)  # QMoE: no expert is a MatMulNBits
    assert compress_config(moe_model, {"moe": "dispatch"}) == (False, True)
    # DeepSeek-V4: auto can only dispatch its experts (it counts them, as it does V3's)
    assert compress_config(tiny_checkpoints["deepseek_v4"]) == (False, True)
    assert compress_config(moe_model, {"moe": "dispatch"}, prefill_int8=True) == (True, False)
    assert compress_config(dense, {"moe": "dispatch"}) == (True, False)


@pytest.mark.parametrize("lowering", FUSED)
def test_fused_lowering_passes_layer_by_layer_parity(tiny_checkpoints, tmp_path, monkeypatch, lowering):
    """Above the end-to-end budget each layer is checked against its transformers module: the fused MoE layer is
    one piece like the others (its contrib domain imported in the piece)."""
    import toolchain.verify.parity as parity

    monkeypatch.setattr(parity, "FULL_PARITY_BYTES", 1 << 10)
    report = export(str(tiny_checkpoints["deepseek_v3"]), tmp_path / "out", new_tokens=4, moe=lowering)
    assert report["parity_mode"] == "layer by layer"
    expected = ["onnxruntime"] if lowering == "fused-onnxruntime" else ["onnxruntime", "openvino"]
    assert sorted(report["parity"]) == expected
    for result in report["parity"].values():
        assert result["passed"] and "layers.2" in result["pieces"] and result["pieces"]["layers.2"] < 1e-4


@pytest.mark.parametrize("lowering", moe.LOWERINGS)
def test_the_lowering_is_recorded_in_the_graph_and_read_from_there(tiny_checkpoints, tmp_path, lowering):
    """The export writes its lowering into the graph's metadata; compression and routing agreement take it from
    there. A graph exported before the record (no key) is told by its nodes, with the same answers; a record that
    names another lowering finds no routers, so it is the record that is read."""
    from toolchain.export.graph import save_graph
    from toolchain.interface.graph import MOE_LOWERING, moe_lowering

    model = load(resolve(str(tiny_checkpoints["qwen3_moe"])))
    graph = build_decoder(model, moe.with_lowering(architecture_for("qwen3_moe"), lowering))
    assert graph.metadata_props[MOE_LOWERING] == lowering
    assert json.loads(graph.metadata_props["dstc.moe_layers"]) == [0, 2]
    assert fused_moe.lowering_of(graph) == lowering
    fused = [(f.layer, f.form) for f in fused_moe.fused_layers(graph)]
    assert fused == ([] if lowering == "dispatch" else [(0, lowering.split("-")[1]), (2, lowering.split("-")[1])])
    save_graph(graph, tmp_path / "model.onnx")
    names = router_values(tmp_path / "model.onnx", lowering)
    assert len(names) == 2
    other = "fused-openvino" if lowering == "dispatch" else "dispatch"
    assert router_values(tmp_path / "model.onnx", other) == []

    older = {k: v for k, v in graph.metadata_props.items() if k != MOE_LOWERING}
    assert moe_lowering(older, (n.op_type for n in graph.graph)) == lowering
    assert router_values(tmp_path / "model.onnx", None) == names
    del graph.metadata_props[MOE_LOWERING]
    assert [(f.layer, f.form) for f in fused_moe.fused_layers(graph)] == fused


def test_a_dense_graph_records_no_lowering(tiny_checkpoints):
    """Nothing is lowered in a dense model, whatever was asked: no key, no fused layer."""
    from toolchain.interface.graph import MOE_LOWERING, moe_lowering

    model = load(resolve(str(tiny_checkpoints["qwen2"])))
    graph = build_decoder(model, moe.with_lowering(architecture_for("qwen2"), "fused-openvino"))
    assert MOE_LOWERING not in graph.metadata_props and graph.metadata_props["dstc.moe_layers"] == "[]"
    assert moe_lowering(graph.metadata_props, (n.op_type for n in graph.graph)) is None
    assert fused_moe.fused_layers(graph) == []
