"""Compression one weight at a time (toolchain/compress/streaming.py): the same quantized tensors as NNCF's
whole-model call, artifacts that compile and verify on both backends, and memory that does not grow with the
model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from toolchain.errors import InputError
from toolchain.stages.compile import compile_artifact
from toolchain.stages.compress import compress
from toolchain.stages.export import export

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def exports(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-exports")
    return {name: export(str(tiny_checkpoints[name]), root / name, parity=()) and root / name
            for name in ("deepseek_v3", "qwen2")}


def nbits_tensors(path: Path) -> dict[str, list[np.ndarray]]:
    model = ir.load(path)
    return {node.outputs[0].name: [v.const_value.numpy() for v in node.inputs[1:] if v is not None]
            for node in model.graph if node.op_type == "MatMulNBits"}


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen2"])
def test_onnxruntime_streaming_writes_nncfs_own_tensors(exports, tmp_path, arch):
    whole = compress(exports[arch], tmp_path / "whole", target="onnxruntime", streaming="never")
    streamed = compress(exports[arch], tmp_path / "streamed", target="onnxruntime", streaming="always")
    a, b = nbits_tensors(tmp_path / "whole" / "model.onnx"), nbits_tensors(tmp_path / "streamed" / "model.onnx")
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        assert all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a[name], b[name])), name
    assert streamed["streaming"] is True and whole["streaming"] is False
    errors = {r["weight"]: r["weight_error"] for r in whole["per_weight"]}
    for row in streamed["per_weight"]:  # measured chunk by chunk, the same figure
        assert row["weight_error"] == pytest.approx(errors[row["weight"]], rel=1e-4, abs=1e-7), row["weight"]
    assert streamed["model"]["top1_agreement"] is None and "not measured" in streamed["model"]["note"]


def test_openvino_streaming_is_a_compressed_ir_that_verifies(exports, tmp_path):
    import openvino as ov

    whole = compress(exports["deepseek_v3"], tmp_path / "whole", target="openvino", streaming="never")
    streamed = compress(exports["deepseek_v3"], tmp_path / "streamed", target="openvino", streaming="always")
    assert ir.load(tmp_path / "streamed" / "model.onnx").opset_imports[""] == 21  # DequantizeLinear block_size
    manifest = compile_artifact(tmp_path / "streamed", tmp_path / "art", "openvino")
    assert manifest["verification"]["passed"] and manifest["verification"]["reference"] == "compressed input graph"
    model = ov.Core().read_model(str(tmp_path / "art" / "openvino_model.xml"))
    types = {op.get_element_type().get_type_name() for op in model.get_ops() if op.get_type_name() == "Constant"}
    assert {"u4", "u8"} <= types  # INT4 body, INT8 embeddings and lm_head, as NNCF's own IR has them
    planned = {r["weight"]: r["precision"] for r in whole["per_weight"]}
    for row in streamed["per_weight"]:
        assert row["precision"].split("-")[0] == planned[row["weight"]].split("-")[0], row["weight"]
    # NNCF's OpenVINO backend stores float16 scales, the streamed DequantizeLinear float32 ones: at most a little
    # more accurate, never less
    errors = {r["weight"]: r["weight_error"] for r in whole["per_weight"]}
    for row in streamed["per_weight"]:
        assert row["weight_error"] <= errors[row["weight"]] * 1.01 + 1e-6, row["weight"]


def quantized_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every integer initializer (MatMulNBits B and zero points, DequantizeLinear values) and scale by name; the
    float zero point and scale of a 3-D weight's Cast / Sub / Mul dequantization (the latent cache's absorbed
    kv_b_proj), which the two paths name differently, by the name of the integer weight they dequantize."""
    model = ir.load(path)
    out, broadcast = {}, set()
    for cast in (n for n in model.graph if n.op_type == "Cast" and n.inputs[0].name in model.graph.initializers):
        for use in cast.outputs[0].uses():
            step = use.node
            if step.op_type == "Sub":
                out[f"{cast.inputs[0].name}:zero_point"] = step.inputs[1].const_value.numpy()
                broadcast.add(step.inputs[1].name)
                step = step.outputs[0].uses()[0].node
            out[f"{cast.inputs[0].name}:scale"] = step.inputs[1].const_value.numpy()
            broadcast.add(step.inputs[1].name)
    out.update({name: v.const_value.numpy() for name, v in model.graph.initializers.items() if name not in broadcast
                and (v.const_value.dtype in (ir.DataType.UINT8, ir.DataType.INT8) or name.endswith("_scale"))})
    return out


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen2"])
def test_int8_per_head_streaming_writes_the_passes_own_tensors(exports, tmp_path, arch):
    whole = compress(exports[arch], tmp_path / "whole", target="onnxruntime", scheme="int8-per-head",
                     streaming="never")
    streamed = compress(exports[arch], tmp_path / "streamed", target="onnxruntime", scheme="int8-per-head",
                        streaming="always")
    a = quantized_tensors(tmp_path / "whole" / "model.onnx")
    b = quantized_tensors(tmp_path / "streamed" / "model.onnx")
    assert a.keys() == b.keys() and len(a) > 20
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name
    errors = {r["weight"]: r["weight_error"] for r in whole["per_weight"]}
    precisions = {r["weight"]: r["precision"] for r in streamed["per_weight"]}
    for row in streamed["per_weight"]:
        assert row["weight_error"] == pytest.approx(errors[row["weight"]], rel=1e-4, abs=1e-7), row["weight"]
    heads = [w for w, p in precisions.items() if p.endswith("per-head")]
    # one scale per head on the projections with heads, and only there
    assert heads and all(w.split("/")[-2] in ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj") for w in heads)
    assert_scale_per_head(tmp_path / "streamed" / "model.onnx", heads)


def assert_scale_per_head(path: Path, heads: list[str]) -> None:
    """Each head's scales are one value, and heads differ (per-axis DequantizeLinear scales [N], or
    MatMulNBits(bits=8) ones [N, 1] after to-matmul-nbits)."""
    model = ir.load(path)
    layout = json.loads(model.metadata_props["dstc.head_layout"])
    for weight in heads:
        names = [f"{weight}_scale", f"{weight}_quantized_nbits_scale"]
        scale = next(model.graph.initializers[n].const_value.numpy() for n in names if n in model.graph.initializers)
        blocks = scale.reshape(-1, layout[weight.split("/")[-2]][1])
        assert np.all(blocks == blocks[:, :1]) and len(np.unique(blocks[:, 0])) > 1, weight


def test_int8_per_head_streaming_compiles_and_verifies_for_openvino(exports, tmp_path):
    summary = compress(exports["deepseek_v3"], tmp_path / "streamed", target="openvino", scheme="int8-per-head",
             streaming="always")
    heads = [r["weight"] for r in summary["per_weight"] if r["precision"].endswith("per-head")]
    assert heads == [f"layers.{i}/self_attn/q_b_proj/weight" for i in range(3)]
    assert_scale_per_head(tmp_path / "streamed" / "model.onnx", heads)
    # the latent cache's absorbed kv_b_proj, [heads, K, N]: a scale per head and output channel
    stacked = [r for r in summary["per_weight"] if r.get("head_side") == "stacked"]
    assert len(stacked) == 2 * 3 and all(r["precision"].startswith("int8") for r in stacked)
    graph = ir.load(tmp_path / "streamed" / "model.onnx").graph
    for row in stacked:
        heads_count, _, width = row["shape"]
        assert graph.initializers[f"{row['weight']}_scale"].const_value.numpy().shape == (heads_count, 1, width)
    manifest = compile_artifact(tmp_path / "streamed", tmp_path / "art", "openvino")
    assert manifest["verification"]["passed"]


def test_data_aware_options_are_refused_in_streaming_form(exports, tmp_path):
    with pytest.raises(InputError, match="not available in bounded memory"):
        compress(exports["qwen2"], tmp_path / "o", target="openvino", awq=True, streaming="always")
    assert not (tmp_path / "o").exists()


MEASURE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np, onnx_ir as ir

    def hwm():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    root = Path(sys.argv[1])
    x = ir.val("x", dtype=ir.DataType.FLOAT, shape=ir.Shape(["b", 2048]))
    nodes, inits, h = [], [], x
    for i in range(int(sys.argv[2])):
        w = ir.Value(name=f"w{i}", const_value=ir.tensor(np.full((2048, 2048), i + 1, np.float32), name=f"w{i}"))
        inits.append(w)
        node = ir.node("MatMul", [h, w], name=f"mm{i}")
        h = node.outputs[0]
        h.name = f"h{i}"
        nodes.append(node)
    graph = ir.Graph([x], [h], nodes=nodes, initializers=inits, opset_imports={"": 18})
    ir.save(ir.Model(graph, ir_version=9), root / "in.onnx", external_data="in.onnx.data")
    del graph, inits, nodes, w
    from toolchain.compress import engine, streaming
    # imports and NNCF's first call (it compiles its OpenVINO kernels) are not what is measured
    import nncf
    from nncf.quantization.algorithms.weight_compression.config import WeightCompressionConfig
    from nncf.quantization.algorithms.weight_compression.weight_lowering import compress_weight
    from nncf.tensor import Tensor
    compress_weight(Tensor(np.ones((2048, 2048), np.float32)), (0,),
                    WeightCompressionConfig(nncf.CompressWeightsMode.INT4_ASYM, 128))
    model = ir.load(root / "in.onnx")
    weights = engine.graph_weights(model, with_arrays=False)
    options = engine.Options(scheme="int4-grouped")
    specs = streaming.plan_specs(weights, {w.name: "int4" for w in weights}, options, sys.argv[3])
    before = hwm()
    streaming.compress_streaming(model, specs, lambda m: None)
    ir.save(model, root / "out.onnx", external_data="out.onnx.data")
    print(json.dumps({"increase": hwm() - before, "weight": 2048 * 2048 * 4}))
""")


def test_memory_of_streaming_compression_does_not_grow_with_the_model(tmp_path):
    """The peak resident set while compressing and saving is a few times one weight (NNCF's temporaries for it),
    the same for 4 weights as for 16, and well below the model's float32 size."""
    increases = {}
    for count in (4, 16):
        out = tmp_path / str(count)
        out.mkdir()
        proc = subprocess.run([sys.executable, "-c", MEASURE, str(out), str(count), "openvino"], cwd=REPO,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        increases[count] = result["increase"]
    weight = 2048 * 2048 * 4
    assert increases[16] < increases[4] + weight, increases
    assert increases[16] < 16 * weight / 2, increases
